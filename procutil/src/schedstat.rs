//! The CPU time a thread has run, from its `schedstat` (first field: time on
//! a CPU in nanoseconds, steal excluded): the one reader of it for the
//! benches' per-thread and per-process CPU of other processes' threads; and
//! the calling thread's own, from its CPU-time clock ([`this_thread_ns`]).
//!
//! `/proc/PID/schedstat` is the thread-group leader's alone; a process's
//! CPU is the sum over `/proc/PID/task/*`, which is what [`live_threads_ns`]
//! reads. A thread that ends while the tasks are read is not counted, nor
//! one that ended before (`runtime::cpuacct::process_ns`, the process
//! CPU-time clock, counts those too).

use std::io;
use std::path::{Path, PathBuf};

/// A schedstat (or the task directory holding them) that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct SchedstatError {
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

fn err(path: &Path, source: io::Error) -> SchedstatError {
    SchedstatError {
        path: path.to_path_buf(),
        source,
    }
}

/// The time on a CPU (ns) of the task whose schedstat file is `path`.
pub fn read(path: &Path) -> Result<u64, SchedstatError> {
    let s = std::fs::read_to_string(path).map_err(|e| err(path, e))?;
    parse(&s).ok_or_else(|| {
        err(
            path,
            io::Error::new(io::ErrorKind::InvalidData, format!("unexpected {s:?}")),
        )
    })
}

fn parse(s: &str) -> Option<u64> {
    s.split_whitespace().next()?.parse().ok()
}

/// The calling thread's CPU time (ns), from its CPU-time clock (no file
/// read: cheap enough to take around every request a thread serves).
pub fn this_thread_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return 0;
    }
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// The time on a CPU (ns) of thread `tid` of this process.
pub fn own_thread_ns(tid: i32) -> Result<u64, SchedstatError> {
    read(Path::new(&format!("/proc/self/task/{tid}/schedstat")))
}

/// The time on a CPU (ns) of all live threads of process `pid`.
pub fn live_threads_ns(pid: u32) -> Result<u64, SchedstatError> {
    sum_tasks(pid, None)
}

/// The time on a CPU (ns) of the threads of process `pid` whose name
/// (`comm`, e.g. `vcpu0`) `pick` accepts.
pub fn named_threads_ns(pid: u32, pick: impl Fn(&str) -> bool) -> Result<u64, SchedstatError> {
    sum_tasks(pid, Some(&pick))
}

/// The threads (tids) of process `pid` whose name `pick` accepts: for a
/// caller that samples the same long-lived threads again and again
/// ([`threads_ns`]) without reading every thread's name each time.
pub fn named_threads(pid: u32, pick: impl Fn(&str) -> bool) -> Result<Vec<u32>, SchedstatError> {
    let dir = PathBuf::from(format!("/proc/{pid}/task"));
    let mut tids = Vec::new();
    for task in std::fs::read_dir(&dir).map_err(|e| err(&dir, e))? {
        let task = task.map_err(|e| err(&dir, e))?;
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        // Gone meanwhile: not listed.
        if let Ok(comm) = std::fs::read_to_string(task.path().join("comm")) {
            if pick(comm.trim_end()) {
                tids.push(tid);
            }
        }
    }
    Ok(tids)
}

/// The time on a CPU (ns) of threads `tids` of process `pid`; an error
/// (NotFound or ESRCH) if one of them has ended.
pub fn threads_ns(pid: u32, tids: &[u32]) -> Result<u64, SchedstatError> {
    tids.iter().try_fold(0, |sum, tid| {
        Ok(sum + read(Path::new(&format!("/proc/{pid}/task/{tid}/schedstat")))?)
    })
}

fn sum_tasks(pid: u32, pick: Option<&dyn Fn(&str) -> bool>) -> Result<u64, SchedstatError> {
    let dir = PathBuf::from(format!("/proc/{pid}/task"));
    let mut total = 0;
    for task in std::fs::read_dir(&dir).map_err(|e| err(&dir, e))? {
        let task = task.map_err(|e| err(&dir, e))?.path();
        if let Some(pick) = pick {
            // Gone meanwhile: not counted.
            let Ok(comm) = std::fs::read_to_string(task.join("comm")) else {
                continue;
            };
            if !pick(comm.trim_end()) {
                continue;
            }
        }
        match read(&task.join("schedstat")) {
            Ok(ns) => total += ns,
            Err(e) if e.source.kind() == io::ErrorKind::NotFound => {}
            // ESRCH: the thread exited between readdir and the read.
            Err(e) if e.source.raw_os_error() == Some(libc::ESRCH) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn burn(ms: u64) {
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed().as_millis() < u128::from(ms) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
    }

    /// A named thread's CPU counts toward its name and the process, and a
    /// name nobody has counts nothing.
    #[test]
    fn threads_are_counted_by_name_and_together() {
        let me = std::process::id();
        let (tx, rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let h = std::thread::Builder::new()
            .name("sched-burner".into())
            .spawn(move || {
                burn(30);
                tx.send(()).unwrap();
                let _ = done_rx.recv();
            })
            .unwrap();
        rx.recv().unwrap();
        let named = named_threads_ns(me, |c| c == "sched-burner").unwrap();
        assert!(
            named >= 20_000_000,
            "the thread burnt 30 ms, counted {named} ns"
        );
        assert!(live_threads_ns(me).unwrap() >= named);
        assert_eq!(named_threads_ns(me, |c| c == "no-such-thread").unwrap(), 0);
        // The same thread found once by name, then sampled by its tid.
        let tids = named_threads(me, |c| c == "sched-burner").unwrap();
        assert_eq!(tids.len(), 1);
        assert!(threads_ns(me, &tids).unwrap() >= named);
        assert!(named_threads(me, |c| c == "no-such-thread")
            .unwrap()
            .is_empty());
        done_tx.send(()).unwrap();
        h.join().unwrap();
        // Once it has ended, sampling it is an error, not a silent 0.
        let t = std::time::Instant::now();
        while threads_ns(me, &tids).is_ok() {
            assert!(t.elapsed().as_secs() < 10, "the thread never went away");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    #[test]
    fn a_missing_process_or_bad_file_names_the_path() {
        let e = live_threads_ns(u32::MAX).unwrap_err();
        assert!(
            e.to_string().contains(&format!("/proc/{}/task", u32::MAX)),
            "{e}"
        );
        let f = std::env::temp_dir().join(format!("schedstat-test-{}", std::process::id()));
        std::fs::write(&f, "x y z\n").unwrap();
        let e = read(&f).unwrap_err();
        assert_eq!(e.source.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains(&f.display().to_string()), "{e}");
        std::fs::remove_file(&f).unwrap();
        assert_eq!(parse("123 4 5\n"), Some(123));
    }
}
