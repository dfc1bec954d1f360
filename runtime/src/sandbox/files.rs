//! The per-sandbox files in the host's state directory, named after the
//! sandbox id: the VMM's stderr, its stdout (probe mode only), a Linux
//! guest's serial console and a container sandbox's vsock socket. Their names are built here only; they are read
//! as empty when missing, and removed at teardown unless BURSTVM_KEEP_LOGS
//! is set (which also keeps the runtime's state directory).

use std::path::{Path, PathBuf};

/// Whether per-sandbox files and the state directory are kept for debugging.
pub(crate) fn keep_logs() -> bool {
    std::env::var_os("BURSTVM_KEEP_LOGS").is_some()
}

/// Paths of one sandbox's files.
#[derive(Debug)]
pub(super) struct Files {
    /// The VMM's stderr (the reason of a failure).
    pub stderr: PathBuf,
    /// The VMM's stdout (its probe values), only in probe mode.
    pub stdout: Option<PathBuf>,
    /// The serial console of a Linux guest.
    pub console: PathBuf,
    /// The VMM's vsock socket (a container sandbox's agent); the VMM
    /// removes it when it exits, teardown again in case it was killed.
    pub vsock: PathBuf,
    /// The VMM's control socket (a pod sandbox's disk slots), as `vsock`.
    pub api: PathBuf,
}

impl Files {
    pub fn new(state_dir: &Path, id: &str, probe: bool) -> Files {
        Files {
            stderr: state_dir.join(format!("{id}.stderr")),
            stdout: probe.then(|| state_dir.join(format!("{id}.stdout"))),
            console: state_dir.join(format!("{id}.console")),
            vsock: state_dir.join(format!("{id}.vsock")),
            api: state_dir.join(format!("{id}.api")),
        }
    }

    /// The VMM's stderr so far.
    pub fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Removes the files (unless BURSTVM_KEEP_LOGS); missing ones are fine.
    pub fn remove(&self) {
        // A socket is no log: never kept.
        let _ = std::fs::remove_file(&self.vsock);
        let _ = std::fs::remove_file(&self.api);
        if keep_logs() {
            return;
        }
        let _ = std::fs::remove_file(&self.stderr);
        let _ = std::fs::remove_file(&self.console);
        if let Some(p) = &self.stdout {
            let _ = std::fs::remove_file(p);
        }
    }
}
