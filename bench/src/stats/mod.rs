//! Startup statistics over merged traces: end-to-end time per sandbox and the
//! per-stage shares of FastIOV's Table 1.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use trace::{Stage, TraceEvent};

mod table;

pub use table::{format_levels, format_table, rootfs_comparison};

/// One sandbox's startup, derived from its trace events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxTimes {
    pub sandbox: String,
    /// From the round's issue instant to the end of the sandbox's last stage.
    pub e2e_ns: u64,
    /// Summed duration of each stage present.
    pub stages: BTreeMap<Stage, u64>,
    /// Each stage's time on the critical path (`critpath`).
    #[serde(default)]
    pub path: BTreeMap<Stage, u64>,
    /// Time on the path that no stage covers (queueing, gaps).
    #[serde(default)]
    pub wait_ns: u64,
}

impl SandboxTimes {
    /// VF-related time on the critical path (FastIOV Table 1's overhead).
    pub fn vf_related_ns(&self) -> u64 {
        self.path
            .iter()
            .filter(|(s, _)| s.is_vf_related())
            .map(|(_, d)| d)
            .sum()
    }
}

/// Groups `events` by sandbox; `origin_ns` is the instant the creations were
/// issued (None: each sandbox's own first start).
pub fn per_sandbox(events: &[TraceEvent], origin_ns: Option<u64>) -> Vec<SandboxTimes> {
    let mut by: BTreeMap<&str, Vec<&TraceEvent>> = BTreeMap::new();
    for e in events {
        by.entry(e.sandbox.as_str()).or_default().push(e);
    }
    by.into_iter()
        .map(|(sb, evs)| {
            let start = evs.iter().map(|e| e.start_ns).min().unwrap_or(0);
            let end = evs.iter().map(|e| e.end_ns).max().unwrap_or(0);
            let origin = origin_ns.unwrap_or(start).min(start);
            let mut stages = BTreeMap::new();
            for e in &evs {
                *stages.entry(e.stage).or_insert(0) += e.duration_ns();
            }
            let cp = crate::critpath::critical_path(&evs, origin);
            debug_assert_eq!(cp.total_ns(), end.saturating_sub(origin));
            SandboxTimes {
                sandbox: sb.to_string(),
                e2e_ns: end.saturating_sub(origin),
                stages,
                path: cp.on_path,
                wait_ns: cp.wait_ns,
            }
        })
        .collect()
}

/// Nearest-rank percentile (q in 0..=1) of unsorted values; 0 when empty.
pub fn percentile(values: &[u64], q: f64) -> u64 {
    if values.is_empty() {
        return 0;
    }
    let mut v = values.to_vec();
    v.sort_unstable();
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// Median of `v`, the upper one for an even count (0 for none); sorts `v`.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn mean(values: &[u64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().map(|&v| v as f64).sum::<f64>() / values.len() as f64
    }
}

fn ms(ns: f64) -> f64 {
    ns / 1e6
}

