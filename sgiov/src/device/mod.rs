//! The device: SG functions, their sockets, connections between sockets
//! (warp pipes, directly or through staging rings), the control protocol
//! (§A.4) and the signal plane loop. Stage 2 puts one `Device` per PF in
//! the NIC daemon; the vhost-user transport only has to call
//! [`Device::attach`] / [`Device::detach`], [`Device::kick`] when a
//! doorbell eventfd fires, [`Device::poll`] when the engine's completion
//! eventfd fires, and raise the interrupts `poll` returns.
//!
//! Isolation: bytes move only along pipes the device built for a
//! connection both sides asked for (CONNECT and ACCEPT, or the echo port),
//! and across tenants only if the two were linked ([`Links`]).
//! Staging rings are the daemon's own memory, zeroed when they are
//! released. An error in one ring or pipe stops that pipe; an SGF whose
//! FIFO or control ring is corrupt stops and its connections are closed;
//! the others go on.

mod conn;
mod control;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use slab::Slab;

use crate::engine::{Engine, EngineConfig, EngineError, Event, PipeSpec, RingKey};
use crate::exec::capacity::Capacities;
use crate::exec::crypto::KeyStore;
use crate::jobgen::Xf;
use crate::layout::{
    ctrl, limits, CtrlMsg, CtrlOp, ErrorCode, PathKind, RingRole, SgfState, Transform,
    FIRST_DATA_RING,
};
use crate::links::Links;
use crate::mem::{Memory, StagingMemory};
use crate::ring::{RingGeom, RingView};
use crate::sched::{PipeKey, Policy};
use crate::sgf::{Inbound, Sgf, SgfError, SgfId, SgfStats};
use crate::signal::{RingId, RING_NONE};

