//! `burstvm bench startup`: N sandbox creations issued at the same instant per
//! variant, after an uncounted warm-up round of the same size.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Barrier;
use std::time::Duration;

use serde::Serialize;
use trace::TraceEvent;

use crate::leaks::{self, LeakReport};
use crate::rootfs::{LayerMode, RootfsSpec};
use crate::runtime::Runtime;
use crate::sandbox::{RootfsCost, Sandbox, SandboxFailure, SandboxSpec};
use crate::stats::{self, GroupStats};
use crate::variant::Variant;

/// Host memory kept free on top of what a round needs.
pub const MEMORY_MARGIN: u64 = 1 << 30;

/// One round's outcome.
pub struct Round {
    pub variant: Variant,
    pub concurrency: usize,
    pub issue_ns: u64,
    pub ids: Vec<String>,
    pub failures: Vec<SandboxFailure>,
    pub teardown_errors: Vec<String>,
    /// Ready sandboxes whose request the echo server answered (None: no network).
    pub answered: Option<usize>,
    /// How the writable layers were made, and what each cost.
    pub rootfs: Option<LayerMode>,
    pub rootfs_costs: Vec<RootfsCost>,
}

/// Parameters shared by every sandbox of a round.
#[derive(Debug, Clone, Serialize)]
pub struct RoundSpec {
    pub memory_bytes: u64,
    pub cpus: f64,
    pub app_size: u64,
    // A limit of the run, not a property of the sandboxes: summary.json omits it.
    #[serde(skip_serializing)]
    pub timeout_secs: u64,
    /// The rootfs of every sandbox (its layer mode is set per round).
    #[serde(skip_serializing)]
    pub rootfs: Option<RootfsSpec>,
}

/// Starts `n` sandboxes at once (a barrier), waits until every one is ready
/// (or failed), then tears them all down.
pub fn run_round(rt: &Runtime, variant: Variant, n: usize, label: &str, spec: &RoundSpec) -> Round {
    let ids: Vec<String> = (0..n)
        .map(|i| {
            format!(
                "{}{}-{}-{}",
                rt.sandbox_prefix(),
                label,
                variant.name().to_lowercase(),
                i
            )
        })
        .collect();
    let barrier = Barrier::new(n + 1);
    let issue = AtomicU64::new(u64::MAX);
    let done = Barrier::new(n);
    type Outcome = Result<(Option<String>, Option<bool>, Option<RootfsCost>), SandboxFailure>;
    let results: Vec<Outcome> = std::thread::scope(|s| {
        let handles: Vec<_> = ids
            .iter()
            .map(|id| {
                let (barrier, issue, done) = (&barrier, &issue, &done);
                let sspec = SandboxSpec {
                    id: id.clone(),
                    variant,
                    memory_bytes: spec.memory_bytes,
                    cpus: spec.cpus,
                    app_size: spec.app_size,
                    keep_running: true,
                    timeout_secs: spec.timeout_secs,
                    rootfs: spec.rootfs.clone(),
                    kernel: None,
                    echo: false,
                };
                std::thread::Builder::new()
                    .name(format!("sb-{id}"))
                    .stack_size(256 << 10)
                    .spawn_scoped(s, move || {
                        // The last to arrive releases everyone: its clock is the issue instant.
                        if barrier.wait().is_leader() {
                            issue.fetch_min(trace::monotonic_ns(), Ordering::Relaxed);
                        }
                        // Every thread passes `done` (also on error or panic)
                        // before any sandbox is torn down: teardown (VM
                        // destruction) must not compete with startups.
                        let done_guard = ArriveOnDrop(done);
                        let mut sb = match Sandbox::start(rt, sspec) {
                            Ok(sb) => sb,
                            Err(f) => {
                                drop(done_guard);
                                return Err(f);
                            }
                        };
                        // READY already means the agent got its reply; the
                        // echo server's count is the server-side proof.
                        let answered = sb
                            .guest_ip
                            .map(|ip| rt.server().replies().get(&ip).copied().unwrap_or(0) > 0);
                        drop(done_guard);
                        let r = sb.check_alive();
                        let td = sb.teardown().err();
                        r.map(|_| (td, answered, sb.rootfs_cost))
                    })
                    .expect("spawn sandbox thread")
            })
            .collect();
        if barrier.wait().is_leader() {
            issue.fetch_min(trace::monotonic_ns(), Ordering::Relaxed);
        }
        handles
            .into_iter()
            .zip(&ids)
            .map(|(h, id)| {
                h.join().unwrap_or_else(|_| {
                    Err(SandboxFailure {
                        sandbox: id.clone(),
                        stage: "?".into(),
                        error: "sandbox thread panicked".into(),
                    })
                })
            })
            .collect()
    });
    let mut failures = Vec::new();
    let mut teardown_errors = Vec::new();
    let mut answered = None;
    let mut rootfs_costs = Vec::new();
    for r in results {
        match r {
            Ok((td, ans, cost)) => {
                teardown_errors.extend(td);
                rootfs_costs.extend(cost);
                if let Some(a) = ans {
                    *answered.get_or_insert(0) += a as usize;
                }
            }
            Err(f) => failures.push(f),
        }
    }
    Round {
        variant,
        concurrency: n,
        issue_ns: issue.into_inner(),
        ids,
        failures,
        teardown_errors,
        answered,
        rootfs: spec.rootfs.as_ref().map(|r| r.layer_mode),
        rootfs_costs,
    }
}

