//! The in-process cache: a LIFO stack of memfds per size class, O(1) take and give-back,
//! shrinking by count, percentage and threshold.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Condvar, Mutex};

use serde::{Deserialize, Serialize};

use super::{Error, SizeClass};
use crate::sys::Mapping;
use crate::table::DIRTY;
use crate::MemoryPolicy;

#[derive(Debug)]
pub(super) struct Entry {
    pub(super) memfd: OwnedFd,
    pub(super) class: SizeClass,
    /// Pages `[0, zeroed_ahead)` were zeroed while idle (pre-zeroing baseline).
    pub(super) zeroed_ahead: u64,
    /// The pool's own locked mapping of the guest bytes, once they were all resident: the
    /// pages stay pinned from then on, through every lease, until the memfd leaves the pool.
    pub(super) pin: Option<Mapping>,
}

/// Per size class numbers in `PoolStats`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ClassStats {
    pub size: u64,
    pub hugepages: bool,
    pub cached: u64,
    pub zeroed_ahead_bytes: u64,
}

/// Size and counters of a pool.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PoolStats {
    /// Memfds in the cache, ready to hand out.
    pub cached_memfds: u64,
    /// Their total memfd bytes (guest bytes plus tables).
    pub cached_bytes: u64,
    /// Memfds currently handed out.
    pub lent_memfds: u64,
    pub lent_bytes: u64,
    /// Automatic shrink threshold on `cached_bytes`.
    pub max_bytes: Option<u64>,
    /// Share of each cached memfd the idle thread keeps zeroed ahead of time.
    pub prezero_percent: u8,
    /// Takes served from the cache.
    pub hits: u64,
    /// Takes that had to create a new memfd.
    pub misses: u64,
    /// Memfds given back.
    pub returned: u64,
    /// Memfds released by shrinking.
    pub released: u64,
    /// Lent memfds whose tenant is gone but which a device still maps (counted in `lent_*`
    /// too): they return to the cache when the last device mapping is gone.
    #[serde(default)]
    pub quarantined_memfds: u64,
    #[serde(default)]
    pub quarantined_bytes: u64,
    /// Lent memfds that came back when their VMM was gone, no device having
    /// ever mapped them (host-only memory, or device memory no device took):
    /// device unmaps ("IOTLB flushes") the return did not wait for.
    #[serde(default)]
    pub returns_without_unmap: u64,
    /// Lent memfds that came back only after every device that mapped them
    /// had unmapped them.
    #[serde(default)]
    pub returns_after_unmap: u64,
    /// Device registrations of host-only memory, refused.
    #[serde(default)]
    pub device_maps_refused: u64,
    /// Recycling latency of returns after an unmap: from the VMM's exit to
    /// the last device's unmap (the time such memory sat quarantined), summed
    /// and the largest. A return without unmap waits for nothing.
    #[serde(default)]
    pub unmap_wait_ns_total: u64,
    #[serde(default)]
    pub unmap_wait_ns_max: u64,
    /// Cached memfds whose pages the pool keeps pinned (locked), so that a taker's DMA
    /// mapping need not pin them again.
    #[serde(default)]
    pub cached_pinned: u64,
    /// Memfds the pool pinned (once each: at `fill`, or when a fully resident one came back).
    #[serde(default)]
    pub pins_made: u64,
    pub classes: Vec<ClassStats>,
}

#[derive(Debug, Default)]
pub(super) struct Inner {
    pub(super) free: HashMap<SizeClass, Vec<Entry>>,
    pub(super) cached_memfds: u64,
    pub(super) cached_bytes: u64,
    lent_memfds: u64,
    lent_bytes: u64,
    max_bytes: Option<u64>,
    pub(super) prezero_percent: u8,
    hits: u64,
    misses: u64,
    returned: u64,
    released: u64,
    quarantined_memfds: u64,
    quarantined_bytes: u64,
    returns_without_unmap: u64,
    returns_after_unmap: u64,
    device_maps_refused: u64,
    unmap_wait_ns_total: u64,
    unmap_wait_ns_max: u64,
    pins_made: u64,
    /// Whether the pool pins its resident memfds (on unless switched off).
    no_pinning: bool,
}

