//! vhost-user-net frontend: the guest's virtio-net rings are served by a VF
//! of `burstvm nic` straight from guest memory. The VMM only sets the device
//! up: the ioeventfds become the vring kicks and the irqfd the vring call,
//! so data never passes through this process.
//!
//! `vf-open` (connect, features, SET_MEM_TABLE of the dma regions) runs
//! inside `new` for `VfInit::Sync`, on a thread for `VfInit::Async`
//! (FastIOV §4.2.2). DRIVER_OK hands the vrings to the NIC — inline in sync
//! mode, so the vCPU waits, on that thread in async mode — and then sets
//! LINK_UP and raises a config interrupt.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

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
use vmm_sys_util::eventfd::EventFd;

use super::net::{net_config, read_config_bytes, NET_FEATURES};
use super::{Interrupt, VirtioDevice, VirtioError, QUEUE_MAX_SIZE};
use crate::bus::{DeviceContext, VfInit};

/// A NIC that does not answer within this time is treated as failed.
const SOCKET_TIMEOUT: Duration = Duration::from_secs(60);

/// What the frontend needs to open and start a VF; `Send`, for the thread.
struct VfLink {
    socket: PathBuf,
    regions: Vec<VhostUserMemoryRegionInfo>,
    /// Keeps the memfds in `regions` open.
    _guestmem: Arc<guestmem::GuestMemory>,
    kicks: Vec<EventFd>,
    call: EventFd,
    trace: Arc<TraceWriter>,
    interrupt: Arc<Interrupt>,
    link: Arc<AtomicU16>,
    generation: Arc<AtomicU32>,
    failed: Arc<AtomicBool>,
}

/// An open vhost-user session.
struct Session {
    frontend: Frontend,
    backend_features: u64,
    protocol: bool,
}

fn vu_err(socket: &Path, what: &'static str, reason: impl ToString) -> VirtioError {
    VirtioError::VhostUser {
        socket: socket.display().to_string(),
        what,
        reason: reason.to_string(),
    }
}

