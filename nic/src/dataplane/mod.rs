//! The dataplane of one PF, in the style of ixy: a thread with its mempool and
//! a loop that reads every port it serves in batches, switches each frame, and
//! writes it out (several threads per PF: `shard`). When whole rounds find nothing to do for `SPIN_ROUNDS` rounds or
//! the spin window (`spin`: adapted to how soon work follows, as KVM's halt
//! polling), whichever comes first, it
//! sleeps in poll(2) on the queues' kick eventfds, the uplink fd and a wake
//! eventfd, so idle VFs cost no CPU. Interrupts go to the guest through the
//! call eventfd (see `virtio`).

mod cut;
mod forward;
pub mod mempool;
pub mod park;
pub mod shard;
pub mod spin;
pub mod switch;
pub mod uplink;
pub mod virtio;

use std::collections::VecDeque;
use std::io;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::devset::Devset;
use crate::poll::{eventfd_fd, wait_readable};
use crate::port::{AtomicCounters, Port, Runtime, VfHw, RXQ, TXQ};
use mempool::{Mempool, Pkt, BUF_SIZE};
use shard::Peers;
use switch::{PortId, Switch, VfView};
use uplink::Uplink;

pub const DEFAULT_BATCH: usize = 32;
/// Frames queued for one VF while its guest posts no receive buffers.
pub(crate) const BACKLOG_MAX: usize = 256;
/// Pool buffers for the frames being switched, whatever the backlogs hold.
const WORKING_SET: usize = 4096;
const SPIN_ROUNDS: u32 = 1000;
/// Idle rounds between looks at the clock.
const SPIN_CLOCK_EVERY: u32 = 32;
/// Upper bound of a sleep. Not the wake-up mechanism: every source of work
/// wakes a sleeping thread itself (kick and wake eventfds, the uplink fd, the
/// cross-thread Dekker in `shard`), so a sleep that runs out is a missed
/// wake-up, i.e. a bug; the cap bounds what such a bug costs. Tests set it far
/// longer (`Dataplane::set_sleep_cap`) so that a missed wake-up fails them.
pub const SAFETY_SLEEP: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Debug)]
pub struct Dataplane {
    devset: Arc<Devset<VfHw>>,
    ports: Vec<Arc<Port>>,
    /// Received by thread 0 only; every thread sends to it.
    uplink: Option<Arc<Uplink>>,
    wake: Arc<EventFd>,
    peers: Peers,
    batch: usize,
    pool: Mempool,
    switch: Switch,
    /// Frames waiting for each VF's receive queue, all switched in the VF
    /// session `session[i]` (`Port::session`): a frame never outlives the
    /// session it was switched for, so a previous tenant's frames never reach
    /// the next user of the VF (dropped when the session moves, `look_at`).
    backlog: Vec<VecDeque<Pkt>>,
    /// Each VF's session as this thread last saw it: of its own VFs, the one
    /// its backlog holds frames of; of the others, the one the switch's view
    /// (and the frames this thread sends them) belong to.
    session: Vec<u64>,
    seen_generation: Vec<u64>,
    /// The PF's change count (raised by every port wake-up) at the last look
    /// at the ports' `want` and generations: unchanged, no port is touched.
    changes: Arc<AtomicU64>,
    seen_changes: u64,
    /// The runtimes of the VFs with an open, working session, owned by this
    /// thread (see `port`): the others are skipped without touching them.
    owned: Vec<Option<Box<Runtime>>>,
    /// VFs to look at again at the next round start: their generation moved,
    /// or their runtime was handed back to a session-side user.
    pending: Vec<bool>,
    any_pending: bool,
    /// The switch sees the VF as active (from the last look at its runtime).
    active: Vec<bool>,
    /// The spoof warning was given for the VF's current session.
    spoof_warned: Vec<bool>,
    scratch: virtio::Scratch,
    /// Idle transmit queues: not polled, woken by their kicks (`park`).
    park: park::Parking,
    /// How long an idle thread polls before it sleeps (`spin`).
    spin: spin::SpinWindow,
    sleep_cap: std::time::Duration,
    /// ixy-style accounting: time spent in busy periods, and frames moved.
    busy_ns: u128,
    frames: u64,
}

