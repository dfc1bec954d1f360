// Helpers of the tests that run `burstvm` subcommands (included with `mod`).
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

pub const BIN: &str = env!("CARGO_BIN_EXE_burstvm");
pub const CNI_BIN: &str = env!("CARGO_BIN_EXE_burstvm-cni");

/// `burstvm ARGS`, with this build's CNI plugin first on CNI_PATH.
pub fn burstvm(args: &[&str]) -> Output {
    let cni_dir = Path::new(CNI_BIN).parent().unwrap();
    Command::new(BIN)
        .args(args)
        .env("CNI_PATH", format!("{}:/opt/cni/bin", cni_dir.display()))
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run burstvm")
}

/// Status, stdout and stderr, for assertion messages.
pub fn text(o: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
