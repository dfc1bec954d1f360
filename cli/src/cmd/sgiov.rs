//! `burstvm bench sgiov ...`: the arguments of the SG-IOV benchmarks. The
//! benches are `bench::sgiov::*` and `bench::sg::*`.

use std::path::PathBuf;

use bench::sg::latency::{LatencyConfig, Mode};
use bench::sg::open::OpenConfig;
use bench::sg::throughput::ThroughputConfig;
use bench::sg::CommonConfig;
use bench::sgiov::jobgen::JobgenConfig;
use bench::sgiov::path::{BenchPath, PathBenchConfig, SendMode};
use bench::sgiov::sched::{Scenario, SchedBenchConfig};
use sgiov::exec::capacity::Capacities;
use sgiov::jobgen::Xf;
use sgiov::sched::Policy;

use burstvm::args::choice;

/// A size with guestmem's syntax (`4096`, `64K`, `1M`), not 0.
fn size(s: &str) -> Result<u64, String> {
    bench::sgiov::parse_size(s)
}

fn size32(s: &str) -> Result<u32, String> {
    let v = size(s)?;
    u32::try_from(v).map_err(|_| format!("size {s:?} over 4G"))
}

/// Message sizes: a list (`4K,64K`) or a range of powers of 4 (`1K..1M`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sizes(pub Vec<u64>);

fn sizes(s: &str) -> Result<Sizes, String> {
    bench::sgiov::parse_sizes(s).map(Sizes)
}

#[derive(Debug, Clone, clap::Args)]
pub struct SchedArgs {
    /// Policies to compare.
    #[arg(long, value_delimiter = ',', default_value = "rr,prio,drf")]
    pub policy: Vec<Policy>,
    /// Capacity of each executor class in bytes/s (`none`: unthrottled).
    #[arg(long, default_value = "copy=400M,crypto=160M")]
    pub capacity: Capacities,
    /// Scenarios to run.
    #[arg(long, value_delimiter = ',', default_value = "a,b,c")]
    pub scenario: Vec<Scenario>,
    /// Measured seconds per scenario and policy (after 0.5 s of warm-up).
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Executor threads.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
}

