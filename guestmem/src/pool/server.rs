//! The pool behind a unix socket: a few workers on one epoll set serve every client
//! connection (no thread per client: a thread's start and end cost more here than a
//! sandbox's requests, and an idle sandbox should cost no thread), and the idle
//! pre-zeroer. What a connection took comes back when its client closes it and no device
//! maps it any more (`lease`); the server never closes a client's connection itself.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::socket::{self, Backlog, SockFlag};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::lease::{LeaseKey, Leases};
use super::protocol::{recv_msg, send_msg, seqpacket, socket_err, Request, Response};
use super::{Error, Pool, SizeClass};
use crate::sys;
use crate::MemoryPolicy;

/// Worker threads: each waits on the one epoll set and serves one ready connection
/// at a time. A request is short (a take, a registration, stats) or bounded work on the
/// pool (fill, prezero, a fresh memfd's pinning): four let a few run at once on any host
/// without a thread per client.
const WORKERS: usize = 4;
/// Epoll keys of the listener and the stop eventfd; connections count up from 1.
const LISTENER: u64 = u64::MAX;
const WAKE: u64 = u64::MAX - 1;

/// The pool behind a unix socket.
pub struct PoolServer {
    path: PathBuf,
    pool: Arc<Pool>,
    shared: Arc<Shared>,
    wake: Arc<EventFd>,
    threads: Vec<JoinHandle<()>>,
    /// `<socket>.lock` beside the socket: one server per socket. Dropped
    /// after `stop_all` removed the socket.
    _lock: procutil::DirLock,
}

/// What the workers share.
struct Shared {
    path: PathBuf,
    epoll: Epoll,
    listener: OwnedFd,
    leases: Arc<Leases>,
    stop: AtomicBool,
    /// Open connections by epoll key.
    conns: Mutex<HashMap<u64, Arc<OwnedFd>>>,
    next_id: AtomicU64,
    /// CPU (ns) the workers have run so far.
    cpu: CpuMeter,
}

/// Takes `<socket>.lock` in the socket's directory (`procutil::DirLock`).
fn lock_socket(path: &Path) -> Result<procutil::DirLock, Error> {
    let dir = path.parent().unwrap_or(Path::new(""));
    let name = format!(
        "{}.lock",
        path.file_name().unwrap_or_default().to_string_lossy()
    );
    procutil::DirLock::acquire(dir, &name).map_err(|source| Error::Owned {
        path: path.display().to_string(),
        source: Box::new(source),
    })
}

impl std::fmt::Debug for PoolServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolServer")
            .field("path", &self.path)
            .finish()
    }
}

