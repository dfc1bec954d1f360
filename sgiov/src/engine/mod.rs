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
//! so a consumer never sees bytes before all bytes ahead of them.

mod jobs;

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

#[derive(Default)]
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

struct ERing {
    view: RingView,
    ptrs: RingPtrs,
    label: String,
    tag: u64,
    producer: Option<PipeKey>,
    consumer: Option<PipeKey>,
}

struct Pending {
    done: bool,
    src_adv: u32,
    sink_adv: u32,
}

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
pub struct JobEnv {
    pub desc: JobDesc,
    pub ord: u64,
    /// Priority lane only: when its signal was read, and the dispatcher's
    /// dispatched count at submission (the latency counters).
    pub hi: Option<(Instant, u64)>,
}

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

    /// Adds a ring with both ends external.
    pub fn add_ring(&mut self, view: RingView, label: String, tag: u64) -> RingKey {
        self.rings.insert(ERing {
            ptrs: RingPtrs::new(view.geom.size),
            view,
            label,
            tag,
            producer: None,
            consumer: None,
        })
    }

    /// Removes a ring no pipe uses.
    pub fn remove_ring(&mut self, r: RingKey) -> Result<RingView, EngineError> {
        let ring = self.rings.get(r).ok_or(EngineError::NoRing(r))?;
        if ring.producer.is_some() || ring.consumer.is_some() {
            return Err(EngineError::InUse {
                ring: ring.label.clone(),
            });
        }
        Ok(self.rings.remove(r).view)
    }

    pub fn ring_ptrs(&self, r: RingKey) -> Option<RingPtrs> {
        self.rings.get(r).map(|x| x.ptrs)
    }

    pub fn ring_view(&self, r: RingKey) -> Option<&RingView> {
        self.rings.get(r).map(|x| &x.view)
    }

    pub fn rings(&self) -> usize {
        self.rings.len()
    }

    pub fn pipes(&self) -> usize {
        self.pipes.len()
    }

    pub fn add_pipe(&mut self, spec: PipeSpec) -> Result<PipeKey, EngineError> {
        let src = self
            .rings
            .get(spec.src)
            .ok_or(EngineError::NoRing(spec.src))?;
        let sink = self
            .rings
            .get(spec.sink)
            .ok_or(EngineError::NoRing(spec.sink))?;
        if src.consumer.is_some() || spec.src == spec.sink {
            return Err(EngineError::Busy {
                ring: src.label.clone(),
                end: "consumer",
            });
        }
        if sink.producer.is_some() {
            return Err(EngineError::Busy {
                ring: sink.label.clone(),
                end: "producer",
            });
        }
        let (gen_src, gen_sink) = (src.ptrs.tail, sink.ptrs.head);
        let hi = self.cfg.sched.policy == Policy::Priority && spec.prio == 0;
        self.hi_pipes += hi as usize;
        let p = self.pipes.insert(EPipe {
            spec: spec.clone(),
            seq: 0,
            gen_src,
            gen_sink,
            pending: VecDeque::new(),
            first_ord: 0,
            outstanding: 0,
            state: PipeState::Running,
            dirty: false,
            hi,
            signalled: None,
            stats: PipeStats::default(),
        }) as PipeKey;
        self.rings[spec.src].consumer = Some(p);
        self.rings[spec.sink].producer = Some(p);
        self.mark(p);
        Ok(p)
    }

    pub fn pipe_state(&self, p: PipeKey) -> Option<PipeState> {
        self.pipes.get(p as usize).map(|x| x.state)
    }

    pub fn pipe_stats(&self, p: PipeKey) -> Option<PipeStats> {
        self.pipes.get(p as usize).map(|x| x.stats)
    }

    fn mark(&mut self, p: PipeKey) {
        if let Some(x) = self.pipes.get_mut(p as usize) {
            if !x.dirty {
                x.dirty = true;
                if x.hi {
                    self.dirty_hi.push_back(p);
                } else {
                    self.dirty.push_back(p);
                }
            }
        }
    }

    /// An external end of `p` moved (a signal was read): marks it, and
    /// starts the latency clock of a priority-lane pipe.
    fn signalled(&mut self, p: PipeKey) {
        if let Some(x) = self.pipes.get_mut(p as usize) {
            if x.hi && x.signalled.is_none() {
                x.signalled = Some(Instant::now());
            }
        }
        self.mark(p);
    }

    /// Whether pipes wait for job generation ([`Engine::poll_bounded`]).
    pub fn has_dirty(&self) -> bool {
        !self.dirty.is_empty() || !self.dirty_hi.is_empty()
    }

    /// The priority lane's latency counters so far.
    pub fn lat_stats(&self) -> LatStats {
        LatStats {
            prio_wait_us: self.lat.wait_us.snapshot(),
            prio_ahead: self.lat.ahead.snapshot(),
            prio_depth: self.lat.depth.snapshot(),
            prio_inline: self.lat.inline.load(Ordering::Relaxed),
        }
    }

    /// The external producer of `r` published head `ptr` (checked).
    pub fn external_head(&mut self, r: RingKey, ptr: u32) -> Result<u32, EngineError> {
        let ring = self.rings.get_mut(r).ok_or(EngineError::NoRing(r))?;
        if ring.producer.is_some() {
            return Err(EngineError::NotExternal {
                ring: ring.label.clone(),
                end: "producer",
            });
        }
        let added = ring.ptrs.publish_head(&ring.label, ptr)?;
        if let (Some(c), true) = (ring.consumer, added > 0) {
            self.signalled(c);
        }
        Ok(added)
    }

    /// The external consumer of `r` published tail `ptr` (checked).
    pub fn external_tail(&mut self, r: RingKey, ptr: u32) -> Result<u32, EngineError> {
        let ring = self.rings.get_mut(r).ok_or(EngineError::NoRing(r))?;
        if ring.consumer.is_some() {
            return Err(EngineError::NotExternal {
                ring: ring.label.clone(),
                end: "consumer",
            });
        }
        let freed = ring.ptrs.publish_tail(&ring.label, ptr)?;
        if let (Some(p), true) = (ring.producer, freed > 0) {
            self.signalled(p);
        }
        Ok(freed)
    }

    /// Stops a pipe with an error: queued jobs are dropped, nothing more is
    /// published (running jobs finish and are ignored).
    pub fn fail_pipe(&mut self, p: PipeKey, code: ErrorCode, what: String) {
        let Some(x) = self.pipes.get_mut(p as usize) else {
            return;
        };
        if x.state != PipeState::Running {
            return;
        }
        x.state = PipeState::Error(code);
        let cancelled = self.disp.cancel(p).len();
        x.outstanding -= cancelled;
        self.stats.pipe_errors += 1;
        self.events.push(Event::PipeError {
            pipe: p,
            tag: x.spec.tag,
            code,
            what,
        });
    }

    /// Closes a pipe (mid-transfer is fine): queued jobs are dropped; the
    /// pipe is gone ([`Event::PipeGone`]) once its running jobs finished.
    pub fn close_pipe(&mut self, p: PipeKey) -> Result<(), EngineError> {
        let x = self
            .pipes
            .get_mut(p as usize)
            .ok_or(EngineError::NoPipe(p))?;
        if x.state == PipeState::Closing {
            return Ok(());
        }
        if x.state == PipeState::Running {
            let cancelled = self.disp.cancel(p).len();
            x.outstanding -= cancelled;
        }
        x.state = PipeState::Closing;
        if x.outstanding == 0 {
            self.remove_pipe(p);
        }
        Ok(())
    }

    fn remove_pipe(&mut self, p: PipeKey) {
        let x = self.pipes.remove(p as usize);
        self.hi_pipes -= x.hi as usize;
        self.disp.cancel(p);
        if let Some(r) = self.rings.get_mut(x.spec.src) {
            r.consumer = None;
        }
        if let Some(r) = self.rings.get_mut(x.spec.sink) {
            r.producer = None;
        }
        self.events.push(Event::PipeGone {
            pipe: p,
            tag: x.spec.tag,
        });
    }

    /// Events since the last call.
    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    /// Processes completions (publishing pointers in job order) and
    /// generates jobs for the pipes whose rings changed. Returns how much
    /// happened (completions + jobs generated).
    pub fn poll(&mut self) -> usize {
        self.poll_bounded(0)
    }

    /// [`Engine::poll`] that generates jobs for at most `budget` pipes of
    /// the backlog (0: all; all as well while no pipe is on the priority
    /// lane: bounded rounds cost throughput, and only buy latency for a
    /// priority pipe), after every pipe of the priority lane: the
    /// caller reads its signals again before coming back for the rest
    /// ([`Engine::has_dirty`]), so a priority-0 signal that arrives while
    /// thousands of pipes are backlogged waits for one bounded round, not
    /// for the whole backlog's job generation.
    pub fn poll_bounded(&mut self, budget: usize) -> usize {
        let mut n = 0;
        for c in self.done.drain() {
            n += 1;
            self.complete(c);
        }
        let mut left = if budget == 0 || self.hi_pipes == 0 {
            usize::MAX
        } else {
            budget
        };
        let mut hi_jobs = 0;
        loop {
            if let Some(p) = self.dirty_hi.pop_front() {
                hi_jobs += self.generate(p);
                continue;
            }
            if left == 0 {
                break;
            }
            let Some(p) = self.dirty.pop_front() else {
                break;
            };
            left -= 1;
            n += self.generate(p);
        }
        // This thread runs as many jobs as the priority lane just made,
        // taken in the dispatcher's order (the policy still decides; under
        // `prio` they are the lane's): no worker wake-up on the priority
        // path, and a worker busy with one maximum-size job does not delay it.
        if self.pool.is_some() {
            for _ in 0..hi_jobs {
                let Some((pipe, job)) = self.disp.try_take() else {
                    break;
                };
                self.lat.inline.fetch_add(1, Ordering::Relaxed);
                self.run_taken(pipe, job);
            }
        }
        n + hi_jobs
    }

    /// Runs a job taken from the dispatcher on this thread.
    fn run_taken(&mut self, pipe: PipeKey, job: Queued<JobEnv>) {
        if let Some(hi) = job.payload.hi {
            self.lat.taken(hi, self.disp.stats().dispatched);
        }
        let result = execute(&job.payload.desc, &self.keys);
        self.disp.done(pipe, job.barrier);
        self.complete(Completion {
            pipe,
            ord: job.payload.ord,
            result,
        });
    }

    /// Without workers: runs every job that may run now on this thread,
    /// polling in between, until nothing is left to do.
    pub fn run_inline(&mut self) -> usize {
        let mut total = 0;
        loop {
            let mut n = self.poll();
            while let Some((pipe, job)) = self.disp.try_take() {
                self.run_taken(pipe, job);
                n += 1;
            }
            if n == 0 {
                return total;
            }
            total += n;
        }
    }

    /// Waits for completions (with workers) up to `timeout`.
    pub fn wait(&self, timeout: Duration) -> bool {
        self.done.wait(timeout)
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            sched: self.disp.stats(),
            ..self.stats
        }
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
