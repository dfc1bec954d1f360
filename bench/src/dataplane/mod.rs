//! `bench dataplane`: the VF switch's cost per packet, counted as ixy counts
//! it. A built-in poll-mode frontend (`SimFrontend` in poll mode: no VM, no
//! syscalls while the NIC polls) drives two or more VFs of an in-process NIC
//! for a fixed time; the NIC's dataplane thread runs as in the daemon. For
//! every frame size, batch size and topology it prints packets/s, the
//! dataplane thread's CPU seconds (from /proc per-thread schedstat, which
//! excludes steal time) and cycles per packet (CPU seconds × the nominal
//! frequency / packets), median of `--reps` runs.
//!
//! Topologies: `loop` — VF i sends to VF (i+1) mod n, every VF sends and
//! receives; `one-way` — VF 2k sends to VF 2k+1.

pub mod dpdk;
pub mod testpmd;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use nic::daemon::{BackgroundServer, Nic};
use nic::dataplane::{Dataplane, SAFETY_SLEEP};
use nic::devset::LockPolicy;
use nic::frontend::{SimFrontend, MIN_MEM};

use crate::stats::median;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    Loop,
    OneWay,
}

impl Topology {
    pub const ALL: [Topology; 2] = [Topology::Loop, Topology::OneWay];

    pub fn name(self) -> &'static str {
        match self {
            Topology::Loop => "loop",
            Topology::OneWay => "one-way",
        }
    }
}

impl std::fmt::Display for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Topology {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| format!("unknown topology {s:?} (loop, one-way)"))
    }
}

/// The peer measured side by side with burstvm's NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// `dpdk-testpmd` frontends against burstvm's NIC and against DPDK's
    /// `net_vhost` backend (`dpdk`).
    Dpdk,
}

impl Peer {
    pub const ALL: [Peer; 1] = [Peer::Dpdk];

    pub fn name(self) -> &'static str {
        match self {
            Peer::Dpdk => "dpdk",
        }
    }
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Peer {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown peer {s:?} (dpdk)"))
    }
}

