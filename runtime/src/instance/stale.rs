//! The names a runtime derives from its tag, its claim on its state
//! directory, and the reaping of what dead runtimes left. A live runtime
//! holds the lock `RUNTIME_LOCK` in its state directory (`procutil::DirLock`,
//! with its pid in it) for its whole life; the kernel drops it when the
//! process dies. So a later runtime tells a dead owner's netns, cgroups and
//! state directory (SIGKILLed, it could not remove them) from a live one's by
//! that lock, not by its pid: a pid may belong to another process by then,
//! or to a zombie nobody reaped.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use netutil::netns;
use procutil::{DirLock, LockError};

use super::RuntimeError;
use crate::cgroup::Layout;

/// The lock file a live runtime holds in its state directory.
pub const RUNTIME_LOCK: &str = "runtime.lock";

/// Every runtime's state directory is `rt-<tag>` under this.
pub const STATE_ROOT: &str = "/run/burstvm";

/// The filesystem type `STATE_ROOT` is on (`statfs`'s `f_type`; None if it
/// cannot be read, e.g. before the first runtime made it).
pub fn state_root_fs() -> Option<nix::sys::statfs::FsType> {
    nix::sys::statfs::statfs(STATE_ROOT)
        .ok()
        .map(|s| s.filesystem_type())
}

/// One line for a log or a benchmark's header on whether `STATE_ROOT` is on
/// tmpfs. Every start makes and removes files there (its VMM's stderr file;
/// with a network also an IPAM lease, the NIC's state file, a VF socket); on a
/// disk filesystem each new inode costs allocation work that tmpfs does not
/// have: 0.5–1.5 ms of host CPU per networked start on this kind of host
/// (docs/runtime.md "The state directory").
pub fn state_root_note(fs: Option<nix::sys::statfs::FsType>) -> String {
    use nix::sys::statfs::TMPFS_MAGIC;
    match fs {
        Some(t) if t == TMPFS_MAGIC => format!("state directory: {STATE_ROOT} is on tmpfs"),
        Some(t) => format!(
            "state directory: {STATE_ROOT} is not on tmpfs (f_type {:#x}), so every file a start \
             makes costs a disk filesystem's inode work (0.5-1.5 ms of CPU per networked \
             start here); scripts/setup.sh mounts a tmpfs there (docs/runtime.md \"The state directory\")",
            t.0
        ),
        None => format!("state directory: cannot statfs {STATE_ROOT}"),
    }
}

/// The state directory of the runtime with `tag`.
pub fn state_dir_of(tag: &str) -> PathBuf {
    Path::new(STATE_ROOT).join(format!("rt-{tag}"))
}

/// Sandbox names (netns, cgroups) made by the runtime with `tag` start with this.
pub fn sandbox_prefix_of(tag: &str) -> String {
    format!("bv{tag}-")
}

/// The name of the server netns of the runtime with `tag`.
pub fn server_netns_of(tag: &str) -> String {
    format!("bvsrv-{tag}")
}

/// The name of the rename pool's cgroups of the runtime with `tag` (`<it>-<k>`).
pub fn cgroup_pool_of(tag: &str) -> String {
    format!("pool-{tag}")
}

/// The pid of the process that made `tag` (see `unique_tag`).
fn tag_pid(tag: &str) -> Option<u32> {
    u64::from_str_radix(tag, 36).ok().map(|n| (n / 64) as u32)
}

/// Makes the state directory of `tag` and takes its `RUNTIME_LOCK`, held
/// as long as the returned lock lives. A directory another live process
/// holds is refused, naming its pid.
pub(super) fn claim_state_dir(tag: &str) -> Result<(PathBuf, DirLock), RuntimeError> {
    let dir = state_dir_of(tag);
    std::fs::create_dir_all(&dir).map_err(|source| RuntimeError::StateDir {
        path: dir.clone(),
        source,
    })?;
    match DirLock::acquire(&dir, RUNTIME_LOCK) {
        Ok(lock) => Ok((dir, lock)),
        Err(source) => Err(RuntimeError::StateDirOwned { path: dir, source }),
    }
}

/// Whether the runtime of the state directory `dir` (tag `tag`) is dead;
/// if so, its lock is returned, held while its leftovers are reaped.
fn dead_owner(dir: &Path, tag: &str) -> Option<Option<DirLock>> {
    match DirLock::take_over(dir, RUNTIME_LOCK) {
        // The pid was written under the lock, which is ours now: its writer is gone.
        Ok(Some(lock)) if lock.previous_pid().is_some() => Some(Some(lock)),
        // Empty: a runtime between making the directory and writing its pid.
        Ok(Some(_)) => None,
        // Made before runtimes held a lock (or a runtime that has not taken
        // it yet): only its tag's pid can tell, and it is still running then.
        Ok(None) => {
            let pid = tag_pid(tag)?;
            (!Path::new(&format!("/proc/{pid}")).exists()).then_some(None)
        }
        Err(LockError::Held { .. }) => None,
        Err(e) => {
            tracing::warn!("stale runtime state {}: {e}", dir.display());
            None
        }
    }
}

