//! Template creation and the KVM state probe: boot the built-in agent to
//! its checkpoint on this thread, complete the pending port write, then save
//! (or round-trip) every piece of state.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};

use super::state::{self, StateError};
use super::{Template, TemplateRegion, STATE_FILE, TEMPLATE_VERSION};
use crate::args::{TemplateMode, VmConfig};
use crate::builder::{self, Vm};
use crate::error::{Error, GuestFailure};
use crate::events::VmEvent;

/// Kicks the calling thread out of KVM_RUN once `deadline` has passed, until
/// dropped (the guest may `hlt` inside KVM for good).
struct Watchdog {
    _stop: mpsc::Sender<()>,
}

impl Watchdog {
    fn new(deadline: Instant) -> std::io::Result<Watchdog> {
        // SAFETY: pthread_self has no preconditions.
        let me = unsafe { libc::pthread_self() };
        let (tx, rx) = mpsc::channel::<()>();
        std::thread::Builder::new()
            .name("checkpoint-watchdog".into())
            .spawn(move || loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match rx.recv_timeout(left.max(Duration::from_millis(10))) {
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        // SAFETY: `me` runs until it drops the Watchdog, which
                        // disconnects the channel and ends this loop first.
                        unsafe { libc::pthread_kill(me, crate::vcpu::kick_signal()) };
                    }
                    _ => return,
                }
            })?;
        Ok(Watchdog { _stop: tx })
    }
}

fn guest_err(cfg: &VmConfig, failure: GuestFailure) -> Error {
    Error::Guest {
        sandbox: cfg.sandbox.clone(),
        failure,
    }
}

