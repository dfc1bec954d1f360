//! A chain of one descriptor whose buffer lies in one memory region: how
//! virtio-net drivers post frames (header and frame in one buffer, Linux
//! with VIRTIO_F_ANY_LAYOUT/VERSION_1, DPDK's virtio PMD). A device takes it
//! straight from the descriptor with its host address (memory that is a
//! [`crate::HostRange`], the translation cache) and copies through that
//! address, one `memmove` per part: no split into lists, no kept slices, no
//! piece walk, no vm-memory slice (DPDK's vhost library copies the same way,
//! through each descriptor's host address). Nothing is
//! checked less than on the general path: one descriptor load decides (no
//! NEXT, no INDIRECT, the head inside the table), the buffer must lie in
//! one region, and every copy makes the range checks [`crate::read_kept`]
//! makes and prepares what it touches. Any other chain (and a buffer over
//! two regions or outside memory) goes the general way
//! ([`RingView::split_into`]), which says what is wrong with it.

use std::marker::PhantomData;
use std::ptr::NonNull;

use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT};
use vm_memory::{ByteValued, GuestMemory};

use crate::segments::{prepared, Prepare};
use crate::view::Slice;
use crate::xlat::HostRange;
use crate::{Buf, CopyError, RingView};

/// The chain at `head`: one buffer, and its host address for this burst.
#[derive(Debug)]
pub struct OneBuf<'m, M: ?Sized> {
    pub head: u16,
    pub buf: Buf,
    /// Device-writable (VRING_DESC_F_WRITE): a receive buffer.
    pub writable: bool,
    /// `buf.len` bytes of guest memory (`HostRange`), mapped while `'m` lasts.
    host: NonNull<u8>,
    mem: PhantomData<&'m M>,
}

// A view of guest memory, not the memory: copying it is free (no bound on `M`).
impl<M: ?Sized> Clone for OneBuf<'_, M> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<M: ?Sized> Copy for OneBuf<'_, M> {}

impl<'m, M: GuestMemory + HostRange + ?Sized> RingView<'m, M> {
    /// The chain at `head` if it is one descriptor whose buffer lies in one
    /// region (see the module doc); `None` sends the caller the general way.
    #[inline]
    pub fn one_buf(&self, head: u16) -> Option<OneBuf<'m, M>> {
        let d = self.descriptor_at(head)?;
        if u32::from(d.flags()) & (VRING_DESC_F_NEXT | VRING_DESC_F_INDIRECT) != 0 {
            return None;
        }
        let buf = Buf {
            addr: d.addr().0,
            len: d.len(),
        };
        Some(OneBuf {
            head,
            buf,
            writable: d.is_write_only(),
            host: self.mem.host_range(buf.addr, buf.len as usize)?,
            mem: PhantomData,
        })
    }
}

