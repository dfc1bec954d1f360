//! The VMM after its spawn: waiting for READY on the ready pipe (bounded by
//! the spec's timeout, the host's interrupt flag and the engine's cancel),
//! naming the first stage it did not complete when it ends without READY,
//! its liveness and exit after READY, and what it wrote (stderr summary, VF
//! backend incidents, probe values). Reading a VMM's output never fails a
//! caller: a missing file reads as empty.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::process::ExitStatus;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use trace::Stage;

use super::{Sandbox, SandboxFailure, VmmSpawnError};

impl Sandbox<'_> {
    /// Waits for the READY line on the pipe (`vmm::Ready`) and returns the
    /// vCPU threads' CPU it carries; EOF means the VMM ended without it.
    pub(super) fn wait_ready(&mut self, ready_r: OwnedFd) -> Result<u64, SandboxFailure> {
        let deadline = Instant::now() + Duration::from_secs(self.spec.timeout_secs + 10);
        let mut f = File::from(ready_r);
        let mut got = Vec::new();
        loop {
            if self.rt.interrupted() {
                return Err(self.failure(&self.next_stage(), "interrupted (SIGINT)".into()));
            }
            if self
                .attach
                .cancel
                .as_ref()
                .is_some_and(|c| c.load(Ordering::SeqCst))
            {
                return Err(self.failure(&self.next_stage(), "cancelled (task killed)".into()));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(
                    self.failure(&self.next_stage(), "no READY from the VMM in time".into())
                );
            }
            match poll_in(f.as_fd(), left.min(Duration::from_millis(200))) {
                Ok(false) => continue,
                Ok(true) => {}
                Err(e) => return Err(self.failed("vmm-spawn", VmmSpawnError::ReadyPipe(e).into())),
            }
            let mut buf = [0u8; 64];
            match f.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    got.extend_from_slice(&buf[..n]);
                    match vmm::Ready::parse(&got) {
                        Some(Ok(r)) => {
                            if self.spec.watch_zeroing {
                                let end = got.iter().position(|&b| b == b'\n').unwrap_or(0);
                                self.ready_pipe = Some((f, got.split_off(end + 1)));
                            }
                            return Ok(r.vcpu_ns);
                        }
                        Some(Err(e)) => return Err(self.failure(&self.next_stage(), e)),
                        None => {}
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.failed("vmm-spawn", VmmSpawnError::ReadyPipe(e).into())),
            }
        }
        // The VMM closed the pipe without READY: it failed. Name its error.
        let status = self.vmm.as_mut().and_then(|c| c.wait().ok());
        let err = self.files.stderr_text();
        let line = stderr_summary(&err);
        let status = status
            .map(|s| s.to_string())
            .unwrap_or_else(|| "unknown status".into());
        // A Linux guest says on its console how far it got.
        let line = match &self.spec.kernel {
            Some(_) => {
                let console = std::fs::read_to_string(&self.files.console).unwrap_or_default();
                let tail: Vec<&str> = console
                    .lines()
                    .filter(|l| !l.trim().is_empty())
                    .rev()
                    .take(3)
                    .collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                format!("{line} | console: {}", tail.join(" | "))
            }
            None => line,
        };
        Err(self.failure(
            &self.next_stage(),
            format!("VMM exited ({status}) without READY: {line}"),
        ))
    }

    /// The first VMM stage this sandbox has not completed (from the trace).
    fn next_stage(&self) -> String {
        let done: Vec<Stage> = trace::read_trace(self.rt.trace_path())
            .map(|evs| {
                evs.into_iter()
                    .filter(|e| e.sandbox == self.spec.id)
                    .map(|e| e.stage)
                    .collect()
            })
            .unwrap_or_default();
        let expected = crate::instance::expected_stages_with(
            self.spec.variant,
            self.spec.rootfs.is_some(),
            self.pooled_id.is_some(),
        );
        let engine_net = self.attach.netns.is_some();
        expected
            .into_iter()
            .filter(|s| !(engine_net && matches!(s, Stage::Netns | Stage::CniAdd)))
            .find(|s| !done.contains(s))
            .map(|s| s.name().to_string())
            .unwrap_or_else(|| "ready".into())
    }

    /// What the VMM said about its VF backend: disconnects, reconnects (with what was
    /// restored) and losses (lines of its stderr naming the VF socket).
    pub fn vf_incidents(&self) -> Vec<String> {
        let err = self.files.stderr_text();
        vf_incidents(&err)
    }

    /// After READY with --keep-running: the VMM must still be running, with its network:
    /// a VF the VMM could not restore after a NIC restart is a failure of the sandbox.
    pub fn check_alive(&mut self) -> Result<(), SandboxFailure> {
        let Some(c) = self.vmm.as_mut() else {
            return Ok(());
        };
        match c.try_wait() {
            Ok(None) => match self
                .vf_incidents()
                .into_iter()
                .find(|l| l.contains(VF_LOST))
            {
                Some(lost) => Err(self.failure("running", lost)),
                None => Ok(()),
            },
            Ok(Some(st)) => {
                self.vmm = None;
                let err = self.files.stderr_text();
                Err(self.failure(
                    "ready",
                    format!("VMM exited with {st} after READY: {}", stderr_summary(&err)),
                ))
            }
            Err(e) => Err(self.failed("ready", VmmSpawnError::Status(e).into())),
        }
    }

    /// After READY: waits (at most `patience`) until the VMM's background
    /// zeroer (the `bg-zeroer` thread a lazy VMM starts at READY) has ended,
    /// then returns the VMM's CPU since READY (`StartCpu::vmm_after_ready_ns`):
    /// the zeroing deferred past the start, counted apart from it. The VMM
    /// says so on the ready pipe (`vmm::ZEROED_LINE`), which the sandbox keeps
    /// under `SandboxSpec::watch_zeroing`: no look into the VMM's /proc, whose
    /// entries every reader instantiates and the VMM's exit must then purge.
    /// None without `watch_zeroing`, if the VMM or its cgroup is gone, or if
    /// the zeroer still runs.
    pub fn wait_background_zeroing(&mut self, patience: Duration) -> Option<u64> {
        let (mut f, mut got) = self.ready_pipe.take()?;
        let deadline = Instant::now() + patience;
        let line = vmm::ZEROED_LINE.as_bytes();
        while !got.windows(line.len()).any(|w| w == line) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.rt.interrupted() {
                return None;
            }
            match poll_in(f.as_fd(), left.min(Duration::from_millis(200))) {
                Ok(false) => continue,
                Ok(true) => {}
                Err(_) => return None,
            }
            let mut buf = [0u8; 64];
            match f.read(&mut buf) {
                Ok(0) => return None, // the VMM is gone
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return None,
            }
        }
        let now = self.cgroup.as_ref()?.cpu_usage_ns()?;
        let ns = now.saturating_sub(self.vmm_cpu_at_ready?);
        if let Some(c) = self.start_cpu.as_mut() {
            c.vmm_after_ready_ns = ns;
        }
        Some(ns)
    }

    /// Waits for the VMM to exit (after READY without --keep-running).
    pub fn wait_exit(&mut self) -> Result<(), SandboxFailure> {
        if let Some(c) = self.vmm.as_mut() {
            let st = c
                .wait()
                .map_err(|e| self.failed("ready", VmmSpawnError::Wait(e).into()))?;
            self.vmm = None;
            if !st.success() {
                let err = self.files.stderr_text();
                return Err(self.failure(
                    "ready",
                    format!("VMM exited with {st} after READY: {}", stderr_summary(&err)),
                ));
            }
        }
        Ok(())
    }

    /// Waits for the VMM to exit and returns its status (a task's exit);
    /// None if it was already reaped.
    pub fn wait_status(&mut self) -> Option<ExitStatus> {
        let st = self.vmm.as_mut()?.wait().ok();
        self.vmm = None;
        st
    }

    /// The VMM's stderr so far (the reason of a failure).
    pub fn vmm_stderr(&self) -> String {
        self.files.stderr_text()
    }

    /// The 64-bit values the agent read at `SandboxSpec::probe`, in order,
    /// once the VMM has exited on its own terms (READY then SIGTERM);
    /// `None` if it did not report them all (killed, failed).
    pub fn probe_values(&self) -> Option<&[u64]> {
        self.probe_values.as_deref()
    }

    /// Reads the probe values from the VMM's stdout (`value <i> 0x<u32>`,
    /// low then high word of each address).
    pub(super) fn read_probe_values(&mut self) {
        let Some(p) = &self.files.stdout else { return };
        let text = std::fs::read_to_string(p).unwrap_or_default();
        let words: Vec<u64> = text
            .lines()
            .filter_map(|l| l.strip_prefix("value "))
            .filter_map(|l| l.split_whitespace().nth(1))
            .filter_map(|h| u64::from_str_radix(h.trim_start_matches("0x"), 16).ok())
            .collect();
        if words.len() == 2 * self.spec.probe.len() {
            self.probe_values = Some(words.chunks(2).map(|w| w[0] | w[1] << 32).collect());
        }
    }
}

