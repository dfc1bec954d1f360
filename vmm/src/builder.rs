//! Assembles a VM from a validated `VmConfig` (Firecracker's builder): KVM,
//! guest memory, boot state, devices on the buses, configured vCPUs.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use trace::{monotonic_ns, Stage, TraceWriter};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use crate::args::{BootSource, VmConfig};
use crate::bootinfo::{BootInfo, BootMem};
use crate::bus::{Bus, DeviceContext, SharedDevice};
use crate::devices::agent_port::AgentPort;
use crate::devices::serial::SerialDevice;
use crate::error::{Error, GuestFailure};
use crate::events::{EventSink, VmEvent};
use crate::layout::*;
use crate::x86::{self, EntryMode};

/// A built VM, ready for its vCPUs to start.
pub struct Vm {
    pub trace: Arc<TraceWriter>,
    pub sink: Arc<EventSink>,
    pub values: Arc<Mutex<Vec<u32>>>,
    pub vcpu_start: Arc<AtomicU64>,
    /// Where each vCPU was when it stopped (vCPU id, description).
    pub vcpu_states: Arc<Mutex<Vec<(u8, String)>>>,
    pub stop: Arc<AtomicBool>,
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub vcpus: Vec<VcpuFd>,
    // Dropped after the vCPU threads stopped (Vm outlives them): devices
    // first (tap, vhost-user), then memory (back to the pool), then KVM.
    pub _mem: Arc<guestmem::GuestMemory>,
    pub _vm: Arc<VmFd>,
    _serial_irq: EventFd,
}

fn kvm_err(sandbox: &str, what: impl Into<String>) -> impl FnOnce(kvm_ioctls::Error) -> Error + '_ {
    let what = what.into();
    move |source| Error::Kvm {
        sandbox: sandbox.to_string(),
        what,
        source,
    }
}

/// Opens and checks the KVM device (the first thing that can fail on a bad host).
pub fn open_kvm(cfg: &VmConfig) -> Result<Kvm, Error> {
    let path =
        std::ffi::CString::new(cfg.kvm_device.as_os_str().as_encoded_bytes()).map_err(|_| {
            Error::InvalidArg {
                field: "--kvm-device",
                msg: format!("{} contains a NUL byte", cfg.kvm_device.display()),
            }
        })?;
    let kvm = Kvm::new_with_path(&path).map_err(|source| Error::KvmOpen {
        path: cfg.kvm_device.clone(),
        source,
    })?;
    let version = kvm.get_api_version();
    if version != 12 {
        return Err(Error::KvmApi {
            path: cfg.kvm_device.clone(),
            version,
        });
    }
    Ok(kvm)
}

/// The agent image followed by the app payload, and where the payload starts.
fn agent_image_layout(cfg: &VmConfig) -> (u64, u64) {
    let app_gpa = align_up(guest::LOAD_ADDR + guest::AGENT_IMAGE.len() as u64, 8);
    let image_size = align_up(app_gpa + cfg.app_size - IMAGE_ADDR, ALIGN_2M);
    (app_gpa, image_size)
}

fn region_specs(cfg: &VmConfig) -> Vec<guestmem::RegionSpec> {
    let mut specs = vec![guestmem::RegionSpec {
        name: "ram".into(),
        gpa: 0,
        size: cfg.ram_size,
        dma: cfg.dma_ram,
    }];
    if let BootSource::Agent = cfg.boot {
        let (_, image_size) = agent_image_layout(cfg);
        specs.push(guestmem::RegionSpec {
            name: "image".into(),
            gpa: IMAGE_ADDR,
            size: image_size,
            dma: cfg.dma_image,
        });
    }
    specs
}

fn devices_of(cfg: &VmConfig) -> Vec<(u64, u32)> {
    (0..cfg.net.len())
        .map(|i| (virtio_mmio_base(i), virtio_gsi(i)))
        .collect()
}

