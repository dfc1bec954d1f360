//! Idle ports are not touched per round: a live VF whose transmit queue has
//! had nothing for a while is parked (`nic/src/dataplane/park.rs`), so a
//! busy dataplane reads nothing of its ring until its guest kicks.

use std::time::{Duration, Instant};

use bench::dataplane::BenchNic;
use nic::frontend::{FrontendMemory, SimFrontend, MIN_MEM, RING_AREA};

/// The ring of an idle VF is not read while the dataplane is busy with
/// others: its avail index is set to garbage (more entries than the ring
/// holds, which a read reports as a fault: `bad_descriptors`, VF in error)
/// while VF 0 streams frames to VF 1 for a while, and nothing notices. Its
/// kick (a valid frame published) brings it back: the frame arrives.
#[test]
fn a_busy_dataplane_leaves_an_idle_vfs_ring_alone_until_it_kicks() {
    let dir = testutil::fresh_dir("nic-park", "idle");
    let b = BenchNic::start_capped(&dir, 3, 32, None, 1, Duration::from_secs(30)).unwrap();
    let ports = &b.nic.pfs[0].ports;
    let macs: Vec<[u8; 6]> = ports.iter().map(|p| p.config().mac).collect();
    let frame = |to: usize, from: usize| {
        let mut f = vec![0u8; 64];
        f[..6].copy_from_slice(&macs[to]);
        f[6..12].copy_from_slice(&macs[from]);
        f[12..14].copy_from_slice(&[0x88, 0xb5]);
        f
    };
    let mut fa = SimFrontend::connect(&ports[0].socket, MIN_MEM).unwrap();
    let mut fb = SimFrontend::connect(&ports[1].socket, MIN_MEM).unwrap();
    let mem = FrontendMemory::new(MIN_MEM, false).unwrap();
    let view = mem.second_view().unwrap();
    let mut fc = SimFrontend::connect_mem(&ports[2].socket, mem).unwrap();
    fa.prepare_tx(&frame(1, 0));
    // Frames VF 1 received while VF 0 streamed for `d`.
    let stream = |fa: &mut SimFrontend, fb: &mut SimFrontend, d: Duration| {
        let (t0, mut got) = (Instant::now(), 0u64);
        while t0.elapsed() < d {
            fa.tx_burst(32);
            got += fb.rx_burst().0 as u64;
        }
        got
    };
    // Busy long enough for VF 2's queue to be parked (256 idle rounds).
    assert!(stream(&mut fa, &mut fb, Duration::from_millis(300)) > 0);
    // The transmit queue's avail index (queue 1), 0x8000 entries ahead.
    let idx = RING_AREA + 0x1000 + 2;
    let (base, size) = view.host();
    assert!((idx as usize) + 2 <= size);
    // SAFETY: inside our own shared mapping of VF 2's guest memory.
    unsafe { std::ptr::write_volatile(base.add(idx as usize) as *mut u16, 0x8000) };
    let got = stream(&mut fa, &mut fb, Duration::from_millis(500));
    assert!(got > 1000, "frames kept flowing ({got})");
    let c = ports[2].counters.snapshot();
    assert_eq!(
        (c.bad_descriptors, c.tx_packets, c.tx_drops),
        (0, 0, 0),
        "the idle VF's ring was read while parked"
    );
    // Its guest sends a frame (a valid avail index, and a kick): polled again.
    let f = frame(0, 2);
    fc.send(&f);
    assert_eq!(fa.recv(Duration::from_secs(3)).as_deref(), Some(&f[..]));
    // The source's counters are added after its burst is switched: another
    // dataplane thread may deliver the frame first.
    let deadline = Instant::now() + Duration::from_secs(3);
    while ports[2].counters.snapshot().tx_packets == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(ports[2].counters.snapshot().tx_packets, 1);
    drop((fa, fb, fc, view, b));
    let _ = std::fs::remove_dir_all(&dir);
}
