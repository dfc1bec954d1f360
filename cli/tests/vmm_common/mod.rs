// Shared helpers for the vmm_* integration tests (included with `mod`).
#![allow(dead_code)]

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

#[allow(unused_imports)] // not every vmm_* test attaches a tap
pub use testutil::tap::open_tap;

pub fn burstvm() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_burstvm"));
    c.arg("vmm");
    c.stdin(Stdio::null());
    c
}

/// A unique name per test process and tag (tap names must stay < 16 bytes).
pub fn unique(tag: &str) -> String {
    format!("{tag}{}", std::process::id() % 100_000)
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

pub fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("spawn burstvm")
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub fn kvm_available() -> bool {
    Path::new("/dev/kvm").exists()
}

pub fn stages(trace: &Path) -> Vec<(String, String, u64, u64)> {
    let s = std::fs::read_to_string(trace).expect("trace file");
    s.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("trace line is JSON");
            (
                v["sandbox"].as_str().unwrap().to_string(),
                v["stage"].as_str().unwrap().to_string(),
                v["start_ns"].as_u64().unwrap(),
                v["end_ns"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Deletes the tap when the test ends, also on failure.
pub struct TapGuard(pub String);

impl Drop for TapGuard {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.0]).status();
    }
}

/// Creates tap `name` (down, unconfigured) for the test.
pub fn add_tap(name: &str) -> TapGuard {
    let st = Command::new("ip")
        .args(["tuntap", "add", "dev", name, "mode", "tap"])
        .status()
        .unwrap();
    assert!(st.success(), "ip tuntap add {name}");
    TapGuard(name.to_string())
}

#[allow(unused_imports)] // not every vmm_* test spawns a child
pub use testutil::{wait_exit, ChildGuard};

/// Where the tiny test kernels load by default (1 MiB, the lowest the VMM allows).
pub const LOW_LOAD: u64 = 0x10_0000;

/// `vmm::tiny_guest::elf(load, code)` written to `dir/name`.
pub fn tiny_elf(dir: &Path, name: &str, load: u64, code: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, vmm::tiny_guest::elf(load, code)).unwrap();
    p
}

/// `outl DATA=data; outb EVENT=event; jmp .`
pub fn agent_event(event: u8, data: u32) -> Vec<u8> {
    let mut c = vec![0x66, 0xba, 0x04, 0x0f, 0xb8]; // mov dx, 0x0f04; mov eax, imm32
    c.extend_from_slice(&data.to_le_bytes());
    c.extend_from_slice(&[0xef, 0x66, 0xba, 0x00, 0x0f, 0xb0, event, 0xee]); // out; mov dx, 0x0f00; mov al, ev; out
    c.extend_from_slice(&[0xeb, 0xfe]);
    c
}

/// A pipe whose write end the child inherits (no O_CLOEXEC): `--ready-fd`.
pub fn ready_pipe() -> (std::fs::File, OwnedFd) {
    let mut fds = [0i32; 2];
    // SAFETY: pipe writes two descriptors into the array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: both descriptors were just created and are owned here.
    unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            OwnedFd::from_raw_fd(fds[1]),
        )
    }
}

/// Reads the VMM's READY line (`vmm::Ready`) from its ready pipe; also
/// returns what came after it in the same reads.
pub fn read_ready_and_rest(rd: &mut std::fs::File) -> (vmm::Ready, Vec<u8>) {
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    loop {
        if let Some(r) = vmm::Ready::parse(&got) {
            let end = got.iter().position(|&b| b == b'\n').unwrap();
            return (r.unwrap(), got.split_off(end + 1));
        }
        let n = rd.read(&mut buf).unwrap();
        assert!(n > 0, "the ready pipe closed after {got:?}");
        got.extend_from_slice(&buf[..n]);
    }
}

/// As `read_ready_and_rest`, the READY line alone.
pub fn read_ready(rd: &mut std::fs::File) -> vmm::Ready {
    read_ready_and_rest(rd).0
}
