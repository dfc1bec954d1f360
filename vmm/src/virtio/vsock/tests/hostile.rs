//! A hostile guest (bad chains, bad headers, packets for no connection,
//! floods, a guest that never reads), the connection cap, the socket file,
//! and the device's life cycle through the virtio-mmio transport.

use std::io::{ErrorKind, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::*;
use crate::virtio::mmio::{self, MmioTransport};
use crate::virtio::vsock::muxer::MAX_RSTS;

#[test]
fn packets_for_no_connection_are_answered_with_rst() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Guest::new();
    let mut d = dev(&g, dir.path(), limits());
    g.post_rx(8, 4096);
    for op in [OP_RW, OP_SHUTDOWN, OP_CREDIT_REQUEST, OP_RESPONSE, OP_RST] {
        let mut h = g.hdr(op, 777, 4242);
        if op == OP_RW {
            h.len = 3;
        }
        g.send(&h, if op == OP_RW { b"abc" } else { &[] });
    }
    d.pump();
    let pkts = g.recv();
    assert_eq!(pkts.len(), 4, "no RST answers a RST: {pkts:?}");
    for (h, _) in &pkts {
        assert_eq!(
            (h.op, h.src_cid, h.dst_cid, h.src_port, h.dst_port),
            (OP_RST, HOST_CID, CID, 4242, 777)
        );
    }
    assert_eq!(d.count(|c| &c.unknown_connection), 4);
    assert_eq!(g.tx_done(), 5);
}

#[test]
fn malformed_tx_chains_are_counted_and_returned() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Guest::new();
    let mut d = dev(&g, dir.path(), limits());
    g.post_rx(8, 4096);
    let mut n = 0;
    let mut post = |g: &mut Guest,
                    d: &mut Dev,
                    hdr_len: u32,
                    descs: &dyn Fn(u64) -> Vec<(u64, u32, u16, u16)>| {
        let b = g.next_buf(TX);
        let mut h = g.hdr(OP_REQUEST, 40000, 5000);
        h.len = hdr_len;
        g.mem.write_slice(&h.to_bytes(), GuestAddress(b)).unwrap();
        g.post_raw(TX, &descs(b));
        d.pump();
        n += 1;
        assert_eq!(g.tx_done(), 1, "chain {n} returned");
        assert_eq!(d.count(|c| &c.bad_chains), n, "chain {n} counted");
    };
    let hl = HDR_LEN as u32;
    post(&mut g, &mut d, 0, &|b| vec![(b, hl, F_WRITE, 0)]); // device-writable
    post(&mut g, &mut d, 0, &|b| vec![(b, 20, 0, 0)]); // shorter than a header
    post(&mut g, &mut d, 100, &|b| vec![(b, hl, 0, 0)]); // len beyond the chain
    post(&mut g, &mut d, 70_000, &|b| vec![(b, hl + 70_000, 0, 0)]); // beyond 64 KiB
    post(&mut g, &mut d, 0, &|_| vec![(MEM as u64 - 10, hl, 0, 0)]); // outside memory
    post(&mut g, &mut d, 0, &|_| vec![(u64::MAX - 8, hl, 0, 0)]); // address overflow
    post(&mut g, &mut d, 0, &|b| vec![(b, hl, F_NEXT, 0)]); // a loop
    post(&mut g, &mut d, 0, &|b| vec![(b, hl, F_NEXT, 200)]); // next outside the table
    post(&mut g, &mut d, 0, &|b| vec![(b, 16, F_INDIRECT, 0)]); // indirect, not negotiated
    post(&mut g, &mut d, 0, &|b| {
        vec![(b, 8, F_NEXT, 1), (b + 64, 8, F_WRITE, 0)]
    }); // short, mixed
    assert!(g.recv().is_empty(), "nothing was acted upon");
    assert_eq!(d.conns(), 0);
    // The device goes on.
    let (mut s, key) = established_host(&mut g, &mut d, 1024);
    g.send_data(key, b"ok");
    d.pump();
    assert_eq!(read_n(&mut s, 2), b"ok");
}