/// Waits on the barrier when dropped, so a thread arrives even if it panics.
struct ArriveOnDrop<'a>(&'a Barrier);

impl Drop for ArriveOnDrop<'_> {
    fn drop(&mut self) {
        self.0.wait();
    }
}

/// MemAvailable of /proc/meminfo, bytes.
pub fn mem_available() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
}

/// Guest bytes one sandbox backs: RAM plus the image region (agent + app
/// + a pmem rootfs image, 2 MiB aligned).
pub fn sandbox_bytes(spec: &RoundSpec) -> u64 {
    let pmem = spec.rootfs.as_ref().map_or(0, |r| r.guest_bytes());
    spec.memory_bytes + (spec.app_size + pmem + (2 << 20)).next_multiple_of(2 << 20)
}

/// Before a round of fresh-memory sandboxes: shrink the pool so that its
/// cached memory plus the round's fresh memory fits the host. Returns the
/// memfds released.
pub fn fit_pool_for_fresh_round(rt: &Runtime, n: usize, spec: &RoundSpec) -> u64 {
    let need =
        n as u64 * (sandbox_bytes(spec) + crate::cgroup::VMM_OVERHEAD_BYTES / 4) + MEMORY_MARGIN;
    let cached = rt.pool().stats().cached_bytes;
    let avail_if_empty = mem_available() + cached;
    rt.pool().shrink_to(avail_if_empty.saturating_sub(need))
}

/// Everything the bench writes to summary.json.
#[derive(Debug, Serialize)]
pub struct Summary {
    #[serde(flatten)]
    pub spec: RoundSpec,
    pub groups: Vec<GroupStats>,
    pub failures: Vec<SandboxFailure>,
    pub leak_checks: Vec<LeakCheck>,
}

#[derive(Debug, Serialize)]
pub struct LeakCheck {
    pub after: String,
    pub clean: bool,
    pub report: LeakReport,
}

/// The measured rounds' events, taken from the runtime's trace.
pub fn round_events(all: &[TraceEvent], ids: &[String]) -> Vec<TraceEvent> {
    let set: std::collections::HashSet<&str> = ids.iter().map(|s| s.as_str()).collect();
    all.iter()
        .filter(|e| set.contains(e.sandbox.as_str()))
        .cloned()
        .collect()
}

