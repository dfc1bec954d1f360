//! One SG function as the device sees it: the area in the guest's memory
//! (read once and validated at attach), its Cross-FIFO, its ring table, the
//! two control rings, and the device → guest signals waiting to be sent.
//!
//! Signals cost per signal: a guest → device word names its ring, which is
//! found by id in a map (no pipe is ever scanned). Device → guest words are
//! coalesced per ring (only the latest pointer of a ring matters), so the
//! backlog the device keeps for a guest that does not drain its FIFO is
//! bounded by the number of its rings.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vm_memory::Bytes;

use crate::dedicated::{self, Channel, DedicatedPlane};
use crate::engine::RingKey;
use crate::fifo::{FifoConsumer, FifoError, FifoProducer};
use crate::layout::{
    area, ctrl, limits, ring as rd, AreaHeader, CtrlMsg, ErrorCode, Layout, RingDesc, RingRole,
    RingState, SgfState, CTRL_REPLY_RING, CTRL_REQ_RING,
};
use crate::mem::{MemError, Memory};
use crate::ring::{RangeSet, RingError, RingGeom, RingPtrs, RingView};
use crate::signal::{RingId, Signal, SignalType, SignalWord};

pub type SgfId = u32;

#[derive(Debug, thiserror::Error)]
pub enum SgfError {
    #[error("SGF {sgf}: area at {gpa:#x}: {what}")]
    BadArea {
        sgf: String,
        gpa: u64,
        what: &'static str,
    },
    #[error("SGF {sgf}: control ring")]
    CtrlRing {
        sgf: String,
        #[source]
        source: RingError,
    },
    #[error("SGF {sgf}: memory")]
    Memory {
        sgf: String,
        #[source]
        source: MemError,
    },
    #[error("SGF {sgf}: FIFO")]
    Fifo {
        sgf: String,
        #[source]
        source: FifoError,
    },
}

impl SgfError {
    pub fn code(&self) -> ErrorCode {
        match self {
            SgfError::BadArea { .. } => ErrorCode::BadArea,
            SgfError::CtrlRing { source, .. } => source.code(),
            SgfError::Memory { .. } => ErrorCode::Memory,
            SgfError::Fifo { source, .. } => source.code(),
        }
    }
}

/// Counters of one SGF (the NIC's control API shows them as they are).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SgfStats {
    pub kicks: u64,
    pub signals_in: u64,
    pub signals_out: u64,
    pub interrupts: u64,
    /// Words with an unknown type or the reserved ring id.
    pub bad_signals: u64,
    /// Words naming a ring that is not open.
    pub unknown_ring: u64,
    pub ring_errors: u64,
    pub ctrl_requests: u64,
    pub ctrl_errors: u64,
    /// Times the device → guest FIFO was full.
    pub d2g_full: u64,
    /// `dedicated` mode: channels looked at by the device's polling (the
    /// O(pipes) scan per round), and channel words naming a ring that is
    /// not their own pipe's (the pipe goes to error).
    #[serde(default)]
    pub chan_scanned: u64,
    #[serde(default)]
    pub chan_forged: u64,
}

/// Pending device → guest words of one ring.
pub mod pend {
    pub const PTR: u8 = 1;
    pub const ERROR: u8 = 2;
    pub const CLOSED: u8 = 4;
}

/// An open ring of the SGF.
pub struct SgfRing {
    pub role: RingRole,
    pub geom: RingGeom,
    /// The engine's ring (data rings); None for the control rings.
    pub engine: Option<RingKey>,
    /// The socket (its TX ring id) this ring belongs to.
    pub sock: RingId,
    pub state: RingState,
    pub code: u32,
    /// The device's pointer as last published (tail of a TX ring, head of an RX ring).
    pub dev_ptr: u32,
    pend: u8,
    /// `dedicated` mode: the socket's own signal channel.
    pub chan: Option<u16>,
}

/// A guest → device signal after validation, for the device to act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inbound {
    /// The guest published a head of a data ring it produces.
    Head {
        ring: RingId,
        engine: RingKey,
        ptr: u32,
    },
    /// The guest published a tail of a data ring it consumes.
    Tail {
        ring: RingId,
        engine: RingKey,
        ptr: u32,
    },
    /// Control requests (or reply space) arrived.
    Ctrl,
    /// The word was invalid for its ring: the ring is now in error.
    RingError { ring: RingId, code: ErrorCode },
}

