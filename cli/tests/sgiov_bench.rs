//! `burstvm bench sgiov latency|throughput|open`, tiny: each runs against a
//! spawned `burstvm nic` and moves checked bytes through real vhost-user
//! sessions. Asserts what moved, the daemon's fd counts and that nothing
//! leaked (the bench itself fails on a leak or a wrong byte); no timing.

use std::path::PathBuf;
use std::time::Duration;

use sgiov::sched::Policy;

use bench::sg::latency::{self, LatencyConfig, Mode};
use bench::sg::open::{self, OpenConfig};
use bench::sg::throughput::{self, ThroughputConfig};
use bench::sg::CommonConfig;

fn common(name: &str) -> CommonConfig {
    CommonConfig {
        threads: 2,
        ring: 4096,
        workers: 1,
        nic_bin: Some(PathBuf::from(env!("CARGO_BIN_EXE_burstvm"))),
        dir: Some(std::env::temp_dir().join(format!("sgb-{name}-{}", std::process::id()))),
    }
}

/// A latency run small enough for the suite: 10 pings x 2 reps of 4 KiB,
/// priority policy, budget 32.
fn small_latency(name: &str, mode: Mode, pipes: Vec<usize>, vfs: Vec<usize>) -> LatencyConfig {
    LatencyConfig {
        pipes,
        samples: 10,
        reps: 2,
        size: 4096,
        policy: Policy::Priority,
        gen_budget: vec![32],
        modes: vec![mode],
        vfs,
        common: common(name),
    }
}

#[test]
fn latency_pings_through_backlogged_pipes_with_a_constant_fd_count() {
    // Both counts leave >= 2 backlogged pipes: two load SGFs each time
    // (fds are per SGF session, not per pipe).
    let rows = latency::run(&small_latency("lat", Mode::Xfifo, vec![4, 32], vec![])).unwrap();
    assert_eq!(rows.len(), 2);
    for r in &rows {
        assert_eq!(r.mode, "xfifo");
        assert_eq!(r.pings, 20, "{r:?}");
        assert!(r.p50_us > 0.0 && r.p99_us >= r.p50_us, "{r:?}");
        assert!(r.backlog_bytes > 0, "backlogged pipes moved nothing: {r:?}");
        assert!(r.signals_per_kick > 0.0, "{r:?}");
    }
    // Daemon fds do not grow with pipes (4 vs 32 open); sessions hold some.
    assert_eq!(rows[0].daemon_fds, rows[1].daemon_fds, "{rows:?}");
    assert!(rows[0].daemon_fds > rows[0].idle_fds, "sessions hold fds");
    assert_eq!(rows[0].growth_p50, 1.0);
}

#[test]
fn vf_row_pings_through_the_switch_with_fds_per_vf() {
    // 4: one backlogged VF pair; 6: two more VF sessions.
    let rows = latency::run(&small_latency("latvf", Mode::Vf, vec![4], vec![4, 6])).unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for r in &rows {
        assert_eq!(r.mode, "vf");
        assert_eq!(r.pings, 20, "{r:?}");
        assert!(r.p50_us > 0.0 && r.p99_us >= r.p50_us, "{r:?}");
        assert!(r.backlog_bytes > 0, "backlogged VFs moved nothing: {r:?}");
        assert!(r.daemon_fds > r.idle_fds, "VF sessions hold fds: {r:?}");
    }
    assert_eq!((rows[0].pipes, rows[1].pipes), (4, 6));
    assert_eq!(rows[0].growth_p50, 1.0);
    // Unlike pipes, every VF session costs the daemon fds.
    assert!(
        rows[1].daemon_fds - rows[1].idle_fds > rows[0].daemon_fds - rows[0].idle_fds,
        "{rows:?}"
    );
}

#[test]
fn dedicated_row_holds_an_eventfd_pair_per_pipe() {
    let rows = latency::run(&small_latency(
        "latded",
        Mode::Dedicated,
        vec![4, 32],
        vec![],
    ))
    .unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for r in &rows {
        assert_eq!(r.mode, "dedicated");
        assert_eq!(r.pings, 20, "{r:?}");
        assert!(r.p50_us > 0.0 && r.p99_us >= r.p50_us, "{r:?}");
        assert!(r.backlog_bytes > 0, "backlogged pipes moved nothing: {r:?}");
        assert!(r.scanned_per_kick > 0.0, "the daemon polls channels: {r:?}");
    }
    assert_eq!(rows[0].growth_p50, 1.0);
    // Unlike the Cross-FIFO, every pipe costs the daemon a kick and a call
    // eventfd (the run itself fails unless the fds are back to idle after).
    assert!(
        rows[1].daemon_fds - rows[0].daemon_fds >= 2 * 28,
        "{rows:?}"
    );
    assert_eq!(rows[0].idle_fds, rows[1].idle_fds);
}

#[test]
fn throughput_moves_bytes_on_every_pipe() {
    let rows = throughput::run(&ThroughputConfig {
        pipes: vec![4, 32],
        duration: Duration::from_millis(300),
        reps: 1,
        policy: Policy::RoundRobin,
        common: common("tp"),
    })
    .unwrap();
    assert_eq!(rows.len(), 2);
    for r in &rows {
        assert_eq!(r.zero_pipes, 0, "a pipe moved nothing: {r:?}");
        assert!(
            r.bytes > 0 && r.min_kb_s > 0.0 && r.max_kb_s >= r.min_kb_s,
            "{r:?}"
        );
        assert!(r.jain > 0.0 && r.jain <= 1.0 + 1e-9, "{r:?}");
    }
    assert_eq!(rows[0].daemon_fds, rows[1].daemon_fds, "{rows:?}");
}

#[test]
fn open_counts_pipes_and_vfs() {
    let rows = open::run(&OpenConfig {
        pipes: 300,
        vfs: 2,
        vf_mem: 2 << 20,
        reps: 1,
        common: common("open"),
    })
    .unwrap();
    assert_eq!(rows[0].count, 300);
    assert_eq!(rows[1].count, 2);
    assert!(rows.iter().all(|r| r.total_ms > 0.0), "{rows:?}");
    assert!(rows[0].daemon_fds.unwrap() > rows[0].idle_fds.unwrap());
}
