//! virtio-vsock (virtio 1.2 §5.10, device id 19) in user space, with
//! Firecracker's hybrid host side: the only control channel between the
//! host (`burstvm run`, the shim) and a Linux guest's agent.
//!
//! The guest has CID 3 (`--vsock-cid`); the host is CID 2. Host side, the
//! VMM listens on one Unix socket per sandbox, `PATH` (`--vsock PATH`):
//! - a host process connects to `PATH` and writes `CONNECT <port>\n`; the
//!   device sends the guest a REQUEST to `<port>` from a host port it
//!   allocates (from 2^30 up); on the guest's RESPONSE it writes
//!   `OK <hostport>\n` and then bytes flow both ways. A RST (nothing
//!   listens in the guest) or no answer within the connect timeout (5 s)
//!   closes the host connection;
//! - a guest connection to host port P goes to the Unix socket `PATH_P`
//!   (RST when nothing listens there). No other path is ever connected.
//!
//! Three queues: RX (device → guest packets), TX (guest → device) and the
//! event queue (VIRTIO_VSOCK_EVENT_TRANSPORT_RESET after a re-activation,
//! so a guest whose driver was reset drops the connections the device
//! closed). Features: VIRTIO_F_VERSION_1 only; stream sockets only.
//!
//! One worker thread per running device (`worker.rs`), asleep in epoll on
//! the queues' ioeventfds, the listening socket, every connection's socket
//! and the stop eventfd; a reset or drop stops and joins it, which closes
//! every connection. Files: `packet.rs` (header, chain copies), `conn.rs`
//! (a connection and its credit), `muxer/` (the connection table and host
//! sockets; the guest's packets in `guest.rs`), `socket.rs` (Unix socket
//! plumbing), `worker.rs` (queues and the epoll loop), `driver.rs` (a model
//! of the driver side, for the tests and the fuzz target), `fuzz.rs`.
//!
//! The guest is untrusted (docs/vmm.md, "virtio-vsock"): a bad chain or
//! header is counted and dropped, a packet for no connection answered with
//! RST, a guest beyond its credit reset; at most [`MAX_CONNECTIONS`]
//! connections (refusals counted); host bytes are read only as far as the
//! guest's credit and RX buffers go, so a guest that never reads costs no
//! host memory and blocks no other connection.

mod conn;
#[doc(hidden)]
pub(crate) mod driver;
pub(crate) mod fuzz;
mod muxer;
mod packet;
mod socket;
#[cfg(test)]
mod tests;
mod worker;

pub use socket::SocketFile;

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::chain::PrepareWrite;
use super::net::read_config_bytes;
use super::worker::{Worker, WorkerError};
use super::{Interrupt, VirtioDevice, VirtioError, QUEUE_MAX_SIZE};

/// virtio device id of a socket device.
pub const VIRTIO_ID_VSOCK: u32 = 19;
pub const VSOCK_FEATURES: u64 = 1 << VIRTIO_F_VERSION_1;
/// The guest's CID unless `--vsock-cid` says otherwise.
pub const DEFAULT_GUEST_CID: u64 = 3;
/// Connections per device (host- and guest-initiated together); more are
/// refused. Fewer when the descriptor limit is low ([`connection_cap`]).
pub const MAX_CONNECTIONS: usize = 1024;
/// Descriptors [`connection_cap`] leaves to the rest of the VMM.
pub const FD_RESERVE: u64 = 256;
/// How long a host connection may take to send its CONNECT line, and the
/// guest to answer a REQUEST.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a closing connection waits for the guest's RST, or for its
/// last bytes to reach the host (Linux's VSOCK_CLOSE_TIMEOUT is 8 s).
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(8);

/// `PATH_<u32>` must fit `sockaddr_un.sun_path` (108 bytes with its NUL).
pub const MAX_PATH_LEN: usize = 107 - "_4294967295".len();

