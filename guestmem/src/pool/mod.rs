//! Host-wide page pool (PiBooster §3.5, §4.2): a cache of resident memfds per size class with
//! O(1) take/return, never zeroed on return, shrinkable by count, by percentage and
//! automatically above a threshold. `PoolServer` hands memfds to VMM processes over a unix
//! socket (SCM_RIGHTS) and takes them back, marked dirty, when the connection closes — also
//! when the VMM was killed. `PoolClient` is the VMM side.
//!
//! One file per concern: `cache` (the in-process cache), `zeroer` (the idle pre-zeroer),
//! `protocol` (the wire format), `server` and `client`.

mod cache;
mod client;
mod lease;
mod protocol;
mod server;
mod zeroer;

use std::os::fd::{AsFd, OwnedFd};

use serde::{Deserialize, Serialize};

pub use cache::{ClassStats, Lent, Pool, PoolStats};
pub use client::{DeviceHold, PoolClient, Taken};
pub use lease::{lease_of, LeaseKey};
pub use server::PoolServer;

use crate::sys::{self, Mapping};
use crate::table::{self, PageTable, DIRTY, ZERO};

const RW: i32 = libc::PROT_READ | libc::PROT_WRITE;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("pool socket {path}: {source}")]
    Socket {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("pool socket {path}: protocol error: {reason}")]
    Protocol { path: String, reason: String },
    #[error("pool socket {path}: protocol error: {source}")]
    Encode {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("pool socket {path}: protocol error: bad response: {source}")]
    Decode {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    /// Another pool server serves this socket (its pid is in the lock error).
    #[error("pool socket {path} belongs to another pool server")]
    Owned {
        path: String,
        #[source]
        source: Box<procutil::LockError>,
    },
    #[error("pool server {path} refused: {reason}")]
    Refused { path: String, reason: String },
    #[error("pool: vanilla memory is never taken from the pool (it must be fresh)")]
    VanillaFromPool,
    #[error("pool size class {size} bytes{}: {what}: {source}", if *.hugepages { " (hugepages)" } else { "" })]
    Memory {
        size: u64,
        hugepages: bool,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("pool: bad argument {arg}: {reason}")]
    BadArg { arg: String, reason: String },
    #[error("pool: bad argument policy: {source}")]
    BadPolicy {
        #[source]
        source: Box<crate::Error>,
    },
    #[error("pool size class {size} bytes{}: {what}: {source}", if *.hugepages { " (hugepages)" } else { "" })]
    Table {
        size: u64,
        hugepages: bool,
        what: String,
        #[source]
        source: Box<crate::Error>,
    },
    #[error("pool lease: {what}: {source}")]
    Lease {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "pool: lease {} of memfd (dev {}, inode {}) is not live: its sandbox is gone or it was \
         never lent by this pool",
        .key.lease, .key.dev, .key.ino
    )]
    NotLive { key: LeaseKey },
    #[error(
        "pool: lease {} of memfd (dev {}, inode {}) is host-only memory (taken for a region no \
         device maps): no device may map it",
        .key.lease, .key.dev, .key.ino
    )]
    HostOnly { key: LeaseKey },
    #[error(
        "pool memory (lease {}, memfd inode {}) cannot be registered with any pool ({tried}): a \
         device must not map pool memory that the pool could recycle under it",
        .key.lease, .key.ino
    )]
    Unregistered { key: LeaseKey, tried: String },
}

/// Who may map a lent memfd: PiBooster's page types (pibooster.txt §3.3). A
/// `Device` memfd may be mapped by a device too (the NIC registers it), so
/// it goes back to the cache only once every device has unmapped it. A
/// `HostOnly` memfd (a region no device maps: the image region under
/// FastIOV's skip, guest RAM under `window`) is PiBooster's semi-writable
/// page: writable by the VMM and the guest, never by a device. The pool
/// refuses any device registration of it, so it needs no device unmap (the
/// software NIC's "IOTLB flush") and goes back as soon as its VMM is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PageUse {
    Device,
    HostOnly,
}

/// Memfds of one size class are interchangeable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
pub struct SizeClass {
    /// Guest bytes (the memfd is this plus the page-state table).
    pub size: u64,
    pub hugepages: bool,
}

