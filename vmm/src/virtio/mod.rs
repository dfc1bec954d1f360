//! Virtio devices of the VMM: the virtio-mmio (version 2) transport,
//! virtio-net over a tap device, the vhost-user-net frontend (a VF of
//! `burstvm nic`), virtio-blk over a file (the rootfs layers) and
//! virtio-vsock (Firecracker's hybrid model: Unix sockets on the host) and
//! virtio-rng (Firecracker's entropy device).
//!
//! Queue notifications from the guest arrive on ioeventfds (one per queue,
//! registered at `mmio_base + 0x50` with the queue index as datamatch) and
//! interrupts go out through an irqfd on the device's GSI, so neither path
//! takes a VM exit to user space once the device is running.

pub mod blk;
mod chain;
pub(crate) mod mmio;
pub(crate) mod net;
pub mod rng;
mod vhost_user;
pub mod vsock;
mod worker;
pub use worker::WorkerError;

pub use mmio::page::{DeviceView, RegisterPage};
pub use mmio::MmioTransport;

/// Counts one hostile or failed case of a guest and logs it: at warn on its
/// 1st, 2nd, 4th, 8th, ... occurrence, at debug otherwise, so that a flood
/// cannot flood the log (the transport's and vsock's counters).
pub(crate) fn note(counter: &std::sync::atomic::AtomicU64, what: std::fmt::Arguments<'_>) {
    let n = counter.fetch_add(1, Ordering::Relaxed) + 1;
    if n.is_power_of_two() {
        tracing::warn!("{what} (occurrence {n})");
    } else {
        tracing::debug!("{what}");
    }
}

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use kvm_ioctls::{IoEventAddress, VmFd};
use virtio_queue::Queue;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::bus::{BusDevice, DeviceContext};
use crate::devspec::{DiskSpec, NetBackend, VsockSpec};

/// Size of one virtio-mmio device window.
pub const MMIO_SIZE: u64 = 0x1000;
/// Queue size the devices offer (the guest may choose a smaller power of two).
pub const QUEUE_MAX_SIZE: u16 = 256;

