//! The text tables a bench prints from the statistics: Table 1 per variant,
//! the concurrency sweep, and the rootfs reflink-against-copy lines.

use super::GroupStats;

/// Reflink against copy for each variant run both ways (same concurrency).
pub fn rootfs_comparison(groups: &[GroupStats]) -> String {
    let mut out = String::new();
    for g in groups {
        let Some(r) = g.rootfs.as_ref().filter(|r| r.mode == "reflink") else {
            continue;
        };
        let base = g.variant.trim_end_matches("+reflink");
        let copy = groups.iter().find_map(|c| {
            c.rootfs
                .as_ref()
                .filter(|cr| cr.mode == "copy" && c.concurrency == g.concurrency)
                .filter(|_| c.variant.trim_end_matches("+copy") == base)
        });
        if let Some(c) = copy {
            let x = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
            out.push_str(&format!(
                "\n== rootfs writable layer per sandbox, {base} x{}: copy {:.3} ms wall / {:.3} ms CPU -> reflink {:.3} ms wall / {:.3} ms CPU ({:.0}x / {:.0}x less)\n",
                g.concurrency,
                c.wall_avg_ms,
                c.cpu_avg_ms,
                r.wall_avg_ms,
                r.cpu_avg_ms,
                x(c.wall_avg_ms, r.wall_avg_ms),
                x(c.cpu_avg_ms, r.cpu_avg_ms)
            ));
        }
    }
    out
}

/// The tables of a bench: `format_table` at the highest concurrency, and
/// with several levels a sweep table (avg / p99 against concurrency).
pub fn format_levels(groups: &[GroupStats], levels: &[usize]) -> String {
    let top = levels.iter().copied().max().unwrap_or(0);
    let main: Vec<GroupStats> = groups
        .iter()
        .filter(|g| g.concurrency == top)
        .cloned()
        .collect();
    let mut out = format_table(&main);
    if levels.len() > 1 {
        out.push_str("\n== sweep: end-to-end ms (avg / p99) against concurrency\n");
        for g in groups {
            out.push_str(&format!(
                "{:<10} {:>5}  avg {:>9.1}  p99 {:>9.1}  failed {}\n",
                g.variant, g.concurrency, g.avg_ms, g.p99_ms, g.failed
            ));
        }
    }
    out
}

/// The stdout table: one block per variant, Table 1 shape.
pub fn format_table(groups: &[GroupStats]) -> String {
    let mut out = String::new();
    for g in groups {
        out.push_str(&format!(
            "\n== {} (concurrency {}, {} ready, {} failed)\n",
            g.variant, g.concurrency, g.ready, g.failed
        ));
        out.push_str(&format!(
            "end-to-end ms: avg {:.1}  p50 {:.1}  p99 {:.1}  max {:.1}\n",
            g.avg_ms, g.p50_ms, g.p99_ms, g.max_ms
        ));
        if let Some(a) = g.answered {
            out.push_str(&format!(
                "requests answered by the echo server: {a}/{}\n",
                g.ready
            ));
        }
        // span: the stage's whole time; path: its time on the critical
        // path. The % columns are shares of the path and sum to 100%.
        out.push_str(&format!(
            "{:<12} {:>10} {:>10} {:>8} {:>10} {:>8}\n",
            "stage", "span ms", "path ms", "% avg", "p99 ms", "% p99"
        ));
        for s in &g.stages {
            out.push_str(&format!(
                "{:<12} {:>10.2} {:>10.2} {:>7.1}% {:>10.2} {:>7.1}%{}\n",
                s.stage.name(),
                s.avg_ms,
                s.path_avg_ms,
                s.avg_share * 100.0,
                s.p99_ms,
                s.p99_share * 100.0,
                if s.overlaps { "  overlaps" } else { "" }
            ));
        }
        out.push_str(&format!(
            "{:<12} {:>10} {:>10.2} {:>7.1}% {:>10} {:>7.1}%\n",
            "(wait)",
            "",
            g.wait_avg_ms,
            g.wait_avg_share * 100.0,
            "",
            g.wait_p99_share * 100.0
        ));
        let (sa, sp) = g
            .stages
            .iter()
            .fold((g.wait_avg_share, g.wait_p99_share), |a, s| {
                (a.0 + s.avg_share, a.1 + s.p99_share)
            });
        out.push_str(&format!(
            "{:<12} {:>10} {:>10} {:>7.1}% {:>10} {:>7.1}%\n",
            "path total",
            "",
            "",
            sa * 100.0,
            "",
            sp * 100.0
        ));
        out.push_str(&format!(
            "{:<12} {:>10} {:>10.2} {:>7.1}% {:>10.2} {:>7.1}%  (on the path)\n",
            "VF-related",
            "",
            g.vf_related_avg_ms,
            g.vf_related_avg_share * 100.0,
            g.vf_related_p99_ms,
            g.vf_related_p99_share * 100.0
        ));
        let over: Vec<&str> = g
            .stages
            .iter()
            .filter(|s| s.overlaps)
            .map(|s| s.stage.name())
            .collect();
        if !over.is_empty() {
            out.push_str(&format!(
                "overlapping stages (span beside the path, not summed): {}\n",
                over.join(", ")
            ));
        }
        if let Some(o) = &g.net_overhead {
            out.push_str(&crate::overhead::format_line(o));
        }
        if let Some(c) = &g.cpu {
            out.push_str(&crate::cpu::format_line(c, g.avg_ms));
        }
        if let Some(w) = &g.prezero {
            out.push_str(&w.describe());
            out.push('\n');
        }
        if let Some(r) = &g.rootfs {
            out.push_str(&format!(
                "rootfs layer ({}): wall avg {:.3} ms p99 {:.3} ms, host CPU avg {:.3} ms p99 {:.3} ms, {:.0} bytes copied avg\n",
                r.mode, r.wall_avg_ms, r.wall_p99_ms, r.cpu_avg_ms, r.cpu_p99_ms, r.bytes_copied_avg
            ));
        }
        if let Some(r) = &g.vs_vanilla {
            // Signed change against vanilla: -65.7% means 65.7% less time.
            out.push_str(&format!(
                "vs vanilla: avg {:+.1}%  p99 {:+.1}%  VF-related {:+.1}%\n",
                -r.avg * 100.0,
                -r.p99 * 100.0,
                -r.vf_related_avg * 100.0
            ));
        }
    }
    out
}
