//! Tenant isolation in the mempool: frames waiting for guests that never read
//! their receive queue (their rings full, their backlogs full) hold pool
//! buffers, but never so many that another VF's transmit queue finds no
//! buffer (which would drop a bystander's frames: one tenant starving another).

use std::time::{Duration, Instant};

use bench::dataplane::BenchNic;
use nic::frontend::{SimFrontend, MIN_MEM, QSIZE};
use testutil::nic::frame;

/// VFs of the PF: a bystander pair, one flooding VF and the rest never reading.
const VFS: usize = 40;
/// Bound of every wait: generous, since the dataplane thread shares 2 cores
/// with the rest of the suite (a loaded run once took over 5 s to fill a ring).
const PATIENCE: Duration = Duration::from_secs(30);
/// Frames sent to each VF that never reads: its receive ring, its backlog, and more.
const PER_HOG: u64 = 600;

/// Sends `n` copies of `f` from `tx`, never overwriting a buffer the NIC has
/// not used yet, and waits until the NIC has taken them all.
fn flood(tx: &mut SimFrontend, f: &[u8], n: u64) {
    tx.prepare_tx(f);
    let (t0, mut sent) = (Instant::now(), 0u64);
    while sent < n || tx.tx_in_flight() > 0 {
        if sent < n {
            sent += tx.tx_burst((n - sent).min(32) as usize) as u64;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{sent} of {n} sent, {} not taken",
            tx.tx_in_flight()
        );
    }
}

#[test]
fn guests_that_never_read_do_not_starve_another_vfs_transmit() {
    let dir = testutil::fresh_dir("nic-backlog", "hogs");
    let b = BenchNic::start(&dir, VFS, 32, None, 1).unwrap();
    let ports = &b.nic.pfs[0].ports;
    let mac = |i: usize| netutil::MacAddr::new(ports[i].config().mac).to_string();
    let mut fe: Vec<SimFrontend> = ports
        .iter()
        .map(|p| SimFrontend::connect(&p.socket, MIN_MEM).unwrap())
        .collect();
    let c = |i: usize| ports[i].counters.snapshot();
    // Every VF reachable before the flood (a VF just connected has no route
    // until the dataplane saw it live): one frame from VF 2 to each.
    for j in (0..VFS).filter(|&j| j != 2) {
        let f = frame(&mac(j), &mac(2), &[j as u8; 60]);
        let t0 = Instant::now();
        while c(j).rx_packets == 0 {
            fe[2].send(&f);
            assert!(t0.elapsed() < PATIENCE, "VF {j} never reachable");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    // Every probe taken by the NIC, and the bystanders' copies read.
    let t0 = Instant::now();
    while fe[2].tx_in_flight() > 0 {
        assert!(t0.elapsed() < PATIENCE, "probes not taken");
        std::thread::yield_now();
    }
    for i in [0, 1] {
        while fe[i].recv(Duration::from_millis(100)).is_some() {}
    }
    let hogs = 3..VFS;
    let base: Vec<_> = (0..VFS).map(c).collect();
    // VF 2 floods every hog; the hogs never read.
    for j in hogs.clone() {
        flood(&mut fe[2], &frame(&mac(j), &mac(2), &[0xee; 1000]), PER_HOG);
    }
    // Every flooded frame accounted for at the source: none dropped for want
    // of a buffer while the hogs' backlogs filled.
    let total = (VFS - 3) as u64 * PER_HOG;
    let t0 = Instant::now();
    let taken = || {
        let d = c(2);
        (
            d.tx_packets - base[2].tx_packets,
            d.tx_drops - base[2].tx_drops,
        )
    };
    while taken().0 + taken().1 < total {
        assert!(t0.elapsed() < PATIENCE, "flood not counted");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(
        taken(),
        (total, 0),
        "the flooder's transmit found no buffer: frames waiting for guests that never read hold the pool"
    );
    // Each hog got what its ring holds, its backlog filled, the rest dropped.
    // The ring holds QSIZE frames in all, the probes among them: a probe is
    // sent again until the VF's counter shows one, so a loaded host may have
    // delivered two before the counter caught up.
    let ring = QSIZE as u64;
    for j in hogs.clone() {
        let t0 = Instant::now();
        while c(j).rx_packets < ring {
            assert!(t0.elapsed() < PATIENCE, "VF {j}: ring not filled");
            std::thread::sleep(Duration::from_millis(2));
        }
        let d = c(j);
        assert!(
            d.rx_drops - base[j].rx_drops > 0,
            "VF {j}: {PER_HOG} frames fit ring and backlog?"
        );
    }
    // The bystanders: VF 0 sends to VF 1, which reads; no frame is dropped.
    let f = frame(&mac(1), &mac(0), &[7; 60]);
    for k in 0..200 {
        fe[0].send(&f);
        let got = fe[1].recv(Duration::from_secs(3));
        assert_eq!(got.as_deref(), Some(&f[..]), "bystander frame {k}");
    }
    // The switch adds a burst's counters once it has forwarded the burst,
    // which the receiver may already hold: wait (bounded) for the last ones.
    let t0 = Instant::now();
    while (c(0).tx_packets - base[0].tx_packets < 200 || c(1).rx_packets - base[1].rx_packets < 200)
        && t0.elapsed() < Duration::from_secs(3)
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    let (a, bb) = (c(0), c(1));
    assert_eq!(
        a.tx_drops - base[0].tx_drops,
        0,
        "bystander's transmit starved"
    );
    assert_eq!(a.tx_packets - base[0].tx_packets, 200);
    assert_eq!(bb.rx_packets - base[1].rx_packets, 200);
    drop((fe, b));
    let _ = std::fs::remove_dir_all(&dir);
}
