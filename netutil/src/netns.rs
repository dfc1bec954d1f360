//! Network namespaces: entering one on a thread of its own (the calling
//! thread, and so the rest of the process, stays where it is), and named
//! namespaces under /run/netns (the `ip netns` convention) made with
//! unshare + bind mount rather than by running `ip`.

use std::fs::{self, File};
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};

/// Where named namespaces are bind-mounted.
pub const NETNS_DIR: &str = "/run/netns";

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("network namespace {path}: does not exist")]
    Gone { path: PathBuf },
    #[error("network namespace {path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("network namespace {path}: the thread working in it panicked")]
    Panicked { path: PathBuf },
    /// The path exists but is not a network namespace (a regular file, a
    /// directory, another kind of namespace).
    #[error("{path} is not a network namespace: {why}")]
    NotNetns { path: PathBuf, why: String },
}

/// `NS_GET_NSTYPE` (linux/nsfs.h): the CLONE_NEW* type of a namespace fd;
/// ENOTTY for anything that is not a namespace.
const NS_GET_NSTYPE: libc::c_ulong = 0xb703;

/// Checks that `file` (opened from `path`) is a network namespace.
fn check_netns(path: &Path, file: &File) -> Result<(), NetnsError> {
    use std::os::fd::AsRawFd;
    // SAFETY: an argument-less ioctl on a valid fd we own.
    let t = unsafe { libc::ioctl(file.as_raw_fd(), NS_GET_NSTYPE as _) };
    let not = |why: String| NetnsError::NotNetns {
        path: path.to_path_buf(),
        why,
    };
    if t < 0 {
        let e = io::Error::last_os_error();
        return Err(if e.raw_os_error() == Some(libc::ENOTTY) {
            let kind = match file.metadata() {
                Ok(m) if m.is_dir() => "a directory",
                Ok(m) if m.is_file() => "a regular file",
                _ => "not a namespace file",
            };
            not(kind.into())
        } else {
            // Another failure proves nothing about the file: keep the cause.
            NetnsError::Io {
                path: path.to_path_buf(),
                op: "NS_GET_NSTYPE",
                source: e,
            }
        });
    }
    if t != libc::CLONE_NEWNET {
        return Err(not(format!("a namespace of another type ({t:#x})")));
    }
    Ok(())
}

fn io_err(path: &Path, op: &'static str) -> impl FnOnce(io::Error) -> NetnsError {
    let path = path.to_path_buf();
    move |source| NetnsError::Io { path, op, source }
}

fn nix_err(path: &Path, op: &'static str) -> impl FnOnce(nix::Error) -> NetnsError {
    let path = path.to_path_buf();
    move |e| NetnsError::Io {
        path,
        op,
        source: e.into(),
    }
}

/// The path of the named namespace `name` (absolute paths stay as they are).
pub fn named_path(name: &str) -> PathBuf {
    if name.starts_with('/') {
        PathBuf::from(name)
    } else {
        Path::new(NETNS_DIR).join(name)
    }
}

/// An open network namespace (a file that refers to it).
#[derive(Debug)]
pub struct Netns {
    path: PathBuf,
    file: File,
}

