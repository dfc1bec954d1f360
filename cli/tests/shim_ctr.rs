//! `ctr run --runtime io.containerd.burstvm.v2` against a private containerd:
//! exit status = the guest's, traces written, nothing left after delete and
//! after a SIGKILLed shim (root, KVM; docs/shim.md).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod shim_common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use shim_common::Fixture;

#[test]
fn ctr_run_exit_status_is_the_guests_and_nothing_is_left() {
    let f = Fixture::new("run1", 8);
    // The image's /app-exit3 ends with status 3, /app with 0 (scripts/build-images.sh).
    for (id, entry, want) in [("t3", Some("/app-exit3"), 3), ("t0", None, 0)] {
        let out = f.ctr_run(id, &["--rm"], entry).output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(want),
            "ctr run {id}: {}\n{}\ncontainerd: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            f.containerd.log_tail()
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains(&format!("guest exited with status {want}")),
            "guest serial/stage summary on the task's stdout: {stdout}"
        );
        let sb = f.sandbox_id(id);
        let stages = f.trace_stages(&sb);
        for s in [
            "cgroup",
            "netns",
            "cni-add",
            "vmm-spawn",
            "vf-open",
            "boot",
            "app-launch",
            "ready",
        ] {
            assert!(
                stages.iter().any(|x| x == s),
                "{sb}: stage {s} in {stages:?}"
            );
        }
        let left = f.wait_clean(&[sb], Duration::from_secs(10));
        assert!(left.is_empty(), "after ctr run --rm {id}: {left:?}");
    }
    // What the built-in agent cannot honour is refused at create, named:
    // an environment variable (`--env`) and arguments after the entrypoint.
    for (id, extra, cmd, want) in [
        (
            "e1",
            &["--rm", "--env", "FOO=bar"][..],
            vec!["/app"],
            "FOO=bar",
        ),
        (
            "e2",
            &["--rm"][..],
            vec!["/app", "x"],
            "arguments after the entrypoint",
        ),
    ] {
        let mut c = f.ctr_run(id, extra, None);
        c.args(&cmd);
        let out = c.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want) && err.contains("Linux guest"),
            "ctr run {id}: {:?}: {err}",
            out.status
        );
        // `--rm` removed the container.
        let left = f.wait_clean(&[f.sandbox_id(id)], Duration::from_secs(10));
        assert!(left.is_empty(), "after a refused create {id}: {left:?}");
    }
}

