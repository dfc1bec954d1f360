//! Leases: when a lent memfd may be recycled.
//!
//! A memfd goes back to the cache only when nobody can write it any more: the VMM that took
//! it (its pool connection) *and* every device process that registered a mapping of it (the
//! NIC, over its own pool connection) are gone. A connection that closed is a guarantee the
//! kernel gives: at process exit the address space is torn down before the files are
//! closed, so a closed connection means its process's mappings are gone, also after SIGKILL.
//! A lent memfd whose taker is gone while a device still maps it is *quarantined*: not in
//! the cache, counted in `PoolStats::quarantined_*`, until the last registration ends.
//!
//! Every take gets its own open file description of the memfd (reopened through
//! `/proc/self/fd`) whose file offset is the lease id. The offset belongs to the description,
//! so whoever receives that fd over SCM_RIGHTS — the VMM, then the NIC in `SET_MEM_TABLE` —
//! reads the lease it was lent under, never a later one of the same memfd: a device that
//! maps a memfd after its tenant died cannot register it under the next tenant's lease. The
//! lease is also written into the page-state trailer, so a device's `DeviceMemory` refuses
//! to prepare pages once the memory was returned (defense in depth).

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};

use nix::fcntl::{open, OFlag};
use nix::sys::stat::Mode;
use nix::unistd::{lseek, Whence};
use serde::{Deserialize, Serialize};

use super::{Error, Lent, PageUse, Pool};

/// Name prefix of every memfd the pool creates (`memfd:burstvm-pool`): a device treats such a
/// memfd as lent memory that must be registered before it is mapped.
pub const POOL_MEMFD_NAME: &str = "pool";

/// Which lent memfd a device maps: the memfd's identity and the lease it was lent under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LeaseKey {
    pub dev: u64,
    pub ino: u64,
    pub lease: u64,
}

fn io_err(what: String) -> impl FnOnce(nix::Error) -> Error {
    move |e| Error::Lease {
        what,
        source: e.into(),
    }
}

/// The lease `fd` was received under, if it is pool memory (a `memfd:burstvm-pool`); `None`
/// for any other file (fresh memory is never recycled, so it needs no registration).
pub fn lease_of(fd: BorrowedFd<'_>) -> Result<Option<LeaseKey>, Error> {
    let raw = fd.as_raw_fd();
    let link =
        std::fs::read_link(format!("/proc/self/fd/{raw}")).map_err(|source| Error::Lease {
            what: format!("readlink /proc/self/fd/{raw}"),
            source,
        })?;
    // A region named like the pool's memfds is only refused later (its registration
    // fails); pool memory is never missed, since the pool names every memfd it makes.
    let pool_name = format!("/memfd:burstvm-{POOL_MEMFD_NAME} (deleted)");
    if link.as_os_str() != pool_name.as_str() {
        return Ok(None);
    }
    let st = nix::sys::stat::fstat(raw).map_err(io_err(format!("fstat fd {raw}")))?;
    let lease = lseek(raw, 0, Whence::SeekCur).map_err(io_err(format!("lseek fd {raw}")))?;
    Ok(Some(LeaseKey {
        dev: st.st_dev,
        ino: st.st_ino,
        lease: lease as u64,
    }))
}

