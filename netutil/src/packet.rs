//! AF_PACKET sockets bound to one interface: a wire to read and write whole
//! Ethernet frames on (the NIC's veth uplink, the tests' view of a tap).
//!
//! With `vlan_aux` the kernel reports the VLAN tag it stripped from a
//! received frame (PACKET_AUXDATA) and `recv` puts it back, so the frame
//! reads as it was on the wire.
//!
//! With `rx_ring` (non-blocking sockets) frames arrive in a TPACKET_V2 ring
//! mapped into the process (PACKET_RX_RING, as DPDK's af_packet driver
//! reads them): `recv` looks at the next slot's status word and makes no
//! system call when nothing is pending, so a poll-mode reader's idle rounds
//! cost no syscall. poll(2) still reports the socket readable while a frame
//! waits in the ring.

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
    /// Receive through a mapped TPACKET_V2 ring (non-blocking sockets only;
    /// see the module doc). VLAN tags are restored as with `vlan_aux`.
    pub rx_ring: bool,
}

/// The ring's geometry: 2 KiB slots (a 1518-byte frame after the slot's
/// header and address), two per page, 512 in all.
const RING_FRAME: u32 = 2048;
const RING_BLOCK: u32 = 4096;
const RING_FRAMES: u32 = 512;
const TP_STATUS_VLAN_VALID: u32 = 1 << 4;
const TP_STATUS_VLAN_TPID_VALID: u32 = 1 << 6;

/// A PACKET_RX_RING mapping: `RING_FRAMES` slots the kernel fills and hands
/// over with TP_STATUS_USER in their status word; the reader hands each
/// back with TP_STATUS_KERNEL.
#[derive(Debug)]
struct RxRing {
    base: std::ptr::NonNull<u8>,
    len: usize,
    /// The next slot to read (one reader at a time: `recv` takes it).
    head: std::sync::Mutex<u32>,
}

// SAFETY: the mapping is shared memory with the kernel, read and handed back
// slot by slot under `head`'s lock; the pointer is valid until drop.
unsafe impl Send for RxRing {}
// SAFETY: as above: every access to a slot happens with `head` locked.
unsafe impl Sync for RxRing {}

impl Drop for RxRing {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are the mapping made in `map_rx_ring`, unmapped once.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
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
    rx_ring: Option<RxRing>,
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
        let rx_ring = if opts.rx_ring {
            if !opts.nonblocking {
                return Err(err("PACKET_RX_RING")(nix::Error::EINVAL));
            }
            let ring = map_rx_ring(&fd).map_err(err("PACKET_RX_RING"))?;
            // A bind to a down link leaves ENETDOWN pending on the socket. A
            // ring reader never reads it (no recvmsg), so the first send
            // would fail with it: read (and so clear) it now.
            let _ = socket::getsockopt(&fd, sockopt::SocketError);
            Some(ring)
        } else {
            None
        };
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
            rx_ring,
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
        if let Some(ring) = &self.rx_ring {
            return Ok(ring.recv(buf));
        }
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
                len = insert_vlan_tag(buf, len, tpid, aux.tp_vlan_tci);
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

/// Puts back the 802.1Q tag the kernel stripped (after the two MAC
/// addresses); returns the new length.
fn insert_vlan_tag(buf: &mut [u8], len: usize, tpid: u16, tci: u16) -> usize {
    buf.copy_within(12..len, 16);
    buf[12..14].copy_from_slice(&tpid.to_be_bytes());
    buf[14..16].copy_from_slice(&tci.to_be_bytes());
    len + 4
}

/// Switches `fd` to TPACKET_V2, asks for an RX ring and maps it.
fn map_rx_ring(fd: &OwnedFd) -> Result<RxRing, nix::Error> {
    let setopt = |name: libc::c_int, val: *const libc::c_void, len: usize| {
        // SAFETY: `val` points to a live value of `len` bytes for the call.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                name,
                val,
                len as libc::socklen_t,
            )
        };
        if r < 0 {
            Err(nix::Error::last())
        } else {
            Ok(())
        }
    };
    let version: libc::c_int = libc::tpacket_versions::TPACKET_V2 as libc::c_int;
    setopt(
        libc::PACKET_VERSION,
        (&version as *const libc::c_int).cast(),
        size_of::<libc::c_int>(),
    )?;
    let req = libc::tpacket_req {
        tp_block_size: RING_BLOCK,
        tp_block_nr: RING_FRAMES * RING_FRAME / RING_BLOCK,
        tp_frame_size: RING_FRAME,
        tp_frame_nr: RING_FRAMES,
    };
    setopt(
        libc::PACKET_RX_RING,
        (&req as *const libc::tpacket_req).cast(),
        size_of::<libc::tpacket_req>(),
    )?;
    let len = (RING_FRAMES * RING_FRAME) as usize;
    // SAFETY: a fresh shared mapping of the socket's ring, of the size asked for.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(nix::Error::last());
    }
    Ok(RxRing {
        base: std::ptr::NonNull::new(p.cast()).ok_or(nix::Error::EFAULT)?,
        len,
        head: std::sync::Mutex::new(0),
    })
}

