//! Process plumbing shared by every crate that forks a helper (the NIC
//! daemon of a bench, dpdk-testpmd, containerd, the runtime's VMMs): one home
//! for the pre-exec step that makes a child die with its parent.
//!
//! PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not
//! the process. [`die_with_parent`] therefore ties the child to the thread
//! that calls `spawn`: right for a child spawned and owned on a thread that
//! outlives it (a test, a bench, a shim's main thread); a child spawned on a
//! short-lived thread must be forked on a keeper thread instead
//! (`runtime::child::spawn_kept`, which uses [`pdeathsig_kill`] too).
//!
//! Beside it, the one home of the directory lock every daemon and runtime
//! holds on what it owns ([`DirLock`], `dirlock.rs`), and of spawning without
//! a fork ([`spawn`]: clone with CLONE_VM | CLONE_VFORK, as posix_spawn does,
//! for children that need pre-exec steps), and of a thread's scheduling
//! class ([`sched`]), and of reading the CPU a thread or process has run
//! ([`schedstat`]), and of the entry of an executable exec'd per start
//! without std's runtime start-up ([`entry`]).

mod child;
mod dirlock;
pub mod entry;
pub mod sched;
pub mod schedstat;
pub mod spawn;

pub use dirlock::{DirLock, LockError};

/// utime and stime (clock ticks) of a /proc/PID/stat line: fields 14 and 15,
/// counted after the `)` that ends the command name (which may hold spaces).
/// The one parser of it (the agent's Stats, the runtime's CPU accounting,
/// tests of thread CPU).
pub fn stat_times(text: &str) -> Option<(u64, u64)> {
    let rest = &text[text.rfind(')')? + 1..];
    // After ")": state is field 3, so utime (14) is the 12th word.
    let mut words = rest.split_whitespace().skip(11);
    Some((words.next()?.parse().ok()?, words.next()?.parse().ok()?))
}

use std::os::unix::process::CommandExt;
use std::process::Command;

/// Between fork and exec: SIGKILL this process when the thread that forked it
/// exits. Async-signal-safe (one system call), for `pre_exec` closures that
/// do more than this.
pub fn pdeathsig_kill() -> std::io::Result<()> {
    // SAFETY: prctl(2) with integer arguments only; no memory is touched.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Makes the child of `cmd` die (SIGKILL) when the thread that spawns it
/// exits (see the module comment); returns `cmd` for chaining.
pub fn die_with_parent(cmd: &mut Command) -> &mut Command {
    // SAFETY: the pre-exec step is `pdeathsig_kill`, one async-signal-safe
    // system call, between fork and exec.
    unsafe { cmd.pre_exec(pdeathsig_kill) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Stdio;
    use std::time::{Duration, Instant};

    /// A child spawned on a thread that then ends is SIGKILLed.
    #[test]
    fn child_dies_when_its_spawning_thread_exits() {
        let child = std::thread::spawn(|| {
            let mut cmd = Command::new("sleep");
            cmd.arg("30").stdin(Stdio::null());
            die_with_parent(&mut cmd).spawn().expect("spawn sleep")
        })
        .join()
        .unwrap();
        let mut child = child;
        let t0 = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "sleep {} outlived its spawning thread",
                child.id()
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}");
    }
}
