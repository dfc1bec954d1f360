//! Boots Debian's installed kernel (linux-image-amd64): the vmlinux is
//! extracted from /boot/vmlinuz-* here, as the kernel's
//! scripts/extract-vmlinux does, and the serial console must show
//! `Linux version` (and the kernel must find the VMM's MP table). A full
//! boot takes minutes on this nested host, so the
//! test stops the VMM with SIGTERM once the banner is seen.

mod vmm_common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use vmm_common::*;

/// (magic, decompressor argv) as in scripts/extract-vmlinux.
const FORMATS: &[(&[u8], &[&str])] = &[
    (&[0xfd, b'7', b'z', b'X', b'Z', 0x00], &["xz", "-dc"]),
    (&[0x28, 0xb5, 0x2f, 0xfd], &["zstd", "-dc"]),
    (&[0x1f, 0x8b, 0x08], &["gzip", "-dc"]),
];

fn decompress(argv: &[&str], data: &[u8]) -> Vec<u8> {
    let mut child = match Command::new(argv[0])
        .args(&argv[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
    {
        Ok(c) => c,
        Err(_) => return Vec::new(),
    };
    let mut stdin = child.stdin.take().unwrap();
    let data = data.to_vec();
    // Trailing bytes after the payload make the tool complain; its output is still whole.
    let feeder = std::thread::spawn(move || {
        let _ = stdin.write_all(&data);
    });
    let mut out = Vec::new();
    child.stdout.take().unwrap().read_to_end(&mut out).unwrap();
    let _ = child.wait();
    let _ = feeder.join();
    out
}

fn extract_vmlinux(dir: &Path) -> PathBuf {
    let vmlinuz = std::fs::read_dir("/boot")
        .expect("/boot")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("vmlinuz-")
        })
        .expect("linux-image-amd64 must be installed (/boot/vmlinuz-*)");
    let image = std::fs::read(&vmlinuz).unwrap();
    for (magic, argv) in FORMATS {
        let mut from = 0;
        while let Some(pos) = image[from..].windows(magic.len()).position(|w| w == *magic) {
            let off = from + pos;
            let out = decompress(argv, &image[off..]);
            if out.starts_with(b"\x7fELF") {
                let p = dir.join("vmlinux");
                std::fs::write(&p, out).unwrap();
                return p;
            }
            from = off + 1;
        }
    }
    panic!(
        "no xz/zstd/gzip payload with an ELF inside {}",
        vmlinuz.display()
    );
}

#[test]
fn linux_kernel_prints_its_banner_on_the_serial_console() {
    assert!(kvm_available(), "/dev/kvm is required");
    let dir = tempdir();
    let vmlinux = extract_vmlinux(dir.path());
    let mut child = burstvm()
        .args([
            "--sandbox",
            &unique("vmmlinux"),
            "--memory",
            "256M",
            "--timeout",
            "0",
        ])
        .args(["--kernel", vmlinux.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let start = Instant::now();
    let mut console = Vec::new();
    let seen = loop {
        let c = String::from_utf8_lossy(&console);
        // The banner, then the kernel finding the VMM's MP table (CPU count).
        if c.contains("Linux version") && c.contains("found SMP MP-table") {
            break true;
        }
        let left = Duration::from_secs(60).saturating_sub(start.elapsed());
        if left.is_zero() {
            break false;
        }
        match rx.recv_timeout(left) {
            Ok(b) => console.extend_from_slice(&b),
            Err(mpsc::RecvTimeoutError::Timeout) => break false,
            Err(mpsc::RecvTimeoutError::Disconnected) => break false,
        }
    };
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert!(
        seen,
        "no `Linux version` + MP table within 60 s; console: {}\nstderr: {stderr}",
        text(&console)
    );
    // Stopped before READY: non-zero, and the message says why.
    assert!(!out.status.success());
    assert!(stderr.contains("SIGTERM"), "{stderr}");
}
