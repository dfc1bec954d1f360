//! `--dataplane-threads 2`: two VFs served by different dataplane threads
//! exchange frames through the cross-thread channels, with exact counters,
//! and the packet buffers go back to their home pools (more frames cross
//! than a pool holds, without a drop).

use testutil::nic as common;

use std::time::{Duration, Instant};

use common::{frame, TestNic};
use nic::frontend::{SimFrontend, MIN_MEM, QSIZE};
use nic::LockPolicy;

/// More than one thread's pool (4096 + 64 buffers per VF served).
const FRAMES: u64 = 3 * 4160;

/// Sends `n` prepared frames from `tx` to `rx` in poll mode, never more in
/// flight than `rx` has receive buffers (so none may be dropped).
fn pump(tx: &mut SimFrontend, rx: &mut SimFrontend, n: u64) -> u64 {
    let (mut sent, mut got, mut bytes) = (0u64, 0u64, 0u64);
    let t0 = Instant::now();
    while got < n {
        let room = (n - sent).min(QSIZE as u64 - (sent - got)).min(32);
        sent += tx.tx_burst(room as usize) as u64;
        let (k, b) = rx.rx_burst();
        got += k as u64;
        bytes += b;
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{got} of {n} frames arrived ({sent} sent)"
        );
        if k == 0 {
            std::thread::yield_now();
        }
    }
    assert_eq!(got, n, "no frame more than sent");
    bytes
}

#[test]
fn vfs_on_different_dataplane_threads_exchange_frames_with_exact_counters() {
    let name = format!("threads-{}", std::process::id());
    let nic = TestNic::start_threads(
        &name,
        2,
        None,
        LockPolicy::Hierarchical,
        vec![],
        Default::default(),
        2,
    );
    // Two dataplane threads for the PF.
    let comms: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect();
    assert!(comms.iter().any(|c| c == "dp-pf0"), "{comms:?}");
    assert!(comms.iter().any(|c| c == "dp-pf0-1"), "{comms:?}");

    let mut c = nic.client();
    let a = c.alloc("pf0", "sb-a", None, None).unwrap();
    let b = c.alloc("pf0", "sb-b", None, None).unwrap();
    assert_ne!(a.index % 2, b.index % 2, "served by different threads");
    let mut fa = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
    let mut fb = SimFrontend::connect(&b.socket, MIN_MEM).unwrap();
    let ab = frame(&b.mac, &a.mac, &[1; 60]);
    let ba = frame(&a.mac, &b.mac, &[2; 1000]);

    // One frame each way, byte-exact, then many in poll mode.
    fa.send(&ab);
    assert_eq!(fb.recv(Duration::from_secs(5)).as_deref(), Some(&ab[..]));
    fb.send(&ba);
    assert_eq!(fa.recv(Duration::from_secs(5)).as_deref(), Some(&ba[..]));
    fa.prepare_tx(&ab);
    fb.prepare_tx(&ba);
    let ab_bytes = pump(&mut fa, &mut fb, FRAMES);
    let ba_bytes = pump(&mut fb, &mut fa, FRAMES);
    assert_eq!(ab_bytes, FRAMES * ab.len() as u64);
    assert_eq!(ba_bytes, FRAMES * ba.len() as u64);

    // A spoofed frame crosses nothing and counts only as a drop.
    let mut spoof = ab.clone();
    spoof[6..12].copy_from_slice(&[2, 0x66, 0x66, 0x66, 0x66, 0x66]);
    fa.send(&spoof);

    let n = FRAMES + 1;
    let va = nic.wait_vf("sb-a", "counted", |v| v.counters.tx_drops == 1);
    let vb = c.get_by_sandbox("sb-b").unwrap();
    let (ca, cb) = (va.counters, vb.counters);
    assert_eq!((ca.tx_packets, ca.tx_bytes), (n, n * ab.len() as u64));
    assert_eq!((cb.rx_packets, cb.rx_bytes), (n, n * ab.len() as u64));
    assert_eq!((cb.tx_packets, cb.tx_bytes), (n, n * ba.len() as u64));
    assert_eq!((ca.rx_packets, ca.rx_bytes), (n, n * ba.len() as u64));
    assert_eq!((ca.rx_drops, cb.rx_drops, cb.tx_drops), (0, 0, 0));
    assert_eq!(ca.bad_descriptors + cb.bad_descriptors, 0);
    drop((fa, fb));
    nic.stop();
}
