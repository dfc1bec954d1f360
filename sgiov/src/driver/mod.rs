//! The guest side of an SG function, in Rust: what the built-in agent's C
//! warp-pipe driver does, step for step (docs/sgiov.md, "Guest driver"), and
//! what stage 2's host frontend wraps with vhost-user. It sets up the area,
//! opens sockets (a TX and an RX ring each), sends and receives bytes, and
//! exchanges signals with the device over the Cross-FIFO.
//!
//! The transport is left to the caller: [`Driver::flush`] says when to ring
//! the doorbell, and [`Driver::interrupt`] is what to run when the device's
//! interrupt arrives. The driver trusts the device (as a guest trusts its
//! NIC); the device trusts nothing the driver writes.//!
//! This file: the driver's state, area set-up and the control requests
//! that open, connect and close sockets. Moving bytes, the doorbell, the
//! interrupt handler and the per-pipe channels are in `io.rs`.

mod io;

use std::collections::HashMap;
use std::sync::Arc;

use vm_memory::{ByteValued, Bytes};

use crate::dedicated::{channel_bytes, GuestChannel, MAX_CHANNELS};
use crate::fifo::{FifoConsumer, FifoError, FifoProducer};
use crate::layout::{
    ctrl, ring as rd, CtrlMsg, CtrlOp, ErrorCode, Layout, PathKind, RingDesc, RingRole, SetupCmd,
    Transform, CTRL_REPLY_RING, CTRL_REQ_RING, FIRST_DATA_RING, SETUP_ATTACH, SETUP_MAGIC,
};
use crate::mem::{BlockAlloc, MemError, Memory};
use crate::ring::{RingGeom, RingView};
use crate::signal::{RingId, Signal, SignalType, SignalWord};

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("driver: {0}")]
    Memory(#[from] MemError),
    #[error("driver: {0}")]
    Fifo(#[from] FifoError),
    #[error("driver: out of {0}")]
    Exhausted(&'static str),
    #[error("driver: socket {0} does not exist")]
    NoSocket(RingId),
}

#[derive(Debug, Clone, Copy)]
pub struct DriverConfig {
    pub fifo_entries: u32,
    pub table_entries: u32,
    pub ctrl_ring: u32,
    /// `dedicated` signal mode: sockets with their own signal channel (at
    /// most [`MAX_CHANNELS`]; 0 = every signal over the Cross-FIFO), and
    /// the slots of each channel FIFO.
    pub channels: u32,
    pub chan_entries: u32,
}

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig {
            fifo_entries: 4096,
            table_entries: 8194,
            ctrl_ring: 64 << 10,
            channels: 0,
            chan_entries: 64,
        }
    }
}

/// A socket's state as the guest knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SockState {
    /// OPEN sent, no reply yet.
    Opening,
    Open,
    /// The device reported an error on one of its rings.
    Error(ErrorCode),
    /// The peer (or the device) closed it; only CLOSE is left to do.
    Closed,
    /// CLOSE sent; its rings are freed with the reply.
    Closing,
}

#[derive(Debug)]
struct DrvRing {
    id: RingId,
    view: RingView,
    /// The guest's pointer (head of TX, tail of RX).
    ours: u32,
    /// The device's pointer as last signalled (tail of TX, head of RX).
    theirs: u32,
}

#[derive(Debug)]
struct DrvSock {
    tx: DrvRing,
    rx: DrvRing,
    state: SockState,
    /// Its own signal channel (`dedicated` mode).
    chan: Option<u16>,
}

#[derive(Debug)]
pub struct Driver {
    mem: Arc<dyn Memory>,
    area: u64,
    layout: Layout,
    g2d: FifoProducer,
    d2g: FifoConsumer,
    heap: BlockAlloc,
    req: DrvRing,
    rep: DrvRing,
    socks: HashMap<RingId, DrvSock>,
    /// Ring id → socket id, for the words of RX rings.
    ring_sock: HashMap<RingId, RingId>,
    free_ids: Vec<RingId>,
    next_id: u32,
    next_req: u32,
    replies: HashMap<u32, CtrlMsg>,
    /// Words that did not fit the FIFO yet.
    backlog: Vec<SignalWord>,
    kick: bool,
    /// `dedicated` mode: the channel array, the open channels, the free
    /// ones, those written since the last flush, those whose doorbell must
    /// ring.
    chan_gpa: u64,
    chan_entries: u32,
    chans: HashMap<u16, GuestChannel>,
    free_chans: Vec<u16>,
    dirty_chans: Vec<u16>,
    chan_kicks: Vec<u16>,
}

