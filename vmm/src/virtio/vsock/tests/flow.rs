//! The protocol: handshakes both ways, the `OK <port>` line, data both
//! ways, credit in both directions, SHUTDOWN half-close, RST.

use std::io::Write;
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::*;
use crate::virtio::vsock::conn::{BUF_ALLOC, CREDIT_UPDATE_THRESHOLD};

fn rw_bytes(pkts: &[(Header, Vec<u8>)]) -> Vec<u8> {
    pkts.iter()
        .filter(|(h, _)| h.op == OP_RW)
        .flat_map(|(_, d)| d.clone())
        .collect()
}

#[test]
fn host_initiated_connection_handshake_and_data() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Guest::new();
    let mut d = dev(&g, dir.path(), limits());
    g.post_rx(8, 4096);
    let mut s = host_connect(&d.path, 1024);
    // Bytes right after the line wait in the socket until the guest accepted.
    s.write_all(b"early").unwrap();
    d.pump();
    let pkts = g.recv();
    assert_eq!(pkts.len(), 1, "{pkts:?}");
    let req = pkts[0].0;
    assert_eq!(
        (
            req.op,
            req.src_cid,
            req.dst_cid,
            req.dst_port,
            req.type_,
            req.len
        ),
        (OP_REQUEST, HOST_CID, CID, 1024, TYPE_STREAM, 0)
    );
    assert!(req.src_port >= 1 << 30, "host port {}", req.src_port);
    assert_eq!(req.buf_alloc, BUF_ALLOC);
    let key = Key {
        local: req.src_port,
        peer: 1024,
    };
    g.send(&g.hdr(OP_RESPONSE, 1024, key.local), &[]);
    d.pump();
    assert_eq!(read_line(&mut s), format!("OK {}", key.local));
    let pkts = g.recv();
    assert_eq!(rw_bytes(&pkts), b"early");
    s.write_all(b"hello").unwrap();
    d.pump();
    let pkts = g.recv();
    let (h, data) = &pkts[0];
    assert_eq!(data, b"hello");
    assert_eq!(
        (h.op, h.src_port, h.dst_port, h.dst_cid, h.len),
        (OP_RW, key.local, 1024, CID, 5)
    );
    g.send_data(key, b"world");
    d.pump();
    assert_eq!(read_n(&mut s, 5), b"world");
    assert_eq!(d.count(|c| &c.host_connections), 1);
    // A second connection to the same guest port gets its own host port.
    let (_s2, key2) = established_host(&mut g, &mut d, 1024);
    assert_ne!(key2.local, key.local);
    assert_eq!(d.conns(), 2);
    // Later kernels post one descriptor per RX buffer: same bytes.
    g.post_rx_one(HDR_LEN as u32 + 100);
    s.write_all(b"one descriptor").unwrap();
    d.pump();
    assert_eq!(rw_bytes(&g.recv()), b"one descriptor");
}

