//! Crashed guests give their VFs back at once (docs/nic.md, "VF lifecycle and
//! the devset"): a VF whose VMM died is reset on its own, not when every VF of
//! its PF is closed, so one long-lived sandbox does not keep crashed
//! sandboxes' VFs out of use. Through the runtime (its NIC daemon, CNI and
//! echo server), with built-in-agent guests. Needs root, /dev/kvm and the
//! CNI plugins (as runtime_startup.rs).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::time::Duration;

use runtime::{Sandbox, SandboxSpec, Variant};

mod cli_common;
use cli_common::networked_runtime_vfs;

const VFS: usize = 8;

/// Whether the runtime's echo server answered the sandbox's guest.
fn answered(rt: &runtime::Runtime, sb: &Sandbox<'_>) -> bool {
    sb.guest_ip
        .is_some_and(|ip| rt.server().replies().get(&ip).copied().unwrap_or(0) > 0)
}

#[test]
fn crashed_guests_vfs_are_reused_while_a_long_lived_one_runs() {
    let rt = networked_runtime_vfs(VFS, 0);
    rt.prepare_variant(Variant::Fastiov).unwrap();
    let pfx = rt.sandbox_prefix();
    let spec = |name: &str| SandboxSpec {
        keep_running: true,
        ..SandboxSpec::new(format!("{pfx}{name}"), Variant::Fastiov, 64 << 20, 60)
    };
    let start = |name: &str| {
        let sb = Sandbox::start(&rt, spec(name)).unwrap_or_else(|f| panic!("{name}: {f}"));
        assert!(answered(&rt, &sb), "{name}: no answer from the echo server");
        sb
    };
    // Every VF of the PF taken: one long-lived sandbox and seven that crash.
    let mut long = start("long");
    let crashed: Vec<_> = (0..VFS - 1).map(|k| start(&format!("crash{k}"))).collect();
    assert_eq!(rt.assigned_vfs().unwrap().len(), VFS);
    for mut sb in crashed {
        let pid = sb.vmm_pid().expect("a running VMM");
        // SAFETY: kill(2) on the VMM this test's runtime spawned.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        testutil::poll_until("the VMM's death", Duration::from_secs(10), || {
            match sb.check_alive() {
                Err(_) => Ok(()),
                Ok(()) => Err(format!("{} alive", sb.id())),
            }
        });
        sb.teardown()
            .unwrap_or_else(|e| panic!("{}: teardown: {e}", sb.id()));
    }
    long.check_alive().expect("the long-lived sandbox runs on");

    // Seven new sandboxes on the crashed ones' VFs, the long one still open.
    let again: Vec<_> = (0..VFS - 1).map(|k| start(&format!("new{k}"))).collect();
    assert_eq!(rt.assigned_vfs().unwrap().len(), VFS);
    long.check_alive().expect("the long-lived sandbox runs on");
    for mut sb in again.into_iter().chain([long]) {
        sb.teardown()
            .unwrap_or_else(|e| panic!("{}: teardown: {e}", sb.id()));
    }
    assert!(rt.assigned_vfs().unwrap().is_empty());
}