impl Dataplane {
    /// `threads` dataplane threads of a PF (see `shard`): thread 0 wakes on
    /// `wake`, the others on eventfds of their own, which their VFs' sessions
    /// write.
    pub fn sharded(
        devset: Arc<Devset<VfHw>>,
        ports: Vec<Arc<Port>>,
        uplink: Option<Uplink>,
        wake: Arc<EventFd>,
        batch: usize,
        threads: usize,
    ) -> io::Result<Vec<Self>> {
        let threads = threads.clamp(1, ports.len().max(1));
        let mut wakes = vec![wake];
        for _ in 1..threads {
            wakes.push(Arc::new(EventFd::new(EFD_NONBLOCK)?));
        }
        let changes = Arc::new(AtomicU64::new(1));
        for (i, port) in ports.iter().enumerate() {
            port.set_wake(wakes[i % threads].clone(), changes.clone());
        }
        let pool = (
            WORKING_SET + ports.len().div_ceil(threads) * BACKLOG_MAX / 4,
            pool_cap(ports.len(), threads),
        );
        let uplink = uplink.map(Arc::new);
        Peers::build(&wakes, pool.1)
            .into_iter()
            .zip(wakes)
            .map(|(peers, wake)| {
                let (up, ch) = (uplink.clone(), changes.clone());
                Self::shard(
                    devset.clone(),
                    ports.clone(),
                    up,
                    (wake, ch),
                    batch,
                    peers,
                    pool,
                )
            })
            .collect()
    }

    fn shard(
        devset: Arc<Devset<VfHw>>,
        ports: Vec<Arc<Port>>,
        uplink: Option<Arc<Uplink>>,
        (wake, changes): (Arc<EventFd>, Arc<AtomicU64>),
        batch: usize,
        peers: Peers,
        pool: (usize, usize),
    ) -> io::Result<Self> {
        let n = ports.len();
        Ok(Dataplane {
            changes,
            seen_changes: 0,
            devset,
            uplink,
            wake,
            batch: batch.max(1),
            pool: Mempool::growing(pool.0, pool.1, peers.me(), peers.threads()),
            switch: Switch::new(n),
            backlog: (0..n)
                .map(|i| VecDeque::with_capacity(if peers.mine(i) { BACKLOG_MAX } else { 0 }))
                .collect(),
            session: vec![0; n],
            seen_generation: vec![0; n],
            owned: (0..n).map(|_| None).collect(),
            pending: vec![false; n],
            any_pending: false,
            active: vec![false; n],
            spoof_warned: vec![false; n],
            scratch: virtio::Scratch::default(),
            park: park::Parking::new(n)?,
            spin: spin::SpinWindow::new(),
            sleep_cap: SAFETY_SLEEP,
            busy_ns: 0,
            frames: 0,
            ports,
            peers,
        })
    }

    /// The eventfd this thread sleeps on (to wake it for a stop).
    pub fn wake(&self) -> Arc<EventFd> {
        self.wake.clone()
    }

    /// The longest sleep (`SAFETY_SLEEP` by default).
    pub fn set_sleep_cap(&mut self, cap: std::time::Duration) {
        self.sleep_cap = cap;
    }

