//! The VF side of the dataplane: moving frames between the mempool and a
//! guest's split virtqueues. Every descriptor comes from untrusted guest
//! memory: `virtq` (the walker and segment copier the VMM's devices use too)
//! walks each chain, refuses malformed ones and checks every buffer against
//! the VF's memory table; a `Fault` puts the VF (only it) in error.
//!
//! Nothing here allocates: the chain's buffers go into the caller's
//! [`Scratch`], frames into mempool buffers, used entries into a reused
//! array, and bytes move one memcpy per descriptor segment.

use std::collections::VecDeque;

use virtio_queue::QueueT;
use virtq::{Ring, Split};
use vm_memory::GuestMemoryMmap;

use super::mempool::{Mempool, Pkt, BUF_SIZE};
use crate::memory::VfMemory;
use crate::port::{AtomicCounters, Port, Runtime, RXQ, TXQ};

/// Room left in a buffer for a VLAN tag added on the uplink.
pub const VLAN_ROOM: usize = 4;
pub const MIN_FRAME: usize = 14;

#[derive(Debug, thiserror::Error)]
pub enum Fault {
    #[error("queue {q}: {source}")]
    Ring {
        q: usize,
        #[source]
        source: virtq::RingError,
    },
    #[error("queue {q}: descriptor chain {head} is malformed ({what})")]
    Chain {
        q: usize,
        head: u16,
        what: &'static str,
    },
    #[error("queue {q}: {source}")]
    Split {
        q: usize,
        #[source]
        source: virtq::SplitError,
    },
    #[error("queue {q}: descriptor chain {head}: {source}")]
    Copy {
        q: usize,
        head: u16,
        #[source]
        source: virtq::CopyError,
    },
}

/// Per-thread working space of the VF side, allocated once.
#[derive(Debug, Default)]
pub struct Scratch {
    pub(super) split: Split,
    /// (head, used length) of the chains of one batch, completed together.
    pub(super) used: Vec<(u16, u32)>,
    /// The heads of one batch, taken before the first is walked.
    pub(super) heads: Vec<u16>,
}

/// Takes up to `max` heads of queue `q` into `heads` and starts loading
/// their descriptors, then (transmit) the first lines of their frames, all
/// before the first chain is copied: the driver just wrote them on another
/// CPU, and the misses overlap instead of costing one round trip per frame
/// (DPDK's vhost library prefetches the same way). Receive buffers are not
/// prefetched: measured, a PREFETCHW of them ahead of the copies changed
/// nothing (docs/results.md), so the pass is not paid for.
pub(super) fn take_heads(
    view: &View<'_, '_>,
    rt: &mut Runtime,
    q: usize,
    max: usize,
    heads: &mut Vec<u16>,
) -> Result<(), Fault> {
    heads.clear();
    heads.extend(
        view.avail_heads(&mut rt.vrings[q].queue, max)
            .map_err(|source| Fault::Ring { q, source })?,
    );
    for &h in heads.iter() {
        view.prefetch_desc(h);
    }
    if q == TXQ {
        for &h in heads.iter() {
            if let Some(one) = view.one_buf(h) {
                one.prefetch();
            }
        }
    }
    Ok(())
}

/// Walks the chain at `head` into `split`: well formed, in the memory table,
/// and only device-readable (transmit) or only device-writable (receive).
/// Returns the host slices of its (first) buffers, for the copy.
fn split_chain<'v, 'm>(
    view: &View<'v, 'm>,
    q: usize,
    head: u16,
    split: &mut Split,
) -> Result<virtq::Kept<'v, Xlat<'m>>, Fault> {
    let e = |source| Fault::Split { q, source };
    view.split_into(head, split).map_err(e)?;
    let (used, wrong, what) = if q == TXQ {
        (
            &split.readable,
            &split.writable,
            "writable buffer in transmit chain",
        )
    } else {
        (
            &split.writable,
            &split.readable,
            "read-only buffer in receive chain",
        )
    };
    if !wrong.is_empty() || used.is_empty() {
        return Err(Fault::Chain { q, head, what });
    }
    // The other side is empty: checking the used side checks the chain.
    split.keep(view.mem(), used).map_err(e)
}

