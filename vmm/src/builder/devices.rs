//! Step 5 of the build: devices on the buses. Port I/O: the serial console
//! (IRQ 4 through an irqfd), the i8042 reset line and the agent port; MMIO:
//! one virtio-net device per `--net` (for a sync VF, `vf-open` happens in
//! here), then one virtio-blk device per `--disk`, then the virtio-vsock
//! device of `--vsock`, then the entropy device of `--entropy`.

use std::io::Write;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use kvm_ioctls::VmFd;
use trace::TraceWriter;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{kvm_err, os_err};
use crate::args::VmConfig;
use crate::bootinfo::DevEntry;
use crate::bus::{Bus, DeviceContext, SharedDevice};
use crate::devices::agent_port::{AgentPort, RootfsExpect, SgExpect};
use crate::devices::i8042::{I8042, I8042_LEN, I8042_PORT};
use crate::devices::serial::SerialDevice;
use crate::devspec::{NetBackend, VfInit};
use crate::error::Error;
use crate::events::EventSink;
use crate::layout::*;
use crate::virtio::RegisterPage;

/// The port I/O bus and what its devices share with the VMM.
pub(super) struct LegacyDevices {
    pub pio: Bus,
    pub serial_irq: EventFd,
    pub values: Arc<Mutex<Vec<u32>>>,
    pub vcpu_start: Arc<AtomicU64>,
}

fn bus_err(sb: &str, device: &str) -> impl FnOnce(crate::bus::BusError) -> Error {
    let (sandbox, device) = (sb.to_string(), device.to_string());
    move |source| Error::Bus {
        sandbox,
        device,
        source,
    }
}

/// What the agent port checks the agent's reports against.
pub(super) struct AgentExpect {
    pub app_checksum: u32,
    pub rootfs: RootfsExpect,
    pub sg: Option<SgExpect>,
}

pub(super) fn attach_legacy_devices(
    sb: &str,
    vm: &VmFd,
    serial_out: Box<dyn Write + Send>,
    expect: AgentExpect,
    trace: &Arc<TraceWriter>,
    sink: &Arc<EventSink>,
) -> Result<LegacyDevices, Error> {
    let serial_irq = EventFd::new(EFD_NONBLOCK).map_err(os_err(sb, "serial eventfd"))?;
    vm.register_irqfd(&serial_irq, SERIAL_IRQ)
        .map_err(kvm_err(sb, "KVM_IRQFD for the serial IRQ 4"))?;
    let serial_trigger = serial_irq
        .try_clone()
        .map_err(os_err(sb, "serial eventfd"))?;
    let values = Arc::new(Mutex::new(Vec::new()));
    let vcpu_start = Arc::new(AtomicU64::new(0));
    let mut pio = Bus::new();
    pio.insert(
        "serial",
        SERIAL_PORT,
        8,
        Arc::new(Mutex::new(SerialDevice::new(serial_trigger, serial_out))),
    )
    .map_err(bus_err(sb, "serial"))?;
    pio.insert(
        "i8042",
        I8042_PORT,
        I8042_LEN,
        Arc::new(Mutex::new(I8042::new(sink.clone()))),
    )
    .map_err(bus_err(sb, "i8042"))?;
    pio.insert(
        "agent-port",
        AGENT_PORT,
        AGENT_PORT_LEN,
        Arc::new(Mutex::new(
            AgentPort::new(
                vcpu_start.clone(),
                expect.app_checksum,
                trace.clone(),
                sink.clone(),
                values.clone(),
            )
            .with_rootfs(expect.rootfs)
            .with_sg(expect.sg),
        )),
    )
    .map_err(bus_err(sb, "agent-port"))?;
    Ok(LegacyDevices {
        pio,
        serial_irq,
        values,
        vcpu_start,
    })
}

// A register page covers a device's whole window.
const _: () = assert!(MMIO_SIZE as usize == crate::virtio::mmio::page::PAGE_SIZE);