    pub fn run(mut self, stop: &AtomicBool) {
        let mut idle = 0u32;
        // Since when the thread has found no work (None while it finds some): the idle period
        // the spin window adapts to ends at the next work, found by polling or after a sleep.
        let mut idle_since: Option<std::time::Instant> = None;
        let mut rx = Vec::with_capacity(self.batch);
        let mut out = Vec::with_capacity(self.ports.len() + 1);
        // The clock is read when a busy period starts and when it ends, not per round.
        let mut busy_since: Option<std::time::Instant> = None;
        while !stop.load(Ordering::Relaxed) {
            self.refresh_ports();
            self.park.round();
            let (me, step) = (self.peers.me(), self.peers.threads());
            // 0. Frames other threads switched to our VFs.
            let mut work = if step > 1 {
                self.peers.receive(
                    &mut self.pool,
                    &mut self.backlog,
                    (&self.active, &self.session),
                    &self.ports,
                )
            } else {
                0
            };
            // 1. Uplink → switch.
            if self.uplink.is_some() && me == 0 {
                work += self.rx_uplink(&mut rx);
                for pkt in rx.drain(..) {
                    self.forward(PortId::Uplink, pkt, &mut out);
                }
            }
            // 2. Each live VF's transmit queue → switch (VFs not owned and
            // parked queues are skipped).
            for i in (me..self.ports.len()).step_by(step) {
                let Some(rt) = self.owned[i].as_mut() else {
                    continue;
                };
                if self.park.is_parked(i) {
                    continue;
                }
                if self.park.before_poll(i, rt.vrings[TXQ].kick.as_deref()) {
                    // Its last poll follows: from here on a publish comes with a kick.
                    virtio::want_kicks(rt, TXQ);
                } else {
                    virtio::quiet(rt, TXQ);
                }
                let mut src = self.owned[i].take().expect("checked");
                let (r, dest_fault) = self.tx_burst(i, &mut src, &mut rx);
                self.owned[i] = Some(src);
                if let Some(cut::DestFault(j, f)) = dest_fault {
                    self.fault(j, f);
                }
                match r {
                    Ok(n) => {
                        work += n;
                        // A queue that found no buffer is waiting, not idle.
                        let busy = n > 0 || self.pool.available() == 0;
                        self.park.after_poll(i, busy);
                    }
                    Err(f) => self.fault(i, f),
                }
                // A VF that came up since the round started (its set-up was
                // acked before this guest published) is switched to: the view
                // is refreshed before the burst is routed, not a round later.
                if !rx.is_empty() && self.changes.load(Ordering::Acquire) != self.seen_changes {
                    self.refresh_ports();
                }
                // The source's counters, once per burst: each frame once, as
                // taken by the switch or as a drop.
                let (mut packets, mut bytes, mut drops) = (0, 0, 0);
                for pkt in rx.drain(..) {
                    let len = pkt.len as u64;
                    if self.forward(PortId::Vf(i), pkt, &mut out) {
                        packets += 1;
                        bytes += len;
                    } else {
                        drops += 1;
                    }
                }
                let c = &self.ports[i].counters;
                AtomicCounters::add_burst([
                    (&c.tx_packets, packets),
                    (&c.tx_bytes, bytes),
                    (&c.tx_drops, drops),
                ]);
            }
            // 3. Queued frames → each VF's receive queue.
            for i in (me..self.ports.len()).step_by(step) {
                if self.backlog[i].is_empty() {
                    continue;
                }
                // Handed back to the session for a moment: the frames wait.
                let Some(rt) = self.owned[i].as_mut() else {
                    continue;
                };
                virtio::quiet(rt, RXQ);
                let port = &self.ports[i];
                let r = virtio::fill_guest_rx(
                    port,
                    rt,
                    &mut self.pool,
                    &mut self.scratch,
                    self.batch,
                    &mut self.backlog[i],
                );
                match r {
                    Ok(n) => work += n,
                    Err(f) => self.fault(i, f),
                }
            }
            self.peers.flush(&mut self.pool);
            if work > 0 {
                idle = 0;
                if let Some(t) = idle_since.take() {
                    let now = std::time::Instant::now();
                    self.spin.idle_ended(now.duration_since(t));
                    busy_since = Some(now);
                }
                busy_since.get_or_insert_with(std::time::Instant::now);
                self.frames += work as u64;
            } else {
                let since = *idle_since.get_or_insert_with(std::time::Instant::now);
                if let Some(t) = busy_since.take() {
                    self.busy_ns += since.duration_since(t).as_nanos();
                }
                idle += 1;
                let window = self.spin.window();
                let spun = idle >= SPIN_ROUNDS
                    || window.is_zero()
                    || (idle.is_multiple_of(SPIN_CLOCK_EVERY) && since.elapsed() >= window);
                // A VF waiting to be taken back (`pending`) does not keep the
                // thread up: its session-side user wakes it when done
                // (`RuntimeGuard`'s drop notifies), and in a burst of session
                // set-ups some VF nearly always waits.
                if spun {
                    self.sleep();
                    idle = 0;
                }
            }
        }
        if let Some(t) = busy_since {
            self.busy_ns += t.elapsed().as_nanos();
        }
        if self.frames > 0 {
            tracing::info!(
                "PF {}: {} frames moved, {} ns/frame in busy periods",
                self.devset.name(),
                self.frames,
                self.busy_ns / self.frames as u128
            );
        }
    }

