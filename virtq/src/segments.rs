//! A walked chain as the device uses it: its device-readable head and
//! device-writable tail (virtio 1.2 §2.7.4.2), each a list of guest buffers,
//! and the copies between those buffers and the device. Shared by the NIC's
//! dataplane and the VMM's virtio-net and virtio-blk, so every check lives
//! here once:
//! - the walk itself ([`RingView::walk`]: indirect refusal, loops, next indexes,
//!   2^32 bytes);
//! - a readable descriptor after a writable one is malformed;
//! - every buffer lies inside guest memory (checked by each copy, or for the
//!   whole chain by [`Split::check_in`], also buffers a short frame never
//!   touches);
//! - every piece is *prepared* before the device reads or writes it: under
//!   lazy zeroing a page the guest never touched may still hold a previous
//!   tenant's bytes, and a device write must not be wiped by a later zeroing.
//!
//! Copies are whole segments (one memcpy per piece of a buffer, on the host
//! slice [`Split::check_in_keep`] kept or one translated for the piece; a
//! piece over two adjacent regions through vm-memory), and a device that
//! keeps one [`Split`] across chains allocates only for the longest chain it
//! has seen: the hot path of the NIC allocates nothing.

use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions};

use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT};

use crate::one::{read_one, write_one};
use crate::view::{contiguous, Slice};
use crate::{ChainError, Ring, RingError, RingView};

/// One buffer of a chain, as the guest described it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buf {
    pub addr: u64,
    pub len: u32,
}

/// A chain split into its device-readable and device-writable buffers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    pub head: u16,
    pub readable: Vec<Buf>,
    pub writable: Vec<Buf>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    #[error(transparent)]
    Walk(#[from] ChainError),
    #[error("descriptor chain {head}: device-readable descriptor after a device-writable one")]
    ReadableAfterWritable { head: u16 },
    #[error("descriptor chain {head}: buffer {addr:#x}+{len:#x} outside guest memory")]
    Outside { head: u16, addr: u64, len: u32 },
    #[error(transparent)]
    Ring(#[from] RingError),
}

/// Why a copy between a chain's buffers and the device failed.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("bytes {skip}..+{len} lie beyond the chain's {total} bytes")]
    Beyond { skip: u64, len: u64, total: u64 },
    #[error("buffer {addr:#x}+{len:#x} overflows the address space")]
    Overflow { addr: u64, len: u32 },
    /// The caller's preparation refused the range (its error, e.g. a guestmem
    /// error, kept as the source).
    #[error("buffer {addr:#x}+{len:#x}: preparing it for the device: {source}")]
    Prepare {
        addr: u64,
        len: usize,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("buffer {addr:#x}+{len:#x}: {source}")]
    Access {
        addr: u64,
        len: usize,
        #[source]
        source: vm_memory::GuestMemoryError,
    },
}

/// Total byte length of `bufs`.
pub fn total(bufs: &[Buf]) -> u64 {
    bufs.iter().map(|b| u64::from(b.len)).sum()
}

impl<M: GuestMemory + ?Sized> RingView<'_, M> {
    /// Walks the chain at `head` into `out` (cleared first, its capacity
    /// reused), checking the order of readable and writable buffers. Buffers
    /// are checked against guest memory when they are copied, or all at once
    /// by [`Split::check_in`].
    pub fn split_into(&self, head: u16, out: &mut Split) -> Result<(), SplitError> {
        out.head = head;
        out.readable.clear();
        out.writable.clear();
        // A chain of one descriptor (a frame with its header, as virtio-net
        // drivers post them): one load, the decision on the flags of that
        // same load, nothing a walk would check left unchecked (no next, no
        // indirect table, one length under 2^32). Anything else, and a head
        // outside the table, is walked.
        if let Some(d) = self.descriptor_at(head) {
            let flags = u32::from(d.flags());
            if flags & (VRING_DESC_F_NEXT | VRING_DESC_F_INDIRECT) == 0 {
                let b = Buf {
                    addr: d.addr().0,
                    len: d.len(),
                };
                if d.is_write_only() {
                    out.writable.push(b);
                } else {
                    out.readable.push(b);
                }
                return Ok(());
            }
        }
        for d in self.walk(head) {
            let d = d?;
            let b = Buf {
                addr: d.addr().0,
                len: d.len(),
            };
            if d.is_write_only() {
                out.writable.push(b);
            } else if out.writable.is_empty() {
                out.readable.push(b);
            } else {
                return Err(SplitError::ReadableAfterWritable { head });
            }
        }
        Ok(())
    }

    /// [`RingView::split_into`] into a new [`Split`].
    pub fn split(&self, head: u16) -> Result<Split, SplitError> {
        let mut s = Split::default();
        self.split_into(head, &mut s)?;
        Ok(s)
    }
}

