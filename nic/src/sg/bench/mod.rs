//! `burstvm bench sgiov latency|throughput|open` (issue 13): warp pipes
//! through a spawned `burstvm nic` daemon over real vhost-user sessions and
//! memfds. The pipes are sharded over a few threads, each owning one SG
//! function and its [`SgFrontend`] (a guest with one vCPU), never a thread
//! per pipe. Every pipe is an echo (CONNECT to port 0): what a frontend sends
//! comes back through the daemon's copy executor and is checked byte for
//! byte. After each configuration the frontends disconnect and the bench
//! checks through the control API and `/proc` that the daemon holds no pipe,
//! ring, staging byte or fd more than before (a leak fails the run).
//!
//! The library functions return rows (for tests); `run_cli` prints tables.

pub mod latency;
pub mod open;
pub mod throughput;
pub mod vf;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sgiov::dedicated::MAX_CHANNELS;
use sgiov::driver::{DriverConfig, DriverError};
use sgiov::layout::{PathKind, Transform};
use sgiov::signal::RingId;

use super::frontend::{SgFrontend, SgFrontendError, HEAP};
use crate::control::{Client, ClientError, DevKind, VfInfo};

/// Control requests in flight at once (the driver's control ring holds 1024).
const CTRL_BATCH: usize = 256;
/// Bound of every wait on the daemon.
const T: Duration = Duration::from_secs(30);
/// Length of the byte pattern each pipe repeats.
const PAT: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum BenchSgError {
    #[error("bench sgiov: {0}")]
    Config(String),
    #[error("bench sgiov: NIC daemon {bin}: spawn")]
    Spawn {
        bin: PathBuf,
        #[source]
        source: Box<std::io::Error>,
    },
    #[error("bench sgiov: NIC daemon: {what}")]
    Daemon { what: String },
    #[error("bench sgiov: control {what}")]
    Control {
        what: String,
        #[source]
        source: Box<ClientError>,
    },
    #[error("bench sgiov: {what}")]
    Frontend {
        what: String,
        #[source]
        source: Box<SgFrontendError>,
    },
    #[error("bench sgiov: {what}")]
    VfFrontend {
        what: String,
        #[source]
        source: Box<crate::frontend::FrontendError>,
    },
    #[error("bench sgiov: {what}")]
    Driver {
        what: String,
        #[source]
        source: Box<DriverError>,
    },
    #[error("bench sgiov: {0}")]
    Check(String),
    #[error("bench sgiov open")]
    Devset(#[from] crate::bench::BenchError),
    #[error("bench sgiov: {what}")]
    Io {
        what: String,
        #[source]
        source: Box<std::io::Error>,
    },
}

/// What the three subcommands share (their common flags).
#[derive(Debug, Clone)]
pub struct CommonConfig {
    /// Frontend threads carrying the (backlogged) pipes, one SG function each.
    pub threads: usize,
    /// Bytes of each pipe's TX and RX ring (a power of two, >= 4096).
    pub ring: u32,
    /// Executor threads of the daemon's SG engine (--sg-workers).
    pub workers: usize,
    /// The burstvm binary that runs `nic` (default: this one).
    pub nic_bin: Option<PathBuf>,
    /// Work directory for sockets and state (a fresh temporary one by default).
    pub dir: Option<PathBuf>,
}

impl Default for CommonConfig {
    fn default() -> Self {
        CommonConfig {
            threads: 2,
            ring: 4096,
            workers: 1,
            nic_bin: None,
            dir: None,
        }
    }
}

impl CommonConfig {
    pub fn check(&self) -> Result<(), BenchSgError> {
        if self.threads == 0 || self.threads > 64 {
            return Err(BenchSgError::Config(format!(
                "--threads {}: must be 1..64",
                self.threads
            )));
        }
        if !self.ring.is_power_of_two() || self.ring < PAT as u32 || self.ring > 1 << 20 {
            return Err(BenchSgError::Config(format!(
                "--ring {}: a power of two 4096..1M",
                self.ring
            )));
        }
        Ok(())
    }

    /// `--pipes`: a non-empty list of counts 1..8192.
    pub fn check_pipes(pipes: &[usize]) -> Result<(), BenchSgError> {
        if pipes.is_empty() || pipes.iter().any(|&n| n == 0 || n > 8192) {
            return Err(BenchSgError::Config(format!(
                "--pipes {pipes:?}: counts 1..8192"
            )));
        }
        Ok(())
    }

    pub fn bin(&self) -> Result<PathBuf, BenchSgError> {
        match &self.nic_bin {
            Some(b) => Ok(b.clone()),
            None => std::env::current_exe().map_err(|source| BenchSgError::Io {
                what: "the burstvm binary".into(),
                source: Box::new(source),
            }),
        }
    }

    pub fn dir(&self, what: &str) -> PathBuf {
        self.dir.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("burstvm-bench-sgiov-{what}-{}", std::process::id()))
        })
    }
}

