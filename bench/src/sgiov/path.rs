//! `bench sgiov path`: what the staging hop costs (§5.1, the zero-copy delegate).
//!
//! Two guests, each a memfd mapped as guest memory ([`GuestMem`]), one
//! 4 MiB ring each. Messages stream from guest A's ring to guest B's ring
//! through the engine, with the daemon's own pipe layout
//! ([`sgiov::device`]'s `direction`):
//!
//! - `staged`: A → `copy` pipe → a staging ring in daemon memory
//!   ([`StagingMemory`], the device's default ring size) → `copy` pipe → B;
//!   the two pipes chain on the staging ring, two copies per byte;
//! - `direct`: A → one `direct` pipe → B, one copy per byte;
//! - `crypto`: the staged path with `encrypt` into the staging ring and
//!   `decrypt` out of it (a chain between two sandboxes, §14.1 of
//!   docs/sgiov.md); bytes written count the records' headers and tags.
//!
//! Two modes: `wait` (stop-and-wait: one message in flight, B takes it
//! whole before A sends the next) and `stream` (A keeps its ring full, B
//! consumes whatever arrived as soon as the sink head moves).
//!
//! Bytes copied are the pipes' own counters (sink bytes), not assumed.
//! Every run checks its last message byte-exact in B.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sgiov::device::DeviceConfig;
use sgiov::engine::{Engine, EngineConfig, EngineError, Event, PipeSpec, RingKey};
use sgiov::exec::crypto::KeyStore;
use sgiov::jobgen::Xf;
use sgiov::layout::PathKind;
use sgiov::mem::{GuestMem, MemError, Memory, StagingMemory};
use sgiov::ring::{RingGeom, RingPtrs, RingView};

/// A path of the benchmark: the device's two, and the staged one encrypted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchPath {
    Staged,
    Direct,
    Crypto,
}

impl BenchPath {
    pub const ALL: [BenchPath; 3] = [BenchPath::Staged, BenchPath::Direct, BenchPath::Crypto];

    pub fn name(self) -> &'static str {
        match self {
            BenchPath::Staged => "staged",
            BenchPath::Direct => "direct",
            BenchPath::Crypto => "crypto",
        }
    }
}

impl std::str::FromStr for BenchPath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "crypto" => Ok(BenchPath::Crypto),
            _ => match s.parse::<PathKind>() {
                Ok(PathKind::Staged) => Ok(BenchPath::Staged),
                Ok(PathKind::Direct) => Ok(BenchPath::Direct),
                Err(_) => Err(format!("unknown path {s:?} (staged, direct, crypto)")),
            },
        }
    }
}

impl std::fmt::Display for BenchPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How guest A sends and guest B consumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendMode {
    /// One message in flight: B takes it whole, then A sends the next.
    Wait,
    /// A keeps its ring full; B consumes as the sink head moves.
    Stream,
}

impl SendMode {
    pub const ALL: [SendMode; 2] = [SendMode::Wait, SendMode::Stream];

    pub fn name(self) -> &'static str {
        match self {
            SendMode::Wait => "wait",
            SendMode::Stream => "stream",
        }
    }
}

impl std::str::FromStr for SendMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown send mode {s:?} (wait, stream)"))
    }
}

impl std::fmt::Display for SendMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What `bench sgiov path` runs (the `burstvm` CLI parses its flags into this).
#[derive(Debug, Clone)]
pub struct PathBenchConfig {
    /// Paths to compare.
    pub path: Vec<BenchPath>,
    /// Send modes.
    pub mode: Vec<SendMode>,
    /// Message sizes in bytes.
    pub msg: Vec<u64>,
    /// Bytes streamed per path, size and run.
    pub bytes: u64,
    /// Executor threads (0: jobs run on the polling thread).
    pub workers: usize,
    /// Size of the staging ring (`None`: the NIC daemon's).
    pub staging_ring: Option<u32>,
    /// Runs of each measurement; the table shows the median.
    pub repeat: usize,
}

