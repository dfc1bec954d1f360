//! The `window` variant through the runtime (issue 27 §2, docs/design.md
//! "Variants"): the NIC maps only the sandbox's DMA window, never its RAM.
//! Needs root, /dev/kvm and the CNI plugins (as runtime_startup.rs).
//!
//! A `window` sandbox and a `fastiov` one side by side on one NIC: both reach
//! READY and the echo server answers both (the window's rings and packet
//! buffers work); the NIC's memory table of the window sandbox's VF is the
//! 2 MiB window, the fastiov one's all of its 64 MiB of RAM; after teardown
//! both VFs map nothing and the runtime's leak check is clean.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::time::Duration;

use nic_api::{DevKind, VfInfo};
use runtime::{Sandbox, SandboxSpec, Variant};

mod cli_common;
use cli_common::networked_runtime_vfs;

fn vfs(rt: &runtime::Runtime) -> Vec<VfInfo> {
    let mut c = nic_api::Client::connect(&rt.nic_socket()).unwrap();
    c.list()
        .unwrap()
        .into_iter()
        .filter(|v| v.kind == DevKind::Vf)
        .collect()
}

#[test]
fn a_window_sandbox_answers_over_its_vf_and_the_nic_maps_only_its_window() {
    const RAM: u64 = 64 << 20;
    let rt = networked_runtime_vfs(2, 0);
    let pfx = rt.sandbox_prefix();
    // Both variants take the hierarchical devset lock: one NIC daemon serves both.
    rt.prepare_variant(Variant::Window).unwrap();
    let mut sbs = Vec::new();
    for v in [Variant::Window, Variant::Fastiov] {
        let spec = SandboxSpec {
            keep_running: true,
            ..SandboxSpec::new(format!("{pfx}{}", v.name()), v, RAM, 60)
        };
        let sb = Sandbox::start(&rt, spec).unwrap_or_else(|e| panic!("{v}: {e}"));
        let ip = sb.guest_ip.unwrap();
        let answered = rt.server().replies().get(&ip).copied().unwrap_or(0);
        assert!(answered > 0, "{v}: the echo server answered its guest");
        sbs.push((v, sb));
    }
    let mapped = |v: Variant| {
        let sb = format!("{pfx}{}", v.name());
        vfs(&rt)
            .into_iter()
            .find(|f| f.sandbox.as_deref() == Some(&sb))
            .unwrap_or_else(|| panic!("{v}: no VF of {sb}"))
            .counters
            .mapped_bytes
    };
    assert_eq!(
        mapped(Variant::Window),
        runtime::variant::DMA_WINDOW_BYTES,
        "the device reaches the window only"
    );
    assert!(
        mapped(Variant::Fastiov) >= RAM,
        "fastiov maps all of guest RAM"
    );
    for (v, mut sb) in sbs {
        sb.check_alive().unwrap_or_else(|e| panic!("{v}: {e}"));
        sb.teardown().unwrap_or_else(|e| panic!("{v}: {e}"));
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while vfs(&rt).iter().any(|f| f.counters.mapped_bytes > 0) {
        assert!(std::time::Instant::now() < deadline, "{:#?}", vfs(&rt));
        std::thread::sleep(Duration::from_millis(50));
    }
    let lc = runtime::leaks::check(&rt, Duration::from_secs(5));
    assert!(lc.is_clean(), "{}", lc.describe());
}