/// A `burstvm nic` child with `sgfs` SG functions on PF `pf0`; SIGTERMed
/// and reaped on drop, and killed by the kernel if this thread dies first.
pub struct Daemon {
    child: Child,
    dir: PathBuf,
    pub control: PathBuf,
}

impl Daemon {
    pub fn spawn(
        bin: &Path,
        dir: &Path,
        sgfs: usize,
        policy: &str,
        workers: usize,
    ) -> Result<Daemon, BenchSgError> {
        Self::spawn_with(bin, dir, sgfs, policy, workers, &[])
    }

    /// [`Daemon::spawn`] with more `burstvm nic` flags.
    pub fn spawn_with(
        bin: &Path,
        dir: &Path,
        sgfs: usize,
        policy: &str,
        workers: usize,
        extra: &[String],
    ) -> Result<Daemon, BenchSgError> {
        Self::spawn_vfs(bin, dir, 1, sgfs, policy, workers, extra)
    }

    /// [`Daemon::spawn_with`] with `vfs` VFs on `pf0` (the VF row of `latency`).
    pub fn spawn_vfs(
        bin: &Path,
        dir: &Path,
        vfs: usize,
        sgfs: usize,
        policy: &str,
        workers: usize,
        extra: &[String],
    ) -> Result<Daemon, BenchSgError> {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).map_err(|source| BenchSgError::Io {
            what: format!("create {}", dir.display()),
            source: Box::new(source),
        })?;
        let control = dir.join("nic.sock");
        let mut cmd = Command::new(bin);
        cmd.arg("nic")
            .args(["--pf", "pf0", "--vfs", &vfs.to_string()])
            .arg("--control")
            .arg(&control)
            .arg("--state-dir")
            .arg(dir)
            .args(["--sgfs", &sgfs.to_string(), "--sg-policy", policy])
            .args(["--sg-workers", &workers.to_string()])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        procutil::die_with_parent(&mut cmd);
        let child = cmd.spawn().map_err(|source| BenchSgError::Spawn {
            bin: bin.into(),
            source: Box::new(source),
        })?;
        let mut d = Daemon {
            child,
            dir: dir.into(),
            control,
        };
        let end = Instant::now() + T;
        while Client::connect(&d.control).is_err() {
            if let Ok(Some(st)) = d.child.try_wait() {
                return Err(BenchSgError::Daemon {
                    what: format!("exited with {st} before its control socket appeared"),
                });
            }
            if Instant::now() > end {
                return Err(BenchSgError::Daemon {
                    what: format!("no control socket {} within {T:?}", d.control.display()),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(d)
    }

    pub fn client(&self) -> Result<Client, BenchSgError> {
        Client::connect(&self.control).map_err(|source| BenchSgError::Control {
            what: format!("connect {}", self.control.display()),
            source: Box::new(source),
        })
    }

    /// The daemon's fd count once it is up: its threads create their fds
    /// (epoll, eventfds) after the control socket is bound, so this waits
    /// for an answer on `c` and then for the count to hold for 200 ms.
    pub fn idle_fds(&self, c: &mut Client) -> Result<usize, BenchSgError> {
        list_sg(c)?;
        let end = Instant::now() + T;
        let (mut last, mut same) = (self.fds(), 0);
        while same < 10 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(20));
            let now = self.fds();
            same = if now == last { same + 1 } else { 0 };
            last = now;
        }
        Ok(last)
    }

    /// Open file descriptors of the daemon process.
    pub fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id())).map_or(0, |d| d.count())
    }

    /// Involuntary context switches so far of the daemon's threads named
    /// `comm` (the kernel took the CPU away from them mid-work).
    pub fn preempted(&self, comm: &str) -> u64 {
        let dir = format!("/proc/{}/task", self.child.id());
        let Ok(tasks) = std::fs::read_dir(&dir) else {
            return 0;
        };
        tasks
            .flatten()
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == comm)
            })
            .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
            .flat_map(|st| {
                st.lines()
                    .filter_map(|l| l.strip_prefix("nonvoluntary_ctxt_switches:"))
                    .filter_map(|v| v.trim().parse::<u64>().ok())
                    .collect::<Vec<_>>()
            })
            .sum()
    }

    /// CPU time (user + system) the daemon used so far.
    pub fn cpu(&self) -> Duration {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        // Fields after the command name (which may hold spaces): utime, stime are 14, 15.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<u64> = rest
            .split_whitespace()
            .skip(11)
            .take(2)
            .filter_map(|x| x.parse().ok())
            .collect();
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
        Duration::from_nanos(f.iter().sum::<u64>() * 1_000_000_000 / hz)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SIGTERM so that it removes its sockets; SIGKILL if it hangs.
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let end = Instant::now() + Duration::from_secs(5);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Memory a frontend needs for `pipes` pipes of two `ring`-byte rings.
pub fn frontend_mem(pipes: usize, ring: u32) -> usize {
    let rings = 2 * pipes as u64 * u64::from(ring);
    // Ring heap after the area, plus slack for alignment; MiB-rounded.
    ((HEAP + rings + rings / 4 + (4 << 20)) as usize).next_multiple_of(1 << 20)
}

/// Driver sizes for `pipes` pipes (signal FIFO, ring table).
pub fn driver_config(pipes: usize) -> DriverConfig {
    let d = DriverConfig::default();
    DriverConfig {
        table_entries: d.table_entries.max(2 * pipes as u32 + 2),
        ..d
    }
}

/// Allocates the SG function of `sandbox` and attaches a frontend to it.
pub fn attach(
    c: &mut Client,
    sandbox: &str,
    pipes: usize,
    ring: u32,
) -> Result<(VfInfo, SgFrontend), BenchSgError> {
    attach_channels(c, sandbox, pipes, ring, 0)
}

/// [`attach`] in `dedicated` signal mode when `channels` > 0: that many
/// sockets get their own signal channel (vring 2 + k, at most
/// [`MAX_CHANNELS`]).
pub fn attach_channels(
    c: &mut Client,
    sandbox: &str,
    pipes: usize,
    ring: u32,
    channels: usize,
) -> Result<(VfInfo, SgFrontend), BenchSgError> {
    let info = c
        .alloc_sg("pf0", sandbox)
        .map_err(|source| BenchSgError::Control {
            what: format!("alloc kind sg for {sandbox}"),
            source: Box::new(source),
        })?;
    let fe = SgFrontend::connect(
        &info.socket,
        frontend_mem(pipes, ring),
        DriverConfig {
            channels: channels.min(MAX_CHANNELS) as u32,
            ..driver_config(pipes)
        },
    )
    .map_err(|source| BenchSgError::Frontend {
        what: format!("attach {}", info.id),
        source: Box::new(source),
    })?;
    Ok((info, fe))
}

/// Opens `n` echo pipes of priority `prio` (OPEN then CONNECT to port 0,
/// in batches, every reply awaited and checked).
pub fn open_echo_pipes(
    fe: &mut SgFrontend,
    n: usize,
    ring: u32,
    prio: u8,
) -> Result<Vec<RingId>, BenchSgError> {
    let drv = |what: &'static str| {
        move |source| BenchSgError::Driver {
            what: what.into(),
            source: Box::new(source),
        }
    };
    let mut socks = Vec::with_capacity(n);
    while socks.len() < n {
        let k = CTRL_BATCH.min(n - socks.len());
        let mut batch = Vec::with_capacity(k);
        let mut reqs = Vec::with_capacity(k);
        for _ in 0..k {
            let (s, r) = fe.drv.open(ring, ring, prio).map_err(drv("OPEN"))?;
            batch.push(s);
            reqs.push(r);
        }
        wait_replies(fe, &reqs, "OPEN")?;
        reqs.clear();
        for &s in &batch {
            let r = fe
                .drv
                .connect(s, 0, Transform::Copy, PathKind::Direct)
                .map_err(drv("CONNECT"))?;
            reqs.push(r);
        }
        wait_replies(fe, &reqs, "CONNECT")?;
        socks.extend(batch);
    }
    Ok(socks)
}

