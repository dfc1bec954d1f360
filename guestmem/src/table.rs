//! The shared page-state table that lives in every burstvm memfd after the guest bytes.
//!
//! Layout of a memfd of `data_size` guest bytes with page size `P`:
//! `[0, data_size)` guest bytes, then one state byte per page, then (in the last 64 bytes
//! of the file) a trailer with a magic. The table is `round_up(npages + 64, P)` bytes, so a
//! process that only has the fd (a vhost-user backend) finds it from the file length.
//!
//! Every party that can write or read a page (uffd handler, background zeroer, VMM, device
//! in another process) moves a page DIRTY -> ZEROING -> ZERO by compare-exchange, so a
//! page is zeroed exactly once, before anybody reads it, and never after anybody wrote it.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::time::Duration;

use crate::sys::round_up;
use crate::Error;

/// Holds a previous tenant's bytes: must be zeroed before anyone reads or writes it.
pub const DIRTY: u8 = 1;
/// Somebody is zeroing the page right now; everybody else waits.
pub const ZEROING: u8 = 2;
/// Zeroed (or written after zeroing); content is this tenant's.
pub const ZERO: u8 = 3;
/// As ZERO, and also mapped into the guest view (UFFDIO_CONTINUE done).
pub const MAPPED: u8 = 4;

pub const MAGIC: u64 = 0x5347_5054_5352_5542; // "BURSTPGS" little-endian
pub const VERSION: u32 = 1;
pub const TRAILER_SIZE: u64 = 64;

#[repr(C)]
struct Trailer {
    magic: AtomicU64,
    version_pagesize: AtomicU64, // version in the low 32 bits, page size in the high 32 bits
    data_size: AtomicU64,
    npages: AtomicU64,
    /// Pages zeroed since the table was formatted or reset, by every party together.
    zeroed: AtomicU64,
    /// The pool lease the memory is lent under (0: not lent by a pool, or returned). A
    /// device attached under another lease must not touch the pages any more.
    lease: AtomicU64,
    _reserved: [u64; 2],
}

pub fn table_size(data_size: u64, page_size: u64) -> u64 {
    round_up(data_size / page_size + TRAILER_SIZE, page_size)
}

/// Counts of pages per state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PageStats {
    /// Pages zeroed since the memory was handed out, by all parties (each page at most once).
    pub zeroed_total: u64,
    pub dirty: u64,
    pub zeroing: u64,
    pub zero: u64,
    pub mapped: u64,
}

/// A view of the page-state table plus the data bytes it governs. Holds raw pointers
/// into mappings owned elsewhere; the owner keeps them alive longer than this view.
#[derive(Debug, Clone, Copy)]
pub struct PageTable {
    data: *mut u8,
    states: *const AtomicU8,
    trailer: *const Trailer,
    npages: u64,
    page_size: u64,
}

// SAFETY: all shared state is accessed through atomics; data bytes are only written by the
// party that won the DIRTY -> ZEROING exchange.
unsafe impl Send for PageTable {}
// SAFETY: as above.
unsafe impl Sync for PageTable {}

impl PageTable {
    /// # Safety
    /// `data` must point to `data_size` mapped bytes and `table` to `table_size(data_size,
    /// page_size)` mapped bytes, both valid for as long as the returned value is used.
    pub unsafe fn new(data: *mut u8, table: *mut u8, data_size: u64, page_size: u64) -> PageTable {
        let tsize = table_size(data_size, page_size);
        Self::new_sub(
            data,
            table,
            table.add((tsize - TRAILER_SIZE) as usize),
            data_size / page_size,
            page_size,
        )
    }

    /// A view of `npages` pages starting at state byte `states` (a sub-range of a table).
    ///
    /// # Safety
    /// `data` must point to `npages * page_size` mapped bytes, `states` to `npages` state
    /// bytes and `trailer` to the table's trailer, all valid while the value is used.
    pub unsafe fn new_sub(
        data: *mut u8,
        states: *mut u8,
        trailer: *const u8,
        npages: u64,
        page_size: u64,
    ) -> PageTable {
        PageTable {
            data,
            states: states as *const AtomicU8,
            trailer: trailer as *const Trailer,
            npages,
            page_size,
        }
    }