/// What `bench dataplane` runs (the `burstvm` CLI parses its flags into this).
#[derive(Debug, Clone)]
pub struct BenchDataplaneConfig {
    /// Instead of the built-in frontend: DPDK's testpmd as the frontend of
    /// both burstvm's NIC and DPDK's vhost backend, interleaved, with the
    /// ratio (uses --sizes, --duration, --reps, --dir).
    pub peer: Option<Peer>,
    /// VFs driven (at least 2; one-way uses them in pairs).
    pub vfs: usize,
    /// Idle VFs beside the driven ones: live ports, each with a connected
    /// frontend that never sends (the cost of ports without work).
    pub idle_vfs: Vec<usize>,
    /// Frame sizes in bytes (Ethernet header included, no FCS).
    pub sizes: Vec<usize>,
    /// Batch sizes: the NIC's `--batch` and the frontend's burst.
    pub batch: Vec<usize>,
    pub topology: Vec<Topology>,
    /// The NIC's `--dataplane-threads` (VFs sharded across them; the CPU
    /// counted is all of theirs).
    pub dataplane_threads: usize,
    /// Time per run.
    pub duration: Duration,
    /// Runs per configuration (the median is printed).
    pub reps: usize,
    /// Work directory for the VF sockets (a fresh temporary one by default).
    pub dir: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchDpError {
    #[error("bench dataplane: {0}")]
    Config(String),
    #[error("bench dataplane: {what}: {source}")]
    Nic {
        what: &'static str,
        #[source]
        source: nic::Error,
    },
    #[error("bench dataplane: {0}")]
    Frontend(#[from] nic::frontend::FrontendError),
    #[error("bench dataplane: {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Cpu(#[from] procutil::schedstat::SchedstatError),
    #[error("bench dataplane: {0}")]
    Run(String),
    #[error("bench dataplane: {0}")]
    Devset(#[source] nic::devset::DevsetError),
    #[error("bench dataplane --peer dpdk: {0}")]
    Peer(#[source] testpmd::TestpmdError),
}

/// One run's result.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub packets: u64,
    pub seconds: f64,
    pub cpu_seconds: f64,
}

impl Sample {
    pub fn pps(&self) -> f64 {
        self.packets as f64 / self.seconds
    }
    pub fn cycles_per_packet(&self, hz: f64) -> f64 {
        self.cpu_seconds * hz / self.packets.max(1) as f64
    }
}

/// CPU time a thread of this process has run (ns).
pub fn thread_cpu_ns(tid: i32) -> Result<u64, BenchDpError> {
    Ok(procutil::schedstat::own_thread_ns(tid)?)
}

/// The CPU's nominal frequency (Hz) and where it came from: the "@ X GHz" of
/// the model name when it has one, else the first "cpu MHz".
pub fn nominal_hz() -> (f64, &'static str) {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    };
    if let Some(ghz) = field("model name")
        .and_then(|m| m.split_once('@').map(|(_, f)| f.trim().to_string()))
        .and_then(|f| f.trim_end_matches("GHz").trim().parse::<f64>().ok())
    {
        return (ghz * 1e9, "model name");
    }
    match field("cpu MHz").and_then(|m| m.parse::<f64>().ok()) {
        Some(mhz) => (mhz * 1e6, "cpu MHz"),
        None => (1e9, "unknown (1 GHz assumed)"),
    }
}

/// A frame of `len` bytes from `src` to `dst` (IPv4 ethertype, zero payload).
fn frame(dst: [u8; 6], src: [u8; 6], len: usize) -> Vec<u8> {
    let mut f = vec![0u8; len.max(14)];
    f[..6].copy_from_slice(&dst);
    f[6..12].copy_from_slice(&src);
    f[12..14].copy_from_slice(&[0x08, 0x00]);
    f
}

/// An in-process NIC with one PF of `vfs` assigned VFs, serving their
/// sockets, and its dataplane thread as the daemon runs it; stopped on drop.
#[derive(Debug)]
pub struct BenchNic {
    pub nic: Arc<Nic>,
    server: Option<BackgroundServer>,
    stop: Arc<AtomicBool>,
    dp_threads: Vec<std::thread::JoinHandle<()>>,
    wakes: Vec<Arc<EventFd>>,
    /// The dataplane threads' ids (for their schedstat).
    pub dp_tids: Vec<i32>,
}

impl BenchNic {
    /// `pin`: the CPU the dataplane threads run on (sched_setaffinity), if any.
    pub fn start(
        dir: &Path,
        vfs: usize,
        batch: usize,
        pin: Option<usize>,
        threads: usize,
    ) -> Result<BenchNic, BenchDpError> {
        Self::start_capped(dir, vfs, batch, pin, threads, SAFETY_SLEEP)
    }

    /// As `start`, with the dataplane threads' longest sleep (a test sets a
    /// long one, so that a missed wake-up shows as a stall).
    pub fn start_capped(
        dir: &Path,
        vfs: usize,
        batch: usize,
        pin: Option<usize>,
        threads: usize,
        sleep_cap: Duration,
    ) -> Result<BenchNic, BenchDpError> {
        let nic_err = |what| move |source| BenchDpError::Nic { what, source };
        let nic = Arc::new(
            Nic::new(
                &[("pf0".into(), vfs)],
                LockPolicy::Hierarchical,
                dir,
                dir.join("state.json"),
                &nic::sg::SgConfig::default(),
            )
            .map_err(nic_err("start"))?,
        );
        let pf = &nic.pfs[0];
        for i in 0..vfs {
            pf.devset
                .assign(i, &format!("bench-dp-{i}"))
                .map_err(BenchDpError::Devset)?;
        }
        let server = BackgroundServer::start(nic.clone()).map_err(nic_err("serve VF sockets"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let dps = Dataplane::sharded(
            pf.devset.clone(),
            pf.ports.clone(),
            None,
            pf.wake.clone(),
            batch,
            threads,
        )
        .map_err(|source| BenchDpError::Io {
            what: "dataplane eventfds".into(),
            source,
        })?;
        let mut b = BenchNic {
            wakes: dps.iter().map(|d| d.wake()).collect(),
            nic,
            server: Some(server),
            stop,
            dp_threads: Vec::new(),
            dp_tids: Vec::new(),
        };
        for (k, mut dp) in dps.into_iter().enumerate() {
            dp.set_sleep_cap(sleep_cap);
            let (tid_tx, tid_rx) = std::sync::mpsc::channel();
            let st = b.stop.clone();
            let t = std::thread::Builder::new()
                .name(format!("dp-bench-{k}"))
                .spawn(move || {
                    let pinned = pin.map(|cpu| {
                        let mut set = nix::sched::CpuSet::new();
                        set.set(cpu)
                            .and_then(|_| {
                                nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
                            })
                            .map_err(|e| format!("pin the dataplane thread to CPU {cpu}: {e}"))
                    });
                    let _ = tid_tx.send((nix::unistd::gettid().as_raw(), pinned));
                    dp.run(&st);
                })
                .map_err(|source| BenchDpError::Io {
                    what: "spawn the dataplane thread".into(),
                    source,
                })?;
            b.dp_threads.push(t);
            match tid_rx.recv_timeout(Duration::from_secs(5)) {
                Ok((tid, None | Some(Ok(())))) => b.dp_tids.push(tid),
                Ok((_, Some(Err(e)))) => return Err(BenchDpError::Run(e)),
                Err(_) => {
                    return Err(BenchDpError::Run(
                        "the dataplane thread did not start".into(),
                    ))
                }
            }
        }
        Ok(b)
    }
}

impl Drop for BenchNic {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for w in &self.wakes {
            let _ = w.write(1);
        }
        for t in self.dp_threads.drain(..) {
            let _ = t.join();
        }
        if let Some(s) = self.server.take() {
            s.stop();
        }
    }
}

/// One configuration of a run.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    /// VFs driven.
    pub vfs: usize,
    /// Idle VFs after them (connected frontends that never send).
    pub idle_vfs: usize,
    pub topology: Topology,
    pub size: usize,
    pub batch: usize,
    pub threads: usize,
}

/// One run: a fresh in-process NIC with `vfs + idle_vfs` VFs and its
/// dataplane threads, one frontend per VF, traffic for `duration`.
pub fn run_once(dir: &Path, run: Run, duration: Duration) -> Result<Sample, BenchDpError> {
    let Run {
        vfs,
        idle_vfs,
        topology,
        size,
        batch,
        threads,
    } = run;
    // Kept until the run ends: it owns the NIC and its dataplane threads.
    let b = BenchNic::start(dir, vfs + idle_vfs, batch, None, threads)?;
    let nic = &b.nic;
    let cpu = || -> Result<u64, BenchDpError> { b.dp_tids.iter().map(|&t| thread_cpu_ns(t)).sum() };
    let ports = &nic.pfs[0].ports;
    let all = ports
        .iter()
        .map(|p| SimFrontend::connect(&p.socket, MIN_MEM))
        .collect::<Result<Vec<_>, _>>()?;
    // The idle ones stay connected (their rings live) until the run ends.
    let (mut fes, mut idle) = (all, Vec::new());
    idle.extend(fes.drain(vfs..));
    for fe in &mut idle {
        fe.no_interrupts();
    }
    let macs: Vec<[u8; 6]> = ports.iter().map(|p| p.config().mac).collect();
    let sends = |i: usize| match topology {
        Topology::Loop => Some((i + 1) % vfs),
        Topology::OneWay => (i.is_multiple_of(2) && i + 1 < vfs).then_some(i + 1),
    };
    for (i, fe) in fes.iter_mut().enumerate() {
        fe.no_interrupts();
        if let Some(j) = sends(i) {
            fe.prepare_tx(&frame(macs[j], macs[i], size));
        }
    }
    // Warm-up: the sessions are open and frames flow before the clock starts.
    let mut received = 0u64;
    let warm = Instant::now() + Duration::from_secs(5);
    while received < 1000 {
        if Instant::now() > warm {
            return Err(BenchDpError::Run(format!(
                "no traffic after 5 s ({received} frames received)"
            )));
        }
        received += pump(&mut fes, &sends, batch);
    }
    let cpu0 = cpu()?;
    let t0 = Instant::now();
    let mut packets = 0u64;
    while t0.elapsed() < duration {
        packets += pump(&mut fes, &sends, batch);
    }
    let seconds = t0.elapsed().as_secs_f64();
    let cpu1 = cpu()?;
    drop(idle);
    Ok(Sample {
        packets,
        seconds,
        cpu_seconds: (cpu1 - cpu0) as f64 / 1e9,
    })
}

/// One burst on every sender, one poll of every receiver; frames received.
fn pump(fes: &mut [SimFrontend], sends: &dyn Fn(usize) -> Option<usize>, batch: usize) -> u64 {
    let mut got = 0;
    for (i, fe) in fes.iter_mut().enumerate() {
        if sends(i).is_some() {
            fe.tx_burst(batch);
        }
        got += fe.rx_burst().0 as u64;
    }
    got
}

pub fn run_cli(args: &BenchDataplaneConfig) -> Result<(), BenchDpError> {
    if args.vfs < 2 || args.vfs > nic::MAX_VFS {
        return Err(BenchDpError::Config(format!(
            "--vfs {}: must be 2..{}",
            args.vfs,
            nic::MAX_VFS
        )));
    }
    if let Some(i) = args.idle_vfs.iter().find(|&&i| args.vfs + i > nic::MAX_VFS) {
        return Err(BenchDpError::Config(format!(
            "--idle-vfs {i}: --vfs + --idle-vfs must be at most {}",
            nic::MAX_VFS
        )));
    }
    if let Some(s) = args.sizes.iter().find(|s| !(60..=1514).contains(*s)) {
        return Err(BenchDpError::Config(format!(
            "--sizes {s}: must be 60..1514"
        )));
    }
    if let Some(b) = args.batch.iter().find(|b| !(1..=256).contains(*b)) {
        return Err(BenchDpError::Config(format!("--batch {b}: must be 1..256")));
    }
    if !(Duration::from_millis(100)..=Duration::from_secs(600)).contains(&args.duration)
        || args.reps == 0
    {
        return Err(BenchDpError::Config(
            "--duration must be 0.1..600 s and --reps at least 1".into(),
        ));
    }
    let dir = args.dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("burstvm-bench-dp-{}", std::process::id()))
    });
    std::fs::create_dir_all(&dir).map_err(|source| BenchDpError::Io {
        what: dir.display().to_string(),
        source,
    })?;
    if args.peer == Some(Peer::Dpdk) {
        let r = dpdk::run(args, &dir);
        if args.dir.is_none() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        return r;
    }
    let threads = args.dataplane_threads;
    if !(1..=64).contains(&threads) {
        return Err(BenchDpError::Config(format!(
            "--dataplane-threads {threads}: must be 1..64"
        )));
    }
    let (hz, source) = nominal_hz();
    println!(
        "# nominal {:.3} GHz ({source}); {} VFs driven, {} dataplane thread(s), {} s x {} runs, median",
        hz / 1e9,
        args.vfs,
        threads,
        args.duration.as_secs_f64(),
        args.reps
    );
    println!("topology  size  batch  idle      Mpps   cpu_s  cycles/pkt");
    let dur = args.duration;
    let mut result = Ok(());
    'all: for &topo in &args.topology {
        for &size in &args.sizes {
            for (&batch, &idle_vfs) in args
                .batch
                .iter()
                .flat_map(|b| args.idle_vfs.iter().map(move |i| (b, i)))
            {
                let run = Run {
                    vfs: args.vfs,
                    idle_vfs,
                    topology: topo,
                    size,
                    batch,
                    threads,
                };
                let mut samples = Vec::new();
                for _ in 0..args.reps {
                    match run_once(&dir, run, dur) {
                        Ok(s) => samples.push(s),
                        Err(e) => {
                            result = Err(e);
                            break 'all;
                        }
                    }
                }
                println!(
                    "{:<8} {:>5} {:>6} {:>5} {:>9.3} {:>7.3} {:>11.0}",
                    topo.name(),
                    size,
                    batch,
                    idle_vfs,
                    median(&mut samples.iter().map(|s| s.pps() / 1e6).collect::<Vec<_>>()),
                    median(&mut samples.iter().map(|s| s.cpu_seconds).collect::<Vec<_>>()),
                    median(
                        &mut samples
                            .iter()
                            .map(|s| s.cycles_per_packet(hz))
                            .collect::<Vec<_>>()
                    ),
                );
            }
        }
    }
    if args.dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frames cross the switch in both topologies and the dataplane thread's
    /// CPU time is read.
    #[test]
    fn short_runs_move_frames_and_count_cpu() {
        let dir = std::env::temp_dir().join(format!("nic-bench-dp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (topo, threads) in [
            (Topology::Loop, 1),
            (Topology::OneWay, 1),
            (Topology::Loop, 2),
        ] {
            let run = Run {
                vfs: 2,
                idle_vfs: 0,
                topology: topo,
                size: 64,
                batch: 8,
                threads,
            };
            let s = run_once(&dir, run, Duration::from_millis(200)).unwrap();
            assert!(s.packets > 0, "{topo:?} {threads}: {s:?}");
            assert!(s.cpu_seconds > 0.0, "{topo:?} {threads}: {s:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
        let (hz, _) = nominal_hz();
        assert!(hz >= 1e8, "{hz}");
    }
}
