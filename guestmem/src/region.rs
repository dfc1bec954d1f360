//! One memfd-backed region: device view (guest bytes + page-state table) and guest view.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::sys::{self, Mapping};
use crate::table::{self, PageStats, PageTable};
use crate::{Error, RegionSpec};

const RW: i32 = libc::PROT_READ | libc::PROT_WRITE;

/// A region of one sandbox's guest memory.
#[derive(Debug)]
pub struct Region {
    spec: RegionSpec,
    page_size: u64,
    hugepages: bool,
    pooled: bool,
    /// Pool memory whose pages the pool keeps resident and locked while it is lent.
    pool_pinned: bool,
    /// A private copy-on-write mapping of a template file: guest and device
    /// view are one mapping, and `memfd` is the template file (read-only).
    private: bool,
    // Mappings are declared before the memfd only for readability; both are independent.
    guest: Mapping,
    device: Mapping,
    memfd: OwnedFd,
    table: PageTable,
    dma_mapped: AtomicBool,
}

impl Region {
    /// A fresh memfd: kernel-zeroed on first touch, every page marked ZERO.
    pub(crate) fn fresh(spec: &RegionSpec, hugepages: bool) -> Result<Region, Error> {
        let page_size = sys::page_size_for(hugepages);
        let memfd = sys::memfd_create(&spec.name, hugepages)
            .map_err(|e| Error::io(format!("memfd_create for region {:?}", spec.name), e))?;
        let total = spec.size + table::table_size(spec.size, page_size);
        sys::ftruncate(memfd.as_fd(), total)
            .map_err(|e| Error::io(format!("ftruncate memfd of region {:?}", spec.name), e))?;
        let region = Region::map(spec, memfd, page_size, hugepages, false, RW)?;
        // SAFETY: the table lies in our own device view, and nobody else has the memfd yet.
        unsafe {
            PageTable::format(region.table_ptr(), spec.size, page_size, table::ZERO);
        }
        Ok(region)
    }

    /// A memfd handed out by the pool (its table already says which pages are dirty);
    /// `pinned`: the pool keeps its pages resident and locked while it is lent.
    pub(crate) fn from_pool(
        spec: &RegionSpec,
        memfd: OwnedFd,
        pinned: bool,
        hugepages: bool,
        guest_prot: i32,
    ) -> Result<Region, Error> {
        let page_size = sys::page_size_for(hugepages);
        let expect = spec.size + table::table_size(spec.size, page_size);
        let got = sys::file_size(memfd.as_fd())
            .map_err(|e| Error::io(format!("fstat pool memfd of region {:?}", spec.name), e))?;
        if got != expect {
            return Err(Error::BadMemfd {
                what: format!("from the pool for region {:?}", spec.name),
                reason: format!("length {got}, expected {expect}"),
            });
        }
        let mut region = Region::map(spec, memfd, page_size, hugepages, true, guest_prot)?;
        region.pool_pinned = pinned;
        let tsize = table::table_size(spec.size, page_size);
        // SAFETY: the trailer is the last TRAILER_SIZE bytes of the device view.
        let trailer = unsafe {
            PageTable::read_trailer(
                region
                    .table_ptr()
                    .add((tsize - table::TRAILER_SIZE) as usize),
            )
        };
        if trailer != Some((spec.size, page_size)) {
            return Err(Error::BadMemfd {
                what: format!("from the pool for region {:?}", spec.name),
                reason: format!(
                    "page-state trailer is {trailer:?}, expected ({}, {page_size})",
                    spec.size
                ),
            });
        }
        Ok(region)
    }

    /// A region restored from a template file (`template::save_region`'s
    /// layout: guest bytes, then room for the page-state table), mapped
    /// MAP_PRIVATE: the guest's and the VMM's writes go to pages of this
    /// process only, never to the file or another sandbox. One mapping
    /// serves as guest and device view (two private mappings would not
    /// share their copies). Every page counts as in use (MAPPED): nothing
    /// is ever zeroed here, and the region never goes to the pool.
    pub(crate) fn from_template(spec: &RegionSpec, file: std::fs::File) -> Result<Region, Error> {
        let page_size = sys::base_page_size();
        let total = spec.size + table::table_size(spec.size, page_size);
        let fd = OwnedFd::from(file);
        let got = sys::file_size(fd.as_fd())
            .map_err(|e| Error::io(format!("fstat template file of region {:?}", spec.name), e))?;
        if got != total {
            return Err(Error::BadMemfd {
                what: format!("template file of region {:?}", spec.name),
                reason: format!("length {got}, expected {total}"),
            });
        }
        let device = Mapping::new_private(fd.as_fd(), total, RW).map_err(|e| {
            Error::io(
                format!("mmap MAP_PRIVATE template of region {:?}", spec.name),
                e,
            )
        })?;
        let guest = device.alias(spec.size);
        // SAFETY: data and table lie inside `device`, which lives as long as the region;
        // the table pages are this process's private copies once written.
        let table = unsafe {
            let t = device.ptr().add(spec.size as usize);
            PageTable::format(t, spec.size, page_size, table::MAPPED);
            PageTable::new(device.ptr(), t, spec.size, page_size)
        };
        Ok(Region {
            spec: spec.clone(),
            page_size,
            hugepages: false,
            pooled: false,
            pool_pinned: false,
            private: true,
            guest,
            device,
            memfd: fd,
            table,
            dma_mapped: AtomicBool::new(false),
        })
    }

