//! The strategies of the first table over one source and one sink ring:
//! `raw` (the executor on a contiguous buffer), `recursive` and `bounce`
//! (`Stream`), and `engine` (the whole engine, inline).

use super::*;

/// A source ring streaming into a sink ring under one strategy.
struct Stream {
    src: RingView,
    sink: RingView,
    xf: Xf,
    bounce: bool,
    max_job: u32,
    seq: u64,
    src_head: u32,
    src_tail: u32,
    sink_head: u32,
    jobs: u64,
    extra: u64,
    scratch: (u64, u64),
}

impl Stream {
    fn new(
        b: &Bench,
        src: RingView,
        sink: RingView,
        xf: Xf,
        bounce: bool,
        max_job: u32,
    ) -> Result<Stream, JobgenBenchError> {
        let sc = 2 * max_job.next_power_of_two().max(4096);
        Ok(Stream {
            src,
            sink,
            xf,
            bounce,
            max_job,
            seq: 0,
            src_head: START,
            src_tail: START,
            sink_head: START,
            jobs: 0,
            extra: 0,
            scratch: (b.block(sc)?, b.block(sc)?),
        })
    }

    /// Processes everything published in the source; the sink is drained
    /// at once (its consumer is infinitely fast).
    fn run(&mut self, b: &Bench) -> Result<(), JobgenBenchError> {
        if self.bounce {
            return self.run_bounce(b);
        }
        loop {
            let src = Span::new(
                RING,
                self.src_tail,
                self.src_head.wrapping_sub(self.src_tail),
            );
            let sink = Span::new(RING, self.sink_head, RING);
            let p = Params {
                xf: self.xf,
                max_job: self.max_job,
                max_jobs: 128,
            };
            let view = &self.src;
            let plan = generate(src, sink, &p, &mut self.seq, &mut |ptr| {
                let mut h = [0u8; 16];
                view.read(ptr, &mut h).map(|_| h)
            })?;
            for j in &plan.jobs {
                execute(&j.desc(&self.src, &self.sink, b.slot), &b.keys)?;
            }
            self.jobs += plan.jobs.len() as u64;
            self.src_tail = self.src_tail.wrapping_add(plan.src_used);
            self.sink_head = self.sink_head.wrapping_add(plan.sink_used);
            if plan.jobs.len() < p.max_jobs {
                return Ok(());
            }
        }
    }

    /// A range of a ring, as one buffer, or None if it wraps.
    fn contiguous(v: &RingView, ptr: u32, len: u32) -> Option<u64> {
        (v.geom.to_end(ptr) >= len).then(|| v.geom.base + v.geom.off(ptr) as u64)
    }

    /// Copies `[ptr, ptr+len)` of ring `v` to or from a contiguous buffer (two jobs).
    fn bounce_copy(
        &mut self,
        b: &Bench,
        v: &RingView,
        ptr: u32,
        len: u32,
        buf: u64,
        into_ring: bool,
    ) -> Result<(), JobgenBenchError> {
        for (i, (addr, n)) in v.ranges(ptr, len).into_iter().enumerate() {
            if n == 0 {
                continue;
            }
            let at = buf + if i == 0 { 0 } else { (len - n) as u64 };
            let (s, d) = if into_ring { (at, addr) } else { (addr, at) };
            execute(&b.job(Op::Copy, b.buf(s, n), b.buf(d, n), 0), &b.keys)?;
            self.jobs += 1;
        }
        self.extra += len as u64;
        Ok(())
    }