#[derive(Debug, thiserror::Error)]
pub enum VirtioError {
    #[error("tap device {name}: no guest MAC given")]
    TapNoMac { name: String },
    #[error("tap device {name}: {source}")]
    TapWorker {
        name: String,
        #[source]
        source: WorkerError,
    },
    #[error(transparent)]
    TapOpen(#[from] netutil::TapError),
    /// `source` is the vhost, I/O or protocol error of the step `what` (a message where the
    /// backend's answer itself is wrong).
    #[error("vhost-user socket {socket}: {what}: {source}")]
    VhostUser {
        socket: String,
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("virtio device at {base:#x}: {what}: {source}")]
    Io {
        base: u64,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("virtio device at {base:#x}: {what}: {source}")]
    Kvm {
        base: u64,
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("{device}: activated before the {need} were ready")]
    QueuesNotReady { device: String, need: &'static str },
    #[error("{device}: dup queue eventfd: {source}")]
    DupEventFd {
        device: String,
        #[source]
        source: std::io::Error,
    },
    /// Zeroing a used ring the guest never touched (lazy zeroing) failed.
    #[error("{device}: used ring: {source}")]
    UsedRing {
        device: String,
        #[source]
        source: guestmem::Error,
    },
    #[error("disk {path}: {what}: {source}")]
    Disk {
        path: String,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("disk {path}: worker: {source}")]
    DiskWorker {
        path: String,
        #[source]
        source: WorkerError,
    },
    #[error(transparent)]
    Vsock(#[from] vsock::VsockError),
    #[error("virtio-mmio {base:#x}: {source}")]
    RegisterPage {
        base: u64,
        #[source]
        source: mmio::page::PageError,
    },
    #[error("entropy device: worker: {source}")]
    RngWorker {
        #[source]
        source: WorkerError,
    },
}

/// The interrupt line of one device: InterruptStatus bits plus the irqfd.
/// With a register page the bits live in the page (its InterruptStatus
/// word), so that the guest reads them without an exit.
#[derive(Debug)]
pub struct Interrupt {
    status: AtomicU32,
    /// Bits that read set whatever the driver acknowledges (`hold`).
    held: AtomicU32,
    page: Option<Arc<RegisterPage>>,
    irqfd: EventFd,
}

/// InterruptStatus bits (virtio-mmio).
pub const INT_USED_RING: u32 = 1;
pub const INT_CONFIG: u32 = 2;

impl Interrupt {
    pub fn new(irqfd: EventFd) -> Self {
        Self::with_page(irqfd, None)
    }

    /// An interrupt whose status bits are `page`'s InterruptStatus word.
    pub fn with_page(irqfd: EventFd, page: Option<Arc<RegisterPage>>) -> Self {
        Interrupt {
            status: AtomicU32::new(0),
            held: AtomicU32::new(0),
            page,
            irqfd,
        }
    }

    fn bits(&self) -> &AtomicU32 {
        match &self.page {
            Some(p) => p.word(mmio::INTERRUPT_STATUS),
            None => &self.status,
        }
    }

    /// Raise the interrupt with `bits` set in InterruptStatus. A config
    /// change is published to the register page before the guest is told.
    pub fn signal(&self, bits: u32) {
        match &self.page {
            Some(p) if bits & INT_CONFIG != 0 => p.publish_view(),
            _ => {}
        }
        self.bits().fetch_or(bits, Ordering::SeqCst);
        if let Err(e) = self.irqfd.write(1) {
            tracing::warn!("virtio: irqfd write failed: {e}");
        }
    }

    pub fn status(&self) -> u32 {
        self.bits().load(Ordering::SeqCst)
    }

    /// The driver acknowledged `bits` (held bits stay set).
    pub fn ack(&self, bits: u32) {
        let held = self.held.load(Ordering::SeqCst);
        self.bits().fetch_and(!(bits & !held), Ordering::SeqCst);
    }

    /// `bits` read set until `clear`: a used-ring interrupt that reaches the
    /// guest without passing through the VMM sets no bit of its own.
    pub fn hold(&self, bits: u32) {
        self.held.fetch_or(bits, Ordering::SeqCst);
        self.bits().fetch_or(bits, Ordering::SeqCst);
    }

    /// A device reset: nothing held, nothing pending.
    pub fn clear(&self) {
        self.held.store(0, Ordering::SeqCst);
        self.bits().store(0, Ordering::SeqCst);
    }

    pub fn irqfd(&self) -> &EventFd {
        &self.irqfd
    }
}

/// A virtio device behind the transport: the device-type specific part.
pub trait VirtioDevice: Send {
    fn device_type(&self) -> u32;
    /// Feature bits offered to the driver.
    fn features(&self) -> u64;
    fn queue_max_sizes(&self) -> &[u16];
    fn read_config(&self, offset: u64, data: &mut [u8]);
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    /// Changes whenever the device changes its config space.
    fn config_generation(&self) -> u32 {
        0
    }
    /// Set in the Status register when the device failed on its own.
    fn needs_reset(&self) -> bool {
        false
    }
    /// The state this device changes on its own (a config interrupt),
    /// readable without blocking, for its register page. A device whose
    /// config space and DEVICE_NEEDS_RESET change only through the
    /// transport needs none.
    fn view(&self) -> Option<Arc<dyn DeviceView>> {
        None
    }
    /// True when used-ring interrupts reach the guest without passing
    /// through the VMM (vhost-user: the NIC writes the irqfd directly), so
    /// InterruptStatus must report the used-ring bit while the device runs.
    fn used_irq_bypasses_status(&self) -> bool {
        false
    }
    /// DRIVER_OK: start serving `queues` (validated against guest memory).
    fn activate(&mut self, features: u64, queues: Vec<Queue>) -> Result<(), VirtioError>;
    /// Status 0 written: stop serving the queues.
    fn reset(&mut self);
}

/// ioeventfds and the irqfd registered with KVM for one device; they are
/// unregistered when the device goes away.
struct KvmWiring {
    vm: Arc<VmFd>,
    base: u64,
    gsi: u32,
    queue_evts: Vec<EventFd>,
    irqfd: EventFd,
    /// Zones registered for coalesced MMIO (`mmio::COALESCED_ZONES`).
    coalesced: Vec<(u64, u32)>,
}

impl KvmWiring {
    /// The wiring of the device at `ctx.mmio_base`, its queue eventfds, and
    /// its interrupt (whose bits live in `ctx.register_page` when it has one).
    fn new(
        ctx: &DeviceContext,
        queues: usize,
    ) -> Result<(Self, Vec<EventFd>, Arc<Interrupt>), VirtioError> {
        let w = Self::register(ctx, queues)?;
        let (evts, irqfd) = w.clone_evts()?;
        let interrupt = Interrupt::with_page(irqfd, ctx.register_page.clone());
        Ok((w, evts, Arc::new(interrupt)))
    }

    fn register(ctx: &DeviceContext, queues: usize) -> Result<Self, VirtioError> {
        let (vm, base, gsi) = (ctx.vm.clone(), ctx.mmio_base, ctx.gsi);
        let io = |what| move |source| VirtioError::Io { base, what, source };
        let irqfd = EventFd::new(EFD_NONBLOCK).map_err(io("irqfd eventfd"))?;
        let mut w = KvmWiring {
            vm,
            base,
            gsi,
            queue_evts: Vec::new(),
            irqfd,
            coalesced: Vec::new(),
        };
        w.vm.register_irqfd(&w.irqfd, gsi)
            .map_err(|source| VirtioError::Kvm {
                base,
                what: "register irqfd",
                source,
            })?;
        for q in 0..queues {
            let evt = EventFd::new(EFD_NONBLOCK).map_err(io("queue eventfd"))?;
            w.vm.register_ioevent(
                &evt,
                &IoEventAddress::Mmio(base + mmio::QUEUE_NOTIFY),
                q as u32,
            )
            .map_err(|source| VirtioError::Kvm {
                base,
                what: "register ioeventfd",
                source,
            })?;
            w.queue_evts.push(evt);
        }
        // Every vCPU drains the ring when KVM has one (crate::coalesced; the
        // same capability check decides both).
        if crate::coalesced::page_offset(&w.vm).is_some() {
            for &(off, len) in mmio::coalesced_zones(ctx.register_page.is_some()) {
                let addr = base + off;
                w.vm.register_coalesced_mmio(IoEventAddress::Mmio(addr), len)
                    .map_err(|source| VirtioError::Kvm {
                        base,
                        what: "register coalesced MMIO",
                        source,
                    })?;
                w.coalesced.push((addr, len));
            }
        }
        Ok(w)
    }

    fn clone_evts(&self) -> Result<(Vec<EventFd>, EventFd), VirtioError> {
        let io = |source| VirtioError::Io {
            base: self.base,
            what: "dup eventfd",
            source,
        };
        let evts = self
            .queue_evts
            .iter()
            .map(|e| e.try_clone().map_err(io))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((evts, self.irqfd.try_clone().map_err(io)?))
    }
}

impl Drop for KvmWiring {
    fn drop(&mut self) {
        for (q, evt) in self.queue_evts.iter().enumerate() {
            let addr = IoEventAddress::Mmio(self.base + mmio::QUEUE_NOTIFY);
            let _ = self.vm.unregister_ioevent(evt, &addr, q as u32);
        }
        let _ = self.vm.unregister_irqfd(&self.irqfd, self.gsi);
        for &(addr, len) in &self.coalesced {
            let _ = self
                .vm
                .unregister_coalesced_mmio(IoEventAddress::Mmio(addr), len);
        }
    }
}

/// A transport plus its KVM wiring; dropping it stops the device.
struct WiredDevice<D: VirtioDevice> {
    // Field order: the transport (and its worker threads) goes first, then
    // the memory its view of guest memory points into.
    transport: MmioTransport<D>,
    _wiring: KvmWiring,
    _memory: Arc<guestmem::GuestMemory>,
}

impl<D: VirtioDevice> BusDevice for WiredDevice<D> {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        self.transport.read(offset, data)
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        self.transport.write(offset, data)
    }
}

/// Number of queues of a virtio-net device without multiqueue: RX and TX.
const NET_QUEUES: usize = 2;

/// Create the virtio-net device for `backend`, wired to KVM at
/// `ctx.mmio_base` / `ctx.gsi`. The core puts it on the MMIO bus. `mac`
/// `None` gives a VF its own MAC from the NIC; a tap needs one.
pub fn create_net_device(
    backend: &NetBackend,
    mac: Option<[u8; 6]>,
    ctx: &DeviceContext,
) -> Result<Box<dyn BusDevice>, VirtioError> {
    // The backend the user named is checked before anything is registered.
    let tap = match backend {
        NetBackend::Tap(name) => Some(netutil::Tap::open_existing(name)?),
        NetBackend::VhostUser(_) | NetBackend::Sg(_) => None,
    };
    let (wiring, evts, interrupt) = KvmWiring::new(ctx, NET_QUEUES)?;
    Ok(match backend {
        NetBackend::Tap(_) => {
            let tap = tap.expect("opened above");
            let mac = mac.ok_or_else(|| VirtioError::TapNoMac {
                name: tap.name().to_string(),
            })?;
            let dev = net::TapNet::new(tap, mac, ctx, evts, interrupt.clone());
            wire(dev, ctx, interrupt, wiring)
        }
        NetBackend::VhostUser(socket) | NetBackend::Sg(socket) => {
            let (kind, mac) = match backend {
                NetBackend::Sg(_) => (vhost_user::VuKind::Sg, None),
                _ => (vhost_user::VuKind::Net, mac),
            };
            let dev =
                vhost_user::VhostUserNet::new(kind, socket, mac, ctx, evts, interrupt.clone())?;
            wire(dev, ctx, interrupt, wiring)
        }
    })
}

/// Create a virtio-blk device serving `spec`, wired to KVM at
/// `ctx.mmio_base` / `ctx.gsi`. The file is opened (and unlinked, if asked)
/// before anything is registered. Returns the device and its size in sectors.
pub fn create_blk_device(
    spec: &DiskSpec,
    ctx: &DeviceContext,
) -> Result<(Box<dyn BusDevice>, Option<blk::DiskSlot>), VirtioError> {
    let disk = blk::Disk::open(spec)?;
    let (wiring, mut evts, interrupt) = KvmWiring::new(ctx, 1)?;
    let dev = blk::Blk::new(disk, ctx, evts.remove(0), interrupt.clone());
    // Only a slot declared empty takes media later: the rootfs disks never change.
    let slot = spec
        .empty
        .then(|| dev.slot(spec.id.clone().unwrap_or_default(), spec.read_only));
    Ok((wire(dev, ctx, interrupt, wiring), slot))
}

/// Number of queues of a virtio-vsock device: RX, TX and event.
const VSOCK_QUEUES: usize = 3;

/// Create the virtio-vsock device of `spec`, wired to KVM at
/// `ctx.mmio_base` / `ctx.gsi`. Its listening socket is bound first (a
/// stale file replaced only if nothing listens on it), before anything is
/// registered. Returns the device and a second guard of the socket file,
/// for the VM to hold: the file goes when either is dropped.
pub fn create_vsock_device(
    spec: &VsockSpec,
    ctx: &DeviceContext,
) -> Result<(Box<dyn BusDevice>, vsock::SocketFile), VirtioError> {
    let (listener, file) = vsock::bind(&spec.path)?;
    let guard = file.clone();
    let (wiring, evts, interrupt) = KvmWiring::new(ctx, VSOCK_QUEUES)?;
    let dev = vsock::Vsock::new(
        spec.cid,
        listener,
        file,
        ctx.mem.clone(),
        chain::prepare_for(ctx),
        evts,
        interrupt.clone(),
        vsock::Limits::default(),
    );
    Ok((wire(dev, ctx, interrupt, wiring), guard))
}

/// Create the entropy device (virtio-rng), wired to KVM at
/// `ctx.mmio_base` / `ctx.gsi`.
pub fn create_rng_device(ctx: &DeviceContext) -> Result<Box<dyn BusDevice>, VirtioError> {
    let (wiring, mut evts, interrupt) = KvmWiring::new(ctx, 1)?;
    let dev = rng::Rng::new(ctx, evts.remove(0), interrupt.clone());
    Ok(wire(dev, ctx, interrupt, wiring))
}

/// Puts `dev` behind a virtio-mmio transport that keeps its KVM wiring alive.
fn wire<D: VirtioDevice + 'static>(
    dev: D,
    ctx: &DeviceContext,
    interrupt: Arc<Interrupt>,
    wiring: KvmWiring,
) -> Box<dyn BusDevice> {
    Box::new(WiredDevice {
        transport: MmioTransport::new(
            dev,
            ctx.mem.clone(),
            interrupt,
            ctx.mmio_base,
            ctx.register_page.clone(),
        ),
        _wiring: wiring,
        _memory: ctx.guestmem.clone(),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use std::process::Command;

    use kvm_ioctls::Kvm;
    use vm_memory::{Bytes, GuestAddress};

    use super::mmio::*;
    use super::*;
    use crate::devspec::VfInit;

    pub(crate) fn ctx(dma: bool) -> DeviceContext {
        let vm = Kvm::new().unwrap().create_vm().unwrap();
        vm.create_irq_chip().unwrap();
        let spec = guestmem::RegionSpec {
            name: "ram".into(),
            gpa: 0,
            size: 1 << 20,
            dma,
        };
        let gm = guestmem::GuestMemory::new(
            &[spec],
            guestmem::MemoryPolicy::Vanilla,
            guestmem::MemorySource::Fresh,
            false,
        )
        .unwrap();
        DeviceContext {
            vm: Arc::new(vm),
            mem: gm.device_guest_memory().unwrap(),
            guestmem: Arc::new(gm),
            mmio_base: 0xd000_0000,
            gsi: 5,
            trace: Arc::new(trace::TraceWriter::new("virtio-test", None).unwrap()),
            vf_init: VfInit::Sync,
            vf_reconnect: std::time::Duration::from_secs(1),
            dma_window: false,
            register_page: None,
        }
    }

    fn w(d: &mut dyn BusDevice, off: u64, v: u32) {
        d.write(off, &v.to_le_bytes());
    }

    /// Threads of this process named `name`, and fds open on /dev/net/tun.
    fn worker_threads(name: &str) -> usize {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter(|t| {
                let comm = t.as_ref().unwrap().path().join("comm");
                std::fs::read_to_string(comm).is_ok_and(|c| c.trim() == name)
            })
            .count()
    }

    fn tun_fds() -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter(|f| {
                std::fs::read_link(f.as_ref().unwrap().path())
                    .is_ok_and(|p| p.as_os_str() == "/dev/net/tun")
            })
            .count()
    }

    /// Drive a tap device to DRIVER_OK and back: the worker thread, the tap
    /// fd and the KVM registrations are gone once the device is dropped.
    #[test]
    fn tap_device_releases_thread_and_fd_on_drop() {
        let tap = format!("bvu{}", std::process::id() % 100_000);
        let _ = Command::new("ip").args(["link", "del", &tap]).status();
        let ok = Command::new("ip")
            .args(["tuntap", "add", "dev", &tap, "mode", "tap"])
            .status()
            .unwrap();
        assert!(ok.success(), "create tap {tap}");
        struct DelTap<'a>(&'a str);
        impl Drop for DelTap<'_> {
            fn drop(&mut self) {
                let _ = Command::new("ip").args(["link", "del", self.0]).status();
            }
        }
        let _del = DelTap(&tap);
        let thread = format!("virtio-net-{tap}");
        let thread = &thread[..thread.len().min(15)]; // comm is truncated to 15 bytes

        let ctx = ctx(false);
        let mut dev = create_net_device(
            &NetBackend::Tap(tap.clone()),
            Some([2, 0, 0, 0, 0, 1]),
            &ctx,
        )
        .expect("create tap device");
        // A second device on the same tap: busy.
        let busy = create_net_device(&NetBackend::Tap(tap.clone()), Some([2; 6]), &ctx);
        assert!(matches!(
            busy,
            Err(VirtioError::TapOpen(netutil::TapError::Busy { .. }))
        ));

        let d = dev.as_mut();
        w(d, STATUS, 1);
        w(d, STATUS, 3);
        w(d, DRIVER_FEATURES_SEL, 1);
        w(d, DRIVER_FEATURES, 1); // VERSION_1
        w(d, STATUS, 3 | 8);
        for (q, base) in [(0u32, 0x1000u64), (1, 0x2000)] {
            w(d, QUEUE_SEL, q);
            w(d, QUEUE_NUM, 8);
            w(d, QUEUE_DESC_LOW, base as u32);
            w(d, QUEUE_DRIVER_LOW, base as u32 + 0x400);
            w(d, QUEUE_DEVICE_LOW, base as u32 + 0x800);
            w(d, QUEUE_READY, 1);
        }
        w(d, STATUS, 3 | 8 | 4);
        let mut status = [0u8; 4];
        d.read(STATUS, &mut status);
        assert_eq!(u32::from_le_bytes(status), 15, "device running");
        // The thread names itself once it runs.
        let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while worker_threads(thread) == 0 && std::time::Instant::now() < end {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(worker_threads(thread), 1);
        assert_eq!(tun_fds(), 1);
        // The used rings are untouched: no frame, nothing to return.
        assert_eq!(ctx.mem.read_obj::<u16>(GuestAddress(0x1802)).unwrap(), 0);

        // Reset stops the worker; DRIVER_OK again restarts it.
        w(d, STATUS, 0);
        assert_eq!(worker_threads(thread), 0);
        drop(dev);
        assert_eq!(worker_threads(thread), 0);
        assert_eq!(tun_fds(), 0);
        // The tap is free again.
        let again = create_net_device(&NetBackend::Tap(tap.clone()), Some([2; 6]), &ctx);
        assert!(again.is_ok());
        drop(again);
    }

    #[test]
    fn missing_tap_and_vf_socket_errors_name_them() {
        let ctx_dma = ctx(true);
        let e = create_net_device(
            &NetBackend::Tap("bvnosuchtap0".into()),
            Some([2; 6]),
            &ctx_dma,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains("bvnosuchtap0") && e.contains("no such interface"),
            "{e}"
        );
        let vf = NetBackend::VhostUser("/nonexistent/vf.sock".into());
        let e = create_net_device(&vf, Some([2; 6]), &ctx_dma)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("/nonexistent/vf.sock") && e.contains("connect"),
            "{e}"
        );
        // Without a dma region there is nothing to give the NIC.
        let e = create_net_device(&vf, Some([2; 6]), &ctx(false))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("no dma region"), "{e}");
    }
}
