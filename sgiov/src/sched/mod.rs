//! Job queues and the scheduler (SG-IOV §6.1, §A.3).
//!
//! Each pipe gets a FIFO job queue the first time it enqueues a job. Only
//! pipes that can run a job now are on an *active list*: one list per
//! executor class (the class of the pipe's next job), inside which the
//! policy orders them:
//!
//! - `rr`: one bucket; pipes take turns, one job per turn.
//! - `prio`: one bucket per priority level (0 = highest, [`PRIO_LEVELS`]
//!   levels); the highest non-empty level runs, round-robin inside it; a
//!   lower level runs whenever no higher one is ready (work-conserving).
//! - `drf`: one bucket per tenant, keyed by the tenant's dominant share
//!   (its usage of each class divided by the class's capacity, the largest
//!   of these); the tenant with the smallest share runs. Under equal
//!   bandwidth demand this converges to the closed form of §A.3, and where
//!   that leaves capacity idle (a tenant limited elsewhere), the next
//!   tenant runs instead: progressive filling ([`drf`] computes both).
//!
//! A dequeue looks only at the head of each class's first bucket, so its
//! cost does not grow with the number of idle or backlogged pipes. The
//! policy is data ([`Policy`], parsed from one flag or control field).

pub mod drf;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::str::FromStr;

use crate::job::{Class, CLASSES, NCLASSES};

pub type PipeKey = u32;
pub type TenantId = u32;

/// Priority levels (0 = highest).
pub const PRIO_LEVELS: u8 = 8;

/// A scheduling policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Policy {
    RoundRobin,
    Priority,
    Drf,
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "rr" | "round-robin" => Ok(Policy::RoundRobin),
            "prio" | "priority" => Ok(Policy::Priority),
            "drf" => Ok(Policy::Drf),
            _ => Err(format!("unknown scheduling policy {s:?} (rr, prio, drf)")),
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Policy::RoundRobin => "rr",
            Policy::Priority => "prio",
            Policy::Drf => "drf",
        })
    }
}

/// A job as the scheduler sees it: its class, its cost and whether it is a
/// barrier; the payload is opaque.
#[derive(Debug)]
pub struct Queued<T> {
    pub class: Class,
    pub cost: u64,
    pub barrier: bool,
    pub payload: T,
}

#[derive(Debug, Clone, Copy)]
pub struct SchedConfig {
    pub policy: Policy,
    /// Capacity of each class (bytes/s) that normalizes DRF shares: the
    /// configured limit, or a nominal figure for an unlimited class.
    pub nominal: [f64; NCLASSES],
    /// Jobs of one pipe that may run at once (they complete in any order;
    /// the pipe publishes in job order).
    pub max_inflight: u32,
}

impl Default for SchedConfig {
    fn default() -> Self {
        SchedConfig {
            policy: Policy::RoundRobin,
            nominal: [1e9, 1e9],
            max_inflight: 4,
        }
    }
}

#[derive(Debug)]
struct PipeQ<T> {
    tenant: TenantId,
    prio: u8,
    jobs: VecDeque<Queued<T>>,
    inflight: u32,
    barrier_inflight: bool,
    /// On an active list (of the class of its head job).
    listed: bool,
    dead: bool,
}

/// Bucket key inside a class: (primary, tenant). RR: (0, 0); priority:
/// (level, 0); DRF: (share as ordered bits, tenant).
type Key = (u64, TenantId);

#[derive(Debug, Default)]
struct ClassQ {
    buckets: BTreeMap<Key, VecDeque<(u64, PipeKey)>>,
}

#[derive(Debug, Default, Clone)]
struct Tenant {
    usage: [f64; NCLASSES],
    /// Pipes of this tenant with jobs queued or running.
    active: u32,
}

/// Most credit (seconds of a class's capacity) a tenant keeps from idling.
pub const DRF_CREDIT: f64 = 0.01;

/// Counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SchedStats {
    pub enqueued: u64,
    pub dispatched: u64,
    pub cancelled: u64,
    pub queues: usize,
}

/// The scheduler: pure data structure, no threads, no clock.
#[derive(Debug)]
pub struct Scheduler<T> {
    cfg: SchedConfig,
    pipes: HashMap<PipeKey, PipeQ<T>>,
    classes: [ClassQ; NCLASSES],
    tenants: HashMap<TenantId, Tenant>,
    stamp: u64,
    stats: SchedStats,
}

fn share_bits(s: f64) -> u64 {
    // Non-negative floats order like their bit patterns.
    s.max(0.0).to_bits()
}

impl<T> Scheduler<T> {
    pub fn new(cfg: SchedConfig) -> Self {
        Scheduler {
            cfg,
            pipes: HashMap::new(),
            classes: Default::default(),
            tenants: HashMap::new(),
            stamp: 0,
            stats: SchedStats::default(),
        }
    }

