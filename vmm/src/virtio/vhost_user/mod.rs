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
//!
//! The same frontend serves an SG function of the NIC (`--net sg:SOCKET`,
//! docs/sgiov.md): `VuKind::Sg` changes only what the guest sees — burstvm's
//! private device id, VERSION_1 only, no config space (no MAC, no link) — not
//! the session, the reconnect or the memory table.
//!
//! Files: `session.rs` (one vhost-user session: open, rings, stop), `monitor.rs` (the
//! monitor thread: async open, err eventfds, reconnect and restore); the device is here.

mod monitor;
mod session;

use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use trace::TraceWriter;
use vhost::vhost_user::Frontend;
use vhost::VhostUserMemoryRegionInfo;
use virtio_bindings::virtio_config::{VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_VERSION_1};
use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::net::{net_config, read_config_bytes, NET_FEATURES};
use super::{Interrupt, VirtioDevice, VirtioError, QUEUE_MAX_SIZE};
use crate::bus::DeviceContext;
use crate::devspec::VfInit;

/// A NIC that does not answer within this time is treated as failed.
const SOCKET_TIMEOUT: Duration = Duration::from_secs(60);
/// Reconnect backoff: first pause, doubled up to the cap.
const BACKOFF_FIRST: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_millis(500);
/// A new backend that refuses the restored rings this many times in a row is given up.
const MAX_RESTORE_FAILURES: u32 = 3;

/// What a vhost-user device is to the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VuKind {
    /// A VF: virtio-net with the VF's MAC and a link status.
    Net,
    /// An SG function: two queues (setup, signal), no config space.
    Sg,
}

impl VuKind {
    pub fn device_type(self) -> u32 {
        match self {
            VuKind::Net => VIRTIO_ID_NET,
            VuKind::Sg => sgiov::layout::VIRTIO_DEVICE_ID,
        }
    }

    pub fn features(self) -> u64 {
        match self {
            VuKind::Net => NET_FEATURES,
            VuKind::Sg => 1 << VIRTIO_F_VERSION_1,
        }
    }
}

/// An open vhost-user session.
struct Session {
    frontend: Frontend,
    backend_features: u64,
    protocol: bool,
    /// VHOST_USER_PROTOCOL_F_RESET_DEVICE negotiated: a guest reset is a VF reset.
    reset_device: bool,
    /// VHOST_USER_PROTOCOL_F_REPLY_ACK negotiated: set-up messages are acked.
    reply_ack: bool,
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
    kind: VuKind,
    /// Features the VMM offers on its own, never sent to the backend:
    /// VIRTIO_F_ACCESS_PLATFORM when the NIC maps only the DMA window.
    platform_features: u64,
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
    /// The guest MAC: `--mac`, or the VF's own, learned at `vf-open`.
    mac: MacSlot,
}

/// The MAC in the device's config space. Without `--mac` it is the VF's,
/// which the NIC reports in its config space (vhost-user GET_CONFIG) at
/// `vf-open`: a VF's MAC is the NIC's to choose, as with SR-IOV passthrough,
/// and any other source MAC is dropped by the NIC's spoof check.
struct MacSlot {
    given: Option<[u8; 6]>,
    learned: Mutex<Option<[u8; 6]>>,
    /// Signalled when the MAC is learned or the device failed.
    done: Condvar,
}

impl MacSlot {
    fn set(&self, mac: [u8; 6]) {
        *self.learned.lock().unwrap_or_else(|e| e.into_inner()) = Some(mac);
        self.done.notify_all();
    }

