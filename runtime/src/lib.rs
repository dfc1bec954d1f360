//! The burstvm sandbox runtime: sandbox lifecycle through the startup stages,
//! FastIOV's variants, the concurrent startup benchmark, its statistics and
//! plots. See docs/runtime.md.

pub mod bench;
pub mod cgroup;
pub mod chaos;
pub mod child;
pub mod cni;
pub mod container;
pub mod cpuacct;
pub mod critpath;
pub mod density;
pub mod failures;
pub mod fileserver;
pub mod guestnet;
pub mod host;
pub mod leaks;
pub mod netpool;
pub mod nicd;
pub mod overhead;
pub mod plot;
pub mod restart;
pub mod rootfs;
mod run;
pub mod runtime;
pub mod sandbox;
pub mod services;
pub mod stats;
pub mod template;
pub mod uplink;
pub mod variant;
pub mod vmmproc;

use std::path::PathBuf;
use std::time::Duration;

pub use chaos::{
    bench_chaos_cli, worker_main as chaos_worker_main, BenchChaosConfig, ChaosWorkerConfig,
};
pub use host::{HostServices, SandboxHost, ServicesInfo};
pub use run::{run_cli, ContainerRun, NetKindArg, RunConfig};
pub use runtime::{Runtime, RuntimeConfig, RuntimeError};
pub use sandbox::{pod_slot, Attach, Sandbox, SandboxFailure, SandboxSpec, SgSpec};
pub use services::{services_cli, ServicesConfig};