    pub fn policy(&self) -> Policy {
        self.cfg.policy
    }

    /// A tenant's dominant share: max over classes of usage / capacity.
    pub fn share(&self, t: TenantId) -> f64 {
        self.tenants.get(&t).map_or(0.0, |x| self.dominant(x))
    }

    fn dominant(&self, t: &Tenant) -> f64 {
        (0..NCLASSES)
            .map(|j| t.usage[j] / self.cfg.nominal[j])
            .fold(0.0, f64::max)
    }

    fn key(&self, p: &PipeQ<T>) -> Key {
        match self.cfg.policy {
            Policy::RoundRobin => (0, 0),
            Policy::Priority => (p.prio.min(PRIO_LEVELS - 1) as u64, 0),
            Policy::Drf => (share_bits(self.share(p.tenant)), p.tenant),
        }
    }

    fn ready(&self, p: &PipeQ<T>) -> bool {
        match p.jobs.front() {
            None => false,
            Some(j) => {
                !(p.dead
                    || p.barrier_inflight
                    || p.inflight >= self.cfg.max_inflight
                    || j.barrier && p.inflight > 0)
            }
        }
    }

    /// Puts the pipe on the active list of its head job's class, if it can run.
    fn list(&mut self, pipe: PipeKey) {
        let Some(p) = self.pipes.get(&pipe) else {
            return;
        };
        if p.listed || !self.ready(p) {
            return;
        }
        let class = p.jobs.front().map_or(Class::Copy, |j| j.class);
        let key = self.key(p);
        self.stamp += 1;
        let stamp = self.stamp;
        self.classes[class.index()]
            .buckets
            .entry(key)
            .or_default()
            .push_back((stamp, pipe));
        if let Some(p) = self.pipes.get_mut(&pipe) {
            p.listed = true;
        }
    }

    /// Enqueues a job on `pipe`'s queue (created on first use).
    pub fn enqueue(&mut self, pipe: PipeKey, tenant: TenantId, prio: u8, job: Queued<T>) {
        self.stats.enqueued += 1;
        let p = self.pipes.entry(pipe).or_insert_with(|| PipeQ {
            tenant,
            prio,
            jobs: VecDeque::new(),
            inflight: 0,
            barrier_inflight: false,
            listed: false,
            dead: false,
        });
        let was_idle = p.jobs.is_empty() && p.inflight == 0;
        p.jobs.push_back(job);
        if was_idle {
            self.tenant_active(tenant, true);
        }
        self.list(pipe);
    }

    /// DRF bookkeeping. A tenant is active while one of its pipes has a job
    /// queued or running. One that becomes active after idling brings at
    /// most [`DRF_CREDIT`] of credit from its idle time: its usage is lifted
    /// so that its share is no lower than the smallest share of the active
    /// tenants minus that credit. (A short gap between one job's completion
    /// and the next job's arrival keeps its deficit.)
    fn tenant_active(&mut self, tenant: TenantId, more: bool) {
        let floor = self
            .tenants
            .iter()
            .filter(|(id, t)| **id != tenant && t.active > 0)
            .map(|(_, t)| self.dominant(t))
            .fold(f64::INFINITY, f64::min)
            - DRF_CREDIT;
        let nominal = self.cfg.nominal;
        let t = self.tenants.entry(tenant).or_default();
        if more {
            if t.active == 0 && floor.is_finite() {
                let dom = (0..NCLASSES)
                    .map(|j| t.usage[j] / nominal[j])
                    .fold(0.0, f64::max);
                if dom < floor {
                    for (j, u) in t.usage.iter_mut().enumerate() {
                        *u += (floor - dom) * nominal[j];
                    }
                }
            }
            t.active += 1;
        } else {
            t.active = t.active.saturating_sub(1);
        }
    }

    /// Whether a job of `class` could be dispatched now.
    pub fn has_ready(&self, class: Class) -> bool {
        !self.classes[class.index()].buckets.is_empty()
    }

    /// Dispatches the next job among the classes in `allowed` (bit i =
    /// class i), by policy. The job counts as running until [`complete`].
    ///
    /// [`complete`]: Scheduler::complete
    pub fn next(&mut self, allowed: u32) -> Option<(PipeKey, Queued<T>)> {
        // The best head across allowed classes: by bucket key, then by stamp
        // (the order pipes became ready: round-robin).
        let mut best: Option<(Key, u64, usize)> = None;
        for c in CLASSES {
            if allowed & (1 << c.index()) == 0 {
                continue;
            }
            if let Some((k, q)) = self.classes[c.index()].buckets.iter().next() {
                let stamp = q.front().map_or(u64::MAX, |e| e.0);
                let cand = (*k, stamp, c.index());
                let better = match best {
                    None => true,
                    Some((bk, bs, _)) => match self.cfg.policy {
                        Policy::RoundRobin => stamp < bs,
                        _ => (k.0, stamp) < (bk.0, bs),
                    },
                };
                if better {
                    best = Some(cand);
                }
            }
        }
        let (key, _, ci) = best?;
        let cq = &mut self.classes[ci];
        let bucket = cq.buckets.get_mut(&key)?;
        let (_, pipe) = bucket.pop_front()?;
        if bucket.is_empty() {
            cq.buckets.remove(&key);
        }
        let p = self.pipes.get_mut(&pipe)?;
        p.listed = false;
        let job = p.jobs.pop_front()?;
        p.inflight += 1;
        if job.barrier {
            p.barrier_inflight = true;
        }
        let tenant = p.tenant;
        self.stats.dispatched += 1;
        if self.cfg.policy == Policy::Drf {
            self.charge(tenant, job.class, job.cost);
        }
        self.list(pipe);
        Some((pipe, job))
    }