fn wait_replies(fe: &mut SgFrontend, reqs: &[u32], what: &str) -> Result<(), BenchSgError> {
    for &r in reqs {
        let st = fe
            .wait_reply(r, T)
            .map_err(|source| BenchSgError::Frontend {
                what: format!("{what} request {r}"),
                source: Box::new(source),
            })?;
        if st != 0 {
            return Err(BenchSgError::Check(format!(
                "{what} request {r} refused: {st}"
            )));
        }
    }
    Ok(())
}

/// Byte `pos` of pipe `sock`'s stream.
fn pattern(sock: RingId) -> Vec<u8> {
    (0..PAT)
        .map(|i| {
            (i as u8)
                .wrapping_mul(31)
                .wrapping_add(sock as u8 ^ (sock >> 8) as u8)
        })
        .collect()
}

/// One backlogged echo pipe as a frontend thread drives it.
struct Pipe {
    sock: RingId,
    pat: Vec<u8>,
    sent: u64,
    got: u64,
    /// Bytes received while counting.
    counted: u64,
}

impl Pipe {
    fn new(sock: RingId) -> Pipe {
        Pipe {
            sock,
            pat: pattern(sock),
            sent: 0,
            got: 0,
            counted: 0,
        }
    }

    /// Fills the TX ring; takes and checks what came back. Whether anything moved.
    fn step(
        &mut self,
        fe: &mut SgFrontend,
        buf: &mut [u8],
        counting: bool,
    ) -> Result<bool, BenchSgError> {
        let drv = |what: &'static str, sock| {
            move |source| BenchSgError::Driver {
                what: format!("{what} on pipe {sock}"),
                source: Box::new(source),
            }
        };
        let mut moved = false;
        let space = fe.drv.tx_space(self.sock) as usize;
        if space > 0 {
            let at = (self.sent % PAT as u64) as usize;
            let n = space.min(PAT - at);
            let sent = fe
                .drv
                .send(self.sock, &self.pat[at..at + n])
                .map_err(drv("send", self.sock))?;
            self.sent += sent as u64;
            moved |= sent > 0;
        }
        if fe.drv.rx_ready(self.sock) > 0 {
            let at = (self.got % PAT as u64) as usize;
            let n = buf.len().min(PAT - at);
            let got = fe
                .drv
                .recv(self.sock, &mut buf[..n])
                .map_err(drv("recv", self.sock))?;
            if buf[..got] != self.pat[at..at + got] {
                return Err(BenchSgError::Check(format!(
                    "pipe {}: bytes {}..+{got} differ from what was sent",
                    self.sock, self.got
                )));
            }
            self.got += got as u64;
            if counting {
                self.counted += got as u64;
            }
            moved |= got > 0;
        }
        Ok(moved)
    }
}

