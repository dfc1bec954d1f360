//! Linux guests. Debian's installed kernel (linux-image-amd64): the vmlinux
//! is extracted from /boot/vmlinuz-* here, as the kernel's
//! scripts/extract-vmlinux does, and the serial console must show
//! `Linux version` (and the kernel must find the VMM's MP table). burstvm's
//! condensed kernel (scripts/build-guest-kernel.sh) must mount the EROFS
//! root from virtio-blk and start init. Each test stops the VMM with
//! SIGTERM once its lines are seen (a full boot takes long on this host).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod guest_common;
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

/// Starts `burstvm vmm ARGS`, waits until the console shows every line of
/// `want` (or `limit` passes), stops it with SIGTERM. Returns whether all
/// were seen, the console and the VMM's stderr.
fn boot_until(args: &[&str], want: &[&str], limit: Duration) -> (bool, String, String) {
    let mut child = burstvm()
        .args(args)
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
        if want.iter().all(|w| c.contains(w)) {
            break true;
        }
        let left = limit.saturating_sub(start.elapsed());
        if left.is_zero() {
            break false;
        }
        match rx.recv_timeout(left) {
            Ok(b) => console.extend_from_slice(&b),
            Err(_) => break false,
        }
    };
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    (seen, text(&console), text(&out.stderr))
}

#[test]
fn linux_kernel_prints_its_banner_on_the_serial_console() {
    assert!(kvm_available(), "/dev/kvm is required");
    let dir = tempdir();
    let vmlinux = extract_vmlinux(dir.path());
    let sb = unique("vmmlinux");
    let (seen, console, stderr) = boot_until(
        &[
            "--sandbox",
            &sb,
            "--memory",
            "256M",
            "--timeout",
            "0",
            "--kernel",
            vmlinux.to_str().unwrap(),
        ],
        // The banner, then the kernel finding the VMM's MP table (CPU count).
        &["Linux version", "found SMP MP-table"],
        Duration::from_secs(60),
    );
    assert!(
        seen,
        "no `Linux version` + MP table within 60 s; console: {console}\nstderr: {stderr}"
    );
    // Stopped before READY: the message says why.
    assert!(stderr.contains("SIGTERM"), "{stderr}");
}

/// The condensed kernel, built and cached by scripts/build-guest-kernel.sh
/// (scripts/setup.sh runs it).
fn condensed_kernel() -> PathBuf {
    PathBuf::from(guest_common::kernel())
}

/// `burstvm rootfs build --init` of the directory `src` (cache under
/// `dir`); the EROFS image's path.
fn image_with_init(dir: &Path, src: &Path) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_burstvm"))
        .args(["rootfs", "build", "--init", "--cache"])
        .arg(dir.join("cache"))
        .arg(src)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    text(&o.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("image   "))
        .unwrap()
        .to_string()
}

#[test]
fn condensed_kernel_mounts_the_erofs_root_from_virtio_blk_and_runs_init() {
    assert!(kvm_available(), "/dev/kvm is required");
    let vmlinux = condensed_kernel();
    let dir = tempdir();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("etc")).unwrap();
    std::fs::write(src.join("etc/os-release"), "NAME=burstvm-linux\n").unwrap();
    let image = image_with_init(dir.path(), &src);
    let rw = dir.path().join("rw.ext4");
    std::fs::File::create(&rw)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    assert!(Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&rw)
        .status()
        .unwrap()
        .success());
    let sb = unique("vmmerofs");
    let ro = format!("path={image},ro");
    let rwd = format!("path={},unlink", rw.display());
    let (seen, console, stderr) = boot_until(
        &[
            "--sandbox",
            &sb,
            "--memory",
            "128M",
            "--timeout",
            "0",
            "--kernel",
            vmlinux.to_str().unwrap(),
            "--cmdline",
            "console=ttyS0 reboot=k panic=-1 root=/dev/vda rootfstype=erofs ro",
            "--disk",
            &ro,
            "--disk",
            &rwd,
        ],
        &[
            "[vda] ",
            "[vdb] ",
            "VFS: Mounted root (erofs filesystem) readonly",
            "Run /sbin/init as init process",
        ],
        Duration::from_secs(120),
    );
    assert!(
        seen,
        "no EROFS root + init within 120 s; console: {console}\nstderr: {stderr}"
    );
    // On a kvm_pvm host the VMM adds what the kernel needs (docs/guest.md).
    if Path::new("/sys/module/kvm_pvm").exists() {
        assert!(
            console.contains("clearcpuid=smap,popcnt,xsave"),
            "{console}"
        );
    }
    assert!(!rw.exists(), "the writable layer is unlinked once open");
}

