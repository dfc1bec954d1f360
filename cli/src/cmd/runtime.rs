//! `burstvm run`, `services`, `template` and the runtime's benches (`bench
//! startup|density|nic-restart|chaos|chaos-worker`): their arguments, parsed
//! into `runtime`'s configs.

use std::path::PathBuf;

use bench::chaos::{BenchChaosConfig, ChaosWorkerConfig, FaultKind};
use bench::density::BenchDensityConfig;
use bench::restart::BenchNicRestartConfig;
use bench::startup::{BenchStartupConfig, Via};
use burstvm::args::choice;
use runtime::sandbox::rootfs::ImageMode;
use runtime::template::{TemplateConfig, TemplateCreateConfig, TemplateProbeConfig, DEFAULT_DIR};
use runtime::{
    NetKindArg, RootfsConfig, RunConfig, SandboxConfig, ServicesConfig, SgSpec, Variant,
};

fn memory(s: &str) -> Result<u64, runtime::Error> {
    runtime::parse_size("--memory", s)
}

fn app_size(s: &str) -> Result<u64, runtime::Error> {
    runtime::parse_size("--app-size", s)
}

fn layer_size(s: &str) -> Result<u64, runtime::Error> {
    runtime::parse_size("--rootfs-layer-size", s)
}

/// The size of each sandbox, shared by `run` and `bench startup`.
#[derive(Debug, Clone, clap::Args)]
pub struct SandboxArgs {
    /// Guest memory per sandbox (e.g. 64M).
    #[arg(long, default_value = "64M", value_parser = memory)]
    pub memory: u64,
    /// CPU limit of each sandbox's cgroup, in CPUs.
    #[arg(long, default_value_t = 1.0)]
    pub cpus: f64,
    /// Size of the app payload the guest agent checksums at app launch.
    #[arg(long, default_value = "0", value_parser = app_size)]
    pub app_size: u64,
}

impl SandboxArgs {
    pub fn into_config(self) -> SandboxConfig {
        SandboxConfig {
            memory: self.memory,
            cpus: self.cpus,
            app_size: self.app_size,
        }
    }
}

/// The root filesystem of each sandbox, shared by `run` and `bench startup`.
#[derive(Debug, Clone, clap::Args)]
pub struct RootfsArgs {
    /// Container image for the rootfs (RunD split): an OCI image layout,
    /// an OCI archive, a directory, or an image `burstvm rootfs build` made
    /// (X.erofs). Built once and cached by digest.
    #[arg(long)]
    pub rootfs: Option<PathBuf>,
    /// File of the image the guest reads and checksums (default:
    /// /etc/os-release, else the smallest file).
    #[arg(long, requires = "rootfs")]
    pub rootfs_file: Option<String>,
    /// How the guest gets the read-only layer: blk (virtio-blk) or pmem
    /// (copied into the image region; built-in agent only).
    #[arg(long, value_parser = choice::<ImageMode>(ImageMode::ALL.map(ImageMode::name)), default_value_t = ImageMode::Blk, requires = "rootfs")]
    pub rootfs_image: ImageMode,
    /// Capacity of each sandbox's writable layer (the ext4 template).
    #[arg(long, default_value = "64M", value_parser = layer_size, requires = "rootfs")]
    pub rootfs_layer_size: u64,
    /// Image cache (default: $BURSTVM_IMAGE_CACHE or /var/lib/burstvm/images).
    #[arg(long, requires = "rootfs")]
    pub image_cache: Option<PathBuf>,
}

impl RootfsArgs {
    pub fn into_config(self) -> RootfsConfig {
        RootfsConfig {
            rootfs: self.rootfs,
            rootfs_file: self.rootfs_file,
            rootfs_image: self.rootfs_image,
            rootfs_layer_size: self.rootfs_layer_size,
            image_cache: self.image_cache,
        }
    }
}

/// A template named on the command line of `run` and `bench startup`.
#[derive(Debug, Clone, clap::Args)]
pub struct TemplateArgs {
    /// Start sandboxes from this template (a name under --template-dir, or
    /// a path) instead of booting them; per-sandbox devices are attached
    /// after the restore.
    #[arg(long)]
    pub template: Option<String>,
    /// Directory of named templates.
    #[arg(long, default_value = DEFAULT_DIR)]
    pub template_dir: PathBuf,
}

