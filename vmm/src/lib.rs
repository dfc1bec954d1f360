//! `burstvm vmm`: one KVM microVM per process (Firecracker's model). The
//! builder assembles the VM from a validated config; the main thread then
//! waits for the guest agent's READY, a failure, a signal or the timeout.
//! See docs/vmm.md.

pub mod api;
mod app;
pub mod args;
mod bootinfo;
mod builder;
pub mod bus;
mod coalesced;
mod config;
mod devices;
pub mod devspec;
mod error;
mod events;
#[doc(hidden)]
pub mod fuzz;
mod launch;
mod layout;
mod linux;
mod mptable;
mod snapshot;
pub mod supported_cpuid;
pub mod tiny_guest;
mod vcpu;
pub mod virtio;
mod x86;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

pub use args::{AgentMode, SgXf, VmConfig, VmParams};
pub use bus::{BusDevice, DeviceContext};
pub use devspec::{DiskSpec, NetBackend, VfInit, VsockSpec};
pub use error::{Error, GuestFailure};
/// The line the VMM writes to `--ready-fd` at READY.
pub use launch::{Ready, ZEROED_LINE};
/// Where `--dma-window` places the window (the built-in agent's device pages).
pub use layout::DMA_WINDOW_ADDR;
/// Whether this host's KVM is kvm_pvm (guests get its kernel parameters).
pub use linux::host_is_kvm_pvm;

use events::VmEvent;

/// Start of the `vmm-spawn` stage: the spawner's timestamp if it passed one.
fn spawn_start() -> u64 {
    let now = trace::monotonic_ns();
    std::env::var("BURSTVM_SPAWN_NS")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .filter(|&t| t > 0 && t <= now)
        .unwrap_or(now)
}

/// Runs one microVM until READY (or until stopped with --keep-running, or
/// until the guest's EXIT with --until-exit). Returns the process exit
/// status: 0, or the guest's EXIT status (low 8 bits) with --until-exit.
pub fn run_cli(args: &VmParams) -> Result<u8, Error> {
    let t0 = spawn_start();
    let cfg = VmConfig::from_params(args)?;
    let os_err = |what: &'static str| {
        let sandbox = cfg.sandbox.clone();
        move |e: nix::Error| Error::Os {
            sandbox,
            what,
            source: std::io::Error::from(e),
        }
    };
    // Termination signals go to a signalfd; blocked before any thread
    // exists so that every thread inherits the mask.
    let mut sigs = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        sigs.add(s);
    }
    sigs.thread_block()
        .map_err(os_err("blocking termination signals"))?;
    let sigfd = SignalFd::with_flags(&sigs, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .map_err(os_err("signalfd"))?;
    vcpu::install_kick_handler().map_err(|source| Error::Os {
        sandbox: cfg.sandbox.clone(),
        what: "vCPU kick signal handler",
        source,
    })?;

    let kvm = builder::open_kvm(&cfg)?;
    // A termination signal while the VM is being built stops the build at
    // the next step (a DMA map of GiBs takes a while).
    let interrupted = || match take_signal(&sigfd) {
        Some(signal) => Err(Error::Guest {
            sandbox: cfg.sandbox.clone(),
            failure: GuestFailure::Terminated { signal },
        }),
        None => Ok(()),
    };
    let vm = match &cfg.template {
        None => builder::build(&cfg, kvm, t0, &interrupted)?,
        Some(args::TemplateMode::Restore(_)) => builder::restore(&cfg, kvm, t0, &interrupted)?,
        Some(_) => {
            drop(kvm);
            return snapshot::create::run(&cfg, t0, &interrupted);
        }
    };
    run_vm(&cfg, vm, &sigfd)
}

fn run_vm(cfg: &VmConfig, mut vm: builder::Vm, sigfd: &SignalFd) -> Result<u8, Error> {
    let sb = cfg.sandbox.clone();
    // Devices registered their coalesced zones on the same capability
    // (virtio::KvmWiring): the ring must then be drained, so no ring, no VM.
    let coalesced = match (coalesced::page_offset(vm.vm_fd()), vm.vcpus.first()) {
        (Some(off), Some(fd)) => Some(std::sync::Arc::new(std::sync::Mutex::new(
            coalesced::Ring::map(fd, off).map_err(|e| Error::Os {
                sandbox: sb.clone(),
                what: "mapping the coalesced MMIO ring",
                source: std::io::Error::from_raw_os_error(e.errno()),
            })?,
        ))),
        _ => None,
    };
    let mut threads = vcpu::VcpuThreads::new();
    for (id, fd) in vm.vcpus.drain(..).enumerate() {
        let v = vcpu::Vcpu {
            id: id as u8,
            fd,
            pio: vm.pio.clone(),
            mmio: vm.mmio.clone(),
            coalesced: coalesced.clone(),
            sink: vm.sink.clone(),
            stop: vm.stop.clone(),
            start_ns: vm.vcpu_start.clone(),
            last_state: vm.vcpu_states.clone(),
            done: threads.done_sender(),
        };
        match v.spawn() {
            Ok(t) => threads.push(t),
            Err(source) => {
                vcpu::stop_all(&vm.stop, threads, Duration::from_secs(2));
                return Err(Error::Os {
                    sandbox: sb,
                    what: "spawning a vCPU thread",
                    source,
                });
            }
        }
    }

    let outcome = wait(cfg, &vm, &threads, sigfd);

    let stuck = vcpu::stop_all(&vm.stop, threads, Duration::from_secs(2));
    if stuck > 0 {
        tracing::warn!("sandbox {sb}: {stuck} vCPU thread(s) did not stop; exiting anyway");
    }
    // A guest that never got ready: say where its vCPUs were (a `cli; hlt`
    // blocks inside KVM with the in-kernel irqchip and never exits).
    let outcome = match outcome {
        Err(GuestFailure::Timeout { secs, .. }) => {
            let mut states = vm
                .vcpu_states
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            states.sort();
            let vcpus = states
                .iter()
                .map(|(id, s)| format!("vCPU {id} {s}"))
                .collect::<Vec<_>>()
                .join("; ");
            Err(GuestFailure::Timeout { secs, vcpus })
        }
        other => other,
    };
    let values = vm.values.lock().unwrap_or_else(|e| e.into_inner()).clone();
    for (i, v) in values.iter().enumerate() {
        println!("value {i} {v:#010x}");
    }
    let status = outcome.map_err(|failure| Error::Guest {
        sandbox: sb.clone(),
        failure,
    })?;
    if cfg.until_exit {
        println!("sandbox {sb}: guest exited with status {status}");
    }
    Ok(status as u8)
}

