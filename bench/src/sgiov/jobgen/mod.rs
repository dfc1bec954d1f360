//! `bench sgiov jobgen`: what handling wrapping rings costs (§5.2, Fig. 14a).
//!
//! Messages stream back to back through a source ring into a sink ring (4
//! MiB each, starting off any message boundary so that wraps split
//! messages), one transformation at a time, on one thread:
//!
//! - `raw`: the executor on one contiguous buffer, one job per message: the
//!   engine's peak;
//! - `recursive`: the job generator's plans, run by the same executors;
//! - `bounce`: the common alternative: a message whose input or output
//!   wraps goes through contiguous scratch buffers (copy in, transform, copy
//!   out) — the extra bytes it copies are counted;
//! - `engine`: `recursive` through the whole engine (dirty list, scheduler,
//!   in-order publication), inline.
//!
//! For `decrypt` the source records are made by the encrypting side of the
//! same strategy outside the timed part. The second table is the latency of
//! a high-priority pipe's 4 KiB messages while a low-priority pipe keeps one
//! worker busy with large jobs, with and without a maximum job size.
//!
//! This file: configuration, errors, the shared ring set-up (`Bench`), the
//! first table's driver and the CLI. The strategies are in `strategies.rs`,
//! the second table (priority latency) in `latency.rs`.

mod latency;
mod strategies;

pub use latency::{latency, LatencyRow};
use strategies::{engine, raw, stream};

use std::sync::Arc;
use std::time::{Duration, Instant};

use sgiov::engine::{Engine, EngineConfig, EngineError, Event, PipeSpec, RingKey};
use sgiov::exec::crypto::{self, KeyStore, RecordHeader};
use sgiov::exec::{execute, ExecError};
use sgiov::job::{Buf, JobDesc, Op};
use sgiov::jobgen::{generate, JobGenError, Params, Span, Xf};
use sgiov::mem::{MemError, Memory, StagingMemory};
use sgiov::ring::{RingGeom, RingView};
use sgiov::sched::{Policy, SchedConfig};

/// What `bench sgiov jobgen` runs (the `burstvm` CLI parses its flags into this).
#[derive(Debug, Clone)]
pub struct JobgenConfig {
    /// Transformations.
    pub xf: Vec<Xf>,
    /// Message sizes in bytes.
    pub msg: Vec<u64>,
    /// Bytes streamed per transformation, size and strategy.
    pub bytes: u64,
    /// Maximum job size of the generator.
    pub max_job: u32,
    /// High-priority messages timed in the latency table (0: skip it).
    pub pings: usize,
    /// Runs of each measurement; the table shows the median.
    pub repeat: usize,
}

