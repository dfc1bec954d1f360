//! The agent binary as PID 1, on the host: in new PID, mount, UTS, network
//! and IPC namespaces, chrooted into a tmpfs that stands in for the
//! initramfs, with the container image (EROFS) and the writable layer (ext4)
//! on loop devices. Its boot steps run as in a guest — early mounts, overlay
//! root, /etc files, switch_root, host name, network — and it serves on Unix
//! sockets (`burstvm_unix_dir`) inside the container root, reached through
//! /proc/PID/root. `Shutdown` ends it: reboot(2) in a PID namespace kills the
//! namespace's init instead of powering anything off. CAP_SYS_RAWIO is
//! dropped, so the agent port stays closed (no port I/O on the host).
//!
//! Needs root, unshare/setpriv (util-linux), mkfs.erofs, mkfs.ext4, debugfs,
//! losetup; skipped otherwise.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::io::Read;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use agent_proto::{Client, CreateProcess, Endpoint, Process, StreamKind};

const T: Duration = Duration::from_secs(20);

fn tool(name: &str) -> Option<PathBuf> {
    let o = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .ok()?;
    let p = String::from_utf8(o.stdout).ok()?.trim().to_string();
    (o.status.success() && !p.is_empty()).then(|| PathBuf::from(p))
}

fn sh(script: &str) {
    let o = Command::new("sh").args(["-c", script]).output().unwrap();
    assert!(
        o.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn out(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// Copies `bin` and the shared libraries `ldd` names into `root`, at the
/// same paths.
fn copy_with_libs(bin: &Path, root: &Path, as_path: &Path) {
    let put = |from: &Path, to: &Path| {
        let dst = root.join(to.strip_prefix("/").unwrap());
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(from, &dst).unwrap();
    };
    put(bin, as_path);
    let list = Command::new("ldd").arg(bin).output().unwrap();
    for line in String::from_utf8_lossy(&list.stdout).lines() {
        let path = line
            .split_whitespace()
            .find(|w| w.starts_with('/'))
            .map(PathBuf::from);
        if let Some(p) = path {
            put(&p, &p);
        }
    }
}

struct Cleanup {
    loops: Vec<String>,
    child: Option<Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
        for l in &self.loops {
            let _ = Command::new("losetup").args(["-d", l]).status();
        }
    }
}

fn losetup(file: &Path, ro: bool) -> String {
    let mut c = Command::new("losetup");
    c.args(["--find", "--show"]);
    if ro {
        c.arg("--read-only");
    }
    out(c.arg(file)).trim().to_string()
}

#[test]
fn agent_as_pid1_mounts_switches_root_and_serves() {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipped: not root");
        return;
    }
    let tools = [
        "unshare",
        "setpriv",
        "chroot",
        "mkfs.erofs",
        "mkfs.ext4",
        "debugfs",
        "losetup",
        "ldd",
    ];
    if let Some(t) = tools.iter().find(|t| tool(t).is_none()) {
        eprintln!("skipped: no {t}");
        return;
    }
    if !Command::new("losetup")
        .arg("--find")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        eprintln!("skipped: no free loop device");
        return;
    }
    let dir = std::env::temp_dir().join(format!("agent-pid1-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut cleanup = Cleanup {
        loops: Vec::new(),
        child: None,
    };

    // The container image: a shell, cat, and files of its own.
    let img = dir.join("image");
    for b in ["/bin/sh", "/bin/cat"] {
        let real = std::fs::canonicalize(b).unwrap();
        copy_with_libs(&real, &img, Path::new(b));
    }
    std::fs::create_dir_all(img.join("etc")).unwrap();
    std::fs::write(img.join("etc/image-file"), "from the image\n").unwrap();
    symlink("../run/resolved/stub", img.join("etc/resolv.conf")).unwrap();
    let erofs = dir.join("image.erofs");
    out(Command::new("mkfs.erofs").arg(&erofs).arg(&img));
    let ro = losetup(&erofs, true);
    cleanup.loops.push(ro.clone());
    // The writable layer.
    let ext4 = dir.join("rw.ext4");
    std::fs::File::create(&ext4)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    out(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&ext4));
    let rw = losetup(&ext4, false);
    cleanup.loops.push(rw.clone());

    // The stand-in initramfs: the agent as /init, with its libraries (the
    // test build is not static).
    let stage = dir.join("initramfs");
    copy_with_libs(
        Path::new(env!("CARGO_BIN_EXE_burstvm-agent")),
        &stage,
        Path::new("/init"),
    );
    let mnt = dir.join("root");
    std::fs::create_dir_all(&mnt).unwrap();
    let chroot = tool("chroot").unwrap();
    let script = format!(
        "set -e; mount -t tmpfs initramfs {mnt}; cp -a {stage}/. {mnt}/; \
         exec env -i burstvm_ro={ro} burstvm_rw={rw} burstvm_hostname=pid1-test \
         burstvm_dns=192.0.2.53 burstvm_unix_dir=/run/agent {chroot} {mnt} /init",
        mnt = mnt.display(),
        stage = stage.display(),
        chroot = chroot.display(),
    );
    let mut child = Command::new("unshare")
        .args([
            "--pid",
            "--mount",
            "--uts",
            "--net",
            "--ipc",
            "--fork",
            "--kill-child",
        ])
        .args(["setpriv", "--bounding-set", "-sys_rawio", "--", "sh", "-c"])
        .arg(&script)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut console = child.stderr.take().unwrap();
    let console = thread::spawn(move || {
        let mut s = String::new();
        let _ = console.read_to_string(&mut s);
        s
    });
    let upid = child.id();
    cleanup.child = Some(child);

    // The namespace's init is unshare's child.
    let deadline = Instant::now() + T;
    let sockets = loop {
        let kids = std::fs::read_to_string(format!("/proc/{upid}/task/{upid}/children"))
            .unwrap_or_default();
        if let Some(pid) = kids.split_whitespace().next() {
            let d = PathBuf::from(format!("/proc/{pid}/root/run/agent"));
            if d.join("stdio.sock").exists() {
                break d;
            }
        }
        let exited = cleanup.child.as_mut().unwrap().try_wait().unwrap();
        if exited.is_some() || Instant::now() > deadline {
            drop(cleanup);
            panic!(
                "agent not serving (exited: {exited:?}); console:\n{}",
                console.join().unwrap()
            );
        }
        thread::sleep(Duration::from_millis(50));
    };
    let mut c = Client::connect(
        &Endpoint::Unix(sockets.join("control.sock")),
        Some(Endpoint::Unix(sockets.join("stdio.sock"))),
        T,
    )
    .unwrap();

    let run = |c: &mut Client, id: &str, script: &str| -> (String, i32) {
        let mut p = Process::from_args(["/bin/sh", "-c", script]);
        p.env = vec!["PATH=/bin".into()];
        c.create_process(&CreateProcess::new(id, p)).unwrap();
        let mut so = c.attach_stream(id, StreamKind::Stdout).unwrap();
        let mut se = c.attach_stream(id, StreamKind::Stderr).unwrap();
        c.start_process(id).unwrap();
        let mut o = String::new();
        so.read_to_string(&mut o).unwrap();
        let mut e = String::new();
        se.read_to_string(&mut e).unwrap();
        let exit = c.wait_process(id, Some(T)).unwrap();
        assert!(e.is_empty(), "{id}: stderr {e}");
        (o, exit.status)
    };
    let (o, s) = run(
        &mut c,
        "etc",
        "cat /etc/image-file /etc/hostname /etc/resolv.conf; cat /proc/sys/kernel/hostname",
    );
    assert_eq!(s, 0);
    assert_eq!(
        o,
        "from the image\npid1-test\nnameserver 192.0.2.53\npid1-test\n"
    );
    let (o, s) = run(
        &mut c,
        "root",
        "echo written > /new-file && cat /new-file; cat /proc/1/cmdline; echo; \
         test -c /dev/null && echo dev; test -c /dev/pts/ptmx && echo pts; \
         test -d /dev/shm && echo shm; test -d /sys/kernel && echo sys; \
         test -e /init || echo no-initramfs",
    );
    assert_eq!(s, 0);
    assert_eq!(o, "written\n/init\0\ndev\npts\nshm\nsys\nno-initramfs\n");
    c.shutdown().unwrap();
    drop(c);

    let mut child = cleanup.child.take().unwrap();
    let deadline = Instant::now() + T;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("agent did not end after Shutdown");
        }
        thread::sleep(Duration::from_millis(50));
    };
    let console = console.join().unwrap();
    assert!(console.contains("powering off"), "{status:?}: {console}");
    assert!(console.contains("events skipped"), "{console}");

    // The writes went to the writable layer's upper directory.
    sh(&format!("sync; blockdev --flushbufs {rw} || true"));
    let cat = |p: &str| {
        out(Command::new("debugfs")
            .args(["-R", &format!("cat {p}")])
            .arg(&ext4))
    };
    assert_eq!(cat("/upper/new-file"), "written\n");
    assert_eq!(cat("/upper/etc/hostname"), "pid1-test\n");
    drop(cleanup);
    std::fs::remove_dir_all(&dir).unwrap();
}
