//! Bad input to `burstvm vmm`: each gets one clear error naming the thing,
//! a non-zero exit, and leaves nothing behind.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod vmm_common;

use std::path::Path;

use vmm_common::*;

fn fails_with(args: &[&str], needles: &[&str]) -> String {
    let out = run(burstvm().args(args));
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    for n in needles {
        assert!(stderr.contains(n), "{args:?}: stderr lacks {n:?}: {stderr}");
    }
    stderr
}

#[test]
fn missing_kvm_device_is_named() {
    let dir = tempdir();
    let trace = dir.path().join("t.jsonl");
    let bad = dir.path().join("no-kvm-here");
    fails_with(
        &[
            "--sandbox",
            "e1",
            "--kvm-device",
            bad.to_str().unwrap(),
            "--trace",
            trace.to_str().unwrap(),
        ],
        &[bad.to_str().unwrap()],
    );
    // Not a KVM device at all: a regular file.
    let file = dir.path().join("plainfile");
    std::fs::write(&file, b"x").unwrap();
    fails_with(
        &["--sandbox", "e1", "--kvm-device", file.to_str().unwrap()],
        &["plainfile"],
    );
    assert!(
        !trace.exists(),
        "trace file created although the VM never started"
    );
}

#[test]
fn non_elf_kernel_is_named() {
    let dir = tempdir();
    let trace = dir.path().join("t.jsonl");
    let k = dir.path().join("bogus-kernel");
    std::fs::write(&k, vec![0x4du8; 8192]).unwrap();
    fails_with(
        &[
            "--sandbox",
            "e2",
            "--kernel",
            k.to_str().unwrap(),
            "--trace",
            trace.to_str().unwrap(),
        ],
        &["bogus-kernel", "not a bootable"],
    );
    // A bzImage is not a vmlinux either: the host's if it has one, else a
    // file with a bzImage's boot sector and setup header magic.
    let vmlinuz = std::fs::read_dir("/boot")
        .ok()
        .and_then(|d| {
            d.filter_map(|e| e.ok())
                .find(|e| e.file_name().to_string_lossy().starts_with("vmlinuz-"))
        })
        .map(|e| e.path())
        .unwrap_or_else(|| {
            let p = dir.path().join("vmlinuz-synthetic");
            let mut b = vec![0u8; 64 << 10];
            b[..2].copy_from_slice(b"MZ");
            b[0x1fe..0x200].copy_from_slice(&[0x55, 0xaa]);
            b[0x202..0x206].copy_from_slice(b"HdrS");
            std::fs::write(&p, b).unwrap();
            p
        });
    fails_with(
        &["--sandbox", "e2", "--kernel", vmlinuz.to_str().unwrap()],
        &[vmlinuz.to_str().unwrap(), "extracted"],
    );
    let missing = dir.path().join("missing-kernel");
    fails_with(
        &["--sandbox", "e2", "--kernel", missing.to_str().unwrap()],
        &["missing-kernel"],
    );
    assert!(!trace.exists());
}

#[test]
fn bad_memory_sizes_are_rejected() {
    fails_with(
        &["--sandbox", "e3", "--memory", "0"],
        &["--memory", "greater than 0"],
    );
    fails_with(
        &["--sandbox", "e3", "--memory", "4G"],
        &["--memory", "3 GiB"],
    );
    fails_with(
        &["--sandbox", "e3", "--memory", "1T"],
        &["--memory", "host can back"],
    );
    fails_with(&["--sandbox", "e3", "--memory", "lots"], &["--memory"]);
}

#[test]
fn other_bad_flags_are_named() {
    fails_with(
        &["--sandbox", "e4", "--memory-policy", "fast"],
        &["--memory-policy"],
    );
    fails_with(
        &["--sandbox", "e4", "--mac", "01:02:03:04:05:06"],
        &["--mac"],
    );
    fails_with(&["--sandbox", "e4", "--ready-fd", "987"], &["--ready-fd"]);
    fails_with(&["--sandbox", &"x".repeat(70)], &["--sandbox"]);
}

#[test]
fn missing_tap_is_named_and_not_created() {
    assert!(kvm_available(), "/dev/kvm is required");
    let name = unique("bvmiss");
    fails_with(
        &["--sandbox", "e5", "--net", &format!("tap:{name}")],
        &[&name, "no such interface"],
    );
    assert!(
        !Path::new("/sys/class/net").join(&name).exists(),
        "the VMM created tap {name}"
    );
}

#[test]
fn busy_tap_is_named_and_released() {
    assert!(kvm_available(), "/dev/kvm is required");
    let name = unique("bvbusy");
    let _guard = add_tap(&name);
    let holder = open_tap(&name).expect("attach the tap in the test");
    fails_with(
        &["--sandbox", "e6", "--net", &format!("tap:{name}")],
        &[&name, "busy"],
    );
    drop(holder);
    // The tap is still there and free: the failed VMM neither deleted nor kept it.
    assert!(Path::new("/sys/class/net").join(&name).exists());
    // Another test's child may hold a copy of `holder` between its fork and exec
    // (O_CLOEXEC closes it only at exec), so "free" is checked over a bounded window.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match open_tap(&name) {
            Ok(_) => break,
            Err(_) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => panic!("tap {name} is not free 5 s after the VMM exited: {e}"),
        }
    }
}
