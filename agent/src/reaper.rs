//! The one child reaper of the process (PID 1 in the guest: every orphan of
//! the sandbox ends up here too).
//!
//! A thread waits for any child with `waitid(P_ALL, WEXITED | WNOWAIT)`,
//! which leaves the zombie in place, then takes the registry lock and reaps
//! it. A process spawned through [`Reaper::spawn`] is registered under the
//! same lock, so its exit is never reaped before its callback is known; a
//! process not registered (an orphan) is reaped and forgotten. Signals go
//! through [`Reaper::kill`], which holds the lock and sends only to a pid
//! not reaped yet, so a pid is never signalled after it was freed.
//!
//! One per process (a waitpid(-1) loop would steal another's children), so
//! every agent in a test binary shares it; such a binary must not wait for
//! children of its own.

use std::collections::HashMap;
use std::io;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread;

use agent_proto::Exit;
use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

type OnExit = Box<dyn FnOnce(Exit) + Send>;

#[derive(Default)]
struct Registry {
    waiting: HashMap<i32, OnExit>,
    /// Bumped by every spawn: the reaper thread sleeps on it while there are
    /// no children at all.
    spawned: u64,
}

// The callbacks are closures: Debug names the pids waited for.
impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("waiting", &self.waiting.keys().collect::<Vec<_>>())
            .field("spawned", &self.spawned)
            .finish()
    }
}

#[derive(Debug)]
pub struct Reaper {
    reg: Mutex<Registry>,
    cv: Condvar,
}

static REAPER: OnceLock<&'static Reaper> = OnceLock::new();

/// The process's reaper (its thread starts on first use).
pub fn reaper() -> &'static Reaper {
    REAPER.get_or_init(|| {
        let r: &'static Reaper = Box::leak(Box::new(Reaper {
            reg: Mutex::new(Registry::default()),
            cv: Condvar::new(),
        }));
        thread::Builder::new()
            .name("reaper".into())
            .spawn(move || r.run())
            .expect("spawning the reaper thread");
        r
    })
}

/// The exit of a reaped status (None for a stop or continue, which
/// `WEXITED` alone never reports).
pub fn exit_of(status: WaitStatus) -> Option<Exit> {
    match status {
        WaitStatus::Exited(_, code) => Some(Exit::code(code)),
        WaitStatus::Signaled(_, sig, _) => Some(Exit::signaled(sig as i32)),
        _ => None,
    }
}

impl Reaper {
    fn lock(&self) -> MutexGuard<'_, Registry> {
        self.reg.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Spawns `cmd` and registers `on_exit`, called (on the reaper thread)
    /// with the child's exit status. Returns the pid.
    pub fn spawn(
        &self,
        cmd: &crate::process::Spawn,
        on_exit: impl FnOnce(Exit) + Send + 'static,
    ) -> io::Result<i32> {
        let mut reg = self.lock();
        // `spawn` returns after the exec (or reaps the child itself when it
        // failed) while the lock keeps the reaper thread off this child.
        let pid = cmd.spawn()?;
        reg.waiting.insert(pid, Box::new(on_exit));
        reg.spawned += 1;
        self.cv.notify_all();
        Ok(pid)
    }

    /// Sends `signal` to `pid` if it is a registered child not reaped yet.
    /// Returns whether it was sent.
    pub fn kill(&self, pid: i32, signal: Signal) -> nix::Result<bool> {
        let reg = self.lock();
        if !reg.waiting.contains_key(&pid) {
            return Ok(false);
        }
        kill(Pid::from_raw(pid), signal)?;
        Ok(true)
    }

    fn run(&self) {
        loop {
            let seen = self.lock().spawned;
            match waitid(Id::All, WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT) {
                Ok(status) => {
                    let Some(pid) = status.pid() else { continue };
                    let mut reg = self.lock();
                    // The child may be gone already (a failed exec that std
                    // reaped): WNOHANG then finds nothing, or ECHILD.
                    let reaped = waitpid(pid, Some(WaitPidFlag::WNOHANG));
                    let on_exit = match reaped {
                        Ok(s) => exit_of(s)
                            .and_then(|e| reg.waiting.remove(&pid.as_raw()).map(|f| (f, e))),
                        Err(_) => None,
                    };
                    drop(reg);
                    if let Some((f, e)) = on_exit {
                        f(e);
                    }
                }
                Err(Errno::ECHILD) => {
                    let mut reg = self.lock();
                    while reg.spawned == seen {
                        reg = self.cv.wait(reg).unwrap_or_else(PoisonError::into_inner);
                    }
                }
                Err(Errno::EINTR) => {}
                Err(e) => {
                    eprintln!("burstvm-agent: reaper: waitid: {e}");
                    thread::sleep(std::time::Duration::from_millis(100));
                }
            }
        }
    }
}
