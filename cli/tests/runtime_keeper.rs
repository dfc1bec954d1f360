//! A runtime's children outlive the thread that started them (runtime/src/child.rs):
//! PR_SET_PDEATHSIG fires when the *thread* that forked a child exits, so the VMM and
//! the NIC daemon are forked on keeper threads their handles own. Here the NIC daemon
//! and a sandbox are started on threads that end at once; the daemon still answers, the
//! VMM still runs while its `Sandbox` lives, and teardown leaves nothing. (That both
//! die with a SIGKILLed runtime is runtime_startup.rs's
//! `a_killed_runtime_with_a_full_net_pool_leaves_nothing` and rootfs.rs's
//! `runtime_layers_leave_nothing_even_after_sigkill`.) Needs root, /dev/kvm and the
//! CNI plugins (as runtime_startup.rs).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::time::{Duration, Instant};

use runtime::{Sandbox, SandboxSpec, Variant};

mod cli_common;
use cli_common::networked_runtime;

/// Runs `f` on a thread, returns its result once the thread is gone entirely
/// (not only joined: out of /proc/self/task, so a PDEATHSIG it caused was sent).
fn on_a_thread_that_ends<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    let (r, tid) = std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() };
            (f(), tid)
        })
        .join()
        .unwrap()
    });
    let task = format!("/proc/self/task/{tid}");
    let end = Instant::now() + Duration::from_secs(5);
    while std::path::Path::new(&task).exists() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        !std::path::Path::new(&task).exists(),
        "{task} is still there"
    );
    r
}

fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').map(|i| s[i + 2..].starts_with(|c| c != 'Z')))
        .unwrap_or(false)
}

#[test]
fn a_sandbox_and_the_nic_daemon_outlive_the_threads_that_started_them() {
    let rt = networked_runtime(0);
    on_a_thread_that_ends(|| rt.prepare_variant(Variant::Fastiov)).unwrap();
    let nic = rt.nic_pid().expect("NIC daemon started");
    let spec = SandboxSpec {
        keep_running: true,
        ..SandboxSpec::new(
            format!("{}keeper", rt.sandbox_prefix()),
            Variant::Fastiov,
            64 << 20,
            60,
        )
    };
    let mut sb = on_a_thread_that_ends(|| Sandbox::start(&rt, spec)).unwrap();
    let vmm = sb.vmm_pid().expect("VMM running");
    // A SIGKILL from the ended threads would have ended both well within this window.
    let end = Instant::now() + Duration::from_millis(500);
    while Instant::now() < end {
        assert!(
            running(nic),
            "the NIC daemon died with the thread that started it"
        );
        assert!(running(vmm), "the VMM died with the thread that started it");
        std::thread::sleep(Duration::from_millis(20));
    }
    sb.check_alive().unwrap();
    nic_api::Client::connect(&rt.nic_socket()).expect("NIC daemon answers");
    sb.teardown().unwrap();
    drop(sb);
    assert!(!running(vmm), "teardown reaped the VMM");
    let leaks = runtime::leaks::check(&rt, Duration::from_secs(10));
    assert!(leaks.is_clean(), "{}", leaks.describe());
}