impl SizeClass {
    pub fn page_size(&self) -> u64 {
        sys::page_size_for(self.hugepages)
    }

    pub fn memfd_size(&self) -> u64 {
        self.size + table::table_size(self.size, self.page_size())
    }

    pub(super) fn validate(&self) -> Result<(), Error> {
        let ps = self.page_size();
        if self.size == 0 || !self.size.is_multiple_of(ps) {
            return Err(Error::BadArg {
                arg: format!("size {}", self.size),
                reason: format!("must be a non-zero multiple of the page size {ps}"),
            });
        }
        Ok(())
    }

    pub(super) fn mem_err(&self, what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let (size, hugepages, what) = (self.size, self.hugepages, what.into());
        move |source| Error::Memory {
            size,
            hugepages,
            what,
            source,
        }
    }

    /// Maps guest bytes and table of `memfd` (the pool's own short-lived device view).
    pub(super) fn map(&self, memfd: &OwnedFd) -> Result<(Mapping, PageTable), Error> {
        let m = Mapping::new(memfd.as_fd(), 0, self.memfd_size(), RW)
            .map_err(self.mem_err("mmap pool memfd"))?;
        // SAFETY: data and table lie inside `m`, which the caller keeps while using the table.
        let t = unsafe {
            PageTable::new(
                m.ptr(),
                m.ptr().add(self.size as usize),
                self.size,
                self.page_size(),
            )
        };
        Ok((m, t))
    }

    /// Whether every page of `memfd` is resident: the file's allocated blocks cover all of
    /// it (shmem and hugetlbfs both count allocated pages in `st_blocks`; the table is
    /// always resident, so this is about the guest bytes). O(1), no page touched.
    pub(super) fn resident(&self, memfd: &OwnedFd) -> bool {
        use std::os::fd::AsRawFd;
        matches!(nix::sys::stat::fstat(memfd.as_raw_fd()),
            Ok(st) if st.st_blocks as u64 * 512 >= self.memfd_size())
    }

    /// The pool's pin of `memfd`'s guest bytes: a read-only mapping of them, locked (which
    /// allocates any page not resident yet). Kept for as long as the memfd is the pool's.
    pub(super) fn pin(&self, memfd: &OwnedFd) -> Result<Mapping, Error> {
        let m = Mapping::new(memfd.as_fd(), 0, self.size, libc::PROT_READ)
            .map_err(self.mem_err("mmap pool memfd to pin it"))?;
        m.lock(0, self.size as usize)
            .map_err(self.mem_err("mlock pool memfd"))?;
        Ok(m)
    }

    /// A new memfd with a formatted table. `fill`: make it resident, writing `pattern`
    /// into every byte if given (pages then DIRTY), else leave it sparse (pages ZERO).
    pub(super) fn create(&self, fill: Option<Option<u8>>) -> Result<OwnedFd, Error> {
        let fd = sys::memfd_create(lease::POOL_MEMFD_NAME, self.hugepages)
            .map_err(self.mem_err("memfd_create"))?;
        sys::ftruncate(fd.as_fd(), self.memfd_size()).map_err(self.mem_err("ftruncate"))?;
        let m = Mapping::new(fd.as_fd(), 0, self.memfd_size(), RW).map_err(|e| {
            if self.hugepages && e.raw_os_error() == Some(libc::ENOMEM) {
                Error::Memory {
                    size: self.size,
                    hugepages: true,
                    what: "not enough reserved huge pages (see /proc/sys/vm/nr_hugepages)".into(),
                    source: e,
                }
            } else {
                self.mem_err("mmap new memfd")(e)
            }
        })?;
        let state = match fill {
            Some(Some(pattern)) => {
                // SAFETY: writes inside our own fresh mapping.
                unsafe { std::ptr::write_bytes(m.ptr(), pattern, self.size as usize) };
                DIRTY
            }
            Some(None) => {
                m.populate_write(0, self.size as usize)
                    .map_err(self.mem_err("MADV_POPULATE_WRITE"))?;
                ZERO
            }
            None => ZERO,
        };
        // SAFETY: the table lies inside `m`; nobody else has this memfd yet.
        unsafe {
            PageTable::format(
                m.ptr().add(self.size as usize),
                self.size,
                self.page_size(),
                state,
            );
        }
        Ok(fd)
    }
}
