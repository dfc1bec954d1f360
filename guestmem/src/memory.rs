//! One sandbox's guest memory: its regions, the DMA-map policy and lazy zeroing.

use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex};

use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap};

use crate::lazy::{ErrorSlot, Lazy, LazyStats, ZeroerHook};
use crate::pool::PoolClient;
use crate::region::Region;
use crate::sys;
use crate::table::table_size;
use crate::{Error, MemoryPolicy, RegionSpec};

/// Where the pages of DMA-capable regions come from.
#[derive(Debug)]
pub enum MemorySource {
    /// New memfds: the kernel zeroes each page when it is first allocated.
    Fresh,
    /// Recycled memfds from a pool server (still holding a previous tenant's bytes).
    /// Used only for `dma = true` regions under `pre*` and `lazy`; vanilla memory and
    /// `dma = false` regions are always fresh.
    Pool(PoolClient),
}

/// One sandbox's guest memory.
pub struct GuestMemory {
    // Drop order matters: guest views (in `regions`) are unmapped before the uffd in
    // `lazy` is closed, and all mappings are gone before the pool connection closes.
    regions: Vec<Region>,
    lazy: Mutex<Option<Lazy>>,
    errors: Arc<ErrorSlot>,
    policy: MemoryPolicy,
    hugepages: bool,
    _pool: Option<PoolClient>,
}

impl std::fmt::Debug for GuestMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestMemory")
            .field("regions", &self.regions)
            .field("policy", &self.policy)
            .field("hugepages", &self.hugepages)
            .finish()
    }
}

pub(crate) fn validate(specs: &[RegionSpec], page_size: u64) -> Result<(), Error> {
    if specs.is_empty() {
        return Err(Error::InvalidSpec {
            region: String::new(),
            reason: "no regions given".into(),
        });
    }
    for (i, s) in specs.iter().enumerate() {
        let bad = |reason: String| Error::InvalidSpec {
            region: s.name.clone(),
            reason,
        };
        if s.name.is_empty() || s.name.contains('\0') {
            return Err(bad("name must be non-empty and without NUL".into()));
        }
        if s.size == 0 || !s.size.is_multiple_of(page_size) {
            return Err(bad(format!(
                "size {:#x} must be a non-zero multiple of the page size {page_size:#x}",
                s.size
            )));
        }
        if !s.gpa.is_multiple_of(page_size) {
            return Err(bad(format!(
                "guest address {:#x} must be aligned to the page size {page_size:#x}",
                s.gpa
            )));
        }
        if s.gpa.checked_add(s.size).is_none() {
            return Err(bad("guest address + size overflows".into()));
        }
        for o in &specs[..i] {
            if o.name == s.name {
                return Err(bad("duplicate region name".into()));
            }
            if s.gpa < o.gpa + o.size && o.gpa < s.gpa + s.size {
                return Err(Error::Overlap {
                    a: o.name.clone(),
                    b: s.name.clone(),
                });
            }
        }
    }
    Ok(())
}

/// Refuses before any page is touched what the host could not lock.
fn check_resources(
    specs: &[RegionSpec],
    pooled: &[bool],
    hugepages: bool,
    page_size: u64,
) -> Result<(), Error> {
    let lock: u64 = specs.iter().filter(|s| s.dma).map(|s| s.size).sum();
    if let Some(limit) = sys::memlock_limit() {
        if lock > limit {
            return Err(Error::MemlockLimit {
                needed: lock,
                limit,
            });
        }
    }
    // Memory that must be newly allocated here (pool memory is already resident).
    let fresh = specs.iter().zip(pooled).filter(|(_, p)| !**p);
    if hugepages {
        // Every fresh region reserves its huge pages at mmap time, table included.
        let needed: u64 = fresh
            .map(|(s, _)| (s.size + table_size(s.size, page_size)) / page_size)
            .sum();
        let free = sys::free_huge_pages();
        if needed > free {
            return Err(Error::HugepagesNotReserved { needed, free });
        }
    } else {
        let needed: u64 = fresh.filter(|(s, _)| s.dma).map(|(s, _)| s.size).sum();
        if let Some(available) = sys::meminfo("MemAvailable") {
            if needed > available {
                return Err(Error::NotEnoughMemory { needed, available });
            }
        }
    }
    Ok(())
}