impl TemplateArgs {
    pub fn into_config(self) -> TemplateConfig {
        TemplateConfig {
            template: self.template,
            template_dir: self.template_dir,
        }
    }
}

/// `burstvm run`: one sandbox through every stage.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Variant: no-net, tap, vanilla, fastiov, fastiov-L/-S/-D/-A, pre10/50/100.
    #[arg(long, default_value = "fastiov")]
    pub variant: Variant,
    #[command(flatten)]
    pub sandbox: SandboxArgs,
    #[command(flatten)]
    pub rootfs: RootfsArgs,
    /// Boot this Linux kernel (vmlinux) with the guest agent instead of the
    /// built-in agent, and run the image's process in it with our stdio; the
    /// exit status is the container's (docs/runtime.md, "Containers").
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// The container image (as --rootfs): OCI archive or layout, a directory,
    /// or an image `burstvm rootfs build` made.
    #[arg(conflicts_with = "rootfs", value_name = "IMAGE")]
    pub image: Option<PathBuf>,
    /// The command to run instead of the image's cmd (after the entrypoint).
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
    /// With --kernel: keep the process's stdin open and pipe ours to it.
    #[arg(short = 'i', long, requires = "kernel")]
    pub interactive: bool,
    /// With --kernel: give the process a terminal.
    #[arg(short = 't', long, requires = "kernel")]
    pub tty: bool,
    /// With --kernel: the guest agent binary (default: $BURSTVM_AGENT, else
    /// what scripts/build-agent.sh built beside this burstvm).
    #[arg(long, requires = "kernel")]
    pub agent: Option<PathBuf>,
    /// The writable layer is a full copy of the template, not a reflink.
    #[arg(long, requires = "rootfs")]
    pub rootfs_copy: bool,
    #[command(flatten)]
    pub template: TemplateArgs,
    /// Keep the sandbox running after READY until Ctrl-C.
    #[arg(long)]
    pub keep_running: bool,
    /// Append the trace (JSON lines) to this file.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Seconds the guest may take to become ready.
    #[arg(long, default_value_t = 60)]
    pub timeout: u64,
    /// The burstvm binary to spawn VMMs and the NIC daemon from (default: this one).
    #[arg(long)]
    pub burstvm_bin: Option<PathBuf>,
    /// Keep this many VF network attachments ready (netns + CNI ADD done in
    /// the background); a VF sandbox claims one (`net-claim` stage).
    #[arg(long, default_value_t = 0)]
    pub net_pool: usize,
    /// The sandbox's network: `vf` (burstvm-cni's VF, the variant's) or `sg` (an SG
    /// function: the runtime's `"kind":"sg"` network; the agent moves `--sg-bytes`
    /// through each of `--sg-pipes` warp pipes and the VMM checks the checksum).
    #[arg(long, value_parser = choice::<NetKindArg>(NetKindArg::ALL.map(NetKindArg::name)), default_value_t = NetKindArg::Vf)]
    pub net_kind: NetKindArg,
    /// SG functions the runtime's NIC daemon serves (`burstvm nic --sgfs`);
    /// default 4 with `--net-kind sg`, else 0.
    #[arg(long)]
    pub sgfs: Option<usize>,
    /// With `--net-kind sg`: warp pipes (echo sockets) the agent opens.
    #[arg(long, default_value_t = SgSpec::default().pipes)]
    pub sg_pipes: u32,
    /// With `--net-kind sg`: bytes through each pipe (a multiple of 8, at most 4096).
    #[arg(long, default_value_t = SgSpec::default().bytes)]
    pub sg_bytes: u32,
}

impl RunArgs {
    pub fn into_config(self) -> RunConfig {
        let mut rootfs = self.rootfs.into_config();
        if rootfs.rootfs.is_none() {
            rootfs.rootfs = self.image;
        }
        RunConfig {
            variant: self.variant,
            sandbox: self.sandbox.into_config(),
            rootfs,
            kernel: self.kernel,
            container: runtime::ContainerRun {
                command: self.command,
                interactive: self.interactive,
                tty: self.tty,
                agent: self.agent,
            },
            rootfs_copy: self.rootfs_copy,
            template: self.template.into_config(),
            keep_running: self.keep_running,
            trace: self.trace,
            timeout: self.timeout,
            burstvm_bin: self.burstvm_bin,
            net_pool: self.net_pool,
            net_kind: self.net_kind,
            sgfs: self.sgfs,
            sg_pipes: self.sg_pipes,
            sg_bytes: self.sg_bytes,
        }
    }
}

