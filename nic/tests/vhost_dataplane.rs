//! The VF vhost-user backends and the dataplane, driven by test frontends
//! (vhost crate Frontend, memfd memory, hand-written split rings).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use testutil::nic as common;

use std::time::Duration;

use common::{frame, TestNic};
use nic::frontend::{SimFrontend, MIN_MEM};
use nic::LockPolicy;
use nic_api::VfState;

const T: Duration = Duration::from_secs(5);

#[test]
fn frames_cross_between_vfs_and_counters_match() {
    for policy in [LockPolicy::Global, LockPolicy::Hierarchical] {
        let nic = TestNic::start(&format!("fwd-{policy:?}"), 3, None, policy);
        let mut c = nic.client();
        let a = c.alloc("pf0", "sb-a", None, None).unwrap();
        let b = c
            .alloc("pf0", "sb-b", Some("02:00:00:00:0b:0b"), None)
            .unwrap();
        assert_eq!(a.state, VfState::Assigned);
        let mut fa = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
        let mut fb = SimFrontend::connect(&b.socket, MIN_MEM).unwrap();
        nic.wait_vf("sb-a", "open", |v| v.state == VfState::Open);

        let f1 = frame(&b.mac, &a.mac, b"hello from a");
        fa.send(&f1);
        assert_eq!(
            fb.recv(T).as_deref(),
            Some(&f1[..]),
            "{policy:?}: unicast a -> b"
        );
        let f2 = frame("ff:ff:ff:ff:ff:ff", &b.mac, &[7u8; 300]);
        fb.send(&f2);
        assert_eq!(
            fa.recv(T).as_deref(),
            Some(&f2[..]),
            "{policy:?}: broadcast b -> a"
        );
        // A spoofed source MAC is dropped and counted once, as a drop only.
        fa.send(&frame(&b.mac, "02:66:66:66:66:66", b"spoof"));
        assert_eq!(fb.recv(Duration::from_millis(300)), None);

        let va = nic.wait_vf("sb-a", "counted", |v| {
            v.counters.tx_packets == 1 && v.counters.tx_drops == 1
        });
        let vb = nic.wait_vf("sb-b", "counted", |v| {
            v.counters.rx_packets == 1 && v.counters.tx_packets == 1
        });
        assert_eq!(va.counters.tx_bytes, f1.len() as u64);
        assert_eq!(va.counters.rx_packets, 1);
        assert_eq!(va.counters.rx_bytes, f2.len() as u64);
        assert_eq!(vb.counters.rx_bytes, f1.len() as u64);
        assert_eq!(vb.counters.tx_bytes, f2.len() as u64);
        assert_eq!(va.counters.bad_descriptors + vb.counters.bad_descriptors, 0);
        drop((fa, fb));
        nic.wait_vf("sb-a", "reset", |v| v.state == VfState::Reset);
        nic.stop();
    }
}

