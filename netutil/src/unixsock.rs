//! Unix stream sockets with a bounded connect: a unix `connect` blocks while
//! the listener's backlog is full (a frozen or overloaded daemon), so every
//! client of a burstvm socket — the NIC's control socket, a VF's vhost-user
//! socket — connects through here.

use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use nix::sys::socket::{self, sockopt, AddressFamily, SockFlag, SockType, UnixAddr};
use nix::sys::time::{TimeVal, TimeValLike};

fn timeval(d: Duration) -> TimeVal {
    // A zero timeval means "block forever" to the kernel: never pass it.
    TimeVal::microseconds(d.as_micros().clamp(1, i64::MAX as u128) as i64)
}

/// Connects a unix stream socket to `path`, waiting at most `timeout` when
/// the listener's backlog is full (bounded by the socket's SO_SNDTIMEO,
/// which stays set on the returned stream). `ErrorKind::TimedOut` when it
/// ran out.
pub fn connect_timeout(path: &Path, timeout: Duration) -> std::io::Result<UnixStream> {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    socket::setsockopt(&fd, sockopt::SendTimeout, &timeval(timeout))?;
    let addr = UnixAddr::new(path)?;
    match socket::connect(fd.as_raw_fd(), &addr) {
        Ok(()) => Ok(UnixStream::from(fd)),
        // EAGAIN after SO_SNDTIMEO: the backlog stayed full.
        Err(nix::errno::Errno::EAGAIN) => Err(std::io::Error::new(
            ErrorKind::TimedOut,
            format!("backlog full for {timeout:?}"),
        )),
        Err(e) => Err(e.into()),
    }
}
