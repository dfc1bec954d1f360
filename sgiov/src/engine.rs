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

struct Completion {
    pipe: PipeKey,
    ord: u64,
    result: Result<(), ExecError>,
}

/// Completed jobs, handed from the workers to the polling thread. The
/// eventfd lets a daemon's event loop wait for them with its other fds.
pub struct Completions {
    q: Mutex<Vec<Completion>>,
    cv: Condvar,
    efd: EventFd,
}

impl Completions {
    fn push(&self, c: Completion) {
        let mut q = self.q.lock().unwrap_or_else(|e| e.into_inner());
        q.push(c);
        // The reader drains everything: only the first completion of a
        // batch needs to wake it (one syscall per batch, not per job).
        if q.len() == 1 {
            drop(q);
            self.cv.notify_all();
            let _ = self.efd.write(1);
        }
    }

    fn drain(&self) -> Vec<Completion> {
        std::mem::take(&mut *self.q.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Waits until a completion is pending or `timeout` passed.
    pub fn wait(&self, timeout: Duration) -> bool {
        let q = self.q.lock().unwrap_or_else(|e| e.into_inner());
        if !q.is_empty() {
            return true;
        }
        let (q, _) = self
            .cv
            .wait_timeout(q, timeout)
            .unwrap_or_else(|e| e.into_inner());
        !q.is_empty()
    }

    /// Readable when jobs completed (read it to reset).
    pub fn eventfd(&self) -> &EventFd {
        &self.efd
    }
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
        let done = Arc::new(Completions {
            q: Mutex::new(Vec::new()),
            cv: Condvar::new(),
            efd: EventFd::new(EFD_NONBLOCK)
                .map_err(|source| EngineError::Workers { n: 0, source })?,
        });
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

    fn complete(&mut self, c: Completion) {
        self.stats.completed += 1;
        let Some(x) = self.pipes.get_mut(c.pipe as usize) else {
            return;
        };
        x.outstanding -= 1;
        if let Some(e) = x.pending.get_mut((c.ord - x.first_ord) as usize) {
            e.done = true;
        }
        match (&c.result, x.state) {
            (Err(e), PipeState::Running) => {
                let (code, what) = (e.code(), format!("{}: {e}", x.spec.label));
                self.fail_pipe(c.pipe, code, what);
            }
            (Ok(()), PipeState::Running) => self.publish(c.pipe),
            _ => {}
        }
        if let Some(x) = self.pipes.get(c.pipe as usize) {
            if x.state == PipeState::Closing && x.outstanding == 0 {
                self.remove_pipe(c.pipe);
            }
        }
    }

    /// Publishes the completed prefix of a pipe's jobs.
    fn publish(&mut self, p: PipeKey) {
        let x = &mut self.pipes[p as usize];
        let (mut src_adv, mut sink_adv) = (0u32, 0u32);
        while x.pending.front().is_some_and(|e| e.done) {
            let e = x.pending.pop_front().unwrap_or(Pending {
                done: true,
                src_adv: 0,
                sink_adv: 0,
            });
            x.first_ord += 1;
            src_adv += e.src_adv;
            sink_adv += e.sink_adv;
        }
        x.stats.src_bytes += src_adv as u64;
        x.stats.sink_bytes += sink_adv as u64;
        let (src, sink) = (x.spec.src, x.spec.sink);
        let mut mark = vec![p];
        if src_adv > 0 {
            let r = &mut self.rings[src];
            let tail = r.ptrs.tail.wrapping_add(src_adv);
            // Our own pointer: it cannot be out of range.
            let _ = r.ptrs.publish_tail(&r.label, tail);
            match r.producer {
                None => self.events.push(Event::Tail {
                    ring: src,
                    tag: r.tag,
                    tail,
                }),
                Some(q) => mark.push(q),
            }
        }
        if sink_adv > 0 {
            let r = &mut self.rings[sink];
            let head = r.ptrs.head.wrapping_add(sink_adv);
            let _ = r.ptrs.publish_head(&r.label, head);
            match r.consumer {
                None => self.events.push(Event::Head {
                    ring: sink,
                    tag: r.tag,
                    head,
                }),
                Some(q) => mark.push(q),
            }
        }
        for q in mark {
            self.mark(q);
        }
    }

    /// Runs the job generator for one pipe; returns jobs generated.
    fn generate(&mut self, p: PipeKey) -> usize {
        // A chained neighbour with jobs running will publish more data (or
        // free more space) and mark this pipe again; so will this pipe's own
        // running jobs. Until then, bytes short of a full job wait, so that
        // jobs do not shrink along a chain (TCP's silly window syndrome,
        // avoided as Nagle does: small pieces wait while work is in flight).
        let busy = |q: Option<PipeKey>| {
            q.and_then(|q| self.pipes.get(q as usize))
                .is_some_and(|y| y.outstanding > 0)
        };
        let Some(x) = self.pipes.get(p as usize) else {
            return 0;
        };
        let (src, sink) = (&self.rings[x.spec.src], &self.rings[x.spec.sink]);
        let (mut up, mut down) = (busy(src.producer), busy(sink.consumer));
        let Some(x) = self.pipes.get_mut(p as usize) else {
            return 0;
        };
        x.dirty = false;
        up |= x.outstanding > 0;
        down |= x.outstanding > 0;
        let room = self.cfg.max_queued.saturating_sub(x.outstanding);
        if x.state != PipeState::Running || room == 0 {
            return 0;
        }
        let (src, sink) = (&self.rings[x.spec.src], &self.rings[x.spec.sink]);
        let sspan = Span::new(
            src.view.geom.size,
            x.gen_src,
            src.ptrs.head.wrapping_sub(x.gen_src),
        );
        let kfree = sink
            .ptrs
            .tail
            .wrapping_add(sink.view.geom.size)
            .wrapping_sub(x.gen_sink);
        let kspan = Span::new(sink.view.geom.size, x.gen_sink, kfree);
        let params = Params {
            xf: x.spec.xf,
            max_job: x.spec.max_job.unwrap_or(self.cfg.max_job),
            max_jobs: room,
        };
        let full = params
            .max_job
            .min(src.view.geom.size / 2)
            .min(sink.view.geom.size / 2);
        // Trailing bytes short of a full job wait too (they would become a
        // small job whose remainder makes the next one small as well).
        let unit = if x.spec.xf == Xf::Encrypt {
            full.saturating_add(OVERHEAD)
        } else {
            full
        };
        let mut sspan = sspan;
        let mut kspan = kspan;
        if up {
            sspan.len -= sspan.len % full;
        }
        if down {
            kspan.len -= kspan.len % unit;
        }
        if sspan.len == 0 || kspan.len == 0 {
            return 0;
        }
        let view = &src.view;
        let mut header = |ptr: u32| {
            let mut h = [0u8; 16];
            view.read(ptr, &mut h).map(|_| h).map_err(|e| e.to_string())
        };
        let plan = match jobgen::generate(sspan, kspan, &params, &mut x.seq, &mut header) {
            Ok(plan) => plan,
            Err(e) => {
                let what = format!("{}: {e}", x.spec.label);
                self.fail_pipe(p, e.code(), what);
                return 0;
            }
        };
        let n = plan.jobs.len();
        x.gen_src = x.gen_src.wrapping_add(plan.src_used);
        x.gen_sink = x.gen_sink.wrapping_add(plan.sink_used);
        x.outstanding += n;
        x.stats.jobs += n as u64;
        x.stats.in_place += plan.in_place as u64;
        self.stats.jobs += n as u64;
        // The clock runs to the dispatch of the first job the signal made.
        let mut hi = x.signalled.take().map(|t| {
            let s = self.disp.stats();
            let depth = s.enqueued.saturating_sub(s.dispatched + s.cancelled);
            self.lat.depth.add(depth);
            (t, s.dispatched)
        });
        let pipe_class = match x.spec.xf {
            Xf::Encrypt | Xf::Decrypt => Class::Crypto,
            Xf::Copy | Xf::Direct => Class::Copy,
        };
        for j in plan.jobs {
            let desc = j.desc(&src.view, &sink.view, x.spec.key_slot);
            let ord = x.first_ord + x.pending.len() as u64;
            x.pending.push_back(Pending {
                done: false,
                src_adv: j.src_adv,
                sink_adv: j.sink_adv,
            });
            let job = Queued {
                // Padding and skips are bookkeeping of this pipe's own stream:
                // they run in its class, not as copies competing elsewhere.
                class: match j.op {
                    Op::Pad | Op::Skip => pipe_class,
                    op => op.class(),
                },
                cost: desc.cost(),
                barrier: j.barrier,
                payload: JobEnv {
                    desc,
                    ord,
                    hi: hi.take(),
                },
            };
            self.disp.submit(p, x.spec.tenant, x.spec.prio, job);
        }
        n
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
