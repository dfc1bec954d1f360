//! `--dataplane-threads 2`: two VFs served by different dataplane threads
//! exchange frames through the cross-thread channels, with exact counters,
//! and the packet buffers go back to their home pools (more frames cross
//! than a pool holds, without a drop); sleeping threads are woken for every
//! frame, and ask for kicks (VRING_USED_F_NO_NOTIFY clear) only while asleep.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use testutil::nic as common;

use std::time::{Duration, Instant};

use common::{frame, TestNic};
use nic::frontend::{SimFrontend, MIN_MEM, QSIZE};
use nic::LockPolicy;
use nic_api::Counters;

/// More than one thread's pool (its cap: 4096 + 256 per VF of the PF + 1024
/// for the channel to the other thread = 5632 here).
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

/// Sends `f` from `tx` until `rx` receives it (at most 20 tries).
fn cross(tx: &mut SimFrontend, rx: &mut SimFrontend, f: &[u8]) {
    for _ in 0..20 {
        tx.send(f);
        if let Some(got) = rx.recv(Duration::from_millis(250)) {
            assert_eq!(got, f);
            return;
        }
    }
    panic!("no frame crossed in 20 tries");
}

fn delta(now: &Counters, base: &Counters) -> Counters {
    Counters {
        rx_packets: now.rx_packets - base.rx_packets,
        rx_bytes: now.rx_bytes - base.rx_bytes,
        rx_drops: now.rx_drops - base.rx_drops,
        tx_packets: now.tx_packets - base.tx_packets,
        tx_bytes: now.tx_bytes - base.tx_bytes,
        tx_drops: now.tx_drops - base.tx_drops,
        bad_descriptors: now.bad_descriptors - base.bad_descriptors,
        bad_requests: now.bad_requests - base.bad_requests,
    }
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
    // Two dataplane threads for the PF (a new thread names itself once it
    // runs: its comm is its parent's until then).
    let comms = || -> Vec<String> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .flatten()
            .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
            .map(|c| c.trim().to_string())
            .collect()
    };
    let named = |c: &[String]| {
        ["dp-pf0", "dp-pf0-1"]
            .iter()
            .all(|n| c.iter().any(|x| x == n))
    };
    let t0 = Instant::now();
    while !named(&comms()) && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let c = comms();
    assert!(named(&c), "{c:?}");

    let mut c = nic.client();
    let a = c.alloc("pf0", "sb-a", None, None).unwrap();
    let b = c.alloc("pf0", "sb-b", None, None).unwrap();
    assert_ne!(a.index % 2, b.index % 2, "served by different threads");
    let mut fa = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
    let mut fb = SimFrontend::connect(&b.socket, MIN_MEM).unwrap();
    let ab = frame(&b.mac, &a.mac, &[1; 60]);
    let ba = frame(&a.mac, &b.mac, &[2; 1000]);

    // One frame each way, byte-exact. A VF that just came up on one thread
    // is routable from the other only once that thread saw it live (the
    // next round after the bump): until then a frame to it has no route and
    // is dropped, so the first frame each way is repeated until one crosses.
    cross(&mut fa, &mut fb, &ab);
    cross(&mut fb, &mut fa, &ba);
    let base_a = c.get_by_sandbox("sb-a").unwrap().counters;
    let base_b = c.get_by_sandbox("sb-b").unwrap().counters;
    // Then many in poll mode: counted exactly from here on.
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

    let n = FRAMES;
    let va = nic.wait_vf("sb-a", "counted", |v| {
        v.counters.tx_drops == base_a.tx_drops + 1
    });
    let vb = c.get_by_sandbox("sb-b").unwrap();
    let (ca, cb) = (delta(&va.counters, &base_a), delta(&vb.counters, &base_b));
    assert_eq!((ca.tx_packets, ca.tx_bytes), (n, n * ab.len() as u64));
    assert_eq!((cb.rx_packets, cb.rx_bytes), (n, n * ab.len() as u64));
    assert_eq!((cb.tx_packets, cb.tx_bytes), (n, n * ba.len() as u64));
    assert_eq!((ca.rx_packets, ca.rx_bytes), (n, n * ba.len() as u64));
    assert_eq!(
        (ca.tx_drops, ca.rx_drops, cb.rx_drops, cb.tx_drops),
        (1, 0, 0, 0)
    );
    assert_eq!(ca.bad_descriptors + cb.bad_descriptors, 0);
    drop((fa, fb));
    nic.stop();
}

