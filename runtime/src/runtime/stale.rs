//! The names a runtime derives from its tag, and the reaping of what dead
//! runtimes left. A tag is unique per process and names its pid, so that a
//! later runtime can tell a dead owner's netns, cgroups and state directory
//! (SIGKILLed, it could not remove them) from a live one's.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use netutil::netns;

use crate::cgroup::Layout;

/// Every runtime's state directory is `rt-<tag>` under this.
pub const STATE_ROOT: &str = "/run/burstvm";

/// The state directory of the runtime with `tag`.
pub fn state_dir_of(tag: &str) -> PathBuf {
    Path::new(STATE_ROOT).join(format!("rt-{tag}"))
}

/// Sandbox names (netns, cgroups) made by the runtime with `tag` start with this.
pub fn sandbox_prefix_of(tag: &str) -> String {
    format!("bv{tag}-")
}

/// The name of the server netns of the runtime with `tag`.
pub fn server_netns_of(tag: &str) -> String {
    format!("bvsrv-{tag}")
}

/// The name of the rename pool's cgroups of the runtime with `tag` (`<it>-<k>`).
pub fn cgroup_pool_of(tag: &str) -> String {
    format!("pool-{tag}")
}

/// The pid of the process that made `tag` (see `unique_tag`).
fn tag_pid(tag: &str) -> Option<u32> {
    u64::from_str_radix(tag, 36).ok().map(|n| (n / 64) as u32)
}

/// Removes what runtimes that died without cleaning up (SIGKILL) left:
/// their sandboxes' netns and cgroups, their server netns and state dir.
/// A runtime counts as dead when the pid in its tag no longer exists.
pub fn reap_stale(layout: &Layout) -> Vec<String> {
    let mut reaped = Vec::new();
    let Ok(rd) = std::fs::read_dir(STATE_ROOT) else {
        return reaped;
    };
    for e in rd.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(tag) = name.strip_prefix("rt-") else {
            continue;
        };
        let Some(pid) = tag_pid(tag) else { continue };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let prefixes = [
            sandbox_prefix_of(tag),
            server_netns_of(tag),
            format!("{}-", cgroup_pool_of(tag)),
        ];
        for ns in prefixes.iter().take(2).flat_map(|p| netns::list(p)) {
            if netns::delete_path(&netns::named_path(&ns)).is_ok() {
                reaped.push(format!("netns {ns}"));
            }
        }
        for cg in layout.list() {
            if !(cg.starts_with(&prefixes[0]) || cg.starts_with(&prefixes[2])) {
                continue;
            }
            // A VMM of a dead runtime should have died with it (PDEATHSIG).
            crate::cgroup::reap(layout, &cg);
            reaped.push(format!("cgroup {cg}"));
        }
        // Its writable layers are a mount inside the state directory: the
        // mount goes first, so that removing the directory never reaches
        // into the filesystem.
        reaped.extend(::rootfs::layers::reap(&e.path().join("rootfs")));
        if ::rootfs::layers::is_mounted(&e.path().join("rootfs/mnt")) {
            continue;
        }
        let _ = std::fs::remove_dir_all(e.path());
        reaped.push(format!("state {}", e.path().display()));
    }
    reaped
}

pub(super) fn unique_tag() -> String {
    // pid plus a per-process counter, base 36, short enough for interface names.
    use std::sync::atomic::AtomicU32;
    static N: AtomicU32 = AtomicU32::new(0);
    let n = (std::process::id() as u64) * 64 + (N.fetch_add(1, Ordering::Relaxed) % 64) as u64;
    let mut s = String::new();
    let mut x = n;
    loop {
        s.insert(0, char::from_digit((x % 36) as u32, 36).unwrap());
        x /= 36;
        if x == 0 {
            break;
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_unique_and_name_their_pid() {
        let a = unique_tag();
        let b = unique_tag();
        assert_ne!(a, b);
        assert!(a.len() <= 11, "{a}: fits interface names");
        assert_eq!(tag_pid(&a), Some(std::process::id()));
        assert_eq!(tag_pid("not a tag!"), None);
    }
}
