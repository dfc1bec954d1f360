//! virtio-net over tap, end to end: the built-in agent's UDP request leaves
//! through a tap the test created, the test answers the agent's ARP and UDP
//! on the tap, and the guest reaches READY. Also: the tap errors.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::path::Path;
use std::process::Command;

use testutil::tap::{open_tap, serve_agent, vmm_command, TestTap, Wire};

const BURSTVM: &str = env!("CARGO_BIN_EXE_burstvm");

fn request_reply_round_trip(tag: &str, vf_init: &str) {
    let tap = TestTap::new(tag);
    let wire = Wire::open(&tap.0);
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.jsonl");
    let sandbox = format!("sbx-{tag}-{}", std::process::id());
    let child = vmm_command(
        BURSTVM,
        &sandbox,
        &format!("tap:{}", tap.0),
        vf_init,
        &trace,
    )
    .spawn()
    .expect("spawn burstvm vmm");
    serve_agent(&wire, child, &sandbox, &trace, vf_init);

    // The VMM detached from the tap, which the test still owns.
    assert!(Path::new("/sys/class/net").join(&tap.0).exists());
    let reattach = open_tap(&tap.0);
    assert!(
        reattach.is_ok(),
        "tap {} still busy after the VMM exited",
        tap.0
    );
}

#[test]
fn tap_request_reply_sync() {
    request_reply_round_trip("s", "sync");
}

#[test]
fn tap_request_reply_async() {
    request_reply_round_trip("a", "async");
}

fn run_vmm_expecting_error(tap: &str) -> String {
    let out = Command::new(BURSTVM)
        .args([
            "vmm",
            "--sandbox",
            "sbx-taperr",
            "--net",
            &format!("tap:{tap}"),
            "--timeout",
            "30",
        ])
        .output()
        .expect("run burstvm vmm");
    assert!(!out.status.success(), "burstvm vmm must fail for tap {tap}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn missing_tap_is_a_clear_error_and_is_not_created() {
    let name = format!("bvnone{}", std::process::id() % 100_000);
    let err = run_vmm_expecting_error(&name);
    assert!(
        err.contains(&name) && err.contains("no such interface"),
        "{err}"
    );
    assert!(
        !Path::new("/sys/class/net").join(&name).exists(),
        "the VMM created {name}"
    );
}

#[test]
fn busy_tap_is_a_clear_error() {
    let tap = TestTap::new("b");
    let _holder = open_tap(&tap.0).expect("test attaches to its tap");
    let err = run_vmm_expecting_error(&tap.0);
    assert!(err.contains(&tap.0) && err.contains("busy"), "{err}");
}

#[test]
fn non_tap_interface_is_a_clear_error() {
    let err = run_vmm_expecting_error("lo");
    assert!(err.contains("lo") && err.contains("not a tun/tap"), "{err}");
}