impl Inner {
    pub(super) fn push(&mut self, e: Entry) {
        self.cached_memfds += 1;
        self.cached_bytes += e.class.memfd_size();
        self.free.entry(e.class).or_default().push(e);
    }

    fn pop(&mut self, class: &SizeClass) -> Option<Entry> {
        let e = self.free.get_mut(class)?.pop()?;
        self.cached_memfds -= 1;
        self.cached_bytes -= class.memfd_size();
        Some(e)
    }

    /// Pops one entry of the class with the most cached bytes (shrinking).
    fn pop_largest(&mut self) -> Option<Entry> {
        let class = *self
            .free
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .max_by_key(|(c, v)| c.memfd_size() * v.len() as u64)?
            .0;
        self.pop(&class)
    }

    /// Drops entries until at most `max` bytes are cached; returns how many.
    fn shrink_to(&mut self, max: u64) -> u64 {
        let mut n = 0;
        while self.cached_bytes > max {
            if self.pop_largest().is_none() {
                break;
            }
            n += 1;
        }
        self.released += n;
        n
    }
}

/// A memfd handed out by `Pool::take`; give it back with `Pool::give_back`.
#[derive(Debug)]
pub struct Lent {
    entry: Entry,
    /// True if it came from the cache (recycled), false if newly created.
    pub recycled: bool,
}

impl Lent {
    pub fn memfd(&self) -> &OwnedFd {
        &self.entry.memfd
    }

    pub fn class(&self) -> SizeClass {
        self.entry.class
    }

    /// The pool keeps its guest bytes resident and locked while it is lent.
    pub fn pinned(&self) -> bool {
        self.entry.pin.is_some()
    }
}

/// The cache itself (in-process). Thread-safe; one per host.
///
/// Pinning: a DMA mapping keeps pages resident and locked (FastIOV's "page pinning",
/// fastiov.txt §3.2.3), per page, at every start. The pool keeps the pages of its resident
/// memfds locked instead, once per memfd, through every lease: a taker told `pinned` has
/// nothing left to pin. Pages a device may see still get zeroed before it does (the page
/// table), whoever pinned them.
#[derive(Debug, Default)]
pub struct Pool {
    inner: Mutex<Inner>,
    pub(super) idle_wake: Condvar,
}