pub struct Sgf {
    pub name: String,
    pub tenant: u32,
    pub mem: Arc<dyn Memory>,
    pub area: u64,
    pub layout: Layout,
    g2d: FifoConsumer,
    d2g: FifoProducer,
    pub state: SgfState,
    pub rings: HashMap<RingId, SgfRing>,
    pub ranges: RangeSet,
    pending: VecDeque<RingId>,
    req: (RingView, RingPtrs),
    rep: (RingView, RingPtrs),
    replies: VecDeque<CtrlMsg>,
    pub stats: SgfStats,
    /// The guest must be interrupted (its g2d FIFO had a backlog, or words
    /// were pushed and it asked for a notification).
    irq: bool,
    /// `dedicated` mode: the channel array (gpa, FIFO slots) and the open
    /// channels; None = Cross-FIFO only.
    chans: Option<(u64, u32, DedicatedPlane)>,
    /// Channels whose guests must be interrupted.
    chan_irqs: Vec<u16>,
}

/// Most replies held back while the reply ring is full; beyond it the
/// device stops taking requests (flow control).
const MAX_REPLY_BACKLOG: usize = 256;

impl Sgf {
    /// Attaches to the area at `gpa`: reads its header once, validates it
    /// and the two control ring descriptors, prepares the area and the
    /// control rings for device access, and takes over the device-owned
    /// FIFO fields.
    pub fn attach(
        name: &str,
        tenant: u32,
        mem: Arc<dyn Memory>,
        gpa: u64,
    ) -> Result<Sgf, SgfError> {
        let bad = |what| SgfError::BadArea {
            sgf: name.to_string(),
            gpa,
            what,
        };
        let memerr = |source| SgfError::Memory {
            sgf: name.to_string(),
            source,
        };
        if !gpa.is_multiple_of(4096) {
            return Err(bad("not 4 KiB aligned"));
        }
        let h: AreaHeader = mem
            .get(gpa, area::SIZE as usize)
            .map_err(|_| bad("header outside guest memory"))?
            .read_obj(0)
            .map_err(|_| bad("header unreadable"))?;
        let layout = Layout::validate(&h).map_err(bad)?;
        if mem.slice(gpa, layout.area_len as usize).is_none() {
            return Err(bad("area outside guest memory"));
        }
        mem.prepare(gpa, layout.area_len as u64).map_err(memerr)?;
        let mut ranges = RangeSet::default();
        let _ = ranges.insert(gpa, gpa + layout.area_len as u64, "the SGF area".into());
        let ctrl_ring = |id: RingId, role, ranges: &mut RangeSet| -> Result<RingView, SgfError> {
            let label = format!("SGF {name} ring {id}");
            let cerr = |source| SgfError::CtrlRing {
                sgf: name.to_string(),
                source,
            };
            let d: RingDesc = mem
                .get(gpa + layout.desc_off(id), rd::BYTES as usize)
                .map_err(memerr)?
                .read_obj(0)
                .map_err(|_| bad("ring table unreadable"))?;
            let geom = RingGeom::from_desc(&label, &*mem, &d, role).map_err(cerr)?;
            ranges
                .insert(geom.base, geom.end(), label.clone())
                .map_err(|other| {
                    cerr(RingError::Overlap {
                        ring: label.clone(),
                        base: geom.base,
                        size: geom.size as u64,
                        other,
                    })
                })?;
            mem.prepare(geom.base, geom.size as u64).map_err(memerr)?;
            Ok(RingView::new(mem.clone(), geom))
        };
        let req = ctrl_ring(CTRL_REQ_RING, RingRole::GuestProduces, &mut ranges)?;
        let rep = ctrl_ring(CTRL_REPLY_RING, RingRole::DeviceProduces, &mut ranges)?;
        let fifo_err = |source| SgfError::Fifo {
            sgf: name.to_string(),
            source,
        };
        let g2d = FifoConsumer::new(
            format!("SGF {name} g2d FIFO"),
            mem.clone(),
            gpa + layout.g2d_off as u64,
            layout.g2d_entries,
            1,
        )
        .map_err(fifo_err)?;
        let d2g = FifoProducer::new(
            format!("SGF {name} d2g FIFO"),
            mem.clone(),
            gpa + layout.d2g_off as u64,
            layout.d2g_entries,
        )
        .map_err(fifo_err)?;
        let mut rings = HashMap::new();
        for (id, view, role) in [
            (CTRL_REQ_RING, &req, RingRole::GuestProduces),
            (CTRL_REPLY_RING, &rep, RingRole::DeviceProduces),
        ] {
            rings.insert(
                id,
                SgfRing {
                    role,
                    geom: view.geom,
                    engine: None,
                    sock: id,
                    state: RingState::Open,
                    code: 0,
                    dev_ptr: 0,
                    pend: 0,
                    chan: None,
                },
            );
        }
        let (qs, ps) = (req.geom.size, rep.geom.size);
        let sgf = Sgf {
            name: name.to_string(),
            tenant,
            mem,
            area: gpa,
            layout,
            g2d,
            d2g,
            state: SgfState::Attached,
            rings,
            ranges,
            pending: VecDeque::new(),
            req: (req, RingPtrs::new(qs)),
            rep: (rep, RingPtrs::new(ps)),
            replies: VecDeque::new(),
            stats: SgfStats::default(),
            irq: false,
            chans: None,
            chan_irqs: Vec::new(),
        };
        for id in [CTRL_REQ_RING, CTRL_REPLY_RING] {
            sgf.write_desc(id, RingState::Open, 0, 0);
        }
        sgf.write_status(SgfState::Attached, 0);
        Ok(sgf)
    }

