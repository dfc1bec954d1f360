//! The client side of the pool socket: a VMM taking memory, a device registering the
//! mappings it holds (`DeviceHold`), `burstvm pool --stats`.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use nix::sys::socket::{self, sockopt};
use nix::sys::time::TimeVal;

use super::lease::{lease_of, LeaseKey};
use super::protocol::{recv_msg, send_msg, seqpacket, socket_err, Request, Response};
use super::{Error, PageUse, PoolStats, SizeClass};
use crate::MemoryPolicy;

/// A pool server that does not answer within this time is treated as failed (a `fill` of
/// many resident memfds is the slowest request).
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// A memfd taken from the pool.
#[derive(Debug)]
pub struct Taken {
    pub memfd: OwnedFd,
    /// Recycled (resident, dirty) rather than newly created (sparse).
    pub recycled: bool,
    /// The pool keeps its guest pages resident and locked for as long as it is lent: a DMA
    /// mapping of it has nothing left to pin.
    pub pinned: bool,
}

/// A connection to a pool server. Memfds taken through it go back to the pool when it is
/// dropped (or the process dies), so keep it until the memory is unmapped.
#[derive(Debug)]
pub struct PoolClient {
    /// `None` once a request timed out: a late answer would be taken for the next one. The
    /// socket stays open all the same, since closing it gives the memory back.
    sock: Mutex<(OwnedFd, bool)>,
    path: PathBuf,
}

