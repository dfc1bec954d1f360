//! Fuzz body of the vsock device: `vmm::fuzz::fuzz_vsock`, run by the
//! cargo-fuzz target `vsock` in `fuzz/` and by the corpus replay test
//! (docs/fuzzing.md). The input is a program for a hostile guest and host
//! around one device (the engine driven one round at a time, real Unix
//! sockets in a fresh directory): TX packets with chosen header fields and
//! chain shapes, RX and event buffers, raw descriptor chains, host clients
//! connecting to `PATH` with any first line, writing, shutting down and
//! closing, listeners at `PATH_<port>`, rounds, deadlines passing, device
//! resets.
//!
//! Besides "no panic, no hang" it checks what the device promises: every
//! packet it sends is from CID 2 to the guest's CID, a stream packet with a
//! known op, `len` 0 unless RW and equal to the used length minus the
//! header, within the RX buffer; no RW ever exceeds the credit the guest
//! last advertised on its connection (`buf_alloc - (sent - fwd_cnt)`); the
//! connections never exceed the cap; every TX chain comes back in the round
//! it was posted in; a re-activation delivers TRANSPORT_RESET.
// The fuzz body reads and writes guest memory it laid out itself: a failed
// access there is a harness bug, so it unwraps.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};

use super::conn::{Key, BUF_ALLOC};
use super::driver::*;
use super::packet::*;
use super::socket::{self, Connect};
use super::Limits;

/// Connections the fuzzed device allows (small, so the cap is reached).
const FUZZ_MAX_CONNECTIONS: usize = 8;
/// Where raw (hostile) buffers point inside guest memory: away from the
/// rings and the model's own buffers.
const RAW_BASE: u64 = 0x1c0_0000;
const RAW_SPAN: u64 = 0x40_0000;
/// Ops per input, at most.
const MAX_OPS: usize = 512;

struct Cur<'a> {
    d: &'a [u8],
    i: usize,
}

impl Cur<'_> {
    fn u8(&mut self) -> u8 {
        let v = self.d.get(self.i).copied().unwrap_or(0);
        self.i += 1;
        v
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn done(&self) -> bool {
        self.i >= self.d.len()
    }
}

/// A directory of its own per input, removed afterwards.
struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Fuzz {
    g: Guest,
    d: Dev,
    hosts: Vec<UnixStream>,
    accepted: Vec<UnixStream>,
    listeners: Vec<(u32, UnixListener)>,
    /// What the guest last advertised per connection (buf_alloc, fwd_cnt).
    told: HashMap<Key, (u32, u32)>,
    /// RW bytes the device sent on the connection's current incarnation.
    sent: HashMap<Key, u32>,
    /// Host ports of the device's REQUESTs (host-initiated connections).
    host_ports: Vec<u32>,
    /// A raw TX chain was posted: its head may be outside the ring (never returned).
    raw_tx: bool,
}

impl Fuzz {
    fn port(&mut self, sel: u8, raw: u32, guest: bool) -> u32 {
        match (sel % 4, guest) {
            (0, true) => 40000,
            (1, true) => 40001,
            (2, true) => 1024,
            (0, false) => 5000,
            (1, false) => 5001,
            (2, false) => self
                .host_ports
                .get(raw as usize % self.host_ports.len().max(1))
                .copied()
                .unwrap_or(1 << 30),
            _ => raw,
        }
    }