/// `burstvm exec`: a further process in a running container sandbox.
#[derive(Debug, Clone, clap::Args)]
pub struct ExecArgs {
    /// The sandbox id (`burstvm run --kernel --keep-running` prints it).
    #[arg(required_unless_present = "vsock", value_name = "SANDBOX")]
    pub sandbox: Option<String>,
    /// The sandbox VMM's vsock socket instead of its id.
    #[arg(long, conflicts_with = "sandbox")]
    pub vsock: Option<PathBuf>,
    /// The command (after `--`).
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
    /// KEY=VALUE added to the environment (PATH and HOME=/ by default).
    #[arg(short = 'e', long = "env", value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// Working directory.
    #[arg(short = 'w', long, default_value = "/")]
    pub workdir: String,
    /// UID[:GID] to run as.
    #[arg(short = 'u', long, default_value = "0", value_parser = uid_gid)]
    pub user: (u32, u32),
    /// Pipe our stdin to the process.
    #[arg(short = 'i', long)]
    pub interactive: bool,
    /// Give the process a terminal.
    #[arg(short = 't', long)]
    pub tty: bool,
}

fn uid_gid(s: &str) -> Result<(u32, u32), String> {
    let num = |v: &str| {
        v.parse::<u32>()
            .map_err(|_| format!("{v:?} is not a number (UID[:GID])"))
    };
    match s.split_once(':') {
        Some((u, g)) => Ok((num(u)?, num(g)?)),
        None => num(s).map(|u| (u, u)),
    }
}

impl ExecArgs {
    pub fn into_config(self) -> runtime::container::ExecConfig {
        runtime::container::ExecConfig {
            sandbox: self.sandbox,
            vsock: self.vsock,
            command: self.command,
            env: self.env,
            cwd: self.workdir,
            uid: self.user.0,
            gid: self.user.1,
            interactive: self.interactive,
            tty: self.tty,
        }
    }
}