/// A chain of the queue, ready for its copy: one buffer straight from its
/// descriptor (`virtq::OneBuf`, how frontends post frames), or walked and
/// split (any other well-formed chain; `Scratch::split` holds its buffers).
pub(super) enum Chain<'v, 'm> {
    One(virtq::OneBuf<'v, Xlat<'m>>),
    Split(virtq::Kept<'v, Xlat<'m>>),
}

impl<'v, 'm> Chain<'v, 'm> {
    /// The chain at `head` of queue `q` (checked as `split_chain` checks it).
    #[inline(always)]
    pub(super) fn take(
        view: &View<'v, 'm>,
        q: usize,
        head: u16,
        split: &mut Split,
    ) -> Result<Self, Fault> {
        match view.one_buf(head) {
            // Transmit reads device-readable buffers, receive writes writable ones;
            // a buffer of the wrong kind is reported by the general path.
            Some(one) if one.writable == (q == RXQ) => Ok(Chain::One(one)),
            _ => split_chain(view, q, head, split).map(Chain::Split),
        }
    }

    /// Bytes in the chain's buffers.
    pub(super) fn len(&self, split: &Split) -> u64 {
        match self {
            Chain::One(one) => u64::from(one.buf.len),
            Chain::Split(_) if !split.readable.is_empty() => virtq::total(&split.readable),
            Chain::Split(_) => virtq::total(&split.writable),
        }
    }

    pub(super) fn read<P>(
        &self,
        gm: &Xlat<'m>,
        prepare: &P,
        split: &Split,
        skip: u64,
        out: &mut [u8],
    ) -> Result<(), virtq::CopyError>
    where
        P: virtq::Prepare,
    {
        match self {
            Chain::One(one) => one.read(prepare, skip, out),
            Chain::Split(kept) => virtq::read_kept(gm, kept, prepare, &split.readable, skip, out),
        }
    }

    fn write<P>(
        &self,
        gm: &Xlat<'m>,
        prepare: &P,
        split: &Split,
        parts: &[&[u8]],
    ) -> Result<(), virtq::CopyError>
    where
        P: virtq::Prepare,
    {
        match self {
            Chain::One(one) => one.write(prepare, 0, parts),
            Chain::Split(kept) => virtq::write_kept(gm, kept, prepare, &split.writable, 0, parts),
        }
    }
}

/// The memory table's translation cache, for one burst.
pub(super) type Xlat<'m> = virtq::Xlat<'m, GuestMemoryMmap>;
/// A queue's rings resolved through it, for one burst.
pub(super) type View<'v, 'm> = virtq::RingView<'v, Xlat<'m>>;

/// Resolves queue `q`'s rings for one burst.
pub(super) fn view<'v, 'm>(
    rt: &Runtime,
    gm: &'v Xlat<'m>,
    q: usize,
) -> Result<View<'v, 'm>, Fault> {
    let ring = Ring::of(&rt.vrings[q].queue, rt.features);
    View::resolve(&ring, gm).map_err(|source| Fault::Ring { q, source })
}

/// The burst's preparation of guest ranges before the device touches them:
/// lazy zeroing exists only for pool memory (a page-state table); without
/// it, preparing is the bounds check `check_in` already made, so the burst
/// skips it (one decision per burst instead of a region search per piece).
pub(super) fn preparer(
    mem: &VfMemory,
) -> impl Fn(u64, u64) -> Result<(), crate::memory::MemError> + '_ {
    let tracked = mem.tracked();
    move |gpa, len| {
        if tracked {
            mem.prepare_for_device_write(gpa, len)
        } else {
            Ok(())
        }
    }
}

/// Kick suppression (virtio 1.2 §2.7.10), as DPDK's vhost backend in poll
/// mode: while the dataplane polls queue `q` it sets VRING_USED_F_NO_NOTIFY,
/// so the driver publishes without kicking (a kick is an eventfd write: a
/// syscall per burst for a virtio-user frontend, an exit for a guest). Once
/// per ring state change, not per burst.
/// The caller polls the queue next (but not for the last time: see `want_kicks`).
pub fn quiet(rt: &mut Runtime, q: usize) {
    if !rt.vrings[q].kicks_wanted || !rt.vrings[q].usable() {
        return;
    }
    let Runtime { mem, vrings, .. } = rt;
    let Some(mem) = mem.as_ref() else { return };
    let vr = &mut vrings[q];
    // A used ring outside guest memory fails the burst's own resolution.
    let _ = vr.queue.disable_notification(&Xlat::new(&mem.gm));
    vr.kicks_wanted = false;
}

