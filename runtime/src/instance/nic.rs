//! The runtime's NIC daemon (`nicd::NicDaemon`, a child): started with the
//! devset lock policy a variant needs, restarted on its state directory after
//! a crash, and asked over its control socket for VF sockets and assignments.
//! The one slot is behind a mutex, so at most one daemon runs per runtime; it
//! dies with the runtime (PDEATHSIG of its keeper thread, `crate::child`).

use std::path::PathBuf;
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use super::{Runtime, RuntimeError};
use crate::nicd::NicDaemon;
use crate::variant::Variant;

/// How often `keep_nic_up_while` looks at the NIC daemon.
pub const NIC_WATCH_PERIOD: Duration = Duration::from_millis(100);
/// How long a NIC daemon's replacement waits for the network pool's ADD in flight.
const QUIESCE_BOUND: Duration = Duration::from_secs(30);

/// NIC daemon restarts while sandboxes ran (`Runtime::keep_nic_up_while`).
#[derive(Debug, Default)]
pub struct NicRestarts {
    /// Times the daemon was found dead and started again.
    pub restarts: usize,
    /// Restarts that failed.
    pub errors: Vec<RuntimeError>,
}

impl NicRestarts {
    /// Counts the outcome of one `restart_nic_if_*`.
    pub fn add(&mut self, r: Result<bool, RuntimeError>) {
        match r {
            Ok(true) => self.restarts += 1,
            Ok(false) => {}
            Err(e) => self.errors.push(e),
        }
    }
}

impl Runtime {
    /// The NIC daemon's slot (a panicked holder left it consistent: every
    /// change is one assignment).
    pub(super) fn nic(&self) -> MutexGuard<'_, Option<NicDaemon>> {
        self.nic.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn nic_socket(&self) -> PathBuf {
        self.state_dir.join("nic.sock")
    }

    /// Where the NIC daemon serves burstvm-cni's commands (`cni::server`).
    pub fn cni_socket(&self) -> PathBuf {
        self.state_dir.join("cni.sock")
    }

    /// The running NIC daemon's pid (CPU accounting).
    pub fn nic_pid(&self) -> Option<u32> {
        let nic = self.nic();
        nic.as_ref().map(|n| n.pid())
    }

    /// Makes sure the NIC daemon runs with the lock policy `variant` needs;
    /// restarts it when the policy differs (no sandbox may be alive then).
    pub fn prepare_variant(&self, variant: Variant) -> Result<(), RuntimeError> {
        let Some(lock) = variant.policy().devset_lock else {
            return Ok(());
        };
        if self.nic().as_ref().is_some_and(|n| n.lock == lock) {
            return Ok(());
        }
        // Before the NIC lock: the refill's CPU meter reads the daemon's pid under it.
        let _quiet = self.net_pool().as_ref().map(|p| p.quiesce(QUIESCE_BOUND));
        let mut nic = self.nic();
        if let Some(old) = nic.take() {
            old.stop();
        }
        *nic = Some(NicDaemon::spawn(self, lock)?);
        drop(nic);
        self.start_net_pool()
    }

    /// SIGKILLs the NIC daemon (a crash) and starts it again on its state directory, with
    /// the same lock policy and pool; running VMMs reconnect to their VF sockets. Returns
    /// the instants of the kill and of the restarted daemon answering on its control
    /// socket, and the new daemon's pid.
    pub fn crash_and_restart_nic(&self) -> Result<(Instant, Instant, u32), RuntimeError> {
        let mut nic = self.nic();
        let old = nic.take().ok_or_else(|| RuntimeError::Nic {
            bin: self.cfg.bin.clone(),
            reason: "no NIC daemon running".into(),
        })?;
        let lock = old.lock;
        let killed = old.kill();
        let (up, pid) = self.respawn_nic(&mut nic, lock)?;
        Ok((killed, up, pid))
    }

    /// Starts the NIC daemon again if something else killed it (`bench
    /// chaos` does, from outside). Returns whether it did. The daemon lives
    /// as long as the runtime (its own keeper thread), whichever thread calls.
    pub fn restart_nic_if_dead(&self) -> Result<bool, RuntimeError> {
        self.restart_nic_if(|n, _| n.exited())
    }

    /// As `restart_nic_if_dead`, also for a daemon killed a moment ago whose
    /// exit is not visible yet (its control socket refuses connections):
    /// before sandboxes are released on it (`bench startup`'s rounds).
    pub fn restart_nic_if_gone(&self) -> Result<bool, RuntimeError> {
        self.restart_nic_if(|n, control| n.exited_or_exiting(control))
    }

    fn restart_nic_if(
        &self,
        gone: impl FnOnce(&mut NicDaemon, &std::path::Path) -> bool,
    ) -> Result<bool, RuntimeError> {
        let control = self.nic_socket();
        let mut nic = self.nic();
        let Some(n) = nic.as_mut() else {
            return Ok(false);
        };
        if !gone(n, &control) {
            return Ok(false);
        }
        let lock = n.lock;
        self.respawn_nic(&mut nic, lock)?;
        Ok(true)
    }

    /// Keeps the NIC daemon up while `busy()` holds (sandboxes are being
    /// started or run): checks every `NIC_WATCH_PERIOD`, restarts a daemon
    /// that died (`restart_nic_if_dead`) on its state directory, and checks
    /// once more when `busy()` turns false. Sandboxes whose VMMs were running
    /// reconnect to the restarted daemon, so one crash does not fail every
    /// sandbox in flight. Restarts and failed restarts go into `out`. The one
    /// watch loop of `bench chaos` and `bench startup`.
    pub fn keep_nic_up_while(&self, out: &mut NicRestarts, busy: impl Fn() -> bool) {
        loop {
            // Sampled first: a death just before `busy()` turned false is still seen.
            let more = busy();
            out.add(self.restart_nic_if_dead());
            if !more {
                return;
            }
            std::thread::sleep(NIC_WATCH_PERIOD);
        }
    }

    /// The one way the NIC daemon is started again: on its state directory
    /// (assignments come back from its state file), same lock policy and
    /// pool. Returns when it answers on its control socket, and its pid.
    fn respawn_nic(
        &self,
        slot: &mut Option<NicDaemon>,
        lock: crate::variant::DevsetLock,
    ) -> Result<(Instant, u32), RuntimeError> {
        let new = NicDaemon::spawn(self, lock)?;
        let up = Instant::now();
        let pid = new.pid();
        *slot = Some(new);
        Ok((up, pid))
    }

    /// The VF's vhost-user socket, asked from the NIC daemon.
    pub fn vf_socket(&self, vf_id: &str) -> Result<PathBuf, crate::host::HostCallError> {
        Ok(nic_api::vf_socket(&self.nic_socket(), vf_id)?)
    }

    /// VFs the NIC daemon still has assigned, with their sandbox (leak check).
    pub fn assigned_vfs(&self) -> Result<Vec<(String, String)>, nic_api::ClientError> {
        if self.nic().is_none() {
            return Ok(Vec::new());
        }
        let mut c = nic_api::Client::connect(&self.nic_socket())?;
        Ok(c.list()?
            .into_iter()
            .filter(|v| v.sandbox.is_some())
            .map(|v| (v.id, v.sandbox.unwrap_or_default()))
            .collect())
    }
}