/// The register pages of the virtio devices `devs` (same order), each
/// mapped read-only over its device's window as KVM slot `first_slot + i`
/// (docs/vmm.md "The register page"). None, so that every read exits, for
/// all devices under `--no-register-pages` or without KVM_CAP_READONLY_MEM,
/// and for a VF whose MAC an asynchronous `vf-open` learns: the guest's read
/// of it waits for the NIC, which a page cannot do.
pub(super) fn register_pages(
    cfg: &VmConfig,
    vm: &VmFd,
    devs: &[DevEntry],
    first_slot: u32,
) -> Result<Vec<Option<Arc<RegisterPage>>>, Error> {
    let sb = cfg.sandbox.as_str();
    let on = cfg.register_pages && vm.check_extension(kvm_ioctls::Cap::ReadonlyMem);
    let mut pages = Vec::with_capacity(devs.len());
    for (i, dev) in devs.iter().enumerate() {
        let eligible = match cfg.net.get(i) {
            Some(b @ NetBackend::VhostUser(_)) => {
                cfg.device_mac(b).is_some() || cfg.vf_init == VfInit::Sync
            }
            _ => true,
        };
        if !(on && eligible) {
            pages.push(None);
            continue;
        }
        let page = RegisterPage::new().map_err(|source| Error::Device {
            sandbox: sb.to_string(),
            device: format!("virtio-mmio {:#x}", dev.mmio_base),
            source: Box::new(crate::virtio::VirtioError::RegisterPage {
                base: dev.mmio_base,
                source,
            }),
        })?;
        let region = kvm_bindings::kvm_userspace_memory_region {
            slot: first_slot + i as u32,
            flags: kvm_bindings::KVM_MEM_READONLY,
            guest_phys_addr: dev.mmio_base,
            memory_size: MMIO_SIZE,
            userspace_addr: page.host_addr(),
        };
        // SAFETY: KVM only reads the page. The devices hold it, and run_vm
        // stops the vCPUs before `Vm` drops them; should a vCPU not stop,
        // KVM faults on the unmapped range (EFAULT), never the host.
        unsafe { vm.set_user_memory_region(region) }.map_err(kvm_err(
            sb,
            format!(
                "KVM_SET_USER_MEMORY_REGION (read-only) for the register page at {:#x}",
                dev.mmio_base
            ),
        ))?;
        pages.push(Some(Arc::new(page)));
    }
    Ok(pages)
}

/// A virtio-mmio device's window `base` on the MMIO bus, named `name`.
fn insert_virtio(
    mmio: &mut Bus,
    sb: &str,
    name: &str,
    base: u64,
    dev: Box<dyn crate::bus::BusDevice>,
) -> Result<(), Error> {
    let dev: SharedDevice = Arc::new(Mutex::new(dev));
    mmio.insert(name, base, MMIO_SIZE, dev)
        .map_err(bus_err(sb, name))
}

/// What every virtio-mmio device's attachment needs: the configuration,
/// the VM, its memory (the devices' view), the trace and the device slots.
pub(super) struct MmioDevices<'a> {
    pub cfg: &'a VmConfig,
    pub vm: &'a Arc<VmFd>,
    pub mem: &'a Arc<guestmem::GuestMemory>,
    pub device_mem: &'a GuestMemoryMmap,
    pub trace: &'a Arc<TraceWriter>,
    pub devs: &'a [DevEntry],
    /// `register_pages`, per entry of `devs`.
    pub pages: &'a [Option<Arc<RegisterPage>>],
}

impl MmioDevices<'_> {
    fn context(&self, slot: &DevEntry) -> DeviceContext {
        let cfg = self.cfg;
        let index = self.devs.iter().position(|d| d.mmio_base == slot.mmio_base);
        DeviceContext {
            vm: self.vm.clone(),
            mem: self.device_mem.clone(),
            guestmem: self.mem.clone(),
            mmio_base: slot.mmio_base,
            gsi: slot.gsi,
            trace: self.trace.clone(),
            vf_init: cfg.vf_init,
            vf_reconnect: cfg.vf_reconnect,
            dma_window: cfg.dma_window > 0,
            register_page: index.and_then(|i| self.pages.get(i)?.clone()),
        }
    }
}

