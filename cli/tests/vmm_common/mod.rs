// Shared helpers for the vmm_* integration tests (included with `mod`).
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output, Stdio};

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