impl Default for JobgenConfig {
    fn default() -> Self {
        JobgenConfig {
            xf: vec![Xf::Copy, Xf::Encrypt, Xf::Decrypt],
            msg: super::parse_sizes("1K..1M").expect("a valid size range"),
            bytes: 32 << 20,
            max_job: 64 << 10,
            pings: 300,
            repeat: 3,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum JobgenBenchError {
    #[error("bench sgiov jobgen: {0}")]
    Args(String),
    #[error("bench sgiov jobgen: memory")]
    Memory(#[from] MemError),
    #[error("bench sgiov jobgen: executor")]
    Exec(#[from] ExecError),
    #[error("bench sgiov jobgen: job generator")]
    JobGen(#[from] JobGenError),
    #[error("bench sgiov jobgen: engine")]
    Engine(#[from] EngineError),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Raw,
    Recursive,
    Bounce,
    Engine,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Raw => "raw",
            Strategy::Recursive => "recursive",
            Strategy::Bounce => "bounce",
            Strategy::Engine => "engine",
        }
    }
}

/// One row of the first table.
#[derive(Debug, Clone)]
pub struct JobgenRow {
    pub xf: Xf,
    pub msg: u64,
    pub strategy: Strategy,
    pub mib_s: f64,
    pub jobs_per_msg: f64,
    pub extra_per_msg: f64,
}

const RING: u32 = 4 << 20;
/// Where the streams start: not a multiple of any message size.
const START: u32 = 0x1230;
const MIB: f64 = (1u64 << 20) as f64;

struct Bench {
    mem: Arc<dyn Memory>,
    staging: Arc<StagingMemory>,
    keys: Arc<KeyStore>,
    slot: u16,
}

impl Bench {
    fn new() -> Result<Bench, JobgenBenchError> {
        let staging = Arc::new(StagingMemory::new("bench-jobgen", 256 << 20)?);
        let keys = Arc::new(KeyStore::new(4));
        let (slot, _) = keys
            .alloc_random()
            .ok_or_else(|| JobgenBenchError::Args("no key slot".into()))?;
        Ok(Bench {
            mem: staging.clone(),
            staging,
            keys,
            slot,
        })
    }

    /// A block, filled once so that page faults stay out of the timing.
    fn block(&self, size: u32) -> Result<u64, JobgenBenchError> {
        let base = self
            .staging
            .alloc(size)
            .ok_or_else(|| JobgenBenchError::Args("out of staging memory".into()))?;
        let fill: Vec<u8> = (0..size).map(|i| (i * 31 + 7) as u8).collect();
        self.mem.get(base, size as usize)?.copy_from(&fill);
        Ok(base)
    }

    fn ring(&self) -> Result<RingView, JobgenBenchError> {
        Ok(RingView::new(
            self.mem.clone(),
            RingGeom {
                base: self.block(RING)?,
                size: RING,
            },
        ))
    }

    fn buf(&self, addr: u64, len: u32) -> Option<Buf> {
        Some(Buf {
            mem: self.mem.clone(),
            addr,
            len,
        })
    }

    fn job(&self, op: Op, src: Option<Buf>, dst: Option<Buf>, seq: u64) -> JobDesc {
        JobDesc {
            op,
            src,
            dst,
            key_slot: self.slot,
            seq,
        }
    }
}

/// The first table: every strategy for one transformation and message size.
pub fn run_size(
    xf: Xf,
    msg: u64,
    bytes: u64,
    max_job: u32,
) -> Result<Vec<JobgenRow>, JobgenBenchError> {
    if msg > (RING / 4) as u64 || msg == 0 {
        return Err(JobgenBenchError::Args(format!(
            "message size {msg} must be in 1..={}",
            RING / 4
        )));
    }
    let b = Bench::new()?;
    let m = msg as u32;
    let count = (bytes / msg).max(8);
    let mut rows = Vec::new();
    for s in [
        Strategy::Raw,
        Strategy::Recursive,
        Strategy::Bounce,
        Strategy::Engine,
    ] {
        let (secs, jobs, extra) = match s {
            Strategy::Raw => {
                let (t, j) = raw(&b, xf, m, count)?;
                (t, j, 0.0)
            }
            Strategy::Recursive => stream(&b, xf, m, count, false, max_job)?,
            Strategy::Bounce => stream(&b, xf, m, count, true, max_job)?,
            Strategy::Engine => engine(&b, xf, m, count, max_job)?,
        };
        rows.push(JobgenRow {
            xf,
            msg,
            strategy: s,
            mib_s: (count * msg) as f64 / secs.max(1e-9) / MIB,
            jobs_per_msg: jobs,
            extra_per_msg: extra,
        });
    }
    Ok(rows)
}

pub fn run_cli(a: &JobgenConfig) -> Result<(), JobgenBenchError> {
    let (sizes, bytes, max_job) = (&a.msg, a.bytes, a.max_job);
    println!(
        "bench sgiov jobgen: {} MiB per run, median of {} runs, rings of {} MiB, max job {}; one thread",
        bytes >> 20,
        a.repeat.max(1),
        RING >> 20,
        guestmem::format_size(max_job as u64)
    );
    println!("| xf | msg | strategy | MiB/s | ratio to raw | jobs/msg | extra bytes copied/msg |");
    println!("|---|---|---|---|---|---|---|");
    for &xf in &a.xf {
        for &m in sizes {
            let runs: Vec<Vec<JobgenRow>> = (0..a.repeat.max(1))
                .map(|_| run_size(xf, m, bytes, max_job))
                .collect::<Result<_, _>>()?;
            let mut rows = runs[0].clone();
            for (i, r) in rows.iter_mut().enumerate() {
                let mut v: Vec<f64> = runs.iter().map(|x| x[i].mib_s).collect();
                v.sort_by(|a, b| a.total_cmp(b));
                r.mib_s = super::percentile(&v, 50.0);
            }
            let raw = rows[0].mib_s;
            for r in rows {
                println!(
                    "| {} | {} | {} | {:.0} | {:.2} | {:.2} | {:.1} |",
                    xf.name(),
                    guestmem::format_size(m),
                    r.strategy.name(),
                    r.mib_s,
                    r.mib_s / raw,
                    r.jobs_per_msg,
                    r.extra_per_msg
                );
            }
        }
    }
    if a.pings > 0 {
        println!();
        println!("High-priority 4 KiB messages while a low-priority pipe streams 1 MiB messages (1 worker, policy prio):");
        println!("| max job size | high-prio p50 µs | high-prio p99 µs | low-prio MiB/s |");
        println!("|---|---|---|---|");
        for mj in [None, Some(max_job)] {
            let r = latency(mj, a.pings)?;
            println!(
                "| {} | {:.0} | {:.0} | {:.0} |",
                mj.map_or(
                    "none (ring-limited)".to_string(),
                    |m| guestmem::format_size(m as u64)
                ),
                r.p50_us,
                r.p99_us,
                r.low_mib_s
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategies_run_and_count() {
        for xf in [Xf::Copy, Xf::Encrypt, Xf::Decrypt] {
            let rows = run_size(xf, 64 << 10, 2 << 20, 16 << 10).unwrap();
            let by = |s: Strategy| rows.iter().find(|r| r.strategy == s).unwrap().clone();
            assert_eq!(by(Strategy::Recursive).extra_per_msg, 0.0, "{xf:?}");
            assert!(
                by(Strategy::Recursive).jobs_per_msg >= 4.0,
                "64K messages in 16K jobs"
            );
            assert!(by(Strategy::Raw).mib_s > 0.0 && by(Strategy::Engine).mib_s > 0.0);
        }
        // Bounce copies something extra whenever a message wraps.
        let rows = run_size(Xf::Copy, 1 << 20, 8 << 20, 64 << 10).unwrap();
        assert!(rows[2].extra_per_msg > 0.0);
    }

    #[test]
    fn latency_runs() {
        let r = latency(Some(64 << 10), 5).unwrap();
        assert!(r.p50_us > 0.0 && r.p99_us >= r.p50_us, "{r:?}");
        // The priority lane must not starve the backlogged low pipe (its
        // rate inside the short window depends on the host's scheduler).
        assert!(r.low_bytes > 0, "{r:?}");
    }
}
