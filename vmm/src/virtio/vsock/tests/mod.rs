//! Unit tests of the vsock device, against the driver model of
//! `driver.rs` (the device's engine driven one round at a time: no thread,
//! no timing) and real Unix sockets on the host side in a temporary
//! directory. `flow.rs`: the protocol (handshakes, data, credit, shutdown);
//! `hostile.rs`: what a hostile guest or host does, limits, and the
//! device's life cycle.

mod flow;
mod hostile;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use vm_memory::{Bytes, GuestAddress};
pub use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

pub use super::conn::Key;
pub use super::driver::*;
pub use super::packet::*;
pub use super::*;

/// A host process's connection to the device's socket, with a read timeout.
pub fn host_connect(path: &Path, port: u32) -> UnixStream {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    writeln!(s, "CONNECT {port}").unwrap();
    s
}

/// Reads one line from `s` (the `OK <port>` answer).
pub fn read_line(s: &mut UnixStream) -> String {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        match s.read(&mut b) {
            Ok(1) if b[0] == b'\n' => break,
            Ok(1) => line.push(b[0]),
            _ => break,
        }
    }
    String::from_utf8(line).unwrap()
}

/// Reads exactly `n` bytes from `s`.
pub fn read_n(s: &mut UnixStream, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    s.read_exact(&mut v).unwrap();
    v
}

/// Whether the host side sees EOF (or a reset) on `s` within 500 ms.
pub fn at_eof(s: &mut UnixStream) -> bool {
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

/// A host-initiated connection to guest `port`, established: the host
/// stream and the connection's key.
pub fn established_host(g: &mut Guest, d: &mut Dev, port: u32) -> (UnixStream, Key) {
    let mut s = host_connect(&d.path, port);
    d.pump();
    let pkts = g.recv();
    let (req, _) = pkts
        .iter()
        .find(|(h, _)| h.op == OP_REQUEST && h.dst_port == port)
        .expect("REQUEST");
    let key = Key {
        local: req.src_port,
        peer: port,
    };
    g.send(&g.hdr(OP_RESPONSE, port, key.local), &[]);
    d.pump();
    assert_eq!(read_line(&mut s), format!("OK {}", key.local));
    (s, key)
}

/// A guest-initiated connection from guest port `gport` to host port
/// `port`, whose `PATH_<port>` listener is `l`: the accepted host stream.
pub fn established_guest(
    g: &mut Guest,
    d: &mut Dev,
    l: &UnixListener,
    gport: u32,
    port: u32,
) -> (UnixStream, Key) {
    g.send(&g.hdr(OP_REQUEST, gport, port), &[]);
    d.pump();
    let (s, _) = l.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let key = Key {
        local: port,
        peer: gport,
    };
    let pkts = g.recv();
    assert!(
        pkts.iter()
            .any(|(h, _)| h.op == OP_RESPONSE && h.src_port == port && h.dst_port == gport),
        "{pkts:?}"
    );
    (s, key)
}

/// A listener at the device's `PATH_<port>`.
pub fn port_listener(d: &Dev, port: u32) -> UnixListener {
    UnixListener::bind(socket::port_path(&d.path, port)).unwrap()
}

#[test]
fn header_round_trips_and_connect_lines_parse() {
    let h = Header {
        src_cid: 3,
        dst_cid: 2,
        src_port: 1,
        dst_port: 2,
        len: 3,
        type_: 1,
        op: 5,
        flags: 6,
        buf_alloc: 7,
        fwd_cnt: 8,
    };
    assert_eq!(Header::from_bytes(&h.to_bytes()), h);
    assert_eq!(&h.to_bytes()[24..28], &3u32.to_le_bytes());
    use socket::{parse_line, Line};
    assert_eq!(
        parse_line(b"CONNECT 52\n"),
        Line::Connect { port: 52, len: 11 }
    );
    assert_eq!(
        parse_line(b"CONNECT 52\r\nxyz"),
        Line::Connect { port: 52, len: 12 }
    );
    assert_eq!(parse_line(b"CONNECT 5"), Line::Incomplete);
    for bad in [
        &b"CONNECT\n"[..],
        b"CONNECT -1\n",
        b"CONNECT 4294967296\n",
        b"connect 5\n",
        b"CONNECT 5 6\n",
        b"\xff\n",
    ] {
        assert_eq!(parse_line(bad), Line::Bad, "{bad:?}");
    }
    assert_eq!(parse_line(&[b'C'; 40]), Line::Bad);
    assert_eq!(
        socket::port_path(Path::new("/run/a.sock"), 52),
        PathBuf::from("/run/a.sock_52")
    );
}