    /// Adds a job's cost to its tenant's usage and moves the tenant's
    /// buckets to their new place in share order.
    fn charge(&mut self, tenant: TenantId, class: Class, cost: u64) {
        let old = share_bits(self.share(tenant));
        self.tenants.entry(tenant).or_default().usage[class.index()] += cost as f64;
        let new = share_bits(self.share(tenant));
        if old == new {
            return;
        }
        for cq in &mut self.classes {
            if let Some(mut q) = cq.buckets.remove(&(old, tenant)) {
                // Merge with a bucket that may already sit at the new key.
                let dst = cq.buckets.entry((new, tenant)).or_default();
                dst.append(&mut q);
                dst.make_contiguous().sort_unstable();
            }
        }
    }

    /// A dispatched job of `pipe` finished.
    pub fn complete(&mut self, pipe: PipeKey, barrier: bool) {
        let (remove, idle, tenant) = match self.pipes.get_mut(&pipe) {
            None => return,
            Some(p) => {
                p.inflight = p.inflight.saturating_sub(1);
                if barrier {
                    p.barrier_inflight = false;
                }
                (
                    p.dead && p.inflight == 0,
                    p.inflight == 0 && p.jobs.is_empty(),
                    p.tenant,
                )
            }
        };
        if idle {
            self.tenant_active(tenant, false);
        }
        if remove {
            self.pipes.remove(&pipe);
        } else {
            self.list(pipe);
        }
    }

    /// Drops a pipe's queue; returns its queued (never dispatched) jobs.
    /// Running jobs still complete; the queue goes away with the last.
    pub fn remove_pipe(&mut self, pipe: PipeKey) -> Vec<T> {
        let Some(p) = self.pipes.get_mut(&pipe) else {
            return Vec::new();
        };
        let jobs: Vec<T> = p.jobs.drain(..).map(|j| j.payload).collect();
        let (tenant, listed, inflight) = (p.tenant, p.listed, p.inflight);
        p.dead = true;
        if !jobs.is_empty() && inflight == 0 {
            self.tenant_active(tenant, false);
        }
        if listed {
            for cq in &mut self.classes {
                cq.buckets.retain(|_, q| {
                    q.retain(|e| e.1 != pipe);
                    !q.is_empty()
                });
            }
        }
        if inflight == 0 {
            self.pipes.remove(&pipe);
        }
        self.stats.cancelled += jobs.len() as u64;
        jobs
    }

    /// Switches policy and capacities at run time (control API): every
    /// runnable pipe is listed again under the new keys, in its old order
    /// of becoming ready. Queues, jobs in flight and DRF usage stay.
    pub fn reconfigure(&mut self, cfg: SchedConfig) {
        self.cfg = cfg;
        let mut listed: Vec<(u64, PipeKey)> = Vec::new();
        for cq in &mut self.classes {
            for (_, q) in std::mem::take(&mut cq.buckets) {
                listed.extend(q);
            }
        }
        listed.sort_unstable();
        for &(_, pipe) in &listed {
            if let Some(p) = self.pipes.get_mut(&pipe) {
                p.listed = false;
            }
        }
        for (_, pipe) in listed {
            self.list(pipe);
        }
    }

    /// Jobs queued on a pipe (not running).
    pub fn queued(&self, pipe: PipeKey) -> usize {
        self.pipes.get(&pipe).map_or(0, |p| p.jobs.len())
    }

    pub fn inflight(&self, pipe: PipeKey) -> u32 {
        self.pipes.get(&pipe).map_or(0, |p| p.inflight)
    }

    /// Pipes currently on an active list (backlogged and runnable).
    pub fn active(&self) -> usize {
        self.classes
            .iter()
            .map(|c| c.buckets.values().map(|q| q.len()).sum::<usize>())
            .sum()
    }

    pub fn stats(&self) -> SchedStats {
        SchedStats {
            queues: self.pipes.len(),
            ..self.stats
        }
    }
}

#[cfg(test)]
mod tests;
