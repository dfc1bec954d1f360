//! The engine's rings and pipes: adding them (checking ends and chains),
//! failing, closing and removing them.

use super::*;

impl Engine {
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

    pub(super) fn remove_pipe(&mut self, p: PipeKey) {
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
}
