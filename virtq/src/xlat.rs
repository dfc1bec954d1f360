//! A guest-address translation cache: the regions of one memory table
//! (guest start, length, region) copied into a small array once, and the
//! region the last access hit checked first. It is a vm-memory
//! [`GuestMemory`]: the ring view ([`crate::RingView`], rings resolved once
//! per burst), indirect tables and the segment copies translate through
//! it, each with one bounds check against the last region instead of a
//! region search (DPDK's vhost library does the same: ring host addresses
//! resolved once, a per-ring cache for buffers).
//!
//! Safety is the memory table's own: `Xlat` borrows the table, so it cannot
//! outlive it, and a memory-table change (which replaces the table) cannot
//! happen while one exists; every access is bounds checked against the
//! region it lands in, and an access the cache does not resolve to one
//! region (a range crossing regions, an address outside every region) goes
//! to the table itself, whose answer is the same as without the cache.

use std::cell::Cell;
use std::iter::FusedIterator;
use std::ptr::NonNull;

use vm_memory::bitmap::{Bitmap, MS};
use vm_memory::guest_memory::{GuestMemoryBackendSliceIterator, GuestMemorySliceIterator};
use vm_memory::{
    GuestAddress, GuestMemory, GuestMemoryBackend, GuestMemoryRegion, GuestMemoryResult,
    MemoryRegionAddress, Permissions, VolatileSlice,
};

/// Regions held in the array; vhost-user tables have at most 8
/// (VHOST_MEMORY_BASELINE_NREGIONS), a VM's own at most a few. Regions
/// beyond it are still served, by the table's own search.
const MAX_REGIONS: usize = 8;

#[derive(Debug)]
struct Region<'m, R> {
    start: u64,
    len: u64,
    region: &'m R,
    /// The host address of `start` (null: the region has no host mapping,
    /// and only the slice accessors serve it).
    host: *mut u8,
}

impl<R> Clone for Region<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<R> Copy for Region<'_, R> {}

/// `region` and the offset of `addr` in it, if `[addr, addr + count)` lies inside it.
#[inline]
fn inside<'m, R>(r: &Region<'m, R>, addr: u64, count: usize) -> Option<(&'m R, u64)> {
    let off = addr.checked_sub(r.start)?;
    (off < r.len && count as u64 <= r.len - off).then_some((r.region, off))
}

/// The translation cache of one memory table (see the module doc). Not
/// `Sync`: one per thread, e.g. one per burst of the NIC's dataplane.
#[derive(Debug)]
pub struct Xlat<'m, M: GuestMemoryBackend> {
    mem: &'m M,
    regions: [Option<Region<'m, M::R>>; MAX_REGIONS],
    /// Index into `regions` of the region the last access hit.
    last: Cell<usize>,
}

impl<'m, M: GuestMemoryBackend> Xlat<'m, M> {
    pub fn new(mem: &'m M) -> Self {
        let mut regions = [None; MAX_REGIONS];
        for (slot, r) in regions.iter_mut().zip(mem.iter()) {
            *slot = Some(Region {
                start: r.start_addr().0,
                len: r.len(),
                region: r,
                host: r
                    .get_host_address(MemoryRegionAddress(0))
                    .unwrap_or(std::ptr::null_mut()),
            });
        }
        Xlat {
            mem,
            regions,
            last: Cell::new(0),
        }
    }

    /// The memory table this cache is for.
    pub fn table(&self) -> &'m M {
        self.mem
    }

    /// The region holding all of `[addr, addr + count)` (`count` > 0) and
    /// the offset of `addr` in it, if one of the cached regions does: the
    /// last one hit first.
    #[inline]
    fn lookup(&self, addr: u64, count: usize) -> Option<(&'m M::R, u64)> {
        self.find(addr, count).map(|(r, off)| (r.region, off))
    }

    /// [`Xlat::lookup`], with the cached region itself.
    #[inline]
    fn find(&self, addr: u64, count: usize) -> Option<(&Region<'m, M::R>, u64)> {
        let r = self.regions[self.last.get()].as_ref()?;
        match inside(r, addr, count) {
            Some((_, off)) => Some((r, off)),
            None => self.search(addr, count),
        }
    }

    /// [`Xlat::find`] past the last region: the others, in order.
    #[cold]
    #[inline(never)]
    fn search(&self, addr: u64, count: usize) -> Option<(&Region<'m, M::R>, u64)> {
        let (i, hit) = self.regions.iter().enumerate().find_map(|(i, r)| {
            let r = r.as_ref()?;
            inside(r, addr, count).map(|(_, off)| (i, (r, off)))
        })?;
        self.last.set(i);
        Some(hit)
    }

    /// `[addr, addr + count)` as one slice, if it lies in one cached region.
    #[inline]
    fn slice(&self, addr: u64, count: usize) -> Option<VolatileSlice<'m, MS<'m, M>>> {
        let (region, off) = self.lookup(addr, count)?;
        region.get_slice(MemoryRegionAddress(off), count).ok()
    }
}