impl RxRing {
    /// The next frame, copied into `buf` (the slot goes back to the kernel);
    /// `None` when the next slot is still the kernel's. A frame the slot or
    /// `buf` cut short is reported as outgoing with length 0 (skipped), as
    /// the socket path reports MSG_TRUNC.
    fn recv(&self, buf: &mut [u8]) -> Option<Received> {
        use std::sync::atomic::{AtomicU32, Ordering};
        let mut head = self.head.lock().unwrap_or_else(|e| e.into_inner());
        let off = (*head * RING_FRAME) as usize;
        // SAFETY: `off` is a slot start inside the mapping; slots are 2 KiB and
        // 16-byte aligned, so the header's fields are in bounds and aligned.
        let slot = unsafe { self.base.as_ptr().add(off) };
        let hdr = slot.cast::<libc::tpacket2_hdr>();
        // SAFETY: the status word is shared with the kernel: read atomically.
        let status = unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*hdr).tp_status)) };
        let st = status.load(Ordering::Acquire);
        if st & libc::TP_STATUS_USER == 0 {
            return None;
        }
        // SAFETY: the slot is ours (TP_STATUS_USER, acquired) until handed back.
        let h = unsafe { std::ptr::read(hdr) };
        // TPACKET_ALIGN(sizeof(tpacket2_hdr)): 16-byte alignment.
        let sll_off = size_of::<libc::tpacket2_hdr>().next_multiple_of(16);
        // SAFETY: the kernel writes the sockaddr_ll right after the aligned header.
        let pkttype = unsafe { (*slot.add(sll_off).cast::<libc::sockaddr_ll>()).sll_pkttype };
        let (mac, snap) = (h.tp_mac as usize, h.tp_snaplen as usize);
        let vlan = h.tp_status & TP_STATUS_VLAN_VALID != 0;
        let room = buf.len().saturating_sub(if vlan { 4 } else { 0 });
        let r = if snap < h.tp_len as usize || mac + snap > RING_FRAME as usize || snap > room {
            Received {
                len: 0,
                outgoing: true,
            }
        } else {
            // SAFETY: `mac + snap` lies inside this slot (checked above).
            let frame = unsafe { std::slice::from_raw_parts(slot.add(mac), snap) };
            buf[..snap].copy_from_slice(frame);
            let mut len = snap;
            if vlan && len >= 12 {
                let tpid = if h.tp_status & TP_STATUS_VLAN_TPID_VALID != 0 {
                    h.tp_vlan_tpid
                } else {
                    0x8100
                };
                len = insert_vlan_tag(buf, len, tpid, h.tp_vlan_tci);
            }
            Received {
                len,
                outgoing: pkttype == libc::PACKET_OUTGOING,
            }
        };
        status.store(libc::TP_STATUS_KERNEL, Ordering::Release);
        *head = (*head + 1) % RING_FRAMES;
        Some(r)
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
