//! The VF row of `bench sgiov latency` (mode `vf`, the SR-IOV comparison):
//! the same checked ping-pong between two VFs of a spawned `burstvm nic`
//! through its switch, while every other VF is backlogged, for each `--vfs`
//! count (one daemon with that many VFs each). Real vhost-user sessions:
//! one [`SimFrontend`] per VF.
//!
//! The test frontend holds one 2 KiB buffer per descriptor, so a ping of
//! `--size` bytes is split into MTU frames (1500 payload bytes each: 3 for
//! 4 KiB). VF A sends them to VF B; B echoes every frame as it arrives
//! (MACs swapped); the round trip ends when A has the last frame back and
//! every byte is checked. An SG pipe's echo is the daemon's copy executor
//! (one crossing each way); a VF's peer is a frontend, so the VF ping
//! crosses the switch twice each way (A → B, B → A), as two guests do.
//!
//! The backlog: VF k of the other `n - 2` sends 1514-byte frames to VF
//! k+1 (mod n - 2) in poll mode (`SimFrontend::tx_burst`, kicks only when
//! the NIC stalled) and drains its RX ring, sharded over `--threads`
//! frontend threads.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use nic_api::{Client, VfInfo, VfState};

use super::latency::{measure, LatencyConfig, LatencyRow};
use super::{BenchSgError, Daemon, Flags, T};
use nic::frontend::{SimFrontend, MIN_MEM};

/// The daemon's dataplane thread of the bench's PF (nic::daemon names it).
const DP_THREAD: &str = "dp-pf0";
/// Payload bytes per ping frame (Ethernet MTU).
const MTU: usize = 1500;
/// Ethernet header: destination, source, ethertype.
const ETH: usize = 14;
/// Frames a backlogged VF publishes per pass.
const BURST: usize = 32;

/// One row per `--vfs` count: p50/p99 of the VF ping, daemon fds with every
/// VF session open, dataplane thread preemptions (growth is set by the caller).
pub fn run(a: &LatencyConfig) -> Result<Vec<LatencyRow>, BenchSgError> {
    if a.vfs.is_empty() || a.vfs.iter().any(|n| !(2..=nic::MAX_VFS).contains(n)) {
        return Err(BenchSgError::Config(format!(
            "--vfs {:?}: counts 2..{} (a pinging pair plus backlogged VFs)",
            a.vfs,
            nic::MAX_VFS
        )));
    }
    let mut rows = Vec::new();
    for &n in &a.vfs {
        let d = Daemon::spawn_vfs(
            &a.common.bin()?,
            &a.common.dir(&format!("latency-vf{n}")),
            n,
            0,
            &a.policy.to_string(),
            a.common.workers,
            &[],
        )?;
        let mut c = d.client()?;
        let idle_fds = d.idle_fds(&mut c)?;
        let mut row = one(a, &d, &mut c, n)?;
        row.idle_fds = idle_fds;
        settle_vfs(&d, &mut c, n, idle_fds)?;
        rows.push(row);
    }
    Ok(rows)
}

fn control_err(what: String) -> impl FnOnce(nic_api::ClientError) -> BenchSgError {
    move |source| BenchSgError::Control {
        what,
        source: Box::new(source),
    }
}

fn sandbox(n: usize, k: usize) -> String {
    format!("latvf{n}-{k}")
}

fn mac(v: &VfInfo) -> Result<[u8; 6], BenchSgError> {
    v.mac
        .map(Into::into)
        .ok_or_else(|| BenchSgError::Check(format!("{}: no MAC", v.id)))
}

fn connect(v: &VfInfo) -> Result<SimFrontend, BenchSgError> {
    SimFrontend::connect(&v.socket, MIN_MEM).map_err(|source| BenchSgError::VfFrontend {
        what: format!("attach a frontend to {}", v.id),
        source: Box::new(source),
    })
}

