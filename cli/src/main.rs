//! The `burstvm` binary: a thin clap dispatcher over the library crates.

use anyhow::Context;
use clap::{Parser, Subcommand};

mod cmd;
mod cri;
mod cri_bench;
mod cri_image_bench;
mod memory_bench;
mod pool;
mod rootfs_build;
mod vmm_bench;

#[derive(Parser)]
#[command(
    name = "burstvm",
    version,
    about = "Secure-container runtime: every sandbox a KVM microVM"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one microVM (one process per sandbox).
    Vmm(Box<burstvm::args::vmm::VmmArgs>),
    /// Run the software SR-IOV NIC daemon.
    Nic(cmd::nic::NicArgs),
    /// Run a standalone page-pool server for VMMs started by hand.
    Pool(pool::PoolArgs),
    /// Create one sandbox through every startup stage; with --kernel, run a
    /// container image's process in it (stdio, exit status).
    Run(cmd::runtime::RunArgs),
    /// Run a further process in a running container sandbox (`run --kernel --keep-running`).
    Exec(cmd::runtime::ExecArgs),
    /// Root filesystems (RunD's read-only layer).
    #[command(subcommand)]
    Rootfs(RootfsCommand),
    /// Run the host-wide services the containerd shim attaches to.
    Services(cmd::runtime::ServicesArgs),
    /// A CRI client for containerd's CRI plugin (crictl's pod and container commands).
    Cri(cri::CriArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// MicroVM templates (RunD §4.3): create one, probe the KVM state calls.
    #[command(subcommand)]
    Template(TemplateCommand),
}

#[derive(Subcommand)]
enum TemplateCommand {
    /// Boot the built-in agent to its checkpoint and save it as NAME.
    Create(cmd::runtime::TemplateCreateArgs),
    /// Save and restore each KVM state at the checkpoint; report which fail.
    Probe(cmd::runtime::TemplateProbeArgs),
}

