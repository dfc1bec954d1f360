//! The container's root filesystem: the snapshotter's mounts from Create are
//! validated and mounted at `<bundle>/rootfs` (as runc's shim does). Then,
//! by guest (`GuestRootfs`):
//!
//! - the built-in agent has no filesystem: the entrypoint (`process.args[0]`)
//!   is read out of the rootfs, confined to it, into `<bundle>/app.payload`,
//!   its app payload (`burstvm vmm --app-file`);
//! - a Linux guest gets RunD's split rootfs: the mounted snapshot built into
//!   the shared read-only EROFS image by the `rootfs` crate's `ImageCache`
//!   (keyed by a digest of the tree, so every container of an image finds the
//!   image built by the first), under a writable layer reflinked per sandbox.

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::mount::{MntFlags, MsFlags};

/// Largest entrypoint handed to the agent (the VMM checks its own limit too).
pub const MAX_PAYLOAD: u64 = 256 << 20;

#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    #[error("rootfs mount {index} ({fstype}): {reason}")]
    Mount {
        index: usize,
        fstype: String,
        reason: String,
    },
    #[error("rootfs mount {index} ({fstype}): mount at {}: {source}", .target.display())]
    MountSys {
        index: usize,
        fstype: String,
        target: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("rootfs {path}: {op}: {source}")]
    Sys {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("entrypoint {entry:?} in {rootfs}: {op}: {source}")]
    EntrypointIo {
        entry: String,
        rootfs: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("entrypoint {entry:?} in {rootfs}: {reason}")]
    Entrypoint {
        entry: String,
        rootfs: PathBuf,
        reason: String,
    },
    #[error("rootfs {rootfs}: build the container image: {source}")]
    Image {
        rootfs: PathBuf,
        #[source]
        source: ::rootfs::Error,
    },
}

/// One mount of the snapshotter (containerd's `types.Mount`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountSpec {
    pub fstype: String,
    pub source: String,
    pub options: Vec<String>,
}

/// What the sandbox boots with (see the module comment).
#[derive(Debug, Clone)]
pub enum GuestRootfs {
    /// The entrypoint's bytes as the built-in agent's app payload.
    AppPayload(PathBuf),
    /// The snapshot as the shared EROFS image (a Linux guest), and whether
    /// this container built it or found it in the cache.
    Image {
        image: Arc<::rootfs::Image>,
        built: ::rootfs::image::Built,
    },
}

