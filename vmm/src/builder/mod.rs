//! Assembles a VM from a validated `VmConfig` in Firecracker's steps:
//! read the inputs, create the VM, create the memory, load the guest,
//! attach the devices, create the vCPUs. `build` calls them in order; each
//! step fails with an error that names the sandbox and what failed.

mod boot;
mod devices;
mod memory;
mod restore;

pub use restore::build as restore;

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use kvm_bindings::{kvm_pit_config, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use trace::{monotonic_ns, Stage, TraceWriter};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use crate::args::{BootSource, VmConfig};
use crate::bootinfo::{DevEntry, VIRTIO_ID_BLOCK, VIRTIO_ID_NET};
use crate::bus::Bus;
use crate::devices::agent_port::RootfsExpect;
use crate::error::{Error, GuestFailure};
use crate::events::{EventSink, VmEvent};
use crate::layout::*;
use crate::linux::LoadedKernel;
use crate::x86::{self, EntryMode};
use virtio_bindings::virtio_ids::VIRTIO_ID_RNG;

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
    // Held only to be dropped after the vCPU threads stopped (Vm outlives
    // them), in this order: devices first (the buses above: tap,
    // vhost-user), then memory (back to the pool), then KVM.
    _memory: Arc<guestmem::GuestMemory>,
    _vm: Arc<VmFd>,
    _serial_irq: EventFd,
    /// Removes the `--vsock` socket file when the VM goes, even if a vCPU
    /// thread that never stopped still holds the device.
    _vsock_socket: Option<crate::virtio::vsock::SocketFile>,
    /// Removes the `--api` socket file with the VM.
    _api_socket: Option<crate::virtio::vsock::SocketFile>,
}

impl Vm {
    /// For the template code (snapshot/): the memory and the VM to save.
    pub(crate) fn memory(&self) -> &Arc<guestmem::GuestMemory> {
        &self._memory
    }

    pub(crate) fn vm_fd(&self) -> &Arc<VmFd> {
        &self._vm
    }

    /// The lazy policy's counters (all zero under the other policies).
    pub fn lazy_stats(&self) -> guestmem::LazyStats {
        self._memory.lazy_stats()
    }

    /// Starts the lazy policy's background zeroer (a no-op for other
    /// policies or when it already runs): at READY for built-in agent guests.
    pub fn start_background_zeroing(
        &self,
        idle_cgroup: Option<&std::path::Path>,
    ) -> Result<(), guestmem::Error> {
        memory::start_background_zeroing(&self._memory, idle_cgroup)
    }

    /// Runs `hook` once the background zeroer has ended (on its thread), at
    /// once if it has or there is nothing to zero lazily.
    pub fn on_background_zeroing_end(&self, hook: guestmem::ZeroerHook) {
        self._memory.on_zeroing_end(hook);
    }
}

pub(crate) fn kvm_err(
    sandbox: &str,
    what: impl Into<String>,
) -> impl FnOnce(kvm_ioctls::Error) -> Error + '_ {
    let what = what.into();
    move |source| Error::Kvm {
        sandbox: sandbox.to_string(),
        what,
        source,
    }
}

