//! Interop with a foreign frontend: DPDK's `dpdk-testpmd` drives VF A of the
//! NIC through its virtio-user PMD (hugetlb memory, its own rings and
//! descriptor layout), the test's `SimFrontend` drives VF B. Frames cross the
//! switch both ways byte-exact, and the NIC's counters equal testpmd's and the
//! test's own counts. Needs root (hugepages) and `dpdk-testpmd` (package
//! dpdk-dev, installed by scripts/setup.sh).

use testutil::nic as common;

use std::time::Duration;

use bench::dataplane::dpdk::Backend;
use bench::dataplane::testpmd::{Hugepages, Testpmd, PAGES_PER_TESTPMD};
use common::{frame, TestNic};
use nic::frontend::{SimFrontend, MIN_MEM};
use nic::LockPolicy;
use nic_api::VfState;

const T: Duration = Duration::from_secs(5);
/// The tests of this file take hugepages in turn: each gives back what it
/// added, which is only right if no other holds pages meanwhile.
static HUGEPAGES: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn testpmd_missing() -> bool {
    let missing = bench::dataplane::testpmd::find().is_none();
    if missing {
        println!(
            "SKIPPED: {} is not on PATH (Debian package dpdk-dev; scripts/setup.sh installs it)",
            bench::dataplane::testpmd::TESTPMD
        );
    }
    missing
}
/// testpmd's txonly frames: 64 bytes, IPv4/UDP 198.18.0.1:9 -> 198.18.0.2:9.
const TXONLY_LEN: usize = 64;