    fn trailer(&self) -> &Trailer {
        // SAFETY: see `new_sub`.
        unsafe { &*self.trailer }
    }

    /// Pages zeroed since the table was formatted or reset (all parties together).
    pub fn zeroed_total(&self) -> u64 {
        self.trailer().zeroed.load(Ordering::Relaxed)
    }

    /// Writes the trailer (magic) and sets every page to `state`.
    ///
    /// # Safety
    /// As `new`; the table must not be in use by anybody else.
    pub unsafe fn format(table: *mut u8, data_size: u64, page_size: u64, state: u8) {
        let npages = data_size / page_size;
        std::ptr::write_bytes(table, state, npages as usize);
        let tsize = table_size(data_size, page_size);
        let tr = &*(table.add((tsize - TRAILER_SIZE) as usize) as *const Trailer);
        tr.version_pagesize
            .store(VERSION as u64 | (page_size << 32), Ordering::Relaxed);
        tr.data_size.store(data_size, Ordering::Relaxed);
        tr.npages.store(npages, Ordering::Relaxed);
        tr.zeroed.store(0, Ordering::Relaxed);
        tr.lease.store(0, Ordering::Relaxed);
        tr.magic.store(MAGIC, Ordering::Release);
    }

    /// Reads a trailer; returns `(data_size, page_size)` if the magic is there.
    ///
    /// # Safety
    /// `trailer` must point to TRAILER_SIZE mapped bytes.
    pub unsafe fn read_trailer(trailer: *const u8) -> Option<(u64, u64)> {
        let tr = &*(trailer as *const Trailer);
        if tr.magic.load(Ordering::Acquire) != MAGIC {
            return None;
        }
        let vp = tr.version_pagesize.load(Ordering::Relaxed);
        if vp as u32 != VERSION {
            return None;
        }
        Some((tr.data_size.load(Ordering::Relaxed), vp >> 32))
    }

    pub fn npages(&self) -> u64 {
        self.npages
    }

    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    fn cell(&self, page: u64) -> &AtomicU8 {
        debug_assert!(page < self.npages);
        // SAFETY: page < npages, inside the table mapping (see `new`).
        unsafe { &*self.states.add(page as usize) }
    }

    pub fn state(&self, page: u64) -> u8 {
        self.cell(page).load(Ordering::Acquire)
    }

    /// The lease the memory is lent under (see `Trailer::lease`).
    pub fn lease(&self) -> u64 {
        self.trailer().lease.load(Ordering::Acquire)
    }

    /// Sets the lease (only the pool, when it lends or takes the memfd back).
    pub fn set_lease(&self, lease: u64) {
        self.trailer().lease.store(lease, Ordering::SeqCst);
    }

    /// Sets every page to `state` and resets the zeroed counter (only for the owner of an
    /// idle memfd, e.g. the pool).
    pub fn set_all(&self, state: u8) {
        for p in 0..self.npages {
            self.cell(p).store(state, Ordering::Release);
        }
        self.trailer().zeroed.store(0, Ordering::Release);
    }