impl PoolClient {
    pub fn connect(path: impl AsRef<Path>) -> Result<PoolClient, Error> {
        let path = path.as_ref().to_path_buf();
        let serr = socket_err(&path);
        let (sock, addr) = seqpacket(&path)?;
        socket::connect(sock.as_raw_fd(), &addr).map_err(|e| serr(e.into()))?;
        let tv = TimeVal::new(CALL_TIMEOUT.as_secs() as _, 0);
        socket::setsockopt(&sock, sockopt::ReceiveTimeout, &tv)
            .and_then(|_| socket::setsockopt(&sock, sockopt::SendTimeout, &tv))
            .map_err(|e| serr(e.into()))?;
        Ok(PoolClient {
            sock: Mutex::new((sock, true)),
            path,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn call(&self, req: &Request) -> Result<(Response, Vec<OwnedFd>), Error> {
        let p = || self.path.display().to_string();
        let mut guard = self.sock.lock().unwrap_or_else(|p| p.into_inner());
        let (sock, in_sync) = &mut *guard;
        if !*in_sync {
            return Err(Error::Protocol {
                path: p(),
                reason: format!(
                    "an earlier request got no answer within {} s",
                    CALL_TIMEOUT.as_secs()
                ),
            });
        }
        let body = serde_json::to_vec(req).map_err(|source| Error::Encode { path: p(), source })?;
        let timed_out = |e: nix::Error| {
            if e == nix::errno::Errno::EAGAIN {
                Error::Protocol {
                    path: p(),
                    reason: format!("no answer within {} s", CALL_TIMEOUT.as_secs()),
                }
            } else {
                Error::Socket {
                    path: p(),
                    source: e.into(),
                }
            }
        };
        send_msg(sock.as_raw_fd(), &body, None).map_err(timed_out)?;
        let (body, fds) = recv_msg(sock.as_raw_fd())
            .map_err(|e| {
                if e == nix::errno::Errno::EAGAIN {
                    *in_sync = false;
                }
                timed_out(e)
            })?
            .ok_or_else(|| Error::Protocol {
                path: p(),
                reason: "server closed the connection".into(),
            })?;
        let resp: Response =
            serde_json::from_slice(&body).map_err(|source| Error::Decode { path: p(), source })?;
        if !resp.ok {
            return Err(Error::Refused {
                path: p(),
                reason: resp.error.unwrap_or_else(|| "no reason given".into()),
            });
        }
        Ok((resp, fds))
    }

    /// Takes a memfd of `size` guest bytes (plus table) for a region under `policy`.
    pub fn take(&self, size: u64, hugepages: bool, policy: MemoryPolicy) -> Result<OwnedFd, Error> {
        self.take_memfd(size, hugepages, policy).map(|(fd, _)| fd)
    }

    /// As `take`; also says whether the memfd was recycled (resident, dirty) or newly
    /// created by the server (sparse: the kernel allocates and zeroes it when populated).
    pub fn take_memfd(
        &self,
        size: u64,
        hugepages: bool,
        policy: MemoryPolicy,
    ) -> Result<(OwnedFd, bool), Error> {
        self.take_memfd_as(size, hugepages, policy, PageUse::Device)
            .map(|t| (t.memfd, t.recycled))
    }

    /// As `take_memfd`, for `page_use` (a `HostOnly` memfd no device may ever map), with
    /// everything the server says about the memfd.
    pub fn take_memfd_as(
        &self,
        size: u64,
        hugepages: bool,
        policy: MemoryPolicy,
        page_use: PageUse,
    ) -> Result<Taken, Error> {
        if policy == MemoryPolicy::Vanilla {
            return Err(Error::VanillaFromPool);
        }
        let (resp, mut fds) = self.call(&Request::Take {
            size,
            hugepages,
            policy: policy.to_string(),
            page_use,
        })?;
        let expect = SizeClass { size, hugepages }.memfd_size();
        if fds.len() != 1 || resp.memfd_size != Some(expect) {
            return Err(Error::Protocol {
                path: self.path.display().to_string(),
                reason: format!(
                    "take answered {} fds and memfd_size {:?}, expected 1 and {expect}",
                    fds.len(),
                    resp.memfd_size
                ),
            });
        }
        Ok(Taken {
            memfd: fds.remove(0),
            recycled: resp.recycled.unwrap_or(false),
            pinned: resp.pinned.unwrap_or(false),
        })
    }

    pub fn stats(&self) -> Result<PoolStats, Error> {
        let (resp, _) = self.call(&Request::Stats)?;
        resp.stats.ok_or_else(|| Error::Protocol {
            path: self.path.display().to_string(),
            reason: "stats response without stats".into(),
        })
    }

    pub fn shrink_count(&self, count: u64) -> Result<u64, Error> {
        self.shrink(Some(count), None, None)
    }

    pub fn shrink_percent(&self, percent: u8) -> Result<u64, Error> {
        self.shrink(None, Some(percent), None)
    }

    pub fn shrink_to(&self, bytes: u64) -> Result<u64, Error> {
        self.shrink(None, None, Some(bytes))
    }

    fn shrink(
        &self,
        count: Option<u64>,
        percent: Option<u8>,
        to_bytes: Option<u64>,
    ) -> Result<u64, Error> {
        let (resp, _) = self.call(&Request::Shrink {
            count,
            percent,
            to_bytes,
        })?;
        Ok(resp.released.unwrap_or(0))
    }

    /// Asks the server to add `count` resident memfds (with `pattern`: dirty ones).
    pub fn fill(
        &self,
        size: u64,
        hugepages: bool,
        count: u64,
        pattern: Option<u8>,
    ) -> Result<(), Error> {
        self.call(&Request::Fill {
            size,
            hugepages,
            count,
            pattern,
        })
        .map(|_| ())
    }

    /// Asks the server to pre-zero `percent`% of every cached memfd now.
    pub fn prezero(&self, percent: u8) -> Result<(), Error> {
        self.call(&Request::Prezero { percent }).map(|_| ())
    }
}

impl PoolClient {
    /// Registers a device mapping of the memory lent under `key` (see `DeviceHold`);
    /// returns whether the pool keeps that memory pinned.
    pub fn register(&self, key: &LeaseKey) -> Result<bool, Error> {
        self.call(&Request::Register {
            dev: key.dev,
            ino: key.ino,
            lease: key.lease,
        })
        .map(|(resp, _)| resp.pinned.unwrap_or(false))
    }
}

/// A device process's hold on the pool memory it maps (the NIC's, for a VF's memory table):
/// one pool connection on which every lent memfd among the mapped fds is registered. The
/// pool recycles none of them before this connection closes, so drop it only after the
/// mappings are gone (a killed process's mappings are gone before its sockets close).
#[derive(Debug)]
pub struct DeviceHold {
    client: PoolClient,
    keys: Vec<LeaseKey>,
    /// Per fd given to `register`: pool memory the pool keeps pinned.
    fd_pinned: Vec<bool>,
}

impl DeviceHold {
    /// Registers the pool memory among `fds` with the pool of `sockets` that lent it. `None`
    /// if no fd is pool memory. Fails (and the caller must not map the fds) if pool memory
    /// is there but no pool accepts it: no socket given, or the lease already ended.
    pub fn register(
        sockets: &[PathBuf],
        fds: &[BorrowedFd<'_>],
    ) -> Result<Option<DeviceHold>, Error> {
        let mut keys = Vec::new();
        let mut fd_keys = Vec::with_capacity(fds.len());
        for fd in fds {
            let k = lease_of(*fd)?;
            if let Some(k) = k {
                if !keys.contains(&k) {
                    keys.push(k);
                }
            }
            fd_keys.push(k);
        }
        let Some(first) = keys.first().copied() else {
            return Ok(None);
        };
        let mut tried = Vec::new();
        for path in sockets {
            let attempt = PoolClient::connect(path).and_then(|client| {
                let pinned = keys
                    .iter()
                    .map(|k| client.register(k))
                    .collect::<Result<Vec<bool>, Error>>()?;
                Ok((client, pinned))
            });
            match attempt {
                Ok((client, pinned)) => {
                    let is_pinned =
                        |k: &LeaseKey| keys.iter().zip(&pinned).any(|(x, p)| x == k && *p);
                    let fd_pinned = fd_keys
                        .iter()
                        .map(|k| k.as_ref().is_some_and(is_pinned))
                        .collect();
                    return Ok(Some(DeviceHold {
                        client,
                        keys,
                        fd_pinned,
                    }));
                }
                Err(e) => tried.push(format!("{}: {e}", path.display())),
            }
        }
        Err(Error::Unregistered {
            key: first,
            tried: if tried.is_empty() {
                "no pool socket configured".into()
            } else {
                tried.join("; ")
            },
        })
    }

    pub fn keys(&self) -> &[LeaseKey] {
        &self.keys
    }

    /// Whether the `i`-th fd given to `register` is pool memory the pool keeps pinned
    /// (resident and locked while lent): the device need not allocate or pin it.
    pub fn pinned(&self, i: usize) -> bool {
        self.fd_pinned.get(i).copied().unwrap_or(false)
    }

    pub fn pool_path(&self) -> &Path {
        self.client.path()
    }
}
