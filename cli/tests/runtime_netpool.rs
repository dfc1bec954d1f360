//! The network pool makes whole attachments off the start path: netns, CNI
//! ADD and the server's neighbour entry for the guest (at 200 starts at
//! once, adding the entries at claim time made `net-claim` take 150-400 ms).
//! A claimed entry goes with its sandbox's teardown; the pool removes the
//! entries it still holds when it stops. Needs root, /dev/kvm and the CNI
//! plugins (as runtime_startup.rs).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use runtime::{Sandbox, SandboxSpec, Variant};
use std::time::Duration;

mod cli_common;
use cli_common::networked_runtime_pooled;

/// The permanent neighbour entries of the server netns, as `ip neigh` shows them.
fn permanent_neighbours(rt: &runtime::Runtime) -> Vec<String> {
    let o = std::process::Command::new("ip")
        .args([
            "-n",
            rt.server().netns_name(),
            "neigh",
            "show",
            "nud",
            "permanent",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| l.split_whitespace().next().unwrap_or_default().to_string())
        .collect()
}

#[test]
fn pooled_attachments_carry_their_neighbour_entry_and_take_it_away() {
    let rt = networked_runtime_pooled(4, 0, 2);
    rt.prepare_variant(Variant::Window).unwrap();
    let (ready, target, err) = rt.wait_net_pool(Duration::from_secs(60)).unwrap();
    assert_eq!((ready, target), (2, 2), "{err:?}");
    let pooled = permanent_neighbours(&rt);
    assert_eq!(
        pooled.len(),
        2,
        "one entry per pooled attachment: {pooled:?}"
    );

    let name = format!("{}np", rt.sandbox_prefix());
    let spec = SandboxSpec {
        keep_running: true,
        net_pool: true,
        ..SandboxSpec::new(name, Variant::Window, 64 << 20, 60)
    };
    let mut sb = Sandbox::start(&rt, spec).unwrap();
    let ip = sb.guest_ip.unwrap().to_string();
    assert!(pooled.contains(&ip), "a pooled address: {ip} in {pooled:?}");
    let answered = rt
        .server()
        .replies()
        .get(&sb.guest_ip.unwrap())
        .copied()
        .unwrap_or(0);
    assert!(
        answered > 0,
        "the echo server answered the claimed attachment"
    );
    sb.teardown().unwrap();
    assert!(
        !permanent_neighbours(&rt).contains(&ip),
        "the teardown removed the claimed entry"
    );

    // The refill makes a new one (with its entry); stopping removes them all.
    let (ready, _, err) = rt.wait_net_pool(Duration::from_secs(60)).unwrap();
    assert_eq!(ready, 2, "{err:?}");
    assert_eq!(permanent_neighbours(&rt).len(), 2);
    let (made, cpu_ns) = rt.net_pool_refill_cpu().unwrap();
    assert!(made >= 3 && cpu_ns > 0, "{made} made, {cpu_ns} ns");
    rt.stop_net_pool().unwrap();
    assert_eq!(permanent_neighbours(&rt), Vec::<String>::new());
    let lc = runtime::leaks::check(&rt, Duration::from_secs(10));
    assert!(lc.is_clean(), "{}", lc.describe());
}
