//! Host-wide page pool (PiBooster §3.5, §4.2): a cache of resident memfds per size class with
//! O(1) take/return, never zeroed on return, shrinkable by count, by percentage and
//! automatically above a threshold. `PoolServer` hands memfds to VMM processes over a unix
//! socket (SCM_RIGHTS) and takes them back, marked dirty, when the connection closes — also
//! when the VMM was killed. `PoolClient` is the VMM side.

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::sys::socket::{
    self, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag,
    SockType, UnixAddr,
};
use serde::{Deserialize, Serialize};

use crate::sys::{self, EventFd, Mapping};
use crate::table::{self, PageTable, DIRTY, ZERO};
use crate::MemoryPolicy;

const RW: i32 = libc::PROT_READ | libc::PROT_WRITE;
const MAX_MSG: usize = 64 * 1024;
/// Bytes the idle pre-zeroer zeroes before giving the entry back to the free list.
const PREZERO_CHUNK: u64 = 8 << 20;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("pool socket {path}: {source}")]
    Socket {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("pool socket {path}: protocol error: {reason}")]
    Protocol { path: String, reason: String },
    #[error("pool server {path} refused: {reason}")]
    Refused { path: String, reason: String },
    #[error("pool: vanilla memory is never taken from the pool (it must be fresh)")]
    VanillaFromPool,
    #[error("pool size class {size} bytes{}: {what}: {source}", if *.hugepages { " (hugepages)" } else { "" })]
    Memory {
        size: u64,
        hugepages: bool,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("pool: bad argument {arg}: {reason}")]
    BadArg { arg: String, reason: String },
    #[error("pool: {0}")]
    Signal(String),
}

/// Memfds of one size class are interchangeable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
pub struct SizeClass {
    /// Guest bytes (the memfd is this plus the page-state table).
    pub size: u64,
    pub hugepages: bool,
}

impl SizeClass {
    pub fn page_size(&self) -> u64 {
        sys::page_size_for(self.hugepages)
    }

    pub fn memfd_size(&self) -> u64 {
        self.size + table::table_size(self.size, self.page_size())
    }

    fn validate(&self) -> Result<(), Error> {
        let ps = self.page_size();
        if self.size == 0 || !self.size.is_multiple_of(ps) {
            return Err(Error::BadArg {
                arg: format!("size {}", self.size),
                reason: format!("must be a non-zero multiple of the page size {ps}"),
            });
        }
        Ok(())
    }

    fn mem_err(&self, what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let (size, hugepages, what) = (self.size, self.hugepages, what.into());
        move |source| Error::Memory {
            size,
            hugepages,
            what,
            source,
        }
    }

    /// Maps guest bytes and table of `memfd` (the pool's own short-lived device view).
    fn map(&self, memfd: &OwnedFd) -> Result<(Mapping, PageTable), Error> {
        let m = Mapping::new(memfd.as_fd(), 0, self.memfd_size(), RW)
            .map_err(self.mem_err("mmap pool memfd"))?;
        // SAFETY: data and table lie inside `m`, which the caller keeps while using the table.
        let t = unsafe {
            PageTable::new(
                m.ptr(),
                m.ptr().add(self.size as usize),
                self.size,
                self.page_size(),
            )
        };
        Ok((m, t))
    }

    /// A new memfd with a formatted table. `fill`: make it resident, writing `pattern`
    /// into every byte if given (pages then DIRTY), else leave it sparse (pages ZERO).
    fn create(&self, fill: Option<Option<u8>>) -> Result<OwnedFd, Error> {
        let fd = sys::memfd_create("pool", self.hugepages).map_err(self.mem_err("memfd_create"))?;
        sys::ftruncate(fd.as_fd(), self.memfd_size()).map_err(self.mem_err("ftruncate"))?;
        let m = Mapping::new(fd.as_fd(), 0, self.memfd_size(), RW).map_err(|e| {
            if self.hugepages && e.raw_os_error() == Some(libc::ENOMEM) {
                Error::Memory {
                    size: self.size,
                    hugepages: true,
                    what: "not enough reserved huge pages (see /proc/sys/vm/nr_hugepages)".into(),
                    source: e,
                }
            } else {
                self.mem_err("mmap new memfd")(e)
            }
        })?;
        let state = match fill {
            Some(Some(pattern)) => {
                // SAFETY: writes inside our own fresh mapping.
                unsafe { std::ptr::write_bytes(m.ptr(), pattern, self.size as usize) };
                DIRTY
            }
            Some(None) => {
                m.populate_write(0, self.size as usize)
                    .map_err(self.mem_err("MADV_POPULATE_WRITE"))?;
                ZERO
            }
            None => ZERO,
        };
        // SAFETY: the table lies inside `m`; nobody else has this memfd yet.
        unsafe {
            PageTable::format(
                m.ptr().add(self.size as usize),
                self.size,
                self.page_size(),
                state,
            );
        }
        Ok(fd)
    }
}

