//! The dataplane of one PF, in the style of ixy: one thread, one mempool, and
//! a loop that reads every port in batches, switches each frame, and writes
//! it out. When a whole round finds nothing to do for `SPIN_ROUNDS` rounds it
//! sleeps in poll(2) on the queues' kick eventfds, the uplink fd and a wake
//! eventfd, so idle VFs cost no CPU. Interrupts go to the guest through the
//! call eventfd (see `virtio`).

pub mod mempool;
pub mod switch;
pub mod uplink;
pub mod virtio;

use std::collections::VecDeque;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

use crate::devset::Devset;
use crate::poll::{eventfd_fd, wait_readable};
use crate::port::{AtomicCounters, Port, VfHw, RXQ, TXQ};
use mempool::{Mempool, Pkt, BUF_SIZE};
use switch::{PortId, Switch, VfView};
use uplink::Uplink;

pub const DEFAULT_BATCH: usize = 32;
/// Frames queued for one VF while its guest posts no receive buffers.
const BACKLOG_MAX: usize = 256;
const SPIN_ROUNDS: u32 = 1000;
/// Upper bound of a sleep: a safety net, not the wake-up mechanism.
const SLEEP: std::time::Duration = std::time::Duration::from_secs(1);

pub struct Dataplane {
    devset: Arc<Devset<VfHw>>,
    ports: Vec<Arc<Port>>,
    uplink: Option<Uplink>,
    wake: Arc<EventFd>,
    batch: usize,
    pool: Mempool,
    switch: Switch,
    /// Frames waiting for each VF's receive queue, with the VF generation
    /// they were switched in (a frame never outlives a reset of its VF).
    backlog: Vec<VecDeque<Pkt>>,
    seen_generation: Vec<u64>,
    /// ixy-style accounting: time spent in rounds that moved frames, and frames moved.
    busy_ns: u128,
    frames: u64,
}

impl Dataplane {
    pub fn new(
        devset: Arc<Devset<VfHw>>,
        ports: Vec<Arc<Port>>,
        uplink: Option<Uplink>,
        wake: Arc<EventFd>,
        batch: usize,
    ) -> Self {
        let n = ports.len();
        Dataplane {
            devset,
            uplink,
            wake,
            batch: batch.max(1),
            pool: Mempool::new(4096 + n * BACKLOG_MAX / 4),
            switch: Switch::new(n),
            backlog: (0..n).map(|_| VecDeque::new()).collect(),
            seen_generation: vec![0; n],
            busy_ns: 0,
            frames: 0,
            ports,
        }
    }

