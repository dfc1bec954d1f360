//! One vsock stream connection: the host Unix stream it is bridged to, its
//! state, and the credit accounting of virtio 1.2 §5.10.6.3 in both
//! directions.
//!
//! Host → guest: the device reads the host socket only while the guest has
//! credit (`peer_buf_alloc - (tx_cnt - peer_fwd_cnt)`), at most that many
//! bytes, straight into an RX buffer; nothing is buffered on this side, so
//! a guest that never reads leaves the bytes in the host socket (the host
//! writer blocks) instead of in the VMM.
//!
//! Guest → host: every packet the device sends advertises [`BUF_ALLOC`] and
//! `fwd_cnt` (bytes written to the host socket). Bytes the host socket does
//! not take at once wait in `out`, which the guest's credit bounds to
//! [`BUF_ALLOC`]; a guest that sends beyond it is reset. The device tells
//! the guest of freed space (CREDIT_UPDATE) once `fwd_cnt` moved
//! [`CREDIT_UPDATE_THRESHOLD`] past what it last advertised, or when asked.

use std::io::{ErrorKind, Read};
use std::net::Shutdown;
use std::num::Wrapping;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use super::packet::{
    Header, HOST_CID, OP_REQUEST, OP_RESPONSE, OP_RW, OP_SHUTDOWN, SHUTDOWN_RCV, SHUTDOWN_SEND,
    TYPE_STREAM,
};

/// Receive buffer the device advertises per connection (guest → host bytes
/// it holds when the host socket is full).
pub const BUF_ALLOC: u32 = 64 << 10;
/// `fwd_cnt` progress that makes the device send a CREDIT_UPDATE unasked.
pub const CREDIT_UPDATE_THRESHOLD: u32 = BUF_ALLOC / 2;

/// A connection as the guest names it: (host port, guest port).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    /// Port on the host side (CID 2).
    pub local: u32,
    /// Port on the guest side.
    pub peer: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// A host process connected to `PATH`; its `CONNECT <port>\n` has not arrived.
    AwaitLine,
    /// Host-initiated: REQUEST queued or sent, waiting for the guest's RESPONSE.
    Connecting,
    Established,
    /// The host is gone (or the guest shut down both ways with bytes still
    /// to flush): waiting for the guest's RST or the flush, under a deadline.
    Closing,
}

/// Control packets a connection owes the guest.
pub const P_REQUEST: u8 = 1;
pub const P_RESPONSE: u8 = 2;
pub const P_CREDIT: u8 = 4;
pub const P_SHUTDOWN: u8 = 8;

/// What the guest did wrong on a connection (it is reset, and counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    #[error("sent {len} bytes with {buffered} of {BUF_ALLOC} buffered (beyond its credit)")]
    Credit { len: u32, buffered: u32 },
    #[error("sent data after its SHUTDOWN SEND")]
    AfterShutdown,
}

/// What became of bytes for the host.
#[derive(Debug)]
pub enum HostWrite {
    Ok,
    /// The host closed its end (EPIPE, ECONNRESET): reset the connection.
    Gone(std::io::Error),
}

/// One packet a connection produced for the guest (payload in the caller's scratch).
#[derive(Debug)]
pub enum Produced {
    Packet(Header, usize),
    Nothing,
    /// Reading the host socket failed: reset the connection.
    Failed(std::io::Error),
}

pub struct Conn {
    pub stream: UnixStream,
    pub state: State,
    /// Set once the connection has its ports (at once for guest-initiated
    /// ones, after the CONNECT line for host-initiated ones).
    pub key: Option<Key>,
    pub deadline: Option<Instant>,
    /// `P_*` bits.
    pub pending: u8,
    /// In the muxer's RX queue.
    pub queued: bool,
    /// The host socket may have bytes or EOF to read (edge-triggered epoll).
    pub readable: bool,
    /// SHUTDOWN flags the guest sent, those sent to it, and those to send.
    pub shut_from_guest: u32,
    pub shut_to_guest: u32,
    pub shut_pending: u32,
    /// The host socket read EOF (the host shut down its writing side).
    pub host_eof: bool,
    /// The host closed its end entirely (EPOLLHUP, EPIPE).
    pub host_gone: bool,
    /// The device shut the host socket's writing side (the guest's SHUTDOWN SEND).
    pub host_wr_shut: bool,
    // Host → guest.
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    tx_cnt: Wrapping<u32>,
    // Guest → host.
    rx_cnt: Wrapping<u32>,
    fwd_cnt: Wrapping<u32>,
    last_fwd_cnt_sent: Wrapping<u32>,
    /// Bytes for the host socket: the first `line_left` are the `OK` line,
    /// the rest the guest's (at most BUF_ALLOC).
    out: Vec<u8>,
    line_left: usize,
}

