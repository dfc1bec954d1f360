//! The pool behind a unix socket: an accept thread, one thread per client connection, and
//! the idle pre-zeroer. What a connection took comes back when it closes and no device
//! maps it any more (`lease`).

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use nix::sys::socket::{self, Backlog, SockFlag};

use nix::poll::PollTimeout;
use vmm_sys_util::eventfd::EventFd;

use super::lease::{LeaseKey, Leases};
use super::protocol::{recv_msg, send_msg, seqpacket, socket_err, Request, Response};
use super::{Error, Pool, SizeClass};
use crate::sys;
use crate::MemoryPolicy;

/// The pool behind a unix socket.
pub struct PoolServer {
    path: PathBuf,
    pool: Arc<Pool>,
    leases: Arc<Leases>,
    stop: Arc<AtomicBool>,
    wake: Arc<EventFd>,
    conns: Arc<Mutex<HashMap<u64, Arc<OwnedFd>>>>,
    threads: Vec<JoinHandle<()>>,
    conn_threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
    /// CPU (ns) the accept and connection threads have run so far.
    cpu: Arc<CpuMeter>,
    /// `<socket>.lock` beside the socket: one server per socket. Dropped
    /// after `stop_all` removed the socket.
    _lock: procutil::DirLock,
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
        let wake = Arc::new(sys::wake_fd().map_err(&serr)?);
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(HashMap::new()));
        let conn_threads = Arc::new(Mutex::new(Vec::new()));
        let cpu = Arc::new(CpuMeter::default());

        let leases = Arc::new(Leases::new(pool.clone()));
        let mut threads = Vec::new();
        {
            let (leases, stop, wake, conns, conn_threads, p, cpu) = (
                leases.clone(),
                stop.clone(),
                wake.clone(),
                conns.clone(),
                conn_threads.clone(),
                path.clone(),
                cpu.clone(),
            );
            threads.push(
                std::thread::Builder::new()
                    .name("pool-accept".into())
                    .spawn(move || {
                        let threads = Threads {
                            conns,
                            conn_threads,
                            cpu,
                        };
                        accept_loop(listener, &p, leases, stop, &wake, threads)
                    })
                    .map_err(&serr)?,
            );
        }
        if idle_prezero {
            let (pool, stop) = (pool.clone(), stop.clone());
            threads.push(
                std::thread::Builder::new()
                    .name("pool-prezero".into())
                    .spawn(move || pool.idle_prezero_loop(&stop))
                    .map_err(&serr)?,
            );
        }
        Ok(PoolServer {
            path,
            pool,
            leases,
            stop,
            wake,
            conns,
            threads,
            conn_threads,
            cpu,
            _lock: lock,
        })
    }

    /// CPU (ns) the server's accept and connection threads have run so far,
    /// up to each one's last accept or request: per start, a bench divides
    /// its growth over a burst by the sandboxes (`runtime::cpuacct`). The
    /// idle pre-zeroer's is not in it: idle-time work, reported apart.
    pub fn cpu_ns(&self) -> u64 {
        self.cpu.total()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Device registrations currently held (`PoolClient::register`), over all leases.
    pub fn registrations(&self) -> usize {
        self.leases.registrations()
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
        sys::signal(&self.wake);
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

/// What the accept loop shares with the server: the connections, their
/// threads and the CPU meter.
struct Threads {
    conns: Arc<Mutex<HashMap<u64, Arc<OwnedFd>>>>,
    conn_threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
    cpu: Arc<CpuMeter>,
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

fn accept_loop(
    listener: OwnedFd,
    path: &Path,
    leases: Arc<Leases>,
    stop: Arc<AtomicBool>,
    wake: &EventFd,
    threads: Threads,
) {
    let Threads {
        conns,
        conn_threads,
        cpu,
    } = threads;
    let mut next_id = 0u64;
    let mut clock = 0;
    while !stop.load(Ordering::Acquire) {
        cpu.add_since(&mut clock);
        match sys::poll_readable(&[listener.as_fd(), sys::borrow(wake)], PollTimeout::NONE) {
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
        let (leases, conns2, p, stop2, cpu2) = (
            leases.clone(),
            conns.clone(),
            path.to_path_buf(),
            stop.clone(),
            cpu.clone(),
        );
        let h = std::thread::Builder::new()
            .name(format!("pool-conn-{id}"))
            .spawn(move || {
                serve_conn(&fd, id, &p, &leases, &stop2, &cpu2);
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

/// Serves one client until it disconnects, then ends its leases and registrations.
fn serve_conn(
    fd: &OwnedFd,
    conn: u64,
    path: &Path,
    leases: &Leases,
    stop: &AtomicBool,
    cpu: &CpuMeter,
) {
    let mut clock = 0;
    loop {
        cpu.add_since(&mut clock);
        let msg = match recv_msg(fd.as_raw_fd()) {
            Ok(Some((body, _fds))) => body,
            Ok(None) => break,
            Err(e) => {
                tracing::debug!("pool {}: client gone: {e}", path.display());
                break;
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
            Ok(req) => match handle(leases, conn, req) {
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
        // the connection closes, below.
        let sent = send_msg(fd.as_raw_fd(), &body, pass.as_ref().map(|f| f.as_raw_fd()));
        if let Err(e) = sent {
            tracing::debug!("pool {}: send to client: {e}", path.display());
            break;
        }
    }
    // The server stopping is not the client going away: its VMM may still run on that
    // memory, so it must not be marked dirty (nor reused). Only drop our reference.
    leases.conn_closed(conn, stop.load(Ordering::Acquire));
    cpu.add_since(&mut clock);
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