/// Runs `burstvm vmm ARGS` to its end (SIGKILL after `limit`): its exit
/// code (None if it had to be killed), the console and stderr.
fn boot_to_exit(args: &[&str], limit: Duration) -> (Option<i32>, String, String) {
    let mut child = burstvm()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (mut stdout, mut stderr) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let out = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = stdout.read_to_end(&mut b);
        b
    });
    let err = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = stderr.read_to_end(&mut b);
        b
    });
    let start = Instant::now();
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    (code, text(&out.join().unwrap()), text(&err.join().unwrap()))
}

/// A root directory with Debian's static busybox as /bin/busybox and its
/// applets `sh`, `echo`, `cat` as links (busybox-static, no registry).
fn busybox_root(dir: &Path) -> PathBuf {
    let src = dir.join("busybox-root");
    std::fs::create_dir_all(src.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", src.join("bin/busybox"))
        .expect("/bin/busybox (Debian's busybox-static; scripts/setup.sh installs it)");
    for applet in ["sh", "echo", "cat"] {
        std::os::unix::fs::symlink("busybox", src.join("bin").join(applet)).unwrap();
    }
    src
}

/// The condensed kernel on an EROFS root, burstvm's init running `cmd`
/// (the words after `--` on the kernel command line), to the VM's end.
fn run_in_guest(image: &str, cmd: &str, limit: Duration) -> (Option<i32>, String, String) {
    let vmlinux = condensed_kernel();
    let sb = unique("vmmuser");
    let ro = format!("path={image},ro");
    let cmdline =
        format!("console=ttyS0 reboot=k panic=-1 root=/dev/vda rootfstype=erofs ro -- {cmd}");
    boot_to_exit(
        &[
            "--sandbox",
            &sb,
            "--memory",
            "128M",
            "--timeout",
            "0",
            "--until-exit",
            "--kernel",
            vmlinux.to_str().unwrap(),
            "--cmdline",
            &cmdline,
            "--disk",
            &ro,
        ],
        limit,
    )
}

/// `run_in_guest(image, cmd)`: the console shows `line` and the VMM exits
/// with `code`.
fn assert_runs(image: &str, cmd: &str, line: &str, code: i32, limit: Duration) {
    let (got, console, stderr) = run_in_guest(image, cmd, limit);
    assert!(
        console.contains(line),
        "console: {console}\nstderr: {stderr}"
    );
    assert_eq!(got, Some(code), "console: {console}\nstderr: {stderr}");
}

/// Linux user space (issue 24): busybox's shell runs from the image, its
/// output reaches the serial console and its exit status is the VMM's.
/// Under kvm_pvm this needs guest/linux's patch 0002 (docs/guest.md).
#[test]
fn a_shell_from_the_image_runs_and_its_exit_status_is_the_vms() {
    assert!(kvm_available(), "/dev/kvm is required");
    let dir = tempdir();
    let image = image_with_init(dir.path(), &busybox_root(dir.path()));
    assert_runs(
        &image,
        "/bin/sh -c \"echo hello from user space; exit 3\"",
        "hello from user space",
        3,
        Duration::from_secs(180),
    );
}

/// fork, execve of a static and a dynamic ELF, a pipe between two
/// processes, wait4, SIGCHLD/SIGUSR1 handlers with FPU state kept,
/// SIGKILL, timers, page faults and threads, checked by
/// guest/linux/selftest.c inside the guest.
#[test]
fn fork_exec_pipes_signals_and_threads_work_in_the_guest() {
    assert!(kvm_available(), "/dev/kvm is required");
    let dir = tempdir();
    let src = dir.path().join("selftest-root");
    let bin = src.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../guest/linux/selftest.c");
    for (out, extra) in [("selftest", &["-static"][..]), ("selftest-dyn", &[][..])] {
        let st = Command::new("cc")
            .args(["-O2", "-pthread"])
            .args(extra)
            .arg(&source)
            .arg("-o")
            .arg(bin.join(out))
            .status()
            .unwrap();
        assert!(st.success(), "cc {out}");
    }
    // What the dynamic build needs: its loader and libc, as ldd names them.
    let ldd = Command::new("ldd")
        .arg(bin.join("selftest-dyn"))
        .output()
        .unwrap();
    for lib in text(&ldd.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/'))
    {
        let to = src.join(lib.trim_start_matches('/'));
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(lib, &to).unwrap();
    }
    let image = image_with_init(dir.path(), &src);
    assert_runs(
        &image,
        "/bin/selftest check /bin/selftest-dyn",
        "selftest: ok",
        0,
        Duration::from_secs(300),
    );
}
