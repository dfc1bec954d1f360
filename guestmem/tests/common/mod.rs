#![allow(dead_code)]
//! Helpers shared by the guestmem integration tests.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use guestmem::pool::{Pool, PoolClient, PoolServer, SizeClass};
use guestmem::{GuestMemory, MemoryPolicy, MemorySource, RegionSpec};

/// A previous tenant's byte. Never used as data by the tests.
pub const CANARY: u8 = 0xA5;
pub const PAGE: u64 = 4096;

pub fn socket_path(tag: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    PathBuf::from(format!(
        "/tmp/guestmem-test-{}-{tag}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// A pool server (no idle pre-zeroer, so states are deterministic) holding `count` memfds
/// of `size` bytes filled with the canary.
pub fn canary_pool(tag: &str, size: u64, count: u64) -> PoolServer {
    canary_pool_with(tag, size, count, false)
}

pub fn canary_pool_with(tag: &str, size: u64, count: u64, hugepages: bool) -> PoolServer {
    let pool = Arc::new(Pool::new(None));
    pool.fill(SizeClass { size, hugepages }, count, Some(CANARY))
        .unwrap();
    PoolServer::start_with(socket_path(tag), pool, false).unwrap()
}

pub fn client(server: &PoolServer) -> PoolClient {
    PoolClient::connect(server.path()).unwrap()
}

/// The "ram" region at GPA 0.
pub fn ram(size: u64, dma: bool) -> RegionSpec {
    RegionSpec {
        name: "ram".into(),
        gpa: 0,
        size,
        dma,
    }
}

/// One DMA-capable "ram" region of `size` bytes of fresh memory under `vanilla`.
pub fn fresh_ram(size: u64) -> GuestMemory {
    GuestMemory::new(
        &[ram(size, true)],
        MemoryPolicy::Vanilla,
        MemorySource::Fresh,
        false,
    )
    .unwrap()
}

/// One DMA-capable "ram" region of `size` bytes taken from `server` (no hugepages).
pub fn pool_ram(server: &PoolServer, size: u64, policy: MemoryPolicy) -> GuestMemory {
    GuestMemory::new(
        &[ram(size, true)],
        policy,
        MemorySource::Pool(client(server)),
        false,
    )
    .unwrap()
}

/// Reads every byte of `[ptr, ptr+len)` with volatile loads; returns how many equal `b`.
pub fn count_byte(ptr: *const u8, len: u64, b: u8) -> u64 {
    let mut n = 0;
    for i in 0..len as usize {
        // SAFETY: callers pass a mapped range.
        if unsafe { std::ptr::read_volatile(ptr.add(i)) } == b {
            n += 1;
        }
    }
    n
}

/// Waits (bounded) until the server has no clients left.
pub fn wait_no_clients(server: &PoolServer) {
    for _ in 0..5000 {
        if server.clients() == 0 {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    panic!("pool server still has {} clients", server.clients());
}

/// Duplicates `fd` without O_CLOEXEC so a child process inherits it; returns the number.
pub fn inheritable(fd: BorrowedFd<'_>) -> i32 {
    // SAFETY: dup of a valid fd; the result is closed by `close_fd`.
    let d = unsafe { libc::dup(fd.as_raw_fd()) };
    assert!(d >= 0);
    d
}

pub fn close_fd(fd: i32) {
    // SAFETY: closes an fd we own.
    unsafe {
        libc::close(fd);
    }
}

/// Re-runs this test binary as a child process executing only `test`, with `env` set.
pub fn child(test: &str, env: &[(&str, String)]) -> std::process::Command {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Runs `test` as a child (see [`child`]) and asserts that it exits 0 having printed `marker`.
pub fn assert_child_prints(test: &str, env: &[(&str, String)], marker: &str) {
    let out = child(test, env).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains(marker),
        "child: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
