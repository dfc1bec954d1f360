//! The data-plane engine: rings, warp pipes, the job generator feeding the
//! scheduler, executors, and in-order publication of heads and tails.
//!
//! A *ring* is a byte ring in some memory (a guest's, or staging). A *pipe*
//! moves bytes from its source ring to its sink ring through a
//! transformation. A ring has at most one producer and one consumer; each
//! is either a pipe of this engine or *external* (a guest, or a benchmark
//! driving the ring itself). Pipes chain: the sink ring of one pipe is the
//! source ring of the next, with no copy in between.
//!
//! The engine is driven by one thread (the signal plane): it tells the
//! engine when an external end moved a pointer ([`Engine::external_head`],
//! [`Engine::external_tail`]), calls [`Engine::poll`], and turns the
//! returned [`Event`]s into signals. Work is proportional to events: only
//! pipes whose rings changed are looked at (the dirty list). Workers run
//! jobs in parallel; a pipe publishes its pointers strictly in job order,
//! so a consumer never sees bytes before all bytes ahead of them.//!
//! This file: configuration, errors, events, the engine's state and its
//! construction; adding and removing rings and pipes is in `registry.rs`,
//! driving the engine (pointer moves, the dirty list, job generation,
//! completions, events) in `drive.rs`, the completion queue in `jobs.rs`.

mod drive;
mod jobs;
mod registry;

use jobs::Completion;
pub use jobs::Completions;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use slab::Slab;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::exec::capacity::Capacities;
use crate::exec::crypto::{KeyStore, OVERHEAD};
use crate::exec::pool::{Dispatcher, WorkerPool};
use crate::exec::{execute, ExecError};
use crate::job::{Class, JobDesc, Op};
use crate::jobgen::{self, Params, Span, Xf};
use crate::lat::{AtomicHist, Hist};
use crate::layout::{limits, ErrorCode};
use crate::ring::{RingError, RingPtrs, RingView};
use crate::sched::{PipeKey, Policy, Queued, SchedConfig, SchedStats, TenantId};

pub type RingKey = usize;

#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    pub sched: SchedConfig,
    pub capacity: Capacities,
    /// Worker threads; 0 = jobs run on the polling thread ([`Engine::run_inline`]).
    pub workers: usize,
    /// Most input bytes per job ([`limits::DEFAULT_MAX_JOB`]).
    pub max_job: u32,
    /// Jobs generated but not completed, per pipe (the paper's job queue of 128).
    pub max_queued: usize,
    /// Backlogged pipes whose jobs [`Engine::poll_bounded`] generates per
    /// call (0: all), so that the polling thread reads its FIFOs again
    /// before it has gone over the whole backlog.
    pub gen_budget: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            sched: SchedConfig::default(),
            capacity: Capacities::unlimited(),
            workers: 2,
            max_job: limits::DEFAULT_MAX_JOB,
            max_queued: 128,
            gen_budget: 32,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("ring {0} does not exist")]
    NoRing(RingKey),
    #[error("pipe {0} does not exist")]
    NoPipe(PipeKey),
    #[error("{ring}: already has a {end}")]
    Busy { ring: String, end: &'static str },
    #[error("{ring}: still used by a pipe")]
    InUse { ring: String },
    #[error("{ring}: its {end} is a pipe, not external")]
    NotExternal { ring: String, end: &'static str },
    #[error("starting {n} executor threads")]
    Workers {
        n: usize,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Ring(#[from] RingError),
}

/// What happened, for the owner of the external ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A pipe produced into `ring`, whose consumer is external: new head.
    Head { ring: RingKey, tag: u64, head: u32 },
    /// A pipe consumed from `ring`, whose producer is external: new tail.
    Tail { ring: RingKey, tag: u64, tail: u32 },
    /// The pipe stopped with an error; it publishes nothing more.
    PipeError {
        pipe: PipeKey,
        tag: u64,
        code: ErrorCode,
        what: String,
    },
    /// A closed pipe is gone (no job of it runs any more): its rings and
    /// their memory may be released.
    PipeGone { pipe: PipeKey, tag: u64 },
}

/// How a pipe is made.
#[derive(Debug, Clone)]
pub struct PipeSpec {
    pub src: RingKey,
    pub sink: RingKey,
    pub xf: Xf,
    pub tenant: TenantId,
    pub prio: u8,
    pub key_slot: u16,
    /// This pipe's maximum job size, if not the engine's.
    pub max_job: Option<u32>,
    pub label: String,
    pub tag: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipeState {
    Running,
    Error(ErrorCode),
    Closing,
}

/// Per-pipe counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PipeStats {
    pub jobs: u64,
    pub src_bytes: u64,
    pub sink_bytes: u64,
    pub in_place: u64,
}

/// Where a priority-0 pipe's time goes (policy `prio`): from the moment
/// its external end published new bytes or room (its signal was read) to a
/// worker taking its job, the jobs dispatched in between, and the jobs
/// queued in the dispatcher when it was submitted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LatStats {
    /// Signal read → job taken by a worker, µs.
    pub prio_wait_us: Hist,
    /// Jobs of other pipes dispatched between its submission and its dispatch.
    pub prio_ahead: Hist,
    /// Jobs queued (all pipes) when it was submitted.
    pub prio_depth: Hist,
    /// Jobs the polling thread ran itself right after the priority lane.
    #[serde(default)]
    pub prio_inline: u64,
}

#[derive(Debug, Default)]
struct LatCounters {
    wait_us: AtomicHist,
    ahead: AtomicHist,
    depth: AtomicHist,
    inline: AtomicU64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub jobs: u64,
    pub completed: u64,
    pub pipe_errors: u64,
    pub sched: SchedStats,
}

#[derive(Debug)]
struct ERing {
    view: RingView,
    ptrs: RingPtrs,
    label: String,
    tag: u64,
    producer: Option<PipeKey>,
    consumer: Option<PipeKey>,
}

#[derive(Debug)]
struct Pending {
    done: bool,
    src_adv: u32,
    sink_adv: u32,
}

#[derive(Debug)]
struct EPipe {
    spec: PipeSpec,
    seq: u64,
    gen_src: u32,
    gen_sink: u32,
    /// Generated jobs in order; `first_ord` is the ordinal of the front.
    pending: VecDeque<Pending>,
    first_ord: u64,
    outstanding: usize,
    state: PipeState,
    dirty: bool,
    /// On the priority lane ([`Engine::poll_bounded`] serves it first).
    hi: bool,
    /// When a signal of its external end was read, for a pipe on the
    /// priority lane whose jobs are not generated yet.
    signalled: Option<Instant>,
    stats: PipeStats,
}

/// What the scheduler carries for each job.
#[derive(Debug)]
pub struct JobEnv {
    pub desc: JobDesc,
    pub ord: u64,
    /// Priority lane only: when its signal was read, and the dispatcher's
    /// dispatched count at submission (the latency counters).
    pub hi: Option<(Instant, u64)>,
}

#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    rings: Slab<ERing>,
    pipes: Slab<EPipe>,
    dirty: VecDeque<PipeKey>,
    /// Dirty pipes of priority 0 under policy `prio`: generated first.
    dirty_hi: VecDeque<PipeKey>,
    /// Pipes on the priority lane: rounds are bounded only while there are.
    hi_pipes: usize,
    disp: Arc<Dispatcher<JobEnv>>,
    lat: Arc<LatCounters>,
    keys: Arc<KeyStore>,
    done: Arc<Completions>,
    // Dropped before `disp`: joins the workers.
    pool: Option<WorkerPool>,
    events: Vec<Event>,
    stats: EngineStats,
}