    fn run_bounce(&mut self, b: &Bench) -> Result<(), JobgenBenchError> {
        while self.src_head != self.src_tail {
            let avail = self.src_head.wrapping_sub(self.src_tail);
            let (op, inlen, outlen, seq) = match self.xf {
                Xf::Copy | Xf::Direct => {
                    let n = avail.min(self.max_job);
                    (Op::Copy, n, n, 0)
                }
                Xf::Encrypt => {
                    let n = avail.min(self.max_job);
                    (Op::Encrypt, n, crypto::data_record_len(n), self.seq)
                }
                Xf::Decrypt => {
                    let mut h = [0u8; 16];
                    self.src.read(self.src_tail, &mut h)?;
                    let h = RecordHeader::decode(&h);
                    (Op::Decrypt, crypto::data_record_len(h.len), h.len, h.seq)
                }
            };
            let input = match Self::contiguous(&self.src, self.src_tail, inlen) {
                Some(a) => a,
                None => {
                    let (v, t, a) = (self.src.clone(), self.src_tail, self.scratch.0);
                    self.bounce_copy(b, &v, t, inlen, a, false)?;
                    a
                }
            };
            let direct = Self::contiguous(&self.sink, self.sink_head, outlen);
            let output = direct.unwrap_or(self.scratch.1);
            execute(
                &b.job(op, b.buf(input, inlen), b.buf(output, outlen), seq),
                &b.keys,
            )?;
            self.jobs += 1;
            if direct.is_none() {
                let (v, h) = (self.sink.clone(), self.sink_head);
                self.bounce_copy(b, &v, h, outlen, output, true)?;
            }
            if op != Op::Copy {
                self.seq += 1;
            }
            self.src_tail = self.src_tail.wrapping_add(inlen);
            self.sink_head = self.sink_head.wrapping_add(outlen);
        }
        Ok(())
    }
}

/// The executor alone: one job per message, messages laid out one after
/// another in a contiguous buffer as large as the rings (so caches favour
/// it no more than the ring strategies), starting over at its end.
pub(super) fn raw(b: &Bench, xf: Xf, msg: u32, count: u64) -> Result<(f64, f64), JobgenBenchError> {
    let rec = crypto::data_record_len(msg);
    let (x, y) = (b.block(RING)?, b.block(RING)?);
    let per = RING / rec;
    let job = |i: u64| -> JobDesc {
        let (xi, yi) = (
            x + (i % per as u64) * rec as u64,
            y + (i % per as u64) * rec as u64,
        );
        match xf {
            Xf::Copy | Xf::Direct => b.job(Op::Copy, b.buf(xi, msg), b.buf(yi, msg), 0),
            Xf::Encrypt => b.job(Op::Encrypt, b.buf(xi, msg), b.buf(yi, rec), i),
            Xf::Decrypt => b.job(Op::Decrypt, b.buf(xi, rec), b.buf(yi, msg), i % per as u64),
        }
    };
    if xf == Xf::Decrypt {
        // The records, made once; decrypting them again verifies them again.
        for i in 0..per as u64 {
            let at = i * rec as u64;
            execute(
                &b.job(Op::Encrypt, b.buf(y + at, msg), b.buf(x + at, rec), i),
                &b.keys,
            )?;
        }
    }
    let jobs: Vec<JobDesc> = (0..count.min(per as u64)).map(job).collect();
    let t = Instant::now();
    for i in 0..count {
        let j = &jobs[(i % jobs.len() as u64) as usize];
        execute(j, &b.keys)?;
    }
    Ok((t.elapsed().as_secs_f64(), 1.0))
}

/// Streams `count` messages; returns (timed seconds, jobs/msg, extra bytes/msg).
pub(super) fn stream(
    b: &Bench,
    xf: Xf,
    msg: u32,
    count: u64,
    bounce: bool,
    max_job: u32,
) -> Result<(f64, f64, f64), JobgenBenchError> {
    let mut timed = Duration::ZERO;
    if xf != Xf::Decrypt {
        let mut s = Stream::new(b, b.ring()?, b.ring()?, xf, bounce, max_job)?;
        let t = Instant::now();
        for _ in 0..count {
            s.src_head = s.src_head.wrapping_add(msg);
            s.run(b)?;
        }
        timed += t.elapsed();
        return Ok((
            timed.as_secs_f64(),
            s.jobs as f64 / count as f64,
            s.extra as f64 / count as f64,
        ));
    }
    // Decrypt: an encrypting stream of the same strategy feeds the records.
    let mid = b.ring()?;
    let mut e = Stream::new(b, b.ring()?, mid.clone(), Xf::Encrypt, bounce, max_job)?;
    let mut d = Stream::new(b, mid, b.ring()?, Xf::Decrypt, bounce, max_job)?;
    for _ in 0..count {
        e.src_head = e.src_head.wrapping_add(msg);
        e.run(b)?;
        d.src_head = e.sink_head;
        let t = Instant::now();
        d.run(b)?;
        timed += t.elapsed();
    }
    Ok((
        timed.as_secs_f64(),
        d.jobs as f64 / count as f64,
        d.extra as f64 / count as f64,
    ))
}

