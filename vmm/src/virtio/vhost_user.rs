//! vhost-user-net frontend: the guest's virtio-net rings are served by a VF
//! of `burstvm nic` straight from guest memory. The VMM only sets the device
//! up: the ioeventfds become the vring kicks and the irqfd the vring call,
//! so data never passes through this process.
//!
//! `vf-open` (connect, features, SET_MEM_TABLE of the dma regions) runs
//! inside `new` for `VfInit::Sync`, on the device's monitor thread for
//! `VfInit::Async` (FastIOV §4.2.2). DRIVER_OK hands the vrings to the NIC —
//! inline in sync mode, so the vCPU waits, on the monitor thread in async
//! mode — and then sets LINK_UP and raises a config interrupt.
//!
//! The monitor thread also keeps the session alive, as QEMU and Cloud
//! Hypervisor do for vhost-user-net: when the NIC daemon goes away (crash,
//! upgrade) it reconnects to the VF socket with backoff until a deadline and
//! restores the session — features, memory table, and for a running driver
//! the vrings with their base taken from the used index in guest memory (a
//! dead backend cannot answer GET_VRING_BASE), the kick, call and err
//! eventfds. The vCPU never waits for that: DRIVER_OK or a reset during a
//! reconnect only change the driver state the monitor restores. What cannot
//! be restored is reported on stderr (naming the socket and the cause), as a
//! `vf-lost` trace entry, and to the guest as DEVICE_NEEDS_RESET.
//!
//! A guest reset (status 0) stops the backend's rings (RESET_DEVICE, a
//! VF-level reset, or GET_VRING_BASE) and keeps the session, so the next
//! DRIVER_OK works on the same VF. A VF the NIC puts into `error` signals its
//! err eventfd: the device then reports DEVICE_NEEDS_RESET with a config
//! interrupt.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use trace::{monotonic_ns, Stage, TraceWriter};
use vhost::vhost_user::message::{
    VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_CONFIG;
use virtio_bindings::virtio_net::VIRTIO_NET_S_LINK_UP;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::net::{net_config, read_config_bytes, NET_FEATURES};
use super::{Interrupt, VirtioDevice, VirtioError, QUEUE_MAX_SIZE};
use crate::bus::{DeviceContext, VfInit};

/// A NIC that does not answer within this time is treated as failed.
const SOCKET_TIMEOUT: Duration = Duration::from_secs(60);
/// Reconnect backoff: first pause, doubled up to the cap.
const BACKOFF_FIRST: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_millis(500);
/// A new backend that refuses the restored rings this many times in a row is given up.
const MAX_RESTORE_FAILURES: u32 = 3;

/// An open vhost-user session.
struct Session {
    frontend: Frontend,
    backend_features: u64,
    protocol: bool,
    /// VHOST_USER_PROTOCOL_F_RESET_DEVICE negotiated: a guest reset is a VF reset.
    reset_device: bool,
}

/// What the guest driver set up at DRIVER_OK (until its reset).
struct DriverState {
    features: u64,
    queues: Vec<Queue>,
    /// The rings were handed to some backend before: their positions are in guest memory.
    started_once: bool,
}

/// The session and the driver state, shared by the vCPU and the monitor thread. Only the
/// monitor drops a session (it polls its socket); the vCPU marks it `broken` instead.
#[derive(Default)]
struct Conn {
    session: Option<Session>,
    /// The rings of `driver` are with the backend of `session`.
    started: bool,
    /// A request on `session` failed: the monitor reconnects.
    broken: bool,
    driver: Option<DriverState>,
    /// Why the backend is gone for good (not restored within the deadline, or refused).
    lost: Option<String>,
}

/// Everything about one VF device; shared with the monitor thread.
struct Vf {
    socket: PathBuf,
    sandbox: String,
    regions: Vec<VhostUserMemoryRegionInfo>,
    /// Keeps the memfds in `regions` open; prepares ring pages before we read them.
    guestmem: Arc<guestmem::GuestMemory>,
    /// Device view of guest memory: the used indexes a reconnect restarts from.
    mem: GuestMemoryMmap,
    kicks: Vec<EventFd>,
    call: EventFd,
    /// One err eventfd per ring (VHOST_USER_SET_VRING_ERR): the NIC put the VF in error.
    errs: Vec<EventFd>,
    /// Wakes the monitor (an async DRIVER_OK, a broken session, stopping).
    wake: EventFd,
    stopping: AtomicBool,
    reconnect: Duration,
    mode: VfInit,
    trace: Arc<TraceWriter>,
    interrupt: Arc<Interrupt>,
    link: AtomicU16,
    generation: AtomicU32,
    failed: AtomicBool,
    conn: Mutex<Conn>,
}

fn vu_err(socket: &Path, what: &'static str, reason: impl ToString) -> VirtioError {
    VirtioError::VhostUser {
        socket: socket.display().to_string(),
        what,
        reason: reason.to_string(),
    }
}

fn borrow(e: &EventFd) -> BorrowedFd<'_> {
    // SAFETY: the eventfd lives as long as `e`, which the borrow ties to.
    unsafe { BorrowedFd::borrow_raw(e.as_raw_fd()) }
}