/// A new open file description of `memfd` whose offset is `lease`.
fn open_lease(memfd: &OwnedFd, lease: u64) -> Result<OwnedFd, Error> {
    let path = format!("/proc/self/fd/{}", memfd.as_raw_fd());
    let raw = open(
        path.as_str(),
        OFlag::O_RDWR | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(io_err(format!("reopen {path}")))?;
    // SAFETY: open returned a new fd that nobody else owns.
    let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
    lseek(fd.as_raw_fd(), lease as i64, Whence::SeekSet)
        .map_err(io_err(format!("lseek {path} to lease {lease}")))?;
    Ok(fd)
}

fn key_of(memfd: &OwnedFd) -> Result<(u64, u64), Error> {
    let st = nix::sys::stat::fstat(memfd.as_fd().as_raw_fd())
        .map_err(io_err("fstat pool memfd".into()))?;
    Ok((st.st_dev, st.st_ino))
}

struct Lease {
    lent: Lent,
    key: (u64, u64),
    /// The taker's connection while it is open.
    holder: Option<u64>,
    /// Device connections that registered a mapping, with their count of registrations.
    devices: HashMap<u64, u32>,
    /// Who may map it; `HostOnly` leases refuse every registration.
    page_use: PageUse,
    /// A device registered it at some point: its return waited for that unmap.
    was_mapped: bool,
    /// When its taker went while a device still mapped it (quarantine start).
    orphaned: Option<std::time::Instant>,
}

#[derive(Default)]
struct Table {
    next: u64,
    leases: HashMap<u64, Lease>,
}

/// The leases of one pool server, by lease id.
pub(super) struct Leases {
    pool: Arc<Pool>,
    table: Mutex<Table>,
}

impl Leases {
    pub fn new(pool: Arc<Pool>) -> Leases {
        Leases {
            pool,
            table: Mutex::new(Table::default()),
        }
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lends `lent` to connection `conn`: returns the fd to send (its own file description,
    /// offset = lease id). On error `lent` goes straight back to the pool.
    pub fn lend(&self, conn: u64, lent: Lent, page_use: PageUse) -> Result<OwnedFd, Error> {
        let id = {
            let mut t = self.lock();
            t.next += 1;
            t.next
        };
        let prepared = key_of(lent.memfd()).and_then(|key| {
            let fd = open_lease(lent.memfd(), id)?;
            let (_m, table) = lent.class().map(lent.memfd())?;
            table.set_lease(id);
            Ok((key, fd))
        });
        match prepared {
            Ok((key, fd)) => {
                let lease = Lease {
                    lent,
                    key,
                    holder: Some(conn),
                    devices: HashMap::new(),
                    page_use,
                    was_mapped: false,
                    orphaned: None,
                };
                self.lock().leases.insert(id, lease);
                Ok(fd)
            }
            Err(e) => {
                self.pool.give_back(lent);
                Err(e)
            }
        }
    }

    /// Connection `conn` (a device process) maps the memory lent under `key`: it stays out of
    /// the cache until `conn` closes. Refused unless the lease is live (its taker connected),
    /// and always for host-only memory (counted in `PoolStats::device_maps_refused`).
    /// Returns whether the pool keeps the memory pinned (the device need not pin it).
    pub fn register(&self, conn: u64, key: LeaseKey) -> Result<bool, Error> {
        let mut t = self.lock();
        match t.leases.get_mut(&key.lease) {
            Some(l) if l.key == (key.dev, key.ino) && l.holder.is_some() => {
                if l.page_use == PageUse::HostOnly {
                    drop(t);
                    self.pool.note_refused_map();
                    return Err(Error::HostOnly { key });
                }
                *l.devices.entry(conn).or_default() += 1;
                l.was_mapped = true;
                Ok(l.lent.pinned())
            }
            _ => Err(Error::NotLive { key }),
        }
    }

    /// Connection `conn` closed: its leases lose their holder, its registrations end. A lease
    /// with neither goes back to the pool (marked dirty); with `stopping` (the server shuts
    /// down, its clients may still run) it is only forgotten.
    pub fn conn_closed(&self, conn: u64, stopping: bool) {
        let mut ended = Vec::new();
        {
            let mut t = self.lock();
            let mut done = Vec::new();
            for (id, l) in t.leases.iter_mut() {
                let was_held = l.holder.is_some();
                if l.holder == Some(conn) {
                    l.holder = None;
                }
                l.devices.remove(&conn);
                match (l.holder.is_none(), l.devices.is_empty()) {
                    // A lease without holder stays in the table only while quarantined.
                    (true, true) => done.push((*id, !was_held)),
                    (true, false) if was_held => {
                        l.orphaned = Some(std::time::Instant::now());
                        self.pool.quarantine(l.lent.class(), true)
                    }
                    _ => {}
                }
            }
            for (id, was_quarantined) in done {
                ended.push((t.leases.remove(&id).expect("listed above"), was_quarantined));
            }
        }
        // Marking a memfd dirty walks its table: outside the lock.
        for (l, was_quarantined) in ended {
            let class = l.lent.class();
            if stopping {
                self.pool.forget(l.lent);
            } else {
                self.pool
                    .note_return(l.was_mapped, l.orphaned.map(|t| t.elapsed()));
                self.pool.give_back(l.lent);
            }
            // After the give-back: quarantined == 0 means the memory is back.
            if was_quarantined {
                self.pool.quarantine(class, false);
            }
        }
    }

    /// Leases currently quarantined and registrations held, for tests and stats.
    pub fn registrations(&self) -> usize {
        self.lock()
            .leases
            .values()
            .map(|l| l.devices.values().sum::<u32>() as usize)
            .sum()
    }
}
