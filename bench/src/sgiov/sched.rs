//! `bench sgiov sched`: tenants contending for executor classes under each
//! policy, measured with the real engine (job generator, scheduler, worker
//! threads, executors over staging memory) and capacity-limited classes,
//! next to what the formulas of [`sgiov::sched::drf`] say.
//!
//! Scenarios (issue 14):
//! - `a`: one engine (copy); tenant 1 with 4 KiB jobs, tenant 2 with 64 KiB jobs.
//! - `b`: tenant 1 uses {copy}, tenant 2 {copy, crypto} (a copy pipe chained
//!   into an encrypting pipe); DRF's answer is 5:2 ≈ 7:3 (Fig. 14c).
//! - `c`: as `b` plus tenant 3 on {crypto}: the closed form leaves copy
//!   capacity idle that only tenant 1 can use — progressive filling.
//!
//! Each tenant's source ring is kept full and its sink drained, so every
//! tenant is always backlogged; a tenant's rate is the bytes its last pipe
//! consumed per second. Priorities: tenant 1 highest.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sgiov::engine::{Engine, EngineConfig, EngineError, PipeSpec, RingKey};
use sgiov::exec::capacity::Capacities;
use sgiov::exec::crypto::KeyStore;
use sgiov::job::{Class, NCLASSES};
use sgiov::jobgen::Xf;
use sgiov::mem::{MemError, Memory, StagingMemory};
use sgiov::ring::{RingGeom, RingView};
use sgiov::sched::drf::{self, TenantDemand};
use sgiov::sched::{PipeKey, Policy, SchedConfig};

/// What `bench sgiov sched` runs (the `burstvm` CLI parses its flags into this).
#[derive(Debug, Clone)]
pub struct SchedBenchConfig {
    /// Policies to compare.
    pub policy: Vec<Policy>,
    /// Capacity of each executor class in bytes/s.
    pub capacity: Capacities,
    /// Scenarios to run.
    pub scenario: Vec<Scenario>,
    /// Measured seconds per scenario and policy (after 0.5 s of warm-up).
    pub seconds: f64,
    /// Executor threads.
    pub workers: usize,
}

