//! The device and the guest driver in one process, over plain memfd-backed
//! guest memory (two mappings of each sandbox's memfd: the guest's and the
//! device's, as vhost-user would give). Doorbells and interrupts are direct
//! calls; everything else is the real protocol.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use std::sync::atomic::Ordering;

use common::*;
use sgiov::driver::SockState;
use sgiov::layout::{fifo, ErrorCode, PathKind, RingDesc, RingRole, SgfState, Transform};
use sgiov::signal::{SignalType, SignalWord};
use vm_memory::Bytes;

#[test]
fn echo_through_a_pipe_pair_every_path_and_transform() {
    for workers in [0, 2] {
        let mut dev = device(workers);
        let mut g = guest(&mut dev, "t-echo", 1);
        for (i, (xf, path)) in [
            (Transform::Copy, PathKind::Staged),
            (Transform::Copy, PathKind::Direct),
            (Transform::Crypto, PathKind::Staged),
        ]
        .into_iter()
        .enumerate()
        {
            let s = open(&mut dev, &mut g, 64 << 10, 0);
            let req = g.drv.connect(s, 0, xf, path).unwrap();
            assert_eq!(reply(&mut dev, &mut g, req), 0);
            echo(&mut dev, &mut g, s, &random(300_000 + i * 7777, i as u64));
            let req = g.drv.close(s).unwrap();
            assert_eq!(reply(&mut dev, &mut g, req), 0);
            assert_eq!(g.drv.state(s), None);
        }
        assert!(
            g.prepared.load(Ordering::Relaxed) > 10,
            "writes went through the preparation hook"
        );
        assert_released(&dev, 0);
        let sg = dev.sgf_stats(g.sgf).unwrap();
        assert!(
            sg.signals_in > sg.kicks,
            "a kick carries many signals ({sg:?})"
        );
        dev.detach(g.sgf).unwrap();
        assert_eq!(dev.stats().rings, 0);
    }
}

#[test]
fn chain_guest_a_to_staging_to_guest_b() {
    let mut dev = device(2);
    let mut a = guest(&mut dev, "t-chain-a", 1);
    let mut b = guest(&mut dev, "t-chain-b", 2);
    let mut c = guest(&mut dev, "t-chain-c", 3);
    // Tenants 1 and 2 are not linked yet: A is refused, and stays free to
    // try again.
    let l = open(&mut dev, &mut b, 4096, 0);
    let req = b.drv.listen(l, 6).unwrap();
    assert_eq!(reply(&mut dev, &mut b, req), 0);
    let sa = open(&mut dev, &mut a, 4096, 0);
    let con = a
        .drv
        .connect(sa, 6, Transform::Crypto, PathKind::Staged)
        .unwrap();
    assert_eq!(reply(&mut dev, &mut a, con), ErrorCode::Refused as u32);
    dev.links().link(2, 1);
    // Only the pair named: tenant 3 is still refused.
    let sc = open(&mut dev, &mut c, 4096, 0);
    let con = c
        .drv
        .connect(sc, 6, Transform::Copy, PathKind::Staged)
        .unwrap();
    assert_eq!(reply(&mut dev, &mut c, con), ErrorCode::Refused as u32);
    for (g, s) in [(&mut a, sa), (&mut b, l), (&mut c, sc)] {
        let req = g.drv.close(s).unwrap();
        assert_eq!(reply(&mut dev, g, req), 0);
    }
    for (port, xf, path) in [
        (7, Transform::Crypto, PathKind::Staged),
        (8, Transform::Copy, PathKind::Staged),
        (9, Transform::Copy, PathKind::Direct),
    ] {
        let l = open(&mut dev, &mut b, 4096, 0);
        let req = b.drv.listen(l, port).unwrap();
        assert_eq!(reply(&mut dev, &mut b, req), 0);
        let sb = open(&mut dev, &mut b, 128 << 10, 0);
        let acc = b.drv.accept(l, sb).unwrap();
        let sa = open(&mut dev, &mut a, 128 << 10, 0);
        let con = a.drv.connect(sa, port, xf, path).unwrap();
        assert_eq!(reply_in(&mut dev, &mut [&mut a, &mut b], 0, con), 0);
        assert_eq!(reply(&mut dev, &mut b, acc), 0);
        transfer(
            &mut dev,
            &mut a,
            sa,
            &mut b,
            sb,
            &random(1 << 20, port as u64),
        );
        transfer(
            &mut dev,
            &mut b,
            sb,
            &mut a,
            sa,
            &random(100_000, 100 + port as u64),
        );
        let req = a.drv.close(sa).unwrap();
        assert_eq!(reply(&mut dev, &mut a, req), 0);
        for s in [sb, l] {
            let req = b.drv.close(s).unwrap();
            assert_eq!(reply(&mut dev, &mut b, req), 0);
        }
    }
    assert_released(&dev, 0);
    // Three chains between A and B, one encrypted; the refused ones count not.
    let st = dev.stats();
    assert_eq!((st.chains, st.crypto_chains), (3, 1), "{st:?}");
}

