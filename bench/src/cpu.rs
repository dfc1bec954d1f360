//! Host CPU per sandbox start, by owner: the averages of what
//! `runtime::cpuacct` measured, and their lines in the bench's tables.

use runtime::cpuacct::{NicCpu, StartCpu};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuPerSandbox {
    pub runtime_ms: f64,
    /// Of `runtime_ms`, the runtime's page-pool server's threads.
    #[serde(default)]
    pub pool_server_ms: f64,
    pub cni_ms: f64,
    pub nicd_ms: f64,
    pub vmm_ms: f64,
    /// Of `vmm_ms`, the VMM's vCPU threads (`runtime::cpuacct::StartCpu::vcpu_ns`).
    #[serde(default)]
    pub vcpu_ms: f64,
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

/// The CPU a round's starts share, from its issue to its last READY.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Shared {
    /// The NIC daemon's (None: no daemon, or it was restarted meanwhile).
    pub nicd: Option<NicCpu>,
    /// The runtime's page-pool server's (`guestmem::pool::PoolServer::cpu_ns`).
    pub pool_server_ns: u64,
}

/// Per-sandbox averages of a round: `starts` from the sandboxes that reached
/// READY, `shared` what they shared over the round (None: not measured). The
/// NIC daemon's CNI server's part is the CNI plugins' (the commands
/// burstvm-cni-thin forwarded to it), the rest the NIC daemon's; the page-pool
/// server's is the runtime's.
pub fn per_sandbox(starts: &[StartCpu], shared: Option<Shared>) -> Option<CpuPerSandbox> {
    if starts.is_empty() {
        return None;
    }
    let n = starts.len() as f64;
    let avg = |f: fn(&StartCpu) -> u64| starts.iter().map(f).sum::<u64>() as f64 / n / 1e6;
    let shared = shared.unwrap_or_default();
    let nicd = shared.nicd.unwrap_or_default();
    let served = nicd.cni_server_ns.min(nicd.total_ns);
    let mut c = CpuPerSandbox {
        runtime_ms: avg(|s| s.runtime_ns) + shared.pool_server_ns as f64 / n / 1e6,
        pool_server_ms: shared.pool_server_ns as f64 / n / 1e6,
        cni_ms: avg(|s| s.cni_ns) + served as f64 / n / 1e6,
        vmm_ms: avg(|s| s.vmm_ns),
        vcpu_ms: avg(|s| s.vcpu_ns),
        nicd_ms: (nicd.total_ns - served) as f64 / n / 1e6,
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
        "host CPU ms per sandbox start: total {:.2} = runtime {:.2} (of which its page-pool server {:.2}) + CNI plugins {:.2} + NIC daemon {:.2} + VMM {:.2} (of which vCPU {:.2})  (wall avg {:.1} ms); after READY, the VMM's deferred zeroing: {:.2}\n",
        c.total_ms,
        c.runtime_ms,
        c.pool_server_ms,
        c.cni_ms,
        c.nicd_ms,
        c.vmm_ms,
        c.vcpu_ms,
        wall_avg_ms,
        c.after_ready_ms
    )
}

/// The CPU table of a bench: one line per group, every level.
pub fn format_summary(groups: &[crate::stats::GroupStats]) -> String {
    let mut out = String::from(
        "\n== host CPU ms per sandbox start, by owner (wall avg beside)\n\
         (after READY: the VMM's deferred zeroing; pool refill: the network pool's netns\n\
         and CNI ADD per attachment, made while the host is idle; neither in the total;\n\
         vCPU: the part of VMM that the VMM's vCPU threads ran)\n\
         variant             n  runtime      CNI      NIC      VMM   (vCPU)    total   wall avg  after READY  pool refill\n",
    );
    for g in groups {
        let Some(c) = &g.cpu else { continue };
        out.push_str(&format!(
            "{:<16} {:>4} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>10.1} {:>12.2} {:>12.2}\n",
            g.variant,
            g.concurrency,
            c.runtime_ms,
            c.cni_ms,
            c.nicd_ms,
            c.vmm_ms,
            c.vcpu_ms,
            c.total_ms,
            g.avg_ms,
            c.after_ready_ms,
            c.pool_refill_ms
        ));
    }
    out
}