#[test]
fn malformed_rx_chains_are_returned_unused() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Guest::new();
    let mut d = dev(&g, dir.path(), limits());
    let b = g.next_buf(RX);
    g.post_raw(RX, &[(b, 4096, 0, 0)]); // device-readable
    let b = g.next_buf(RX);
    g.post_raw(RX, &[(b, 20, F_WRITE, 0)]); // no room for a header
    g.post_raw(RX, &[(MEM as u64 - 100, 4096, F_WRITE, 0)]); // outside memory
    let b = g.next_buf(RX);
    g.post_raw(
        RX,
        &[
            (b, HDR_LEN as u32, F_WRITE | F_NEXT, 1),
            (MEM as u64 + 4096, 4096, F_WRITE, 0),
        ],
    );
    g.post_rx(1, 4096);
    let _s = host_connect(&d.path, 1024);
    d.pump();
    let used = g.used(RX);
    assert_eq!(
        used.iter().map(|u| u.1).collect::<Vec<_>>(),
        [0, 0, 0, 0, HDR_LEN as u32]
    );
    assert_eq!(d.count(|c| &c.bad_chains), 4);
    // The REQUEST went into the good buffer.
    let at = buf(RX, used[4].0 / 2);
    let mut raw = [0u8; HDR_LEN];
    g.mem.read_slice(&mut raw, GuestAddress(at)).unwrap();
    assert_eq!(Header::from_bytes(&raw).op, OP_REQUEST);
}

#[test]
fn bad_headers_are_dropped_or_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Guest::new();
    let mut d = dev(&g, dir.path(), limits());
    g.post_rx(16, 4096);
    let l = port_listener(&d, 5000);
    l.set_nonblocking(true).unwrap();
    let (mut s, key) = established_host(&mut g, &mut d, 1024);
    // A spoofed source CID: dropped, the host sees nothing.
    let mut h = g.hdr(OP_RW, key.peer, key.local);
    h.src_cid = 4;
    h.len = 3;
    g.send(&h, b"bad");
    // To another CID (another sandbox, the hypervisor): never routed, no RST.
    for cid in [0, 1, 4, 5, u64::MAX] {
        let mut h = g.hdr(OP_REQUEST, 40000, 5000);
        h.dst_cid = cid;
        g.send(&h, &[]);
    }
    d.pump();
    assert!(g.recv().is_empty());
    assert_eq!(l.accept().unwrap_err().kind(), ErrorKind::WouldBlock);
    assert_eq!(d.count(|c| &c.bad_headers), 6);
    // SEQPACKET (not offered): refused with RST, nothing connected.
    let mut h = g.hdr(OP_REQUEST, 40000, 5000);
    h.type_ = 2;
    g.send(&h, &[]);
    d.pump();
    assert_eq!(g.recv()[0].0.op, OP_RST);
    assert_eq!(l.accept().unwrap_err().kind(), ErrorKind::WouldBlock);
    // An unknown op on a live connection: dropped, the connection lives.
    g.send(&g.hdr(99, key.peer, key.local), &[]);
    d.pump();
    assert_eq!(d.count(|c| &c.bad_headers), 8);
    g.send_data(key, b"alive");
    d.pump();
    assert_eq!(read_n(&mut s, 5), b"alive");
    // A RESPONSE on an established connection: a protocol error, RST.
    g.send(&g.hdr(OP_RESPONSE, key.peer, key.local), &[]);
    d.pump();
    assert_eq!(g.recv()[0].0.op, OP_RST);
    assert!(at_eof(&mut s));
    // Data before the guest accepted: the same.
    let mut s = host_connect(&d.path, 1025);
    d.pump();
    let req = g.recv()[0].0;
    let mut h = g.hdr(OP_RW, 1025, req.src_port);
    h.len = 1;
    g.send(&h, b"x");
    d.pump();
    assert_eq!(g.recv()[0].0.op, OP_RST);
    assert!(at_eof(&mut s));
    assert_eq!(d.count(|c| &c.protocol_errors), 2);
    assert_eq!(d.conns(), 0);
}

#[test]
fn connections_are_capped_and_refusals_counted() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Guest::new();
    let mut d = dev(
        &g,
        dir.path(),
        Limits {
            max_connections: 3,
            ..limits()
        },
    );
    g.post_rx(16, 4096);
    let l = port_listener(&d, 5000);
    let conns: Vec<_> = (1..=3)
        .map(|p| established_guest(&mut g, &mut d, &l, p, 5000))
        .collect();
    g.send(&g.hdr(OP_REQUEST, 4, 5000), &[]);
    d.pump();
    assert_eq!(g.recv()[0].0.op, OP_RST);
    let mut host = UnixStream::connect(&d.path).unwrap();
    d.pump();
    assert!(at_eof(&mut host));
    assert_eq!(d.count(|c| &c.refused), 2);
    assert_eq!(d.conns(), 3);
    // One closes: room again.
    let key = conns[0].1;
    g.send(&g.hdr(OP_RST, key.peer, key.local), &[]);
    d.pump();
    let (_s, _) = established_host(&mut g, &mut d, 1024);
    assert_eq!(d.conns(), 3);
}