/// The virtio-net devices in the first slots of `devs`, all sharing `device_mem`.
pub(super) fn attach_net_devices(d: &MmioDevices<'_>) -> Result<Bus, Error> {
    let (cfg, devs) = (d.cfg, d.devs);
    let sb = cfg.sandbox.as_str();
    let mut mmio = Bus::new();
    for (backend, slot) in cfg.net.iter().zip(devs) {
        let ctx = d.context(slot);
        let base = slot.mmio_base;
        let name = match backend {
            NetBackend::Tap(n) => format!("tap:{n}"),
            NetBackend::VhostUser(p) => format!("vf:{}", p.display()),
            NetBackend::Sg(p) => format!("sg:{}", p.display()),
        };
        let dev = crate::virtio::create_net_device(backend, cfg.device_mac(backend), &ctx)
            .map_err(|source| Error::Net {
                sandbox: sb.to_string(),
                device: name.clone(),
                source: Box::new(source),
            })?;
        insert_virtio(&mut mmio, sb, &name, base, dev)?;
    }
    Ok(mmio)
}

/// The virtio-blk devices (the rootfs layers), in the slots after the
/// network devices.
pub(super) fn attach_disks(
    d: &MmioDevices<'_>,
    mmio: &mut Bus,
) -> Result<Vec<crate::virtio::blk::DiskSlot>, Error> {
    let (cfg, devs) = (d.cfg, d.devs);
    let sb = cfg.sandbox.as_str();
    let mut media = Vec::new();
    for (spec, slot) in cfg.disks.iter().zip(&devs[cfg.net.len()..]) {
        let ctx = d.context(slot);
        let name = match &spec.id {
            Some(id) if spec.empty => format!("disk:slot {id}"),
            _ => format!("disk:{}", spec.path.display()),
        };
        let (dev, disk_slot) =
            crate::virtio::create_blk_device(spec, &ctx).map_err(|source| Error::Device {
                sandbox: sb.to_string(),
                device: name.clone(),
                source: Box::new(source),
            })?;
        media.extend(disk_slot);
        insert_virtio(mmio, sb, &name, slot.mmio_base, dev)?;
    }
    Ok(media)
}

/// The control socket (`--api`) over the empty disk slots; the guard that
/// removes its file.
pub(super) fn serve_api(
    cfg: &VmConfig,
    slots: Vec<crate::virtio::blk::DiskSlot>,
) -> Result<Option<crate::virtio::vsock::SocketFile>, Error> {
    let Some(path) = &cfg.api else {
        return Ok(None);
    };
    let (listener, file) = crate::virtio::vsock::bind(path).map_err(|source| Error::Api {
        sandbox: cfg.sandbox.clone(),
        source,
    })?;
    crate::api::serve(listener, slots, &cfg.sandbox);
    Ok(Some(file))
}

/// The virtio-vsock device (`--vsock`), in the slot after the disks.
/// Returns the guard that removes its socket file.
pub(super) fn attach_vsock(
    d: &MmioDevices<'_>,
    mmio: &mut Bus,
) -> Result<Option<crate::virtio::vsock::SocketFile>, Error> {
    let (cfg, devs) = (d.cfg, d.devs);
    let sb = cfg.sandbox.as_str();
    let Some(spec) = &cfg.vsock else {
        return Ok(None);
    };
    let slot = &devs[cfg.net.len() + cfg.disks.len()];
    let ctx = d.context(slot);
    let (dev, guard) =
        crate::virtio::create_vsock_device(spec, &ctx).map_err(|source| Error::Vsock {
            sandbox: sb.to_string(),
            source,
        })?;
    let name = format!("vsock:{}", spec.path.display());
    insert_virtio(mmio, sb, &name, slot.mmio_base, dev)?;
    Ok(Some(guard))
}

/// The entropy device (`--entropy`), in the last slot.
pub(super) fn attach_entropy(d: &MmioDevices<'_>, mmio: &mut Bus) -> Result<(), Error> {
    let (cfg, devs) = (d.cfg, d.devs);
    if !cfg.entropy {
        return Ok(());
    }
    let sb = cfg.sandbox.as_str();
    let slot = devs
        .last()
        .expect("devices_of gave the entropy device a slot");
    let ctx = d.context(slot);
    let name = "entropy";
    let dev = crate::virtio::create_rng_device(&ctx).map_err(|source| Error::Device {
        sandbox: sb.to_string(),
        device: name.to_string(),
        source: Box::new(source),
    })?;
    insert_virtio(mmio, sb, name, slot.mmio_base, dev)?;
    Ok(())
}
