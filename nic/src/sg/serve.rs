//! The SG thread of one PF: owns the `sgiov` device, turns the SGF
//! sessions' memory tables into device memory, serves the setup queue
//! (attach/detach), turns doorbells into `Device::kick`, completions into
//! `Device::poll`, and raises the interrupts `poll` returns. A session that
//! ends (also a SIGKILLed VMM) closes its slot; the next refresh detaches the
//! SGF, whose connections close while running jobs keep the mapping alive.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nic_api::{SgCounters, SgLat};
use sgiov::device::{Device, DeviceError};
use sgiov::layout::{ErrorCode, SetupCmd, SETUP_ATTACH, SETUP_DETACH, SETUP_MAGIC};
use sgiov::sgf::SgfId;
use virtq::{Ring, RingView, Split};
use vm_memory::ByteValued;
use vmm_sys_util::eventfd::EventFd;

use super::mem::SgMemory;
use super::SgPf;
use crate::dataplane::virtio::Fault;
use crate::devset::Devset;
use crate::memory::VfMemory;
use crate::poll::{eventfd_fd, wait_readable};
use crate::port::{AtomicCounters, Port, VfHw};

/// Queue indexes of the SGF (docs/sgiov.md §8).
const SETUP_Q: usize = sgiov::layout::SETUP_QUEUE as usize;
const SIGNAL_Q: usize = sgiov::layout::SIGNAL_QUEUE as usize;
/// `dedicated` channel k is vring CHANNEL_Q + k (signal-only).
const CHANNEL_Q: usize = 2;
/// Longest sleep without an event (the stats are published at this pace).
const IDLE: Duration = Duration::from_millis(100);
/// Setup commands taken per kick.
const SETUP_BATCH: usize = 16;

#[derive(Debug)]
struct Slot {
    port: Arc<Port>,
    seen: u64,
    /// The memory table the attached SGF uses.
    mem: Option<Arc<VfMemory>>,
    setup: Option<Arc<EventFd>>,
    doorbell: Option<Arc<EventFd>>,
    /// `dedicated` mode: the doorbells of the SGF's channels (vrings 2 + k),
    /// one per pipe: the wait set grows with pipes here, by design.
    chan_kicks: Vec<Arc<EventFd>>,
    sgf: Option<SgfId>,
    setup_errors: u64,
}

#[derive(Debug)]
pub struct SgLoop {
    pf: String,
    devset: Arc<Devset<VfHw>>,
    slots: Vec<Slot>,
    dev: Device,
    wake: Arc<EventFd>,
    counters: Arc<Mutex<Vec<SgCounters>>>,
    lat: SgLat,
    sched: Arc<Mutex<super::SchedSetting>>,
}

impl SgLoop {
    pub fn new(pf: &str, sg: &SgPf) -> Result<SgLoop, DeviceError> {
        Ok(SgLoop {
            pf: pf.into(),
            devset: sg.devset.clone(),
            slots: sg
                .ports
                .iter()
                .map(|p| Slot {
                    port: p.clone(),
                    seen: 0,
                    mem: None,
                    setup: None,
                    doorbell: None,
                    chan_kicks: Vec::new(),
                    sgf: None,
                    setup_errors: 0,
                })
                .collect(),
            dev: {
                let mut d = Device::new(sg.config)?;
                d.set_links(sg.links.clone());
                d
            },
            wake: sg.wake.clone(),
            counters: sg.counters.clone(),
            lat: SgLat::default(),
            sched: sg.sched.clone(),
        })
    }

