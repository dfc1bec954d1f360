//! Several dataplane threads per PF (`--dataplane-threads N`): VF `i` is
//! served by thread `i % N`, the uplink's receive side by thread 0 (any
//! thread sends to the uplink: one write on its fd). A frame for a VF of
//! another thread crosses through a bounded channel per thread pair (std's
//! array channel: slots allocated once, no lock, no allocation per frame), and
//! its buffer goes back to its home pool through a second channel. A thread
//! about to sleep says so, and whoever sends it frames wakes it.

use std::collections::VecDeque;
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

use super::mempool::{Mempool, Pkt};
use super::BACKLOG_MAX;
use crate::port::{AtomicCounters, Port};

/// Frames in flight from one thread to another.
pub(crate) const CROSS_RING: usize = 1024;

/// This thread's side of the link with one other thread.
#[derive(Debug)]
struct Link {
    /// Frames for that thread's VFs (VF index, the VF's session the sender
    /// switched it for, packet).
    to: SyncSender<(u32, u64, Pkt)>,
    from: Receiver<(u32, u64, Pkt)>,
    /// That thread's buffers going home, and ours coming back.
    home_to: SyncSender<Pkt>,
    home_from: Receiver<Pkt>,
    wake: Arc<EventFd>,
    asleep: Arc<AtomicBool>,
    /// Frames or home-going buffers written this round (the peer is woken
    /// if it sleeps: a thread whose pool ran dry waits for its buffers).
    sent: bool,
}

/// The other dataplane threads of the PF, as one thread sees them.
#[derive(Debug)]
pub struct Peers {
    me: usize,
    n: usize,
    links: Vec<Option<Link>>,
    asleep: Arc<AtomicBool>,
    /// Buffers of ours came home since the last `sleeping` check.
    returned: bool,
}

impl Peers {
    /// The only thread of its PF.
    fn single() -> Self {
        Peers {
            me: 0,
            n: 1,
            links: Vec::new(),
            asleep: Arc::default(),
            returned: false,
        }
    }

    /// The links of `wakes.len()` threads whose pools have `pool` buffers.
    pub fn build(wakes: &[Arc<EventFd>], pool: usize) -> Vec<Peers> {
        let n = wakes.len();
        if n == 1 {
            return vec![Peers::single()];
        }
        let asleep: Vec<Arc<AtomicBool>> = (0..n).map(|_| Arc::default()).collect();
        let mut all: Vec<Peers> = (0..n)
            .map(|me| Peers {
                me,
                n,
                links: (0..n).map(|_| None).collect(),
                asleep: asleep[me].clone(),
                returned: false,
            })
            .collect();
        for a in 0..n {
            for b in a + 1..n {
                let (ab_tx, ab_rx) = sync_channel(CROSS_RING);
                let (ba_tx, ba_rx) = sync_channel(CROSS_RING);
                // A pool's buffers can all be away at once: going home never fails.
                let (home_ab_tx, home_ab_rx) = sync_channel(pool);
                let (home_ba_tx, home_ba_rx) = sync_channel(pool);
                all[a].links[b] = Some(Link {
                    to: ab_tx,
                    from: ba_rx,
                    home_to: home_ab_tx,
                    home_from: home_ba_rx,
                    wake: wakes[b].clone(),
                    asleep: asleep[b].clone(),
                    sent: false,
                });
                all[b].links[a] = Some(Link {
                    to: ba_tx,
                    from: ab_rx,
                    home_to: home_ba_tx,
                    home_from: home_ab_rx,
                    wake: wakes[a].clone(),
                    asleep: asleep[a].clone(),
                    sent: false,
                });
            }
        }
        all
    }

    pub fn me(&self) -> usize {
        self.me
    }
    pub fn threads(&self) -> usize {
        self.n
    }
    pub fn mine(&self, vf: usize) -> bool {
        self.n == 1 || vf % self.n == self.me
    }