/// A long-lived sandbox (a pod sandbox, as CRI marks it) is stopped by
/// `ctr task kill` (SIGTERM: graceful, status 0); another one's shim is
/// SIGKILLed: its VMM dies with it and containerd's `shim delete` removes the rest.
#[test]
fn kill_stops_gracefully_and_a_killed_shim_leaves_nothing() {
    let f = Fixture::new("kill", 8);
    let pod = [
        "-d",
        "--annotation",
        "io.kubernetes.cri.container-type=sandbox",
    ];
    for id in ["g1", "k1"] {
        let out = f.ctr_run(id, &pod, None).output().unwrap();
        assert!(
            out.status.success(),
            "ctr run -d {id}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (g1, k1) = (f.sandbox_id("g1"), f.sandbox_id("k1"));
    for sb in [&g1, &k1] {
        assert!(
            f.trace_stages(sb).iter().any(|s| s == "ready"),
            "{sb} ready"
        );
    }
    let tasks =
        String::from_utf8_lossy(&f.ctr(&["task", "ls"]).output().unwrap().stdout).into_owned();
    assert!(tasks.contains("g1") && tasks.contains("RUNNING"), "{tasks}");
    // What the built-in agent cannot serve answers Unimplemented, saying why.
    for (args, want) in [
        (&["task", "pause", "g1"][..], "pause is not supported"),
        (
            &["task", "exec", "--exec-id", "x1", "g1", "/app"][..],
            "exec is not supported on the built-in agent",
        ),
        // ctr pauses a task before it checkpoints it.
        (&["task", "checkpoint", "g1"][..], "is not supported"),
    ] {
        let out = f.ctr(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want) && err.contains("not implemented"),
            "ctr {args:?}: {err}"
        );
    }

    // The stage trace is also in the task's bundle.
    let bundle_trace = f.containerd.bundle(&f.ns, "g1").join("trace.jsonl");
    let lines = std::fs::read_to_string(&bundle_trace).unwrap();
    assert!(
        lines.contains(&format!("\"sandbox\":\"{g1}\"")) && lines.contains("\"ready\""),
        "{lines}"
    );
    // Graceful: SIGTERM → the VMM closes its devices and exits 0.
    let st = f.ctr(&["task", "kill", "g1"]).status().unwrap();
    assert!(st.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = f.ctr(&["task", "ls"]).output().unwrap();
        let ls = String::from_utf8_lossy(&out.stdout).into_owned();
        let line = ls
            .lines()
            .find(|l| l.starts_with("g1"))
            .unwrap_or("")
            .to_string();
        if line.contains("STOPPED") {
            break;
        }
        assert!(Instant::now() < deadline, "g1 not stopped: {ls}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = f.ctr(&["task", "delete", "g1"]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(f
        .ctr(&["container", "rm", "g1"])
        .status()
        .unwrap()
        .success());

    // SIGKILL of the shim that serves k1.
    let shims = f.containerd.shim_pids();
    assert_eq!(shims.len(), 1, "one shim left (k1's): {shims:?}");
    // SAFETY: kill(2) on the shim our containerd started for k1.
    unsafe { libc::kill(shims[0] as i32, libc::SIGKILL) };
    let left = f.wait_clean(&[g1.clone(), k1.clone()], Duration::from_secs(20));
    assert!(
        left.is_empty(),
        "after SIGKILL of k1's shim: {left:?}\n{}",
        f.containerd.log_tail()
    );
    let out = f.ctr(&["task", "delete", "k1"]).output().unwrap();
    let _ = out; // containerd may already have removed the dead task
    assert!(f
        .ctr(&["container", "rm", "k1"])
        .status()
        .unwrap()
        .success());
    assert!(f.leftovers(&[g1, k1]).is_empty());
}

/// 50 `ctr run` at once: every exit status is its guest's, every sandbox
/// traced, nothing left.
#[test]
fn fifty_concurrent_ctr_runs() {
    let f = Fixture::new("run50", 56);
    let n = 50;
    let results: Vec<(String, Option<i32>, String)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|i| {
                let f = &f;
                s.spawn(move || {
                    let id = format!("c{i}");
                    let entry = if i % 2 == 0 { None } else { Some("/app-exit3") };
                    let out = f
                        .ctr_run(&id, &["--rm", "--null-io"], entry)
                        .output()
                        .unwrap();
                    (
                        id,
                        out.status.code(),
                        String::from_utf8_lossy(&out.stderr).into_owned(),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut sbs = Vec::new();
    for (i, (id, code, err)) in results.iter().enumerate() {
        let want = if i % 2 == 0 { 0 } else { 3 };
        assert_eq!(*code, Some(want), "ctr run {id}: {err}");
        let sb = f.sandbox_id(id);
        assert!(
            f.trace_stages(&sb).iter().any(|s| s == "ready"),
            "{sb} traced"
        );
        sbs.push(sb);
    }
    let left = f.wait_clean(&sbs, Duration::from_secs(30));
    assert!(left.is_empty(), "after 50 ctr run --rm: {left:?}");
}

/// docs/shim.md's containerd config, as a user copies it (plus a private
/// root, state and sockets), loads the CRI plugin: its
/// `default_runtime_name` names a runtime of its table (no VM).
#[test]
fn the_documented_containerd_config_loads_the_cri_plugin() {
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/shim.md")).unwrap();
    let section = doc.split("## containerd config").nth(1).unwrap();
    let block = section
        .split("```toml\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .unwrap();
    assert!(block.starts_with("version = 2\n"), "{block}");
    let dir = PathBuf::from(format!("/tmp/bvshim-doccfg-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.display();
    let toml = format!(
        "{}[grpc]\n  address = \"{d}/containerd.sock\"\n[ttrpc]\n  address = \"{d}/containerd.sock.ttrpc\"\n",
        block.replacen(
            "version = 2\n",
            &format!("version = 2\nroot = \"{d}/root\"\nstate = \"{d}/state\"\n"),
            1
        )
    );
    std::fs::write(dir.join("config.toml"), toml).unwrap();
    let mut cmd = Command::new("containerd");
    cmd.arg("--config")
        .arg(dir.join("config.toml"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("containerd.log")).unwrap());
    procutil::die_with_parent(&mut cmd);
    let child = cmd.spawn().unwrap();
    let socket = dir.join("containerd.sock");
    let deadline = Instant::now() + Duration::from_secs(30);
    let plugins = loop {
        let out = Command::new("ctr")
            .arg("--address")
            .arg(&socket)
            .args(["plugins", "ls"])
            .output()
            .unwrap();
        if out.status.success() {
            break String::from_utf8_lossy(&out.stdout).into_owned();
        }
        if Instant::now() > deadline {
            break String::new();
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    runtime::sandbox::stop_child(child, Duration::from_secs(10));
    let log = std::fs::read_to_string(dir.join("containerd.log")).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    let cri = plugins
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some("cri"))
        .unwrap_or_else(|| panic!("no cri plugin listed: {plugins:?}\n{log}"));
    assert_eq!(
        cri.split_whitespace().last(),
        Some("ok"),
        "{cri}\n{}",
        log.lines()
            .filter(|l| l.contains("cri"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