/// What the sandbox's rootfs is made into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want<'a> {
    /// The entrypoint, for the built-in agent.
    Payload { entry: &'a str },
    /// The EROFS image, in this cache.
    Image { cache: &'a Path },
}

/// A mounted (or given) rootfs and what was taken from it.
#[derive(Debug)]
pub struct Prepared {
    pub rootfs: PathBuf,
    /// Whether we mounted `rootfs` (and must unmount it).
    pub mounted: bool,
    pub guest: GuestRootfs,
}

const OVERLAY_DIRS: [&str; 3] = ["lowerdir", "upperdir", "workdir"];
const OVERLAY_FLAGS: [&str; 8] = [
    "index=off",
    "index=on",
    "userxattr",
    "volatile",
    "metacopy=off",
    "redirect_dir=off",
    "ro",
    "rw",
];

/// Checks the mounts: overlay or bind only, absolute existing directories,
/// known options only. An empty list means the bundle's rootfs is given.
pub fn validate(mounts: &[MountSpec]) -> Result<(), RootfsError> {
    if mounts.len() > 1 {
        return Err(RootfsError::Mount {
            index: 1,
            fstype: mounts[1].fstype.clone(),
            reason: format!(
                "{} mounts given; the overlayfs and native snapshotters give one",
                mounts.len()
            ),
        });
    }
    for (index, m) in mounts.iter().enumerate() {
        let bad = |reason: String| RootfsError::Mount {
            index,
            fstype: m.fstype.clone(),
            reason,
        };
        let dir_ok = |p: &str| {
            let p = Path::new(p);
            if !p.is_absolute() {
                return Err(bad(format!("{p:?} is not an absolute path")));
            }
            if !p.is_dir() {
                return Err(bad(format!("{} is not a directory", p.display())));
            }
            Ok(())
        };
        match m.fstype.as_str() {
            "overlay" => {
                let mut has_lower = false;
                for o in &m.options {
                    match o.split_once('=') {
                        Some((k, v)) if OVERLAY_DIRS.contains(&k) => {
                            if k == "lowerdir" {
                                has_lower = true;
                                for d in v.split(':') {
                                    dir_ok(d)?;
                                }
                            } else {
                                dir_ok(v)?;
                            }
                        }
                        _ if OVERLAY_FLAGS.contains(&o.as_str()) => {}
                        _ => return Err(bad(format!("option {o:?} is not accepted"))),
                    }
                }
                if !has_lower {
                    return Err(bad("no lowerdir".into()));
                }
            }
            "bind" | "rbind" => {
                dir_ok(&m.source)?;
                for o in &m.options {
                    if !["bind", "rbind", "ro", "rw"].contains(&o.as_str()) {
                        return Err(bad(format!("option {o:?} is not accepted")));
                    }
                }
            }
            t => {
                return Err(bad(format!(
                    "type {t:?} is not supported (overlay and bind are)"
                )))
            }
        }
    }
    Ok(())
}

fn sys(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> RootfsError {
    let path = path.to_path_buf();
    move |source| RootfsError::Sys { path, op, source }
}

/// Validates and mounts `mounts` at `<bundle>/rootfs`, then makes what
/// `want` says of it: the entrypoint's payload, or the EROFS image. On
/// error nothing stays mounted.
pub fn prepare(bundle: &Path, mounts: &[MountSpec], want: Want) -> Result<Prepared, RootfsError> {
    validate(mounts)?;
    let rootfs = bundle.join("rootfs");
    std::fs::create_dir_all(&rootfs).map_err(sys(&rootfs, "create directory"))?;
    let mounted = match mounts.first() {
        None => false,
        Some(m) => {
            mount_one(m, &rootfs)?;
            true
        }
    };
    let guest = match want {
        Want::Payload { entry } => {
            let payload = bundle.join("app.payload");
            extract(&rootfs, entry, &payload).map(|()| GuestRootfs::AppPayload(payload))
        }
        Want::Image { cache } => build_image(&rootfs, cache),
    };
    match guest {
        Ok(guest) => Ok(Prepared {
            rootfs,
            mounted,
            guest,
        }),
        Err(e) => {
            if mounted {
                let _ = unmount(&rootfs);
            }
            Err(e)
        }
    }
}

/// The container's tree as the shared read-only EROFS image: built once
/// per tree (`ImageCache`'s key for a directory is a digest of its names,
/// modes, owners, link targets and contents, so a second container of the
/// same image, on a snapshot of its own, finds the first one's image).
pub fn build_image(rootfs: &Path, cache: &Path) -> Result<GuestRootfs, RootfsError> {
    let (image, built) = ::rootfs::ImageCache::new(cache)
        .build(rootfs)
        .map_err(|source| RootfsError::Image {
            rootfs: rootfs.to_path_buf(),
            source,
        })?;
    Ok(GuestRootfs::Image {
        image: Arc::new(image),
        built,
    })
}

fn mount_one(m: &MountSpec, target: &Path) -> Result<(), RootfsError> {
    let ro = m.options.iter().any(|o| o == "ro");
    let mut flags = if ro {
        MsFlags::MS_RDONLY
    } else {
        MsFlags::empty()
    };
    let err = |source: nix::Error| RootfsError::MountSys {
        index: 0,
        fstype: m.fstype.clone(),
        target: target.to_path_buf(),
        source,
    };
    if m.fstype == "overlay" {
        let data: Vec<&str> = m
            .options
            .iter()
            .map(String::as_str)
            .filter(|o| *o != "ro" && *o != "rw")
            .collect();
        nix::mount::mount(
            Some("overlay"),
            target,
            Some("overlay"),
            flags,
            Some(data.join(",").as_str()),
        )
        .map_err(err)?;
    } else {
        flags = MsFlags::MS_BIND | MsFlags::MS_REC;
        nix::mount::mount(
            Some(m.source.as_str()),
            target,
            None::<&str>,
            flags,
            None::<&str>,
        )
        .map_err(err)?;
        if ro {
            let r = nix::mount::mount(
                None::<&str>,
                target,
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
                None::<&str>,
            );
            if let Err(e) = r {
                let _ = unmount(target);
                return Err(err(e));
            }
        }
    }
    Ok(())
}

/// Copies the entrypoint out of `rootfs`, resolving it inside the rootfs
/// only (`RESOLVE_IN_ROOT`: `..` and absolute symlinks cannot leave it).
fn extract(rootfs: &Path, entry: &str, out: &Path) -> Result<(), RootfsError> {
    let bad = |reason: String| RootfsError::Entrypoint {
        entry: entry.to_string(),
        rootfs: rootfs.to_path_buf(),
        reason,
    };
    let io = |op: &'static str| {
        move |source: std::io::Error| RootfsError::EntrypointIo {
            entry: entry.to_string(),
            rootfs: rootfs.to_path_buf(),
            op,
            source,
        }
    };
    if !entry.starts_with('/') {
        return Err(bad("process.args[0] must be an absolute path".into()));
    }
    let root = std::fs::File::open(rootfs).map_err(sys(rootfs, "open"))?;
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOCTTY)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let fd = nix::fcntl::openat2(root.as_raw_fd(), entry.trim_start_matches('/'), how)
        .map_err(|e| io("open")(e.into()))?;
    // SAFETY: openat2 returned a new descriptor that nothing else owns.
    let mut f = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let md = f.metadata().map_err(io("stat"))?;
    if !md.is_file() {
        return Err(bad("not a regular file".into()));
    }
    if md.len() > MAX_PAYLOAD {
        return Err(bad(format!(
            "{} bytes; the agent's app payload is at most {MAX_PAYLOAD}",
            md.len()
        )));
    }
    let mut data = Vec::with_capacity(md.len() as usize);
    f.by_ref()
        .take(MAX_PAYLOAD)
        .read_to_end(&mut data)
        .map_err(io("read"))?;
    std::fs::write(out, &data).map_err(sys(out, "write app payload"))
}