impl PoolServer {
    /// Takes the lock `<path>.lock` (refused while another server holds
    /// it: `Error::Owned` names its pid), binds `path` (replacing a stale
    /// socket file) and serves `pool` on background threads,
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
        let serr = socket_err(&path);
        // Before the socket file is touched: a second server leaves the first's alone.
        let lock = lock_socket(&path)?;
        if let Ok(meta) = std::fs::symlink_metadata(&path) {
            use std::os::unix::fs::FileTypeExt;
            if meta.file_type().is_socket() {
                let _ = std::fs::remove_file(&path);
            }
        }
        let (listener, addr) = seqpacket(&path)?;
        socket::bind(listener.as_raw_fd(), &addr).map_err(|e| serr(e.into()))?;
        // Pool memory holds other tenants' bytes: only this user may connect.
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                .map_err(&serr)?;
        }
        let backlog = Backlog::new(256).map_err(|e| serr(e.into()))?;
        socket::listen(&listener, backlog).map_err(|e| serr(e.into()))?;
        fcntl(listener.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK))
            .map_err(|e| serr(e.into()))?;
        let wake = Arc::new(sys::wake_fd().map_err(&serr)?);
        let epoll = Epoll::new().map_err(&serr)?;
        epoll
            .ctl(
                ControlOperation::Add,
                listener.as_raw_fd(),
                EpollEvent::new(EventSet::IN | EventSet::ONE_SHOT, LISTENER),
            )
            .map_err(&serr)?;
        // Level-triggered, never read: once signalled, every worker sees it.
        epoll
            .ctl(
                ControlOperation::Add,
                wake.as_raw_fd(),
                EpollEvent::new(EventSet::IN, WAKE),
            )
            .map_err(&serr)?;
        let shared = Arc::new(Shared {
            path: path.clone(),
            epoll,
            listener,
            leases: Arc::new(Leases::new(pool.clone())),
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            cpu: CpuMeter::default(),
        });
        let mut server = PoolServer {
            path,
            pool: pool.clone(),
            shared: shared.clone(),
            wake,
            threads: Vec::new(),
            _lock: lock,
        };
        for i in 0..WORKERS {
            let sh = shared.clone();
            let w = std::thread::Builder::new()
                .name(format!("pool-serve-{i}"))
                .spawn(move || sh.worker())
                .map_err(&serr);
            match w {
                Ok(h) => server.threads.push(h),
                // Dropping the server stops the workers started so far.
                Err(e) => return Err(e),
            }
        }
        if idle_prezero {
            let (pool, sh) = (pool, shared);
            let h = std::thread::Builder::new()
                .name("pool-prezero".into())
                .spawn(move || pool.idle_prezero_loop(&sh.stop))
                .map_err(&serr)?;
            server.threads.push(h);
        }
        Ok(server)
    }

    /// CPU (ns) the server's worker threads have run so far, up to each
    /// one's last accept or request: per start, a bench divides its growth
    /// over a burst by the sandboxes (`runtime::cpuacct`). The idle
    /// pre-zeroer's is not in it: idle-time work, reported apart.
    pub fn cpu_ns(&self) -> u64 {
        self.shared.cpu.total()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Device registrations currently held (`PoolClient::register`), over all leases.
    pub fn registrations(&self) -> usize {
        self.shared.leases.registrations()
    }

    /// Number of connected clients.
    pub fn clients(&self) -> usize {
        self.shared.conns().len()
    }

    /// Stops serving: closes every connection (their memfds come back), joins the threads
    /// and removes the socket file.
    pub fn shutdown(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        sys::signal(&self.wake);
        self.pool.idle_wake.notify_all();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
        // The server stopping is not a client going away: its VMM may still run on that
        // memory, so it must not be marked dirty (nor reused). Only our references go.
        let left: Vec<u64> = self.shared.conns().drain().map(|(id, _)| id).collect();
        for id in left {
            self.shared.leases.conn_closed(id, true);
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for PoolServer {
    fn drop(&mut self) {
        if !self.shared.stop.load(Ordering::Acquire) {
            self.stop_all();
        }
    }
}

/// The CPU the server's threads ran: each adds its own clock's growth after
/// every accept or request it served (a clock read, no file), and at its end.
#[derive(Debug, Default)]
struct CpuMeter(AtomicU64);

impl CpuMeter {
    fn total(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// Adds what the calling thread ran since `*last` (its clock), and moves `*last`.
    fn add_since(&self, last: &mut u64) {
        let now = procutil::schedstat::this_thread_ns();
        self.0
            .fetch_add(now.saturating_sub(*last), Ordering::Relaxed);
        *last = now;
    }
}

/// What a served connection waits for next.
enum Next {
    /// Its next request.
    Request,
    /// Only its end: it stopped reading replies (one was dropped), so it is
    /// not served any more; its leases stay its own until it goes away.
    End,
    /// It went away.
    Gone,
}

impl Shared {
    fn conns(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<OwnedFd>>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits on the epoll set and serves what is ready, one event at a time
    /// (one-shot: a connection is served by one worker at once).
    fn worker(&self) {
        let mut clock = 0;
        let mut events = [EpollEvent::default(); 1];
        loop {
            self.cpu.add_since(&mut clock);
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            match self.epoll.wait(-1, &mut events) {
                Ok(1) => {}
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("pool {}: epoll: {e}", self.path.display());
                    return;
                }
            }
            match events[0].data() {
                WAKE => {}
                LISTENER => self.accept_all(),
                id => {
                    let set = events[0].event_set();
                    // A bug in a request's handling ends that client's service, not the
                    // worker. What it holds stays lent (never reused) until the server
                    // stops: where the panic left the leases is unknown.
                    let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        self.serve(id, set)
                    }));
                    if served.is_err() {
                        tracing::error!(
                            "pool {}: serving client {id} panicked; its connection is closed and \
                             its memory stays lent until the server stops",
                            self.path.display()
                        );
                        self.conns().remove(&id);
                    }
                }
            }
        }
    }

    /// Accepts every pending client, then waits for the next.
    fn accept_all(&self) {
        loop {
            match socket::accept4(
                self.listener.as_raw_fd(),
                SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            ) {
                // SAFETY: accept4 returned a new fd that we now own.
                Ok(fd) => self.add(unsafe { OwnedFd::from_raw_fd(fd) }),
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(nix::errno::Errno::EINTR | nix::errno::Errno::ECONNABORTED) => {}
                // Out of fds and the like: the next try may succeed; not in a hot loop.
                Err(e) => {
                    tracing::warn!("pool {}: accept: {e}", self.path.display());
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    break;
                }
            }
        }
        self.arm(self.listener.as_raw_fd(), LISTENER, EventSet::IN);
    }

    fn add(&self, fd: OwnedFd) {
        if !peer_trusted(&fd) {
            tracing::warn!(
                "pool {}: refused a client of another user",
                self.path.display()
            );
            return;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let raw = fd.as_raw_fd();
        // In the table before its first event can reach another worker.
        self.conns().insert(id, Arc::new(fd));
        let ev = EpollEvent::new(EventSet::IN | EventSet::ONE_SHOT, id);
        if let Err(e) = self.epoll.ctl(ControlOperation::Add, raw, ev) {
            tracing::error!("pool {}: epoll add: {e}", self.path.display());
            // Never served: it took nothing.
            self.conns().remove(&id);
        }
    }

    /// Re-arms one-shot interest in `set` (plus hang-ups, always reported).
    fn arm(&self, fd: RawFd, key: u64, set: EventSet) {
        let ev = EpollEvent::new(set | EventSet::ONE_SHOT, key);
        if let Err(e) = self.epoll.ctl(ControlOperation::Modify, fd, ev) {
            tracing::error!("pool {}: epoll re-arm: {e}", self.path.display());
        }
    }

    /// Serves connection `id`, which epoll reported ready with `set`.
    fn serve(&self, id: u64, set: EventSet) {
        let Some(fd) = self.conns().get(&id).cloned() else {
            return;
        };
        let next = if set.contains(EventSet::IN) {
            self.serve_request(&fd, id)
        } else if set.intersects(EventSet::HANG_UP | EventSet::READ_HANG_UP | EventSet::ERROR) {
            Next::Gone
        } else {
            Next::Request
        };
        match next {
            Next::Request => self.arm(fd.as_raw_fd(), id, EventSet::IN),
            Next::End => self.arm(fd.as_raw_fd(), id, EventSet::READ_HANG_UP),
            Next::Gone => {
                // The client went away (its process's mappings are gone):
                // what it took comes back (`lease`), before it leaves the
                // table (`clients()` == 0 means all is back).
                self.leases.conn_closed(id, false);
                // Closed here: epoll forgets it, nothing else holds it.
                self.conns().remove(&id);
                drop(fd);
            }
        }
    }

    /// Receives, handles and answers one request of connection `conn`.
    fn serve_request(&self, fd: &OwnedFd, conn: u64) -> Next {
        let msg = match recv_msg(fd.as_raw_fd()) {
            Ok(Some((body, _fds))) => body,
            Ok(None) => return Next::Gone,
            // Readiness without a message: a signal, or another wake-up.
            Err(nix::errno::Errno::EAGAIN) => return Next::Request,
            Err(e) => {
                tracing::debug!("pool {}: client gone: {e}", self.path.display());
                return Next::Gone;
            }
        };
        let (resp, pass) = match serde_json::from_slice::<Request>(&msg) {
            Err(e) => (
                Response {
                    error: Some(format!("bad request: {e}")),
                    ..Default::default()
                },
                None,
            ),
            Ok(req) => match handle(&self.leases, conn, req) {
                Ok(r) => r,
                Err(e) => (
                    Response {
                        error: Some(e.to_string()),
                        ..Default::default()
                    },
                    None,
                ),
            },
        };
        let body = serde_json::to_vec(&resp).unwrap_or_else(|_| b"{\"ok\":false}".to_vec());
        // A lease whose fd could not be sent is still this connection's: it comes back when
        // the connection closes.
        match send_msg(fd.as_raw_fd(), &body, pass.as_ref().map(|f| f.as_raw_fd())) {
            Ok(()) => Next::Request,
            // Its replies fill its socket: it sends without reading. A worker
            // does not wait for it; closing it here would not end its mappings.
            Err(nix::errno::Errno::EAGAIN) => {
                tracing::warn!(
                    "pool {}: a client stopped reading its replies; it is not served any more",
                    self.path.display()
                );
                Next::End
            }
            Err(e) => {
                tracing::debug!("pool {}: send to client: {e}", self.path.display());
                Next::Gone
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

/// One request of connection `conn`; a `take` answers with the lease fd to pass.
fn handle(leases: &Leases, conn: u64, req: Request) -> Result<(Response, Option<OwnedFd>), Error> {
    let pool = leases.pool();
    let ok = Response {
        ok: true,
        ..Default::default()
    };
    match req {
        Request::Take {
            size,
            hugepages,
            policy,
            page_use,
        } => {
            let policy: MemoryPolicy = policy.parse().map_err(|e| Error::BadPolicy {
                source: Box::new(e),
            })?;
            let lent = pool.take(SizeClass { size, hugepages }, policy)?;
            let resp = Response {
                memfd_size: Some(lent.class().memfd_size()),
                recycled: Some(lent.recycled),
                pinned: Some(lent.pinned()),
                ..ok
            };
            Ok((resp, Some(leases.lend(conn, lent, page_use)?)))
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
        Request::Register { dev, ino, lease } => {
            let pinned = leases.register(conn, LeaseKey { dev, ino, lease })?;
            Ok((
                Response {
                    pinned: Some(pinned),
                    ..ok
                },
                None,
            ))
        }
    }
}
