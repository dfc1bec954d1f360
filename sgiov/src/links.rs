//! Which tenants' SG functions may connect to each other (a chain between
//! two sandboxes). Ports are one namespace per PF, so without this table any
//! SGF could CONNECT to any other sandbox's listener: a connection across
//! tenants is refused unless the owner of the control API linked the two
//! tenants. Connections inside one tenant (and the echo port) need no link.
//!
//! The table is shared: the NIC's control thread links and unlinks, the PF's
//! SG thread asks at CONNECT time. Unlinking does not cut connections that
//! exist; they end when either side closes or its SGF detaches (a released
//! sandbox's session ends, which detaches it).

use std::collections::HashSet;
use std::sync::Mutex;

#[derive(Debug, Default)]
pub struct Links(Mutex<HashSet<(u32, u32)>>);

fn key(a: u32, b: u32) -> (u32, u32) {
    (a.min(b), a.max(b))
}

impl Links {
    fn set(&self) -> std::sync::MutexGuard<'_, HashSet<(u32, u32)>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets tenants `a` and `b` connect to each other (both ways).
    pub fn link(&self, a: u32, b: u32) {
        self.set().insert(key(a, b));
    }

    /// Drops every link of `tenant` (its sandbox was released).
    pub fn unlink_all(&self, tenant: u32) {
        self.set().retain(|&(x, y)| x != tenant && y != tenant);
    }

    /// May a socket of tenant `a` connect to a listener of tenant `b`?
    pub fn allowed(&self, a: u32, b: u32) -> bool {
        a == b || self.set().contains(&key(a, b))
    }

    /// The tenants `tenant` is linked with, sorted.
    pub fn peers(&self, tenant: u32) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .set()
            .iter()
            .filter_map(|&(x, y)| {
                if x == tenant {
                    Some(y)
                } else if y == tenant {
                    Some(x)
                } else {
                    None
                }
            })
            .collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_symmetric_and_only_for_the_pair_named() {
        let l = Links::default();
        assert!(l.allowed(3, 3), "inside one tenant");
        assert!(!l.allowed(1, 2));
        l.link(2, 1);
        assert!(l.allowed(1, 2) && l.allowed(2, 1));
        assert!(!l.allowed(1, 3) && !l.allowed(3, 2), "only the pair named");
        l.link(1, 3);
        assert_eq!(l.peers(1), vec![2, 3]);
        l.unlink_all(1);
        assert!(!l.allowed(1, 2) && !l.allowed(1, 3));
        assert!(l.peers(2).is_empty());
    }
}
