//! One VF as seen by its vhost-user session and by the dataplane: its config
//! (MAC, VLAN), counters, and runtime (memory table, two vrings, eventfds).
//! The devset's lifecycle hooks (`VfDevice`) act on it.
//!
//! The runtime (rings, memory table) is owned by whoever uses it: the
//! dataplane thread takes it out of the port while the VF is live and runs on
//! it without locks; a session-side user ([`Port::runtime`]) raises the
//! port's `want` count and wakes the dataplane, which hands the runtime back
//! at its next round start, between two batches, and takes it again once no
//! one wants it. So a session change (new memory table, stopped ring, close,
//! reset) is applied while the dataplane provably holds nothing of the old
//! state, and the hot path pays one relaxed load per live port per round.

use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError};

use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::EventFd;

use crate::devset::VfDevice;
use crate::memory::VfMemory;
use nic_api::Counters;

/// Queue indexes of virtio-net: 0 = receive (NIC → guest), 1 = transmit.
pub const RXQ: usize = 0;
pub const TXQ: usize = 1;
pub const MAX_QUEUE_SIZE: u16 = 1024;

#[derive(Debug, Default)]
pub struct AtomicCounters {
    pub rx_packets: AtomicU64,
    pub rx_bytes: AtomicU64,
    pub rx_drops: AtomicU64,
    pub tx_packets: AtomicU64,
    pub tx_bytes: AtomicU64,
    pub tx_drops: AtomicU64,
    pub bad_descriptors: AtomicU64,
    pub bad_requests: AtomicU64,
}