    fn tx_packet(&mut self, c: &mut Cur) {
        let (sel, op, sp, dp) = (c.u8(), c.u8(), c.u8(), c.u8());
        let (flags, ba, fc, plen) = (c.u8(), c.u8(), c.u8(), c.u16());
        let raw = c.u32();
        let src_port = self.port(sp, raw, true);
        let dst_port = self.port(dp, raw, false);
        let key = Key {
            local: dst_port,
            peer: src_port,
        };
        let mut h = self.g.hdr((op % 9).into(), src_port, dst_port);
        h.flags = flags.into();
        h.buf_alloc = [0, 4096, 256 << 10, raw][usize::from(ba % 4)];
        h.fwd_cnt = match fc % 3 {
            0 => self.sent.get(&key).copied().unwrap_or(0),
            1 => 0,
            _ => raw,
        };
        if sel & 1 != 0 {
            h.src_cid = u64::from(raw);
        }
        if sel & 2 != 0 {
            h.dst_cid = [0, 1, 3, 4, u64::MAX][usize::from(flags % 5)];
        }
        if sel & 4 != 0 {
            h.type_ = 2;
        }
        let payload = vec![0x5a; usize::from(plen % 6000)];
        h.len = if h.op == OP_RW {
            payload.len() as u32
        } else {
            0
        };
        if sel & 32 != 0 {
            h.len = raw;
        }
        if self.g.free(TX) == 0 {
            return;
        }
        // Payload bytes the chain holds after the header; None: a bad chain.
        let have = match (sel >> 3) & 3 {
            0 => {
                let data: &[u8] = if h.op == OP_RW { &payload } else { &[] };
                self.g.send(&h, data);
                Some(data.len())
            }
            layout => {
                let b = self.g.next_buf(TX);
                self.g
                    .mem
                    .write_slice(&h.to_bytes(), GuestAddress(b))
                    .unwrap();
                let total = (HDR_LEN + payload.len()) as u32;
                let descs = match layout {
                    1 => vec![(b, total, 0, 0)],
                    2 => vec![(b, total, 2, 0)], // device-writable
                    _ => vec![(b, 20, 0, 0)],    // shorter than a header
                };
                self.g.post_raw(TX, &descs);
                (layout == 1).then_some(payload.len())
            }
        };
        // What the device accepts, and so updates the connection's credit from.
        let accepted = have.is_some_and(|n| h.len as usize <= n)
            && h.src_cid == CID
            && h.dst_cid == HOST_CID
            && h.type_ == TYPE_STREAM;
        if accepted {
            self.told.insert(key, (h.buf_alloc, h.fwd_cnt));
        }
    }

    fn raw_chain(&mut self, c: &mut Cur) {
        let q = usize::from(c.u8() % 3);
        let n = usize::from(c.u8() % 3) + 1;
        let mut descs = Vec::new();
        for _ in 0..n {
            let (sel, off, len, flags, next) = (c.u8(), c.u16(), c.u32(), c.u16(), c.u8());
            let addr = match sel % 4 {
                0 | 1 => RAW_BASE + (u64::from(off) * 64) % RAW_SPAN,
                2 => MEM as u64 - 8,
                _ => u64::MAX - 8,
            };
            let len = if sel & 4 != 0 { len } else { len % 0x2_0000 };
            descs.push((addr, len, flags & 7, u16::from(next % 4)));
        }
        if self.g.free(q) == 0 {
            return;
        }
        self.raw_tx |= q == TX;
        self.g.post_raw(q, &descs);
    }

    fn host_connect(&mut self, c: &mut Cur) {
        let (sel, port, n) = (c.u8(), c.u32(), c.u8());
        if self.hosts.len() >= 16 {
            return;
        }
        let Connect::Connected(mut s) = socket::connect(&self.d.path) else {
            return;
        };
        let _ = match sel % 3 {
            0 => {
                let port = [1024, 1025, port][usize::from(n % 3)];
                s.write(format!("CONNECT {port}\n").as_bytes())
            }
            1 => {
                let bytes: Vec<u8> = (0..n % 40).map(|_| c.u8()).collect();
                s.write(&bytes)
            }
            _ => Ok(0),
        };
        self.hosts.push(s);
    }

    /// The host streams of one kind, the one `idx` picks moved first.
    fn stream(&mut self, accepted: bool, idx: u8) -> Option<&mut Vec<UnixStream>> {
        let v = if accepted {
            &mut self.accepted
        } else {
            &mut self.hosts
        };
        if v.is_empty() {
            return None;
        }
        let i = usize::from(idx) % v.len();
        v.swap(0, i);
        Some(v)
    }