impl<M: ?Sized> OneBuf<'_, M> {
    /// Starts loading the lines of the buffer's first 65 bytes (a small
    /// frame with its virtio-net header, wherever the buffer starts): a
    /// device that holds a burst's buffers asks for all of them before it
    /// copies the first, so the misses on lines the driver's CPU just wrote
    /// overlap. Longer copies run ahead by themselves.
    #[inline]
    pub fn prefetch(&self) {
        let p = self.host.as_ptr();
        crate::view::prefetch_ptr(p);
        if self.buf.len > 64 {
            crate::view::prefetch_ptr(p.wrapping_add(64));
        }
    }

    /// [`crate::read_bufs`] for this chain: bytes `skip..skip + out.len()`.
    #[inline]
    pub fn read<P>(&self, prepare: &P, skip: u64, out: &mut [u8]) -> Result<(), CopyError>
    where
        P: Prepare + ?Sized,
    {
        let at = self.prepared_range(prepare, skip, out.len())?;
        if !out.is_empty() {
            // SAFETY: `at + out.len()` <= buf.len (`range`), and the buffer's
            // buf.len bytes are mapped while 'm lasts (`host`); `out` is the
            // caller's exclusive memory. A racing guest write changes what is
            // read, never where (as vm-memory's own copies).
            unsafe {
                std::ptr::copy(self.host.as_ptr().add(at), out.as_mut_ptr(), out.len());
            }
        }
        Ok(())
    }

    /// [`crate::write_bufs`] for this chain: `parts` one after the other from `skip`.
    #[inline]
    pub fn write<P>(&self, prepare: &P, skip: u64, parts: &[&[u8]]) -> Result<(), CopyError>
    where
        P: Prepare + ?Sized,
    {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let mut at = self.prepared_range(prepare, skip, len)?;
        for data in parts {
            // SAFETY: the parts end at `skip + len` <= buf.len (`range`),
            // inside the mapped buffer (`host`); `ptr::copy` allows a part
            // that overlaps it.
            unsafe {
                std::ptr::copy(data.as_ptr(), self.host.as_ptr().add(at), data.len());
            }
            at += data.len();
        }
        Ok(())
    }

    /// Reads a `T` from bytes `skip..skip + size_of::<T>()` (unaligned):
    /// one load per word, straight into registers. For the few fields a
    /// device decides on (an Ethernet header's addresses): read through a
    /// byte array instead, they come back from a stack copy at other widths
    /// than it was written with, which defeats store forwarding and makes
    /// the load wait until every older store (the previous frames' copies
    /// into other buffers) has reached the cache.
    #[inline]
    pub fn read_obj<T, P>(&self, prepare: &P, skip: u64) -> Result<T, CopyError>
    where
        T: ByteValued,
        P: Prepare + ?Sized,
    {
        let at = self.prepared_range(prepare, skip, size_of::<T>())?;
        // SAFETY: inside the mapped buffer (`range`, `host`); any bytes are
        // a valid `T` (`ByteValued`). A racing guest write changes the
        // value read, never where it is read.
        Ok(unsafe { self.host.as_ptr().add(at).cast::<T>().read_unaligned() })
    }

    /// Writes `val` at bytes `skip..skip + size_of::<T>()` (unaligned): a
    /// value in registers goes out as one store per word (see `read_obj`).
    #[inline]
    pub fn write_obj<T, P>(&self, prepare: &P, skip: u64, val: T) -> Result<(), CopyError>
    where
        T: ByteValued,
        P: Prepare + ?Sized,
    {
        let at = self.prepared_range(prepare, skip, size_of::<T>())?;
        // SAFETY: inside the mapped buffer (`range`, `host`).
        unsafe { self.host.as_ptr().add(at).cast::<T>().write_unaligned(val) };
        Ok(())
    }

    /// Copies bytes `skip..skip + len` of this buffer to bytes
    /// `dst_skip..` of `dst`, another chain's buffer (guest to guest: one
    /// `memmove`, no bounce buffer), after preparing both ranges
    /// (`prepare` for this buffer's memory, `dst_prepare` for `dst`'s).
    #[inline]
    pub fn copy_to<N, P, Q>(
        &self,
        prepare: &P,
        skip: u64,
        dst: &OneBuf<'_, N>,
        dst_prepare: &Q,
        dst_skip: u64,
        len: usize,
    ) -> Result<(), CopyError>
    where
        N: ?Sized,
        P: Prepare + ?Sized,
        Q: Prepare + ?Sized,
    {
        let from = self.range(skip, len)?;
        let to = dst.range(dst_skip, len)?;
        if len == 0 {
            return Ok(());
        }
        prepared(prepare, self.buf.addr + from as u64, len)?;
        prepared(dst_prepare, dst.buf.addr + to as u64, len)?;
        // SAFETY: both ranges lie inside their buffers (`range`), which are
        // mapped while their views' memory is borrowed (`host`); `ptr::copy`
        // allows the two to overlap (two ports of one frontend may share
        // its memory).
        unsafe {
            std::ptr::copy(self.host.as_ptr().add(from), dst.host.as_ptr().add(to), len);
        }
        Ok(())
    }

    /// `range`, then the range prepared (when not empty) for the access.
    #[inline]
    fn prepared_range<P>(&self, prepare: &P, skip: u64, len: usize) -> Result<usize, CopyError>
    where
        P: Prepare + ?Sized,
    {
        let at = self.range(skip, len)?;
        if len > 0 {
            prepared(prepare, self.buf.addr + at as u64, len)?;
        }
        Ok(at)
    }

    /// The offset of bytes `skip..skip + len` in the buffer, or the error
    /// the piece walk gives for them.
    #[inline]
    fn range(&self, skip: u64, len: usize) -> Result<usize, CopyError> {
        within(&self.buf, skip, len as u64).map(|()| skip as usize)
    }
}

/// Whether bytes `skip..skip + len` lie in buffer `b`; the error the piece
/// walk gives when they do not.
#[inline]
fn within(b: &Buf, skip: u64, len: u64) -> Result<(), CopyError> {
    let total = u64::from(b.len);
    if skip.checked_add(len).is_none_or(|end| end > total) {
        return Err(CopyError::Beyond { skip, len, total });
    }
    Ok(())
}

