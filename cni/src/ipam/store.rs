//! The lease store, in the reference `host-local` plugin's on-disk format
//! (backend/disk, v1.9.1), so that the two can share a data directory:
//! `<dataDir>/<network>/<address>` holds `<container id>\r\n<ifname>`,
//! `last_reserved_ip.<range set index>` the set's last reservation, and
//! every change happens under an exclusive flock(2) of `<network>/lock`
//! (host-local's go-filemutex takes the same lock).

use std::cell::RefCell;
use std::ffi::{CStr, CString};
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg, OFlag};
use nix::sys::stat::Mode;

use super::known;

/// host-local's default data directory.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/cni/networks";
const LAST_RESERVED: &str = "last_reserved_ip.";
const LINE_BREAK: &str = "\r\n";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("IPAM store {}: {op}: {source}", .path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    /// Another process held the lock for all of `waited`.
    #[error("IPAM store {} stayed locked by another plugin for {waited:?}", .path.display())]
    Busy { path: PathBuf, waited: Duration },
}

fn io_err<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

/// One network's leases, locked for as long as the value lives.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    /// `dir`, open once: listed through it (a listing rewinds it when done)
    /// and leases read relative to it, with no walk of the full path.
    dir_fd: RefCell<Dir>,
    /// `dir`'s (device, inode), under which this process remembers its
    /// files (`known`); None unless `dir` is on tmpfs, whose inode numbers
    /// are not reused (ext4's are, at once: a name and inode would not tell
    /// a lease from the next one).
    dir_id: Option<(u64, u64)>,
    _lock: Flock<File>,
}

/// Who holds a lease: an attachment (container id and interface).
#[derive(Debug, Clone, Copy)]
pub struct Owner<'a> {
    pub id: &'a str,
    pub ifname: &'a str,
}

impl Owner<'_> {
    fn key(&self) -> String {
        format!("{}{LINE_BREAK}{}", self.id.trim(), self.ifname)
    }

    /// Whether a lease file's text names this owner; `legacy` also accepts
    /// the id alone (files of host-local before 0.8 carry no ifname).
    fn owns(&self, text: &str, legacy: bool) -> bool {
        let t = text.trim();
        t == self.key() || (legacy && t == self.id.trim())
    }
}

/// A lease file's owner as (container id, ifname); `None` ifname for the
/// old id-only format.
pub fn parse_owner(text: &str) -> (&str, Option<&str>) {
    match text.trim().split_once(LINE_BREAK) {
        Some((id, ifname)) => (id, Some(ifname)),
        None => (text.trim(), None),
    }
}

