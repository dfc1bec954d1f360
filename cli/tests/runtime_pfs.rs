//! A runtime whose NIC needs more VFs than a PF has (issue 27: 200 sandboxes
//! and a 200-attachment network pool): the NIC daemon gets a second PF with
//! an uplink of its own on the server bridge, and the sandbox network spans
//! both PFs. Needs root, /dev/kvm and the CNI plugins (as runtime_startup.rs).
//!
//! With every VF of pf0 taken, a sandbox still starts: its VF comes from
//! pf1, and the echo server answers it over pf1's uplink. After teardown
//! nothing is left.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use nic_api::{DevKind, MAX_VFS};
use runtime::{Sandbox, SandboxSpec, Variant};
use std::time::Duration;

mod cli_common;
use cli_common::{networked_runtime_vfs, nic_devices};

#[test]
fn a_sandbox_gets_a_vf_of_the_second_pf_when_the_first_is_full() {
    let rt = networked_runtime_vfs(MAX_VFS + 2, 0);
    assert_eq!(rt.server().uplink_ifs().len(), 2, "one uplink per PF");
    rt.prepare_variant(Variant::Fastiov).unwrap();
    let vfs = nic_devices(&rt, DevKind::Vf);
    let count = |pf: &str| vfs.iter().filter(|v| v.pf == pf).count();
    assert_eq!((count("pf0"), count("pf1")), (MAX_VFS, 2), "{vfs:#?}");

    // Take every VF of pf0 from outside the runtime.
    let mut nic = nic_api::Client::connect(&rt.nic_socket()).unwrap();
    let holders: Vec<String> = (0..MAX_VFS).map(|i| format!("hold-{i}")).collect();
    for h in &holders {
        let vf = nic.alloc("pf0", h, None, None).unwrap();
        assert_eq!(vf.pf, "pf0");
    }

    let name = format!("{}pf1", rt.sandbox_prefix());
    let spec = SandboxSpec {
        keep_running: true,
        ..SandboxSpec::new(name.clone(), Variant::Fastiov, 64 << 20, 60)
    };
    let mut sb = Sandbox::start(&rt, spec).unwrap();
    let ip = sb.guest_ip.unwrap();
    let answered = rt.server().replies().get(&ip).copied().unwrap_or(0);
    assert!(answered > 0, "the echo server answered over pf1's uplink");
    let mine = nic_devices(&rt, DevKind::Vf)
        .into_iter()
        .find(|v| v.sandbox.as_deref() == Some(name.as_str()))
        .expect("the sandbox's VF");
    assert_eq!(mine.pf, "pf1", "{mine:#?}");
    sb.check_alive().unwrap();
    sb.teardown().unwrap();

    for h in &holders {
        nic.release(h).unwrap();
    }
    let lc = runtime::leaks::check(&rt, Duration::from_secs(10));
    assert!(lc.is_clean(), "{}", lc.describe());
}