    pub fn run(mut self, stop: &AtomicBool) {
        let mut idle = 0u32;
        let mut rx = Vec::with_capacity(self.batch);
        let mut out = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let round = std::time::Instant::now();
            self.refresh_ports();
            let mut work = 0;
            // 1. Uplink → switch.
            if self.uplink.is_some() {
                work += self.rx_uplink(&mut rx);
                for pkt in rx.drain(..) {
                    self.forward(PortId::Uplink, pkt, &mut out);
                }
            }
            // 2. Each VF's transmit queue → switch.
            for i in 0..self.ports.len() {
                let port = self.ports[i].clone();
                let r = virtio::take_guest_tx(
                    &port,
                    &mut port.runtime(),
                    &mut self.pool,
                    self.batch,
                    &mut rx,
                );
                match r {
                    Ok(n) => work += n,
                    Err(f) => self.fault(i, f),
                }
                for pkt in rx.drain(..) {
                    self.forward(PortId::Vf(i), pkt, &mut out);
                }
            }
            // 3. Queued frames → each VF's receive queue.
            for i in 0..self.ports.len() {
                let port = self.ports[i].clone();
                let r = virtio::fill_guest_rx(
                    &port,
                    &mut port.runtime(),
                    &mut self.pool,
                    self.batch,
                    &mut self.backlog[i],
                );
                match r {
                    Ok(n) => work += n,
                    Err(f) => self.fault(i, f),
                }
            }
            if work > 0 {
                idle = 0;
                self.busy_ns += round.elapsed().as_nanos();
                self.frames += work as u64;
            } else {
                idle += 1;
                if idle >= SPIN_ROUNDS {
                    self.sleep();
                    idle = 0;
                }
            }
        }
        if self.frames > 0 {
            tracing::info!(
                "PF {}: {} frames moved, {} ns/frame in busy rounds",
                self.devset.name(),
                self.frames,
                self.busy_ns / self.frames as u128
            );
        }
    }

    /// Picks up config and lifecycle changes of the VFs.
    fn refresh_ports(&mut self) {
        for (i, port) in self.ports.iter().enumerate() {
            let g = port.generation();
            if g == self.seen_generation[i] {
                continue;
            }
            self.seen_generation[i] = g;
            let cfg = port.config();
            let active = {
                let rt = port.runtime();
                rt.active && !rt.failed
            };
            self.switch.set_vf(
                i,
                VfView {
                    mac: cfg.mac,
                    vlan: cfg.vlan,
                    active,
                },
            );
            if !active {
                // Closed, reset or failed: nothing queued for it may survive.
                for p in self.backlog[i].drain(..) {
                    self.pool.free(p);
                }
            }
        }
    }

    fn rx_uplink(&mut self, rx: &mut Vec<Pkt>) -> usize {
        let up = self.uplink.as_ref().expect("checked");
        while rx.len() < self.batch {
            let Some(mut pkt) = self.pool.alloc() else {
                break;
            };
            match up.recv(self.pool.buf_mut(&pkt)) {
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

    /// Switches one frame: to the uplink at once, to VFs through their backlog.
    fn forward(&mut self, from: PortId, mut pkt: Pkt, out: &mut Vec<PortId>) {
        let vlan = match from {
            PortId::Uplink => {
                let (vid, len) = switch::untag(self.pool.buf_mut(&pkt), pkt.len);
                pkt.len = len;
                vid
            }
            PortId::Vf(i) => self.switch.vf_vlan(i),
        };
        if pkt.len < 14 || !self.switch.route(from, vlan, self.pool.data(&pkt), out) {
            if let PortId::Vf(i) = from {
                AtomicCounters::add(&self.ports[i].counters.tx_drops, 1);
            }
            self.pool.free(pkt);
            return;
        }
        if out.is_empty() {
            self.pool.free(pkt);
            return;
        }
        // One buffer per destination: copies first, the original goes last.
        let mut pkts: Vec<Pkt> = (1..out.len())
            .filter_map(|_| self.pool.clone_pkt(&pkt))
            .collect();
        pkts.push(pkt);
        for (dest, mut p) in out.iter().rev().zip(pkts.into_iter().rev()) {
            match *dest {
                PortId::Uplink => {
                    if let Some(v) = vlan {
                        p.len = switch::tag(self.pool.buf_mut(&p), p.len, v);
                    }
                    let sent = self
                        .uplink
                        .as_ref()
                        .is_some_and(|u| u.send(self.pool.data(&p)));
                    if let (false, PortId::Vf(i)) = (sent || self.uplink.is_none(), from) {
                        AtomicCounters::add(&self.ports[i].counters.tx_drops, 1);
                    }
                    self.pool.free(p);
                }
                PortId::Vf(j) => {
                    if self.backlog[j].len() >= BACKLOG_MAX {
                        AtomicCounters::add(&self.ports[j].counters.rx_drops, 1);
                        self.pool.free(p);
                    } else {
                        self.backlog[j].push_back(p);
                    }
                }
            }
        }
    }

    /// A malformed descriptor chain: this VF only goes to error.
    fn fault(&mut self, i: usize, f: virtio::Fault) {
        let port = &self.ports[i];
        tracing::warn!(
            "VF {}: {f}; VF in error state until the guest or the devset resets it",
            port.id
        );
        AtomicCounters::add(&port.counters.bad_descriptors, 1);
        for p in self.backlog[i].drain(..) {
            self.pool.free(p);
        }
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

    /// Sleeps until a kick, an uplink frame, a wake-up, or the safety timeout.
    fn sleep(&mut self) {
        let mut kicks = Vec::new();
        for (i, port) in self.ports.iter().enumerate() {
            let rt = port.runtime();
            if !rt.active || rt.failed {
                continue;
            }
            if let Some(k) = &rt.vrings[TXQ].kick {
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
            .chain(std::iter::once(eventfd_fd(&self.wake)))
            .chain(self.uplink.as_ref().map(|u| u.as_fd()))
            .collect();
        wait_readable(&fds, SLEEP);
        // Drain the eventfds that fired (non-blocking); the uplink fd is read by the loop.
        for k in &kicks {
            let _ = k.read();
        }
        let _ = self.wake.read();
    }
}

const _: () = assert!(BUF_SIZE >= 1518 + 4);
