//! The VF side of the dataplane: moving frames between the mempool and a
//! guest's split virtqueues. Every descriptor comes from untrusted guest
//! memory: its range is checked against the VF's memory table, a chain cut
//! short or pointing outside the table is a `Fault` (the VF goes to error).

use std::collections::VecDeque;

use virtio_queue::{DescriptorChain, QueueOwnedT, QueueT};
use virtq::Ring;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::mempool::{Mempool, Pkt, BUF_SIZE};
use crate::memory::VfMemory;
use crate::port::{AtomicCounters, Port, Runtime, RXQ, TXQ};

/// Room left in a buffer for a VLAN tag added on the uplink.
const VLAN_ROOM: usize = 4;
const MIN_FRAME: usize = 14;

#[derive(Debug, thiserror::Error)]
pub enum Fault {
    #[error("queue {q}: {e}")]
    Queue { q: usize, e: virtio_queue::Error },
    #[error("queue {q}: descriptor chain {head} is malformed ({what})")]
    Chain {
        q: usize,
        head: u16,
        what: &'static str,
    },
    #[error("queue {q}: descriptor {addr:#x}+{len} outside the memory table")]
    Range { q: usize, addr: u64, len: u32 },
    #[error("queue {q}: {what}")]
    Memory { q: usize, what: String },
    #[error("queue {q}: {source}")]
    Walk { q: usize, source: virtq::ChainError },
}

type Chain<'a> = DescriptorChain<&'a GuestMemoryMmap>;

/// Up to `max` available chains of queue `q` (borrowing ends before add_used).
fn pop_chains<'a>(
    rt: &mut Runtime,
    gm: &'a GuestMemoryMmap,
    q: usize,
    max: usize,
) -> Result<Vec<Chain<'a>>, Fault> {
    let queue = &mut rt.vrings[q].queue;
    let iter = queue.iter(gm).map_err(|e| Fault::Queue { q, e })?;
    Ok(iter.take(max).collect())
}

/// Collects the descriptors of a chain (`virtq::Ring::walk`: indirect
/// tables, loops, bad next indexes), checking each range and direction.
fn descriptors(
    chain: Chain<'_>,
    ring: Ring,
    q: usize,
    mem_ok: impl Fn(u64, usize) -> bool,
    want_write: bool,
) -> Result<Vec<(u64, u32)>, Fault> {
    let head = chain.head_index();
    let mut out = Vec::new();
    for d in ring.walk(chain.memory(), head) {
        let d = d.map_err(|source| Fault::Walk { q, source })?;
        if d.is_write_only() != want_write {
            return Err(Fault::Chain {
                q,
                head,
                what: if want_write {
                    "read-only buffer in receive chain"
                } else {
                    "writable buffer in transmit chain"
                },
            });
        }
        if !mem_ok(d.addr().0, d.len() as usize) {
            return Err(Fault::Range {
                q,
                addr: d.addr().0,
                len: d.len(),
            });
        }
        out.push((d.addr().0, d.len()));
    }
    Ok(out)
}

/// Guest transmit queue → packets (the VF's `tx_*` counters). Returns how
/// many frames it took.
pub fn take_guest_tx(
    port: &Port,
    rt: &mut Runtime,
    pool: &mut Mempool,
    batch: usize,
    out: &mut Vec<Pkt>,
) -> Result<usize, Fault> {
    if !rt.active || rt.failed || !rt.vrings[TXQ].usable() {
        return Ok(0);
    }
    let mem = rt.mem.take().expect("usable ring implies a memory table");
    let r = take_guest_tx_inner(port, rt, &mem, pool, batch, out);
    rt.mem = Some(mem);
    r
}

fn take_guest_tx_inner(
    port: &Port,
    rt: &mut Runtime,
    mem: &VfMemory,
    pool: &mut Mempool,
    batch: usize,
    out: &mut Vec<Pkt>,
) -> Result<usize, Fault> {
    let gm = &mem.gm;
    let hdr_len = rt.hdr_len;
    let ring = Ring::of(&rt.vrings[TXQ].queue, rt.features);
    let chains = pop_chains(rt, gm, TXQ, batch)?;
    let mut heads = Vec::with_capacity(chains.len());
    for chain in chains {
        let head = chain.head_index();
        let descs = descriptors(chain, ring, TXQ, |a, l| mem.check(a, l), false)?;
        heads.push(head);
        let total: usize = descs.iter().map(|d| d.1 as usize).sum();
        let frame_len = total.saturating_sub(hdr_len);
        let c = &port.counters;
        if !(MIN_FRAME..=BUF_SIZE - VLAN_ROOM).contains(&frame_len) {
            AtomicCounters::add(&c.tx_drops, 1);
            continue;
        }
        let Some(mut pkt) = pool.alloc() else {
            AtomicCounters::add(&c.tx_drops, 1);
            continue;
        };
        // Copy the frame, skipping the virtio-net header.
        let buf = pool.buf_mut(&pkt);
        let (mut skip, mut w) = (hdr_len, 0usize);
        for (addr, len) in descs {
            let len = len as usize;
            if skip >= len {
                skip -= len;
                continue;
            }
            let n = len - skip;
            let gpa = addr + skip as u64;
            // Lazy zeroing: a page the guest never wrote must read as zeros.
            if let Err(e) = mem.prepare_for_device_write(gpa, n as u64) {
                pool.free(pkt);
                return Err(Fault::Memory {
                    q: TXQ,
                    what: e.to_string(),
                });
            }
            if let Err(e) = gm.read_slice(&mut buf[w..w + n], GuestAddress(gpa)) {
                pool.free(pkt);
                return Err(Fault::Memory {
                    q: TXQ,
                    what: e.to_string(),
                });
            }
            w += n;
            skip = 0;
        }
        pkt.len = w;
        AtomicCounters::add(&c.tx_packets, 1);
        AtomicCounters::add(&c.tx_bytes, w as u64);
        out.push(pkt);
    }
    let vr = &mut rt.vrings[TXQ];
    for &h in &heads {
        vr.queue
            .add_used(gm, h, 0)
            .map_err(|e| Fault::Queue { q: TXQ, e })?;
    }
    if !heads.is_empty()
        && vr
            .queue
            .needs_notification(gm)
            .map_err(|e| Fault::Queue { q: TXQ, e })?
    {
        vr.signal();
    }
    Ok(heads.len())
}