impl Conn {
    pub fn new(stream: UnixStream, state: State, key: Option<Key>) -> Self {
        Conn {
            stream,
            state,
            key,
            deadline: None,
            pending: 0,
            queued: false,
            readable: false,
            shut_from_guest: 0,
            shut_to_guest: 0,
            shut_pending: 0,
            host_eof: false,
            host_gone: false,
            host_wr_shut: false,
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            tx_cnt: Wrapping(0),
            rx_cnt: Wrapping(0),
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            out: Vec::new(),
            line_left: 0,
        }
    }

    /// The guest's credit for host → guest bytes:
    /// `buf_alloc - (tx_cnt - fwd_cnt)`, 0 if the guest claims more than it
    /// allowed (or a `fwd_cnt` ahead of what was sent).
    pub fn credit(&self) -> u32 {
        let in_flight = (self.tx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Every packet of the guest carries its receive buffer and progress.
    pub fn update_peer(&mut self, hdr: &Header) {
        self.peer_buf_alloc = hdr.buf_alloc;
        self.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
    }

    /// Guest → host bytes the device holds (received, not yet written).
    pub fn buffered(&self) -> u32 {
        (self.rx_cnt - self.fwd_cnt).0
    }

    #[cfg(test)]
    pub fn tx_cnt(&self) -> u32 {
        self.tx_cnt.0
    }

    /// Header of a packet to the guest on this connection (`guest_cid`'s side).
    pub fn header(&self, guest_cid: u64, op: u16, len: u32, flags: u32) -> Header {
        let key = self.key.expect("a connection with ports");
        Header {
            src_cid: HOST_CID,
            dst_cid: guest_cid,
            src_port: key.local,
            dst_port: key.peer,
            len,
            type_: TYPE_STREAM,
            op,
            flags,
            buf_alloc: BUF_ALLOC,
            fwd_cnt: self.fwd_cnt.0,
        }
    }

    /// Whether host bytes may go to the guest now.
    pub fn can_send_data(&self) -> bool {
        self.state == State::Established
            && self.readable
            && !self.host_eof
            && self.shut_from_guest & SHUTDOWN_RCV == 0
            && self.credit() > 0
    }

    /// Whether the connection has something for the guest.
    pub fn has_rx_work(&self) -> bool {
        self.pending != 0 || self.can_send_data()
    }

    /// The connection owes the guest a CREDIT_UPDATE: asked for, or the
    /// host took enough bytes since the last advertised `fwd_cnt`.
    pub fn check_credit_update(&mut self) {
        if (self.fwd_cnt - self.last_fwd_cnt_sent).0 >= CREDIT_UPDATE_THRESHOLD {
            self.pending |= P_CREDIT;
        }
    }

    /// The guest's bytes for the host: written at once where the socket
    /// takes them, the rest kept (within the credit the device advertised).
    pub fn guest_data(&mut self, data: &[u8]) -> Result<HostWrite, Violation> {
        if self.shut_from_guest & SHUTDOWN_SEND != 0 {
            return Err(Violation::AfterShutdown);
        }
        let len = data.len() as u32;
        let buffered = self.buffered();
        if u64::from(buffered) + u64::from(len) > u64::from(BUF_ALLOC) {
            return Err(Violation::Credit { len, buffered });
        }
        self.rx_cnt += Wrapping(len);
        self.out.extend_from_slice(data);
        Ok(self.flush())
    }

    /// Queues the `OK <port>\n` line for the host (before any guest byte).
    pub fn queue_ok_line(&mut self, port: u32) {
        let line = format!("OK {port}\n");
        self.line_left = line.len();
        let mut out = line.into_bytes();
        out.append(&mut self.out);
        self.out = out;
    }

    /// Writes what waits for the host socket; once everything is out, a
    /// guest's SHUTDOWN SEND becomes the host socket's `shutdown(SHUT_WR)`.
    pub fn flush(&mut self) -> HostWrite {
        let mut done = 0;
        let r = loop {
            if done == self.out.len() {
                break HostWrite::Ok;
            }
            match super::socket::send(&self.stream, &self.out[done..]) {
                Ok(0) => break HostWrite::Ok,
                Ok(n) => done += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break HostWrite::Ok,
                Err(e) => break HostWrite::Gone(e),
            }
        };
        let line = done.min(self.line_left);
        self.line_left -= line;
        self.fwd_cnt += Wrapping((done - line) as u32);
        self.out.drain(..done);
        if self.out.is_empty() {
            // A drained buffer gives its memory back (a stalled host may have grown it).
            self.out.shrink_to(4096);
            if self.shut_from_guest & SHUTDOWN_SEND != 0 && !self.host_wr_shut {
                self.host_wr_shut = true;
                let _ = self.stream.shutdown(Shutdown::Write);
            }
        }
        if matches!(r, HostWrite::Ok) {
            self.check_credit_update();
        }
        r
    }

    pub fn flushed(&self) -> bool {
        self.out.is_empty()
    }

    /// The host closed its end (EPOLLHUP, not after the device's own
    /// shutdown): once nothing more can come from it, the guest hears
    /// SHUTDOWN with both flags.
    pub fn host_closed(&mut self) {
        self.host_gone = true;
        if self.host_eof || self.shut_from_guest & SHUTDOWN_RCV != 0 {
            self.shut_pending |= SHUTDOWN_RCV | SHUTDOWN_SEND;
            self.pending |= P_SHUTDOWN;
        }
    }

    /// The guest's SHUTDOWN: RCV stops host → guest bytes (and the host
    /// socket's reading side, so a host writer sees EPIPE); SEND shuts the
    /// host socket's writing side once the guest's bytes are written.
    pub fn guest_shutdown(&mut self, flags: u32) {
        let new = flags & !self.shut_from_guest;
        self.shut_from_guest |= flags;
        if new & SHUTDOWN_RCV != 0 {
            let _ = self.stream.shutdown(Shutdown::Read);
        }
        if new & SHUTDOWN_SEND != 0 {
            // Applies the shutdown now if nothing waits.
            let _ = self.flush();
        }
    }

    /// The next packet for the guest, if any: control packets first, then
    /// host bytes (at most `scratch.len()` and the guest's credit), then
    /// the SHUTDOWN that follows the host's EOF, then a CREDIT_UPDATE (any
    /// packet carries the credit, so it is sent only when nothing else is).
    pub fn produce(&mut self, guest_cid: u64, scratch: &mut [u8]) -> Produced {
        let packet = |c: &mut Conn, op, len, flags| {
            let h = c.header(guest_cid, op, len, flags);
            c.last_fwd_cnt_sent = c.fwd_cnt;
            c.pending &= !P_CREDIT;
            Produced::Packet(h, len as usize)
        };
        if self.pending & P_REQUEST != 0 {
            self.pending &= !P_REQUEST;
            return packet(self, OP_REQUEST, 0, 0);
        }
        if self.pending & P_RESPONSE != 0 {
            self.pending &= !P_RESPONSE;
            return packet(self, OP_RESPONSE, 0, 0);
        }
        while self.can_send_data() {
            let n = scratch.len().min(self.credit() as usize);
            match self.stream.read(&mut scratch[..n]) {
                Ok(0) => {
                    self.readable = false;
                    self.host_eof = true;
                    self.shut_pending |= SHUTDOWN_SEND;
                    if self.host_gone {
                        self.shut_pending |= SHUTDOWN_RCV;
                    }
                    self.pending |= P_SHUTDOWN;
                }
                Ok(n) => {
                    self.tx_cnt += Wrapping(n as u32);
                    return packet(self, OP_RW, n as u32, 0);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => self.readable = false,
                Err(e) => {
                    self.readable = false;
                    return Produced::Failed(e);
                }
            }
        }
        if self.pending & P_SHUTDOWN != 0 {
            self.pending &= !P_SHUTDOWN;
            let flags = self.shut_pending & !self.shut_to_guest;
            self.shut_pending = 0;
            if flags != 0 {
                self.shut_to_guest |= flags;
                return packet(self, OP_SHUTDOWN, 0, flags);
            }
        }
        if self.pending & P_CREDIT != 0 {
            return packet(self, super::packet::OP_CREDIT_UPDATE, 0, 0);
        }
        Produced::Nothing
    }
}
