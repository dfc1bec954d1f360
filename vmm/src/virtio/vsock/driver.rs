//! A model of the driver side of the device's three queues in guest
//! memory, and the device's engine driven one round at a time: shared by
//! the unit tests and the fuzz target (`fuzz::fuzz_vsock`). The layout is
//! Linux 6.1's by default (an RX buffer is a 44-byte header descriptor and
//! a data descriptor; a TX packet its header and, with data, a second
//! descriptor); raw chains of any shape can be posted too.
// A harness (unit tests, the fuzz target) over guest memory it laid out
// itself: a failed access there is a harness bug, so it unwraps.
#![allow(clippy::unwrap_used)]

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::packet::*;
use super::worker::{Engine, Parts};
use super::*;

pub const CID: u64 = 3;
pub const QSIZE: u16 = 64;
/// Chains a queue can have outstanding (two descriptors each).
pub const CHAINS: u16 = QSIZE / 2;
pub const MEM: usize = 32 << 20;
pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;
#[cfg(test)]
pub const F_INDIRECT: u16 = 4;
pub const RX: usize = 0;
pub const TX: usize = 1;
pub const EVQ: usize = 2;

pub fn qbase(q: usize) -> u64 {
    0x10000 * (q as u64 + 1)
}

/// Buffer area of chain slot `slot` of queue `q` (128 KiB each).
pub fn buf(q: usize, slot: u16) -> u64 {
    0x10_0000 + q as u64 * 0x80_0000 + u64::from(slot) * 0x2_0000
}