/// `interrupted` is polled between the long steps; its error aborts the build.
pub fn build(
    cfg: &VmConfig,
    kvm: Kvm,
    spawn_start: u64,
    interrupted: &dyn Fn() -> Result<(), Error>,
) -> Result<Vm, Error> {
    let sb = cfg.sandbox.as_str();
    let mem_err = |source| Error::Memory {
        sandbox: sb.to_string(),
        source,
    };

    // Everything read from files comes first, so bad input fails before
    // any memory or device exists.
    let devs = devices_of(cfg);
    let linux = match &cfg.boot {
        BootSource::Linux {
            kernel,
            initrd,
            cmdline,
        } => {
            let cl = crate::linux::build_cmdline(cmdline.as_deref(), &devs).map_err(|msg| {
                Error::InvalidArg {
                    field: "--cmdline",
                    msg,
                }
            })?;
            Some(crate::linux::load(
                kernel,
                initrd.as_deref(),
                &cl,
                cfg.ram_size,
            )?)
        }
        BootSource::Agent => None,
    };
    let serial_out: Box<dyn Write + Send> = match &cfg.serial_log {
        Some(p) => Box::new(std::io::LineWriter::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|source| Error::File {
                    what: "serial log",
                    path: p.clone(),
                    source,
                })?,
        )),
        None => Box::new(std::io::stdout()),
    };

    let trace = Arc::new(TraceWriter::new(sb, cfg.trace.as_deref())?);

    let vm = Arc::new(kvm.create_vm().map_err(kvm_err(sb, "KVM_CREATE_VM"))?);
    vm.set_tss_address(KVM_TSS_ADDR as usize)
        .map_err(kvm_err(sb, "KVM_SET_TSS_ADDR"))?;
    vm.set_identity_map_address(KVM_IDENTITY_MAP_ADDR)
        .map_err(kvm_err(sb, "KVM_SET_IDENTITY_MAP_ADDR"))?;
    vm.create_irq_chip()
        .map_err(kvm_err(sb, "KVM_CREATE_IRQCHIP"))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit)
        .map_err(kvm_err(sb, "KVM_CREATE_PIT2"))?;

    let source = match &cfg.pool_socket {
        Some(p) => guestmem::MemorySource::Pool(
            guestmem::pool::PoolClient::connect(p).map_err(|e| mem_err(e.into()))?,
        ),
        None => guestmem::MemorySource::Fresh,
    };
    interrupted()?;
    let mut mem = guestmem::GuestMemory::new(&region_specs(cfg), cfg.policy, source, cfg.hugepages)
        .map_err(mem_err)?;
    for (slot, r) in mem.regions().iter().enumerate() {
        let region = kvm_userspace_memory_region {
            slot: slot as u32,
            flags: 0,
            guest_phys_addr: r.gpa(),
            memory_size: r.size(),
            userspace_addr: r.guest_view_ptr() as u64,
        };
        // SAFETY: the guest view stays mapped while vCPUs run: run_vm stops
        // them before `Vm` (which owns the memory) is dropped. Should a
        // vCPU not stop, KVM faults on the unmapped range (EFAULT), never
        // the host.
        unsafe { vm.set_user_memory_region(region) }.map_err(kvm_err(
            sb,
            format!("KVM_SET_USER_MEMORY_REGION for region {}", r.name()),
        ))?;
    }
    trace.record(Stage::VmmSpawn, spawn_start, monotonic_ns())?;

    // DMA map: the dma-ram / dma-image stages (absent for dma = false).
    for (name, stage) in [("ram", Stage::DmaRam), ("image", Stage::DmaImage)] {
        if mem.regions().iter().any(|r| r.name() == name && r.dma()) {
            let t0 = monotonic_ns();
            interrupted()?;
            mem.dma_map(name).map_err(mem_err)?;
            trace.record(stage, t0, monotonic_ns())?;
        }
    }

    // Boot state, all on the instant-zero list.
    let payload = crate::app::payload(sb, cfg.app_size as usize);
    let expected = crate::app::checksum(&payload);
    let write = |gpa: u64, data: &[u8], what: &'static str| {
        mem.write_instant(gpa, data).map_err(|e| Error::GuestWrite {
            sandbox: sb.to_string(),
            gpa,
            what,
            msg: e.to_string(),
        })
    };
    let entry = match &linux {
        None => {
            write(GDT_ADDR, &x86::gdt_bytes(&x86::GDT_64), "GDT")?;
            write(PML4_ADDR, &x86::page_tables(), "page tables")?;
            let (app_gpa, _) = agent_image_layout(cfg);
            let usable = [BootMem {
                base: RAM_FREE_START,
                size: cfg.ram_size - RAM_FREE_START,
            }];
            write(
                BOOT_INFO_ADDR,
                BootInfo::new(cfg, &usable, &devs, app_gpa).as_bytes(),
                "boot info",
            )?;
            write(guest::LOAD_ADDR, guest::AGENT_IMAGE, "agent image")?;
            if !payload.is_empty() {
                write(app_gpa, &payload, "app payload")?;
            }
            EntryMode::Long64 {
                rip: guest::ENTRY_ADDR,
                rsp: 0x8ff0,
                rdi: BOOT_INFO_ADDR,
                rsi: 0,
            }
        }
        Some(k) => {
            let gdt: &[u64] = if k.pvh { &x86::GDT_32 } else { &x86::GDT_64 };
            let scratch_err = |e: vm_memory::GuestMemoryError| Error::GuestWrite {
                sandbox: sb.to_string(),
                gpa: 0,
                what: "kernel staging",
                msg: e.to_string(),
            };
            k.scratch
                .write_slice(&x86::gdt_bytes(gdt), GuestAddress(GDT_ADDR))
                .map_err(scratch_err)?;
            k.scratch
                .write_slice(&x86::page_tables(), GuestAddress(PML4_ADDR))
                .map_err(scratch_err)?;
            // CPU count and IOAPIC routing for the kernel.
            k.scratch
                .write_slice(
                    &crate::mptable::build(cfg.vcpus),
                    GuestAddress(crate::mptable::MPTABLE_ADDR),
                )
                .map_err(scratch_err)?;
            let mut buf = vec![0u8; 2 << 20];
            for &(gpa, len) in &k.ranges {
                let mut off = 0;
                while off < len {
                    let n = (len - off).min(buf.len() as u64) as usize;
                    k.scratch
                        .read_slice(&mut buf[..n], GuestAddress(gpa + off))
                        .map_err(scratch_err)?;
                    write(gpa + off, &buf[..n], "kernel")?;
                    off += n as u64;
                }
            }
            k.entry
        }
    };
    drop(linux);
    drop(payload);

    interrupted()?;
    mem.start_lazy_zeroing().map_err(mem_err)?;
    let mem = Arc::new(mem);
    let sink = Arc::new(EventSink::new().map_err(|source| Error::Os {
        sandbox: sb.to_string(),
        what: "eventfd",
        source,
    })?);
    {
        let sink = sink.clone();
        mem.set_lazy_error_callback(Box::new(move |msg| {
            sink.post(VmEvent::Failure(GuestFailure::MemoryHandler(
                msg.to_string(),
            )))
        }));
    }

    // Port I/O: serial and agent port.
    let os_err = |what: &'static str| {
        move |source| Error::Os {
            sandbox: sb.to_string(),
            what,
            source,
        }
    };
    let serial_irq = EventFd::new(libc::EFD_NONBLOCK).map_err(os_err("serial eventfd"))?;
    vm.register_irqfd(&serial_irq, SERIAL_IRQ)
        .map_err(kvm_err(sb, "KVM_IRQFD for the serial IRQ 4"))?;
    let serial_trigger = serial_irq.try_clone().map_err(os_err("serial eventfd"))?;
    let values = Arc::new(Mutex::new(Vec::new()));
    let vcpu_start = Arc::new(AtomicU64::new(0));
    let mut pio = Bus::new();
    let dev_err = |device: &str| {
        let device = device.to_string();
        move |e: crate::bus::BusError| Error::Device {
            sandbox: sb.to_string(),
            device,
            msg: e.to_string(),
        }
    };
    pio.insert(
        "serial",
        SERIAL_PORT,
        8,
        Arc::new(Mutex::new(SerialDevice::new(serial_trigger, serial_out))),
    )
    .map_err(dev_err("serial"))?;
    pio.insert(
        "agent-port",
        AGENT_PORT,
        AGENT_PORT_LEN,
        Arc::new(Mutex::new(AgentPort::new(
            vcpu_start.clone(),
            expected,
            trace.clone(),
            sink.clone(),
            values.clone(),
        ))),
    )
    .map_err(dev_err("agent-port"))?;

    // Virtio devices (vf-open happens in here for sync VFs).
    let mut mmio = Bus::new();
    for (i, backend) in cfg.net.iter().enumerate() {
        let (base, gsi) = devs[i];
        let ctx = DeviceContext {
            vm: vm.clone(),
            mem: mem.device_guest_memory().map_err(mem_err)?,
            guestmem: mem.clone(),
            mmio_base: base,
            gsi,
            trace: trace.clone(),
            vf_init: cfg.vf_init,
        };
        let name = match backend {
            crate::bus::NetBackend::Tap(n) => format!("tap:{n}"),
            crate::bus::NetBackend::VhostUser(p) => format!("vf:{}", p.display()),
        };
        let dev = crate::virtio::create_net_device(backend, cfg.netcfg.mac.bytes(), &ctx).map_err(
            |e| Error::Net {
                sandbox: sb.to_string(),
                device: name.clone(),
                msg: e.to_string(),
            },
        )?;
        let dev: SharedDevice = Arc::new(Mutex::new(dev));
        mmio.insert(&name, base, MMIO_SIZE, dev)
            .map_err(dev_err(&name))?;
    }

    interrupted()?;
    // vCPUs.
    let base_cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err(sb, "KVM_GET_SUPPORTED_CPUID"))?;
    let mut vcpus = Vec::new();
    for id in 0..cfg.vcpus {
        let fd = vm
            .create_vcpu(id as u64)
            .map_err(kvm_err(sb, format!("KVM_CREATE_VCPU {id}")))?;
        let mut cpuid = base_cpuid.clone();
        x86::filter_cpuid(&mut cpuid, id, cfg.vcpus);
        x86::setup_vcpu(&fd, &cpuid, entry).map_err(|(what, source)| Error::Kvm {
            sandbox: sb.to_string(),
            what: format!("vCPU {id}: {what}"),
            source,
        })?;
        vcpus.push(fd);
    }
    Ok(Vm {
        trace,
        sink,
        values,
        vcpu_start,
        vcpu_states: Arc::default(),
        stop: Arc::new(AtomicBool::new(false)),
        pio: Arc::new(pio),
        mmio: Arc::new(mmio),
        vcpus,
        _mem: mem,
        _vm: vm,
        _serial_irq: serial_irq,
    })
}
