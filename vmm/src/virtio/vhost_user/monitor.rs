//! The monitor thread of a VF device: the async `vf-open` and DRIVER_OK, the NIC's err
//! eventfds, and reconnecting to a restarted NIC daemon (restoring the session).

use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use trace::{monotonic_ns, Stage};
use virtio_queue::QueueT;

use super::{borrow, Session, Vf, BACKOFF_FIRST, BACKOFF_MAX, MAX_RESTORE_FAILURES};
use crate::devspec::VfInit;
use crate::virtio::VirtioError;

impl Vf {
    /// The backend is gone for good: said loudly, traced, and the guest told.
    fn lose(&self, since_ns: u64, cause: String) {
        self.report(&format!("backend lost, not restored: {cause}"));
        tracing::error!("VF {}: {cause}", self.socket.display());
        if let Err(e) = self.trace.record(Stage::VfLost, since_ns, monotonic_ns()) {
            tracing::warn!("vhost-user {}: trace: {e}", self.socket.display());
        }
        self.lock().lost = Some(cause);
        self.link.store(0, Ordering::SeqCst);
        self.fail();
    }

    /// Sleeps `d` unless woken (stop, a vCPU request).
    fn pause(&self, d: Duration) {
        let mut fds = [PollFd::new(borrow(&self.wake), PollFlags::POLLIN)];
        let ms =
            PollTimeout::try_from(d.as_millis().min(60_000) as i32).unwrap_or(PollTimeout::MAX);
        let _ = poll(&mut fds, ms);
        let _ = self.wake.read();
    }

