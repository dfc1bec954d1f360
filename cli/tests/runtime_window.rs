//! The `window` variant through the runtime (issue 27 §2, docs/design.md
//! "Variants"): the NIC maps only the sandbox's DMA window, never its RAM.
//! Needs root, /dev/kvm and the CNI plugins (as runtime_startup.rs).
//!
//! - A `window` sandbox and a `fastiov` one side by side on one NIC: both
//!   reach READY and the echo server answers both (the window's rings and
//!   packet buffers work); the NIC's memory table of the window sandbox's VF
//!   is the 128 KiB window, the fastiov one's all of its 64 MiB of RAM; after
//!   teardown both VFs map nothing and the runtime's leak check is clean.
//! - VFs and templates together: two `window` sandboxes restored from one
//!   template at once, each with a fresh window of its own, both answered
//!   over their VFs without a boot; the NIC maps each one's window only
//!   (never the template's copy-on-write memory).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::Mutex;
use std::time::Duration;

use nic_api::{DevKind, VfInfo};
use runtime::{Sandbox, SandboxSpec, Variant};

mod cli_common;
use cli_common::{burstvm, networked_runtime_vfs, nic_devices, text};

/// VMs and NICs on a 2-core machine: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn vfs(rt: &runtime::Runtime) -> Vec<VfInfo> {
    nic_devices(rt, DevKind::Vf)
}

#[test]
fn a_window_sandbox_answers_over_its_vf_and_the_nic_maps_only_its_window() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
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
    while vfs(&rt).iter().any(|f| f.mapped_bytes > 0) {
        assert!(std::time::Instant::now() < deadline, "{:#?}", vfs(&rt));
        std::thread::sleep(Duration::from_millis(50));
    }
    let lc = runtime::leaks::check(&rt, Duration::from_secs(5));
    assert!(lc.is_clean(), "{}", lc.describe());
}

#[test]
fn window_sandboxes_restored_from_one_template_answer_over_their_own_vfs() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("burstvm-window-tmpl-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let o = burstvm(&["template", "create", "tw", "--dir", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let rt = networked_runtime_vfs(2, 0);
    rt.prepare_variant(Variant::Window).unwrap();
    let pfx = rt.sandbox_prefix();
    let ids = [format!("{pfx}tw-a"), format!("{pfx}tw-b")];
    let sbs: Vec<Sandbox> = std::thread::scope(|s| {
        let hs: Vec<_> = ids
            .iter()
            .map(|id| {
                let spec = SandboxSpec {
                    keep_running: true,
                    template: Some(dir.join("tw")),
                    ..SandboxSpec::new(id.clone(), Variant::Window, 64 << 20, 60)
                };
                let rt = &rt;
                s.spawn(move || Sandbox::start(rt, spec))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap().unwrap_or_else(|e| panic!("{e}")))
            .collect()
    });
    let replies = rt.server().replies();
    for sb in &sbs {
        let ip = sb.guest_ip.unwrap();
        assert!(
            replies.get(&ip).copied().unwrap_or(0) > 0,
            "{}: answered",
            sb.id()
        );
    }
    let trace = std::fs::read_to_string(rt.trace_path()).unwrap();
    for id in &ids {
        let stage = |s: &str| trace.contains(&format!("\"sandbox\":\"{id}\",\"stage\":\"{s}\""));
        assert!(
            stage("restore") && stage("dma-window") && stage("vf-open"),
            "{id}: {trace}"
        );
        assert!(!stage("boot"), "{id}: restored, not booted: {trace}");
    }
    let devs = vfs(&rt);
    for id in &ids {
        let v = devs
            .iter()
            .find(|v| v.sandbox.as_deref() == Some(id.as_str()))
            .unwrap_or_else(|| panic!("no VF of {id}: {devs:#?}"));
        assert_eq!(
            v.mapped_bytes,
            runtime::variant::DMA_WINDOW_BYTES,
            "{id}: the NIC maps this restore's window only"
        );
    }
    for mut sb in sbs {
        sb.check_alive().unwrap();
        sb.teardown().unwrap();
    }
    let lc = runtime::leaks::check(&rt, Duration::from_secs(5));
    assert!(lc.is_clean(), "{}", lc.describe());
    drop(rt);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `bench echo`: the guest's echo loop over a window VF and a fastiov VF
/// keeps going (replies counted over the interval, host CPU per exchange
/// measured), and a variant without a VF is refused with the flag named.
#[test]
fn bench_echo_counts_the_echo_loop_of_each_vf_variant() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let o = burstvm(&[
        "bench",
        "echo",
        "--variants",
        "window,fastiov",
        "--seconds",
        "1",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    for v in ["window", "fastiov"] {
        let row: Vec<&str> = out
            .lines()
            .find(|l| l.starts_with(v))
            .unwrap_or_else(|| panic!("no {v} row: {out}"))
            .split_whitespace()
            .collect();
        let replies: u64 = row[1].parse().unwrap();
        let vmm_us: f64 = row[4].parse().unwrap();
        assert!(replies > 10, "{v}: the loop kept going: {out}");
        assert!(vmm_us > 0.0, "{v}: the VMM's CPU was measured: {out}");
    }
    let o = burstvm(&["bench", "echo", "--variants", "no-net"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--variants"), "{}", text(&o));
}
