//! containerd runs real containers through the shim (issue 26, docs/shim.md
//! "Two guests"): with a kernel in the shim config, `ctr run` of the busybox
//! image boots the condensed Linux kernel with the guest agent on the image
//! built from the snapshot, and the task API drives the OCI process (stdio
//! through containerd's FIFOs, exit status, signals, exec, a terminal, pids,
//! metrics). Root, KVM, containerd; the kernel (scripts/build-guest-kernel.sh)
//! and the static agent (scripts/build-agent.sh). Two boots: under kvm_pvm
//! the kernel runs emulated (~30-40 s each).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod guest_common;
mod shim_common;

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use guest_common::{agent, kernel};
use shim_common::Fixture;

const BUSYBOX: &str = "burstvm.local/busybox:1";

fn describe(what: &str, o: &Output) -> String {
    format!(
        "{what}: status {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The EROFS images in the cache, with inode and mtime (a rebuild replaces the file).
fn images(cache: &Path) -> Vec<(PathBuf, u64, i64)> {
    let mut v: Vec<_> = std::fs::read_dir(cache)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "erofs"))
        .map(|p| {
            let m = std::fs::metadata(&p).unwrap();
            (p, m.ino(), m.mtime_nsec() + m.mtime() * 1_000_000_000)
        })
        .collect();
    v.sort();
    v
}