fn inline_engine(b: &Bench, max_job: u32) -> Result<Engine, JobgenBenchError> {
    Ok(Engine::new(
        EngineConfig {
            workers: 0,
            max_job,
            ..Default::default()
        },
        b.keys.clone(),
    )?)
}

fn add_pipe(
    eng: &mut Engine,
    b: &Bench,
    src: RingKey,
    sink: RingKey,
    xf: Xf,
) -> Result<(), JobgenBenchError> {
    eng.add_pipe(PipeSpec {
        src,
        sink,
        xf,
        tenant: 1,
        prio: 0,
        key_slot: b.slot,
        max_job: None,
        label: format!("bench {}", xf.name()),
        tag: 0,
    })?;
    Ok(())
}

/// Moves a fresh engine's rings to `START` (pointers start at 0).
fn prime(eng: &mut Engine, src: RingKey, sink: RingKey) -> Result<(), JobgenBenchError> {
    eng.external_head(src, START)?;
    eng.run_inline();
    let h = eng.ring_ptrs(sink).map_or(0, |p| p.head);
    eng.external_tail(sink, h)?;
    Ok(())
}

/// `recursive` through the whole engine.
pub(super) fn engine(
    b: &Bench,
    xf: Xf,
    msg: u32,
    count: u64,
    max_job: u32,
) -> Result<(f64, f64, f64), JobgenBenchError> {
    let mut timed = Duration::ZERO;
    if xf != Xf::Decrypt {
        let mut eng = inline_engine(b, max_job)?;
        let (src, sink) = (
            eng.add_ring(b.ring()?, "src".into(), 0),
            eng.add_ring(b.ring()?, "sink".into(), 1),
        );
        add_pipe(&mut eng, b, src, sink, xf)?;
        prime(&mut eng, src, sink)?;
        let jobs0 = eng.stats().jobs;
        return engine_loop(&mut eng, src, sink, msg, count, jobs0);
    }
    // Two engines share the record ring: only the decrypting one is timed.
    let mid = b.ring()?;
    let mut enc = inline_engine(b, max_job)?;
    let (p, s) = (
        enc.add_ring(b.ring()?, "plain".into(), 0),
        enc.add_ring(mid.clone(), "records".into(), 1),
    );
    add_pipe(&mut enc, b, p, s, Xf::Encrypt)?;
    let mut dec = inline_engine(b, max_job)?;
    let (s2, k) = (
        dec.add_ring(mid, "records".into(), 0),
        dec.add_ring(b.ring()?, "out".into(), 1),
    );
    add_pipe(&mut dec, b, s2, k, Xf::Decrypt)?;
    for _ in 0..count {
        let h = enc.ring_ptrs(p).map_or(0, |x| x.head);
        enc.external_head(p, h.wrapping_add(msg))?;
        enc.run_inline();
        enc.take_events();
        let sh = enc.ring_ptrs(s).map_or(0, |x| x.head);
        let t = Instant::now();
        dec.external_head(s2, sh)?;
        dec.run_inline();
        let kh = dec.ring_ptrs(k).map_or(0, |x| x.head);
        dec.external_tail(k, kh)?;
        dec.take_events();
        timed += t.elapsed();
        let st = dec.ring_ptrs(s2).map_or(0, |x| x.tail);
        enc.external_tail(s, st)?;
    }
    Ok((
        timed.as_secs_f64(),
        dec.stats().jobs as f64 / count as f64,
        0.0,
    ))
}

fn engine_loop(
    eng: &mut Engine,
    src: RingKey,
    sink: RingKey,
    msg: u32,
    count: u64,
    jobs0: u64,
) -> Result<(f64, f64, f64), JobgenBenchError> {
    let t = Instant::now();
    for _ in 0..count {
        let h = eng.ring_ptrs(src).map_or(0, |x| x.head);
        eng.external_head(src, h.wrapping_add(msg))?;
        eng.run_inline();
        let kh = eng.ring_ptrs(sink).map_or(0, |x| x.head);
        eng.external_tail(sink, kh)?;
        eng.take_events();
    }
    let secs = t.elapsed().as_secs_f64();
    Ok((secs, (eng.stats().jobs - jobs0) as f64 / count as f64, 0.0))
}