fn one(
    a: &LatencyConfig,
    d: &Daemon,
    c: &mut Client,
    n: usize,
) -> Result<LatencyRow, BenchSgError> {
    let mut vfs = Vec::with_capacity(n);
    for k in 0..n {
        vfs.push(
            c.alloc("pf0", &sandbox(n, k), None, None)
                .map_err(control_err(format!("alloc VF for {}", sandbox(n, k))))?,
        );
    }
    let macs = vfs.iter().map(mac).collect::<Result<Vec<_>, _>>()?;
    let flags = Arc::new(Flags::default());
    let load = start_vf_load(&vfs[2..], &macs[2..], a.common.threads, &flags)?;
    let r = (|| {
        let mut fa = connect(&vfs[0])?;
        let mut fb = connect(&vfs[1])?;
        wait_open(c, n)?;
        let pat: Vec<u8> = (0..a.size).map(|i| (i * 13 + n) as u8).collect();
        let frames: Vec<Vec<u8>> = pat
            .chunks(MTU)
            .map(|p| {
                let mut f = Vec::with_capacity(ETH + p.len());
                f.extend_from_slice(&macs[1]);
                f.extend_from_slice(&macs[0]);
                f.extend_from_slice(&[0x88, 0xb5]); // local experimental ethertype
                f.extend_from_slice(p);
                f
            })
            .collect();
        for _ in 0..a.samples.min(20) {
            ping(&mut fa, &mut fb, &frames)?;
        }
        flags.go.store(true, Ordering::Relaxed);
        let cpu0 = d.cpu();
        let pre0 = d.preempted(DP_THREAD);
        let t0 = Instant::now();
        let (p50_us, p99_us) = measure(a, || ping(&mut fa, &mut fb, &frames))?;
        let cpu = (d.cpu() - cpu0).as_secs_f64() / t0.elapsed().as_secs_f64();
        // Budget, signals per kick and the SG thread's counters do not apply.
        Ok::<_, BenchSgError>(LatencyRow {
            pipes: n,
            mode: "vf",
            p50_us,
            p99_us,
            growth_p50: 1.0,
            growth_p99: 1.0,
            daemon_fds: d.fds(),
            daemon_cpu_pct: cpu * 100.0,
            pings: a.reps * a.samples,
            sg_preempted: d.preempted(DP_THREAD) - pre0,
            ..LatencyRow::default()
        })
    })();
    flags.stop.store(true, Ordering::Relaxed);
    let mut backlog = 0u64;
    let mut failed = None;
    for h in load {
        match h.join() {
            Ok(Ok(b)) => backlog += b,
            Ok(Err(e)) => failed = Some(e),
            Err(_) => failed = Some(BenchSgError::Check("a VF load thread panicked".into())),
        }
    }
    let mut row = r?;
    if let Some(e) = failed {
        return Err(e);
    }
    if n > 2 && backlog == 0 {
        return Err(BenchSgError::Check(format!(
            "{n} VFs: the backlogged VFs moved nothing"
        )));
    }
    row.backlog_bytes = backlog;
    Ok(row)
}

