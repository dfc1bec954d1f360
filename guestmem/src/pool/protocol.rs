//! The wire protocol: one JSON object per SOCK_SEQPACKET message each way; a `take` response
//! carries the memfd as SCM_RIGHTS.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use nix::sys::socket::{
    self, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    UnixAddr,
};
use serde::{Deserialize, Serialize};

use super::{Error, PoolStats};

/// An error of the socket at `path`.
pub(super) fn socket_err(path: &Path) -> impl Fn(std::io::Error) -> Error {
    let path = path.display().to_string();
    move |source| Error::Socket {
        path: path.clone(),
        source,
    }
}

/// A SOCK_SEQPACKET socket and the address of `path` (for either end).
pub(super) fn seqpacket(path: &Path) -> Result<(OwnedFd, UnixAddr), Error> {
    let serr = socket_err(path);
    let sock = socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| serr(e.into()))?;
    let addr = UnixAddr::new(path).map_err(|e| serr(e.into()))?;
    Ok((sock, addr))
}

const MAX_MSG: usize = 64 * 1024;

fn device_use() -> super::PageUse {
    super::PageUse::Device
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub(super) enum Request {
    Take {
        size: u64,
        hugepages: bool,
        policy: String,
        /// Absent (older clients): `device`.
        #[serde(default = "device_use")]
        page_use: super::PageUse,
    },
    Stats,
    Shrink {
        count: Option<u64>,
        percent: Option<u8>,
        to_bytes: Option<u64>,
    },
    Fill {
        size: u64,
        hugepages: bool,
        count: u64,
        pattern: Option<u8>,
    },
    Prezero {
        percent: u8,
    },
    /// A device maps the memfd lent under `lease`: keep it out of the cache until this
    /// connection closes.
    Register {
        dev: u64,
        ino: u64,
        lease: u64,
    },
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct Response {
    pub(super) ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) memfd_size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) recycled: Option<bool>,
    /// Take and register: the pool keeps the memfd's pages pinned (absent from older
    /// servers: not pinned).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) pinned: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) released: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) stats: Option<PoolStats>,
}

pub(super) fn send_msg(fd: RawFd, body: &[u8], pass: Option<RawFd>) -> nix::Result<()> {
    let iov = [IoSlice::new(body)];
    let fds = pass.map(|f| [f]);
    let cmsgs: Vec<ControlMessage> = fds.iter().map(|f| ControlMessage::ScmRights(f)).collect();
    socket::sendmsg::<()>(fd, &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    Ok(())
}

/// Receives one message; `Ok(None)` on EOF. Its length is peeked first
/// (`MSG_PEEK | MSG_TRUNC` gives a datagram's whole length), so the buffer
/// is the message's size: a zeroed `MAX_MSG` buffer per message cost every
/// lease and registration 16 page faults in the pool server's fresh
/// connection threads (0.1 ms per networked start).
pub(super) fn recv_msg(fd: RawFd) -> nix::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    let len = loop {
        match socket::recv(fd, &mut [], MsgFlags::MSG_PEEK | MsgFlags::MSG_TRUNC) {
            Ok(n) => break n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e),
        }
    };
    let mut buf = vec![0u8; len.min(MAX_MSG)];
    let mut cmsg = nix::cmsg_space!([RawFd; 4]);
    let (n, fds) = loop {
        let mut iov = [IoSliceMut::new(&mut buf)];
        match socket::recvmsg::<()>(fd, &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC) {
            Ok(msg) => {
                let mut fds = Vec::new();
                for c in msg.cmsgs()? {
                    if let ControlMessageOwned::ScmRights(v) = c {
                        // SAFETY: the kernel just installed these fds for us.
                        fds.extend(v.into_iter().map(|f| unsafe { OwnedFd::from_raw_fd(f) }));
                    }
                }
                break (msg.bytes, fds);
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e),
        }
    };
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    buf.truncate(n);
    Ok(Some((buf, fds)))
}
