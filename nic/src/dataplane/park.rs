//! Idle transmit queues are parked: a VF whose transmit queue had nothing
//! for `PARK_ROUNDS` rounds is no longer polled per round (no ring state,
//! no guest memory touched); its kick eventfd joins an epoll set instead,
//! which the thread looks at every `READY_EVERY` rounds while any queue is
//! parked (one syscall for all of them, none while none is parked). A kick
//! unparks the queue. This is per-queue notification as DPDK's vhost library
//! offers it (`rte_vhost_enable_guest_notification` + the kickfd), applied
//! only to queues without work, so busy queues keep being polled every round.
//!
//! No publish is missed: parking drains the kick eventfd, registers it and
//! asks the driver for kicks again (clears VRING_USED_F_NO_NOTIFY, which the
//! dataplane sets while it polls: `virtio::want_kicks`) *before* the queue's
//! last poll, so a buffer published after that poll comes with a kick, and
//! one published before it is found by it.
//! A queue that took nothing because the pool ran dry is not idle (its
//! buffers are waiting): it stays polled.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use vmm_sys_util::eventfd::EventFd;

use crate::poll::eventfd_fd;

/// Rounds without transmit work before a queue is parked.
pub const PARK_ROUNDS: u32 = 256;
/// How often (in rounds) the kicks of parked queues are looked at.
pub const READY_EVERY: u32 = 8;

#[derive(Debug)]
pub struct Parking {
    epoll: Epoll,
    /// Rounds in a row the VF's transmit queue had nothing.
    idle: Vec<u32>,
    /// The kick fd registered while parked (the runtime holding it is owned
    /// by the thread as long as the queue is parked: `unpark` before it goes).
    parked: Vec<Option<i32>>,
    n_parked: usize,
    round: u32,
    events: Vec<EpollEvent>,
    /// Queues parked so far (tests and accounting).
    pub parks: u64,
}

impl Parking {
    pub fn new(vfs: usize) -> io::Result<Self> {
        Ok(Parking {
            epoll: Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(io::Error::from)?,
            idle: vec![0; vfs],
            parked: vec![None; vfs],
            n_parked: 0,
            round: 0,
            events: vec![EpollEvent::empty(); 64],
            parks: 0,
        })
    }

    /// The VF's transmit queue is parked: skip it this round.
    pub fn is_parked(&self, vf: usize) -> bool {
        self.parked[vf].is_some()
    }

    /// Before polling VF `vf`'s transmit queue: parks it once it was idle
    /// long enough (the poll that follows is its last, and sees everything
    /// published before the kick eventfd was drained). Returns whether it
    /// parked the queue now: the caller then asks the driver for kicks
    /// before that last poll.
    pub fn before_poll(&mut self, vf: usize, kick: Option<&EventFd>) -> bool {
        if self.idle[vf] < PARK_ROUNDS || self.parked[vf].is_some() {
            return false;
        }
        let Some(kick) = kick else { return false };
        // Kicks of the busy period: drained, so only later ones report.
        let _ = kick.read();
        let fd = eventfd_fd(kick);
        if self
            .epoll
            .add(fd, EpollEvent::new(EpollFlags::EPOLLIN, vf as u64))
            .is_ok()
        {
            self.parked[vf] = Some(std::os::fd::AsRawFd::as_raw_fd(&fd));
            self.n_parked += 1;
            self.parks += 1;
            return true;
        }
        false
    }

    /// After the poll: `busy` when it took frames or could not (no buffers).
    pub fn after_poll(&mut self, vf: usize, busy: bool) {
        if busy {
            self.idle[vf] = 0;
            self.unpark(vf);
        } else {
            self.idle[vf] = self.idle[vf].saturating_add(1);
        }
    }

    /// Polled again from the next round (its kick fired, its runtime goes
    /// back to the session, or the thread slept and drained every kick).
    pub fn unpark(&mut self, vf: usize) {
        self.idle[vf] = 0;
        if let Some(fd) = self.parked[vf].take() {
            // SAFETY: the fd is the kick eventfd of a runtime this thread still
            // owns (see `parked`), so it is open.
            let _ = self.epoll.delete(unsafe { BorrowedFd::borrow_raw(fd) });
            self.n_parked -= 1;
        }
    }

    /// Readable when a parked queue was kicked (the thread's sleep waits on it).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.epoll.0.as_fd()
    }

    /// At round start, every `READY_EVERY` rounds while a queue is parked:
    /// unparks the queues that were kicked.
    pub fn round(&mut self) {
        if self.n_parked == 0 {
            return;
        }
        self.round = self.round.wrapping_add(1);
        if self.round.is_multiple_of(READY_EVERY) {
            self.unpark_kicked();
        }
    }

    /// Unparks the queues that were kicked.
    pub fn unpark_kicked(&mut self) {
        if self.n_parked == 0 {
            return;
        }
        let n = self
            .epoll
            .wait(&mut self.events, EpollTimeout::ZERO)
            .unwrap_or(0);
        for k in 0..n {
            let vf = self.events[k].data() as usize;
            self.unpark(vf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    fn idle_rounds(p: &mut Parking, vf: usize, kick: &EventFd, n: u32) {
        for _ in 0..n {
            if !p.is_parked(vf) {
                p.before_poll(vf, Some(kick));
                p.after_poll(vf, false);
            }
            p.round();
        }
    }

    #[test]
    fn an_idle_queue_parks_and_a_kick_unparks_it() {
        let mut p = Parking::new(2).unwrap();
        let kick = EventFd::new(EFD_NONBLOCK).unwrap();
        kick.write(1).unwrap(); // a kick of the busy period
        idle_rounds(&mut p, 0, &kick, PARK_ROUNDS);
        assert!(!p.is_parked(0));
        idle_rounds(&mut p, 0, &kick, 1);
        assert!(p.is_parked(0), "idle for PARK_ROUNDS rounds");
        // The old kick was drained: it does not unpark.
        idle_rounds(&mut p, 0, &kick, 2 * READY_EVERY);
        assert!(p.is_parked(0));
        kick.write(1).unwrap();
        idle_rounds(&mut p, 0, &kick, READY_EVERY);
        assert!(!p.is_parked(0), "a kick unparks within READY_EVERY rounds");
        assert_eq!(p.parks, 1);
    }

    #[test]
    fn work_in_the_last_poll_keeps_the_queue_polled() {
        let mut p = Parking::new(1).unwrap();
        let kick = EventFd::new(EFD_NONBLOCK).unwrap();
        idle_rounds(&mut p, 0, &kick, PARK_ROUNDS);
        // Parked before the poll; the poll finds frames published before.
        p.before_poll(0, Some(&kick));
        assert!(p.is_parked(0));
        p.after_poll(0, true);
        assert!(!p.is_parked(0));
        // No kick fd (ring not set up): never parked.
        let mut q = Parking::new(1).unwrap();
        for _ in 0..2 * PARK_ROUNDS {
            q.before_poll(0, None);
            q.after_poll(0, false);
        }
        assert!(!q.is_parked(0));
    }
}