    fn host_write(&mut self, c: &mut Cur, accepted: bool) {
        let (idx, len) = (c.u8(), c.u16());
        if let Some(v) = self.stream(accepted, idx) {
            let _ = v[0].write(&vec![0xa5; usize::from(len % 20000)]);
        }
    }

    fn host_shutdown(&mut self, c: &mut Cur, accepted: bool) {
        let (idx, how) = (c.u8(), c.u8());
        if let Some(v) = self.stream(accepted, idx) {
            match how % 3 {
                0 => drop(v[0].shutdown(Shutdown::Write)),
                1 => drop(v[0].shutdown(Shutdown::Read)),
                _ => drop(v.swap_remove(0)),
            }
        }
    }

    fn listener(&mut self, c: &mut Cur) {
        let port = [5000, 5001][usize::from(c.u8() % 2)];
        let path = socket::port_path(&self.d.path, port);
        if let Some(i) = self.listeners.iter().position(|(p, _)| *p == port) {
            self.listeners.swap_remove(i);
            let _ = std::fs::remove_file(&path);
        } else if let Ok(l) = UnixListener::bind(&path) {
            l.set_nonblocking(true).expect("non-blocking listener");
            self.listeners.push((port, l));
        }
    }

    fn drain_host(&mut self) {
        for (_, l) in &self.listeners {
            while let Ok((s, _)) = l.accept() {
                if self.accepted.len() < 16 {
                    s.set_nonblocking(true).expect("non-blocking stream");
                    self.accepted.push(s);
                }
            }
        }
        let mut buf = [0u8; 4096];
        for s in self.hosts.iter_mut().chain(self.accepted.iter_mut()) {
            let _ = s.set_nonblocking(true);
            while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
        }
    }

    /// Checks every packet the device delivered, and the TX ring.
    fn harvest(&mut self) {
        for (h, data) in self.g.recv() {
            assert_eq!(
                (h.src_cid, h.dst_cid, h.type_),
                (HOST_CID, CID, TYPE_STREAM)
            );
            assert_eq!(h.buf_alloc, BUF_ALLOC);
            assert!(h.len as usize <= MAX_PAYLOAD);
            let key = Key {
                local: h.src_port,
                peer: h.dst_port,
            };
            match h.op {
                OP_REQUEST | OP_RESPONSE => {
                    assert_eq!(h.len, 0);
                    self.sent.insert(key, 0);
                    if h.op == OP_REQUEST {
                        self.host_ports.push(h.src_port);
                        self.host_ports.truncate(8);
                    }
                }
                OP_RW => {
                    assert_eq!(data.len(), h.len as usize);
                    let sent = self.sent.entry(key).or_insert(0);
                    *sent = sent.wrapping_add(h.len);
                    let (buf_alloc, fwd_cnt) = *self
                        .told
                        .get(&key)
                        .expect("data only on a connection the guest spoke on");
                    assert!(
                        sent.wrapping_sub(fwd_cnt) <= buf_alloc,
                        "{key:?}: {sent} sent, guest allowed {buf_alloc} past {fwd_cnt}"
                    );
                }
                OP_RST | OP_SHUTDOWN | OP_CREDIT_UPDATE => assert_eq!(h.len, 0),
                op => panic!("device sent op {op}"),
            }
        }
        assert!(self.d.conns() <= FUZZ_MAX_CONNECTIONS);
        self.g.tx_done();
        if !self.raw_tx {
            assert_eq!(self.g.free(TX), CHAINS, "TX chains not returned");
        }
    }

    fn round(&mut self) {
        self.d.pump();
        self.harvest();
    }