    /// Hands a frame for VF `vf` (not ours), switched for its session
    /// `session` (`Port::session`), to its thread; gives it back when that
    /// thread's channel is full.
    pub fn send(&mut self, vf: usize, session: u64, pkt: Pkt) -> Result<(), Pkt> {
        let link = self.links[vf % self.n].as_mut().expect("another thread");
        match link.to.try_send((vf as u32, session, pkt)) {
            Ok(()) => {
                link.sent = true;
                Ok(())
            }
            Err(TrySendError::Full((_, _, p)) | TrySendError::Disconnected((_, _, p))) => Err(p),
        }
    }

    /// Takes our buffers back and the frames other threads switched to our
    /// VFs into their backlogs (`rx_drops` when a backlog is full, the VF no
    /// longer active, or the frame was switched for another session of the
    /// VF than the one its backlog holds: a previous tenant's frames never
    /// reach the next one). Returns how many frames came.
    pub fn receive(
        &mut self,
        pool: &mut Mempool,
        backlog: &mut [VecDeque<Pkt>],
        (active, sessions): (&[bool], &[u64]),
        ports: &[Arc<Port>],
    ) -> usize {
        let mut n = 0;
        for link in self.links.iter().flatten() {
            while let Ok(p) = link.home_from.try_recv() {
                pool.free(p);
                self.returned = true;
            }
            while let Ok((vf, session, p)) = link.from.try_recv() {
                n += 1;
                let vf = vf as usize;
                if active[vf] && session == sessions[vf] && backlog[vf].len() < BACKLOG_MAX {
                    backlog[vf].push_back(p);
                } else {
                    AtomicCounters::add(&ports[vf].counters.rx_drops, 1);
                    pool.free(p);
                }
            }
        }
        n
    }

    /// End of a round: buffers of other pools go home; a sleeping thread we
    /// sent frames to is woken.
    pub fn flush(&mut self, pool: &mut Mempool) {
        if self.links.is_empty() {
            return;
        }
        for (home, link) in self.links.iter_mut().enumerate() {
            let Some(link) = link else { continue };
            for p in pool.away(home).drain(..) {
                // Only fails when that thread is gone: the buffer is freed.
                let _ = link.home_to.try_send(p);
                link.sent = true;
            }
        }
        // Every channel write of the round (frames in `send`, buffers above)
        // before the reads of `asleep` (see `sleeping`): a Dekker pair.
        fence(Ordering::SeqCst);
        for link in self.links.iter_mut().flatten() {
            if std::mem::take(&mut link.sent) && link.asleep.load(Ordering::SeqCst) {
                let _ = link.wake.write(1);
            }
        }
    }