/// Queued frames → guest receive queue (the VF's `rx_*` counters). Frames
/// stay queued while the guest posts no buffers. Returns how many frames it
/// delivered or dropped.
pub fn fill_guest_rx(
    port: &Port,
    rt: &mut Runtime,
    pool: &mut Mempool,
    batch: usize,
    backlog: &mut VecDeque<Pkt>,
) -> Result<usize, Fault> {
    if backlog.is_empty() || !rt.active || rt.failed || !rt.vrings[RXQ].usable() {
        return Ok(0);
    }
    let mem = rt.mem.take().expect("usable ring implies a memory table");
    let r = fill_guest_rx_inner(port, rt, &mem, pool, batch, backlog);
    rt.mem = Some(mem);
    r
}

/// Writes `hdr` then `frame` into the guest buffers `descs` (which hold at
/// least that many bytes); returns how many bytes it wrote.
fn write_chain(
    mem: &VfMemory,
    descs: &[(u64, u32)],
    hdr: &[u8],
    frame: &[u8],
) -> Result<usize, Fault> {
    let fault = |what: String| Fault::Memory { q: RXQ, what };
    let mut src = hdr.iter().chain(frame.iter()).copied();
    let total = hdr.len() + frame.len();
    let mut written = 0usize;
    let mut chunk = [0u8; 2048];
    for &(addr, len) in descs {
        if written == total {
            break;
        }
        let n = (len as usize).min(total - written);
        mem.prepare_for_device_write(addr, n as u64)
            .map_err(|e| fault(e.to_string()))?;
        let mut done = 0;
        while done < n {
            let m = (n - done).min(chunk.len());
            for b in chunk[..m].iter_mut() {
                *b = src.next().expect("total bytes counted");
            }
            mem.gm
                .write_slice(&chunk[..m], GuestAddress(addr + done as u64))
                .map_err(|e| fault(e.to_string()))?;
            done += m;
        }
        written += n;
    }
    Ok(written)
}

fn fill_guest_rx_inner(
    port: &Port,
    rt: &mut Runtime,
    mem: &VfMemory,
    pool: &mut Mempool,
    batch: usize,
    backlog: &mut VecDeque<Pkt>,
) -> Result<usize, Fault> {
    let gm = &mem.gm;
    let hdr_len = rt.hdr_len;
    let ring = Ring::of(&rt.vrings[RXQ].queue, rt.features);
    let chains = pop_chains(rt, gm, RXQ, batch.min(backlog.len()))?;
    let mut used = Vec::with_capacity(chains.len());
    let c = &port.counters;
    for chain in chains {
        let head = chain.head_index();
        let descs = descriptors(chain, ring, RXQ, |a, l| mem.check(a, l), true)?;
        let pkt = backlog.pop_front().expect("one chain per queued frame");
        // virtio_net_hdr: all zero (no offloads), num_buffers = 1 when present.
        let mut hdr = [0u8; 12];
        if hdr_len == 12 {
            hdr[10] = 1;
        }
        let frame = pool.data(&pkt);
        let cap: usize = descs.iter().map(|d| d.1 as usize).sum();
        if cap < hdr_len + frame.len() {
            AtomicCounters::add(&c.rx_drops, 1);
            pool.free(pkt);
            used.push((head, 0));
            continue;
        }
        let written = write_chain(mem, &descs, &hdr[..hdr_len], frame);
        let frame_len = frame.len();
        // Back to the pool also when the guest's memory failed the write.
        pool.free(pkt);
        let written = written?;
        AtomicCounters::add(&c.rx_packets, 1);
        AtomicCounters::add(&c.rx_bytes, frame_len as u64);
        used.push((head, written as u32));
    }
    let vr = &mut rt.vrings[RXQ];
    for &(h, len) in &used {
        vr.queue
            .add_used(gm, h, len)
            .map_err(|e| Fault::Queue { q: RXQ, e })?;
    }
    if !used.is_empty()
        && vr
            .queue
            .needs_notification(gm)
            .map_err(|e| Fault::Queue { q: RXQ, e })?
    {
        vr.signal();
    }
    Ok(used.len())
}
