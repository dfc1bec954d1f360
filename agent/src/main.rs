//! burstvm's guest agent (docs/guest.md, "The guest agent (Linux guests)"):
//! `/init` of the initramfs, PID 1 of the guest.
//!
//! BOOT → early mounts → container root (image, writable layer, overlay,
//! /etc files) and root switch → host name → network → vsock listeners →
//! READY → serve until the power-off rule fires → sync → EXIT → power off.
//! A failed step reports ERROR (its code) and powers off.

use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::time::Duration;

use agent::boot::{self, BootConfig, BootError};
use agent::port::{AgentPort, ErrorCode, Event};
use agent::{Agent, AgentConfig};
use anyhow::Context;

fn main() {
    let port = AgentPort::open();
    port.report(Event::Boot, 0);
    if !port.enabled() {
        eprintln!(
            "burstvm-agent: no agent port (ioperm refused: not under burstvm?): events skipped"
        );
    }
    if std::process::id() != 1 {
        eprintln!("burstvm-agent: not PID 1: run as a guest's /init (tests use the library)");
        std::process::exit(2);
    }
    let status = match run(&port) {
        Ok(status) => {
            eprintln!("burstvm-agent: powering off (status {status})");
            status
        }
        Err((code, e)) => {
            eprintln!("burstvm-agent: {e:#}");
            port.report(Event::Error, code as u32);
            power_off();
        }
    };
    nix::unistd::sync();
    port.report(Event::Exit, status as u32);
    power_off();
}

/// Whether the kernel runs under kvm_pvm: burstvm's VMM then adds the word `burstvm_kvm_pvm`
/// to its command line (vmm::linux::KVM_PVM_PARAM).
fn kvm_pvm() -> bool {
    std::fs::read_to_string("/proc/cmdline")
        .is_ok_and(|c| c.split_whitespace().any(|w| w == "burstvm_kvm_pvm"))
}

/// Ends the VM. burstvm's VMM offers no ACPI, so a power-off would only
/// halt the guest: the restart (`reboot=k`: an i8042 reset) is what ends a
/// burstvm VM, as Firecracker's guests end (docs/design.md, agent port).
fn power_off() -> ! {
    nix::unistd::sync();
    let e = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_AUTOBOOT);
    // Only reached when reboot failed: PID 1 must not exit (the kernel would panic).
    eprintln!("burstvm-agent: power off: {e:?}");
    loop {
        std::thread::park();
    }
}

type Failed = (ErrorCode, anyhow::Error);

fn step<T>(code: ErrorCode, what: &str, r: Result<T, BootError>) -> Result<T, Failed> {
    r.with_context(|| what.to_string()).map_err(|e| (code, e))
}

fn run(port: &AgentPort) -> Result<i32, Failed> {
    let cfg = step(ErrorCode::Config, "configuration", BootConfig::from_env())?;
    step(ErrorCode::Mount, "early mounts", boot::mounts::early())?;
    if let Some(image) = &cfg.ro {
        let newroot = step(
            ErrorCode::Mount,
            "container root",
            boot::mounts::container_root(&cfg, image),
        )?;
        if cfg.pod {
            step(
                ErrorCode::Mount,
                "pod layer",
                boot::mounts::keep_for_pod(&newroot),
            )?;
        }
        step(
            ErrorCode::Mount,
            "switch root",
            boot::mounts::switch_root(&newroot),
        )?;
    } else {
        eprintln!("burstvm-agent: no burstvm_ro: processes run in the initramfs");
    }
    if let Some(h) = &cfg.hostname {
        nix::unistd::sethostname(h)
            .with_context(|| format!("sethostname {h}"))
            .map_err(|e| (ErrorCode::Config, e))?;
    }
    port.report(Event::RootfsMounted, 0);
    step(
        ErrorCode::Network,
        "network",
        boot::net::configure(&cfg, Duration::from_secs(2)),
    )?;
    port.report(Event::NetConfigured, 0);
    // A pod's containers get roots of their own (`MountContainer`).
    let containers = cfg
        .pod
        .then(|| agent::pod::Roots(Arc::new(boot::containers::GuestRoots::new(cfg.clone()))));
    let agent: Arc<Agent> = Agent::new(AgentConfig {
        pod: cfg.pod,
        containers,
        drop_ioperm: port.enabled(),
        no_avx: kvm_pvm(),
        port: *port,
        ..AgentConfig::default()
    });
    match &cfg.unix_dir {
        None => {
            let control = step(
                ErrorCode::Vsock,
                "control listener",
                boot::vsock::VsockListener::bind(cfg.vsock_port),
            )?;
            let stdio = step(
                ErrorCode::Vsock,
                "stdio listener",
                boot::vsock::VsockListener::bind(cfg.stdio_port),
            )?;
            agent.serve_control(control);
            agent.serve_stdio(stdio);
            eprintln!(
                "burstvm-agent: ready (vsock ports {} and {})",
                cfg.vsock_port, cfg.stdio_port
            );
        }
        Some(dir) => {
            let bind = |name: &str| {
                std::fs::create_dir_all(dir)
                    .and_then(|()| UnixListener::bind(dir.join(name)))
                    .with_context(|| format!("listen on {}", dir.join(name).display()))
                    .map_err(|e| (ErrorCode::Vsock, e))
            };
            agent.serve_control(bind("control.sock")?);
            agent.serve_stdio(bind("stdio.sock")?);
            eprintln!("burstvm-agent: ready (Unix sockets in {})", dir.display());
        }
    }
    port.report(Event::Ready, 0);
    let off = agent.wait_power_off();
    eprintln!("burstvm-agent: {:?}", off.reason);
    Ok(off.status)
}
