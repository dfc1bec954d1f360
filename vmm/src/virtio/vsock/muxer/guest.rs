//! The guest's packets, dispatched to the connection table: a REQUEST
//! opens a connection to `PATH_<port>`, the other ops act on their
//! connection as virtio 1.2 §5.10.6 says; a packet for no connection is
//! answered with RST, a bad CID or type refused, an op out of place resets
//! its connection, and every such case is counted.

use std::time::Instant;

use super::Muxer;
use crate::virtio::vsock::conn::{Conn, HostWrite, Key, State, Violation, P_CREDIT, P_RESPONSE};
use crate::virtio::vsock::note;
use crate::virtio::vsock::packet::*;
use crate::virtio::vsock::socket::{self, Connect};

impl Muxer {
    /// A well-formed packet from the guest (its chain already checked).
    pub fn guest_packet(&mut self, h: &Header, payload: &[u8], now: Instant) {
        let path = self.path.display();
        if h.src_cid != self.cid || h.dst_cid != HOST_CID {
            note(
                &self.counters.bad_headers,
                format_args!(
                    "vsock {path}: {} from CID {} to CID {} dropped (guest is {}, host {HOST_CID})",
                    op_name(h.op),
                    h.src_cid,
                    h.dst_cid,
                    self.cid
                ),
            );
            return;
        }
        let key = Key {
            local: h.dst_port,
            peer: h.src_port,
        };
        let found = self.keys.get(&key).copied();
        if h.type_ != TYPE_STREAM {
            note(
                &self.counters.bad_headers,
                format_args!("vsock {path}: socket type {} refused", h.type_),
            );
            if let Some(i) = found {
                self.remove(i);
            }
            if h.op != OP_RST {
                self.push_rst(self.rst_to(key));
            }
            return;
        }
        let Some(i) = found else {
            match h.op {
                OP_REQUEST => self.guest_request(h, key),
                OP_RST => {}
                _ => {
                    note(
                        &self.counters.unknown_connection,
                        format_args!(
                            "vsock {path}: {} for no connection ({} -> {}): RST",
                            op_name(h.op),
                            h.src_port,
                            h.dst_port
                        ),
                    );
                    self.push_rst(self.rst_to(key));
                }
            }
            return;
        };
        let c = self.slots[i].as_mut().expect("keys index live slots");
        c.update_peer(h);
        match (h.op, c.state) {
            (OP_RST, _) => {
                self.remove(i);
            }
            (OP_RESPONSE, State::Connecting) => {
                c.state = State::Established;
                c.deadline = None;
                c.queue_ok_line(key.local);
                // Bytes the host sent right after its CONNECT line wait in the socket.
                c.readable = true;
                if let HostWrite::Gone(_) = c.flush() {
                    self.kill(i);
                    return;
                }
                self.enqueue(i);
            }
            (OP_RW, State::Established | State::Closing) => {
                if c.host_gone {
                    return; // closing: the guest has not seen our SHUTDOWN yet
                }
                match c.guest_data(payload) {
                    Ok(HostWrite::Ok) => self.enqueue(i),
                    Ok(HostWrite::Gone(e)) => {
                        tracing::debug!("vsock {path}: host socket write: {e}");
                        self.kill(i);
                    }
                    Err(v) => {
                        let counter = match v {
                            Violation::Credit { .. } => &self.counters.credit_violations,
                            Violation::AfterShutdown => &self.counters.protocol_errors,
                        };
                        note(
                            counter,
                            format_args!("vsock {path}: guest port {}: {v}: RST", key.peer),
                        );
                        self.kill(i);
                    }
                }
            }
            (OP_SHUTDOWN, State::Established | State::Closing) => {
                c.guest_shutdown(h.flags & SHUTDOWN_BOTH);
                if c.shut_from_guest == SHUTDOWN_BOTH {
                    if !self.finish_guest_close(i) {
                        let c = self.slots[i].as_mut().expect("not ended");
                        c.state = State::Closing;
                        c.deadline = Some(now + self.limits.close_timeout);
                    }
                    return;
                }
                self.enqueue(i);
            }
            (OP_CREDIT_UPDATE, _) => self.enqueue(i),
            (OP_CREDIT_REQUEST, _) => {
                c.pending |= P_CREDIT;
                self.enqueue(i);
            }
            (OP_REQUEST | OP_RESPONSE | OP_RW | OP_SHUTDOWN, state) => {
                note(
                    &self.counters.protocol_errors,
                    format_args!(
                        "vsock {path}: {} on a connection in state {state:?}: RST",
                        op_name(h.op)
                    ),
                );
                self.kill(i);
            }
            (op, _) => note(
                &self.counters.bad_headers,
                format_args!("vsock {path}: unknown op {op} dropped"),
            ),
        }
    }

    /// The guest connects to host port `key.local`: `PATH_<port>`.
    fn guest_request(&mut self, h: &Header, key: Key) {
        let path = self.path.display().to_string();
        if self.live >= self.limits.max_connections {
            note(
                &self.counters.refused,
                format_args!(
                    "vsock {path}: guest connection to port {} refused: {} connections open",
                    key.local, self.live
                ),
            );
            self.push_rst(self.rst_to(key));
            return;
        }
        let target = socket::port_path(&self.path, key.local);
        let stream = match socket::connect(&target) {
            Connect::Connected(s) => s,
            Connect::Refused(e) => {
                note(
                    &self.counters.connect_failures,
                    format_args!(
                        "vsock {path}: guest connection to {}: {e}: RST",
                        target.display()
                    ),
                );
                self.push_rst(self.rst_to(key));
                return;
            }
            Connect::Busy => {
                note(
                    &self.counters.connect_failures,
                    format_args!(
                        "vsock {path}: guest connection to {}: backlog full: RST",
                        target.display()
                    ),
                );
                self.push_rst(self.rst_to(key));
                return;
            }
        };
        let mut c = Conn::new(stream, State::Established, Some(key));
        c.update_peer(h);
        c.pending |= P_RESPONSE;
        match self.insert(c) {
            Ok(i) => {
                self.counters
                    .guest_connections
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.enqueue(i);
            }
            Err(e) => {
                tracing::warn!("vsock {path}: epoll add: {e}");
                self.push_rst(self.rst_to(key));
            }
        }
    }
}
