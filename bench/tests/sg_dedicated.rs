//! An SG function in `dedicated` signal mode over a real vhost-user
//! session (the daemon in this process, alone in this test binary so that
//! the process's fd count is this test's): channel vrings accept no
//! virtqueue, every channel holds a kick/call eventfd pair on both sides,
//! and all of them are given back when the frontend disconnects.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use testutil::nic as common;

use std::time::{Duration, Instant};

use bench::sg::open_echo_pipes;
use common::{wait_sg, TestNic};
use nic::sg::frontend::SgFrontend;
use nic_api::VfState;
use sgiov::driver::DriverConfig;
use vhost::vhost_user::message::{VhostUserHeaderFlag, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VringConfigData};

const MEM: usize = 64 << 20;
const T: Duration = Duration::from_secs(10);
const CHANNELS: usize = 8;

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// A bare session with REPLY_ACK, so that a refused message is an error.
fn bare(socket: &std::path::Path) -> Frontend {
    let mut fe = Frontend::connect(socket, 4).unwrap();
    fe.set_owner().unwrap();
    let f = fe.get_features().unwrap();
    fe.set_features(f).unwrap();
    let p = fe.get_protocol_features().unwrap();
    fe.set_protocol_features(p & VhostUserProtocolFeatures::REPLY_ACK)
        .unwrap();
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    fe
}

#[test]
fn dedicated_channels_are_signal_only_and_their_fds_come_back() {
    let nic = TestNic::start_sg("sg-ded", 1, 1);
    let mut c = nic.client();
    let info = c.alloc_sg("pf0", "sb-ded").unwrap();

    // A channel vring (index >= 2) never gets a virtqueue: SET_VRING_NUM
    // and SET_VRING_ADDR there are refused (and end that session).
    for what in ["SET_VRING_NUM", "SET_VRING_ADDR"] {
        let fe = bare(&info.socket);
        // The same message on a queue is fine.
        fe.set_vring_num(0, 64).unwrap();
        let r = if what == "SET_VRING_NUM" {
            fe.set_vring_num(2, 64)
        } else {
            fe.set_vring_addr(
                3,
                &VringConfigData {
                    queue_max_size: 64,
                    queue_size: 64,
                    flags: 0,
                    desc_table_addr: 0x1000,
                    used_ring_addr: 0x2000,
                    avail_ring_addr: 0x3000,
                    log_addr: None,
                },
            )
        };
        assert!(r.is_err(), "{what} on a channel vring was accepted");
        drop(fe);
        wait_sg(&mut c, "sb-ded", "closed", |v| v.state != VfState::Open);
    }

    let base = fds();
    let cfg = DriverConfig {
        channels: CHANNELS as u32,
        ..Default::default()
    };
    let mut fe = SgFrontend::connect(&info.socket, MEM, cfg).unwrap();
    let socks = open_echo_pipes(&mut fe, CHANNELS, 4096, 1).expect("OPEN + CONNECT echo");
    for &s in &socks {
        assert!(fe.drv.channel(s).is_some(), "socket {s} has a channel");
    }
    for (i, &s) in socks.iter().enumerate() {
        assert_eq!(fe.drv.send(s, &vec![i as u8 + 1; 3000]).unwrap(), 3000);
    }
    let t0 = Instant::now();
    while !socks.iter().all(|&s| fe.drv.rx_ready(s) == 3000) {
        assert!(t0.elapsed() < T, "echoes did not come back");
        fe.pump(Duration::from_millis(5)).unwrap();
    }
    for (i, &s) in socks.iter().enumerate() {
        let mut b = vec![0u8; 3000];
        assert_eq!(fe.drv.recv(s, &mut b).unwrap(), 3000);
        assert!(
            b.iter().all(|&x| x == i as u8 + 1),
            "socket {s}: bytes differ"
        );
    }
    let v = wait_sg(&mut c, "sb-ded", "polled its channels", |v| {
        v.sg.is_some_and(|s| s.attached && s.sockets == CHANNELS as u64 && s.sgf.chan_scanned > 0)
    });
    assert_eq!(v.sg.unwrap().sgf.chan_forged, 0);
    // Both ends hold a kick and a call eventfd per channel.
    let held = fds() - base;
    assert!(held >= 4 * CHANNELS, "{held} fds for {CHANNELS} channels");

    drop(fe);
    wait_sg(&mut c, "sb-ded", "detached", |v| {
        let s = v.sg.unwrap();
        !s.attached && s.pf_pipes == 0 && s.pf_rings == 0 && v.state != VfState::Open
    });
    let t0 = Instant::now();
    while fds() != base {
        assert!(
            t0.elapsed() < T,
            "fds not given back: {} now, {base} before the session",
            fds()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    c.release("sb-ded").unwrap();
    nic.stop();
}
