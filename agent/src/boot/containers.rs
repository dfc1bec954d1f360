//! A pod sandbox's container roots in the guest ([`crate::pod`]): the
//! container's EROFS image from the disk the host inserted into an empty
//! slot (found by its virtio serial, once it shows its capacity), an
//! upper and work directory of its own on the pod's writable layer, an
//! overlay of the two, /etc files as the pod's, and /proc, /sys and /dev.
//!
//! ```text
//! /run/burstvm/containers/<id>/image    the EROFS image (read-only)
//! /run/burstvm/containers/<id>/rootfs   the overlay: the container's /
//! /run/burstvm/rw/containers/<id>/      its upper and work directories
//! ```

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agent_proto::{AgentError, ErrorCode};
use nix::mount::{umount2, MntFlags, MsFlags};

use super::mounts::{self, RW_DIR};
use super::{BootConfig, BootError};

pub const CONTAINERS_DIR: &str = "/run/burstvm/containers";
/// How often a new disk's serial and capacity are looked at.
const POLL: Duration = Duration::from_millis(20);

fn io(what: &str, path: &Path, e: impl std::fmt::Display) -> AgentError {
    AgentError::new(ErrorCode::Io, format!("{what} {}: {e}", path.display()))
}

/// The guest's container roots.
#[derive(Debug)]
pub struct GuestRoots {
    /// The pod's /etc settings (host name, name servers).
    pub cfg: BootConfig,
    pub sys_block: PathBuf,
    pub dev: PathBuf,
}

impl GuestRoots {
    pub fn new(cfg: BootConfig) -> GuestRoots {
        GuestRoots {
            cfg,
            sys_block: "/sys/block".into(),
            dev: "/dev".into(),
        }
    }

    /// The block device whose virtio serial is `serial`, once its capacity
    /// is not 0 (the host's insert raises a config change that the kernel
    /// handles on a work queue), waited for at most `limit`.
    fn find_disk(&self, serial: &str, limit: Duration) -> Result<PathBuf, AgentError> {
        let deadline = Instant::now() + limit;
        loop {
            let mut found = None;
            if let Ok(rd) = fs::read_dir(&self.sys_block) {
                for e in rd.flatten() {
                    let s = fs::read_to_string(e.path().join("serial")).unwrap_or_default();
                    if s.trim_end_matches(['\n', '\0']) == serial {
                        let size = fs::read_to_string(e.path().join("size")).unwrap_or_default();
                        found = Some((e.file_name(), size.trim().parse::<u64>().unwrap_or(0)));
                        break;
                    }
                }
            }
            match found {
                Some((name, sectors)) if sectors > 0 => return Ok(self.dev.join(name)),
                _ if Instant::now() >= deadline => {
                    return Err(AgentError::new(
                        ErrorCode::NotFound,
                        match found {
                            Some((name, _)) => format!(
                                "disk {serial} ({}) has no media after {limit:?}",
                                name.to_string_lossy()
                            ),
                            None => format!(
                                "no disk with serial {serial} in {}",
                                self.sys_block.display()
                            ),
                        },
                    ))
                }
                _ => std::thread::sleep(POLL),
            }
        }
    }
}

/// A boot mount step's error as the agent answers it (with its cause).
fn agent_err(e: BootError) -> AgentError {
    let cause = std::error::Error::source(&e)
        .map(|c| format!(": {c}"))
        .unwrap_or_default();
    AgentError::new(ErrorCode::Io, format!("{e}{cause}"))
}

fn mkdir(p: &Path) -> Result<(), AgentError> {
    mounts::mkdir(p).map_err(agent_err)
}

fn mount_at(
    what: &'static str,
    src: &Path,
    target: &Path,
    fstype: Option<&str>,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), AgentError> {
    mounts::mount_at(what, Some(src), target, fstype, flags, data).map_err(agent_err)
}

/// Drops the device's cached blocks: a slot's earlier media may have left
/// some, and the new image must be read from the disk.
fn flush_buffers(dev: &Path) -> Result<(), AgentError> {
    use std::os::fd::AsRawFd;
    let f = fs::File::open(dev).map_err(|e| io("open", dev, e))?;
    // BLKFLSBUF = _IO(0x12, 97).
    // SAFETY: an ioctl without argument on a block device we opened.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), 0x1261, 0) };
    if r < 0 {
        return Err(io("BLKFLSBUF", dev, std::io::Error::last_os_error()));
    }
    Ok(())
}

fn paths(id: &str) -> (PathBuf, PathBuf, PathBuf) {
    let base = Path::new(CONTAINERS_DIR).join(id);
    let layer = Path::new(RW_DIR).join("containers").join(id);
    (base.join("image"), base.join("rootfs"), layer)
}

impl crate::pod::ContainerRoots for GuestRoots {
    fn mount(&self, id: &str, disk: &str) -> Result<PathBuf, AgentError> {
        let dev = self.find_disk(disk, agent_proto::client::MOUNT_WAIT)?;
        flush_buffers(&dev)?;
        let (image, rootfs, layer) = paths(id);
        let r = (|| {
            mount_at(
                "mount the container image (erofs) at",
                &dev,
                &image,
                Some("erofs"),
                MsFlags::MS_RDONLY,
                None,
            )?;
            // A layer left by an earlier container of the same id is not this one's.
            let _ = fs::remove_dir_all(&layer);
            let (upper, work) = (layer.join("upper"), layer.join("work"));
            mkdir(&upper)?;
            mkdir(&work)?;
            let opts = format!(
                "lowerdir={},upperdir={},workdir={}",
                image.display(),
                upper.display(),
                work.display()
            );
            mount_at(
                "mount the container overlay at",
                Path::new("overlay"),
                &rootfs,
                Some("overlay"),
                MsFlags::empty(),
                Some(&opts),
            )?;
            mounts::write_etc(&rootfs, &self.cfg).map_err(agent_err)?;
            let nsd = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
            mount_at(
                "mount proc at",
                Path::new("proc"),
                &rootfs.join("proc"),
                Some("proc"),
                nsd,
                None,
            )?;
            mount_at(
                "mount sysfs at",
                Path::new("sysfs"),
                &rootfs.join("sys"),
                Some("sysfs"),
                nsd | MsFlags::MS_RDONLY,
                None,
            )?;
            mount_at(
                "bind /dev at",
                &self.dev,
                &rootfs.join("dev"),
                None,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None,
            )
        })();
        if let Err(e) = r {
            let _ = self.unmount(id, &rootfs);
            return Err(e);
        }
        Ok(rootfs)
    }

    fn unmount(&self, id: &str, root: &Path) -> Result<(), AgentError> {
        let (image, _, layer) = paths(id);
        let targets = [
            root.join("dev"),
            root.join("sys"),
            root.join("proc"),
            root.to_path_buf(),
            image,
        ];
        for t in &targets {
            match umount2(t, MntFlags::MNT_DETACH) {
                // EINVAL: not a mount point (a mount that failed); ENOENT: never made.
                Ok(()) | Err(nix::Error::EINVAL) | Err(nix::Error::ENOENT) => {}
                Err(e) => return Err(io("unmount", t, e)),
            }
        }
        let _ = fs::remove_dir_all(&layer);
        let _ = fs::remove_dir_all(Path::new(CONTAINERS_DIR).join(id));
        Ok(())
    }
}
