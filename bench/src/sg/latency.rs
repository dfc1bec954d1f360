//! `bench sgiov latency`: a priority-0 ping-pong of `--size` bytes on one
//! pipe of its own SG function while every other pipe (priority 7, sharded
//! over `--threads` SG functions) is kept backlogged, for each `--pipes`
//! count; the daemon schedules with `--policy` (prio by default). Growth is
//! each count's latency over that of the first count (8 in the issue).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sgiov::sched::Policy;
use sgiov::signal::RingId;

use super::{
    attach_channels, join_load, load_sgfs, median, open_echo_pipes, pf_lat, settle,
    signals_and_kicks, start_load, BenchSgError, CommonConfig, Daemon, Flags, Signals, T,
};
use nic::sg::frontend::SgFrontend;
use nic_api::Client;

/// The daemon's SG thread of the bench's PF (nic::daemon names it).
const SG_THREAD: &str = "sg-pf0";

/// What `bench sgiov latency` runs (the `burstvm` CLI parses its flags into this).
#[derive(Debug, Clone)]
pub struct LatencyConfig {
    /// Pipe counts (the ping pipe included), comma-separated.
    pub pipes: Vec<usize>,
    /// Ping-pongs per repetition.
    pub samples: usize,
    /// Repetitions (p50 and p99 are the medians over them).
    pub reps: usize,
    /// Bytes per ping (at most --ring).
    pub size: usize,
    /// Scheduling policy of the daemon's SG engine.
    pub policy: Policy,
    /// The daemon's --sg-gen-budget, one daemon each (0: the whole backlog
    /// per round, no bounded rounds; growth is against the first pipe count
    /// of the same budget).
    pub gen_budget: Vec<usize>,
    /// Signal planes compared: xfifo (SG functions, Cross-FIFO, one row per
    /// --pipes count and budget), dedicated (one signal channel and eventfd
    /// pair per pipe, polled: the SR-IOV model; one row per --pipes count,
    /// first budget), vf (VF pairs through the switch, one row per --vfs
    /// count, one daemon each).
    pub modes: Vec<Mode>,
    /// VF counts of the vf mode (2..256: the pinging pair, the rest backlogged).
    pub vfs: Vec<usize>,
    pub common: CommonConfig,
}

impl Default for LatencyConfig {
    fn default() -> Self {
        LatencyConfig {
            pipes: vec![8, 64, 512, 4096],
            samples: 200,
            reps: 3,
            size: 4096,
            policy: Policy::Priority,
            gen_budget: vec![32],
            modes: Mode::ALL.to_vec(),
            vfs: vec![8, 64, 256],
            common: CommonConfig::default(),
        }
    }
}

/// A signal plane of the latency bench.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Xfifo,
    Dedicated,
    Vf,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Xfifo, Mode::Dedicated, Mode::Vf];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Xfifo => "xfifo",
            Mode::Dedicated => "dedicated",
            Mode::Vf => "vf",
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown latency mode {s:?} (xfifo, dedicated, vf)"))
    }
}

#[derive(Debug, Clone, Default)]
pub struct LatencyRow {
    pub pipes: usize,
    pub mode: &'static str,
    /// The daemon's --sg-gen-budget.
    pub gen_budget: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    /// p50 and p99 over those of the first pipe count.
    pub growth_p50: f64,
    pub growth_p99: f64,
    /// Daemon fds with every pipe open, and with none.
    pub daemon_fds: usize,
    pub idle_fds: usize,
    /// Guest → device signals per doorbell over the SG functions.
    pub signals_per_kick: f64,
    /// Daemon CPU over the measured pings (percent of one core).
    pub daemon_cpu_pct: f64,
    /// Pings done, each `size` bytes checked.
    pub pings: usize,
    /// Checked bytes the backlogged pipes moved meanwhile.
    pub backlog_bytes: u64,
    /// The daemon's counters over the measured pings (log2 buckets: each
    /// figure is its bucket's upper bound): SG thread round length p99 and
    /// max (µs), priority signal read → job dispatched p99 (µs), jobs
    /// dispatched ahead of a priority job p99, executor queue depth p99.
    pub round_p99_us: u64,
    pub round_max_us: u64,
    pub prio_wait_p99_us: u64,
    pub prio_ahead_p99: u64,
    pub queue_depth_p99: u64,
    /// Jobs the SG thread ran itself right after the priority lane.
    pub prio_inline: u64,
    /// Involuntary context switches of the daemon's SG thread during the
    /// pings (the CPU taken away from it mid-round).
    pub sg_preempted: u64,
    /// Channels the daemon polled per doorbell (`dedicated` rows; 0 for
    /// the others): the O(pipes) scan of the SR-IOV model.
    pub scanned_per_kick: f64,
}

