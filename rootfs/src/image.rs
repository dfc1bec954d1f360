//! The shared read-only layer: an EROFS image per container image, built
//! once with `mkfs.erofs` and cached by digest (`<cache>/<digest>.erofs`
//! plus `<digest>.json`). Images are uncompressed, without xattrs and with
//! every timestamp 0 (`-x-1 -T0`): the agent's reader stays small, and the
//! same source always gives the same bytes.
//!
//! The digest is the OCI manifest digest for an image layout, the sha256 of
//! the file for an OCI archive, and a sha256 over the walk of a plain
//! directory (names, types, modes, owners, sizes, link targets, contents).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::oci::{self, SourceKind};
use crate::{io_err, run_tool, Error};

pub const DEFAULT_CACHE: &str = "/var/lib/burstvm/images";
/// The file the agent checksums when none is named, if the image has it.
pub const DEFAULT_CHECK_FILE: &str = "/etc/os-release";

/// Size and agent checksum (`guest::checksum`) of a regular file of the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSum {
    pub size: u64,
    pub checksum: u32,
}

/// `<digest>.json` next to the image.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageMeta {
    pub digest: String,
    pub source: String,
    pub kind: String,
    pub erofs_bytes: u64,
    /// Wall time of the build that made this image (unpack + mkfs + checksums).
    pub build_ms: f64,
    /// Every regular file: path in the image → size and checksum.
    pub files: BTreeMap<String, FileSum>,
}

/// A built image.
#[derive(Debug, Clone)]
pub struct Image {
    /// The EROFS file.
    pub path: PathBuf,
    pub meta: ImageMeta,
}

impl Image {
    /// An image given as its `.erofs` file, with the `.json` next to it.
    pub fn open(erofs: &Path) -> Result<Image, Error> {
        let mp = erofs.with_extension("json");
        let data = std::fs::read(&mp).map_err(io_err(&mp, "read image metadata"))?;
        let meta = serde_json::from_slice(&data).map_err(|source| Error::Meta {
            path: mp.clone(),
            source,
        })?;
        if !erofs.is_file() {
            return Err(Error::Source {
                path: erofs.to_path_buf(),
                reason: "no such EROFS image".into(),
            });
        }
        Ok(Image {
            path: erofs.to_path_buf(),
            meta,
        })
    }

    pub fn file(&self, path: &str) -> Option<FileSum> {
        self.meta.files.get(path).copied()
    }

    /// The file a sandbox checks when none is named: /etc/os-release, else
    /// the smallest non-empty file (guest code is slow; reading is the point,
    /// not volume).
    pub fn default_check_file(&self) -> Option<String> {
        if self.meta.files.contains_key(DEFAULT_CHECK_FILE) {
            return Some(DEFAULT_CHECK_FILE.into());
        }
        self.meta
            .files
            .iter()
            .filter(|(_, f)| f.size > 0)
            .min_by_key(|(p, f)| (f.size, p.len()))
            .map(|(p, _)| p.clone())
    }
}

/// Where built images live.
#[derive(Debug, Clone)]
pub struct ImageCache {
    dir: PathBuf,
}

/// What `build` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Built {
    Now,
    Cached,
}

