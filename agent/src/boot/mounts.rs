//! Mounts and the root switch.
//!
//! In the initramfs: /proc, /sys, /dev (devtmpfs), /dev/pts (a new devpts
//! instance, ptmxmode=0666), /dev/shm, /tmp, /run. The container root: the
//! EROFS image read-only at /run/burstvm/ro, the writable layer (ext4 disk or
//! tmpfs) at /run/burstvm/rw, an overlay of the two at /newroot; /etc files
//! from the configuration are written through the overlay (so they land in
//! the upper layer); /dev (with pts and shm), /proc and /sys are moved into
//! it; then the switch_root method: MS_MOVE of the new root onto `/`,
//! `chroot(".")`. (pivot_root is refused on the initramfs's rootfs.)

use std::fs;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use nix::mount::{mount, MsFlags};
use nix::unistd::{chdir, chroot};

use super::{BootConfig, BootError};

pub const RO_DIR: &str = "/run/burstvm/ro";
pub const RW_DIR: &str = "/run/burstvm/rw";
pub const NEWROOT: &str = "/newroot";

pub(crate) fn mkdir(path: &Path) -> Result<(), BootError> {
    fs::create_dir_all(path).map_err(|source| BootError::File {
        step: "mkdir",
        path: path.to_owned(),
        source,
    })
}

pub(crate) fn mount_at(
    step: &'static str,
    src: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), BootError> {
    mkdir(target)?;
    mount(src, target, fstype, flags, data).map_err(|source| BootError::Mount {
        step,
        path: target.to_owned(),
        source,
    })
}

/// The initramfs's filesystems.
pub fn early() -> Result<(), BootError> {
    let nsd = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    let fs = |t: &str, p: &str, flags: MsFlags, data: Option<&str>| {
        mount_at(
            "mount",
            Some(Path::new(t)),
            Path::new(p),
            Some(t),
            flags,
            data,
        )
    };
    fs("proc", "/proc", nsd | MsFlags::MS_NOEXEC, None)?;
    fs("sysfs", "/sys", nsd | MsFlags::MS_NOEXEC, None)?;
    match fs("devtmpfs", "/dev", MsFlags::MS_NOSUID, Some("mode=0755")) {
        // CONFIG_DEVTMPFS_MOUNT mounted it already.
        Err(BootError::Mount {
            source: nix::Error::EBUSY,
            ..
        }) => {}
        r => r?,
    }
    fs(
        "devpts",
        "/dev/pts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620,gid=5"),
    )?;
    fs("tmpfs", "/dev/shm", nsd, Some("mode=1777"))?;
    fs("tmpfs", "/tmp", nsd, Some("mode=1777"))?;
    fs("tmpfs", "/run", nsd, Some("mode=0755"))?;
    Ok(())
}

/// The container root at [`NEWROOT`]: image, writable layer, overlay, /etc
/// files, /dev /proc /sys moved in. Ready for [`switch_root`].
pub fn container_root(cfg: &BootConfig, image: &Path) -> Result<PathBuf, BootError> {
    let (ro, rw, newroot) = (Path::new(RO_DIR), Path::new(RW_DIR), Path::new(NEWROOT));
    mount_at(
        "mount the image (erofs)",
        Some(image),
        ro,
        Some("erofs"),
        MsFlags::MS_RDONLY,
        None,
    )?;
    match &cfg.rw {
        Some(dev) => mount_at(
            "mount the writable layer (ext4)",
            Some(dev),
            rw,
            Some("ext4"),
            MsFlags::MS_NOATIME,
            None,
        )?,
        None => mount_at(
            "mount the writable layer (tmpfs)",
            Some(Path::new("tmpfs")),
            rw,
            Some("tmpfs"),
            MsFlags::empty(),
            Some("mode=0755"),
        )?,
    }
    let (upper, work) = (rw.join("upper"), rw.join("work"));
    mkdir(&upper)?;
    mkdir(&work)?;
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        ro.display(),
        upper.display(),
        work.display()
    );
    mount_at(
        "mount the overlay",
        Some(Path::new("overlay")),
        newroot,
        Some("overlay"),
        MsFlags::empty(),
        Some(&opts),
    )?;
    write_etc(newroot, cfg)?;
    for dir in ["/dev", "/proc", "/sys"] {
        mount_at(
            "move into the container root",
            Some(Path::new(dir)),
            &newroot.join(&dir[1..]),
            None,
            MsFlags::MS_MOVE,
            None,
        )?;
    }
    Ok(newroot.to_owned())
}

