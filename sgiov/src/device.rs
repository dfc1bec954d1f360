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

struct Socket {
    tx: RingId,
    rx: RingId,
    prio: u8,
    state: SockState,
}

struct Listener {
    sgf: SgfId,
    sock: RingId,
    accepts: VecDeque<(RingId, u32)>,
    backlog: VecDeque<(SgfId, RingId, u32, Transform, PathKind)>,
}

/// One pipe of a connection, with its guest rings (for errors).
struct ConnPipe {
    pipe: PipeKey,
    guest_src: Option<(SgfId, RingId)>,
    guest_sink: Option<(SgfId, RingId)>,
    gone: bool,
}

/// A connection: its pipes, staging rings and key slots.
struct Conn {
    ends: Vec<(SgfId, RingId)>,
    pipes: Vec<ConnPipe>,
    staging: Vec<(RingKey, u64, u32)>,
    keys: Vec<u16>,
    closing: bool,
}

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
        let sgf = Sgf::attach(name, tenant, mem, gpa)?;
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
        if let Some(s) = self.sgfs.get_mut(id as usize) {
            s.sgf.stats.kicks += 1;
        }
        self.consume(id);
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

    /// Handles the control requests that arrived.
    fn control(&mut self, id: SgfId) {
        for _ in 0..limits::CTRL_BUDGET {
            let Some(m) = self.sgfs.get_mut(id as usize).and_then(|s| {
                s.sgf.write_replies();
                s.sgf.next_request()
            }) else {
                return;
            };
            if let Some(r) = self.request(id, &m) {
                self.reply(id, reply_to(&m, r));
            }
        }
        // More requests than the budget: continue in the next round.
        self.rekick.push_back(id);
    }

    fn reply(&mut self, id: SgfId, m: CtrlMsg) {
        if let Some(s) = self.sgfs.get_mut(id as usize) {
            s.sgf.reply(m);
        }
    }

    /// One control request; `None` when the reply comes later.
    fn request(&mut self, id: SgfId, m: &CtrlMsg) -> Option<Result<(), ErrorCode>> {
        let Some(op) = CtrlOp::from_u16(m.op) else {
            return Some(Err(ErrorCode::BadRequest));
        };
        match op {
            CtrlOp::Open => Some(self.open(id, m)),
            CtrlOp::Listen => Some(self.listen(id, m)),
            CtrlOp::Connect => self.connect(id, m).transpose(),
            CtrlOp::Accept => self.accept(id, m).transpose(),
            CtrlOp::Close => self.close(id, m).transpose(),
        }
    }

    fn sock_state(&self, id: SgfId, sock: RingId) -> Option<SockState> {
        self.sgfs
            .get(id as usize)?
            .sockets
            .get(&sock)
            .map(|s| s.state)
    }

    fn set_state(&mut self, id: SgfId, sock: RingId, st: SockState) {
        if let Some(s) = self
            .sgfs
            .get_mut(id as usize)
            .and_then(|x| x.sockets.get_mut(&sock))
        {
            s.state = st;
        }
    }

    /// OPEN: validate the two ring descriptors (read once) and register them.
    fn open(&mut self, id: SgfId, m: &CtrlMsg) -> Result<(), ErrorCode> {
        let (tx, rx) = (m.sock, m.aux);
        let slot = self.sgfs.get_mut(id as usize).ok_or(ErrorCode::NotFound)?;
        let sgf = &mut slot.sgf;
        let valid =
            |r: RingId| r >= FIRST_DATA_RING && r != RING_NONE && (r as u32) < sgf.ring_table_len();
        if tx == rx || !valid(tx) || !valid(rx) {
            return Err(ErrorCode::BadRequest);
        }
        if sgf.rings.contains_key(&tx) || sgf.rings.contains_key(&rx) {
            return Err(ErrorCode::Busy);
        }
        if slot.sockets.len() >= limits::MAX_SOCKETS_PER_SGF {
            return Err(ErrorCode::NoSpace);
        }
        let mut geoms = Vec::with_capacity(2);
        for (r, role) in [
            (tx, RingRole::GuestProduces),
            (rx, RingRole::DeviceProduces),
        ] {
            let d = sgf.read_desc(r).ok_or(ErrorCode::Memory)?;
            let label = format!("SGF {} ring {r}", sgf.name);
            let geom = RingGeom::from_desc(&label, &*sgf.mem, &d, role).map_err(|e| e.code())?;
            geoms.push((r, role, geom, label));
        }
        let mut inserted = Vec::new();
        for (_, _, g, label) in &geoms {
            if sgf.ranges.insert(g.base, g.end(), label.clone()).is_err() {
                for b in inserted {
                    sgf.ranges.remove(b);
                }
                return Err(ErrorCode::Overlap);
            }
            inserted.push(g.base);
        }
        for (_, _, g, _) in &geoms {
            if sgf.mem.prepare(g.base, g.size as u64).is_err() {
                for b in inserted {
                    sgf.ranges.remove(b);
                }
                return Err(ErrorCode::Memory);
            }
        }
        for (r, role, g, label) in geoms {
            let view = RingView::new(sgf.mem.clone(), g);
            let k = self
                .engine
                .add_ring(view, label, ((id as u64) << 16) | r as u64);
            sgf.add_ring(r, role, g, k, tx);
        }
        slot.sockets.insert(
            tx,
            Socket {
                tx,
                rx,
                prio: m.prio.min(crate::sched::PRIO_LEVELS - 1),
                state: SockState::Open,
            },
        );
        Ok(())
    }

    fn listen(&mut self, id: SgfId, m: &CtrlMsg) -> Result<(), ErrorCode> {
        match self.sock_state(id, m.sock) {
            None => return Err(ErrorCode::NotFound),
            Some(SockState::Open) => {}
            Some(_) => return Err(ErrorCode::State),
        }
        if m.port == 0 {
            return Err(ErrorCode::BadRequest);
        }
        if self.ports.contains_key(&m.port) {
            return Err(ErrorCode::AddrInUse);
        }
        self.ports.insert(
            m.port,
            Listener {
                sgf: id,
                sock: m.sock,
                accepts: VecDeque::new(),
                backlog: VecDeque::new(),
            },
        );
        self.set_state(id, m.sock, SockState::Listening { port: m.port });
        Ok(())
    }

    fn connect(&mut self, id: SgfId, m: &CtrlMsg) -> Result<Option<()>, ErrorCode> {
        match self.sock_state(id, m.sock) {
            None => return Err(ErrorCode::NotFound),
            Some(SockState::Open) => {}
            Some(_) => return Err(ErrorCode::State),
        }
        let xf = Transform::from_u8(m.xf).ok_or(ErrorCode::BadRequest)?;
        let path = PathKind::from_u8(m.path).ok_or(ErrorCode::BadRequest)?;
        if xf == Transform::Crypto && path == PathKind::Direct {
            return Err(ErrorCode::BadRequest);
        }
        if m.port == 0 {
            self.establish((id, m.sock), None, xf, path)?;
            return Ok(Some(()));
        }
        let lsgf = self.ports.get(&m.port).ok_or(ErrorCode::Refused)?.sgf;
        if !self.links.allowed(self.tenant(id), self.tenant(lsgf)) {
            // Another tenant's port: as if nobody listened (no probing).
            return Err(ErrorCode::Refused);
        }
        let l = self.ports.get_mut(&m.port).ok_or(ErrorCode::Refused)?;
        if let Some((b, breq)) = l.accepts.pop_front() {
            let lsgf = l.sgf;
            self.pair((id, m.sock, m.req_id), (lsgf, b, breq), xf, path);
            return Ok(None);
        }
        if l.backlog.len() >= limits::LISTEN_BACKLOG {
            return Err(ErrorCode::Refused);
        }
        l.backlog.push_back((id, m.sock, m.req_id, xf, path));
        self.set_state(
            id,
            m.sock,
            SockState::Connecting {
                port: m.port,
                req_id: m.req_id,
            },
        );
        Ok(None)
    }

    fn tenant(&self, id: SgfId) -> u32 {
        self.sgfs.get(id as usize).map_or(0, |s| s.sgf.tenant)
    }

    fn accept(&mut self, id: SgfId, m: &CtrlMsg) -> Result<Option<()>, ErrorCode> {
        let port = match self.sock_state(id, m.sock) {
            Some(SockState::Listening { port }) => port,
            None => return Err(ErrorCode::NotFound),
            Some(_) => return Err(ErrorCode::State),
        };
        match self.sock_state(id, m.aux) {
            None => return Err(ErrorCode::NotFound),
            Some(SockState::Open) => {}
            Some(_) => return Err(ErrorCode::State),
        }
        let l = self.ports.get_mut(&port).ok_or(ErrorCode::NotFound)?;
        if let Some((a, asock, areq, xf, path)) = l.backlog.pop_front() {
            self.pair((a, asock, areq), (id, m.aux, m.req_id), xf, path);
        } else {
            l.accepts.push_back((m.aux, m.req_id));
            self.set_state(id, m.aux, SockState::AcceptWait { listener: m.sock });
        }
        Ok(None)
    }

    /// Connects a waiting CONNECT and a waiting ACCEPT; replies to both.
    fn pair(
        &mut self,
        c: (SgfId, RingId, u32),
        a: (SgfId, RingId, u32),
        xf: Transform,
        path: PathKind,
    ) {
        let r = self.establish((c.0, c.1), Some((a.0, a.1)), xf, path);
        if r.is_ok() && c.0 != a.0 {
            self.chains += 1;
            self.crypto_chains += (xf == Transform::Crypto) as u64;
        }
        let msg = |op: CtrlOp, req_id, sock, aux, peer| CtrlMsg {
            op: op as u16 | ctrl::REPLY,
            req_id,
            status: r.err().map_or(0, |e| e as u32),
            sock,
            aux,
            peer_sock: peer,
            ..Default::default()
        };
        if r.is_err() {
            self.set_state(c.0, c.1, SockState::Open);
            self.set_state(a.0, a.1, SockState::Open);
        }
        self.reply(c.0, msg(CtrlOp::Connect, c.2, c.1, 0, a.1));
        self.reply(a.0, msg(CtrlOp::Accept, a.2, a.1, a.1, c.1));
    }

    /// Builds the pipes of a connection between socket `a` and socket `b`
    /// (or `a` with itself: the echo service).
    fn establish(
        &mut self,
        a: (SgfId, RingId),
        b: Option<(SgfId, RingId)>,
        xf: Transform,
        path: PathKind,
    ) -> Result<(), ErrorCode> {
        let conn = self.conns.insert(Conn {
            ends: vec![a],
            pipes: Vec::new(),
            staging: Vec::new(),
            keys: Vec::new(),
            closing: false,
        });
        let dirs = match b {
            None => vec![(a, a)],
            Some(b) => {
                self.conns[conn].ends.push(b);
                vec![(a, b), (b, a)]
            }
        };
        for (from, to) in dirs {
            if let Err(e) = self.direction(conn, from, to, xf, path) {
                self.teardown(conn);
                return Err(e);
            }
        }
        let ends = self.conns[conn].ends.clone();
        for (s, sock) in ends {
            self.set_state(s, sock, SockState::Connected { conn });
        }
        Ok(())
    }

    /// The pipes carrying `from`'s TX ring to `to`'s RX ring.
    fn direction(
        &mut self,
        conn: usize,
        from: (SgfId, RingId),
        to: (SgfId, RingId),
        xf: Transform,
        path: PathKind,
    ) -> Result<(), ErrorCode> {
        let ring_of =
            |d: &Device, (s, sock): (SgfId, RingId), tx: bool| -> Option<(RingId, RingKey)> {
                let slot = d.sgfs.get(s as usize)?;
                let so = slot.sockets.get(&sock)?;
                let r = if tx { so.tx } else { so.rx };
                Some((r, slot.sgf.rings.get(&r)?.engine?))
            };
        let (src_id, src) = ring_of(self, from, true).ok_or(ErrorCode::NotFound)?;
        let (sink_id, sink) = ring_of(self, to, false).ok_or(ErrorCode::NotFound)?;
        let slot = &self.sgfs[from.0 as usize];
        let (tenant, prio) = (slot.sgf.tenant, slot.sockets[&from.1].prio);
        let label = |what: &str| format!("SGF {} socket {} {what}", slot.sgf.name, from.1);
        let spec = |src, sink, xf, key_slot, what: &str| PipeSpec {
            src,
            sink,
            xf,
            tenant,
            prio,
            key_slot,
            max_job: None,
            label: label(what),
            tag: conn as u64,
        };
        let mut specs = Vec::new();
        let (gsrc, gsink) = (Some((from.0, src_id)), Some((to.0, sink_id)));
        match path {
            PathKind::Direct => {
                specs.push((spec(src, sink, Xf::Direct, 0, "direct pipe"), gsrc, gsink))
            }
            PathKind::Staged => {
                let size = self.cfg.staging_ring;
                let addr = self.staging.alloc(size).ok_or(ErrorCode::NoSpace)?;
                let mem: Arc<dyn Memory> = self.staging.clone();
                let geom = RingGeom { base: addr, size };
                let st =
                    self.engine
                        .add_ring(RingView::new(mem, geom), label("staging ring"), u64::MAX);
                self.conns[conn].staging.push((st, addr, size));
                let (x1, x2, key) = match xf {
                    Transform::Copy => (Xf::Copy, Xf::Copy, 0),
                    Transform::Crypto => {
                        let (k, _) = self.keys.alloc_random().ok_or(ErrorCode::NoSpace)?;
                        self.conns[conn].keys.push(k);
                        (Xf::Encrypt, Xf::Decrypt, k)
                    }
                };
                specs.push((spec(src, st, x1, key, "to-staging pipe"), gsrc, None));
                specs.push((spec(st, sink, x2, key, "from-staging pipe"), None, gsink));
            }
        }
        for (s, gs, gk) in specs {
            let pipe = self.engine.add_pipe(s).map_err(|_| ErrorCode::Busy)?;
            self.conns[conn].pipes.push(ConnPipe {
                pipe,
                guest_src: gs,
                guest_sink: gk,
                gone: false,
            });
        }
        Ok(())
    }

    /// Closes a connection's pipes; its ends see `Closed` on their rings.
    fn teardown(&mut self, conn: usize) {
        let Some(c) = self.conns.get_mut(conn) else {
            return;
        };
        if c.closing {
            return;
        }
        c.closing = true;
        let (pipes, ends): (Vec<PipeKey>, Vec<(SgfId, RingId)>) =
            (c.pipes.iter().map(|p| p.pipe).collect(), c.ends.clone());
        for p in pipes {
            let _ = self.engine.close_pipe(p);
        }
        for (s, sock) in ends {
            let Some(slot) = self.sgfs.get_mut(s as usize) else {
                continue;
            };
            let Some(so) = slot.sockets.get_mut(&sock) else {
                continue;
            };
            if let SockState::Connected { conn } = so.state {
                so.state = SockState::PeerClosed { conn };
            }
            let (tx, rx) = (so.tx, so.rx);
            slot.sgf.ring_closed(tx);
            slot.sgf.ring_closed(rx);
        }
        self.finish_conn(conn);
    }

    /// Frees a torn-down connection once all its pipes are gone: staging
    /// rings, key slots, and the replies to CLOSE requests that waited.
    fn finish_conn(&mut self, conn: usize) {
        let done = self.conns.get(conn).is_some_and(|c| {
            c.closing
                && c.pipes
                    .iter()
                    .all(|p| p.gone || self.engine.pipe_state(p.pipe).is_none())
        });
        if !done {
            return;
        }
        let c = self.conns.remove(conn);
        for (k, addr, size) in c.staging {
            if self.engine.remove_ring(k).is_ok() {
                self.staging.free(addr, size);
            }
        }
        for k in c.keys {
            self.keys.remove(k);
        }
        for (s, sock) in c.ends {
            if let Some(SockState::PeerClosed { .. }) = self.sock_state(s, sock) {
                self.set_state(s, sock, SockState::Dead);
            }
            if let Some(SockState::Closing { req_id, .. }) = self.sock_state(s, sock) {
                self.release_socket(s, sock);
                self.reply(
                    s,
                    CtrlMsg {
                        op: CtrlOp::Close as u16 | ctrl::REPLY,
                        req_id,
                        sock,
                        ..Default::default()
                    },
                );
            }
        }
    }

    /// Removes a socket and its rings (no pipe uses them any more).
    fn release_socket(&mut self, id: SgfId, sock: RingId) {
        let Some(slot) = self.sgfs.get_mut(id as usize) else {
            return;
        };
        let Some(s) = slot.sockets.remove(&sock) else {
            return;
        };
        for r in [s.tx, s.rx] {
            if let Some(k) = slot.sgf.remove_ring(r).and_then(|x| x.engine) {
                let _ = self.engine.remove_ring(k);
            }
        }
    }

    fn retire_ring(&mut self, k: RingKey) {
        // A ring still used by a closing pipe goes once the pipe is gone.
        if self.engine.remove_ring(k).is_err() {
            self.orphans.push(k);
        }
    }

    fn unlisten(&mut self, port: u32) {
        let Some(l) = self.ports.remove(&port) else {
            return;
        };
        for (s, sock, req_id, _, _) in l.backlog {
            self.set_state(s, sock, SockState::Open);
            self.reply(
                s,
                CtrlMsg {
                    op: CtrlOp::Connect as u16 | ctrl::REPLY,
                    req_id,
                    status: ErrorCode::Refused as u32,
                    sock,
                    ..Default::default()
                },
            );
        }
        for (sock, req_id) in l.accepts {
            self.set_state(l.sgf, sock, SockState::Open);
            self.reply(
                l.sgf,
                CtrlMsg {
                    op: CtrlOp::Accept as u16 | ctrl::REPLY,
                    req_id,
                    status: ErrorCode::State as u32,
                    sock: l.sock,
                    aux: sock,
                    ..Default::default()
                },
            );
        }
        self.set_state(l.sgf, l.sock, SockState::Open);
    }

    fn close(&mut self, id: SgfId, m: &CtrlMsg) -> Result<Option<()>, ErrorCode> {
        let st = self.sock_state(id, m.sock).ok_or(ErrorCode::NotFound)?;
        match st {
            SockState::Connected { conn } | SockState::PeerClosed { conn } => {
                self.set_state(
                    id,
                    m.sock,
                    SockState::Closing {
                        conn,
                        req_id: m.req_id,
                    },
                );
                if self.conns.get(conn).is_some_and(|c| c.closing) {
                    self.finish_conn(conn);
                } else {
                    self.teardown(conn);
                }
                return Ok(None);
            }
            SockState::Closing { .. } => return Err(ErrorCode::State),
            SockState::Dead => {}
            SockState::Listening { port } => self.unlisten(port),
            SockState::Connecting { port, .. } => {
                if let Some(l) = self.ports.get_mut(&port) {
                    l.backlog.retain(|c| !(c.0 == id && c.1 == m.sock));
                }
            }
            SockState::AcceptWait { listener } => {
                if let Some(SockState::Listening { port }) = self.sock_state(id, listener) {
                    if let Some(l) = self.ports.get_mut(&port) {
                        l.accepts.retain(|a| a.0 != m.sock);
                    }
                }
            }
            SockState::Open => {}
        }
        self.release_socket(id, m.sock);
        Ok(Some(()))
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