impl Pool {
    /// `max_bytes`: automatic shrink threshold on cached bytes (None = unbounded).
    pub fn new(max_bytes: Option<u64>) -> Pool {
        Pool {
            inner: Mutex::new(Inner {
                max_bytes,
                ..Inner::default()
            }),
            idle_wake: Condvar::new(),
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a memfd of `class` for a sandbox under `policy` (never vanilla). O(1) on a hit;
    /// on a miss a new sparse memfd is created (the kernel zeroes it when populated).
    /// `Pre(p)` also sets the pool's pre-zeroing share to p% (the host runs that baseline).
    pub fn take(&self, class: SizeClass, policy: MemoryPolicy) -> Result<Lent, Error> {
        class.validate()?;
        if policy == MemoryPolicy::Vanilla {
            return Err(Error::VanillaFromPool);
        }
        let hit = {
            let mut inner = self.lock();
            if let MemoryPolicy::Pre(p) = policy {
                if inner.prezero_percent != p {
                    inner.prezero_percent = p;
                    self.idle_wake.notify_all();
                }
            }
            let e = inner.pop(&class);
            if e.is_some() {
                inner.hits += 1;
                inner.lent_memfds += 1;
                inner.lent_bytes += class.memfd_size();
            }
            e
        };
        if let Some(entry) = hit {
            return Ok(Lent {
                entry,
                recycled: true,
            });
        }
        let memfd = class.create(None)?;
        let mut inner = self.lock();
        inner.misses += 1;
        inner.lent_memfds += 1;
        inner.lent_bytes += class.memfd_size();
        Ok(Lent {
            entry: Entry {
                memfd,
                class,
                zeroed_ahead: 0,
                pin: None,
            },
            recycled: false,
        })
    }

    /// Puts a memfd back, still holding its tenant's bytes: every page is marked DIRTY
    /// (nothing is zeroed). One that came back fully resident and was not pinned yet is
    /// pinned now, once (its taker's DMA mapping made it resident). Shrinks automatically
    /// above the threshold.
    pub fn give_back(&self, lent: Lent) {
        let mut entry = lent.entry;
        // The lease ends before the pages are marked: a device still attached under it
        // then never marks a page zero again (see `PageTable::ensure_range_for`).
        let marked = entry.class.map(&entry.memfd).map(|(_m, t)| {
            t.set_lease(0);
            t.set_all(DIRTY)
        });
        let pinned_now = if !self.pinning() {
            entry.pin = None;
            false
        } else {
            marked.is_ok() && entry.pin.is_none() && self.pin_resident(&mut entry)
        };
        let mut inner = self.lock();
        inner.lent_memfds -= 1;
        inner.lent_bytes -= entry.class.memfd_size();
        if let Err(e) = marked {
            // Cannot mark it dirty: never reuse it.
            tracing::error!("dropping returned memfd: {e}");
            inner.released += 1;
            return;
        }
        inner.returned += 1;
        inner.pins_made += pinned_now as u64;
        entry.zeroed_ahead = 0;
        inner.push(entry);
        if let Some(max) = inner.max_bytes {
            inner.shrink_to(max);
        }
        self.idle_wake.notify_all();
    }

    /// Pins `entry` if every guest page of it is resident (a memfd with holes stays unpinned:
    /// pinning would allocate them, and its next taker's DMA mapping does that). True if
    /// pinned; a failure (e.g. RLIMIT_MEMLOCK) only leaves it unpinned.
    fn pin_resident(&self, entry: &mut Entry) -> bool {
        if !entry.class.resident(&entry.memfd) {
            return false;
        }
        match entry.class.pin(&entry.memfd) {
            Ok(m) => {
                entry.pin = Some(m);
                true
            }
            Err(e) => {
                tracing::warn!("pool: memfd left unpinned: {e}");
                false
            }
        }
    }

    /// Counts a lease's return: after a device's unmap, or without one;
    /// `waited`: how long it sat quarantined after its VMM was gone.
    pub(super) fn note_return(&self, after_unmap: bool, waited: Option<std::time::Duration>) {
        let mut inner = self.lock();
        if after_unmap {
            inner.returns_after_unmap += 1;
        } else {
            inner.returns_without_unmap += 1;
        }
        let ns = waited.map_or(0, |d| d.as_nanos() as u64);
        inner.unmap_wait_ns_total += ns;
        inner.unmap_wait_ns_max = inner.unmap_wait_ns_max.max(ns);
    }

    /// Counts a refused device registration of host-only memory.
    pub(super) fn note_refused_map(&self) {
        self.lock().device_maps_refused += 1;
    }

    /// Counts a lent memfd in or out of quarantine (its tenant is gone, a device maps it).
    pub(super) fn quarantine(&self, class: SizeClass, on: bool) {
        let mut inner = self.lock();
        if on {
            inner.quarantined_memfds += 1;
            inner.quarantined_bytes += class.memfd_size();
        } else {
            inner.quarantined_memfds -= 1;
            inner.quarantined_bytes -= class.memfd_size();
        }
    }

    /// Drops the pool's reference to a lent memfd without touching it (the holder keeps
    /// using it; it is freed when the holder closes it too).
    pub fn forget(&self, lent: Lent) {
        let mut inner = self.lock();
        inner.lent_memfds -= 1;
        inner.lent_bytes -= lent.entry.class.memfd_size();
        inner.released += 1;
    }

    /// Adds `count` resident memfds of `class`. With `pattern` every byte is written with it
    /// and pages are marked DIRTY (a stand-in for memory a previous tenant used).
    pub fn fill(&self, class: SizeClass, count: u64, pattern: Option<u8>) -> Result<(), Error> {
        class.validate()?;
        for _ in 0..count {
            let memfd = class.create(Some(pattern))?;
            // Resident now: pinned here, off any sandbox's start.
            let pin = self.pinning().then(|| class.pin(&memfd)).transpose()?;
            let mut inner = self.lock();
            inner.pins_made += pin.is_some() as u64;
            inner.push(Entry {
                memfd,
                class,
                zeroed_ahead: if pattern.is_some() {
                    0
                } else {
                    class.size / class.page_size()
                },
                pin,
            });
            if let Some(max) = inner.max_bytes {
                inner.shrink_to(max);
            }
        }
        self.idle_wake.notify_all();
        Ok(())
    }

    /// Releases up to `n` cached memfds (largest class first); returns how many.
    pub fn shrink_count(&self, n: u64) -> u64 {
        let mut inner = self.lock();
        let mut done = 0;
        while done < n && inner.pop_largest().is_some() {
            done += 1;
        }
        inner.released += done;
        done
    }

    /// Releases `percent`% of the cached memfds (rounded up); returns how many.
    pub fn shrink_percent(&self, percent: u8) -> u64 {
        let cached = self.lock().cached_memfds;
        let n = (cached * percent.min(100) as u64).div_ceil(100);
        self.shrink_count(n)
    }

    /// Releases cached memfds until at most `max_bytes` are cached; returns how many.
    pub fn shrink_to(&self, max_bytes: u64) -> u64 {
        self.lock().shrink_to(max_bytes)
    }

    /// Sets (or clears) the automatic shrink threshold and applies it.
    pub fn set_max_bytes(&self, max_bytes: Option<u64>) -> u64 {
        let mut inner = self.lock();
        inner.max_bytes = max_bytes;
        max_bytes.map(|m| inner.shrink_to(m)).unwrap_or(0)
    }

    /// Sets the share of each cached memfd the idle thread zeroes ahead of time.
    pub fn set_prezero_percent(&self, percent: u8) {
        self.lock().prezero_percent = percent.min(100);
        self.idle_wake.notify_all();
    }

    fn pinning(&self) -> bool {
        !self.lock().no_pinning
    }

    /// Switches the pool's pinning on or off (on by default). Off: cached memfds are
    /// unpinned now and none is pinned again, so takers' DMA mappings pin every page
    /// themselves (FastIOV's per-start pinning, for side-by-side measurements). On: the
    /// cached memfds that are fully resident are pinned now.
    pub fn set_pinning(&self, on: bool) {
        // Take the entries out, (un)pin them outside the lock, put them back.
        let entries: Vec<Entry> = {
            let mut inner = self.lock();
            inner.no_pinning = !on;
            inner.cached_memfds = 0;
            inner.cached_bytes = 0;
            std::mem::take(&mut inner.free)
                .into_values()
                .flatten()
                .collect()
        };
        let mut made = 0;
        let entries: Vec<Entry> = entries
            .into_iter()
            .map(|mut e| {
                if !on {
                    e.pin = None;
                } else if e.pin.is_none() && self.pin_resident(&mut e) {
                    made += 1;
                }
                e
            })
            .collect();
        let mut inner = self.lock();
        inner.pins_made += made;
        for e in entries {
            inner.push(e);
        }
    }

    pub fn stats(&self) -> PoolStats {
        let inner = self.lock();
        let mut classes: Vec<ClassStats> = inner
            .free
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(c, v)| ClassStats {
                size: c.size,
                hugepages: c.hugepages,
                cached: v.len() as u64,
                zeroed_ahead_bytes: v.iter().map(|e| e.zeroed_ahead * c.page_size()).sum(),
            })
            .collect();
        classes.sort_by_key(|c| (c.size, c.hugepages));
        PoolStats {
            cached_memfds: inner.cached_memfds,
            cached_bytes: inner.cached_bytes,
            lent_memfds: inner.lent_memfds,
            lent_bytes: inner.lent_bytes,
            max_bytes: inner.max_bytes,
            prezero_percent: inner.prezero_percent,
            hits: inner.hits,
            misses: inner.misses,
            returned: inner.returned,
            released: inner.released,
            quarantined_memfds: inner.quarantined_memfds,
            quarantined_bytes: inner.quarantined_bytes,
            returns_without_unmap: inner.returns_without_unmap,
            returns_after_unmap: inner.returns_after_unmap,
            device_maps_refused: inner.device_maps_refused,
            unmap_wait_ns_total: inner.unmap_wait_ns_total,
            unmap_wait_ns_max: inner.unmap_wait_ns_max,
            cached_pinned: inner
                .free
                .values()
                .flatten()
                .filter(|e| e.pin.is_some())
                .count() as u64,
            pins_made: inner.pins_made,
            classes,
        }
    }
}