/// The scheduler state of thread `tid` of this process ('S': asleep, here in poll(2)).
fn thread_state(tid: i32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap_or_default();
    // "tid (comm) S ...": the state follows the last ')'.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next())
        .unwrap_or('?')
}

/// Waits (up to 5 s) until every dataplane thread sleeps in poll(2).
fn all_asleep(tids: &[i32]) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        if tids.iter().all(|&t| thread_state(t) == 'S') {
            return true;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    false
}

/// Two VFs served by two dataplane threads whose safety sleep is 30 s (a
/// missed wake-up then holds a frame for 30 s), their frontends, and a frame
/// each way, already routable both ways (a VF is routable from the other
/// thread once that thread saw it live).
struct TwoThreads {
    dir: std::path::PathBuf,
    b: bench::dataplane::BenchNic,
    fa: SimFrontend,
    fb: SimFrontend,
    ab: Vec<u8>,
    ba: Vec<u8>,
}

fn two_threads(name: &str) -> TwoThreads {
    let dir = testutil::fresh_dir("nic-threads", name);
    let b = bench::dataplane::BenchNic::start_capped(&dir, 2, 32, None, 2, Duration::from_secs(30))
        .unwrap();
    let ports = &b.nic.pfs[0].ports;
    let mut fa = SimFrontend::connect(&ports[0].socket, MIN_MEM).unwrap();
    let mut fb = SimFrontend::connect(&ports[1].socket, MIN_MEM).unwrap();
    let (ma, mb) = (ports[0].config().mac, ports[1].config().mac);
    let mac = |m: [u8; 6]| netutil::MacAddr::new(m).to_string();
    let ab = frame(&mac(mb), &mac(ma), &[1; 60]);
    let ba = frame(&mac(ma), &mac(mb), &[2; 200]);
    cross(&mut fa, &mut fb, &ab);
    cross(&mut fb, &mut fa, &ba);
    TwoThreads {
        dir,
        b,
        fa,
        fb,
        ab,
        ba,
    }
}