impl AtomicCounters {
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
    /// A burst's counts: one atomic add per non-zero count.
    pub fn add_burst<const N: usize>(counts: [(&AtomicU64, u64); N]) {
        for (c, n) in counts {
            if n > 0 {
                Self::add(c, n);
            }
        }
    }
    /// Counts one case of frontend misbehaviour and logs it: at warn on its
    /// 1st, 2nd, 4th, 8th, ... occurrence, at debug otherwise, so that a
    /// flood cannot flood the log (the VMM's hostile-guest counters do the same).
    pub fn note(c: &AtomicU64, what: std::fmt::Arguments<'_>) {
        let n = c.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            tracing::warn!("{what} (occurrence {n})");
        } else {
            tracing::debug!("{what}");
        }
    }
    pub fn snapshot(&self) -> Counters {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Counters {
            rx_packets: l(&self.rx_packets),
            rx_bytes: l(&self.rx_bytes),
            rx_drops: l(&self.rx_drops),
            tx_packets: l(&self.tx_packets),
            tx_bytes: l(&self.tx_bytes),
            tx_drops: l(&self.tx_drops),
            bad_descriptors: l(&self.bad_descriptors),
            bad_requests: l(&self.bad_requests),
        }
    }
    fn clear(&self) {
        for c in [
            &self.rx_packets,
            &self.rx_bytes,
            &self.rx_drops,
            &self.tx_packets,
            &self.tx_bytes,
            &self.tx_drops,
            &self.bad_descriptors,
            &self.bad_requests,
        ] {
            c.store(0, Ordering::Relaxed);
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortConfig {
    pub mac: [u8; 6],
    pub vlan: Option<u16>,
}

#[derive(Debug)]
pub struct Vring {
    pub queue: Queue,
    pub kick: Option<Arc<EventFd>>,
    pub call: Option<EventFd>,
    /// VHOST_USER_SET_VRING_ERR: signalled when the VF goes to error, so that the VMM
    /// tells the guest (DEVICE_NEEDS_RESET and a config interrupt).
    pub err: Option<EventFd>,
    pub enabled: bool,
    /// Whether the ring last told the driver to kick (VRING_USED_F_NO_NOTIFY
    /// clear, as a fresh ring starts): the dataplane clears it while it polls
    /// the ring and sets it again before it relies on kicks (`dataplane::virtio`).
    pub kicks_wanted: bool,
}

impl Vring {
    fn new() -> Self {
        Vring {
            queue: Queue::new(MAX_QUEUE_SIZE).expect("valid max size"),
            kick: None,
            call: None,
            err: None,
            enabled: false,
            kicks_wanted: true,
        }
    }
    /// The dataplane may use the ring: addresses set, kick fd received, enabled.
    pub fn usable(&self) -> bool {
        self.enabled && self.kick.is_some() && self.queue.ready()
    }
    pub fn signal(&self) {
        if let Some(call) = &self.call {
            // A full eventfd counter still wakes the guest: ignoring the error is right.
            let _ = call.write(1);
        }
    }
    /// Tells the frontend this ring failed (its err eventfd, if it gave one).
    pub fn signal_error(&self) {
        if let Some(err) = &self.err {
            let _ = err.write(1);
        }
    }
}

/// A signal-only vring (an SG function's `dedicated` channel, vring 2 + k):
/// a doorbell and an interrupt eventfd, no virtqueue.
#[derive(Debug, Default)]
pub struct ChanVring {
    pub kick: Option<Arc<EventFd>>,
    pub call: Option<EventFd>,
    pub enabled: bool,
}

impl ChanVring {
    pub fn signal(&self) {
        if let Some(call) = &self.call {
            let _ = call.write(1);
        }
    }
}

/// What a session set up; dropped whole at close and reset.
#[derive(Debug)]
pub struct Runtime {
    pub active: bool,
    pub failed: bool,
    /// The virtio features the frontend acked (SET_FEATURES).
    pub features: u64,
    pub hdr_len: usize,
    /// Shared: an SG function's jobs keep the mapping alive past a close.
    pub mem: Option<Arc<VfMemory>>,
    pub vrings: [Vring; 2],
    /// Signal-only vrings past the two queues (SG functions; empty for a VF).
    pub channels: Vec<ChanVring>,
}

impl Runtime {
    /// Whether the dataplane has frames to move here: the session is live and
    /// a ring is usable. Until then the runtime stays with the session side,
    /// so that the frontend's set-up messages do not each take it back from
    /// the dataplane (a wake-up and a wait apiece).
    pub fn carries_frames(&self) -> bool {
        self.active && !self.failed && self.vrings.iter().any(Vring::usable)
    }

    /// A guest's device reset (VHOST_USER_RESET_DEVICE, a VF-level reset): rings, their
    /// eventfds and the error state go; the memory table stays (the frontend may send a
    /// new one).
    pub fn reset_device(&mut self) {
        self.vrings = [Vring::new(), Vring::new()];
        self.channels = Vec::new();
        self.failed = false;
        self.hdr_len = 12;
    }

    fn new() -> Self {
        Runtime {
            active: false,
            failed: false,
            features: 0,
            hdr_len: 12,
            mem: None,
            vrings: [Vring::new(), Vring::new()],
            channels: Vec::new(),
        }
    }

    /// Channel vring `k`, created on first use (enabled from the start
    /// unless the frontend negotiated VHOST_USER_F_PROTOCOL_FEATURES).
    pub fn channel_mut(&mut self, k: usize) -> &mut ChanVring {
        let enabled = self.features
            & vhost::vhost_user::message::VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
            == 0;
        while self.channels.len() <= k {
            self.channels.push(ChanVring {
                enabled,
                ..Default::default()
            });
        }
        &mut self.channels[k]
    }
}

#[derive(Debug)]
pub struct Port {
    pub pf: String,
    pub index: usize,
    pub id: String,
    pub socket: PathBuf,
    pub default_mac: [u8; 6],
    pub counters: AtomicCounters,
    /// Bytes the current session's memory table maps (`VfInfo::mapped_bytes`):
    /// set with the table, 0 from every new session on (`new_session`).
    mapped_bytes: AtomicU64,
    config: Mutex<PortConfig>,
    /// `None` while the dataplane holds the runtime.
    /// Boxed: the dataplane takes and returns it by pointer (a move per VF
    /// per round of the struct itself showed as memcpy in the profile).
    runtime: Mutex<Option<Box<Runtime>>>,
    /// Signalled when the dataplane hands the runtime back.
    returned: Condvar,
    /// Session-side users holding or waiting for the runtime.
    want: AtomicU32,
    /// The dataplane came for the runtime while a session-side user had it (or
    /// wanted it): the last user to let go wakes the dataplane. Without it a
    /// release wakes nobody, so the set-up messages of a VF whose rings carry no
    /// frames yet (the runtime stays on the session side) cost no wake-up apiece.
    refused: AtomicBool,
    /// Bumped on every open, close, reset and config change: the dataplane
    /// looks at the port again.
    generation: AtomicU64,
    /// Bumped on every open, close and reset, with the runtime in hand: the
    /// dataplane drops frames queued for an earlier session (`dataplane`).
    session: AtomicU64,
    /// Wakes the dataplane thread that serves the VF (one of the PF's), and
    /// the PF's change count, raised with every wake-up: a dataplane round
    /// looks at the ports' `want` and generation only when it moved.
    wake: Mutex<(Arc<EventFd>, Arc<AtomicU64>)>,
    /// The serving dataplane thread runs the VF (for the PF's other threads,
    /// which switch frames to it).
    live: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Port {
    pub fn new(
        pf: &str,
        index: usize,
        id: String,
        socket: PathBuf,
        mac: [u8; 6],
        wake: Arc<EventFd>,
    ) -> Self {
        Port {
            pf: pf.into(),
            index,
            id,
            socket,
            default_mac: mac,
            counters: AtomicCounters::default(),
            mapped_bytes: AtomicU64::new(0),
            config: Mutex::new(PortConfig { mac, vlan: None }),
            runtime: Mutex::new(Some(Box::new(Runtime::new()))),
            returned: Condvar::new(),
            want: AtomicU32::new(0),
            refused: AtomicBool::new(false),
            generation: AtomicU64::new(1),
            session: AtomicU64::new(1),
            wake: Mutex::new((wake, Arc::default())),
            live: AtomicBool::new(false),
        }
    }
    pub fn config(&self) -> PortConfig {
        *lock(&self.config)
    }
    pub fn set_config(&self, cfg: PortConfig) {
        *lock(&self.config) = cfg;
        self.bump();
    }
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }
    /// The VF's session: moves at every open, close and reset.
    pub fn session(&self) -> u64 {
        self.session.load(Ordering::Acquire)
    }
    fn new_session(&self) {
        self.session.fetch_add(1, Ordering::AcqRel);
        self.mapped_bytes.store(0, Ordering::Relaxed);
    }
    /// Installs a session's memory table (SET_MEM_TABLE), counted in `mapped_bytes`.
    pub fn set_memory(&self, mem: VfMemory) {
        let bytes = mem.mapped_bytes();
        self.runtime().mem = Some(Arc::new(mem));
        self.mapped_bytes.store(bytes, Ordering::Relaxed);
    }
    pub fn mapped_bytes(&self) -> u64 {
        self.mapped_bytes.load(Ordering::Relaxed)
    }
    /// The runtime, for a session-side user: waits (a round of the dataplane
    /// at most) until the dataplane handed it back.
    pub fn runtime(&self) -> RuntimeGuard<'_> {
        // Raised before locking: a dataplane that takes the runtime after this
        // sees it and hands it back at its next round.
        self.want.fetch_add(1, Ordering::SeqCst);
        let mut g = lock(&self.runtime);
        if g.is_none() {
            self.notify();
            while g.is_none() {
                g = self.returned.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        }
        let carried = g.as_ref().is_some_and(|rt| rt.carries_frames());
        RuntimeGuard {
            port: self,
            guard: Some(g),
            carried,
        }
    }
    /// Dataplane: a session-side user waits for the runtime it holds.
    pub fn wanted(&self) -> bool {
        self.want.load(Ordering::Relaxed) != 0
    }
    /// Dataplane: takes the runtime if no session-side user holds or wants it
    /// (never blocks).
    pub fn take_runtime(&self) -> Option<Box<Runtime>> {
        // Before `want` is read (both SeqCst, as the user's side in
        // `RuntimeGuard::drop`): either this sees the last user gone, or that
        // user sees the refusal and wakes us.
        self.refused.store(true, Ordering::SeqCst);
        if self.want.load(Ordering::SeqCst) != 0 {
            return None;
        }
        let mut g = match self.runtime.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        // Checked again under the lock: a user that raised `want` before we
        // locked waits for us; one that raises it after finds `None` and waits.
        if self.want.load(Ordering::SeqCst) != 0 {
            return None;
        }
        self.refused.store(false, Ordering::Relaxed);
        g.take()
    }
    /// Dataplane: hands the runtime back and wakes the users waiting for it,
    /// if any (a condition-variable signal is a futex syscall even with no waiter,
    /// and most hand-backs are of a runtime nobody asked for: `look_at`).
    pub fn return_runtime(&self, rt: Box<Runtime>) {
        let mut g = lock(&self.runtime);
        *g = Some(rt);
        // Under the lock: a user waiting in `runtime` raised `want` before it took
        // the lock, which it held before us; one that raises it later finds the
        // runtime back when it locks.
        let waiting = self.want.load(Ordering::SeqCst) != 0;
        drop(g);
        if waiting {
            self.returned.notify_all();
        }
    }
    /// Tells the dataplane something changed (rings, state, config).
    pub fn bump(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.notify();
    }
    pub fn notify(&self) {
        let w = lock(&self.wake);
        // Before the eventfd write; after the change it announces (`want`,
        // generation): a round that sees the new count sees the change.
        w.1.fetch_add(1, Ordering::Release);
        let _ = w.0.write(1);
    }
    /// The dataplane thread that serves this VF and the PF's change count
    /// (set before the threads run).
    pub fn set_wake(&self, wake: Arc<EventFd>, changes: Arc<AtomicU64>) {
        *lock(&self.wake) = (wake, changes);
    }
    pub fn live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }
    /// The serving dataplane thread publishes whether it runs the VF;
    /// returns whether that changed.
    pub fn set_live(&self, live: bool) -> bool {
        self.live.swap(live, Ordering::AcqRel) != live
    }
}

/// A session-side user's hold on a port's runtime (see [`Port::runtime`]).
#[derive(Debug)]
pub struct RuntimeGuard<'a> {
    port: &'a Port,
    guard: Option<MutexGuard<'a, Option<Box<Runtime>>>>,
    /// `carries_frames` when the hold began.
    carried: bool,
}

