//! The body of an executable that burstvm execs on every start (the VMM per
//! sandbox, the CNI plugins per attachment), entered from a C `main` under
//! `#![no_main]` instead of through std's runtime start-up.
//!
//! std's start-up finds the main thread's stack guard with
//! `pthread_getattr_np`, which in glibc opens and parses /proc/self/maps,
//! and maps a signal stack for its overflow message: 0.05 ms of CPU per
//! exec here (a static hello-world, 0.477 -> 0.425 ms; docs/results.md,
//! "Startup CPU, round 18"). What of it these executables rely on is kept:
//! SIGPIPE ignored (a write to a closed socket or pipe is an EPIPE error,
//! not death), standard descriptors that are closed opened on /dev/null
//! (a file opened later never becomes "stdout"), a panic's exit status
//! 101 after its message, and stdout flushed at the end. What is dropped
//! is the message "thread 'main' has overflowed its stack" before the
//! SIGSEGV of a main-thread overflow.

use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The exit status of a panic, as std's runtime gives it.
pub const PANIC_STATUS: i32 = 101;

/// Runs `body` as std's runtime would run `main`, returning the exit status.
pub fn run(body: impl FnOnce() -> i32) -> i32 {
    // SAFETY: setting a signal's disposition to SIG_IGN, before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    open_closed_standard_fds();
    let status = catch_unwind(AssertUnwindSafe(body)).unwrap_or(PANIC_STATUS);
    // Unwritten output is lost otherwise: glibc's exit does not know Rust's buffer.
    let _ = std::io::stdout().flush();
    status
}

/// fds 0, 1 and 2 that are not open are opened on /dev/null, as std does.
fn open_closed_standard_fds() {
    let mut fds = [0, 1, 2].map(|fd| libc::pollfd {
        fd,
        events: 0,
        revents: 0,
    });
    // SAFETY: poll reads and writes only `fds`, which it is given with its length.
    if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) } < 0 {
        return;
    }
    for p in fds.iter().filter(|p| p.revents & libc::POLLNVAL != 0) {
        // SAFETY: opening a path from a NUL-terminated literal; the lowest free
        // fd is the closed one (descriptors are taken in order, lowest first).
        let fd = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR) };
        if fd != p.fd {
            // Not the hole we meant to fill (or no /dev/null): nothing more to do.
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::process::{CommandExt, ExitStatusExt};

    const CHILD: &str = "PROCUTIL_ENTRY_CHILD";

    #[test]
    fn a_panic_is_status_101_and_a_value_is_itself() {
        assert_eq!(run(|| 7), 7);
        assert_eq!(run(|| panic!("boom")), PANIC_STATUS);
    }

    /// In a process of its own (this test binary again), entered with SIGPIPE
    /// at its default and stdin closed, as an exec'd plugin may be: the
    /// write to a closed pipe is an error, not death, and fd 0 is /dev/null.
    #[test]
    fn sigpipe_is_ignored_and_a_closed_stdin_is_dev_null() {
        if std::env::var_os(CHILD).is_some() {
            // SAFETY: restoring the default disposition, as an exec'd process starts.
            unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
            let status = run(|| {
                let stdin = std::fs::metadata("/proc/self/fd/0").unwrap();
                let null = std::fs::metadata("/dev/null").unwrap();
                assert_eq!(stdin.rdev(), null.rdev(), "fd 0 is not /dev/null");
                let (r, w) = std::io::pipe().unwrap();
                drop(r);
                let e = (&w).write_all(b"x").unwrap_err();
                assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe);
                42
            });
            std::process::exit(status);
        }
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "entry::tests::sigpipe_is_ignored_and_a_closed_stdin_is_dev_null",
        ])
        .env(CHILD, "1");
        // SAFETY: close(2) is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::close(0);
                Ok(())
            });
        }
        let st = cmd.status().unwrap();
        assert_eq!(st.signal(), None, "killed: {st}");
        assert_eq!(st.code(), Some(42), "{st}");
    }
}