#[test]
fn descriptors_outside_memory_fail_only_that_vf() {
    let nic = TestNic::start("bad", 3, None, LockPolicy::Hierarchical);
    let mut c = nic.client();
    let (a, b, d) = (
        c.alloc("pf0", "sb-a", None, None).unwrap(),
        c.alloc("pf0", "sb-b", None, None).unwrap(),
        c.alloc("pf0", "sb-d", None, None).unwrap(),
    );
    let mut fa = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
    let mut fb = SimFrontend::connect(&b.socket, MIN_MEM).unwrap();
    let mut fd = SimFrontend::connect(&d.socket, MIN_MEM).unwrap();
    fa.send_out_of_bounds();
    let va = nic.wait_vf("sb-a", "in error", |v| v.state == VfState::Error);
    assert_eq!(va.counters.bad_descriptors, 1);
    // The failed VF neither sends nor receives; the others keep forwarding.
    fa.send(&frame(&b.mac, &a.mac, b"after error"));
    let f = frame(&d.mac, &b.mac, b"still forwarding");
    fb.send(&f);
    assert_eq!(fd.recv(T).as_deref(), Some(&f[..]));
    fb.send(&frame(&a.mac, &b.mac, b"to the failed VF"));
    assert_eq!(fa.recv(Duration::from_millis(300)), None);
    assert_eq!(
        nic.client()
            .get_by_sandbox("sb-a")
            .unwrap()
            .counters
            .tx_packets,
        0
    );
    // Its frontend gone, the failed VF is reset on its own (B and D stay
    // open) and works again.
    drop(fa);
    let va = nic.wait_vf("sb-a", "reset", |v| v.state == VfState::Reset);
    assert_eq!(va.counters.bad_descriptors, 0, "reset clears the counters");
    for s in ["sb-b", "sb-d"] {
        assert_eq!(nic.client().get_by_sandbox(s).unwrap().state, VfState::Open);
    }
    let mut fa = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
    let f = frame(&a.mac, &b.mac, b"works again");
    fb.send(&f);
    assert_eq!(fa.recv(T).as_deref(), Some(&f[..]));
    drop((fa, fb, fd));
    nic.stop();
}

/// A started ring asked to move or shrink (a guest changing a queue after
/// DRIVER_OK) is counted and ignored: the session goes on and frames still
/// use the rings the VF validated.
#[test]
fn moving_a_started_ring_is_counted_and_ignored() {
    let nic = TestNic::start("move", 2, None, LockPolicy::Hierarchical);
    let mut c = nic.client();
    let (a, b) = (
        c.alloc("pf0", "sb-a", None, None).unwrap(),
        c.alloc("pf0", "sb-b", None, None).unwrap(),
    );
    let mut fa = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
    let mut fb = SimFrontend::connect(&b.socket, MIN_MEM).unwrap();
    for q in [0, 1] {
        // A quarter of the ring area on: inside memory, aligned.
        fb.move_started_ring(q, 0x4000).unwrap();
    }
    let vb = nic.wait_vf("sb-b", "counted", |v| v.counters.bad_requests == 4);
    assert_eq!((vb.state, vb.counters.bad_descriptors), (VfState::Open, 0));
    let f = frame(&b.mac, &a.mac, b"to the rings B set up");
    fa.send(&f);
    assert_eq!(fb.recv(T).as_deref(), Some(&f[..]));
    let f = frame(&a.mac, &b.mac, b"from the rings B set up");
    fb.send(&f);
    assert_eq!(fa.recv(T).as_deref(), Some(&f[..]));
    drop((fa, fb));
    let vb = nic.wait_vf("sb-b", "reset", |v| v.state == VfState::Reset);
    assert_eq!(vb.counters.bad_requests, 0, "reset clears the counters");
    nic.stop();
}

#[test]
fn second_frontend_on_an_open_vf_is_refused() {
    let nic = TestNic::start("excl", 2, None, LockPolicy::Global);
    let a = nic.client().alloc("pf0", "sb-a", None, None).unwrap();
    let fa = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
    assert!(SimFrontend::connect(&a.socket, MIN_MEM).is_err());
    // A free VF cannot be opened either.
    let free = nic
        .client()
        .list()
        .unwrap()
        .into_iter()
        .find(|v| v.state == VfState::Free)
        .unwrap();
    assert!(SimFrontend::connect(&free.socket, MIN_MEM).is_err());
    assert_eq!(
        nic.client().get_by_sandbox("sb-a").unwrap().state,
        VfState::Open
    );
    drop(fa);
    nic.stop();
}

