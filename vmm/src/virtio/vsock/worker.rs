//! The device's worker: one thread per running device, asleep in epoll on
//! the three queues' ioeventfds, the listening socket, every connection's
//! socket and the stop eventfd (the thread model of virtio-net,
//! `virtio/worker.rs`). Each wake-up handles the fds that fired, then does
//! one round ([`Engine::step`]): the guest's TX packets (at most
//! [`TX_BURST`] per round, so a guest that keeps its TX queue full cannot
//! starve the host side), the deadlines, then whatever the guest is owed,
//! into its RX buffers, and the event queue.
//!
//! Chains are resolved, walked and split through `chain.rs` (`virtq`), each
//! burst returned with one used-index store and at most one interrupt.

use std::io::ErrorKind;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_VRING;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::epoll::{Epoll, EpollEvent};
use vmm_sys_util::eventfd::EventFd;

use super::conn::Key;
use super::muxer::Muxer;
use super::packet::{self, PacketError, EVENT_LEN, EVENT_TRANSPORT_RESET, HDR_LEN, MAX_PAYLOAD};
use super::{
    note, Limits, VsockCounters, TOKEN_CONN, TOKEN_EVENT, TOKEN_LISTENER, TOKEN_RX, TOKEN_TX,
};
use crate::virtio::chain::{self, PrepareWrite, Split};
use crate::virtio::worker::STOP_TOKEN;
use crate::virtio::Interrupt;

/// TX chains handled per round.
pub const TX_BURST: usize = 256;

/// What a worker is made of (moved onto its thread).
pub struct Parts {
    pub cid: u64,
    pub path: PathBuf,
    pub listener: Arc<UnixListener>,
    pub mem: GuestMemoryMmap,
    pub prepare: Arc<PrepareWrite>,
    pub features: u64,
    pub rx: Queue,
    pub tx: Queue,
    pub event: Queue,
    pub interrupt: Arc<Interrupt>,
    pub counters: Arc<VsockCounters>,
    pub limits: Limits,
    /// Send VIRTIO_VSOCK_EVENT_TRANSPORT_RESET first (a re-activation).
    pub reset_event: bool,
}

pub struct Engine {
    pub(super) mux: Muxer,
    name: String,
    mem: GuestMemoryMmap,
    prepare: Arc<PrepareWrite>,
    features: u64,
    rx: Queue,
    tx: Queue,
    event: Queue,
    interrupt: Arc<Interrupt>,
    counters: Arc<VsockCounters>,
    reset_event: bool,
    /// An RX head taken when the guest seemed owed a packet that then did
    /// not materialise (a connection's socket had nothing after all): used
    /// for the next packet instead of being returned empty.
    spare_rx: Option<u16>,
    /// More TX chains were available after the last round's burst.
    tx_more: bool,
    split: Split,
    payload: Vec<u8>,
    scratch: Vec<u8>,
    used: Vec<(u16, u32)>,
}

impl Engine {
    /// `epoll` holds the queue eventfds and the listener (the worker's
    /// tokens); connections are added to it as they come.
    pub fn new(p: Parts, epoll: Epoll) -> Self {
        let name = format!("vsock {}", p.path.display());
        Engine {
            mux: Muxer::new(
                p.cid,
                p.path,
                p.listener,
                epoll,
                p.counters.clone(),
                p.limits,
            ),
            name,
            mem: p.mem,
            prepare: p.prepare,
            features: p.features,
            rx: p.rx,
            tx: p.tx,
            event: p.event,
            interrupt: p.interrupt,
            counters: p.counters,
            reset_event: p.reset_event,
            spare_rx: None,
            tx_more: false,
            split: Split::default(),
            payload: Vec::with_capacity(MAX_PAYLOAD),
            scratch: vec![0; MAX_PAYLOAD],
            used: Vec::new(),
        }
    }