/// The guest: its memory and its driver's view of the three queues.
pub struct Guest {
    pub mem: GuestMemoryMmap,
    avail: [u16; 3],
    used_seen: [u16; 3],
    /// RX: where the payload of the chain at each head starts, and the
    /// chain's capacity (raw chains are not in it).
    payload_at: std::collections::HashMap<u16, (u64, u32)>,
    /// Our receive buffer and how much of it the guest consumed.
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl Guest {
    pub fn new() -> Self {
        Guest {
            mem: GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM)]).unwrap(),
            avail: [0; 3],
            used_seen: [0; 3],
            payload_at: Default::default(),
            buf_alloc: 256 << 10,
            fwd_cnt: 0,
        }
    }

    /// The device's copy of queue `q` (as the transport hands it over).
    pub fn queue(&self, q: usize) -> Queue {
        let mut queue = Queue::new(QUEUE_MAX_SIZE).unwrap();
        queue.set_size(QSIZE);
        let b = qbase(q) as u32;
        queue.set_desc_table_address(Some(b), Some(0));
        queue.set_avail_ring_address(Some(b + 0x1000), Some(0));
        queue.set_used_ring_address(Some(b + 0x2000), Some(0));
        queue.set_ready(true);
        assert!(queue.is_valid(&self.mem));
        queue
    }

    fn desc(&self, q: usize, idx: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = GuestAddress(qbase(q) + 16 * u64::from(idx % QSIZE));
        let m = &self.mem;
        m.write_obj(addr, at).unwrap();
        m.write_obj(len, GuestAddress(at.0 + 8)).unwrap();
        m.write_obj(flags, GuestAddress(at.0 + 12)).unwrap();
        m.write_obj(next, GuestAddress(at.0 + 14)).unwrap();
    }

    fn publish(&mut self, q: usize, head: u16) {
        let a = self.avail[q];
        let slot = GuestAddress(qbase(q) + 0x1000 + 4 + 2 * u64::from(a % QSIZE));
        self.mem.write_obj(head, slot).unwrap();
        self.avail[q] = a.wrapping_add(1);
        self.mem
            .write_obj(self.avail[q], GuestAddress(qbase(q) + 0x1002))
            .unwrap();
    }

    /// Chains that may still be posted on `q`.
    pub fn free(&self, q: usize) -> u16 {
        CHAINS - self.avail[q].wrapping_sub(self.used_seen[q]).min(CHAINS)
    }

    /// The slot of the next chain of `q` (its descriptors are 2*slot, 2*slot+1).
    fn slot(&self, q: usize) -> u16 {
        let out = self.avail[q].wrapping_sub(self.used_seen[q]);
        assert!(out < CHAINS, "queue {q}: {out} chains outstanding");
        self.avail[q] % CHAINS
    }

    /// The buffer area of the next chain of `q`.
    pub fn next_buf(&self, q: usize) -> u64 {
        buf(q, self.slot(q))
    }

    /// Forgets the rings (a driver reset): indexes back to 0 in memory and here.
    pub fn reset_queues(&mut self) {
        for q in 0..3 {
            self.mem
                .write_slice(&[0u8; 0x3000], GuestAddress(qbase(q)))
                .unwrap();
        }
        self.avail = [0; 3];
        self.used_seen = [0; 3];
    }

    /// Posts `n` RX buffers as Linux 6.1 does: header and `len` data bytes
    /// in two descriptors.
    pub fn post_rx(&mut self, n: usize, len: u32) {
        for _ in 0..n {
            let s = self.slot(RX);
            let (h, b) = (2 * s, buf(RX, s));
            self.desc(RX, h, b, HDR_LEN as u32, F_WRITE | F_NEXT, h + 1);
            self.desc(RX, h + 1, b + 64, len, F_WRITE, 0);
            self.payload_at.insert(h, (b + 64, HDR_LEN as u32 + len));
            self.publish(RX, h);
        }
    }

    /// Posts RX buffers (as `post_rx`) until the queue is full.
    #[cfg(test)]
    pub fn fill_rx(&mut self, len: u32) {
        let out = self.avail[RX].wrapping_sub(self.used_seen[RX]);
        self.post_rx(usize::from(CHAINS - 1 - out), len);
    }

    /// Posts one RX buffer of `len` bytes in one descriptor (later kernels).
    pub fn post_rx_one(&mut self, len: u32) {
        let s = self.slot(RX);
        let (h, b) = (2 * s, buf(RX, s));
        self.desc(RX, h, b, len, F_WRITE, 0);
        self.payload_at.insert(h, (b + HDR_LEN as u64, len));
        self.publish(RX, h);
    }

    /// Posts a chain of raw descriptors (addr, len, flags, next relative to
    /// the slot's first descriptor) on queue `q`.
    pub fn post_raw(&mut self, q: usize, descs: &[(u64, u32, u16, u16)]) {
        let s = self.slot(q);
        let h = 2 * s;
        if q == RX {
            self.payload_at.remove(&h);
        }
        for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
            self.desc(q, h + i as u16, addr, len, flags, h.wrapping_add(next));
        }
        self.publish(q, h);
    }

    /// Sends a packet: header and payload in two descriptors (one without payload).
    pub fn send(&mut self, h: &Header, payload: &[u8]) {
        let s = self.slot(TX);
        let (d, b) = (2 * s, buf(TX, s));
        self.mem
            .write_slice(&h.to_bytes(), GuestAddress(b))
            .unwrap();
        if payload.is_empty() {
            self.desc(TX, d, b, HDR_LEN as u32, 0, 0);
        } else {
            self.mem.write_slice(payload, GuestAddress(b + 64)).unwrap();
            self.desc(TX, d, b, HDR_LEN as u32, F_NEXT, d + 1);
            self.desc(TX, d + 1, b + 64, payload.len() as u32, 0, 0);
        }
        self.publish(TX, d);
    }

    /// A header from the guest (its CID and receive buffer) to the host.
    pub fn hdr(&self, op: u16, src_port: u32, dst_port: u32) -> Header {
        Header {
            src_cid: CID,
            dst_cid: HOST_CID,
            src_port,
            dst_port,
            len: 0,
            type_: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: self.buf_alloc,
            fwd_cnt: self.fwd_cnt,
        }
    }

    /// Sends `data` on connection `key` (host port `key.local`).
    #[cfg(test)]
    pub fn send_data(&mut self, key: conn::Key, data: &[u8]) {
        let mut h = self.hdr(OP_RW, key.peer, key.local);
        h.len = data.len() as u32;
        self.send(&h, data);
    }

    /// New used elements of queue `q`: (head, len).
    pub fn used(&mut self, q: usize) -> Vec<(u16, u32)> {
        let ring = qbase(q) + 0x2000;
        let idx: u16 = self.mem.read_obj(GuestAddress(ring + 2)).unwrap();
        let mut out = Vec::new();
        while self.used_seen[q] != idx {
            let e = ring + 4 + 8 * u64::from(self.used_seen[q] % QSIZE);
            let id: u32 = self.mem.read_obj(GuestAddress(e)).unwrap();
            let len: u32 = self.mem.read_obj(GuestAddress(e + 4)).unwrap();
            out.push((id as u16, len));
            self.used_seen[q] = self.used_seen[q].wrapping_add(1);
        }
        out
    }

    /// Packets the device put into RX buffers since the last call (raw
    /// chains left out): the used length must be the header's and fit.
    pub fn recv(&mut self) -> Vec<(Header, Vec<u8>)> {
        let used = self.used(RX);
        let mut out = Vec::new();
        for (head, len) in used {
            let Some(&(payload_at, capacity)) = self.payload_at.get(&head) else {
                continue;
            };
            if len == 0 {
                continue;
            }
            let mut raw = [0u8; HDR_LEN];
            self.mem
                .read_slice(&mut raw, GuestAddress(buf(RX, head / 2)))
                .unwrap();
            let h = Header::from_bytes(&raw);
            assert_eq!(len as usize, HDR_LEN + h.len as usize, "used length");
            assert!(len <= capacity, "{len} bytes in a chain of {capacity}");
            let mut data = vec![0u8; h.len as usize];
            self.mem
                .read_slice(&mut data, GuestAddress(payload_at))
                .unwrap();
            out.push((h, data));
        }
        out
    }

    /// TX chains the device returned since the last call (their count).
    pub fn tx_done(&mut self) -> usize {
        self.used(TX).len()
    }
}