/// What a load shard moved while the run was counting.
#[derive(Debug, Clone, Default)]
pub struct ShardResult {
    /// Checked bytes received per pipe while counting.
    pub per_pipe: Vec<u64>,
    pub doorbells: u64,
    pub interrupts: u64,
}

/// Control of the load shards: `go` starts counting, `stop` ends the run.
#[derive(Default)]
pub struct Flags {
    pub go: AtomicBool,
    pub stop: AtomicBool,
}

/// Signal mode of a load: Cross-FIFO, or `dedicated` (one channel per pipe).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signals {
    Xfifo,
    Dedicated,
}

/// Pipes of load shard `k` of `threads` over `pipes`.
fn share(pipes: usize, threads: usize, k: usize) -> usize {
    pipes / threads + usize::from(k < pipes % threads)
}

/// SG functions a load of `pipes` over `threads` shards takes: one per
/// shard over the Cross-FIFO; in `dedicated` mode one per
/// [`MAX_CHANNELS`] pipes of a shard (the vhost-user vring index is 8 bits:
/// the pipes shard over SGFs as SR-IOV's over VFs).
pub fn load_sgfs(pipes: usize, threads: usize, signals: Signals) -> usize {
    let threads = threads.min(pipes).max(1);
    (0..threads)
        .map(|k| match signals {
            Signals::Xfifo => 1,
            Signals::Dedicated => share(pipes, threads, k).div_ceil(MAX_CHANNELS).max(1),
        })
        .sum()
}