pub fn run(a: &LatencyConfig) -> Result<Vec<LatencyRow>, BenchSgError> {
    a.common.check()?;
    CommonConfig::check_pipes(&a.pipes)?;
    if a.size == 0 || a.size > a.common.ring as usize || a.samples == 0 || a.reps == 0 {
        return Err(BenchSgError::Config(
            "--size 1..--ring, --samples and --reps at least 1".into(),
        ));
    }
    let mut rows: Vec<LatencyRow> = Vec::new();
    let budgets: &[usize] = if a.modes.contains(&Mode::Xfifo) {
        &a.gen_budget
    } else {
        &[]
    };
    let mut runs: Vec<(Signals, usize)> = budgets.iter().map(|&b| (Signals::Xfifo, b)).collect();
    if a.modes.contains(&Mode::Dedicated) {
        runs.push((
            Signals::Dedicated,
            a.gen_budget.first().copied().unwrap_or(32),
        ));
    }
    for (signals, budget) in runs {
        let max = a.pipes.iter().max().copied().unwrap_or(1);
        let sgfs = load_sgfs(max.saturating_sub(1).max(1), a.common.threads, signals) + 1;
        let d = Daemon::spawn_with(
            &a.common.bin()?,
            &a.common.dir("latency"),
            sgfs,
            &a.policy.to_string(),
            a.common.workers,
            &["--sg-gen-budget".into(), budget.to_string()],
        )?;
        let mut c = d.client()?;
        let idle_fds = d.idle_fds(&mut c)?;
        let first = rows.len();
        for &n in &a.pipes {
            let mut row = one(a, &d, &mut c, n, signals)?;
            settle(&d, &mut c, idle_fds)?;
            row.idle_fds = idle_fds;
            row.gen_budget = budget;
            let (p50, p99) = rows
                .get(first)
                .map_or((row.p50_us, row.p99_us), |f| (f.p50_us, f.p99_us));
            row.growth_p50 = row.p50_us / p50;
            row.growth_p99 = row.p99_us / p99;
            rows.push(row);
        }
    }
    if a.modes.contains(&Mode::Vf) {
        let vf = super::vf::run(a)?;
        let (p50, p99) = (vf[0].p50_us, vf[0].p99_us);
        for mut row in vf {
            row.growth_p50 = row.p50_us / p50;
            row.growth_p99 = row.p99_us / p99;
            rows.push(row);
        }
    }
    Ok(rows)
}