/// `burstvm bench startup`: concurrent startup per variant.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchStartupArgs {
    /// Sandboxes started at the same instant per variant.
    #[arg(long, default_value_t = 50)]
    pub concurrency: usize,
    /// Comma-separated variants.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "no-net,vanilla,fastiov,window"
    )]
    pub variants: Vec<Variant>,
    #[command(flatten)]
    pub sandbox: SandboxArgs,
    #[command(flatten)]
    pub rootfs: RootfsArgs,
    /// Also run every variant with a full copy of the writable layer per
    /// sandbox, beside RunD's reflink (RunD §4.2: 207 ms → 0.2 ms).
    #[arg(long, requires = "rootfs")]
    pub rootfs_copy: bool,
    /// Also run every variant started from this template, beside the boot
    /// (RunD §4.3).
    #[command(flatten)]
    pub template: TemplateArgs,
    /// Run at each of these concurrencies instead (Fig. 13a), e.g. 10,50,100,200.
    #[arg(long, value_delimiter = ',')]
    pub sweep: Vec<usize>,
    /// Output directory for trace.jsonl, summary.json and the PNG plots.
    #[arg(long, default_value = "bench-startup")]
    pub out: PathBuf,
    /// Skip the uncounted warm-up round.
    #[arg(long)]
    pub no_warmup: bool,
    /// Keep this many VF network attachments ready (netns + CNI ADD done in
    /// the background, refilled after each round); VF variants claim one per
    /// sandbox (`net-claim` stage). Each pooled round waits for a full pool.
    #[arg(long, default_value_t = 0)]
    pub net_pool: usize,
    /// With `--net-pool`: run every VF variant without and with the pool
    /// (group `<variant>+pool`), side by side in one run.
    #[arg(long, requires = "net_pool")]
    pub net_pool_compare: bool,
    /// Switch the page pool's pinning off: every DMA mapping of pool memory pins
    /// its pages itself, at every start (FastIOV's way), instead of the pool
    /// keeping its memory pinned once (docs/guestmem.md).
    #[arg(long)]
    pub no_pool_pinning: bool,
    /// Run burstvm-cni in a process of its own per ADD and DEL (an exec'd CNI
    /// plugin) instead of in the NIC daemon's CNI server through
    /// burstvm-cni-thin: the A/B of the server (docs/cni.md).
    #[arg(long)]
    pub cni_exec: bool,
    /// The built-in agent does all its work at CPL0, as before its switch to CPL3
    /// (kvm_pvm then emulates every instruction of it): the A/B of the switch.
    #[arg(long)]
    pub agent_cpl0: bool,
    /// Measured rounds per variant, interleaved (every variant's first, then
    /// every variant's second, ...; one warm-up each). The tables pool their
    /// sandboxes; the CPU table gains each repetition's ratio to no-net and
    /// their median, since the host drifts between rounds.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub repeat: u64,
    /// Take sandbox cgroups from a RunD-style rename pool instead of mkdir.
    #[arg(long)]
    pub cgroup_pool: bool,
    /// Seconds each guest may take to become ready.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    /// The burstvm binary (default: this one).
    #[arg(long)]
    pub burstvm_bin: Option<PathBuf>,
    /// `cri`: also create each round's sandboxes through containerd's CRI
    /// plugin (RunPodSandbox, a private containerd with the burstvm shim) and
    /// report that path beside the direct one (docs/shim.md).
    #[arg(long, value_parser = choice::<Via>(Via::ALL.map(Via::name)), default_value_t = Via::Direct)]
    pub via: Via,
    /// With `--via cri`: the directory with pause.tar made by scripts/build-images.sh.
    #[arg(long, default_value = "bench-images")]
    pub images: PathBuf,
    /// With `--via cri`: run a container of `<images>/<IMAGE>.tar` (e.g.
    /// busybox) in each Linux-guest pod and time RunPodSandbox +
    /// CreateContainer + StartContainer to its first output line, beside
    /// the same container started directly (`burstvm run`'s path).
    #[arg(long, requires = "kernel")]
    pub image: Option<String>,
    /// The condensed Linux kernel for `--image` (scripts/build-guest-kernel.sh).
    #[arg(long, requires = "image")]
    pub kernel: Option<PathBuf>,
    /// The static guest agent for `--image` (default: as `burstvm run` finds it).
    #[arg(long, requires = "image")]
    pub agent: Option<PathBuf>,
    /// Back every sandbox's memory with 2 MiB hugetlb pages, as FastIOV's
    /// evaluation does (reserved for the run and given back after it).
    #[arg(long)]
    pub hugepages: bool,
}

impl BenchStartupArgs {
    pub fn into_config(self) -> BenchStartupConfig {
        BenchStartupConfig {
            concurrency: self.concurrency,
            variants: self.variants,
            sandbox: self.sandbox.into_config(),
            rootfs: self.rootfs.into_config(),
            rootfs_copy: self.rootfs_copy,
            template: self.template.into_config(),
            sweep: self.sweep,
            out: self.out,
            no_warmup: self.no_warmup,
            net_pool: self.net_pool,
            net_pool_compare: self.net_pool_compare,
            no_pool_pinning: self.no_pool_pinning,
            cni_exec: self.cni_exec,
            agent_cpl0: self.agent_cpl0,
            repeat: self.repeat as usize,
            cgroup_pool: self.cgroup_pool,
            timeout: self.timeout,
            burstvm_bin: self.burstvm_bin,
            via: self.via,
            images: self.images,
            image: self.image,
            kernel: self.kernel,
            agent: self.agent,
            hugepages: self.hugepages,
        }
    }
}

/// `burstvm template create NAME` / `burstvm template probe`.
#[derive(Debug, Clone, clap::Args)]
pub struct TemplateCreateArgs {
    /// Name of the template (a directory under --dir).
    pub name: String,
    /// Directory of named templates.
    #[arg(long, default_value = DEFAULT_DIR)]
    pub dir: PathBuf,
    /// Guest memory and the largest app payload of the sandboxes that
    /// will start from it (the template fixes both).
    #[command(flatten)]
    pub sandbox: SandboxArgs,
    /// Replace an existing template of that name.
    #[arg(long)]
    pub force: bool,
    /// The burstvm binary to run the VMM from (default: this one).
    #[arg(long)]
    pub burstvm_bin: Option<PathBuf>,
}