    /// Writes the device-owned fields of a ring descriptor. A failure means
    /// the area is gone (the VMM died); the SGF is being detached then.
    pub fn write_desc(&self, id: RingId, state: RingState, error: u32, dev_ptr: u32) {
        let at = self.area + self.layout.desc_off(id);
        if let Ok(s) = self.mem.get(at, rd::BYTES as usize) {
            let _ = s.store(dev_ptr, rd::DEV_PTR as usize, Ordering::Release);
            let _ = s.store(error, rd::ERROR as usize, Ordering::Release);
            let _ = s.store(state as u32, rd::STATE as usize, Ordering::Release);
        }
    }

    pub fn write_status(&self, state: SgfState, error: u32) {
        if let Ok(s) = self.mem.get(self.area, area::SIZE as usize) {
            let _ = s.store(error, area::DEV_ERROR as usize, Ordering::Release);
            let _ = s.store(state as u32, area::DEV_STATE as usize, Ordering::Release);
        }
    }

    /// Reads a ring descriptor once (OPEN).
    pub fn read_desc(&self, id: RingId) -> Option<RingDesc> {
        if id as u32 >= self.layout.table_entries {
            return None;
        }
        self.mem
            .get(self.area + self.layout.desc_off(id), rd::BYTES as usize)
            .ok()?
            .read_obj(0)
            .ok()
    }

    /// Puts the whole SGF into error: no signal is processed any more.
    pub fn fail(&mut self, code: ErrorCode) {
        self.state = SgfState::Error;
        self.write_status(SgfState::Error, code as u32);
        self.irq = true;
    }

    /// Takes up to `budget` guest → device words and validates each against
    /// its ring. Returns what the device must act on and whether more words
    /// are waiting (call again).
    pub fn consume(&mut self, budget: usize, out: &mut Vec<Inbound>) -> Result<bool, SgfError> {
        if self.state != SgfState::Attached {
            return Ok(false);
        }
        let fifo_err = |name: &str, source| SgfError::Fifo {
            sgf: name.to_string(),
            source,
        };
        let mut words = Vec::new();
        let n = self
            .g2d
            .pop(budget, &mut words)
            .map_err(|e| fifo_err(&self.name, e))?;
        self.stats.signals_in += words.len() as u64;
        let mut ctrl = false;
        for w in words {
            match self.inbound(w) {
                Some(Inbound::Ctrl) => ctrl = true,
                Some(i) => out.push(i),
                None => {}
            }
        }
        if ctrl {
            out.push(Inbound::Ctrl);
        }
        let chan_more = self.consume_channels(out);
        // The guest waits for FIFO space: tell it there is some now.
        if self
            .g2d
            .producer_backlog()
            .map_err(|e| fifo_err(&self.name, e))?
        {
            self.irq = true;
        }
        if n == budget {
            // The budget ran out: more words may wait; the caller comes back.
            return Ok(true);
        }
        Ok(self.g2d.arm().map_err(|e| fifo_err(&self.name, e))? || chan_more)
    }