fn write_file(path: &Path, text: &str) -> Result<(), BootError> {
    let e = |step| {
        move |source| BootError::File {
            step,
            path: path.to_owned(),
            source,
        }
    };
    // A symbolic link (resolv.conf often is one) is replaced, not followed.
    match fs::remove_file(path) {
        Err(x) if x.kind() != io::ErrorKind::NotFound => return Err(e("remove")(x)),
        _ => {}
    }
    fs::write(path, text).map_err(e("write"))
}

/// /etc/hostname and /etc/hosts (with a host name), /etc/resolv.conf (with
/// name servers) under `root`; the image's files stay otherwise.
pub fn write_etc(root: &Path, cfg: &BootConfig) -> Result<(), BootError> {
    let etc = root.join("etc");
    mkdir(&etc)?;
    if let Some(h) = &cfg.hostname {
        write_file(&etc.join("hostname"), &format!("{h}\n"))?;
        let me = cfg
            .net
            .map(|(a, _)| a)
            .unwrap_or(IpAddr::from([127, 0, 1, 1]));
        write_file(
            &etc.join("hosts"),
            &format!(
                "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n{me}\t{h}\n"
            ),
        )?;
    }
    if !cfg.dns.is_empty() {
        let text: String = cfg
            .dns
            .iter()
            .map(|d| format!("nameserver {d}\n"))
            .collect();
        write_file(&etc.join("resolv.conf"), &text)?;
    }
    Ok(())
}

/// A pod sandbox keeps its writable layer past the root switch: its
/// containers' upper directories go there (`boot::containers`). A tmpfs at
/// `<newroot>/run/burstvm` takes it (and the containers' mounts), so
/// nothing of the pod's lands in the pause image's overlay.
pub fn keep_for_pod(newroot: &Path) -> Result<(), BootError> {
    let run = newroot.join("run/burstvm");
    mount_at(
        "mount the pod's tmpfs",
        Some(Path::new("tmpfs")),
        &run,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0755"),
    )?;
    mount_at(
        "move the writable layer into the container root",
        Some(Path::new(RW_DIR)),
        &newroot.join(&RW_DIR[1..]),
        None,
        MsFlags::MS_MOVE,
        None,
    )
}

/// The switch_root method: `newroot` becomes `/` of this process (and of
/// every process it starts from now on).
pub fn switch_root(newroot: &Path) -> Result<(), BootError> {
    let e = |step| {
        move |source| BootError::Mount {
            step,
            path: newroot.to_owned(),
            source,
        }
    };
    chdir(newroot).map_err(e("chdir"))?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(e("move onto /"))?;
    chroot(".").map_err(e("chroot"))?;
    chdir("/").map_err(e("chdir / in"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etc_files() {
        let root = std::env::temp_dir().join(format!("agent-etc-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(root.join("etc")).unwrap();
        std::os::unix::fs::symlink("../run/resolved/stub", root.join("etc/resolv.conf")).unwrap();
        fs::write(root.join("etc/hosts"), "image\n").unwrap();
        let mut cfg = BootConfig::default();
        write_etc(&root, &cfg).unwrap();
        assert_eq!(
            fs::read_to_string(root.join("etc/hosts")).unwrap(),
            "image\n"
        );
        cfg.hostname = Some("box".into());
        cfg.net = Some(("192.0.2.5".parse().unwrap(), 24));
        cfg.dns = vec!["192.0.2.53".parse().unwrap(), "192.0.2.54".parse().unwrap()];
        write_etc(&root, &cfg).unwrap();
        assert_eq!(
            fs::read_to_string(root.join("etc/hostname")).unwrap(),
            "box\n"
        );
        assert!(fs::read_to_string(root.join("etc/hosts"))
            .unwrap()
            .contains("192.0.2.5\tbox\n"));
        let meta = fs::symlink_metadata(root.join("etc/resolv.conf")).unwrap();
        assert!(meta.is_file());
        assert_eq!(
            fs::read_to_string(root.join("etc/resolv.conf")).unwrap(),
            "nameserver 192.0.2.53\nnameserver 192.0.2.54\n"
        );
        assert!(!root.join("run").exists(), "followed the symlink");
        fs::remove_dir_all(&root).unwrap();
    }
}
