//! `bench dataplane --peer dpdk`: burstvm's VF switch against DPDK's own
//! vhost-user backend, same job, same frontend, one run (issue 12).
//!
//! Topology, the same for both backends: one `dpdk-testpmd` frontend with two
//! virtio-user ports (port 0 on VF/vhost port A, port 1 on B) in
//! `io` forwarding with retry, primed with `start tx_first 4` (4 bursts of
//! 32 txonly frames per port, `--txpkts` = the frame size, source = the
//! port's MAC, destination = the other port's MAC). Every frame then
//! circulates: frontend port 0 → backend → frontend port 1 → backend →
//! frontend port 0, 256 frames in flight. The backend is either
//! - burstvm: an in-process NIC (the daemon's dataplane, `--batch 32`), its
//!   switch forwarding VF A ↔ VF B by destination MAC, or
//! - DPDK: a second testpmd with two `net_vhost` ports in `io` forwarding
//!   (vhost port A ↔ B), DPDK's vhost library as the backend.
//!
//! Pinning (2-core machine): the frontend's lcores on CPU 0, the backend's
//! polling thread (burstvm's dataplane thread, DPDK's forwarding lcore) on
//! CPU 1. Frames per second: frames the frontend received in the window
//! (both ports, `show port stats`); backend CPU: all threads of the backend
//! process (schedstat, steal excluded), for burstvm the bench's own process,
//! whose other threads sleep. Cycles per frame = CPU s × nominal Hz / frames.
//! Two pollers that share a core starve each other (a descheduled receiver
//! drains one ring per time slice), hence one frontend process, not a
//! txonly and an rxonly one.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::dataplane::testpmd::{
    process_cpu_ns, Hugepages, Testpmd, TestpmdError, PAGES_PER_TESTPMD,
};
use crate::dataplane::{nominal_hz, BenchDataplaneConfig, BenchDpError, BenchNic};
use crate::stats::median;

const FRONTEND_CPU: usize = 0;
const BACKEND_CPU: usize = 1;
const WARMUP: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Burstvm,
    Dpdk,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Burstvm => "burstvm",
            Backend::Dpdk => "dpdk",
        }
    }
}

/// One measured window.
#[derive(Debug, Clone, Copy)]
pub struct PeerSample {
    pub frames: u64,
    pub seconds: f64,
    pub cpu_seconds: f64,
    /// DPDK only: testpmd's own count (`--record-core-cycles`) of TSC cycles
    /// per frame spent in polls that moved frames, over the whole run: the
    /// backend's cost without its empty polls.
    pub busy_cycles_per_frame: Option<f64>,
}

impl From<TestpmdError> for BenchDpError {
    fn from(e: TestpmdError) -> Self {
        BenchDpError::Peer(e)
    }
}

/// The backend under test, torn down on drop.
enum Running {
    Burstvm { _nic: BenchNic },
    Dpdk(Testpmd),
}

impl Running {
    fn pid(&self) -> u32 {
        match self {
            Running::Burstvm { .. } => std::process::id(),
            Running::Dpdk(t) => t.pid(),
        }
    }
}

/// Starts `backend` with two ports; returns it, its two vhost-user sockets
/// and the MACs the frontend must send from.
fn start_backend(
    backend: Backend,
    dir: &Path,
) -> Result<(Running, [String; 2], [String; 2]), BenchDpError> {
    match backend {
        Backend::Burstvm => {
            let b = BenchNic::start(dir, 2, nic::dataplane::DEFAULT_BATCH, Some(BACKEND_CPU), 1)?;
            let ports = &b.nic.pfs[0].ports;
            let sock = |i: usize| ports[i].socket.display().to_string();
            let mac = |i: usize| netutil::MacAddr::from(ports[i].config().mac).to_string();
            let (s, m) = ([sock(0), sock(1)], [mac(0), mac(1)]);
            Ok((Running::Burstvm { _nic: b }, s, m))
        }
        Backend::Dpdk => {
            let s = [0, 1].map(|i| dir.join(format!("vhost{i}.sock")).display().to_string());
            for p in &s {
                let _ = std::fs::remove_file(p);
            }
            let vdevs: Vec<String> = (0..2)
                .map(|i| format!("net_vhost{i},iface={},queues=1", s[i]))
                .collect();
            let mut t = Testpmd::spawn("backend", BACKEND_CPU, &vdevs, &["--record-core-cycles"])?;
            t.cmd("set fwd io")?;
            t.cmd("start")?;
            // The io engine forwards by port, not by MAC: any unicast MACs do.
            let m = ["02:42:bf:00:00:00".into(), "02:42:bf:00:00:01".into()];
            Ok((Running::Dpdk(t), s, m))
        }
    }
}

