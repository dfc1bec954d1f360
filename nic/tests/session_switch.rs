//! Session changes while the dataplane forwards at full speed: the dataplane
//! owns each live VF's rings and hands them back for every session message.
//! Memory a frontend gave up (a new memory table, or a disconnect) must never
//! see another byte: canary bytes in it stay as they were.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use testutil::nic as common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{frame, TestNic};
use nic::frontend::{FrontendMemory, SimFrontend, MIN_MEM};
use nic::LockPolicy;
use nic_api::VfState;

const T: Duration = Duration::from_secs(5);
const CANARY: u8 = 0xa5;

/// Fills memory the frontend gave up with canary bytes; returns the view.
fn poison(old: &FrontendMemory) -> FrontendMemory {
    let view = old.second_view().unwrap();
    let (p, n) = view.host();
    // SAFETY: our own mapping of `n` bytes.
    unsafe { std::ptr::write_bytes(p, CANARY, n) };
    view
}

fn untouched(view: &FrontendMemory) -> bool {
    let (p, n) = view.host();
    // SAFETY: our own mapping of `n` bytes, read only here.
    let bytes = unsafe { std::slice::from_raw_parts(p, n) };
    bytes.iter().all(|&b| b == CANARY)
}

#[test]
fn memory_switches_and_reconnects_while_forwarding_leave_old_memory_untouched() {
    let name = format!("switch-{}", std::process::id());
    // A released VF whose devset stays open (A) is not free again at once:
    // one VF per reconnect.
    let nic = TestNic::start(&name, 5, None, LockPolicy::Hierarchical);
    let mut c = nic.client();
    let a = c.alloc("pf0", "sb-a", None, None).unwrap();
    const B_MAC: &str = "02:00:00:00:0b:0b";
    let b = c.alloc("pf0", "sb-b", Some(B_MAC), None).unwrap();
    let f = frame(&b.mac, &a.mac, &[0x42; 200]);

    // A sends to B in poll mode as fast as the dataplane takes frames.
    let stop = Arc::new(AtomicBool::new(false));
    let mut fa = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
    fa.prepare_tx(&f);
    let sender = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut sent = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let n = fa.tx_burst(32);
                sent += n as u64;
                if n == 0 {
                    std::thread::yield_now();
                }
            }
            (fa, sent)
        })
    };

    let mut fb = SimFrontend::connect(&b.socket, MIN_MEM).unwrap();
    let mut views = Vec::new();
    for round in 0..6 {
        // Forwarding reaches B's current memory, byte-exact.
        assert_eq!(fb.recv(T).as_deref(), Some(&f[..]), "round {round}");
        if round % 2 == 0 {
            // New memory table in the same session: once GET_VRING_BASE is
            // answered, the old memory is the frontend's alone.
            let old = fb
                .switch_memory(FrontendMemory::new(MIN_MEM, false).unwrap())
                .unwrap();
            views.push(poison(&old));
        } else {
            // Disconnect: once the VF is closed (and reset), its memory is
            // gone. Then the sandbox's VF is released and allocated again.
            let old = fb.into_memory();
            nic.wait_vf("sb-b", "closed", |v| {
                matches!(v.state, VfState::Closed | VfState::Reset)
            });
            views.push(poison(&old));
            drop(old);
            c.release("sb-b").unwrap();
            let b = c.alloc("pf0", "sb-b", Some(B_MAC), None).unwrap();
            fb = SimFrontend::connect(&b.socket, MIN_MEM).unwrap();
        }
    }
    assert_eq!(fb.recv(T).as_deref(), Some(&f[..]), "after the last switch");
    stop.store(true, Ordering::Relaxed);
    let (fa, sent) = sender.join().unwrap();

    // Every frame A published was taken, and counted once: forwarded or dropped
    // (B closed for a moment).
    let va = nic.wait_vf("sb-a", "done", |v| {
        v.counters.tx_packets + v.counters.tx_drops == sent
    });
    assert!(va.counters.tx_packets > 0);
    let vb = c.get_by_sandbox("sb-b").unwrap();
    assert_eq!(va.counters.bad_descriptors + vb.counters.bad_descriptors, 0);
    assert_eq!(vb.state, VfState::Open);
    for (k, v) in views.iter().enumerate() {
        assert!(untouched(v), "memory {k} written after it was given up");
    }
    drop((fa, fb));
    nic.stop();
}

/// The dataplane's translation cache (`virtq::Xlat`) never outlives the
/// memory table it was made for: after a SET_MEM_TABLE to new memory at the
/// *same* guest addresses (the case a stale cache keyed by guest address
/// would get wrong), every later frame, received and transmitted, uses the
/// new memory, and the old memory's canary bytes stay as they were.
#[test]
fn a_memory_table_change_moves_every_later_access_to_the_new_memory() {
    let name = format!("xlat-{}", std::process::id());
    let nic = TestNic::start(&name, 2, None, LockPolicy::Hierarchical);
    let mut c = nic.client();
    let a = c.alloc("pf0", "sb-a", None, None).unwrap();
    let b = c.alloc("pf0", "sb-b", None, None).unwrap();
    let mut fa = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
    let mut fb = SimFrontend::connect(&b.socket, MIN_MEM).unwrap();
    let to_b = |k: u8| frame(&b.mac, &a.mac, &[k; 100]);
    let to_a = |k: u8| frame(&a.mac, &b.mac, &[k; 60]);

    // Both directions through the first memory tables: the cache is warm.
    fa.send(&to_b(1));
    assert_eq!(fb.recv(T).as_deref(), Some(&to_b(1)[..]));
    fb.send(&to_a(2));
    assert_eq!(fa.recv(T).as_deref(), Some(&to_a(2)[..]));

    // B and then A move to new memory; the old memory gets canaries.
    let mut views = Vec::new();
    for fe in [&mut fb, &mut fa] {
        let old = fe
            .switch_memory(FrontendMemory::new(MIN_MEM, false).unwrap())
            .unwrap();
        views.push(poison(&old));
    }
    // More frames than one burst each way, all through the new tables.
    const N: u8 = 40;
    for k in 0..N {
        fa.send(&to_b(10 + k));
        assert_eq!(fb.recv(T).as_deref(), Some(&to_b(10 + k)[..]), "frame {k}");
        fb.send(&to_a(100 + k));
        assert_eq!(fa.recv(T).as_deref(), Some(&to_a(100 + k)[..]), "frame {k}");
    }
    for (k, v) in views.iter().enumerate() {
        assert!(
            untouched(v),
            "memory {k} touched after its table was replaced"
        );
    }
    let n = u64::from(N) + 1;
    let va = nic.wait_vf("sb-a", "counted", |v| v.counters.rx_packets == n);
    let vb = nic.wait_vf("sb-b", "counted", |v| v.counters.rx_packets == n);
    for v in [&va, &vb] {
        let k = &v.counters;
        assert_eq!((k.tx_packets, k.tx_drops, k.rx_drops), (n, 0, 0));
        assert_eq!(k.bad_descriptors, 0);
    }
    drop((fa, fb));
    nic.stop();
}
