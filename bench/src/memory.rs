//! `burstvm bench memory`: time from request to DMA-ready and of a first full touch of the
//! guest view, per memory policy (FastIOV Fig. 6 / §6.1 baselines).

use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use guestmem::pool::{Pool, PoolClient, PoolServer, SizeClass};
use guestmem::{GuestMemory, MemoryPolicy, MemorySource, RegionSpec};

/// Byte the pool is pre-filled with (a previous tenant's data).
const DIRTY_PATTERN: u8 = 0xA5;

/// What `burstvm bench memory` measures (its arguments are cli's `MemoryBenchArgs`).
#[derive(Debug, Clone)]
pub struct MemoryBenchConfig {
    /// Guest memory per sandbox in bytes (one `ram` region, dma = true).
    pub size: u64,
    /// The policies to measure, in this order.
    pub policies: Vec<MemoryPolicy>,
    /// Use 2 MiB hugetlb pages (must be reserved in /proc/sys/vm/nr_hugepages).
    pub hugepages: bool,
    /// Sandboxes mapping their memory at the same time.
    pub concurrency: usize,
    /// Repetitions per policy (the median over all sandboxes and runs is reported).
    pub runs: usize,
    /// With the pool's pinning (see `guestmem::pool::Pool::set_pinning`), without, or both.
    pub pool_pinning: PoolPinning,
}

/// Which pool-pinning setting pool policies run with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolPinning {
    /// The pool keeps its memory pinned (the default everywhere).
    On,
    /// Off: each DMA mapping pins its pages itself.
    Off,
    /// Both, side by side: pool policies also run as `<policy> unpinned`.
    Compare,
}

impl std::str::FromStr for PoolPinning {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "on" => Ok(PoolPinning::On),
            "off" => Ok(PoolPinning::Off),
            "compare" => Ok(PoolPinning::Compare),
            _ => Err(Error::BadArg {
                arg: "--pool-pinning".into(),
                reason: format!("{s:?}: expected on, off or compare"),
            }),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("bench memory: bad argument {arg}: {reason}")]
    BadArg { arg: String, reason: String },
    #[error("bench memory, policy {policy}: {source}")]
    Memory {
        policy: String,
        #[source]
        source: guestmem::Error,
    },
    #[error("bench memory: {0}")]
    Pool(#[from] guestmem::pool::Error),
    #[error("bench memory, policy {policy}: a benchmark thread panicked")]
    Panicked { policy: String },
    #[error("bench memory, policy {policy}: guest read {count} bytes of old data (zeroing bug)")]
    Leak { policy: String, count: u64 },
}

/// Median timings of one policy.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PolicyResult {
    pub policy: String,
    pub dma_ready: Duration,
    pub first_touch: Duration,
    /// Median userfaultfd faults per sandbox during the first touch (lazy only).
    pub faults: u64,
    pub samples: usize,
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    if v.is_empty() {
        Duration::ZERO
    } else {
        v[v.len() / 2]
    }
}

struct Sample {
    dma_ready: Duration,
    first_touch: Duration,
    faults: u64,
    old_bytes: u64,
}

/// One sandbox: request -> DMA-ready, then a first touch of every page of the guest view.
fn one(
    spec: &RegionSpec,
    policy: MemoryPolicy,
    socket: &std::path::Path,
    hugepages: bool,
) -> Result<Sample, guestmem::Error> {
    let t0 = Instant::now();
    let source = match policy {
        MemoryPolicy::Vanilla => MemorySource::Fresh,
        _ => MemorySource::Pool(PoolClient::connect(socket)?),
    };
    let mut gm = GuestMemory::new(std::slice::from_ref(spec), policy, source, hugepages)?;
    gm.dma_map(&spec.name)?;
    gm.start_lazy_zeroing()?;
    let t1 = Instant::now();
    let r = &gm.regions()[0];
    let ps = r.page_size() as usize;
    let base = r.guest_view_ptr();
    let mut old_bytes = 0;
    for off in (0..r.size() as usize).step_by(ps) {
        // SAFETY: inside the guest view; volatile so the touch really happens.
        unsafe {
            let p = base.add(off);
            if std::ptr::read_volatile(p.add(1)) != 0 {
                old_bytes += 1;
            }
            std::ptr::write_volatile(p, 1);
        }
    }
    let t2 = Instant::now();
    if let Some(e) = gm.lazy_error() {
        return Err(e);
    }
    Ok(Sample {
        dma_ready: t1 - t0,
        first_touch: t2 - t1,
        faults: gm.lazy_stats().faults,
        old_bytes,
    })
}

