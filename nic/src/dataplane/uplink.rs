//! The PF's uplink: a tap device, or an AF_PACKET socket bound to an interface
//! (a veth end) inside a network namespace. Both are non-blocking fds that
//! carry one Ethernet frame per read/write.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UplinkSpec {
    Tap(String),
    Veth { netns: String, ifname: String },
}

impl std::str::FromStr for UplinkSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(name) = s.strip_prefix("tap:") {
            if name.is_empty() || name.len() >= libc::IFNAMSIZ {
                return Err(format!("uplink {s:?}: tap name must be 1..15 bytes"));
            }
            return Ok(UplinkSpec::Tap(name.into()));
        }
        if let Some(rest) = s.strip_prefix("veth:") {
            if let Some((ns, ifname)) = rest.split_once('/') {
                if !ns.is_empty() && !ifname.is_empty() && ifname.len() < libc::IFNAMSIZ {
                    return Ok(UplinkSpec::Veth {
                        netns: ns.into(),
                        ifname: ifname.into(),
                    });
                }
            }
        }
        Err(format!("uplink {s:?}: expected tap:NAME or veth:NETNS/IF"))
    }
}

#[derive(Debug, thiserror::Error)]
#[error("uplink {what}: {source}")]
pub struct UplinkError {
    what: String,
    source: io::Error,
}

pub struct Uplink {
    fd: OwnedFd,
    packet_socket: bool,
}

fn ifreq(name: &str) -> libc::ifreq {
    // SAFETY: ifreq is plain data; all-zero is valid.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    req
}

/// Sets IFF_UP on `name` through any socket of the namespace the socket is in.
fn set_up(sock: RawFd, name: &str) -> io::Result<()> {
    let mut req = ifreq(name);
    // SAFETY: ioctls with a valid ifreq on a valid socket.
    unsafe {
        if libc::ioctl(sock, libc::SIOCGIFFLAGS, &mut req) < 0 {
            return Err(io::Error::last_os_error());
        }
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(sock, libc::SIOCSIFFLAGS, &req) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn check(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

impl Uplink {
    pub fn open(spec: &UplinkSpec) -> Result<Self, UplinkError> {
        match spec {
            UplinkSpec::Tap(name) => Self::open_tap(name).map_err(|source| UplinkError {
                what: format!("tap:{name}"),
                source,
            }),
            UplinkSpec::Veth { netns, ifname } => {
                let (ns, ifn) = (netns.clone(), ifname.clone());
                // setns only on a throw-away thread: the daemon's threads stay in
                // the host namespace, the socket stays bound to the netns.
                std::thread::spawn(move || Self::open_packet_in_netns(&ns, &ifn))
                    .join()
                    .unwrap_or_else(|_| Err(io::Error::other("netns thread panicked")))
                    .map_err(|source| UplinkError {
                        what: format!("veth:{netns}/{ifname}"),
                        source,
                    })
            }
        }
    }

    fn open_tap(name: &str) -> io::Result<Self> {
        let f = File::options()
            .read(true)
            .write(true)
            .open("/dev/net/tun")?;
        let mut req = ifreq(name);
        req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
        // SAFETY: TUNSETIFF with a valid ifreq.
        check(unsafe { libc::ioctl(f.as_raw_fd(), libc::TUNSETIFF, &req) })?;
        let fd: OwnedFd = f.into();
        set_nonblocking(fd.as_raw_fd())?;
        // SAFETY: plain socket creation.
        let s = check(unsafe {
            libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0)
        })?;
        // SAFETY: s was just created and is owned here.
        let s = unsafe { OwnedFd::from_raw_fd(s) };
        set_up(s.as_raw_fd(), name)?;
        Ok(Uplink {
            fd,
            packet_socket: false,
        })
    }

    fn open_packet_in_netns(netns: &str, ifname: &str) -> io::Result<Self> {
        let path = if netns.starts_with('/') {
            netns.to_string()
        } else {
            format!("/run/netns/{netns}")
        };
        let ns = File::open(&path)?;
        // SAFETY: setns on this (throw-away) thread with a valid netns fd.
        check(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) })?;
        let proto = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket creation.
        let s = check(unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                proto as i32,
            )
        })?;
        // SAFETY: s was just created and is owned here.
        let fd = unsafe { OwnedFd::from_raw_fd(s) };
        let cname = CString::new(ifname).map_err(io::Error::other)?;
        // SAFETY: valid C string.
        let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) };
        if ifindex == 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: sockaddr_ll is plain data.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: bind with a valid sockaddr_ll.
        check(unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &sll as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        })?;
        enable_auxdata(fd.as_raw_fd())?;
        set_up(fd.as_raw_fd(), ifname)?;
        Ok(Uplink {
            fd,
            packet_socket: true,
        })
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Reads one frame; `None` when nothing is pending.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        loop {
            let n = if self.packet_socket {
                match recv_packet(self.raw_fd(), buf) {
                    Ok(Some((n, outgoing))) if !outgoing => n as isize,
                    // Our own transmissions and the host's are not input.
                    Ok(Some(_)) => continue,
                    Ok(None) => return Ok(None),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
            } else {
                // SAFETY: read into a valid buffer.
                unsafe { libc::read(self.raw_fd(), buf.as_mut_ptr().cast(), buf.len()) }
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock => Ok(None),
                    io::ErrorKind::Interrupted => continue,
                    _ => Err(e),
                };
            }
            if n as usize > buf.len() {
                continue; // larger than a packet buffer: dropped
            }
            return Ok(Some(n as usize));
        }
    }

    /// Writes one frame; false if it was dropped (queue full).
    pub fn send(&self, frame: &[u8]) -> bool {
        // SAFETY: write from a valid buffer.
        let n = unsafe { libc::write(self.raw_fd(), frame.as_ptr().cast(), frame.len()) };
        n == frame.len() as isize
    }
}