impl Vf {
    fn lock(&self) -> MutexGuard<'_, Conn> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn err(&self, what: &'static str, reason: impl ToString) -> VirtioError {
        vu_err(&self.socket, what, reason)
    }

    /// A line on stderr that names the sandbox and the VF socket (the runtime reads it).
    fn report(&self, msg: &str) {
        eprintln!(
            "sandbox {}: VF socket {}: {msg}",
            self.sandbox,
            self.socket.display()
        );
    }

    /// `vf-open` (the first time): connect, SET_OWNER, features, SET_MEM_TABLE (acked, so
    /// the NIC's mapping of guest memory is inside the stage).
    fn open(&self, first: bool) -> Result<Session, VirtioError> {
        let start = monotonic_ns();
        let stream = UnixStream::connect(&self.socket).map_err(|e| self.err("connect", e))?;
        stream
            .set_read_timeout(Some(SOCKET_TIMEOUT))
            .and_then(|_| stream.set_write_timeout(Some(SOCKET_TIMEOUT)))
            .map_err(|e| self.err("socket timeout", e))?;
        let mut frontend = Frontend::from_stream(stream, 2);
        frontend.set_owner().map_err(|e| self.err("SET_OWNER", e))?;
        let backend_features = frontend
            .get_features()
            .map_err(|e| self.err("GET_FEATURES", e))?;
        if backend_features & (1 << VIRTIO_F_VERSION_1) == 0 {
            return Err(self.err("GET_FEATURES", "backend lacks VIRTIO_F_VERSION_1"));
        }
        let protocol = backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0;
        // Features are final only at DRIVER_OK; until then VERSION_1 (and
        // the protocol-features bit) lets the NIC interpret our messages.
        let early = (1 << VIRTIO_F_VERSION_1)
            | (backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits());
        frontend
            .set_features(early)
            .map_err(|e| self.err("SET_FEATURES", e))?;
        let mut reset_device = false;
        if protocol {
            let theirs = frontend
                .get_protocol_features()
                .map_err(|e| self.err("GET_PROTOCOL_FEATURES", e))?;
            let ours = theirs
                & (VhostUserProtocolFeatures::REPLY_ACK | VhostUserProtocolFeatures::RESET_DEVICE);
            frontend
                .set_protocol_features(ours)
                .map_err(|e| self.err("SET_PROTOCOL_FEATURES", e))?;
            if ours.contains(VhostUserProtocolFeatures::REPLY_ACK) {
                frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
            }
            reset_device = ours.contains(VhostUserProtocolFeatures::RESET_DEVICE);
        }
        frontend
            .set_mem_table(&self.regions)
            .map_err(|e| self.err("SET_MEM_TABLE", e))?;
        if first {
            if let Err(e) = self.trace.record(Stage::VfOpen, start, monotonic_ns()) {
                tracing::warn!("vhost-user {}: trace: {e}", self.socket.display());
            }
        }
        Ok(Session {
            frontend,
            backend_features,
            protocol,
            reset_device,
        })
    }

    /// The address the NIC knows `gpa` by: the userspace address we gave
    /// for its region in SET_MEM_TABLE (vhost-user vring addresses are
    /// frontend virtual addresses).
    fn host_addr(&self, gpa: u64, what: &'static str) -> Result<u64, VirtioError> {
        self.regions
            .iter()
            .find(|r| gpa >= r.guest_phys_addr && gpa - r.guest_phys_addr < r.memory_size)
            .map(|r| r.userspace_addr + (gpa - r.guest_phys_addr))
            .ok_or_else(|| self.err(what, format!("{gpa:#x} is not in a dma region")))
    }

    fn ring_config(&self, q: &Queue) -> Result<VringConfigData, VirtioError> {
        Ok(VringConfigData {
            queue_max_size: q.max_size(),
            queue_size: q.size(),
            flags: 0,
            desc_table_addr: self.host_addr(q.desc_table(), "descriptor table")?,
            used_ring_addr: self.host_addr(q.used_ring(), "used ring")?,
            avail_ring_addr: self.host_addr(q.avail_ring(), "avail ring")?,
            log_addr: None,
        })
    }

    /// Where each ring of `d` restarts: 0 for a fresh driver; after a reconnect the used
    /// index in guest memory (what the old backend completed; what it had taken but not
    /// completed is taken again).
    fn ring_bases(&self, d: &DriverState) -> Result<Vec<u16>, VirtioError> {
        if !d.started_once {
            return Ok(vec![0; d.queues.len()]);
        }
        d.queues
            .iter()
            .map(|q| {
                // Ring pages the guest never touched are zeroed first (lazy memory).
                for gpa in [q.used_ring(), q.avail_ring()] {
                    self.guestmem
                        .prepare_for_device_write(gpa, 4)
                        .map_err(|e| self.err("used index", e))?;
                }
                q.used_idx(&self.mem, Ordering::Acquire)
                    .map(|w| w.0)
                    .map_err(|e| self.err("used index", e))
            })
            .collect()
    }

    /// Hands the rings of `d` to the backend of `s`, starting at `bases`.
    fn start(&self, s: &mut Session, d: &DriverState, bases: &[u16]) -> Result<(), VirtioError> {
        let f = &mut s.frontend;
        let mut acked = d.features & s.backend_features;
        acked |= s.backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        f.set_features(acked)
            .map_err(|e| self.err("SET_FEATURES", e))?;
        for (i, q) in d.queues.iter().enumerate() {
            let cfg = self.ring_config(q)?;
            f.set_vring_num(i, q.size())
                .map_err(|e| self.err("SET_VRING_NUM", e))?;
            f.set_vring_addr(i, &cfg)
                .map_err(|e| self.err("SET_VRING_ADDR", e))?;
            f.set_vring_base(i, bases[i])
                .map_err(|e| self.err("SET_VRING_BASE", e))?;
            f.set_vring_call(i, &self.call)
                .map_err(|e| self.err("SET_VRING_CALL", e))?;
            f.set_vring_err(i, &self.errs[i])
                .map_err(|e| self.err("SET_VRING_ERR", e))?;
            f.set_vring_kick(i, &self.kicks[i])
                .map_err(|e| self.err("SET_VRING_KICK", e))?;
            if s.protocol {
                f.set_vring_enable(i, true)
                    .map_err(|e| self.err("SET_VRING_ENABLE", e))?;
            }
        }
        Ok(())
    }

    /// Stops the backend using the rings (guest reset): a VF reset when negotiated, else
    /// GET_VRING_BASE on each ring.
    fn stop(&self, s: &mut Session, rings: usize) -> Result<(), VirtioError> {
        if s.reset_device {
            return s
                .frontend
                .reset_device()
                .map_err(|e| self.err("RESET_DEVICE", e));
        }
        for i in 0..rings {
            s.frontend
                .get_vring_base(i)
                .map_err(|e| self.err("GET_VRING_BASE", e))?;
        }
        Ok(())
    }

    /// Starts the driver's rings on the current session if that is still to be done.
    /// A failure of the connection leaves the session to the monitor (reconnect).
    fn apply(&self, c: &mut Conn) -> Result<(), VirtioError> {
        let Conn {
            session: Some(s),
            started: started @ false,
            broken: false,
            driver: Some(d),
            ..
        } = c
        else {
            return Ok(());
        };
        let bases = match self.ring_bases(d) {
            Ok(b) => b,
            Err(e) => {
                self.fail();
                return Err(e);
            }
        };
        if let Err(e) = self.start(s, d, &bases) {
            c.broken = true;
            let _ = self.wake.write(1);
            return Err(e);
        }
        *started = true;
        d.started_once = true;
        self.set_link(true);
        Ok(())
    }

    fn set_link(&self, up: bool) {
        self.link.store(
            if up { VIRTIO_NET_S_LINK_UP as u16 } else { 0 },
            Ordering::SeqCst,
        );
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.interrupt.signal(VIRTIO_MMIO_INT_CONFIG);
    }

    /// DEVICE_NEEDS_RESET plus a config interrupt.
    fn fail(&self) {
        self.failed.store(true, Ordering::SeqCst);
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.interrupt.signal(VIRTIO_MMIO_INT_CONFIG);
    }

    /// The backend is gone for good: said loudly, traced, and the guest told.
    fn lose(&self, since_ns: u64, cause: String) {
        self.report(&format!("backend lost, not restored: {cause}"));
        tracing::error!("VF {}: {cause}", self.socket.display());
        if let Err(e) = self.trace.record(Stage::VfLost, since_ns, monotonic_ns()) {
            tracing::warn!("vhost-user {}: trace: {e}", self.socket.display());
        }
        self.lock().lost = Some(cause);
        self.link.store(0, Ordering::SeqCst);
        self.fail();
    }

    /// Sleeps `d` unless woken (stop, a vCPU request).
    fn pause(&self, d: Duration) {
        let mut fds = [PollFd::new(borrow(&self.wake), PollFlags::POLLIN)];
        let ms =
            PollTimeout::try_from(d.as_millis().min(60_000) as i32).unwrap_or(PollTimeout::MAX);
        let _ = poll(&mut fds, ms);
        let _ = self.wake.read();
    }

    /// The monitor thread: the async `vf-open`, async DRIVER_OK, the NIC's error reports,
    /// and reconnects when the backend goes away.
    fn monitor(self: Arc<Self>) {
        if self.mode == VfInit::Async {
            match self.open(true) {
                Ok(s) => {
                    let mut c = self.lock();
                    c.session = Some(s);
                    if let Err(e) = self.apply(&mut c) {
                        tracing::warn!("{e}");
                    }
                }
                Err(e) => self.lose(monotonic_ns(), format!("vf-open failed: {e}")),
            }
        }
        while !self.stopping.load(Ordering::SeqCst) {
            let (sock, broken) = {
                let c = self.lock();
                let sock = c.session.as_ref().map(|s| s.frontend.as_raw_fd());
                (sock, c.broken)
            };
            if broken {
                self.reconnect("a request to the backend failed");
                continue;
            }
            let mut fds = vec![PollFd::new(borrow(&self.wake), PollFlags::POLLIN)];
            fds.extend(
                self.errs
                    .iter()
                    .map(|e| PollFd::new(borrow(e), PollFlags::POLLIN)),
            );
            // SAFETY: only this thread drops the session, so the fd stays open while polled.
            let sock_fd = sock.map(|fd| unsafe { BorrowedFd::borrow_raw(fd) });
            if let Some(fd) = sock_fd {
                // Only the peer's close (not our own replies arriving) wakes us; nix lacks
                // the flag.
                fds.push(PollFd::new(
                    fd,
                    PollFlags::from_bits_retain(libc::POLLRDHUP),
                ));
            }
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(nix::Error::EINTR) => {}
                Err(e) => {
                    tracing::error!("VF {}: monitor poll: {e}", self.socket.display());
                    return;
                }
            }
            // nix answers None for bits it does not know (POLLRDHUP): something happened.
            let ready = |p: &PollFd| p.revents().is_none_or(|r| !r.is_empty());
            let woke = ready(&fds[0]);
            let errored = fds[1..1 + self.errs.len()].iter().any(ready);
            let hup = sock_fd.is_some() && ready(&fds[fds.len() - 1]);
            drop(fds);
            if woke {
                let _ = self.wake.read();
                let mut c = self.lock();
                if let Err(e) = self.apply(&mut c) {
                    tracing::warn!("{e}");
                }
            }
            if errored {
                for e in &self.errs {
                    let _ = e.read();
                }
                let running = self.lock().started;
                if running {
                    self.report(
                        "the NIC put the VF in error (malformed descriptors?); device needs reset",
                    );
                    self.fail();
                }
            }
            if hup {
                self.reconnect("backend disconnected");
            }
        }
    }

    /// The backend is gone: reconnect with backoff until the deadline, then restore the
    /// session (and the running rings). Never holds the lock while waiting for a backend.
    fn reconnect(&self, why: &str) {
        let since = monotonic_ns();
        let t0 = Instant::now();
        {
            let mut c = self.lock();
            c.session = None;
            c.started = false;
            c.broken = false;
        }
        self.set_link(false);
        if self.reconnect.is_zero() {
            self.lose(
                since,
                format!("{why}; reconnecting is disabled (--vf-reconnect 0)"),
            );
            return;
        }
        self.report(&format!(
            "{why}; reconnecting for up to {} s",
            self.reconnect.as_secs_f64()
        ));
        let mut backoff = BACKOFF_FIRST;
        let mut last = String::from("none yet");
        let mut refused = 0;
        loop {
            if self.stopping.load(Ordering::SeqCst) {
                return;
            }
            if t0.elapsed() >= self.reconnect {
                let cause = format!(
                    "{why}, no backend within {} s (last error: {last})",
                    self.reconnect.as_secs_f64()
                );
                self.lose(since, cause);
                return;
            }
            match self
                .open(false)
                .map_err(Restore::Retry)
                .and_then(|s| self.restore(s))
            {
                Ok(what) => {
                    if let Err(e) = self.trace.record(Stage::VfReconnect, since, monotonic_ns()) {
                        tracing::warn!("vhost-user {}: trace: {e}", self.socket.display());
                    }
                    self.report(&format!(
                        "backend reconnected after {} ms; restored {what}",
                        t0.elapsed().as_millis()
                    ));
                    return;
                }
                Err(Restore::Retry(e)) => last = e.to_string(),
                Err(Restore::Refused(e)) => {
                    refused += 1;
                    last = e.to_string();
                    if refused >= MAX_RESTORE_FAILURES {
                        self.lose(since, format!("{why}; the new backend refuses it: {last}"));
                        return;
                    }
                }
                Err(Restore::Impossible(cause)) => {
                    self.lose(since, format!("{why}; {cause}"));
                    return;
                }
            }
            self.pause(backoff);
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// Puts a new session in place and, for a running driver, gives it the rings where
    /// the old backend left them. Returns what was restored, for the report.
    fn restore(&self, mut s: Session) -> Result<String, Restore> {
        let mut c = self.lock();
        let Some(d) = c.driver.as_ref() else {
            c.session = Some(s);
            return Ok("features and memory table (no driver running)".into());
        };
        let missing = d.features & !s.backend_features & NET_FEATURES;
        if missing != 0 {
            return Err(Restore::Impossible(format!(
                "the new backend lacks negotiated features {missing:#x}"
            )));
        }
        let bases = self
            .ring_bases(d)
            .map_err(|e| Restore::Impossible(e.to_string()))?;
        let avail: Vec<u16> = d
            .queues
            .iter()
            .map(|q| q.avail_idx(&self.mem, Ordering::Acquire).map_or(0, |w| w.0))
            .collect();
        self.start(&mut s, d, &bases).map_err(Restore::Refused)?;
        c.session = Some(s);
        c.started = true;
        if let Some(d) = c.driver.as_mut() {
            d.started_once = true;
        }
        drop(c);
        // Kicks and interrupts the old backend may have swallowed.
        for k in &self.kicks {
            let _ = k.write(1);
        }
        let _ = self.call.write(1);
        self.set_link(true);
        let rings = bases
            .iter()
            .zip(&avail)
            .enumerate()
            .map(|(i, (b, a))| {
                format!(
                    "ring {i} at used index {b} ({} buffers pending)",
                    a.wrapping_sub(*b)
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        Ok(format!(
            "features, memory table, kick/call/err eventfds, {rings}; buffers the old \
             backend had taken but not completed are processed again"
        ))
    }
}

/// Why a restore attempt failed.
enum Restore {
    /// Connecting or negotiating failed: try again.
    Retry(VirtioError),
    /// The new backend refused the restored rings.
    Refused(VirtioError),
    /// Cannot work with any backend of this kind.
    Impossible(String),
}

pub struct VhostUserNet {
    mac: [u8; 6],
    vf: Arc<Vf>,
    monitor: Option<JoinHandle<()>>,
}

impl VhostUserNet {
    pub fn new(
        socket: &Path,
        mac: [u8; 6],
        ctx: &DeviceContext,
        kicks: Vec<EventFd>,
        interrupt: Arc<Interrupt>,
    ) -> Result<Self, VirtioError> {
        // Only DMA regions are shared with the NIC (design.md "Variants").
        let regions: Vec<VhostUserMemoryRegionInfo> = ctx
            .guestmem
            .regions()
            .iter()
            .filter(|r| r.dma())
            .map(|r| VhostUserMemoryRegionInfo {
                guest_phys_addr: r.gpa(),
                memory_size: r.size(),
                userspace_addr: r.device_view_ptr() as u64,
                mmap_offset: r.mmap_offset(),
                mmap_handle: r.memfd().as_raw_fd(),
            })
            .collect();
        if regions.is_empty() {
            return Err(vu_err(
                socket,
                "SET_MEM_TABLE",
                "no dma region to share with the NIC (a VF needs --dma-ram true)",
            ));
        }
        let call = interrupt
            .irqfd()
            .try_clone()
            .map_err(|e| vu_err(socket, "dup irqfd", e))?;
        let mk = || EventFd::new(EFD_NONBLOCK).map_err(|e| vu_err(socket, "eventfd", e));
        let errs = kicks.iter().map(|_| mk()).collect::<Result<Vec<_>, _>>()?;
        let vf = Arc::new(Vf {
            socket: socket.to_path_buf(),
            sandbox: ctx.trace.sandbox().to_string(),
            regions,
            guestmem: ctx.guestmem.clone(),
            mem: ctx.mem.clone(),
            kicks,
            call,
            errs,
            wake: mk()?,
            stopping: AtomicBool::new(false),
            reconnect: ctx.vf_reconnect,
            mode: ctx.vf_init,
            trace: ctx.trace.clone(),
            interrupt,
            link: AtomicU16::new(0),
            generation: AtomicU32::new(0),
            failed: AtomicBool::new(false),
            conn: Mutex::new(Conn::default()),
        });
        if ctx.vf_init == VfInit::Sync {
            let s = vf.open(true)?;
            vf.lock().session = Some(s);
        }
        let vf2 = vf.clone();
        let monitor = std::thread::Builder::new()
            .name("vhost-user-vf".into())
            .spawn(move || vf2.monitor())
            .map_err(|e| vu_err(socket, "spawn monitor thread", e))?;
        Ok(VhostUserNet {
            mac,
            vf,
            monitor: Some(monitor),
        })
    }
}

impl VirtioDevice for VhostUserNet {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }
    fn features(&self) -> u64 {
        NET_FEATURES
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_MAX_SIZE, QUEUE_MAX_SIZE]
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(
            &net_config(&self.mac, self.vf.link.load(Ordering::SeqCst)),
            offset,
            data,
        )
    }
    fn config_generation(&self) -> u32 {
        self.vf.generation.load(Ordering::SeqCst)
    }
    fn needs_reset(&self) -> bool {
        self.vf.failed.load(Ordering::SeqCst)
    }
    fn used_irq_bypasses_status(&self) -> bool {
        true
    }
    fn activate(&mut self, features: u64, queues: Vec<Queue>) -> Result<(), VirtioError> {
        let mut c = self.vf.lock();
        if let Some(cause) = &c.lost {
            return Err(self.vf.err("DRIVER_OK", format!("backend lost: {cause}")));
        }
        for (i, q) in queues.iter().enumerate() {
            if !q.ready() {
                return Err(self
                    .vf
                    .err("SET_VRING_ADDR", format!("queue {i} not ready")));
            }
            self.vf.ring_config(q)?;
        }
        c.driver = Some(DriverState {
            features,
            queues,
            started_once: false,
        });
        match self.vf.mode {
            // The vCPU waits for the NIC to have the rings (unless it is reconnecting:
            // then the monitor hands them over once it is back).
            VfInit::Sync => {
                if let Err(e) = self.vf.apply(&mut c) {
                    tracing::warn!("{e}; reconnecting");
                }
            }
            VfInit::Async => {
                let _ = self.vf.wake.write(1);
            }
        }
        Ok(())
    }
    fn reset(&mut self) {
        let mut c = self.vf.lock();
        let rings = c.driver.take().map_or(0, |d| d.queues.len());
        if c.started {
            c.started = false;
            if let Some(s) = c.session.as_mut() {
                // The NIC stops using guest memory before the reset completes.
                if let Err(e) = self.vf.stop(s, rings) {
                    tracing::warn!("{e}; reconnecting");
                    c.broken = true;
                    let _ = self.vf.wake.write(1);
                }
            }
        }
        self.vf.link.store(0, Ordering::SeqCst);
        // A reset clears what the backend reported (the VF reset took it out of error);
        // a lost backend stays lost.
        self.vf.failed.store(c.lost.is_some(), Ordering::SeqCst);
    }
}

impl Drop for VhostUserNet {
    fn drop(&mut self) {
        self.vf.stopping.store(true, Ordering::SeqCst);
        let _ = self.vf.wake.write(1);
        if let Some(t) = self.monitor.take() {
            let _ = t.join();
        }
    }
}