impl TemplateCreateArgs {
    pub fn into_config(self) -> TemplateCreateConfig {
        TemplateCreateConfig {
            name: self.name,
            dir: self.dir,
            sandbox: self.sandbox.into_config(),
            force: self.force,
            burstvm_bin: self.burstvm_bin,
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct TemplateProbeArgs {
    /// The burstvm binary to run the VMM from (default: this one).
    #[arg(long)]
    pub burstvm_bin: Option<PathBuf>,
}

impl TemplateProbeArgs {
    pub fn into_config(self) -> TemplateProbeConfig {
        TemplateProbeConfig {
            burstvm_bin: self.burstvm_bin,
        }
    }
}

/// `burstvm services`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServicesArgs {
    /// Directory for services.json (what the shim config names) and replies.json.
    #[arg(long, default_value = "/run/burstvm/services")]
    pub dir: PathBuf,
    /// Where to write the burstvm-cni network config (containerd's CNI conf dir).
    #[arg(long, default_value = "/etc/cni/net.d/10-burstvm.conf")]
    pub cni_conf: PathBuf,
    /// The engine's CNI bin dir (containerd's `bin_dir`): if it holds
    /// burstvm-cni-thin, the config names it with the NIC daemon's CNI server,
    /// which then serves the engine's ADD and DEL (docs/cni.md).
    #[arg(long, default_value = "/opt/cni/bin")]
    pub cni_bin: PathBuf,
    /// VFs the NIC daemon creates: at least the pods that run at once.
    #[arg(long, default_value_t = 64)]
    pub vfs: usize,
    /// The NIC daemon runs this variant's devset lock policy.
    #[arg(long, default_value = "fastiov")]
    pub variant: Variant,
    /// The burstvm binary VMMs and the NIC daemon are spawned from (default: this one).
    #[arg(long)]
    pub burstvm_bin: Option<PathBuf>,
}

impl ServicesArgs {
    pub fn into_config(self) -> ServicesConfig {
        ServicesConfig {
            dir: self.dir,
            cni_conf: self.cni_conf,
            cni_bin: self.cni_bin,
            vfs: self.vfs,
            variant: self.variant,
            burstvm_bin: self.burstvm_bin,
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct BenchDensityArgs {
    /// Idle sandboxes kept alive, one level after another, e.g. 100,300.
    #[arg(long, value_delimiter = ',', default_value = "100")]
    pub sandboxes: Vec<usize>,
    /// Network of every sandbox: no-net or tap (a VF variant cannot use a template).
    #[arg(long, default_value = "no-net")]
    pub variant: Variant,
    #[command(flatten)]
    pub sandbox: SandboxArgs,
    /// With a template: every level runs booted and then from the template.
    #[command(flatten)]
    pub template: TemplateArgs,
    /// Sandboxes started (at once) with N running, timed (RunD Fig. 13).
    #[arg(long, default_value_t = 10)]
    pub more: usize,
    /// Seconds each guest may take to become ready.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    /// Write the levels as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// The burstvm binary (default: this one).
    #[arg(long)]
    pub burstvm_bin: Option<PathBuf>,
}

impl BenchDensityArgs {
    pub fn into_config(self) -> BenchDensityConfig {
        BenchDensityConfig {
            sandboxes: self.sandboxes,
            variant: self.variant,
            sandbox: self.sandbox.into_config(),
            template: self.template.into_config(),
            more: self.more,
            timeout: self.timeout,
            json: self.json,
            burstvm_bin: self.burstvm_bin,
        }
    }
}

/// `burstvm bench nic-restart`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchNicRestartArgs {
    /// Sandboxes running (and exchanging requests) while the NIC daemon is killed.
    #[arg(long, default_value_t = 2)]
    pub guests: usize,
    /// Kills and restarts of the NIC daemon.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// A variant with a VF (vanilla, fastiov, ...).
    #[arg(long, default_value = "fastiov")]
    pub variant: Variant,
    #[command(flatten)]
    pub sandbox: SandboxArgs,
    /// Seconds each guest may take to become ready, and traffic to resume.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    /// The burstvm binary (default: this one).
    #[arg(long)]
    pub burstvm_bin: Option<PathBuf>,
}

impl BenchNicRestartArgs {
    pub fn into_config(self) -> BenchNicRestartConfig {
        BenchNicRestartConfig {
            guests: self.guests,
            rounds: self.rounds,
            variant: self.variant,
            sandbox: self.sandbox.into_config(),
            timeout: self.timeout,
            burstvm_bin: self.burstvm_bin,
        }
    }
}

/// `burstvm bench echo`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchEchoArgs {
    /// VF variants, measured one after the other in one run.
    #[arg(long, value_delimiter = ',', default_value = "fastiov,window")]
    pub variants: Vec<Variant>,
    /// Seconds each variant's echo loop is counted.
    #[arg(long, default_value_t = 5)]
    pub seconds: u64,
    #[command(flatten)]
    pub sandbox: SandboxArgs,
    /// Seconds the guest may take to become ready.
    #[arg(long, default_value_t = 60)]
    pub timeout: u64,
    /// The burstvm binary (default: this one).
    #[arg(long)]
    pub burstvm_bin: Option<PathBuf>,
}

impl BenchEchoArgs {
    pub fn into_config(self) -> bench::echo::BenchEchoConfig {
        bench::echo::BenchEchoConfig {
            variants: self.variants,
            seconds: self.seconds,
            sandbox: self.sandbox.into_config(),
            timeout: self.timeout,
            burstvm_bin: self.burstvm_bin,
        }
    }
}

/// `burstvm bench chaos`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchChaosArgs {
    /// Bursts to run.
    #[arg(long, default_value_t = 4)]
    pub rounds: u32,
    /// Sandboxes started at once per round.
    #[arg(long, default_value_t = 50)]
    pub concurrency: usize,
    /// Variant of every sandbox; it must have a VF, and pool memory or a DMA window.
    #[arg(long, default_value = "fastiov-A")]
    pub variant: Variant,
    /// Guest memory per sandbox.
    #[arg(long, default_value = "32M", value_parser = memory)]
    pub memory: u64,
    /// VMMs SIGKILLed per round.
    #[arg(long, default_value_t = 5)]
    pub kills: usize,
    /// Faults beside VMM kills; one per round, in turn.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "freeze,nic,worker",
        value_parser = choice::<FaultKind>(FaultKind::ALL.map(FaultKind::name))
    )]
    pub faults: Vec<FaultKind>,
    /// How long a freeze stops the NIC daemon, ms.
    #[arg(long, default_value_t = 400)]
    pub freeze_ms: u64,
    /// Tenants each slot runs back to back (later ones on earlier ones' memory).
    #[arg(long, default_value_t = 3)]
    pub tenants: usize,
    /// Seed of the fault schedule (default: from the clock; printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Seconds each guest may take to become ready.
    #[arg(long, default_value_t = 30)]
    pub timeout: u64,
    /// Write the report as JSON here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// The burstvm binary (default: this one).
    #[arg(long)]
    pub burstvm_bin: Option<PathBuf>,
}

