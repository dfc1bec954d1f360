//! Resources of a running VMM are released when it ends: the tap it
//! attached, and the pool memory it took (`--pool-socket`, lazy zeroing);
//! loading a kernel touches only the pages it writes.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod vmm_common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vmm_common::*;

#[test]
fn sigterm_releases_the_tap() {
    assert!(kvm_available(), "/dev/kvm is required");
    let name = unique("bvrel");
    let _tap = add_tap(&name);
    let child = burstvm()
        .args([
            "--sandbox",
            &unique("vmmrel"),
            "--timeout",
            "0",
            "--net",
            &format!("tap:{name}"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut vmm = ChildGuard(child);
    // Wait until the VMM holds the tap (attaching it ourselves fails with EBUSY).
    let t = Instant::now();
    loop {
        match open_tap(&name) {
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => break,
            Ok(f) => drop(f),
            Err(e) => panic!("attach {name}: {e}"),
        }
        assert!(
            vmm.0.try_wait().unwrap().is_none(),
            "VMM exited before attaching the tap"
        );
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "VMM never attached {name}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(vmm.0.id() as i32, libc::SIGTERM) };
    let status = wait_exit(&mut vmm.0, Duration::from_secs(20));
    let mut err = String::new();
    std::io::Read::read_to_string(vmm.0.stderr.as_mut().unwrap(), &mut err).unwrap();
    // Unless the guest finished first, the signal ended it and the error says so.
    assert!(
        status.success() || err.contains("sandbox"),
        "{status:?}: {err}"
    );
    assert!(
        Path::new("/sys/class/net").join(&name).exists(),
        "VMM deleted a tap it did not create"
    );
    open_tap(&name).expect("tap released after the VMM ended");
}

/// A `burstvm pool` with one 32 MiB memfd at `sock`, once its socket is there.
fn start_pool(sock: &Path) -> ChildGuard {
    let pool = Command::new(env!("CARGO_BIN_EXE_burstvm"))
        .args([
            "pool",
            "--socket",
            sock.to_str().unwrap(),
            "--fill",
            "32M:1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pool = ChildGuard(pool);
    let t = Instant::now();
    while !sock.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "pool socket never appeared"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    pool
}

/// A temporary directory with a pool at `pool.sock` in it (KVM checked first).
fn pool_in_tempdir() -> (tempfile::TempDir, std::path::PathBuf, ChildGuard) {
    assert!(kvm_available(), "/dev/kvm is required");
    let dir = tempdir();
    let sock = dir.path().join("pool.sock");
    let pool = start_pool(&sock);
    (dir, sock, pool)
}

#[test]
fn pool_memory_with_lazy_zeroing_boots_and_goes_back() {
    let (dir, sock, _pool) = pool_in_tempdir();
    let trace = dir.path().join("t.jsonl");
    // Twice: the second VMM gets the memory the first one gave back, still dirty.
    for round in 0..2 {
        let sb = unique(&format!("vmmpool{round}"));
        let out = run(burstvm()
            .env("BURSTVM_LOG", "vmm=info")
            .args(["--sandbox", &sb, "--memory", "32M", "--app-size", "64K"])
            .args([
                "--memory-policy",
                "lazy",
                "--dma-ram",
                "true",
                "--dma-image",
                "false",
            ])
            .args([
                "--pool-socket",
                sock.to_str().unwrap(),
                "--trace",
                trace.to_str().unwrap(),
            ]));
        assert!(out.status.success(), "round {round}: {}", text(&out.stderr));
        let st: Vec<String> = stages(&trace)
            .into_iter()
            .filter(|s| s.0 == sb)
            .map(|s| s.1)
            .collect();
        assert_eq!(st, ["vmm-spawn", "dma-ram", "boot", "app-launch", "ready"]);
        // What the agent touches is what the VMM wrote plus its allocator's first block,
        // all mapped ahead: its boot takes no userfault.
        let err = text(&out.stderr);
        assert!(
            err.contains("lazy zeroing at READY: 0 userfaults"),
            "round {round}: {err}"
        );
    }
}

/// With `--idle-cgroup DIR` the background zeroer writes its own thread id to
/// `DIR/tasks` when it starts (a cgroup-v1 move of that thread alone). A plain
/// directory stands in for the cgroup here, so the write stays on record after the
/// zeroer ends; `runtime`'s `the_idle_cgroup_takes_a_single_thread` moves a thread
/// into the real one.
#[test]
fn the_background_zeroer_joins_the_idle_cgroup() {
    let (dir, sock, _pool) = pool_in_tempdir();
    let idle = dir.path().join("idle");
    std::fs::create_dir(&idle).unwrap();
    let child = burstvm()
        .args(["--sandbox", &unique("vmmidle"), "--memory", "32M"])
        .args(["--memory-policy", "lazy", "--dma-ram", "true"])
        .args(["--pool-socket", sock.to_str().unwrap()])
        .args(["--idle-cgroup", idle.to_str().unwrap(), "--keep-running"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut vmm = ChildGuard(child);
    let pid = vmm.0.id();
    let tasks = idle.join("tasks");
    let t = Instant::now();
    let tid = loop {
        if let Some(tid) = std::fs::read_to_string(&tasks)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
        {
            break tid;
        }
        assert!(vmm.0.try_wait().unwrap().is_none(), "VMM exited");
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no thread joined {}",
            tasks.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_ne!(tid, pid, "the VMM's main thread moved, not the zeroer");
    if let Ok(name) = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")) {
        assert_eq!(name.trim(), guestmem::ZEROER_THREAD);
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    wait_exit(&mut vmm.0, Duration::from_secs(20));
}

/// A lazy VMM writes "zeroed" on its ready pipe after READY, once its
/// background zeroer has gone over the rest of RAM, and keeps running; its
/// parent waits on the pipe instead of looking for the thread in /proc.
#[test]
fn a_lazy_vmm_says_on_its_ready_pipe_when_the_deferred_zeroing_is_over() {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    let (_dir, sock, _pool) = pool_in_tempdir();
    let (mut rd, wr) = ready_pipe();
    let child = burstvm()
        .args(["--sandbox", &unique("vmmzeroed"), "--memory", "32M"])
        .args(["--memory-policy", "lazy", "--dma-ram", "true"])
        .args(["--pool-socket", sock.to_str().unwrap(), "--keep-running"])
        .args(["--ready-fd", &wr.as_raw_fd().to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    drop(wr);
    let mut vmm = ChildGuard(child);
    let (ready, mut rest) = read_ready_and_rest(&mut rd);
    assert!(ready.vcpu_ns > 0, "{ready:?}");
    // Bounded: the pipe is read on a thread, the test waits at most 60 s.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        while !rest.ends_with(b"\n") {
            match rd.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => rest.extend_from_slice(&buf[..n]),
            }
        }
        let _ = tx.send(rest);
    });
    let line = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("no line after READY within 60 s");
    assert_eq!(line, vmm::ZEROED_LINE.as_bytes());
    assert!(
        vmm.0.try_wait().unwrap().is_none(),
        "the VMM exited: --keep-running"
    );
    // The zeroer went over all of RAM through the device view first: every
    // page of the 32 MiB memfd is mapped in the VMM by then.
    let status = std::fs::read_to_string(format!("/proc/{}/status", vmm.0.id())).unwrap();
    let shmem_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("RssShmem:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    assert!(shmem_kib >= 32 << 10, "RssShmem {shmem_kib} kB");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(vmm.0.id() as i32, libc::SIGTERM) };
    wait_exit(&mut vmm.0, Duration::from_secs(20));
}

/// Peak RSS (KiB) of a VMM that boots `elf` in 64 MiB to READY.
fn peak_rss_kib(elf: &Path) -> i64 {
    // Reaped by wait4 below (for its rusage), not by Child::wait.
    #[allow(clippy::zombie_processes)]
    let child = burstvm()
        .args([
            "--sandbox",
            &unique("vmmrss"),
            "--memory",
            "64M",
            "--kernel",
        ])
        .arg(elf)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it for our own child.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: pid is our child, not yet reaped (Child never waited).
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    assert_eq!(r, pid, "wait4: {}", std::io::Error::last_os_error());
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "VMM failed on {}: status {status}",
        elf.display()
    );
    ru.ru_maxrss
}

#[test]
fn kernel_loaded_at_16m_costs_only_its_own_pages() {
    // The same READY guest at 1 MiB and at 16 MiB (where vmlinux and
    // Firecracker's test guests load): the 15 MiB below the ELF must not be
    // written (it once went through a scratch copy: +18 MiB RSS per VM).
    assert!(kvm_available(), "/dev/kvm is required");
    let dir = tempdir();
    let code = agent_event(0x06, 0);
    let low = tiny_elf(dir.path(), "low.elf", LOW_LOAD, &code);
    let high = tiny_elf(dir.path(), "high.elf", 16 << 20, &code);
    let (lo, hi) = (peak_rss_kib(&low), peak_rss_kib(&high));
    assert!(
        hi < lo + 2048,
        "peak RSS {hi} KiB at 16 MiB against {lo} KiB at 1 MiB"
    );
}
