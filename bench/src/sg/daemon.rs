//! The `burstvm nic` daemon a bench spawns (SG functions, optionally VFs)
//! and what the bench reads back from it: its control API, CPU, fds and
//! preemptions, the SG counters, and `settle`, the leak check after each
//! configuration.

use super::*;

/// A `burstvm nic` child with `sgfs` SG functions on PF `pf0`; SIGTERMed
/// and reaped on drop, and killed by the kernel if this thread dies first.
#[derive(Debug)]
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
        Duration::from_nanos(runtime::cpuacct::process_ns(self.child.id()).unwrap_or(0))
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
pub fn pf_lat(c: &mut Client) -> Result<nic_api::SgLat, BenchSgError> {
    Ok(list_sg(c)?
        .first()
        .and_then(|v| v.sg)
        .map(|s| s.pf_lat)
        .unwrap_or_default())
}

pub(super) fn list_sg(c: &mut Client) -> Result<Vec<VfInfo>, BenchSgError> {
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
