// Shared by the tests that boot the Linux guest with the guest agent
// (container_run, shim_linux; included with `mod`).
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

/// Runs `scripts/NAME ARGS` and returns its stdout, trimmed; panics with
/// its stderr when it fails.
pub fn script(name: &str, args: &[&str]) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(name);
    let o = Command::new("bash").arg(&p).args(args).output().unwrap();
    assert!(
        o.status.success(),
        "{name} {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

/// The condensed kernel (built and cached by scripts/setup.sh).
pub fn kernel() -> String {
    script("build-guest-kernel.sh", &["--cached"])
}

/// The static guest agent: `$BURSTVM_AGENT`, else built once per test
/// process (tests run in parallel: one cargo build, not one each).
pub fn agent() -> String {
    static AGENT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    AGENT
        .get_or_init(|| {
            std::env::var("BURSTVM_AGENT").unwrap_or_else(|_| script("build-agent.sh", &[]))
        })
        .clone()
}