    /// The thread body: until the stop eventfd fires.
    pub fn run(mut self, evts: Vec<EventFd>) {
        let mut events = vec![EpollEvent::default(); 64];
        // Buffers and packets may have been posted before the worker started.
        self.step(Instant::now());
        loop {
            let timeout = if self.tx_more {
                0
            } else {
                match self.mux.next_deadline() {
                    Some(d) => {
                        let left = d.saturating_duration_since(Instant::now());
                        i32::try_from(left.as_millis() + 1).unwrap_or(i32::MAX)
                    }
                    None => -1,
                }
            };
            if !self.turn(timeout, &mut events, &evts) {
                return;
            }
        }
    }

    /// One wake-up: waits up to `timeout_ms` (-1: no limit) for fds, handles
    /// them, then does a round. Returns false when told to stop (or epoll failed).
    pub fn turn(&mut self, timeout_ms: i32, events: &mut [EpollEvent], evts: &[EventFd]) -> bool {
        let n = match self.mux.epoll.wait(timeout_ms, events) {
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => 0,
            Err(e) => {
                tracing::error!("{}: epoll wait: {e}", self.name);
                return false;
            }
        };
        let now = Instant::now();
        for ev in &events[..n] {
            match ev.data() {
                STOP_TOKEN => return false,
                t @ (TOKEN_RX | TOKEN_TX | TOKEN_EVENT) => {
                    if let Some(e) = evts.get(t as usize) {
                        let _ = e.read();
                    }
                }
                TOKEN_LISTENER => self.mux.accept(now),
                t if t >= TOKEN_CONN => {
                    self.mux
                        .conn_event((t - TOKEN_CONN) as usize, ev.event_set(), now)
                }
                _ => {}
            }
        }
        self.step(now);
        true
    }

    /// One round: guest TX, deadlines, packets owed to the guest, events.
    pub fn step(&mut self, now: Instant) {
        self.tx_more = self.process_tx(now);
        self.mux.expire(now);
        self.process_rx(now);
        self.process_event();
    }

    /// Handles up to [`TX_BURST`] TX chains; returns whether more wait.
    fn process_tx(&mut self, now: Instant) -> bool {
        let Engine {
            mux,
            name,
            mem,
            prepare,
            features,
            tx,
            interrupt,
            counters,
            split,
            payload,
            used,
            ..
        } = self;
        if !tx.ready() {
            return false;
        }
        let gm = chain::Xlat::new(mem);
        let what = format_args!("{name}: TX queue");
        let Some(view) = chain::view(&gm, tx, *features, &what) else {
            return false;
        };
        let heads = match view.avail_heads(&mut *tx, TX_BURST) {
            Ok(h) => h,
            Err(e) => {
                note(&counters.bad_chains, format_args!("{name}: TX queue: {e}"));
                return false;
            }
        };
        used.clear();
        for head in heads {
            let r = view
                .split_into(head, split)
                .map_err(PacketError::from)
                .and_then(|()| packet::read_tx(view.mem(), &**prepare, split, payload));
            match r {
                Ok(h) => {
                    counters.tx_packets.fetch_add(1, Ordering::Relaxed);
                    mux.guest_packet(&h, payload, now);
                }
                Err(e) => note(
                    &counters.bad_chains,
                    format_args!("{name}: TX chain {head} dropped: {e}"),
                ),
            }
            // A head outside the ring has no used slot to return.
            if head < view.size() {
                used.push((head, 0));
            }
        }
        match view.complete_used(&mut *tx, used) {
            Ok(true) => interrupt.signal(VIRTIO_MMIO_INT_VRING),
            Ok(false) => {}
            Err(e) => tracing::warn!("{name}: TX used ring: {e}"),
        }
        view.pending(tx.next_avail()).is_ok_and(|n| n > 0)
    }