pub use variant::{Policy, Variant};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{field}: {reason}")]
    BadArg { field: &'static str, reason: String },
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Sandbox(#[from] SandboxFailure),
    #[error(transparent)]
    Plot(#[from] plot::PlotError),
    #[error(transparent)]
    Host(#[from] host::HostError),
    #[error("output {}: {source}", .path.display())]
    Output {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Trace(#[from] trace::TraceError),
    #[error("{0}")]
    Leaks(String),
    #[error(transparent)]
    Teardown(#[from] sandbox::TeardownError),
    #[error("interrupted (SIGINT); everything was torn down")]
    Interrupted,
    #[error("cannot find the burstvm binary: {0}")]
    Bin(#[source] std::io::Error),
    #[error(transparent)]
    Rootfs(#[from] ::rootfs::Error),
    /// A file the runtime reads or writes itself (the agent, its initramfs).
    #[error("{} ({what}): {source}", .path.display())]
    File {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Initramfs(#[from] agent_proto::InitramfsError),
    /// The guest agent refused a request or its connection failed.
    #[error("guest agent: {0}")]
    Agent(#[from] agent_proto::ClientError),
}

pub(crate) fn bad(field: &'static str, reason: impl Into<String>) -> Error {
    Error::BadArg {
        field,
        reason: reason.into(),
    }
}

/// Parses `64M`, `1G`, `4096`, `512K` into bytes.
pub fn parse_size(field: &'static str, s: &str) -> Result<u64, Error> {
    let t = s.trim();
    let (num, mul) = match t.chars().last() {
        Some(c) if c.is_ascii_alphabetic() => {
            let mul = match c.to_ascii_uppercase() {
                'K' => 1u64 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                _ => return Err(bad(field, format!("{s:?}: unknown size suffix {c:?}"))),
            };
            (&t[..t.len() - 1], mul)
        }
        _ => (t, 1),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| bad(field, format!("{s:?} is not a size (e.g. 64M)")))?;
    n.checked_mul(mul)
        .ok_or_else(|| bad(field, format!("{s:?} is too large")))
}

pub(crate) fn burstvm_bin(given: &Option<PathBuf>) -> Result<PathBuf, Error> {
    match given {
        Some(p) => Ok(p.clone()),
        None => std::env::current_exe().map_err(Error::Bin),
    }
}

/// The size of each sandbox, shared by `run` and `bench startup`.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// Guest memory per sandbox, bytes.
    pub memory: u64,
    /// CPU limit of each sandbox's cgroup, in CPUs.
    pub cpus: f64,
    /// Size of the app payload the guest agent checksums at app launch, bytes.
    pub app_size: u64,
}

impl SandboxConfig {
    /// Checks `--cpus`; returns `--memory` and `--app-size` in bytes.
    pub fn bytes(&self) -> Result<(u64, u64), Error> {
        let (memory, app_size) = (self.memory, self.app_size);
        if !self.cpus.is_finite() || self.cpus <= 0.0 {
            return Err(bad("--cpus", format!("{} must be positive", self.cpus)));
        }
        Ok((memory, app_size))
    }
}

/// The root filesystem of each sandbox, shared by `run` and `bench startup`.
#[derive(Debug, Clone)]
pub struct RootfsConfig {
    /// Container image for the rootfs (RunD split): an OCI image layout,
    /// an OCI archive, a directory, or an image `burstvm rootfs build` made
    /// (X.erofs). Built once and cached by digest.
    pub rootfs: Option<PathBuf>,
    /// File of the image the guest reads and checksums (default:
    /// /etc/os-release, else the smallest file).
    pub rootfs_file: Option<String>,
    /// How the guest gets the read-only layer: blk (virtio-blk) or pmem
    /// (copied into the image region; built-in agent only).
    pub rootfs_image: rootfs::ImageMode,
    /// Capacity of each sandbox's writable layer (the ext4 template), bytes.
    pub rootfs_layer_size: u64,
    /// Image cache (default: $BURSTVM_IMAGE_CACHE or /var/lib/burstvm/images).
    pub image_cache: Option<PathBuf>,
}

impl RootfsConfig {
    fn image_cache(&self) -> ::rootfs::ImageCache {
        self.image_cache
            .clone()
            .map(::rootfs::ImageCache::new)
            .unwrap_or_else(::rootfs::ImageCache::from_env)
    }

    /// The image cache's directory (the guest agent's initramfs is kept there too).
    pub fn image_cache_dir(&self) -> PathBuf {
        self.image_cache().dir().to_path_buf()
    }

    /// The image (built or found in the cache; with burstvm's Linux init for
    /// a kernel) and the layer size, if a rootfs was asked for.
    fn image(&self, init: bool) -> Result<Option<(std::sync::Arc<::rootfs::Image>, u64)>, Error> {
        let Some(src) = &self.rootfs else {
            return Ok(None);
        };
        let cache = self.image_cache();
        let img = cache.resolve(src, init)?;
        let bytes = self.rootfs_layer_size;
        if bytes < (1 << 20) {
            return Err(bad("--rootfs-layer-size", "at least 1M"));
        }
        Ok(Some((std::sync::Arc::new(img), bytes)))
    }

    fn spec(
        &self,
        image: &std::sync::Arc<::rootfs::Image>,
        layer: rootfs::LayerMode,
    ) -> Result<rootfs::RootfsSpec, Error> {
        rootfs::RootfsSpec::new(
            image.clone(),
            self.rootfs_file.as_deref(),
            self.rootfs_image,
            layer,
        )
        .map_err(|e| bad("--rootfs-file", e.to_string()))
    }
}

/// `burstvm bench startup`: concurrent startup per variant.
#[derive(Debug, Clone)]
pub struct BenchStartupConfig {
    /// Sandboxes started at the same instant per variant.
    pub concurrency: usize,
    /// Comma-separated variants.
    pub variants: Vec<Variant>,
    pub sandbox: SandboxConfig,
    pub rootfs: RootfsConfig,
    /// Also run every variant with a full copy of the writable layer per
    /// sandbox, beside RunD's reflink (RunD §4.2: 207 ms → 0.2 ms).
    pub rootfs_copy: bool,
    /// Also run every variant started from this template, beside the boot
    /// (RunD §4.3).
    pub template: template::TemplateConfig,
    /// Run at each of these concurrencies instead (Fig. 13a), e.g. 10,50,100,200.
    pub sweep: Vec<usize>,
    /// Output directory for trace.jsonl, summary.json and the PNG plots.
    pub out: PathBuf,
    /// Skip the uncounted warm-up round.
    pub no_warmup: bool,
    /// Keep this many VF network attachments ready (netns + CNI ADD done in
    /// the background, refilled after each round); VF variants claim one per
    /// sandbox (`net-claim` stage). Each pooled round waits for a full pool.
    pub net_pool: usize,
    /// With `--net-pool`: run every VF variant without and with the pool
    /// (group `<variant>+pool`), side by side in one run.
    pub net_pool_compare: bool,
    /// Take sandbox cgroups from a RunD-style rename pool instead of mkdir.
    pub cgroup_pool: bool,
    /// Seconds each guest may take to become ready.
    pub timeout: u64,
    /// The burstvm binary (default: this one).
    pub burstvm_bin: Option<PathBuf>,
    /// `cri`: also create each round's sandboxes through containerd's CRI
    /// plugin (RunPodSandbox, a private containerd with the burstvm shim) and
    /// report that path beside the direct one (docs/shim.md).
    pub via: Via,
    /// With `--via cri`: the directory with pause.tar made by scripts/build-images.sh.
    pub images: PathBuf,
    /// With `--via cri`: containers of this image (`<images>/<image>.tar`)
    /// in Linux-guest pods, beside `burstvm run`'s path (docs/shim.md).
    pub image: Option<String>,
    /// The condensed Linux kernel for `image`.
    pub kernel: Option<PathBuf>,
    /// The static guest agent for `image` (default: as `burstvm run` finds it).
    pub agent: Option<PathBuf>,
}

/// How `bench startup` creates sandboxes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The runtime library only.
    Direct,
    /// The runtime library, and RunPodSandbox through containerd's CRI plugin.
    Cri,
}

impl Via {
    pub const ALL: [Via; 2] = [Via::Direct, Via::Cri];

    pub fn name(self) -> &'static str {
        match self {
            Via::Direct => "direct",
            Via::Cri => "cri",
        }
    }
}

impl std::fmt::Display for Via {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Via {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|v| v.name() == s)
            .ok_or_else(|| format!("unknown --via {s:?} (direct, cri)"))
    }
}

/// What `bench startup` measures: the validated levels and round spec, and
/// the runtime (checked against host memory and VF limits).
pub fn bench_setup(a: &BenchStartupConfig) -> Result<(Runtime, bench::BenchPlan), Error> {
    let (memory, app_size) = a.sandbox.bytes()?;
    let levels = if a.sweep.is_empty() {
        vec![a.concurrency]
    } else {
        a.sweep.clone()
    };
    if levels.contains(&0) {
        return Err(bad("--concurrency", "must be at least 1"));
    }
    if a.variants.is_empty() {
        return Err(bad("--variants", "at least one variant"));
    }
    let image = a.rootfs.image(false)?;
    let rootfs = image
        .as_ref()
        .map(|(img, _)| a.rootfs.spec(img, rootfs::LayerMode::Reflink))
        .transpose()?;
    let mut layer_modes = Vec::new();
    if rootfs.is_some() {
        layer_modes.push(rootfs::LayerMode::Reflink);
        if a.rootfs_copy {
            layer_modes.push(rootfs::LayerMode::Copy);
        }
    }
    let pmem_bytes = rootfs.as_ref().map_or(0, |r| r.guest_bytes());
    let spec = bench::RoundSpec {
        memory_bytes: memory,
        cpus: a.sandbox.cpus,
        app_size,
        timeout_secs: a.timeout,
        rootfs,
        template: None,
        net_pool: false,
    };
    let max_n = *levels.iter().max().expect("non-empty");
    let need = max_n as u64 * bench::sandbox_bytes(&spec) + bench::MEMORY_MARGIN;
    let avail = bench::mem_available();
    if need > avail {
        return Err(bad(
            "--concurrency",
            format!(
                "{max_n} sandboxes of {} MiB need {} MiB but the host has {} MiB available",
                bench::sandbox_bytes(&spec) >> 20,
                need >> 20,
                avail >> 20
            ),
        ));
    }
    let vf_variants = a
        .variants
        .iter()
        .any(|v| v.policy().net == variant::NetKind::Vf);
    // While a pooled round runs, the refilled pool holds VFs too.
    let vfs = max_n + if vf_variants { a.net_pool } else { 0 };
    if vf_variants && vfs > nic::MAX_VFS {
        return Err(bad(
            "--concurrency",
            format!(
                "{max_n} sandboxes and {} pooled attachments with a VF each, but a PF has at most {} VFs",
                a.net_pool,
                nic::MAX_VFS
            ),
        ));
    }
    // The CRI path needs the services' CNI config even for no-net rounds.
    let network = a.via == Via::Cri
        || a.variants
            .iter()
            .any(|v| v.policy().net != variant::NetKind::None);
    let rt = Runtime::new(RuntimeConfig {
        bin: burstvm_bin(&a.burstvm_bin)?,
        trace_path: None,
        vfs,
        network,
        cgroup_pool: if a.cgroup_pool { max_n } else { 0 },
        cgroup_limits: cgroup::Limits {
            memory_bytes: memory + (app_size + pmem_bytes + (4 << 20)).next_multiple_of(2 << 20),
            cpus: a.sandbox.cpus,
        },
        rootfs_layer_bytes: image.as_ref().map(|(_, b)| *b),
        net_pool: a.net_pool,
        sgfs: 0,
    })?;
    let plan = bench::BenchPlan {
        variants: a.variants.clone(),
        layer_modes,
        template: a.template.resolve()?,
        levels,
        spec,
        out: a.out.clone(),
        warmup: !a.no_warmup,
        net_pool: match (a.net_pool, a.net_pool_compare) {
            (0, _) => bench::NetPoolRuns::Off,
            (_, false) => bench::NetPoolRuns::On,
            (_, true) => bench::NetPoolRuns::Compare,
        },
    };
    Ok((rt, plan))
}

pub fn bench_startup_cli(a: &BenchStartupConfig) -> Result<(), Error> {
    runtime::install_sigint_handler();
    let (rt, plan) = bench_setup(a)?;
    let result = bench::run(&rt, &plan, &mut |l| eprintln!("{l}"));
    // Also after an error or Ctrl-C: say whether anything was left.
    let final_check = leaks::check(&rt, Duration::from_secs(5));
    let out = match result {
        Ok(out) => out,
        Err(e) => {
            eprintln!("{}", final_check.describe());
            return Err(e);
        }
    };
    print!("{}", out.table);
    for p in &out.plots {
        println!("wrote {}", p.display());
    }
    println!("wrote {}", a.out.join("trace.jsonl").display());
    println!("wrote {}", a.out.join("summary.json").display());
    drop(rt);
    if runtime::sigint_received() {
        eprintln!("{}", final_check.describe());
        return Err(Error::Interrupted);
    }
    if !out.clean || !final_check.is_clean() {
        return Err(Error::Leaks(format!(
            "leaks found after the benchmark (see above); at the end: {}",
            final_check.describe()
        )));
    }
    println!("leak check: clean after every round");
    Ok(())
}