impl BenchChaosArgs {
    pub fn into_config(self) -> BenchChaosConfig {
        BenchChaosConfig {
            rounds: self.rounds,
            concurrency: self.concurrency,
            variant: self.variant,
            memory: self.memory,
            kills: self.kills,
            faults: self.faults,
            freeze_ms: self.freeze_ms,
            tenants: self.tenants,
            seed: self.seed,
            timeout: self.timeout,
            report: self.report,
            burstvm_bin: self.burstvm_bin,
        }
    }
}

/// What the controller tells a worker to be.
#[derive(Debug, Clone, clap::Args)]
pub struct ChaosWorkerArgs {
    #[arg(long)]
    pub concurrency: usize,
    #[arg(long)]
    pub variant: Variant,
    #[arg(long)]
    pub memory_bytes: u64,
    #[arg(long)]
    pub timeout: u64,
    /// Tenants each slot runs back to back.
    #[arg(long)]
    pub tenants: usize,
    #[arg(long)]
    pub burstvm_bin: PathBuf,
}

impl ChaosWorkerArgs {
    pub fn into_config(self) -> ChaosWorkerConfig {
        ChaosWorkerConfig {
            concurrency: self.concurrency,
            variant: self.variant,
            memory_bytes: self.memory_bytes,
            timeout: self.timeout,
            tenants: self.tenants,
            burstvm_bin: self.burstvm_bin,
        }
    }
}
