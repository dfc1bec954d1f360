//! The network overhead as FastIOV counts it (§3.1, §6.2): a variant's
//! end-to-end time minus that of `no-net` in the same run, and how much of
//! vanilla's overhead a variant removes.

use serde::{Deserialize, Serialize};

use crate::stats::GroupStats;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NetOverhead {
    /// The `no-net` group it is measured against.
    pub baseline: String,
    /// avg / p99 end-to-end minus the baseline's, ms.
    pub avg_ms: f64,
    pub p99_ms: f64,
    /// End-to-end / the baseline's.
    pub ratio_avg: f64,
    pub ratio_p99: f64,
    /// This overhead / vanilla's (FastIOV: 0.039), and 1 - that.
    pub of_vanilla_avg: Option<f64>,
    pub of_vanilla_p99: Option<f64>,
    pub reduction_vs_vanilla_avg: Option<f64>,
}

/// `label` split as variant name and the suffix that names its round mode
/// ("fastiov+reflink" -> ("fastiov", "+reflink")).
fn split(label: &str) -> (&str, &str) {
    match label.find('+') {
        Some(i) => label.split_at(i),
        None => (label, ""),
    }
}

/// The group named `base` + the suffix of `label` at `concurrency`, else plain `base`.
fn peer<'a>(
    groups: &'a [GroupStats],
    base: &str,
    label: &str,
    concurrency: usize,
) -> Option<&'a GroupStats> {
    // A pooled group is measured against the plain baselines (vanilla
    // without the pool is the paper's), other modes against their own.
    let (_, suffix) = split(label);
    let suffix = suffix.replace("+pool", "");
    let find = |name: &str| {
        groups
            .iter()
            .find(|g| g.variant == name && g.concurrency == concurrency && g.ready > 0)
    };
    find(&format!("{base}{suffix}")).or_else(|| find(base))
}

/// Fills `net_overhead` of every group that has a `no-net` group at the same concurrency.
pub fn add_net_overhead(groups: &mut [GroupStats]) {
    let div = |a: f64, b: f64| if b != 0.0 { a / b } else { 0.0 };
    let computed: Vec<Option<NetOverhead>> = groups
        .iter()
        .map(|g| {
            if g.ready == 0 {
                return None;
            }
            let base = peer(groups, "no-net", &g.variant, g.concurrency)?;
            let van = peer(groups, "vanilla", &g.variant, g.concurrency);
            let (avg, p99) = (g.avg_ms - base.avg_ms, g.p99_ms - base.p99_ms);
            let van_over = van.map(|v| (v.avg_ms - base.avg_ms, v.p99_ms - base.p99_ms));
            Some(NetOverhead {
                baseline: base.variant.clone(),
                avg_ms: avg,
                p99_ms: p99,
                ratio_avg: div(g.avg_ms, base.avg_ms),
                ratio_p99: div(g.p99_ms, base.p99_ms),
                of_vanilla_avg: van_over.map(|v| div(avg, v.0)),
                of_vanilla_p99: van_over.map(|v| div(p99, v.1)),
                reduction_vs_vanilla_avg: van_over.map(|v| 1.0 - div(avg, v.0)),
            })
        })
        .collect();
    for (g, o) in groups.iter_mut().zip(computed) {
        g.net_overhead = o;
    }
}

/// One table line.
pub fn format_line(o: &NetOverhead) -> String {
    let mut s = format!(
        "network overhead vs {}: avg {:+.1} ms  p99 {:+.1} ms  (end-to-end {:.2}x / p99 {:.2}x)",
        o.baseline, o.avg_ms, o.p99_ms, o.ratio_avg, o.ratio_p99
    );
    if let (Some(a), Some(p), Some(r)) = (
        o.of_vanilla_avg,
        o.of_vanilla_p99,
        o.reduction_vs_vanilla_avg,
    ) {
        s.push_str(&format!(
            "; {a:.3} of vanilla's (p99 {p:.3}), reduced {:.1}%",
            r * 100.0
        ));
    }
    s.push('\n');
    s
}

/// The headline summary: one line per group with an overhead, every level.
pub fn format_summary(groups: &[GroupStats]) -> String {
    let mut out = String::from(
        "\n== network overhead (end-to-end minus no-net, same run; FastIOV §6.2)\n\
         variant             n   avg ms   p99 ms  x no-net  of vanilla  reduction\n",
    );
    for g in groups {
        let Some(o) = &g.net_overhead else { continue };
        let of = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
        out.push_str(&format!(
            "{:<16} {:>4} {:>8.1} {:>8.1} {:>8.2}x {:>11} {:>10}\n",
            g.variant,
            g.concurrency,
            o.avg_ms,
            o.p99_ms,
            o.ratio_avg,
            of(o.of_vanilla_avg),
            o.reduction_vs_vanilla_avg
                .map_or("-".to_string(), |r| format!("{:.1}%", r * 100.0)),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::group_stats;

    fn g(name: &str, n: usize, avg: f64, p99: f64) -> GroupStats {
        let mut g = group_stats(name, n, &[], 0);
        g.ready = n;
        g.avg_ms = avg;
        g.p99_ms = p99;
        g
    }

    #[test]
    fn overhead_is_against_no_net_of_the_same_level_and_mode() {
        let mut gs = vec![
            g("no-net", 50, 100.0, 150.0),
            g("vanilla", 50, 600.0, 1150.0),
            g("fastiov", 50, 120.0, 190.0),
            g("no-net", 200, 400.0, 500.0),
            g("fastiov", 200, 500.0, 600.0),
            g("no-net+copy", 50, 200.0, 300.0),
            g("fastiov+copy", 50, 260.0, 300.0),
            g("vanilla+pool", 50, 500.0, 900.0),
            g("fastiov+pool", 50, 110.0, 160.0),
        ];
        add_net_overhead(&mut gs);
        let f = gs[2].net_overhead.as_ref().unwrap();
        assert_eq!(f.baseline, "no-net");
        assert!((f.avg_ms - 20.0).abs() < 1e-9);
        assert!((f.ratio_avg - 1.2).abs() < 1e-9);
        assert!((f.of_vanilla_avg.unwrap() - 0.04).abs() < 1e-9);
        assert!((f.of_vanilla_p99.unwrap() - 0.04).abs() < 1e-9);
        assert!((f.reduction_vs_vanilla_avg.unwrap() - 0.96).abs() < 1e-9);
        let f200 = gs[4].net_overhead.as_ref().unwrap();
        assert!((f200.avg_ms - 100.0).abs() < 1e-9);
        assert_eq!(f200.of_vanilla_avg, None, "no vanilla at 200");
        let c = gs[6].net_overhead.as_ref().unwrap();
        assert_eq!(c.baseline, "no-net+copy");
        assert!((c.avg_ms - 60.0).abs() < 1e-9);
        assert!(gs[0].net_overhead.as_ref().unwrap().avg_ms.abs() < 1e-9);
        // A pooled group against plain no-net and plain vanilla.
        let p = gs[8].net_overhead.as_ref().unwrap();
        assert_eq!(p.baseline, "no-net");
        assert!((p.of_vanilla_avg.unwrap() - 0.02).abs() < 1e-9);
        let sum = format_summary(&gs);
        assert!(sum.contains("0.040"), "{sum}");
        assert!(format_line(f).contains("reduced 96.0%"));
    }
}
