//! The VMM side of the pool socket.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};

use super::protocol::{recv_msg, send_msg, Request, Response};
use super::{Error, PoolStats, SizeClass};
use crate::MemoryPolicy;

/// A VMM's connection to a pool server. Memfds taken through it go back to the pool when it
/// is dropped (or the process dies), so keep it until the memory is unmapped.
#[derive(Debug)]
pub struct PoolClient {
    sock: Mutex<OwnedFd>,
    path: PathBuf,
}

impl PoolClient {
    pub fn connect(path: impl AsRef<Path>) -> Result<PoolClient, Error> {
        let path = path.as_ref().to_path_buf();
        let serr = |source: std::io::Error| Error::Socket {
            path: path.display().to_string(),
            source,
        };
        let sock = socket::socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(|e| serr(e.into()))?;
        let addr = UnixAddr::new(&path).map_err(|e| serr(e.into()))?;
        socket::connect(sock.as_raw_fd(), &addr).map_err(|e| serr(e.into()))?;
        Ok(PoolClient {
            sock: Mutex::new(sock),
            path,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn call(&self, req: &Request) -> Result<(Response, Vec<OwnedFd>), Error> {
        let p = || self.path.display().to_string();
        let sock = self.sock.lock().unwrap_or_else(|p| p.into_inner());
        let body = serde_json::to_vec(req).map_err(|e| Error::Protocol {
            path: p(),
            reason: e.to_string(),
        })?;
        send_msg(sock.as_raw_fd(), &body, None).map_err(|e| Error::Socket {
            path: p(),
            source: e.into(),
        })?;
        let (body, fds) = recv_msg(sock.as_raw_fd())
            .map_err(|e| Error::Socket {
                path: p(),
                source: e.into(),
            })?
            .ok_or_else(|| Error::Protocol {
                path: p(),
                reason: "server closed the connection".into(),
            })?;
        let resp: Response = serde_json::from_slice(&body).map_err(|e| Error::Protocol {
            path: p(),
            reason: format!("bad response: {e}"),
        })?;
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
        if policy == MemoryPolicy::Vanilla {
            return Err(Error::VanillaFromPool);
        }
        let (resp, mut fds) = self.call(&Request::Take {
            size,
            hugepages,
            policy: policy.to_string(),
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
        Ok((fds.remove(0), resp.recycled.unwrap_or(false)))
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
