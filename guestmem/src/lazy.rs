//! Lazy zeroing (FastIOV §4.3.2, §5): a userfaultfd MINOR-fault handler on the guest view and
//! a background zeroer at the lowest priority, both zeroing through the device view.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use userfaultfd::{Event, EventBuffer, FeatureFlags, RegisterMode, Uffd, UffdBuilder};

use nix::poll::PollTimeout;
use procutil::sched::{self, Policy};
use vmm_sys_util::eventfd::EventFd;

use crate::sys;
use crate::table::{PageTable, MAPPED, ZERO};
use crate::{Error, Region};

const UFFD_FEATURE_MINOR_HUGETLBFS: u64 = 1 << 9;
const UFFD_FEATURE_MINOR_SHMEM: u64 = 1 << 10;
/// Pages zeroed per background batch: short enough that a waiter never waits long.
const BATCH_PAGES: u64 = 256;
/// The background zeroer's thread name.
pub const ZEROER_THREAD: &str = "bg-zeroer";
/// Bytes the fault handler zeroes and maps per fault (one page at least): the kernel's
/// default `fault_around_bytes`. The built-in agent touches ~21 pages in three clusters, so
/// 64 KiB takes as few faults as 256 KiB did and zeroes a quarter of the bytes
/// (docs/results.md "Startup CPU, round 13").
const FAULT_AROUND_BYTES: u64 = 64 << 10;

/// Counters of the lazy-zeroing machinery of one GuestMemory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct LazyStats {
    /// MINOR faults served by the handler.
    pub faults: u64,
    /// Pages the handler zeroed (the rest were already zeroed by someone else).
    pub fault_zeroed: u64,
    /// Pages the background zeroer zeroed.
    pub background_zeroed: u64,
    /// Pages the background zeroer mapped into the guest view ahead of the guest.
    pub background_mapped: u64,
    /// Blocks mapped ahead of the guest because the VMM wrote into them (`write_instant`).
    pub instant_mapped: u64,
    /// Pages of those blocks zeroed with them (beyond the pages written).
    pub instant_zeroed: u64,
}

/// Run on the background zeroer's own thread: first (`GuestMemory::start_lazy_zeroing_with`),
/// e.g. to move that thread into an idle cgroup, or last (`GuestMemory::on_zeroing_end`),
/// e.g. to tell a waiter the deferred zeroing is over.
pub type ZeroerHook = Box<dyn FnOnce() + Send>;

/// Told the first lazy-zeroing error, once (`GuestMemory::set_lazy_error_callback`).
pub type LazyErrorCallback = Box<dyn Fn(&Arc<LazyError>) + Send + Sync>;

