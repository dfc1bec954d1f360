//! 4096 warp pipes on one SG function through the daemon: its fd and
//! thread counts do not grow with pipes. Alone in its test binary, so no
//! other test opens fds meanwhile (daemon and frontend share this process;
//! the frontend's fds are fixed too).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use testutil::nic as common;

use std::time::{Duration, Instant};

use common::TestNic;
use nic::sg::frontend::SgFrontend;
use sgiov::driver::DriverConfig;
use sgiov::layout::{PathKind, Transform};

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).unwrap().count()
}

#[test]
fn four_thousand_pipes_with_a_constant_daemon_fd_count() {
    let nic = TestNic::start_sg("sg-4096", 1, 1);
    let mut c = nic.client();
    let info = c.alloc_sg("pf0", "sb-4096").unwrap();
    let t = Duration::from_secs(30);
    let mut fe = SgFrontend::connect(&info.socket, 64 << 20, DriverConfig::default()).unwrap();
    let mut socks = Vec::new();
    let mut base = None;
    // Requests go out in batches of 512 (the control ring holds 1024).
    for _ in 0..8 {
        let mut reqs = Vec::new();
        for _ in 0..512 {
            let (s, r) = fe.drv.open(4096, 4096, 1).unwrap();
            socks.push(s);
            reqs.push(r);
        }
        for r in reqs {
            assert_eq!(fe.wait_reply(r, t).unwrap(), 0);
        }
        // The baseline once the session is surely set up (its last vring
        // messages may be handled after the attach): 512 pipes open.
        base.get_or_insert_with(|| (count("/proc/self/fd"), count("/proc/self/task")));
    }
    let (fds, threads) = base.unwrap();
    for chunk in socks.chunks(512) {
        let reqs: Vec<u32> = chunk
            .iter()
            .map(|&s| {
                fe.drv
                    .connect(s, 0, Transform::Copy, PathKind::Direct)
                    .unwrap()
            })
            .collect();
        for r in reqs {
            assert_eq!(fe.wait_reply(r, t).unwrap(), 0);
        }
    }
    for (i, &s) in socks.iter().enumerate() {
        assert_eq!(fe.drv.send(s, &(i as u32).to_le_bytes()).unwrap(), 4);
    }
    let t0 = Instant::now();
    while !socks.iter().all(|&s| fe.drv.rx_ready(s) == 4) {
        assert!(t0.elapsed() < t, "4096 echoes did not come back");
        fe.pump(Duration::from_millis(5)).unwrap();
    }
    for (i, &s) in socks.iter().enumerate() {
        let mut b = [0u8; 4];
        assert_eq!(fe.drv.recv(s, &mut b).unwrap(), 4);
        assert_eq!(u32::from_le_bytes(b), i as u32);
    }
    assert_eq!(count("/proc/self/fd"), fds, "fds do not grow with pipes");
    assert_eq!(count("/proc/self/task"), threads, "nor threads");
    let t0 = Instant::now();
    let st = loop {
        let v = c.get_by_sandbox("sb-4096").unwrap().sg.unwrap();
        // HEAD in, TAIL in, TAIL of the receive side: three per pipe.
        if v.pf_pipes == 4096 && v.sgf.signals_in >= 3 * 4096 {
            break v;
        }
        assert!(t0.elapsed() < t, "counters: {v:?}");
        fe.pump(Duration::from_millis(20)).unwrap();
    };
    assert_eq!(st.sockets, 4096);
    assert!(
        st.sgf.kicks * 8 < st.sgf.signals_in,
        "signals per doorbell: {st:?}"
    );
    drop(fe);
    nic.stop();
}
