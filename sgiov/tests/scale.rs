//! 4096 warp pipes on one SG function: the device's fd and thread counts do
//! not grow with the number of pipes. Alone in its test binary, so no other
//! test opens fds meanwhile.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use common::*;
use sgiov::layout::{PathKind, Transform};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn four_thousand_sockets_with_a_constant_fd_count() {
    let mut dev = device(2);
    let mut g = guest(&mut dev, "t-4096", 1);
    let fds = open_fds();
    let threads = std::fs::read_dir("/proc/self/task").unwrap().count();
    let mut socks = Vec::new();
    let mut reqs = Vec::new();
    // Requests go out in batches of 512 (the control ring holds 1024).
    for _ in 0..8 {
        for _ in 0..512 {
            let (s, r) = g.drv.open(4096, 4096, 1).unwrap();
            socks.push(s);
            reqs.push(r);
        }
        for r in reqs.drain(..) {
            assert_eq!(reply(&mut dev, &mut g, r), 0);
        }
    }
    for chunk in socks.chunks(512) {
        let reqs: Vec<u32> = chunk
            .iter()
            .map(|&s| {
                g.drv
                    .connect(s, 0, Transform::Copy, PathKind::Direct)
                    .unwrap()
            })
            .collect();
        for r in reqs {
            assert_eq!(reply(&mut dev, &mut g, r), 0);
        }
    }
    // One message through every pipe.
    for (i, &s) in socks.iter().enumerate() {
        assert_eq!(g.drv.send(s, &(i as u32).to_le_bytes()).unwrap(), 4);
    }
    until(&mut dev, &mut [&mut g], "4096 echoes", |gs| {
        socks.iter().all(|&s| gs[0].drv.rx_ready(s) == 4)
    });
    for (i, &s) in socks.iter().enumerate() {
        let mut b = [0u8; 4];
        assert_eq!(g.drv.recv(s, &mut b).unwrap(), 4);
        assert_eq!(u32::from_le_bytes(b), i as u32);
    }
    assert_eq!(dev.stats().pipes, 4096);
    assert_eq!(open_fds(), fds, "fds do not grow with pipes");
    assert_eq!(
        std::fs::read_dir("/proc/self/task").unwrap().count(),
        threads,
        "nor threads"
    );
    let st = dev.sgf_stats(g.sgf).unwrap();
    assert!(
        st.signals_in >= 3 * 4096 && st.kicks * 8 < st.signals_in,
        "signals per kick: {st:?}"
    );
}