/// Runs vCPU 0 on this thread until an event `stop_at` accepts; every other
/// exit than port and MMIO I/O is an error (the agent does nothing else).
fn run_until(
    cfg: &VmConfig,
    vm: &Vm,
    fd: &mut VcpuFd,
    deadline: Instant,
    stop_at: impl Fn(&VmEvent) -> bool,
) -> Result<(), Error> {
    let _dog = Watchdog::new(deadline).map_err(builder::os_err(&cfg.sandbox, "watchdog thread"))?;
    loop {
        if Instant::now() >= deadline {
            return Err(guest_err(
                cfg,
                GuestFailure::Timeout {
                    secs: cfg.timeout_secs,
                    vcpus: "vCPU 0 before the template checkpoint".into(),
                },
            ));
        }
        match fd.run() {
            Ok(VcpuExit::IoOut(port, data)) => {
                vm.pio.write(port as u64, data);
            }
            Ok(VcpuExit::IoIn(port, data)) => {
                if !vm.pio.read(port as u64, data) {
                    data.fill(0xff);
                }
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                if !vm.mmio.read(addr, data) {
                    data.fill(0);
                }
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                vm.mmio.write(addr, data);
            }
            Ok(other) => {
                let what = format!("{other:?} before the template checkpoint");
                return Err(guest_err(
                    cfg,
                    GuestFailure::UnexpectedExit { vcpu: 0, what },
                ));
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {}
            Err(e) => {
                let what = format!("KVM_RUN failed: {e}");
                return Err(guest_err(
                    cfg,
                    GuestFailure::UnexpectedExit { vcpu: 0, what },
                ));
            }
        }
        for ev in vm.sink.drain() {
            if stop_at(&ev) {
                return Ok(());
            }
            match ev {
                VmEvent::Failure(f) => return Err(guest_err(cfg, f)),
                VmEvent::GuestExit(status) => {
                    return Err(guest_err(cfg, GuestFailure::Exit { status }))
                }
                _ => {}
            }
        }
    }
}

/// KVM finishes an `out` (advances RIP) only on the next KVM_RUN: run once
/// with immediate_exit so the saved state is after the instruction
/// (Firecracker does the same before it saves).
fn complete_pending_io(cfg: &VmConfig, fd: &mut VcpuFd) -> Result<(), Error> {
    fd.set_kvm_immediate_exit(1);
    let r = fd.run().map(|_| ()).map_err(|e| e.errno());
    fd.set_kvm_immediate_exit(0);
    match r {
        Err(libc::EINTR) => Ok(()),
        other => Err(guest_err(
            cfg,
            GuestFailure::UnexpectedExit {
                vcpu: 0,
                what: format!("KVM_RUN with immediate_exit returned {other:?}, expected EINTR"),
            },
        )),
    }
}

/// Builds the VM (boot info asks for the checkpoint) and runs it there.
fn boot_to_checkpoint(
    cfg: &VmConfig,
    t0: u64,
    interrupted: &dyn Fn() -> Result<(), Error>,
) -> Result<(Vm, VcpuFd), Error> {
    let kvm = builder::open_kvm(cfg)?;
    let mut vm = builder::build(cfg, kvm, t0, interrupted)?;
    let mut fd = vm.vcpus.pop().ok_or_else(|| Error::InvalidArg {
        field: "--vcpus",
        msg: "no vCPU".into(),
    })?;
    let deadline = Instant::now() + Duration::from_secs(cfg.timeout_secs.max(1));
    run_until(cfg, &vm, &mut fd, deadline, |e| *e == VmEvent::Checkpoint)?;
    complete_pending_io(cfg, &mut fd)?;
    Ok((vm, fd))
}

/// `--template-save` and `--template-probe`.
pub fn run(
    cfg: &VmConfig,
    t0: u64,
    interrupted: &dyn Fn() -> Result<(), Error>,
) -> Result<u8, Error> {
    match &cfg.template {
        Some(TemplateMode::Save(dir)) => {
            let (vm, fd) = boot_to_checkpoint(cfg, t0, interrupted)?;
            let t = save(cfg, &vm, &fd, dir)?;
            let pages: u64 = t.regions.iter().map(|r| r.data_pages).sum();
            println!(
                "template {}: saved at the checkpoint ({} MSRs, {pages} data pages)",
                dir.display(),
                t.vcpus[0].msrs.len()
            );
            Ok(0)
        }
        Some(TemplateMode::Probe) => probe(cfg, t0, interrupted),
        _ => Err(Error::InvalidArg {
            field: "--template",
            msg: "not a template save or probe".into(),
        }),
    }
}

/// Saves the paused VM into `dir` (a new directory): the memory files, then
/// the state file; made under a temporary name and renamed into place.
fn save(cfg: &VmConfig, vm: &Vm, fd: &VcpuFd, dir: &Path) -> Result<Template, Error> {
    let sb = cfg.sandbox.as_str();
    let state_err = |source: StateError| Error::SnapshotState {
        sandbox: sb.to_string(),
        path: dir.to_path_buf(),
        source,
    };
    if dir.exists() {
        return Err(Error::Template {
            path: dir.to_path_buf(),
            msg: "already exists".into(),
        });
    }
    let kvm = builder::open_kvm(cfg)?;
    let vcpu = state::save_vcpu(&kvm, fd).map_err(state_err)?;
    let vm_state = state::save_vm(vm.vm_fd()).map_err(state_err)?;

    let name = dir.file_name().unwrap_or_default().to_string_lossy();
    let tmp: PathBuf = dir.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let file_err = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::File { what, path, source }
    };
    std::fs::create_dir_all(&tmp).map_err(file_err("template directory", &tmp))?;
    let result = (|| {
        let mut regions = Vec::new();
        for r in vm.memory().regions() {
            let file = format!("{}.mem", r.name());
            let saved = guestmem::template::save_region(r, &tmp.join(&file)).map_err(|source| {
                Error::TemplateMemory {
                    path: dir.to_path_buf(),
                    source,
                }
            })?;
            regions.push(TemplateRegion {
                name: r.name().to_string(),
                gpa: r.gpa(),
                size: r.size(),
                file,
                data_pages: saved.data_pages,
            });
        }
        let t = Template {
            version: TEMPLATE_VERSION,
            agent_checksum: guest::checksum(guest::AGENT_IMAGE),
            ram_size: cfg.ram_size,
            app_size: cfg.app_size,
            regions,
            devices: Vec::new(),
            vm: vm_state,
            vcpus: vec![vcpu],
        };
        let json = serde_json::to_vec(&t).map_err(|source| Error::TemplateSerialize {
            path: dir.to_path_buf(),
            source,
        })?;
        let state = tmp.join(STATE_FILE);
        std::fs::write(&state, json).map_err(file_err("template state", &state))?;
        std::fs::rename(&tmp, dir).map_err(file_err("template directory", dir))?;
        Ok(t)
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

/// One line of the probe: a state, its get and its set (with the value the
/// get returned), each ok or the errno.
struct ProbeLine {
    what: &'static str,
    get: Result<(), i32>,
    set: Result<(), i32>,
}

fn errno(e: kvm_ioctls::Error) -> i32 {
    e.errno()
}

fn round_trip<T>(
    what: &'static str,
    get: impl FnOnce() -> Result<T, kvm_ioctls::Error>,
    set: impl FnOnce(&T) -> Result<(), kvm_ioctls::Error>,
) -> ProbeLine {
    match get() {
        Ok(v) => ProbeLine {
            what,
            get: Ok(()),
            set: set(&v).map_err(errno),
        },
        Err(e) => ProbeLine {
            what,
            get: Err(e.errno()),
            set: Err(0),
        },
    }
}

fn probe_lines(kvm: &Kvm, vm: &VmFd, fd: &VcpuFd) -> Vec<ProbeLine> {
    let mut out = Vec::new();
    for (what, id) in [
        ("irqchip PIC master", kvm_bindings::KVM_IRQCHIP_PIC_MASTER),
        ("irqchip PIC slave", kvm_bindings::KVM_IRQCHIP_PIC_SLAVE),
        ("irqchip IOAPIC", kvm_bindings::KVM_IRQCHIP_IOAPIC),
    ] {
        out.push(round_trip(
            what,
            || state::get_irqchip(vm, id),
            |c| vm.set_irqchip(c),
        ));
    }
    out.push(round_trip("pit2", || vm.get_pit2(), |p| vm.set_pit2(p)));
    out.push(round_trip(
        "clock",
        || vm.get_clock(),
        |c| {
            vm.set_clock(&kvm_bindings::kvm_clock_data {
                clock: c.clock,
                ..Default::default()
            })
        },
    ));
    out.push(round_trip(
        "cpuid2",
        || fd.get_cpuid2(KVM_MAX_CPUID_ENTRIES),
        |c| fd.set_cpuid2(c),
    ));
    out.push(round_trip(
        "mp_state",
        || fd.get_mp_state(),
        |m| fd.set_mp_state(*m),
    ));
    out.push(round_trip("regs", || fd.get_regs(), |r| fd.set_regs(r)));
    out.push(round_trip("sregs", || fd.get_sregs(), |s| fd.set_sregs(s)));
    out.push(round_trip("fpu", || fd.get_fpu(), |f| fd.set_fpu(f)));
    out.push(round_trip(
        "xsave",
        || fd.get_xsave(),
        // SAFETY: the legacy-size buffer KVM_GET_XSAVE filled.
        |x| unsafe { fd.set_xsave(x) },
    ));
    out.push(round_trip("xcrs", || fd.get_xcrs(), |x| fd.set_xcrs(x)));
    out.push(round_trip(
        "debugregs",
        || fd.get_debug_regs(),
        |d| fd.set_debug_regs(d),
    ));
    out.push(round_trip("lapic", || fd.get_lapic(), |l| fd.set_lapic(l)));
    out.push(round_trip(
        "msrs",
        || {
            state::get_msrs(kvm, fd)
                .map_err(|e| e.source)
                .map(|(m, _)| m)
        },
        |m| state::set_msrs(fd, m).map_err(|e| e.source),
    ));
    out.push(round_trip(
        "vcpu_events",
        || fd.get_vcpu_events(),
        |e| fd.set_vcpu_events(e),
    ));
    out
}

fn show(r: &Result<(), i32>) -> String {
    match r {
        Ok(()) => "ok".into(),
        Err(0) => "-".into(),
        Err(e) => format!("errno {e} ({})", std::io::Error::from_raw_os_error(*e)),
    }
}

/// Round-trips every state at the checkpoint, prints one line per state,
/// then lets the guest run on to READY: a set that silently broke the state
/// shows as a guest that never gets there.
fn probe(
    cfg: &VmConfig,
    t0: u64,
    interrupted: &dyn Fn() -> Result<(), Error>,
) -> Result<u8, Error> {
    let (vm, mut fd) = boot_to_checkpoint(cfg, t0, interrupted)?;
    let kvm = builder::open_kvm(cfg)?;
    let lines = probe_lines(&kvm, vm.vm_fd(), &fd);
    let (_, skipped) = state::get_msrs(&kvm, &fd).unwrap_or_default();
    let mut failed = 0;
    for l in &lines {
        failed += usize::from(l.get.is_err()) + usize::from(l.set.is_err());
        println!(
            "probe {:<20} get {:<30} set {}",
            l.what,
            show(&l.get),
            show(&l.set)
        );
    }
    if !skipped.is_empty() {
        let list: Vec<String> = skipped.iter().map(|i| format!("{i:#x}")).collect();
        println!(
            "probe msrs: {} listed by KVM_GET_MSR_INDEX_LIST cannot be read: {}",
            skipped.len(),
            list.join(",")
        );
    }
    let deadline = Instant::now() + Duration::from_secs(cfg.timeout_secs.max(1));
    let resumed = run_until(cfg, &vm, &mut fd, deadline, |e| *e == VmEvent::Ready);
    match &resumed {
        Ok(()) => println!("probe resume: READY after every set"),
        Err(e) => println!("probe resume: failed: {e}"),
    }
    println!("probe: {failed} failed call(s)");
    Ok(u8::from(failed > 0 || resumed.is_err()))
}