/// The average over several rounds of one group, each weighted by its sandboxes that
/// reached READY (`bench startup --repeat`).
pub fn weighted_mean(rounds: &[(CpuPerSandbox, usize)]) -> Option<CpuPerSandbox> {
    let n: usize = rounds.iter().map(|(_, k)| k).sum();
    if n == 0 {
        return None;
    }
    let avg = |f: fn(&CpuPerSandbox) -> f64| {
        rounds.iter().map(|(c, k)| f(c) * *k as f64).sum::<f64>() / n as f64
    };
    Some(CpuPerSandbox {
        runtime_ms: avg(|c| c.runtime_ms),
        pool_server_ms: avg(|c| c.pool_server_ms),
        cni_ms: avg(|c| c.cni_ms),
        nicd_ms: avg(|c| c.nicd_ms),
        vmm_ms: avg(|c| c.vmm_ms),
        vcpu_ms: avg(|c| c.vcpu_ms),
        total_ms: avg(|c| c.total_ms),
        after_ready_ms: avg(|c| c.after_ready_ms),
        pool_refill_ms: avg(|c| c.pool_refill_ms),
    })
}

/// Each group's extra CPU per start over `no-net`'s at the same concurrency,
/// split into the vCPU threads' part (the guest's own code, KVM serving its
/// exits and the VMM's handlers of them: what the hypervisor makes a guest
/// driver cost) and the rest (runtime, CNI plugins, NIC daemon, the VMM's
/// other threads), with the ratio of each side to no-net's. Empty without a
/// no-net group.
pub fn format_vcpu_split(groups: &[crate::stats::GroupStats]) -> String {
    let mut rows = String::new();
    for g in groups.iter().filter(|g| g.variant != "no-net") {
        let base = groups
            .iter()
            .find(|b| b.variant == "no-net" && b.concurrency == g.concurrency)
            .and_then(|b| b.cpu.as_ref());
        let (Some(c), Some(b)) = (g.cpu.as_ref(), base) else {
            continue;
        };
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        let (other, base_other) = (c.total_ms - c.vcpu_ms, b.total_ms - b.vcpu_ms);
        rows.push_str(&format!(
            "{:<16} {:>4} {:>8.2} {:>8.2} {:>8.2} {:>9.2} {:>9.2} {:>9.2}\n",
            g.variant,
            g.concurrency,
            c.total_ms - b.total_ms,
            c.vcpu_ms - b.vcpu_ms,
            other - base_other,
            ratio(c.total_ms, b.total_ms),
            ratio(c.vcpu_ms, b.vcpu_ms),
            ratio(other, base_other),
        ));
    }
    if rows.is_empty() {
        return rows;
    }
    String::from(
        "\n== extra host CPU ms per start over no-net, the vCPU threads apart\n\
         (vCPU: the guest's own code, KVM serving its exits, which under kvm_pvm includes\n\
         emulating every instruction the guest runs at CPL0, and the VMM's exit handlers;\n\
         other: runtime, CNI, NIC daemon and the VMM's other threads; x no-net: each side\n\
         against no-net's)\n\
         variant             n    extra     vCPU    other   total x    vCPU x   other x\n",
    ) + &rows
}