/// Waits until every VF's session is open (the dataplane switches to it).
fn wait_open(c: &mut Client, n: usize) -> Result<(), BenchSgError> {
    let end = Instant::now() + T;
    loop {
        let open = c
            .list()
            .map_err(control_err("list".into()))?
            .iter()
            .filter(|v| v.state == VfState::Open)
            .count();
        if open == n {
            return Ok(());
        }
        if Instant::now() > end {
            return Err(BenchSgError::Check(format!(
                "only {open} of {n} VFs open within {T:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One ping-pong: `frames` A → B, each echoed by B as it arrives, all back
/// at A (checked byte for byte). Its round trip.
fn ping(
    fa: &mut SimFrontend,
    fb: &mut SimFrontend,
    frames: &[Vec<u8>],
) -> Result<Duration, BenchSgError> {
    let t = Instant::now();
    let left = || T.saturating_sub(t.elapsed());
    for f in frames {
        fa.send(f);
    }
    for (i, f) in frames.iter().enumerate() {
        let mut got = fb.recv(left()).ok_or_else(|| {
            BenchSgError::Check(format!("VF ping: frame {i} not at B within {T:?}"))
        })?;
        if got != *f {
            return Err(BenchSgError::Check(format!(
                "VF ping: frame {i} differs at B"
            )));
        }
        // The echo: back to the sender, MACs swapped.
        let (dst, src) = got.split_at_mut(6);
        dst.swap_with_slice(&mut src[..6]);
        fb.send(&got);
    }
    for (i, f) in frames.iter().enumerate() {
        let got = fa.recv(left()).ok_or_else(|| {
            BenchSgError::Check(format!("VF ping: echo of frame {i} not back within {T:?}"))
        })?;
        if got.len() != f.len() || got[..6] != f[6..12] || got[12..] != f[12..] {
            return Err(BenchSgError::Check(format!(
                "VF ping: echo of frame {i} differs"
            )));
        }
    }
    Ok(t.elapsed())
}

type LoadHandle = std::thread::JoinHandle<Result<u64, BenchSgError>>;

/// Starts `threads` shards over the backlogged VFs (VF k sends to VF k+1
/// mod their count); returns once every frontend is attached. Each handle
/// returns the bytes its VFs received after `go`.
fn start_vf_load(
    vfs: &[VfInfo],
    macs: &[[u8; 6]],
    threads: usize,
    flags: &Arc<Flags>,
) -> Result<Vec<LoadHandle>, BenchSgError> {
    if vfs.is_empty() {
        return Ok(Vec::new());
    }
    let threads = threads.min(vfs.len()).max(1);
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
    let mut handles = Vec::new();
    for t in 0..threads {
        let mine: Vec<(PathBuf, String, Vec<u8>)> = (t..vfs.len())
            .step_by(threads)
            .map(|k| {
                let dst = macs[(k + 1) % macs.len()];
                let mut f = vec![0u8; ETH + MTU];
                f[..6].copy_from_slice(&dst);
                f[6..12].copy_from_slice(&macs[k]);
                f[12..14].copy_from_slice(&[0x88, 0xb5]);
                (vfs[k].socket.clone(), vfs[k].id.clone(), f)
            })
            .collect();
        let (flags, ready) = (flags.clone(), ready_tx.clone());
        let h = std::thread::Builder::new()
            .name(format!("vf-load-{t}"))
            .spawn(move || {
                let fes = mine
                    .iter()
                    .map(|(sock, id, frame)| {
                        let mut fe = SimFrontend::connect(sock, MIN_MEM).map_err(|source| {
                            BenchSgError::VfFrontend {
                                what: format!("attach a frontend to {id}"),
                                source: Box::new(source),
                            }
                        })?;
                        fe.prepare_tx(frame);
                        Ok(fe)
                    })
                    .collect::<Result<Vec<_>, BenchSgError>>();
                let mut fes = match fes {
                    Ok(f) => {
                        let _ = ready.send(Ok(()));
                        f
                    }
                    Err(e) => {
                        let _ = ready.send(Err(e.to_string()));
                        return Err(e);
                    }
                };
                let mut counted = 0u64;
                while !flags.stop.load(Ordering::Relaxed) {
                    let counting = flags.go.load(Ordering::Relaxed);
                    let mut moved = false;
                    for fe in &mut fes {
                        moved |= fe.tx_burst(BURST) > 0;
                        let (frames, bytes) = fe.rx_burst();
                        moved |= frames > 0;
                        if counting {
                            counted += bytes;
                        }
                    }
                    if !moved {
                        // Every ring full and nothing switched yet: back off
                        // briefly rather than spin against the dataplane.
                        std::thread::sleep(Duration::from_micros(100));
                    }
                }
                Ok(counted)
            })
            .map_err(|source| BenchSgError::Io {
                what: "spawn a VF load thread".into(),
                source: Box::new(source),
            })?;
        handles.push(h);
    }
    for _ in 0..threads {
        let r = ready_rx.recv_timeout(T * 4);
        if !matches!(r, Ok(Ok(()))) {
            flags.stop.store(true, Ordering::Relaxed);
            let why = match r {
                Ok(Err(e)) => e,
                _ => "never got ready".into(),
            };
            for h in handles {
                let _ = h.join();
            }
            return Err(BenchSgError::Check(format!("a VF load shard: {why}")));
        }
    }
    Ok(handles)
}

/// After the frontends are gone: releases the VFs and waits until the daemon
/// holds no more fds than before they were taken (a leak is an error).
fn settle_vfs(d: &Daemon, c: &mut Client, n: usize, fds: usize) -> Result<(), BenchSgError> {
    for k in 0..n {
        c.release(&sandbox(n, k))
            .map_err(control_err(format!("release {}", sandbox(n, k))))?;
    }
    let end = Instant::now() + T;
    loop {
        let now = d.fds();
        if now == fds {
            return Ok(());
        }
        if Instant::now() > end {
            return Err(BenchSgError::Check(format!(
                "leak after the VF frontends closed: daemon fds {now} (idle {fds})"
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
