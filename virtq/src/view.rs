//! A split virtqueue's three rings as host memory, resolved once per burst.
//!
//! [`RingView::resolve`] translates the descriptor table (16 × size bytes),
//! the available ring (flags, idx, size entries, `used_event`) and the used
//! ring (flags, idx, size elements, `avail_event`) through the memory table
//! (e.g. [`crate::Xlat`]) into one [`VolatileSlice`] each, bounds checked
//! there once, and keeps the host addresses of the table and of the rings'
//! entries. Every access afterwards is a masked index and one volatile load
//! or store through those addresses: a descriptor as one 16-byte load, an
//! available entry as one 2-byte load, a used element as two 4-byte stores,
//! the available index with Acquire, the used index with one Release store
//! per burst. A ring that does not lie inside one memory region is refused
//! (as DPDK's `vring_translate` refuses a ring it cannot map contiguously);
//! guests put each ring in one allocation, so only a hostile or broken
//! driver meets that. So is a ring that breaks virtio's alignment (table 16,
//! available ring 2, used ring 4), which the volatile accesses rely on.
//!
//! The view *borrows* the memory table: a device builds one per burst and
//! keeps no host address across bursts, so a memory-table change (applied
//! between bursts) never meets a stale translation.

use std::ptr::NonNull;
use std::sync::atomic::{fence, Ordering};

use virtio_queue::desc::split::Descriptor;
use virtio_queue::QueueT;
use vm_memory::bitmap::BS;
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions, VolatileMemory, VolatileSlice};

use crate::{Ring, DESC_SIZE};

/// Bytes before the rings' entries (flags, idx), per available entry and per used element.
pub(crate) const HEADER: usize = 4;
pub(crate) const AVAIL_ENTRY: usize = 2;
pub(crate) const USED_ELEM: usize = 8;
/// Offset of the `idx` word in both rings.
pub(crate) const IDX: usize = 2;

/// Why a queue's rings cannot be used. The device names the queue.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    #[error("{part} at {addr:#x}+{len:#x} is not inside one guest memory region")]
    NotMapped {
        part: &'static str,
        addr: u64,
        len: u64,
    },
    #[error("available index {avail} is more than the ring's {size} entries ahead of {next}")]
    AvailAhead { avail: u16, next: u16, size: u16 },
    #[error("used element for head {head} outside a ring of {size}")]
    HeadOutOfRange { head: u16, size: u16 },
    /// Split virtqueues are a power of two in size (virtio 1.2 §2.7);
    /// virtio-queue refuses other sizes when the driver sets them.
    #[error("queue size {size} is not a power of two")]
    BadSize { size: u16 },
    /// virtio 1.2 §2.7: the table is 16-aligned, the available ring 2, the used ring 4.
    #[error("{part} at {addr:#x} is not {align}-byte aligned")]
    Misaligned {
        part: &'static str,
        addr: u64,
        align: usize,
    },
}

/// `[addr, addr + len)` as one host slice, if it lies inside one region.
#[inline]
pub(crate) fn contiguous<M: GuestMemory + ?Sized>(
    mem: &M,
    addr: u64,
    len: usize,
) -> Option<VolatileSlice<'_, BS<'_, M::Bitmap>>> {
    let mut slices = mem
        .get_slices(GuestAddress(addr), len, Permissions::ReadWrite)
        .ok()?;
    let s = slices.next()?.ok()?;
    (s.len() == len).then_some(s)
}

/// Starts loading the cache line at `p`. A hint: it accesses nothing
/// architecturally and never faults, whatever `p` is.
#[inline]
pub(crate) fn prefetch_ptr(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 only hints the cache; it accesses no memory
    // architecturally and does not fault on any address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// A host slice of guest memory `M`.
pub(crate) type Slice<'m, M> = VolatileSlice<'m, BS<'m, <M as GuestMemory>::Bitmap>>;

/// The rings of one queue for one burst (see the module doc).
#[derive(Debug)]
pub struct RingView<'m, M: GuestMemory + ?Sized> {
    pub(crate) ring: Ring,
    /// `size - 1`: ring slots are free-running indexes masked with it (no division).
    pub(crate) mask: u16,
    pub(crate) mem: &'m M,
    pub(crate) avail: Slice<'m, M>,
    pub(crate) used: Slice<'m, M>,
    /// Host addresses (aligned and bounds checked by `resolve`): descriptor
    /// 0 of the table, available entry 0 and used element 0 (as u32 id/len
    /// pairs) inside the two ring slices above. A slot access is a masked
    /// index and one volatile load or store, as in DPDK's vhost library.
    desc_host: NonNull<Descriptor>,
    avail_host: NonNull<u16>,
    used_host: NonNull<u32>,
}