    fn map(
        spec: &RegionSpec,
        memfd: OwnedFd,
        page_size: u64,
        hugepages: bool,
        pooled: bool,
        guest_prot: i32,
    ) -> Result<Region, Error> {
        let total = spec.size + table::table_size(spec.size, page_size);
        let map_err = |view: &str, e: std::io::Error| {
            if hugepages && e.raw_os_error() == Some(libc::ENOMEM) {
                Error::HugepagesNotReserved {
                    needed: total / page_size,
                    free: sys::free_huge_pages(),
                }
            } else {
                Error::io(format!("mmap {view} view of region {:?}", spec.name), e)
            }
        };
        let device = Mapping::new(memfd.as_fd(), 0, total, RW).map_err(|e| map_err("device", e))?;
        let guest = Mapping::new(memfd.as_fd(), 0, spec.size, guest_prot)
            .map_err(|e| map_err("guest", e))?;
        // SAFETY: data and table both lie inside `device`, which lives as long as the region.
        let table = unsafe {
            PageTable::new(
                device.ptr(),
                device.ptr().add(spec.size as usize),
                spec.size,
                page_size,
            )
        };
        Ok(Region {
            spec: spec.clone(),
            page_size,
            hugepages,
            pooled,
            pool_pinned: false,
            private: false,
            guest,
            device,
            memfd,
            table,
            dma_mapped: AtomicBool::new(false),
        })
    }

    fn table_ptr(&self) -> *mut u8 {
        // SAFETY: size < device view length.
        unsafe { self.device.ptr().add(self.spec.size as usize) }
    }

    pub fn name(&self) -> &str {
        &self.spec.name
    }

    pub fn gpa(&self) -> u64 {
        self.spec.gpa
    }

    pub fn size(&self) -> u64 {
        self.spec.size
    }

    pub fn dma(&self) -> bool {
        self.spec.dma
    }

    pub fn spec(&self) -> &RegionSpec {
        &self.spec
    }

    /// The memfd: guest bytes at `[0, size)`, then the page-state table. Send it with
    /// `mmap_offset = 0` and `size()` in vhost-user SET_MEM_TABLE.
    pub fn memfd(&self) -> BorrowedFd<'_> {
        self.memfd.as_fd()
    }

    /// Offset of the guest bytes in the memfd (always 0).
    pub fn mmap_offset(&self) -> u64 {
        0
    }

    /// Length of the memfd (guest bytes plus page-state table).
    pub fn memfd_size(&self) -> u64 {
        self.device.len() as u64
    }

    /// The guest view: give it to KVM as the memslot's userspace address.
    pub fn guest_view_ptr(&self) -> *mut u8 {
        self.guest.ptr()
    }

    /// The device view: what the VMM writes through (after `prepare_for_device_write`).
    pub fn device_view_ptr(&self) -> *mut u8 {
        self.device.ptr()
    }

    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    pub fn hugepages(&self) -> bool {
        self.hugepages
    }

    /// True if the memory came from the pool (recycled, possibly holding old bytes).
    pub fn pooled(&self) -> bool {
        self.pooled
    }

    /// True if the pool keeps this pool memory's pages resident and locked while it is
    /// lent: `dma_map` has nothing to pin.
    pub fn pool_pinned(&self) -> bool {
        self.pool_pinned
    }

    /// True for a private copy-on-write mapping of a template: no other
    /// process can share its pages (no vhost-user SET_MEM_TABLE).
    pub fn private(&self) -> bool {
        self.private
    }

    /// True once `dma_map` made the region resident and locked.
    pub fn dma_mapped(&self) -> bool {
        self.dma_mapped.load(Ordering::Acquire)
    }

    /// Pages per state in the shared page-state table.
    pub fn page_stats(&self) -> PageStats {
        self.table.stats()
    }

    pub(crate) fn table(&self) -> &PageTable {
        &self.table
    }

    pub(crate) fn device_mapping(&self) -> &Mapping {
        &self.device
    }

    pub(crate) fn guest_mapping(&self) -> &Mapping {
        &self.guest
    }

    pub(crate) fn set_dma_mapped(&self) {
        self.dma_mapped.store(true, Ordering::Release);
    }

    pub(crate) fn contains(&self, gpa: u64, len: u64) -> bool {
        gpa >= self.spec.gpa
            && gpa
                .checked_add(len)
                .is_some_and(|end| end <= self.spec.gpa + self.spec.size)
    }
}
