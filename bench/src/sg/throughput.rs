//! `bench sgiov throughput`: every pipe backlogged (echo, all one priority)
//! for `--duration` seconds per `--pipes` count: aggregate MB/s of checked
//! bytes, per-pipe min/mean/max and Jain's fairness index, the daemon's CPU.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{
    jain, join_load, median, settle, signals_and_kicks, start_load, BenchSgError, CommonConfig,
    Daemon, Flags,
};
use nic_api::Client;
use sgiov::sched::Policy;

/// What `bench sgiov throughput` runs (the `burstvm` CLI parses its flags into this).
#[derive(Debug, Clone)]
pub struct ThroughputConfig {
    /// Pipe counts, comma-separated.
    pub pipes: Vec<usize>,
    /// Time counted per repetition.
    pub duration: Duration,
    /// Repetitions (the columns are medians over them).
    pub reps: usize,
    /// Scheduling policy of the daemon's SG engine.
    pub policy: Policy,
    pub common: CommonConfig,
}

impl Default for ThroughputConfig {
    fn default() -> Self {
        ThroughputConfig {
            pipes: vec![8, 512, 4096],
            duration: Duration::from_secs(1),
            reps: 3,
            policy: Policy::RoundRobin,
            common: CommonConfig::default(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct ThroughputRow {
    pub pipes: usize,
    pub mb_s: f64,
    /// Per-pipe KB/s.
    pub min_kb_s: f64,
    pub mean_kb_s: f64,
    pub max_kb_s: f64,
    pub jain: f64,
    /// Pipes that moved nothing in a repetition (summed over them).
    pub zero_pipes: usize,
    /// Aggregate over that of the first pipe count.
    pub ratio: f64,
    pub daemon_fds: usize,
    pub idle_fds: usize,
    pub signals_per_kick: f64,
    /// Daemon CPU (percent of one core) and its cost per MB moved.
    pub daemon_cpu_pct: f64,
    pub cpu_us_per_mb: f64,
    /// Checked bytes received over all repetitions.
    pub bytes: u64,
}

pub fn run(a: &ThroughputConfig) -> Result<Vec<ThroughputRow>, BenchSgError> {
    a.common.check()?;
    CommonConfig::check_pipes(&a.pipes)?;
    if !(Duration::from_millis(10)..=Duration::from_secs(600)).contains(&a.duration) || a.reps == 0
    {
        return Err(BenchSgError::Config(
            "--duration 0.01..600 s, --reps at least 1".into(),
        ));
    }
    let d = Daemon::spawn(
        &a.common.bin()?,
        &a.common.dir("throughput"),
        a.common.threads,
        &a.policy.to_string(),
        a.common.workers,
    )?;
    let mut c = d.client()?;
    let idle_fds = d.idle_fds(&mut c)?;
    let mut rows: Vec<ThroughputRow> = Vec::new();
    for &n in &a.pipes {
        let mut row = one(a, &d, &mut c, n, idle_fds)?;
        row.ratio = row.mb_s / rows.first().map_or(row.mb_s, |f| f.mb_s);
        rows.push(row);
    }
    Ok(rows)
}

/// One repetition: per-pipe KB/s, bytes, seconds, daemon CPU seconds,
/// daemon fds, signals per kick.
struct Rep {
    per: Vec<f64>,
    bytes: u64,
    secs: f64,
    cpu: f64,
    fds: usize,
    spk: f64,
}

fn one(
    a: &ThroughputConfig,
    d: &Daemon,
    c: &mut Client,
    n: usize,
    idle_fds: usize,
) -> Result<ThroughputRow, BenchSgError> {
    let mut reps = Vec::new();
    for rep in 0..a.reps {
        let flags = Arc::new(Flags::default());
        let load = start_load(
            &d.control,
            &format!("tp{n}-{rep}"),
            n,
            a.common.threads,
            a.common.ring,
            4,
            &flags,
            super::Signals::Xfifo,
        )?;
        // Warm up (rings full, executor busy) before counting.
        std::thread::sleep(Duration::from_millis(100));
        let cpu0 = d.cpu();
        let t0 = Instant::now();
        flags.go.store(true, Ordering::Relaxed);
        std::thread::sleep(a.duration);
        // Before the frontends go (their SGFs' counters end with them).
        let fds = d.fds();
        let counters = signals_and_kicks(c);
        let shards = join_load(&flags, load)?;
        let secs = t0.elapsed().as_secs_f64();
        let cpu = (d.cpu() - cpu0).as_secs_f64();
        let (sig, kicks) = counters?;
        settle(d, c, idle_fds)?;
        let per: Vec<f64> = shards
            .iter()
            .flat_map(|s| &s.per_pipe)
            .map(|&b| b as f64 / secs / 1e3)
            .collect();
        reps.push(Rep {
            per,
            bytes: shards.iter().flat_map(|s| &s.per_pipe).sum(),
            secs,
            cpu,
            fds,
            spk: sig as f64 / kicks.max(1) as f64,
        });
    }
    let col = |f: &dyn Fn(&Rep) -> f64| median(&mut reps.iter().map(f).collect::<Vec<_>>());
    Ok(ThroughputRow {
        pipes: n,
        mb_s: col(&|r| r.bytes as f64 / r.secs / 1e6),
        min_kb_s: col(&|r| r.per.iter().copied().fold(f64::INFINITY, f64::min)),
        mean_kb_s: col(&|r| r.per.iter().sum::<f64>() / r.per.len().max(1) as f64),
        max_kb_s: col(&|r| r.per.iter().copied().fold(0.0, f64::max)),
        jain: col(&|r| jain(&r.per)),
        zero_pipes: reps
            .iter()
            .map(|r| r.per.iter().filter(|&&v| v == 0.0).count())
            .sum(),
        ratio: 1.0,
        daemon_fds: reps.iter().map(|r| r.fds).max().unwrap_or(0),
        idle_fds,
        signals_per_kick: col(&|r| r.spk),
        daemon_cpu_pct: col(&|r| r.cpu / r.secs * 100.0),
        cpu_us_per_mb: col(&|r| r.cpu * 1e6 / (r.bytes as f64 / 1e6).max(1e-9)),
        bytes: reps.iter().map(|r| r.bytes).sum(),
    })
}

pub fn run_cli(a: &ThroughputConfig) -> Result<(), BenchSgError> {
    println!(
        "bench sgiov throughput: every pipe backlogged (echo through the daemon's copy executor, \
         {} B rings, {} frontend threads), daemon --sg-policy {} --sg-workers {}; {} s x {} reps, medians",
        a.common.ring, a.common.threads, a.policy, a.common.workers, a.duration.as_secs_f64(), a.reps
    );
    println!(
        "{:>6} {:>9} {:>9} {:>9} {:>9} {:>6} {:>5} {:>6} {:>5} {:>5} {:>8} {:>6} {:>9}",
        "pipes",
        "MB/s",
        "min_KB/s",
        "mean_KB/s",
        "max_KB/s",
        "jain",
        "zero",
        "x_agg",
        "fds",
        "idle",
        "sig/kick",
        "cpu%",
        "cpu_us/MB"
    );
    let rows = run(a)?;
    for r in &rows {
        println!(
            "{:>6} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>6.3} {:>5} {:>6.2} {:>5} {:>5} {:>8.1} {:>6.1} {:>9.0}",
            r.pipes,
            r.mb_s,
            r.min_kb_s,
            r.mean_kb_s,
            r.max_kb_s,
            r.jain,
            r.zero_pipes,
            r.ratio,
            r.daemon_fds,
            r.idle_fds,
            r.signals_per_kick,
            r.daemon_cpu_pct,
            r.cpu_us_per_mb
        );
    }
    println!(
        "MB/s: checked echo bytes received per second (TX ring -> RX ring, one copy by the \
         daemon); x_agg: against {} pipes; zero: pipes that moved nothing; \
         cpu%: daemon CPU",
        a.pipes[0]
    );
    Ok(())
}
