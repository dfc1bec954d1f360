//! Host CPU per sandbox start, by owner: the averages of what
//! `runtime::cpuacct` measured, and their lines in the bench's tables.

use runtime::cpuacct::StartCpu;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuPerSandbox {
    pub runtime_ms: f64,
    pub cni_ms: f64,
    pub nicd_ms: f64,
    pub vmm_ms: f64,
    pub total_ms: f64,
    /// The VMM's CPU after READY until its background zeroer ended: the
    /// zeroing a lazy start defers, not part of `total_ms`.
    #[serde(default)]
    pub after_ready_ms: f64,
    /// With the network pool: the host CPU of one pooled attachment (netns
    /// and CNI ADD, made while the host is idle), not part of `total_ms`.
    #[serde(default)]
    pub pool_refill_ms: f64,
}

/// Per-sandbox averages of a round: `starts` from the sandboxes that reached
/// READY, `nicd_ns` the daemon's CPU over the round.
pub fn per_sandbox(starts: &[StartCpu], nicd_ns: Option<u64>) -> Option<CpuPerSandbox> {
    if starts.is_empty() {
        return None;
    }
    let n = starts.len() as f64;
    let avg = |f: fn(&StartCpu) -> u64| starts.iter().map(f).sum::<u64>() as f64 / n / 1e6;
    let mut c = CpuPerSandbox {
        runtime_ms: avg(|s| s.runtime_ns),
        cni_ms: avg(|s| s.cni_ns),
        vmm_ms: avg(|s| s.vmm_ns),
        nicd_ms: nicd_ns.map_or(0.0, |d| d as f64 / n / 1e6),
        total_ms: 0.0,
        after_ready_ms: avg(|s| s.vmm_after_ready_ns),
        pool_refill_ms: 0.0,
    };
    c.total_ms = c.runtime_ms + c.cni_ms + c.vmm_ms + c.nicd_ms;
    Some(c)
}

/// One table line, beside the wall time.
pub fn format_line(c: &CpuPerSandbox, wall_avg_ms: f64) -> String {
    format!(
        "host CPU ms per sandbox start: total {:.2} = runtime {:.2} + CNI plugins {:.2} + NIC daemon {:.2} + VMM {:.2}  (wall avg {:.1} ms); after READY, the VMM's deferred zeroing: {:.2}\n",
        c.total_ms, c.runtime_ms, c.cni_ms, c.nicd_ms, c.vmm_ms, wall_avg_ms, c.after_ready_ms
    )
}

/// The CPU table of a bench: one line per group, every level.
pub fn format_summary(groups: &[crate::stats::GroupStats]) -> String {
    let mut out = String::from(
        "\n== host CPU ms per sandbox start, by owner (wall avg beside)\n\
         (after READY: the VMM's deferred zeroing; pool refill: the network pool's netns\n\
         and CNI ADD per attachment, made while the host is idle; neither in the total)\n\
         variant             n  runtime      CNI      NIC      VMM    total   wall avg  after READY  pool refill\n",
    );
    for g in groups {
        let Some(c) = &g.cpu else { continue };
        out.push_str(&format!(
            "{:<16} {:>4} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>10.1} {:>12.2} {:>12.2}\n",
            g.variant,
            g.concurrency,
            c.runtime_ms,
            c.cni_ms,
            c.nicd_ms,
            c.vmm_ms,
            c.total_ms,
            g.avg_ms,
            c.after_ready_ms,
            c.pool_refill_ms
        ));
    }
    out
}

/// CPU time (ns) all threads of process `pid` have run, from
/// `/proc/PID/task/*/schedstat` (first field: time on a CPU, steal excluded).
pub fn process_cpu_ns(pid: u32) -> std::io::Result<u64> {
    let dir = std::path::PathBuf::from(format!("/proc/{pid}/task"));
    let io = |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", dir.display()));
    let mut total = 0;
    for task in std::fs::read_dir(&dir).map_err(io)? {
        let path = task.map_err(io)?.path().join("schedstat");
        // A thread that ended meanwhile is simply not counted.
        if let Ok(s) = std::fs::read_to_string(&path) {
            total += s
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn averages_per_owner() {
        let s = |r, c, v| StartCpu {
            runtime_ns: r,
            cni_ns: c,
            vmm_ns: v,
            vmm_after_ready_ns: 2 * v,
        };
        let c = per_sandbox(
            &[s(1_000_000, 2_000_000, 10_000_000), s(3_000_000, 0, 0)],
            Some(4_000_000),
        )
        .unwrap();
        assert_eq!(c.runtime_ms, 2.0);
        assert_eq!(c.cni_ms, 1.0);
        assert_eq!(c.vmm_ms, 5.0);
        assert_eq!(c.nicd_ms, 2.0);
        assert_eq!(c.total_ms, 10.0);
        // Deferred zeroing is reported apart, never in the start's total.
        assert_eq!(c.after_ready_ms, 10.0);
        assert!(per_sandbox(&[], None).is_none());
        assert!(format_line(&c, 50.0).contains("total 10.00"));
    }
}