impl<'m, M: GuestMemory + ?Sized> RingView<'m, M> {
    /// Resolves `ring`'s descriptor table, available and used rings (with
    /// the event-index words when `ring.event_idx`) in `mem`.
    pub fn resolve(ring: &Ring, mem: &'m M) -> Result<Self, RingError> {
        if !ring.size.is_power_of_two() {
            return Err(RingError::BadSize { size: ring.size });
        }
        let size = usize::from(ring.size);
        let event = if ring.event_idx { 2 } else { 0 };
        let part = |part, addr: GuestAddress, len: usize| {
            contiguous(mem, addr.0, len).ok_or(RingError::NotMapped {
                part,
                addr: addr.0,
                len: len as u64,
            })
        };
        let desc = part(
            "descriptor table",
            ring.desc_table,
            size * DESC_SIZE as usize,
        )?;
        let avail = part(
            "available ring",
            ring.avail_ring,
            HEADER + size * AVAIL_ENTRY + event,
        )?;
        let used = part(
            "used ring",
            ring.used_ring,
            HEADER + size * USED_ELEM + event,
        )?;
        let host = |part, addr: GuestAddress, s: &Slice<'m, M>, align: usize, skip: usize| {
            let p = s.ptr_guard_mut().as_ptr();
            if !(p as usize).is_multiple_of(align) {
                return Err(RingError::Misaligned {
                    part,
                    addr: addr.0,
                    align,
                });
            }
            // `skip` < s.len() (the header of a ring resolved with its entries).
            Ok(NonNull::new(p.wrapping_add(skip)).expect("a mapped slice"))
        };
        Ok(RingView {
            ring: *ring,
            mask: ring.size - 1,
            mem,
            desc_host: host("descriptor table", ring.desc_table, &desc, 16, 0)?.cast(),
            avail_host: host("available ring", ring.avail_ring, &avail, 2, HEADER)?.cast(),
            used_host: host("used ring", ring.used_ring, &used, 4, HEADER)?.cast(),
            avail,
            used,
        })
    }

    /// The memory the view was resolved in (for the buffers' own checks and copies).
    pub fn mem(&self) -> &'m M {
        self.mem
    }

    pub fn size(&self) -> u16 {
        self.ring.size
    }

    /// Descriptor `index` of the table, if `index` < size.
    #[inline]
    pub(crate) fn descriptor_at(&self, index: u16) -> Option<Descriptor> {
        if index < self.ring.size {
            self.descriptor(index)
        } else {
            None
        }
    }

    /// Descriptor `index` of the table (`index` < size, checked by the caller).
    #[inline]
    pub(crate) fn descriptor(&self, index: u16) -> Option<Descriptor> {
        if index >= self.ring.size {
            return None;
        }
        // SAFETY: `index` < size: inside the table slice (size × 16 bytes,
        // mapped while 'm lasts), 16-aligned (`resolve`). The driver may
        // rewrite it meanwhile: the one load gives a consistent copy that
        // every check is made on.
        Some(unsafe { self.desc_host.add(usize::from(index)).read_volatile() })
    }

    /// Starts loading descriptor `index` into the cache (nothing if it is
    /// outside the table): a device that knows a burst's heads asks for all
    /// their descriptors before it walks the first, so the cache misses on a
    /// table the driver just wrote overlap instead of one per chain (DPDK's
    /// vhost library prefetches the same way).
    #[inline]
    pub fn prefetch_desc(&self, index: u16) {
        if index < self.ring.size {
            // `index` < size: inside the table (a hint in any case).
            prefetch_ptr(
                self.desc_host
                    .as_ptr()
                    .wrapping_add(usize::from(index))
                    .cast(),
            );
        }
    }

    /// How many chains the driver made available past `next_avail` (the
    /// index read with Acquire: the entries and descriptors it covers are
    /// visible after it).
    pub fn pending(&self, next_avail: u16) -> Result<u16, RingError> {
        let avail = self.load_u16(&self.avail, IDX, Ordering::Acquire);
        let n = avail.wrapping_sub(next_avail);
        if n > self.ring.size {
            return Err(RingError::AvailAhead {
                avail,
                next: next_avail,
                size: self.ring.size,
            });
        }
        Ok(n)
    }

    /// The chains the driver made available, at most `max`: `q`'s next
    /// available index moves past them now (each one taken must be returned
    /// through [`RingView::complete_used`], or the queue fails).
    pub fn avail_heads(
        &self,
        q: &mut impl QueueT,
        max: usize,
    ) -> Result<AvailHeads<'_, 'm, M>, RingError> {
        let next = q.next_avail();
        let n = self
            .pending(next)?
            .min(u16::try_from(max).unwrap_or(u16::MAX));
        q.set_next_avail(next.wrapping_add(n));
        Ok(AvailHeads {
            view: self,
            pos: next,
            left: n,
        })
    }

    /// The head index in available entry `pos` (a free-running index, taken
    /// modulo the ring size); the caller checks it as a descriptor index.
    #[inline]
    pub fn avail_head(&self, pos: u16) -> u16 {
        // SAFETY: the slot is masked below size: inside the ring's entries
        // (mapped while 'm lasts), 2-aligned (`resolve`).
        u16::from_le(unsafe {
            self.avail_host
                .add(usize::from(pos & self.mask))
                .read_volatile()
        })
    }

    /// Writes used element `slot` (< size, masked by the caller): `head` and
    /// `len`, as two aligned 32-bit stores (a used ring is 4-aligned, so
    /// its 8-byte elements need not be 8-aligned).
    #[inline]
    pub(crate) fn put_used(&self, slot: u16, head: u16, len: u32) {
        let e = usize::from(slot & self.mask) * 2;
        // SAFETY: the slot is masked below size: inside the ring's elements
        // (mapped while 'm lasts), 4-aligned (`resolve`).
        unsafe {
            self.used_host
                .add(e)
                .write_volatile(u32::from(head).to_le());
            self.used_host.add(e + 1).write_volatile(len.to_le());
        }
    }

    /// The word at `off` of a resolved ring (in bounds by construction).
    /// A misaligned ring cannot take the atomic load: a volatile load and
    /// a fence then.
    pub(crate) fn load_u16(&self, s: &Slice<'m, M>, off: usize, order: Ordering) -> u16 {
        let v = s.load::<u16>(off, order).unwrap_or_else(|_| {
            let v = s.get_ref::<u16>(off).expect("resolved header").load();
            fence(Ordering::Acquire);
            v
        });
        u16::from_le(v)
    }
}

