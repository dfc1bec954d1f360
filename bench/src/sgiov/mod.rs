//! The SG-IOV benchmarks that need no device transport (`crate::sg` adds
//! `latency`, `throughput` and `open`, which need the daemon):
//!
//! - `sched`: the three scheduling scenarios of issue 14, measured with real
//!   executors under capacity limits, against the formulas of [`sgiov::sched::drf`];
//! - `jobgen`: the job generator's recursive splitting against a
//!   bounce-buffer strategy and against the raw executor on one contiguous
//!   buffer, and the head-of-line blocking a maximum job size bounds;
//! - `path`: guest → staging → guest against direct guest → guest (two
//!   copies against one) through the engine over memfd guest memory.
//!
//! All are library functions returning rows (for tests and plots) plus a
//! `run_cli` printing the tables; the `burstvm` binary only dispatches.

pub mod jobgen;
pub mod path;
pub mod sched;

use std::time::Duration;

/// Parses a size with guestmem's syntax (`4096`, `64K`, `1M`), not 0.
pub fn parse_size(s: &str) -> Result<u64, String> {
    guestmem::parse_bytes(s)
        .filter(|v| *v > 0)
        .ok_or_else(|| format!("bad size {s:?}"))
}

/// A list of sizes: `1K,4K,64K` or a range `1K..1M` (powers of 4 from the
/// first to the last, both included).
pub fn parse_sizes(s: &str) -> Result<Vec<u64>, String> {
    if let Some((a, b)) = s.split_once("..") {
        let (mut x, end) = (parse_size(a)?, parse_size(b)?);
        let mut v = Vec::new();
        while x < end {
            v.push(x);
            x *= 4;
        }
        v.push(end);
        return Ok(v);
    }
    s.split(',').map(parse_size).collect()
}

/// CPU time (user + system) this process used so far.
pub fn cpu_time() -> Duration {
    let ru = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF);
    match ru {
        Ok(ru) => {
            let tv = |t: nix::sys::time::TimeVal| {
                Duration::new(t.tv_sec() as u64, t.tv_usec() as u32 * 1000)
            };
            tv(ru.user_time()) + tv(ru.system_time())
        }
        Err(_) => Duration::ZERO,
    }
}

/// The `p`-th percentile (0..=100) of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * p / 100.0).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(
            parse_sizes("1K..1M").unwrap(),
            vec![1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20]
        );
        assert_eq!(parse_sizes("1K,3K").unwrap(), vec![1024, 3072]);
        assert!(parse_size("0").is_err());
        assert!(parse_size("x").is_err());
        assert_eq!(guestmem::format_size(65536), "64K");
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 50.0), 2.0);
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 99.0), 4.0);
    }
}
