//! The build from a template (docs/templates.md): instead of loading and
//! booting a guest, map the template's memory copy-on-write, write this
//! sandbox's boot info and app payload over it, restore the VM and vCPU
//! state, then attach this sandbox's devices as a boot does. The guest
//! resumes after its checkpoint; nothing of the boot path runs.

use std::sync::Arc;

use kvm_ioctls::Kvm;
use trace::{monotonic_ns, Stage, TraceWriter};

use super::{create_irqchip, create_vm, devices_of, finish, kvm_err, memory, read_inputs, Vm};
use crate::args::{TemplateMode, VmConfig};
use crate::error::Error;
use crate::snapshot::{state, Template};

pub fn build(
    cfg: &VmConfig,
    kvm: Kvm,
    spawn_start: u64,
    interrupted: &dyn Fn() -> Result<(), Error>,
) -> Result<Vm, Error> {
    let sb = cfg.sandbox.as_str();
    let Some(TemplateMode::Restore(dir)) = &cfg.template else {
        return Err(Error::InvalidArg {
            field: "--template",
            msg: "not a template restore".into(),
        });
    };
    let t = Template::load(dir)?;
    let bad = |msg: String| Error::Template {
        path: dir.clone(),
        msg,
    };
    if t.ram_size != cfg.ram_size {
        return Err(bad(format!(
            "made with --memory {} bytes, this sandbox asks for {}",
            t.ram_size, cfg.ram_size
        )));
    }
    let image = memory::agent_image_layout(cfg, None);
    let image_size = t.regions.iter().find(|r| r.name == "image").map(|r| r.size);
    if image_size != Some(image.size) {
        return Err(bad(format!(
            "its image region holds an app of up to {} bytes; --app-size {} needs another \
             (create the template with --app-size)",
            t.app_size, cfg.app_size
        )));
    }
    let devs = devices_of(cfg);
    let inputs = read_inputs(cfg, &devs)?;
    let trace = Arc::new(TraceWriter::new(sb, cfg.trace.as_deref())?);
    let vm = create_vm(sb, &kvm)?;
    trace.record(Stage::VmmSpawn, spawn_start, monotonic_ns())?;
    interrupted()?;

    let t0 = monotonic_ns();
    // A DMA window is this sandbox's own fresh region beside the template's
    // private copy-on-write memory: the only memory a VF maps.
    let window: Vec<_> = memory::window_spec(cfg).into_iter().collect();
    let mut mem = guestmem::GuestMemory::from_template_with(&t.region_files(dir), &window)
        .map_err(|source| Error::TemplateMemory {
            path: dir.clone(),
            source,
        })?;
    memory::register_slots(sb, &vm, &mem)?;
    let pages = super::devices::register_pages(cfg, &vm, &devs, mem.regions().len() as u32)?;
    create_irqchip(sb, &vm)?;
    let device_mem = memory::device_view(sb, &mem)?;
    let app_checksum = super::boot::write_sandbox_info(cfg, &mem, &devs, &image)?;
    let state_err = |source| Error::SnapshotState {
        sandbox: sb.to_string(),
        path: dir.clone(),
        source,
    };
    state::restore_vm(&vm, &t.vm).map_err(state_err)?;
    let fd = vm
        .create_vcpu(0)
        .map_err(kvm_err(sb, "KVM_CREATE_VCPU 0"))?;
    state::restore_vcpu(&fd, &t.vcpus[0]).map_err(state_err)?;
    trace.record(Stage::Restore, t0, monotonic_ns())?;
    memory::dma_map(cfg, &mut mem, &trace, interrupted)?;

    finish(
        cfg,
        &vm,
        mem,
        &device_mem,
        inputs.serial_out,
        app_checksum,
        trace,
        &devs,
        &pages,
        || Ok(vec![fd]),
    )
}