impl ImageCache {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        ImageCache { dir: dir.into() }
    }

    /// `$BURSTVM_IMAGE_CACHE`, else [`DEFAULT_CACHE`].
    pub fn from_env() -> Self {
        Self::new(
            std::env::var_os("BURSTVM_IMAGE_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_CACHE)),
        )
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `arg` as an image: a built `.erofs` (with its `.json`), or a source
    /// to build (cached; with burstvm's Linux init if `init`).
    pub fn resolve(&self, arg: &Path, init: bool) -> Result<Image, Error> {
        if arg.extension().is_some_and(|e| e == "erofs") && arg.with_extension("json").is_file() {
            return Image::open(arg);
        }
        self.build_with(arg, init).map(|(i, _)| i)
    }

    /// Builds the EROFS image of `source`, or finds it in the cache.
    pub fn build(&self, source: &Path) -> Result<(Image, Built), Error> {
        self.build_with(source, false)
    }

    /// As `build`; with `init`, burstvm's Linux init (`guest::LINUX_INIT`)
    /// is installed as /sbin/init (and /dev, /proc, /sys made if missing),
    /// which makes it another image (digest suffix `+init`).
    pub fn build_with(&self, source: &Path, init: bool) -> Result<(Image, Built), Error> {
        let t0 = Instant::now();
        let kind = oci::kind_of(source)?;
        let manifest = match kind {
            SourceKind::OciLayout => Some(oci::read_manifest(source)?),
            _ => None,
        };
        let digest = match (&manifest, kind) {
            (Some(m), _) => m.digest.clone(),
            (None, SourceKind::OciArchive) => {
                let f = File::open(source).map_err(io_err(source, "open"))?;
                format!(
                    "archive-{}",
                    oci::sha256_of(std::io::BufReader::new(f), source)?
                )
            }
            (None, _) => format!("dir-{}", dir_digest(source)?),
        };
        let digest = if init {
            format!("{digest}+init")
        } else {
            digest
        };
        let key = digest.replace(':', "-");
        let erofs = self.dir.join(format!("{key}.erofs"));
        if let Ok(img) = Image::open(&erofs) {
            return Ok((img, Built::Cached));
        }
        std::fs::create_dir_all(&self.dir).map_err(io_err(&self.dir, "create image cache"))?;
        // One builder per image; a waiting one then finds the result.
        let lock_path = self.dir.join(format!("{key}.lock"));
        let lock = File::create(&lock_path).map_err(io_err(&lock_path, "create lock"))?;
        let _lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive).map_err(
            |(_, e)| Error::Io {
                path: lock_path.clone(),
                what: "lock",
                source: e.into(),
            },
        )?;
        if let Ok(img) = Image::open(&erofs) {
            return Ok((img, Built::Cached));
        }

        let staging = self.dir.join(format!("{key}.staging"));
        let _cleanup = RemoveOnDrop(staging.clone());
        let _ = std::fs::remove_dir_all(&staging);
        let root: PathBuf = match kind {
            SourceKind::Directory if !init => source.to_path_buf(),
            SourceKind::Directory => {
                let rootdir = staging.join("rootfs");
                std::fs::create_dir_all(&staging).map_err(io_err(&staging, "create"))?;
                run_tool("cp", Command::new("cp").arg("-a").arg(source).arg(&rootdir))?;
                rootdir
            }
            SourceKind::OciLayout => {
                let rootdir = staging.join("rootfs");
                std::fs::create_dir_all(&rootdir).map_err(io_err(&rootdir, "create"))?;
                oci::unpack_layers(source, manifest.as_ref().expect("read above"), &rootdir)?;
                rootdir
            }
            SourceKind::OciArchive => {
                let layout = staging.join("layout");
                std::fs::create_dir_all(&layout).map_err(io_err(&layout, "create"))?;
                oci::unpack_archive(source, &layout)?;
                let m = oci::read_manifest(&layout)?;
                let rootdir = staging.join("rootfs");
                std::fs::create_dir_all(&rootdir).map_err(io_err(&rootdir, "create"))?;
                oci::unpack_layers(&layout, &m, &rootdir)?;
                rootdir
            }
        };

        if init {
            install_init(&root)?;
        }
        let files = file_sums(&root)?;
        let tmp = self.dir.join(format!("{key}.erofs.tmp"));
        run_tool(
            "mkfs.erofs",
            Command::new("mkfs.erofs")
                .args(["-x-1", "-T0", "--quiet"])
                .arg(format!("-U{}", uuid_of(&digest)))
                .arg(&tmp)
                .arg(&root),
        )?;
        let erofs_bytes = std::fs::metadata(&tmp).map_err(io_err(&tmp, "stat"))?.len();
        let meta = ImageMeta {
            digest,
            source: source.display().to_string(),
            kind: kind.name().into(),
            erofs_bytes,
            build_ms: t0.elapsed().as_secs_f64() * 1e3,
            files,
        };
        let mp = erofs.with_extension("json");
        let mtmp = self.dir.join(format!("{key}.json.tmp"));
        std::fs::write(&mtmp, serde_json::to_vec_pretty(&meta).expect("json"))
            .map_err(io_err(&mtmp, "write"))?;
        // The image first, the metadata last: `open` needs both.
        std::fs::rename(&tmp, &erofs).map_err(io_err(&erofs, "rename"))?;
        std::fs::rename(&mtmp, &mp).map_err(io_err(&mp, "rename"))?;
        Ok((Image { path: erofs, meta }, Built::Now))
    }
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// burstvm's init as /sbin/init, and the mount points the kernel needs.
fn install_init(root: &Path) -> Result<(), Error> {
    use std::os::unix::fs::PermissionsExt;
    for d in ["sbin", "dev", "proc", "sys"] {
        let p = root.join(d);
        if std::fs::symlink_metadata(&p).is_err() {
            std::fs::create_dir(&p).map_err(io_err(&p, "create"))?;
        }
    }
    let init = root.join("sbin/init");
    let _ = std::fs::remove_file(&init);
    std::fs::write(&init, guest::LINUX_INIT).map_err(io_err(&init, "write"))?;
    std::fs::set_permissions(&init, std::fs::Permissions::from_mode(0o755))
        .map_err(io_err(&init, "chmod"))
}

/// A stable filesystem UUID from the digest (reproducible images).
fn uuid_of(digest: &str) -> String {
    let h = oci::hex(&Sha256::digest(digest.as_bytes())[..16]);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Entries of `root`, depth first in name order: (path relative to root, metadata).
fn walk(
    root: &Path,
    f: &mut dyn FnMut(&Path, &std::fs::Metadata) -> Result<(), Error>,
) -> Result<(), Error> {
    fn rec(
        root: &Path,
        rel: &Path,
        f: &mut dyn FnMut(&Path, &std::fs::Metadata) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let dir = root.join(rel);
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .map_err(io_err(&dir, "read dir"))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()
            .map_err(io_err(&dir, "read dir"))?;
        names.sort();
        for n in names {
            let r = rel.join(&n);
            let p = root.join(&r);
            let m = std::fs::symlink_metadata(&p).map_err(io_err(&p, "stat"))?;
            f(&r, &m)?;
            if m.is_dir() {
                rec(root, &r, f)?;
            }
        }
        Ok(())
    }
    rec(root, Path::new(""), f)
}

fn stream(path: &Path, mut each: impl FnMut(&[u8])) -> Result<(), Error> {
    let mut f = File::open(path).map_err(io_err(path, "open"))?;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f.read(&mut buf).map_err(io_err(path, "read"))?;
        if n == 0 {
            return Ok(());
        }
        each(&buf[..n]);
    }
}

/// sha256 over the walk of a directory tree (hex).
pub fn dir_digest(root: &Path) -> Result<String, Error> {
    let mut h = Sha256::new();
    walk(root, &mut |rel, m| {
        h.update(rel.as_os_str().as_encoded_bytes());
        h.update([0]);
        h.update(format!("{:o} {} {} {}", m.mode(), m.uid(), m.gid(), m.len()).as_bytes());
        let p = root.join(rel);
        if m.file_type().is_symlink() {
            let t = std::fs::read_link(&p).map_err(io_err(&p, "readlink"))?;
            h.update(t.as_os_str().as_encoded_bytes());
        } else if m.is_file() {
            stream(&p, |b| h.update(b))?;
        }
        h.update([0]);
        Ok(())
    })?;
    Ok(format!("sha256:{}", oci::hex(&h.finalize())))
}

/// Size and agent checksum of every regular file under `root`.
fn file_sums(root: &Path) -> Result<BTreeMap<String, FileSum>, Error> {
    let mut out = BTreeMap::new();
    walk(root, &mut |rel, m| {
        if m.is_file() {
            let mut c = guest::Checksum::default();
            stream(&root.join(rel), |b| c.add(b))?;
            out.insert(
                format!("/{}", rel.display()),
                FileSum {
                    size: m.len(),
                    checksum: c.finish(),
                },
            );
        }
        Ok(())
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(root: &Path) {
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::write(root.join("etc/os-release"), b"NAME=test\n").unwrap();
        std::fs::write(root.join("bin/app"), vec![7u8; 5000]).unwrap();
        std::os::unix::fs::symlink("app", root.join("bin/sh")).unwrap();
    }

    #[test]
    fn directory_build_is_cached_by_digest() {
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("src");
        tree(&src);
        let cache = ImageCache::new(t.path().join("cache"));
        let (a, built) = cache.build(&src).unwrap();
        assert_eq!(built, Built::Now);
        assert!(a.meta.digest.starts_with("dir-sha256:"));
        assert_eq!(
            a.meta.erofs_bytes,
            std::fs::metadata(&a.path).unwrap().len()
        );
        let mut magic = [0u8; 4];
        use std::os::unix::fs::FileExt;
        File::open(&a.path)
            .unwrap()
            .read_exact_at(&mut magic, 1024)
            .unwrap();
        assert_eq!(u32::from_le_bytes(magic), 0xE0F5_E1E2);
        assert_eq!(
            a.file("/bin/app"),
            Some(FileSum {
                size: 5000,
                checksum: guest::checksum(&[7u8; 5000])
            })
        );
        assert!(a.file("/bin/sh").is_none(), "symlinks are not files");
        assert_eq!(a.default_check_file().as_deref(), Some("/etc/os-release"));
        // Same tree: the cache answers, same bytes.
        let (b, built) = cache.build(&src).unwrap();
        assert_eq!((built, &b.path), (Built::Cached, &a.path));
        assert_eq!(Image::open(&a.path).unwrap().meta.digest, a.meta.digest);
        assert_eq!(cache.resolve(&a.path, false).unwrap().path, a.path);
        // With burstvm's init: another image, the source untouched.
        let (i, _) = cache.build_with(&src, true).unwrap();
        assert!(i.meta.digest.ends_with("+init"));
        assert_eq!(
            i.file("/sbin/init").unwrap().size,
            guest::LINUX_INIT.len() as u64
        );
        assert!(!src.join("sbin").exists());
        // A changed byte is another image.
        std::fs::write(src.join("bin/app"), vec![8u8; 5000]).unwrap();
        let (c, built) = cache.build(&src).unwrap();
        assert_eq!(built, Built::Now);
        assert_ne!(c.meta.digest, a.meta.digest);
        // No staging or lock debris besides the lock files.
        let left: Vec<String> = std::fs::read_dir(cache.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".staging") || n.ends_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn oci_layout_and_archive_build() {
        let t = tempfile::tempdir().unwrap();
        let layout = t.path().join("layout");
        let l = oci::tests::layer(
            &[("etc", None), ("etc/os-release", Some(b"ID=oci\n"))],
            true,
        );
        let md = oci::tests::make_layout(&layout, &[l]);
        let cache = ImageCache::new(t.path().join("cache"));
        let (img, _) = cache.build(&layout).unwrap();
        assert_eq!(img.meta.digest, md);
        assert_eq!(img.meta.kind, "oci-layout");
        assert_eq!(img.file("/etc/os-release").unwrap().size, 7);
        // The same layout as an archive.
        let archive = t.path().join("image.tar");
        let mut b = tar::Builder::new(File::create(&archive).unwrap());
        b.append_dir_all(".", &layout).unwrap();
        b.finish().unwrap();
        drop(b);
        let (img2, _) = cache.build(&archive).unwrap();
        assert_eq!(img2.meta.kind, "oci-archive");
        assert_eq!(img2.file("/etc/os-release"), img.file("/etc/os-release"));
        let e = cache
            .build(&t.path().join("missing"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing"), "{e}");
    }
}
