//! One owner per directory: an exclusive flock(2) on a lock file inside it,
//! holding the owner's pid. Every daemon and runtime that owns a directory
//! (the NIC's state and socket directories, a page-pool server's socket, a
//! runtime's state directory, `burstvm services`) takes one for its lifetime.
//!
//! The kernel drops the lock when the owner's last descriptor of the file
//! closes — at the latest when the process dies, also by SIGKILL — so a
//! crashed owner never blocks its successor, and a holder is alive by
//! construction: no pid in `/proc` is trusted (a pid may be reused, a zombie
//! keeps its pid). The pid in the file only names the holder in messages and
//! tells a reaper that an owner had finished taking the lock.
//!
//! The descriptor is close-on-exec: a child the owner spawns never inherits
//! the lock (it would outlive its owner).

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long `acquire` keeps trying while another descriptor holds the lock:
/// an owner between its lock and its pid write, a prober (`take_over`) or a
/// killed owner the kernel has not finished closing hold it that briefly.
/// A live owner holds it for good and is named after this.
const CONTENDED_FOR: Duration = Duration::from_secs(1);

/// Why a lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// A live process holds it: the directory has an owner.
    #[error("{} is held by {}", .path.display(), holder(*.pid))]
    Held { path: PathBuf, pid: Option<u32> },
    #[error("lock file {}: {op}: {source}", .path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

fn holder(pid: Option<u32>) -> String {
    match pid {
        Some(pid) => format!("pid {pid}"),
        None => "a process that has not written its pid yet".into(),
    }
}

impl LockError {
    /// The pid of the live holder, when the error is `Held` and it is known.
    pub fn holder_pid(&self) -> Option<u32> {
        match self {
            LockError::Held { pid, .. } => *pid,
            LockError::Io { .. } => None,
        }
    }
}

/// An exclusive lock on `<dir>/<name>`, held until dropped (or the process
/// dies). Dropping it removes the lock file if it is still this one.
#[derive(Debug)]
pub struct DirLock {
    file: File,
    path: PathBuf,
    /// The pid the file held when a reaper took it over (`take_over`).
    previous: Option<u32>,
}

enum Try {
    Locked(File),
    Busy(File),
}

fn io_err<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(io::Error) -> LockError + 'a {
    move |source| LockError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

fn try_lock(file: File, path: &Path) -> Result<Try, LockError> {
    // SAFETY: flock(2) on a descriptor `file` owns; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(Try::Locked(file));
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Ok(Try::Busy(file));
    }
    Err(io_err(path, "flock")(e))
}

/// The pid written in the lock file (none while the file is empty).
fn read_pid(mut file: &File) -> Option<u32> {
    let mut s = String::new();
    file.rewind().ok()?;
    file.read_to_string(&mut s).ok()?;
    s.trim().parse().ok()
}

/// Whether `path` still names the file `file` is open on: an owner that
/// releases removes the file, and a lock taken on a removed file locks
/// nothing anybody else will open.
fn still_named(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

impl DirLock {
    /// Takes the lock `<dir>/<name>` (creating the file) and writes this
    /// process's pid into it. `Held` names the live holder's pid.
    pub fn acquire(dir: &Path, name: &str) -> Result<DirLock, LockError> {
        let path = dir.join(name);
        let deadline = Instant::now() + CONTENDED_FOR;
        loop {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o644)
                .open(&path)
                .map_err(io_err(&path, "open"))?;
            match try_lock(file, &path)? {
                Try::Locked(file) if still_named(&file, &path) => {
                    let mut lock = DirLock {
                        file,
                        path,
                        previous: None,
                    };
                    lock.write_pid()?;
                    return Ok(lock);
                }
                // Its owner removed it on release: open the new one.
                Try::Locked(_) => continue,
                Try::Busy(file) => {
                    if Instant::now() >= deadline {
                        return Err(LockError::Held {
                            pid: read_pid(&file),
                            path,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    /// For a reaper or a liveness probe: takes the lock of `<dir>/<name>`
    /// if its owner is gone, without creating the file. `Ok(None)`: there
    /// is no lock file. `Held`: a live owner has it. Otherwise the lock is
    /// ours; [`DirLock::previous_pid`] is the pid the dead owner wrote
    /// (`None`: the file is empty, its owner is still taking it or died
    /// before it wrote its pid).
    pub fn take_over(dir: &Path, name: &str) -> Result<Option<DirLock>, LockError> {
        let path = dir.join(name);
        let file = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(&path, "open")(e)),
        };
        match try_lock(file, &path)? {
            Try::Busy(file) => Err(LockError::Held {
                pid: read_pid(&file),
                path,
            }),
            Try::Locked(file) => Ok(Some(DirLock {
                previous: read_pid(&file),
                file,
                path,
            })),
        }
    }

    fn write_pid(&mut self) -> Result<(), LockError> {
        let pid = format!("{}\n", std::process::id());
        self.file
            .set_len(0)
            .map_err(io_err(&self.path, "truncate"))?;
        self.file.rewind().map_err(io_err(&self.path, "seek"))?;
        self.file
            .write_all(pid.as_bytes())
            .map_err(io_err(&self.path, "write pid"))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// See [`DirLock::take_over`].
    pub fn previous_pid(&self) -> Option<u32> {
        self.previous
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Removed before the lock goes (closing the file): a successor that
        // opened it meanwhile sees it unnamed and opens a new one.
        if still_named(&self.file, &self.path) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("dirlock-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_second_owner_is_refused_with_the_first_ones_pid() {
        let d = dir("second");
        let a = DirLock::acquire(&d, "x.lock").unwrap();
        let e = DirLock::acquire(&d, "x.lock").unwrap_err();
        assert_eq!(e.holder_pid(), Some(std::process::id()), "{e}");
        assert!(e
            .to_string()
            .contains(&format!("pid {}", std::process::id())));
        assert!(matches!(
            DirLock::take_over(&d, "x.lock"),
            Err(LockError::Held { .. })
        ));
        drop(a);
        assert!(!d.join("x.lock").exists(), "released: the file is removed");
        let b = DirLock::acquire(&d, "x.lock").unwrap();
        drop(b);
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A holder killed with SIGKILL leaves its file and pid; the lock is free
    /// at once, and a reaper sees who held it.
    #[test]
    fn a_killed_owner_leaves_a_free_lock_naming_it() {
        let d = dir("killed");
        let path = d.join("x.lock");
        // A shell that takes the lock with flock(1) on its fd 9, says so, and
        // becomes `sleep` (same pid, fd 9 kept): an owner we can SIGKILL. The
        // pid is ours to write. Not polled with take_over: a take-over that
        // won the race would remove the file the shell is about to lock.
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(r#"exec 9>"$0" && flock -x 9 && echo locked && exec sleep 30"#)
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("sh");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line, "locked\n", "flock never held it");
        assert!(matches!(
            DirLock::take_over(&d, "x.lock"),
            Err(LockError::Held { .. })
        ));
        std::fs::write(&path, format!("{}\n", child.id())).unwrap();
        let e = DirLock::acquire(&d, "x.lock").unwrap_err();
        assert_eq!(e.holder_pid(), Some(child.id()), "{e}");
        child.kill().unwrap();
        child.wait().unwrap();
        let t = DirLock::take_over(&d, "x.lock")
            .unwrap()
            .expect("file kept");
        assert_eq!(t.previous_pid(), Some(child.id()));
        drop(t);
        assert!(DirLock::take_over(&d, "x.lock").unwrap().is_none());
        let a = DirLock::acquire(&d, "x.lock").unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap().trim(),
            std::process::id().to_string()
        );
        drop(a);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