    /// The MAC the guest must use, if known yet.
    fn known(&self) -> Option<[u8; 6]> {
        self.given
            .or(*self.learned.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The MAC for the config space. A driver that reads it before an
    /// asynchronous `vf-open` learned it waits for it (bounded by the
    /// session's socket timeout); a failed open leaves it zero.
    fn get(&self, failed: &AtomicBool) -> [u8; 6] {
        if let Some(m) = self.given {
            return m;
        }
        let deadline = std::time::Instant::now() + SOCKET_TIMEOUT;
        let mut g = self.learned.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(m) = *g {
                return m;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if failed.load(Ordering::SeqCst) || left.is_zero() {
                return [0; 6];
            }
            g = self
                .done
                .wait_timeout(g, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Vf {
    /// The config space with `mac` (none for an SG function).
    fn config(&self, mac: [u8; 6], offset: u64, data: &mut [u8]) {
        match self.kind {
            VuKind::Sg => data.fill(0),
            VuKind::Net => read_config_bytes(
                &net_config(&mac, self.link.load(Ordering::SeqCst)),
                offset,
                data,
            ),
        }
    }
}

/// What a register page republishes at a config interrupt (link, failure).
/// The builder gives a VF a page only when its MAC is known from the start
/// (`--mac`, or a sync `vf-open`), so the view never waits for it.
impl crate::virtio::DeviceView for Vf {
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        self.config(self.mac.known().unwrap_or_default(), offset, data)
    }
    fn needs_reset(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }
}

fn vu_err(
    socket: &Path,
    what: &'static str,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> VirtioError {
    VirtioError::VhostUser {
        socket: socket.display().to_string(),
        what,
        source: source.into(),
    }
}

fn borrow(e: &EventFd) -> BorrowedFd<'_> {
    // SAFETY: the eventfd lives as long as `e`, which the borrow ties to.
    unsafe { BorrowedFd::borrow_raw(e.as_raw_fd()) }
}

pub struct VhostUserNet {
    vf: Arc<Vf>,
    monitor: Option<JoinHandle<()>>,
}

impl VhostUserNet {
    /// `mac`: the guest MAC from `--mac`; `None` takes the VF's from the NIC (ignored for
    /// an SG function).
    pub fn new(
        kind: VuKind,
        socket: &Path,
        mac: Option<[u8; 6]>,
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
                "no dma region to share with the NIC (a VF needs --dma-ram true or --dma-window)",
            ));
        }
        let call = interrupt
            .irqfd()
            .try_clone()
            .map_err(|e| vu_err(socket, "dup irqfd", e))?;
        let mk = || EventFd::new(EFD_NONBLOCK).map_err(|e| vu_err(socket, "eventfd", e));
        let errs = kicks.iter().map(|_| mk()).collect::<Result<Vec<_>, _>>()?;
        // The window is the only memory the device reaches: the driver must
        // use platform DMA (a Linux guest's restricted swiotlb pool in the
        // window). The NIC still sees guest-physical addresses there.
        let platform_features = if ctx.dma_window && kind == VuKind::Net {
            1 << VIRTIO_F_ACCESS_PLATFORM
        } else {
            0
        };
        let vf = Arc::new(Vf {
            kind,
            platform_features,
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
            mac: MacSlot {
                given: mac,
                learned: Mutex::new(None),
                done: Condvar::new(),
            },
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
            vf,
            monitor: Some(monitor),
        })
    }
}

impl VirtioDevice for VhostUserNet {
    fn device_type(&self) -> u32 {
        self.vf.kind.device_type()
    }
    fn features(&self) -> u64 {
        self.vf.kind.features() | self.vf.platform_features
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_MAX_SIZE, QUEUE_MAX_SIZE]
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // Only a read of the MAC bytes may have to wait for it.
        let mac = if offset < 6 && self.vf.kind == VuKind::Net {
            self.vf.mac.get(&self.vf.failed)
        } else {
            [0; 6]
        };
        self.vf.config(mac, offset, data)
    }
    fn view(&self) -> Option<Arc<dyn crate::virtio::DeviceView>> {
        Some(self.vf.clone())
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
        // The stop is acknowledged, so the NIC has signalled whatever error the old rings
        // had (it signals in the same VF-side critical section as it enters the error
        // state): those signals are about the rings this reset ends, not the next ones.
        self.vf.take_err_signals();
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