/// A guest that floods TX and never posts an RX buffer: the RSTs it is owed
/// are bounded, the rest dropped and counted; nothing else grows.
#[test]
fn rst_flood_without_rx_buffers_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Guest::new();
    let mut d = dev(&g, dir.path(), limits());
    let total = MAX_RSTS + 100;
    let mut sent = 0;
    while sent < total {
        for _ in 0..(CHAINS as usize - 1).min(total - sent) {
            // Half for no connection, half REQUESTs to a port nobody serves.
            let op = if sent % 2 == 0 {
                OP_CREDIT_REQUEST
            } else {
                OP_REQUEST
            };
            g.send(&g.hdr(op, 10_000 + sent as u32, 6000), &[]);
            sent += 1;
        }
        d.pump();
        g.tx_done();
    }
    assert_eq!(d.count(|c| &c.rst_dropped), 100);
    assert_eq!(d.count(|c| &c.connect_failures), total as u64 / 2);
    assert_eq!(d.conns(), 0);
    let mut rsts = 0;
    for _ in 0..total {
        g.fill_rx(64);
        d.pump();
        let got = g.recv();
        assert!(got.iter().all(|(h, _)| h.op == OP_RST));
        rsts += got.len();
        if got.is_empty() {
            break;
        }
    }
    assert_eq!(rsts, MAX_RSTS);
}

/// A guest that never reads one connection stalls only that one: the
/// device reads no more than its credit, the host's writes back up in its
/// own socket, and another connection carries on.
#[test]
fn a_guest_that_never_reads_stalls_only_its_connection() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Guest::new();
    let mut d = dev(&g, dir.path(), limits());
    g.post_rx(CHAINS as usize - 1, 4096);
    g.buf_alloc = 4096;
    let (mut a, ka) = established_host(&mut g, &mut d, 1024);
    g.buf_alloc = 256 << 10;
    let (mut b, kb) = established_host(&mut g, &mut d, 1025);
    a.set_nonblocking(true).unwrap();
    let chunk = [1u8; 4096];
    let mut written = 0usize;
    let start = Instant::now();
    loop {
        match a.write(&chunk) {
            Ok(n) => written += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => panic!("{e}"),
        }
        d.pump();
        g.recv();
        g.fill_rx(4096);
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "host never blocked"
        );
    }
    assert!(written > 4096);
    assert_eq!(d.e.mux.conn(ka).unwrap().tx_cnt(), 4096);
    b.write_all(b"other").unwrap();
    g.send_data(kb, b"works");
    d.pump();
    assert_eq!(read_n(&mut b, 5), b"works");
    let pkts = g.recv();
    assert!(pkts
        .iter()
        .any(|(h, d)| h.src_port == kb.local && d == b"other"));
    assert!(pkts.iter().all(|(h, _)| h.src_port != ka.local));
}

#[test]
fn the_socket_file_is_replaced_only_when_stale_and_removed_only_if_ours() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v.sock");
    // A VMM that died without cleaning up left its socket file.
    let (l, file) = bind(&path).unwrap();
    drop(l);
    std::mem::forget(file);
    assert!(path.exists());
    let (l, file) = bind(&path).expect("stale file replaced");
    // A live one is not.
    let e = bind(&path).unwrap_err();
    assert!(matches!(e, VsockError::InUse { .. }));
    assert!(e.to_string().contains(&*path.to_string_lossy()), "{e}");
    // Dropping the guard removes it; a file someone else put there is kept.
    drop(file);
    assert!(!path.exists());
    drop(l);
    let (_l, file) = bind(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, b"not ours").unwrap();
    drop(file);
    assert_eq!(std::fs::read(&path).unwrap(), b"not ours");
    // A file that is not a socket is never replaced.
    let e = bind(&path).unwrap_err();
    assert!(matches!(e, VsockError::NotASocket { .. }), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), b"not ours");
}

fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Through the virtio-mmio transport with the worker thread: identity and
/// config, a connection, a reset that closes it, a re-activation that
/// starts with VIRTIO_VSOCK_EVENT_TRANSPORT_RESET, and a drop that removes
/// the socket file.
#[test]
fn device_life_cycle_through_the_transport() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v.sock");
    let mut g = Guest::new();
    let (listener, file) = bind(&path).unwrap();
    let evts: Vec<EventFd> = (0..3)
        .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
        .collect();
    let kick: Vec<EventFd> = evts.iter().map(|e| e.try_clone().unwrap()).collect();
    let prepare: Arc<PrepareWrite> = Arc::new(|_, _| Ok(()));
    let irq = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
    let dev = Vsock::new(
        CID,
        listener,
        file,
        g.mem.clone(),
        prepare,
        evts,
        irq.clone(),
        limits(),
    );
    let counters = dev.counters().clone();
    let mut t = MmioTransport::new(dev, g.mem.clone(), irq, 0xd000_0000, None);
    let r = |t: &mut MmioTransport<Vsock>, off| {
        let mut b = [0u8; 4];
        t.read(off, &mut b);
        u32::from_le_bytes(b)
    };
    let w = |t: &mut MmioTransport<Vsock>, off, v: u32| t.write(off, &v.to_le_bytes());
    assert_eq!(r(&mut t, mmio::DEVICE_ID), 19);
    w(&mut t, mmio::DEVICE_FEATURES_SEL, 1);
    assert_eq!(r(&mut t, mmio::DEVICE_FEATURES), 1, "VERSION_1 only");
    w(&mut t, mmio::DEVICE_FEATURES_SEL, 0);
    assert_eq!(r(&mut t, mmio::DEVICE_FEATURES), 0, "no SEQPACKET");
    let mut cid = [0u8; 8];
    t.read(mmio::CONFIG, &mut cid);
    assert_eq!(u64::from_le_bytes(cid), CID);
    let start = |t: &mut MmioTransport<Vsock>| {
        w(t, mmio::STATUS, 1);
        w(t, mmio::STATUS, 3);
        w(t, mmio::DRIVER_FEATURES_SEL, 1);
        w(t, mmio::DRIVER_FEATURES, 1);
        w(t, mmio::STATUS, 11);
        for q in 0..3u32 {
            let b = qbase(q as usize) as u32;
            w(t, mmio::QUEUE_SEL, q);
            w(t, mmio::QUEUE_NUM, u32::from(QSIZE));
            w(t, mmio::QUEUE_DESC_LOW, b);
            w(t, mmio::QUEUE_DRIVER_LOW, b + 0x1000);
            w(t, mmio::QUEUE_DEVICE_LOW, b + 0x2000);
            w(t, mmio::QUEUE_READY, 1);
        }
        w(t, mmio::STATUS, 15);
        assert_eq!(r(t, mmio::STATUS), 15, "running");
    };
    // An event buffer before the first activation: no event for it.
    let eb = g.next_buf(EVQ);
    g.post_raw(EVQ, &[(eb, 4, F_WRITE, 0)]);
    g.post_rx(8, 4096);
    start(&mut t);
    let mut s = host_connect(&path, 1024);
    let req = wait_for("REQUEST", || g.recv().into_iter().next()).0;
    assert_eq!(req.op, OP_REQUEST);
    g.send(&g.hdr(OP_RESPONSE, 1024, req.src_port), &[]);
    kick[TX].write(1).unwrap();
    assert_eq!(read_line(&mut s), format!("OK {}", req.src_port));
    assert!(g.used(EVQ).is_empty());
    // Reset: the worker stops and the connection is closed.
    w(&mut t, mmio::STATUS, 0);
    assert!(at_eof(&mut s));
    // Again: the first thing the guest hears is the transport reset.
    g.reset_queues();
    let eb = g.next_buf(EVQ);
    g.mem.write_obj(0xffff_ffffu32, GuestAddress(eb)).unwrap();
    g.post_raw(EVQ, &[(eb, 4, F_WRITE, 0)]);
    g.post_rx(8, 4096);
    start(&mut t);
    let ev = wait_for("event", || g.used(EVQ).into_iter().next());
    assert_eq!(ev.1, 4);
    assert_eq!(
        g.mem.read_obj::<u32>(GuestAddress(eb)).unwrap(),
        EVENT_TRANSPORT_RESET
    );
    assert_eq!(VsockCounters::get(&counters.events), 1);
    // The new driver works as the old one did.
    let mut s = host_connect(&path, 1025);
    let req = wait_for("REQUEST", || g.recv().into_iter().next()).0;
    assert_eq!(req.dst_port, 1025);
    // Dropping the device closes everything and removes the socket file.
    drop(t);
    assert!(at_eof(&mut s));
    assert!(!path.exists());
    assert!(UnixStream::connect(&path).is_err());
}

/// The fuzz target's seeds run clean (the corpus replay runs them too).
#[test]
fn vsock_fuzz_seeds_run_clean() {
    for seed in fuzz::vsock_seeds() {
        fuzz::fuzz_vsock(&seed);
    }
    // Truncated and empty inputs too.
    for seed in fuzz::vsock_seeds() {
        for cut in [0, 1, 7, seed.len() / 2] {
            fuzz::fuzz_vsock(&seed[..cut.min(seed.len())]);
        }
    }
}