    /// Fills RX buffers with what the guest is owed, one packet per buffer.
    fn process_rx(&mut self, now: Instant) {
        let Engine {
            mux,
            name,
            mem,
            prepare,
            features,
            rx,
            interrupt,
            counters,
            spare_rx,
            split,
            scratch,
            used,
            ..
        } = self;
        if !mux.has_rx_work() || !rx.ready() {
            return;
        }
        let gm = chain::Xlat::new(mem);
        let what = format_args!("{name}: RX queue");
        let Some(view) = chain::view(&gm, rx, *features, &what) else {
            return;
        };
        used.clear();
        while mux.has_rx_work() {
            let head = match spare_rx.take() {
                Some(h) => h,
                None => match view.avail_heads(&mut *rx, 1) {
                    Ok(mut h) => match h.next() {
                        Some(h) => h,
                        None => break, // no buffer: the guest kicks RX when it posts one
                    },
                    Err(e) => {
                        note(&counters.bad_chains, format_args!("{name}: RX queue: {e}"));
                        break;
                    }
                },
            };
            let capacity = view
                .split_into(head, split)
                .map_err(PacketError::from)
                .and_then(|()| packet::writable_capacity(view.mem(), split, "RX", HDR_LEN));
            let capacity = match capacity {
                Ok(c) => c,
                Err(e) => {
                    note(
                        &counters.bad_chains,
                        format_args!("{name}: RX chain {head} returned unused: {e}"),
                    );
                    if head < view.size() {
                        used.push((head, 0));
                    }
                    continue;
                }
            };
            let room = usize::try_from(capacity - HDR_LEN as u64)
                .unwrap_or(usize::MAX)
                .min(MAX_PAYLOAD);
            let Some((h, n)) = mux.next_packet(&mut scratch[..room], now) else {
                *spare_rx = Some(head);
                break;
            };
            match packet::write_rx(view.mem(), &**prepare, split, &h, &scratch[..n]) {
                Ok(len) => {
                    counters.rx_packets.fetch_add(1, Ordering::Relaxed);
                    if head < view.size() {
                        used.push((head, len));
                    }
                }
                Err(e) => {
                    note(
                        &counters.bad_chains,
                        format_args!("{name}: RX chain {head}: {e}"),
                    );
                    if head < view.size() {
                        used.push((head, 0));
                    }
                    if n > 0 {
                        mux.reset(Key {
                            local: h.src_port,
                            peer: h.dst_port,
                        });
                    }
                }
            }
        }
        match view.complete_used(&mut *rx, used) {
            Ok(true) => interrupt.signal(VIRTIO_MMIO_INT_VRING),
            Ok(false) => {}
            Err(e) => tracing::warn!("{name}: RX used ring: {e}"),
        }
    }

    /// Delivers a pending TRANSPORT_RESET into the event queue.
    fn process_event(&mut self) {
        let Engine {
            name,
            mem,
            prepare,
            features,
            event,
            interrupt,
            counters,
            reset_event,
            split,
            used,
            ..
        } = self;
        if !*reset_event || !event.ready() {
            return;
        }
        let gm = chain::Xlat::new(mem);
        let what = format_args!("{name}: event queue");
        let Some(view) = chain::view(&gm, event, *features, &what) else {
            return;
        };
        used.clear();
        while *reset_event {
            let head = match view.avail_heads(&mut *event, 1) {
                Ok(mut h) => match h.next() {
                    Some(h) => h,
                    None => break,
                },
                Err(e) => {
                    note(
                        &counters.bad_chains,
                        format_args!("{name}: event queue: {e}"),
                    );
                    break;
                }
            };
            let id = EVENT_TRANSPORT_RESET.to_le_bytes();
            let r = view
                .split_into(head, split)
                .map_err(PacketError::from)
                .and_then(|()| packet::writable_capacity(view.mem(), split, "event", EVENT_LEN))
                .and_then(|_| {
                    virtq::write_bufs(view.mem(), &**prepare, &split.writable, 0, &[&id])
                        .map_err(PacketError::from)
                });
            let len = match r {
                Ok(()) => {
                    *reset_event = false;
                    counters.events.fetch_add(1, Ordering::Relaxed);
                    EVENT_LEN as u32
                }
                Err(e) => {
                    note(
                        &counters.bad_chains,
                        format_args!("{name}: event chain {head} returned unused: {e}"),
                    );
                    0
                }
            };
            if head < view.size() {
                used.push((head, len));
            }
        }
        match view.complete_used(&mut *event, used) {
            Ok(true) => interrupt.signal(VIRTIO_MMIO_INT_VRING),
            Ok(false) => {}
            Err(e) => tracing::warn!("{name}: event used ring: {e}"),
        }
    }
}
