//! Tests of the scheduler: policies (rr, prio, drf), reconfiguration,
//! barriers and in-flight limits, removal.

use super::*;

fn job(class: Class, cost: u64, id: u32) -> Queued<u32> {
    Queued {
        class,
        cost,
        barrier: false,
        payload: id,
    }
}

fn cfg(policy: Policy) -> SchedConfig {
    SchedConfig {
        policy,
        nominal: [400e6, 160e6],
        max_inflight: 1,
    }
}

#[test]
fn reconfigure_lists_runnable_pipes_under_the_new_policy() {
    let mut s = Scheduler::new(cfg(Policy::Priority));
    for id in 0..4 {
        s.enqueue(1, 1, 7, job(Class::Copy, 10, id));
        s.enqueue(2, 2, 0, job(Class::Copy, 10, 100 + id));
    }
    let (p, j) = s.next(1).unwrap();
    assert_eq!(p, 2, "prio: level 0 first");
    s.complete(p, j.barrier);
    s.reconfigure(cfg(Policy::RoundRobin));
    assert_eq!(s.policy(), Policy::RoundRobin);
    assert_eq!(s.active(), 2, "both pipes listed again");
    let mut order = Vec::new();
    for _ in 0..4 {
        let (p, j) = s.next(1).unwrap();
        s.complete(p, j.barrier);
        order.push(p);
    }
    assert_eq!(order, vec![1, 2, 1, 2], "rr: turns, pipe 1 was ready first");
    s.reconfigure(cfg(Policy::Priority));
    assert_eq!(s.next(1).unwrap().0, 2);
}

const ALL: u32 = 0b11;

#[test]
fn policies_parse() {
    assert_eq!("rr".parse::<Policy>().unwrap(), Policy::RoundRobin);
    assert_eq!("priority".parse::<Policy>().unwrap(), Policy::Priority);
    assert_eq!("drf".parse::<Policy>().unwrap(), Policy::Drf);
    assert!("fifo".parse::<Policy>().is_err());
    assert_eq!(Policy::Drf.to_string(), "drf");
}

#[test]
fn round_robin_alternates_pipes() {
    let mut s = Scheduler::new(cfg(Policy::RoundRobin));
    for i in 0..3 {
        s.enqueue(1, 1, 0, job(Class::Copy, 10, 100 + i));
        s.enqueue(2, 2, 0, job(Class::Copy, 10, 200 + i));
    }
    let mut order = Vec::new();
    while let Some((pipe, j)) = s.next(ALL) {
        order.push(j.payload);
        s.complete(pipe, false);
    }
    assert_eq!(order, vec![100, 200, 101, 201, 102, 202]);
    assert_eq!(s.active(), 0);
}

#[test]
fn priority_is_strict_and_work_conserving() {
    let mut s = Scheduler::new(cfg(Policy::Priority));
    for i in 0..3 {
        s.enqueue(1, 1, 5, job(Class::Copy, 10, 100 + i));
        s.enqueue(2, 2, 0, job(Class::Copy, 10, 200 + i));
    }
    s.enqueue(3, 3, 7, job(Class::Crypto, 10, 300));
    // Only crypto allowed: the low-priority crypto job runs (work-conserving).
    let (p, j) = s.next(0b10).unwrap();
    assert_eq!(j.payload, 300);
    s.complete(p, false);
    let mut order = Vec::new();
    while let Some((pipe, j)) = s.next(ALL) {
        order.push(j.payload);
        s.complete(pipe, false);
    }
    assert_eq!(order, vec![200, 201, 202, 100, 101, 102]);
}

#[test]
fn barrier_and_inflight_limits() {
    let mut s = Scheduler::new(SchedConfig {
        max_inflight: 4,
        ..cfg(Policy::RoundRobin)
    });
    s.enqueue(1, 1, 0, job(Class::Copy, 1, 1));
    s.enqueue(
        1,
        1,
        0,
        Queued {
            barrier: true,
            ..job(Class::Crypto, 1, 2)
        },
    );
    s.enqueue(1, 1, 0, job(Class::Copy, 1, 3));
    let (_, a) = s.next(ALL).unwrap();
    assert_eq!(a.payload, 1);
    assert!(s.next(ALL).is_none(), "the barrier waits for job 1");
    s.complete(1, false);
    let (_, b) = s.next(ALL).unwrap();
    assert_eq!(b.payload, 2);
    assert!(s.next(ALL).is_none(), "job 3 waits for the barrier");
    s.complete(1, true);
    assert_eq!(s.next(ALL).unwrap().1.payload, 3);
}

#[test]
fn removal_cancels_queued_jobs_and_frees_the_queue() {
    let mut s = Scheduler::new(cfg(Policy::Drf));
    for i in 0..5 {
        s.enqueue(7, 1, 0, job(Class::Copy, 1, i));
    }
    let (p, _) = s.next(ALL).unwrap();
    assert_eq!(s.remove_pipe(7), vec![1, 2, 3, 4]);
    assert!(s.next(ALL).is_none());
    assert_eq!(s.stats().queues, 1, "running job keeps the queue");
    s.complete(p, false);
    assert_eq!(s.stats().queues, 0);
    assert_eq!(s.stats().cancelled, 4);
}

#[test]
fn drf_equalizes_dominant_shares() {
    // One resource, 4 KiB jobs against 64 KiB jobs: DRF gives equal bytes.
    let mut s = Scheduler::new(cfg(Policy::Drf));
    let mut bytes = [0u64; 3];
    for _ in 0..2000 {
        for (pipe, cost) in [(1u32, 4096u64), (2, 65536)] {
            if s.queued(pipe) < 2 {
                s.enqueue(pipe, pipe, 0, job(Class::Copy, cost, pipe));
            }
        }
        let (p, j) = s.next(ALL).unwrap();
        bytes[p as usize] += j.cost;
        s.complete(p, false);
    }
    let r = bytes[1] as f64 / bytes[2] as f64;
    assert!((r - 1.0).abs() < 0.05, "ratio {r}");
}

#[test]
fn drf_newly_active_tenant_gets_bounded_idle_credit() {
    let mut s = Scheduler::new(cfg(Policy::Drf));
    // Tenant 1 alone uses 100 MB (0.25 s of a 400 MB/s class).
    s.enqueue(1, 1, 0, job(Class::Copy, 1_000_000, 1));
    for _ in 0..100 {
        let (p, _) = s.next(ALL).unwrap();
        s.enqueue(1, 1, 0, job(Class::Copy, 1_000_000, 1));
        s.complete(p, false);
    }
    // Tenant 2 arrives: it may catch up DRF_CREDIT (4 MB here), not
    // 100 MB, then they alternate.
    let mut runs = Vec::new();
    for _ in 0..20 {
        for p in [1, 2] {
            if s.queued(p) == 0 {
                s.enqueue(p, p, 0, job(Class::Copy, 1_000_000, p));
            }
        }
        let (p, _) = s.next(ALL).unwrap();
        runs.push(p);
        s.complete(p, false);
    }
    let ones = runs.iter().filter(|&&p| p == 1).count();
    assert!((6..=10).contains(&ones), "{runs:?}");
}