/// Reads bytes `skip..` of one buffer `b` whose whole host slice is `s`.
#[inline]
pub(crate) fn read_one<M, P>(
    b: &Buf,
    s: &Slice<'_, M>,
    prepare: &P,
    skip: u64,
    out: &mut [u8],
) -> Result<(), CopyError>
where
    M: GuestMemory + ?Sized,
    P: Prepare + ?Sized,
{
    let (addr, p) = piece::<M>(b, s, skip, out.len() as u64)?;
    if !out.is_empty() {
        prepared(prepare, addr, out.len())?;
        p.copy_to(out);
    }
    Ok(())
}

/// Writes `parts` one after the other at bytes `skip..` of one buffer `b`
/// whose whole host slice is `s`, after preparing the range they cover.
#[inline]
pub(crate) fn write_one<M, P>(
    b: &Buf,
    s: &Slice<'_, M>,
    prepare: &P,
    skip: u64,
    parts: &[&[u8]],
) -> Result<(), CopyError>
where
    M: GuestMemory + ?Sized,
    P: Prepare + ?Sized,
{
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let (addr, p) = piece::<M>(b, s, skip, len as u64)?;
    if len == 0 {
        return Ok(());
    }
    prepared(prepare, addr, len)?;
    let mut at = 0;
    for data in parts {
        if let Ok(dst) = p.subslice(at, data.len()) {
            dst.copy_from(data);
        }
        at += data.len();
    }
    Ok(())
}

