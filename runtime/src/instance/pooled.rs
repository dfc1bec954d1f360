//! The runtime's side of the network pool (`crate::netpool`): started once
//! the NIC daemon runs (its ADDs need it), claimed from by VF sandboxes, held
//! busy while a sandbox starts, and stopped (every ready entry DELed) before
//! a final leak check and when the runtime drops.

use std::sync::{Arc, MutexGuard};

use super::{state_err, Runtime, RuntimeError};
use crate::failures::Failures;
use crate::netpool::{NetPool, PoolError};

impl Runtime {
    /// The network pool's slot (None until started, and after `stop_net_pool`).
    pub(super) fn net_pool(&self) -> MutexGuard<'_, Option<NetPool>> {
        self.net_pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the network pool (once, when configured): its ADDs need the NIC daemon.
    pub(super) fn start_net_pool(&self) -> Result<(), RuntimeError> {
        let mut pool = self.net_pool();
        if pool.is_some() || self.cfg.net_pool == 0 {
            return Ok(());
        }
        let Some(cni) = self.cni.clone() else {
            return Ok(());
        };
        cni.require_vf("the network pool (--net-pool)")?;
        // The ADDs burstvm-cni-thin forwards run in the NIC daemon's CNI server.
        let nic = self.nic.clone();
        let served = move || {
            let pid = nic
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()?
                .pid();
            crate::cpuacct::nic_cpu(pid).map(|c| c.cni_server_ns)
        };
        *pool = Some(
            NetPool::start(
                cni,
                self.server().neighbors(),
                self.sandbox_prefix(),
                self.cfg.net_pool,
                Box::new(move || served().unwrap_or(0)),
            )
            .map_err(state_err(&self.state_dir))?,
        );
        Ok(())
    }

    /// A ready VF attachment from the network pool (None: no pool, or empty).
    pub fn claim_net(&self) -> Option<crate::netpool::Pooled> {
        let pool = self.net_pool();
        pool.as_ref()?.claim()
    }

    /// Held while a sandbox starts: the network pool refills only when no
    /// start is in progress (None: no pool).
    pub fn net_pool_busy(&self) -> Option<crate::netpool::Busy> {
        let pool = self.net_pool();
        pool.as_ref().map(|p| p.busy())
    }

    /// Waits (at most `bound`) until the network pool is full: how many are
    /// ready of how many, and the refill's last error. None: no pool.
    pub fn wait_net_pool(
        &self,
        bound: std::time::Duration,
    ) -> Option<(usize, usize, Option<Arc<PoolError>>)> {
        let pool = self.net_pool();
        let p = pool.as_ref()?;
        let (ready, err) = p.wait_full(bound);
        Some((ready, p.target(), err))
    }

    /// Attachments the network pool made and their host CPU in ns (None:
    /// no pool).
    pub fn net_pool_refill_cpu(&self) -> Option<(u64, u64)> {
        let pool = self.net_pool();
        pool.as_ref().map(|p| p.refill_cpu())
    }

    /// Names the network pool holds (not leaks while the runtime lives).
    pub fn net_pool_owned(&self) -> std::collections::HashSet<String> {
        let pool = self.net_pool();
        pool.as_ref().map(|p| p.owned()).unwrap_or_default()
    }

    /// Stops the network pool and DELs what it holds (before a final leak check).
    pub fn stop_net_pool(&self) -> Result<(), Failures<PoolError>> {
        let pool = self.net_pool().take();
        match pool {
            Some(mut p) => p.stop(),
            None => Ok(()),
        }
    }
}