    /// `dedicated` mode: one polling round over every channel (the SR-IOV
    /// model's O(pipes) scan, counted). A word is valid only for its own
    /// pipe's two rings: any other id is forged, counted, and puts that
    /// pipe (its TX ring) into error; a corrupt channel FIFO does the same.
    /// Returns whether words raced in after the channels were re-armed.
    fn consume_channels(&mut self, out: &mut Vec<Inbound>) -> bool {
        let Some((_, _, plane)) = self.chans.as_mut() else {
            return false;
        };
        let (mut words, mut bad) = (Vec::new(), Vec::new());
        let before = plane.scanned();
        let again = plane.poll(&mut words, &mut bad);
        self.stats.chan_scanned += plane.scanned() - before;
        self.stats.signals_in += words.len() as u64;
        let owners: Vec<Option<(RingId, bool)>> = words
            .iter()
            .map(|(k, w)| {
                let c = plane.get(*k)?;
                Some((c.tx, w.decode().is_ok_and(|s| c.owns(s.ring))))
            })
            .collect();
        // A guest that found its channel full waits for a notification.
        let mut waiting: Vec<u16> = words
            .iter()
            .map(|(k, _)| *k)
            .filter(|k| plane.producer_backlog(*k))
            .collect();
        waiting.dedup();
        self.chan_irqs.extend(waiting);
        for ((_, w), owner) in words.into_iter().zip(owners) {
            match owner {
                None => {}
                Some((tx, false)) => {
                    if w.decode().is_err() {
                        self.stats.bad_signals += 1;
                    } else {
                        self.stats.chan_forged += 1;
                        out.push(self.ring_error(tx, ErrorCode::BadRing));
                    }
                }
                Some((_, true)) => {
                    if let Some(i) = self.inbound(w) {
                        out.push(i);
                    }
                }
            }
        }
        for k in bad {
            let tx = self
                .chans
                .as_ref()
                .and_then(|(_, _, p)| p.get(k))
                .map(|c| c.tx);
            // The channel is dropped (its range stays taken until CLOSE);
            // the pipe's words go over the Cross-FIFO from now on.
            if let Some((_, _, p)) = self.chans.as_mut() {
                p.remove(k);
            }
            if let Some(tx) = tx {
                out.push(self.ring_error(tx, ErrorCode::FifoCorrupt));
            }
        }
        again
    }

    /// Turns on the `dedicated` mode (ATTACH with channels): channel k of
    /// `entries` slots per FIFO lies at `gpa + k * channel_bytes(entries)`.
    /// Each channel is checked when a socket opens it.
    pub fn enable_channels(&mut self, gpa: u64, entries: u32) -> Result<(), SgfError> {
        let fifo = limits::MIN_FIFO_ENTRIES..=limits::MAX_FIFO_ENTRIES;
        if !entries.is_power_of_two() || !fifo.contains(&entries) || !gpa.is_multiple_of(64) {
            return Err(SgfError::BadArea {
                sgf: self.name.clone(),
                gpa,
                what:
                    "channel array: FIFO slots not a power of two 64..65536, or not 64-byte aligned",
            });
        }
        self.chans = Some((gpa, entries, DedicatedPlane::new()));
        Ok(())
    }

