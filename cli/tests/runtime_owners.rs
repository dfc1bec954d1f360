//! One owner per directory for `burstvm services` (the host services the
//! shim attaches to): a second services process on the same directory is
//! refused, naming the first's pid, and touches nothing of it; the first's
//! liveness is its lock, not its pid, so a killed one is seen gone even
//! when its pid belongs to another process, and its successor starts at
//! once (reaping what the killed one left). Root, iproute2, /opt/cni/bin.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

mod cli_common;
use cli_common::BIN;
use runtime::host::HostError;
use runtime::ServicesInfo;

const START: Duration = Duration::from_secs(60);

fn services(dir: &Path, cni_conf: &Path) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.arg("services")
        .arg("--dir")
        .arg(dir)
        .arg("--cni-conf")
        .arg(cni_conf)
        .args(["--vfs", "1"])
        .env(
            "PATH",
            format!("/opt/cni/bin:{}", std::env::var("PATH").unwrap_or_default()),
        );
    procutil::die_with_parent(&mut cmd);
    cmd
}

/// Starts services on `dir` and waits until `services.json` says they run.
fn start(dir: &Path, cni_conf: &Path, log: PathBuf) -> (testutil::ChildGuard, ServicesInfo) {
    let child = services(dir, cni_conf)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut child = testutil::ChildGuard(child);
    let info = testutil::poll_until("services running", START, || {
        if let Some(st) = child.0.try_wait().unwrap() {
            panic!(
                "services exited ({st}): {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        ServicesInfo::load(&dir.join("services.json")).map_err(|e| e.to_string())
    });
    (child, info)
}

fn kill(child: &mut Child) {
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn a_second_services_process_is_refused_and_a_killed_one_is_seen_gone() {
    let root = testutil::fresh_dir("bv-owners", "services");
    let (dir, conf) = (root.join("services"), root.join("cni/10-burstvm.conf"));
    let (mut first, info) = start(&dir, &conf, root.join("first.log"));
    assert_eq!(info.owner_pid, first.0.id());
    let json = std::fs::read(dir.join("services.json")).unwrap();

    // The second: refused before it makes anything, its CNI config unwritten.
    let conf2 = root.join("cni2/10-burstvm.conf");
    testutil::assert_refused_owner(&mut services(&dir, &conf2), first.0.id(), START);
    assert!(!conf2.exists(), "the refused services wrote its CNI config");
    assert_eq!(std::fs::read(dir.join("services.json")).unwrap(), json);
    assert!(conf.exists());
    ServicesInfo::load(&dir.join("services.json")).expect("the first serves on");
    nic_api::Client::connect(&info.nic_socket)
        .expect("the first's NIC daemon")
        .list()
        .unwrap();

    // Killed: gone, also when the file names a pid that is alive (reused).
    kill(&mut first.0);
    let mut other = testutil::ChildGuard(Command::new("sleep").arg("600").spawn().unwrap());
    let mut v: serde_json::Value = serde_json::from_slice(&json).unwrap();
    v["owner_pid"] = other.0.id().into();
    std::fs::write(dir.join("services.json"), v.to_string()).unwrap();
    let e = ServicesInfo::load(&dir.join("services.json")).unwrap_err();
    assert!(matches!(e, HostError::Gone { .. }), "{e}");

    // The successor takes the directory at once.
    let (mut next, info2) = start(&dir, &conf, root.join("next.log"));
    assert_eq!(info2.owner_pid, next.0.id());
    testutil::stop_child(&mut next.0);
    assert!(!dir.join("services.json").exists(), "services.json left");
    kill(&mut other.0);
    let _ = std::fs::remove_dir_all(&root);
}
