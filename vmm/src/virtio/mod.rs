//! Virtio devices of the VMM: the virtio-mmio (version 2) transport,
//! virtio-net over a tap device and the vhost-user-net frontend (a VF of
//! `burstvm nic`).
//!
//! Queue notifications from the guest arrive on ioeventfds (one per queue,
//! registered at `mmio_base + 0x50` with the queue index as datamatch) and
//! interrupts go out through an irqfd on the device's GSI, so neither path
//! takes a VM exit to user space once the device is running.

mod mmio;
mod net;
mod tap;
mod vhost_user;

pub use mmio::MmioTransport;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use kvm_ioctls::{IoEventAddress, VmFd};
use virtio_queue::Queue;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::bus::{DeviceContext, MmioDevice, NetBackend};

/// Size of one virtio-mmio device window.
pub const MMIO_SIZE: u64 = 0x1000;
/// Queue size the devices offer (the guest may choose a smaller power of two).
pub const QUEUE_MAX_SIZE: u16 = 256;

#[derive(Debug, thiserror::Error)]
pub enum VirtioError {
    #[error("tap device {name}: {reason}")]
    Tap { name: String, reason: String },
    #[error("vhost-user socket {socket}: {what}: {reason}")]
    VhostUser {
        socket: String,
        what: &'static str,
        reason: String,
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
    #[error("virtio device: {0}")]
    Activate(String),
}

/// The interrupt line of one device: InterruptStatus bits plus the irqfd.
pub struct Interrupt {
    status: AtomicU32,
    irqfd: EventFd,
}

/// InterruptStatus bits (virtio-mmio).
pub const INT_USED_RING: u32 = 1;
pub const INT_CONFIG: u32 = 2;

impl Interrupt {
    pub fn new(irqfd: EventFd) -> Self {
        Interrupt {
            status: AtomicU32::new(0),
            irqfd,
        }
    }

    /// Raise the interrupt with `bits` set in InterruptStatus.
    pub fn signal(&self, bits: u32) {
        self.status.fetch_or(bits, Ordering::SeqCst);
        if let Err(e) = self.irqfd.write(1) {
            tracing::warn!("virtio: irqfd write failed: {e}");
        }
    }

    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
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
}

impl KvmWiring {
    fn new(vm: Arc<VmFd>, base: u64, gsi: u32, queues: usize) -> Result<Self, VirtioError> {
        let io = |what| move |source| VirtioError::Io { base, what, source };
        let irqfd = EventFd::new(EFD_NONBLOCK).map_err(io("irqfd eventfd"))?;
        let mut w = KvmWiring {
            vm,
            base,
            gsi,
            queue_evts: Vec::new(),
            irqfd,
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
    }
}

/// A transport plus its KVM wiring; dropping it stops the device.
struct WiredDevice<D: VirtioDevice> {
    // Field order: the transport (and its worker threads) goes first.
    transport: MmioTransport<D>,
    _wiring: KvmWiring,
}

impl<D: VirtioDevice> MmioDevice for WiredDevice<D> {
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
/// `ctx.mmio_base` / `ctx.gsi`. The core puts it on the MMIO bus.
pub fn create_net_device(
    backend: &NetBackend,
    mac: [u8; 6],
    ctx: &DeviceContext,
) -> Result<Box<dyn MmioDevice>, VirtioError> {
    let wiring = KvmWiring::new(ctx.vm.clone(), ctx.mmio_base, ctx.gsi, NET_QUEUES)?;
    let (evts, irqfd) = wiring.clone_evts()?;
    let interrupt = Arc::new(Interrupt::new(irqfd));
    match backend {
        NetBackend::Tap(name) => {
            let dev = net::TapNet::new(name, mac, ctx, evts, interrupt.clone())?;
            let transport = MmioTransport::new(dev, ctx.mem.clone(), interrupt, ctx.mmio_base);
            Ok(Box::new(WiredDevice {
                transport,
                _wiring: wiring,
            }))
        }
        NetBackend::VhostUser(socket) => {
            let dev = vhost_user::VhostUserNet::new(socket, mac, ctx, evts, interrupt.clone())?;
            let transport = MmioTransport::new(dev, ctx.mem.clone(), interrupt, ctx.mmio_base);
            Ok(Box::new(WiredDevice {
                transport,
                _wiring: wiring,
            }))
        }
    }
}
