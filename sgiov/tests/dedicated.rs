//! The `dedicated` signal mode (one signal channel per socket, polled by
//! the device): echoes through it, and a channel word that names another
//! pipe's ring is rejected, counted, fails only its own pipe.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use common::*;
use sgiov::driver::{DriverConfig, SockState};
use sgiov::layout::{ErrorCode, PathKind, Transform};
use sgiov::signal::{SignalType, SignalWord};

fn dedicated() -> DriverConfig {
    DriverConfig {
        channels: 4,
        ..Default::default()
    }
}

fn echo_socket(dev: &mut Dev, g: &mut Guest) -> u16 {
    let s = open(dev, g, 64 << 10, 0);
    let req = g
        .drv
        .connect(s, 0, Transform::Copy, PathKind::Direct)
        .unwrap();
    assert_eq!(reply(dev, g, req), 0);
    s
}

#[test]
fn a_forged_channel_word_fails_only_its_own_pipe() {
    let mut dev = device(0);
    let mut g = guest_cfg(&mut dev, "t-ded-forge", 1, dedicated());
    let mut other = guest_cfg(&mut dev, "t-ded-other", 2, dedicated());
    let (a, b) = (echo_socket(&mut dev, &mut g), echo_socket(&mut dev, &mut g));
    let c = echo_socket(&mut dev, &mut other);
    assert!(g.drv.channel(a).is_some() && g.drv.channel(b).is_some());
    assert_ne!(g.drv.channel(a), g.drv.channel(b));
    echo(&mut dev, &mut g, a, &random(100_000, 1));
    echo(&mut dev, &mut g, b, &random(100_000, 2));
    let st = dev.sgf_stats(g.sgf).unwrap();
    assert!(st.chan_scanned > 0 && st.signals_in > 0, "{st:?}");
    assert_eq!(st.chan_forged, 0);

    // a's channel names b's TX ring (same SGF) and the control request
    // ring: both forged (ring ids are per SGF: the other guest's are its own).
    let (b_tx, _) = g.drv.rings(b).unwrap();
    for ring in [b_tx, 0] {
        let w = SignalWord::encode(SignalType::Head, ring, 1 << 20);
        g.drv.push_channel_word(a, w).unwrap();
    }
    until(&mut dev, &mut [&mut g], "a in error", |gs| {
        matches!(gs[0].drv.state(a), Some(SockState::Error(_)))
    });
    assert_eq!(g.drv.state(a), Some(SockState::Error(ErrorCode::BadRing)));
    let st = dev.sgf_stats(g.sgf).unwrap();
    assert_eq!(st.chan_forged, 2, "{st:?}");
    // b and the other guest's pipe are untouched and keep moving.
    assert_eq!(g.drv.state(b), Some(SockState::Open));
    echo(&mut dev, &mut g, b, &random(50_000, 3));
    echo(&mut dev, &mut other, c, &random(50_000, 4));
    assert_eq!(dev.sgf_stats(other.sgf).unwrap().chan_forged, 0);

    // Closing releases the channels; a new socket takes one again.
    for s in [a, b] {
        let req = g.drv.close(s).unwrap();
        assert_eq!(reply(&mut dev, &mut g, req), 0);
    }
    let d = echo_socket(&mut dev, &mut g);
    echo(&mut dev, &mut g, d, &random(10_000, 5));
    for (gg, s) in [(&mut g, d), (&mut other, c)] {
        let req = gg.drv.close(s).unwrap();
        assert_eq!(reply(&mut dev, gg, req), 0);
    }
    assert_released(&dev, 0);
}

#[test]
fn without_channels_signals_stay_on_the_cross_fifo() {
    let mut dev = device(0);
    let mut g = guest(&mut dev, "t-ded-none", 1);
    let s = echo_socket(&mut dev, &mut g);
    assert_eq!(g.drv.channel(s), None);
    echo(&mut dev, &mut g, s, &random(20_000, 6));
    let st = dev.sgf_stats(g.sgf).unwrap();
    assert_eq!((st.chan_scanned, st.chan_forged), (0, 0), "{st:?}");
}
