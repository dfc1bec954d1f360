//! The load: frontends (one per shard thread, one SG function each) attach,
//! open echo pipes in control batches and drive them, each pipe checking
//! byte for byte what comes back (`start_load`, `join_load`).

use super::*;

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
#[derive(Debug, Default)]
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