/// Before the dataplane stops polling queue `q` (it sleeps, or parks the
/// queue): asks the driver for kicks again, then looks at the available
/// index once more (virtio-queue's `enable_notification`: flag store, SeqCst
/// fence, index load), so a buffer published before the driver saw the flag
/// is found here and one published after it comes with a kick. Returns
/// whether such a buffer is waiting (then the caller must poll, not sleep).
/// A queue the dataplane would not poll has nothing waiting for it.
pub fn want_kicks(rt: &mut Runtime, q: usize) -> bool {
    if !rt.active || rt.failed || !rt.vrings[q].usable() {
        return false;
    }
    let Runtime { mem, vrings, .. } = rt;
    let Some(mem) = mem.as_ref() else {
        return false;
    };
    let vr = &mut vrings[q];
    vr.kicks_wanted = true;
    // A ring outside guest memory: polled again, where the burst faults it.
    vr.queue
        .enable_notification(&Xlat::new(&mem.gm))
        .unwrap_or(true)
}

/// Returns the batch's chains to the guest (one used-index update) and
/// interrupts it if it asked.
pub(super) fn complete(
    rt: &mut Runtime,
    view: &View<'_, '_>,
    q: usize,
    used: &[(u16, u32)],
) -> Result<(), Fault> {
    let vr = &mut rt.vrings[q];
    if view
        .complete_used(&mut vr.queue, used)
        .map_err(|source| Fault::Ring { q, source })?
    {
        vr.signal();
    }
    Ok(())
}

/// The virtio_net_hdr of a received frame, its first `hdr_len` bytes (10
/// or 12): all zero (no offloads), num_buffers = 1 when present.
pub(super) fn rx_hdr(hdr_len: usize) -> [u8; 12] {
    let mut hdr = [0u8; 12];
    if hdr_len == 12 {
        hdr[10] = 1;
    }
    hdr
}

/// The length of the frame in a transmit chain of `chain_len` bytes after
/// its `hdr_len`-byte virtio-net header, if the switch takes frames that
/// long (else the frame is a `tx_drops`).
pub(super) fn frame_len(chain_len: u64, hdr_len: u64) -> Option<usize> {
    let len = chain_len.saturating_sub(hdr_len) as usize;
    (MIN_FRAME..=BUF_SIZE - VLAN_ROOM)
        .contains(&len)
        .then_some(len)
}