/// What the VMM prints when it gives a VF backend up (vmm/src/virtio/vhost_user.rs).
const VF_LOST: &str = "backend lost, not restored";

/// The VMM's reports about its VF backends: `sandbox ID: VF socket PATH: ...` lines.
fn vf_incidents(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter(|l| l.contains(": VF socket "))
        .map(|l| l.trim().to_string())
        .collect()
}

/// The VMM's error as one line: its non-empty stderr lines, joined.
fn stderr_summary(err: &str) -> String {
    let lines: Vec<&str> = err
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let s = lines.join(" | ");
    if s.len() > 600 {
        let mut cut = 600;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        format!("{}…", &s[..cut])
    } else {
        s
    }
}

fn poll_in(fd: BorrowedFd<'_>, timeout: Duration) -> std::io::Result<bool> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut p = [PollFd::new(fd, PollFlags::POLLIN)];
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    match poll(
        &mut p,
        PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
    ) {
        Ok(n) => Ok(n > 0),
        Err(nix::Error::EINTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vf_reports_of_the_vmm_are_found() {
        let err = "boot log\n\
            sandbox s1: VF socket /run/x/pf0-vf1.sock: backend disconnected; reconnecting for up to 30 s\n\
            sandbox s1: VF socket /run/x/pf0-vf1.sock: backend reconnected after 812 ms; restored features\n\
            sandbox s1: VF socket /run/x/pf0-vf1.sock: backend lost, not restored: no backend within 30 s\n";
        let v = vf_incidents(err);
        assert_eq!(v.len(), 3);
        assert!(v[2].contains(VF_LOST) && v[2].contains("pf0-vf1.sock"));
        assert!(vf_incidents("nothing here\n").is_empty());
    }
}