    /// OPEN with a channel: checks that channel `k` lies in guest memory
    /// and overlaps nothing the SGF uses (area, rings, other channels),
    /// then takes over its device-owned fields for the pipe `tx`/`rx`.
    pub fn open_channel(&mut self, k: u16, tx: RingId, rx: RingId) -> Result<(), ErrorCode> {
        let Some((gpa, entries, plane)) = self.chans.as_mut() else {
            return Err(ErrorCode::BadRequest);
        };
        if k as usize >= dedicated::MAX_CHANNELS {
            return Err(ErrorCode::BadRequest);
        }
        if plane.contains(k) {
            return Err(ErrorCode::Busy);
        }
        let bytes = dedicated::channel_bytes(*entries);
        let at = gpa
            .checked_add(k as u64 * bytes)
            .filter(|a| a.checked_add(bytes).is_some())
            .ok_or(ErrorCode::BadRing)?;
        if self.mem.slice(at, bytes as usize).is_none() {
            return Err(ErrorCode::BadRing);
        }
        let label = format!("SGF {} channel {k}", self.name);
        self.ranges
            .insert(at, at + bytes, label)
            .map_err(|_| ErrorCode::Overlap)?;
        let c = self
            .mem
            .prepare(at, bytes)
            .map_err(|_| ErrorCode::Memory)
            .and_then(|_| {
                Channel::new(self.mem.clone(), at, *entries, tx, rx).map_err(|e| e.code())
            });
        match c {
            Ok(c) => {
                plane.insert(k, c);
                Ok(())
            }
            Err(e) => {
                self.ranges.remove(at);
                Err(e)
            }
        }
    }

    /// Releases channel `k` (a refused OPEN, or its socket's rings gone).
    pub fn close_channel(&mut self, k: u16) {
        if let Some((gpa, entries, plane)) = self.chans.as_mut() {
            plane.remove(k);
            self.ranges
                .remove(*gpa + k as u64 * dedicated::channel_bytes(*entries));
        }
    }

    /// The two rings of an opened socket signal over channel `k`.
    pub fn bind_channel(&mut self, k: u16, tx: RingId, rx: RingId) {
        for r in [tx, rx] {
            if let Some(r) = self.rings.get_mut(&r) {
                r.chan = Some(k);
            }
        }
    }

    /// Open channels (`dedicated` mode).
    pub fn channels(&self) -> usize {
        self.chans.as_ref().map_or(0, |(_, _, p)| p.len())
    }

    /// The channels whose guests must be interrupted (their call eventfds).
    pub fn take_channel_irqs(&mut self) -> Vec<u16> {
        let mut v = std::mem::take(&mut self.chan_irqs);
        v.sort_unstable();
        v.dedup();
        v
    }

    fn inbound(&mut self, w: SignalWord) -> Option<Inbound> {
        let Ok(Signal { ty, ring, ptr }) = w.decode() else {
            self.stats.bad_signals += 1;
            return None;
        };
        let Some(r) = self.rings.get(&ring) else {
            self.stats.unknown_ring += 1;
            return None;
        };
        if r.state != RingState::Open {
            // A signal racing a close or an error: nothing to do.
            return None;
        }
        let expected = match ty {
            SignalType::Head => RingRole::GuestProduces,
            SignalType::Tail => RingRole::DeviceProduces,
            _ => return Some(self.ring_error(ring, ErrorCode::WrongDirection)),
        };
        if r.role != expected {
            return Some(self.ring_error(ring, ErrorCode::WrongDirection));
        }
        let label = format!("SGF {} ring {ring}", self.name);
        match (ring, r.engine) {
            (CTRL_REQ_RING, _) => match self.req.1.publish_head(&label, ptr) {
                Ok(_) => Some(Inbound::Ctrl),
                Err(e) => Some(self.ring_error(ring, e.code())),
            },
            (CTRL_REPLY_RING, _) => match self.rep.1.publish_tail(&label, ptr) {
                Ok(_) => Some(Inbound::Ctrl),
                Err(e) => Some(self.ring_error(ring, e.code())),
            },
            (_, Some(engine)) if ty == SignalType::Head => {
                Some(Inbound::Head { ring, engine, ptr })
            }
            (_, Some(engine)) => Some(Inbound::Tail { ring, engine, ptr }),
            (_, None) => None,
        }
    }

