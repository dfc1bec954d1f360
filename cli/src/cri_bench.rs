//! `burstvm bench startup --via cri`: FastIOV's startup benchmark as the
//! paper ran it (`crictl runp`): per variant, N sandboxes through the runtime
//! library directly, then N pod sandboxes issued at once with RunPodSandbox
//! through a private containerd's CRI plugin and the burstvm shim, attached
//! to this process's runtime (`host::export`). Both paths' stage tables
//! come from the runtime's trace; the extra time containerd and the shim add
//! and the host CPU per sandbox are printed side by side.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bench::startup::{self, BenchStartupConfig};
use bench::stats::{self, GroupStats};
use runtime::{leaks, Runtime, Variant};
use serde::Serialize;
use trace::TraceEvent;

use crate::cri::{CriClient, PodArgs};

/// The CRI round of one (variant, concurrency), beside its direct round.
#[derive(Debug, Serialize)]
pub struct PathCompare {
    pub variant: String,
    pub concurrency: usize,
    pub direct_avg_ms: f64,
    pub direct_p99_ms: f64,
    /// RunPodSandbox issued → sandbox ready (the runtime's `ready`).
    pub cri_ready_avg_ms: f64,
    pub cri_ready_p99_ms: f64,
    /// RunPodSandbox issued → the call returned.
    pub rpc_avg_ms: f64,
    pub rpc_p99_ms: f64,
    /// Issued → the runtime's first stage (containerd: netns, CNI ADD, shim start, Create).
    pub before_runtime_avg_ms: f64,
    /// Ready → RunPodSandbox returned (shim Start reply, containerd's bookkeeping).
    pub after_ready_avg_ms: f64,
    /// RunPodSandbox avg/p99 minus the direct path's.
    pub extra_avg_ms: f64,
    pub extra_p99_ms: f64,
    /// Host CPU (all processes) per sandbox, start through teardown.
    pub cpu_ms_direct: f64,
    pub cpu_ms_cri: f64,
    pub cri_failed: usize,
}

#[derive(Debug, Serialize)]
struct Summary {
    #[serde(flatten)]
    spec: startup::RoundSpec,
    groups: Vec<GroupStats>,
    paths: Vec<PathCompare>,
    failures: Vec<String>,
    leaks: Vec<String>,
}

/// Busy CPU time of the whole host (all CPUs), ms, from /proc/stat.
pub(crate) fn host_cpu_ms() -> f64 {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<u64> = s
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal
    let busy: u64 = [0, 1, 2, 5, 6, 7].iter().filter_map(|&i| f.get(i)).sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    busy as f64 * 1000.0 / hz
}

pub(crate) fn avg(v: &[u64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<u64>() as f64 / v.len() as f64 / 1e6
    }
}

pub(crate) fn p99(v: &[u64]) -> f64 {
    stats::percentile(v, 0.99) as f64 / 1e6
}

/// Looks a CNI plugin up where the runtime does.
fn find_plugin(bin: &Path, name: &str) -> Result<PathBuf> {
    runtime::instance::cni_path(bin)
        .into_iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| anyhow!("CNI plugin {name} not found (scripts/setup.sh installs it)"))
}

pub(crate) struct CriSetup {
    pub dir: PathBuf,
    pub trace: PathBuf,
    pub containerd: shim::containerd::Containerd,
}