impl Deref for RuntimeGuard<'_> {
    type Target = Runtime;
    fn deref(&self) -> &Runtime {
        let g = self.guard.as_ref().expect("held until drop");
        g.as_ref().expect("present while held")
    }
}

impl DerefMut for RuntimeGuard<'_> {
    fn deref_mut(&mut self) -> &mut Runtime {
        let g = self.guard.as_mut().expect("held until drop");
        g.as_mut().expect("present while held")
    }
}

impl Drop for RuntimeGuard<'_> {
    fn drop(&mut self) {
        let carries = self
            .guard
            .as_ref()
            .and_then(|g| g.as_ref())
            .is_some_and(|rt| rt.carries_frames());
        drop(self.guard.take());
        let last = self.port.want.fetch_sub(1, Ordering::SeqCst) == 1;
        if carries && !self.carried {
            // It became the dataplane's business in this hold: a new
            // generation makes the dataplane look (whoever holds it next).
            self.port.bump();
        } else if last && (carries || self.port.refused.swap(false, Ordering::SeqCst)) {
            // The last user gone: the dataplane takes back a runtime that
            // carries frames, or looks at one it found held.
            self.port.notify();
        }
    }
}

/// The devset payload of a VF.
#[derive(Debug)]
pub struct VfHw {
    pub port: Arc<Port>,
}

