//! The connection table of one device (Firecracker's "muxer"): host
//! connections accepted on `PATH`, guest connections to `PATH_<port>`, the
//! guest's packets dispatched to them, and the packets owed to the guest.
//!
//! Connections live in a slot table (epoll token = `TOKEN_CONN + slot`) and
//! are found by [`Key`] once they have ports. What the guest is owed waits
//! in two bounded places, never in a per-packet queue: per connection a few
//! `P_*` bits plus its readable host socket (a FIFO of connection slots
//! serves them round-robin, one packet per turn), and for RSTs to
//! connections the device does not (or no longer) know, a queue of at most
//! [`MAX_RSTS`] headers (further ones are dropped and counted: a guest that
//! floods TX without posting RX buffers only loses its own RSTs).
//!
//! Connection sockets are registered edge-triggered (IN, OUT, RDHUP): the
//! device reads one only while the guest has credit and RX buffers, and
//! remembers that it is readable meanwhile, so a stalled connection never
//! makes the loop spin or other connections wait. The guest's packets are
//! dispatched in `guest.rs`.

mod guest;

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::conn::{Conn, HostWrite, Key, Produced, State, BUF_ALLOC, P_REQUEST};
use super::packet::*;
use super::socket::{self, Line, CONNECT_LINE_MAX};
use super::{note, Limits, VsockCounters, TOKEN_CONN, TOKEN_LISTENER};

/// RSTs for unknown connections waiting for RX buffers, at most.
pub const MAX_RSTS: usize = 1024;
/// Host ports the device allocates for host-initiated connections start
/// here (as Firecracker's), far from the guest's own choices.
pub const FIRST_LOCAL_PORT: u32 = 1 << 30;
/// How long accepting pauses after accept() failed (e.g. EMFILE), so that a
/// level-triggered listener cannot make the loop spin.
const ACCEPT_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

pub struct Muxer {
    cid: u64,
    path: PathBuf,
    listener: Arc<UnixListener>,
    pub(super) epoll: Epoll,
    counters: Arc<VsockCounters>,
    limits: Limits,
    slots: Vec<Option<Conn>>,
    free: Vec<usize>,
    live: usize,
    keys: HashMap<Key, usize>,
    rxq: VecDeque<usize>,
    rsts: VecDeque<Header>,
    next_port: u32,
    accept_paused: Option<Instant>,
}

impl Muxer {
    pub fn new(
        cid: u64,
        path: PathBuf,
        listener: Arc<UnixListener>,
        epoll: Epoll,
        counters: Arc<VsockCounters>,
        limits: Limits,
    ) -> Self {
        Muxer {
            cid,
            path,
            listener,
            epoll,
            counters,
            limits,
            slots: Vec::new(),
            free: Vec::new(),
            live: 0,
            keys: HashMap::new(),
            rxq: VecDeque::new(),
            rsts: VecDeque::new(),
            next_port: FIRST_LOCAL_PORT,
            accept_paused: None,
        }
    }

    /// Open connections.
    pub fn len(&self) -> usize {
        self.live
    }

    #[cfg(test)]
    pub fn conn(&self, key: Key) -> Option<&Conn> {
        self.keys.get(&key).and_then(|&i| self.slots[i].as_ref())
    }

    fn insert(&mut self, conn: Conn) -> std::io::Result<usize> {
        let i = self.free.pop().unwrap_or_else(|| {
            self.slots.push(None);
            self.slots.len() - 1
        });
        let set = EventSet::IN | EventSet::OUT | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED;
        let ev = EpollEvent::new(set, TOKEN_CONN + i as u64);
        if let Err(e) = self
            .epoll
            .ctl(ControlOperation::Add, conn.stream.as_raw_fd(), ev)
        {
            self.free.push(i);
            return Err(e);
        }
        if let Some(key) = conn.key {
            self.keys.insert(key, i);
        }
        self.slots[i] = Some(conn);
        self.live += 1;
        Ok(i)
    }

    /// Forgets connection `i` and closes its host socket (which leaves the epoll set).
    fn remove(&mut self, i: usize) -> Option<Conn> {
        let c = self.slots.get_mut(i)?.take()?;
        if let Some(key) = c.key {
            self.keys.remove(&key);
        }
        self.free.push(i);
        self.live -= 1;
        Some(c)
    }

    /// Closes connection `i` and tells the guest (RST).
    fn kill(&mut self, i: usize) {
        if let Some(c) = self.remove(i) {
            if let Some(key) = c.key {
                self.push_rst(self.rst_to(key));
            }
        }
    }