/// The main loop: guest events, signals and the READY deadline. Returns the
/// guest's EXIT status under --until-exit, else 0.
fn wait(
    cfg: &VmConfig,
    vm: &builder::Vm,
    threads: &vcpu::VcpuThreads,
    sigfd: &SignalFd,
) -> Result<u32, GuestFailure> {
    let deadline =
        (cfg.timeout_secs > 0).then(|| Instant::now() + Duration::from_secs(cfg.timeout_secs));
    let mut ready = false;
    loop {
        let timeout = match (ready, deadline) {
            (false, Some(d)) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(GuestFailure::Timeout {
                        secs: cfg.timeout_secs,
                        vcpus: String::new(),
                    });
                }
                PollTimeout::try_from(left.as_millis().min(60_000) as i32 + 1)
                    .unwrap_or(PollTimeout::MAX)
            }
            _ => PollTimeout::NONE,
        };
        let mut fds = [
            PollFd::new(sigfd.as_fd(), PollFlags::POLLIN),
            PollFd::new(vm.sink.wake_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, timeout) {
            Ok(_) | Err(nix::Error::EINTR) => {}
            Err(e) => {
                return Err(GuestFailure::UnexpectedExit {
                    vcpu: 0,
                    what: format!("poll in the VMM main loop failed: {e}"),
                })
            }
        }
        if let Some(signal) = take_signal(sigfd) {
            if ready {
                return Ok(0);
            }
            return Err(GuestFailure::Terminated { signal });
        }
        for ev in vm.sink.drain() {
            match ev {
                VmEvent::Ready if !ready => {
                    ready = true;
                    let lazy = vm.lazy_stats();
                    if lazy != guestmem::LazyStats::default() {
                        tracing::info!(
                            "sandbox {}: lazy zeroing at READY: {} userfaults ({} pages \
                             zeroed), {} blocks mapped ahead ({} pages zeroed)",
                            cfg.sandbox,
                            lazy.faults,
                            lazy.fault_zeroed,
                            lazy.instant_mapped,
                            lazy.instant_zeroed
                        );
                    }
                    if let Err(e) = vm.start_background_zeroing(cfg.idle_cgroup.as_deref()) {
                        return Err(GuestFailure::MemoryHandler(e.to_string()));
                    }
                    print!("{}", vm.trace.summary());
                    if let Some(fd) = cfg.ready_fd {
                        let vcpu_ns = threads.cpu_ns();
                        notify_ready(fd, Ready { vcpu_ns });
                        // A parent that has closed its end gets nothing: the
                        // write fails with EPIPE (SIGPIPE is ignored).
                        vm.on_background_zeroing_end(Box::new(move || {
                            write_line(fd, ZEROED_LINE);
                        }));
                    }
                    if !cfg.keep_running && !cfg.until_exit {
                        return Ok(0);
                    }
                }
                VmEvent::Ready => {}
                // A task (--until-exit) ends with its guest, with the guest's status.
                VmEvent::GuestExit(status) if ready && cfg.until_exit => return Ok(status),
                // After READY the agent ends with EXIT 0; with --keep-running
                // the VM stays (idle) until a signal.
                VmEvent::GuestExit(0) if ready => {}
                VmEvent::GuestExit(0) if !cfg.probe.is_empty() => return Ok(0),
                VmEvent::GuestExit(status) => return Err(GuestFailure::Exit { status }),
                VmEvent::Reset => {
                    println!(
                        "sandbox {}: guest reset the machine (i8042 reset command)",
                        cfg.sandbox
                    );
                    return Ok(0);
                }
                VmEvent::Failure(f) => return Err(f),
                // Only a template save or probe asks for the checkpoint
                // (snapshot::create runs those VMs itself).
                VmEvent::Checkpoint => {}
            }
        }
    }
}

/// The name of a pending termination signal, consuming it.
fn take_signal(sigfd: &SignalFd) -> Option<String> {
    let si = sigfd.read_signal().ok().flatten()?;
    Some(
        Signal::try_from(si.ssi_signo as i32)
            .map(|s| s.as_str().to_string())
            .unwrap_or_else(|_| format!("signal {}", si.ssi_signo)),
    )
}

fn notify_ready(fd: i32, ready: Ready) {
    if !write_line(fd, &ready.line()) {
        tracing::warn!("--ready-fd {fd}: {}", std::io::Error::last_os_error());
    }
}

/// One write of `line` to `fd` (a pipe: whole, up to PIPE_BUF); whether it went.
fn write_line(fd: i32, line: &str) -> bool {
    let msg = line.as_bytes();
    // SAFETY: writes from a valid buffer to a descriptor validated at startup.
    let n = unsafe { libc::write(fd, msg.as_ptr().cast(), msg.len()) };
    n == msg.len() as isize
}
