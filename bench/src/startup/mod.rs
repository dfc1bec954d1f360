//! `burstvm bench startup`: N sandbox creations issued at the same instant per
//! variant, after an uncounted warm-up round of the same size.//!
//! This file: the whole benchmark (plan, variants in turn, leak checks,
//! summary, plots); one round of N concurrent sandboxes and the host-memory
//! and pre-zeroing checks around it are in `round.rs`.

mod round;
mod setup;

pub use round::*;
pub use setup::*;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Barrier;
use std::time::Duration;

use serde::Serialize;
use trace::TraceEvent;

use crate::stats::{self, GroupStats};
use runtime::instance::{NicRestarts, Runtime};
use runtime::leaks::{self, LeakReport};
use runtime::sandbox::rootfs::{LayerMode, RootfsSpec};
use runtime::sandbox::{RootfsCost, Sandbox, SandboxFailure, SandboxSpec};
use runtime::variant::{NetKind, Variant};

/// Before a pooled round: the pool refills while the host is idle; wait
/// (bounded) until it is full, and say how full it got.
fn wait_net_pool(rt: &Runtime, log: &mut dyn FnMut(&str)) {
    let t0 = std::time::Instant::now();
    if let Some((ready, target, err)) = rt.wait_net_pool(NET_POOL_FILL_BOUND) {
        log(&format!(
            "  net pool: {ready} of {target} attachments ready after {:.0} ms{}",
            t0.elapsed().as_secs_f64() * 1e3,
            err.map(|e| format!(" (last refill error: {e})"))
                .unwrap_or_default()
        ));
    }
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

#[derive(Debug)]
pub struct BenchPlan {
    pub variants: Vec<Variant>,
    /// Writable-layer modes each variant runs with (empty: no rootfs).
    pub layer_modes: Vec<LayerMode>,
    /// Each variant also starts from this template (RunD §4.3).
    pub template: Option<PathBuf>,
    pub levels: Vec<usize>,
    pub spec: RoundSpec,
    pub out: PathBuf,
    pub warmup: bool,
    /// Which rounds of VF variants claim from the network pool.
    pub net_pool: NetPoolRuns,
    /// `--hugepages`: the 2 MiB pages reserved for the run, given back on drop.
    pub hugepages: Option<crate::hugepages::Hugepages>,
    /// Measured rounds per group (`--repeat`), interleaved: every group's first,
    /// then every group's second, ... so that the host's drift reaches all alike.
    pub repeat: usize,
}

/// `--net-pool` / `--net-pool-compare`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetPoolRuns {
    /// No pool.
    Off,
    /// Every VF variant claims from the pool.
    On,
    /// Every VF variant runs without, then with the pool (`<variant>+pool`).
    Compare,
}

/// How long a pooled round waits for the pool to be full.
pub const NET_POOL_FILL_BOUND: Duration = Duration::from_secs(120);

#[derive(Debug)]
pub struct BenchOutput {
    pub summary: Summary,
    pub table: String,
    pub plots: Vec<PathBuf>,
    pub clean: bool,
}

/// The variant's runtime set-up, and (unless the variant takes memory from
/// the pool) room in host memory for `n` fresh sandboxes.
fn prepare_variant(
    rt: &Runtime,
    v: Variant,
    n: usize,
    spec: &RoundSpec,
    log: &mut dyn FnMut(&str),
) -> Result<u64, crate::Error> {
    rt.prepare_variant(v)?;
    let mut released = 0;
    if !v.policy().uses_pool() {
        released = fit_pool_for_fresh_round(rt, n, spec);
        if released > 0 {
            log(&format!("pool: released {released} cached memfds so that {n} fresh sandboxes fit in host memory"));
        }
    }
    Ok(released)
}

/// Says when the NIC daemon died during a round and was restarted (or
/// could not be); false if a restart failed.
fn log_nic_restarts(nic: &NicRestarts, log: &mut dyn FnMut(&str)) -> bool {
    if nic.restarts > 0 {
        log(&format!(
            "  the NIC daemon died and was restarted {} time(s) during the round",
            nic.restarts
        ));
    }
    for e in &nic.errors {
        log(&format!("  NIC daemon restart failed: {e}"));
    }
    nic.errors.is_empty()
}