/// Unmounts a rootfs this shim mounted (lazily: nothing in the VM holds it).
pub fn unmount(rootfs: &Path) -> Result<(), RootfsError> {
    match nix::mount::umount2(rootfs, MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::Error::EINVAL) | Err(nix::Error::ENOENT) => Ok(()),
        Err(e) => Err(RootfsError::Sys {
            path: rootfs.to_path_buf(),
            op: "unmount",
            source: e.into(),
        }),
    }
}

/// Whether `path` is a mount point (a SIGKILLed shim's leftover).
pub fn is_mounted(path: &Path) -> bool {
    let Ok(mi) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.to_string_lossy();
    mi.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|mp| mp == want)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(fstype: &str, source: &str, options: &[&str]) -> MountSpec {
        MountSpec {
            fstype: fstype.into(),
            source: source.into(),
            options: options.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn mounts_are_validated() {
        let d = tempfile::tempdir().unwrap();
        let p = |s: &str| {
            let q = d.path().join(s);
            std::fs::create_dir_all(&q).unwrap();
            q.display().to_string()
        };
        let (l1, l2, u, w) = (p("l1"), p("l2"), p("u"), p("w"));
        let ok = m(
            "overlay",
            "overlay",
            &[
                &format!("lowerdir={l1}:{l2}"),
                &format!("upperdir={u}"),
                &format!("workdir={w}"),
                "index=off",
            ],
        );
        validate(std::slice::from_ref(&ok)).unwrap();
        validate(&[]).unwrap();
        validate(&[m("bind", &l1, &["rbind", "ro"])]).unwrap();
        let err = |ms: &[MountSpec]| validate(ms).unwrap_err().to_string();
        assert!(err(&[m("ext4", "/dev/sda", &[])]).contains("not supported"));
        assert!(err(&[m("overlay", "overlay", &["lowerdir=rel"])]).contains("absolute"));
        assert!(
            err(&[m("overlay", "overlay", &["lowerdir=/nonexistent-dir"])])
                .contains("not a directory")
        );
        assert!(err(&[m("overlay", "overlay", &[&format!("upperdir={u}")])]).contains("lowerdir"));
        assert!(
            err(&[m("overlay", "o", &[&format!("lowerdir={l1}"), "xino=on"])]).contains("xino=on")
        );
        assert!(err(&[m("bind", &l1, &["nosuid"])]).contains("nosuid"));
        assert!(err(&[ok.clone(), ok]).contains("2 mounts"));
    }

    #[test]
    fn the_entrypoint_cannot_leave_the_rootfs() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("rootfs");
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::write(root.join("bin/app"), b"BVMAPP01\x03\0\0\0rest").unwrap();
        std::fs::write(d.path().join("secret"), b"host file").unwrap();
        std::os::unix::fs::symlink("/bin/app", root.join("link")).unwrap();
        std::os::unix::fs::symlink("../../secret", root.join("bin/escape")).unwrap();
        let out = d.path().join("payload");
        extract(&root, "/bin/app", &out).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"BVMAPP01\x03\0\0\0rest");
        // An absolute symlink resolves inside the rootfs, not on the host.
        extract(&root, "/link", &out).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"BVMAPP01\x03\0\0\0rest");
        // `..` stops at the rootfs: ../../secret is <rootfs>/secret, which does not exist.
        let e = extract(&root, "/bin/escape", &out).unwrap_err().to_string();
        assert!(e.contains("/bin/escape"), "{e}");
        assert!(extract(&root, "bin/app", &out).is_err());
        assert!(extract(&root, "/bin", &out)
            .unwrap_err()
            .to_string()
            .contains("regular"));
        // An empty mount list: the bundle's rootfs is used as it is.
        let p = prepare(d.path(), &[], Want::Payload { entry: "/bin/app" }).unwrap();
        assert!(!p.mounted);
        assert!(
            matches!(&p.guest, GuestRootfs::AppPayload(a) if *a == d.path().join("app.payload")),
            "{:?}",
            p.guest
        );
    }

    /// Two containers of one image have snapshots of their own with the
    /// same tree: the second finds the image the first built (the cache's
    /// answer, not a timing).
    #[test]
    fn a_second_container_of_an_image_finds_it_built() {
        if std::process::Command::new("mkfs.erofs")
            .arg("--version")
            .output()
            .is_err()
        {
            eprintln!("skipped: no mkfs.erofs (erofs-utils)");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let cache = d.path().join("cache");
        let tree = |name: &str, app: &[u8]| {
            let b = d.path().join(name);
            let r = b.join("rootfs");
            std::fs::create_dir_all(r.join("bin")).unwrap();
            std::fs::create_dir_all(r.join("etc")).unwrap();
            std::fs::write(r.join("bin/app"), app).unwrap();
            std::fs::write(r.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
            b
        };
        let image = |bundle: &Path| match prepare(bundle, &[], Want::Image { cache: &cache })
            .unwrap()
            .guest
        {
            GuestRootfs::Image { image, built } => (image, built),
            g => panic!("{g:?}"),
        };
        let (a, built_a) = image(&tree("c1", b"app v1"));
        let (b, built_b) = image(&tree("c2", b"app v1"));
        assert_eq!(built_a, ::rootfs::image::Built::Now);
        assert_eq!(built_b, ::rootfs::image::Built::Cached);
        assert_eq!(a.path, b.path);
        assert!(a.meta.files.contains_key("/bin/app"), "{:?}", a.meta.files);
        // Another tree is another image.
        let (c, built_c) = image(&tree("c3", b"app v2"));
        assert_eq!(built_c, ::rootfs::image::Built::Now);
        assert_ne!(a.path, c.path);
    }
}
