//! Children that die with the runtime process, and not before their owner:
//! VMMs and the NIC daemon. Each runs in its own process group (a terminal's
//! Ctrl-C reaches only the runtime, which tears down in order) with
//! PR_SET_PDEATHSIG = SIGKILL. Linux delivers that signal when the *thread*
//! that forked the child exits, not the process: forked on a short-lived
//! thread (a worker that hands its sandbox on, a request handler), the child
//! would be killed with it. So these children are forked on a keeper thread
//! that their handle owns (`Keeper`) and that ends only when the handle drops
//! it: a child lives while its owner keeps it, and dies with the process.
//! The pre-exec steps the runtime's children share are here too (also for
//! the CNI plugins it executes in a netns); they are async-signal-safe only.
//! Children are spawned without a fork (`procutil::spawn`: clone with
//! CLONE_VM | CLONE_VFORK), so a burst of starts copies nothing of the
//! runtime's memory.

use procutil::spawn::{Child, Command, Process};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The thread a child was forked on; dropping it ends the thread, which
/// SIGKILLs the child if it is still running (reap it first).
#[derive(Debug)]
pub struct Keeper {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    /// The CPU the fork and exec cost the keeper thread (the owner's cost).
    pub spawn_cpu_ns: u64,
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.stop = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Spawns `cmd` on a new keeper thread (see the module comment); the
/// caller's `pre_exec` should call `own_group_dying_with_parent`.
pub fn spawn_kept(mut cmd: Command, name: &str) -> std::io::Result<(Child, Keeper)> {
    let (res_tx, res_rx) = mpsc::sync_channel(1);
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    let thread = std::thread::Builder::new()
        .name(format!("keep-{name}"))
        .stack_size(256 << 10)
        .spawn(move || {
            let cpu0 = crate::cpuacct::thread_ns();
            let r = cmd.spawn();
            let cpu = crate::cpuacct::thread_ns().saturating_sub(cpu0);
            let spawned = r.is_ok();
            let _ = res_tx.send(r.map(|c| (c, cpu)));
            if spawned {
                // Returns when the Keeper drops its sender.
                let _ = stop_rx.recv();
            }
        })?;
    let r = res_rx
        .recv()
        .map_err(|_| std::io::Error::other("keeper thread ended before the spawn"));
    let mut keeper = Keeper {
        stop: Some(stop_tx),
        thread: Some(thread),
        spawn_cpu_ns: 0,
    };
    let (child, cpu) = r??;
    keeper.spawn_cpu_ns = cpu;
    Ok((child, keeper))
}

/// Between fork and exec: own process group, SIGKILL when the forking
/// thread (a keeper) exits. Only async-signal-safe calls.
pub fn own_group_dying_with_parent() -> std::io::Result<()> {
    // Own process group: a terminal Ctrl-C reaches only the runtime, which tears down in order.
    // SAFETY: setpgid(2) with integer arguments only; no memory is touched.
    if unsafe { libc::setpgid(0, 0) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    procutil::pdeathsig_kill()
}

/// Between fork and exec: joins the network namespace open as `ns_fd` (the
/// parent keeps it open until the spawn returned). Async-signal-safe.
pub fn enter_netns(ns_fd: std::os::fd::RawFd) -> std::io::Result<()> {
    // SAFETY: setns(2) on a descriptor the parent keeps open; no memory arguments.
    if unsafe { libc::setns(ns_fd, libc::CLONE_NEWNET) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// SIGTERM (the VMM closes its devices and exits), SIGKILL after `grace`.
/// Also for the other children of burstvm's tools (containerd, services).
pub fn stop_child(mut c: impl Process, grace: Duration) {
    if c.try_wait().ok().flatten().is_none() {
        // SAFETY: kill(2) on our own, not yet reaped child.
        unsafe { libc::kill(c.pid() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = c.kill();
    }
    let _ = c.wait();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::os::unix::process::ExitStatusExt;

    /// The helper process of `a_kept_child_dies_with_the_process` sets this.
    const ROLE: &str = "BURSTVM_CHILD_TEST_ROLE";

    fn sleeper(secs: u32) -> Command {
        let mut cmd = Command::new("/bin/sleep");
        cmd.arg(secs.to_string());
        // SAFETY: the closure only makes async-signal-safe system calls.
        unsafe { cmd.pre_exec(own_group_dying_with_parent) };
        cmd
    }

    /// Spawns a kept `sleep` on a thread that ends at once; returns the
    /// child, its keeper, and that thread's tid once it is gone entirely
    /// (so that a PDEATHSIG it triggered has been sent).
    fn kept_from_a_short_thread() -> (Child, Keeper) {
        let (child, keeper, tid) = std::thread::spawn(|| {
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() };
            let (c, k) = spawn_kept(sleeper(20), "test").expect("spawn sleep");
            (c, k, tid)
        })
        .join()
        .unwrap();
        let task = format!("/proc/self/task/{tid}");
        let end = Instant::now() + Duration::from_secs(5);
        while std::path::Path::new(&task).exists() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!std::path::Path::new(&task).exists(), "{task} still there");
        (child, keeper)
    }

    /// Alive for the whole window: a SIGKILL it was sent would end it well within.
    fn stays_alive(c: &mut Child, window: Duration) -> bool {
        let end = Instant::now() + window;
        while Instant::now() < end {
            if c.try_wait().unwrap().is_some() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }

    #[test]
    fn a_kept_child_outlives_the_spawning_thread_and_dies_with_its_keeper() {
        let (mut c, keeper) = kept_from_a_short_thread();
        let alive = stays_alive(&mut c, Duration::from_millis(300));
        // Dropping the keeper of a running child kills it (PDEATHSIG).
        drop(keeper);
        let st = c.wait().unwrap();
        assert!(alive, "the child died with the thread that asked for it");
        assert_eq!(st.signal(), Some(libc::SIGKILL), "{st}");
    }

    /// Not a test of its own: the "runtime" process of the test below.
    #[test]
    fn kept_child_helper_process() {
        if std::env::var_os(ROLE).is_none() {
            return;
        }
        let (c, _keeper) = kept_from_a_short_thread();
        println!("kept-pid {}", c.id());
        // Until the test SIGKILLs this process (bounded by the sleeper).
        std::thread::sleep(Duration::from_secs(20));
    }

    fn state(pid: u32) -> Option<char> {
        let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        s[s.rfind(')')? + 2..].chars().next()
    }

    #[test]
    fn a_kept_child_dies_with_the_process() {
        let mut helper = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["child::tests::kept_child_helper_process", "--exact"])
            .args(["--nocapture", "--test-threads=1"])
            .env(ROLE, "runtime")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawn helper");
        let out = std::io::BufReader::new(helper.stdout.take().unwrap());
        let pid: Option<u32> = out
            .lines()
            .map_while(Result::ok)
            // On the harness's "test ... " line (--nocapture).
            .find_map(|l| {
                l.split("kept-pid ")
                    .nth(1)
                    .and_then(|p| p.trim().parse().ok())
            });
        let Some(pid) = pid else {
            let _ = helper.kill();
            panic!("helper exited with {:?} without a pid", helper.wait());
        };
        let alive_before = matches!(state(pid), Some(s) if s != 'Z');
        helper.kill().unwrap();
        helper.wait().unwrap();
        let end = Instant::now() + Duration::from_secs(5);
        while matches!(state(pid), Some(s) if s != 'Z') && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        let left = state(pid);
        if matches!(left, Some(s) if s != 'Z') {
            // SAFETY: kill(2) on the sleeper this test made; no orphan holds the lock.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        assert!(alive_before, "the kept child died with its thread");
        assert!(
            !matches!(left, Some(s) if s != 'Z'),
            "kept child {pid} outlived the SIGKILLed process ({left:?})"
        );
    }
}