impl Ring {
    /// One chain outside a burst: [`RingView::split_into`] on a view
    /// resolved for it (a device handling many chains resolves one view).
    pub fn split_into<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        head: u16,
        out: &mut Split,
    ) -> Result<(), SplitError> {
        RingView::resolve(self, mem)?.split_into(head, out)
    }
}

impl Split {
    /// Every buffer lies in `mem`, also those a copy would not reach (a
    /// device that must refuse the whole chain, as the NIC does).
    pub fn check_in<M: GuestMemory + ?Sized>(&self, mem: &M) -> Result<(), SplitError> {
        self.check_in_keep(mem).map(drop)
    }

    /// [`Split::check_in`], keeping the host slices of the first [`KEPT`]
    /// readable and writable buffers (readable, writable): a copy through
    /// them ([`read_kept`], [`write_kept`]) does not translate again.
    pub fn check_in_keep<'m, M: GuestMemory + ?Sized>(
        &self,
        mem: &'m M,
    ) -> Result<(Kept<'m, M>, Kept<'m, M>), SplitError> {
        Ok((
            self.keep(mem, &self.readable)?,
            self.keep(mem, &self.writable)?,
        ))
    }

    /// Checks `bufs` (one side of this split) like [`Split::check_in`] and
    /// keeps the host slices of the first [`KEPT`]: for a device that uses
    /// one side and has refused chains with the other.
    #[inline]
    pub fn keep<'m, M: GuestMemory + ?Sized>(
        &self,
        mem: &'m M,
        bufs: &[Buf],
    ) -> Result<Kept<'m, M>, SplitError> {
        let mut kept = Kept::none();
        for (i, b) in bufs.iter().enumerate() {
            let one = if i < KEPT {
                contiguous(mem, b.addr, b.len as usize)
            } else {
                None
            };
            match one {
                Some(s) => kept.slices[i] = Some(s),
                // Past the kept ones, or a buffer over adjacent regions.
                None if mem.check_range(
                    GuestAddress(b.addr),
                    b.len as usize,
                    Permissions::ReadWrite,
                ) => {}
                None => {
                    return Err(SplitError::Outside {
                        head: self.head,
                        addr: b.addr,
                        len: b.len,
                    })
                }
            }
        }
        Ok(kept)
    }
}

/// How many buffers per side [`Split::check_in_keep`] keeps as host slices
/// (a frame's chain has one or two).
pub const KEPT: usize = 2;

/// Host slices of a chain's first buffers, for one burst (they borrow the
/// memory table like the ring view).
#[derive(Debug)]
pub struct Kept<'m, M: GuestMemory + ?Sized> {
    slices: [Option<Slice<'m, M>>; KEPT],
}

impl<'m, M: GuestMemory + ?Sized> Kept<'m, M> {
    /// Nothing kept: every piece is translated when copied.
    pub fn none() -> Self {
        Kept {
            slices: std::array::from_fn(|_| None),
        }
    }

    /// Bytes `off..off + n` of buffer `i`, if it was kept.
    #[inline]
    fn piece(&self, i: usize, off: u64, n: usize) -> Option<Slice<'m, M>> {
        let s = self.slices.get(i)?.as_ref()?;
        s.subslice(usize::try_from(off).ok()?, n).ok()
    }
}

