//! Driving the engine from the signal plane: external pointer moves, the
//! dirty list, job generation and dispatch, inline runs, completions
//! published in job order, events and statistics.

use super::*;

impl Engine {
    pub(super) fn mark(&mut self, p: PipeKey) {
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