impl Engine {
    pub fn new(cfg: EngineConfig, keys: Arc<KeyStore>) -> Result<Engine, EngineError> {
        let disp = Arc::new(Dispatcher::new(cfg.sched, cfg.capacity));
        let done =
            Arc::new(Completions::new().map_err(|source| EngineError::Workers { n: 0, source })?);
        let lat = Arc::new(LatCounters::default());
        let pool = if cfg.workers > 0 {
            let (k, d) = (keys.clone(), done.clone());
            let (l, ds) = (lat.clone(), disp.clone());
            Some(
                WorkerPool::start(
                    "sgiov-exec",
                    cfg.workers,
                    disp.clone(),
                    Arc::new(move |pipe, job: Queued<JobEnv>| {
                        if let Some(hi) = job.payload.hi {
                            l.taken(hi, ds.stats().dispatched);
                        }
                        let result = execute(&job.payload.desc, &k);
                        d.push(Completion {
                            pipe,
                            ord: job.payload.ord,
                            result,
                        });
                    }),
                )
                .map_err(|source| EngineError::Workers {
                    n: cfg.workers,
                    source,
                })?,
            )
        } else {
            None
        };
        Ok(Engine {
            cfg,
            rings: Slab::new(),
            pipes: Slab::new(),
            dirty: VecDeque::new(),
            dirty_hi: VecDeque::new(),
            hi_pipes: 0,
            disp,
            lat,
            keys,
            done,
            pool,
            events: Vec::new(),
            stats: EngineStats::default(),
        })
    }

    pub fn keys(&self) -> &Arc<KeyStore> {
        &self.keys
    }

