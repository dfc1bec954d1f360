//! Step 3 of the build: guest memory (guestmem regions as KVM memory slots),
//! its DMA map, and the one vm-memory view the devices share.

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::VmFd;
use trace::{monotonic_ns, Stage, TraceWriter};
use vm_memory::{GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use super::kvm_err;
use crate::args::{BootSource, VmConfig};
use crate::error::Error;
use crate::layout::*;

pub(super) fn mem_err(sandbox: &str) -> impl Fn(guestmem::Error) -> Error + '_ {
    move |source| Error::Memory {
        sandbox: sandbox.to_string(),
        source,
    }
}

/// The image region of the built-in agent: the agent, the app payload and
/// (pmem mode) the EROFS image, each where the previous ends.
pub(super) struct ImageLayout {
    pub app_gpa: u64,
    /// (gpa, len) of the EROFS image in pmem mode.
    pub rootfs: Option<(u64, u64)>,
    pub size: u64,
}

pub(super) fn agent_image_layout(cfg: &VmConfig, pmem_len: Option<u64>) -> ImageLayout {
    let app_gpa = align_up(guest::LOAD_ADDR + guest::AGENT_IMAGE.len() as u64, 8);
    let rootfs = pmem_len.map(|len| (align_up(app_gpa + cfg.app_size, 4096), len));
    let end = rootfs.map_or(app_gpa + cfg.app_size, |(gpa, len)| gpa + len);
    ImageLayout {
        app_gpa,
        rootfs,
        size: align_up(end - IMAGE_ADDR, ALIGN_2M),
    }
}

fn region_specs(cfg: &VmConfig, image: &ImageLayout) -> Vec<guestmem::RegionSpec> {
    let mut specs = vec![guestmem::RegionSpec {
        name: "ram".into(),
        gpa: 0,
        size: cfg.ram_size,
        dma: cfg.dma_ram,
    }];
    if let BootSource::Agent = cfg.boot {
        specs.push(guestmem::RegionSpec {
            name: "image".into(),
            gpa: IMAGE_ADDR,
            size: image.size,
            dma: cfg.dma_image,
        });
    }
    specs.extend(window_spec(cfg));
    specs
}

/// The DMA window region of `--dma-window` (None without one): fresh for
/// every sandbox, booted or restored from a template.
pub(super) fn window_spec(cfg: &VmConfig) -> Option<guestmem::RegionSpec> {
    (cfg.dma_window > 0).then(|| guestmem::RegionSpec {
        name: "window".into(),
        gpa: DMA_WINDOW_ADDR,
        size: cfg.dma_window,
        dma: true,
    })
}

/// The regions (fresh or from the pool), each one a KVM memory slot over
/// its guest view.
pub(super) fn create_memory(
    cfg: &VmConfig,
    image: &ImageLayout,
    vm: &VmFd,
    interrupted: &dyn Fn() -> Result<(), Error>,
) -> Result<guestmem::GuestMemory, Error> {
    let sb = cfg.sandbox.as_str();
    let source = match &cfg.pool_socket {
        Some(p) => guestmem::MemorySource::Pool(
            guestmem::pool::PoolClient::connect(p).map_err(|e| mem_err(sb)(e.into()))?,
        ),
        None => guestmem::MemorySource::Fresh,
    };
    interrupted()?;
    let mem =
        guestmem::GuestMemory::new(&region_specs(cfg, image), cfg.policy, source, cfg.hugepages)
            .map_err(mem_err(sb))?;
    register_slots(sb, vm, &mem)?;
    Ok(mem)
}

/// Each region a KVM memory slot over its guest view.
pub(super) fn register_slots(
    sb: &str,
    vm: &VmFd,
    mem: &guestmem::GuestMemory,
) -> Result<(), Error> {
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
    Ok(())
}

/// The DMA map: the dma-ram / dma-image stages (absent for dma = false).
pub(super) fn dma_map(
    cfg: &VmConfig,
    mem: &mut guestmem::GuestMemory,
    trace: &TraceWriter,
    interrupted: &dyn Fn() -> Result<(), Error>,
) -> Result<(), Error> {
    for (name, stage) in [
        ("ram", Stage::DmaRam),
        ("image", Stage::DmaImage),
        ("window", Stage::DmaWindow),
    ] {
        if mem.regions().iter().any(|r| r.name() == name && r.dma()) {
            let t0 = monotonic_ns();
            interrupted()?;
            mem.dma_map(name).map_err(mem_err(&cfg.sandbox))?;
            trace.record(stage, t0, monotonic_ns())?;
        }
    }
    Ok(())
}

/// One vm-memory view of every region over guestmem's existing device
/// mapping, shared (cloned) by all devices: no mapping of its own.
///
/// The view does not own the memory: whoever holds a clone must also hold
/// the `Arc<GuestMemory>` (devices get both in `DeviceContext` and keep the
/// Arc for as long as they keep the view), so the mapping outlives it.
pub(super) fn device_view(sb: &str, mem: &guestmem::GuestMemory) -> Result<GuestMemoryMmap, Error> {
    let view_err = |what: String| {
        let sandbox = sb.to_string();
        move |source: Box<dyn std::error::Error + Send + Sync>| Error::MemoryView {
            sandbox,
            what,
            source,
        }
    };
    let mut regions: Vec<&guestmem::Region> = mem.regions().iter().collect();
    regions.sort_by_key(|r| r.gpa());
    let mut out = Vec::with_capacity(regions.len());
    for r in regions {
        // SAFETY: the device view is a MAP_SHARED read/write mapping of
        // `r.size()` bytes that stays mapped while the GuestMemory lives,
        // and every holder of this view holds that GuestMemory (see above);
        // a raw region never unmaps what it points at.
        let raw = unsafe {
            MmapRegion::build_raw(
                r.device_view_ptr(),
                r.size() as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
            )
        }
        .map_err(|e| view_err(format!("region {}", r.name()))(e.into()))?;
        let region = GuestRegionMmap::new(raw, GuestAddress(r.gpa())).ok_or_else(|| {
            view_err(format!("region {}", r.name()))("wraps the address space".into())
        })?;
        out.push(region);
    }
    GuestMemoryMmap::from_regions(out).map_err(|e| view_err("regions".into())(e.into()))
}

/// Starts the lazy policy's background zeroer (a no-op for other policies or
/// when it already runs); with `idle_cgroup`, its thread first moves itself
/// into that cgroup (`VmParams::idle_cgroup`). A refused move leaves it where
/// it is, at SCHED_IDLE in the VMM's cgroup, with a warning.
pub(crate) fn start_background_zeroing(
    mem: &guestmem::GuestMemory,
    idle_cgroup: Option<&std::path::Path>,
) -> Result<(), guestmem::Error> {
    let Some(dir) = idle_cgroup else {
        return mem.start_lazy_zeroing_shared();
    };
    let tasks = dir.join("tasks");
    mem.start_lazy_zeroing_with(Box::new(move || {
        // "0" is the writing thread itself. Named by its tid, the move would
        // also take the kernel's global lock against forks and exits
        // (cgroup_threadgroup_rwsem, for write), which every fork on the
        // host then waits for; ~4 µs more per move here.
        if let Err(e) = std::fs::write(&tasks, "0") {
            tracing::warn!(
                "background zeroer: cannot join the idle cgroup {}: {e}; it stays in the VMM's",
                tasks.display()
            );
        }
    }))
}