    fn restart(&mut self) {
        self.g.reset_queues();
        let eb = self.g.next_buf(EVQ);
        self.g.mem.write_obj(u32::MAX, GuestAddress(eb)).unwrap();
        self.g.post_raw(EVQ, &[(eb, 4, 2, 0)]);
        self.g.post_rx(4, 4096);
        self.raw_tx = false;
        self.d.restart(&self.g);
        self.d.pump();
        let ev = self.g.used(EVQ);
        assert_eq!(ev, [(0, EVENT_LEN as u32)], "TRANSPORT_RESET delivered");
        let id: u32 = self.g.mem.read_obj(GuestAddress(eb)).unwrap();
        assert_eq!(id, EVENT_TRANSPORT_RESET);
        self.harvest();
    }
}

static RUNS: AtomicU64 = AtomicU64::new(0);

/// The body (see the module doc): `data` is a sequence of ops, each a kind
/// byte and its arguments (missing bytes read as 0).
pub fn fuzz_vsock(data: &[u8]) {
    let n = RUNS.fetch_add(1, Ordering::Relaxed);
    let dir = Dir(std::env::temp_dir().join(format!("bvsock-fz-{}-{n}", std::process::id())));
    std::fs::create_dir_all(&dir.0).expect("fuzz directory");
    let g = Guest::new();
    let limits = Limits {
        max_connections: FUZZ_MAX_CONNECTIONS,
        connect_timeout: Duration::from_secs(3600),
        close_timeout: Duration::from_secs(3600),
    };
    let d = dev(&g, &dir.0, limits);
    let mut f = Fuzz {
        g,
        d,
        hosts: Vec::new(),
        accepted: Vec::new(),
        listeners: Vec::new(),
        told: HashMap::new(),
        sent: HashMap::new(),
        host_ports: Vec::new(),
        raw_tx: false,
    };
    let mut c = Cur { d: data, i: 0 };
    for _ in 0..MAX_OPS {
        if c.done() {
            break;
        }
        match c.u8() % 12 {
            0 => f.tx_packet(&mut c),
            1 => {
                let (n, len, one) = (c.u8() % 8 + 1, c.u16() % 8192, c.u8() & 1 != 0);
                for _ in 0..n.min(f.g.free(RX) as u8) {
                    if one {
                        f.g.post_rx_one(u32::from(len));
                    } else {
                        f.g.post_rx(1, u32::from(len));
                    }
                }
            }
            2 => f.raw_chain(&mut c),
            3 => f.host_connect(&mut c),
            4 => f.host_write(&mut c, false),
            5 => f.host_shutdown(&mut c, false),
            6 => f.listener(&mut c),
            7 => f.drain_host(),
            8 => f.round(),
            9 => {
                f.d.e.mux.expire(Instant::now() + Duration::from_secs(7200));
                f.round();
            }
            10 => f.restart(),
            _ => {
                if c.u8() & 1 == 0 {
                    f.host_write(&mut c, true)
                } else {
                    f.host_shutdown(&mut c, true)
                }
            }
        }
    }
    f.round();
}

/// Op encoders for the seeds.
#[allow(clippy::too_many_arguments)]
fn tx(sel: u8, op: u16, sp: u8, dp: u8, flags: u8, ba: u8, fc: u8, plen: u16, raw: u32) -> Vec<u8> {
    let mut v = vec![0, sel, op as u8, sp, dp, flags, ba, fc];
    v.extend_from_slice(&plen.to_le_bytes());
    v.extend_from_slice(&raw.to_le_bytes());
    v
}

/// A raw chain on queue `q`: (address selector, offset, len, flags, next) per descriptor.
fn raw(q: u8, descs: &[(u8, u16, u32, u16, u8)]) -> Vec<u8> {
    let mut v = vec![2, q, descs.len() as u8 - 1];
    for &(sel, off, len, flags, next) in descs {
        v.push(sel);
        v.extend_from_slice(&off.to_le_bytes());
        v.extend_from_slice(&len.to_le_bytes());
        v.extend_from_slice(&flags.to_le_bytes());
        v.push(next);
    }
    v
}

/// `n` RX buffers (1..=8) of `len` bytes.
fn rx(n: u8, len: u16) -> Vec<u8> {
    let mut v = vec![1, n - 1];
    v.extend_from_slice(&len.to_le_bytes());
    v.push(0);
    v
}