fn share(part: f64, whole: f64) -> f64 {
    if whole > 0.0 {
        part / whole
    } else {
        0.0
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageStats {
    pub stage: Stage,
    /// Sandboxes in which the stage appears.
    pub count: usize,
    /// Stage time (whole span, on the path or not), averaged over all sandboxes.
    pub avg_ms: f64,
    /// Its time on the critical path, averaged over all sandboxes.
    #[serde(default)]
    pub path_avg_ms: f64,
    /// path_avg_ms / avg end-to-end: these and `wait_avg_share` sum to 1.
    pub avg_share: f64,
    pub p99_ms: f64,
    /// On-path share of the stage in the p99 sandbox (the one at the p99
    /// rank of end-to-end): these and `wait_p99_share` sum to 1.
    pub p99_share: f64,
    /// The stage runs partly or wholly beside the critical path (its span
    /// exceeds its on-path time by more than 1%).
    #[serde(default)]
    pub overlaps: bool,
}

/// Reduction of a variant against vanilla: 1 - variant/vanilla.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reduction {
    pub avg: f64,
    pub p99: f64,
    pub vf_related_avg: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupStats {
    pub variant: String,
    pub concurrency: usize,
    /// Sandboxes that reached `ready`.
    pub ready: usize,
    pub failed: usize,
    pub avg_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub stages: Vec<StageStats>,
    /// Critical-path time no stage covers (queueing before the first
    /// stage, gaps between stages), average and share.
    #[serde(default)]
    pub wait_avg_ms: f64,
    #[serde(default)]
    pub wait_avg_share: f64,
    #[serde(default)]
    pub wait_p99_share: f64,
    pub vf_related_avg_ms: f64,
    pub vf_related_avg_share: f64,
    pub vf_related_p99_ms: f64,
    pub vf_related_p99_share: f64,
    pub vs_vanilla: Option<Reduction>,
    /// Ready sandboxes whose first request the echo server answered (None: no network).
    #[serde(default)]
    pub answered: Option<usize>,
    /// The writable rootfs layers of the round (None: no rootfs).
    #[serde(default)]
    pub rootfs: Option<RootfsStats>,
    /// End-to-end minus `no-net`'s in the same run (FastIOV §6.2).
    #[serde(default)]
    pub net_overhead: Option<crate::overhead::NetOverhead>,
    /// Host CPU per sandbox start, by owner (None: not measured).
    #[serde(default)]
    pub cpu: Option<crate::cpu::CpuPerSandbox>,
    /// `pre*`: what the idle zeroer did ahead of the round.
    #[serde(default)]
    pub prezero: Option<crate::startup::PrezeroWait>,
    /// Measured rounds merged into this group (`bench startup --repeat`).
    #[serde(default)]
    pub rounds: usize,
    /// Host CPU ms per start (`cpu.total_ms`) of each of those rounds, in order.
    #[serde(default)]
    pub cpu_total_per_round: Vec<f64>,
}

/// What making the writable layers cost, per sandbox (RunD §4.2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RootfsStats {
    /// "reflink" or "copy".
    pub mode: String,
    pub wall_avg_ms: f64,
    pub wall_p99_ms: f64,
    /// Host CPU time of the rootfs stage (the thread that made the layer).
    pub cpu_avg_ms: f64,
    pub cpu_p99_ms: f64,
    pub bytes_copied_avg: f64,
}

/// Statistics of the writable layers of one round.
pub fn rootfs_stats(
    mode: runtime::sandbox::rootfs::LayerMode,
    costs: &[runtime::sandbox::RootfsCost],
) -> RootfsStats {
    let wall: Vec<u64> = costs.iter().map(|c| c.wall_ns).collect();
    let cpu: Vec<u64> = costs.iter().map(|c| c.cpu_ns).collect();
    let bytes: Vec<u64> = costs.iter().map(|c| c.bytes_copied).collect();
    RootfsStats {
        mode: mode.name().into(),
        wall_avg_ms: ms(mean(&wall)),
        wall_p99_ms: ms(percentile(&wall, 0.99) as f64),
        cpu_avg_ms: ms(mean(&cpu)),
        cpu_p99_ms: ms(percentile(&cpu, 0.99) as f64),
        bytes_copied_avg: mean(&bytes),
    }
}

/// Statistics of one round (the sandboxes that reached `ready`).
pub fn group_stats(
    variant: &str,
    concurrency: usize,
    sandboxes: &[SandboxTimes],
    failed: usize,
) -> GroupStats {
    let e2e: Vec<u64> = sandboxes.iter().map(|s| s.e2e_ns).collect();
    let avg = mean(&e2e);
    let p99 = percentile(&e2e, 0.99) as f64;
    // The sandbox at the p99 rank of end-to-end: its path shares are the p99 shares.
    let p99_sb = sandboxes.iter().find(|s| s.e2e_ns as f64 == p99);
    let p99_of = |st: Option<Stage>| -> f64 {
        p99_sb.map_or(0.0, |s| {
            let d = match st {
                Some(st) => s.path.get(&st).copied().unwrap_or(0),
                None => s.wait_ns,
            };
            share(d as f64, s.e2e_ns as f64)
        })
    };
    let n = sandboxes.len().max(1) as f64;
    let mut stages = Vec::new();
    for st in Stage::ALL {
        let d: Vec<u64> = sandboxes
            .iter()
            .filter_map(|s| s.stages.get(&st).copied())
            .collect();
        if d.is_empty() {
            continue;
        }
        // Averaged over all sandboxes, so that shares add up like Table 1.
        let st_avg = d.iter().sum::<u64>() as f64 / n;
        let path_avg = sandboxes
            .iter()
            .map(|s| s.path.get(&st).copied().unwrap_or(0))
            .sum::<u64>() as f64
            / n;
        stages.push(StageStats {
            stage: st,
            count: d.len(),
            avg_ms: ms(st_avg),
            path_avg_ms: ms(path_avg),
            avg_share: share(path_avg, avg),
            p99_ms: ms(percentile(&d, 0.99) as f64),
            p99_share: p99_of(Some(st)),
            overlaps: st_avg > path_avg * 1.01,
        });
    }
    let wait_avg = sandboxes.iter().map(|s| s.wait_ns).sum::<u64>() as f64 / n;
    let vf: Vec<u64> = sandboxes.iter().map(|s| s.vf_related_ns()).collect();
    let vf_avg = mean(&vf);
    let vf_p99 = percentile(&vf, 0.99) as f64;
    GroupStats {
        variant: variant.to_string(),
        concurrency,
        ready: sandboxes.len(),
        failed,
        avg_ms: ms(avg),
        p50_ms: ms(percentile(&e2e, 0.5) as f64),
        p99_ms: ms(p99),
        max_ms: ms(e2e.iter().copied().max().unwrap_or(0) as f64),
        stages,
        wait_avg_ms: ms(wait_avg),
        wait_avg_share: share(wait_avg, avg),
        wait_p99_share: p99_of(None),
        vf_related_avg_ms: ms(vf_avg),
        vf_related_avg_share: share(vf_avg, avg),
        vf_related_p99_ms: ms(vf_p99),
        vf_related_p99_share: share(vf_p99, p99),
        vs_vanilla: None,
        answered: None,
        rootfs: None,
        net_overhead: None,
        cpu: None,
        prezero: None,
        rounds: 1,
        cpu_total_per_round: Vec::new(),
    }
}

/// Fills `vs_vanilla` of every group that has a vanilla group at the same
/// concurrency, and `net_overhead` of every group with a `no-net` one.
pub fn add_reductions(groups: &mut [GroupStats]) {
    crate::overhead::add_net_overhead(groups);
    let base: Vec<(usize, f64, f64, f64)> = groups
        .iter()
        .filter(|g| g.variant == "vanilla" && g.ready > 0)
        .map(|g| (g.concurrency, g.avg_ms, g.p99_ms, g.vf_related_avg_ms))
        .collect();
    let red = |b: f64, v: f64| if b > 0.0 { 1.0 - v / b } else { 0.0 };
    for g in groups.iter_mut() {
        if let Some(&(_, a, p, vf)) = base.iter().find(|b| b.0 == g.concurrency) {
            if g.variant != "vanilla" && g.ready > 0 {
                g.vs_vanilla = Some(Reduction {
                    avg: red(a, g.avg_ms),
                    p99: red(p, g.p99_ms),
                    vf_related_avg: red(vf, g.vf_related_avg_ms),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(sb: &str, stage: Stage, s: u64, e: u64) -> TraceEvent {
        TraceEvent {
            sandbox: sb.into(),
            stage,
            start_ns: s,
            end_ns: e,
        }
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn percentile_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 0.5), 50);
        assert_eq!(percentile(&v, 0.99), 99);
        assert_eq!(percentile(&v, 1.0), 100);
        assert_eq!(percentile(&[7], 0.99), 7);
        assert_eq!(percentile(&[], 0.5), 0);
        assert_eq!(percentile(&[3, 1, 2], 0.5), 2);
    }

    #[test]
    fn e2e_is_measured_from_the_issue_instant() {
        let evs = vec![
            ev("a", Stage::Cgroup, 10 * MS, 12 * MS),
            ev("a", Stage::Ready, 20 * MS, 30 * MS),
            ev("b", Stage::Cgroup, 15 * MS, 16 * MS),
            ev("b", Stage::VfOpen, 16 * MS, 26 * MS),
            ev("b", Stage::VfOpen, 26 * MS, 27 * MS),
        ];
        let t = per_sandbox(&evs, Some(10 * MS));
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].e2e_ns, 20 * MS);
        assert_eq!(t[1].e2e_ns, 17 * MS); // waited 5 ms before its first stage
        assert_eq!(t[1].stages[&Stage::VfOpen], 11 * MS);
        assert_eq!(t[1].vf_related_ns(), 11 * MS);
        let own = per_sandbox(&evs, None);
        assert_eq!(own[1].e2e_ns, 12 * MS);
    }

    fn synthetic(variant_scale: u64, n: u64) -> Vec<SandboxTimes> {
        (0..n)
            .map(|i| {
                let mut stages = BTreeMap::new();
                stages.insert(Stage::Cgroup, MS);
                stages.insert(Stage::VfOpen, variant_scale * (i + 1) * MS);
                stages.insert(Stage::Boot, 4 * MS);
                SandboxTimes {
                    sandbox: format!("s{i}"),
                    e2e_ns: MS + variant_scale * (i + 1) * MS + 4 * MS,
                    path: stages.clone(),
                    stages,
                    wait_ns: 0,
                }
            })
            .collect()
    }

    #[test]
    fn shares_and_reductions() {
        let van = synthetic(10, 100);
        let fast = synthetic(1, 100);
        let mut gs = vec![
            group_stats("vanilla", 100, &van, 0),
            group_stats("fastiov", 100, &fast, 1),
        ];
        add_reductions(&mut gs);
        let v = &gs[0];
        // e2e_i = 5 + 10*(i+1) ms: mean 510, p50 = 505, p99 = 995, max 1005.
        assert!((v.avg_ms - 510.0).abs() < 1e-9);
        assert!((v.p50_ms - 505.0).abs() < 1e-9);
        assert!((v.p99_ms - 995.0).abs() < 1e-9);
        assert!((v.max_ms - 1005.0).abs() < 1e-9);
        let vf = v.stages.iter().find(|s| s.stage == Stage::VfOpen).unwrap();
        assert!((vf.avg_share - 505.0 / 510.0).abs() < 1e-9);
        assert!((vf.p99_share - 990.0 / 995.0).abs() < 1e-9);
        assert!((v.vf_related_avg_share - 505.0 / 510.0).abs() < 1e-9);
        let shares: f64 = v.stages.iter().map(|s| s.avg_share).sum();
        assert!((shares - 1.0).abs() < 1e-9, "disjoint stages cover e2e");
        assert!(v.vs_vanilla.is_none());
        let r = gs[1].vs_vanilla.as_ref().unwrap();
        // fastiov e2e mean = 5 + 50.5 = 55.5 ms.
        assert!((r.avg - (1.0 - 55.5 / 510.0)).abs() < 1e-9);
        assert!((r.vf_related_avg - 0.9).abs() < 1e-9);
        assert_eq!(gs[1].failed, 1);
        let table = format_table(&gs);
        assert!(table.contains("== vanilla (concurrency 100, 100 ready, 0 failed)"));
        assert!(table.contains("vf-open"));
        assert!(table.contains("vs vanilla: avg -89.1%"));
    }

    #[test]
    fn rootfs_layers_are_compared_per_variant() {
        use runtime::sandbox::rootfs::LayerMode;
        use runtime::sandbox::RootfsCost;
        let cost = |w, c, b| RootfsCost {
            wall_ns: w * MS,
            cpu_ns: c * MS,
            bytes_copied: b,
        };
        let mut r = group_stats("no-net+reflink", 2, &synthetic(1, 2), 0);
        r.rootfs = Some(rootfs_stats(
            LayerMode::Reflink,
            &[cost(1, 1, 0), cost(3, 1, 0)],
        ));
        let mut c = group_stats("no-net+copy", 2, &synthetic(1, 2), 0);
        c.rootfs = Some(rootfs_stats(
            LayerMode::Copy,
            &[cost(100, 50, 10), cost(100, 50, 30)],
        ));
        assert_eq!(r.rootfs.as_ref().unwrap().wall_avg_ms, 2.0);
        assert_eq!(c.rootfs.as_ref().unwrap().bytes_copied_avg, 20.0);
        let cmp = rootfs_comparison(&[r.clone(), c.clone()]);
        assert!(cmp.contains("no-net x2: copy 100.000 ms wall / 50.000 ms CPU -> reflink 2.000 ms wall / 1.000 ms CPU (50x / 50x less)"), "{cmp}");
        assert!(format_table(&[c]).contains("rootfs layer (copy)"));
        assert_eq!(rootfs_comparison(&[r]), "");
    }

    #[test]
    fn path_shares_sum_to_one_with_overlapping_stages() {
        // Per sandbox i: queued i ms, vmm-spawn, vf-open beside boot, app
        // launch beside an async vf-driver, the link wait, ready.
        let mut evs = Vec::new();
        for i in 0..50u64 {
            let sb = format!("s{i}");
            let t = i * MS;
            evs.push(ev(&sb, Stage::VmmSpawn, t, t + 10 * MS));
            evs.push(ev(&sb, Stage::Boot, t + 10 * MS, t + 40 * MS));
            evs.push(ev(&sb, Stage::VfOpen, t + 12 * MS, t + 30 * MS));
            evs.push(ev(&sb, Stage::AppLaunch, t + 40 * MS, t + 50 * MS));
            evs.push(ev(&sb, Stage::VfDriver, t + 45 * MS, t + 55 * MS));
            evs.push(ev(&sb, Stage::VfLink, t + 55 * MS, t + (70 + i) * MS));
            evs.push(ev(&sb, Stage::Ready, t + (70 + i) * MS, t + (71 + i) * MS));
        }
        let times = per_sandbox(&evs, Some(0));
        for t in &times {
            assert_eq!(t.path.values().sum::<u64>() + t.wait_ns, t.e2e_ns);
        }
        let g = group_stats("fastiov", 50, &times, 0);
        let avg: f64 = g.stages.iter().map(|s| s.avg_share).sum::<f64>() + g.wait_avg_share;
        let p99: f64 = g.stages.iter().map(|s| s.p99_share).sum::<f64>() + g.wait_p99_share;
        assert!((avg - 1.0).abs() < 1e-9, "avg shares sum to {avg}");
        assert!((p99 - 1.0).abs() < 1e-9, "p99 shares sum to {p99}");
        let st = |x: Stage| g.stages.iter().find(|s| s.stage == x).unwrap();
        assert!(st(Stage::VfOpen).overlaps && st(Stage::VfOpen).avg_share == 0.0);
        assert!(st(Stage::AppLaunch).overlaps && !st(Stage::Boot).overlaps);
        // On-path VF time: driver 10 + link (15 + i) ms.
        assert!((g.vf_related_avg_ms - (25.0 + 24.5)).abs() < 1e-9);
        let table = format_table(&[g]);
        assert!(
            table.contains("path total") && table.contains("100.0%"),
            "{table}"
        );
        assert!(
            table.contains(
                "overlapping stages (span beside the path, not summed): vf-open, app-launch"
            ),
            "{table}"
        );
    }

    #[test]
    fn empty_group_is_all_zero() {
        let g = group_stats("fastiov", 5, &[], 5);
        assert_eq!(g.ready, 0);
        assert_eq!(g.avg_ms, 0.0);
        assert!(g.stages.is_empty());
    }
}
