//! `burstvm cri runp/stopp/rmp` through containerd's CRI plugin: the plugin
//! makes the netns and runs the forwarder, burstvm-cni-thin, which the NIC
//! daemon's CNI server answers (the engine's bin dir has no burstvm-cni to
//! fall back to); the shim attaches the VF named by
//! the placeholder link, and the guest's request reaches the echo server
//! over it (root, KVM; docs/shim.md).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod shim_common;

use std::process::Command;
use std::time::Duration;

use shim_common::{Fixture, BURSTVM};

fn cri(f: &Fixture, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BURSTVM)
        .arg("cri")
        .arg("--endpoint")
        .arg(f.containerd.socket())
        .args(["--timeout", "120"])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).trim().to_string(),
    )
}

#[test]
fn cri_runp_reaches_the_echo_server_over_the_vf_and_rmp_leaves_nothing() {
    let f = Fixture::new("cri", 8);
    let conf: serde_json::Value =
        serde_json::from_slice(&std::fs::read(f.dir.join("cni-conf/10-burstvm.conf")).unwrap())
            .unwrap();
    assert_eq!(conf["type"], "burstvm-cni-thin", "{conf}");
    assert!(conf["cniSocket"].is_string(), "{conf}");
    f.containerd
        .import("k8s.io", &f.dir.join("images/pause.tar"))
        .unwrap();
    let (ok, pod, err) = cri(
        &f,
        &[
            "runp",
            "--name",
            "p1",
            "--annotation",
            "io.burstvm.variant=vanilla",
        ],
    );
    assert!(ok, "runp: {err}\ncontainerd: {}", f.containerd.log_tail());
    assert_eq!(pod.len(), 64, "pod id {pod:?}");
    let sb = shim::sandbox_id("k8s.io", &pod);

    // The CRI plugin made the netns and ran CNI; the runtime's stages start at the cgroup.
    let stages = f.trace_stages(&sb);
    for s in [
        "cgroup",
        "vmm-spawn",
        "dma-ram",
        "dma-image",
        "vf-open",
        "boot",
        "vf-driver",
        "ready",
    ] {
        assert!(
            stages.iter().any(|x| x == s),
            "{sb}: stage {s} in {stages:?}"
        );
    }
    assert!(
        !stages.iter().any(|x| x == "cni-add" || x == "netns"),
        "{stages:?}"
    );

    let (ok, status, err) = cri(&f, &["inspectp", &pod]);
    assert!(ok, "inspectp: {err}");
    let v: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(v["state"], 0, "Ready: {status}");
    let ip = v["network"]["ip"].as_str().unwrap().to_string();
    assert!(
        ip.starts_with("10.77."),
        "pod IP from burstvm-cni's IPAM: {ip}"
    );
    // The guest's request was answered by the echo server (services' count per guest).
    let replies = f.services_dir.join("replies.json");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while runtime::host::read_replies(&replies)
        .get(&ip)
        .copied()
        .unwrap_or(0)
        == 0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no echo reply to {ip}: {:?}",
            runtime::host::read_replies(&replies)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The VF the CRI plugin's CNI ADD assigned to this pod is the one the VMM opened.
    let info = runtime::ServicesInfo::load(&f.services_dir.join("services.json")).unwrap();
    let mut nic = nic_api::Client::connect(&info.nic_socket).unwrap();
    let vf = nic
        .list()
        .unwrap()
        .into_iter()
        .find(|v| v.sandbox.as_deref() == Some(pod.as_str()))
        .expect("VF assigned to the pod");
    assert!(
        vf.counters.rx_packets > 0 && vf.counters.tx_packets > 0,
        "{vf:?}"
    );

    let (ok, pods, _) = cri(&f, &["pods"]);
    assert!(
        ok && pods.contains(&pod) && pods.contains("Ready"),
        "{pods}"
    );
    let (ok, _, err) = cri(&f, &["stopp", &pod]);
    assert!(ok, "stopp: {err}");
    let (ok, _, err) = cri(&f, &["rmp", &pod]);
    assert!(ok, "rmp: {err}");
    let left = f.wait_clean(&[sb], Duration::from_secs(15));
    assert!(left.is_empty(), "after stopp/rmp: {left:?}");
    let (ok, pods, _) = cri(&f, &["pods"]);
    assert!(ok && !pods.contains(&pod), "{pods}");
    assert!(shim::containerd::mounts_under(f.containerd.dir())
        .iter()
        .all(|m| !m.to_string_lossy().contains(&pod)));
}