/// A lease file's text, `name` opened in the network's directory `dir`.
/// Every ADD reads every lease of its network (the one-lease-per-attachment
/// check, as host-local does), so this is one open relative to the
/// directory (no walk of the full path per lease), one read and one close:
/// no size query, no second read for the end of a file shorter than the buffer.
fn read_lease(dir: RawFd, name: &CStr) -> io::Result<String> {
    let fd = nix::fcntl::openat(
        Some(dir),
        name,
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(io::Error::from)?;
    // SAFETY: openat just returned this descriptor; nothing else owns it.
    let mut f = unsafe { File::from_raw_fd(fd) };
    let mut buf = [0u8; 512];
    let n = f.read(&mut buf)?;
    let mut bytes = buf[..n].to_vec();
    if n == buf.len() {
        f.read_to_end(&mut bytes)?;
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

impl Store {
    /// Opens `<data_dir>/<network>` (created if missing) and takes its lock,
    /// waiting at most `wait` for another holder to let go: a plugin stuck
    /// while holding it must not hang every ADD behind it.
    pub fn open(data_dir: &Path, network: &str, wait: Duration) -> Result<Store, StoreError> {
        let dir = data_dir.join(network);
        std::fs::create_dir_all(&dir).map_err(io_err(&dir, "create the directory"))?;
        let dir_fd = Dir::open(
            &dir,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_err(&dir, "open the directory")(e.into()))?;
        let st = nix::sys::stat::fstat(dir_fd.as_raw_fd())
            .map_err(|e| io_err(&dir, "stat the directory")(e.into()))?;
        let on_tmpfs = nix::sys::statfs::statfs(&dir)
            .is_ok_and(|f| f.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC);
        let dir_id = on_tmpfs.then_some((st.st_dev, st.st_ino));
        let dir_fd = RefCell::new(dir_fd);
        let path = dir.join("lock");
        let file = OpenOptions::new()
            .read(true)
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path)
            .map_err(io_err(&path, "open the lock file"))?;
        let deadline = Instant::now() + wait;
        // Polled, not a blocking flock, so that the wait is bounded. A burst's
        // ADDs hold the lock well under a millisecond each: retries at most
        // 1 ms apart cost one system call each.
        let mut pause = Duration::from_micros(50);
        let mut file = file;
        loop {
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) => {
                    return Ok(Store {
                        dir,
                        dir_fd,
                        dir_id,
                        _lock: lock,
                    })
                }
                Err((f, Errno::EWOULDBLOCK)) if Instant::now() < deadline => {
                    file = f;
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(1));
                }
                Err((_, Errno::EWOULDBLOCK)) => {
                    return Err(StoreError::Busy { path, waited: wait })
                }
                Err((_, e)) => return Err(io_err(&path, "flock")(e.into())),
            }
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Takes `ip` for `owner` unless a lease file for it exists (then
    /// false), and records it as range set `set`'s last reservation.
    pub fn reserve(&self, owner: Owner, ip: IpAddr, set: usize) -> Result<bool, StoreError> {
        let path = self.dir.join(ip.to_string());
        let mut f = match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(false),
            Err(e) => return Err(io_err(&path, "create the lease")(e)),
        };
        if let Err(e) = f.write_all(owner.key().as_bytes()) {
            let _ = std::fs::remove_file(&path);
            return Err(io_err(&path, "write the lease")(e));
        }
        let last = self.dir.join(format!("{LAST_RESERVED}{set}"));
        std::fs::write(&last, ip.to_string()).map_err(io_err(&last, "write"))?;
        Ok(true)
    }

    /// Range set `set`'s last reservation, if it has one that parses.
    pub fn last_reserved(&self, set: usize) -> Option<IpAddr> {
        std::fs::read_to_string(self.dir.join(format!("{LAST_RESERVED}{set}")))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Every lease: its address and its file's text. Files whose names are
    /// not addresses (the lock, the last reservations) are not leases.
    pub fn leases(&self) -> Result<Vec<(IpAddr, String)>, StoreError> {
        Ok(self
            .list(None)?
            .into_iter()
            .map(|(ip, _, text)| (ip, text))
            .collect())
    }

    /// As `leases`, with each file's name; with `known`, a file whose name
    /// and inode it holds is not read again, and `known` becomes what this
    /// listing saw.
    fn list(
        &self,
        mut known: Option<&mut known::Files>,
    ) -> Result<Vec<(IpAddr, CString, String)>, StoreError> {
        let mut out = Vec::new();
        let mut seen = known::Files::new();
        let mut dir = self.dir_fd.borrow_mut();
        let fd = dir.as_raw_fd();
        for e in dir.iter() {
            let e = e.map_err(|e| io_err(&self.dir, "read the directory")(e.into()))?;
            let name = e.file_name();
            let Some(ip) = name.to_str().ok().and_then(|n| n.parse::<IpAddr>().ok()) else {
                continue;
            };
            let key = name.to_bytes();
            let text = match known.as_deref_mut().and_then(|k| k.remove(key)) {
                Some((ino, text)) if ino == e.ino() => text,
                _ => match read_lease(fd, name) {
                    Ok(text) => text,
                    // Released between the listing and the read: not a lease.
                    Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
                    Err(err) => {
                        return Err(io_err(&self.dir.join(ip.to_string()), "read the lease")(
                            err,
                        ))
                    }
                },
            };
            if known.is_some() {
                seen.insert(key.to_vec(), (e.ino(), text.clone()));
            }
            out.push((ip, name.to_owned(), text));
        }
        if let Some(k) = known {
            *k = seen;
        }
        Ok(out)
    }

    /// The addresses `owner` holds (old id-only leases of its id included).
    /// On tmpfs only the files that are new since this process last listed
    /// the directory are read (`known`), and a lease found for `owner` is
    /// read again before it counts; elsewhere every file is read.
    pub fn owned_by(&self, owner: Owner) -> Result<Vec<IpAddr>, StoreError> {
        let Some(id) = self.dir_id else {
            return Ok(self
                .leases()?
                .into_iter()
                .filter(|(_, t)| owner.owns(t, true))
                .map(|(ip, _)| ip)
                .collect());
        };
        let mut files = known::take(id);
        let listed = self.list(Some(&mut files));
        known::put(id, files);
        let fd = self.dir_fd.borrow().as_raw_fd();
        let mut out = Vec::new();
        for (ip, name, _) in listed?.into_iter().filter(|(_, _, t)| owner.owns(t, true)) {
            match read_lease(fd, &name) {
                Ok(t) if owner.owns(&t, true) => out.push(ip),
                Ok(_) => {}
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(err) => {
                    return Err(io_err(&self.dir.join(ip.to_string()), "read the lease")(
                        err,
                    ))
                }
            }
        }
        Ok(out)
    }

    /// Removes `owner`'s leases, or, when it has none in the current
    /// format, the old id-only ones of its id (as host-local does).
    /// Returns the addresses released.
    pub fn release(&self, owner: Owner) -> Result<Vec<IpAddr>, StoreError> {
        let leases = self.leases()?;
        let mut gone = self.remove_where(&leases, |t| owner.owns(t, false))?;
        if gone.is_empty() {
            gone = self.remove_where(&leases, |t| owner.owns(t, true))?;
        }
        Ok(gone)
    }

    /// Removes the leases whose text `doomed` accepts; returns their addresses.
    pub fn remove_where(
        &self,
        leases: &[(IpAddr, String)],
        doomed: impl Fn(&str) -> bool,
    ) -> Result<Vec<IpAddr>, StoreError> {
        let mut gone = Vec::new();
        for (ip, _) in leases.iter().filter(|(_, t)| doomed(t)) {
            let path = self.dir.join(ip.to_string());
            match std::fs::remove_file(&path) {
                Ok(()) => gone.push(*ip),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(&path, "remove the lease")(e)),
            }
        }
        Ok(gone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAIT: Duration = Duration::from_secs(5);

    fn owner<'a>(id: &'a str, ifname: &'a str) -> Owner<'a> {
        Owner { id, ifname }
    }

    #[test]
    fn reserve_writes_host_locals_files() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path(), "net", WAIT).unwrap();
        let ip: IpAddr = "10.0.0.5".parse().unwrap();
        assert!(s.reserve(owner("c1", "eth0"), ip, 0).unwrap());
        assert!(
            !s.reserve(owner("c2", "eth0"), ip, 0).unwrap(),
            "taken twice"
        );
        let dir = d.path().join("net");
        assert_eq!(
            std::fs::read_to_string(dir.join("10.0.0.5")).unwrap(),
            "c1\r\neth0"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("last_reserved_ip.0")).unwrap(),
            "10.0.0.5"
        );
        assert_eq!(s.last_reserved(0), Some(ip));
        assert_eq!(s.last_reserved(1), None);
        assert_eq!(s.leases().unwrap(), vec![(ip, "c1\r\neth0".to_string())]);
        // A lease longer than the first read is read whole.
        let long = "c".repeat(700);
        let ip2: IpAddr = "10.0.0.6".parse().unwrap();
        assert!(s.reserve(owner(&long, "eth0"), ip2, 0).unwrap());
        assert_eq!(s.owned_by(owner(&long, "eth0")).unwrap(), vec![ip2]);
    }

    #[test]
    fn release_takes_the_owners_leases_and_old_id_only_ones_as_a_fallback() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path(), "net", WAIT).unwrap();
        let ips: Vec<IpAddr> = ["10.0.0.2", "10.0.0.3", "10.0.0.4", "fd00::2"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        s.reserve(owner("c1", "eth0"), ips[0], 0).unwrap();
        s.reserve(owner("c1", "eth1"), ips[1], 0).unwrap();
        s.reserve(owner("c1", "eth0"), ips[3], 1).unwrap();
        std::fs::write(s.dir().join(ips[2].to_string()), "c1\n").unwrap();
        assert_eq!(s.owned_by(owner("c1", "eth0")).unwrap().len(), 3);
        let mut gone = s.release(owner("c1", "eth0")).unwrap();
        gone.sort();
        assert_eq!(gone, vec![ips[0], ips[3]]);
        // Only the old-format lease of c1 is left for an ifname with none.
        assert_eq!(s.release(owner("c1", "eth2")).unwrap(), vec![ips[2]]);
        assert_eq!(s.release(owner("c1", "eth1")).unwrap(), vec![ips[1]]);
        assert!(s.leases().unwrap().is_empty());
        assert_eq!(parse_owner("c1\r\neth0"), ("c1", Some("eth0")));
        assert_eq!(parse_owner("c1"), ("c1", None));
    }

    /// The one-lease check reads only lease files it has not seen (by name
    /// and inode), and believes what it finds for an owner only as read again.
    #[test]
    fn owned_by_reads_only_new_lease_files() {
        let d = tempfile::tempdir_in("/dev/shm").unwrap();
        let s = Store::open(d.path(), "net", WAIT).unwrap();
        let ip = |k: u8| -> IpAddr { format!("10.0.0.{k}").parse().unwrap() };
        for k in 2..6 {
            s.reserve(owner(&format!("c{k}"), "eth0"), ip(k), 0)
                .unwrap();
        }
        assert_eq!(s.owned_by(owner("c3", "eth0")).unwrap(), vec![ip(3)]);
        // Rewritten in place (same inode; no writer does that): not read again.
        std::fs::write(s.dir().join("10.0.0.4"), "c9\r\neth0").unwrap();
        assert!(s.owned_by(owner("c9", "eth0")).unwrap().is_empty());
        // ... and what the remembered text claims is read again before it counts.
        assert!(s.owned_by(owner("c4", "eth0")).unwrap().is_empty());
        // Released and leased again (a new file): read.
        std::fs::remove_file(s.dir().join("10.0.0.5")).unwrap();
        s.reserve(owner("c7", "eth0"), ip(5), 0).unwrap();
        assert_eq!(s.owned_by(owner("c7", "eth0")).unwrap(), vec![ip(5)]);
        assert!(s.owned_by(owner("c5", "eth0")).unwrap().is_empty());
        // A new store on the same directory (the next ADD) knows the same.
        drop(s);
        let s = Store::open(d.path(), "net", WAIT).unwrap();
        assert!(s.owned_by(owner("c9", "eth0")).unwrap().is_empty());
        // The full listing (releases) reads every file.
        assert_eq!(s.release(owner("c9", "eth0")).unwrap(), vec![ip(4)]);

        // Elsewhere than on tmpfs every file is read each time.
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path(), "net", WAIT).unwrap();
        s.reserve(owner("c2", "eth0"), ip(2), 0).unwrap();
        assert_eq!(s.owned_by(owner("c2", "eth0")).unwrap(), vec![ip(2)]);
        std::fs::write(s.dir().join("10.0.0.2"), "c9\r\neth0").unwrap();
        let on_tmpfs = s.dir_id.is_some();
        assert_eq!(
            s.owned_by(owner("c9", "eth0")).unwrap().is_empty(),
            on_tmpfs
        );
    }

    #[test]
    fn a_held_lock_is_waited_for_then_refused() {
        let d = tempfile::tempdir().unwrap();
        let held = Store::open(d.path(), "net", WAIT).unwrap();
        let e = Store::open(d.path(), "net", Duration::from_millis(30)).unwrap_err();
        assert!(matches!(e, StoreError::Busy { .. }), "{e}");
        assert!(e.to_string().contains("net/lock"), "{e}");
        let t = std::thread::spawn({
            let p = d.path().to_path_buf();
            move || Store::open(&p, "net", WAIT).map(|_| ())
        });
        std::thread::sleep(Duration::from_millis(20));
        drop(held);
        t.join().unwrap().unwrap();
    }
}