    /// The monitor thread: the async `vf-open`, async DRIVER_OK, the NIC's error reports,
    /// and reconnects when the backend goes away.
    pub(super) fn monitor(self: Arc<Self>) {
        // The NIC's session thread reads each message as it arrives, which
        // wakes this one (the socket's write space): a SCHED_BATCH thread is
        // not switched to for such wake-ups until the NIC's thread blocks
        // (procutil::sched; docs/vmm.md "The vhost-user session").
        if let Err(e) = procutil::sched::set_thread_policy(procutil::sched::Policy::Batch) {
            tracing::debug!(
                "VF {}: monitor stays SCHED_OTHER: {e}",
                self.socket.display()
            );
        }
        if self.mode == VfInit::Async {
            match self.open(true) {
                Ok(s) => {
                    let mut c = self.lock();
                    c.session = Some(s);
                    if let Err(e) = self.apply(&mut c) {
                        tracing::warn!("{e}");
                    }
                }
                Err(e) => self.lose(monotonic_ns(), format!("vf-open failed: {e}")),
            }
        }
        while !self.stopping.load(Ordering::SeqCst) {
            let (sock, broken) = {
                let c = self.lock();
                let sock = c.session.as_ref().map(|s| s.frontend.as_raw_fd());
                (sock, c.broken)
            };
            if broken {
                self.reconnect("a request to the backend failed");
                continue;
            }
            let mut fds = vec![PollFd::new(borrow(&self.wake), PollFlags::POLLIN)];
            fds.extend(
                self.errs
                    .iter()
                    .map(|e| PollFd::new(borrow(e), PollFlags::POLLIN)),
            );
            // SAFETY: only this thread drops the session, so the fd stays open while polled.
            let sock_fd = sock.map(|fd| unsafe { BorrowedFd::borrow_raw(fd) });
            if let Some(fd) = sock_fd {
                // Only the peer's close (not our own replies arriving) wakes us; nix lacks
                // the flag.
                fds.push(PollFd::new(
                    fd,
                    PollFlags::from_bits_retain(libc::POLLRDHUP),
                ));
            }
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(nix::Error::EINTR) => {}
                Err(e) => {
                    tracing::error!("VF {}: monitor poll: {e}", self.socket.display());
                    return;
                }
            }
            // nix answers None for bits it does not know (POLLRDHUP): something happened.
            let ready = |p: &PollFd| p.revents().is_none_or(|r| !r.is_empty());
            let woke = ready(&fds[0]);
            let errored = fds[1..1 + self.errs.len()].iter().any(ready);
            let hup = sock_fd.is_some() && ready(&fds[fds.len() - 1]);
            drop(fds);
            if woke {
                let _ = self.wake.read();
                let mut c = self.lock();
                if let Err(e) = self.apply(&mut c) {
                    tracing::warn!("{e}");
                }
            }
            if errored {
                // Under the lock, as the guest's reset drains them: a signal that reset
                // already consumed (an error of the rings it stopped) is not reported.
                let c = self.lock();
                if self.take_err_signals() && c.started {
                    self.report(
                        "the NIC put the VF in error (malformed descriptors?); device needs reset",
                    );
                    self.fail();
                }
            }
            if hup {
                self.reconnect("backend disconnected");
            }
        }
    }

    /// The backend is gone: reconnect with backoff until the deadline, then restore the
    /// session (and the running rings). Never holds the lock while waiting for a backend.
    fn reconnect(&self, why: &str) {
        let since = monotonic_ns();
        let t0 = Instant::now();
        {
            let mut c = self.lock();
            c.session = None;
            c.started = false;
            c.broken = false;
        }
        self.set_link(false);
        if self.reconnect.is_zero() {
            self.lose(
                since,
                format!("{why}; reconnecting is disabled (--vf-reconnect 0)"),
            );
            return;
        }
        self.report(&format!(
            "{why}; reconnecting for up to {} s",
            self.reconnect.as_secs_f64()
        ));
        let mut backoff = BACKOFF_FIRST;
        let mut last = String::from("none yet");
        let mut refused = 0;
        loop {
            if self.stopping.load(Ordering::SeqCst) {
                return;
            }
            if t0.elapsed() >= self.reconnect {
                let cause = format!(
                    "{why}, no backend within {} s (last error: {last})",
                    self.reconnect.as_secs_f64()
                );
                self.lose(since, cause);
                return;
            }
            match self
                .open(false)
                .map_err(Restore::Retry)
                .and_then(|s| self.restore(s))
            {
                Ok(what) => {
                    if let Err(e) = self.trace.record(Stage::VfReconnect, since, monotonic_ns()) {
                        tracing::warn!("vhost-user {}: trace: {e}", self.socket.display());
                    }
                    self.report(&format!(
                        "backend reconnected after {} ms; restored {what}",
                        t0.elapsed().as_millis()
                    ));
                    return;
                }
                Err(Restore::Retry(e)) => last = e.to_string(),
                Err(Restore::Refused(e)) => {
                    refused += 1;
                    last = e.to_string();
                    if refused >= MAX_RESTORE_FAILURES {
                        self.lose(since, format!("{why}; the new backend refuses it: {last}"));
                        return;
                    }
                }
                Err(Restore::Impossible(cause)) => {
                    self.lose(since, format!("{why}; {cause}"));
                    return;
                }
            }
            self.pause(backoff);
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// Puts a new session in place and, for a running driver, gives it the rings where
    /// the old backend left them. Returns what was restored, for the report.
    fn restore(&self, mut s: Session) -> Result<String, Restore> {
        let mut c = self.lock();
        let Some(d) = c.driver.as_ref() else {
            c.session = Some(s);
            return Ok("features and memory table (no driver running)".into());
        };
        let missing = d.features & !s.backend_features & self.kind.features();
        if missing != 0 {
            return Err(Restore::Impossible(Impossible::MissingFeatures(missing)));
        }
        let bases = self
            .ring_bases(d)
            .map_err(|e| Restore::Impossible(Impossible::RingBases(e)))?;
        let avail: Vec<u16> = d
            .queues
            .iter()
            .map(|q| q.avail_idx(&self.mem, Ordering::Acquire).map_or(0, |w| w.0))
            .collect();
        self.start(&mut s, d, &bases).map_err(Restore::Refused)?;
        c.session = Some(s);
        c.started = true;
        if let Some(d) = c.driver.as_mut() {
            d.started_once = true;
        }
        drop(c);
        // Kicks and interrupts the old backend may have swallowed.
        for k in &self.kicks {
            let _ = k.write(1);
        }
        let _ = self.call.write(1);
        self.set_link(true);
        let rings = bases
            .iter()
            .zip(&avail)
            .enumerate()
            .map(|(i, (b, a))| {
                format!(
                    "ring {i} at used index {b} ({} buffers pending)",
                    a.wrapping_sub(*b)
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        Ok(format!(
            "features, memory table, kick/call/err eventfds, {rings}; buffers the old \
             backend had taken but not completed are processed again"
        ))
    }
}

/// Why a restore attempt failed.
enum Restore {
    /// Connecting or negotiating failed: try again.
    Retry(VirtioError),
    /// The new backend refused the restored rings.
    Refused(VirtioError),
    /// Cannot work with any backend of this kind.
    Impossible(Impossible),
}

/// Why no backend of this kind can take the device over.
#[derive(Debug, thiserror::Error)]
enum Impossible {
    #[error("the new backend lacks negotiated features {0:#x}")]
    MissingFeatures(u64),
    #[error(transparent)]
    RingBases(VirtioError),
}