fn one(
    a: &LatencyConfig,
    d: &Daemon,
    c: &mut Client,
    n: usize,
    signals: Signals,
) -> Result<LatencyRow, BenchSgError> {
    let ring = a.common.ring;
    let flags = Arc::new(Flags::default());
    let load = if n > 1 {
        start_load(
            &d.control,
            &format!("lat{n}-load"),
            n - 1,
            a.common.threads,
            ring,
            7,
            &flags,
            signals,
        )?
    } else {
        Vec::new()
    };
    let (mode, channels) = match signals {
        Signals::Xfifo => ("xfifo", 0),
        Signals::Dedicated => ("dedicated", 1),
    };
    let r = (|| {
        let (_, mut fe) = attach_channels(c, &format!("lat{n}-ping"), 1, ring, channels)?;
        let sock = open_echo_pipes(&mut fe, 1, ring, 0)?[0];
        let pat: Vec<u8> = (0..a.size).map(|i| (i * 7 + n) as u8).collect();
        let mut buf = vec![0u8; a.size];
        for _ in 0..a.samples.min(20) {
            ping(&mut fe, sock, &pat, &mut buf)?;
        }
        flags.go.store(true, Ordering::Relaxed);
        // The daemon publishes its counters every 100 ms.
        std::thread::sleep(Duration::from_millis(150));
        let lat0 = pf_lat(c)?;
        let cpu0 = d.cpu();
        let pre0 = d.preempted(SG_THREAD);
        let t0 = Instant::now();
        let (p50_us, p99_us) = measure(a, || ping(&mut fe, sock, &pat, &mut buf))?;
        let cpu = (d.cpu() - cpu0).as_secs_f64() / t0.elapsed().as_secs_f64();
        let fds = d.fds();
        let sg_preempted = d.preempted(SG_THREAD) - pre0;
        // The daemon publishes its counters every 100 ms.
        std::thread::sleep(Duration::from_millis(150));
        let (sig, kicks) = signals_and_kicks(c)?;
        let scanned = channels_scanned(c)?;
        let lat = pf_lat(c)?;
        let round = lat.round_us.since(&lat0.round_us);
        let pick = |h: &sgiov::lat::Hist, e: &sgiov::lat::Hist| h.since(e).quantile(0.99);
        Ok::<_, BenchSgError>(LatencyRow {
            pipes: n,
            mode,
            gen_budget: 0,
            p50_us,
            p99_us,
            growth_p50: 1.0,
            growth_p99: 1.0,
            daemon_fds: fds,
            idle_fds: 0,
            signals_per_kick: sig as f64 / kicks.max(1) as f64,
            daemon_cpu_pct: cpu * 100.0,
            pings: a.reps * a.samples,
            backlog_bytes: 0,
            round_p99_us: round.quantile(0.99),
            round_max_us: round.max(),
            prio_wait_p99_us: pick(&lat.prio.prio_wait_us, &lat0.prio.prio_wait_us),
            prio_ahead_p99: pick(&lat.prio.prio_ahead, &lat0.prio.prio_ahead),
            queue_depth_p99: pick(&lat.queue_depth, &lat0.queue_depth),
            prio_inline: lat.prio.prio_inline - lat0.prio.prio_inline,
            sg_preempted,
            scanned_per_kick: scanned as f64 / kicks.max(1) as f64,
        })
    })();
    let shards = join_load(&flags, load);
    let mut row = r?;
    row.backlog_bytes = shards?.iter().flat_map(|s| &s.per_pipe).sum();
    Ok(row)
}

/// Channels polled so far over every SG function of the daemon.
fn channels_scanned(c: &mut Client) -> Result<u64, BenchSgError> {
    Ok(super::list_sg(c)?
        .iter()
        .map(|v| v.sg.unwrap_or_default().sgf.chan_scanned)
        .sum())
}

/// `--reps` times `--samples` round trips of `ping`: the medians over the
/// reps of their p50 and p99 (µs).
pub(crate) fn measure(
    a: &LatencyConfig,
    mut ping: impl FnMut() -> Result<Duration, BenchSgError>,
) -> Result<(f64, f64), BenchSgError> {
    let (mut p50s, mut p99s) = (Vec::new(), Vec::new());
    for _ in 0..a.reps {
        let mut us = Vec::with_capacity(a.samples);
        for _ in 0..a.samples {
            us.push(ping()?.as_secs_f64() * 1e6);
        }
        us.sort_by(f64::total_cmp);
        p50s.push(crate::sgiov::percentile(&us, 50.0));
        p99s.push(crate::sgiov::percentile(&us, 99.0));
    }
    Ok((median(&mut p50s), median(&mut p99s)))
}

/// One ping-pong: `pat` out, the same bytes back (checked). Its round trip.
fn ping(
    fe: &mut SgFrontend,
    sock: RingId,
    pat: &[u8],
    buf: &mut [u8],
) -> Result<Duration, BenchSgError> {
    let drv = |what: &'static str| {
        move |source| BenchSgError::Driver {
            what: format!("ping {what}"),
            source: Box::new(source),
        }
    };
    let fe_err = |source| BenchSgError::Frontend {
        what: "ping".into(),
        source: Box::new(source),
    };
    let t = Instant::now();
    let sent = fe.drv.send(sock, pat).map_err(drv("send"))?;
    if sent != pat.len() {
        return Err(BenchSgError::Check(format!(
            "ping: only {sent} of {} bytes fit the TX ring",
            pat.len()
        )));
    }
    let mut got = 0;
    while got < pat.len() {
        if fe.drv.rx_ready(sock) > 0 {
            got += fe.drv.recv(sock, &mut buf[got..]).map_err(drv("recv"))?;
            continue;
        }
        if t.elapsed() > T {
            return Err(BenchSgError::Check(format!(
                "ping: {got} of {} bytes back within {T:?}",
                pat.len()
            )));
        }
        fe.pump(Duration::from_millis(1)).map_err(fe_err)?;
    }
    let rtt = t.elapsed();
    if buf[..got] != *pat {
        return Err(BenchSgError::Check("ping: the echo differs".into()));
    }
    Ok(rtt)
}