pub fn run(a: &MemoryBenchConfig) -> Result<Vec<PolicyResult>, Error> {
    let size = a.size;
    let policies = a.policies.clone();
    if a.concurrency == 0 || a.runs == 0 {
        return Err(Error::BadArg {
            arg: "--concurrency/--runs".into(),
            reason: "must be at least 1".into(),
        });
    }
    let page = guestmem::page_size_for(a.hugepages);
    if !size.is_multiple_of(page) {
        return Err(Error::BadArg {
            arg: "--size".into(),
            reason: format!("{size} is not a multiple of the page size {page}"),
        });
    }
    let spec = RegionSpec {
        name: "ram".into(),
        gpa: 0,
        size,
        dma: true,
    };
    let class = SizeClass {
        size,
        hugepages: a.hugepages,
    };
    let socket = PathBuf::from(format!(
        "/tmp/burstvm-bench-pool-{}.sock",
        std::process::id()
    ));
    let pool = Arc::new(Pool::new(None));
    // Same starting state for every policy: enough dirty, resident memory for one wave.
    if policies.iter().any(|p| *p != MemoryPolicy::Vanilla) {
        pool.fill(class, a.concurrency as u64, Some(DIRTY_PATTERN))?;
    }
    // No idle pre-zeroer: pre-zeroing is done explicitly (untimed) before each pre run.
    let server = PoolServer::start_with(&socket, pool.clone(), false)?;

    // Every pool policy with the pool's pinning (as the runtime runs) and/or without.
    let pin_runs: &[bool] = match a.pool_pinning {
        PoolPinning::On => &[true],
        PoolPinning::Off => &[false],
        PoolPinning::Compare => &[true, false],
    };
    // Vanilla takes nothing from the pool: one row, with the first setting.
    let runs: Vec<(MemoryPolicy, bool)> = pin_runs
        .iter()
        .flat_map(|&pin| {
            policies
                .iter()
                .filter(move |p| **p != MemoryPolicy::Vanilla || pin == pin_runs[0])
                .map(move |&p| (p, pin))
        })
        .collect();
    let mut results = Vec::new();
    for (policy, pin) in runs {
        // Untimed: (un)pinning the cached memfds is the pool's, not a sandbox's, work.
        pool.set_pinning(pin);
        let name = match (pin, policy) {
            (false, p) if p != MemoryPolicy::Vanilla => format!("{p} unpinned"),
            (_, p) => p.to_string(),
        };
        let mut dma = Vec::new();
        let mut touch = Vec::new();
        let mut faults = Vec::new();
        for _ in 0..a.runs {
            match policy {
                MemoryPolicy::Pre(p) => pool.prezero_now(p)?,
                _ => pool.set_prezero_percent(0),
            }
            let barrier = Arc::new(Barrier::new(a.concurrency));
            let handles: Vec<_> = (0..a.concurrency)
                .map(|_| {
                    let (spec, socket, barrier, hp) =
                        (spec.clone(), socket.clone(), barrier.clone(), a.hugepages);
                    std::thread::spawn(move || {
                        barrier.wait();
                        one(&spec, policy, &socket, hp)
                    })
                })
                .collect();
            for h in handles {
                let s = h
                    .join()
                    .map_err(|_| Error::Panicked {
                        policy: policy.to_string(),
                    })?
                    .map_err(|source| Error::Memory {
                        policy: policy.to_string(),
                        source,
                    })?;
                if s.old_bytes > 0 {
                    return Err(Error::Leak {
                        policy: policy.to_string(),
                        count: s.old_bytes,
                    });
                }
                dma.push(s.dma_ready);
                touch.push(s.first_touch);
                faults.push(s.faults);
            }
            // Returned memory is marked dirty once the server saw the connections close.
            while server.clients() > 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        results.push(PolicyResult {
            policy: name,
            samples: dma.len(),
            dma_ready: median(&mut dma),
            first_touch: median(&mut touch),
            faults: {
                faults.sort();
                faults[faults.len() / 2]
            },
        });
    }
    server.shutdown();
    Ok(results)
}

/// The results as the table `burstvm bench memory` prints.
pub fn format_table(a: &MemoryBenchConfig, results: &[PolicyResult]) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let base = results.iter().find(|r| r.policy == "vanilla");
    let ratio = |v: Duration, b: Option<Duration>| match b {
        Some(b) if !b.is_zero() => format!("{:.2}", v.as_secs_f64() / b.as_secs_f64()),
        _ => "-".into(),
    };
    let mut out = format!(
        "memory bench: {} per sandbox, {} pages, concurrency {}, runs {} (median of {} samples)\n",
        guestmem::format_size(a.size),
        if a.hugepages { "2 MiB" } else { "4 KiB" },
        a.concurrency,
        a.runs,
        a.concurrency * a.runs
    );
    out += &format!(
        "{:<16} {:>14} {:>8} {:>16} {:>8} {:>10} {:>8} {:>12}\n",
        "policy",
        "dma-ready ms",
        "ratio",
        "first-touch ms",
        "ratio",
        "total ms",
        "ratio",
        "uffd faults"
    );
    for r in results {
        let total = r.dma_ready + r.first_touch;
        out += &format!(
            "{:<16} {:>14.1} {:>8} {:>16.1} {:>8} {:>10.1} {:>8} {:>12}\n",
            r.policy,
            ms(r.dma_ready),
            ratio(r.dma_ready, base.map(|b| b.dma_ready)),
            ms(r.first_touch),
            ratio(r.first_touch, base.map(|b| b.first_touch)),
            ms(total),
            ratio(total, base.map(|b| b.dma_ready + b.first_touch)),
            r.faults,
        );
    }
    out
}

pub fn run_cli(a: &MemoryBenchConfig) -> Result<(), Error> {
    let results = run(a)?;
    print!("{}", format_table(a, &results));
    Ok(())
}