/// The one buffer of `bufs` and its kept host slice, if `bufs` is one
/// buffer that was kept (a frame in one descriptor): copied without the
/// piece walk (`crate::one`).
#[inline]
fn one_kept<'k, 'm, M: GuestMemory + ?Sized>(
    kept: &'k Kept<'m, M>,
    bufs: &'k [Buf],
) -> Option<(&'k Buf, &'k Slice<'m, M>)> {
    match (bufs, kept.slices[0].as_ref()) {
        ([b], Some(s)) => Some((b, s)),
        _ => None,
    }
}

/// Calls `f(i, in_buf, gpa, offset, n)` for each piece of `bufs` that covers
/// bytes `skip..skip + len` of their concatenation (`i` the buffer, `in_buf`
/// the piece's offset in it, `offset` counts from `skip`).
fn for_pieces(
    bufs: &[Buf],
    skip: u64,
    len: u64,
    mut f: impl FnMut(usize, u64, u64, usize, usize) -> Result<(), CopyError>,
) -> Result<(), CopyError> {
    let total = total(bufs);
    let end = skip
        .checked_add(len)
        .filter(|&e| e <= total)
        .ok_or(CopyError::Beyond { skip, len, total })?;
    let mut at = 0u64;
    for (i, b) in bufs.iter().enumerate() {
        let (lo, hi) = (at, at + u64::from(b.len));
        at = hi;
        if hi <= skip {
            continue;
        }
        if lo >= end {
            break;
        }
        let (s, e) = (lo.max(skip), hi.min(end));
        let addr = b.addr.checked_add(s - lo).ok_or(CopyError::Overflow {
            addr: b.addr,
            len: b.len,
        })?;
        f(i, s - lo, addr, (s - skip) as usize, (e - s) as usize)?;
    }
    Ok(())
}

/// What a device does to a guest range before it reads or writes it (under
/// lazy zeroing a never-touched page must read as zeros, and a device write
/// must not be wiped by a later zeroing); refusing the range refuses the
/// copy. Any `Fn(gpa, len) -> Result<(), E>` is one.
pub trait Prepare {
    fn prepare(&self, gpa: u64, len: u64) -> Result<(), Box<dyn std::error::Error + Send + Sync>>;
}

impl<F, E> Prepare for F
where
    F: Fn(u64, u64) -> Result<(), E> + ?Sized,
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    #[inline]
    fn prepare(&self, gpa: u64, len: u64) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self(gpa, len).map_err(Into::into)
    }
}

pub(crate) fn prepared<P>(prepare: &P, addr: u64, n: usize) -> Result<(), CopyError>
where
    P: Prepare + ?Sized,
{
    prepare
        .prepare(addr, n as u64)
        .map_err(|source| CopyError::Prepare {
            addr,
            len: n,
            source,
        })
}

/// Copies bytes `skip..skip + out.len()` of the buffers into `out`, one
/// memcpy per piece, preparing each piece first (a read of a never-touched
/// page must see zeros, not a previous tenant's bytes).
pub fn read_bufs<M, P>(
    mem: &M,
    prepare: &P,
    bufs: &[Buf],
    skip: u64,
    out: &mut [u8],
) -> Result<(), CopyError>
where
    M: GuestMemory + ?Sized,
    P: Prepare + ?Sized,
{
    read_kept(mem, &Kept::none(), prepare, bufs, skip, out)
}

/// [`read_bufs`] through the host slices `kept` holds for `bufs`.
pub fn read_kept<M, P>(
    mem: &M,
    kept: &Kept<'_, M>,
    prepare: &P,
    bufs: &[Buf],
    skip: u64,
    out: &mut [u8],
) -> Result<(), CopyError>
where
    M: GuestMemory + ?Sized,
    P: Prepare + ?Sized,
{
    if let Some((b, s)) = one_kept(kept, bufs) {
        return read_one::<M, _>(b, s, prepare, skip, out);
    }
    for_pieces(bufs, skip, out.len() as u64, |i, in_buf, addr, off, n| {
        prepared(prepare, addr, n)?;
        let out = &mut out[off..off + n];
        // A kept buffer or a piece inside one region: one host slice, one
        // memcpy. One that crosses regions (legal for a buffer):
        // vm-memory's own copy.
        if let Some(s) = kept.piece(i, in_buf, n) {
            s.copy_to(out);
            return Ok(());
        }
        if let Some(s) = contiguous(mem, addr, n) {
            s.copy_to(out);
            return Ok(());
        }
        mem.read_slice(out, GuestAddress(addr))
            .map_err(|source| CopyError::Access {
                addr,
                len: n,
                source,
            })
    })
}