    fn rst_to(&self, key: Key) -> Header {
        Header {
            src_cid: HOST_CID,
            dst_cid: self.cid,
            src_port: key.local,
            dst_port: key.peer,
            type_: TYPE_STREAM,
            op: OP_RST,
            buf_alloc: BUF_ALLOC,
            ..Header::default()
        }
    }

    fn push_rst(&mut self, h: Header) {
        if self.rsts.len() >= MAX_RSTS {
            note(
                &self.counters.rst_dropped,
                format_args!(
                    "vsock {}: no RX buffers for {MAX_RSTS} RSTs, one dropped",
                    self.path.display()
                ),
            );
            return;
        }
        self.rsts.push_back(h);
    }

    fn enqueue(&mut self, i: usize) {
        if let Some(c) = self.slots[i].as_mut() {
            if !c.queued && c.has_rx_work() {
                c.queued = true;
                self.rxq.push_back(i);
            }
        }
    }

    /// Whether the guest is owed a packet (approximately: a queued
    /// connection may turn out to have nothing).
    pub fn has_rx_work(&self) -> bool {
        !self.rsts.is_empty() || !self.rxq.is_empty()
    }

    /// The next packet for the guest, its payload in `scratch[..n]` (whose
    /// length bounds it: the RX buffer's room).
    pub fn next_packet(&mut self, scratch: &mut [u8], now: Instant) -> Option<(Header, usize)> {
        loop {
            if let Some(h) = self.rsts.pop_front() {
                return Some((h, 0));
            }
            let i = self.rxq.pop_front()?;
            let Some(c) = self.slots[i].as_mut() else {
                continue;
            };
            c.queued = false;
            match c.produce(self.cid, scratch) {
                Produced::Packet(h, n) => {
                    if h.op == OP_SHUTDOWN && c.shut_to_guest == SHUTDOWN_BOTH {
                        // The host is gone: wait for the guest's RST, not forever.
                        c.state = State::Closing;
                        c.deadline = Some(now + self.limits.close_timeout);
                    }
                    self.enqueue(i);
                    return Some((h, n));
                }
                Produced::Nothing => {}
                Produced::Failed(e) => {
                    tracing::debug!("vsock {}: host socket read: {e}", self.path.display());
                    self.kill(i);
                }
            }
        }
    }

    /// The guest lost bytes the device read for it (its RX buffer failed):
    /// the stream cannot go on.
    pub fn reset(&mut self, key: Key) {
        if let Some(&i) = self.keys.get(&key) {
            self.kill(i);
        }
    }

