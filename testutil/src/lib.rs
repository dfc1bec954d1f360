//! Helpers shared by the workspace's tests. Only ever a dev-dependency.
#![allow(clippy::unwrap_used)] // test support: a failed step fails the test

#[cfg(feature = "nic")]
pub mod nic;
pub mod tap;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// `/tmp/<prefix><pid>-<name>`, emptied and created: a test's own directory (pid and name
/// keep it apart from every other test and run).
pub fn fresh_dir(prefix: &str, name: &str) -> PathBuf {
    let dir = PathBuf::from(format!("/tmp/{prefix}{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    dir
}

/// Kills and reaps the child when the test ends, also on failure.
#[derive(Debug)]
pub struct ChildGuard(pub Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits (bounded by `limit`) for the child to exit.
pub fn wait_exit(child: &mut Child, limit: Duration) -> ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(t.elapsed() < limit, "child {} did not exit", child.id());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `cmd` with `input` on its stdin to its end and returns its output;
/// one still running after `limit` is killed and fails the test, with what
/// it printed.
pub fn run_bounded(cmd: &mut Command, input: &[u8], limit: Duration) -> Output {
    use std::io::Write;
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    child.stdin.take().unwrap().write_all(input).unwrap();
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!(
                "{cmd:?} still running after {limit:?}: {} / {}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.wait_with_output().unwrap()
}

/// Runs `cmd` (a second daemon on a directory a first one, pid `holder`,
/// owns) and checks that it is refused: it exits non-zero within `limit`
/// (killed if not) with a message on stderr naming the holder's pid, which
/// is returned.
pub fn assert_refused_owner(cmd: &mut Command, holder: u32, limit: Duration) -> String {
    use std::io::Read;
    let mut child = ChildGuard(
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}")),
    );
    let st = wait_exit(&mut child.0, limit);
    let mut err = String::new();
    if let Some(mut e) = child.0.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    assert!(!st.success(), "second owner accepted ({st}): {err}");
    assert!(
        err.contains(&format!("pid {holder}")),
        "the refusal does not name the first owner (pid {holder}): {err}"
    );
    err
}

/// Calls `check` every 10 ms until it returns `Some`, for `limit` at most; then
/// fails with `what` and the last `Err` description. The one bounded poll loop
/// of the tests: wait for a condition, never sleep for a guessed time.
pub fn poll_until<T>(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> Result<T, String>,
) -> T {
    let t0 = Instant::now();
    loop {
        match check() {
            Ok(v) => return v,
            Err(last) => assert!(t0.elapsed() < limit, "{what} not within {limit:?}: {last}"),
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits (10 s at most) until every thread of `pid` is in job-control stop
/// (state `T`). kill(SIGSTOP) returns before that: the kernel wakes one thread,
/// which then stops the others, and until it runs the others keep serving.
pub fn wait_stopped(pid: u32) {
    poll_until(
        &format!("SIGSTOP of pid {pid}"),
        Duration::from_secs(10),
        || {
            let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
                .map_err(|e| format!("/proc/{pid}/task: {e}"))?;
            let mut running = Vec::new();
            for t in tasks.flatten() {
                let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                // The state is the first field after the parenthesised comm.
                let state = stat
                    .rsplit_once(')')
                    .and_then(|(_, r)| r.split_whitespace().next());
                if state != Some("T") {
                    running.push(format!("{:?}={state:?}", t.file_name()));
                }
            }
            if running.is_empty() {
                Ok(())
            } else {
                Err(format!("threads not stopped: {running:?}"))
            }
        },
    )
}

/// Stops a daemon the test started: SIGTERM, up to 10 s to exit, then SIGKILL.
pub fn stop_child(child: &mut Child) {
    // SAFETY: signalling our own child by its pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let end = Instant::now() + Duration::from_secs(10);
    while child.try_wait().ok().flatten().is_none() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Writes `contents` (a script with its `#!` line) at `path`, mode 0755.
///
/// The file is written by a `cp` child, never by this process: test threads
/// fork concurrently, and a child forked while this process held a write fd to
/// the script keeps that fd until its own exec, so exec'ing the script would
/// fail with ETXTBSY now and then.
pub fn write_executable(path: &Path, contents: &str) {
    let src = path.with_extension("src");
    std::fs::write(&src, contents).unwrap_or_else(|e| panic!("write {}: {e}", src.display()));
    let status = Command::new("cp")
        .arg(&src)
        .arg(path)
        .status()
        .unwrap_or_else(|e| panic!("cp {} {}: {e}", src.display(), path.display()));
    assert!(
        status.success(),
        "cp {} {}: {status}",
        src.display(),
        path.display()
    );
    let _ = std::fs::remove_file(&src);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

#[cfg(test)]
mod tests {
    #[test]
    fn scripts_run_at_once_under_concurrent_forks() {
        let dir = std::env::temp_dir().join(format!("testutil-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::thread::scope(|s| {
            for t in 0..4 {
                let dir = &dir;
                s.spawn(move || {
                    for i in 0..20 {
                        let p = dir.join(format!("s{t}-{i}"));
                        super::write_executable(&p, &format!("#!/bin/sh\necho {t}-{i}\n"));
                        let out = std::process::Command::new(&p).output().unwrap();
                        assert_eq!(
                            String::from_utf8_lossy(&out.stdout).trim(),
                            format!("{t}-{i}")
                        );
                    }
                });
            }
        });
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