/// Writes `parts` one after the other at bytes `skip..` of the buffers (a
/// header and a frame, without gathering them first), one memcpy per piece,
/// after preparing every buffer range they cover.
pub fn write_bufs<M, P>(
    mem: &M,
    prepare: &P,
    bufs: &[Buf],
    skip: u64,
    parts: &[&[u8]],
) -> Result<(), CopyError>
where
    M: GuestMemory + ?Sized,
    P: Prepare + ?Sized,
{
    write_kept(mem, &Kept::none(), prepare, bufs, skip, parts)
}

/// [`write_bufs`] through the host slices `kept` holds for `bufs`.
pub fn write_kept<M, P>(
    mem: &M,
    kept: &Kept<'_, M>,
    prepare: &P,
    bufs: &[Buf],
    skip: u64,
    parts: &[&[u8]],
) -> Result<(), CopyError>
where
    M: GuestMemory + ?Sized,
    P: Prepare + ?Sized,
{
    // Every piece the parts land in is prepared first, once (a header and a
    // frame sharing a descriptor: one call), so a refusal moves no byte.
    if let Some((b, s)) = one_kept(kept, bufs) {
        return write_one::<M, _>(b, s, prepare, skip, parts);
    }
    let len = parts.iter().map(|p| p.len() as u64).sum();
    for_pieces(bufs, skip, len, |_, _, addr, _, n| {
        prepared(prepare, addr, n)
    })?;
    let mut skip = skip;
    for data in parts {
        for_pieces(bufs, skip, data.len() as u64, |i, in_buf, addr, off, n| {
            let data = &data[off..off + n];
            if let Some(s) = kept.piece(i, in_buf, n) {
                s.copy_from(data);
                return Ok(());
            }
            if let Some(s) = contiguous(mem, addr, n) {
                s.copy_from(data);
                return Ok(());
            }
            mem.write_slice(data, GuestAddress(addr))
                .map_err(|source| CopyError::Access {
                    addr,
                    len: n,
                    source,
                })
        })?;
        skip += data.len() as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{self, mem_with, INDIRECT, MEM, NEXT, TABLE, WRITE};
    use std::cell::RefCell;
    use virtio_queue::desc::split::Descriptor;
    use vm_memory::GuestMemoryMmap;

    fn ring(size: u16) -> Ring {
        testing::ring(size, 0)
    }

    fn split(r: Ring, m: &GuestMemoryMmap, head: u16) -> Result<Split, SplitError> {
        RingView::resolve(&r, m).unwrap().split(head)
    }

    fn no_prepare(_: u64, _: u64) -> Result<(), String> {
        Ok(())
    }

    /// A chain of `n` descriptors of `len` bytes each at 0x4000 + i * 0x100.
    fn small_descs(n: u16, len: u32, flags: u16) -> Vec<(u64, u32, u16, u16)> {
        (0..n)
            .map(|i| {
                let next = if i + 1 < n { NEXT } else { 0 };
                (0x4000 + u64::from(i) * 0x100, len, flags | next, i + 1)
            })
            .collect()
    }

    /// The single-descriptor path gives what the walk gives, for every
    /// flag a lone descriptor may carry, and for heads it must not take.
    #[test]
    fn a_one_descriptor_chain_splits_as_the_walk_does() {
        let walked = |r: &Ring, m: &GuestMemoryMmap, head: u16| -> Result<Split, SplitError> {
            let v = RingView::resolve(r, m).unwrap();
            let mut s = Split {
                head,
                ..Split::default()
            };
            for d in v.walk(head) {
                let d = d?;
                let b = Buf {
                    addr: d.addr().0,
                    len: d.len(),
                };
                if d.is_write_only() {
                    s.writable.push(b);
                } else {
                    s.readable.push(b);
                }
            }
            Ok(s)
        };
        let m = mem_with(&[
            (0x4000, 60, 0, 0),
            (0x5000, 2048, WRITE, 0),
            (0x6000, 32, INDIRECT, 0),
            (0x7000, 0, 0, 0),
            (0x8000, u32::MAX, WRITE, 0),
            (0x9000, 16, NEXT, 7),
        ]);
        let indirect_ok = Ring {
            features: 1 << crate::VIRTIO_F_INDIRECT_DESC,
            ..ring(8)
        };
        for r in [ring(8), indirect_ok] {
            for head in [0, 1, 2, 3, 4, 5, 8, 200, u16::MAX] {
                assert_eq!(split(r, &m, head), walked(&r, &m, head), "head {head}");
            }
        }
        assert_eq!(
            split(ring(8), &m, 1).unwrap().writable,
            [Buf {
                addr: 0x5000,
                len: 2048
            }]
        );
        assert_eq!(
            split(ring(8), &m, 2),
            Err(SplitError::Walk(ChainError::IndirectNotNegotiated {
                head: 2,
                index: 2
            }))
        );
        assert!(matches!(
            split(ring(8), &m, 8),
            Err(SplitError::Walk(ChainError::NextOutOfRange {
                index: 8,
                ..
            }))
        ));
    }

    #[test]
    fn split_orders_buffers_and_refuses_malformed_chains() {
        let m = mem_with(&[
            (0x4000, 16, NEXT, 1),
            (0x5000, 8, WRITE | NEXT, 2),
            (0x6000, 1, WRITE, 0),
        ]);
        let s = split(ring(8), &m, 0).unwrap();
        assert_eq!(
            s.readable,
            vec![Buf {
                addr: 0x4000,
                len: 16
            }]
        );
        assert_eq!(total(&s.writable), 9);

        let m = mem_with(&[(0x5000, 8, WRITE | NEXT, 1), (0x4000, 16, 0, 0)]);
        assert_eq!(
            split(ring(8), &m, 0),
            Err(SplitError::ReadableAfterWritable { head: 0 })
        );
        // A buffer past the end of memory, also one the device would never touch.
        let m = mem_with(&[(0x4000, 16, NEXT, 1), (MEM - 4, 8, 0, 0)]);
        let s = split(ring(8), &m, 0).unwrap();
        assert_eq!(
            s.check_in(&m),
            Err(SplitError::Outside {
                head: 0,
                addr: MEM - 4,
                len: 8
            })
        );
        // Walk errors come through typed (the walk's own tests cover them all).
        let m = mem_with(&[(0x4000, 16, NEXT, 1), (0x4000, 16, NEXT, 0)]);
        assert!(matches!(
            split(ring(8), &m, 0),
            Err(SplitError::Walk(ChainError::Loop { .. }))
        ));
    }

    #[test]
    fn split_into_reuses_its_buffers() {
        let m = mem_with(&small_descs(6, 4, 0));
        let mut s = Split::default();
        RingView::resolve(&ring(8), &m)
            .unwrap()
            .split_into(0, &mut s)
            .unwrap();
        let cap = s.readable.capacity();
        assert_eq!(s.readable.len(), 6);
        RingView::resolve(&ring(8), &m)
            .unwrap()
            .split_into(3, &mut s)
            .unwrap();
        assert_eq!((s.head, s.readable.len()), (3, 3));
        assert_eq!(s.readable.capacity(), cap, "no new allocation");
    }

    /// A frame spread over many small descriptors (the guest's scatter-gather)
    /// comes out whole, and every byte range is prepared before it is read.
    #[test]
    fn frame_split_over_many_small_descriptors() {
        let descs = small_descs(40, 7, 0);
        let m = mem_with(&descs);
        let frame: Vec<u8> = (0..40 * 7).map(|i| i as u8).collect();
        for (i, c) in frame.chunks(7).enumerate() {
            m.write_slice(c, GuestAddress(0x4000 + i as u64 * 0x100))
                .unwrap();
        }
        let s = split(ring(64), &m, 0).unwrap();
        assert_eq!(total(&s.readable), 280);
        let prepared = RefCell::new(0u64);
        let prep = |_a: u64, n: u64| -> Result<(), String> {
            *prepared.borrow_mut() += n;
            Ok(())
        };
        // Skipping a 12-byte header that spans two descriptors.
        let mut out = vec![0u8; 280 - 12];
        read_bufs(&m, &prep, &s.readable, 12, &mut out).unwrap();
        assert_eq!(out, frame[12..]);
        assert_eq!(*prepared.borrow(), 268, "exactly the bytes read");
        // The same through the host slices kept by the check (the first
        // KEPT buffers; the others translated by the copy).
        let (kept, _) = s.check_in_keep(&m).unwrap();
        let mut via = vec![0u8; 280 - 12];
        read_kept(&m, &kept, &no_prepare, &s.readable, 12, &mut via).unwrap();
        assert_eq!(via, out);
        // And back into a writable chain of the same shape, header first.
        let m2 = mem_with(&small_descs(40, 7, WRITE));
        let s2 = split(ring(64), &m2, 0).unwrap();
        let hdr = [0xeeu8; 12];
        write_bufs(&m2, &no_prepare, &s2.writable, 0, &[&hdr, &out]).unwrap();
        let mut back = vec![0u8; 280];
        read_bufs(&m2, &no_prepare, &s2.writable, 0, &mut back).unwrap();
        assert_eq!(back[..12], hdr);
        assert_eq!(back[12..], frame[12..]);
    }

    /// A virtio-net header alone in its own descriptor, the frame in the next.
    #[test]
    fn header_alone_in_its_own_descriptor() {
        let m = mem_with(&[(0x4000, 12, WRITE | NEXT, 1), (0x5000, 1500, WRITE, 0)]);
        let s = split(ring(8), &m, 0).unwrap();
        let calls = RefCell::new(Vec::new());
        let prep = |a: u64, n: u64| -> Result<(), String> {
            calls.borrow_mut().push((a, n));
            Ok(())
        };
        let hdr = [1u8; 12];
        let frame = [7u8; 60];
        write_bufs(&m, &prep, &s.writable, 0, &[&hdr, &frame]).unwrap();
        assert_eq!(*calls.borrow(), vec![(0x4000, 12), (0x5000, 60)]);
        let mut f = [0u8; 60];
        read_bufs(&m, &no_prepare, &s.writable, 12, &mut f).unwrap();
        assert_eq!(f, frame);
        // Header and frame sharing a descriptor: a piece boundary inside it.
        let m = mem_with(&[(0x4000, 20, WRITE | NEXT, 1), (0x5000, 100, WRITE, 0)]);
        let s = split(ring(8), &m, 0).unwrap();
        calls.borrow_mut().clear();
        write_bufs(&m, &prep, &s.writable, 0, &[&hdr, &frame]).unwrap();
        assert_eq!(*calls.borrow(), vec![(0x4000, 20), (0x5000, 52)]);
    }

    /// A buffer over two adjacent regions is legal: not kept as one host
    /// slice, still checked and copied whole; one past the memory is refused.
    #[test]
    fn kept_slices_and_buffers_across_regions() {
        let m = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0x8000),
            (GuestAddress(0x8000), 0x8000),
        ])
        .unwrap();
        let descs = [(0x4000, 16, WRITE | NEXT, 1), (0x7ff8, 16, WRITE, 0)];
        for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
            let d = Descriptor::new(addr, len, flags, next);
            m.write_obj(d, GuestAddress(TABLE + 16 * i as u64)).unwrap();
        }
        let s = split(ring(8), &m, 0).unwrap();
        let (_, kept) = s.check_in_keep(&m).unwrap();
        assert!(kept.piece(0, 0, 16).is_some() && kept.piece(1, 0, 16).is_none());
        let data: Vec<u8> = (0..32).collect();
        write_kept(&m, &kept, &no_prepare, &s.writable, 0, &[&data]).unwrap();
        let mut back = [0u8; 16];
        m.read_slice(&mut back, GuestAddress(0x7ff8)).unwrap();
        assert_eq!(back[..], data[16..]);
        let mut via = [0u8; 32];
        read_kept(&m, &kept, &no_prepare, &s.writable, 0, &mut via).unwrap();
        assert_eq!(via[..], data[..]);
        // Past the end of memory: refused by the check.
        m.write_obj(
            Descriptor::new(0xfff8, 16, WRITE, 0),
            GuestAddress(TABLE + 16),
        )
        .unwrap();
        let s = split(ring(8), &m, 0).unwrap();
        assert!(matches!(
            s.check_in_keep(&m),
            Err(SplitError::Outside { addr: 0xfff8, .. })
        ));
    }

    /// A chain of one kept buffer (the frame path) copies and refuses
    /// exactly as the piece walk does, preparation included.
    #[test]
    fn one_kept_buffer_copies_as_the_piece_walk_does() {
        let m = mem_with(&[(0x4000, 100, WRITE, 0)]);
        let s = split(ring(8), &m, 0).unwrap();
        let (_, kept) = s.check_in_keep(&m).unwrap();
        let none = Kept::none();
        let hdr = [0xaa; 12];
        let frame: Vec<u8> = (0..64).collect();
        let seen = RefCell::new(Vec::new());
        let log = |a: u64, n: u64| -> Result<(), String> {
            seen.borrow_mut().push((a, n));
            Ok(())
        };
        let mut results = Vec::new();
        for k in [&kept, &none] {
            m.write_slice(&[0u8; 100], GuestAddress(0x4000)).unwrap();
            seen.borrow_mut().clear();
            write_kept(&m, k, &log, &s.writable, 3, &[&hdr, &frame]).unwrap();
            let mut back = [0u8; 100];
            m.read_slice(&mut back, GuestAddress(0x4000)).unwrap();
            let mut via = [0u8; 70];
            read_kept(&m, k, &log, &s.writable, 5, &mut via).unwrap();
            let over = read_kept(&m, k, &log, &s.writable, 40, &mut [0u8; 61]);
            let too_long = write_kept(&m, k, &log, &s.writable, 0, &[&[1; 101]]);
            results.push((
                back.to_vec(),
                via.to_vec(),
                seen.borrow().clone(),
                format!("{over:?} {too_long:?}"),
            ));
        }
        assert_eq!(results[0], results[1]);
        let (back, _, prepared, errors) = &results[0];
        assert_eq!((&back[3..15], &back[15..79]), (&hdr[..], &frame[..]));
        assert_eq!(prepared[..2], [(0x4003, 76), (0x4005, 70)]);
        assert!(errors.contains("Beyond"), "{errors}");
    }

    #[test]
    fn copies_fail_cleanly() {
        let m = mem_with(&[]);
        let bufs = [
            Buf {
                addr: 0x4000,
                len: 4,
            },
            Buf {
                addr: 0x5000,
                len: 4,
            },
        ];
        assert!(matches!(
            read_bufs(&m, &no_prepare, &bufs, 6, &mut [0u8; 3]),
            Err(CopyError::Beyond { total: 8, .. })
        ));
        assert!(matches!(
            read_bufs(&m, &no_prepare, &bufs, u64::MAX, &mut [0u8; 2]),
            Err(CopyError::Beyond { .. })
        ));
        // A refused preparation stops the copy before any byte moves.
        m.write_slice(&[9; 4], GuestAddress(0x4000)).unwrap();
        let refuse = |_: u64, _: u64| -> Result<(), String> { Err("no".into()) };
        assert!(matches!(
            write_bufs(&m, &refuse, &bufs, 0, &[&[1, 2]]),
            Err(CopyError::Prepare { addr: 0x4000, .. })
        ));
        let mut b = [0u8; 4];
        m.read_slice(&mut b, GuestAddress(0x4000)).unwrap();
        assert_eq!(b, [9; 4]);
        // Outside memory: an error, not a crash.
        let out = [Buf {
            addr: MEM - 2,
            len: 4,
        }];
        assert!(matches!(
            read_bufs(&m, &no_prepare, &out, 0, &mut [0u8; 4]),
            Err(CopyError::Access { .. })
        ));
        let wrap = [Buf {
            addr: u64::MAX - 1,
            len: 4,
        }];
        assert!(matches!(
            read_bufs(&m, &no_prepare, &wrap, 3, &mut [0u8; 1]),
            Err(CopyError::Overflow { .. })
        ));
    }
}
