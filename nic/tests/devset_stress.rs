//! Devset stress under both lock policies: threads open, close, reset, assign,
//! release and fail VFs in random order; the invariants are checked after
//! every step, and the device itself checks that no VF is reset while it is
//! open (a close resets its own VF; a devset reset needs all closed).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use nic::devset::{Devset, DevsetError, LockPolicy, VfDevice};
use nic_api::VfState;
use rand::{Rng, SeedableRng};

struct Probe {
    /// VFs open right now, counted by the devices themselves.
    open_now: Arc<AtomicI64>,
    violations: Arc<AtomicU64>,
    resets: Arc<AtomicU64>,
    open: bool,
}

impl VfDevice for Probe {
    fn on_open(&mut self) {
        assert!(!self.open, "opened twice");
        self.open = true;
        self.open_now.fetch_add(1, Ordering::SeqCst);
    }
    fn on_close(&mut self) {
        assert!(self.open, "closed while not open");
        self.open = false;
        self.open_now.fetch_sub(1, Ordering::SeqCst);
    }
    fn reset(&mut self) {
        if self.open {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
        self.resets.fetch_add(1, Ordering::SeqCst);
    }
}

fn stress(policy: LockPolicy) {
    const VFS: usize = 6;
    const THREADS: usize = 8;
    const STEPS: usize = 3000;
    let open_now = Arc::new(AtomicI64::new(0));
    let violations = Arc::new(AtomicU64::new(0));
    let resets = Arc::new(AtomicU64::new(0));
    let d = Arc::new(Devset::new("pf-stress", VFS, policy, |_| Probe {
        open_now: open_now.clone(),
        violations: violations.clone(),
        resets: resets.clone(),
        open: false,
    }));
    let stats = Arc::new([(); 6].map(|_| AtomicU64::new(0)));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (d, stats) = (d.clone(), stats.clone());
            std::thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed + t as u64);
                for step in 0..STEPS {
                    let i = rng.gen_range(0..VFS);
                    let op = rng.gen_range(0..6);
                    let ok = match op {
                        0 => d.assign(i, &format!("sb-{t}-{step}")).is_ok(),
                        1 => {
                            // VF-local work long enough to overlap with others.
                            let spin = rng.gen_range(0..2000);
                            matches!(
                                d.open(i, |vf| {
                                    assert_eq!(vf.state, VfState::Open);
                                    assert_eq!(vf.open_count, 1);
                                    std::hint::black_box((0..spin).sum::<u64>());
                                    if spin % 17 == 0 {
                                        Err(())
                                    } else {
                                        Ok(())
                                    }
                                }),
                                Ok(Ok(()))
                            )
                        }
                        2 => d.close(i).is_ok(),
                        3 => match d.try_reset() {
                            Ok(_) => true,
                            Err(DevsetError::Busy { open, .. }) => {
                                assert!(open > 0, "busy with zero open");
                                false
                            }
                            Err(e) => panic!("{e}"),
                        },
                        4 => d.release(i).is_ok(),
                        _ => d.mark_error(i).is_ok(),
                    };
                    if ok {
                        stats[op].fetch_add(1, Ordering::Relaxed);
                    }
                    if let Err(e) = d.check_invariants() {
                        panic!("{policy:?} thread {t} step {step} op {op}: {e}");
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("stress thread");
    }
    assert_eq!(
        violations.load(Ordering::SeqCst),
        0,
        "{policy:?}: a VF was reset while open"
    );
    // Every kind of operation really happened, resets included.
    for (op, s) in stats.iter().enumerate() {
        assert!(
            s.load(Ordering::Relaxed) > 0,
            "{policy:?}: operation {op} never succeeded"
        );
    }
    assert!(resets.load(Ordering::SeqCst) > 0);
    // Quiesce: close everything, reset, release: all VFs free again.
    for i in 0..VFS {
        let _ = d.close(i);
    }
    assert_eq!(d.open_count(), 0);
    assert_eq!(open_now.load(Ordering::SeqCst), 0);
    d.try_reset().unwrap();
    for i in 0..VFS {
        d.release(i).unwrap();
    }
    d.check_invariants().unwrap();
    assert!(
        d.snapshot()
            .iter()
            .all(|(s, sb)| *s == VfState::Free && sb.is_none()),
        "{:?}",
        d.snapshot()
    );
}

#[test]
fn devset_stress_global() {
    stress(LockPolicy::Global);
}

#[test]
fn devset_stress_hierarchical() {
    stress(LockPolicy::Hierarchical);
}

/// The hierarchical policy lets VF-local work of different VFs overlap; the
/// global one never does.
#[test]
fn only_hierarchical_overlaps_vf_local_work() {
    for (policy, expect_overlap) in [
        (LockPolicy::Global, false),
        (LockPolicy::Hierarchical, true),
    ] {
        let inside = Arc::new(AtomicI64::new(0));
        let max_inside = Arc::new(AtomicI64::new(0));
        let d = Arc::new(Devset::new("pf-overlap", 4, policy, |_| Probe {
            open_now: Arc::new(AtomicI64::new(0)),
            violations: Arc::new(AtomicU64::new(0)),
            resets: Arc::new(AtomicU64::new(0)),
            open: false,
        }));
        for i in 0..4 {
            d.assign(i, &format!("s{i}")).unwrap();
        }
        let barrier = Arc::new(std::sync::Barrier::new(4));
        let ts: Vec<_> = (0..4)
            .map(|i| {
                let (d, inside, max_inside, b) = (
                    d.clone(),
                    inside.clone(),
                    max_inside.clone(),
                    barrier.clone(),
                );
                std::thread::spawn(move || {
                    b.wait();
                    d.open(i, |_| {
                        let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        max_inside.fetch_max(n, Ordering::SeqCst);
                        std::thread::sleep(std::time::Duration::from_millis(50));
                        inside.fetch_sub(1, Ordering::SeqCst);
                        Ok::<(), ()>(())
                    })
                    .unwrap()
                    .unwrap();
                })
            })
            .collect();
        for t in ts {
            t.join().unwrap();
        }
        let m = max_inside.load(Ordering::SeqCst);
        assert_eq!(
            m > 1,
            expect_overlap,
            "{policy:?}: max concurrent VF-local work {m}"
        );
    }
}