impl Default for SchedBenchConfig {
    fn default() -> Self {
        SchedBenchConfig {
            policy: vec![Policy::RoundRobin, Policy::Priority, Policy::Drf],
            capacity: "copy=400M,crypto=160M".parse().expect("a valid capacity"),
            scenario: Scenario::ALL.to_vec(),
            seconds: 2.0,
            workers: 2,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SchedBenchError {
    #[error("bench sgiov sched: engine")]
    Engine(#[from] EngineError),
    #[error("bench sgiov sched: staging memory")]
    Memory(#[from] MemError),
    #[error("bench sgiov sched: {0}")]
    Setup(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    A,
    B,
    C,
}

impl Scenario {
    pub const ALL: [Scenario; 3] = [Scenario::A, Scenario::B, Scenario::C];
}

impl FromStr for Scenario {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "a" => Ok(Scenario::A),
            "b" => Ok(Scenario::B),
            "c" => Ok(Scenario::C),
            _ => Err(format!("unknown scenario {s:?} (a, b, c)")),
        }
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Scenario::A => "a",
            Scenario::B => "b",
            Scenario::C => "c",
        })
    }
}

/// A tenant: the classes of its chained pipes, in order, and its job size.
#[derive(Debug, Clone)]
pub struct TenantDef {
    pub stages: Vec<Class>,
    pub job: u32,
    pub prio: u8,
}

pub fn tenants(s: Scenario) -> Vec<TenantDef> {
    let t = |stages: &[Class], job: u32, prio| TenantDef {
        stages: stages.to_vec(),
        job,
        prio,
    };
    match s {
        Scenario::A => vec![
            t(&[Class::Copy], 4 << 10, 0),
            t(&[Class::Copy], 64 << 10, 1),
        ],
        Scenario::B => vec![
            t(&[Class::Copy], 64 << 10, 0),
            t(&[Class::Copy, Class::Crypto], 64 << 10, 1),
        ],
        Scenario::C => vec![
            t(&[Class::Copy], 64 << 10, 0),
            t(&[Class::Copy, Class::Crypto], 64 << 10, 1),
            t(&[Class::Crypto], 64 << 10, 2),
        ],
    }
}

/// What the formulas give each tenant (bytes/s), or None if a class it
/// uses is unthrottled.
pub fn expected(policy: Policy, caps: &Capacities, ts: &[TenantDef]) -> Option<Vec<f64>> {
    let c: Vec<f64> = (0..NCLASSES)
        .map(|j| caps.0[j].unwrap_or(f64::INFINITY))
        .collect();
    let demands: Vec<TenantDemand> = ts
        .iter()
        .map(|t| TenantDemand::equal(&t.stages.iter().map(|c| c.index()).collect::<Vec<_>>()))
        .collect();
    if demands
        .iter()
        .any(|d| d.uses.iter().any(|u| !c[u.0].is_finite()))
    {
        return None;
    }
    let sizes: Vec<f64> = ts.iter().map(|t| t.job as f64).collect();
    Some(match policy {
        Policy::Drf => drf::drf(&c, &demands),
        Policy::RoundRobin => drf::round_robin(&c, &demands, &sizes),
        Policy::Priority => {
            let prio: Vec<u8> = ts.iter().map(|t| t.prio).collect();
            drf::priority(&c, &demands, &prio, &sizes)
        }
    })
}

/// One table row.
#[derive(Debug, Clone)]
pub struct SchedRow {
    pub scenario: Scenario,
    pub policy: Policy,
    pub tenant: usize,
    pub classes: String,
    pub measured: f64,
    pub expected: Option<f64>,
    /// Error against the formula, % of the expected rate (of the tenant's
    /// bottleneck capacity when the formula gives it nothing).
    pub error_pct: Option<f64>,
    /// Process CPU time / wall time during the measurement.
    pub cpu: f64,
}

const RING: u32 = 1 << 20;

/// Runs one scenario under one policy.
pub fn run(
    sc: Scenario,
    policy: Policy,
    caps: Capacities,
    seconds: f64,
    workers: usize,
) -> Result<Vec<SchedRow>, SchedBenchError> {
    let ts = tenants(sc);
    let nominal: [f64; NCLASSES] = std::array::from_fn(|j| caps.0[j].unwrap_or(1e9));
    let keys = Arc::new(KeyStore::new(16));
    let mut eng = Engine::new(
        EngineConfig {
            sched: SchedConfig {
                policy,
                nominal,
                max_inflight: 4,
            },
            capacity: caps,
            workers: workers.max(1),
            ..Default::default()
        },
        keys.clone(),
    )?;
    let staging = Arc::new(StagingMemory::new("bench-sched", 64 << 20)?);
    let mem: Arc<dyn Memory> = staging.clone();
    let ring = |eng: &mut Engine, label: String| -> Result<RingKey, SchedBenchError> {
        let base = staging
            .alloc(RING)
            .ok_or_else(|| SchedBenchError::Setup("out of staging memory".into()))?;
        // Touch the ring once so page faults stay out of the measurement.
        mem.get(base, RING as usize)?
            .copy_from(&vec![0x5a; RING as usize]);
        Ok(eng.add_ring(
            RingView::new(mem.clone(), RingGeom { base, size: RING }),
            label,
            0,
        ))
    };
    // Per tenant: (source ring, sink ring, last pipe).
    let mut ends: Vec<(RingKey, RingKey, PipeKey)> = Vec::new();
    for (i, t) in ts.iter().enumerate() {
        let src = ring(&mut eng, format!("tenant {} source", i + 1))?;
        let mut prev = src;
        let mut last = 0;
        for (k, c) in t.stages.iter().enumerate() {
            let next = ring(&mut eng, format!("tenant {} ring {}", i + 1, k + 1))?;
            let (xf, key) = match c {
                Class::Copy => (Xf::Copy, 0),
                Class::Crypto => (
                    Xf::Encrypt,
                    keys.alloc_random()
                        .ok_or_else(|| SchedBenchError::Setup("no key slot".into()))?
                        .0,
                ),
            };
            last = eng.add_pipe(PipeSpec {
                src: prev,
                sink: next,
                xf,
                tenant: i as u32 + 1,
                prio: t.prio,
                key_slot: key,
                max_job: Some(t.job),
                label: format!("tenant {} stage {}", i + 1, k + 1),
                tag: 0,
            })?;
            prev = next;
        }
        ends.push((src, prev, last));
    }
    let feed = |eng: &mut Engine| -> Result<(), EngineError> {
        for &(src, sink, _) in &ends {
            if let Some(p) = eng.ring_ptrs(src) {
                if p.free() > 0 {
                    eng.external_head(src, p.tail.wrapping_add(RING))?;
                }
            }
            if let Some(p) = eng.ring_ptrs(sink) {
                if p.used() > 0 {
                    eng.external_tail(sink, p.head)?;
                }
            }
        }
        Ok(())
    };
    let run_for = |eng: &mut Engine, d: Duration| -> Result<(), EngineError> {
        let end = Instant::now() + d;
        while Instant::now() < end {
            feed(eng)?;
            eng.poll();
            eng.take_events();
            eng.wait(Duration::from_millis(1));
        }
        Ok(())
    };
    run_for(&mut eng, Duration::from_millis(500))?;
    let bytes = |eng: &Engine| -> Vec<u64> {
        ends.iter()
            .map(|e| eng.pipe_stats(e.2).map_or(0, |s| s.src_bytes))
            .collect()
    };
    let (b0, t0, c0) = (bytes(&eng), Instant::now(), super::cpu_time());
    run_for(&mut eng, Duration::from_secs_f64(seconds))?;
    let (b1, wall, cpu) = (
        bytes(&eng),
        t0.elapsed().as_secs_f64(),
        (super::cpu_time() - c0).as_secs_f64(),
    );
    drop(eng);
    let want = expected(policy, &caps, &ts);
    Ok(ts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let measured = (b1[i] - b0[i]) as f64 / wall;
            let expected = want.as_ref().map(|w| w[i]);
            let bottleneck = t
                .stages
                .iter()
                .filter_map(|c| caps.get(*c))
                .fold(f64::INFINITY, f64::min);
            let error_pct = expected.map(|e| {
                let base = if e > 0.01 * bottleneck { e } else { bottleneck };
                (measured - e) / base * 100.0
            });
            SchedRow {
                scenario: sc,
                policy,
                tenant: i + 1,
                classes: t
                    .stages
                    .iter()
                    .map(|c| c.name())
                    .collect::<Vec<_>>()
                    .join("+"),
                measured,
                expected,
                error_pct,
                cpu: cpu / wall,
            }
        })
        .collect())
}

