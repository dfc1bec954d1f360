//! The containers of a pod sandbox (docs/shim.md, "Pods"): the VM is the
//! pod, each CRI container a root of its own in it, mounted when the host
//! asks (`MountContainer`) from a disk the host inserted into an empty slot
//! after boot. The server keeps which roots exist and runs a container's
//! processes chrooted into its root; how a root is made is a
//! [`ContainerRoots`] (the guest's in `boot::containers`, a directory in
//! tests).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use agent_proto::{AgentError, ErrorCode};

/// Makes and removes container roots.
pub trait ContainerRoots: Send + Sync {
    /// Mounts container `id`'s root from the disk with serial `disk`; its path.
    fn mount(&self, id: &str, disk: &str) -> Result<PathBuf, AgentError>;
    /// Unmounts the root `root` of container `id` (its processes are gone).
    fn unmount(&self, id: &str, root: &Path) -> Result<(), AgentError>;
}

/// The roots of a pod sandbox's agent (`AgentConfig::containers`).
#[derive(Clone)]
pub struct Roots(pub Arc<dyn ContainerRoots>);

impl fmt::Debug for Roots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Roots")
    }
}

/// A container id the agent makes a directory of: 1..=64 bytes of
/// `[A-Za-z0-9_.-]`, not `.` or `..` (CRI and containerd ids are hex).
pub fn validate_id(id: &str) -> Result<(), AgentError> {
    let ok = (1..=64).contains(&id.len())
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(AgentError::new(
            ErrorCode::Invalid,
            format!("container id {id:?}: 1..64 bytes of [A-Za-z0-9_.-]"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_ids() {
        for good in ["c1", "0123456789abcdef", "a.b-c_d"] {
            assert!(validate_id(good).is_ok(), "{good}");
        }
        let long = "x".repeat(65);
        for bad in ["", ".", "..", "a/b", "../x", long.as_str(), "a b"] {
            assert!(validate_id(bad).is_err(), "{bad:?}");
        }
    }
}