impl VfLink {
    /// `vf-open`: connect, SET_OWNER, features, SET_MEM_TABLE (acked, so the
    /// NIC's mapping of guest memory is inside the stage).
    fn open(&self) -> Result<Session, VirtioError> {
        let s = &self.socket;
        let start = monotonic_ns();
        let stream = UnixStream::connect(s).map_err(|e| vu_err(s, "connect", e))?;
        stream
            .set_read_timeout(Some(SOCKET_TIMEOUT))
            .and_then(|_| stream.set_write_timeout(Some(SOCKET_TIMEOUT)))
            .map_err(|e| vu_err(s, "socket timeout", e))?;
        let mut frontend = Frontend::from_stream(stream, 2);
        frontend
            .set_owner()
            .map_err(|e| vu_err(s, "SET_OWNER", e))?;
        let backend_features = frontend
            .get_features()
            .map_err(|e| vu_err(s, "GET_FEATURES", e))?;
        if backend_features & (1 << VIRTIO_F_VERSION_1) == 0 {
            return Err(vu_err(
                s,
                "GET_FEATURES",
                "backend lacks VIRTIO_F_VERSION_1",
            ));
        }
        let protocol = backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0;
        // Features are final only at DRIVER_OK; until then VERSION_1 (and
        // the protocol-features bit) lets the NIC interpret our messages.
        let early = (1 << VIRTIO_F_VERSION_1)
            | (backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits());
        frontend
            .set_features(early)
            .map_err(|e| vu_err(s, "SET_FEATURES", e))?;
        if protocol {
            let theirs = frontend
                .get_protocol_features()
                .map_err(|e| vu_err(s, "GET_PROTOCOL_FEATURES", e))?;
            let ours = theirs & VhostUserProtocolFeatures::REPLY_ACK;
            frontend
                .set_protocol_features(ours)
                .map_err(|e| vu_err(s, "SET_PROTOCOL_FEATURES", e))?;
            if ours.contains(VhostUserProtocolFeatures::REPLY_ACK) {
                frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
            }
        }
        frontend
            .set_mem_table(&self.regions)
            .map_err(|e| vu_err(s, "SET_MEM_TABLE", e))?;
        if let Err(e) = self.trace.record(Stage::VfOpen, start, monotonic_ns()) {
            tracing::warn!("vhost-user {}: trace: {e}", s.display());
        }
        Ok(Session {
            frontend,
            backend_features,
            protocol,
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
            .ok_or_else(|| {
                vu_err(
                    &self.socket,
                    what,
                    format!("{gpa:#x} is not in a dma region"),
                )
            })
    }

    /// DRIVER_OK: hand the vrings to the NIC, then report link up.
    fn start(
        &self,
        session: &mut Session,
        features: u64,
        queues: &[Queue],
    ) -> Result<(), VirtioError> {
        let s = &self.socket;
        let f = &mut session.frontend;
        let mut acked = features & session.backend_features;
        acked |= session.backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        f.set_features(acked)
            .map_err(|e| vu_err(s, "SET_FEATURES", e))?;
        for (i, q) in queues.iter().enumerate() {
            if !q.ready() {
                return Err(vu_err(s, "SET_VRING_ADDR", format!("queue {i} not ready")));
            }
            let cfg = VringConfigData {
                queue_max_size: q.max_size(),
                queue_size: q.size(),
                flags: 0,
                desc_table_addr: self.host_addr(q.desc_table(), "descriptor table")?,
                used_ring_addr: self.host_addr(q.used_ring(), "used ring")?,
                avail_ring_addr: self.host_addr(q.avail_ring(), "avail ring")?,
                log_addr: None,
            };
            f.set_vring_num(i, q.size())
                .map_err(|e| vu_err(s, "SET_VRING_NUM", e))?;
            f.set_vring_addr(i, &cfg)
                .map_err(|e| vu_err(s, "SET_VRING_ADDR", e))?;
            f.set_vring_base(i, 0)
                .map_err(|e| vu_err(s, "SET_VRING_BASE", e))?;
            f.set_vring_call(i, &self.call)
                .map_err(|e| vu_err(s, "SET_VRING_CALL", e))?;
            f.set_vring_kick(i, &self.kicks[i])
                .map_err(|e| vu_err(s, "SET_VRING_KICK", e))?;
            if session.protocol {
                f.set_vring_enable(i, true)
                    .map_err(|e| vu_err(s, "SET_VRING_ENABLE", e))?;
            }
        }
        // Kicks the guest wrote before the NIC listened are still pending in
        // the eventfds, so nothing is lost.
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

    fn fail(&self, e: &VirtioError) {
        tracing::error!("{e}");
        self.failed.store(true, Ordering::SeqCst);
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.interrupt.signal(VIRTIO_MMIO_INT_CONFIG);
    }
}

/// The DRIVER_OK request passed to the async thread.
struct Activation {
    features: u64,
    queues: Vec<Queue>,
}

enum Mode {
    /// The session was opened in `new`; DRIVER_OK runs inline.
    Sync(Option<Session>),
    /// `vf-open` and the vring setup run on `thread`.
    Async {
        tx: Option<mpsc::Sender<Activation>>,
        thread: Option<JoinHandle<Option<Session>>>,
    },
}

pub struct VhostUserNet {
    mac: [u8; 6],
    vf: Arc<VfLink>,
    mode: Mode,
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
        let vf = Arc::new(VfLink {
            socket: socket.to_path_buf(),
            regions,
            _guestmem: ctx.guestmem.clone(),
            kicks,
            call,
            trace: ctx.trace.clone(),
            interrupt,
            link: Arc::new(AtomicU16::new(0)),
            generation: Arc::new(AtomicU32::new(0)),
            failed: Arc::new(AtomicBool::new(false)),
        });
        let mode = match ctx.vf_init {
            VfInit::Sync => Mode::Sync(Some(vf.open()?)),
            VfInit::Async => {
                let (tx, rx) = mpsc::channel::<Activation>();
                let vf2 = vf.clone();
                let thread = std::thread::Builder::new()
                    .name("vf-open".into())
                    .spawn(move || {
                        let mut session = match vf2.open() {
                            Ok(s) => s,
                            Err(e) => {
                                vf2.fail(&e);
                                return None;
                            }
                        };
                        // Ends when the device is reset or dropped (sender gone).
                        if let Ok(a) = rx.recv() {
                            if let Err(e) = vf2.start(&mut session, a.features, &a.queues) {
                                vf2.fail(&e);
                            }
                        }
                        Some(session)
                    })
                    .map_err(|e| vu_err(socket, "spawn vf-open thread", e))?;
                Mode::Async {
                    tx: Some(tx),
                    thread: Some(thread),
                }
            }
        };
        Ok(VhostUserNet { mac, vf, mode })
    }

    fn stop_async(&mut self) -> Option<Session> {
        if let Mode::Async { tx, thread } = &mut self.mode {
            tx.take();
            return thread.take().and_then(|t| t.join().ok().flatten());
        }
        None
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
        match &mut self.mode {
            Mode::Sync(session) => {
                let session = session.as_mut().ok_or_else(|| {
                    vu_err(
                        &self.vf.socket,
                        "DRIVER_OK",
                        "session closed by an earlier reset",
                    )
                })?;
                self.vf.start(session, features, &queues)
            }
            Mode::Async { tx, .. } => {
                let tx = tx.as_ref().ok_or_else(|| {
                    vu_err(
                        &self.vf.socket,
                        "DRIVER_OK",
                        "session closed by an earlier reset",
                    )
                })?;
                tx.send(Activation { features, queues })
                    .map_err(|_| vu_err(&self.vf.socket, "DRIVER_OK", "vf-open failed"))
            }
        }
    }
    fn reset(&mut self) {
        // Tearing the session down stops the NIC using guest memory; a new
        // driver init after a reset is not supported over a VF (the guest
        // sees DEVICE_NEEDS_RESET at its next DRIVER_OK).
        let session = match &mut self.mode {
            Mode::Sync(s) => s.take(),
            Mode::Async { .. } => self.stop_async(),
        };
        drop(session);
        self.vf.link.store(0, Ordering::SeqCst);
    }
}

impl Drop for VhostUserNet {
    fn drop(&mut self) {
        self.stop_async();
    }
}
