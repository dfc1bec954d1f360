// Helpers of the tests that run `burstvm` subcommands (included with `mod`).
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

pub const BIN: &str = env!("CARGO_BIN_EXE_burstvm");
pub const CNI_BIN: &str = env!("CARGO_BIN_EXE_burstvm-cni");

/// `burstvm ARGS`, with this build's CNI plugin first on CNI_PATH.
pub fn burstvm(args: &[&str]) -> Output {
    let cni_dir = Path::new(CNI_BIN).parent().unwrap();
    Command::new(BIN)
        .args(args)
        .env("CNI_PATH", format!("{}:/opt/cni/bin", cni_dir.display()))
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run burstvm")
}

/// Status, stdout and stderr, for assertion messages.
pub fn text(o: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A networked runtime (one VF, `sgfs` SG functions, 64 MiB cgroup limit, no
/// pools, no rootfs) of this build's binary, with this build's CNI plugin
/// first on CNI_PATH (the runtime finds burstvm-cni there).
pub fn networked_runtime(sgfs: usize) -> runtime::Runtime {
    networked_runtime_vfs(1, sgfs)
}

/// `networked_runtime` with `vfs` VFs.
pub fn networked_runtime_vfs(vfs: usize, sgfs: usize) -> runtime::Runtime {
    networked_runtime_pooled(vfs, sgfs, 0)
}

/// As `networked_runtime_vfs`, with a network pool of `net_pool` attachments.
pub fn networked_runtime_pooled(vfs: usize, sgfs: usize, net_pool: usize) -> runtime::Runtime {
    let cni_dir = Path::new(CNI_BIN).parent().unwrap();
    std::env::set_var("CNI_PATH", format!("{}:/opt/cni/bin", cni_dir.display()));
    runtime::Runtime::new(runtime::RuntimeConfig {
        bin: BIN.into(),
        trace_path: None,
        vfs,
        network: true,
        cgroup_pool: 0,
        cgroup_limits: runtime::cgroup::Limits {
            memory_bytes: 64 << 20,
            cpus: 1.0,
        },
        rootfs_layer_bytes: None,
        net_pool,
        sgfs,
        cni_server: true,
    })
    .expect("runtime")
}

/// The devices of kind `kind` the runtime's NIC daemon serves, as `list` shows them.
pub fn nic_devices(rt: &runtime::Runtime, kind: nic_api::DevKind) -> Vec<nic_api::VfInfo> {
    let mut c = nic_api::Client::connect(&rt.nic_socket()).unwrap();
    c.list()
        .unwrap()
        .into_iter()
        .filter(|v| v.kind == kind)
        .collect()
}