    /// At round start: hands runtimes back to the session-side users that
    /// want them, and picks up config and lifecycle changes of the VFs.
    fn refresh_ports(&mut self) {
        let c = self.changes.load(Ordering::Acquire);
        // Nothing announced since the last look: no port is read.
        let n = if c != self.seen_changes {
            self.ports.len()
        } else {
            0
        };
        self.seen_changes = c;
        for i in 0..n {
            if self.owned[i].is_some() && self.ports[i].wanted() {
                self.give_back(i);
            }
            let g = self.ports[i].generation();
            if g != self.seen_generation[i] {
                self.seen_generation[i] = g;
                if self.peers.mine(i) {
                    self.pending[i] = true;
                    self.any_pending = true;
                } else {
                    // Served by another thread: only the switch's view. The
                    // session first: a view newer than it only makes the
                    // serving thread drop what this one sends.
                    self.session[i] = self.ports[i].session();
                    let active = self.ports[i].live();
                    self.set_view(i, active);
                }
            }
        }
        if !self.any_pending {
            return;
        }
        self.any_pending = false;
        for i in 0..self.ports.len() {
            if self.pending[i] {
                self.look_at(i);
                self.any_pending |= self.pending[i];
            }
        }
    }

    fn give_back(&mut self, i: usize) {
        // Before its kick eventfd can go with the runtime.
        self.park.unpark(i);
        if let Some(rt) = self.owned[i].take() {
            self.ports[i].return_runtime(rt);
            self.pending[i] = true;
            self.any_pending = true;
        }
    }

    /// Takes VF `i`'s runtime if the session is live, and updates the switch.
    /// Stays pending while a session-side user holds the runtime.
    fn look_at(&mut self, i: usize) {
        let port = &self.ports[i];
        let rt = match self.owned[i].take() {
            Some(rt) => rt,
            None => match port.take_runtime() {
                Some(rt) => rt,
                None => return,
            },
        };
        self.pending[i] = false;
        // Changes only with the runtime in hand (ours now): what the backlog
        // holds for an earlier session (a closed, reset or reopened VF) goes.
        let session = port.session();
        if session != self.session[i] {
            self.session[i] = session;
            for p in self.backlog[i].drain(..) {
                self.pool.free(p);
            }
        }
        let active = rt.active && !rt.failed;
        // Owned once a ring can carry frames (`Runtime::carries_frames`);
        // until then frames switched to it wait in its backlog.
        if rt.carries_frames() {
            self.owned[i] = Some(rt);
        } else {
            port.return_runtime(rt);
        }
        // The PF's other threads route by it: a change is a new generation for them.
        if self.peers.threads() > 1 && port.set_live(active) {
            port.bump();
        }
        if !self.active[i] && active {
            self.spoof_warned[i] = false;
        }
        self.set_view(i, active);
        if !active {
            // Closed, reset or failed: nothing queued for it may survive.
            for p in self.backlog[i].drain(..) {
                self.pool.free(p);
            }
        }
    }

    fn set_view(&mut self, i: usize, active: bool) {
        self.active[i] = active;
        let cfg = self.ports[i].config();
        self.switch.set_vf(
            i,
            VfView {
                mac: cfg.mac,
                vlan: cfg.vlan,
                active,
            },
        );
    }

    fn rx_uplink(&mut self, rx: &mut Vec<Pkt>) -> usize {
        let up = self.uplink.as_ref().expect("checked");
        while rx.len() < self.batch {
            let Some(mut pkt) = self.pool.alloc() else {
                break;
            };
            match up.recv(pkt.buf_mut()) {
                Ok(Some(n)) if n >= 14 => {
                    pkt.len = n;
                    rx.push(pkt);
                }
                Ok(Some(_)) => self.pool.free(pkt),
                Ok(None) => {
                    self.pool.free(pkt);
                    break;
                }
                Err(e) => {
                    tracing::warn!("PF {}: uplink read: {e}", self.devset.name());
                    self.pool.free(pkt);
                    break;
                }
            }
        }
        rx.len()
    }