/// Iterator of [`RingView::avail_heads`]: head indexes, in the driver's order.
#[derive(Debug)]
pub struct AvailHeads<'v, 'm, M: GuestMemory + ?Sized> {
    view: &'v RingView<'m, M>,
    pos: u16,
    left: u16,
}

impl<M: GuestMemory + ?Sized> AvailHeads<'_, '_, M> {
    /// Heads not yet taken.
    pub fn len(&self) -> usize {
        usize::from(self.left)
    }

    pub fn is_empty(&self) -> bool {
        self.left == 0
    }
}

impl<M: GuestMemory + ?Sized> Iterator for AvailHeads<'_, '_, M> {
    type Item = u16;

    #[inline]
    fn next(&mut self) -> Option<u16> {
        self.left = self.left.checked_sub(1)?;
        let head = self.view.avail_head(self.pos);
        self.pos = self.pos.wrapping_add(1);
        Some(head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    const SIZE: u16 = 8;
    const DESC_LEN: u64 = 16 * SIZE as u64;
    const AVAIL_LEN: u64 = 4 + 2 * SIZE as u64;
    const USED_LEN: u64 = 4 + 8 * SIZE as u64;

    /// Two adjacent regions: [0, 0x4000) and [0x4000, 0x8000).
    fn two_regions() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x4000), (GuestAddress(0x4000), 0x4000)])
            .unwrap()
    }

    fn ring(desc: u64, avail: u64, used: u64, event_idx: bool) -> Ring {
        Ring {
            desc_table: GuestAddress(desc),
            avail_ring: GuestAddress(avail),
            used_ring: GuestAddress(used),
            size: SIZE,
            features: 0,
            event_idx,
        }
    }

    fn refused(r: Ring, m: &GuestMemoryMmap) -> Option<&'static str> {
        match RingView::resolve(&r, m) {
            Ok(_) => None,
            Err(RingError::NotMapped { part, .. }) => Some(part),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn a_ring_must_lie_inside_one_region() {
        let m = two_regions();
        let end = 0x4000u64;
        // Each ring ending exactly at the first region's end: accepted.
        assert_eq!(refused(ring(end - DESC_LEN, 0x100, 0x200, false), &m), None);
        assert_eq!(refused(ring(0, end - AVAIL_LEN, 0x200, false), &m), None);
        assert_eq!(refused(ring(0, 0x100, end - USED_LEN, false), &m), None);
        // With EVENT_IDX each ring is 2 bytes longer.
        assert_eq!(
            refused(ring(0, end - AVAIL_LEN - 2, end - 0x100, true), &m),
            None
        );
        // (A used ring is 4-aligned: with its 70 bytes it ends 2 short of the region.)
        assert_eq!(refused(ring(0, 0x100, end - USED_LEN - 4, true), &m), None);
        // One byte past (so crossing into the adjacent region): refused, named.
        for (r, part) in [
            (
                ring(end - DESC_LEN + 1, 0x100, 0x200, false),
                "descriptor table",
            ),
            (ring(0, end - AVAIL_LEN + 1, 0x200, false), "available ring"),
            (ring(0, 0x100, end - USED_LEN + 1, false), "used ring"),
            (ring(0, end - AVAIL_LEN, 0x200, true), "available ring"),
            (ring(0, 0x100, end - USED_LEN, true), "used ring"),
            // Past the end of memory, and far outside it.
            (
                ring(0x8000 - DESC_LEN + 1, 0x100, 0x200, false),
                "descriptor table",
            ),
            (ring(0, 0x100, u64::MAX - 8, false), "used ring"),
        ] {
            assert_eq!(refused(r, &m), Some(part), "{r:?}");
        }
        let e = RingView::resolve(&ring(end - 8, 0x100, 0x200, false), &m)
            .err()
            .unwrap();
        assert_eq!(
            e.to_string(),
            "descriptor table at 0x3ff8+0x80 is not inside one guest memory region"
        );
        // Misaligned rings (virtio 1.2 §2.7: 16, 2, 4): refused, named.
        for (r, part, addr, align) in [
            (ring(8, 0x100, 0x200, false), "descriptor table", 8, 16),
            (ring(0, 0x101, 0x200, false), "available ring", 0x101, 2),
            (ring(0, 0x100, 0x202, false), "used ring", 0x202, 4),
        ] {
            assert_eq!(
                RingView::resolve(&r, &m).err(),
                Some(RingError::Misaligned { part, addr, align }),
                "{r:?}"
            );
        }
        // A ring of size 0 or not a power of two: refused, named.
        for size in [0, 3, 6, 0xffff] {
            let r = Ring {
                size,
                ..ring(0, 0x100, 0x200, false)
            };
            assert_eq!(
                RingView::resolve(&r, &m).err(),
                Some(RingError::BadSize { size })
            );
        }
    }

    #[test]
    fn avail_heads_wrap_around_at_65535() {
        let m = two_regions();
        let r = ring(0, 0x1000, 0x2000, false);
        let mut q = virtio_queue::Queue::new(SIZE).unwrap();
        q.set_size(SIZE);
        q.set_next_avail(65534);
        // The driver made 4 available: entries 65534, 65535, 0, 1 (slots 6, 7, 0, 1).
        for (slot, head) in [(6u64, 3u16), (7, 5), (0, 1), (1, 7)] {
            m.write_obj(head, GuestAddress(0x1000 + 4 + 2 * slot))
                .unwrap();
        }
        m.write_obj(2u16, GuestAddress(0x1002)).unwrap();
        let v = RingView::resolve(&r, &m).unwrap();
        assert_eq!(v.pending(65534), Ok(4));
        let heads: Vec<u16> = v.avail_heads(&mut q, 3).unwrap().collect();
        assert_eq!(heads, [3, 5, 1], "at most max, in order");
        assert_eq!(q.next_avail(), 1);
        let heads: Vec<u16> = v.avail_heads(&mut q, 64).unwrap().collect();
        assert_eq!((heads, q.next_avail()), (vec![7], 2));
        assert!(v.avail_heads(&mut q, 64).unwrap().is_empty());
        // An index more than the ring ahead of the device: refused, nothing taken.
        m.write_obj(2u16 + SIZE + 1, GuestAddress(0x1002)).unwrap();
        assert_eq!(
            v.avail_heads(&mut q, 64).err(),
            Some(RingError::AvailAhead {
                avail: 11,
                next: 2,
                size: SIZE
            })
        );
        assert_eq!(q.next_avail(), 2);
    }
}