/// Every path that makes work for another dataplane thread wakes it: with
/// the safety sleep at 30 s, a missed wake-up stalls a frame for 30 s. Many
/// small rounds of frames, one way at a time, between VFs of two threads; before every
/// other round both threads are seen asleep in poll(2) (so the frame's first
/// thread is woken by the kick and must wake the second itself), the rounds
/// between start at once (the receiver may be on its way to sleep: the
/// sleeper's flag/re-check against the sender's publish/flag read). Every
/// frame must arrive within 3 s, far below the sleep.
#[test]
fn a_sleeping_dataplane_thread_is_woken_for_every_cross_thread_frame() {
    const ROUNDS: usize = 60;
    const SLOW: Duration = Duration::from_secs(3);
    let TwoThreads {
        dir,
        b,
        mut fa,
        mut fb,
        ab,
        ba,
    } = two_threads("wake");
    let ports = &b.nic.pfs[0].ports;
    let base = [0, 1].map(|i| ports[i].counters.snapshot());

    // Round r: one direction ((r / 2) % 2), so the receiving thread has no
    // kick of its own to wake it; every other round waits for both threads asleep.
    let (mut sent, mut asleep_rounds) = ([0u64; 2], 0);
    for round in 0..ROUNDS {
        if round % 2 == 0 {
            assert!(all_asleep(&b.dp_tids), "round {round}: threads never slept");
            asleep_rounds += 1;
        }
        let k = 1 + round % 3;
        let dir = (round / 2) % 2;
        let (from, to, f, name) = match dir {
            0 => (&mut fa, &mut fb, &ab, "A→B"),
            _ => (&mut fb, &mut fa, &ba, "B→A"),
        };
        for _ in 0..k {
            from.send(f);
        }
        sent[dir] += k as u64;
        for n in 0..k {
            let t0 = Instant::now();
            let got = to.recv(SLOW);
            assert_eq!(
                got.as_deref(),
                Some(&f[..]),
                "round {round}: {name} frame {n} of {k} not there after {:?} (a lost wake-up)",
                t0.elapsed()
            );
        }
    }
    assert_eq!(asleep_rounds, ROUNDS / 2);
    let [ca, cb] = [0, 1].map(|i| delta(&ports[i].counters.snapshot(), &base[i]));
    assert_eq!((ca.tx_packets, cb.rx_packets), (sent[0], sent[0]));
    assert_eq!((cb.tx_packets, ca.rx_packets), (sent[1], sent[1]));
    assert_eq!(
        (ca.tx_drops, ca.rx_drops, cb.tx_drops, cb.rx_drops),
        (0, 0, 0, 0)
    );
    drop((fa, fb, b));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Kick suppression (virtio 1.2 §2.7.10): while a dataplane thread polls a
/// transmit queue its used ring says VRING_USED_F_NO_NOTIFY, so a poll-mode
/// driver's bursts cost no kick; before the thread sleeps it clears the flag
/// again, so the next burst is kicked (`tx_burst` kicks as a driver does:
/// only while the flag is clear) and wakes it. With the safety sleep at 30 s,
/// a thread that slept with kicks suppressed would hold the frames 30 s; one
/// that never suppressed them fails `suppressed`.
#[test]
fn a_polled_queue_suppresses_kicks_and_a_sleeping_one_asks_for_them() {
    const NO_NOTIFY: u16 = virtio_bindings::virtio_ring::VRING_USED_F_NO_NOTIFY as u16;
    const PER_ROUND: u64 = 2000;
    let TwoThreads {
        dir,
        b,
        mut fa,
        mut fb,
        ab,
        ..
    } = two_threads("kick");
    let ports = &b.nic.pfs[0].ports;
    fa.no_interrupts();
    fb.no_interrupts();
    let base = [0, 1].map(|i| ports[i].counters.snapshot());
    fa.prepare_tx(&ab);
    // Rounds in which the polling thread was seen suppressing kicks: not
    // every round need show it (on a loaded 2-core host the thread may go
    // back to sleep between every two bursts of a descheduled frontend), so
    // after 8 rounds without one it gets up to 24 more.
    let (mut sent, mut got, mut suppressed_rounds) = (0u64, 0u64, 0);
    for round in 0..32 {
        if round >= 8 && suppressed_rounds > 0 {
            break;
        }
        assert!(all_asleep(&b.dp_tids), "round {round}: threads never slept");
        assert_eq!(
            fa.used_flags(1) & NO_NOTIFY,
            0,
            "round {round}: the thread sleeps with the transmit queue's kicks suppressed"
        );
        let (t0, mut suppressed) = (Instant::now(), false);
        let until = got + PER_ROUND;
        while got < until {
            let room = (QSIZE as u64 - (sent - got)).min(32);
            sent += fa.tx_burst(room as usize) as u64;
            got += fb.rx_burst().0 as u64;
            suppressed |= fa.used_flags(1) & NO_NOTIFY != 0;
            assert!(
                t0.elapsed() < Duration::from_secs(3),
                "round {round}: {got} of {until} frames after {:?} (a burst published \
                 while the thread slept was not kicked)",
                t0.elapsed()
            );
        }
        suppressed_rounds += suppressed as usize;
        while got < sent {
            got += fb.rx_burst().0 as u64;
            assert!(
                t0.elapsed() < Duration::from_secs(6),
                "round {round}: in flight"
            );
        }
    }
    assert!(
        suppressed_rounds > 0,
        "the polled queue never suppressed kicks"
    );
    let [ca, cb] = [0, 1].map(|i| delta(&ports[i].counters.snapshot(), &base[i]));
    assert_eq!((ca.tx_packets, cb.rx_packets), (sent, sent));
    assert_eq!((ca.tx_drops, cb.rx_drops), (0, 0));
    drop((fa, fb, b));
    let _ = std::fs::remove_dir_all(&dir);
}