impl Netns {
    pub fn open(path: &Path) -> Result<Netns, NetnsError> {
        match File::open(path) {
            Ok(file) => {
                check_netns(path, &file)?;
                Ok(Netns {
                    path: path.to_path_buf(),
                    file,
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err(NetnsError::Gone {
                path: path.to_path_buf(),
            }),
            Err(e) => Err(io_err(path, "open")(e)),
        }
    }

    /// `/run/netns/<name>`, or `name` itself when it is a path.
    pub fn open_named(name: &str) -> Result<Netns, NetnsError> {
        Netns::open(&named_path(name))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether this is the namespace the calling thread is in.
    pub fn is_current(&self) -> Result<bool, NetnsError> {
        use std::os::unix::fs::MetadataExt;
        let ours = fs::metadata("/proc/thread-self/ns/net").map_err(io_err(&self.path, "stat"))?;
        let this = self.file.metadata().map_err(io_err(&self.path, "stat"))?;
        Ok((ours.dev(), ours.ino()) == (this.dev(), this.ino()))
    }

    /// Runs `f` on a scoped thread inside this namespace and returns its
    /// result; a panic in `f` is resumed on the calling thread.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T, NetnsError> {
        std::thread::scope(|s| {
            s.spawn(|| {
                setns(&self.file, CloneFlags::CLONE_NEWNET)
                    .map_err(nix_err(&self.path, "setns"))?;
                Ok(f())
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }

    /// Runs `f` on the calling thread inside this namespace, then moves the
    /// thread back to the namespace it was in, also when `f` panics. No
    /// thread is started: for a short single-purpose process (a CNI plugin)
    /// or a thread that serves one call at a time (the CNI server's workers),
    /// where starting one is a fair part of the work. Nothing else may run
    /// on the thread meanwhile (no async executor on it). A thread that
    /// cannot go back aborts its process: its next call would run in this
    /// sandbox's namespace.
    pub fn run_here<T>(&self, f: impl FnOnce() -> T) -> Result<T, NetnsError> {
        let home = File::open("/proc/thread-self/ns/net")
            .map_err(io_err(&self.path, "open the calling thread's namespace"))?;
        setns(&self.file, CloneFlags::CLONE_NEWNET).map_err(nix_err(&self.path, "setns"))?;
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        if let Err(e) = setns(&home, CloneFlags::CLONE_NEWNET) {
            // The thread would go on in another sandbox's namespace.
            eprintln!(
                "network namespace {}: cannot return the thread to its own: {e}",
                self.path.display()
            );
            std::process::abort();
        }
        r.map_err(|p| std::panic::resume_unwind(p))
    }

    /// Starts a named thread that enters this namespace and runs `f` there.
    pub fn spawn(
        &self,
        thread_name: &str,
        f: impl FnOnce() + Send + 'static,
    ) -> Result<std::thread::JoinHandle<()>, NetnsError> {
        let file = self.file.try_clone().map_err(io_err(&self.path, "dup"))?;
        let path = self.path.clone();
        std::thread::Builder::new()
            .name(thread_name.to_string())
            .spawn(move || {
                if let Err(e) = setns(&file, CloneFlags::CLONE_NEWNET) {
                    tracing::error!("netns {}: setns: {e}", path.display());
                    return;
                }
                f()
            })
            .map_err(io_err(&self.path, "spawn thread"))
    }
}

impl AsFd for Netns {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

/// A named namespace this process created; deleted by `delete` or on drop.
#[derive(Debug)]
pub struct NamedNetns {
    name: String,
    ns: Netns,
    deleted: bool,
}

impl NamedNetns {
    /// Creates `/run/netns/<name>` holding a new namespace with `lo` up.
    pub fn create(name: &str) -> Result<NamedNetns, NetnsError> {
        let dir = Path::new(NETNS_DIR);
        fs::create_dir_all(dir).map_err(io_err(dir, "create directory"))?;
        let path = dir.join(name);
        File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io_err(&path, "create mount point"))?;
        // From here on a failure removes the mount point again.
        let made = std::thread::scope(|s| {
            // unshare() moves only the calling thread, so do it on a thread
            // that ends afterwards; the bind mount keeps the namespace alive.
            s.spawn(|| -> Result<(), NetnsError> {
                unshare(CloneFlags::CLONE_NEWNET).map_err(nix_err(&path, "unshare"))?;
                mount(
                    Some("/proc/thread-self/ns/net"),
                    &path,
                    None::<&str>,
                    MsFlags::MS_BIND,
                    None::<&str>,
                )
                .map_err(nix_err(&path, "bind mount"))?;
                let mut nl = crate::Rtnl::open().map_err(io_err(&path, "open rtnetlink"))?;
                nl.set_up_by_name("lo", true)
                    .map_err(io_err(&path, "set lo up"))
            })
            .join()
            .map_err(|_| NetnsError::Panicked { path: path.clone() })?
        });
        if let Err(e) = made.and_then(|()| Netns::open(&path)) {
            let _ = delete_path(&path);
            return Err(e);
        }
        Ok(NamedNetns {
            name: name.to_string(),
            ns: Netns::open(&path)?,
            deleted: false,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> &Path {
        self.ns.path()
    }

    pub fn netns(&self) -> &Netns {
        &self.ns
    }

    /// See [`Netns::run`].
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T, NetnsError> {
        self.ns.run(f)
    }

    pub fn delete(&mut self) -> Result<(), NetnsError> {
        if self.deleted {
            return Ok(());
        }
        self.deleted = true;
        delete_path(self.ns.path())
    }
}

impl Drop for NamedNetns {
    fn drop(&mut self) {
        if let Err(e) = self.delete() {
            tracing::warn!("{e}");
        }
    }
}

/// Unmounts and removes a `/run/netns/<name>` file (idempotent).
pub fn delete_path(path: &Path) -> Result<(), NetnsError> {
    match umount2(path, MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {}
        Err(e) => return Err(nix_err(path, "unmount")(e)),
    }
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(path, "remove")(e)),
    }
}

/// Names of the namespaces under /run/netns that start with `prefix`.
pub fn list(prefix: &str) -> Vec<String> {
    let Ok(rd) = fs::read_dir(NETNS_DIR) else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

#[cfg(test)]
mod not_netns_tests {
    use super::*;

    #[test]
    fn only_network_namespaces_open() {
        assert!(Netns::open(Path::new("/proc/self/ns/net")).is_ok());
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("regular");
        fs::write(&f, b"x").unwrap();
        for (p, want) in [
            (f.as_path(), "regular file"),
            (d.path(), "directory"),
            (Path::new("/proc/self/ns/uts"), "another type"),
        ] {
            match Netns::open(p) {
                Err(e @ NetnsError::NotNetns { .. }) => {
                    assert!(e.to_string().contains(want), "{e}")
                }
                other => panic!("{}: {:?}", p.display(), other.map(|n| n.path)),
            }
        }
        assert!(matches!(
            Netns::open(&d.path().join("missing")),
            Err(NetnsError::Gone { .. })
        ));
    }
}
