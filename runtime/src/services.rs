//! `burstvm services`: the host-wide services that attached sandboxes (the
//! containerd shim) use, started once per host: the page-pool server, the NIC
//! daemon, the server netns with the echo server, and the burstvm-cni config
//! in the engine's CNI conf dir. It is a self-hosted `Runtime` that exports
//! itself (`host::export`) and runs until SIGINT/SIGTERM.

use std::path::PathBuf;
use std::time::Duration;

use crate::instance::{install_sigint_handler, sigint_received};
use crate::{burstvm_bin, cgroup, host, Error, Runtime, RuntimeConfig, Variant};

/// `burstvm services`.
#[derive(Debug, Clone)]
pub struct ServicesConfig {
    /// Directory for services.json (what the shim config names) and replies.json.
    pub dir: PathBuf,
    /// Where to write the burstvm-cni network config (containerd's CNI conf dir).
    pub cni_conf: PathBuf,
    /// The engine's CNI bin dir (containerd's `bin_dir`): if it holds
    /// burstvm-cni-thin, the config names it and the NIC daemon serves the
    /// engine's ADD and DEL.
    pub cni_bin: PathBuf,
    /// VFs the NIC daemon creates: at least the pods that run at once.
    pub vfs: usize,
    /// The NIC daemon runs this variant's devset lock policy.
    pub variant: Variant,
    /// The burstvm binary VMMs and the NIC daemon are spawned from (default: this one).
    pub burstvm_bin: Option<PathBuf>,
}

pub fn services_cli(a: &ServicesConfig) -> Result<(), Error> {
    install_sigint_handler();
    if a.variant.policy().devset_lock.is_none() {
        return Err(crate::bad(
            "--variant",
            format!("{} has no VF; name a VF variant (e.g. fastiov)", a.variant),
        ));
    }
    // Before anything is made: a second services process on the same
    // directory is refused, naming the first's pid, and touches nothing.
    let lock = host::claim_services_dir(&a.dir)?;
    // What a killed predecessor left describes services that are gone: no
    // attached sandbox may read it while ours start.
    for f in ["services.json", "replies.json"] {
        let _ = std::fs::remove_file(a.dir.join(f));
    }
    let rt = Runtime::new(RuntimeConfig::networked(
        burstvm_bin(&a.burstvm_bin)?,
        a.vfs,
        cgroup::Limits {
            memory_bytes: 64 << 20,
            cpus: 1.0,
        },
    ))?;
    rt.hold_dir_lock(lock);
    rt.prepare_variant(a.variant)?;
    let info = host::export(&rt, &a.dir, &a.cni_conf, &a.cni_bin)?;
    println!(
        "services ready: {} (NIC {}, CNI config {})",
        a.dir.join("services.json").display(),
        info.nic_socket.display(),
        info.cni_config.display()
    );
    let mut last = String::new();
    while !sigint_received() {
        host::write_replies(&rt, &info, &mut last);
        std::thread::sleep(Duration::from_millis(100));
    }
    for p in [
        a.dir.join("services.json"),
        info.replies.clone(),
        a.cni_conf.clone(),
    ] {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}
