//! The jobs' way back: workers hand completions to the polling thread
//! ([`Completions`]), which retires them in job order and publishes the
//! pipe's pointers ([`Engine::publish`]), and job generation from a pipe's
//! rings into the scheduler ([`Engine::generate`]).

use super::*;

#[derive(Debug)]
pub(super) struct Completion {
    pub(super) pipe: PipeKey,
    pub(super) ord: u64,
    pub(super) result: Result<(), ExecError>,
}

/// Completed jobs, handed from the workers to the polling thread. The
/// eventfd lets a daemon's event loop wait for them with its other fds.
#[derive(Debug)]
pub struct Completions {
    q: Mutex<Vec<Completion>>,
    cv: Condvar,
    efd: EventFd,
}

impl Completions {
    pub(super) fn new() -> std::io::Result<Completions> {
        Ok(Completions {
            q: Mutex::new(Vec::new()),
            cv: Condvar::new(),
            efd: EventFd::new(EFD_NONBLOCK)?,
        })
    }

    pub(super) fn push(&self, c: Completion) {
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

    pub(super) fn drain(&self) -> Vec<Completion> {
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

impl Engine {
    pub(super) fn complete(&mut self, c: Completion) {
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
    pub(super) fn publish(&mut self, p: PipeKey) {
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
    pub(super) fn generate(&mut self, p: PipeKey) -> usize {
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
            view.read(ptr, &mut h).map(|_| h)
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