#[test]
fn host_connection_refused_timed_out_or_malformed_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Guest::new();
    let mut d = dev(&g, dir.path(), limits());
    g.post_rx(16, 4096);
    // The guest answers RST: nothing listens there.
    let mut s = host_connect(&d.path, 7);
    d.pump();
    let req = g.recv()[0].0;
    g.send(&g.hdr(OP_RST, 7, req.src_port), &[]);
    d.pump();
    assert!(at_eof(&mut s));
    assert_eq!(d.conns(), 0);
    assert!(g.recv().is_empty(), "no RST answers a RST");
    // No answer: closed after the connect timeout, and the guest told (RST).
    let mut s = host_connect(&d.path, 8);
    d.pump();
    let req = g.recv()[0].0;
    std::thread::sleep(Duration::from_millis(250));
    d.wait(0);
    assert!(at_eof(&mut s));
    let pkts = g.recv();
    assert_eq!(pkts.len(), 1);
    assert_eq!(
        (pkts[0].0.op, pkts[0].0.src_port, pkts[0].0.dst_port),
        (OP_RST, req.src_port, 8)
    );
    assert_eq!(d.count(|c| &c.timeouts), 1);
    // A late RESPONSE finds no connection: RST.
    g.send(&g.hdr(OP_RESPONSE, 8, req.src_port), &[]);
    d.pump();
    assert_eq!(g.recv()[0].0.op, OP_RST);
    // No line at all: closed after the timeout. A bad line: at once.
    let mut quiet = UnixStream::connect(&d.path).unwrap();
    d.pump();
    assert_eq!(d.conns(), 1);
    std::thread::sleep(Duration::from_millis(250));
    d.wait(0);
    assert!(at_eof(&mut quiet));
    assert_eq!(d.count(|c| &c.timeouts), 2);
    for line in [&b"HELLO 5\n"[..], b"CONNECT x\n", &[b'9'; 64]] {
        let mut bad = UnixStream::connect(&d.path).unwrap();
        bad.write_all(line).unwrap();
        d.pump();
        assert!(at_eof(&mut bad), "{line:?}");
    }
    assert_eq!(d.count(|c| &c.bad_connect_lines), 3);
    // A line in pieces is fine.
    let mut s = UnixStream::connect(&d.path).unwrap();
    s.write_all(b"CONN").unwrap();
    d.pump();
    assert!(g.recv().is_empty());
    s.write_all(b"ECT 9\n").unwrap();
    d.pump();
    let pkts = g.recv();
    assert_eq!((pkts[0].0.op, pkts[0].0.dst_port), (OP_REQUEST, 9));
    assert_eq!(d.conns(), 1);
}

#[test]
fn guest_initiated_connection_to_path_port() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Guest::new();
    let mut d = dev(&g, dir.path(), limits());
    g.post_rx(8, 4096);
    let l = port_listener(&d, 5000);
    let (mut s, key) = established_guest(&mut g, &mut d, &l, 40000, 5000);
    g.send_data(key, b"ping");
    d.pump();
    assert_eq!(read_n(&mut s, 4), b"ping");
    s.write_all(b"pong").unwrap();
    d.pump();
    let pkts = g.recv();
    assert_eq!(rw_bytes(&pkts), b"pong");
    assert_eq!((pkts[0].0.src_port, pkts[0].0.dst_port), (5000, 40000));
    assert_eq!(d.count(|c| &c.guest_connections), 1);
    // Nobody at PATH_6000, or only a stale file there: RST.
    drop(UnixListener::bind(socket::port_path(&d.path, 6001)).unwrap());
    for (gport, port) in [(40001, 6000), (40002, 6001)] {
        g.send(&g.hdr(OP_REQUEST, gport, port), &[]);
        d.pump();
        let pkts = g.recv();
        assert_eq!(pkts.len(), 1);
        assert_eq!(
            (pkts[0].0.op, pkts[0].0.src_port, pkts[0].0.dst_port),
            (OP_RST, port, gport)
        );
    }
    assert_eq!(d.count(|c| &c.connect_failures), 2);
    assert_eq!(d.conns(), 1);
}

