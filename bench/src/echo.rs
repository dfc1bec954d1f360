//! `burstvm bench echo`: the guest's own echo loop per VF variant, side by
//! side (issue 27 §2: what the DMA window costs the dataplane). One sandbox
//! at a time runs the built-in agent in echo mode — a request to the
//! runtime's echo server as soon as the previous reply arrived — and the
//! bench counts the server's replies over a fixed interval, with the host CPU
//! of the VMM and the NIC daemon over the same interval (all their threads,
//! from `/proc/PID/task/*/schedstat`), counted once a lazy VMM's background
//! zeroer is done. The agent keeps its rings and packet
//! buffers in the window under `window` and in RAM otherwise, building and
//! reading frames in place in both, so a difference is the device path's.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::{bad, Error};
use runtime::variant::NetKind;
use runtime::{burstvm_bin, cgroup, leaks, SandboxConfig, Variant};
use runtime::{Runtime, RuntimeConfig, Sandbox, SandboxSpec};

/// `burstvm bench echo`.
#[derive(Debug, Clone)]
pub struct BenchEchoConfig {
    /// VF variants, measured one after the other in one run.
    pub variants: Vec<Variant>,
    /// Seconds each variant's echo loop is counted.
    pub seconds: u64,
    pub sandbox: SandboxConfig,
    /// Seconds the guest may take to become ready.
    pub timeout: u64,
    /// The burstvm binary (default: this one).
    pub burstvm_bin: Option<PathBuf>,
}

/// One variant's echo loop.
#[derive(Debug, Clone, PartialEq)]
pub struct EchoResult {
    pub variant: Variant,
    pub replies: u64,
    pub elapsed: Duration,
    /// Host CPU over the interval, ns: the VMM (all threads) and the NIC daemon.
    pub vmm_cpu_ns: u64,
    pub nic_cpu_ns: u64,
}

impl EchoResult {
    pub fn per_second(&self) -> f64 {
        self.replies as f64 / self.elapsed.as_secs_f64()
    }

    /// Host CPU per exchange, µs: (VMM, NIC daemon).
    pub fn cpu_us_per_exchange(&self) -> (f64, f64) {
        let n = self.replies.max(1) as f64;
        (
            self.vmm_cpu_ns as f64 / n / 1e3,
            self.nic_cpu_ns as f64 / n / 1e3,
        )
    }
}

fn cpu(pid: Option<u32>, what: &str) -> Result<u64, Error> {
    let pid = pid.ok_or_else(|| bad("--variants", format!("no {what} process to measure")))?;
    procutil::schedstat::live_threads_ns(pid)
        .map_err(|e| bad("--variants", format!("{what} {pid}: {e}")))
}

fn measure(rt: &Runtime, a: &BenchEchoConfig, variant: Variant) -> Result<EchoResult, Error> {
    let (memory, app_size) = a.sandbox.bytes()?;
    rt.prepare_variant(variant)?;
    let id = format!("{}echo-{}", rt.sandbox_prefix(), variant.name());
    let spec = SandboxSpec {
        cpus: a.sandbox.cpus,
        app_size,
        keep_running: true,
        echo: true,
        watch_zeroing: true,
        ..SandboxSpec::new(id, variant, memory, a.timeout)
    };
    let mut sb = Sandbox::start(rt, spec)?;
    let ip = sb.guest_ip.ok_or_else(|| {
        bad(
            "--variants",
            format!("{variant}: the sandbox has no address"),
        )
    })?;
    // A lazy VMM zeroes the rest of RAM after READY: not the echo's CPU.
    sb.wait_background_zeroing(Duration::from_secs(a.timeout));
    let replies = || rt.server().replies().get(&ip).copied().unwrap_or(0);
    let (vmm, nic) = (sb.vmm_pid(), rt.nic_pid());
    let (r0, v0, n0, t0) = (
        replies(),
        cpu(vmm, "VMM")?,
        cpu(nic, "NIC daemon")?,
        Instant::now(),
    );
    std::thread::sleep(Duration::from_secs(a.seconds));
    let (r1, v1, n1, elapsed) = (
        replies(),
        cpu(vmm, "VMM")?,
        cpu(nic, "NIC daemon")?,
        t0.elapsed(),
    );
    sb.check_alive()?;
    sb.teardown()?;
    Ok(EchoResult {
        variant,
        replies: r1 - r0,
        elapsed,
        vmm_cpu_ns: v1 - v0,
        nic_cpu_ns: n1 - n0,
    })
}

pub fn run(a: &BenchEchoConfig) -> Result<Vec<EchoResult>, Error> {
    if a.variants.is_empty() || a.seconds == 0 {
        return Err(bad("--variants", "at least one variant and one second"));
    }
    if let Some(v) = a.variants.iter().find(|v| v.policy().net != NetKind::Vf) {
        return Err(bad(
            "--variants",
            format!("{v}: the echo loop runs over a VF"),
        ));
    }
    let (memory, app_size) = a.sandbox.bytes()?;
    let rt = Runtime::new(RuntimeConfig::networked(
        burstvm_bin(&a.burstvm_bin)?,
        1,
        cgroup::Limits::for_guest(memory, app_size, a.sandbox.cpus),
    ))?;
    let results = a
        .variants
        .iter()
        .map(|&v| measure(&rt, a, v))
        .collect::<Result<Vec<_>, _>>();
    let lc = leaks::check(&rt, Duration::from_secs(5));
    let results = results?;
    if !lc.is_clean() {
        return Err(bad("leak check", lc.describe()));
    }
    Ok(results)
}

/// The table `burstvm bench echo` prints, ratios against the first variant.
pub fn format(results: &[EchoResult]) -> String {
    let mut s = format!(
        "{:<12} {:>8} {:>10} {:>8} {:>13} {:>13}\n",
        "variant", "replies", "per s", "ratio", "VMM µs/xchg", "NIC µs/xchg"
    );
    let base = results.first().map(EchoResult::per_second);
    for r in results {
        let (vmm, nic) = r.cpu_us_per_exchange();
        s += &format!(
            "{:<12} {:>8} {:>10.1} {:>8.2} {:>13.1} {:>13.1}\n",
            r.variant.name(),
            r.replies,
            r.per_second(),
            base.map_or(1.0, |b| r.per_second() / b),
            vmm,
            nic
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_cpu_per_exchange() {
        let r = EchoResult {
            variant: Variant::Window,
            replies: 200,
            elapsed: Duration::from_secs(2),
            vmm_cpu_ns: 40_000_000,
            nic_cpu_ns: 2_000_000,
        };
        assert_eq!(r.per_second(), 100.0);
        assert_eq!(r.cpu_us_per_exchange(), (200.0, 10.0));
        let t = format(&[
            EchoResult {
                variant: Variant::Fastiov,
                ..r.clone()
            },
            r,
        ]);
        assert!(t.lines().nth(2).unwrap().starts_with("window"), "{t}");
        assert!(t.contains("1.00"), "{t}");
    }
}
