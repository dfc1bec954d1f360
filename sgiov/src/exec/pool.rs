//! The dispatcher (scheduler + capacity limits behind one lock) and the
//! worker pool: a fixed number of threads that take jobs in policy order and
//! run them. Threads do not depend on the number of pipes.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::exec::capacity::{Capacities, TokenBucket};
use crate::job::CLASSES;
use crate::sched::{PipeKey, Queued, SchedConfig, SchedStats, Scheduler, TenantId};

#[derive(Debug)]
struct State<T> {
    sched: Scheduler<T>,
    buckets: Vec<TokenBucket>,
    stop: bool,
}

/// Shared by the submitter (the signal plane) and the workers.
#[derive(Debug)]
pub struct Dispatcher<T> {
    state: Mutex<State<T>>,
    cv: Condvar,
}

impl<T> Dispatcher<T> {
    pub fn new(cfg: SchedConfig, caps: Capacities) -> Self {
        let now = Instant::now();
        Dispatcher {
            state: Mutex::new(State {
                sched: Scheduler::new(cfg),
                buckets: CLASSES
                    .iter()
                    .map(|c| TokenBucket::new(caps.get(*c), now))
                    .collect(),
                stop: false,
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn submit(&self, pipe: PipeKey, tenant: TenantId, prio: u8, job: Queued<T>) {
        self.lock().sched.enqueue(pipe, tenant, prio, job);
        self.cv.notify_one();
    }

    /// The next job whose class has capacity now, or None.
    pub fn try_take(&self) -> Option<(PipeKey, Queued<T>)> {
        Self::pick(&mut self.lock()).ok()
    }

    /// Err: how long until a throttled class with ready jobs may run (None:
    /// nothing is ready at all).
    fn pick(st: &mut State<T>) -> Result<(PipeKey, Queued<T>), Option<Duration>> {
        let now = Instant::now();
        let mut mask = 0;
        let mut wait: Option<Duration> = None;
        for c in CLASSES {
            if st.sched.has_ready(c) {
                if st.buckets[c.index()].ready(now) {
                    mask |= 1 << c.index();
                } else {
                    let w = st.buckets[c.index()].wait();
                    wait = Some(wait.map_or(w, |x| x.min(w)));
                }
            }
        }
        if mask != 0 {
            if let Some((p, j)) = st.sched.next(mask) {
                st.buckets[j.class.index()].take(j.cost);
                return Ok((p, j));
            }
        }
        Err(wait)
    }

    /// Blocks until a job may run; None once stopped.
    pub fn take(&self) -> Option<(PipeKey, Queued<T>)> {
        let mut st = self.lock();
        loop {
            if st.stop {
                return None;
            }
            match Self::pick(&mut st) {
                Ok(j) => return Some(j),
                Err(Some(d)) => {
                    st = self
                        .cv
                        .wait_timeout(st, d.max(Duration::from_micros(20)))
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                Err(None) => st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
            }
        }
    }

    /// A job taken with `take`/`try_take` finished.
    pub fn done(&self, pipe: PipeKey, barrier: bool) {
        self.lock().sched.complete(pipe, barrier);
        self.cv.notify_one();
    }

    /// Drops a pipe's queue; returns the jobs that never ran.
    pub fn cancel(&self, pipe: PipeKey) -> Vec<T> {
        self.lock().sched.remove_pipe(pipe)
    }

    pub fn queued(&self, pipe: PipeKey) -> usize {
        self.lock().sched.queued(pipe)
    }

    pub fn stats(&self) -> SchedStats {
        self.lock().sched.stats()
    }

    /// New policy and capacities (the token buckets start empty).
    pub fn reconfigure(&self, cfg: SchedConfig, caps: Capacities) {
        let now = Instant::now();
        let mut st = self.lock();
        st.sched.reconfigure(cfg);
        st.buckets = CLASSES
            .iter()
            .map(|c| TokenBucket::new(caps.get(*c), now))
            .collect();
        drop(st);
        self.cv.notify_all();
    }

    pub fn stop(&self) {
        self.lock().stop = true;
        self.cv.notify_all();
    }
}

/// Worker threads running `work` on every job they take.
pub struct WorkerPool {
    threads: Vec<JoinHandle<()>>,
    stop: Box<dyn Fn() + Send + Sync>,
}

pub type Work<T> = Arc<dyn Fn(PipeKey, Queued<T>) + Send + Sync>;

impl std::fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerPool")
            .field("threads", &self.threads.len())
            .finish_non_exhaustive()
    }
}

impl WorkerPool {
    pub fn start<T: Send + 'static>(
        name: &str,
        n: usize,
        disp: Arc<Dispatcher<T>>,
        work: Work<T>,
    ) -> std::io::Result<WorkerPool> {
        let mut threads = Vec::with_capacity(n);
        for i in 0..n {
            let (d, w) = (disp.clone(), work.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("{name}-{i}"))
                    .spawn(move || {
                        while let Some((pipe, job)) = d.take() {
                            let barrier = job.barrier;
                            w(pipe, job);
                            d.done(pipe, barrier);
                        }
                    })?,
            );
        }
        Ok(WorkerPool {
            threads,
            stop: Box::new(move || disp.stop()),
        })
    }

    pub fn len(&self) -> usize {
        self.threads.len()
    }

    pub fn is_empty(&self) -> bool {
        self.threads.is_empty()
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        (self.stop)();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::Class;
    use crate::sched::Policy;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn pool_runs_every_job_and_respects_capacity() {
        let d = Arc::new(Dispatcher::new(
            SchedConfig {
                policy: Policy::RoundRobin,
                ..Default::default()
            },
            "copy=20M".parse().unwrap(),
        ));
        let sum = Arc::new(AtomicU64::new(0));
        let s = sum.clone();
        let pool = WorkerPool::start(
            "t-pool",
            2,
            d.clone(),
            Arc::new(move |_, j: Queued<u64>| {
                s.fetch_add(j.payload, Ordering::SeqCst);
            }),
        )
        .unwrap();
        let t0 = Instant::now();
        // 2 MB at 20 MB/s: about 100 ms, never much less.
        for i in 0..32u64 {
            d.submit(
                (i % 4) as u32,
                1,
                0,
                Queued {
                    class: Class::Copy,
                    cost: 62_500,
                    barrier: false,
                    payload: 1,
                },
            );
        }
        while sum.load(Ordering::SeqCst) < 32 {
            std::thread::sleep(Duration::from_millis(2));
            assert!(t0.elapsed() < Duration::from_secs(10));
        }
        assert!(
            t0.elapsed() >= Duration::from_millis(80),
            "capacity not enforced"
        );
        drop(pool);
        assert_eq!(d.stats().dispatched, 32);
    }
}