#[test]
fn host_bytes_never_exceed_the_guests_credit() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Guest::new();
    let mut d = dev(&g, dir.path(), limits());
    g.buf_alloc = 1000;
    g.post_rx(CHAINS as usize - 1, 4096);
    let (mut s, key) = established_host(&mut g, &mut d, 1024);
    s.write_all(&[7u8; 5000]).unwrap();
    d.pump();
    let mut sent = rw_bytes(&g.recv()).len() as u32;
    assert_eq!(sent, 1000);
    d.pump();
    assert!(g.recv().is_empty(), "nothing beyond the credit");
    // The guest consumes a little at a time; the device never has more
    // than buf_alloc - (tx_cnt - fwd_cnt) in flight.
    let mut consumed = 0u32;
    for step in [300u32, 1, 0, 699, 1000, 50] {
        consumed += step;
        g.fwd_cnt = consumed;
        g.fill_rx(4096);
        g.send(&g.hdr(OP_CREDIT_UPDATE, 1024, key.local), &[]);
        d.pump();
        sent += rw_bytes(&g.recv()).len() as u32;
        assert!(
            sent - consumed <= g.buf_alloc,
            "{sent} sent, {consumed} consumed"
        );
        assert_eq!(sent, (consumed + g.buf_alloc).min(5000));
        assert_eq!(d.e.mux.conn(key).unwrap().tx_cnt(), sent);
    }
    // A bigger buffer: the rest comes in packets no larger than an RX buffer.
    g.buf_alloc = 1 << 20;
    s.write_all(&[8u8; 10000]).unwrap();
    g.fill_rx(4096);
    g.send(&g.hdr(OP_CREDIT_UPDATE, 1024, key.local), &[]);
    d.pump();
    let pkts = g.recv();
    assert!(pkts.iter().all(|(h, _)| h.len <= 4096));
    sent += rw_bytes(&pkts).len() as u32;
    assert_eq!(sent, 15000);
    // A guest whose fwd_cnt runs ahead of what it was sent has no credit.
    g.fwd_cnt = 1 << 31;
    g.send(&g.hdr(OP_CREDIT_UPDATE, 1024, key.local), &[]);
    s.write_all(b"x").unwrap();
    d.pump();
    assert!(rw_bytes(&g.recv()).is_empty());
}

#[test]
fn credit_update_when_asked_and_after_progress() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Guest::new();
    let mut d = dev(&g, dir.path(), limits());
    g.post_rx(8, 4096);
    let (mut s, key) = established_host(&mut g, &mut d, 1024);
    g.send(&g.hdr(OP_CREDIT_REQUEST, 1024, key.local), &[]);
    d.pump();
    let pkts = g.recv();
    assert_eq!(pkts.len(), 1);
    let h = pkts[0].0;
    assert_eq!(
        (h.op, h.buf_alloc, h.fwd_cnt),
        (OP_CREDIT_UPDATE, BUF_ALLOC, 0)
    );
    // Under the threshold nothing is said; past it an update comes unasked.
    let chunk = vec![1u8; CREDIT_UPDATE_THRESHOLD as usize - 100];
    g.send_data(key, &chunk);
    d.pump();
    assert_eq!(read_n(&mut s, chunk.len()).len(), chunk.len());
    assert!(g.recv().is_empty());
    g.send_data(key, &chunk);
    d.pump();
    read_n(&mut s, chunk.len());
    let pkts = g.recv();
    assert_eq!(pkts.len(), 1);
    let h = pkts[0].0;
    assert_eq!(
        (h.op, h.fwd_cnt),
        (OP_CREDIT_UPDATE, 2 * chunk.len() as u32)
    );
}

