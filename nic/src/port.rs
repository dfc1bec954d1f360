//! One VF as seen by its vhost-user session and by the dataplane: its config
//! (MAC, VLAN), counters, and runtime (memory table, two vrings, eventfds).
//! The devset's lifecycle hooks (`VfDevice`) act on it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::EventFd;

use crate::control::Counters;
use crate::devset::VfDevice;
use crate::memory::VfMemory;

/// Queue indexes of virtio-net: 0 = receive (NIC → guest), 1 = transmit.
pub const RXQ: usize = 0;
pub const TXQ: usize = 1;
pub const MAX_QUEUE_SIZE: u16 = 1024;

#[derive(Default)]
pub struct AtomicCounters {
    pub rx_packets: AtomicU64,
    pub rx_bytes: AtomicU64,
    pub rx_drops: AtomicU64,
    pub tx_packets: AtomicU64,
    pub tx_bytes: AtomicU64,
    pub tx_drops: AtomicU64,
    pub bad_descriptors: AtomicU64,
}

impl AtomicCounters {
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
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

pub struct Vring {
    pub queue: Queue,
    pub kick: Option<Arc<EventFd>>,
    pub call: Option<EventFd>,
    /// VHOST_USER_SET_VRING_ERR: signalled when the VF goes to error, so that the VMM
    /// tells the guest (DEVICE_NEEDS_RESET and a config interrupt).
    pub err: Option<EventFd>,
    pub enabled: bool,
}

impl Vring {
    fn new() -> Self {
        Vring {
            queue: Queue::new(MAX_QUEUE_SIZE).expect("valid max size"),
            kick: None,
            call: None,
            err: None,
            enabled: false,
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

/// What a session set up; dropped whole at close and reset.
pub struct Runtime {
    pub active: bool,
    pub failed: bool,
    /// The virtio features the frontend acked (SET_FEATURES).
    pub features: u64,
    pub hdr_len: usize,
    /// Shared: an SG function's jobs keep the mapping alive past a close.
    pub mem: Option<Arc<VfMemory>>,
    pub vrings: [Vring; 2],
}

impl Runtime {
    /// A guest's device reset (VHOST_USER_RESET_DEVICE, a VF-level reset): rings, their
    /// eventfds and the error state go; the memory table stays (the frontend may send a
    /// new one).
    pub fn reset_device(&mut self) {
        self.vrings = [Vring::new(), Vring::new()];
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
        }
    }
}

pub struct Port {
    pub pf: String,
    pub index: usize,
    pub id: String,
    pub socket: PathBuf,
    pub default_mac: [u8; 6],
    pub counters: AtomicCounters,
    config: Mutex<PortConfig>,
    runtime: Mutex<Runtime>,
    /// Bumped on every open, close, reset and config change: the dataplane drops
    /// what it holds for an older generation (queued frames).
    generation: AtomicU64,
    /// Wakes the PF's dataplane thread.
    wake: Arc<EventFd>,
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
            config: Mutex::new(PortConfig { mac, vlan: None }),
            runtime: Mutex::new(Runtime::new()),
            generation: AtomicU64::new(1),
            wake,
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
    pub fn runtime(&self) -> MutexGuard<'_, Runtime> {
        lock(&self.runtime)
    }
    pub fn failed(&self) -> bool {
        self.runtime().failed
    }
    /// Tells the dataplane something changed (rings, state, config).
    pub fn bump(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.notify();
    }
    pub fn notify(&self) {
        let _ = self.wake.write(1);
    }
}

/// The devset payload of a VF.
pub struct VfHw {
    pub port: Arc<Port>,
}

impl VfDevice for VfHw {
    fn on_open(&mut self) {
        // Fresh rings and no memory: nothing of a previous session survives.
        let mut rt = self.port.runtime();
        *rt = Runtime::new();
        rt.active = true;
        drop(rt);
        self.port.bump();
    }
    fn on_close(&mut self) {
        let mut rt = self.port.runtime();
        let failed = rt.failed;
        *rt = Runtime::new(); // unmaps the memory table, closes the eventfds
        rt.failed = failed;
        drop(rt);
        self.port.bump();
    }
    fn reset(&mut self) {
        *self.port.runtime() = Runtime::new();
        self.port.counters.clear();
        self.port.bump();
    }
}
