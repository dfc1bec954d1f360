//! CRI containers inside a burstvm pod (issue 26, docs/shim.md "What a pod
//! is here"): with a kernel in the shim config, RunPodSandbox boots the
//! Linux guest in pod mode with empty disk slots; each container's image is
//! inserted into a slot and mounted as its root by the agent. Driven with
//! `burstvm cri` as kubelet would: a pod with containers of two images,
//! logs, exec, the pod's VF, stop, remove, nothing left. Root, KVM,
//! containerd; the kernel and the static agent; one boot (~30-40 s here).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod guest_common;
mod shim_common;

use std::process::Command;
use std::time::{Duration, Instant};

use guest_common::{agent, kernel};
use shim_common::{derive_image, Fixture, BURSTVM};

const BUSYBOX: &str = "burstvm.local/busybox:1";
/// Derived from busybox: the same layers, its entrypoint prints $GREETING.
const GREETER: &str = "burstvm.local/greeter:1";

/// `burstvm cri ARGS` against the fixture's containerd: (success, stdout, stderr).
fn cri(f: &Fixture, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BURSTVM)
        .arg("cri")
        .arg("--endpoint")
        .arg(f.containerd.socket())
        .args(["--timeout", "300"])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).trim().to_string(),
    )
}

fn ok(f: &Fixture, args: &[&str]) -> String {
    let (ok, out, err) = cri(f, args);
    assert!(
        ok,
        "burstvm cri {args:?}: {err}\ncontainerd: {}",
        f.containerd.log_tail()
    );
    out.trim().to_string()
}

/// Polls `logs ID` until it holds `want` (at most 60 s).
fn wait_log(f: &Fixture, id: &str, want: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, out, _) = cri(f, &["logs", id]);
        if out.contains(want) || Instant::now() > deadline {
            return out;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn state(f: &Fixture, id: &str) -> serde_json::Value {
    serde_json::from_str(&ok(f, &["inspect", id])).unwrap()
}

#[test]
fn a_pod_runs_containers_of_two_images_with_logs_exec_a_terminal_and_its_vf() {
    let f = Fixture::new("pod", 4);
    // The CRI runtime's ConfigPath is the fixture's shim.json: make it the
    // Linux guest's (read at every Create).
    let linux = f.write_linux_config(&kernel(), &agent(), "fastiov", "128M");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&linux).unwrap()).unwrap();
    cfg["pod_slots"] = 2.into();
    std::fs::write(&f.shim_config, serde_json::to_vec(&cfg).unwrap()).unwrap();
    // A second image: busybox's layers, an entrypoint of its own.
    let images = f.dir.join("images");
    derive_image(
        &images.join("busybox.tar"),
        &images.join("greeter.tar"),
        GREETER,
        &["sh", "-c", "echo $GREETING; cat /tmp/mine 2>&1; exit 3"],
    );
    for tar in ["pause.tar", "busybox.tar", "greeter.tar"] {
        f.containerd.import("k8s.io", &images.join(tar)).unwrap();
    }
    let logs = f.dir.join("pod-logs");
    let pod = ok(
        &f,
        &["runp", "--name", "p1", "--log-dir", logs.to_str().unwrap()],
    );
    let sb = shim::sandbox_id("k8s.io", &pod);

    // c1 of busybox, c2 of the derived image (its entrypoint), each its own root.
    let c1 = ok(
        &f,
        &[
            "create",
            &pod,
            BUSYBOX,
            "--name",
            "c1",
            "--",
            "sh",
            "-c",
            "echo hello-from-c1; echo marker-c1 > /tmp/mine; sleep 1000",
        ],
    );
    let c2 = ok(
        &f,
        &[
            "create",
            &pod,
            GREETER,
            "--name",
            "c2",
            "--env",
            "GREETING=hi-from-c2",
        ],
    );
    ok(&f, &["start", &c1]);
    assert!(wait_log(&f, &c1, "hello-from-c1").contains("hello-from-c1"));
    ok(&f, &["start", &c2]);
    let out = wait_log(&f, &c2, "hi-from-c2");
    // c2 has its own root: c1's /tmp/mine is not there.
    assert!(out.contains("hi-from-c2"), "{out}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let s2 = loop {
        let s = state(&f, &c2);
        if s["state"] == 2 || Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(s2["exit_code"], 3, "{s2}");
    // Its whole log, now that it has exited.
    let (_, out, _) = cri(&f, &["logs", &c2]);
    assert!(
        out.contains("No such file") && !out.contains("marker-c1"),
        "c2 saw c1's file: {out}"
    );

    // exec into c1: its root (the file it wrote), its exit status.
    let (okx, out, err) = cri(&f, &["exec", &c1, "--", "cat", "/tmp/mine"]);
    assert!(okx && out.trim() == "marker-c1", "{out} {err}");
    let (okx, _, _) = cri(&f, &["exec", &c1, "--", "sh", "-c", "exit 7"]);
    assert!(!okx);
    // The pod's VF: c1 fetches from the services' file server.
    const N: u64 = 100_000;
    let fetch = format!(
        "gw=$(ip route | awk '/^default/ {{print $3}}'); \
         wget -q -O - http://$gw:{}/bytes/{N} | wc -c",
        runtime::fileserver::FILE_PORT
    );
    let (okx, out, err) = cri(&f, &["exec", &c1, "--", "sh", "-c", &fetch]);
    assert!(okx && out.trim() == N.to_string(), "{out} {err}");

    // One EROFS file per tree: the derived image has busybox's layers, so
    // both containers' images are one file, built once.
    let erofs = std::fs::read_dir(f.image_cache())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "erofs"))
        .count();
    assert_eq!(erofs, 2, "pause's tree and busybox's, each built once");

    // c2's task was deleted when it exited (CRI does that): its slot is free
    // again. Two slots, both held by running containers (c1 and `hold`): a
    // third cannot start, and says why.
    let hold = ok(
        &f,
        &[
            "create", &pod, BUSYBOX, "--name", "hold", "--", "sleep", "1000",
        ],
    );
    ok(&f, &["start", &hold]);
    let full = ok(
        &f,
        &["create", &pod, BUSYBOX, "--name", "full", "--", "true"],
    );
    let (started, _, err) = cri(&f, &["start", &full]);
    assert!(!started && err.contains("no free disk slot"), "{err}");
    ok(&f, &["rm", &full]);
    // Once `hold` is removed, c3 takes its slot again.
    ok(&f, &["rm", "-f", &hold]);
    ok(&f, &["rm", &c2]);
    let c3 = ok(
        &f,
        &[
            "create",
            &pod,
            BUSYBOX,
            "--name",
            "c3",
            "--tty",
            "--",
            "sh",
            "-c",
            "tty; echo c3-here",
        ],
    );
    ok(&f, &["start", &c3]);
    // Its main process has a terminal of its own.
    let out = wait_log(&f, &c3, "c3-here");
    assert!(
        out.contains("/dev/pts/") && out.contains("c3-here"),
        "{out}"
    );

    ok(&f, &["stop", &c1]);
    assert_eq!(state(&f, &c1)["state"], 2);
    ok(&f, &["rm", "-f", &c1, &c3]);
    ok(&f, &["stopp", &pod]);
    ok(&f, &["rmp", &pod]);
    let left = f.wait_clean(&[sb], Duration::from_secs(60));
    assert!(left.is_empty(), "left behind: {left:?}");
}
