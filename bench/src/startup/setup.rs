//! `burstvm bench startup`'s configuration, its validation against the host
//! (`bench_setup`) and the command itself (`bench_startup_cli`).

use std::path::PathBuf;
use std::time::Duration;

use runtime::{burstvm_bin, cgroup, leaks, sandbox::rootfs, template, variant};
use runtime::{RootfsConfig, Runtime, RuntimeConfig, SandboxConfig, Variant};

use super::{mem_available, run, sandbox_bytes, BenchPlan, NetPoolRuns, RoundSpec, MEMORY_MARGIN};
use crate::{bad, Error};

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
    /// Measured rounds per group, interleaved across the groups (`BenchPlan::repeat`).
    pub repeat: usize,
    /// Switch the page pool's pinning off (`guestmem::pool::Pool::set_pinning`):
    /// DMA mappings of pool memory pin every page themselves, at every start.
    pub no_pool_pinning: bool,
    /// Run burstvm-cni in a process of its own per ADD and DEL, as an
    /// exec'd CNI plugin, instead of in the NIC daemon's CNI server
    /// (`RuntimeConfig::cni_server`): the A/B of the server.
    pub cni_exec: bool,
    /// The built-in agent does all its work at CPL0 (`burstvm vmm --agent-cpl0`), as
    /// before its switch to CPL3: on kvm_pvm every instruction of it is then emulated.
    pub agent_cpl0: bool,
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
    /// Back every sandbox's memory with 2 MiB hugetlb pages (FastIOV §6's
    /// setting); the bench reserves them for the run and gives them back.
    pub hugepages: bool,
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
pub fn bench_setup(a: &BenchStartupConfig) -> Result<(Runtime, BenchPlan), Error> {
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
    if a.repeat > 1 && a.via == Via::Cri {
        return Err(bad(
            "--repeat",
            "repeats the direct path's rounds only; give it without --via cri",
        ));
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
    let spec = RoundSpec {
        memory_bytes: memory,
        cpus: a.sandbox.cpus,
        app_size,
        timeout_secs: a.timeout,
        rootfs,
        template: None,
        net_pool: false,
        hugepages: a.hugepages,
        agent_cpl0: a.agent_cpl0,
    };
    if a.hugepages && (a.template.resolve()?.is_some() || a.via == Via::Cri) {
        return Err(bad(
            "--hugepages",
            "not with --template (a template's memory is a private file mapping) or --via cri",
        ));
    }
    if a.hugepages && !memory.is_multiple_of(2 << 20) {
        return Err(bad(
            "--memory",
            format!("{memory} bytes: with --hugepages, a multiple of 2 MiB"),
        ));
    }
    let max_n = *levels.iter().max().expect("non-empty");
    let need = max_n as u64 * sandbox_bytes(&spec) + MEMORY_MARGIN;
    let avail = mem_available();
    if need > avail {
        return Err(bad(
            "--concurrency",
            format!(
                "{max_n} sandboxes of {} MiB need {} MiB but the host has {} MiB available",
                sandbox_bytes(&spec) >> 20,
                need >> 20,
                avail >> 20
            ),
        ));
    }
    let vf_variants = a
        .variants
        .iter()
        .any(|v| v.policy().net == variant::NetKind::Vf);
    // While a pooled round runs, the refilled pool holds VFs too. Beyond a
    // PF's 256 the runtime's NIC gets more PFs, which the network spans.
    let vfs = max_n + if vf_variants { a.net_pool } else { 0 };
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
        cgroup_limits: cgroup::Limits::for_guest(memory, app_size + pmem_bytes, a.sandbox.cpus),
        rootfs_layer_bytes: image.as_ref().map(|(_, b)| *b),
        net_pool: a.net_pool,
        sgfs: 0,
        cni_server: !a.cni_exec,
    })?;
    if a.no_pool_pinning {
        rt.pool().set_pinning(false);
    }
    // Live sandboxes and the page pool's cache of the last pool round, each
    // at most max_n sandboxes of RAM, image region and window.
    let hugepages = a
        .hugepages
        .then(|| {
            let per_sandbox = (sandbox_bytes(&spec) >> 21) + 1;
            crate::hugepages::Hugepages::reserve(2 * max_n as u64 * per_sandbox + 16)
                .map_err(|e| bad("--hugepages", e.to_string()))
        })
        .transpose()?;
    let plan = BenchPlan {
        variants: a.variants.clone(),
        layer_modes,
        template: a.template.resolve()?,
        levels,
        spec,
        out: a.out.clone(),
        warmup: !a.no_warmup,
        net_pool: match (a.net_pool, a.net_pool_compare) {
            (0, _) => NetPoolRuns::Off,
            (_, false) => NetPoolRuns::On,
            (_, true) => NetPoolRuns::Compare,
        },
        hugepages,
        repeat: a.repeat,
    };
    Ok((rt, plan))
}

pub fn bench_startup_cli(a: &BenchStartupConfig) -> Result<(), Error> {
    runtime::instance::install_sigint_handler();
    let (rt, plan) = bench_setup(a)?;
    eprintln!("{}", cgroup::favordynmods_note(cgroup::favordynmods()));
    eprintln!(
        "{}",
        runtime::instance::state_root_note(runtime::instance::state_root_fs())
    );
    let result = run(&rt, &plan, &mut |l| eprintln!("{l}"));
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
    // After the leak check: every lent memfd is back (PiBooster's recycling, §3.3).
    let ps = rt.pool().stats();
    println!(
        "page pool: {} memfds back without waiting for a device unmap (no device mapped them: \
         host-only regions, PiBooster's third page type), {} after the NIC's unmap (quarantined \
         {:.2} ms on average after their VMM exited, at most {:.2} ms); {} device maps of \
         host-only memory refused; {} memfds pinned by the pool (once each), {} cached pinned",
        ps.returns_without_unmap,
        ps.returns_after_unmap,
        ps.unmap_wait_ns_total as f64 / ps.returns_after_unmap.max(1) as f64 / 1e6,
        ps.unmap_wait_ns_max as f64 / 1e6,
        ps.device_maps_refused,
        ps.pins_made,
        ps.cached_pinned
    );
    drop(rt);
    if runtime::instance::sigint_received() {
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