#[derive(Subcommand)]
enum RootfsCommand {
    /// Build the EROFS image of a container image (cached by digest).
    Build(rootfs_build::BuildArgs),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Concurrent sandbox startup, per variant (FastIOV's evaluation).
    Startup(Box<cmd::runtime::BenchStartupArgs>),
    /// DMA-map and first-touch cost of each memory policy.
    Memory(memory_bench::MemoryBenchArgs),
    /// Concurrent VF opens under each devset lock policy.
    Devset(cmd::nic::BenchDevsetArgs),
    /// The VF switch's CPU cycles per packet under a poll-mode frontend (ixy's count).
    Dataplane(cmd::nic::BenchDataplaneArgs),
    /// The outage of running sandboxes when the NIC daemon is killed and restarted.
    NicRestart(cmd::runtime::BenchNicRestartArgs),
    /// The guest's own echo loop over its VF, per variant: exchanges per second and host CPU.
    Echo(cmd::runtime::BenchEchoArgs),
    /// Sandbox bursts while VMMs, the NIC daemon and the runtime are SIGKILLed:
    /// no leaked resource, no byte of one tenant seen by another.
    Chaos(cmd::runtime::BenchChaosArgs),
    /// The runtime process `bench chaos` runs (and kills).
    #[command(hide = true)]
    ChaosWorker(cmd::runtime::ChaosWorkerArgs),
    /// SG-IOV: scheduling policies, the job generator, and warp pipes through the NIC daemon.
    #[command(subcommand)]
    Sgiov(SgiovBench),
    /// VMM start-to-exit, N at one instant, side by side with Firecracker.
    Vmm(vmm_bench::BenchVmmArgs),
    /// N idle sandboxes: per-sandbox host cost, booted and from a template (RunD §5.3).
    Density(Box<cmd::runtime::BenchDensityArgs>),
}

#[derive(Subcommand)]
enum SgiovBench {
    /// Tenants contending for executor classes under rr, prio and drf.
    Sched(cmd::sgiov::SchedArgs),
    /// Recursive splitting against bounce buffers and the raw executor.
    Jobgen(cmd::sgiov::JobgenArgs),
    /// Guest → staging → guest against direct guest → guest, by message size.
    Path(cmd::sgiov::PathArgs),
    /// A priority ping-pong on one pipe while every other pipe is backlogged (NIC daemon).
    Latency(cmd::sgiov::LatencyArgs),
    /// Every pipe backlogged: aggregate MB/s, per-pipe spread, Jain's index (NIC daemon).
    Throughput(cmd::sgiov::ThroughputArgs),
    /// Opening thousands of pipes against bench devset opening VFs (NIC daemon).
    Open(cmd::sgiov::OpenArgs),
}

fn main() -> std::process::ExitCode {
    burstvm::init_logging();
    let result = match Cli::parse().command {
        // The VMM's exit status is the guest's under --until-exit.
        Command::Vmm(a) => match vmm::run_cli(&a.into_params()) {
            Ok(0) => Ok(()),
            Ok(status) => return std::process::ExitCode::from(status),
            Err(e) => Err(anyhow::Error::new(e).context("burstvm vmm")),
        },
        Command::Nic(a) => {
            let cni_socket = a.cni_socket.clone();
            a.into_config()
                .and_then(|c| {
                    // Serves for as long as the daemon runs (dropped after it: socket removed).
                    let _cni = cni_socket
                        .map(|p| cni::server::CniServer::start(&p))
                        .transpose()?;
                    Ok(nic::run_cli(&c)?)
                })
                .context("burstvm nic")
        }
        Command::Pool(a) => pool::run(&a).context("burstvm pool"),
        // With --kernel the exit status is the container's.
        Command::Run(a) => match runtime::run_cli(&a.into_config()) {
            Ok(0) => Ok(()),
            Ok(status) => return std::process::ExitCode::from(status.clamp(0, 255) as u8),
            Err(e) => Err(anyhow::Error::new(e).context("burstvm run")),
        },
        Command::Exec(a) => match runtime::container::exec_cli(&a.into_config()) {
            Ok(0) => Ok(()),
            Ok(status) => return std::process::ExitCode::from(status.clamp(0, 255) as u8),
            Err(e) => Err(anyhow::Error::new(e).context("burstvm exec")),
        },
        Command::Rootfs(RootfsCommand::Build(a)) => {
            rootfs_build::run(&a).context("burstvm rootfs build")
        }
        Command::Template(TemplateCommand::Create(a)) => {
            runtime::template::create_cli(&a.into_config()).context("burstvm template create")
        }
        Command::Template(TemplateCommand::Probe(a)) => {
            runtime::template::probe_cli(&a.into_config()).context("burstvm template probe")
        }
        Command::Services(a) => runtime::services_cli(&a.into_config()).context("burstvm services"),
        // `cri exec` exits with the command's status.
        Command::Cri(a) => match cri::run_cli(&a) {
            Ok(0) => Ok(()),
            Ok(status) => return std::process::ExitCode::from(status),
            Err(e) => Err(e.context("burstvm cri")),
        },
        Command::Bench(BenchCommand::Startup(a))
            if a.via == bench::startup::Via::Cri && a.image.is_some() =>
        {
            cri_image_bench::run(&a.into_config())
                .context("burstvm bench startup --via cri --image")
        }
        Command::Bench(BenchCommand::Startup(a)) if a.via == bench::startup::Via::Cri => {
            cri_bench::run(&a.into_config()).context("burstvm bench startup --via cri")
        }
        Command::Bench(BenchCommand::Startup(a)) => {
            bench::startup::bench_startup_cli(&a.into_config()).context("burstvm bench startup")
        }
        Command::Bench(BenchCommand::Memory(a)) => {
            bench::memory::run_cli(&a.config()).context("burstvm bench memory")
        }
        Command::Bench(BenchCommand::Devset(a)) => {
            bench::devset::run_cli(&a.into_config()).context("burstvm bench devset")
        }
        Command::Bench(BenchCommand::Dataplane(a)) => a
            .into_config()
            .and_then(|c| Ok(bench::dataplane::run_cli(&c)?))
            .context("burstvm bench dataplane"),
        Command::Bench(BenchCommand::Sgiov(SgiovBench::Sched(a))) => {
            bench::sgiov::sched::run_cli(&a.into_config()).context("burstvm bench sgiov sched")
        }
        Command::Bench(BenchCommand::Sgiov(SgiovBench::Jobgen(a))) => {
            bench::sgiov::jobgen::run_cli(&a.into_config()).context("burstvm bench sgiov jobgen")
        }
        Command::Bench(BenchCommand::Sgiov(SgiovBench::Path(a))) => {
            bench::sgiov::path::run_cli(&a.into_config()).context("burstvm bench sgiov path")
        }
        Command::Bench(BenchCommand::Sgiov(SgiovBench::Latency(a))) => {
            bench::sg::latency::run_cli(&a.into_config()).context("burstvm bench sgiov latency")
        }
        Command::Bench(BenchCommand::Sgiov(SgiovBench::Throughput(a))) => a
            .into_config()
            .and_then(|c| Ok(bench::sg::throughput::run_cli(&c)?))
            .context("burstvm bench sgiov throughput"),
        Command::Bench(BenchCommand::Sgiov(SgiovBench::Open(a))) => {
            bench::sg::open::run_cli(&a.into_config()).context("burstvm bench sgiov open")
        }
        Command::Bench(BenchCommand::Echo(a)) => bench::echo::run(&a.into_config())
            .map(|r| print!("{}", bench::echo::format(&r)))
            .context("burstvm bench echo"),
        Command::Bench(BenchCommand::NicRestart(a)) => {
            bench::restart::run_cli(&a.into_config()).context("burstvm bench nic-restart")
        }
        Command::Bench(BenchCommand::Vmm(a)) => {
            bench::vmm::run(&a.into_config()).context("burstvm bench vmm")
        }
        Command::Bench(BenchCommand::Chaos(a)) => {
            bench::chaos::bench_chaos_cli(&a.into_config()).context("burstvm bench chaos")
        }
        Command::Bench(BenchCommand::ChaosWorker(a)) => {
            bench::chaos::worker_main(&a.into_config()).context("burstvm bench chaos-worker")
        }
        Command::Bench(BenchCommand::Density(a)) => {
            bench::density::bench_density_cli(&a.into_config()).context("burstvm bench density")
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line naming the cause chain, as the VMM contract asks.
            eprintln!("{e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