impl Driver {
    /// Lays out an area at `area` (4 KiB aligned) and a heap for ring
    /// buffers at `[heap, heap+heap_len)`, writes the header, the FIFOs'
    /// guest-owned fields and the control ring descriptors. Returns the
    /// driver and the setup command to give the device.
    pub fn new(
        mem: Arc<dyn Memory>,
        area: u64,
        heap: u64,
        heap_len: u64,
        cfg: DriverConfig,
    ) -> Result<(Driver, SetupCmd), DriverError> {
        let layout = Layout::canonical(cfg.fifo_entries, cfg.table_entries);
        let a = mem.for_write(area, layout.area_len as usize)?;
        a.write_slice(&vec![0u8; layout.area_len as usize], 0)
            .map_err(|_| DriverError::Exhausted("area"))?;
        a.write_obj(layout.header(), 0)
            .map_err(|_| DriverError::Exhausted("area"))?;
        let g2d = FifoProducer::new(
            "guest g2d".into(),
            mem.clone(),
            area + layout.g2d_off as u64,
            layout.g2d_entries,
        )?;
        let d2g = FifoConsumer::new(
            "guest d2g".into(),
            mem.clone(),
            area + layout.d2g_off as u64,
            layout.d2g_entries,
            1,
        )?;
        let mut heap = BlockAlloc::new(heap, heap_len);
        let mut ring = |id, role: RingRole, size: u32| -> Result<DrvRing, DriverError> {
            let base = heap
                .alloc(size as u64)
                .ok_or(DriverError::Exhausted("ring memory"))?;
            let d = RingDesc {
                base,
                size,
                role: role as u32,
                ..Default::default()
            };
            mem.for_write(area + layout.desc_off(id), rd::BYTES as usize)?
                .write_obj(d, 0)
                .map_err(|_| DriverError::Exhausted("ring table"))?;
            Ok(DrvRing {
                id,
                view: RingView::new(mem.clone(), RingGeom { base, size }),
                ours: 0,
                theirs: 0,
            })
        };
        let req = ring(CTRL_REQ_RING, RingRole::GuestProduces, cfg.ctrl_ring)?;
        let rep = ring(CTRL_REPLY_RING, RingRole::DeviceProduces, cfg.ctrl_ring)?;
        let channels = cfg.channels.min(MAX_CHANNELS as u32);
        let chan_gpa = if channels > 0 {
            let len = (channels as u64 * channel_bytes(cfg.chan_entries)).next_power_of_two();
            heap.alloc(len)
                .ok_or(DriverError::Exhausted("channel memory"))?
        } else {
            0
        };
        let setup = SetupCmd {
            magic: SETUP_MAGIC,
            op: SETUP_ATTACH,
            area_gpa: area,
            area_len: layout.area_len,
            chan_entries: if channels > 0 { cfg.chan_entries } else { 0 },
            chan_gpa,
        };
        Ok((
            Driver {
                mem,
                area,
                layout,
                g2d,
                d2g,
                heap,
                req,
                rep,
                socks: HashMap::new(),
                ring_sock: HashMap::new(),
                free_ids: Vec::new(),
                next_id: FIRST_DATA_RING as u32,
                next_req: 1,
                replies: HashMap::new(),
                backlog: Vec::new(),
                kick: false,
                chan_gpa,
                chan_entries: cfg.chan_entries,
                chans: HashMap::new(),
                free_chans: (0..channels as u16).rev().collect(),
                dirty_chans: Vec::new(),
                chan_kicks: Vec::new(),
            },
            setup,
        ))
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    fn signal(&mut self, ty: SignalType, ring: RingId, ptr: u32) -> Result<(), DriverError> {
        let w = Signal::new(ty, ring, ptr).word();
        let chan = self
            .ring_sock
            .get(&ring)
            .and_then(|s| self.socks.get(s))
            .and_then(|s| s.chan);
        if let Some(k) = chan {
            return self.channel_word(k, w);
        }
        if !self.backlog.is_empty() || !self.g2d.push(w)? {
            self.backlog.push(w);
        }
        Ok(())
    }

    fn request(&mut self, mut m: CtrlMsg) -> Result<u32, DriverError> {
        if self.req.view.geom.size - self.req.ours.wrapping_sub(self.req.theirs) < ctrl::MSG_BYTES {
            return Err(DriverError::Exhausted("control ring space"));
        }
        m.req_id = self.next_req;
        self.next_req = self.next_req.wrapping_add(1).max(1);
        self.req.view.write(self.req.ours, m.as_slice())?;
        self.req.ours = self.req.ours.wrapping_add(ctrl::MSG_BYTES);
        self.signal(SignalType::Head, CTRL_REQ_RING, self.req.ours)?;
        Ok(m.req_id)
    }

    fn alloc_id(&mut self) -> Result<RingId, DriverError> {
        if let Some(id) = self.free_ids.pop() {
            return Ok(id);
        }
        if self.next_id >= self.layout.table_entries.min(0xFFFF) {
            return Err(DriverError::Exhausted("ring ids"));
        }
        self.next_id += 1;
        Ok((self.next_id - 1) as RingId)
    }

    fn new_ring(&mut self, role: RingRole, size: u32) -> Result<DrvRing, DriverError> {
        let id = self.alloc_id()?;
        let Some(base) = self.heap.alloc(size as u64) else {
            self.free_ids.push(id);
            return Err(DriverError::Exhausted("ring memory"));
        };
        let d = RingDesc {
            base,
            size,
            role: role as u32,
            ..Default::default()
        };
        self.mem
            .for_write(self.area + self.layout.desc_off(id), rd::BYTES as usize)?
            .write_obj(d, 0)
            .map_err(|_| DriverError::Exhausted("ring table"))?;
        Ok(DrvRing {
            id,
            view: RingView::new(self.mem.clone(), RingGeom { base, size }),
            ours: 0,
            theirs: 0,
        })
    }

    /// Opens a socket: allocates its TX and RX rings, fills their
    /// descriptors and sends OPEN. Returns the socket id (its TX ring id)
    /// and the request id.
    pub fn open(
        &mut self,
        tx_size: u32,
        rx_size: u32,
        prio: u8,
    ) -> Result<(RingId, u32), DriverError> {
        let tx = self.new_ring(RingRole::GuestProduces, tx_size)?;
        let rx = self.new_ring(RingRole::DeviceProduces, rx_size)?;
        self.open_rings(tx, rx, prio)
    }

    /// Fault injection for tests: sends OPEN for ring ids whose descriptors
    /// are written exactly as given. The driver does not track the socket.
    pub fn open_raw(
        &mut self,
        tx: (RingId, RingDesc),
        rx: (RingId, RingDesc),
    ) -> Result<u32, DriverError> {
        for (id, d) in [tx, rx] {
            if (id as u32) < self.layout.table_entries {
                self.mem
                    .for_write(self.area + self.layout.desc_off(id), rd::BYTES as usize)?
                    .write_obj(d, 0)
                    .map_err(|_| DriverError::Exhausted("ring table"))?;
            }
        }
        self.request(CtrlMsg {
            op: CtrlOp::Open as u16,
            sock: tx.0,
            aux: rx.0,
            ..Default::default()
        })
    }

    /// The socket's (TX, RX) ring ids.
    pub fn rings(&self, sock: RingId) -> Option<(RingId, RingId)> {
        self.socks.get(&sock).map(|s| (s.tx.id, s.rx.id))
    }

    /// The guest-physical bases of the socket's (TX, RX) rings.
    pub fn ring_bases(&self, sock: RingId) -> Option<(u64, u64)> {
        self.socks
            .get(&sock)
            .map(|s| (s.tx.view.geom.base, s.rx.view.geom.base))
    }

    fn open_rings(
        &mut self,
        tx: DrvRing,
        rx: DrvRing,
        prio: u8,
    ) -> Result<(RingId, u32), DriverError> {
        let sock = tx.id;
        // `dedicated` mode: the socket's own channel, fresh guest fields.
        let chan = match self.free_chans.pop() {
            Some(k) => {
                let at = self.chan_gpa + k as u64 * channel_bytes(self.chan_entries);
                match GuestChannel::new(self.mem.clone(), at, self.chan_entries) {
                    Ok(c) => {
                        self.chans.insert(k, c);
                        Some(k)
                    }
                    Err(e) => {
                        self.free_chans.push(k);
                        return Err(e.into());
                    }
                }
            }
            None if self.chan_gpa != 0 => return Err(DriverError::Exhausted("channels")),
            None => None,
        };
        self.ring_sock.insert(tx.id, sock);
        self.ring_sock.insert(rx.id, sock);
        let m = CtrlMsg {
            op: CtrlOp::Open as u16,
            sock,
            aux: rx.id,
            prio,
            chan: chan.map_or(0, |k| k as u8 + 1),
            ..Default::default()
        };
        self.socks.insert(
            sock,
            DrvSock {
                tx,
                rx,
                state: SockState::Opening,
                chan,
            },
        );
        Ok((sock, self.request(m)?))
    }

    pub fn listen(&mut self, sock: RingId, port: u32) -> Result<u32, DriverError> {
        self.request(CtrlMsg {
            op: CtrlOp::Listen as u16,
            sock,
            port,
            ..Default::default()
        })
    }

    pub fn connect(
        &mut self,
        sock: RingId,
        port: u32,
        xf: Transform,
        path: PathKind,
    ) -> Result<u32, DriverError> {
        self.request(CtrlMsg {
            op: CtrlOp::Connect as u16,
            sock,
            port,
            xf: xf as u8,
            path: path as u8,
            ..Default::default()
        })
    }

    /// Offers `new_sock` (open, unconnected) to the listener `sock` for
    /// the next incoming connection.
    pub fn accept(&mut self, sock: RingId, new_sock: RingId) -> Result<u32, DriverError> {
        self.request(CtrlMsg {
            op: CtrlOp::Accept as u16,
            sock,
            aux: new_sock,
            ..Default::default()
        })
    }

    pub fn close(&mut self, sock: RingId) -> Result<u32, DriverError> {
        let s = self
            .socks
            .get_mut(&sock)
            .ok_or(DriverError::NoSocket(sock))?;
        s.state = SockState::Closing;
        self.request(CtrlMsg {
            op: CtrlOp::Close as u16,
            sock,
            ..Default::default()
        })
    }
}