/// The uncounted warm-up round of `n` × `v` (sandbox ids `w<n><tag>`: the
/// concurrency and the run's tag are in them, so ids of sweep levels and
/// runs never collide in the trace). False if it left something behind.
fn warm_up(
    rt: &Runtime,
    v: Variant,
    n: usize,
    label: &str,
    tag: &str,
    spec: &RoundSpec,
    log: &mut dyn FnMut(&str),
) -> bool {
    log(&format!("{label} x{n}: warm-up round"));
    let w = run_round(rt, v, n, &format!("w{n}{tag}"), spec);
    for f in &w.failures {
        log(&format!("  warm-up failure: {f}"));
    }
    log_nic_restarts(&w.nic, log);
    let lc = leaks::check(rt, Duration::from_secs(5));
    if !lc.is_clean() {
        log(&format!("  after warm-up: {}", lc.describe()));
        return false;
    }
    true
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
    prepare_variant(rt, v, n, &plan.spec, log)?;
    let clean = !plan.warmup || warm_up(rt, v, n, v.name(), "", &plan.spec, log);
    if let Some(w) = idle_prezero(rt, v) {
        log(&format!("  {}", w.describe()));
    }
    Ok(clean)
}

/// Runs every (concurrency, variant) pair and writes trace.jsonl, summary.json and the plots.
pub fn run(
    rt: &Runtime,
    plan: &BenchPlan,
    log: &mut dyn FnMut(&str),
) -> Result<BenchOutput, crate::Error> {
    std::fs::create_dir_all(&plan.out).map_err(|source| crate::Error::Output {
        path: plan.out.clone(),
        source,
    })?;
    let mut measured: Vec<(Round, String, Vec<TraceEvent>)> = Vec::new();
    let mut leak_checks = Vec::new();
    let mut clean = true;
    let modes: Vec<Option<LayerMode>> = if plan.layer_modes.is_empty() {
        vec![None]
    } else {
        plan.layer_modes.iter().copied().map(Some).collect()
    };
    let starts: Vec<Option<&PathBuf>> = match &plan.template {
        Some(t) => vec![None, Some(t)],
        None => vec![None],
    };
    let pooled = |v: Variant| -> &'static [bool] {
        match (v.policy().net == NetKind::Vf, plan.net_pool) {
            (false, _) | (_, NetPoolRuns::Off) => &[false],
            (true, NetPoolRuns::On) => &[true],
            (true, NetPoolRuns::Compare) => &[false, true],
        }
    };
    let runs: Vec<(Variant, Option<LayerMode>, Option<&PathBuf>, bool)> = plan
        .variants
        .iter()
        .flat_map(|&v| modes.iter().map(move |&m| (v, m)))
        .flat_map(|(v, m)| starts.iter().map(move |&t| (v, m, t)))
        .flat_map(|(v, m, t)| pooled(v).iter().map(move |&p| (v, m, t, p)))
        .collect();
    let repeat = plan.repeat.max(1);
    let mut pool_shrunk = false;
    'levels: for &n in &plan.levels {
        for (rep, &(v, mode, template, net_pool)) in
            (0..repeat).flat_map(|rep| runs.iter().map(move |r| (rep, r)))
        {
            if rt.interrupted() {
                break 'levels;
            }
            let mut round_spec = plan.spec.clone();
            if let (Some(r), Some(m)) = (round_spec.rootfs.as_mut(), mode) {
                r.layer_mode = m;
            }
            round_spec.template = template.cloned();
            round_spec.net_pool = net_pool;
            // With two layer modes the groups are named by mode too.
            let mut label = match mode {
                Some(m) if modes.len() > 1 => format!("{v}+{}", m.name()),
                _ => v.name().to_string(),
            };
            if template.is_some() {
                label.push_str("+template");
            }
            if net_pool {
                label.push_str("+pool");
            }
            // A fresh round that shrank the pool leaves the next pool round a cold
            // pool: with --repeat that round gets its warm-up again.
            if prepare_variant(rt, v, n, &plan.spec, log)? > 0 {
                pool_shrunk = true;
            }
            let warm = rep == 0 || (pool_shrunk && v.policy().uses_pool());
            if warm && v.policy().uses_pool() {
                pool_shrunk = false;
            }
            let mut tag = mode.map_or(String::new(), |m| m.name()[..1].to_string());
            if template.is_some() {
                tag.push('t');
            }
            if net_pool {
                tag.push('p');
            }
            if plan.warmup && warm {
                if net_pool {
                    wait_net_pool(rt, log);
                }
                clean &= warm_up(rt, v, n, &label, &tag, &round_spec, log);
            }
            if repeat > 1 {
                tag.push_str(&format!("r{rep}"));
            }
            let prezero = idle_prezero(rt, v);
            if let Some(w) = &prezero {
                log(&format!("  {}", w.describe()));
            }
            // Also before a round without the pool: its refill must not run during the round.
            if plan.net_pool != NetPoolRuns::Off {
                wait_net_pool(rt, log);
            }
            if rt.interrupted() {
                break 'levels;
            }
            if repeat > 1 {
                log(&format!(
                    "{label} x{n}: measured round {} of {repeat}",
                    rep + 1
                ));
            } else {
                log(&format!("{label} x{n}: measured round"));
            }
            let mut r = run_round(rt, v, n, &format!("m{n}{tag}"), &round_spec);
            r.prezero = prezero;
            for f in &r.failures {
                log(&format!("  failure: {f}"));
            }
            for e in &r.teardown_errors {
                log(&format!("  teardown: {e}"));
            }
            clean &= log_nic_restarts(&r.nic, log);
            let lc = leaks::check(rt, Duration::from_secs(5));
            log(&format!("  {}", lc.describe()));
            clean &= lc.is_clean() && r.teardown_errors.is_empty();
            leak_checks.push(LeakCheck {
                after: format!("{label} x{n}"),
                clean: lc.is_clean(),
                report: lc,
            });
            let all = trace::read_trace(rt.trace_path())?;
            let evs = round_events(&all, &r.ids);
            measured.push((r, label, evs));
        }
    }
    // What the pool's attachments cost, counted apart from the starts.
    let refill = rt.net_pool_refill_cpu();
    // The pool's attachments are DELed before the caller's final leak check.
    if let Err(e) = rt.stop_net_pool() {
        log(&format!("  {e}"));
        clean = false;
    }
    // Outputs.
    let mut groups = Vec::new();
    let mut failures = Vec::new();
    let mut trace_out = String::new();
    // One group per (label, concurrency): its repetitions' sandboxes together.
    let mut keys: Vec<(&str, usize)> = Vec::new();
    for (r, label, _) in &measured {
        if !keys.contains(&(label.as_str(), r.concurrency)) {
            keys.push((label.as_str(), r.concurrency));
        }
    }
    for (label, n) in keys {
        let rounds: Vec<_> = measured
            .iter()
            .filter(|(r, l, _)| l == label && r.concurrency == n)
            .collect();
        let (mut times, mut failed, mut answered) = (Vec::new(), 0, None::<usize>);
        let (mut costs, mut cpus) = (Vec::new(), Vec::new());
        for (r, _, evs) in &rounds {
            let ok = ready_events(r, evs);
            let t = stats::per_sandbox(&ok, Some(r.issue_ns));
            if let Some(c) = &r.cpu {
                cpus.push((c.clone(), t.len()));
            }
            times.extend(t);
            failed += r.failures.len();
            if let Some(a) = r.answered {
                answered = Some(answered.unwrap_or(0) + a);
            }
            costs.extend(r.rootfs_costs.iter().copied());
            failures.extend(r.failures.iter().cloned());
            for e in evs {
                trace_out.push_str(&serde_json::to_string(e).expect("event serializes"));
                trace_out.push('\n');
            }
        }
        let first = &rounds[0].0;
        let mut g = stats::group_stats(label, n, &times, failed);
        g.answered = answered;
        g.rootfs = first.rootfs.map(|m| stats::rootfs_stats(m, &costs));
        g.cpu = crate::cpu::weighted_mean(&cpus);
        g.rounds = rounds.len();
        g.cpu_total_per_round = cpus.iter().map(|(c, _)| c.total_ms).collect();
        if let (Some(c), Some((made @ 1.., ns)), true) =
            (g.cpu.as_mut(), refill, label.ends_with("+pool"))
        {
            c.pool_refill_ms = ns as f64 / made as f64 / 1e6;
        }
        g.prezero = first.prezero.clone();
        groups.push(g);
    }
    stats::add_reductions(&mut groups);
    write(&plan.out.join("trace.jsonl"), trace_out.as_bytes())?;
    let top = *plan.levels.iter().max().unwrap_or(&0);
    let main: Vec<GroupStats> = groups
        .iter()
        .filter(|g| g.concurrency == top)
        .cloned()
        .collect();
    let table = stats::format_table(&main)
        + &stats::rootfs_comparison(&main)
        + &crate::overhead::format_summary(&groups)
        + &crate::cpu::format_summary(&groups)
        + &crate::cpu::format_vcpu_split(&groups)
        + &crate::cpu::format_repeats(&groups);
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
    std::fs::write(path, data).map_err(|source| crate::Error::Output {
        path: path.to_path_buf(),
        source,
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
    let mut drawn: Vec<&str> = Vec::new();
    for (r, label, evs) in measured.iter().filter(|(r, _, _)| r.concurrency == top) {
        // With --repeat: the first repetition's timeline and distribution.
        if drawn.contains(&label.as_str()) {
            continue;
        }
        drawn.push(label);
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
            template: None,
            net_pool: false,
            hugepages: false,
            agent_cpl0: false,
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