/// Starts `threads` shards over `pipes` backlogged echo pipes (priority
/// `prio`), SG functions of sandboxes `<prefix>-<k>`; returns once every
/// pipe is open. The handles return each shard's counts after `stop`. In
/// `dedicated` mode a shard's pipes spread over SG functions
/// `<prefix>-<k>-<j>` of at most [`MAX_CHANNELS`] pipes each, every pipe
/// with its own channel (one thread still drives all of a shard's SGFs).
#[allow(clippy::too_many_arguments)]
pub fn start_load(
    control: &Path,
    prefix: &str,
    pipes: usize,
    threads: usize,
    ring: u32,
    prio: u8,
    flags: &Arc<Flags>,
    signals: Signals,
) -> Result<Vec<std::thread::JoinHandle<Result<ShardResult, BenchSgError>>>, BenchSgError> {
    let threads = threads.min(pipes).max(1);
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
    let mut handles = Vec::new();
    for k in 0..threads {
        let n = share(pipes, threads, k);
        let (control, flags, ready) = (control.to_path_buf(), flags.clone(), ready_tx.clone());
        let prefix = format!("{prefix}-{k}");
        let h = std::thread::Builder::new()
            .name(format!("sg-load-{k}"))
            .spawn(move || {
                let opened = (|| {
                    let mut c =
                        Client::connect(&control).map_err(|source| BenchSgError::Control {
                            what: "connect".into(),
                            source: Box::new(source),
                        })?;
                    let mut fes = Vec::new();
                    match signals {
                        Signals::Xfifo => {
                            let (_, mut fe) = attach(&mut c, &prefix, n, ring)?;
                            let socks = open_echo_pipes(&mut fe, n, ring, prio)?;
                            fes.push((fe, socks));
                        }
                        Signals::Dedicated => {
                            let sgfs = n.div_ceil(MAX_CHANNELS).max(1);
                            for j in 0..sgfs {
                                let m = share(n, sgfs, j);
                                let sandbox = format!("{prefix}-{j}");
                                let (_, mut fe) = attach_channels(&mut c, &sandbox, m, ring, m)?;
                                let socks = open_echo_pipes(&mut fe, m, ring, prio)?;
                                fes.push((fe, socks));
                            }
                        }
                    }
                    Ok::<_, BenchSgError>(fes)
                })();
                let mut fes = match opened {
                    Ok(x) => {
                        let _ = ready.send(Ok(()));
                        x
                    }
                    Err(e) => {
                        let _ = ready.send(Err(e.to_string()));
                        return Err(e);
                    }
                };
                let r = drive(&mut fes, &flags);
                flags.stop.store(true, Ordering::Relaxed);
                r
            })
            .map_err(|source| BenchSgError::Io {
                what: "spawn a load thread".into(),
                source: Box::new(source),
            })?;
        handles.push(h);
    }
    for _ in 0..threads {
        match ready_rx.recv_timeout(T * 4) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                flags.stop.store(true, Ordering::Relaxed);
                return Err(BenchSgError::Check(format!("a load shard failed: {e}")));
            }
            Err(_) => {
                flags.stop.store(true, Ordering::Relaxed);
                return Err(BenchSgError::Check("a load shard never got ready".into()));
            }
        }
    }
    Ok(handles)
}

/// The loop of a load shard: keeps every pipe's TX ring full and drains its
/// RX ring, doorbells and interrupts through each SG function's signal
/// plane, until `stop`.
fn drive(
    fes: &mut [(SgFrontend, Vec<RingId>)],
    flags: &Flags,
) -> Result<ShardResult, BenchSgError> {
    let mut pipes: Vec<Vec<Pipe>> = fes
        .iter()
        .map(|(_, socks)| socks.iter().map(|&s| Pipe::new(s)).collect())
        .collect();
    let mut buf = vec![0u8; PAT];
    let counts = |fes: &[(SgFrontend, Vec<RingId>)]| {
        fes.iter().fold((0, 0), |(d, i), (fe, _)| {
            (d + fe.doorbells, i + fe.interrupts)
        })
    };
    let (mut db0, mut irq0) = counts(fes);
    let mut counting = false;
    while !flags.stop.load(Ordering::Relaxed) {
        if !counting && flags.go.load(Ordering::Relaxed) {
            counting = true;
            (db0, irq0) = counts(fes);
        }
        let mut moved = false;
        for ((fe, _), pipes) in fes.iter_mut().zip(&mut pipes) {
            for p in pipes.iter_mut() {
                moved |= p.step(fe, &mut buf, counting)?;
            }
        }
        // Idle: the first SGF waits (briefly) for its interrupts, the
        // others are only drained.
        for (i, (fe, _)) in fes.iter_mut().enumerate() {
            let wait = if moved || i > 0 {
                Duration::ZERO
            } else {
                Duration::from_millis(1)
            };
            fe.pump(wait).map_err(|source| BenchSgError::Frontend {
                what: "pump".into(),
                source: Box::new(source),
            })?;
        }
    }
    let (db, irq) = counts(fes);
    Ok(ShardResult {
        per_pipe: pipes.iter().flatten().map(|p| p.counted).collect(),
        doorbells: db - db0,
        interrupts: irq - irq0,
    })
}

