//! The host side's Unix sockets (Firecracker's hybrid model): the one
//! listening socket at `PATH` that host processes connect to and send
//! `CONNECT <port>\n`, the `PATH_<port>` sockets that guest-initiated
//! connections reach, and the guard that removes `PATH` when the VMM is done.
//!
//! Only these two kinds of path are ever connected: `PATH` itself (to see
//! whether a stale file is still served) and `PATH_<decimal u32>`, built
//! here from the configured path; a guest chooses only the number.

use std::io::ErrorKind;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};

use super::VsockError;

/// Longest accepted `CONNECT <port>\n` line (with room for spaces and `\r`).
pub const CONNECT_LINE_MAX: usize = 32;

/// The socket file at `PATH`, removed when the guard goes — but only if it
/// is still the socket this VMM bound (same device and inode), never a
/// file another process put there since.
#[derive(Debug, Clone)]
pub struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl SocketFile {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        match std::fs::symlink_metadata(&self.path) {
            Ok(md) if md.dev() == self.dev && md.ino() == self.ino => {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    tracing::warn!("vsock socket {}: remove: {e}", self.path.display());
                }
            }
            _ => {}
        }
    }
}

/// What a non-blocking connect to a Unix socket path found.
#[derive(Debug)]
pub enum Connect {
    Connected(UnixStream),
    /// Nothing at the path, or nothing listening (ENOENT, ECONNREFUSED).
    Refused(std::io::Error),
    /// A listener whose backlog is full (EAGAIN): it exists but is busy.
    Busy,
}

/// Connects to `path` without blocking (a Unix connect either completes at
/// once or fails with EAGAIN when the listener's backlog is full). The
/// stream is non-blocking and close-on-exec.
pub fn connect(path: &Path) -> Connect {
    let addr = match UnixAddr::new(path) {
        Ok(a) => a,
        Err(e) => return Connect::Refused(e.into()),
    };
    let fd: OwnedFd = match socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    ) {
        Ok(fd) => fd,
        Err(e) => return Connect::Refused(e.into()),
    };
    match socket::connect(fd.as_raw_fd(), &addr) {
        Ok(()) => Connect::Connected(UnixStream::from(fd)),
        Err(nix::Error::EAGAIN) => Connect::Busy,
        Err(e) => Connect::Refused(e.into()),
    }
}

/// `PATH_<port>`: where a guest-initiated connection to host port `port` goes.
pub fn port_path(base: &Path, port: u32) -> PathBuf {
    let mut s = base.as_os_str().to_owned();
    s.push(format!("_{port}"));
    PathBuf::from(s)
}

/// Binds the listening socket at `path` (non-blocking, close-on-exec). A
/// socket file already there is replaced only when nothing listens on it
/// (a VMM that died without cleaning up); a live one, or a file that is not
/// a socket, is an error naming the path.
pub fn bind(path: &Path) -> Result<(UnixListener, SocketFile), VsockError> {
    let io = |what| {
        move |source| VsockError::Io {
            path: path.to_path_buf(),
            what,
            source,
        }
    };
    let listener = match UnixListener::bind(path) {
        Ok(l) => l,
        Err(e) if e.kind() == ErrorKind::AddrInUse => {
            let md = std::fs::symlink_metadata(path).map_err(io("stat existing file"))?;
            if !md.file_type().is_socket() {
                return Err(VsockError::NotASocket {
                    path: path.to_path_buf(),
                });
            }
            match connect(path) {
                Connect::Connected(_) | Connect::Busy => {
                    return Err(VsockError::InUse {
                        path: path.to_path_buf(),
                    })
                }
                Connect::Refused(_) => {
                    tracing::info!(
                        "vsock socket {}: replacing a stale socket file (nothing listens on it)",
                        path.display()
                    );
                    match std::fs::remove_file(path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == ErrorKind::NotFound => {}
                        Err(e) => return Err(io("remove stale socket file")(e)),
                    }
                    UnixListener::bind(path).map_err(io("bind"))?
                }
            }
        }
        Err(e) => return Err(io("bind")(e)),
    };
    let md = std::fs::symlink_metadata(path).map_err(io("stat"))?;
    let file = SocketFile {
        path: path.to_path_buf(),
        dev: md.dev(),
        ino: md.ino(),
    };
    listener
        .set_nonblocking(true)
        .map_err(io("set non-blocking"))?;
    Ok((listener, file))
}

/// What the first bytes of a host connection say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Line {
    /// No newline yet: wait for more bytes.
    Incomplete,
    /// `CONNECT <port>\n`, `len` bytes long (newline included).
    Connect { port: u32, len: usize },
    /// Not a CONNECT line, or longer than [`CONNECT_LINE_MAX`].
    Bad,
}

/// Parses the start of a host connection's byte stream.
pub fn parse_line(buf: &[u8]) -> Line {
    let Some(nl) = buf.iter().position(|&b| b == b'\n') else {
        return if buf.len() >= CONNECT_LINE_MAX {
            Line::Bad
        } else {
            Line::Incomplete
        };
    };
    if nl >= CONNECT_LINE_MAX {
        return Line::Bad;
    }
    let Ok(text) = std::str::from_utf8(&buf[..nl]) else {
        return Line::Bad;
    };
    let mut words = text.split_ascii_whitespace();
    match (words.next(), words.next(), words.next()) {
        (Some("CONNECT"), Some(port), None) => match port.parse::<u32>() {
            Ok(port) => Line::Connect { port, len: nl + 1 },
            Err(_) => Line::Bad,
        },
        _ => Line::Bad,
    }
}

/// Writes to `stream` without raising SIGPIPE when the host closed its end
/// (EPIPE instead), whatever the process's SIGPIPE disposition.
pub fn send(stream: &UnixStream, buf: &[u8]) -> std::io::Result<usize> {
    socket::send(stream.as_raw_fd(), buf, socket::MsgFlags::MSG_NOSIGNAL).map_err(Into::into)
}

/// Peeks at the first bytes of `stream` (nothing is consumed); 0: the
/// host closed it.
pub fn peek(stream: &UnixStream, buf: &mut [u8; CONNECT_LINE_MAX]) -> std::io::Result<usize> {
    socket::recv(stream.as_raw_fd(), buf, socket::MsgFlags::MSG_PEEK).map_err(Into::into)
}