    pub fn run(mut self, stop: &AtomicBool, stop_fd: &EventFd) {
        let mut published = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            // Bounded rounds: with work left (signals past their budget,
            // pipes waiting for job generation) the doorbells are looked at
            // again before the rest of the backlog is served.
            let more = self.dev.has_more();
            let timeout = if more { Duration::ZERO } else { IDLE };
            let mut which = Vec::new();
            let ready = {
                let mut fds = vec![
                    eventfd_fd(&self.wake),
                    eventfd_fd(stop_fd),
                    eventfd_fd(self.dev.engine().completions().eventfd()),
                ];
                for (i, s) in self.slots.iter().enumerate() {
                    if let Some(k) = &s.setup {
                        fds.push(eventfd_fd(k));
                        which.push((i, SETUP_Q));
                    }
                    if let (Some(k), Some(_)) = (&s.doorbell, s.sgf) {
                        fds.push(eventfd_fd(k));
                        which.push((i, SIGNAL_Q));
                    }
                    if s.sgf.is_some() {
                        for (c, k) in s.chan_kicks.iter().enumerate() {
                            fds.push(eventfd_fd(k));
                            which.push((i, CHANNEL_Q + c));
                        }
                    }
                }
                wait_readable(&fds, timeout)
            };
            let round = Instant::now();
            let busy = more || ready.iter().any(|&r| r);
            if ready[0] {
                let _ = self.wake.read();
                self.apply_sched();
            }
            if ready[2] {
                let _ = self.dev.engine().completions().eventfd().read();
            }
            // Doorbells per slot (Cross-FIFO and channels), as of before the
            // refresh: a slot whose session changed is looked at again.
            let mut doorbells = vec![0u64; self.slots.len()];
            for (k, &(i, q)) in which.iter().enumerate() {
                if !ready[3 + k] {
                    continue;
                }
                let s = &self.slots[i];
                let kick = match q {
                    SETUP_Q => s.setup.as_ref(),
                    SIGNAL_Q => s.doorbell.as_ref(),
                    c => s.chan_kicks.get(c - CHANNEL_Q),
                };
                if let Some(k) = kick {
                    let _ = k.read();
                }
                if q != SETUP_Q {
                    doorbells[i] += 1;
                }
            }
            self.refresh();
            for (k, &(i, q)) in which.iter().enumerate() {
                if ready[3 + k] && q == SETUP_Q {
                    self.setup(i);
                }
            }
            for (i, &n) in doorbells.iter().enumerate() {
                // One consume round serves every doorbell of the SGF (in
                // `dedicated` mode it polls all of its channels).
                if let (true, Some(id)) = (n > 0, self.slots[i].sgf) {
                    self.dev.kicks(id, n);
                }
            }
            for id in self.dev.poll() {
                if let Some(s) = self.slots.iter().find(|s| s.sgf == Some(id)) {
                    s.port.runtime().vrings[SIGNAL_Q].signal();
                }
            }
            self.channel_interrupts();
            if busy {
                let q = self.dev.engine().stats().sched;
                let depth = q.enqueued.saturating_sub(q.dispatched + q.cancelled);
                self.lat.queue_depth.add(depth);
                self.lat.round_us.add(round.elapsed().as_micros() as u64);
            }
            if published.elapsed() >= IDLE {
                self.publish();
                published = Instant::now();
            }
        }
        for i in 0..self.slots.len() {
            self.detach(i);
        }
        self.publish();
        tracing::info!("PF {}: SG device stopped", self.pf);
    }

    /// Raises the call eventfds of the channels (`dedicated` mode) the
    /// device asked for, one runtime lock per SGF.
    fn channel_interrupts(&mut self) {
        let mut irqs = self.dev.take_channel_irqs();
        irqs.sort_unstable();
        for per_sgf in irqs.chunk_by(|a, b| a.0 == b.0) {
            let id = per_sgf[0].0;
            if let Some(s) = self.slots.iter().find(|s| s.sgf == Some(id)) {
                let rt = s.port.runtime();
                for &(_, k) in per_sgf {
                    if let Some(c) = rt.channels.get(k as usize) {
                        c.signal();
                    }
                }
            }
        }
    }

    /// Picks up session changes: a new or dropped memory table, kick fds,
    /// a closed or failed slot (which detaches its SGF).
    fn refresh(&mut self) {
        for i in 0..self.slots.len() {
            let port = self.slots[i].port.clone();
            let g = port.generation();
            if g == self.slots[i].seen {
                continue;
            }
            self.slots[i].seen = g;
            let (mem, setup, doorbell, chan_kicks) = {
                let rt = port.runtime();
                let active = rt.active && !rt.failed;
                (
                    rt.mem.clone().filter(|_| active),
                    rt.vrings[SETUP_Q].kick.clone().filter(|_| active),
                    rt.vrings[SIGNAL_Q].kick.clone().filter(|_| active),
                    rt.channels
                        .iter()
                        .filter(|c| active && c.enabled)
                        .filter_map(|c| c.kick.clone())
                        .collect(),
                )
            };
            let slot = &self.slots[i];
            let same_mem = match (&slot.mem, &mem) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            };
            if slot.sgf.is_some() && !same_mem {
                self.detach(i);
            }
            let slot = &mut self.slots[i];
            let has_setup = setup.is_some();
            slot.setup = setup;
            slot.doorbell = doorbell;
            slot.chan_kicks = chan_kicks;
            if slot.sgf.is_none() {
                slot.mem = None;
            }
            // Without REPLY_ACK a kick can come before the session enabled
            // the queue (the kick was taken, the chain left): look again.
            if has_setup {
                self.setup(i);
            }
        }
    }

    fn detach(&mut self, i: usize) {
        let slot = &mut self.slots[i];
        slot.mem = None;
        if let Some(id) = slot.sgf.take() {
            if let Err(e) = self.dev.detach(id) {
                tracing::warn!("SGF {}: detach: {e}", slot.port.id);
            } else {
                tracing::info!("SGF {}: detached", slot.port.id);
            }
            // A session can begin and end between two periodic copies: the
            // control API must not show it as never having run.
            self.publish();
        }
    }

    /// Serves the setup queue: each chain is a 32-byte `SetupCmd` the
    /// device reads and a 4-byte status it writes.
    fn setup(&mut self, i: usize) {
        let port = self.slots[i].port.clone();
        let r = {
            let mut rt = port.runtime();
            if !rt.active || rt.failed || !rt.vrings[SETUP_Q].usable() {
                return;
            }
            let Some(mem) = rt.mem.clone() else { return };
            self.setup_chains(i, &port, &mut rt, &mem)
        };
        if let Err(f) = r {
            self.fault(i, f);
        }
    }

    /// Takes up to [`SETUP_BATCH`] chains through the one walker (`virtq`,
    /// as every other device): a malformed chain or buffer is a [`Fault`]
    /// naming the queue, which puts this SGF only in error.
    fn setup_chains(
        &mut self,
        i: usize,
        port: &Port,
        rt: &mut crate::port::Runtime,
        mem: &Arc<VfMemory>,
    ) -> Result<(), Fault> {
        let gm = &mem.gm;
        let ring = |source| Fault::Ring { q: SETUP_Q, source };
        let view = RingView::resolve(&Ring::of(&rt.vrings[SETUP_Q].queue, rt.features), gm)
            .map_err(ring)?;
        let prepare = |gpa, len| mem.prepare_for_device_write(gpa, len);
        let mut split = Split::default();
        let mut used = Vec::new();
        let heads = view
            .avail_heads(&mut rt.vrings[SETUP_Q].queue, SETUP_BATCH)
            .map_err(ring)?;
        for head in heads {
            let e = |source| Fault::Split { q: SETUP_Q, source };
            view.split_into(head, &mut split).map_err(e)?;
            split.check_in(gm).map_err(e)?;
            let size = size_of::<SetupCmd>() as u64;
            if virtq::total(&split.readable) < size || virtq::total(&split.writable) < 4 {
                return Err(Fault::Chain {
                    q: SETUP_Q,
                    head,
                    what: "a setup chain is a 32-byte command, then a 4-byte writable status",
                });
            }
            let copy = |source| Fault::Copy {
                q: SETUP_Q,
                head,
                source,
            };
            let mut cmd = SetupCmd::default();
            virtq::read_bufs(gm, &prepare, &split.readable, 0, cmd.as_mut_slice()).map_err(copy)?;
            let status = match self.command(i, port, mem, &cmd) {
                Ok(()) => 0,
                Err(code) => {
                    self.slots[i].setup_errors += 1;
                    code as u32
                }
            };
            virtq::write_bufs(gm, &prepare, &split.writable, 0, &[&status.to_le_bytes()])
                .map_err(copy)?;
            used.push((head, 4));
        }
        let vr = &mut rt.vrings[SETUP_Q];
        if view.complete_used(&mut vr.queue, &used).map_err(ring)? {
            vr.signal();
        }
        Ok(())
    }

    fn command(
        &mut self,
        i: usize,
        port: &Port,
        mem: &Arc<VfMemory>,
        cmd: &SetupCmd,
    ) -> Result<(), ErrorCode> {
        if cmd.magic != SETUP_MAGIC {
            return Err(ErrorCode::BadRequest);
        }
        match cmd.op {
            SETUP_ATTACH => {
                if self.slots[i].sgf.is_some() {
                    return Err(ErrorCode::Busy);
                }
                let view = Arc::new(SgMemory::new(format!("SGF {}", port.id), mem.clone()));
                // A tenant is a sandbox: the slot stands for it (DRF).
                match self.dev.attach_channels(
                    &port.id,
                    super::tenant_of(i),
                    view,
                    cmd.area_gpa,
                    cmd.chan_gpa,
                    cmd.chan_entries,
                ) {
                    Ok(id) => {
                        tracing::info!("SGF {}: attached area {:#x}", port.id, cmd.area_gpa);
                        self.slots[i].sgf = Some(id);
                        self.slots[i].mem = Some(mem.clone());
                        Ok(())
                    }
                    Err(e) => {
                        tracing::warn!("SGF {}: attach refused: {e}", port.id);
                        Err(match e {
                            DeviceError::Sgf(e) => e.code(),
                            _ => ErrorCode::Memory,
                        })
                    }
                }
            }
            SETUP_DETACH => {
                if self.slots[i].sgf.is_none() {
                    return Err(ErrorCode::State);
                }
                self.detach(i);
                Ok(())
            }
            _ => Err(ErrorCode::BadRequest),
        }
    }

    /// A malformed setup chain: this SGF slot only goes to error (as a VF).
    fn fault(&mut self, i: usize, f: Fault) {
        let port = self.slots[i].port.clone();
        tracing::warn!("SGF {}: {f}; in error state until reset", port.id);
        AtomicCounters::add(&port.counters.bad_descriptors, 1);
        port.runtime().failed = true;
        self.detach(i);
        if let Err(e) = self.devset.mark_error(i) {
            tracing::warn!("SGF {}: {e}", port.id);
        }
        port.bump();
    }

    /// A policy or capacity change the control API asked for.
    fn apply_sched(&mut self) {
        let mut s = self.sched.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((policy, cap)) = s.want.take() {
            self.dev.reconfigure(policy, cap);
            s.now = (policy, cap);
            tracing::info!("PF {}: SG scheduling {policy}, capacity {cap}", self.pf);
        }
    }

    /// Copies the counters the control API shows.
    fn publish(&self) {
        let d = self.dev.stats();
        let lat = SgLat {
            prio: self.dev.engine().lat_stats(),
            ..self.lat
        };
        let mut out = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        for (c, s) in out.iter_mut().zip(&self.slots) {
            let st = s
                .sgf
                .and_then(|id| self.dev.sgf_stats(id))
                .unwrap_or_default();
            *c = SgCounters {
                attached: s.sgf.is_some(),
                sockets: s.sgf.and_then(|id| self.dev.sgf_sockets(id)).unwrap_or(0) as u64,
                sgf: st,
                setup_errors: s.setup_errors,
                pf_sgfs: d.sgfs as u64,
                pf_sockets: d.sockets as u64,
                pf_pipes: d.pipes as u64,
                pf_rings: d.rings as u64,
                pf_staging_bytes: d.staging_bytes,
                pf_key_slots: d.key_slots as u64,
                pf_lat: lat,
                pf_chains: d.chains,
                pf_crypto_chains: d.crypto_chains,
            };
        }
    }
}