impl Default for PathBenchConfig {
    fn default() -> Self {
        PathBenchConfig {
            path: BenchPath::ALL.to_vec(),
            mode: SendMode::ALL.to_vec(),
            msg: vec![1 << 10, 16 << 10, 64 << 10, 1 << 20],
            bytes: 64 << 20,
            workers: 0,
            staging_ring: None,
            repeat: 3,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PathBenchError {
    #[error("bench sgiov path: {0}")]
    Args(String),
    #[error("bench sgiov path: memory")]
    Memory(#[from] MemError),
    #[error("bench sgiov path: engine")]
    Engine(#[from] EngineError),
    #[error("bench sgiov path: {path} pipe failed: {what}")]
    Pipe { path: &'static str, what: String },
    #[error("bench sgiov path: {path} path: a {msg}-byte message did not arrive in guest B")]
    Stalled { path: &'static str, msg: u32 },
    #[error("bench sgiov path: {path} path: guest B's byte {at} of a {msg}-byte message differs from guest A's")]
    Mismatch {
        path: &'static str,
        msg: u32,
        at: usize,
    },
}

/// Guest rings: a message size of up to a quarter of it.
pub const RING: u32 = 4 << 20;
/// Guest-physical address of each guest's ring.
const GPA: u64 = 0x1000_0000;
/// The first message's size: off every power of two, so later messages wrap.
const FIRST: u32 = 0x1230;
const MIB: f64 = (1u64 << 20) as f64;

/// Two guests and the engine connecting them along one path.
#[derive(Debug)]
pub struct PathRig {
    pub path: BenchPath,
    eng: Engine,
    src: RingKey,
    sink: RingKey,
    src_view: RingView,
    sink_view: RingView,
    pipes: Vec<sgiov::sched::PipeKey>,
    workers: usize,
    // Keeps the staging ring's block allocated while the engine uses it.
    _staging: Option<Arc<StagingMemory>>,
}

impl PathRig {
    pub fn new(
        path: BenchPath,
        workers: usize,
        staging_ring: u32,
    ) -> Result<PathRig, PathBenchError> {
        let guest = |name: &str| -> Result<RingView, PathBenchError> {
            let (mem, _file) = GuestMem::memfd(name, GPA, RING as usize)?;
            let mem: Arc<dyn Memory> = Arc::new(mem);
            let view = RingView::new(
                mem,
                RingGeom {
                    base: GPA,
                    size: RING,
                },
            );
            // Fault every page in now, out of the timing.
            let fill: Vec<u8> = (0..RING)
                .map(|i| (i.wrapping_mul(131) >> 3) as u8)
                .collect();
            view.write(0, &fill)?;
            Ok(view)
        };
        let (src_view, sink_view) = (guest("bench-path guest A")?, guest("bench-path guest B")?);
        let keys = Arc::new(KeyStore::new(1));
        let mut eng = Engine::new(
            EngineConfig {
                workers,
                ..Default::default()
            },
            keys.clone(),
        )?;
        let src = eng.add_ring(src_view.clone(), "guest A tx".into(), 0);
        let sink = eng.add_ring(sink_view.clone(), "guest B rx".into(), 1);
        let key_slot = match path {
            BenchPath::Crypto => {
                keys.alloc_random()
                    .ok_or_else(|| PathBenchError::Args("no key slot".into()))?
                    .0
            }
            _ => 0,
        };
        let spec = |src, sink, xf, label: &str| PipeSpec {
            src,
            sink,
            xf,
            tenant: 1,
            prio: 0,
            key_slot,
            max_job: None,
            label: format!("bench path {label}"),
            tag: 0,
        };
        let mut pipes = Vec::new();
        let mut staging = None;
        match path {
            BenchPath::Direct => pipes.push(eng.add_pipe(spec(src, sink, Xf::Direct, "direct"))?),
            BenchPath::Staged | BenchPath::Crypto => {
                let (x1, x2) = match path {
                    BenchPath::Crypto => (Xf::Encrypt, Xf::Decrypt),
                    _ => (Xf::Copy, Xf::Copy),
                };
                let mem = Arc::new(StagingMemory::new(
                    "bench-path staging",
                    staging_ring as usize,
                )?);
                let base = mem.alloc(staging_ring).ok_or_else(|| {
                    PathBenchError::Args(format!("staging ring of {staging_ring} bytes"))
                })?;
                let view = RingView::new(
                    mem.clone(),
                    RingGeom {
                        base,
                        size: staging_ring,
                    },
                );
                view.write(0, &vec![0u8; staging_ring as usize])?;
                let st = eng.add_ring(view, "staging".into(), u64::MAX);
                pipes.push(eng.add_pipe(spec(src, st, x1, "to staging"))?);
                pipes.push(eng.add_pipe(spec(st, sink, x2, "from staging"))?);
                staging = Some(mem);
            }
        }
        let mut rig = PathRig {
            path,
            eng,
            src,
            sink,
            src_view,
            sink_view,
            pipes,
            workers,
            _staging: staging,
        };
        rig.send(FIRST, None)?;
        Ok(rig)
    }

    /// One round of the engine (inline, or collecting the workers' results);
    /// a pipe error ends the run.
    fn step(&mut self) -> Result<(), PathBenchError> {
        if self.workers == 0 {
            self.eng.run_inline();
        } else {
            self.eng.poll();
        }
        for ev in self.eng.take_events() {
            if let Event::PipeError { what, .. } = ev {
                let path = self.path.name();
                return Err(PathBenchError::Pipe { path, what });
            }
        }
        Ok(())
    }

    /// Guest A sends one message (`data`, or what its ring holds) and guest
    /// B consumes it once it has arrived whole.
    pub fn send(&mut self, msg: u32, data: Option<&[u8]>) -> Result<(), PathBenchError> {
        let path = self.path.name();
        let head = self.eng.ring_ptrs(self.src).map_or(0, |p| p.head);
        if let Some(d) = data {
            self.src_view.write(head, d)?;
        }
        let target = self
            .eng
            .ring_ptrs(self.sink)
            .map_or(0, |p| p.head)
            .wrapping_add(msg);
        self.eng.external_head(self.src, head.wrapping_add(msg))?;
        let start = Instant::now();
        loop {
            self.step()?;
            let kh = self.eng.ring_ptrs(self.sink).map_or(0, |p| p.head);
            if kh == target {
                self.eng.external_tail(self.sink, kh)?;
                return Ok(());
            }
            // Inline, one round does all there is; with workers, wait for them.
            if self.workers == 0 || start.elapsed() > Duration::from_secs(10) {
                return Err(PathBenchError::Stalled { path, msg });
            }
            self.eng.wait(Duration::from_millis(1));
        }
    }

    /// Streams `count` messages of `msg` bytes: guest A publishes a
    /// message whenever its ring has room for it, guest B consumes whatever
    /// arrived each time the engine made progress (the sink's tail follows
    /// its head). Bytes are what A's ring holds (the pattern written at
    /// start, or what earlier sends left).
    pub fn stream(&mut self, msg: u32, count: u64) -> Result<(), PathBenchError> {
        let path = self.path.name();
        let total = count * msg as u64;
        let (mut sent, mut got) = (0u64, 0u64);
        let mut last = Instant::now();
        while got < total {
            let sp = self.eng.ring_ptrs(self.src).unwrap_or(RingPtrs::new(RING));
            let mut head = sp.head;
            while sent < total && head.wrapping_sub(sp.tail) + msg <= RING {
                head = head.wrapping_add(msg);
                sent += msg as u64;
            }
            if head != sp.head {
                self.eng.external_head(self.src, head)?;
            }
            self.step()?;
            let kp = self.eng.ring_ptrs(self.sink).unwrap_or(RingPtrs::new(RING));
            if kp.head != kp.tail {
                got += kp.head.wrapping_sub(kp.tail) as u64;
                self.eng.external_tail(self.sink, kp.head)?;
                last = Instant::now();
            } else if last.elapsed() > Duration::from_secs(10) {
                return Err(PathBenchError::Stalled { path, msg });
            } else if self.workers > 0 {
                self.eng.wait(Duration::from_millis(1));
            }
        }
        Ok(())
    }

    /// Compares the last `msg` bytes guest B received with what guest A sent
    /// (both rings have the same size and start, so a byte keeps its pointer).
    pub fn check_last(&self, msg: u32) -> Result<(), PathBenchError> {
        let end = self.eng.ring_ptrs(self.sink).map_or(0, |p| p.head);
        let at = end.wrapping_sub(msg);
        let (mut a, mut b) = (vec![0u8; msg as usize], vec![0u8; msg as usize]);
        self.src_view.read(at, &mut a)?;
        self.sink_view.read(at, &mut b)?;
        match a.iter().zip(&b).position(|(x, y)| x != y) {
            None => Ok(()),
            Some(at) => Err(PathBenchError::Mismatch {
                path: self.path.name(),
                msg,
                at,
            }),
        }
    }

    /// Bytes the pipes wrote into their sinks, and jobs run, so far.
    pub fn copied(&self) -> (u64, u64) {
        let bytes = self
            .pipes
            .iter()
            .filter_map(|p| self.eng.pipe_stats(*p))
            .map(|s| s.sink_bytes)
            .sum();
        (bytes, self.eng.stats().jobs)
    }
}

/// One row of the table.
#[derive(Debug, Clone)]
pub struct PathRow {
    pub path: BenchPath,
    pub mode: SendMode,
    pub msg: u64,
    pub mib_s: f64,
    /// Bytes written per message over the message size (crypto: records).
    pub copies_per_msg: f64,
    pub bytes_copied_per_msg: f64,
    pub jobs_per_msg: f64,
    /// Host CPU (user + system, all threads) per message.
    pub cpu_us_per_msg: f64,
}

/// One run: `bytes` of `msg`-byte messages along `path`.
pub fn run_one(
    path: BenchPath,
    mode: SendMode,
    msg: u64,
    bytes: u64,
    workers: usize,
    staging_ring: u32,
) -> Result<PathRow, PathBenchError> {
    if msg == 0 || msg > (RING / 4) as u64 {
        return Err(PathBenchError::Args(format!(
            "message size {msg} must be in 1..={}",
            RING / 4
        )));
    }
    let m = msg as u32;
    let count = (bytes / msg).max(8);
    let mut rig = PathRig::new(path, workers, staging_ring)?;
    let (b0, j0) = rig.copied();
    let (cpu0, t) = (super::cpu_time(), Instant::now());
    match mode {
        SendMode::Wait => {
            for _ in 0..count {
                rig.send(m, None)?;
            }
        }
        SendMode::Stream => rig.stream(m, count)?,
    }
    let secs = t.elapsed().as_secs_f64();
    let cpu = (super::cpu_time() - cpu0).as_secs_f64();
    rig.check_last(m)?;
    let (b1, j1) = rig.copied();
    let per = |x: u64| x as f64 / count as f64;
    Ok(PathRow {
        path,
        mode,
        msg,
        mib_s: (count * msg) as f64 / secs.max(1e-9) / MIB,
        copies_per_msg: per(b1 - b0) / msg as f64,
        bytes_copied_per_msg: per(b1 - b0),
        jobs_per_msg: per(j1 - j0),
        cpu_us_per_msg: cpu * 1e6 / count as f64,
    })
}

pub fn run_cli(a: &PathBenchConfig) -> Result<(), PathBenchError> {
    let (sizes, bytes) = (&a.msg, a.bytes);
    let staging_ring = a
        .staging_ring
        .unwrap_or(DeviceConfig::default().staging_ring);
    let repeat = a.repeat.max(1);
    println!(
        "bench sgiov path: {} MiB per run, median of {repeat} runs, guest rings of {} MiB (memfd), staging ring {}, max job {}, {}",
        bytes >> 20,
        RING >> 20,
        guestmem::format_size(staging_ring as u64),
        guestmem::format_size(EngineConfig::default().max_job as u64),
        match a.workers {
            0 => "jobs inline on one thread".to_string(),
            n => format!("{n} executor threads"),
        }
    );
    println!("| msg | mode | path | MiB/s | ÷ staged | copies/msg | bytes written/msg | jobs/msg | host CPU µs/msg |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (&m, &mode) in sizes
        .iter()
        .flat_map(|m| a.mode.iter().map(move |x| (m, x)))
    {
        let mut rows = Vec::new();
        for &p in &a.path {
            let runs: Vec<PathRow> = (0..repeat)
                .map(|_| run_one(p, mode, m, bytes, a.workers, staging_ring))
                .collect::<Result<_, _>>()?;
            let median = |f: fn(&PathRow) -> f64| {
                let mut v: Vec<f64> = runs.iter().map(f).collect();
                v.sort_by(|a, b| a.total_cmp(b));
                super::percentile(&v, 50.0)
            };
            let mut r = runs[0].clone();
            r.mib_s = median(|r| r.mib_s);
            r.cpu_us_per_msg = median(|r| r.cpu_us_per_msg);
            rows.push(r);
        }
        let staged = rows
            .iter()
            .find(|r| r.path == BenchPath::Staged)
            .map(|r| r.mib_s);
        for r in rows {
            let ratio = match (r.path, staged) {
                (BenchPath::Staged, _) | (_, None) => "-".to_string(),
                (_, Some(s)) => format!("{:.2}", r.mib_s / s.max(1e-9)),
            };
            println!(
                "| {} | {} | {} | {:.0} | {ratio} | {:.2} | {:.0} | {:.2} | {:.1} |",
                guestmem::format_size(m),
                mode.name(),
                r.path.name(),
                r.mib_s,
                r.copies_per_msg,
                r.bytes_copied_per_msg,
                r.jobs_per_msg,
                r.cpu_us_per_msg
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Seeded random messages arrive byte-exact on both paths, inline and
    /// with workers; staged copies every byte twice, direct once.
    #[test]
    fn paths_deliver_exact_bytes_and_count_copies() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(14);
        for workers in [0, 2] {
            for path in [BenchPath::Staged, BenchPath::Direct, BenchPath::Crypto] {
                // A small staging ring so that messages wrap it and span several fills.
                let mut rig = PathRig::new(path, workers, 16 << 10).unwrap();
                let (b0, _) = rig.copied();
                let mut sent = 0u64;
                for _ in 0..40 {
                    let n = rng.gen_range(1..=100_000u32);
                    let data: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
                    rig.send(n, Some(&data)).unwrap();
                    let mut got = vec![0u8; n as usize];
                    let end = rig.eng.ring_ptrs(rig.sink).unwrap().head;
                    rig.sink_view.read(end.wrapping_sub(n), &mut got).unwrap();
                    assert!(got == data, "{path:?} workers {workers}: {n}-byte message");
                    rig.check_last(n).unwrap();
                    sent += n as u64;
                }
                let written = rig.copied().0 - b0;
                match path {
                    BenchPath::Staged => assert_eq!(written, 2 * sent),
                    BenchPath::Direct => assert_eq!(written, sent),
                    // Records: a header and a tag per record on the way in.
                    BenchPath::Crypto => assert!(written > 2 * sent, "{written} vs {sent}"),
                }
                // Streaming: the ring kept full, consumed as it arrives;
                // the last message checked against A's ring.
                rig.stream(70_001, 90).unwrap();
                rig.check_last(70_001).unwrap();
            }
        }
    }

    #[test]
    fn run_one_reports_copy_counts() {
        let w = SendMode::Wait;
        let s = run_one(BenchPath::Staged, w, 64 << 10, 1 << 20, 0, 256 << 10).unwrap();
        let d = run_one(BenchPath::Direct, w, 64 << 10, 1 << 20, 0, 256 << 10).unwrap();
        let st = SendMode::Stream;
        let c = run_one(BenchPath::Crypto, st, 64 << 10, 1 << 20, 2, 256 << 10).unwrap();
        assert!(c.copies_per_msg > 2.0 && c.mib_s > 0.0, "{c:?}");
        assert_eq!((s.copies_per_msg, d.copies_per_msg), (2.0, 1.0));
        assert_eq!(s.bytes_copied_per_msg, 2.0 * d.bytes_copied_per_msg);
        assert!(s.mib_s > 0.0 && d.mib_s > 0.0);
        assert!("direct".parse::<PathKind>().is_ok() && "x".parse::<PathKind>().is_err());
        assert_eq!("crypto".parse::<BenchPath>(), Ok(BenchPath::Crypto));
        assert!("x".parse::<BenchPath>().unwrap_err().contains("crypto"));
    }
}