/// Why the device could not be set up; each names the socket path.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    #[error("vsock socket {path}: another process is listening on it")]
    InUse { path: PathBuf },
    #[error("vsock socket {path}: a file that is not a socket is in the way (not replaced)")]
    NotASocket { path: PathBuf },
    #[error("vsock socket {path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("vsock socket {path}: worker: {source}")]
    Worker {
        path: PathBuf,
        #[source]
        source: WorkerError,
    },
}

/// Bounds of one device (tests shorten them).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub connect_timeout: Duration,
    pub close_timeout: Duration,
}

/// [`MAX_CONNECTIONS`], or fewer when the process's descriptor limit
/// (RLIMIT_NOFILE) would not leave [`FD_RESERVE`] descriptors to the rest
/// of the VMM: each connection holds one, and a guest must not be able to
/// make the VMM run out.
pub fn connection_cap() -> usize {
    use nix::sys::resource::{getrlimit, Resource};
    let soft = getrlimit(Resource::RLIMIT_NOFILE).map_or(1024, |(soft, _)| soft);
    let room = soft.saturating_sub(FD_RESERVE).max(16);
    usize::try_from(room).map_or(MAX_CONNECTIONS, |r| r.min(MAX_CONNECTIONS))
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: connection_cap(),
            connect_timeout: CONNECT_TIMEOUT,
            close_timeout: CLOSE_TIMEOUT,
        }
    }
}

/// Per-device counters (tests and diagnostics). The hostile cases are
/// also logged: at warn on their 1st, 2nd, 4th, 8th, ... occurrence, at
/// debug otherwise, so that a flood cannot flood the log.
#[derive(Default, Debug)]
pub struct VsockCounters {
    pub tx_packets: AtomicU64,
    pub rx_packets: AtomicU64,
    pub events: AtomicU64,
    pub host_connections: AtomicU64,
    pub guest_connections: AtomicU64,
    /// Malformed chains: descriptors, directions, sizes, lengths.
    pub bad_chains: AtomicU64,
    /// Headers with a wrong CID, type or op.
    pub bad_headers: AtomicU64,
    /// Packets for no connection (answered with RST).
    pub unknown_connection: AtomicU64,
    /// Ops not valid in their connection's state (the connection is reset).
    pub protocol_errors: AtomicU64,
    /// Data beyond the credit the device advertised (the connection is reset).
    pub credit_violations: AtomicU64,
    /// Connections refused at [`MAX_CONNECTIONS`].
    pub refused: AtomicU64,
    /// Guest connections to a `PATH_<port>` nobody listens on.
    pub connect_failures: AtomicU64,
    /// Host connections whose first line was not `CONNECT <port>`.
    pub bad_connect_lines: AtomicU64,
    /// Host connections that sent no line, and REQUESTs the guest never answered.
    pub timeouts: AtomicU64,
    /// RSTs dropped because the guest posted no RX buffers for them.
    pub rst_dropped: AtomicU64,
}

impl VsockCounters {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

pub(crate) use crate::virtio::note;

/// Epoll tokens of the worker.
const TOKEN_RX: u64 = 0;
const TOKEN_TX: u64 = 1;
const TOKEN_EVENT: u64 = 2;
const TOKEN_LISTENER: u64 = 3;
/// Connection `i` has token `TOKEN_CONN + i`.
const TOKEN_CONN: u64 = 16;

pub struct Vsock {
    cid: u64,
    path: PathBuf,
    listener: Arc<UnixListener>,
    /// Removes `PATH` when the device goes (the builder holds a second guard).
    _file: SocketFile,
    mem: GuestMemoryMmap,
    prepare: Arc<PrepareWrite>,
    queue_evts: Vec<EventFd>,
    interrupt: Arc<Interrupt>,
    counters: Arc<VsockCounters>,
    limits: Limits,
    /// Activations so far: every one after the first starts with a TRANSPORT_RESET event.
    activations: u64,
    worker: Option<Worker>,
}

// The prepare hook is a closure and guest memory is large: Debug leaves them out.
impl std::fmt::Debug for Vsock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vsock")
            .field("cid", &self.cid)
            .field("path", &self.path)
            .field("counters", &self.counters)
            .field("limits", &self.limits)
            .field("activations", &self.activations)
            .field("worker", &self.worker.is_some())
            .finish_non_exhaustive()
    }
}

