//! Named network namespaces (`/run/netns/<name>`, the `ip netns` convention),
//! made with unshare + bind mount rather than by running `ip`.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};

pub const NETNS_DIR: &str = "/run/netns";

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("netns {path}: {op}: {source}")]
    Sys {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("netns {path}: the thread working in it panicked")]
    Panicked { path: PathBuf },
}

fn sys(path: &Path, op: &'static str) -> impl FnOnce(io::Error) -> NetnsError {
    let path = path.to_path_buf();
    move |source| NetnsError::Sys { path, op, source }
}

/// A named network namespace; deleted by `delete` or on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
    path: PathBuf,
    deleted: bool,
}

impl Netns {
    /// Creates `/run/netns/<name>` holding a new network namespace with `lo` up.
    pub fn create(name: &str) -> Result<Netns, NetnsError> {
        let dir = Path::new(NETNS_DIR);
        fs::create_dir_all(dir).map_err(sys(dir, "create directory"))?;
        let path = dir.join(name);
        File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(sys(&path, "create mount point"))?;
        let ns = Netns {
            name: name.to_string(),
            path: path.clone(),
            deleted: false,
        };
        // unshare() moves only the calling thread, so do it on a thread that
        // exits afterwards; the bind mount keeps the namespace alive.
        let p = path.clone();
        std::thread::spawn(move || -> Result<(), NetnsError> {
            unshare(CloneFlags::CLONE_NEWNET).map_err(|e| sys(&p, "unshare")(e.into()))?;
            mount(
                Some("/proc/thread-self/ns/net"),
                &p,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(|e| sys(&p, "bind mount")(e.into()))?;
            set_lo_up().map_err(sys(&p, "set lo up"))
        })
        .join()
        .map_err(|_| NetnsError::Panicked { path: path.clone() })??;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on a thread that has entered this namespace.
    pub fn run_in<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, NetnsError> {
        run_in_path(&self.path, f)
    }

    pub fn delete(&mut self) -> Result<(), NetnsError> {
        if self.deleted {
            return Ok(());
        }
        self.deleted = true;
        delete_path(&self.path)
    }
}

impl Drop for Netns {
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
        Err(e) => return Err(sys(path, "unmount")(e.into())),
    }
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(sys(path, "remove")(e)),
    }
}

/// Runs `f` on a fresh thread inside the namespace at `path`.
pub fn run_in_path<T: Send + 'static>(
    path: &Path,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, NetnsError> {
    let file = File::open(path).map_err(sys(path, "open"))?;
    let p = path.to_path_buf();
    std::thread::spawn(move || -> Result<T, NetnsError> {
        setns(file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|e| sys(&p, "setns")(e.into()))?;
        Ok(f())
    })
    .join()
    .map_err(|_| NetnsError::Panicked {
        path: path.to_path_buf(),
    })?
}

/// Starts a thread that enters the namespace at `path` and runs `f` there.
pub fn spawn_in(
    path: &Path,
    name: &str,
    f: impl FnOnce() + Send + 'static,
) -> Result<std::thread::JoinHandle<()>, NetnsError> {
    let file = File::open(path).map_err(sys(path, "open"))?;
    let p = path.to_path_buf();
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            if let Err(e) = setns(file.as_fd(), CloneFlags::CLONE_NEWNET) {
                tracing::error!("netns {}: setns: {e}", p.display());
                return;
            }
            f()
        })
        .map_err(sys(path, "spawn thread"))
}

/// Names of the namespaces under /run/netns starting with `prefix`.
pub fn list(prefix: &str) -> Vec<String> {
    let Ok(rd) = fs::read_dir(NETNS_DIR) else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// Brings `lo` up in the calling thread's namespace (SIOCSIFFLAGS).
fn set_lo_up() -> io::Result<()> {
    // SAFETY: plain socket/ioctl calls on a zeroed ifreq we own.
    unsafe {
        let s = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if s < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (i, b) in b"lo\0".iter().enumerate() {
            ifr.ifr_name[i] = *b as libc::c_char;
        }
        let mut r = libc::ioctl(s, libc::SIOCGIFFLAGS, &mut ifr);
        if r == 0 {
            ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            r = libc::ioctl(s, libc::SIOCSIFFLAGS, &ifr);
        }
        let err = io::Error::last_os_error();
        libc::close(s);
        if r < 0 {
            return Err(err);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns_inode(path: &str) -> u64 {
        use std::os::unix::fs::MetadataExt;
        fs::metadata(path).unwrap().ino()
    }

    #[test]
    fn create_enter_delete() {
        let name = format!("bvtest-{}", std::process::id());
        let mut ns = Netns::create(&name).expect("create netns (run as root)");
        let inner = ns.run_in(|| ns_inode("/proc/thread-self/ns/net")).unwrap();
        assert_ne!(inner, ns_inode("/proc/self/ns/net"));
        assert!(list("bvtest-").contains(&name));
        ns.delete().unwrap();
        assert!(!Path::new(NETNS_DIR).join(&name).exists());
    }
}