/// Waits until `ctr task ls` shows `id` RUNNING; panics with `run`'s output
/// if it ends first.
fn wait_running(f: &Fixture, id: &str, run: &mut std::process::Child) {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let ls = f.ctr(&["task", "ls"]).output().unwrap();
        let ls = String::from_utf8_lossy(&ls.stdout).into_owned();
        if ls
            .lines()
            .any(|l| l.starts_with(id) && l.contains("RUNNING"))
        {
            return;
        }
        if let Ok(Some(st)) = run.try_wait() {
            let mut err = String::new();
            let _ = run.stderr.take().unwrap().read_to_string(&mut err);
            panic!("ctr run {id} ended ({st}) before running: {err}");
        }
        assert!(Instant::now() < deadline, "{id} not running: {ls}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Linux guests' state directories, removed when a failed test has left
/// them (dropped after the fixture: its shims and VMMs are gone by then).
struct StateDirs(Vec<String>);

impl Drop for StateDirs {
    fn drop(&mut self) {
        for sb in &self.0 {
            let d = Path::new(shim::service::STATE_ROOT).join(format!("shim-{sb}"));
            if d.exists() {
                shim::task::remove_state_dir(&d);
            }
        }
    }
}

#[test]
fn ctr_runs_containers_in_linux_guests() {
    assert!(Path::new("/dev/kvm").exists(), "/dev/kvm is required");
    // The agent: $BURSTVM_AGENT (as burstvm run takes it), else built here.
    let agent = agent();
    let kernel = kernel();
    let ns = format!("bvt{}", std::process::id());
    let _state = StateDirs(vec![
        shim::sandbox_id(&ns, "l1"),
        shim::sandbox_id(&ns, "l2"),
    ]);
    let f = Fixture::new("linux", 4);
    assert_eq!(f.ns, ns);
    f.import("busybox.tar");
    let cfg = f.write_linux_config(&kernel, &agent, "fastiov", "128M");

    // 1. The process's stdout and stderr, its exit status; env (image's and
    // --env), cwd, HOME from the image's passwd; --memory-limit is the
    // guest's RAM (the config says 128M). No network: the annotation.
    let l1 = f.sandbox_id("l1");
    let out = f
        .ctr_run_with(
            &cfg,
            BUSYBOX,
            "l1",
            &[
                "--rm",
                "--env",
                "FOO=bar",
                "--cwd",
                "/tmp",
                "--memory-limit",
                "200000000",
                "--annotation",
                "io.burstvm.variant=no-net",
            ],
            &[
                "sh",
                "-c",
                "echo hello; echo image=$BURSTVM_IMAGE foo=$FOO home=$HOME; pwd; id -u; \
                 grep MemTotal /proc/meminfo; echo to-stderr >&2; exit 3",
            ],
        )
        .output()
        .unwrap();
    let what = format!("ctr run l1\ncontainerd: {}", f.containerd.log_tail());
    assert_eq!(out.status.code(), Some(3), "{}", describe(&what, &out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.starts_with("hello\nimage=busybox foo=bar home=/root\n/tmp\n0\nMemTotal:"),
        "{}",
        describe(&what, &out)
    );
    let mem_kib: u64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(
        (150_000..200_000).contains(&mem_kib),
        "a 191 MiB guest: MemTotal {mem_kib} kB"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("to-stderr"),
        "{}",
        describe(&what, &out)
    );
    let stages = f.trace_stages(&l1);
    for s in ["cgroup", "rootfs", "vmm-spawn", "boot", "ready"] {
        assert!(
            stages.iter().any(|x| x == s),
            "{l1}: stage {s} in {stages:?}"
        );
    }
    let left = f.wait_clean(std::slice::from_ref(&l1), Duration::from_secs(20));
    assert!(left.is_empty(), "after ctr run --rm l1: {left:?}");
    let built = images(&f.image_cache());
    assert_eq!(built.len(), 1, "the busybox image: {built:?}");
    // A host directory bound into the container is refused at create, named
    // (the guest shares no file system with the host).
    let out = f
        .ctr_run_with(
            &cfg,
            BUSYBOX,
            "m1",
            &[
                "--rm",
                "--mount",
                "type=bind,src=/tmp,dst=/data,options=rbind:ro",
            ],
            &["true"],
        )
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("/data") && err.contains("cannot be honoured"),
        "{}",
        describe("ctr run --mount", &out)
    );
    let left = f.wait_clean(&[f.sandbox_id("m1")], Duration::from_secs(10));
    assert!(left.is_empty(), "after a refused create: {left:?}");

    // 2. A long-running container (a VF: fastiov) with --cpus: exec'd
    // processes beside it, a terminal, pids, metrics; SIGKILL gives 137.
    let l2 = f.sandbox_id("l2");
    let mut run = f
        .ctr_run_with(
            &cfg,
            BUSYBOX,
            "l2",
            &["--rm", "--cpus", "0.5"],
            &["sh", "-c", "echo main started; exec sleep 1000"],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_running(&f, "l2", &mut run);
    // The second container of the image found it built: same file, not rewritten.
    assert_eq!(images(&f.image_cache()), built, "the image was rebuilt");
    // --cpus is the sandbox cgroup's CPU limit (v2 cpu.max, v1 cfs quota).
    let quota: Vec<String> = runtime::cgroup::Layout::detect()
        .unwrap()
        .dirs(&l2)
        .iter()
        .flat_map(|d| [d.join("cpu.max"), d.join("cpu.cfs_quota_us")])
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .collect();
    assert!(
        quota
            .iter()
            .any(|c| c.starts_with("50000 100000") || c.trim() == "50000"),
        "CPU quota of {l2}: {quota:?}"
    );
    let exec = f
        .ctr(&[
            "task",
            "exec",
            "--exec-id",
            "e1",
            "--cwd",
            "/home/app",
            "l2",
            "sh",
            "-c",
            "echo from exec; pwd; echo $BURSTVM_IMAGE; ip -4 addr show eth0 | grep -c inet; exit 4",
        ])
        .output()
        .unwrap();
    assert_eq!(
        exec.status.code(),
        Some(4),
        "{}",
        describe("exec e1", &exec)
    );
    assert_eq!(
        String::from_utf8_lossy(&exec.stdout),
        "from exec\n/home/app\nbusybox\n1\n",
        "{}",
        describe("exec e1", &exec)
    );
    // A terminal: ctr -t needs one of its own, script(1) gives it.
    let ctr_exec_t = format!(
        "ctr --address {} -n {} task exec -t --exec-id e2 l2 sh -c 'tty; echo tty done'",
        f.containerd.socket().display(),
        f.ns
    );
    let tty = Command::new("script")
        .args(["-qec", &ctr_exec_t, "/dev/null"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let tty_out = String::from_utf8_lossy(&tty.stdout);
    assert!(
        tty.status.success() && tty_out.contains("/dev/pts/") && tty_out.contains("tty done"),
        "{}",
        describe("exec -t e2", &tty)
    );
    let ps = f.ctr(&["task", "ps", "l2"]).output().unwrap();
    let pids = String::from_utf8_lossy(&ps.stdout)
        .lines()
        .skip(1)
        .filter(|l| !l.trim().is_empty())
        .count();
    assert!(pids >= 1, "{}", describe("task ps", &ps));
    let metrics = f.ctr(&["task", "metrics", "l2"]).output().unwrap();
    assert!(
        metrics.status.success() && String::from_utf8_lossy(&metrics.stdout).contains("memory"),
        "{}",
        describe("task metrics", &metrics)
    );
    // A program the image does not have: the exec fails, named; the task runs on.
    let missing = f
        .ctr(&["task", "exec", "--exec-id", "e3", "l2", "/no/such/program"])
        .output()
        .unwrap();
    assert!(
        !missing.status.success()
            && String::from_utf8_lossy(&missing.stderr).contains("/no/such/program"),
        "{}",
        describe("exec e3", &missing)
    );
    let pause = f.ctr(&["task", "pause", "l2"]).output().unwrap();
    assert!(
        !pause.status.success()
            && String::from_utf8_lossy(&pause.stderr).contains("pause is not supported"),
        "{}",
        describe("task pause", &pause)
    );
    let kill = f
        .ctr(&["task", "kill", "-s", "SIGKILL", "l2"])
        .output()
        .unwrap();
    assert!(kill.status.success(), "{}", describe("task kill", &kill));
    let out = run.wait_with_output().unwrap();
    let what = format!("ctr run l2\ncontainerd: {}", f.containerd.log_tail());
    assert_eq!(out.status.code(), Some(137), "{}", describe(&what, &out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("main started"),
        "{}",
        describe(&what, &out)
    );
    let left = f.wait_clean(&[l1.clone(), l2.clone()], Duration::from_secs(20));
    assert!(left.is_empty(), "after ctr run --rm l2: {left:?}");

    // 3. A shim SIGKILLed while its guest boots takes the VMM with it;
    // containerd's `shim delete` removes the rest (the writable layers'
    // mount and the state directory included). No boot to the end.
    let l3 = f.sandbox_id("l3");
    let mut run = f
        .ctr_run_with(&cfg, BUSYBOX, "l3", &["-d"], &["sleep", "1000"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while runtime::vmmproc::processes(|s| s == l3.as_bytes()).is_empty() {
        assert!(Instant::now() < deadline, "no VMM for {l3}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let state = Path::new(shim::service::STATE_ROOT).join(format!("shim-{l3}"));
    assert!(
        !shim::containerd::mounts_under(&state).is_empty(),
        "the writable layers are mounted under {}",
        state.display()
    );
    let shims = f.containerd.shim_pids();
    assert_eq!(shims.len(), 1, "l3's shim alone: {shims:?}");
    // SAFETY: kill(2) on the shim our containerd started for l3.
    unsafe { libc::kill(shims[0] as i32, libc::SIGKILL) };
    let st = testutil::wait_exit(&mut run, Duration::from_secs(60));
    assert!(!st.success(), "ctr run -d l3 after its shim died: {st}");
    let left = f.wait_clean(&[l1, l2, l3], Duration::from_secs(30));
    assert!(
        left.is_empty(),
        "after SIGKILL of l3's shim: {left:?}\n{}",
        f.containerd.log_tail()
    );
    let _ = f.ctr(&["task", "delete", "l3"]).output();
    assert!(f
        .ctr(&["container", "rm", "l3"])
        .status()
        .unwrap()
        .success());
}