    /// Accepts every pending host connection on `PATH`.
    pub fn accept(&mut self, now: Instant) {
        if self.accept_paused.is_some() {
            return;
        }
        loop {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!("vsock {}: accept: {e}", self.path.display());
                    self.pause_accept(now);
                    return;
                }
            };
            if self.live >= self.limits.max_connections {
                note(
                    &self.counters.refused,
                    format_args!(
                        "vsock {}: host connection refused: {} connections open",
                        self.path.display(),
                        self.live
                    ),
                );
                continue;
            }
            if let Err(e) = stream.set_nonblocking(true) {
                tracing::warn!("vsock {}: host connection: {e}", self.path.display());
                continue;
            }
            let mut c = Conn::new(stream, State::AwaitLine, None);
            c.deadline = Some(now + self.limits.connect_timeout);
            match self.insert(c) {
                Ok(i) => {
                    self.counters
                        .host_connections
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    self.await_line(i, now);
                }
                Err(e) => tracing::warn!("vsock {}: epoll add: {e}", self.path.display()),
            }
        }
    }

    fn pause_accept(&mut self, now: Instant) {
        let fd = self.listener.as_raw_fd();
        let ev = EpollEvent::new(EventSet::empty(), TOKEN_LISTENER);
        if self.epoll.ctl(ControlOperation::Modify, fd, ev).is_ok() {
            self.accept_paused = Some(now + ACCEPT_PAUSE);
        }
    }

    /// Reads a host connection's `CONNECT <port>\n` (only the line: bytes
    /// after it stay in the socket until the connection is established).
    fn await_line(&mut self, i: usize, now: Instant) {
        let mut buf = [0u8; CONNECT_LINE_MAX];
        let peeked = match self.slots[i].as_ref() {
            Some(c) => socket::peek(&c.stream, &mut buf),
            None => return,
        };
        let line = match peeked {
            Ok(0) => {
                self.remove(i);
                return;
            }
            Ok(n) => socket::parse_line(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => return,
            Err(_) => {
                self.remove(i);
                return;
            }
        };
        let (port, len) = match line {
            Line::Incomplete => return,
            Line::Bad => {
                let shown = String::from_utf8_lossy(&buf).into_owned();
                note(
                    &self.counters.bad_connect_lines,
                    format_args!(
                        "vsock {}: host connection closed: not a CONNECT <port> line: {shown:?}",
                        self.path.display()
                    ),
                );
                self.remove(i);
                return;
            }
            Line::Connect { port, len } => (port, len),
        };
        let c = self.slots[i].as_mut().expect("peeked above");
        // The peeked line is in the socket: this read takes exactly it.
        if c.stream.read_exact(&mut buf[..len]).is_err() {
            self.remove(i);
            return;
        }
        let Some(local) = self.alloc_port(port) else {
            self.remove(i);
            return;
        };
        let key = Key { local, peer: port };
        let c = self.slots[i].as_mut().expect("checked above");
        c.key = Some(key);
        c.state = State::Connecting;
        c.pending |= P_REQUEST;
        c.deadline = Some(now + self.limits.connect_timeout);
        self.keys.insert(key, i);
        self.enqueue(i);
    }

    fn alloc_port(&mut self, peer: u32) -> Option<u32> {
        for _ in 0..=self.limits.max_connections {
            let p = self.next_port;
            self.next_port = p.checked_add(1).unwrap_or(FIRST_LOCAL_PORT);
            if !self.keys.contains_key(&Key { local: p, peer }) {
                return Some(p);
            }
        }
        None
    }

    /// Readiness of connection `i`'s host socket.
    pub fn conn_event(&mut self, i: usize, ev: EventSet, now: Instant) {
        let Some(c) = self.slots.get_mut(i).and_then(Option::as_mut) else {
            return;
        };
        let input = EventSet::IN | EventSet::READ_HANG_UP | EventSet::HANG_UP | EventSet::ERROR;
        if c.state == State::AwaitLine {
            if ev.intersects(input) {
                self.await_line(i, now);
            }
            return;
        }
        // EPOLLHUP: both directions are shut. After the device's own
        // shutdown(SHUT_WR) that is just the host's EOF; otherwise the host
        // closed its end, and nothing it is owed can be written.
        if ev.contains(EventSet::ERROR) || (ev.contains(EventSet::HANG_UP) && !c.host_wr_shut) {
            if c.state == State::Connecting || !c.flushed() {
                self.kill(i);
                return;
            }
            c.host_closed();
        }
        if ev.intersects(input) {
            c.readable = true;
        }
        if ev.contains(EventSet::OUT) && !c.flushed() {
            if let HostWrite::Gone(_) = c.flush() {
                self.kill(i);
                return;
            }
            if self.finish_guest_close(i) {
                return;
            }
        }
        self.enqueue(i);
    }

    /// A connection the guest shut down both ways ends (RST) once its bytes
    /// reached the host. Returns whether it ended.
    fn finish_guest_close(&mut self, i: usize) -> bool {
        let done = self.slots[i]
            .as_ref()
            .is_some_and(|c| c.shut_from_guest == SHUTDOWN_BOTH && c.flushed());
        if done {
            self.kill(i);
        }
        done
    }

    /// Deadlines: host connections without a CONNECT line, REQUESTs the
    /// guest did not answer, closes that did not complete.
    pub fn expire(&mut self, now: Instant) {
        if self.accept_paused.is_some_and(|t| t <= now) {
            let fd = self.listener.as_raw_fd();
            let ev = EpollEvent::new(EventSet::IN, TOKEN_LISTENER);
            if self.epoll.ctl(ControlOperation::Modify, fd, ev).is_ok() {
                self.accept_paused = None;
            }
        }
        for i in 0..self.slots.len() {
            let Some(c) = self.slots[i].as_mut() else {
                continue;
            };
            if c.deadline.is_none_or(|d| d > now) {
                continue;
            }
            c.deadline = None;
            let path = self.path.display();
            match c.state {
                State::AwaitLine => {
                    note(
                        &self.counters.timeouts,
                        format_args!("vsock {path}: host connection sent no CONNECT line"),
                    );
                    self.remove(i);
                }
                State::Connecting => {
                    let port = c.key.map_or(0, |k| k.peer);
                    note(
                        &self.counters.timeouts,
                        format_args!(
                            "vsock {path}: guest did not answer the connection to port {port} in {:?}",
                            self.limits.connect_timeout
                        ),
                    );
                    self.kill(i);
                }
                State::Closing => self.kill(i),
                State::Established => {}
            }
        }
    }

    /// The earliest deadline (for the epoll timeout).
    pub fn next_deadline(&self) -> Option<Instant> {
        self.slots
            .iter()
            .flatten()
            .filter_map(|c| c.deadline)
            .chain(self.accept_paused)
            .min()
    }
}