/// What [`Xlat::get_slices`](GuestMemory::get_slices) yields: the one slice
/// the cache resolved, or the table's own iterator.
#[derive(Debug)]
pub enum XlatSlices<'a, M: GuestMemoryBackend> {
    One(Option<VolatileSlice<'a, MS<'a, M>>>),
    Table(GuestMemoryBackendSliceIterator<'a, M>),
}

impl<'a, M: GuestMemoryBackend> Iterator for XlatSlices<'a, M> {
    type Item = GuestMemoryResult<VolatileSlice<'a, MS<'a, M>>>;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        match self {
            XlatSlices::One(s) => s.take().map(Ok),
            XlatSlices::Table(t) => t.next(),
        }
    }
}

impl<M: GuestMemoryBackend> FusedIterator for XlatSlices<'_, M> {}

impl<'a, M: GuestMemoryBackend> GuestMemorySliceIterator<'a, MS<'a, M>> for XlatSlices<'a, M> {}

impl<M: GuestMemoryBackend> GuestMemory for Xlat<'_, M>
where
    <M::R as GuestMemoryRegion>::B: Bitmap,
{
    type PhysicalMemory = M;
    type Bitmap = <M::R as GuestMemoryRegion>::B;

    fn check_range(&self, addr: GuestAddress, count: usize, access: Permissions) -> bool {
        count > 0 && self.lookup(addr.0, count).is_some()
            || GuestMemory::check_range(self.mem, addr, count, access)
    }

    #[inline]
    fn get_slices<'a>(
        &'a self,
        addr: GuestAddress,
        count: usize,
        _access: Permissions,
    ) -> GuestMemoryResult<impl GuestMemorySliceIterator<'a, MS<'a, M>>> {
        if count > 0 {
            if let Some(s) = self.slice(addr.0, count) {
                return Ok(XlatSlices::One(Some(s)));
            }
        }
        Ok(XlatSlices::Table(GuestMemoryBackend::get_slices(
            self.mem, addr, count,
        )))
    }

    fn physical_memory(&self) -> Option<&M> {
        Some(self.mem)
    }
}

/// Guest memory whose ranges inside one region have a host address a
/// device may copy through directly: the frame path's buffers
/// ([`crate::OneBuf`]), one pointer and one bounds check instead of a
/// vm-memory slice per access (DPDK's vhost copies the same way, through
/// the host address of each descriptor).
pub trait HostRange {
    /// The host address of `[addr, addr + len)` (`len` > 0) if it lies in
    /// one region with a host mapping: valid for `len` bytes as long as
    /// `self` is borrowed. The guest may write the same bytes meanwhile
    /// (shared memory): a copy through it sees some of each, never bytes
    /// outside the range.
    fn host_range(&self, addr: u64, len: usize) -> Option<NonNull<u8>>;
}