#[test]
fn bad_inputs_stay_with_their_ring_or_sgf() {
    let mut dev = device(0);
    let mut g = guest(&mut dev, "t-bad", 1);
    let good = open(&mut dev, &mut g, 16 << 10, 0);
    let req = g
        .drv
        .connect(good, 0, Transform::Copy, PathKind::Staged)
        .unwrap();
    assert_eq!(reply(&mut dev, &mut g, req), 0);

    // Bad descriptors: each OPEN is refused with its own code.
    let d = |base: u64, size: u32, role: RingRole| RingDesc {
        base,
        size,
        role: role as u32,
        ..Default::default()
    };
    let ok_rx = d(0x300_0000, 4096, RingRole::DeviceProduces);
    type Case = ((u16, RingDesc), (u16, RingDesc), ErrorCode);
    let cases: Vec<Case> = vec![
        (
            (7000, d(MEM as u64, 4096, RingRole::GuestProduces)),
            (7001, ok_rx),
            ErrorCode::BadRing,
        ), // outside memory
        (
            (7000, d(0x301_0000, 3000, RingRole::GuestProduces)),
            (7001, ok_rx),
            ErrorCode::BadRing,
        ), // not a power of two
        (
            (7000, d(0x301_0010, 4096, RingRole::GuestProduces)),
            (7001, ok_rx),
            ErrorCode::BadRing,
        ), // misaligned
        (
            (7000, d(0x301_0000, 4096, RingRole::DeviceProduces)),
            (7001, ok_rx),
            ErrorCode::BadRing,
        ), // wrong role
        (
            (7000, d(0x300_0000, 8192, RingRole::GuestProduces)),
            (7001, ok_rx),
            ErrorCode::Overlap,
        ), // overlaps its partner
        (
            (7000, d(AREA, 4096, RingRole::GuestProduces)),
            (7001, ok_rx),
            ErrorCode::Overlap,
        ), // overlaps the area
        (
            (good, d(0x302_0000, 4096, RingRole::GuestProduces)),
            (7001, ok_rx),
            ErrorCode::Busy,
        ), // id in use
        (
            (0xFFFF, d(0x302_0000, 4096, RingRole::GuestProduces)),
            (7001, ok_rx),
            ErrorCode::BadRequest,
        ), // reserved id
        (
            (9000, d(0x302_0000, 4096, RingRole::GuestProduces)),
            (7001, ok_rx),
            ErrorCode::BadRequest,
        ), // beyond the table
    ];
    for (tx, rx, code) in cases {
        let req = g.drv.open_raw(tx, rx).unwrap();
        assert_eq!(reply(&mut dev, &mut g, req), code as u32, "{tx:?} {rx:?}");
    }
    // A ring overlapping an open ring of another socket. (The "id in use"
    // case above overwrote that socket's descriptor in the table: the device
    // kept its own copy from OPEN, which is what counts.)
    let (good_tx, _) = g.drv.ring_bases(good).unwrap();
    let over = d(good_tx + 4096, 4096, RingRole::GuestProduces);
    let req = g.drv.open_raw((7000, over), (7001, ok_rx)).unwrap();
    assert_eq!(reply(&mut dev, &mut g, req), ErrorCode::Overlap as u32);
    let victim = open(&mut dev, &mut g, 4096, 0);
    let req = g
        .drv
        .connect(victim, 0, Transform::Copy, PathKind::Direct)
        .unwrap();
    assert_eq!(reply(&mut dev, &mut g, req), 0);

    // Bad pointers and directions: only that ring (and its pipe) stops.
    let (vtx, vrx) = g.drv.rings(victim).unwrap();
    g.drv
        .push_word(SignalWord::encode(SignalType::Tail, vrx, 100))
        .unwrap(); // tail past head
    until(&mut dev, &mut [&mut g], "the ring error", |gs| {
        gs[0].drv.state(victim) == Some(SockState::Error(ErrorCode::BadPointer))
    });
    let v2 = open(&mut dev, &mut g, 4096, 0);
    let (v2tx, _) = g.drv.rings(v2).unwrap();
    g.drv
        .push_word(SignalWord::encode(SignalType::Head, v2tx, 5000))
        .unwrap(); // past tail + size
    until(&mut dev, &mut [&mut g], "the ring error", |gs| {
        gs[0].drv.state(v2) == Some(SockState::Error(ErrorCode::BadPointer))
    });
    let v3 = open(&mut dev, &mut g, 4096, 0);
    let (_, v3rx) = g.drv.rings(v3).unwrap();
    g.drv
        .push_word(SignalWord::encode(SignalType::Head, v3rx, 10))
        .unwrap(); // HEAD on an RX ring
    until(&mut dev, &mut [&mut g], "the ring error", |gs| {
        gs[0].drv.state(v3) == Some(SockState::Error(ErrorCode::WrongDirection))
    });
    // Unknown ring ids and unknown types are counted and dropped.
    let before = dev.sgf_stats(g.sgf).unwrap();
    g.drv
        .push_word(SignalWord::encode(SignalType::Head, 6000, 1))
        .unwrap();
    g.drv.push_word(SignalWord(0x0009_0002_0000_0001)).unwrap();
    g.drv
        .push_word(SignalWord::encode(SignalType::Head, vtx, 10))
        .unwrap(); // ring in error: ignored
    echo(&mut dev, &mut g, good, &random(100_000, 1));
    let after = dev.sgf_stats(g.sgf).unwrap();
    assert_eq!(after.unknown_ring, before.unknown_ring + 1);
    assert_eq!(after.bad_signals, before.bad_signals + 1);
    assert_eq!(dev.sgf_state(g.sgf), Some(SgfState::Attached));

    // A flooded FIFO (the producer index claims more words than slots) puts
    // that SGF in error; another SGF keeps moving.
    let mut h = guest(&mut dev, "t-bad-h", 2);
    let hs = open(&mut dev, &mut h, 16 << 10, 0);
    let req = h
        .drv
        .connect(hs, 0, Transform::Copy, PathKind::Staged)
        .unwrap();
    assert_eq!(reply(&mut dev, &mut h, req), 0);
    let prod = AREA + g.drv.layout().g2d_off as u64 + fifo::PROD;
    g.guest_view
        .get(prod, 4)
        .unwrap()
        .store(100_000u32, 0, Ordering::Release)
        .unwrap();
    dev.kick(g.sgf);
    dev.poll();
    assert_eq!(dev.sgf_state(g.sgf), Some(SgfState::Error));
    let status: u32 = g.guest_view.get(AREA + 64, 4).unwrap().read_obj(0).unwrap();
    assert_eq!(status, SgfState::Error as u32);
    echo(&mut dev, &mut h, hs, &random(200_000, 2));
    // The failed SGF's connections are gone; detaching it leaks nothing.
    dev.detach(g.sgf).unwrap();
    let req = h.drv.close(hs).unwrap();
    assert_eq!(reply(&mut dev, &mut h, req), 0);
    dev.detach(h.sgf).unwrap();
    dev.poll();
    assert_released(&dev, 0);
    assert_eq!((dev.stats().sgfs, dev.stats().rings), (0, 0));
}