const MIB: f64 = (1u64 << 20) as f64;

pub fn run_cli(a: &SchedBenchConfig) -> Result<(), SchedBenchError> {
    println!(
        "bench sgiov sched: capacity {}, {} worker(s), {:.1} s per run; MiB/s of each tenant's input",
        a.capacity, a.workers, a.seconds
    );
    println!("| scenario | policy | tenant | classes | job | measured MiB/s | expected MiB/s | error % | CPU |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for &sc in &a.scenario {
        let ts = tenants(sc);
        for &p in &a.policy {
            for r in run(sc, p, a.capacity, a.seconds, a.workers)? {
                println!(
                    "| {} | {} | T{} | {} | {} | {:.1} | {} | {} | {:.0}% |",
                    r.scenario,
                    r.policy,
                    r.tenant,
                    r.classes,
                    guestmem::format_size(ts[r.tenant - 1].job as u64),
                    r.measured / MIB,
                    r.expected.map_or("-".into(), |e| format!("{:.1}", e / MIB)),
                    r.error_pct.map_or("-".into(), |e| format!("{e:+.1}")),
                    r.cpu * 100.0
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formulas_of_the_scenarios() {
        let caps: Capacities = "copy=400M,crypto=160M".parse().unwrap();
        let m = |v: Vec<f64>| {
            v.iter()
                .map(|x| (x / MIB * 10.0).round() / 10.0)
                .collect::<Vec<_>>()
        };
        // (a) one engine: RR gives bytes in proportion to job size, DRF equal bytes.
        assert_eq!(
            m(expected(Policy::RoundRobin, &caps, &tenants(Scenario::A)).unwrap()),
            vec![23.5, 376.5]
        );
        assert_eq!(
            m(expected(Policy::Drf, &caps, &tenants(Scenario::A)).unwrap()),
            vec![200.0, 200.0]
        );
        assert_eq!(
            m(expected(Policy::Priority, &caps, &tenants(Scenario::A)).unwrap()),
            vec![400.0, 0.0]
        );
        // (b) DRF: 400·400/560 against 160·400/560 (5:2, the paper's ~7:3).
        assert_eq!(
            m(expected(Policy::Drf, &caps, &tenants(Scenario::B)).unwrap()),
            vec![285.7, 114.3]
        );
        // (c) progressive filling gives tenant 1 the copy capacity left idle.
        assert_eq!(
            m(expected(Policy::Drf, &caps, &tenants(Scenario::C)).unwrap()),
            vec![320.0, 80.0, 80.0]
        );
        assert!(expected(Policy::Drf, &Capacities::unlimited(), &tenants(Scenario::A)).is_none());
    }

    #[test]
    fn a_short_run_reports_every_tenant() {
        let caps: Capacities = "copy=100M,crypto=40M".parse().unwrap();
        let rows = run(Scenario::C, Policy::Drf, caps, 0.2, 2).unwrap();
        assert_eq!(rows.len(), 3);
        assert!(rows
            .iter()
            .all(|r| r.measured > 0.0 && r.expected.is_some()));
    }
}