    /// A malformed descriptor chain: this VF only goes to error.
    fn fault(&mut self, i: usize, f: virtio::Fault) {
        let port = &self.ports[i];
        tracing::warn!(
            "VF {}: {f}; VF in error state until the guest resets it or its frontend goes",
            port.id
        );
        AtomicCounters::add(&port.counters.bad_descriptors, 1);
        for p in self.backlog[i].drain(..) {
            self.pool.free(p);
        }
        // The devset lock comes before a runtime (a close waits for its VF's
        // runtime with the devset side held): hold none while taking it.
        for j in 0..self.ports.len() {
            self.give_back(j);
        }
        let port = &self.ports[i];
        // Error state, stopped I/O and the guest told, all at once: a guest reset
        // (recover) comes after, never in between.
        let r = self.devset.mark_error_with(i, |vf| {
            let rt = &mut *vf.dev.port.runtime();
            rt.failed = true;
            for vr in &rt.vrings {
                vr.signal_error();
            }
        });
        if let Err(e) = r {
            tracing::warn!("VF {}: {e}", port.id);
        }
        port.bump();
    }

    /// Before a sleep: the queues the thread would wake for ask their drivers
    /// for kicks again (polled queues do not get them: `virtio::want_kicks`).
    /// False when one of them has work already: the thread polls on.
    fn ask_for_kicks(&mut self) -> bool {
        for (i, rt) in self.owned.iter_mut().enumerate() {
            let Some(rt) = rt else { continue };
            if !self.park.is_parked(i) && virtio::want_kicks(rt, TXQ) {
                return false;
            }
            if !self.backlog[i].is_empty() && virtio::want_kicks(rt, RXQ) {
                return false;
            }
        }
        true
    }

    /// Sleeps until a kick, an uplink frame, a wake-up, or the safety timeout.
    fn sleep(&mut self) {
        if !self.ask_for_kicks() {
            return;
        }
        if !self.peers.sleeping(
            &mut self.pool,
            &mut self.backlog,
            (&self.active, &self.session),
            &self.ports,
        ) {
            return;
        }
        let mut kicks = Vec::new();
        for (i, rt) in self.owned.iter().enumerate() {
            let Some(rt) = rt else { continue };
            // A parked queue's kick is in the parking's epoll set (below).
            if let Some(k) = rt.vrings[TXQ]
                .kick
                .as_ref()
                .filter(|_| !self.park.is_parked(i))
            {
                kicks.push(k.clone());
            }
            // Receive kicks matter only with frames waiting for buffers.
            if !self.backlog[i].is_empty() {
                if let Some(k) = &rt.vrings[RXQ].kick {
                    kicks.push(k.clone());
                }
            }
        }
        let fds: Vec<BorrowedFd<'_>> = kicks
            .iter()
            .map(|k| eventfd_fd(k))
            .chain([eventfd_fd(&self.wake), self.park.fd()])
            .chain(
                self.uplink
                    .as_ref()
                    .filter(|_| self.peers.me() == 0)
                    .map(|u| u.as_fd()),
            )
            .collect();
        let ready = wait_readable(&fds, self.sleep_cap);
        self.peers.awake();
        // Drain the eventfds that fired, and only those: with a burst of sandboxes
        // starting, a read of every kick would be a syscall per VF per wake-up. One that
        // fires after the poll stays readable and ends the next sleep at once. The
        // uplink fd is read by the loop.
        for (k, _) in kicks.iter().zip(&ready).filter(|(_, r)| **r) {
            let _ = k.read();
        }
        let (wake, parked) = (ready[kicks.len()], ready[kicks.len() + 1]);
        // Parked queues stay parked unless kicked.
        if parked {
            self.park.unpark_kicked();
        }
        if wake {
            let _ = self.wake.read();
        }
    }
}

impl Drop for Dataplane {
    /// A stopped (or panicking) dataplane hands every runtime back, so that
    /// sessions and the devset never wait for it.
    fn drop(&mut self) {
        for i in 0..self.ports.len() {
            if let Some(rt) = self.owned[i].take() {
                self.ports[i].return_runtime(rt);
            }
        }
    }
}

/// The cap of one thread's pool, for a PF of `vfs` VFs served by `threads`
/// threads. A thread's buffers can wait in any VF's backlog (its own VFs',
/// and another thread's after a cross-thread send) and in its channels to the
/// other threads; the pool can hold all of those at once and still have its
/// working set, so guests that never read their receive queue hold at most
/// their backlogs and never starve another VF's transmit queue of buffers
/// (tenant isolation). It preallocates the working set and a quarter of the
/// backlogs, and grows to the cap only as backlogs actually fill.
fn pool_cap(vfs: usize, threads: usize) -> usize {
    WORKING_SET + vfs * BACKLOG_MAX + (threads - 1) * shard::CROSS_RING
}

const _: () = assert!(BUF_SIZE >= 1518 + 4);