pub struct BenchPlan {
    pub variants: Vec<Variant>,
    /// Writable-layer modes each variant runs with (empty: no rootfs).
    pub layer_modes: Vec<LayerMode>,
    pub levels: Vec<usize>,
    pub spec: RoundSpec,
    pub out: PathBuf,
    pub warmup: bool,
}

pub struct BenchOutput {
    pub summary: Summary,
    pub table: String,
    pub plots: Vec<PathBuf>,
    pub clean: bool,
}

/// Everything before a measured round of `n` × `v`: the NIC's lock policy,
/// room for fresh memory, the uncounted warm-up round, the pre-zeroer.
/// Returns false if the warm-up left something behind. Shared by
/// `bench startup` and its `--via cri` variant (cli).
pub fn prepare_measured_round(
    rt: &Runtime,
    v: Variant,
    n: usize,
    plan: &BenchPlan,
    log: &mut dyn FnMut(&str),
) -> Result<bool, crate::Error> {
    let mut clean = true;
    rt.prepare_variant(v)?;
    if !v.policy().uses_pool() {
        let released = fit_pool_for_fresh_round(rt, n, &plan.spec);
        if released > 0 {
            log(&format!("pool: released {released} cached memfds so that {n} fresh sandboxes fit in host memory"));
        }
    }
    if plan.warmup {
        log(&format!("{v} x{n}: warm-up round"));
        // The concurrency is in the label: sandbox ids of sweep levels must not collide in the trace.
        let w = run_round(rt, v, n, &format!("w{n}"), &plan.spec);
        for f in &w.failures {
            log(&format!("  warm-up failure: {f}"));
        }
        let lc = leaks::check(rt, Duration::from_secs(5));
        if !lc.is_clean() {
            log(&format!("  after warm-up: {}", lc.describe()));
            clean = false;
        }
    }
    let mp = v.policy().memory_policy;
    if let Some(p) = mp.strip_prefix("pre").and_then(|p| p.parse::<u8>().ok()) {
        // What the idle pre-zeroer would have done between bursts.
        rt.pool()
            .prezero_now(p)
            .map_err(crate::runtime::RuntimeError::from)?;
    } else {
        rt.pool().set_prezero_percent(0);
    }
    Ok(clean)
}

