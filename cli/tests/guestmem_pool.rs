//! `burstvm pool` (standalone page-pool server) and `burstvm bench memory`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use guestmem::pool::PoolClient;
use guestmem::{GuestMemory, MemoryPolicy, MemorySource, RegionSpec};

const BIN: &str = env!("CARGO_BIN_EXE_burstvm");

fn wait_for(path: &std::path::Path) {
    let t = Instant::now();
    while !path.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One server per socket: a second `burstvm pool` on the same socket exits
/// non-zero naming the first's pid, and the first serves on (its socket is
/// not replaced); once the first is SIGKILLed, its successor starts at once.
#[test]
fn a_second_pool_server_on_the_same_socket_is_refused_until_the_first_dies() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("pool.sock");
    let serve = || {
        let mut cmd = Command::new(BIN);
        cmd.args(["pool", "--socket"])
            .arg(&sock)
            .args(["--fill", "4M:1"]);
        cmd
    };
    let mut first = testutil::ChildGuard(serve().stderr(Stdio::null()).spawn().unwrap());
    wait_for(&sock);
    let ctl = PoolClient::connect(&sock).unwrap();
    let inode = |p: &std::path::Path| std::os::unix::fs::MetadataExt::ino(&p.metadata().unwrap());
    let ino = inode(&sock);
    testutil::assert_refused_owner(&mut serve(), first.0.id(), Duration::from_secs(30));
    assert_eq!(inode(&sock), ino, "the first server's socket was replaced");
    assert_eq!(ctl.stats().unwrap().cached_memfds, 1, "the first serves on");
    let again = PoolClient::connect(&sock).unwrap();
    assert_eq!(again.stats().unwrap().cached_memfds, 1);
    drop((ctl, again));

    first.0.kill().unwrap();
    first.0.wait().unwrap();
    let next = testutil::ChildGuard(serve().stderr(Stdio::null()).spawn().unwrap());
    let c = testutil::poll_until("the successor serving", Duration::from_secs(30), || {
        PoolClient::connect(&sock).map_err(|e| e.to_string())
    });
    assert_eq!(c.stats().unwrap().cached_memfds, 1);
    let lock = std::fs::read_to_string(dir.path().join("pool.sock.lock")).unwrap();
    assert_eq!(lock.trim(), next.0.id().to_string());
}

#[test]
fn pool_server_serves_dirty_memory_and_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("pool.sock");
    let server = Command::new(BIN)
        .args(["pool", "--socket"])
        .arg(&sock)
        .args(["--fill", "4M:2", "--fill-pattern", "0xA5", "--max", "64M"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(&sock);
    let ctl = PoolClient::connect(&sock).unwrap();
    let st = ctl.stats().unwrap();
    assert_eq!((st.cached_memfds, st.max_bytes), (2, Some(64 << 20)));

    // A sandbox under lazy gets that dirty memory and never sees the pattern.
    let spec = RegionSpec {
        name: "ram".into(),
        gpa: 0,
        size: 4 << 20,
        dma: true,
    };
    let c = PoolClient::connect(&sock).unwrap();
    let mut gm =
        GuestMemory::new(&[spec], MemoryPolicy::Lazy, MemorySource::Pool(c), false).unwrap();
    gm.dma_map("ram").unwrap();
    let r = &gm.regions()[0];
    assert!(r.pooled());
    // SAFETY: the guest view maps the whole 4 MiB region readable while
    // `gm` lives, and it lives until after the slice's last use.
    let view = unsafe { std::slice::from_raw_parts(r.guest_view_ptr(), 4 << 20) };
    assert!(view.iter().all(|b| *b == 0));
    assert_eq!(ctl.stats().unwrap().lent_memfds, 1);
    drop(gm);
    let t = Instant::now();
    while ctl.stats().unwrap().lent_memfds != 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "memory never came back"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(ctl.shrink_count(1).unwrap(), 1);
    drop(ctl);

    // Client mode against the running server: shrink, then stats as JSON.
    let out = Command::new(BIN)
        .args(["pool", "--socket"])
        .arg(&sock)
        .args(["--shrink-percent", "100", "--stats"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("released 1 memfds"), "{stdout}");
    let json: serde_json::Value =
        serde_json::from_str(&stdout[stdout.find('{').unwrap()..]).unwrap();
    assert_eq!(json["cached_memfds"], 0);
    assert_eq!(json["released"], 2);

    // SIGTERM: clean exit, socket removed.
    // SAFETY: kill(2) on our own, not yet reaped child.
    unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
    let out = server.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!sock.exists());
    assert!(
        !dir.path().join("pool.sock.lock").exists(),
        "lock file left"
    );

    // Bad arguments: clear error naming the flag.
    let out = Command::new(BIN)
        .args(["pool", "--socket"])
        .arg(&sock)
        .args(["--fill", "4M"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--fill"));
}

#[test]
fn bench_memory_prints_a_row_per_policy() {
    let out = Command::new(BIN)
        .args([
            "bench",
            "memory",
            "--size",
            "8M",
            "--runs",
            "1",
            "--concurrency",
            "2",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Side by side: every pool policy with the pool's pinning and without (vanilla never
    // takes pool memory: one row).
    let labels: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.split("  ").next())
        .collect();
    for p in [
        "vanilla",
        "pre10",
        "pre50",
        "pre100",
        "lazy",
        "pre10 unpinned",
        "pre50 unpinned",
        "pre100 unpinned",
        "lazy unpinned",
    ] {
        assert_eq!(
            labels.iter().filter(|l| **l == p).count(),
            1,
            "one row for {p:?}:\n{stdout}"
        );
    }
    assert!(!stdout.contains("vanilla unpinned"), "{stdout}");
    for (flag, value) in [("--policy", "fast"), ("--pool-pinning", "sometimes")] {
        let out = Command::new(BIN)
            .args(["bench", "memory", flag, value])
            .output()
            .unwrap();
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains(flag));
    }
}
