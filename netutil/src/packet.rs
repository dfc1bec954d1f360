//! AF_PACKET sockets bound to one interface: a wire to read and write whole
//! Ethernet frames on (the NIC's veth uplink, the tests' view of a tap).
//!
//! With `vlan_aux` the kernel reports the VLAN tag it stripped from a
//! received frame (PACKET_AUXDATA) and `recv` puts it back, so the frame
//! reads as it was on the wire.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::Duration;

use nix::sys::socket::{self, sockopt, AddressFamily, SockFlag, SockProtocol, SockType};
use nix::sys::time::TimeVal;

#[derive(Debug, thiserror::Error)]
#[error("packet socket on {ifname}: {op}: {source}")]
pub struct PacketError {
    pub ifname: String,
    pub op: &'static str,
    #[source]
    pub source: io::Error,
}

/// How to open a packet socket.
#[derive(Debug, Clone, Copy, Default)]
pub struct PacketOptions {
    pub nonblocking: bool,
    /// Restore VLAN tags the kernel stripped (see the module doc).
    pub vlan_aux: bool,
    /// Receives give up after this long (blocking sockets).
    pub recv_timeout: Option<Duration>,
}

/// One received frame: its length and whether this host sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    pub len: usize,
    pub outgoing: bool,
}

#[derive(Debug)]
pub struct PacketSocket {
    fd: OwnedFd,
    ifname: String,
    ifindex: u32,
}

impl PacketSocket {
    /// A raw socket for every protocol on `ifname` (of the calling thread's netns).
    pub fn open(ifname: &str, opts: PacketOptions) -> Result<PacketSocket, PacketError> {
        let err = |op| {
            let ifname = ifname.to_string();
            move |e: nix::Error| PacketError {
                ifname,
                op,
                source: e.into(),
            }
        };
        let ifindex = nix::net::if_::if_nametoindex(ifname).map_err(err("if_nametoindex"))?;
        let mut flags = SockFlag::SOCK_CLOEXEC;
        if opts.nonblocking {
            flags |= SockFlag::SOCK_NONBLOCK;
        }
        let fd = socket::socket(
            AddressFamily::Packet,
            SockType::Raw,
            flags,
            SockProtocol::EthAll,
        )
        .map_err(err("socket"))?;
        // SAFETY: sockaddr_ll is plain integers and bytes; all-zero is valid.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: `sll` is a complete sockaddr_ll of the length passed, alive
        // for the call; `fd` is the socket just made.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(err("bind")(nix::Error::last()));
        }
        if opts.vlan_aux {
            let on: libc::c_int = 1;
            // SAFETY: PACKET_AUXDATA takes an int, read from `on` during the call.
            let r = unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_PACKET,
                    libc::PACKET_AUXDATA,
                    (&on as *const libc::c_int).cast(),
                    size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if r < 0 {
                return Err(err("PACKET_AUXDATA")(nix::Error::last()));
            }
        }
        if let Some(t) = opts.recv_timeout {
            socket::setsockopt(
                &fd,
                sockopt::ReceiveTimeout,
                &TimeVal::from(libc::timeval {
                    tv_sec: t.as_secs() as libc::time_t,
                    tv_usec: t.subsec_micros() as libc::suseconds_t,
                }),
            )
            .map_err(err("SO_RCVTIMEO"))?;
        }
        Ok(PacketSocket {
            fd,
            ifname: ifname.to_string(),
            ifindex,
        })
    }

    pub fn ifname(&self) -> &str {
        &self.ifname
    }

    pub fn ifindex(&self) -> u32 {
        self.ifindex
    }

    /// Sends one frame; returns the bytes sent.
    pub fn send(&self, frame: &[u8]) -> io::Result<usize> {
        Ok(socket::send(
            self.fd.as_raw_fd(),
            frame,
            socket::MsgFlags::empty(),
        )?)
    }

    /// Receives one frame into `buf`; `None` when nothing is pending (a
    /// non-blocking socket, or the receive timeout passed). A frame larger
    /// than `buf` is skipped: it is reported as outgoing with length 0.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<Option<Received>> {
        const TP_STATUS_VLAN_VALID: u32 = 1 << 4;
        const TP_STATUS_VLAN_TPID_VALID: u32 = 1 << 6;
        let mut sll = std::mem::MaybeUninit::<libc::sockaddr_ll>::zeroed();
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let mut cbuf = [0u64; 16];
        // SAFETY: msghdr is plain integers and pointers; all-zero is valid.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_name = sll.as_mut_ptr().cast();
        msg.msg_namelen = size_of::<libc::sockaddr_ll>() as u32;
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = size_of_val(&cbuf);
        // SAFETY: every pointer in `msg` refers to a live buffer of the
        // length given next to it (`sll`, `iov` over `buf`, `cbuf`).
        let n = unsafe { libc::recvmsg(self.fd.as_raw_fd(), &mut msg, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock => Ok(None),
                _ => Err(e),
            };
        }
        if msg.msg_flags & libc::MSG_TRUNC != 0 {
            return Ok(Some(Received {
                len: 0,
                outgoing: true,
            }));
        }
        let mut len = n as usize;
        if let Some(aux) = auxdata(&msg) {
            if aux.tp_status & TP_STATUS_VLAN_VALID != 0 && len >= 12 && len + 4 <= buf.len() {
                let tpid = if aux.tp_status & TP_STATUS_VLAN_TPID_VALID != 0 {
                    aux.tp_vlan_tpid
                } else {
                    0x8100
                };
                buf.copy_within(12..len, 16);
                buf[12..14].copy_from_slice(&tpid.to_be_bytes());
                buf[14..16].copy_from_slice(&aux.tp_vlan_tci.to_be_bytes());
                len += 4;
            }
        }
        // SAFETY: recvmsg succeeded, so the kernel filled the address
        // (zero-initialized before, so every byte is initialized either way).
        let sll = unsafe { sll.assume_init() };
        Ok(Some(Received {
            len,
            outgoing: sll.sll_pkttype == libc::PACKET_OUTGOING,
        }))
    }
}

/// The PACKET_AUXDATA control message of a received `msg`, if present.
fn auxdata(msg: &libc::msghdr) -> Option<libc::tpacket_auxdata> {
    // SAFETY: `msg` was filled by a successful recvmsg, so msg_control and
    // msg_controllen describe the control messages the kernel wrote; the
    // CMSG_* walk stays inside that buffer and the payload is read unaligned.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_PACKET && (*c).cmsg_type == libc::PACKET_AUXDATA {
                return Some(std::ptr::read_unaligned(
                    libc::CMSG_DATA(c) as *const libc::tpacket_auxdata
                ));
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
    }
    None
}

impl AsRawFd for PacketSocket {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsFd for PacketSocket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