/// Removes what runtimes that died without cleaning up (SIGKILL) left:
/// their sandboxes' netns and cgroups, their server netns and state dir.
/// A runtime counts as dead when nobody holds the lock in its state
/// directory (see the module comment).
pub fn reap_stale(layout: &Layout) -> Vec<String> {
    let mut reaped = Vec::new();
    let Ok(rd) = std::fs::read_dir(STATE_ROOT) else {
        return reaped;
    };
    for e in rd.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(tag) = name.strip_prefix("rt-") else {
            continue;
        };
        let Some(_lock) = dead_owner(&e.path(), tag) else {
            continue;
        };
        let prefixes = [
            sandbox_prefix_of(tag),
            server_netns_of(tag),
            format!("{}-", cgroup_pool_of(tag)),
        ];
        for ns in prefixes.iter().take(2).flat_map(|p| netns::list(p)) {
            if netns::delete_path(&netns::named_path(&ns)).is_ok() {
                reaped.push(format!("netns {ns}"));
            }
        }
        for cg in layout.list() {
            if !(cg.starts_with(&prefixes[0]) || cg.starts_with(&prefixes[2])) {
                continue;
            }
            // A VMM of a dead runtime should have died with it (PDEATHSIG).
            crate::cgroup::reap(layout, &cg);
            reaped.push(format!("cgroup {cg}"));
        }
        // Its writable layers are a mount inside the state directory: the
        // mount goes first, so that removing the directory never reaches
        // into the filesystem.
        reaped.extend(::rootfs::layers::reap(&e.path().join("rootfs")));
        if ::rootfs::layers::is_mounted(&e.path().join("rootfs/mnt")) {
            continue;
        }
        let _ = std::fs::remove_dir_all(e.path());
        reaped.push(format!("state {}", e.path().display()));
    }
    reaped
}

pub(super) fn unique_tag() -> String {
    // pid plus a per-process counter, base 36, short enough for interface names.
    use std::sync::atomic::AtomicU32;
    static N: AtomicU32 = AtomicU32::new(0);
    tag_of(std::process::id(), N.fetch_add(1, Ordering::Relaxed) % 64)
}

/// The tag of `pid`'s runtime number `k` (< 64), base 36.
fn tag_of(pid: u32, k: u32) -> String {
    let mut s = String::new();
    let mut x = pid as u64 * 64 + k as u64;
    loop {
        s.insert(
            0,
            char::from_digit((x % 36) as u32, 36).expect("x % 36 is a base-36 digit"),
        );
        x /= 36;
        if x == 0 {
            break;
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_root_note_tells_tmpfs_from_a_disk_filesystem() {
        use nix::sys::statfs::{EXT4_SUPER_MAGIC, TMPFS_MAGIC};
        let tmpfs = state_root_note(Some(TMPFS_MAGIC));
        assert_eq!(tmpfs, "state directory: /run/burstvm is on tmpfs");
        let disk = state_root_note(Some(EXT4_SUPER_MAGIC));
        assert!(disk.contains("is not on tmpfs (f_type 0xef53)"), "{disk}");
        assert!(disk.contains("scripts/setup.sh mounts a tmpfs"), "{disk}");
        assert!(state_root_note(None).contains("cannot statfs /run/burstvm"));
    }

    #[test]
    fn tags_are_unique_and_name_their_pid() {
        let a = unique_tag();
        let b = unique_tag();
        assert_ne!(a, b);
        assert!(a.len() <= 11, "{a}: fits interface names");
        assert_eq!(tag_pid(&a), Some(std::process::id()));
        assert_eq!(tag_pid("not a tag!"), None);
    }

    /// A runtime's state directory has one owner: a second claim is refused
    /// naming the holder's pid, and a live owner's directory is never reaped.
    /// Once the owner is gone, a successor claims it at once. (Root: /run/burstvm.)
    #[test]
    fn a_state_directory_has_one_owner() {
        let tag = unique_tag();
        let (dir, lock) = claim_state_dir(&tag).unwrap();
        let e = claim_state_dir(&tag).unwrap_err();
        assert!(
            matches!(&e, RuntimeError::StateDirOwned { source, .. }
                if source.holder_pid() == Some(std::process::id())),
            "{e:?}"
        );
        let chain = format!("{e}: {}", std::error::Error::source(&e).unwrap());
        assert!(
            chain.contains(&format!("pid {}", std::process::id())),
            "{chain}"
        );
        let reaped = reap_stale(&Layout::detect().unwrap());
        assert!(
            dir.exists(),
            "a live owner's directory was reaped: {reaped:?}"
        );
        drop(lock);
        let (_, again) = claim_state_dir(&tag).unwrap();
        drop(again);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A runtime killed with its state, netns and lock file left, whose pid
    /// now belongs to another live process (here our own `sleep`): its lock
    /// is free, so everything it left is reaped. (Root: netns, /run/burstvm.)
    #[test]
    fn a_dead_runtime_whose_pid_lives_on_is_reaped() {
        let mut other = testutil::ChildGuard(
            std::process::Command::new("sleep")
                .arg("600")
                .spawn()
                .unwrap(),
        );
        let pid = other.0.id();
        let tag = tag_of(pid, 63);
        let dir = state_dir_of(&tag);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(RUNTIME_LOCK), format!("{pid}\n")).unwrap();
        std::fs::write(dir.join("trace.jsonl"), "").unwrap();
        let ns = format!("{}t", sandbox_prefix_of(&tag));
        std::mem::forget(netutil::NamedNetns::create(&ns).unwrap());
        let reaped = reap_stale(&Layout::detect().unwrap());
        let left = (dir.exists(), netns::list(&ns));
        if left.0 || !left.1.is_empty() {
            let _ = netns::delete_path(&netns::named_path(&ns));
            let _ = std::fs::remove_dir_all(&dir);
        }
        assert_eq!(left, (false, vec![]), "not reaped: {reaped:?}");
        assert!(reaped.contains(&format!("netns {ns}")), "{reaped:?}");
        assert!(
            other.0.try_wait().unwrap().is_none(),
            "the other process is untouched"
        );
    }
}