/// With `--repeat`: each group's CPU per start against `no-net`'s of the same
/// repetition and concurrency, round by round, and the median of those ratios
/// (`stats::median`; the host drifts between rounds; a ratio within one repetition does not).
pub fn format_repeats(groups: &[crate::stats::GroupStats]) -> String {
    let reps = groups
        .iter()
        .map(|g| g.cpu_total_per_round.len())
        .max()
        .unwrap_or(0);
    if reps < 2 {
        return String::new();
    }
    let mut out = format!(
        "\n== host CPU per start x no-net, each of the {reps} repetitions, and their median\n{:<16} {:>4}",
        "variant", "n"
    );
    for r in 1..=reps {
        out.push_str(&format!(" {:>6}", format!("rep{r}")));
    }
    out.push_str("  median\n");
    for g in groups.iter().filter(|g| g.variant != "no-net") {
        let Some(base) = groups
            .iter()
            .find(|b| b.variant == "no-net" && b.concurrency == g.concurrency)
        else {
            continue;
        };
        let mut ratios: Vec<f64> = g
            .cpu_total_per_round
            .iter()
            .zip(&base.cpu_total_per_round)
            .filter(|(_, b)| **b > 0.0)
            .map(|(v, b)| v / b)
            .collect();
        if ratios.is_empty() {
            continue;
        }
        out.push_str(&format!("{:<16} {:>4}", g.variant, g.concurrency));
        for r in &ratios {
            out.push_str(&format!(" {r:>6.2}"));
        }
        for _ in ratios.len()..reps {
            out.push_str(&format!(" {:>6}", "-"));
        }
        let median = crate::stats::median(&mut ratios);
        out.push_str(&format!("  {median:>6.2}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repetitions_average_by_ready_sandboxes_and_give_median_ratios() {
        let c = |total| CpuPerSandbox {
            total_ms: total,
            vmm_ms: total / 2.0,
            ..Default::default()
        };
        let m = weighted_mean(&[(c(10.0), 3), (c(20.0), 1)]).unwrap();
        assert!((m.total_ms - 12.5).abs() < 1e-9 && (m.vmm_ms - 6.25).abs() < 1e-9);
        assert_eq!(weighted_mean(&[(c(10.0), 0)]), None);

        let g = |name: &str, per_round: &[f64]| {
            let mut g = crate::stats::group_stats(name, 50, &[], 0);
            g.cpu_total_per_round = per_round.to_vec();
            g
        };
        let groups = [
            g("no-net", &[5.0, 10.0, 4.0]),
            g("window+pool", &[6.0, 11.0, 8.0]),
        ];
        let t = format_repeats(&groups);
        let row = t.lines().find(|l| l.starts_with("window+pool")).unwrap();
        let cols: Vec<&str> = row.split_whitespace().collect();
        // 1.20, 1.10, 2.00 per repetition; median 1.20.
        assert_eq!(cols[2..], ["1.20", "1.10", "2.00", "1.20"], "{t}");
        assert!(!t.lines().any(|l| l.starts_with("no-net ")), "{t}");
        // One round each: no table.
        assert_eq!(
            format_repeats(&[g("no-net", &[5.0]), g("fastiov", &[9.0])]),
            ""
        );
    }

    #[test]
    fn the_vcpu_split_puts_each_side_against_no_net() {
        let g = |name: &str, total: f64, vcpu: f64| {
            let mut g = crate::stats::group_stats(name, 50, &[], 0);
            g.cpu = Some(CpuPerSandbox {
                total_ms: total,
                vmm_ms: vcpu + 1.0,
                vcpu_ms: vcpu,
                ..Default::default()
            });
            g
        };
        let t = format_vcpu_split(&[g("no-net", 3.0, 1.0), g("window+pool", 4.5, 2.0)]);
        let row = t.lines().find(|l| l.starts_with("window+pool")).unwrap();
        let cols: Vec<&str> = row.split_whitespace().collect();
        // extra 1.5 = vCPU 1.0 + other 0.5; 4.5/3, 2/1, 2.5/2.
        assert_eq!(
            cols[2..],
            ["1.50", "1.00", "0.50", "1.50", "2.00", "1.25"],
            "{t}"
        );
        assert!(!t.lines().any(|l| l.starts_with("no-net ")), "{t}");
        assert_eq!(format_vcpu_split(&[g("fastiov", 5.0, 2.0)]), "", "no base");
    }

    #[test]
    fn averages_per_owner() {
        let s = |r, c, v| StartCpu {
            runtime_ns: r,
            cni_ns: c,
            vmm_ns: v,
            vcpu_ns: v / 2,
            vmm_after_ready_ns: 2 * v,
        };
        let c = per_sandbox(
            &[s(1_000_000, 2_000_000, 10_000_000), s(3_000_000, 0, 0)],
            Some(Shared {
                nicd: Some(NicCpu {
                    total_ns: 6_000_000,
                    cni_server_ns: 2_000_000,
                }),
                pool_server_ns: 1_000_000,
            }),
        )
        .unwrap();
        // The sandbox threads' 2.0 per start, and the page-pool server's 0.5.
        assert_eq!(c.runtime_ms, 2.5);
        assert_eq!(c.pool_server_ms, 0.5);
        // The plugin processes' 1.0 per start, and the daemon's CNI server's 1.0.
        assert_eq!(c.cni_ms, 2.0);
        assert_eq!(c.vmm_ms, 5.0);
        assert_eq!(c.vcpu_ms, 2.5);
        assert_eq!(c.nicd_ms, 2.0);
        assert_eq!(c.total_ms, 11.5);
        // Deferred zeroing is reported apart, never in the start's total.
        assert_eq!(c.after_ready_ms, 10.0);
        assert!(per_sandbox(&[], None).is_none());
        assert!(format_line(&c, 50.0).contains("total 11.50"));
    }
}
