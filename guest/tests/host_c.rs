//! The agent's C code compiled for the host: the frame code (net.c) and
//! boot-info header checked by tests/host_harness.c, and the EROFS reader
//! (erofs.c) run by tests/host_erofs.c against images mkfs.erofs builds.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("guest-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn build(exe: &Path, sources: &[&str]) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let st = Command::new("gcc")
        .args(["-O1", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(exe)
        .args(sources.iter().map(|s| root.join(s)))
        .status()
        .expect("run gcc");
    assert!(st.success(), "host build of {sources:?} failed");
}

#[test]
fn net_frames_and_bootinfo_layout() {
    let dir = scratch_dir("host-c");
    let exe = dir.join("host_harness");
    build(&exe, &["tests/host_harness.c", "src/c/net.c"]);
    let out = Command::new(&exe).output().expect("run harness");
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("0 failures"), "{text}");
}

/// Deterministic bytes (xorshift64*), so a failure reproduces.
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        v.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    v.truncate(len);
    v
}

/// path in the image → contents, covering every layout the reader handles:
/// fully inline, full blocks plus inline tail, exact blocks, empty, deep
/// paths and a directory spanning several blocks.
fn tree() -> BTreeMap<String, Vec<u8>> {
    let mut t = BTreeMap::new();
    t.insert("/etc/os-release".into(), b"NAME=burstvm\n".to_vec());
    t.insert("/bin/app".into(), bytes(1, 10_000));
    t.insert("/big/blocks".into(), bytes(2, 3 * 4096));
    t.insert("/empty".into(), Vec::new());
    t.insert("/deep/a/b/c/d/leaf".into(), bytes(3, 4095));
    for i in 0..300 {
        t.insert(format!("/many/entry-with-a-long-name-{i:04}"), bytes(i, 9));
    }
    t
}

fn run(exe: &Path, image: &Path, paths: &[&str]) -> (bool, String) {
    let out = Command::new(exe).arg(image).args(paths).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn erofs_reader_finds_files_and_checksums_them() {
    let dir = scratch_dir("host-erofs");
    let exe = dir.join("host_erofs");
    build(&exe, &["tests/host_erofs.c", "src/c/erofs.c"]);
    let src = dir.join("src");
    let files = tree();
    for (p, data) in &files {
        let f = src.join(&p[1..]);
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(f, data).unwrap();
    }
    std::os::unix::fs::symlink("app", src.join("bin/link")).unwrap();

    // Default layout (inline tails) and all-plain data.
    for (name, extra) in [("inline", None), ("plain", Some("-Enoinline_data"))] {
        let image = dir.join(format!("{name}.erofs"));
        let mut cmd = Command::new("mkfs.erofs");
        cmd.args(["-x-1", "-T0", "--quiet"]).args(extra);
        let st = cmd
            .arg(&image)
            .arg(&src)
            .status()
            .expect("mkfs.erofs (apt erofs-utils)");
        assert!(st.success(), "mkfs.erofs {name}");
        let paths: Vec<&str> = files.keys().map(|s| s.as_str()).collect();
        let (ok, text) = run(&exe, &image, &paths);
        assert!(ok, "{name}: {text}");
        for (p, data) in &files {
            let want = format!("{p} ok {} {:08x}", data.len(), guest::checksum(data));
            assert!(
                text.lines().any(|l| l == want),
                "{name}: want {want:?} in\n{text}"
            );
        }
        // Missing, through a file, the symlink (not followed: it is no dir).
        let (_, text) = run(
            &exe,
            &image,
            &[
                "/etc/missing",
                "/etc/os-release/x",
                "/bin/link/x",
                "/many/entry-with-a-long-name-0300",
            ],
        );
        assert_eq!(
            text,
            "/etc/missing err 3\n/etc/os-release/x err 4\n/bin/link/x err 4\n/many/entry-with-a-long-name-0300 err 3\n"
        );
    }

    // Not EROFS, and a truncated image: refused, never a crash.
    let mut bad = std::fs::read(dir.join("inline.erofs")).unwrap();
    bad[1024] ^= 0xff;
    std::fs::write(dir.join("bad.erofs"), &bad).unwrap();
    assert_eq!(
        run(&exe, &dir.join("bad.erofs"), &["/bin/app"]),
        (false, "mount err 2\n".into())
    );
    let short = &std::fs::read(dir.join("inline.erofs")).unwrap()[..6000];
    std::fs::write(dir.join("short.erofs"), short).unwrap();
    let (_, text) = run(&exe, &dir.join("short.erofs"), &["/bin/app"]);
    assert!(text.contains("err"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
