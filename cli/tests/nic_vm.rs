//! `burstvm nic` with real microVMs: `burstvm vmm` processes running the
//! built-in agent on VFs of one PF (not the test frontend). The test's tap is
//! the PF's uplink; the test reads it with an AF_PACKET socket and plays the
//! server there.
//!
//! - Two guests on two VFs: guest B's request leaves through the uplink, the
//!   test answers it; guest A's server is guest B, so A's request crosses the
//!   switch VF to VF (never the uplink); the test answers A from the uplink.
//!   The per-VF counters of the control API match exactly what was sent.
//! - A VMM killed with SIGKILL while its VF is open: the VF is closed and
//!   reset at once while another VF of the devset stays open, and after
//!   release is allocated again and used by a new VMM to READY.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod nic_vm_common;

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use nic_api::{Counters, VfInfo, VfState};
use nic_vm_common::*;

#[test]
fn two_guests_talk_through_the_vf_switch_with_exact_counters() {
    let tap = TestTap::new("nv");
    let nic = Nic::start("two", &tap.0, "hierarchical");
    let mut up = Uplink::open(&tap.0);
    let pid = std::process::id();
    // B's server is the test on the uplink; A's server is guest B.
    let b = Guest {
        sandbox: format!("nicvm-b-{pid}"),
        mac: MAC_B,
        ip: IP_B,
        server: (SERVER_IP, SERVER_MAC),
        mode: SYNC_VANILLA,
        extra: &[],
    };
    let a = Guest {
        sandbox: format!("nicvm-a-{pid}"),
        mac: MAC_A,
        ip: IP_A,
        server: (IP_B, MAC_B),
        mode: ASYNC_LAZY,
        extra: &[],
    };
    let vf_a = nic.alloc(&a.sandbox, a.mac);
    let vf_b = nic.alloc(&b.sandbox, b.mac);
    assert_ne!(vf_a.id, vf_b.id);
    let idle = nic.resources();

    // Guest B: its request goes out on the uplink (A is not active yet, so
    // the flood of the unknown server MAC reaches only the uplink).
    let mut vmm_b = Vmm::start(&nic.dir, &vf_b, &b);
    let req_b = wait_request(&mut up, &mut vmm_b, b.mac);
    let client_port = check_request(&req_b, &b);
    let reply_b = udp_reply_to(b.mac, SERVER_IP, b.ip, client_port, b"pong B");
    let replies_b = reply_until_ready(&mut up, &mut vmm_b, &reply_b);
    assert_eq!(nic.get(&vf_b).state, VfState::Open);

    // Guest A asks guest B: the switch takes A's frames to B's VF (B's
    // counters show them); the test answers for B from the uplink (the agent
    // checks IPs and ports, not the source MAC).
    let mut vmm_a = Vmm::start(&nic.dir, &vf_a, &a);
    let end = Instant::now() + GUEST_WAIT;
    while nic.get(&vf_b).counters.rx_packets < replies_b + 1 {
        vmm_a.check_alive("its request to reach B's VF");
        assert!(
            Instant::now() < end,
            "A's request never reached B's VF: A {:?} B {:?}: {}",
            nic.get(&vf_a),
            nic.get(&vf_b),
            vmm_a.stderr()
        );
        up.pump(Duration::from_millis(50));
    }
    let reply_a = udp_reply_to(a.mac, IP_B, a.ip, client_port, b"pong A from B");
    let replies_a = reply_until_ready(&mut up, &mut vmm_a, &reply_a);
    assert!(replies_a >= 1 && replies_b >= 1);

    // Both guests are READY and idle: nothing moves any more. The uplink saw
    // B's requests only; A's went VF to VF.
    up.pump(Duration::from_millis(300));
    assert!(
        up.from(a.mac).is_empty(),
        "A's frames reached the uplink: {:?}",
        up.from(a.mac)
    );
    let on_wire_b = up.from(b.mac);
    assert!(
        on_wire_b.iter().all(|f| f[..] == req_b[..]),
        "B sends only its request"
    );
    let n_b = on_wire_b.len() as u64;

    // A's request count is whatever A sent (≥ 1, one per second until its
    // reply); everything else follows from it and from what the test saw
    // and sent. Polled through `list`: the NIC may still be finishing the
    // last frame's accounting.
    let len_a = request_len(&a.sandbox);
    let expected = |n_a: u64| {
        let want_a = Counters {
            tx_packets: n_a,
            tx_bytes: n_a * len_a,
            rx_packets: replies_a,
            rx_bytes: replies_a * reply_a.len() as u64,
            ..Counters::default()
        };
        let want_b = Counters {
            tx_packets: n_b,
            tx_bytes: n_b * req_b.len() as u64,
            rx_packets: replies_b + n_a,
            rx_bytes: replies_b * reply_b.len() as u64 + n_a * len_a,
            ..Counters::default()
        };
        (want_a, want_b)
    };
    let end = Instant::now() + NIC_WAIT;
    loop {
        let all = nic.list();
        let find = |vf: &VfInfo| all.iter().find(|v| v.id == vf.id).expect("VF in list");
        let (va, vb) = (find(&vf_a), find(&vf_b));
        let (want_a, want_b) = expected(va.counters.tx_packets);
        let settled = va.counters == want_a && vb.counters == want_b;
        if settled || Instant::now() >= end {
            assert!(va.counters.tx_packets >= 1, "A sent its request: {va:?}");
            assert_eq!(va.counters, want_a, "counters of A's VF {}", va.id);
            assert_eq!(vb.counters, want_b, "counters of B's VF {}", vb.id);
            for (v, g) in [(va, &a), (vb, &b)] {
                assert_eq!(v.state, VfState::Open, "{v:?}");
                assert_eq!(v.sandbox.as_deref(), Some(g.sandbox.as_str()));
                assert_eq!(v.mac, Some(g.mac.into()));
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(nic.resources().1 > idle.1, "open VFs map guest memory");

    // Both VMMs end: the devset's last close resets both VFs (counters
    // cleared), and the daemon holds nothing of the guests any more.
    vmm_a.terminate();
    vmm_b.terminate();
    for vf in [&vf_a, &vf_b] {
        let v = nic.wait_vf(vf, "reset", |v| v.state == VfState::Reset);
        assert_eq!(v.counters, Counters::default(), "reset clears counters");
    }
    nic.expect_resources(&idle);
}

#[test]
fn sigkilled_vmm_vf_is_closed_reset_and_reused() {
    let tap = TestTap::new("nk");
    let nic = Nic::start("kill", &tap.0, "global");
    let mut up = Uplink::open(&tap.0);
    let pid = std::process::id();
    let guest = |name: &str, mac, ip, mode| Guest {
        sandbox: format!("nicvm-{name}-{pid}"),
        mac,
        ip,
        server: (SERVER_IP, SERVER_MAC),
        mode,
        extra: &[],
    };
    let a = guest("ka", MAC_A, IP_A, SYNC_VANILLA);
    let b = guest("kb", MAC_B, IP_B, ASYNC_LAZY);
    let c = guest("kc", MAC_C, IP_C, ASYNC_LAZY);
    let vf_a = nic.alloc(&a.sandbox, a.mac);
    let vf_b = nic.alloc(&b.sandbox, b.mac);
    let idle = nic.resources();

    // B keeps its VF open for the whole time A dies.
    let mut vmm_b = Vmm::start(&nic.dir, &vf_b, &b);
    let port = check_request(&wait_request(&mut up, &mut vmm_b, b.mac), &b);
    let reply_b = udp_reply_to(b.mac, SERVER_IP, b.ip, port, b"pong");
    reply_until_ready(&mut up, &mut vmm_b, &reply_b);

    // A is killed while its guest waits for the reply: VF open, rings live.
    let mut vmm_a = Vmm::start(&nic.dir, &vf_a, &a);
    check_request(&wait_request(&mut up, &mut vmm_a, a.mac), &a);
    let before = nic.get(&vf_a);
    assert_eq!(before.state, VfState::Open, "{before:?}");
    assert!(before.counters.tx_packets >= 1, "{before:?}");
    vmm_a.signal(libc::SIGKILL);
    assert_eq!(vmm_a.wait_exit().signal(), Some(libc::SIGKILL));

    // Closed and reset on its own (counters cleared) while B's VF of the
    // same devset stays open.
    let va = nic.wait_vf(&vf_a, "reset", |v| v.state == VfState::Reset);
    assert_eq!(va.counters, Counters::default(), "reset clears counters");
    let vb = nic.get(&vf_b);
    assert_eq!(vb.state, VfState::Open, "{vb:?}");

    // Released, A's VF is the only free one: a new sandbox gets it and its
    // VMM reaches READY over it, B still running.
    nic.release(&a.sandbox);
    let freed = nic.get(&vf_a);
    assert_eq!((freed.state, freed.sandbox), (VfState::Free, None));
    let vf_c = nic.alloc(&c.sandbox, c.mac);
    assert_eq!(vf_c.id, vf_a.id, "the reset VF is allocated again");
    let mut vmm_c = Vmm::start(&nic.dir, &vf_c, &c);
    let req_c = wait_request(&mut up, &mut vmm_c, c.mac);
    let port = check_request(&req_c, &c);
    let reply_c = udp_reply_to(c.mac, SERVER_IP, c.ip, port, b"pong C");
    let replies_c = reply_until_ready(&mut up, &mut vmm_c, &reply_c);
    up.pump(Duration::from_millis(300));
    let n_c = up.from(c.mac).len() as u64;
    let vc = expect_counters(
        &nic,
        &vf_c,
        "C",
        Counters {
            tx_packets: n_c,
            tx_bytes: n_c * req_c.len() as u64,
            rx_packets: replies_c,
            rx_bytes: replies_c * reply_c.len() as u64,
            ..Counters::default()
        },
    );
    assert_eq!(
        (vc.state, vc.sandbox.as_deref()),
        (VfState::Open, Some(c.sandbox.as_str()))
    );
    vmm_b.check_alive("C's run");
    vmm_c.terminate();
    vmm_b.terminate();
    for vf in [&vf_c, &vf_b] {
        nic.wait_vf(vf, "reset", |v| v.state == VfState::Reset);
    }
    nic.expect_resources(&idle);
}