/// The host socket takes little (a small send buffer) and its reader is
/// slow: the guest's bytes wait in the device within BUF_ALLOC, go out as
/// the host reads (EPOLLOUT), and credit follows; a guest beyond its
/// credit is reset.
#[test]
fn guest_bytes_for_a_slow_host_are_bounded_by_the_credit() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Guest::new();
    let mut d = dev(&g, dir.path(), limits());
    g.post_rx(16, 4096);
    let small_sndbuf = |d: &Dev, key| {
        let c = d.e.mux.conn(key).unwrap();
        nix::sys::socket::setsockopt(&c.stream, nix::sys::socket::sockopt::SndBuf, &4096).unwrap();
    };
    let (mut s, key) = established_host(&mut g, &mut d, 1024);
    small_sndbuf(&d, key);
    let half = vec![5u8; BUF_ALLOC as usize / 2];
    g.send_data(key, &half);
    g.send_data(key, &half);
    d.pump();
    let c = d.e.mux.conn(key).unwrap();
    assert!(
        c.buffered() > 0 && c.buffered() <= BUF_ALLOC,
        "{}",
        c.buffered()
    );
    // The host reads slowly; the device writes more as the socket drains.
    let mut got = 0;
    let mut buf = vec![0u8; 8192];
    while got < BUF_ALLOC as usize {
        use std::io::Read;
        got += s.read(&mut buf).unwrap();
        d.pump();
    }
    assert_eq!(got, BUF_ALLOC as usize);
    assert_eq!(d.e.mux.conn(key).unwrap().buffered(), 0);
    // Updates kept the guest's view within the threshold of the truth.
    let pkts = g.recv();
    let last = pkts
        .iter()
        .rev()
        .find(|(h, _)| h.op == OP_CREDIT_UPDATE)
        .unwrap();
    assert!(
        last.0.fwd_cnt > BUF_ALLOC - CREDIT_UPDATE_THRESHOLD,
        "{}",
        last.0.fwd_cnt
    );
    g.send(&g.hdr(OP_CREDIT_REQUEST, 1024, key.local), &[]);
    d.pump();
    assert_eq!(g.recv()[0].0.fwd_cnt, BUF_ALLOC);

    // A host that does not read: the guest sends its whole credit, then
    // more (as if it ignored the credit): reset, host socket closed.
    let (mut s2, key2) = established_host(&mut g, &mut d, 1025);
    small_sndbuf(&d, key2);
    for _ in 0..3 {
        g.send_data(key2, &half);
    }
    d.pump();
    assert_eq!(d.count(|c| &c.credit_violations), 1);
    assert!(d.e.mux.conn(key2).is_none());
    let pkts = g.recv();
    assert!(pkts
        .iter()
        .any(|(h, _)| h.op == OP_RST && h.src_port == key2.local));
    s2.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut rest = Vec::new();
    use std::io::Read;
    let _ = s2.read_to_end(&mut rest);
    assert!(
        rest.len() < 2 * half.len() + 8,
        "{} bytes reached the host",
        rest.len()
    );
    // The other connection is unaffected.
    g.send_data(key, b"still");
    d.pump();
    assert_eq!(read_n(&mut s, 5), b"still");
}

#[test]
fn shutdown_half_closes_each_direction() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Guest::new();
    let mut d = dev(&g, dir.path(), limits());
    g.post_rx(16, 4096);
    let (mut s, key) = established_host(&mut g, &mut d, 1024);
    // The host's shutdown(SHUT_WR) becomes SHUTDOWN SEND, after its bytes.
    s.write_all(b"tail").unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    d.pump();
    let pkts = g.recv();
    assert_eq!(rw_bytes(&pkts), b"tail");
    let last = pkts.last().unwrap().0;
    assert_eq!((last.op, last.flags), (OP_SHUTDOWN, SHUTDOWN_SEND));
    // The other direction still works.
    g.send_data(key, b"after");
    d.pump();
    assert_eq!(read_n(&mut s, 5), b"after");
    // The guest's SHUTDOWN SEND: the host reads its last bytes, then EOF.
    g.send_data(key, b"last");
    let mut sh = g.hdr(OP_SHUTDOWN, 1024, key.local);
    sh.flags = SHUTDOWN_SEND;
    g.send(&sh, &[]);
    d.pump();
    assert_eq!(read_n(&mut s, 4), b"last");
    assert!(at_eof(&mut s));
    assert_eq!(d.conns(), 1);
    // The guest closes (SHUTDOWN both): the device answers RST, forgets it.
    sh.flags = SHUTDOWN_BOTH;
    g.send(&sh, &[]);
    d.pump();
    let pkts = g.recv();
    assert_eq!(pkts.len(), 1);
    assert_eq!((pkts[0].0.op, pkts[0].0.src_port), (OP_RST, key.local));
    assert_eq!(d.conns(), 0);

    // Guest first: its SHUTDOWN SEND is the host's EOF, the host still writes.
    let l = port_listener(&d, 5000);
    let (mut s, key) = established_guest(&mut g, &mut d, &l, 40000, 5000);
    let mut sh = g.hdr(OP_SHUTDOWN, 40000, 5000);
    sh.flags = SHUTDOWN_SEND;
    g.send(&sh, &[]);
    d.pump();
    assert!(at_eof(&mut s));
    s.write_all(b"reply").unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    d.pump();
    let pkts = g.recv();
    assert_eq!(rw_bytes(&pkts), b"reply");
    assert_eq!(pkts.last().unwrap().0.flags, SHUTDOWN_SEND);
    // The guest's RST ends it.
    g.send(&g.hdr(OP_RST, key.peer, key.local), &[]);
    d.pump();
    assert_eq!(d.conns(), 0);
    assert!(g.recv().is_empty());
}

