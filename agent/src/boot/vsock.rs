//! The guest's vsock listener (any CID, one port).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{
    accept4, bind, listen, socket, AddressFamily, Backlog, SockFlag, SockType, VsockAddr,
};

use super::BootError;
use crate::server::Listener;

#[derive(Debug)]
pub struct VsockListener {
    fd: OwnedFd,
    port: u32,
}

impl VsockListener {
    pub fn bind(port: u32) -> Result<VsockListener, BootError> {
        let e = |step| move |source| BootError::Vsock { step, port, source };
        let fd = socket(
            AddressFamily::Vsock,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(e("socket"))?;
        bind(fd.as_raw_fd(), &VsockAddr::new(libc::VMADDR_CID_ANY, port)).map_err(e("bind"))?;
        listen(&fd, Backlog::new(128).unwrap_or(Backlog::MAXCONN)).map_err(e("listen"))?;
        Ok(VsockListener { fd, port })
    }
}

impl Listener for VsockListener {
    fn accept(&self) -> io::Result<UnixStream> {
        let fd = accept4(self.fd.as_raw_fd(), SockFlag::SOCK_CLOEXEC)?;
        // SAFETY: accept4 returned a new connected socket that nothing else owns.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        Ok(UnixStream::from(fd))
    }

    fn describe(&self) -> String {
        format!("vsock port {}", self.port)
    }
}
