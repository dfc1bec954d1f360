//! A sandbox's teardown, in reverse order of its start: the VMM (SIGTERM,
//! SIGKILL after a grace), its writable layer, the guest's neighbour entry,
//! CNI DEL on the network the ADD ran on, the netns, the cgroup, the
//! per-sandbox files. It runs once (explicitly or from `Drop`), goes on
//! after a failed step and returns every failure.

use std::time::Duration;

use super::net::IFNAME;
use super::{Sandbox, TeardownError, TeardownStep};
use crate::failures::Failures;

/// How long a teardown keeps retrying a CNI DEL the plugin answers with
/// "try again later" (the NIC daemon restarting after a crash).
pub(crate) const DEL_PATIENCE: Duration = Duration::from_secs(20);

impl Sandbox<'_> {
    /// Tears everything down in reverse order; goes on after a failed step
    /// and returns every failure.
    pub fn teardown(&mut self) -> Result<(), TeardownError> {
        if self.torn_down {
            return Ok(());
        }
        self.torn_down = true;
        let mut errs = Vec::new();
        if let Some(c) = self.vmm.take() {
            crate::child::stop_child(c, Duration::from_secs(2));
        }
        // Only now: the keeper thread's end would SIGKILL a running VMM.
        self.keeper = None;
        // The VMM unlinked its layer once open; if it never got there, the
        // layer removes its file now.
        self.layer = None;
        self.read_probe_values();
        if let Some(ip) = self.neighbor.take() {
            if let Err(source) = self.rt.del_neighbor(ip) {
                errs.push(TeardownStep::Neighbor { ip, source });
            }
        }
        if self.cni_added {
            self.cni_added = false;
            let id = self.pooled_id.as_deref().unwrap_or(&self.spec.id);
            // DEL on the network the ADD ran on.
            if let (Some(cni), Some(ns)) = (self.network(), self.netns.as_ref()) {
                if let Err(e) = cni.del_retrying(id, ns.path(), IFNAME, DEL_PATIENCE) {
                    errs.push(TeardownStep::CniDel(Box::new(e)));
                }
            }
        }
        if self.tap_added {
            self.tap_added = false;
            // The plugin removes the veth pair and releases the lease.
            if let (Ok(cni), Some(ns)) = (self.rt.tap_cni(), self.netns.as_ref()) {
                if let Err(e) = cni.del(&self.spec.id, ns.path(), IFNAME) {
                    errs.push(TeardownStep::CniDel(Box::new(e)));
                }
            }
        }
        if let Some(mut ns) = self.netns.take() {
            if let Err(e) = ns.delete() {
                errs.push(TeardownStep::Netns(e));
            }
        }
        if let Some(mut cg) = self.cgroup.take() {
            if let Err(e) = cg.delete() {
                errs.push(TeardownStep::Cgroup(e));
            }
        }
        self.files.remove();
        Failures::check(|| format!("sandbox {} teardown", self.spec.id), errs)
    }
}

impl Drop for Sandbox<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            tracing::warn!("{e}");
        }
    }
}