/// Bytes `skip..skip + len` of buffer `b` (host slice `s`, all of it): its
/// guest address and host piece, or the error the piece walk gives.
#[inline]
fn piece<'m, M: GuestMemory + ?Sized>(
    b: &Buf,
    s: &Slice<'m, M>,
    skip: u64,
    len: u64,
) -> Result<(u64, Slice<'m, M>), CopyError> {
    within(b, skip, len)?;
    let addr = b.addr.checked_add(skip).ok_or(CopyError::Overflow {
        addr: b.addr,
        len: b.len,
    })?;
    // In range of `s` (b.len bytes) by the check above.
    let piece = s
        .subslice(skip as usize, len as usize)
        .map_err(|_| CopyError::Beyond {
            skip,
            len,
            total: u64::from(b.len),
        })?;
    Ok((addr, piece))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{ring, write_table, INDIRECT, NEXT, TABLE, WRITE};
    use crate::{read_bufs, write_bufs, Xlat, VIRTIO_F_INDIRECT_DESC};
    use std::cell::RefCell;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    /// Two adjacent regions [0, 0x8000) and [0x8000, 0x10000).
    fn mem_with(descs: &[(u64, u32, u16, u16)]) -> GuestMemoryMmap {
        let m = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0x8000),
            (GuestAddress(0x8000), 0x8000),
        ])
        .unwrap();
        write_table(&m, TABLE, descs);
        m
    }

    /// A preparation that records each range it is asked for in `seen`.
    fn logger(seen: &RefCell<Vec<(u64, u64)>>) -> impl Fn(u64, u64) -> Result<(), String> + '_ {
        |a, n| {
            seen.borrow_mut().push((a, n));
            Ok(())
        }
    }

    #[test]
    fn only_a_lone_descriptor_in_one_region_is_taken() {
        let m = mem_with(&[
            (0x4000, 100, 0, 0),
            (0x5000, 2048, WRITE, 0),
            (0x4000, 16, NEXT, 0),
            (0x6000, 32, INDIRECT, 0),
            (0x7ff0, 32, 0, 0),
            (0xfff0, 32, WRITE, 0),
            (0x4000, 0, 0, 0),
        ]);
        for features in [0, 1 << VIRTIO_F_INDIRECT_DESC] {
            let r = ring(8, features);
            let x = Xlat::new(&m);
            let v = RingView::resolve(&r, &x).unwrap();
            let one = v.one_buf(0).unwrap();
            assert_eq!(
                (one.head, one.buf, one.writable),
                (
                    0,
                    Buf {
                        addr: 0x4000,
                        len: 100
                    },
                    false
                )
            );
            assert!(v.one_buf(1).unwrap().writable);
            // NEXT, INDIRECT, over two regions, past memory, empty, outside the table.
            for head in [2, 3, 4, 5, 6, 8, u16::MAX] {
                assert!(v.one_buf(head).is_none(), "head {head}");
            }
        }
    }

    #[test]
    fn copies_match_the_general_copiers_and_refuse_alike() {
        let m = mem_with(&[(0x4000, 100, WRITE, 0)]);
        let r = ring(8, 0);
        let x = Xlat::new(&m);
        let v = RingView::resolve(&r, &x).unwrap();
        let one = v.one_buf(0).unwrap();
        let bufs = [one.buf];
        let seen = RefCell::new(Vec::new());
        let log = logger(&seen);
        let (hdr, frame) = ([7u8; 12], [9u8; 60]);
        one.write(&log, 2, &[&hdr, &frame]).unwrap();
        let mut a = [0u8; 80];
        one.read(&log, 1, &mut a).unwrap();
        let mut b = [0u8; 80];
        read_bufs(&m, &log, &bufs, 1, &mut b).unwrap();
        assert_eq!(a, b);
        assert_eq!((&a[1..13], &a[13..73]), (&hdr[..], &frame[..]));
        assert_eq!(seen.borrow()[..2], [(0x4002, 72), (0x4001, 80)]);
        // Too long, or past the end: the errors the general copiers give, no byte moved.
        let long = one.read(&log, 41, &mut [0u8; 60]).unwrap_err();
        let general = read_bufs(&m, &log, &bufs, 41, &mut [0u8; 60]).unwrap_err();
        assert_eq!(format!("{long:?}"), format!("{general:?}"));
        let over = one.write(&log, 0, &[&[1u8; 101]]).unwrap_err();
        let general = write_bufs(&m, &log, &bufs, 0, &[&[1u8; 101]]).unwrap_err();
        assert_eq!(format!("{over:?}"), format!("{general:?}"));
        // A refused preparation moves nothing.
        let refuse = |_: u64, _: u64| -> Result<(), String> { Err("no".into()) };
        assert!(matches!(
            one.write(&refuse, 0, &[&[1u8; 4]]),
            Err(CopyError::Prepare {
                addr: 0x4000,
                len: 4,
                ..
            })
        ));
        let mut back = [0u8; 4];
        m.read_slice(&mut back, GuestAddress(0x4000)).unwrap();
        assert_eq!(back, [0, 0, 7, 7]);
    }

    #[test]
    fn words_are_read_and_written_unaligned_with_the_same_checks() {
        let m = mem_with(&[(0x4001, 20, WRITE, 0)]);
        let r = ring(8, 0);
        let x = Xlat::new(&m);
        let v = RingView::resolve(&r, &x).unwrap();
        let one = v.one_buf(0).unwrap();
        let seen = RefCell::new(Vec::new());
        let log = logger(&seen);
        m.write_slice(&(1u8..=20).collect::<Vec<_>>(), GuestAddress(0x4001))
            .unwrap();
        // Bytes 5..13 (buffer offsets), little-endian, at an odd address.
        assert_eq!(
            one.read_obj::<u64, _>(&log, 5).unwrap(),
            u64::from_le_bytes([6, 7, 8, 9, 10, 11, 12, 13])
        );
        one.write_obj(&log, 12, 0xa1a2_a3a4_a5a6_a7a8u64).unwrap();
        one.write_obj(&log, 0, [0xeeu8; 3]).unwrap();
        let mut back = [0u8; 20];
        m.read_slice(&mut back, GuestAddress(0x4001)).unwrap();
        assert_eq!(&back[..3], &[0xee; 3]);
        assert_eq!(&back[3..12], &[4, 5, 6, 7, 8, 9, 10, 11, 12]);
        assert_eq!(&back[12..], &0xa1a2_a3a4_a5a6_a7a8u64.to_le_bytes());
        assert_eq!(seen.borrow()[..], [(0x4006, 8), (0x400d, 8), (0x4001, 3)]);
        // Past the end (by one byte): the general copiers' error, nothing
        // prepared or written.
        let before = seen.borrow().len();
        assert!(matches!(
            one.read_obj::<u64, _>(&log, 13),
            Err(CopyError::Beyond {
                skip: 13,
                len: 8,
                total: 20
            })
        ));
        assert!(matches!(
            one.write_obj(&log, 13, 0u64),
            Err(CopyError::Beyond { skip: 13, .. })
        ));
        assert!(one.write_obj(&log, u64::MAX - 3, 0u64).is_err());
        assert_eq!(seen.borrow().len(), before);
        let mut again = [0u8; 20];
        m.read_slice(&mut again, GuestAddress(0x4001)).unwrap();
        assert_eq!(again, back);
        // A refused preparation: nothing written.
        let refuse = |_: u64, _: u64| -> Result<(), String> { Err("no".into()) };
        assert!(matches!(
            one.write_obj(&refuse, 0, 0u64),
            Err(CopyError::Prepare {
                addr: 0x4001,
                len: 8,
                ..
            })
        ));
        m.read_slice(&mut again, GuestAddress(0x4001)).unwrap();
        assert_eq!(again, back);
    }
}