    /// Puts one ring into error (reported to the guest by an `Error` word and
    /// in its descriptor). An error on a control ring fails the SGF.
    pub fn ring_error(&mut self, ring: RingId, code: ErrorCode) -> Inbound {
        self.stats.ring_errors += 1;
        let opened = self
            .rings
            .get_mut(&ring)
            .filter(|r| r.state == RingState::Open);
        if let Some(dev_ptr) = opened.map(|r| {
            r.state = RingState::Error;
            r.code = code as u32;
            r.dev_ptr
        }) {
            self.write_desc(ring, RingState::Error, code as u32, dev_ptr);
            self.queue(ring, pend::ERROR);
        }
        if ring == CTRL_REQ_RING || ring == CTRL_REPLY_RING {
            self.fail(code);
        }
        Inbound::RingError { ring, code }
    }

    /// Marks a ring closed by the device (peer gone): a `Closed` word.
    pub fn ring_closed(&mut self, ring: RingId) {
        let live = self
            .rings
            .get_mut(&ring)
            .filter(|r| r.state == RingState::Open || r.state == RingState::Error);
        if let Some((code, dev_ptr)) = live.map(|r| {
            r.state = RingState::Closed;
            (r.code, r.dev_ptr)
        }) {
            self.write_desc(ring, RingState::Closed, code, dev_ptr);
            self.queue(ring, pend::CLOSED);
        }
    }

    /// The device's pointer of a data ring moved (engine event).
    pub fn publish(&mut self, ring: RingId, ptr: u32) {
        if let Some((state, code)) = self.rings.get_mut(&ring).map(|r| {
            r.dev_ptr = ptr;
            (r.state, r.code)
        }) {
            self.write_desc(ring, state, code, ptr);
            self.queue(ring, pend::PTR);
        }
    }

    fn queue(&mut self, ring: RingId, what: u8) {
        if let Some(r) = self.rings.get_mut(&ring) {
            if r.pend == 0 {
                self.pending.push_back(ring);
            }
            r.pend |= what;
        }
    }

