//! The agent's frame code (net.c) and boot-info header, compiled for the
//! host and checked by tests/host_harness.c.

use std::path::Path;
use std::process::Command;

#[test]
fn net_frames_and_bootinfo_layout() {
    let dir = std::env::temp_dir().join(format!("guest-host-c-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("host_harness");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let st = Command::new("gcc")
        .args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(root.join("tests/host_harness.c"))
        .arg(root.join("src/c/net.c"))
        .status()
        .expect("run gcc");
    assert!(st.success(), "host build of net.c failed");
    let out = Command::new(&exe).output().expect("run harness");
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("0 failures"), "{text}");
}