    pub fn completions(&self) -> &Arc<Completions> {
        &self.done
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Switches the scheduling policy and the class capacities at run time
    /// (the NIC's control API); queued jobs are rescheduled under them.
    pub fn reconfigure(&mut self, policy: Policy, capacity: Capacities) {
        self.cfg.sched.policy = policy;
        // The priority lane follows the policy (pipes already dirty are
        // generated once more from the list they are on).
        for (_, x) in self.pipes.iter_mut() {
            x.hi = policy == Policy::Priority && x.spec.prio == 0;
        }
        self.hi_pipes = self.pipes.iter().filter(|(_, x)| x.hi).count();
        self.cfg.sched.nominal = capacity.nominal();
        self.cfg.capacity = capacity;
        self.disp.reconfigure(self.cfg.sched, capacity);
    }
}

impl LatCounters {
    /// A priority-lane job was taken; `dispatched` counts it.
    fn taken(&self, (t, at): (Instant, u64), dispatched: u64) {
        self.wait_us.add(t.elapsed().as_micros() as u64);
        self.ahead.add(dispatched.saturating_sub(at + 1));
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Join the workers before the rings' memories can go away.
        self.pool.take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::{Memory, StagingMemory};
    use crate::ring::RingGeom;

    const RING: u32 = 64 << 10;

    /// `backlog` priority-7 copy pipes with 16 KiB waiting each, then one
    /// priority-0 pipe signalled last with 4 KiB; one bounded poll.
    fn setup(policy: Policy, backlog: usize, budget: usize) -> (Engine, Vec<PipeKey>, PipeKey) {
        let mem = Arc::new(StagingMemory::new("engine-prio-lane", 16 << 20).unwrap());
        let cfg = EngineConfig {
            sched: SchedConfig {
                policy,
                ..Default::default()
            },
            workers: 0,
            gen_budget: budget,
            ..Default::default()
        };
        let mut eng = Engine::new(cfg, Arc::new(KeyStore::new(1))).unwrap();
        let pipe = |eng: &mut Engine, prio: u8| {
            let mut ring = |l: &str| {
                let base = mem.alloc(RING).unwrap();
                let view = RingView::new(
                    mem.clone() as Arc<dyn Memory>,
                    RingGeom { base, size: RING },
                );
                eng.add_ring(view, l.into(), 0)
            };
            let (src, sink) = (ring("src"), ring("sink"));
            let p = eng
                .add_pipe(PipeSpec {
                    src,
                    sink,
                    xf: Xf::Copy,
                    tenant: 1,
                    prio,
                    key_slot: 0,
                    max_job: Some(4096),
                    label: format!("prio {prio}"),
                    tag: 0,
                })
                .unwrap();
            (p, src)
        };
        let low: Vec<_> = (0..backlog).map(|_| pipe(&mut eng, 7)).collect();
        let (hi, hi_src) = pipe(&mut eng, 0);
        // Pipes start dirty with nothing to do.
        assert_eq!(eng.poll(), 0);
        for &(_, src) in &low {
            eng.external_head(src, 16 << 10).unwrap();
        }
        eng.external_head(hi_src, 4096).unwrap();
        eng.poll_bounded(budget);
        (eng, low.into_iter().map(|x| x.0).collect(), hi)
    }

    fn jobs(eng: &Engine, p: PipeKey) -> u64 {
        eng.pipe_stats(p).unwrap().jobs
    }

    #[test]
    fn priority_pipe_is_dispatched_before_the_queued_backlog() {
        let (mut eng, low, hi) = setup(Policy::Priority, 64, 4);
        // One bounded round: the priority pipe signalled last got its job;
        // of the backlog only `budget` pipes (4 jobs each) were generated.
        assert_eq!(jobs(&eng, hi), 1);
        let generated: Vec<_> = low.iter().filter(|&&p| jobs(&eng, p) > 0).collect();
        assert_eq!(generated.len(), 4);
        assert!(eng.has_dirty());
        assert_eq!(eng.disp.queued(hi), 1);
        assert_eq!(eng.stats().sched.enqueued, 1 + 4 * 4);
        // The first job dispatched is the priority pipe's, ahead of 16.
        let (first, job) = eng.disp.try_take().unwrap();
        assert_eq!(first, hi);
        let dispatched = eng.disp.stats().dispatched;
        eng.lat.taken(job.payload.hi.unwrap(), dispatched);
        // The rest of the backlog is generated by further rounds, every
        // byte copied, and the counters saw one priority job with nothing
        // dispatched ahead of it.
        eng.run_inline();
        assert!(!eng.has_dirty());
        assert!(low.iter().all(|&p| jobs(&eng, p) == 4));
        let lat = eng.lat_stats();
        assert_eq!(lat.prio_wait_us.count(), 1);
        assert_eq!(lat.prio_ahead.max(), 0);
        assert_eq!(lat.prio_depth.count(), 1);
    }

    #[test]
    fn round_robin_keeps_signal_order_and_no_priority_lane() {
        // No priority lane under rr: rounds are not bounded either, every
        // pipe is generated in signal order, as before.
        let (eng, low, hi) = setup(Policy::RoundRobin, 64, 4);
        assert_eq!(jobs(&eng, hi), 1);
        assert!(low.iter().all(|&p| jobs(&eng, p) == 4));
        assert!(!eng.has_dirty());
        assert_eq!(eng.lat_stats().prio_depth.count(), 0);
        // One job per turn: the first turn is in signal order.
        let order: Vec<PipeKey> = std::iter::from_fn(|| eng.disp.try_take().map(|j| j.0))
            .take(65)
            .collect();
        let mut signalled = low.clone();
        signalled.push(hi);
        assert_eq!(order, signalled);
    }
}