#[test]
fn close_mid_transfer_and_detach_mid_transfer_leave_nothing() {
    let mut dev = device(2);
    let mut a = guest(&mut dev, "t-kill-a", 1);
    let mut b = guest(&mut dev, "t-kill-b", 2);
    dev.links().link(1, 2);
    let mut pairs = Vec::new();
    for port in [21, 22] {
        let l = open(&mut dev, &mut b, 4096, 0);
        let req = b.drv.listen(l, port).unwrap();
        assert_eq!(reply(&mut dev, &mut b, req), 0);
        let sb = open(&mut dev, &mut b, 64 << 10, 0);
        let acc = b.drv.accept(l, sb).unwrap();
        let sa = open(&mut dev, &mut a, 64 << 10, 0);
        let con = a
            .drv
            .connect(sa, port, Transform::Crypto, PathKind::Staged)
            .unwrap();
        assert_eq!(reply_in(&mut dev, &mut [&mut a, &mut b], 0, con), 0);
        assert_eq!(reply(&mut dev, &mut b, acc), 0);
        pairs.push((sa, sb));
    }
    // A fills both connections; B reads nothing: jobs are queued and running.
    let data = random(64 << 10, 9);
    for _ in 0..3 {
        for &(sa, _) in &pairs {
            a.drv.send(sa, &data).unwrap();
        }
        pump(&mut dev, &mut [&mut a, &mut b]);
    }
    // Close the first connection from A mid-transfer: the reply comes once
    // its pipes are gone; B sees the close.
    let req = a.drv.close(pairs[0].0).unwrap();
    assert_eq!(reply(&mut dev, &mut a, req), 0);
    until(
        &mut dev,
        &mut [&mut a, &mut b],
        "B to see the close",
        |gs| gs[1].drv.state(pairs[0].1) == Some(SockState::Closed),
    );
    // "SIGKILL" A's VMM with the second connection busy: detach.
    for &(sa, _) in &pairs[1..] {
        a.drv.send(sa, &data).unwrap();
    }
    pump(&mut dev, &mut [&mut a, &mut b]);
    dev.detach(a.sgf).unwrap();
    until(&mut dev, &mut [&mut b], "B to see the second close", |gs| {
        gs[0].drv.state(pairs[1].1) == Some(SockState::Closed)
    });
    for &(_, sb) in &pairs {
        let req = b.drv.close(sb).unwrap();
        assert_eq!(reply(&mut dev, &mut b, req), 0);
    }
    // B's two listeners are still open.
    assert_released(&dev, 2);
    dev.detach(b.sgf).unwrap();
    dev.poll();
    assert_eq!(dev.stats().rings, 0);
}
