//! The second table: latency of a high-priority pipe's 4 KiB messages while
//! a low-priority pipe keeps one worker busy with large jobs, with and
//! without a maximum job size.

use super::*;

/// The second table's row: latency of a high-priority pipe.
#[derive(Debug, Clone)]
pub struct LatencyRow {
    pub max_job: Option<u32>,
    pub p50_us: f64,
    pub p99_us: f64,
    pub low_mib_s: f64,
    /// Low-priority bytes the worker finished by the end of the run, the
    /// ones still queued when the last ping returned included (on a loaded
    /// host the worker may not have been scheduled inside the window).
    pub low_bytes: u64,
}

/// A low-priority copy pipe kept backlogged with 1 MiB messages and a
/// high-priority pipe sending 4 KiB messages one at a time, on one worker.
pub fn latency(max_job: Option<u32>, pings: usize) -> Result<LatencyRow, JobgenBenchError> {
    let b = Bench::new()?;
    let mut eng = Engine::new(
        EngineConfig {
            sched: SchedConfig {
                policy: Policy::Priority,
                ..Default::default()
            },
            workers: 1,
            max_job: max_job.unwrap_or(u32::MAX),
            max_queued: 4,
            ..Default::default()
        },
        b.keys.clone(),
    )?;
    let ring = |eng: &mut Engine, l: &str| -> Result<RingKey, JobgenBenchError> {
        Ok(eng.add_ring(b.ring()?, l.into(), 0))
    };
    let (ls, lk, hs, hk) = (
        ring(&mut eng, "low src")?,
        ring(&mut eng, "low sink")?,
        ring(&mut eng, "high src")?,
        ring(&mut eng, "high sink")?,
    );
    let mut pipes = Vec::new();
    for (s, k, prio, label) in [(ls, lk, 7, "low"), (hs, hk, 0, "high")] {
        pipes.push(eng.add_pipe(PipeSpec {
            src: s,
            sink: k,
            xf: Xf::Copy,
            tenant: prio as u32,
            prio,
            key_slot: 0,
            max_job: None,
            label: label.into(),
            tag: prio as u64,
        })?);
    }
    let low_pipe = pipes[0];
    let mut lat = Vec::with_capacity(pings);
    let low0 = eng.pipe_stats(low_pipe).map_or(0, |s| s.src_bytes);
    let t0 = Instant::now();
    for i in 0..pings + 20 {
        // Keep the low pipe backlogged with 1 MiB messages.
        let feed = |eng: &mut Engine| -> Result<(), EngineError> {
            let p = eng
                .ring_ptrs(ls)
                .unwrap_or(sgiov::ring::RingPtrs::new(RING));
            if p.free() >= 1 << 20 {
                eng.external_head(ls, p.head.wrapping_add(p.free() & !((1 << 20) - 1)))?;
            }
            let k = eng
                .ring_ptrs(lk)
                .unwrap_or(sgiov::ring::RingPtrs::new(RING));
            if k.used() > 0 {
                eng.external_tail(lk, k.head)?;
            }
            Ok(())
        };
        feed(&mut eng)?;
        eng.poll();
        let h = eng.ring_ptrs(hs).map_or(0, |x| x.head);
        let start = Instant::now();
        eng.external_head(hs, h.wrapping_add(4096))?;
        let mut done = false;
        while !done {
            eng.poll();
            for ev in eng.take_events() {
                if let Event::Head { ring, head, .. } = ev {
                    if ring == hk {
                        done = true;
                        eng.external_tail(hk, head)?;
                    }
                }
            }
            feed(&mut eng)?;
            if !done {
                eng.wait(Duration::from_millis(1));
            }
            if start.elapsed() > Duration::from_secs(10) {
                return Err(JobgenBenchError::Args(
                    "a high-priority message took more than 10 s".into(),
                ));
            }
        }
        if i >= 20 {
            lat.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    let low = eng.pipe_stats(low_pipe).map_or(0, |s| s.src_bytes) - low0;
    let wall = t0.elapsed().as_secs_f64();
    // Jobs already given to the worker finish without new pings.
    let drain = Instant::now();
    let mut low_bytes = low;
    while low_bytes == 0 && drain.elapsed() < Duration::from_secs(10) {
        eng.wait(Duration::from_millis(1));
        eng.poll();
        low_bytes = eng.pipe_stats(low_pipe).map_or(0, |s| s.src_bytes) - low0;
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    Ok(LatencyRow {
        max_job,
        p50_us: crate::sgiov::percentile(&lat, 50.0),
        p99_us: crate::sgiov::percentile(&lat, 99.0),
        low_mib_s: low as f64 / wall / MIB,
        low_bytes,
    })
}