#[derive(Debug, Clone, Copy)]
pub struct DeviceConfig {
    pub engine: EngineConfig,
    /// Address space of the staging memfd (pages are allocated on use).
    pub staging_bytes: usize,
    /// Size of one staging ring.
    pub staging_ring: u32,
    pub key_slots: usize,
    /// Guest → device words taken per SGF per kick round.
    pub signal_budget: usize,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig {
            engine: EngineConfig::default(),
            staging_bytes: 4 << 30,
            staging_ring: 256 << 10,
            key_slots: 16384,
            signal_budget: limits::SIGNAL_BUDGET,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error(transparent)]
    Sgf(#[from] SgfError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("staging memory")]
    Staging(#[source] crate::mem::MemError),
    #[error("SGF {0} does not exist")]
    NoSgf(SgfId),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SockState {
    Open,
    Listening {
        port: u32,
    },
    /// CONNECT waiting in a listener's backlog.
    Connecting {
        port: u32,
        req_id: u32,
    },
    /// Offered to a listener by ACCEPT.
    AcceptWait {
        listener: RingId,
    },
    Connected {
        conn: usize,
    },
    /// The peer closed; the guest must CLOSE.
    PeerClosed {
        conn: usize,
    },
    /// Its connection is gone; CLOSE releases it at once.
    Dead,
    /// CLOSE asked; the reply goes out when the connection's pipes are gone.
    Closing {
        conn: usize,
        req_id: u32,
    },
}

#[derive(Debug)]
struct Socket {
    tx: RingId,
    rx: RingId,
    prio: u8,
    state: SockState,
}

#[derive(Debug)]
struct Listener {
    sgf: SgfId,
    sock: RingId,
    accepts: VecDeque<(RingId, u32)>,
    backlog: VecDeque<(SgfId, RingId, u32, Transform, PathKind)>,
}

/// One pipe of a connection, with its guest rings (for errors).
#[derive(Debug)]
struct ConnPipe {
    pipe: PipeKey,
    guest_src: Option<(SgfId, RingId)>,
    guest_sink: Option<(SgfId, RingId)>,
    gone: bool,
}

/// A connection: its pipes, staging rings and key slots.
#[derive(Debug)]
struct Conn {
    ends: Vec<(SgfId, RingId)>,
    pipes: Vec<ConnPipe>,
    staging: Vec<(RingKey, u64, u32)>,
    keys: Vec<u16>,
    closing: bool,
}

#[derive(Debug)]
struct SgfSlot {
    sgf: Sgf,
    sockets: HashMap<RingId, Socket>,
}

/// Device-wide counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DeviceStats {
    pub sgfs: usize,
    pub sockets: usize,
    pub connections: usize,
    pub pipes: usize,
    pub rings: usize,
    pub staging_bytes: u64,
    pub key_slots: usize,
    /// Connections ever established between two SGFs (chains), and those
    /// of them that encrypt: cumulative, they survive detach.
    pub chains: u64,
    pub crypto_chains: u64,
}

#[derive(Debug)]
pub struct Device {
    cfg: DeviceConfig,
    engine: Engine,
    staging: Arc<StagingMemory>,
    keys: Arc<KeyStore>,
    sgfs: Slab<SgfSlot>,
    ports: HashMap<u32, Listener>,
    conns: Slab<Conn>,
    /// SGFs with words left after their budget, or freshly kicked.
    rekick: VecDeque<SgfId>,
    /// Engine rings of detached SGFs still used by closing pipes.
    orphans: Vec<RingKey>,
    /// Tenant pairs allowed to connect to each other.
    links: Arc<Links>,
    chains: u64,
    crypto_chains: u64,
}

fn reply_to(m: &CtrlMsg, status: Result<(), ErrorCode>) -> CtrlMsg {
    CtrlMsg {
        op: m.op | ctrl::REPLY,
        status: status.err().map_or(0, |c| c as u32),
        ..*m
    }
}

impl Device {
    pub fn new(cfg: DeviceConfig) -> Result<Device, DeviceError> {
        let keys = Arc::new(KeyStore::new(cfg.key_slots));
        let engine = Engine::new(cfg.engine, keys.clone())?;
        let staging = Arc::new(
            StagingMemory::new("staging", cfg.staging_bytes).map_err(DeviceError::Staging)?,
        );
        Ok(Device {
            cfg,
            engine,
            staging,
            keys,
            sgfs: Slab::new(),
            ports: HashMap::new(),
            conns: Slab::new(),
            rekick: VecDeque::new(),
            orphans: Vec::new(),
            links: Arc::new(Links::default()),
            chains: 0,
            crypto_chains: 0,
        })
    }

    /// Shares the table of tenants allowed to connect across SGFs (the NIC
    /// daemon's control thread edits it).
    pub fn set_links(&mut self, links: Arc<Links>) {
        self.links = links;
    }

    /// The engine's policy and capacities, at run time.
    pub fn reconfigure(&mut self, policy: Policy, capacity: Capacities) {
        self.engine.reconfigure(policy, capacity);
    }

    pub fn links(&self) -> &Arc<Links> {
        &self.links
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn keys(&self) -> &Arc<KeyStore> {
        &self.keys
    }

    /// The staging memory (tests inspect staged bytes through it).
    pub fn staging(&self) -> &Arc<StagingMemory> {
        &self.staging
    }

    /// Attaches an SG function whose area is at `gpa` in `mem`.
    pub fn attach(
        &mut self,
        name: &str,
        tenant: u32,
        mem: Arc<dyn Memory>,
        gpa: u64,
    ) -> Result<SgfId, DeviceError> {
        self.attach_channels(name, tenant, mem, gpa, 0, 0)
    }

    /// [`Device::attach`] in `dedicated` signal mode when `chan_entries` is
    /// not 0: sockets may then open their own signal channel in the array
    /// at `chan_gpa` (see [`crate::dedicated`]).
    pub fn attach_channels(
        &mut self,
        name: &str,
        tenant: u32,
        mem: Arc<dyn Memory>,
        gpa: u64,
        chan_gpa: u64,
        chan_entries: u32,
    ) -> Result<SgfId, DeviceError> {
        let mut sgf = Sgf::attach(name, tenant, mem, gpa)?;
        if chan_entries != 0 {
            sgf.enable_channels(chan_gpa, chan_entries)?;
        }
        Ok(self.sgfs.insert(SgfSlot {
            sgf,
            sockets: HashMap::new(),
        }) as SgfId)
    }

    /// Detaches an SGF (its VMM went away, or the guest detached): every
    /// connection is closed (peers see `Closed`), every listener removed.
    /// Pipes still running finish against memory that stays mapped until
    /// they are gone.
    pub fn detach(&mut self, id: SgfId) -> Result<(), DeviceError> {
        self.stop_sgf(id);
        let slot = self
            .sgfs
            .try_remove(id as usize)
            .ok_or(DeviceError::NoSgf(id))?;
        slot.sgf.write_status(SgfState::Detached, 0);
        for (_, s) in slot.sockets {
            for r in [s.tx, s.rx] {
                if let Some(k) = slot.sgf.rings.get(&r).and_then(|x| x.engine) {
                    self.retire_ring(k);
                }
            }
        }
        Ok(())
    }

    /// Closes every connection and listener of an SGF.
    fn stop_sgf(&mut self, id: SgfId) {
        let Some(slot) = self.sgfs.get(id as usize) else {
            return;
        };
        let socks: Vec<(RingId, SockState)> =
            slot.sockets.iter().map(|(k, s)| (*k, s.state)).collect();
        for (sock, state) in socks {
            match state {
                SockState::Connected { conn }
                | SockState::PeerClosed { conn }
                | SockState::Closing { conn, .. } => self.teardown(conn),
                SockState::Listening { port } => self.unlisten(port),
                SockState::Connecting { port, .. } => {
                    if let Some(l) = self.ports.get_mut(&port) {
                        l.backlog.retain(|c| !(c.0 == id && c.1 == sock));
                    }
                }
                SockState::AcceptWait { .. } | SockState::Open | SockState::Dead => {}
            }
        }
    }

    pub fn sgf_stats(&self, id: SgfId) -> Option<SgfStats> {
        self.sgfs.get(id as usize).map(|s| s.sgf.stats)
    }

    /// Open sockets of an SGF.
    pub fn sgf_sockets(&self, id: SgfId) -> Option<usize> {
        self.sgfs.get(id as usize).map(|s| s.sockets.len())
    }

    /// SGFs left with signals after their budget: poll again without waiting.
    pub fn has_rekick(&self) -> bool {
        !self.rekick.is_empty()
    }

    /// Work is left for another [`Device::poll`] right away: SGFs with
    /// signals left after their budget, or pipes waiting for job generation.
    /// The transport checks its doorbells, then polls again without waiting.
    pub fn has_more(&self) -> bool {
        self.has_rekick() || self.engine.has_dirty()
    }

    pub fn sgf_state(&self, id: SgfId) -> Option<SgfState> {
        self.sgfs.get(id as usize).map(|s| s.sgf.state)
    }

    pub fn stats(&self) -> DeviceStats {
        DeviceStats {
            sgfs: self.sgfs.len(),
            sockets: self.sgfs.iter().map(|(_, s)| s.sockets.len()).sum(),
            connections: self.conns.len(),
            pipes: self.engine.pipes(),
            rings: self.engine.rings(),
            staging_bytes: self.staging.in_use(),
            key_slots: self.keys.in_use(),
            chains: self.chains,
            crypto_chains: self.crypto_chains,
        }
    }

    /// The guest rang the doorbell of `id`: consume its signals.
    pub fn kick(&mut self, id: SgfId) {
        self.kicks(id, 1);
    }

    /// `n` doorbells of `id` rang (its Cross-FIFO's and its channels'):
    /// one consume round serves them all (it polls every channel).
    pub fn kicks(&mut self, id: SgfId, n: u64) {
        if let Some(s) = self.sgfs.get_mut(id as usize) {
            s.sgf.stats.kicks += n;
        }
        self.consume(id);
    }

    /// The channels (`dedicated` mode) whose guests must be interrupted,
    /// after [`Device::poll`].
    pub fn take_channel_irqs(&mut self) -> Vec<(SgfId, u16)> {
        let mut out = Vec::new();
        for (id, s) in self.sgfs.iter_mut() {
            out.extend(
                s.sgf
                    .take_channel_irqs()
                    .into_iter()
                    .map(|k| (id as SgfId, k)),
            );
        }
        out
    }

    fn consume(&mut self, id: SgfId) {
        let budget = self.cfg.signal_budget;
        let mut inbound = Vec::new();
        let Some(slot) = self.sgfs.get_mut(id as usize) else {
            return;
        };
        match slot.sgf.consume(budget, &mut inbound) {
            Ok(true) => self.rekick.push_back(id),
            Ok(false) => {}
            Err(e) => {
                let code = e.code();
                slot.sgf.fail(code);
                self.stop_sgf(id);
                return;
            }
        }
        for i in inbound {
            match i {
                Inbound::Head { ring, engine, ptr } => {
                    if let Err(e) = self.engine.external_head(engine, ptr) {
                        self.guest_ring_error(id, ring, engine_code(&e));
                    }
                }
                Inbound::Tail { ring, engine, ptr } => {
                    if let Err(e) = self.engine.external_tail(engine, ptr) {
                        self.guest_ring_error(id, ring, engine_code(&e));
                    }
                }
                Inbound::Ctrl => self.control(id),
                Inbound::RingError { ring, code } => self.stop_ring_pipes(id, ring, code),
            }
        }
    }

    fn guest_ring_error(&mut self, id: SgfId, ring: RingId, code: ErrorCode) {
        if let Some(s) = self.sgfs.get_mut(id as usize) {
            s.sgf.ring_error(ring, code);
        }
        self.stop_ring_pipes(id, ring, code);
    }

    /// Fails the pipes that read or write a guest ring in error.
    fn stop_ring_pipes(&mut self, id: SgfId, ring: RingId, code: ErrorCode) {
        let conn = self
            .sgfs
            .get(id as usize)
            .and_then(|s| s.sgf.rings.get(&ring))
            .and_then(|r| self.sgfs[id as usize].sockets.get(&r.sock))
            .and_then(|s| match s.state {
                SockState::Connected { conn } => Some(conn),
                _ => None,
            });
        let Some(c) = conn.and_then(|c| self.conns.get(c)) else {
            return;
        };
        let hit: Vec<PipeKey> = c
            .pipes
            .iter()
            .filter(|p| p.guest_src == Some((id, ring)) || p.guest_sink == Some((id, ring)))
            .map(|p| p.pipe)
            .collect();
        for p in hit {
            self.engine
                .fail_pipe(p, code, format!("guest ring {ring} in error"));
        }
    }

    /// The signal plane's round: completions and job generation in the
    /// engine, engine events turned into device → guest words, SGFs with
    /// words left consumed again, and pending words flushed. Returns the
    /// SGFs whose guests must be interrupted.
    pub fn poll(&mut self) -> Vec<SgfId> {
        // Bounded job generation: a priority signal behind a large backlog
        // waits for one round of `gen_budget` pipes ([`Device::has_more`]).
        let budget = self.cfg.engine.gen_budget;
        if self.cfg.engine.workers == 0 {
            self.engine.run_inline();
        } else {
            self.engine.poll_bounded(budget);
        }
        for _ in 0..self.rekick.len() {
            if let Some(id) = self.rekick.pop_front() {
                self.consume(id);
            }
        }
        self.engine.poll_bounded(budget);
        for ev in self.engine.take_events() {
            match ev {
                Event::Head { tag, head: ptr, .. } | Event::Tail { tag, tail: ptr, .. } => {
                    let (s, r) = ((tag >> 16) as SgfId, tag as RingId);
                    if let Some(slot) = self.sgfs.get_mut(s as usize) {
                        slot.sgf.publish(r, ptr);
                    }
                }
                Event::PipeError {
                    tag, pipe, code, ..
                } => {
                    let Some(c) = self.conns.get(tag as usize) else {
                        continue;
                    };
                    let rings: Vec<_> = c
                        .pipes
                        .iter()
                        .filter(|p| p.pipe == pipe)
                        .flat_map(|p| [p.guest_src, p.guest_sink])
                        .flatten()
                        .collect();
                    for (s, r) in rings {
                        if let Some(slot) = self.sgfs.get_mut(s as usize) {
                            slot.sgf.ring_error(r, code);
                        }
                    }
                }
                Event::PipeGone { tag, pipe } => {
                    if let Some(c) = self.conns.get_mut(tag as usize) {
                        for p in c.pipes.iter_mut().filter(|p| p.pipe == pipe) {
                            p.gone = true;
                        }
                        self.finish_conn(tag as usize);
                    }
                }
            }
        }
        if !self.orphans.is_empty() {
            let e = &mut self.engine;
            self.orphans.retain(|k| e.remove_ring(*k).is_err());
        }
        let mut irq = Vec::new();
        let ids: Vec<SgfId> = self
            .sgfs
            .iter()
            .filter(|(_, s)| s.sgf.has_pending())
            .map(|(k, _)| k as SgfId)
            .collect();
        for id in ids {
            let slot = &mut self.sgfs[id as usize];
            match slot.sgf.flush() {
                Ok(true) => irq.push(id),
                Ok(false) => {}
                Err(e) => {
                    slot.sgf.fail(e.code());
                    self.stop_sgf(id);
                    irq.push(id);
                }
            }
        }
        irq
    }
}

fn engine_code(e: &EngineError) -> ErrorCode {
    match e {
        EngineError::Ring(r) => r.code(),
        _ => ErrorCode::BadPointer,
    }
}
