//! The volatile writable layer (RunD §4.2): an XFS filesystem burstvm
//! manages (a sparse file, loop-mounted with autoclear), a pre-made ext4
//! template on it, and per sandbox a reflink (FICLONE) of the template:
//! copy-on-write, so a new layer costs one ioctl however big the template
//! is. The VMM opens the clone and unlinks it (`--disk ...,unlink`), so
//! nothing persists after the sandbox; if the VMM never got that far, the
//! [`Layer`] removes it. Dropping [`WritableLayers`] unmounts the filesystem
//! (the loop device goes with it) and removes the backing file; [`reap`]
//! does the same for the layers of a runtime that died.
//!
//! For comparison, [`WritableLayers::copy_for`] makes a full copy of the
//! template instead (every allocated extent, holes stay holes).

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{io_err, run_tool, Error};

const TEMPLATE: &str = "template.ext4";
const CLONE_SUFFIX: &str = ".rw";

/// Where and how big.
#[derive(Debug, Clone)]
pub struct LayerConfig {
    /// Holds the backing file `rw.xfs` and the mount point `mnt/`; created,
    /// and removed on drop.
    pub dir: PathBuf,
    /// Size of the managed filesystem (a sparse file: only what is written costs).
    pub fs_bytes: u64,
    /// Capacity of each sandbox's writable layer (the ext4 template).
    pub template_bytes: u64,
}

impl LayerConfig {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        LayerConfig {
            dir: dir.into(),
            fs_bytes: 4 << 30,
            template_bytes: 64 << 20,
        }
    }
}

/// The managed filesystem and its template.
#[derive(Debug)]
pub struct WritableLayers {
    dir: PathBuf,
    backing: PathBuf,
    mnt: PathBuf,
    template: PathBuf,
    mounted: bool,
}

fn layers_err(dir: &Path, reason: impl Into<String>) -> Error {
    Error::Layers {
        path: dir.to_path_buf(),
        reason: reason.into(),
    }
}

/// mkfs.ext4's arguments for the template. A writable layer lives as long
/// as its sandbox (the VMM unlinks its clone at open), so a journal would
/// protect nothing the sandbox outlives, and checksums guard no medium that
/// anyone but this one guest writes: both are off. 4 KiB blocks make 64 MiB
/// one block group instead of mkfs's eight of 1 KiB. The inode tables are
/// zeroed here, once per template, not by the guest's ext4lazyinit thread
/// after every mount. Under kvm_pvm, which emulates the guest kernel, a
/// container start executes 0.46 M fewer emulated instructions this way and
/// its `rootfs-mount` stage fell from 1.8 to 1.5 s (docs/rootfs.md).
pub const EXT4_ARGS: &[&str] = &[
    "-q",
    "-F",
    "-L",
    "burstvm-rw",
    "-b",
    "4096",
    "-O",
    "^has_journal,^metadata_csum",
    "-E",
    "lazy_itable_init=0",
];

impl WritableLayers {
    /// Creates the filesystem (mkfs.xfs with reflink), mounts it and makes
    /// the template (mkfs.ext4). On error, whatever was made is undone.
    pub fn create(cfg: &LayerConfig) -> Result<WritableLayers, Error> {
        let dir = cfg.dir.clone();
        let mnt = dir.join("mnt");
        std::fs::create_dir_all(&mnt).map_err(io_err(&mnt, "create"))?;
        let mut l = WritableLayers {
            backing: dir.join("rw.xfs"),
            template: mnt.join(TEMPLATE),
            mnt,
            dir,
            mounted: false,
        };
        // From here on, `l` is dropped (and cleaned) on any error.
        let f = File::create(&l.backing).map_err(io_err(&l.backing, "create"))?;
        f.set_len(cfg.fs_bytes)
            .map_err(io_err(&l.backing, "size"))?;
        drop(f);
        run_tool(
            "mkfs.xfs",
            Command::new("mkfs.xfs")
                .args(["-q", "-m", "reflink=1"])
                .arg(&l.backing),
        )?;
        // mount(8) sets the loop device up with autoclear: it is detached
        // when the filesystem is unmounted.
        run_tool(
            "mount",
            Command::new("mount")
                .args(["-t", "xfs", "-o", "loop,nodev,nosuid,noexec"])
                .arg(&l.backing)
                .arg(&l.mnt),
        )?;
        l.mounted = true;
        let t = File::create(&l.template).map_err(io_err(&l.template, "create"))?;
        t.set_len(cfg.template_bytes)
            .map_err(io_err(&l.template, "size"))?;
        drop(t);
        run_tool(
            "mkfs.ext4",
            Command::new("mkfs.ext4").args(EXT4_ARGS).arg(&l.template),
        )?;
        Ok(l)
    }

