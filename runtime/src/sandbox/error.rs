//! How a sandbox fails: the stage and its typed cause (`SandboxFailure`,
//! whose `source()` is the cause itself so that callers can downcast it),
//! the VMM spawn's errors, and a teardown's failed steps (every step runs;
//! all failures are returned together).

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::cgroup;
use crate::failures::Failures;

/// Why a stage failed: the typed error of the step that failed (a `CniError`,
/// `HostCallError`, `CgroupError`, `VmmSpawnError`, ...), or a message where
/// the failure is a condition and not an error value.
pub type StageError = Box<dyn std::error::Error + Send + Sync>;

/// A sandbox that failed: in which stage, and why.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SandboxFailure {
    pub sandbox: String,
    pub stage: String,
    /// The failure's message (what the wire and the reports show).
    pub error: String,
    /// The typed cause `error` was made from (downcast it to match on it); None for a
    /// condition (no READY in time, interrupted, the VMM exited).
    #[serde(skip)]
    pub cause: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

impl SandboxFailure {
    /// A failure of `stage` caused by `error`, kept as its source.
    pub fn caused(sandbox: &str, stage: &str, error: StageError) -> SandboxFailure {
        SandboxFailure {
            sandbox: sandbox.to_string(),
            stage: stage.to_string(),
            error: error.to_string(),
            cause: Some(Arc::from(error)),
        }
    }
}

impl std::fmt::Display for SandboxFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "sandbox {}: stage {}: {}",
            self.sandbox, self.stage, self.error
        )
    }
}

impl std::error::Error for SandboxFailure {
    // The cause itself (not the Arc), so that `downcast_ref` finds its type.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Starting or waiting for the VMM process: the file, program or step, and the cause.
#[derive(Debug, thiserror::Error)]
pub enum VmmSpawnError {
    #[error("{}: {source}", .path.display())]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("spawn VMM {}: {source}", .program.display())]
    Spawn {
        program: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The pipe the VMM writes READY to could not be made.
    #[error("ready pipe: {0}")]
    ReadyPipe(#[source] std::io::Error),
    /// Waiting for the spawned VMM to exit failed.
    #[error("wait for VMM: {0}")]
    Wait(#[source] std::io::Error),
    /// Asking whether the VMM still runs failed.
    #[error("VMM status: {0}")]
    Status(#[source] std::io::Error),
}

/// A sandbox's teardown: every step that failed (the others still ran).
pub type TeardownError = Failures<TeardownStep>;

/// One teardown step that failed, with its typed cause.
#[derive(Debug, thiserror::Error)]
pub enum TeardownStep {
    #[error("neighbour entry {ip}: {source}")]
    Neighbor {
        ip: Ipv4Addr,
        #[source]
        source: crate::host::HostCallError,
    },
    #[error(transparent)]
    CniDel(Box<crate::cni_exec::CniError>),
    #[error(transparent)]
    Netns(netutil::NetnsError),
    #[error(transparent)]
    Cgroup(cgroup::CgroupError),
}

pub(super) fn file_err(path: &Path) -> impl FnOnce(std::io::Error) -> VmmSpawnError + '_ {
    move |source| VmmSpawnError::File {
        path: path.to_path_buf(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_keeps_its_typed_cause() {
        let cause = VmmSpawnError::File {
            path: "/nowhere/sb.stderr".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        let f = SandboxFailure::caused("sb1", "vmm-spawn", cause.into());
        assert!(
            f.to_string()
                .starts_with("sandbox sb1: stage vmm-spawn: /nowhere/sb.stderr: "),
            "{f}"
        );
        let src = std::error::Error::source(&f).expect("cause kept");
        assert!(
            matches!(
                src.downcast_ref::<VmmSpawnError>(),
                Some(VmmSpawnError::File { path, .. }) if path == Path::new("/nowhere/sb.stderr")
            ),
            "{src:?}"
        );
        let wire = serde_json::to_value(&f).unwrap();
        assert_eq!(wire["error"], f.error.as_str());
        assert!(wire.get("cause").is_none(), "{wire}");
    }
}