/// Why a lazy-zeroing thread stopped serving faults; each names the region
/// and page it is about where there is one.
#[derive(Debug, thiserror::Error)]
pub enum LazyError {
    #[error("poll on userfaultfd: {0}")]
    Poll(#[source] std::io::Error),
    #[error("read userfaultfd events: {0} ({0:?})")]
    ReadEvents(#[source] userfaultfd::Error),
    #[error("unexpected userfaultfd event {0}")]
    UnexpectedEvent(String),
    #[error("bad userfaultfd event: {0}")]
    BadEvent(#[source] userfaultfd::Error),
    #[error("fault at {0:#x} outside every lazy region")]
    Outside(usize),
    #[error("region {region:?}: {source}")]
    Zero {
        region: String,
        #[source]
        source: Error,
    },
    #[error("region {region:?}: UFFDIO_CONTINUE pages {start}..{end}: {source:?}")]
    Continue {
        region: String,
        start: u64,
        end: u64,
        #[source]
        source: userfaultfd::Error,
    },
    #[error("region {region:?}: UFFDIO_CONTINUE page {page}: {source:?}")]
    ContinuePage {
        region: String,
        page: u64,
        #[source]
        source: userfaultfd::Error,
    },
    #[error("region {region:?}: UFFDIO_WAKE page {page}: {source:?}")]
    Wake {
        region: String,
        page: u64,
        #[source]
        source: userfaultfd::Error,
    },
    #[error("region {region:?}: UFFDIO_CONTINUE page {page}: page not in the memfd")]
    NotResident { region: String, page: u64 },
}

/// First error of a lazy-zeroing thread; the VMM polls it (or its fd) and stops the VM.
pub(crate) struct ErrorSlot {
    first: Mutex<Option<Arc<LazyError>>>,
    fd: EventFd,
    callback: Mutex<Option<LazyErrorCallback>>,
    fired: AtomicBool,
}

impl ErrorSlot {
    pub fn new() -> Result<ErrorSlot, Error> {
        Ok(ErrorSlot {
            first: Mutex::new(None),
            fd: sys::wake_fd().map_err(|e| Error::io("eventfd for lazy-zeroing errors", e))?,
            callback: Mutex::new(None),
            fired: AtomicBool::new(false),
        })
    }

    pub fn report(&self, e: LazyError) {
        tracing::error!("lazy zeroing: {e}");
        {
            let mut first = self.first.lock().unwrap_or_else(|p| p.into_inner());
            if first.is_some() {
                return;
            }
            *first = Some(Arc::new(e));
        }
        self.fire();
        // Last, so a poller that wakes up finds the callback done.
        sys::signal(&self.fd);
    }

    /// Calls the callback once with the first error, whichever of report/set_callback
    /// comes second.
    fn fire(&self) {
        let cb = self.callback.lock().unwrap_or_else(|p| p.into_inner());
        if let (Some(cb), Some(e)) = (&*cb, self.get()) {
            if !self.fired.swap(true, Ordering::AcqRel) {
                cb(&e);
            }
        }
    }

    pub fn get(&self) -> Option<Arc<LazyError>> {
        self.first.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        sys::borrow(&self.fd)
    }

    pub fn set_callback(&self, cb: LazyErrorCallback) {
        *self.callback.lock().unwrap_or_else(|p| p.into_inner()) = Some(cb);
        self.fire();
    }
}

struct LazyRegion {
    name: String,
    guest: usize,
    len: u64,
    table: PageTable,
}

struct Shared {
    uffd: Uffd,
    regions: Vec<LazyRegion>,
    stop: AtomicBool,
    wake: EventFd,
    errors: Arc<ErrorSlot>,
    faults: AtomicU64,
    fault_zeroed: AtomicU64,
    background_zeroed: AtomicU64,
    background_mapped: AtomicU64,
    instant_mapped: AtomicU64,
    instant_zeroed: AtomicU64,
    zeroer_end: Mutex<ZeroerEnd>,
    /// Signalled when the zeroer has ended (`Lazy::wait_zeroer_done`).
    zeroer_ended: Condvar,
}

/// Whether the background zeroer has ended, and what runs when it does.
#[derive(Default)]
struct ZeroerEnd {
    ended: bool,
    hooks: Vec<ZeroerHook>,
}

impl Shared {
    /// The zeroer thread's last act: marks it ended and runs the hooks given so far.
    fn zeroer_ended(&self) {
        let hooks = {
            let mut e = self.zeroer_end.lock().unwrap_or_else(|p| p.into_inner());
            e.ended = true;
            std::mem::take(&mut e.hooks)
        };
        self.zeroer_ended.notify_all();
        for h in hooks {
            h();
        }
    }
}

/// The uffd, its handler thread and (once started) the background zeroer.
pub(crate) struct Lazy {
    shared: Arc<Shared>,
    handler: Option<JoinHandle<()>>,
    zeroer: Option<JoinHandle<()>>,
}

fn uffd_errno(e: &userfaultfd::Error) -> Option<i32> {
    match e {
        userfaultfd::Error::SystemError(n) => Some(*n as i32),
        _ => None,
    }
}

impl Lazy {
    /// Registers the guest views of `regions` (MINOR mode) and starts the fault handler.
    /// The regions must outlive the returned value's threads (`stop` joins them).
    pub fn new(regions: &[&Region], errors: Arc<ErrorSlot>) -> Result<Lazy, Error> {
        let names = regions
            .iter()
            .map(|r| r.name())
            .collect::<Vec<_>>()
            .join(",");
        let uffd = UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            // KVM touches guest memory from kernel mode: those faults must reach us too.
            .user_mode_only(false)
            .require_features(FeatureFlags::from_bits_retain(
                UFFD_FEATURE_MINOR_SHMEM | UFFD_FEATURE_MINOR_HUGETLBFS,
            ))
            .create()
            .map_err(|source| Error::Userfaultfd {
                region: names.clone(),
                op: "create with MINOR_SHMEM|MINOR_HUGETLBFS",
                source,
            })?;
        let mut lazy_regions = Vec::new();
        for r in regions {
            uffd.register_with_mode(
                r.guest_view_ptr() as *mut libc::c_void,
                r.size() as usize,
                RegisterMode::MINOR,
            )
            .map_err(|source| Error::Userfaultfd {
                region: r.name().to_string(),
                op: "register guest view in MINOR mode",
                source,
            })?;
            lazy_regions.push(LazyRegion {
                name: r.name().to_string(),
                guest: r.guest_view_ptr() as usize,
                len: r.size(),
                table: *r.table(),
            });
        }
        let shared = Arc::new(Shared {
            uffd,
            regions: lazy_regions,
            stop: AtomicBool::new(false),
            wake: sys::wake_fd().map_err(|e| Error::io("eventfd for lazy-zeroing stop", e))?,
            errors,
            faults: AtomicU64::new(0),
            fault_zeroed: AtomicU64::new(0),
            background_zeroed: AtomicU64::new(0),
            background_mapped: AtomicU64::new(0),
            instant_mapped: AtomicU64::new(0),
            instant_zeroed: AtomicU64::new(0),
            zeroer_end: Mutex::new(ZeroerEnd::default()),
            zeroer_ended: Condvar::new(),
        });
        let s = shared.clone();
        let handler = std::thread::Builder::new()
            .name("uffd-handler".into())
            .spawn(move || handler_loop(&s))
            .map_err(|e| Error::io("spawn uffd handler thread", e))?;
        Ok(Lazy {
            shared,
            handler: Some(handler),
            zeroer: None,
        })
    }

    pub fn start_zeroer(&mut self, idle: bool, on_start: Option<ZeroerHook>) -> Result<(), Error> {
        if self.zeroer.is_some() {
            return Ok(());
        }
        let s = self.shared.clone();
        self.zeroer = Some(
            std::thread::Builder::new()
                .name(ZEROER_THREAD.into())
                .spawn(move || {
                    if let Some(f) = on_start {
                        f();
                    }
                    zeroer_loop(&s, idle);
                    s.zeroer_ended();
                })
                .map_err(|e| Error::io("spawn background zeroer thread", e))?,
        );
        Ok(())
    }

    pub fn stats(&self) -> LazyStats {
        let s = &self.shared;
        LazyStats {
            faults: s.faults.load(Ordering::Relaxed),
            fault_zeroed: s.fault_zeroed.load(Ordering::Relaxed),
            background_zeroed: s.background_zeroed.load(Ordering::Relaxed),
            background_mapped: s.background_mapped.load(Ordering::Relaxed),
            instant_mapped: s.instant_mapped.load(Ordering::Relaxed),
            instant_zeroed: s.instant_zeroed.load(Ordering::Relaxed),
        }
    }

    /// Maps the fault-around blocks that `[guest_addr, guest_addr+len)` of a guest view
    /// touches into that view now, zeroing what is still dirty: pages the VMM wrote before
    /// the guest runs (FastIOV's instant-zeroing list, which lazy zeroing does not manage)
    /// then cost the guest no fault. Addresses outside every lazy region are left alone.
    pub fn map_ahead(&self, guest_addr: usize, len: u64) -> Result<(), LazyError> {
        let s = &self.shared;
        let Some(r) = s.region_of(guest_addr) else {
            return Ok(());
        };
        let ps = r.table.page_size();
        let first = (guest_addr - r.guest) as u64 / ps;
        let last = (((guest_addr - r.guest) as u64 + len.max(1) - 1) / ps)
            .min(r.table.npages().saturating_sub(1));
        let block = (FAULT_AROUND_BYTES / ps).max(1);
        let mut start = first / block * block;
        while start <= last {
            let end = (start + block).min(r.table.npages());
            if (start..end).any(|p| r.table.state(p) != MAPPED) {
                map_block(s, r, first.max(start), &s.instant_zeroed)?;
                s.instant_mapped.fetch_add(1, Ordering::Relaxed);
            }
            start = end;
        }
        Ok(())
    }

    /// Stops and joins both threads. The uffd stays open until `self` is dropped, which
    /// must happen after the guest views are unmapped: closing a uffd wakes blocked faults
    /// and would let them map pages that were never zeroed.
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        sys::signal(&self.shared.wake);
        if let Some(h) = self.handler.take() {
            let _ = h.join();
        }
        if let Some(h) = self.zeroer.take() {
            let _ = h.join();
        }
    }

    /// Has `hook` run when the background zeroer has ended (on its thread), or hands it
    /// back to be run now if it already has. Never run if no zeroer is started before
    /// `self` is dropped.
    pub fn on_zeroer_end(&self, hook: ZeroerHook) -> Option<ZeroerHook> {
        let mut e = self
            .shared
            .zeroer_end
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if e.ended {
            return Some(hook);
        }
        e.hooks.push(hook);
        None
    }

    /// Waits until the background zeroer has gone over every page (tests, benchmark).
    pub fn wait_zeroer_done(&self) {
        if self.zeroer.is_none() {
            return;
        }
        let s = &self.shared;
        let mut e = s.zeroer_end.lock().unwrap_or_else(|p| p.into_inner());
        while !e.ended {
            e = s.zeroer_ended.wait(e).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Drop for Lazy {
    fn drop(&mut self) {
        self.stop();
    }
}

fn handler_loop(s: &Shared) {
    let mut buf = EventBuffer::new(64);
    loop {
        let ready =
            match sys::poll_readable(&[s.uffd_fd(), sys::borrow(&s.wake)], PollTimeout::NONE) {
                Ok(r) => r,
                Err(e) => return s.errors.report(LazyError::Poll(e)),
            };
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        if !ready[0] {
            continue;
        }
        let events = match s.uffd.read_events(&mut buf) {
            Ok(ev) => ev.collect::<Vec<_>>(),
            Err(e) => return s.errors.report(LazyError::ReadEvents(e)),
        };
        for ev in events {
            let res = match ev {
                Ok(Event::Pagefault { addr, .. }) => handle_fault(s, addr as usize),
                Ok(other) => Err(LazyError::UnexpectedEvent(format!("{other:?}"))),
                Err(e) => Err(LazyError::BadEvent(e)),
            };
            if let Err(e) = res {
                // Stop serving faults: the faulting vCPU stays blocked and never sees
                // unzeroed memory; the VMM sees the error and tears the VM down.
                return s.errors.report(e);
            }
        }
    }
}

impl Shared {
    fn uffd_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the uffd lives as long as `self`.
        unsafe { BorrowedFd::borrow_raw(self.uffd.as_raw_fd()) }
    }

    fn region_of(&self, addr: usize) -> Option<&LazyRegion> {
        self.regions
            .iter()
            .find(|r| addr >= r.guest && addr < r.guest + r.len as usize)
    }

    /// UFFDIO_CONTINUE for `[addr, addr+len)`.
    fn continue_range(&self, addr: usize, len: u64) -> Result<Continued, userfaultfd::Error> {
        loop {
            match self
                .uffd
                .r#continue(addr as *mut libc::c_void, len as usize, true)
            {
                Ok(n) if n == len => return Ok(Continued::Mapped),
                // Partial (EAGAIN): retry the whole range; mapped pages then report EEXIST.
                Ok(_) => continue,
                Err(e) if uffd_errno(&e) == Some(libc::EAGAIN) => continue,
                Err(e) if uffd_errno(&e) == Some(libc::EEXIST) => return Ok(Continued::Exists),
                // A hole in the memfd (never populated): the kernel zero-fills it on touch.
                Err(e) if uffd_errno(&e) == Some(libc::EFAULT) => {
                    return Ok(Continued::NotResident)
                }
                Err(e) => return Err(e),
            }
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Continued {
    Mapped,
    Exists,
    NotResident,
}

fn handle_fault(s: &Shared, addr: usize) -> Result<(), LazyError> {
    s.faults.fetch_add(1, Ordering::Relaxed);
    let r = s.region_of(addr).ok_or(LazyError::Outside(addr))?;
    let page = (addr - r.guest) as u64 / r.table.page_size();
    map_block(s, r, page, &s.fault_zeroed)
}

/// Zeroes and maps into the guest view the aligned fault-around block of `page` (as the
/// kernel does for file mappings, so a guest walking its memory takes one fault per
/// block), counting the pages it zeroed in `zeroed`. `page` goes first: a racing device or
/// vCPU waits on it soonest.
fn map_block(s: &Shared, r: &LazyRegion, page: u64, zeroed: &AtomicU64) -> Result<(), LazyError> {
    let ps = r.table.page_size();
    let block = (FAULT_AROUND_BYTES / ps).max(1);
    let first = page / block * block;
    let end = (first + block).min(r.table.npages());
    let zero_err = |source| LazyError::Zero {
        region: r.name.clone(),
        source,
    };
    r.table.prefault_dirty(first, end);
    for p in std::iter::once(page).chain((first..end).filter(|p| *p != page)) {
        if r.table.ensure_zeroed(p).map_err(zero_err)? {
            zeroed.fetch_add(1, Ordering::Relaxed);
        }
    }
    let cont_err = |page: u64, source| LazyError::ContinuePage {
        region: r.name.clone(),
        page,
        source,
    };
    if (first..end).all(|p| r.table.state(p) == ZERO) {
        let a = r.guest + (first * ps) as usize;
        if s.continue_range(a, (end - first) * ps)
            .map_err(|e| cont_err(first, e))?
            == Continued::Mapped
        {
            for p in first..end {
                r.table.transition(p, ZERO, MAPPED);
            }
            return Ok(());
        }
    }
    // Some pages of the block are mapped already (or holes): page by page.
    for p in first..end {
        if p != page && r.table.state(p) != ZERO {
            continue;
        }
        let a = r.guest + (p * ps) as usize;
        match s.continue_range(a, ps).map_err(|e| cont_err(p, e))? {
            Continued::Mapped => {}
            Continued::Exists => {
                if p == page {
                    // Mapped by someone else meanwhile: make sure a faulter wakes.
                    s.uffd
                        .wake(a as *mut libc::c_void, ps as usize)
                        .map_err(|source| LazyError::Wake {
                            region: r.name.clone(),
                            page: p,
                            source,
                        })?;
                }
            }
            Continued::NotResident if p == page => {
                return Err(LazyError::NotResident {
                    region: r.name.clone(),
                    page,
                })
            }
            Continued::NotResident => continue,
        }
        r.table.transition(p, ZERO, MAPPED);
    }
    Ok(())
}

fn zeroer_loop(s: &Shared, idle: bool) {
    // Lowest priority between batches; normal priority while holding pages in ZEROING so a
    // fault waiting on one of them is not stuck behind an idle-class thread.
    let can_switch = idle && sched::set_thread_policy(Policy::Idle).is_ok();
    if idle && !can_switch {
        let _ = sched::set_thread_nice(19);
    }
    // Top down: guests allocate from low addresses, so the zeroer and the guest's first
    // touches meet once instead of contending page after page.
    for r in &s.regions {
        let ps = r.table.page_size();
        let mut end = r.table.npages();
        while end > 0 {
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            let start = end.saturating_sub(BATCH_PAGES);
            if can_switch {
                std::thread::yield_now();
                let _ = sched::set_thread_policy(Policy::Other);
            }
            let mut err = None;
            r.table.prefault_dirty(start, end);
            for p in start..end {
                match r.table.ensure_zeroed(p) {
                    Ok(true) => {
                        s.background_zeroed.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(false) => {}
                    Err(source) => {
                        err = Some(LazyError::Zero {
                            region: r.name.clone(),
                            source,
                        });
                        break;
                    }
                }
            }
            if can_switch {
                let _ = sched::set_thread_policy(Policy::Idle);
            }
            if let Some(e) = err {
                return s.errors.report(e);
            }
            if let Err(e) = map_ahead(s, r, start, end, ps) {
                return s.errors.report(e);
            }
            end = start;
        }
    }
}

/// Maps zeroed pages `[start, end)` into the guest view so the guest never faults on them.
fn map_ahead(s: &Shared, r: &LazyRegion, start: u64, end: u64, ps: u64) -> Result<(), LazyError> {
    let addr = r.guest + (start * ps) as usize;
    let all_unmapped = (start..end).all(|p| r.table.state(p) == ZERO);
    if all_unmapped {
        match s.continue_range(addr, (end - start) * ps) {
            Ok(Continued::Mapped) => {
                for p in start..end {
                    r.table.transition(p, ZERO, MAPPED);
                }
                s.background_mapped
                    .fetch_add(end - start, Ordering::Relaxed);
                return Ok(());
            }
            // Raced with the handler, or holes: go page by page.
            Ok(_) => {}
            Err(source) => {
                return Err(LazyError::Continue {
                    region: r.name.clone(),
                    start,
                    end,
                    source,
                })
            }
        }
    }
    for p in start..end {
        if r.table.state(p) != ZERO {
            continue;
        }
        let a = r.guest + (p * ps) as usize;
        match s.continue_range(a, ps) {
            Ok(Continued::Mapped) => {
                r.table.transition(p, ZERO, MAPPED);
                s.background_mapped.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Continued::Exists) => {
                r.table.transition(p, ZERO, MAPPED);
            }
            Ok(Continued::NotResident) => {}
            Err(source) => {
                return Err(LazyError::ContinuePage {
                    region: r.name.clone(),
                    page: p,
                    source,
                })
            }
        }
    }
    Ok(())
}