/// A host client: `CONNECT` to port 1024 (0), 1025 (1).
fn connect(port_sel: u8) -> Vec<u8> {
    vec![3, 0, 0, 0, 0, 0, port_sel]
}

fn write(len: u16) -> Vec<u8> {
    let mut v = vec![4, 0];
    v.extend_from_slice(&len.to_le_bytes());
    v
}

pub fn vsock_seeds() -> Vec<Vec<u8>> {
    let round = vec![8u8];
    let mut seeds = Vec::new();
    // Host-initiated: CONNECT 1024, RESPONSE (to the host port the device
    // chose: dp 2), data both ways, credit request, shutdowns.
    seeds.push(
        [
            rx(8, 4096),
            connect(0),
            round.clone(),
            tx(0, OP_RESPONSE, 2, 2, 0, 2, 0, 0, 0),
            round.clone(),
            write(3000),
            round.clone(),
            tx(0, OP_RW, 2, 2, 0, 2, 0, 100, 0),
            tx(0, OP_CREDIT_REQUEST, 2, 2, 0, 2, 0, 0, 0),
            round.clone(),
            vec![7],
            vec![5, 0, 0],
            round.clone(),
            tx(0, OP_SHUTDOWN, 2, 2, 3, 2, 0, 0, 0),
            round.clone(),
        ]
        .concat(),
    );
    // Guest-initiated to PATH_5000, a small credit, data, half-closes, a reset.
    seeds.push(
        [
            vec![6, 0],
            rx(8, 4096),
            tx(0, OP_REQUEST, 0, 0, 0, 1, 1, 0, 0),
            round.clone(),
            vec![7],
            vec![11, 0, 0, 0x10, 0x27],
            round.clone(),
            tx(0, OP_CREDIT_UPDATE, 0, 0, 0, 1, 0, 0, 0),
            round.clone(),
            tx(0, OP_SHUTDOWN, 0, 0, 2, 1, 0, 0, 0),
            round.clone(),
            vec![10],
            round.clone(),
        ]
        .concat(),
    );
    // Hostile headers and chains, packets for no connection, bad lines, timeouts.
    seeds.push(
        [
            rx(4, 64),
            tx(1, OP_REQUEST, 0, 0, 0, 2, 1, 0, 0x1234),
            tx(2, OP_REQUEST, 0, 0, 3, 2, 1, 0, 0),
            tx(4, OP_REQUEST, 0, 0, 0, 2, 1, 0, 0),
            tx(0, OP_RW, 3, 3, 0, 3, 2, 10, 0xffff_ffff),
            tx(8, OP_RW, 0, 0, 0, 2, 1, 50, 0),
            tx(16, OP_REQUEST, 0, 0, 0, 2, 1, 0, 0),
            tx(24, OP_REQUEST, 0, 0, 0, 2, 1, 0, 0),
            tx(32, OP_RW, 0, 0, 0, 2, 1, 10, 70_000),
            raw(1, &[(0, 0, 44, 1, 0)]),
            raw(1, &[(2, 0, 44, 0, 0)]),
            raw(0, &[(0, 16, 4096, 0, 0)]),
            raw(0, &[(0, 32, 44, 3, 1), (3, 0, 4096, 2, 0)]),
            round.clone(),
            connect(1),
            vec![
                3, 1, 0, 0, 0, 0, 12, b'X', b'Y', b'\n', 0, 0, 0, 0, 0, 0, 0, 0, 0,
            ],
            vec![3, 2, 0, 0, 0, 0, 0],
            round.clone(),
            vec![9],
        ]
        .concat(),
    );
    // A REQUEST flood past the connection cap, then a reset.
    let mut flood = vec![vec![6, 0], rx(8, 4096)];
    for p in 0..12u32 {
        flood.push(tx(0, OP_REQUEST, 3, 0, 0, 2, 1, 0, 50_000 + p));
    }
    flood.extend([round.clone(), connect(0), round.clone(), vec![10]]);
    seeds.push(flood.concat());
    seeds
}
