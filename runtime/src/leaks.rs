//! After every run: nothing this runtime created may be left behind.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::instance::Runtime;
use netutil::netns;

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LeakReport {
    pub netns: Vec<String>,
    pub links: Vec<String>,
    pub cgroups: Vec<String>,
    pub assigned_vfs: Vec<String>,
    pub vmm_pids: Vec<u32>,
    pub pool_lent_memfds: u64,
    pub pool_clients: usize,
    /// Writable-layer files (reflinks or copies) still on the managed filesystem.
    pub rootfs_layers: Vec<String>,
    /// The writable layers' template changed (it must never).
    pub rootfs_template: Option<String>,
    /// A check that could not run (e.g. the NIC daemon did not answer).
    pub errors: Vec<String>,
}

impl LeakReport {
    pub fn is_clean(&self) -> bool {
        *self == LeakReport::default()
    }

    pub fn describe(&self) -> String {
        if self.is_clean() {
            return "leak check: clean (no netns, link, cgroup, assigned VF, VMM process, lent pool memory or writable layer left)".into();
        }
        let mut parts = Vec::new();
        let mut add = |what: &str, v: &[String]| {
            if !v.is_empty() {
                parts.push(format!("{what}: {}", v.join(", ")));
            }
        };
        add("netns", &self.netns);
        add("links", &self.links);
        add("cgroups", &self.cgroups);
        add("assigned VFs", &self.assigned_vfs);
        add("writable layers", &self.rootfs_layers);
        add("rootfs template changed", self.rootfs_template.as_slice());
        add("errors", &self.errors);
        if !self.vmm_pids.is_empty() {
            parts.push(format!("VMM pids: {:?}", self.vmm_pids));
        }
        if self.pool_lent_memfds > 0 || self.pool_clients > 0 {
            parts.push(format!(
                "pool: {} memfds lent, {} clients connected",
                self.pool_lent_memfds, self.pool_clients
            ));
        }
        format!("leak check: LEAKS FOUND: {}", parts.join("; "))
    }
}

/// Looks for anything of this runtime's sandboxes still alive. Pool memory
/// comes back asynchronously when a VMM's connection closes, so the check
/// waits up to `grace` for it.
pub fn check(rt: &Runtime, grace: Duration) -> LeakReport {
    let prefix = rt.sandbox_prefix();
    let deadline = Instant::now() + grace;
    loop {
        // What the network pool holds is the runtime's, not a sandbox's.
        let netns = netns::list(&prefix);
        let pooled = rt.net_pool_owned();
        let mut r = LeakReport {
            netns: netns.into_iter().filter(|n| !pooled.contains(n)).collect(),
            cgroups: rt
                .layout()
                .list()
                .into_iter()
                .filter(|c| c.starts_with(&prefix))
                .collect(),
            vmm_pids: vmm_processes(&prefix),
            pool_lent_memfds: rt.pool().stats().lent_memfds,
            pool_clients: rt.pool_clients(),
            ..Default::default()
        };
        (r.rootfs_layers, r.rootfs_template) = rt.layer_leaks();
        match rt.assigned_vfs() {
            Ok(v) => {
                r.assigned_vfs = v
                    .into_iter()
                    .filter(|(_, sb)| !pooled.contains(sb))
                    .map(|(vf, sb)| format!("{vf} ({sb})"))
                    .collect()
            }
            Err(e) => r.errors.push(format!("NIC daemon: {e}")),
        }
        match rt.leftover_links() {
            Ok(v) => r.links = v,
            Err(e) => r.errors.push(e.to_string()),
        }
        if r.is_clean() || Instant::now() >= deadline {
            return r;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Pids of the VMM processes (`burstvm-vmm` or `burstvm vmm`) of sandboxes `<prefix>...`.
pub fn vmm_processes(prefix: &str) -> Vec<u32> {
    crate::vmmproc::processes(|sb| sb.starts_with(prefix.as_bytes()))
}
