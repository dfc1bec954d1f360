//! `bench startup` keeps its NIC daemon up the way `bench chaos` does
//! (`Runtime::keep_nic_up_while`): a daemon that died between rounds is
//! started again before the next one, and one SIGKILLed while a round's
//! guests use their VFs is restarted on its state directory, so the VMMs
//! reconnect instead of every sandbox in flight failing. Through the
//! runtime's own round (`bench::run_round`), with built-in-agent guests.
//! Needs root, /dev/kvm and the CNI plugins (as runtime_startup.rs).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bench::startup::{run_round, RoundSpec};
use nic_api::VfState;
use runtime::{Runtime, Variant};

mod cli_common;
use cli_common::networked_runtime_vfs;

const N: usize = 4;

fn spec() -> RoundSpec {
    RoundSpec {
        memory_bytes: 64 << 20,
        cpus: 1.0,
        app_size: 0,
        timeout_secs: 60,
        rootfs: None,
        template: None,
        net_pool: false,
        hugepages: false,
        agent_cpl0: false,
    }
}

fn kill_nic(rt: &Runtime) -> u32 {
    let pid = rt.nic_pid().expect("a NIC daemon");
    // SAFETY: kill(2) on the NIC daemon this test's runtime spawned.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    pid
}

#[test]
fn bench_rounds_restart_a_nic_daemon_that_died() {
    let rt = networked_runtime_vfs(N, 0);
    rt.prepare_variant(Variant::Fastiov).unwrap();

    // Died between rounds: started again before the next round's sandboxes.
    let dead = kill_nic(&rt);
    testutil::poll_until("the NIC daemon's death", Duration::from_secs(10), || {
        match nic_api::Client::connect(&rt.nic_socket()) {
            Err(_) => Ok(()),
            Ok(_) => Err(format!("pid {dead} still answers")),
        }
    });
    let r = run_round(&rt, Variant::Fastiov, N, "before", &spec());
    assert!(r.failures.is_empty(), "{:?}", r.failures);
    assert_eq!((r.nic.restarts, r.nic.errors.len()), (1, 0), "{:?}", r.nic);
    assert_ne!(rt.nic_pid(), Some(dead));

    // Killed while a sandbox's guest uses its VF: the round goes on, that
    // sandbox's VMM reconnects to the restarted daemon and it succeeds
    // (sandboxes in CNI ADD or in the middle of their VF's set-up at that
    // instant may fail: neither is repeated).
    let stop = AtomicBool::new(false);
    let (r, open) = std::thread::scope(|s| {
        let killer = s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let open = nic_api::Client::connect(&rt.nic_socket())
                    .and_then(|mut c| c.list())
                    .ok()
                    // Its session set up and used: the guest sent a frame.
                    .and_then(|l| {
                        l.into_iter()
                            .find(|v| v.state == VfState::Open && v.counters.tx_packets > 0)
                    })
                    .and_then(|v| v.sandbox);
                if let Some(sb) = open {
                    kill_nic(&rt);
                    return Some(sb);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            None
        });
        let r = run_round(&rt, Variant::Fastiov, N, "during", &spec());
        stop.store(true, Ordering::Relaxed);
        (r, killer.join().unwrap())
    });
    let open = open.expect("no guest ever used its VF during the round");
    assert!(r.nic.restarts >= 1, "{:?}", r.nic);
    assert!(r.nic.errors.is_empty(), "{:?}", r.nic);
    assert!(
        r.failures.iter().all(|f| f.sandbox != open),
        "{open}, running on its VF when the daemon died, failed: {:?}",
        r.failures
    );
    assert!(
        r.failures.len() < N,
        "every sandbox failed: {:?}",
        r.failures
    );
    assert!(rt.assigned_vfs().unwrap().is_empty());
}