#[test]
fn dpdk_virtio_user_frames_cross_the_switch_byte_exact_with_exact_counters() {
    if testpmd_missing() {
        return;
    }
    let _turn = HUGEPAGES.lock().unwrap_or_else(|e| e.into_inner());
    let nr = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages";
    let pages_before = std::fs::read_to_string(nr).unwrap();
    let pages = Hugepages::reserve(PAGES_PER_TESTPMD).unwrap();

    let nic = TestNic::start("dpdk", 2, None, LockPolicy::Hierarchical);
    let mut c = nic.client();
    let a = c
        .alloc("pf0", "sb-dpdk", Some("02:00:00:00:d0:0a"), None)
        .unwrap();
    let b = c
        .alloc("pf0", "sb-sim", Some("02:00:00:00:d0:0b"), None)
        .unwrap();
    // testpmd as A's guest driver: mac= must be the VF's (spoof check).
    let vdev = format!(
        "net_virtio_user0,path={},mac={}",
        a.socket.display(),
        a.mac.unwrap()
    );
    let peer = format!("--eth-peer=0,{}", b.mac.unwrap());
    let mut pmd =
        Testpmd::spawn("interop", 0, &[vdev], &["--forward-mode=macswap", &peer]).unwrap();
    nic.wait_vf("sb-dpdk", "open", |v| v.state == VfState::Open);
    let mut fb = SimFrontend::connect(&b.socket, MIN_MEM).unwrap();
    nic.wait_vf("sb-sim", "open", |v| v.state == VfState::Open);

    // 1. DPDK -> NIC: two bursts of txonly frames from A to B, then macswap.
    pmd.cmd("start tx_first 2").unwrap();
    let sent = pmd.port_stats(0).unwrap().tx_packets;
    assert!(sent > 0, "testpmd sent nothing");
    let mut first = Vec::new();
    for i in 0..sent {
        let f = fb
            .recv(T)
            .unwrap_or_else(|| panic!("txonly frame {i} of {sent} never reached VF B"));
        assert_eq!(f.len(), TXONLY_LEN, "frame {i}");
        assert_eq!(&f[..6], &*b.mac.unwrap(), "dst");
        assert_eq!(&f[6..12], &*a.mac.unwrap(), "src");
        // IPv4, UDP, 198.18.0.1 -> 198.18.0.2 (testpmd's txonly template).
        assert_eq!(&f[12..14], &[0x08, 0x00]);
        assert_eq!(f[14] >> 4, 4);
        assert_eq!(f[23], 17);
        assert_eq!(&f[26..34], &[198, 18, 0, 1, 198, 18, 0, 2]);
        if i == 0 {
            first = f;
        } else {
            assert_eq!(f, first, "every txonly frame is the same");
        }
    }
    assert_eq!(fb.recv(Duration::from_millis(200)), None, "no extra frame");

    // 2. NIC -> DPDK -> NIC: B's frames of every length, split by DPDK over
    // its own mbufs, come back from A with the MACs swapped, byte-exact.
    let lens = [60usize, 64, 65, 128, 511, 1000, 1499, 1514];
    let mut bytes = 0u64;
    for (k, &len) in lens.iter().cycle().take(40).enumerate() {
        let payload: Vec<u8> = (0..len - 14).map(|j| (j * 7 + k) as u8).collect();
        let out = frame(&a.mac, &b.mac, &payload);
        fb.send(&out);
        let back = fb
            .recv(T)
            .unwrap_or_else(|| panic!("frame {k} ({len} B) never came back"));
        let want = frame(&b.mac, &a.mac, &payload);
        assert!(back == want, "frame {k} ({len} B) changed on its way");
        bytes += len as u64;
    }
    let rt = 40u64;

    // Counters: the NIC's, testpmd's and ours agree.
    let st = pmd.port_stats(0).unwrap();
    assert_eq!(
        (st.rx_packets, st.tx_packets),
        (rt, sent + rt),
        "testpmd: {st:?}"
    );
    let va = nic.wait_vf("sb-dpdk", "counted", |v| v.counters.tx_packets == sent + rt);
    let vb = nic.wait_vf("sb-sim", "counted", |v| v.counters.rx_packets == sent + rt);
    let (ca, cb) = (va.counters, vb.counters);
    assert_eq!((ca.rx_packets, ca.rx_bytes), (rt, bytes), "A rx: {ca:?}");
    assert_eq!(
        ca.tx_bytes,
        sent * TXONLY_LEN as u64 + bytes,
        "A tx: {ca:?}"
    );
    assert_eq!((cb.tx_packets, cb.tx_bytes), (rt, bytes), "B tx: {cb:?}");
    assert_eq!(cb.rx_bytes, ca.tx_bytes, "B rx: {cb:?}");
    let faults = ca.rx_drops + ca.tx_drops + cb.rx_drops + cb.tx_drops;
    assert_eq!(faults + ca.bad_descriptors + cb.bad_descriptors, 0);

    // testpmd quits cleanly: its VF closes and is reset.
    pmd.cmd("stop").unwrap();
    pmd.quit().unwrap();
    drop(fb);
    nic.wait_vf("sb-dpdk", "reset", |v| v.state == VfState::Reset);
    nic.stop();
    drop(pages);
    assert_eq!(
        std::fs::read_to_string(nr).unwrap(),
        pages_before,
        "hugepages given back"
    );
}

/// `bench dataplane --peer dpdk` in short: the same testpmd frontend moves
/// frames through burstvm's NIC and through DPDK's vhost backend, and both
/// backends' CPU time is counted.
#[test]
fn bench_peer_dpdk_moves_frames_through_both_backends() {
    if testpmd_missing() {
        return;
    }
    let _turn = HUGEPAGES.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::path::PathBuf::from(format!("/tmp/nic-t{}-bench-dpdk", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pages = Hugepages::reserve(2 * PAGES_PER_TESTPMD).unwrap();
    for backend in [Backend::Burstvm, Backend::Dpdk] {
        let s = bench::dataplane::dpdk::run_once(backend, &dir, 64, Duration::from_millis(300))
            .unwrap();
        assert!(s.frames > 1000, "{backend:?}: {s:?}");
        assert!(s.cpu_seconds > 0.0, "{backend:?}: {s:?}");
        assert_eq!(
            s.busy_cycles_per_frame.is_some(),
            backend == Backend::Dpdk,
            "{s:?}"
        );
    }
    drop(pages);
    std::fs::remove_dir_all(&dir).unwrap();
}