    /// Before a sleep: says so, then looks once more for frames (a sender
    /// that wrote before seeing `asleep` is caught here, one after it wakes
    /// us). False when frames or our own buffers came: no sleep.
    pub fn sleeping(
        &mut self,
        pool: &mut Mempool,
        backlog: &mut [VecDeque<Pkt>],
        views: (&[bool], &[u64]),
        ports: &[Arc<Port>],
    ) -> bool {
        if self.links.is_empty() {
            return true;
        }
        self.asleep.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        // Buffers that came home may unblock a transmit queue left waiting
        // for them (its kick was already consumed): one more round.
        if self.receive(pool, backlog, views, ports) > 0 || std::mem::take(&mut self.returned) {
            self.asleep.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    pub fn awake(&self) {
        self.asleep.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    //! The sleeper/waker pair, one step at a time (the interleavings a
    //! running pair of threads hits only by chance).
    use super::*;
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    struct Pair {
        peers: Vec<Peers>,
        pools: Vec<Mempool>,
        wakes: Vec<Arc<EventFd>>,
        backlog: Vec<VecDeque<Pkt>>,
        ports: Vec<Arc<Port>>,
    }

    /// Threads 0 and 1 of a PF with VFs 0 (thread 0) and 1 (thread 1).
    fn pair() -> Pair {
        let wakes: Vec<_> = (0..2)
            .map(|_| Arc::new(EventFd::new(EFD_NONBLOCK).unwrap()))
            .collect();
        let ports = (0..2)
            .map(|i| {
                let sock = format!("/nonexistent/vf{i}.sock").into();
                Arc::new(Port::new(
                    "pf0",
                    i,
                    format!("vf{i}"),
                    sock,
                    [2, 0, 0, 0, 0, i as u8],
                    wakes[i].clone(),
                ))
            })
            .collect();
        Pair {
            peers: Peers::build(&wakes, 4),
            pools: (0..2).map(|h| Mempool::with_home(4, h, 2)).collect(),
            wakes,
            backlog: (0..2).map(|_| VecDeque::new()).collect(),
            ports,
        }
    }

    impl Pair {
        fn sleeping(&mut self, t: usize) -> bool {
            let views = (&[true, true][..], &[0, 0][..]);
            self.peers[t].sleeping(&mut self.pools[t], &mut self.backlog, views, &self.ports)
        }
        fn woken(&self, t: usize) -> bool {
            self.wakes[t].read().is_ok()
        }
    }

    #[test]
    fn a_frame_for_a_sleeping_thread_wakes_it() {
        let mut p = pair();
        assert!(p.sleeping(1));
        let pkt = p.pools[0].alloc().unwrap();
        p.peers[0].send(1, 0, pkt).unwrap();
        assert!(!p.woken(1), "woken at the round end, not per frame");
        p.peers[0].flush(&mut p.pools[0]);
        assert!(p.woken(1));
        // Awake: no more eventfd writes.
        p.peers[1].awake();
        let pkt = p.pools[0].alloc().unwrap();
        p.peers[0].send(1, 0, pkt).unwrap();
        p.peers[0].flush(&mut p.pools[0]);
        assert!(!p.woken(1));
    }

    #[test]
    fn a_frame_sent_before_the_flag_keeps_the_thread_awake() {
        let mut p = pair();
        // Sent (and flushed) while thread 1 ran: no wake-up ...
        let pkt = p.pools[0].alloc().unwrap();
        p.peers[0].send(1, 0, pkt).unwrap();
        p.peers[0].flush(&mut p.pools[0]);
        assert!(!p.woken(1));
        // ... so its look after raising the flag must find it.
        assert!(!p.sleeping(1), "slept with a frame in its channel");
        assert_eq!(p.backlog[1].len(), 1);
    }

    #[test]
    fn buffers_going_home_wake_their_sleeping_pool() {
        let mut p = pair();
        // Thread 1's buffer freed by thread 0 (a frame it delivered).
        let pkt = p.pools[1].alloc().unwrap();
        assert!(p.sleeping(1));
        p.pools[0].free(pkt);
        p.peers[0].flush(&mut p.pools[0]);
        assert!(
            p.woken(1),
            "a thread whose pool ran dry waits for its buffers"
        );
        p.peers[1].awake();
        // Came home before the next sleep: one more round instead (they may
        // unblock a transmit queue whose kick was consumed).
        assert!(!p.sleeping(1));
        assert_eq!(p.pools[1].available(), 4);
        assert!(p.sleeping(1));
    }

    /// A frame switched for an earlier session of its VF (a tenant that has
    /// gone since) is dropped on arrival, never queued for the next one.
    #[test]
    fn a_frame_for_an_earlier_session_of_its_vf_is_dropped() {
        let mut p = pair();
        for session in [6, 7] {
            let pkt = p.pools[0].alloc().unwrap();
            p.peers[0].send(1, session, pkt).unwrap();
        }
        let views = (&[true, true][..], &[0, 7][..]);
        let n = p.peers[1].receive(&mut p.pools[1], &mut p.backlog, views, &p.ports);
        assert_eq!(n, 2);
        assert_eq!(p.backlog[1].len(), 1, "only the current session's frame");
        assert_eq!(p.ports[1].counters.snapshot().rx_drops, 1);
    }
}