    pub fn template(&self) -> &Path {
        &self.template
    }

    pub fn mount_point(&self) -> &Path {
        &self.mnt
    }

    pub fn backing_file(&self) -> &Path {
        &self.backing
    }

    fn clone_path(&self, id: &str) -> Result<PathBuf, Error> {
        if id.is_empty() || id.contains('/') || id.starts_with('.') {
            return Err(layers_err(
                &self.dir,
                format!("sandbox id {id:?} cannot name a file"),
            ));
        }
        Ok(self.mnt.join(format!("{id}{CLONE_SUFFIX}")))
    }

    /// A reflink of the template for sandbox `id` (RunD's "build-in storage image").
    pub fn clone_for(&self, id: &str) -> Result<Layer, Error> {
        let path = self.clone_path(id)?;
        let src = File::open(&self.template).map_err(io_err(&self.template, "open template"))?;
        let dst = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io_err(&path, "create clone"))?;
        let layer = Layer { path, copied: 0 };
        // SAFETY: FICLONE takes the source fd as its argument; both fds are open.
        if unsafe { libc::ioctl(dst.as_raw_fd(), libc::FICLONE, src.as_raw_fd()) } < 0 {
            return Err(Error::Io {
                path: layer.path.clone(),
                what: "FICLONE from the template",
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(layer)
    }

    /// A full copy of the template for sandbox `id` (the baseline RunD
    /// replaces): every allocated extent is read and written; holes stay holes.
    pub fn copy_for(&self, id: &str) -> Result<Layer, Error> {
        let path = self.clone_path(id)?;
        let src = File::open(&self.template).map_err(io_err(&self.template, "open template"))?;
        let size = src
            .metadata()
            .map_err(io_err(&self.template, "stat"))?
            .len();
        let dst = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io_err(&path, "create copy"))?;
        let mut layer = Layer { path, copied: 0 };
        dst.set_len(size).map_err(io_err(&layer.path, "size"))?;
        let mut buf = vec![0u8; 1 << 20];
        let mut off = 0u64;
        while let Some((start, end)) =
            next_extent(&src, off, size).map_err(io_err(&self.template, "SEEK_DATA/SEEK_HOLE"))?
        {
            let mut at = start;
            while at < end {
                let n = ((end - at) as usize).min(buf.len());
                src.read_exact_at(&mut buf[..n], at)
                    .map_err(io_err(&self.template, "read"))?;
                dst.write_all_at(&buf[..n], at)
                    .map_err(io_err(&layer.path, "write"))?;
                at += n as u64;
                layer.copied += n as u64;
            }
            off = end;
        }
        Ok(layer)
    }

    /// sha256 (hex) of the template's bytes: it must never change.
    pub fn template_digest(&self) -> Result<String, Error> {
        let f = File::open(&self.template).map_err(io_err(&self.template, "open template"))?;
        crate::oci::sha256_of(std::io::BufReader::new(f), &self.template)
    }

    /// Files on the managed filesystem besides the template: clones nobody
    /// removed (leak check).
    pub fn leftovers(&self) -> Vec<PathBuf> {
        std::fs::read_dir(&self.mnt)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| {
                        p.file_name()
                            .is_some_and(|n| n != TEMPLATE && n != "lost+found")
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for WritableLayers {
    fn drop(&mut self) {
        if self.mounted {
            if let Err(e) = unmount(&self.mnt) {
                tracing::warn!("{e}");
            }
        }
        let _ = std::fs::remove_file(&self.backing);
        let _ = std::fs::remove_dir(&self.mnt);
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// The next data extent at or after `off`: (start, end).
fn next_extent(f: &File, off: u64, size: u64) -> std::io::Result<Option<(u64, u64)>> {
    if off >= size {
        return Ok(None);
    }
    let fd = f.as_raw_fd();
    // SAFETY: lseek on an open fd.
    let start = unsafe { libc::lseek(fd, off as libc::off_t, libc::SEEK_DATA) };
    if start < 0 {
        let e = std::io::Error::last_os_error();
        // ENXIO: no data after `off`.
        return if e.raw_os_error() == Some(libc::ENXIO) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    // SAFETY: as above.
    let end = unsafe { libc::lseek(fd, start, libc::SEEK_HOLE) };
    if end < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(Some((start as u64, (end as u64).min(size))))
}

/// One sandbox's writable layer. Dropping it removes the file if the VMM
/// has not unlinked it (it never started, or died before opening it).
#[derive(Debug)]
pub struct Layer {
    path: PathBuf,
    copied: u64,
}

impl Layer {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes written to make it (0 for a reflink).
    pub fn bytes_copied(&self) -> u64 {
        self.copied
    }
}

impl Drop for Layer {
    fn drop(&mut self) {
        match std::fs::remove_file(&self.path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                tracing::warn!("writable layer {}: {e}", self.path.display())
            }
            _ => {}
        }
    }
}

/// Whether `path` is a mount point (/proc/self/mountinfo).
pub fn is_mounted(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.to_string_lossy();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| unescape(m) == want)
}

/// mountinfo escapes space, tab, newline and backslash as \ooo.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 4], 8) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Loop devices whose backing file is `file` (/sys/block/loop*/loop/backing_file).
pub fn loops_backed_by(file: &Path) -> Vec<String> {
    let want = file.to_string_lossy();
    std::fs::read_dir("/sys/block")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with("loop"))
                .filter(|e| {
                    std::fs::read_to_string(e.path().join("loop/backing_file"))
                        .is_ok_and(|b| b.trim_end().trim_end_matches(" (deleted)") == want)
                })
                .map(|e| format!("/dev/{}", e.file_name().to_string_lossy()))
                .collect()
        })
        .unwrap_or_default()
}

/// Unmounts `mnt`; a filesystem still busy (a VMM holding an unlinked
/// clone) is detached lazily and goes, with its loop device, when released.
fn unmount(mnt: &Path) -> Result<(), Error> {
    use nix::mount::{umount2, MntFlags};
    for _ in 0..20 {
        match umount2(mnt, MntFlags::empty()) {
            Ok(()) => return Ok(()),
            Err(nix::Error::EBUSY) => std::thread::sleep(Duration::from_millis(50)),
            Err(nix::Error::EINVAL) => return Ok(()), // not mounted
            Err(e) => {
                return Err(Error::Io {
                    path: mnt.to_path_buf(),
                    what: "umount",
                    source: e.into(),
                })
            }
        }
    }
    umount2(mnt, MntFlags::MNT_DETACH).map_err(|e| Error::Io {
        path: mnt.to_path_buf(),
        what: "umount (lazy)",
        source: e.into(),
    })
}

/// Removes the layers a dead runtime left in `dir` (its mount first, so that
/// removing the directory never reaches into the mounted filesystem).
/// Returns what was removed.
pub fn reap(dir: &Path) -> Vec<String> {
    let mut done = Vec::new();
    let mnt = dir.join("mnt");
    if is_mounted(&mnt) {
        match unmount(&mnt) {
            Ok(()) => done.push(format!("mount {}", mnt.display())),
            Err(e) => {
                tracing::warn!("{e}");
                return done; // never remove files under a live mount
            }
        }
    }
    if dir.exists() && std::fs::remove_dir_all(dir).is_ok() {
        done.push(format!("writable layers {}", dir.display()));
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    fn sha(p: &Path) -> Vec<u8> {
        Sha256::digest(std::fs::read(p).unwrap()).to_vec()
    }

    fn cfg(name: &str) -> LayerConfig {
        let mut c = LayerConfig::new(
            std::env::temp_dir().join(format!("bv-layers-{name}-{}", std::process::id())),
        );
        c.fs_bytes = 512 << 20;
        c.template_bytes = 16 << 20;
        c
    }

    #[test]
    fn clones_are_private_and_everything_goes_on_drop() {
        let c = cfg("clones");
        let l = WritableLayers::create(&c).unwrap();
        assert!(is_mounted(l.mount_point()));
        let backing = l.backing_file().to_path_buf();
        assert_eq!(loops_backed_by(&backing).len(), 1);
        let before = sha(l.template());

        let a = l.clone_for("sb-a").unwrap();
        let b = l.clone_for("sb-b").unwrap();
        assert_eq!(a.bytes_copied(), 0);
        File::options()
            .write(true)
            .open(a.path())
            .unwrap()
            .write_all_at(b"marker of sb-a", 0)
            .unwrap();
        let mut got = [0u8; 14];
        File::open(b.path())
            .unwrap()
            .read_exact_at(&mut got, 0)
            .unwrap();
        assert_eq!(
            got, [0u8; 14],
            "one sandbox's write is invisible to another"
        );
        assert_eq!(sha(l.template()), before, "the template is unchanged");
        // The template is EXT4_ARGS's: no journal, no checksums, 4 KiB blocks.
        let out = Command::new("dumpe2fs")
            .arg("-h")
            .arg(l.template())
            .output()
            .unwrap();
        let h = String::from_utf8_lossy(&out.stdout);
        let features = h
            .lines()
            .find(|l| l.starts_with("Filesystem features:"))
            .unwrap();
        assert!(features.contains("extent"), "{features}");
        assert!(!features.contains("has_journal"), "{features}");
        assert!(!features.contains("metadata_csum"), "{features}");
        assert!(
            h.lines()
                .any(|l| l.starts_with("Block size:") && l.ends_with(" 4096")),
            "{h}"
        );
        assert!(l.clone_for("sb-a").is_err(), "one layer per sandbox");
        assert!(l.clone_for("../x").is_err());

        // The full copy: same bytes as the template, written out.
        let c2 = l.copy_for("sb-copy").unwrap();
        assert!(c2.bytes_copied() > 0);
        assert_eq!(sha(c2.path()), before);

        // A clone the VMM unlinked and one it never opened: both gone.
        std::fs::remove_file(a.path()).unwrap();
        drop((a, b, c2));
        assert!(l.leftovers().is_empty(), "{:?}", l.leftovers());
        drop(l);
        assert!(!is_mounted(&c.dir.join("mnt")));
        assert!(loops_backed_by(&backing).is_empty());
        assert!(!c.dir.exists());
    }

    #[test]
    fn reap_unmounts_before_removing() {
        let c = cfg("reap");
        let l = WritableLayers::create(&c).unwrap();
        let keep = l.clone_for("left-behind").unwrap();
        let backing = l.backing_file().to_path_buf();
        // A runtime killed with SIGKILL runs no destructor.
        std::mem::forget(keep);
        std::mem::forget(l);
        let done = reap(&c.dir);
        assert!(done.iter().any(|d| d.starts_with("mount")), "{done:?}");
        assert!(!c.dir.exists());
        assert!(loops_backed_by(&backing).is_empty());
        assert!(reap(&c.dir).is_empty());
    }
}