/// Stops the shards and collects their results.
pub fn join_load(
    flags: &Flags,
    handles: Vec<std::thread::JoinHandle<Result<ShardResult, BenchSgError>>>,
) -> Result<Vec<ShardResult>, BenchSgError> {
    flags.stop.store(true, Ordering::Relaxed);
    let mut out = Vec::new();
    for h in handles {
        out.push(
            h.join()
                .map_err(|_| BenchSgError::Check("a load thread panicked".into()))??,
        );
    }
    Ok(out)
}

/// Signals in and doorbells (kicks) over every SG function of the daemon.
pub fn signals_and_kicks(c: &mut Client) -> Result<(u64, u64), BenchSgError> {
    let (mut sig, mut kicks) = (0, 0);
    for v in list_sg(c)? {
        let s = v.sg.unwrap_or_default();
        sig += s.sgf.signals_in;
        kicks += s.sgf.kicks;
    }
    Ok((sig, kicks))
}

/// The PF's signal-plane latency counters (every SG function of the PF
/// shows the same; the daemon publishes them every 100 ms).
pub fn pf_lat(c: &mut Client) -> Result<crate::sg::SgLat, BenchSgError> {
    Ok(list_sg(c)?
        .first()
        .and_then(|v| v.sg)
        .map(|s| s.pf_lat)
        .unwrap_or_default())
}

fn list_sg(c: &mut Client) -> Result<Vec<VfInfo>, BenchSgError> {
    Ok(c.list()
        .map_err(|source| BenchSgError::Control {
            what: "list".into(),
            source: Box::new(source),
        })?
        .into_iter()
        .filter(|v| v.kind == DevKind::Sg)
        .collect())
}

/// After the frontends are gone: every SG function detached, the PF's device
/// empty, the daemon back to `fds` descriptors; then releases the
/// sandboxes. A leak is an error.
pub fn settle(d: &Daemon, c: &mut Client, fds: usize) -> Result<(), BenchSgError> {
    let end = Instant::now() + T;
    loop {
        let sgs = list_sg(c)?;
        let clean = sgs.iter().all(|v| {
            v.sg.is_some_and(|s| {
                !s.attached
                    && s.pf_sgfs == 0
                    && s.pf_pipes == 0
                    && s.pf_rings == 0
                    && s.pf_staging_bytes == 0
            })
        });
        let now = d.fds();
        if clean && now == fds {
            for v in sgs.iter().filter_map(|v| v.sandbox.as_deref()) {
                c.release(v).map_err(|source| BenchSgError::Control {
                    what: format!("release {v}"),
                    source: Box::new(source),
                })?;
            }
            return Ok(());
        }
        if Instant::now() > end {
            return Err(BenchSgError::Check(format!(
                "leak after the frontends closed: daemon fds {now} (idle {fds}), SGFs {:?}",
                sgs.iter().map(|v| v.sg).collect::<Vec<_>>()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Jain's fairness index of `x`: 1 when all equal, 1/n when one has all.
pub fn jain(x: &[f64]) -> f64 {
    let (s, s2) = x.iter().fold((0.0, 0.0), |(s, s2), v| (s + v, s2 + v * v));
    if s2 == 0.0 {
        0.0
    } else {
        s * s / (x.len() as f64 * s2)
    }
}

/// Median of `v` (0 for none).
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_and_median() {
        assert!((jain(&[1.0, 1.0, 1.0, 1.0]) - 1.0).abs() < 1e-12);
        assert!((jain(&[4.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
        assert_eq!(jain(&[0.0, 0.0]), 0.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn frontend_memory_holds_the_rings() {
        let m = frontend_mem(4096, 4096);
        assert!(m as u64 >= HEAP + 2 * 4096 * 4096);
        assert_eq!(m % (1 << 20), 0);
        assert!(driver_config(4096).table_entries >= 8194);
    }
}
