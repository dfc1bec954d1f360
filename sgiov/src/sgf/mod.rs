//! One SG function as the device sees it: the area in the guest's memory
//! (read once and validated at attach), its Cross-FIFO, its ring table, the
//! two control rings, and the device → guest signals waiting to be sent.
//!
//! Signals cost per signal: a guest → device word names its ring, which is
//! found by id in a map (no pipe is ever scanned). Device → guest words are
//! coalesced per ring (only the latest pointer of a ring matters), so the
//! backlog the device keeps for a guest that does not drain its FIFO is
//! bounded by the number of its rings.
//!
//! This file: the SGF, its attach (area header, control rings, FIFOs),
//! descriptors and status, and its ring registry. The signals over the
//! Cross-FIFO are in `signals.rs`, the `dedicated` mode's per-pipe
//! channels in `channels.rs`, the control rings' requests and replies in
//! `control.rs`.

mod channels;
mod control;
mod signals;

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
use crate::ring::{Overlap, RangeSet, RingError, RingGeom, RingPtrs, RingView};
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
#[derive(Debug)]
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

#[derive(Debug)]
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
                .map_err(|Overlap { owner: other }| {
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