impl GuestMemory {
    /// Creates the regions. Nothing is made resident yet (see `dma_map`). Under `lazy` the
    /// guest views are registered with userfaultfd and the fault handler runs from here on;
    /// under `pre*` the guest views of pool memory are inaccessible until `dma_map`
    /// zeroed them.
    pub fn new(
        specs: &[RegionSpec],
        policy: MemoryPolicy,
        source: MemorySource,
        hugepages: bool,
    ) -> Result<GuestMemory, Error> {
        let page_size = sys::page_size_for(hugepages);
        validate(specs, page_size)?;
        let pool = match source {
            MemorySource::Fresh => None,
            MemorySource::Pool(c) => Some(c),
        };
        // DMA regions come from the pool under every policy but vanilla; under
        // lazy, regions no device maps do too, as host-only memory (the uffd
        // handler zeroes what the guest touches; no device may map it, so it
        // goes back without waiting for one: `pool::PageUse`).
        let use_pool: Vec<bool> = specs
            .iter()
            .map(|s| {
                pool.is_some()
                    && policy != MemoryPolicy::Vanilla
                    && (s.dma || policy == MemoryPolicy::Lazy)
            })
            .collect();
        check_resources(specs, &use_pool, hugepages, page_size)?;

        // Take the pool memfds first: a pool miss is sparse memory that dma_map allocates,
        // so it counts against MemAvailable like fresh memory, checked before any use.
        let mut taken = Vec::with_capacity(specs.len());
        let mut miss_bytes = 0;
        for (spec, &pooled) in specs.iter().zip(&use_pool) {
            taken.push(match (&pool, pooled) {
                (Some(client), true) => {
                    let page_use = if spec.dma {
                        crate::pool::PageUse::Device
                    } else {
                        crate::pool::PageUse::HostOnly
                    };
                    let t = client.take_memfd_as(spec.size, hugepages, policy, page_use)?;
                    if !t.recycled && !hugepages {
                        miss_bytes += spec.size;
                    }
                    Some((t.memfd, t.pinned))
                }
                _ => None,
            });
        }
        if miss_bytes > 0 {
            let fresh: u64 = specs
                .iter()
                .zip(&use_pool)
                .filter(|(s, p)| s.dma && !**p)
                .map(|(s, _)| s.size)
                .sum();
            if let Some(available) = sys::meminfo("MemAvailable") {
                if miss_bytes + fresh > available {
                    return Err(Error::NotEnoughMemory {
                        needed: miss_bytes + fresh,
                        available,
                    });
                }
            }
        }

        let mut regions = Vec::with_capacity(specs.len());
        for (spec, fd) in specs.iter().zip(taken) {
            let region = match fd {
                Some((fd, pinned)) => {
                    // Pre-zeroing: the guest must not see the pages before dma_map zeroed
                    // them; lazy: the uffd handler guards the guest view.
                    let prot = match policy {
                        MemoryPolicy::Pre(_) => libc::PROT_NONE,
                        _ => libc::PROT_READ | libc::PROT_WRITE,
                    };
                    Region::from_pool(spec, fd, pinned, hugepages, prot)?
                }
                _ => Region::fresh(spec, hugepages)?,
            };
            regions.push(region);
        }
        let errors = Arc::new(ErrorSlot::new()?);
        let lazy = if policy == MemoryPolicy::Lazy {
            let lazy_regions: Vec<&Region> = regions.iter().filter(|r| r.pooled()).collect();
            if lazy_regions.is_empty() {
                None
            } else {
                Some(Lazy::new(&lazy_regions, errors.clone())?)
            }
        } else {
            None
        };
        Ok(GuestMemory {
            regions,
            lazy: Mutex::new(lazy),
            errors,
            policy,
            hugepages,
            _pool: pool,
        })
    }

    /// Guest memory over regions that take nothing from the pool and need no
    /// zeroing (restored templates).
    pub(crate) fn from_regions(regions: Vec<Region>) -> Result<GuestMemory, Error> {
        Ok(GuestMemory {
            regions,
            lazy: Mutex::new(None),
            errors: Arc::new(ErrorSlot::new()?),
            policy: MemoryPolicy::Vanilla,
            hugepages: false,
            _pool: None,
        })
    }

    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    pub fn region(&self, name: &str) -> Result<&Region, Error> {
        self.regions
            .iter()
            .find(|r| r.name() == name)
            .ok_or_else(|| Error::UnknownRegion(name.to_string()))
    }

    pub fn policy(&self) -> MemoryPolicy {
        self.policy
    }

    pub fn hugepages(&self) -> bool {
        self.hugepages
    }

    fn region_for(&self, gpa: u64, len: u64) -> Result<&Region, Error> {
        self.regions
            .iter()
            .find(|r| r.contains(gpa, len.max(1)))
            .ok_or(Error::OutOfRange { gpa, len })
    }