    /// Pushes the pending device → guest words (the latest of each ring).
    /// Returns whether the guest must be interrupted.
    pub fn flush(&mut self) -> Result<bool, SgfError> {
        let fifo_err = |name: &str, source| SgfError::Fifo {
            sgf: name.to_string(),
            source,
        };
        // Rings whose channel is full: pending again after this flush.
        let mut deferred = Vec::new();
        'rings: while let Some(&id) = self.pending.front() {
            let Some(r) = self.rings.get(&id) else {
                self.pending.pop_front();
                continue;
            };
            let route = r
                .chan
                .filter(|k| self.chans.as_ref().is_some_and(|(_, _, p)| p.contains(*k)));
            let ptr_type = if r.role == RingRole::GuestProduces {
                SignalType::Tail
            } else {
                SignalType::Head
            };
            let mut words = Vec::with_capacity(3);
            if r.pend & pend::PTR != 0 {
                words.push((pend::PTR, Signal::new(ptr_type, id, r.dev_ptr)));
            }
            if r.pend & pend::ERROR != 0 {
                words.push((pend::ERROR, Signal::new(SignalType::Error, id, r.code)));
            }
            if r.pend & pend::CLOSED != 0 {
                words.push((pend::CLOSED, Signal::new(SignalType::Closed, id, 0)));
            }
            for (bit, s) in words {
                let pushed = match (route, self.chans.as_mut()) {
                    (Some(k), Some((_, _, p))) => p.push(k, s.word()),
                    _ => self.d2g.push(s.word()),
                }
                .map_err(|e| fifo_err(&self.name, e))?;
                if !pushed {
                    self.stats.d2g_full += 1;
                    if route.is_some() {
                        // Only this pipe's channel is full.
                        self.pending.pop_front();
                        deferred.push(id);
                        continue 'rings;
                    }
                    self.pending.extend(deferred);
                    return self.finish_flush();
                }
                self.stats.signals_out += 1;
                if let Some(r) = self.rings.get_mut(&id) {
                    r.pend &= !bit;
                }
            }
            self.pending.pop_front();
        }
        self.pending.extend(deferred);
        self.d2g
            .clear_backlog()
            .map_err(|e| fifo_err(&self.name, e))?;
        self.finish_flush()
    }

    fn finish_flush(&mut self) -> Result<bool, SgfError> {
        let err = |source| SgfError::Fifo {
            sgf: self.name.clone(),
            source,
        };
        if let Some((_, _, p)) = self.chans.as_mut() {
            p.flush(&mut self.chan_irqs).map_err(err)?;
        }
        let notify = self.d2g.flush().map_err(err)?;
        let irq = notify || std::mem::take(&mut self.irq);
        if irq {
            self.stats.interrupts += 1;
        }
        Ok(irq)
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty() || self.irq || !self.chan_irqs.is_empty()
    }

    /// Takes the next control request (read once), if a whole one is there
    /// and the reply backlog has room. The tail it frees is signalled.
    pub fn next_request(&mut self) -> Option<CtrlMsg> {
        if self.state != SgfState::Attached
            || self.req.1.used() < ctrl::MSG_BYTES
            || self.replies.len() >= MAX_REPLY_BACKLOG
        {
            return None;
        }
        let mut b = [0u8; 64];
        let tail = self.req.1.tail;
        if self.req.0.read(tail, &mut b).is_err() {
            self.ring_error(CTRL_REQ_RING, ErrorCode::Memory);
            return None;
        }
        let label = format!("SGF {} ring 0", self.name);
        let _ = self
            .req
            .1
            .publish_tail(&label, tail.wrapping_add(ctrl::MSG_BYTES));
        let t = self.req.1.tail;
        if let Some(r) = self.rings.get_mut(&CTRL_REQ_RING) {
            r.dev_ptr = t;
        }
        self.queue(CTRL_REQ_RING, pend::PTR);
        self.stats.ctrl_requests += 1;
        let mut m = CtrlMsg::default();
        // CtrlMsg is ByteValued and exactly 64 bytes.
        vm_memory::ByteValued::as_mut_slice(&mut m).copy_from_slice(&b);
        Some(m)
    }

    /// Queues a reply; written into ring 1 as soon as there is room.
    pub fn reply(&mut self, m: CtrlMsg) {
        if m.status != 0 {
            self.stats.ctrl_errors += 1;
        }
        self.replies.push_back(m);
        self.write_replies();
    }

    /// Writes held-back replies while ring 1 has room.
    pub fn write_replies(&mut self) {
        let mut wrote = false;
        while self.rep.1.free() >= ctrl::MSG_BYTES {
            let Some(m) = self.replies.pop_front() else {
                break;
            };
            let head = self.rep.1.head;
            if self
                .rep
                .0
                .write(head, vm_memory::ByteValued::as_slice(&m))
                .is_err()
            {
                self.ring_error(CTRL_REPLY_RING, ErrorCode::Memory);
                return;
            }
            let label = format!("SGF {} ring 1", self.name);
            let _ = self
                .rep
                .1
                .publish_head(&label, head.wrapping_add(ctrl::MSG_BYTES));
            wrote = true;
        }
        if wrote {
            let h = self.rep.1.head;
            if let Some(r) = self.rings.get_mut(&CTRL_REPLY_RING) {
                r.dev_ptr = h;
            }
            self.queue(CTRL_REPLY_RING, pend::PTR);
        }
    }

    /// Registers an opened data ring.
    pub fn add_ring(
        &mut self,
        id: RingId,
        role: RingRole,
        geom: RingGeom,
        engine: RingKey,
        sock: RingId,
    ) {
        self.rings.insert(
            id,
            SgfRing {
                role,
                geom,
                engine: Some(engine),
                sock,
                state: RingState::Open,
                code: 0,
                dev_ptr: 0,
                pend: 0,
                chan: None,
            },
        );
        self.write_desc(id, RingState::Open, 0, 0);
    }

    /// Forgets a ring: its id and its memory range are free again.
    pub fn remove_ring(&mut self, id: RingId) -> Option<SgfRing> {
        let r = self.rings.remove(&id)?;
        self.ranges.remove(r.geom.base);
        // A socket's channel goes with its TX ring (the socket id).
        if let Some(k) = r.chan.filter(|_| id == r.sock) {
            self.close_channel(k);
        }
        self.write_desc(id, RingState::Free, 0, 0);
        Some(r)
    }

    /// Data rings (sockets use two each).
    pub fn data_rings(&self) -> usize {
        self.rings.len().saturating_sub(2)
    }

    pub fn ring_table_len(&self) -> u32 {
        self.layout.table_entries.min(limits::MAX_TABLE_ENTRIES)
    }
}