pub(crate) fn os_err(sandbox: &str, what: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    let sandbox = sandbox.to_string();
    move |source| Error::Os {
        sandbox,
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

/// The virtio-mmio devices in slot order: network devices, then disks,
/// then the vsock device, then the entropy device. The Linux command line gets one
/// `virtio_mmio.device=` per entry (`read_inputs`), the boot info lists them.
fn devices_of(cfg: &VmConfig) -> Vec<DevEntry> {
    let types = cfg
        .net
        .iter()
        .map(|n| match n {
            crate::devspec::NetBackend::Sg(_) => sgiov::layout::VIRTIO_DEVICE_ID,
            _ => VIRTIO_ID_NET,
        })
        .chain(cfg.disks.iter().map(|_| VIRTIO_ID_BLOCK))
        .chain(
            cfg.vsock
                .iter()
                .map(|_| crate::virtio::vsock::VIRTIO_ID_VSOCK),
        )
        .chain(cfg.entropy.then_some(VIRTIO_ID_RNG));
    types
        .enumerate()
        .map(|(i, virtio_type)| DevEntry {
            mmio_base: virtio_mmio_base(i),
            gsi: virtio_gsi(i),
            virtio_type,
        })
        .collect()
}

/// What the build reads from files, before anything else exists.
struct Inputs {
    linux: Option<LoadedKernel>,
    serial_out: Box<dyn Write + Send>,
    /// The pmem-mode EROFS image, open, and its length.
    pmem: Option<(std::fs::File, u64)>,
}

/// The pmem-mode EROFS image: opened and sized before anything is built.
fn open_pmem(cfg: &VmConfig) -> Result<Option<(std::fs::File, u64)>, Error> {
    let Some(p) = &cfg.rootfs_pmem else {
        return Ok(None);
    };
    let file_err = |source| Error::File {
        what: "--rootfs-pmem image",
        path: p.clone(),
        source,
    };
    let f = std::fs::File::open(p).map_err(file_err)?;
    let len = f.metadata().map_err(file_err)?.len();
    let room = MAX_IMAGE - memory::agent_image_layout(cfg, Some(0)).size;
    if len == 0 || len > room {
        return Err(Error::InvalidArg {
            field: "--rootfs-pmem",
            msg: format!(
                "{}: {len} bytes; the image region has room for 1..{room}",
                p.display()
            ),
        });
    }
    Ok(Some((f, len)))
}

/// Step 1: everything read from files comes first, so bad input fails
/// before any memory or device exists.
fn read_inputs(cfg: &VmConfig, devs: &[DevEntry]) -> Result<Inputs, Error> {
    let linux = match &cfg.boot {
        BootSource::Linux {
            kernel,
            initrd,
            cmdline,
        } => {
            let slots: Vec<(u64, u32)> = devs.iter().map(|d| (d.mmio_base, d.gsi)).collect();
            // burstvm's Linux init reads the file to check from its environment.
            let cmdline = match (&cfg.rootfs_check, cmdline) {
                (Some((f, _)), Some(c)) => Some(format!("{c} burstvm_check={f}")),
                (Some((f, _)), None) => Some(format!(
                    "{} burstvm_check={f}",
                    crate::linux::DEFAULT_CMDLINE
                )),
                (None, c) => c.clone(),
            };
            let window = (cfg.dma_window > 0).then_some((DMA_WINDOW_ADDR, cfg.dma_window));
            let cl = crate::linux::build_cmdline(cmdline.as_deref(), &slots, window)
                .map_err(|source| Error::Cmdline { source })?;
            Some(crate::linux::probe(
                kernel,
                initrd.as_deref(),
                &cl,
                cfg.ram_size,
                window,
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
    Ok(Inputs {
        linux,
        serial_out,
        pmem: open_pmem(cfg)?,
    })
}

/// Step 2: the KVM VM. Its irqchip and PIT come after the memory slots
/// (`create_irqchip`).
fn create_vm(sb: &str, kvm: &Kvm) -> Result<Arc<VmFd>, Error> {
    let vm = kvm.create_vm().map_err(kvm_err(sb, "KVM_CREATE_VM"))?;
    vm.set_tss_address(KVM_TSS_ADDR as usize)
        .map_err(kvm_err(sb, "KVM_SET_TSS_ADDR"))?;
    vm.set_identity_map_address(KVM_IDENTITY_MAP_ADDR)
        .map_err(kvm_err(sb, "KVM_SET_IDENTITY_MAP_ADDR"))?;
    Ok(Arc::new(vm))
}

/// The in-kernel irqchip and PIT, once every memory slot is in place (as
/// Firecracker orders them): a slot set after KVM_CREATE_IRQCHIP waits for
/// a full SRCU grace period, 3-11 ms of wall time per VM on this host
/// (docs/vmm.md "Memory slots before the irqchip").
fn create_irqchip(sb: &str, vm: &VmFd) -> Result<(), Error> {
    vm.create_irq_chip()
        .map_err(kvm_err(sb, "KVM_CREATE_IRQCHIP"))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit)
        .map_err(kvm_err(sb, "KVM_CREATE_PIT2"))?;
    Ok(())
}

/// Step 6: the vCPUs, configured to enter the guest at `entry`.
fn create_vcpus(
    cfg: &VmConfig,
    kvm: &Kvm,
    vm: &VmFd,
    entry: EntryMode,
) -> Result<Vec<VcpuFd>, Error> {
    let sb = cfg.sandbox.as_str();
    let base_cpuid = match &cfg.supported_cpuid {
        Some(path) => {
            crate::supported_cpuid::read(path).map_err(|source| Error::SupportedCpuid {
                sandbox: sb.to_string(),
                source,
            })?
        }
        None => kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm_err(sb, "KVM_GET_SUPPORTED_CPUID"))?,
    };
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
    Ok(vcpus)
}

/// Builds the VM. `interrupted` is polled between the long steps; its
/// error aborts the build.
pub fn build(
    cfg: &VmConfig,
    kvm: Kvm,
    spawn_start: u64,
    interrupted: &dyn Fn() -> Result<(), Error>,
) -> Result<Vm, Error> {
    let sb = cfg.sandbox.as_str();
    let devs = devices_of(cfg);
    let inputs = read_inputs(cfg, &devs)?;
    let trace = Arc::new(TraceWriter::new(sb, cfg.trace.as_deref())?);

    let image = memory::agent_image_layout(cfg, inputs.pmem.as_ref().map(|p| p.1));
    let vm = create_vm(sb, &kvm)?;
    let mut mem = memory::create_memory(cfg, &image, &vm, interrupted)?;
    let pages = devices::register_pages(cfg, &vm, &devs, mem.regions().len() as u32)?;
    create_irqchip(sb, &vm)?;
    trace.record(Stage::VmmSpawn, spawn_start, monotonic_ns())?;
    memory::dma_map(cfg, &mut mem, &trace, interrupted)?;

    let device_mem = memory::device_view(sb, &mem)?;
    let guest = boot::load_guest(cfg, &mem, inputs.linux, &device_mem, &devs, &image)?;
    if let (Some((f, len)), Some((gpa, _))) = (&inputs.pmem, image.rootfs) {
        boot::load_pmem_image(cfg, &mem, f, *len, gpa, &trace)?;
    }
    drop(inputs.pmem);
    interrupted()?;
    // The built-in agent reports READY, and its background zeroer starts
    // then (`Vm::start_background_zeroing`): until READY only what the guest
    // or a device touches is zeroed (on fault, before device access), so a
    // start's CPU is the start's own and the rest of RAM is zeroed after it.
    if !matches!(cfg.boot, BootSource::Agent) {
        memory::start_background_zeroing(&mem, cfg.idle_cgroup.as_deref())
            .map_err(memory::mem_err(sb))?;
    }
    let make_vcpus = || {
        interrupted()?;
        create_vcpus(cfg, &kvm, &vm, guest.entry)
    };
    finish(
        cfg,
        &vm,
        mem,
        &device_mem,
        inputs.serial_out,
        guest.app_checksum,
        trace,
        &devs,
        &pages,
        make_vcpus,
    )
}

/// The last steps, shared with the template restore: devices over the
/// memory (`device_mem` is its device view), then the vCPUs (`make_vcpus`), then the `Vm`.
#[allow(clippy::too_many_arguments)]
fn finish(
    cfg: &VmConfig,
    vm: &Arc<VmFd>,
    mem: guestmem::GuestMemory,
    device_mem: &GuestMemoryMmap,
    serial_out: Box<dyn Write + Send>,
    app_checksum: u32,
    trace: Arc<TraceWriter>,
    devs: &[DevEntry],
    pages: &[Option<Arc<crate::virtio::RegisterPage>>],
    make_vcpus: impl FnOnce() -> Result<Vec<VcpuFd>, Error>,
) -> Result<Vm, Error> {
    let sb = cfg.sandbox.as_str();
    let mem = Arc::new(mem);
    let sink = Arc::new(EventSink::new().map_err(os_err(sb, "eventfd"))?);
    {
        let sink = sink.clone();
        // The failure is a report (an exit line): flattened here.
        mem.set_lazy_error_callback(Box::new(move |e| {
            sink.post(VmEvent::Failure(GuestFailure::MemoryHandler(e.to_string())))
        }));
    }

    // The marker is the built-in agent's and burstvm init's proof of the
    // writable layer; a Linux guest booted from an initramfs (the guest
    // agent) mounts the layers itself and reports ROOTFS_MOUNTED instead.
    let from_initrd = matches!(
        &cfg.boot,
        BootSource::Linux {
            initrd: Some(_),
            ..
        }
    );
    let rootfs = RootfsExpect {
        file: cfg.rootfs_check.clone(),
        marker: cfg.disks.iter().any(|d| !d.read_only) && !from_initrd,
    };
    let sg = cfg
        .agent_mode
        .is_sg()
        .then(|| crate::devices::agent_port::SgExpect {
            pipes: cfg.sg_pipes,
            checksum: match cfg.agent_mode {
                crate::args::AgentMode::SgSend | crate::args::AgentMode::SgRecv => {
                    crate::bootinfo::sg_checksum_seeded(cfg.sg_port, cfg.sg_pipes, cfg.sg_bytes)
                }
                _ => crate::bootinfo::sg_checksum(&cfg.sandbox, cfg.sg_pipes, cfg.sg_bytes),
            },
        });
    let expect = devices::AgentExpect {
        app_checksum,
        rootfs,
        sg,
    };
    let legacy = devices::attach_legacy_devices(sb, vm, serial_out, expect, &trace, &sink)?;
    let d = devices::MmioDevices {
        cfg,
        vm,
        mem: &mem,
        device_mem,
        trace: &trace,
        devs,
        pages,
    };
    let mut mmio = devices::attach_net_devices(&d)?;
    let disk_slots = devices::attach_disks(&d, &mut mmio)?;
    let vsock_socket = devices::attach_vsock(&d, &mut mmio)?;
    devices::attach_entropy(&d, &mut mmio)?;
    let api_socket = devices::serve_api(cfg, disk_slots)?;

    let vcpus = make_vcpus()?;
    Ok(Vm {
        trace,
        sink,
        values: legacy.values,
        vcpu_start: legacy.vcpu_start,
        vcpu_states: Arc::default(),
        stop: Arc::new(AtomicBool::new(false)),
        pio: Arc::new(legacy.pio),
        mmio: Arc::new(mmio),
        vcpus,
        _memory: mem,
        _vm: vm.clone(),
        _serial_irq: legacy.serial_irq,
        _vsock_socket: vsock_socket,
        _api_socket: api_socket,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::VmParams;

    fn params() -> VmParams {
        VmParams {
            kernel: Some("/vmlinux".into()),
            net: vec!["tap:t0".parse().unwrap()],
            disk: vec!["path=/img,ro".parse().unwrap()],
            vsock: Some("/run/sb1.vsock".into()),
            ..VmParams::new("sb1")
        }
    }

    /// The vsock device takes the slot after the disks, so the Linux
    /// command line's `virtio_mmio.device=` list covers it like the others.
    #[test]
    fn vsock_takes_the_slot_after_the_disks() {
        let cfg = VmConfig::from_params(&params()).unwrap();
        let devs = devices_of(&cfg);
        let types: Vec<u32> = devs.iter().map(|d| d.virtio_type).collect();
        assert_eq!(types, [VIRTIO_ID_NET, VIRTIO_ID_BLOCK, 19]);
        assert_eq!((devs[2].mmio_base, devs[2].gsi), (0xd000_2000, 7));
        let slots: Vec<(u64, u32)> = devs.iter().map(|d| (d.mmio_base, d.gsi)).collect();
        let cl = crate::linux::build_cmdline(None, &slots, None).unwrap();
        let s = cl.as_cstring().unwrap().into_string().unwrap();
        assert!(s.contains("virtio_mmio.device=4K@0xd0002000:7"), "{s}");
        // Templates carry no devices: a vsock device is refused there too.
        let mut p = params();
        p.kernel = None;
        p.net.clear();
        p.disk.clear();
        p.template_save = Some("/tmp/t".into());
        let e = VmConfig::from_params(&p).unwrap_err().to_string();
        assert!(e.contains("no devices"), "{e}");
    }

    /// The entropy device takes the last slot, after vsock; only a Linux
    /// guest may have it.
    #[test]
    fn entropy_takes_the_last_slot_and_needs_a_kernel() {
        let mut p = params();
        p.entropy = true;
        let devs = devices_of(&VmConfig::from_params(&p).unwrap());
        let types: Vec<u32> = devs.iter().map(|d| d.virtio_type).collect();
        assert_eq!(types, [VIRTIO_ID_NET, VIRTIO_ID_BLOCK, 19, VIRTIO_ID_RNG]);
        assert_eq!((devs[3].mmio_base, devs[3].gsi), (0xd000_3000, 8));
        p.kernel = None;
        let e = VmConfig::from_params(&p).unwrap_err().to_string();
        assert!(e.contains("--entropy"), "{e}");
    }
}