impl VfDevice for VfHw {
    fn on_open(&mut self) {
        // Fresh rings and no memory: nothing of a previous session survives.
        let mut rt = self.port.runtime();
        *rt = Runtime::new();
        rt.active = true;
        self.port.new_session();
        drop(rt);
        self.port.bump();
    }
    fn on_close(&mut self) {
        let mut rt = self.port.runtime();
        let failed = rt.failed;
        *rt = Runtime::new(); // unmaps the memory table, closes the eventfds
        rt.failed = failed;
        self.port.new_session();
        drop(rt);
        self.port.bump();
    }
    fn reset(&mut self) {
        // Rings, memory table and eventfds were dropped at the close; the
        // error state, counters and queued frames of the tenant go here.
        let mut rt = self.port.runtime();
        *rt = Runtime::new();
        self.port.counters.clear();
        self.port.new_session();
        drop(rt);
        self.port.bump();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    fn port() -> (Port, Arc<EventFd>) {
        let wake = Arc::new(EventFd::new(EFD_NONBLOCK).unwrap());
        let p = Port::new(
            "pf0",
            0,
            "0000:b1:00.0".into(),
            "vf.sock".into(),
            [2, 0, 0, 0, 0, 1],
            wake.clone(),
        );
        (p, wake)
    }

    /// Wake-ups of the dataplane since the last call.
    fn wakes(w: &EventFd) -> u64 {
        w.read().unwrap_or(0)
    }

    /// A session-side hold of a runtime that carries no frames (a VF's set-up
    /// messages) wakes the dataplane only if the dataplane came for it meanwhile.
    #[test]
    fn a_release_wakes_the_dataplane_only_when_it_has_business() {
        let (p, w) = port();
        for _ in 0..3 {
            let mut rt = p.runtime();
            rt.active = true;
        }
        assert_eq!(wakes(&w), 0, "set-up holds woke the dataplane");

        // The dataplane comes while a user holds it: refused, then woken at the release.
        let held = p.runtime();
        assert!(p.take_runtime().is_none());
        drop(held);
        assert_eq!(wakes(&w), 1, "the refused dataplane was not woken");
        let rt = p.take_runtime().expect("free again");
        p.return_runtime(rt);
        // Taken once: the refusal is forgotten.
        drop(p.runtime());
        assert_eq!(wakes(&w), 0);
    }

    /// The dataplane signals a hand-back only when a user waits: one that waits
    /// is woken, in every interleaving of its `want` and the hand-back.
    #[test]
    fn a_user_waiting_for_the_runtime_gets_it_back() {
        let (p, _w) = port();
        let p = Arc::new(p);
        for round in 0..200 {
            let rt = p.take_runtime().expect("no user holds it");
            let (tx, rx) = std::sync::mpsc::channel();
            let user = {
                let p = p.clone();
                std::thread::spawn(move || {
                    let mut rt = p.runtime();
                    rt.active = true;
                    drop(rt);
                    tx.send(()).unwrap();
                })
            };
            // Sometimes before the user asked, sometimes after it waits.
            if round % 2 == 1 {
                while !p.wanted() {
                    std::thread::yield_now();
                }
            }
            p.return_runtime(rt);
            rx.recv_timeout(std::time::Duration::from_secs(10))
                .unwrap_or_else(|_| panic!("round {round}: the waiting user was not woken"));
            user.join().unwrap();
        }
    }

    /// A runtime that carries frames goes back to the dataplane: the release
    /// that made it carry them is a new generation, a later release a wake-up.
    #[test]
    fn a_runtime_that_carries_frames_is_handed_back() {
        let (p, w) = port();
        let g0 = p.generation();
        {
            let mut rt = p.runtime();
            rt.active = true;
            let vr = &mut rt.vrings[0];
            vr.queue.set_ready(true);
            vr.enabled = true;
            vr.kick = Some(Arc::new(EventFd::new(EFD_NONBLOCK).unwrap()));
            assert!(rt.carries_frames());
        }
        assert_eq!((p.generation(), wakes(&w)), (g0 + 1, 1));
        drop(p.runtime());
        assert_eq!((p.generation(), wakes(&w)), (g0 + 1, 1));
    }
}