/// Runs every (concurrency, variant) pair and writes trace.jsonl, summary.json and the plots.
pub fn run(
    rt: &Runtime,
    plan: &BenchPlan,
    log: &mut dyn FnMut(&str),
) -> Result<BenchOutput, crate::Error> {
    std::fs::create_dir_all(&plan.out).map_err(|e| crate::Error::Output {
        path: plan.out.clone(),
        reason: e.to_string(),
    })?;
    let mut measured: Vec<(Round, String, Vec<TraceEvent>)> = Vec::new();
    let mut leak_checks = Vec::new();
    let mut clean = true;
    let modes: Vec<Option<LayerMode>> = if plan.layer_modes.is_empty() {
        vec![None]
    } else {
        plan.layer_modes.iter().copied().map(Some).collect()
    };
    let runs: Vec<(Variant, Option<LayerMode>)> = plan
        .variants
        .iter()
        .flat_map(|&v| modes.iter().map(move |&m| (v, m)))
        .collect();
    'levels: for &n in &plan.levels {
        for &(v, mode) in &runs {
            if rt.interrupted() {
                break 'levels;
            }
            let mut round_spec = plan.spec.clone();
            if let (Some(r), Some(m)) = (round_spec.rootfs.as_mut(), mode) {
                r.layer_mode = m;
            }
            // With two layer modes the groups are named by mode too.
            let label = match mode {
                Some(m) if modes.len() > 1 => format!("{v}+{}", m.name()),
                _ => v.name().to_string(),
            };
            rt.prepare_variant(v)?;
            if !v.policy().uses_pool() {
                let released = fit_pool_for_fresh_round(rt, n, &plan.spec);
                if released > 0 {
                    log(&format!("pool: released {released} cached memfds so that {n} fresh sandboxes fit in host memory"));
                }
            }
            let tag = mode.map_or(String::new(), |m| m.name()[..1].to_string());
            if plan.warmup {
                log(&format!("{label} x{n}: warm-up round"));
                // The concurrency is in the label: sandbox ids of sweep levels must not collide in the trace.
                let w = run_round(rt, v, n, &format!("w{n}{tag}"), &round_spec);
                for f in &w.failures {
                    log(&format!("  warm-up failure: {f}"));
                }
                let lc = leaks::check(rt, Duration::from_secs(5));
                if !lc.is_clean() {
                    log(&format!("  after warm-up: {}", lc.describe()));
                    clean = false;
                }
            }
            let mp = v.policy().memory_policy;
            if let Some(p) = mp.strip_prefix("pre").and_then(|p| p.parse::<u8>().ok()) {
                // What the idle pre-zeroer would have done between bursts.
                rt.pool()
                    .prezero_now(p)
                    .map_err(crate::runtime::RuntimeError::from)?;
            } else {
                rt.pool().set_prezero_percent(0);
            }
            if rt.interrupted() {
                break 'levels;
            }
            log(&format!("{label} x{n}: measured round"));
            let r = run_round(rt, v, n, &format!("m{n}{tag}"), &round_spec);
            for f in &r.failures {
                log(&format!("  failure: {f}"));
            }
            for e in &r.teardown_errors {
                log(&format!("  teardown: {e}"));
            }
            let lc = leaks::check(rt, Duration::from_secs(5));
            log(&format!("  {}", lc.describe()));
            clean &= lc.is_clean() && r.teardown_errors.is_empty();
            leak_checks.push(LeakCheck {
                after: format!("{label} x{n}"),
                clean: lc.is_clean(),
                report: lc,
            });
            let all = trace::read_trace(rt.trace_path()).map_err(|e| crate::Error::Output {
                path: rt.trace_path().to_path_buf(),
                reason: e.to_string(),
            })?;
            let evs = round_events(&all, &r.ids);
            measured.push((r, label, evs));
        }
    }
    // Outputs.
    let mut groups = Vec::new();
    let mut failures = Vec::new();
    let mut trace_out = String::new();
    for (r, label, evs) in &measured {
        let ok = ready_events(r, evs);
        let times = stats::per_sandbox(&ok, Some(r.issue_ns));
        let mut g = stats::group_stats(label, r.concurrency, &times, r.failures.len());
        g.answered = r.answered;
        g.rootfs = r.rootfs.map(|m| stats::rootfs_stats(m, &r.rootfs_costs));
        groups.push(g);
        failures.extend(r.failures.iter().cloned());
        for e in evs {
            trace_out.push_str(&serde_json::to_string(e).expect("event serializes"));
            trace_out.push('\n');
        }
    }
    stats::add_reductions(&mut groups);
    write(&plan.out.join("trace.jsonl"), trace_out.as_bytes())?;
    let top = *plan.levels.iter().max().unwrap_or(&0);
    let main: Vec<GroupStats> = groups
        .iter()
        .filter(|g| g.concurrency == top)
        .cloned()
        .collect();
    let table = stats::format_table(&main) + &stats::rootfs_comparison(&main);
    let mut sweep_table = String::new();
    if plan.levels.len() > 1 {
        sweep_table.push_str("\n== sweep: end-to-end ms (avg / p99) against concurrency\n");
        for g in &groups {
            sweep_table.push_str(&format!(
                "{:<10} {:>5}  avg {:>9.1}  p99 {:>9.1}  failed {}\n",
                g.variant, g.concurrency, g.avg_ms, g.p99_ms, g.failed
            ));
        }
    }
    let summary = Summary {
        spec: plan.spec.clone(),
        groups,
        failures,
        leak_checks,
    };
    write(
        &plan.out.join("summary.json"),
        &serde_json::to_vec_pretty(&summary).expect("summary serializes"),
    )?;
    let plots = draw(plan, &measured, &summary.groups, top)?;
    Ok(BenchOutput {
        table,
        summary,
        plots,
        clean,
    })
}