    /// Instant-zero list (FastIOV §4.3.2): zeroes the pages `[gpa, gpa+len)` touches (if
    /// still dirty), writes `data` through the device view and leaves them marked done, so
    /// neither the fault handler nor the background zeroer ever wipes them. Under `lazy`
    /// their fault-around blocks are mapped into the guest view too: pages on the list are
    /// not lazy zeroing's to manage, and the guest's first touch of them (its code, page
    /// tables, boot info) then takes no userfault.
    pub fn write_instant(&self, gpa: u64, data: &[u8]) -> Result<(), Error> {
        let len = data.len() as u64;
        let r = self.region_for(gpa, len)?;
        let off = gpa - r.gpa();
        r.table().ensure_range(off, len)?;
        // SAFETY: [off, off+len) lies inside the device view (checked by region_for); the
        // pages are ZERO/MAPPED so nobody zeroes them any more.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                r.device_view_ptr().add(off as usize),
                data.len(),
            );
        }
        self.map_ahead(gpa, len)
    }

    /// Under `lazy`, zeroes (where still dirty) and maps into the guest view now the
    /// fault-around blocks `[gpa, gpa+len)` touches, so the guest's first touch of them
    /// takes no userfault; a no-op under the other policies and outside lazy regions.
    /// For what the guest is known to touch first: what the VMM wrote (`write_instant`),
    /// the start of the built-in agent's allocator.
    pub fn map_ahead(&self, gpa: u64, len: u64) -> Result<(), Error> {
        let r = self.region_for(gpa, len)?;
        if let Some(l) = &*self.lazy.lock().unwrap_or_else(|p| p.into_inner()) {
            // SAFETY: [gpa, gpa+len) lies inside the region (region_for), so inside its
            // guest view.
            let guest = unsafe { r.guest_view_ptr().add((gpa - r.gpa()) as usize) } as usize;
            l.map_ahead(guest, len).map_err(|source| Error::MapAhead {
                gpa,
                len,
                source: Box::new(source),
            })?;
        }
        Ok(())
    }

    /// Makes a region resident and locked for device access, applying the policy. The VMM
    /// times this as the `dma-ram` / `dma-image` stage.
    pub fn dma_map(&mut self, region: &str) -> Result<(), Error> {
        self.dma_map_shared(region)
    }

    /// `dma_map` through a shared reference (for a `GuestMemory` already in an `Arc`).
    pub fn dma_map_shared(&self, region: &str) -> Result<(), Error> {
        let r = self.region(region)?;
        if !r.dma() {
            return Err(Error::NotDma(region.to_string()));
        }
        if r.dma_mapped() {
            return Ok(());
        }
        let dev = r.device_mapping();
        let size = r.size() as usize;
        if let (MemoryPolicy::Pre(_), true) = (self.policy, r.pooled()) {
            // The share not zeroed ahead of time is zeroed now, synchronously.
            let t = r.table();
            t.prefault_dirty(0, t.npages());
            for p in 0..t.npages() {
                t.ensure_zeroed(p)?;
            }
        }
        // Fresh memory: the kernel allocates and zeroes every page here. Pool memory is
        // resident already: locking it only pins it (and populates any page a pool miss
        // left sparse, which the kernel zeroes). Memory the pool keeps pinned needs
        // neither: its pages stay resident and locked for as long as the lease lives.
        if !r.pooled() {
            dev.populate_write(0, size)
                .map_err(|e| Error::io(format!("MADV_POPULATE_WRITE region {region:?}"), e))?;
        }
        if !r.pool_pinned() {
            dev.lock(0, size)
                .map_err(|e| Error::io(format!("mlock region {region:?}"), e))?;
        }
        if let (MemoryPolicy::Pre(_), true) = (self.policy, r.pooled()) {
            r.guest_mapping()
                .protect(libc::PROT_READ | libc::PROT_WRITE)
                .map_err(|e| Error::io(format!("mprotect guest view of region {region:?}"), e))?;
        }
        r.set_dma_mapped();
        Ok(())
    }

    /// Starts the background zeroer (lazy only; a no-op otherwise). The fault handler
    /// already runs from `new`.
    pub fn start_lazy_zeroing(&mut self) -> Result<(), Error> {
        self.start_lazy_zeroing_shared()
    }

    /// `start_lazy_zeroing` through a shared reference.
    pub fn start_lazy_zeroing_shared(&self) -> Result<(), Error> {
        self.start_lazy_zeroing_with_priority(true)
    }

    /// As `start_lazy_zeroing`; `idle = false` runs the background zeroer at normal
    /// priority instead of SCHED_IDLE (tests and experiments).
    pub fn start_lazy_zeroing_with_priority(&self, idle: bool) -> Result<(), Error> {
        self.start_zeroer(idle, None)
    }

    /// As `start_lazy_zeroing_shared`, with `on_start` run first on the zeroer's thread
    /// (the VMM moves that thread into an idle cgroup there). Not run when there is no
    /// zeroer to start.
    pub fn start_lazy_zeroing_with(&self, on_start: ZeroerHook) -> Result<(), Error> {
        self.start_zeroer(true, Some(on_start))
    }

    fn start_zeroer(&self, idle: bool, on_start: Option<ZeroerHook>) -> Result<(), Error> {
        match &mut *self.lazy.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(l) => l.start_zeroer(idle, on_start),
            None => Ok(()),
        }
    }

    /// Call before a device (or the VMM on a device's behalf) reads or writes guest pages
    /// through a view other than the guest view: zeroes any still-dirty page of the range
    /// and marks it, so the device sees no old bytes and a later guest fault does not wipe
    /// what the device wrote.
    pub fn prepare_for_device_write(&self, gpa: u64, len: u64) -> Result<(), Error> {
        let r = self.region_for(gpa, len)?;
        r.table().ensure_range(gpa - r.gpa(), len)?;
        Ok(())
    }

    /// A vm-memory view of every region through its own `MAP_SHARED` mapping of the memfd
    /// (a device view). Pages the guest has not touched yet may still hold old bytes under
    /// `lazy` (and under `pre*` before `dma_map`): call `prepare_for_device_write` before
    /// reading or writing them. Drop it before this `GuestMemory`: the memory goes back to
    /// the pool when the `GuestMemory` is dropped.
    pub fn device_guest_memory(&self) -> Result<GuestMemoryMmap, Error> {
        let mut regions: Vec<&Region> = self.regions.iter().collect();
        regions.sort_by_key(|r| r.gpa());
        let mut ranges = Vec::with_capacity(regions.len());
        for r in regions {
            if r.private() {
                return Err(Error::PrivateRegion(r.name().to_string()));
            }
            let fd = r
                .memfd()
                .try_clone_to_owned()
                .map_err(|e| Error::io(format!("dup memfd of region {:?}", r.name()), e))?;
            ranges.push((
                GuestAddress(r.gpa()),
                r.size() as usize,
                Some(FileOffset::new(std::fs::File::from(fd), 0)),
            ));
        }
        GuestMemoryMmap::from_ranges_with_files(ranges).map_err(|source| Error::Mapping { source })
    }

    /// First error of the lazy-zeroing threads, if any. The VM must stop when it is set.
    pub fn lazy_error(&self) -> Option<Error> {
        self.errors.get().map(Error::LazyHandler)
    }

    /// An eventfd that becomes readable when a lazy-zeroing thread failed (for poll/epoll).
    pub fn lazy_error_fd(&self) -> BorrowedFd<'_> {
        self.errors.fd()
    }

    /// Called once, from the failing thread, with the first lazy-zeroing error.
    pub fn set_lazy_error_callback(&self, cb: crate::LazyErrorCallback) {
        self.errors.set_callback(cb)
    }

    pub fn lazy_stats(&self) -> LazyStats {
        self.lazy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|l| l.stats())
            .unwrap_or_default()
    }

    /// Runs `hook` once the background zeroer has ended, on its thread; at once if it
    /// already has, or if this memory has nothing to zero lazily. Never run if the
    /// zeroer is not started before this memory is dropped.
    pub fn on_zeroing_end(&self, hook: ZeroerHook) {
        let now = match &*self.lazy.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(l) => l.on_zeroer_end(hook),
            None => Some(hook),
        };
        // Run with the lock released: a hook may ask this memory for its stats.
        if let Some(hook) = now {
            hook();
        }
    }

    /// Blocks until the background zeroer finished its pass (tests and benchmarks).
    pub fn wait_background_zeroing(&self) {
        if let Some(l) = &*self.lazy.lock().unwrap_or_else(|p| p.into_inner()) {
            l.wait_zeroer_done();
        }
    }

    /// Borrow of a region's memfd by name (for SET_MEM_TABLE). A template's
    /// private copy-on-write region has none another process could share.
    pub fn memfd(&self, region: &str) -> Result<BorrowedFd<'_>, Error> {
        let r = self.region(region)?;
        if r.private() {
            return Err(Error::PrivateRegion(region.to_string()));
        }
        Ok(r.memfd())
    }
}

impl Drop for GuestMemory {
    fn drop(&mut self) {
        let mut lazy = self.lazy.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(l) = lazy.as_mut() {
            l.stop();
        }
        // Guest views go before the uffd closes (see Lazy::stop).
        self.regions.clear();
        drop(lazy);
    }
}

const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<GuestMemory>();
};
