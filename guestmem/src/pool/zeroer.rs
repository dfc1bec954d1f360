//! The idle pre-zeroer (the `pre<P>` baseline): keeps P% of every cached memfd zeroed, at
//! SCHED_IDLE priority, so that a `pre<P>` take finds that share done.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::cache::Entry;
use super::{Error, Pool};
use procutil::sched::{self, Policy};

/// Bytes the idle pre-zeroer zeroes before giving the entry back to the free list.
const PREZERO_CHUNK: u64 = 8 << 20;

impl Pool {
    /// Takes one cached entry that is below the pre-zero share, if any.
    fn take_underzeroed(&self) -> Option<(Entry, u64)> {
        let mut inner = self.lock();
        let pct = inner.prezero_percent as u64;
        if pct == 0 {
            return None;
        }
        let mut found = None;
        for (class, v) in inner.free.iter() {
            let target = (class.size / class.page_size()) * pct / 100;
            if let Some(i) = v.iter().position(|e| e.zeroed_ahead < target) {
                found = Some((*class, i, target));
                break;
            }
        }
        let (class, i, target) = found?;
        let e = inner.free.get_mut(&class)?.swap_remove(i);
        inner.cached_memfds -= 1;
        inner.cached_bytes -= class.memfd_size();
        Some((e, target))
    }

    /// Zeroes up to `max_bytes` of `e` towards `target` pages; marks them ZERO.
    fn zero_ahead(e: &mut Entry, target: u64, max_bytes: u64) -> Result<(), Error> {
        let ps = e.class.page_size();
        let (_m, t) = e.class.map(&e.memfd)?;
        let end = target.min(e.zeroed_ahead + (max_bytes / ps).max(1));
        t.prefault_dirty(e.zeroed_ahead, end);
        for p in e.zeroed_ahead..end {
            t.ensure_zeroed(p).map_err(|err| Error::Table {
                size: e.class.size,
                hugepages: e.class.hugepages,
                what: "pre-zeroing".into(),
                source: Box::new(err),
            })?;
        }
        e.zeroed_ahead = end;
        Ok(())
    }

    /// Synchronously zeroes every cached memfd up to `percent`% (what the idle thread would
    /// do given time; used by the benchmark before timing `pre*`). Also sets the share.
    pub fn prezero_now(&self, percent: u8) -> Result<(), Error> {
        self.set_prezero_percent(percent);
        while let Some((mut e, target)) = self.take_underzeroed() {
            let r = Self::zero_ahead(&mut e, target, u64::MAX);
            self.lock().push(e);
            r?;
        }
        Ok(())
    }

    /// Idle-priority loop that keeps cached memfds pre-zeroed to the configured share.
    pub(super) fn idle_prezero_loop(&self, stop: &AtomicBool) {
        if sched::set_thread_policy(Policy::Idle).is_err() {
            let _ = sched::set_thread_nice(19);
        }
        while !stop.load(Ordering::Acquire) {
            match self.take_underzeroed() {
                Some((mut e, target)) => {
                    let r = Self::zero_ahead(&mut e, target, PREZERO_CHUNK);
                    self.lock().push(e);
                    if let Err(err) = r {
                        tracing::error!("idle pre-zeroing: {err}");
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }
                None => {
                    let inner = self.lock();
                    let _ = self
                        .idle_wake
                        .wait_timeout(inner, Duration::from_millis(200))
                        .unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }
}