fn write(path: &Path, data: &[u8]) -> Result<(), crate::Error> {
    std::fs::write(path, data).map_err(|e| crate::Error::Output {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

fn draw(
    plan: &BenchPlan,
    measured: &[(Round, String, Vec<TraceEvent>)],
    groups: &[GroupStats],
    top: usize,
) -> Result<Vec<PathBuf>, crate::Error> {
    use crate::plot;
    let mut out = Vec::new();
    let mib = plan.spec.memory_bytes >> 20;
    let mut cdf_series = Vec::new();
    for (r, label, evs) in measured.iter().filter(|(r, _, _)| r.concurrency == top) {
        let ok = ready_events(r, evs);
        if ok.is_empty() {
            continue;
        }
        let p = plan.out.join(format!("timeline-{label}.png"));
        plot::timeline(
            &p,
            &format!("{label} startup timeline: {top} sandboxes, {mib} MiB"),
            &ok,
            r.issue_ns,
        )?;
        out.push(p);
        let e2e: Vec<u64> = stats::per_sandbox(&ok, Some(r.issue_ns))
            .iter()
            .map(|s| s.e2e_ns)
            .collect();
        cdf_series.push((label.clone(), e2e));
    }
    let main: Vec<GroupStats> = groups
        .iter()
        .filter(|g| g.concurrency == top && g.ready > 0)
        .cloned()
        .collect();
    if !main.is_empty() {
        let p = plan.out.join("breakdown.png");
        plot::breakdown(
            &p,
            &format!("average startup breakdown: {top} sandboxes, {mib} MiB"),
            &main,
        )?;
        out.push(p);
        let p = plan.out.join("cdf.png");
        plot::cdf(
            &p,
            &format!("startup time distribution: {top} sandboxes, {mib} MiB"),
            &cdf_series,
        )?;
        out.push(p);
    }
    if plan.levels.len() > 1 && groups.iter().any(|g| g.ready > 0) {
        let p = plan.out.join("sweep.png");
        plot::sweep(
            &p,
            &format!("startup time against concurrency, {mib} MiB"),
            groups,
        )?;
        out.push(p);
    }
    Ok(out)
}

/// The trace events of the sandboxes of a round that did not fail.
fn ready_events(r: &Round, evs: &[TraceEvent]) -> Vec<TraceEvent> {
    let failed: std::collections::HashSet<&str> =
        r.failures.iter().map(|f| f.sandbox.as_str()).collect();
    evs.iter()
        .filter(|e| !failed.contains(e.sandbox.as_str()))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use trace::Stage;

    #[test]
    fn round_events_keep_only_the_round() {
        let ev = |sb: &str| TraceEvent {
            sandbox: sb.into(),
            stage: Stage::Boot,
            start_ns: 1,
            end_ns: 2,
        };
        let all = vec![ev("w-0"), ev("m-0"), ev("m-1"), ev("m-10")];
        let ids = vec!["m-0".to_string(), "m-1".to_string()];
        let got: Vec<String> = round_events(&all, &ids)
            .into_iter()
            .map(|e| e.sandbox)
            .collect();
        assert_eq!(got, vec!["m-0", "m-1"]);
    }

    #[test]
    fn sandbox_bytes_count_the_image_region() {
        let spec = RoundSpec {
            memory_bytes: 64 << 20,
            cpus: 1.0,
            app_size: 0,
            timeout_secs: 1,
            rootfs: None,
        };
        assert_eq!(sandbox_bytes(&spec), (64 << 20) + (2 << 20));
        let spec = RoundSpec {
            app_size: (3 << 20) + 1,
            ..spec
        };
        assert_eq!(sandbox_bytes(&spec), (64 << 20) + (6 << 20));
        assert!(mem_available() > 0);
    }
}