    /// Sets a page to `state` if it is `from`.
    pub fn transition(&self, page: u64, from: u8, to: u8) -> bool {
        self.cell(page)
            .compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Before zeroing pages `[first, end)` through this table's data mapping: maps the
    /// DIRTY ones' span in one MADV_POPULATE_WRITE, so that zeroing them takes no page
    /// fault each (pool memory the pool pins is resident but not mapped here). Only a
    /// prefault: where it fails, the zeroing faults as before.
    pub fn prefault_dirty(&self, first: u64, end: u64) {
        let end = end.min(self.npages);
        let Some(lo) = (first..end).find(|&p| self.state(p) == DIRTY) else {
            return;
        };
        let hi = (lo..end).rfind(|&p| self.state(p) == DIRTY).unwrap_or(lo) + 1;
        // SAFETY: [lo, hi) pages lie inside the data mapping.
        let _ = unsafe {
            crate::sys::populate_write(
                self.data.add((lo * self.page_size) as usize),
                ((hi - lo) * self.page_size) as usize,
            )
        };
    }

    /// Makes sure `page` holds no previous tenant's bytes. Returns true if this call zeroed
    /// it. Waits while another party zeroes it.
    pub fn ensure_zeroed(&self, page: u64) -> Result<bool, Error> {
        self.ensure_zeroed_for(page, None)
    }

    /// `ensure_zeroed` for a device attached under `lease`: if the memory is no longer lent
    /// under it (the tenant died and the pool took the memfd back), the page is left as it
    /// is (`DIRTY` stays `DIRTY`) and `StaleLease` returned, so a late device write is never
    /// hidden behind a `ZERO` mark. The check follows the DIRTY -> ZEROING exchange, and the
    /// pool clears the lease before it marks pages dirty, so one of the two always sees it.
    fn ensure_zeroed_for(&self, page: u64, lease: Option<u64>) -> Result<bool, Error> {
        let cell = self.cell(page);
        let mut spins = 0u32;
        loop {
            match cell.load(Ordering::Acquire) {
                ZERO | MAPPED => return Ok(false),
                DIRTY => {
                    if cell
                        .compare_exchange(DIRTY, ZEROING, Ordering::Acquire, Ordering::Relaxed)
                        .is_ok()
                    {
                        if let Some(l) = lease {
                            let now = self.lease();
                            if now != l {
                                cell.store(DIRTY, Ordering::Release);
                                return Err(Error::StaleLease { lease: l, now });
                            }
                        }
                        // SAFETY: page < npages; we won the exchange, nobody else touches
                        // these bytes until we publish ZERO.
                        unsafe {
                            std::ptr::write_bytes(
                                self.data.add((page * self.page_size) as usize),
                                0,
                                self.page_size as usize,
                            );
                        }
                        cell.store(ZERO, Ordering::Release);
                        self.trailer().zeroed.fetch_add(1, Ordering::Relaxed);
                        return Ok(true);
                    }
                }
                ZEROING => {
                    spins += 1;
                    if spins < 64 {
                        std::hint::spin_loop();
                    } else if spins < 256 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(Duration::from_micros(20));
                    }
                }
                other => return Err(Error::CorruptTable { page, state: other }),
            }
        }
    }

    /// `ensure_zeroed` for every page overlapping `[offset, offset+len)`.
    pub fn ensure_range(&self, offset: u64, len: u64) -> Result<u64, Error> {
        self.ensure_range_for(offset, len, None)
    }

    /// `ensure_range` for a device attached under `lease` (see `ensure_zeroed_for`); also
    /// refuses a range of already zeroed pages once the lease is gone.
    pub fn ensure_range_for(
        &self,
        offset: u64,
        len: u64,
        lease: Option<u64>,
    ) -> Result<u64, Error> {
        if let Some(l) = lease {
            let now = self.lease();
            if now != l {
                return Err(Error::StaleLease { lease: l, now });
            }
        }
        if len == 0 {
            return Ok(0);
        }
        let first = offset / self.page_size;
        let last = (offset + len - 1) / self.page_size;
        let mut zeroed = 0;
        for p in first..=last.min(self.npages.saturating_sub(1)) {
            if self.ensure_zeroed_for(p, lease)? {
                zeroed += 1;
            }
        }
        Ok(zeroed)
    }

    pub fn stats(&self) -> PageStats {
        let mut s = PageStats {
            zeroed_total: self.zeroed_total(),
            ..PageStats::default()
        };
        for p in 0..self.npages {
            match self.state(p) {
                DIRTY => s.dirty += 1,
                ZEROING => s.zeroing += 1,
                ZERO => s.zero += 1,
                _ => s.mapped += 1,
            }
        }
        s
    }
}