/// Asks the kernel for the VLAN tag of received frames (see `recv_packet`).
pub fn enable_auxdata(fd: RawFd) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: setsockopt with a valid int option.
    check(unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_PACKET,
            libc::PACKET_AUXDATA,
            &on as *const _ as *const libc::c_void,
            4,
        )
    })?;
    Ok(())
}

/// Receives one frame from an AF_PACKET socket (with `enable_auxdata`). The kernel strips a VLAN tag
/// into metadata (PACKET_AUXDATA); it is put back into the frame. Returns the
/// length and whether the frame was outgoing; `None` if nothing is pending.
pub fn recv_packet(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<(usize, bool)>> {
    const TP_STATUS_VLAN_VALID: u32 = 1 << 4;
    const TP_STATUS_VLAN_TPID_VALID: u32 = 1 << 6;
    // SAFETY: plain data structures for recvmsg, all pointers valid for the call.
    unsafe {
        let mut sll: libc::sockaddr_ll = std::mem::zeroed();
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let mut cbuf = [0u64; 16];
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_name = &mut sll as *mut _ as *mut libc::c_void;
        msg.msg_namelen = std::mem::size_of::<libc::sockaddr_ll>() as u32;
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&cbuf);
        let n = libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT);
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::WouldBlock {
                Ok(None)
            } else {
                Err(e)
            };
        }
        let mut n = n as usize;
        if msg.msg_flags & libc::MSG_TRUNC != 0 {
            return Ok(Some((0, true))); // too large for a packet buffer: skipped
        }
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_PACKET && (*c).cmsg_type == libc::PACKET_AUXDATA {
                let aux =
                    std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::tpacket_auxdata);
                if aux.tp_status & TP_STATUS_VLAN_VALID != 0 && n >= 12 && n + 4 <= buf.len() {
                    let tpid = if aux.tp_status & TP_STATUS_VLAN_TPID_VALID != 0 {
                        aux.tp_vlan_tpid
                    } else {
                        0x8100
                    };
                    buf.copy_within(12..n, 16);
                    buf[12..14].copy_from_slice(&tpid.to_be_bytes());
                    buf[14..16].copy_from_slice(&aux.tp_vlan_tci.to_be_bytes());
                    n += 4;
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
        Ok(Some((n, sll.sll_pkttype == libc::PACKET_OUTGOING)))
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a valid fd.
    let flags = check(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
    check(unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn parses_specs() {
        assert_eq!(
            "tap:up0".parse::<UplinkSpec>(),
            Ok(UplinkSpec::Tap("up0".into()))
        );
        assert_eq!(
            "veth:ns1/eth0".parse::<UplinkSpec>(),
            Ok(UplinkSpec::Veth {
                netns: "ns1".into(),
                ifname: "eth0".into()
            })
        );
        assert!("veth:ns1".parse::<UplinkSpec>().is_err());
        assert!("tap:".parse::<UplinkSpec>().is_err());
        assert!("eth0".parse::<UplinkSpec>().is_err());
    }
}