impl SchedArgs {
    pub fn into_config(self) -> SchedBenchConfig {
        SchedBenchConfig {
            policy: self.policy,
            capacity: self.capacity,
            scenario: self.scenario,
            seconds: self.seconds,
            workers: self.workers,
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct JobgenArgs {
    /// Transformations.
    #[arg(long, value_delimiter = ',', default_value = "copy,encrypt,decrypt")]
    pub xf: Vec<Xf>,
    /// Message sizes: a list (`4K,64K`) or a range of powers of 4 (`1K..1M`).
    #[arg(long, default_value = "1K..1M", value_parser = sizes)]
    pub msg: Sizes,
    /// Bytes streamed per transformation, size and strategy.
    #[arg(long, default_value = "32M", value_parser = size)]
    pub bytes: u64,
    /// Maximum job size of the generator.
    #[arg(long, default_value = "64K", value_parser = size32)]
    pub max_job: u32,
    /// High-priority messages timed in the latency table (0: skip it).
    #[arg(long, default_value_t = 300)]
    pub pings: usize,
    /// Runs of each measurement; the table shows the median.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
}

impl JobgenArgs {
    pub fn into_config(self) -> JobgenConfig {
        JobgenConfig {
            xf: self.xf,
            msg: self.msg.0,
            bytes: self.bytes,
            max_job: self.max_job,
            pings: self.pings,
            repeat: self.repeat,
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct PathArgs {
    /// Paths: `staged` (guest → staging → guest), `direct` (guest → guest),
    /// `crypto` (guest → encrypt → staging → decrypt → guest).
    #[arg(long, value_delimiter = ',', default_value = "staged,direct,crypto")]
    pub path: Vec<BenchPath>,
    /// Modes: `wait` (stop-and-wait) and `stream` (pipelined).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "wait,stream",
        value_parser = choice::<SendMode>(SendMode::ALL.map(SendMode::name))
    )]
    pub mode: Vec<SendMode>,
    /// Message sizes: a list (`4K,64K`) or a range of powers of 4 (`1K..1M`).
    #[arg(long, default_value = "1K,16K,64K,1M", value_parser = sizes)]
    pub msg: Sizes,
    /// Bytes streamed per path, size and run.
    #[arg(long, default_value = "64M", value_parser = size)]
    pub bytes: u64,
    /// Executor threads (0: jobs run on the polling thread).
    #[arg(long, default_value_t = 0)]
    pub workers: usize,
    /// Size of the staging ring (default: the NIC daemon's).
    #[arg(long, value_parser = size32)]
    pub staging_ring: Option<u32>,
    /// Runs of each measurement; the table shows the median.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
}

impl PathArgs {
    pub fn into_config(self) -> PathBenchConfig {
        PathBenchConfig {
            path: self.path,
            mode: self.mode,
            msg: self.msg.0,
            bytes: self.bytes,
            workers: self.workers,
            staging_ring: self.staging_ring,
            repeat: self.repeat,
        }
    }
}

/// Flags shared by `latency`, `throughput` and `open` (the NIC daemon's benches).
#[derive(Debug, Clone, clap::Args)]
pub struct CommonArgs {
    /// Frontend threads carrying the (backlogged) pipes, one SG function each.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Bytes of each pipe's TX and RX ring (a power of two, >= 4096).
    #[arg(long, default_value_t = 4096)]
    pub ring: u32,
    /// Executor threads of the daemon's SG engine (--sg-workers).
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// The burstvm binary that runs `nic` (default: this one).
    #[arg(long)]
    pub nic_bin: Option<PathBuf>,
    /// Work directory for sockets and state (a fresh temporary one by default).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

impl CommonArgs {
    pub fn into_config(self) -> CommonConfig {
        CommonConfig {
            threads: self.threads,
            ring: self.ring,
            workers: self.workers,
            nic_bin: self.nic_bin,
            dir: self.dir,
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct LatencyArgs {
    /// Pipe counts (the ping pipe included), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "8,64,512,4096")]
    pub pipes: Vec<usize>,
    /// Ping-pongs per repetition.
    #[arg(long, default_value_t = 200)]
    pub samples: usize,
    /// Repetitions (p50 and p99 are the medians over them).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Bytes per ping (at most --ring).
    #[arg(long, default_value_t = 4096)]
    pub size: usize,
    /// Scheduling policy of the daemon's SG engine (rr, prio, drf).
    #[arg(long, default_value = "prio")]
    pub policy: Policy,
    /// The daemon's --sg-gen-budget, one daemon each (0: the whole backlog
    /// per round, no bounded rounds; growth is against the first pipe count
    /// of the same budget).
    #[arg(long, value_delimiter = ',', default_value = "32")]
    pub gen_budget: Vec<usize>,
    /// Signal planes compared: xfifo (SG functions, Cross-FIFO, one row per
    /// --pipes count and budget), dedicated (one signal channel and eventfd
    /// pair per pipe, polled: the SR-IOV model; one row per --pipes count,
    /// first budget), vf (VF pairs through the switch, one row per --vfs
    /// count, one daemon each).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "xfifo,dedicated,vf",
        value_parser = choice::<Mode>(Mode::ALL.map(Mode::name))
    )]
    pub modes: Vec<Mode>,
    /// VF counts of the vf mode (2..256: the pinging pair, the rest backlogged).
    #[arg(long, value_delimiter = ',', default_value = "8,64,256")]
    pub vfs: Vec<usize>,
    #[command(flatten)]
    pub common: CommonArgs,
}

impl LatencyArgs {
    pub fn into_config(self) -> LatencyConfig {
        LatencyConfig {
            pipes: self.pipes,
            samples: self.samples,
            reps: self.reps,
            size: self.size,
            policy: self.policy,
            gen_budget: self.gen_budget,
            modes: self.modes,
            vfs: self.vfs,
            common: self.common.into_config(),
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct ThroughputArgs {
    /// Pipe counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "8,512,4096")]
    pub pipes: Vec<usize>,
    /// Seconds counted per repetition.
    #[arg(long, default_value_t = 1.0)]
    pub duration: f64,
    /// Repetitions (the columns are medians over them).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Scheduling policy of the daemon's SG engine (rr, prio, drf).
    #[arg(long, default_value = "rr")]
    pub policy: Policy,
    #[command(flatten)]
    pub common: CommonArgs,
}

impl ThroughputArgs {
    pub fn into_config(self) -> anyhow::Result<ThroughputConfig> {
        Ok(ThroughputConfig {
            pipes: self.pipes,
            duration: super::nic::secs("duration", self.duration)?,
            reps: self.reps,
            policy: self.policy,
            common: self.common.into_config(),
        })
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct OpenArgs {
    /// Pipes opened on one SG function.
    #[arg(long, default_value_t = 4096)]
    pub pipes: usize,
    /// VFs opened concurrently by `bench devset` (hierarchical lock).
    #[arg(long, default_value_t = 200)]
    pub vfs: usize,
    /// Memory table of each VF (bytes, K/M/G suffix).
    #[arg(long, default_value = "4M", value_parser = super::nic::bytes)]
    pub vf_mem: usize,
    /// Repetitions (medians).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    #[command(flatten)]
    pub common: CommonArgs,
}

impl OpenArgs {
    pub fn into_config(self) -> OpenConfig {
        OpenConfig {
            pipes: self.pipes,
            vfs: self.vfs,
            vf_mem: self.vf_mem,
            reps: self.reps,
            common: self.common.into_config(),
        }
    }
}