/// A private containerd with the burstvm shim attached to `rt`; `linux`:
/// fields that make the shim config the Linux guest's (kernel, agent, ...).
pub(crate) fn setup(
    rt: &Runtime,
    a: &BenchStartupConfig,
    memory: u64,
    linux: Option<serde_json::Value>,
) -> Result<CriSetup> {
    let pause = a.images.join("pause.tar");
    if !pause.is_file() {
        bail!(
            "--images: {} missing; run scripts/build-images.sh {} first",
            pause.display(),
            a.images.display()
        );
    }
    let exe = std::env::current_exe().context("current exe")?;
    let bin_dir = exe.parent().context("exe dir")?.to_path_buf();
    if !bin_dir.join("containerd-shim-burstvm-v2").is_file() {
        bail!(
            "containerd-shim-burstvm-v2 is not next to {} (cargo build --release builds both)",
            exe.display()
        );
    }
    let dir = PathBuf::from(format!("/tmp/burstvm-bench-cri-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cni_bin = dir.join("cni-bin");
    std::fs::create_dir_all(&cni_bin).with_context(|| cni_bin.display().to_string())?;
    // The forwarder too, so the NIC daemon serves containerd's ADD and DEL
    // (`runtime::host::engine_cni_config`).
    for p in [
        "burstvm-cni",
        runtime::cni_exec::FORWARDER,
        "host-local",
        "loopback",
    ] {
        std::os::unix::fs::symlink(find_plugin(rt.bin(), p)?, cni_bin.join(p))
            .with_context(|| format!("link {p}"))?;
    }
    let info = runtime::host::export(
        rt,
        &dir.join("services"),
        &dir.join("cni-conf/10-burstvm.conf"),
        &cni_bin,
    )?;
    let trace = dir.join("cri-trace.jsonl");
    let shim_config = dir.join("shim.json");
    shim::containerd::write_shim_config(
        &shim_config,
        &dir.join("services/services.json"),
        "fastiov",
        memory,
        Some(&trace),
    )
    .with_context(|| shim_config.display().to_string())?;
    if let Some(extra) = linux {
        let mut v: serde_json::Value = serde_json::from_slice(
            &std::fs::read(&shim_config).with_context(|| shim_config.display().to_string())?,
        )?;
        for (k, x) in extra.as_object().into_iter().flatten() {
            v[k] = x.clone();
        }
        std::fs::write(&shim_config, serde_json::to_vec_pretty(&v)?)
            .with_context(|| shim_config.display().to_string())?;
    }
    let _ = info;
    let containerd = shim::containerd::Containerd::start(shim::containerd::ContainerdConfig {
        dir: dir.join("containerd"),
        shim_dir: bin_dir,
        shim_config,
        cni_bin_dir: cni_bin,
        cni_conf_dir: dir.join("cni-conf"),
        sandbox_image: "burstvm.local/pause:1".into(),
    })?;
    containerd.import("k8s.io", &pause)?;
    Ok(CriSetup {
        dir,
        trace,
        containerd,
    })
}

/// What a CRI round left after StopPodSandbox/RemovePodSandbox (waits up to 15 s).
pub(crate) fn cri_leftovers(rt: &Runtime, s: &CriSetup, sandboxes: &[String]) -> Vec<String> {
    let layout = runtime::cgroup::Layout::detect().ok();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let mut left: Vec<String> = s
            .containerd
            .shim_pids()
            .into_iter()
            .map(|p| format!("shim {p}"))
            .collect();
        let set: std::collections::HashSet<&str> = sandboxes.iter().map(String::as_str).collect();
        left.extend(
            runtime::vmmproc::processes(|sb| {
                std::str::from_utf8(sb).is_ok_and(|sb| set.contains(sb))
            })
            .into_iter()
            .map(|p| format!("VMM {p}")),
        );
        if let Some(l) = &layout {
            for sb in sandboxes {
                left.extend(
                    l.dirs(sb)
                        .into_iter()
                        .filter(|d| d.exists())
                        .map(|d| format!("cgroup {}", d.display())),
                );
            }
        }
        left.extend(
            shim::containerd::mounts_under(&s.containerd.dir().join("state"))
                .into_iter()
                .map(|m| format!("mount {}", m.display())),
        );
        match rt.assigned_vfs() {
            Ok(v) => left.extend(v.into_iter().map(|(vf, sb)| format!("VF {vf} ({sb})"))),
            Err(e) => left.push(format!("NIC: {e}")),
        }
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

struct CriRound {
    issue_ns: u64,
    /// sandbox id → when its RunPodSandbox returned.
    returned: HashMap<String, u64>,
    failures: Vec<String>,
    events: Vec<TraceEvent>,
    cpu_ms: f64,
    leftovers: Vec<String>,
}

fn cri_round(rt: &Runtime, s: &CriSetup, c: &CriClient, v: Variant, n: usize) -> Result<CriRound> {
    let pods: Vec<PodArgs> = (0..n)
        .map(|i| PodArgs {
            name: format!("bench-{}-{n}-{i}", v.name().to_lowercase()),
            namespace: "bench".into(),
            uid: None,
            runtime: "burstvm".into(),
            annotations: vec![(shim::config::ANNOTATION_VARIANT.into(), v.name().into())],
            // Without a network the pod takes the host's: containerd runs no CNI.
            host_network: v.policy().net == runtime::variant::NetKind::None,
            log_dir: None,
        })
        .collect();
    let cpu0 = host_cpu_ms();
    let (issue_ns, results) = c.runp_concurrent(&pods);
    let mut ids = Vec::new();
    let mut returned = HashMap::new();
    let mut failures = Vec::new();
    for (pod, (r, end)) in pods.iter().zip(results) {
        match r {
            Ok(id) => {
                returned.insert(shim::sandbox_id("k8s.io", &id), end);
                ids.push(id);
            }
            Err(e) => failures.push(format!("{} via cri: {e}", pod.name)),
        }
    }
    // Pods that failed may still exist in containerd; list and remove every pod of the round.
    let all: Vec<String> = c
        .pods()
        .unwrap_or_default()
        .into_iter()
        .filter(|p| p.metadata.as_ref().is_some_and(|m| m.namespace == "bench"))
        .map(|p| p.id)
        .collect();
    failures.extend(c.stop_remove_concurrent(&all));
    let cpu_ms = host_cpu_ms() - cpu0;
    let sandboxes: Vec<String> = returned.keys().cloned().collect();
    // No file yet when no sandbox became ready.
    let events: Vec<TraceEvent> = (if s.trace.exists() {
        trace::read_trace(&s.trace).map_err(|e| anyhow!("{}: {e}", s.trace.display()))?
    } else {
        Vec::new()
    })
    .into_iter()
    .filter(|e| returned.contains_key(&e.sandbox))
    .collect();
    let leftovers = cri_leftovers(rt, s, &sandboxes);
    Ok(CriRound {
        issue_ns,
        returned,
        failures,
        events,
        cpu_ms,
        leftovers,
    })
}

pub fn run(a: &BenchStartupConfig) -> Result<()> {
    runtime::instance::install_sigint_handler();
    let (rt, plan) = startup::bench_setup(a)?;
    std::fs::create_dir_all(&plan.out).with_context(|| plan.out.display().to_string())?;
    let s = setup(&rt, a, plan.spec.memory_bytes, None)?;
    let client = CriClient::connect(s.containerd.socket(), Duration::from_secs(a.timeout + 60))?;
    let mut groups = Vec::new();
    let mut paths = Vec::new();
    let mut failures = Vec::new();
    let mut leaks_found = Vec::new();
    let mut trace_out = String::new();
    // End-to-end times per group label and concurrency, for the CDF.
    let mut e2e_series: Vec<(String, usize, Vec<u64>)> = Vec::new();
    'levels: for &n in &plan.levels {
        for &v in &plan.variants {
            if rt.interrupted() {
                break 'levels;
            }
            if !startup::prepare_measured_round(&rt, v, n, &plan, &mut |l| eprintln!("{l}"))? {
                leaks_found.push(format!("{v} x{n}: after the warm-up round"));
            }
            eprintln!("{v} x{n}: measured round, direct");
            let cpu0 = host_cpu_ms();
            let r = startup::run_round(&rt, v, n, &format!("m{n}"), &plan.spec);
            let cpu_direct = host_cpu_ms() - cpu0;
            let lc = leaks::check(&rt, Duration::from_secs(5));
            if !lc.is_clean() {
                leaks_found.push(format!("{v} x{n} direct: {}", lc.describe()));
            }
            failures.extend(r.failures.iter().map(|f| f.to_string()));
            let all = trace::read_trace(rt.trace_path()).map_err(|e| anyhow!("trace: {e}"))?;
            let failed: std::collections::HashSet<&str> =
                r.failures.iter().map(|f| f.sandbox.as_str()).collect();
            let devs: Vec<TraceEvent> = startup::round_events(&all, &r.ids)
                .into_iter()
                .filter(|e| !failed.contains(e.sandbox.as_str()))
                .collect();
            let dtimes = stats::per_sandbox(&devs, Some(r.issue_ns));
            let mut g = stats::group_stats(v.name(), n, &dtimes, r.failures.len());
            g.answered = r.answered;
            groups.push(g);

            eprintln!("{v} x{n}: measured round, via containerd's CRI plugin");
            let cr = cri_round(&rt, &s, &client, v, n)?;
            for e in devs.iter().chain(&cr.events) {
                trace_out.push_str(&serde_json::to_string(e).expect("event"));
                trace_out.push('\n');
            }
            if !cr.leftovers.is_empty() {
                leaks_found.push(format!("{v} x{n} cri: {}", cr.leftovers.join(", ")));
            }
            for f in &cr.failures {
                eprintln!("  failure: {f}");
            }
            failures.extend(cr.failures.iter().cloned());
            let ctimes = stats::per_sandbox(&cr.events, Some(cr.issue_ns));
            groups.push(stats::group_stats(
                &format!("{}/cri", v.name()),
                n,
                &ctimes,
                n - ctimes.len(),
            ));
            let mut rpc = Vec::new();
            let mut before = Vec::new();
            let mut after = Vec::new();
            for t in &ctimes {
                let evs = cr.events.iter().filter(|e| e.sandbox == t.sandbox);
                let first = evs.clone().map(|e| e.start_ns).min().unwrap_or(cr.issue_ns);
                let last = evs.map(|e| e.end_ns).max().unwrap_or(cr.issue_ns);
                let ret = cr.returned.get(&t.sandbox).copied().unwrap_or(last);
                rpc.push(ret.saturating_sub(cr.issue_ns));
                before.push(first.saturating_sub(cr.issue_ns));
                after.push(ret.saturating_sub(last));
            }
            let de2e: Vec<u64> = dtimes.iter().map(|t| t.e2e_ns).collect();
            let ce2e: Vec<u64> = ctimes.iter().map(|t| t.e2e_ns).collect();
            e2e_series.push((v.name().into(), n, de2e.clone()));
            e2e_series.push((format!("{}/cri", v.name()), n, ce2e.clone()));
            paths.push(PathCompare {
                variant: v.name().into(),
                concurrency: n,
                direct_avg_ms: avg(&de2e),
                direct_p99_ms: p99(&de2e),
                cri_ready_avg_ms: avg(&ce2e),
                cri_ready_p99_ms: p99(&ce2e),
                rpc_avg_ms: avg(&rpc),
                rpc_p99_ms: p99(&rpc),
                before_runtime_avg_ms: avg(&before),
                after_ready_avg_ms: avg(&after),
                extra_avg_ms: avg(&rpc) - avg(&de2e),
                extra_p99_ms: p99(&rpc) - p99(&de2e),
                cpu_ms_direct: cpu_direct / n as f64,
                cpu_ms_cri: cr.cpu_ms / n as f64,
                cri_failed: n - ctimes.len(),
            });
        }
    }
    // Each path against its own vanilla: the CRI groups' labels lose "/cri" meanwhile.
    let (mut direct, mut cri): (Vec<GroupStats>, Vec<GroupStats>) = groups
        .into_iter()
        .partition(|g| !g.variant.ends_with("/cri"));
    stats::add_reductions(&mut direct);
    for g in &mut cri {
        g.variant.truncate(g.variant.len() - "/cri".len());
    }
    stats::add_reductions(&mut cri);
    let mut groups = Vec::new();
    for d in direct {
        let v = d.variant.clone();
        groups.push(d);
        if let Some(i) = cri.iter().position(|c| c.variant == v) {
            let mut c = cri.remove(i);
            c.variant.push_str("/cri");
            groups.push(c);
        }
    }
    let mut table = stats::format_levels(&groups, &plan.levels);
    table.push_str(&format_paths(&paths));
    std::fs::write(plan.out.join("trace.jsonl"), trace_out).context("trace.jsonl")?;
    let summary = Summary {
        spec: plan.spec.clone(),
        groups,
        paths,
        failures: failures.clone(),
        leaks: leaks_found.clone(),
    };
    std::fs::write(
        plan.out.join("summary.json"),
        serde_json::to_vec_pretty(&summary).expect("summary"),
    )
    .context("summary.json")?;
    let plots = draw(&plan, &summary.groups, &e2e_series)?;
    print!("{table}");
    for p in &plots {
        println!("wrote {}", p.display());
    }
    for f in &failures {
        eprintln!("failure: {f}");
    }
    println!("wrote {}", plan.out.join("trace.jsonl").display());
    println!("wrote {}", plan.out.join("summary.json").display());
    let dir = s.dir.clone();
    drop(client);
    drop(s);
    let _ = std::fs::remove_dir_all(dir);
    let lc = leaks::check(&rt, Duration::from_secs(5));
    if !leaks_found.is_empty() || !lc.is_clean() {
        bail!(
            "leaks: {}; at the end: {}",
            leaks_found.join("; "),
            lc.describe()
        );
    }
    if runtime::instance::sigint_received() {
        bail!("interrupted");
    }
    println!("leak check: clean after every round (direct and CRI)");
    Ok(())
}

/// Fig. 11 and 12 with both paths: the breakdown and the CDF at the highest concurrency.
fn draw(
    plan: &startup::BenchPlan,
    groups: &[GroupStats],
    e2e: &[(String, usize, Vec<u64>)],
) -> Result<Vec<PathBuf>> {
    let top = *plan.levels.iter().max().unwrap_or(&0);
    let mib = plan.spec.memory_bytes >> 20;
    let main: Vec<GroupStats> = groups
        .iter()
        .filter(|g| g.concurrency == top && g.ready > 0)
        .cloned()
        .collect();
    if main.is_empty() {
        return Ok(Vec::new());
    }
    let b = plan.out.join("breakdown.png");
    bench::plot::breakdown(
        &b,
        &format!("average startup breakdown, direct and via CRI: {top} sandboxes, {mib} MiB"),
        &main,
    )?;
    let series: Vec<(String, Vec<u64>)> = e2e
        .iter()
        .filter(|(_, n, v)| *n == top && !v.is_empty())
        .map(|(l, _, v)| (l.clone(), v.clone()))
        .collect();
    let c = plan.out.join("cdf.png");
    bench::plot::cdf(
        &c,
        &format!("startup time distribution, direct and via CRI: {top} sandboxes, {mib} MiB"),
        &series,
    )?;
    Ok(vec![b, c])
}

/// The side-by-side table: what containerd and the shim add to a startup.
pub fn format_paths(paths: &[PathCompare]) -> String {
    let mut out =
        String::from("\n== direct vs containerd CRI (RunPodSandbox): end-to-end ms, avg / p99\n");
    out.push_str(&format!(
        "{:<10} {:>5} {:>17} {:>17} {:>17} {:>9} {:>9} {:>15} {:>15} {:>7}\n",
        "variant",
        "N",
        "direct",
        "cri ready",
        "RunPodSandbox",
        "before",
        "after",
        "extra",
        "CPU ms/sb d|cri",
        "failed"
    ));
    for p in paths {
        out.push_str(&format!(
            "{:<10} {:>5} {:>8.1} / {:>6.1} {:>8.1} / {:>6.1} {:>8.1} / {:>6.1} {:>9.1} {:>9.1} {:>+7.1} / {:>+5.1} {:>7.1}|{:<7.1} {:>7}\n",
            p.variant,
            p.concurrency,
            p.direct_avg_ms,
            p.direct_p99_ms,
            p.cri_ready_avg_ms,
            p.cri_ready_p99_ms,
            p.rpc_avg_ms,
            p.rpc_p99_ms,
            p.before_runtime_avg_ms,
            p.after_ready_avg_ms,
            p.extra_avg_ms,
            p.extra_p99_ms,
            p.cpu_ms_direct,
            p.cpu_ms_cri,
            p.cri_failed
        ));
    }
    out.push_str(
        "before = issue → the runtime's first stage (containerd: netns, CNI ADD, shim start, Create); \
         after = ready → RunPodSandbox returned; extra = RunPodSandbox − direct\n",
    );
    out
}