/// Only for regions without a dirty bitmap (`B = ()`): a copy through the
/// host address marks nothing, and there is nothing to mark.
impl<M> HostRange for Xlat<'_, M>
where
    M: GuestMemoryBackend,
    M::R: GuestMemoryRegion<B = ()>,
{
    #[inline]
    fn host_range(&self, addr: u64, len: usize) -> Option<NonNull<u8>> {
        if len == 0 {
            return None;
        }
        let (r, off) = self.find(addr, len)?;
        // SAFETY: in bounds: `inside` checked off + len <= r.len, and the
        // region maps r.len bytes from `host` (null only without a mapping).
        NonNull::new(r.host).map(|h| unsafe { h.add(off as usize) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestMemoryMmap};

    /// Two adjacent regions [0x1000, 0x3000) and [0x3000, 0x4000), a hole,
    /// then [0x8000, 0x9000).
    fn table() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0x1000), 0x2000),
            (GuestAddress(0x3000), 0x1000),
            (GuestAddress(0x8000), 0x1000),
        ])
        .unwrap()
    }

    #[test]
    fn accesses_inside_one_region_hit_the_cache_and_match_the_table() {
        let m = table();
        let x = Xlat::new(&m);
        x.write_slice(&[1, 2, 3], GuestAddress(0x8ffd)).unwrap();
        assert_eq!(x.last.get(), 2, "the region of the last access");
        let mut b = [0u8; 3];
        m.read_slice(&mut b, GuestAddress(0x8ffd)).unwrap();
        assert_eq!(b, [1, 2, 3]);
        x.write_obj(0xabcdu16, GuestAddress(0x1000)).unwrap();
        assert_eq!(x.last.get(), 0);
        assert_eq!(m.read_obj::<u16>(GuestAddress(0x1000)).unwrap(), 0xabcd);
        assert_eq!(
            x.load::<u16>(GuestAddress(0x1000), std::sync::atomic::Ordering::Acquire)
                .unwrap(),
            0xabcd
        );
    }

    #[test]
    fn host_range_is_the_tables_bytes_inside_one_region_only() {
        let m = table();
        let x = Xlat::new(&m);
        m.write_slice(&[5, 6, 7, 8], GuestAddress(0x8ffc)).unwrap();
        let p = x.host_range(0x8ffc, 4).unwrap();
        // SAFETY: host_range gave 4 mapped bytes of the table, which `m` keeps alive.
        let got = unsafe { std::slice::from_raw_parts(p.as_ptr(), 4) };
        assert_eq!(got, [5, 6, 7, 8]);
        assert_eq!(
            p.as_ptr(),
            m.get_host_address(GuestAddress(0x8ffc)).unwrap(),
            "the table's own host address"
        );
        // Crossing two regions, past a region's end, in no region, empty: none.
        for (addr, len) in [(0x2ff0, 32), (0x8ffc, 5), (0x5000, 1), (0x1000, 0)] {
            assert!(x.host_range(addr, len).is_none(), "{addr:#x}+{len}");
        }
    }

    #[test]
    fn a_range_crossing_two_regions_goes_to_the_table() {
        let m = table();
        let x = Xlat::new(&m);
        let data: Vec<u8> = (0..32).collect();
        // 16 bytes at the end of region 0, 16 at the start of region 1.
        x.write_slice(&data, GuestAddress(0x2ff0)).unwrap();
        let mut back = [0u8; 32];
        m.read_slice(&mut back, GuestAddress(0x2ff0)).unwrap();
        assert_eq!(back[..], data[..]);
        let mut via = [0u8; 32];
        x.read_slice(&mut via, GuestAddress(0x2ff0)).unwrap();
        assert_eq!(via, back);
        assert!(GuestMemory::check_range(
            &x,
            GuestAddress(0x2ff0),
            32,
            Permissions::ReadWrite
        ));
    }

    #[test]
    fn one_byte_past_a_region_is_refused_as_by_the_table() {
        let m = table();
        let x = Xlat::new(&m);
        for (addr, len) in [
            (0x9000u64, 1usize), // one past the end of the last region
            (0x8fff, 2),         // last byte + one past
            (0x3fff, 2),         // into the hole
            (0x4000, 1),         // in the hole
            (0x0fff, 1),         // one before the first region
            (u64::MAX, 1),
        ] {
            let a = GuestAddress(addr);
            let want = GuestMemoryBackend::check_range(&m, a, len);
            assert!(!want, "{addr:#x}+{len}");
            assert_eq!(
                GuestMemory::check_range(&x, a, len, Permissions::ReadWrite),
                want
            );
            let mut b = vec![0u8; len];
            assert!(x.read_slice(&mut b, a).is_err(), "{addr:#x}+{len}");
            assert!(x.write_slice(&b, a).is_err(), "{addr:#x}+{len}");
        }
        // The last byte itself is fine, and the miss left the cache usable.
        x.write_obj(7u8, GuestAddress(0x8fff)).unwrap();
        assert_eq!(m.read_obj::<u8>(GuestAddress(0x8fff)).unwrap(), 7);
    }

    #[test]
    fn more_regions_than_the_array_are_served_by_the_table() {
        let ranges: Vec<_> = (0..MAX_REGIONS as u64 + 2)
            .map(|i| (GuestAddress(i * 0x2000), 0x1000))
            .collect();
        let m: GuestMemoryMmap = GuestMemoryMmap::from_ranges(&ranges).unwrap();
        let x = Xlat::new(&m);
        let far = GuestAddress((MAX_REGIONS as u64 + 1) * 0x2000 + 8);
        x.write_obj(0x55aau16, far).unwrap();
        assert_eq!(m.read_obj::<u16>(far).unwrap(), 0x55aa);
        assert!(x.read_obj::<u16>(GuestAddress(0x1000)).is_err(), "a hole");
    }
}