#[test]
fn killed_frontend_process_closes_and_resets_its_vf() {
    const NAME: &str = "killed_frontend_process_closes_and_resets_its_vf";
    common::hold_frontend_if_child();
    let nic = TestNic::start("kill", 2, None, LockPolicy::Global);
    let a = nic.client().alloc("pf0", "sb-a", None, None).unwrap();
    let mut child = common::spawn_frontend_child(NAME, &a.socket);
    nic.wait_vf("sb-a", "open", |v| v.state == VfState::Open);
    // SAFETY: killing our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().unwrap();
    nic.wait_vf("sb-a", "closed and reset", |v| v.state == VfState::Reset);
    let mut c = nic.client();
    c.release("sb-a").unwrap();
    assert_eq!(c.get_by_id(&a.id).unwrap().state, VfState::Free);
    let again = c.alloc("pf0", "sb-new", None, None).unwrap();
    assert_eq!(again.id, a.id, "the reset VF is allocated again");
    let fe = SimFrontend::connect(&again.socket, MIN_MEM).unwrap();
    nic.wait_vf("sb-new", "open", |v| v.state == VfState::Open);
    drop(fe);
    nic.stop();
}

#[test]
fn tap_uplink_carries_frames_both_ways_with_vlan_tags() {
    let tap = format!("nt{}", std::process::id() % 1_000_000);
    let nic = TestNic::start(
        "tap",
        2,
        Some(format!("tap:{tap}")),
        LockPolicy::Hierarchical,
    );
    let mut c = nic.client();
    let a = c.alloc("pf0", "sb-a", None, None).unwrap();
    let b = c.alloc("pf0", "sb-b", None, Some(7)).unwrap();
    let mut fa = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
    let mut fb = SimFrontend::connect(&b.socket, MIN_MEM).unwrap();
    let up = common::PacketSocket::open(&tap);
    // VF → uplink (unknown destination goes out of the uplink).
    let f = frame("02:aa:aa:aa:aa:aa", &a.mac, b"to the wire");
    fa.send(&f);
    assert_eq!(
        up.recv_type(common::TEST_ETHERTYPE, T).as_deref(),
        Some(&f[..])
    );
    // VLAN VF → uplink: tagged with 7.
    fb.send(&frame("02:aa:aa:aa:aa:aa", &b.mac, b"tagged"));
    let got = up
        .recv_type(common::TEST_ETHERTYPE, T)
        .expect("tagged frame on the uplink");
    assert_eq!(&got[12..16], &[0x81, 0x00, 0x00, 0x07]);
    // Uplink → VF, learned the sender: untagged to a, tagged 7 to b only.
    let f = frame(&a.mac, "02:aa:aa:aa:aa:aa", b"from the wire");
    up.send(&f);
    assert_eq!(common::recv_test_frame(&mut fa, T).as_deref(), Some(&f[..]));
    let plain = frame(&b.mac, "02:aa:aa:aa:aa:aa", b"vlan 7");
    let mut tagged = plain[..12].to_vec();
    tagged.extend_from_slice(&[0x81, 0x00, 0x00, 0x07]);
    tagged.extend_from_slice(&plain[12..]);
    up.send(&tagged);
    assert_eq!(
        common::recv_test_frame(&mut fb, T).as_deref(),
        Some(&plain[..])
    );
    up.send(&plain); // untagged: not b's VLAN
    assert_eq!(
        common::recv_test_frame(&mut fb, Duration::from_millis(300)),
        None
    );
    drop((fa, fb, up));
    nic.stop();
    // The daemon's tap is gone with it (netdev unregistration is asynchronous).
    let t0 = std::time::Instant::now();
    while std::path::Path::new(&format!("/sys/class/net/{tap}")).exists() {
        assert!(t0.elapsed() < T, "tap {tap} left behind");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn veth_uplink_in_a_netns() {
    let id = std::process::id() % 1_000_000;
    let (ns, host_if, ns_if) = (format!("nicns{id}"), format!("nvh{id}"), format!("nvn{id}"));
    common::sh(&format!("ip netns add {ns} && ip link add {host_if} type veth peer name {ns_if} netns {ns} && ip link set {host_if} up"));
    let nic = TestNic::start(
        "veth",
        1,
        Some(format!("veth:{ns}/{ns_if}")),
        LockPolicy::Global,
    );
    let a = nic.client().alloc("pf0", "sb-a", None, None).unwrap();
    let mut fa = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
    let host = common::PacketSocket::open(&host_if);
    let f = frame("02:bb:bb:bb:bb:bb", &a.mac, b"through the veth");
    fa.send(&f);
    let got = host.recv_type(common::TEST_ETHERTYPE, T);
    let f2 = frame(&a.mac, "02:bb:bb:bb:bb:bb", b"back");
    host.send(&f2);
    let back = common::recv_test_frame(&mut fa, T);
    drop((fa, host));
    nic.stop();
    common::sh(&format!("ip link del {host_if}; ip netns del {ns}"));
    assert_eq!(got.as_deref(), Some(&f[..]));
    assert_eq!(back.as_deref(), Some(&f2[..]));
}

#[test]
fn chain_with_bad_next_index_fails_the_vf() {
    let nic = TestNic::start("chain", 2, None, LockPolicy::Global);
    let mut c = nic.client();
    let (a, b) = (
        c.alloc("pf0", "sb-a", None, None).unwrap(),
        c.alloc("pf0", "sb-b", None, None).unwrap(),
    );
    let mut fa = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
    let mut fb = SimFrontend::connect(&b.socket, MIN_MEM).unwrap();
    fa.send_broken_chain();
    let va = nic.wait_vf("sb-a", "in error", |v| v.state == VfState::Error);
    assert_eq!(
        (va.counters.bad_descriptors, va.counters.tx_packets),
        (1, 0)
    );
    assert_eq!(fa.tx_done(), 0, "a malformed chain is not completed");
    // The other VF is untouched.
    let f = frame(&a.mac, &b.mac, b"x");
    fb.send(&f);
    assert_eq!(fa.recv(Duration::from_millis(300)), None);
    assert_eq!(
        nic.client().get_by_sandbox("sb-b").unwrap().state,
        VfState::Open
    );
    drop((fa, fb));
    nic.stop();
}

/// VIRTIO_F_INDIRECT_DESC is never offered: a chain through an indirect
/// table is a fault of that VF (virtio-queue alone would follow it).
#[test]
fn indirect_chain_without_the_feature_fails_the_vf() {
    let nic = TestNic::start("indirect", 2, None, LockPolicy::Hierarchical);
    let mut c = nic.client();
    let (a, b) = (
        c.alloc("pf0", "sb-a", None, None).unwrap(),
        c.alloc("pf0", "sb-b", None, None).unwrap(),
    );
    let mut fa = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
    let mut fb = SimFrontend::connect(&b.socket, MIN_MEM).unwrap();
    let f = frame(&b.mac, &a.mac, b"through an indirect table");
    fa.send_indirect(&f);
    let va = nic.wait_vf("sb-a", "in error", |v| v.state == VfState::Error);
    assert_eq!(
        (va.counters.bad_descriptors, va.counters.tx_packets),
        (1, 0)
    );
    assert_eq!(fb.recv(Duration::from_millis(300)), None, "frame forwarded");
    assert_eq!(
        nic.client().get_by_sandbox("sb-b").unwrap().state,
        VfState::Open
    );
    drop((fa, fb));
    nic.stop();
}

/// The VF offers VIRTIO_F_IN_ORDER (virtio 1.2 §2.7.9: the device uses
/// buffers in the order they were made available): receive buffers posted
/// with heads out of index order, one too short for its frame in the
/// middle, come back in exactly that order, the short one as a drop of
/// length 0, and each frame lands in the buffer of its turn.
#[test]
fn receive_buffers_are_used_in_the_order_they_were_made_available() {
    use nic::frontend::{BUF, BUFFERS, HDR_LEN};
    assert_ne!(
        nic::session::VIRTIO_FEATURES & (1 << virtio_bindings::virtio_config::VIRTIO_F_IN_ORDER),
        0,
        "offered, so DPDK's virtio PMD takes its in-order paths"
    );
    let (nic, a, b, mut fa, mut fb) = sim_to_raw("inorder");
    // Heads 5, 3 (too short for any frame with its header), 9, posted in that order.
    let order = [(5u16, BUF as u32), (3, 8), (9, BUF as u32)];
    for (k, &(head, len)) in order.iter().enumerate() {
        // Junk where the virtio-net header goes: the device must write all of it.
        let p = fb.ptr(BUFFERS + head as u64 * BUF, HDR_LEN);
        // SAFETY: inside the frontend's own memory (a buffer of BUF bytes).
        unsafe { std::ptr::write_bytes(p, 0xa5, HDR_LEN) };
        fb.write_desc(
            0,
            head,
            BUFFERS + head as u64 * BUF,
            len,
            2, /* WRITE */
            0,
        );
        fb.put_avail(0, k as u16, head);
    }
    fb.advance_avail(0, order.len() as u16);
    fb.kick(0);
    let frames: Vec<Vec<u8>> = (0..3u8)
        .map(|i| frame(&b.mac, &a.mac, &[i + 1; 40]))
        .collect();
    for f in &frames {
        fa.send(f);
    }
    let end = std::time::Instant::now() + T;
    while fb.used_idx(0) != 3 {
        assert!(std::time::Instant::now() < end, "3 used entries");
        std::thread::sleep(Duration::from_millis(5));
    }
    let n = (HDR_LEN + frames[0].len()) as u32;
    let used: Vec<(u32, u32)> = (0..3).map(|i| fb.used_elem(0, i)).collect();
    assert_eq!(
        used,
        [(5, n), (3, 0), (9, n)],
        "avail order, the short one empty"
    );
    // Frame 1 went to head 5; frame 2 was dropped on the short buffer, frame 3 went to 9.
    for (head, f) in [(5u64, &frames[0]), (9, &frames[2])] {
        let p = fb.ptr(BUFFERS + head * BUF + HDR_LEN as u64, f.len());
        // SAFETY: inside the frontend's own memory (a posted buffer of BUF bytes).
        let got = unsafe { std::slice::from_raw_parts(p, f.len()) };
        assert_eq!(got, &f[..], "head {head}");
        // No offloads, num_buffers = 1 (VIRTIO_NET_F_MRG_RXBUF's 12-byte header).
        let h = fb.ptr(BUFFERS + head * BUF, HDR_LEN);
        // SAFETY: as above.
        let hdr = unsafe { std::slice::from_raw_parts(h, HDR_LEN) };
        assert_eq!(hdr, &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0], "head {head}");
    }
    let vb = nic.wait_vf("sb-b", "counted", |v| v.counters.rx_drops == 1);
    assert_eq!(
        (vb.counters.rx_packets, vb.counters.bad_descriptors),
        (2, 0)
    );
}

/// Cut-through (a VF→VF frame copied straight into the destination's
/// receive buffer) never lets a frame overtake an earlier one of the same
/// source: frames that had to wait for receive buffers are delivered
/// before a later frame that finds a buffer free.
#[test]
fn frames_waiting_for_receive_buffers_are_not_overtaken() {
    use nic::frontend::{VuFrontend, BUF, BUFFERS, HDR_LEN};
    let (nic, a, b, mut fa, mut fb) = sim_to_raw("cut-order");
    let post = |fb: &mut VuFrontend, heads: std::ops::Range<u16>| {
        for (k, head) in heads.clone().enumerate() {
            fb.write_desc(0, head, BUFFERS + head as u64 * BUF, BUF as u32, 2, 0);
            fb.put_avail(0, k as u16, head);
        }
        fb.advance_avail(0, heads.len() as u16);
    };
    let wait_used = |fb: &VuFrontend, n: u16| {
        let end = std::time::Instant::now() + T;
        while fb.used_idx(0) != n {
            assert!(std::time::Instant::now() < end, "{n} used entries");
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    let frames: Vec<Vec<u8>> = (1..=6u8).map(|i| frame(&b.mac, &a.mac, &[i; 50])).collect();
    // One receive buffer: frame 1 takes it, 2 and 3 wait in B's backlog.
    post(&mut fb, 0..1);
    for f in &frames[..3] {
        fa.send(f);
    }
    wait_used(&fb, 1);
    nic.wait_vf("sb-a", "sent", |v| v.counters.tx_packets == 3);
    // Buffers for everything, and frames 4..6 right behind them: whichever
    // the dataplane sees first, 2 and 3 must come before 4.
    post(&mut fb, 1..6);
    for f in &frames[3..] {
        fa.send(f);
    }
    wait_used(&fb, 6);
    for (k, f) in frames.iter().enumerate() {
        let (id, len) = fb.used_elem(0, k as u16);
        assert_eq!(
            (id, len),
            (k as u32, (HDR_LEN + f.len()) as u32),
            "entry {k}"
        );
        let p = fb.ptr(BUFFERS + k as u64 * BUF + HDR_LEN as u64, f.len());
        // SAFETY: inside the frontend's own memory (a posted buffer of BUF bytes).
        let got = unsafe { std::slice::from_raw_parts(p, f.len()) };
        assert_eq!(got, &f[..], "frame {} in order", k + 1);
    }
    let vb = nic.wait_vf("sb-b", "counted", |v| v.counters.rx_packets == 6);
    let va = nic.wait_vf("sb-a", "counted", |v| v.counters.tx_packets == 6);
    assert_eq!((va.counters.tx_drops, vb.counters.rx_drops), (0, 0));
    let n: u64 = frames.iter().map(|f| f.len() as u64).sum();
    assert_eq!((va.counters.tx_bytes, vb.counters.rx_bytes), (n, n));
}

/// A destination whose receive ring is broken (its available index more
/// than the ring ahead) goes to error when a frame is cut through to it;
/// the source, whose frame it was, stays open and counts the frame once,
/// as a drop (its destination went down before it could take it).
#[test]
fn a_broken_destination_ring_fails_the_destination_not_the_source() {
    use nic::frontend::QSIZE;
    let (nic, a, b, mut fa, mut fb) = sim_to_raw("cut-fault");
    fb.advance_avail(0, QSIZE + 7);
    fa.send(&frame(&b.mac, &a.mac, b"to a broken ring"));
    let vb = nic.wait_vf("sb-b", "error", |v| v.state == VfState::Error);
    assert_eq!(vb.counters.bad_descriptors, 1);
    let va = nic.wait_vf("sb-a", "counted", |v| v.counters.tx_drops == 1);
    assert_eq!(
        (
            va.state,
            va.counters.bad_descriptors,
            va.counters.tx_packets
        ),
        (VfState::Open, 0, 0)
    );
}

/// A NIC with VFs `sb-a` (driven by a `SimFrontend`, all its receive
/// buffers posted) and `sb-b` (a raw `VuFrontend` that posts nothing yet),
/// both open.
fn sim_to_raw(
    name: &str,
) -> (
    TestNic,
    nic_api::VfInfo,
    nic_api::VfInfo,
    SimFrontend,
    nic::frontend::VuFrontend,
) {
    use nic::frontend::{FrontendMemory, VuFrontend};
    let nic = TestNic::start(name, 2, None, LockPolicy::Hierarchical);
    let mut c = nic.client();
    let a = c.alloc("pf0", "sb-a", None, None).unwrap();
    let b = c.alloc("pf0", "sb-b", None, None).unwrap();
    let fa = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
    let fb =
        VuFrontend::connect_mem(&b.socket, FrontendMemory::new(MIN_MEM, false).unwrap()).unwrap();
    nic.wait_vf("sb-b", "open", |v| v.state == VfState::Open);
    (nic, a, b, fa, fb)
}