pub fn run_cli(a: &LatencyConfig) -> Result<(), BenchSgError> {
    println!(
        "bench sgiov latency: {} B ping-pong on one priority-0 pipe, every other pipe backlogged \
         (echo, priority 7, {} frontend threads), daemon --sg-policy {} --sg-workers {}; \
         {} samples x {} reps, medians; budget: --sg-gen-budget (0 = whole backlog per round)",
        a.size, a.common.threads, a.policy, a.common.workers, a.samples, a.reps
    );
    println!(
        "{:>6} {:>6} {:>6} {:>9} {:>9} {:>7} {:>7} {:>6} {:>6} {:>8} {:>7} {:>10} {:>9} {:>9} {:>9} {:>7} {:>7} {:>6} {:>7} {:>9}",
        "pipes",
        "mode",
        "budget",
        "p50_us",
        "p99_us",
        "x_p50",
        "x_p99",
        "fds",
        "idle",
        "sig/kick",
        "cpu%",
        "backlog_MB",
        "round99",
        "roundmax",
        "wait99",
        "ahead99",
        "depth99",
        "inline",
        "preempt",
        "scan/kick"
    );
    let rows = run(a)?;
    for r in &rows {
        println!(
            "{:>6} {:>6} {:>6} {:>9.1} {:>9.1} {:>7.2} {:>7.2} {:>6} {:>6} {:>8.1} {:>7.1} {:>10.1} {:>9} {:>9} {:>9} {:>7} {:>7} {:>6} {:>7} {:>9.1}",
            r.pipes,
            r.mode,
            r.gen_budget,
            r.p50_us,
            r.p99_us,
            r.growth_p50,
            r.growth_p99,
            r.daemon_fds,
            r.idle_fds,
            r.signals_per_kick,
            r.daemon_cpu_pct,
            r.backlog_bytes as f64 / 1e6,
            r.round_p99_us,
            r.round_max_us,
            r.prio_wait_p99_us,
            r.prio_ahead_p99,
            r.queue_depth_p99,
            r.prio_inline,
            r.sg_preempted,
            r.scanned_per_kick
        );
    }
    println!(
        "x_p50/x_p99: growth against {} pipes (vf rows: against {} VFs); fds: daemon fds with \
         every pipe (VF session) open (idle: none); sig/kick: guest->device signals per doorbell; \
         cpu%: daemon CPU during the pings",
        a.pipes[0],
        a.vfs.first().copied().unwrap_or(0)
    );
    println!(
        "vf rows: pipes = VFs (one daemon each); the ping is split into {}-byte MTU frames VF A -> \
         VF B, echoed by B's frontend, timed until the last is back at A; every other VF sends \
         1514-byte frames to the next one in poll mode; budget, sig/kick and the SG counters do \
         not apply (0); preempt: involuntary context switches of the dataplane thread dp-pf0",
        1500
    );
    println!(
        "dedicated rows: every pipe has its own signal channel (two FIFOs in its guest's memory) \
         and its own kick/call eventfd pair (vrings 2+k of its SGF's vhost-user session, at most \
         {} per SGF: the pipes shard over ceil(n/{}) SGFs as SR-IOV's over VFs); the daemon polls \
         every channel of an SGF on each of its doorbells (scan/kick: channels polled per \
         doorbell); control messages stay on the Cross-FIFO",
        sgiov::dedicated::MAX_CHANNELS,
        sgiov::dedicated::MAX_CHANNELS
    );
    println!(
        "round99/roundmax: the daemon's SG thread round (doorbells, completions, bounded job \
         generation) p99/max in us; wait99: priority signal read -> its job taken by a worker, \
         p99 us; ahead99: jobs dispatched before it, p99; depth99: executor queue depth per round, \
         p99 (log2 buckets: each figure is its bucket's upper bound); inline: jobs the SG thread \
         ran itself after the priority lane; preempt: involuntary context switches of the \
         daemon's SG thread during the pings"
    );
    Ok(())
}