impl Vsock {
    /// A device for guest `cid` whose host side is `listener` (bound at
    /// `file`, by [`bind`]).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cid: u64,
        listener: UnixListener,
        file: SocketFile,
        mem: GuestMemoryMmap,
        prepare: Arc<PrepareWrite>,
        queue_evts: Vec<EventFd>,
        interrupt: Arc<Interrupt>,
        limits: Limits,
    ) -> Self {
        Vsock {
            cid,
            path: file.path().to_path_buf(),
            listener: Arc::new(listener),
            _file: file,
            mem,
            prepare,
            queue_evts,
            interrupt,
            counters: Arc::default(),
            limits,
            activations: 0,
            worker: None,
        }
    }

    pub fn counters(&self) -> &Arc<VsockCounters> {
        &self.counters
    }

    fn device(&self) -> String {
        format!("vsock {}", self.path.display())
    }
}

/// Binds the host side's listening socket at `path` (see `socket::bind`).
pub fn bind(path: &Path) -> Result<(UnixListener, SocketFile), VsockError> {
    socket::bind(path)
}

impl Drop for Vsock {
    fn drop(&mut self) {
        self.worker = None;
        tracing::debug!("{}: {:?}", self.device(), self.counters);
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }
    fn features(&self) -> u64 {
        VSOCK_FEATURES
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_MAX_SIZE, QUEUE_MAX_SIZE, QUEUE_MAX_SIZE]
    }
    /// `struct virtio_vsock_config { le64 guest_cid; }`, read-only.
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.cid.to_le_bytes(), offset, data)
    }
    fn activate(&mut self, features: u64, queues: Vec<Queue>) -> Result<(), VirtioError> {
        let device = self.device();
        if queues.len() != 3 || !queues[..2].iter().all(|q| q.ready()) {
            return Err(VirtioError::QueuesNotReady {
                device,
                need: "RX and TX queues",
            });
        }
        // Used rings the guest never touched must be zeroed before we write them.
        for q in queues.iter().filter(|q| q.ready()) {
            let len = 6 + 8 * q.size() as u64;
            (self.prepare)(q.used_ring(), len).map_err(|source| VirtioError::UsedRing {
                device: device.clone(),
                source,
            })?;
        }
        let evts = self
            .queue_evts
            .iter()
            .map(|e| e.try_clone())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| VirtioError::DupEventFd {
                device: device.clone(),
                source,
            })?;
        let mut q = queues.into_iter();
        let parts = worker::Parts {
            cid: self.cid,
            path: self.path.clone(),
            listener: self.listener.clone(),
            mem: self.mem.clone(),
            prepare: self.prepare.clone(),
            features,
            rx: q.next().expect("three queues"),
            tx: q.next().expect("three queues"),
            event: q.next().expect("three queues"),
            interrupt: self.interrupt.clone(),
            counters: self.counters.clone(),
            limits: self.limits,
            reset_event: self.activations > 0,
        };
        let mut fds: Vec<(i32, u64)> = evts
            .iter()
            .zip([TOKEN_RX, TOKEN_TX, TOKEN_EVENT])
            .map(|(e, t)| (e.as_raw_fd(), t))
            .collect();
        fds.push((self.listener.as_raw_fd(), TOKEN_LISTENER));
        let w = Worker::spawn("virtio-vsock".into(), &fds, move |epoll| {
            worker::Engine::new(parts, epoll).run(evts)
        })
        .map_err(|source| VsockError::Worker {
            path: self.path.clone(),
            source,
        })?;
        self.activations += 1;
        self.worker = Some(w);
        Ok(())
    }
    /// Status 0: the worker stops, every connection is closed (host
    /// sockets shut, nothing more to the guest).
    fn reset(&mut self) {
        self.worker = None;
    }
}
