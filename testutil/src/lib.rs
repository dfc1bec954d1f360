//! Helpers shared by the workspace's tests. Only ever a dev-dependency.

#[cfg(feature = "nic")]
pub mod nic;
pub mod virtio;

use std::path::Path;
use std::process::Command;

/// Writes `contents` (a script with its `#!` line) at `path`, mode 0755.
///
/// The file is written by a `cp` child, never by this process: test threads
/// fork concurrently, and a child forked while this process held a write fd to
/// the script keeps that fd until its own exec, so exec'ing the script would
/// fail with ETXTBSY now and then.
pub fn write_executable(path: &Path, contents: &str) {
    let src = path.with_extension("src");
    std::fs::write(&src, contents).unwrap_or_else(|e| panic!("write {}: {e}", src.display()));
    let status = Command::new("cp")
        .arg(&src)
        .arg(path)
        .status()
        .unwrap_or_else(|e| panic!("cp {} {}: {e}", src.display(), path.display()));
    assert!(
        status.success(),
        "cp {} {}: {status}",
        src.display(),
        path.display()
    );
    let _ = std::fs::remove_file(&src);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

#[cfg(test)]
mod tests {
    #[test]
    fn scripts_run_at_once_under_concurrent_forks() {
        let dir = std::env::temp_dir().join(format!("testutil-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::thread::scope(|s| {
            for t in 0..4 {
                let dir = &dir;
                s.spawn(move || {
                    for i in 0..20 {
                        let p = dir.join(format!("s{t}-{i}"));
                        super::write_executable(&p, &format!("#!/bin/sh\necho {t}-{i}\n"));
                        let out = std::process::Command::new(&p).output().unwrap();
                        assert_eq!(
                            String::from_utf8_lossy(&out.stdout).trim(),
                            format!("{t}-{i}")
                        );
                    }
                });
            }
        });
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