#[test]
fn host_close_is_shutdown_both_then_rst() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Guest::new();
    let mut d = dev(&g, dir.path(), limits());
    g.post_rx(16, 4096);
    let (mut s, key) = established_host(&mut g, &mut d, 1024);
    s.write_all(b"bye").unwrap();
    drop(s);
    // The bytes and the EOF may take more than one round on a loaded host:
    // rounds of up to 10 ms for at most 5 s until the SHUTDOWN, every packet
    // kept (a count of rounds was once used up early: a round ends at the
    // first event).
    let mut pkts = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        d.wait(10);
        pkts.extend(g.recv());
        if pkts.last().is_some_and(|p| p.0.op == OP_SHUTDOWN) {
            break;
        }
    }
    assert_eq!(rw_bytes(&pkts), b"bye");
    let last = pkts.last().unwrap().0;
    assert_eq!((last.op, last.flags), (OP_SHUTDOWN, SHUTDOWN_BOTH));
    // The guest answers RST: gone.
    g.send(&g.hdr(OP_RST, 1024, key.local), &[]);
    d.pump();
    assert_eq!(d.conns(), 0);
    // A guest that does not answer: RST after the close timeout.
    let (s, key) = established_host(&mut g, &mut d, 1024);
    drop(s);
    d.pump();
    assert_eq!(g.recv().last().unwrap().0.op, OP_SHUTDOWN);
    assert_eq!(d.conns(), 1);
    std::thread::sleep(Duration::from_millis(250));
    d.wait(0);
    assert_eq!(d.conns(), 0);
    let pkts = g.recv();
    assert_eq!((pkts[0].0.op, pkts[0].0.src_port), (OP_RST, key.local));
}

/// A guest that said it receives no more (SHUTDOWN RCV): host bytes stay
/// in the host socket, a host writer gets EPIPE; when the host then closes,
/// the guest hears SHUTDOWN with both flags.
#[test]
fn guest_shutdown_rcv_stops_host_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Guest::new();
    let mut d = dev(&g, dir.path(), limits());
    g.post_rx(16, 4096);
    let (mut s, key) = established_host(&mut g, &mut d, 1024);
    let mut sh = g.hdr(OP_SHUTDOWN, 1024, key.local);
    sh.flags = SHUTDOWN_RCV;
    g.send(&sh, &[]);
    d.pump();
    assert!(g.recv().is_empty());
    let e = s.write_all(&[1u8; 100]).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}");
    d.pump();
    assert!(rw_bytes(&g.recv()).is_empty());
    // The guest still sends; then the host goes.
    g.send_data(key, b"x");
    d.pump();
    assert_eq!(read_n(&mut s, 1), b"x");
    drop(s);
    d.pump();
    let pkts = g.recv();
    assert_eq!(pkts.len(), 1, "{pkts:?}");
    assert_eq!(
        (pkts[0].0.op, pkts[0].0.flags),
        (OP_SHUTDOWN, SHUTDOWN_BOTH)
    );
}