/// One window: backend and frontend started fresh, warmed up, measured,
/// torn down.
pub fn run_once(
    backend: Backend,
    dir: &Path,
    size: usize,
    duration: Duration,
) -> Result<PeerSample, BenchDpError> {
    let (running, socks, macs) = start_backend(backend, dir)?;
    let vdevs: Vec<String> = (0..2)
        .map(|i| format!("net_virtio_user{i},path={},mac={}", socks[i], macs[i]))
        .collect();
    let txpkts = format!("--txpkts={size}");
    let peer0 = format!("--eth-peer=0,{}", macs[1]);
    let peer1 = format!("--eth-peer=1,{}", macs[0]);
    let mut fe = Testpmd::spawn("frontend", FRONTEND_CPU, &vdevs, &[&txpkts, &peer0, &peer1])?;
    fe.cmd("set fwd io retry")?;
    fe.cmd("start tx_first 4")?;
    let received = |fe: &mut Testpmd| -> Result<u64, BenchDpError> {
        Ok(fe.port_stats(0)?.rx_packets + fe.port_stats(1)?.rx_packets)
    };
    std::thread::sleep(WARMUP);
    let (f0, c0, t0) = (
        received(&mut fe)?,
        process_cpu_ns(running.pid())?,
        Instant::now(),
    );
    std::thread::sleep(duration);
    let c1 = process_cpu_ns(running.pid())?;
    let seconds = t0.elapsed().as_secs_f64();
    let f1 = received(&mut fe)?;
    if f1 == f0 {
        return Err(BenchDpError::Run(format!(
            "{}: no frame crossed the backend in {seconds:.1} s ({f0} before)",
            backend.name()
        )));
    }
    fe.cmd("stop")?;
    fe.quit()?;
    let mut busy_cycles_per_frame = None;
    if let Running::Dpdk(mut t) = running {
        // "CPU cycles/packet=172.53 (busy cycles=... / total io packets=...)"
        let out = t.cmd("stop")?;
        busy_cycles_per_frame = out
            .split("CPU cycles/packet=")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse().ok());
        t.quit()?;
    }
    Ok(PeerSample {
        frames: f1 - f0,
        seconds,
        cpu_seconds: (c1 - c0) as f64 / 1e9,
        busy_cycles_per_frame,
    })
}

pub fn run(args: &BenchDataplaneConfig, dir: &Path) -> Result<(), BenchDpError> {
    if crate::dataplane::testpmd::find().is_none() {
        return Err(BenchDpError::Config(format!(
            "--peer dpdk: {} is not on PATH (Debian package dpdk-dev, installed by scripts/setup.sh)",
            crate::dataplane::testpmd::TESTPMD
        )));
    }
    // At most two testpmds run at once (a frontend and DPDK's backend).
    let _pages = Hugepages::reserve(2 * PAGES_PER_TESTPMD).map_err(TestpmdError::from)?;
    let (hz, source) = nominal_hz();
    println!(
        "# nominal {:.3} GHz ({source}); frontend dpdk-testpmd virtio-user x2 on CPU {FRONTEND_CPU}, \
         backend polling thread on CPU {BACKEND_CPU}; {} s x {} runs interleaved, median",
        hz / 1e9,
        args.duration.as_secs_f64(),
        args.reps
    );
    println!("rep  size  backend      Mpps   cpu_s  cycles/pkt  busy_cycles/pkt");
    let dur = args.duration;
    let backends = [Backend::Burstvm, Backend::Dpdk];
    // samples[size][backend]
    let mut samples = vec![[Vec::new(), Vec::new()]; args.sizes.len()];
    for rep in 0..args.reps {
        for (si, &size) in args.sizes.iter().enumerate() {
            for (bi, &b) in backends.iter().enumerate() {
                let s = run_once(b, dir, size, dur)?;
                println!(
                    "{rep:>3} {size:>5}  {:<8} {:>9.3} {:>7.3} {:>11.0}  {}",
                    b.name(),
                    s.frames as f64 / s.seconds / 1e6,
                    s.cpu_seconds,
                    s.cpu_seconds * hz / s.frames as f64,
                    s.busy_cycles_per_frame
                        .map_or("-".into(), |c| format!("{c:.0}"))
                );
                samples[si][bi].push(s);
            }
        }
    }
    println!("# median: size  burstvm Mpps  dpdk Mpps  burstvm cyc/pkt  dpdk cyc/pkt  ratio burstvm/dpdk");
    for (si, &size) in args.sizes.iter().enumerate() {
        let mpps = |v: &Vec<PeerSample>| {
            median(
                &mut v
                    .iter()
                    .map(|s| s.frames as f64 / s.seconds / 1e6)
                    .collect::<Vec<_>>(),
            )
        };
        let cyc = |v: &Vec<PeerSample>| {
            median(
                &mut v
                    .iter()
                    .map(|s| s.cpu_seconds * hz / s.frames as f64)
                    .collect::<Vec<_>>(),
            )
        };
        let [ours, theirs] = &samples[si];
        println!(
            "median {size:>5} {:>13.3} {:>10.3} {:>16.0} {:>13.0} {:>10.2}",
            mpps(ours),
            mpps(theirs),
            cyc(ours),
            cyc(theirs),
            cyc(ours) / cyc(theirs)
        );
    }
    Ok(())
}