/// The engine of a device over a guest's queues, its socket at `dir/v.sock`.
pub struct Dev {
    pub e: Engine,
    pub path: PathBuf,
    pub counters: Arc<VsockCounters>,
    listener: Arc<UnixListener>,
    limits: Limits,
    _file: SocketFile,
    events: Vec<EpollEvent>,
}

fn engine(
    g: &Guest,
    path: &Path,
    listener: &Arc<UnixListener>,
    counters: &Arc<VsockCounters>,
    limits: Limits,
    reset_event: bool,
) -> Engine {
    let epoll = Epoll::new().unwrap();
    epoll
        .ctl(
            ControlOperation::Add,
            listener.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_LISTENER),
        )
        .unwrap();
    let prepare: Arc<PrepareWrite> = Arc::new(|_, _| Ok(()));
    let parts = Parts {
        cid: CID,
        path: path.to_path_buf(),
        listener: listener.clone(),
        mem: g.mem.clone(),
        prepare,
        features: VSOCK_FEATURES,
        rx: g.queue(RX),
        tx: g.queue(TX),
        event: g.queue(EVQ),
        interrupt: Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap())),
        counters: counters.clone(),
        limits,
        reset_event,
    };
    Engine::new(parts, epoll)
}

/// A device over `g`'s queues (as activated), listening at `dir/v.sock`.
pub fn dev(g: &Guest, dir: &Path, limits: Limits) -> Dev {
    let path = dir.join("v.sock");
    let (listener, file) = bind(&path).unwrap();
    let listener = Arc::new(listener);
    let counters: Arc<VsockCounters> = Arc::default();
    Dev {
        e: engine(g, &path, &listener, &counters, limits, false),
        path,
        counters,
        listener,
        limits,
        _file: file,
        events: vec![EpollEvent::default(); 64],
    }
}

#[cfg(test)]
pub fn limits() -> Limits {
    Limits {
        max_connections: MAX_CONNECTIONS,
        connect_timeout: Duration::from_millis(200),
        close_timeout: Duration::from_millis(200),
    }
}

impl Dev {
    /// Lets the device handle everything that is ready (Unix sockets are
    /// synchronous: what a host process wrote is readable at once).
    pub fn pump(&mut self) {
        for _ in 0..4 {
            assert!(self.e.turn(0, &mut self.events, &[]));
        }
    }

    /// Waits `ms` for fds, then one round (deadlines).
    #[cfg(test)]
    pub fn wait(&mut self, ms: i32) {
        assert!(self.e.turn(ms, &mut self.events, &[]));
    }

    #[cfg(test)]
    pub fn count(&self, c: impl Fn(&VsockCounters) -> &AtomicU64) -> u64 {
        VsockCounters::get(c(&self.counters))
    }

    pub fn conns(&self) -> usize {
        self.e.mux.len()
    }

    /// A device reset and re-activation on `g`'s (new) queues: every
    /// connection closed, a TRANSPORT_RESET event owed.
    pub fn restart(&mut self, g: &Guest) {
        let e = engine(
            g,
            &self.path,
            &self.listener,
            &self.counters,
            self.limits,
            true,
        );
        self.e = e;
    }
}