/// The frame of transmit chain `head` (after its `hdr_len`-byte virtio-net
/// header) copied into a packet buffer, one memcpy per segment; `None` when
/// it cannot be taken (a bad length, no buffer left): a `tx_drops`.
pub(super) fn copy_out<'v, 'm>(
    chain: &Chain<'v, 'm>,
    (gm, prepare, split): (&Xlat<'m>, &impl virtq::Prepare, &Split),
    hdr_len: u64,
    head: u16,
    pool: &mut Mempool,
) -> Result<Option<Pkt>, Fault> {
    let Some(frame_len) = frame_len(chain.len(split), hdr_len) else {
        return Ok(None);
    };
    let Some(mut pkt) = pool.alloc() else {
        return Ok(None);
    };
    let buf = &mut pkt.buf_mut()[..frame_len];
    if let Err(source) = chain.read(gm, prepare, split, hdr_len, buf) {
        pool.free(pkt);
        return Err(Fault::Copy {
            q: TXQ,
            head,
            source,
        });
    }
    pkt.len = frame_len;
    Ok(Some(pkt))
}

/// Guest transmit queue → packets in `out`. Frames that cannot be taken (bad
/// length, no packet buffer) count as `tx_drops`; the others are counted by
/// the switch once it has forwarded them. Returns how many chains it took.
pub fn take_guest_tx(
    port: &Port,
    rt: &mut Runtime,
    pool: &mut Mempool,
    scratch: &mut Scratch,
    batch: usize,
    out: &mut Vec<Pkt>,
) -> Result<usize, Fault> {
    if !rt.active || rt.failed || !rt.vrings[TXQ].usable() {
        return Ok(0);
    }
    let mem = rt.mem.take().expect("usable ring implies a memory table");
    let r = take_guest_tx_inner(port, rt, &mem, pool, scratch, batch, out);
    rt.mem = Some(mem);
    r
}

fn take_guest_tx_inner(
    port: &Port,
    rt: &mut Runtime,
    mem: &VfMemory,
    pool: &mut Mempool,
    scratch: &mut Scratch,
    batch: usize,
    out: &mut Vec<Pkt>,
) -> Result<usize, Fault> {
    let hdr_len = rt.hdr_len as u64;
    let gm = Xlat::new(&mem.gm);
    let view = view(rt, &gm, TXQ)?;
    let prepare = preparer(mem);
    let Scratch { split, used, heads } = scratch;
    used.clear();
    let mut drops = 0;
    take_heads(&view, rt, TXQ, batch, heads)?;
    for &head in heads.iter() {
        let chain = Chain::take(&view, TXQ, head, split)?;
        used.push((head, 0));
        match copy_out(&chain, (&gm, &prepare, split), hdr_len, head, pool)? {
            Some(pkt) => out.push(pkt),
            None => drops += 1,
        }
    }
    if drops > 0 {
        AtomicCounters::add(&port.counters.tx_drops, drops);
    }
    complete(rt, &view, TXQ, used)?;
    Ok(used.len())
}

/// Queued frames → guest receive queue (the VF's `rx_*` counters). Frames
/// stay queued while the guest posts no buffers. Returns how many frames it
/// delivered or dropped.
pub fn fill_guest_rx(
    port: &Port,
    rt: &mut Runtime,
    pool: &mut Mempool,
    scratch: &mut Scratch,
    batch: usize,
    backlog: &mut VecDeque<Pkt>,
) -> Result<usize, Fault> {
    if backlog.is_empty() || !rt.active || rt.failed || !rt.vrings[RXQ].usable() {
        return Ok(0);
    }
    let mem = rt.mem.take().expect("usable ring implies a memory table");
    let r = fill_guest_rx_inner(port, rt, &mem, pool, scratch, batch, backlog);
    rt.mem = Some(mem);
    r
}

fn fill_guest_rx_inner(
    port: &Port,
    rt: &mut Runtime,
    mem: &VfMemory,
    pool: &mut Mempool,
    scratch: &mut Scratch,
    batch: usize,
    backlog: &mut VecDeque<Pkt>,
) -> Result<usize, Fault> {
    let hdr_len = rt.hdr_len;
    let gm = Xlat::new(&mem.gm);
    let view = view(rt, &gm, RXQ)?;
    let prepare = preparer(mem);
    let hdr = rx_hdr(hdr_len);
    let Scratch { split, used, heads } = scratch;
    used.clear();
    let (mut packets, mut bytes, mut drops) = (0, 0, 0);
    take_heads(&view, rt, RXQ, batch.min(backlog.len()), heads)?;
    let mut result = Ok(());
    for &head in heads.iter() {
        let chain = match Chain::take(&view, RXQ, head, split) {
            Ok(c) => c,
            Err(f) => {
                result = Err(f);
                break;
            }
        };
        let pkt = backlog.pop_front().expect("checked non-empty");
        let frame = pkt.data();
        let len = hdr_len + frame.len();
        if chain.len(split) < len as u64 {
            drops += 1;
            used.push((head, 0));
        } else {
            let parts: [&[u8]; 2] = [&hdr[..hdr_len], frame];
            if let Err(source) = chain.write(&gm, &prepare, split, &parts) {
                result = Err(Fault::Copy {
                    q: RXQ,
                    head,
                    source,
                });
            } else {
                packets += 1;
                bytes += frame.len() as u64;
                used.push((head, len as u32));
            }
        }
        // Back to the pool also when the guest's memory failed the write.
        pool.free(pkt);
        if result.is_err() {
            break;
        }
    }
    let c = &port.counters;
    AtomicCounters::add_burst([
        (&c.rx_packets, packets),
        (&c.rx_bytes, bytes),
        (&c.rx_drops, drops),
    ]);
    result?;
    complete(rt, &view, RXQ, used)?;
    Ok(used.len())
}