#[derive(Debug)]
struct Entry {
    memfd: OwnedFd,
    class: SizeClass,
    /// Pages `[0, zeroed_ahead)` were zeroed while idle (pre-zeroing baseline).
    zeroed_ahead: u64,
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
    pub classes: Vec<ClassStats>,
}

#[derive(Debug, Default)]
struct Inner {
    free: HashMap<SizeClass, Vec<Entry>>,
    cached_memfds: u64,
    cached_bytes: u64,
    lent_memfds: u64,
    lent_bytes: u64,
    max_bytes: Option<u64>,
    prezero_percent: u8,
    hits: u64,
    misses: u64,
    returned: u64,
    released: u64,
}

impl Inner {
    fn push(&mut self, e: Entry) {
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
}

/// The cache itself (in-process). Thread-safe; one per host.
#[derive(Debug, Default)]
pub struct Pool {
    inner: Mutex<Inner>,
    idle_wake: Condvar,
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

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
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
            },
            recycled: false,
        })
    }

    /// Puts a memfd back, still holding its tenant's bytes: every page is marked DIRTY
    /// (nothing is zeroed). Shrinks automatically above the threshold.
    pub fn give_back(&self, lent: Lent) {
        let mut entry = lent.entry;
        let marked = entry
            .class
            .map(&entry.memfd)
            .map(|(_m, t)| t.set_all(DIRTY));
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
        entry.zeroed_ahead = 0;
        inner.push(entry);
        if let Some(max) = inner.max_bytes {
            inner.shrink_to(max);
        }
        self.idle_wake.notify_all();
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
            let mut inner = self.lock();
            inner.push(Entry {
                memfd,
                class,
                zeroed_ahead: if pattern.is_some() {
                    0
                } else {
                    class.size / class.page_size()
                },
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
            classes,
        }
    }

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
        for p in e.zeroed_ahead..end {
            t.ensure_zeroed(p).map_err(|err| Error::Memory {
                size: e.class.size,
                hugepages: e.class.hugepages,
                what: "pre-zeroing".into(),
                source: std::io::Error::other(err.to_string()),
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
    fn idle_prezero_loop(&self, stop: &AtomicBool) {
        if sys::set_thread_sched(true).is_err() {
            sys::set_thread_nice(19);
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

// ---------------------------------------------------------------------------------------
// Protocol: one JSON object per SOCK_SEQPACKET message each way; a `take` response carries
// the memfd as SCM_RIGHTS.

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
enum Request {
    Take {
        size: u64,
        hugepages: bool,
        policy: String,
    },
    Stats,
    Shrink {
        count: Option<u64>,
        percent: Option<u8>,
        to_bytes: Option<u64>,
    },
    Fill {
        size: u64,
        hugepages: bool,
        count: u64,
        pattern: Option<u8>,
    },
    Prezero {
        percent: u8,
    },
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Response {
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    memfd_size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    recycled: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    released: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stats: Option<PoolStats>,
}

fn send_msg(fd: RawFd, body: &[u8], pass: Option<RawFd>) -> nix::Result<()> {
    let iov = [IoSlice::new(body)];
    let fds = pass.map(|f| [f]);
    let cmsgs: Vec<ControlMessage> = fds.iter().map(|f| ControlMessage::ScmRights(f)).collect();
    socket::sendmsg::<()>(fd, &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    Ok(())
}

/// Receives one message; `Ok(None)` on EOF.
fn recv_msg(fd: RawFd) -> nix::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    let mut buf = vec![0u8; MAX_MSG];
    let mut cmsg = nix::cmsg_space!([RawFd; 4]);
    let (n, fds) = loop {
        let mut iov = [IoSliceMut::new(&mut buf)];
        match socket::recvmsg::<()>(fd, &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC) {
            Ok(msg) => {
                let mut fds = Vec::new();
                for c in msg.cmsgs()? {
                    if let ControlMessageOwned::ScmRights(v) = c {
                        // SAFETY: the kernel just installed these fds for us.
                        fds.extend(v.into_iter().map(|f| unsafe { OwnedFd::from_raw_fd(f) }));
                    }
                }
                break (msg.bytes, fds);
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e),
        }
    };
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    buf.truncate(n);
    Ok(Some((buf, fds)))
}

/// The pool behind a unix socket.
pub struct PoolServer {
    path: PathBuf,
    pool: Arc<Pool>,
    stop: Arc<AtomicBool>,
    wake: Arc<EventFd>,
    conns: Arc<Mutex<HashMap<u64, Arc<OwnedFd>>>>,
    threads: Vec<JoinHandle<()>>,
    conn_threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl std::fmt::Debug for PoolServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolServer")
            .field("path", &self.path)
            .finish()
    }
}

impl PoolServer {
    /// Binds `path` (replacing a stale socket file) and serves `pool` on background threads,
    /// including the idle pre-zeroer.
    pub fn start(path: impl AsRef<Path>, pool: Arc<Pool>) -> Result<PoolServer, Error> {
        Self::start_with(path, pool, true)
    }

    /// As `start`; `idle_prezero = false` leaves pre-zeroing to explicit `prezero_now`
    /// calls (benchmarks that need a fixed starting state).
    pub fn start_with(
        path: impl AsRef<Path>,
        pool: Arc<Pool>,
        idle_prezero: bool,
    ) -> Result<PoolServer, Error> {
        let path = path.as_ref().to_path_buf();
        let serr = |source: std::io::Error| Error::Socket {
            path: path.display().to_string(),
            source,
        };
        let listener = socket::socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(|e| serr(e.into()))?;
        if let Ok(meta) = std::fs::symlink_metadata(&path) {
            use std::os::unix::fs::FileTypeExt;
            if meta.file_type().is_socket() {
                let _ = std::fs::remove_file(&path);
            }
        }
        let addr = UnixAddr::new(&path).map_err(|e| serr(e.into()))?;
        socket::bind(listener.as_raw_fd(), &addr).map_err(|e| serr(e.into()))?;
        // Pool memory holds other tenants' bytes: only this user may connect.
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                .map_err(serr)?;
        }
        let backlog = Backlog::new(256).map_err(|e| serr(e.into()))?;
        socket::listen(&listener, backlog).map_err(|e| serr(e.into()))?;
        let wake = Arc::new(EventFd::new().map_err(serr)?);
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(HashMap::new()));
        let conn_threads = Arc::new(Mutex::new(Vec::new()));

        let mut threads = Vec::new();
        {
            let (pool, stop, wake, conns, conn_threads, p) = (
                pool.clone(),
                stop.clone(),
                wake.clone(),
                conns.clone(),
                conn_threads.clone(),
                path.clone(),
            );
            threads.push(
                std::thread::Builder::new()
                    .name("pool-accept".into())
                    .spawn(move || {
                        accept_loop(listener, &p, pool, stop, &wake, conns, conn_threads)
                    })
                    .map_err(serr)?,
            );
        }
        if idle_prezero {
            let (pool, stop) = (pool.clone(), stop.clone());
            threads.push(
                std::thread::Builder::new()
                    .name("pool-prezero".into())
                    .spawn(move || pool.idle_prezero_loop(&stop))
                    .map_err(serr)?,
            );
        }
        Ok(PoolServer {
            path,
            pool,
            stop,
            wake,
            conns,
            threads,
            conn_threads,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Number of connected clients.
    pub fn clients(&self) -> usize {
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Stops serving: closes every connection (their memfds come back), joins the threads
    /// and removes the socket file.
    pub fn shutdown(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.wake.signal();
        self.pool.idle_wake.notify_all();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
        for c in self
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            let _ = socket::shutdown(c.as_raw_fd(), socket::Shutdown::Both);
        }
        let hs: Vec<_> = self
            .conn_threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        for h in hs {
            let _ = h.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for PoolServer {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.stop_all();
        }
    }
}

fn accept_loop(
    listener: OwnedFd,
    path: &Path,
    pool: Arc<Pool>,
    stop: Arc<AtomicBool>,
    wake: &EventFd,
    conns: Arc<Mutex<HashMap<u64, Arc<OwnedFd>>>>,
    conn_threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
) {
    let mut next_id = 0u64;
    while !stop.load(Ordering::Acquire) {
        match sys::poll_readable(&[listener.as_fd(), wake.fd()], -1) {
            Ok(r) if r[0] => {}
            Ok(_) => continue,
            Err(e) => {
                tracing::error!("pool {}: poll: {e}", path.display());
                return;
            }
        }
        if stop.load(Ordering::Acquire) {
            return;
        }
        let fd = match socket::accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC) {
            // SAFETY: accept4 returned a new fd that we now own.
            Ok(fd) => Arc::new(unsafe { OwnedFd::from_raw_fd(fd) }),
            Err(e) => {
                tracing::warn!("pool {}: accept: {e}", path.display());
                continue;
            }
        };
        if !peer_trusted(&fd) {
            tracing::warn!("pool {}: refused a client of another user", path.display());
            continue;
        }
        next_id += 1;
        let id = next_id;
        conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, fd.clone());
        let (pool, conns2, p, stop2) = (
            pool.clone(),
            conns.clone(),
            path.to_path_buf(),
            stop.clone(),
        );
        let h = std::thread::Builder::new()
            .name(format!("pool-conn-{id}"))
            .spawn(move || {
                serve_conn(&fd, &p, &pool, &stop2);
                conns2.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
            });
        match h {
            Ok(h) => {
                let mut ts = conn_threads.lock().unwrap_or_else(|p| p.into_inner());
                ts.retain(|t| !t.is_finished());
                ts.push(h);
            }
            Err(e) => {
                tracing::error!("pool {}: spawn connection thread: {e}", path.display());
                conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
            }
        }
    }
}

/// Only root or this process's own user may take pool memory.
fn peer_trusted(fd: &OwnedFd) -> bool {
    match socket::getsockopt(fd, socket::sockopt::PeerCredentials) {
        Ok(cred) => {
            // SAFETY: geteuid has no preconditions.
            let me = unsafe { libc::geteuid() };
            cred.uid() == 0 || cred.uid() == me
        }
        Err(_) => false,
    }
}

/// Serves one client until it disconnects, then gives back everything it took.
fn serve_conn(fd: &OwnedFd, path: &Path, pool: &Pool, stop: &AtomicBool) {
    let mut lent: Vec<Lent> = Vec::new();
    loop {
        let msg = match recv_msg(fd.as_raw_fd()) {
            Ok(Some((body, _fds))) => body,
            Ok(None) => break,
            Err(e) => {
                tracing::debug!("pool {}: client gone: {e}", path.display());
                break;
            }
        };
        let mut pass = None;
        let resp = match serde_json::from_slice::<Request>(&msg) {
            Err(e) => Response {
                error: Some(format!("bad request: {e}")),
                ..Default::default()
            },
            Ok(req) => match handle(pool, req) {
                Ok((resp, l)) => {
                    if let Some(l) = l {
                        pass = Some(l);
                    }
                    resp
                }
                Err(e) => Response {
                    error: Some(e.to_string()),
                    ..Default::default()
                },
            },
        };
        let body = serde_json::to_vec(&resp).unwrap_or_else(|_| b"{\"ok\":false}".to_vec());
        let sent = send_msg(
            fd.as_raw_fd(),
            &body,
            pass.as_ref().map(|l: &Lent| l.memfd().as_raw_fd()),
        );
        if let Some(l) = pass {
            // Counted as lent even if sending failed: it comes back below either way.
            lent.push(l);
        }
        if let Err(e) = sent {
            tracing::debug!("pool {}: send to client: {e}", path.display());
            break;
        }
    }
    // The server stopping is not the client going away: its VMM may still run on that
    // memory, so it must not be marked dirty (nor reused). Only drop our reference.
    let server_stopping = stop.load(Ordering::Acquire);
    for l in lent {
        if server_stopping {
            pool.forget(l);
        } else {
            pool.give_back(l);
        }
    }
}

fn handle(pool: &Pool, req: Request) -> Result<(Response, Option<Lent>), Error> {
    let ok = Response {
        ok: true,
        ..Default::default()
    };
    match req {
        Request::Take {
            size,
            hugepages,
            policy,
        } => {
            let policy: MemoryPolicy = policy.parse().map_err(|e: crate::Error| Error::BadArg {
                arg: "policy".into(),
                reason: e.to_string(),
            })?;
            let lent = pool.take(SizeClass { size, hugepages }, policy)?;
            let resp = Response {
                memfd_size: Some(lent.class().memfd_size()),
                recycled: Some(lent.recycled),
                ..ok
            };
            Ok((resp, Some(lent)))
        }
        Request::Stats => Ok((
            Response {
                stats: Some(pool.stats()),
                ..ok
            },
            None,
        )),
        Request::Shrink {
            count,
            percent,
            to_bytes,
        } => {
            let released = match (count, percent, to_bytes) {
                (Some(n), None, None) => pool.shrink_count(n),
                (None, Some(p), None) if p <= 100 => pool.shrink_percent(p),
                (None, None, Some(b)) => pool.shrink_to(b),
                _ => {
                    return Err(Error::BadArg {
                        arg: "shrink".into(),
                        reason: "give exactly one of count, percent (0-100), to_bytes".into(),
                    })
                }
            };
            Ok((
                Response {
                    released: Some(released),
                    ..ok
                },
                None,
            ))
        }
        Request::Fill {
            size,
            hugepages,
            count,
            pattern,
        } => {
            pool.fill(SizeClass { size, hugepages }, count, pattern)?;
            Ok((ok, None))
        }
        Request::Prezero { percent } => {
            if percent > 100 {
                return Err(Error::BadArg {
                    arg: "percent".into(),
                    reason: format!("{percent} > 100"),
                });
            }
            pool.prezero_now(percent)?;
            Ok((ok, None))
        }
    }
}

/// A VMM's connection to a pool server. Memfds taken through it go back to the pool when it
/// is dropped (or the process dies), so keep it until the memory is unmapped.
#[derive(Debug)]
pub struct PoolClient {
    sock: Mutex<OwnedFd>,
    path: PathBuf,
}

impl PoolClient {
    pub fn connect(path: impl AsRef<Path>) -> Result<PoolClient, Error> {
        let path = path.as_ref().to_path_buf();
        let serr = |source: std::io::Error| Error::Socket {
            path: path.display().to_string(),
            source,
        };
        let sock = socket::socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(|e| serr(e.into()))?;
        let addr = UnixAddr::new(&path).map_err(|e| serr(e.into()))?;
        socket::connect(sock.as_raw_fd(), &addr).map_err(|e| serr(e.into()))?;
        Ok(PoolClient {
            sock: Mutex::new(sock),
            path,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn call(&self, req: &Request) -> Result<(Response, Vec<OwnedFd>), Error> {
        let p = || self.path.display().to_string();
        let sock = self.sock.lock().unwrap_or_else(|p| p.into_inner());
        let body = serde_json::to_vec(req).map_err(|e| Error::Protocol {
            path: p(),
            reason: e.to_string(),
        })?;
        send_msg(sock.as_raw_fd(), &body, None).map_err(|e| Error::Socket {
            path: p(),
            source: e.into(),
        })?;
        let (body, fds) = recv_msg(sock.as_raw_fd())
            .map_err(|e| Error::Socket {
                path: p(),
                source: e.into(),
            })?
            .ok_or_else(|| Error::Protocol {
                path: p(),
                reason: "server closed the connection".into(),
            })?;
        let resp: Response = serde_json::from_slice(&body).map_err(|e| Error::Protocol {
            path: p(),
            reason: format!("bad response: {e}"),
        })?;
        if !resp.ok {
            return Err(Error::Refused {
                path: p(),
                reason: resp.error.unwrap_or_else(|| "no reason given".into()),
            });
        }
        Ok((resp, fds))
    }

    /// Takes a memfd of `size` guest bytes (plus table) for a region under `policy`.
    pub fn take(&self, size: u64, hugepages: bool, policy: MemoryPolicy) -> Result<OwnedFd, Error> {
        self.take_memfd(size, hugepages, policy).map(|(fd, _)| fd)
    }

    /// As `take`; also says whether the memfd was recycled (resident, dirty) or newly
    /// created by the server (sparse: the kernel allocates and zeroes it when populated).
    pub fn take_memfd(
        &self,
        size: u64,
        hugepages: bool,
        policy: MemoryPolicy,
    ) -> Result<(OwnedFd, bool), Error> {
        if policy == MemoryPolicy::Vanilla {
            return Err(Error::VanillaFromPool);
        }
        let (resp, mut fds) = self.call(&Request::Take {
            size,
            hugepages,
            policy: policy.to_string(),
        })?;
        let expect = SizeClass { size, hugepages }.memfd_size();
        if fds.len() != 1 || resp.memfd_size != Some(expect) {
            return Err(Error::Protocol {
                path: self.path.display().to_string(),
                reason: format!(
                    "take answered {} fds and memfd_size {:?}, expected 1 and {expect}",
                    fds.len(),
                    resp.memfd_size
                ),
            });
        }
        Ok((fds.remove(0), resp.recycled.unwrap_or(false)))
    }

    pub fn stats(&self) -> Result<PoolStats, Error> {
        let (resp, _) = self.call(&Request::Stats)?;
        resp.stats.ok_or_else(|| Error::Protocol {
            path: self.path.display().to_string(),
            reason: "stats response without stats".into(),
        })
    }

    pub fn shrink_count(&self, count: u64) -> Result<u64, Error> {
        self.shrink(Some(count), None, None)
    }

    pub fn shrink_percent(&self, percent: u8) -> Result<u64, Error> {
        self.shrink(None, Some(percent), None)
    }

    pub fn shrink_to(&self, bytes: u64) -> Result<u64, Error> {
        self.shrink(None, None, Some(bytes))
    }

    fn shrink(
        &self,
        count: Option<u64>,
        percent: Option<u8>,
        to_bytes: Option<u64>,
    ) -> Result<u64, Error> {
        let (resp, _) = self.call(&Request::Shrink {
            count,
            percent,
            to_bytes,
        })?;
        Ok(resp.released.unwrap_or(0))
    }

    /// Asks the server to add `count` resident memfds (with `pattern`: dirty ones).
    pub fn fill(
        &self,
        size: u64,
        hugepages: bool,
        count: u64,
        pattern: Option<u8>,
    ) -> Result<(), Error> {
        self.call(&Request::Fill {
            size,
            hugepages,
            count,
            pattern,
        })
        .map(|_| ())
    }

    /// Asks the server to pre-zero `percent`% of every cached memfd now.
    pub fn prezero(&self, percent: u8) -> Result<(), Error> {
        self.call(&Request::Prezero { percent }).map(|_| ())
    }
}

// ---------------------------------------------------------------------------------------
// `burstvm pool`

/// `burstvm pool --socket PATH [--max SIZE] [--prezero P] [--fill SIZE:COUNT]...` runs a
/// server; with `--stats` / `--shrink-*` it queries a running one instead.
#[derive(Debug, Clone, clap::Args)]
pub struct PoolArgs {
    /// Unix socket to serve on (VMMs use it as --pool-socket).
    #[arg(long)]
    pub socket: PathBuf,
    /// Shrink automatically when more than this many bytes are cached (e.g. 8G).
    #[arg(long)]
    pub max: Option<String>,
    /// Keep this share (0-100) of every cached memfd zeroed ahead of time, at idle priority.
    #[arg(long, default_value_t = 0)]
    pub prezero: u8,
    /// Pre-fill the pool with COUNT resident memfds of SIZE guest bytes (e.g. 64M:10).
    #[arg(long, value_name = "SIZE:COUNT")]
    pub fill: Vec<String>,
    /// Write this byte into every --fill memfd and mark it dirty, as if a previous tenant
    /// had used it (e.g. 0xA5; for canary tests). Default: kernel-zeroed, marked zero.
    #[arg(long, value_name = "BYTE", value_parser = parse_byte)]
    pub fill_pattern: Option<u8>,
    /// Use 2 MiB hugetlb pages for --fill.
    #[arg(long)]
    pub hugepages: bool,
    /// Client mode: print the running server's stats (JSON) and exit.
    #[arg(long)]
    pub stats: bool,
    /// Client mode: release N cached memfds of the running server.
    #[arg(long, value_name = "N")]
    pub shrink_count: Option<u64>,
    /// Client mode: release that percentage of the cached memfds.
    #[arg(long, value_name = "P")]
    pub shrink_percent: Option<u8>,
    /// Client mode: release cached memfds until at most SIZE bytes are cached.
    #[arg(long, value_name = "SIZE")]
    pub shrink_to: Option<String>,
}

/// `burstvm pool --stats/--shrink-*`: talks to a running server.
fn run_client(a: &PoolArgs) -> Result<(), Error> {
    let c = PoolClient::connect(&a.socket)?;
    let released = match (a.shrink_count, a.shrink_percent, &a.shrink_to) {
        (Some(n), None, None) => Some(c.shrink_count(n)?),
        (None, Some(p), None) => Some(c.shrink_percent(p)?),
        (None, None, Some(s)) => {
            Some(c.shrink_to(crate::parse_size(s).map_err(|e| Error::BadArg {
                arg: "--shrink-to".into(),
                reason: e.to_string(),
            })?)?)
        }
        (None, None, None) => None,
        _ => {
            return Err(Error::BadArg {
                arg: "--shrink-*".into(),
                reason: "give only one of --shrink-count, --shrink-percent, --shrink-to".into(),
            })
        }
    };
    if let Some(n) = released {
        println!("released {n} memfds");
    }
    if a.stats {
        let st = c.stats()?;
        println!(
            "{}",
            serde_json::to_string_pretty(&st).unwrap_or_else(|e| e.to_string())
        );
    }
    Ok(())
}

fn parse_byte(s: &str) -> Result<u8, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u8::from_str_radix(h, 16),
        None => s.parse::<u8>(),
    };
    r.map_err(|_| format!("{s:?} is not a byte (0-255 or 0x00-0xff)"))
}

pub fn run_cli(a: &PoolArgs) -> Result<(), Error> {
    use nix::sys::signal::{SigSet, Signal};
    if a.stats || a.shrink_count.is_some() || a.shrink_percent.is_some() || a.shrink_to.is_some() {
        return run_client(a);
    }
    let max = a
        .max
        .as_deref()
        .map(crate::parse_size)
        .transpose()
        .map_err(|e| Error::BadArg {
            arg: "--max".into(),
            reason: e.to_string(),
        })?;
    if a.prezero > 100 {
        return Err(Error::BadArg {
            arg: "--prezero".into(),
            reason: format!("{} > 100", a.prezero),
        });
    }
    let mut fills = Vec::new();
    for f in &a.fill {
        let bad = |reason: String| Error::BadArg {
            arg: format!("--fill {f}"),
            reason,
        };
        let (s, c) = f
            .split_once(':')
            .ok_or_else(|| bad("expected SIZE:COUNT".into()))?;
        let size = crate::parse_size(s).map_err(|e| bad(e.to_string()))?;
        let count: u64 = c.parse().map_err(|_| bad("COUNT is not a number".into()))?;
        fills.push((size, count));
    }
    // Block the stop signals before any thread exists so only sigwait below sees them.
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.thread_block()
        .map_err(|e| Error::Signal(format!("block SIGINT/SIGTERM: {e}")))?;
    let pool = Arc::new(Pool::new(max));
    pool.set_prezero_percent(a.prezero);
    for (size, count) in fills {
        pool.fill(
            SizeClass {
                size,
                hugepages: a.hugepages,
            },
            count,
            a.fill_pattern,
        )?;
    }
    let server = PoolServer::start(&a.socket, pool)?;
    eprintln!("burstvm pool: serving on {}", a.socket.display());
    let sig = set
        .wait()
        .map_err(|e| Error::Signal(format!("sigwait: {e}")))?;
    let stats = server.pool().stats();
    server.shutdown();
    eprintln!(
        "burstvm pool: {sig:?}, stopped ({} memfds, {} bytes cached)",
        stats.cached_memfds, stats.cached_bytes
    );
    Ok(())
}
