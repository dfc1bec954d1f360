//! The shared read-only layer: an EROFS image per container image, built
//! once with `mkfs.erofs` and cached by digest (`<cache>/<digest>.erofs`
//! plus `<digest>.json`). Images are uncompressed, without xattrs and with
//! every timestamp 0 (`-x-1 -T0`): the agent's reader stays small, and the
//! same source always gives the same bytes.
//!
//! The digest is the OCI manifest digest for an image layout, the sha256 of
//! the file for an OCI archive, and a sha256 over the walk of a plain
//! directory (names, types, modes, owners, sizes, link targets, contents).
//!
//! The sidecar also keeps an OCI image's config (entrypoint, cmd, env, cwd,
//! user) and its user resolved to numeric ids against the image's own
//! /etc/passwd and /etc/group, which only the build sees unpacked.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::LazyLock;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::{resolve_user, ExecUser, ImageConfig};
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
    /// The OCI image config; `None` for a directory source (and in sidecars
    /// written before burstvm kept it).
    #[serde(default)]
    pub config: Option<ImageConfig>,
    /// `config.user` resolved at build time against the image's
    /// /etc/passwd and /etc/group; `None` when `config` is.
    #[serde(default)]
    pub exec_user: Option<ExecUser>,
}

impl ImageMeta {
    /// Whether the sidecar has everything this build of burstvm writes: an
    /// OCI image's sidecar from before the image config was kept does not,
    /// and the cache builds that image again.
    fn is_current(&self) -> bool {
        self.kind == SourceKind::Directory.name()
            || (self.config.is_some() && self.exec_user.is_some())
    }
}

/// What an image without a config runs with: nothing, in `/`, as root.
static NO_CONFIG: LazyLock<ImageConfig> = LazyLock::new(ImageConfig::default);
static ROOT: LazyLock<ExecUser> = LazyLock::new(ExecUser::root);

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

    /// The image's config; for a directory source (no config): no
    /// entrypoint or cmd, no env, cwd `/`, user root.
    pub fn config(&self) -> &ImageConfig {
        self.meta.config.as_ref().unwrap_or(&NO_CONFIG)
    }

    /// The numeric user the image's processes run as (resolved at build
    /// time); root (0/0, no additional groups, home `/`) without a config.
    pub fn exec_user(&self) -> &ExecUser {
        self.meta.exec_user.as_ref().unwrap_or(&ROOT)
    }

    /// The process's argv: the entrypoint, then `override_cmd` if not
    /// empty, else the image's cmd (Docker's rule); an error naming the
    /// image if that leaves nothing to run.
    pub fn args(&self, override_cmd: &[String]) -> Result<Vec<String>, Error> {
        self.config()
            .args(override_cmd)
            .map_err(|source| Error::Command {
                image: self.meta.source.clone(),
                source,
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
        let cached = |erofs: &Path| Image::open(erofs).ok().filter(|i| i.meta.is_current());
        if let Some(img) = cached(&erofs) {
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
        if let Some(img) = cached(&erofs) {
            return Ok((img, Built::Cached));
        }

        let staging = self.dir.join(format!("{key}.staging"));
        let _cleanup = RemoveOnDrop(staging.clone());
        let _ = std::fs::remove_dir_all(&staging);
        let (root, config): (PathBuf, Option<ImageConfig>) = match kind {
            SourceKind::Directory if !init => (source.to_path_buf(), None),
            SourceKind::Directory => {
                let rootdir = staging.join("rootfs");
                std::fs::create_dir_all(&staging).map_err(io_err(&staging, "create"))?;
                run_tool("cp", Command::new("cp").arg("-a").arg(source).arg(&rootdir))?;
                (rootdir, None)
            }
            SourceKind::OciLayout => {
                let m = manifest.as_ref().expect("read above");
                let config = oci::read_config(source, m)?;
                let rootdir = staging.join("rootfs");
                std::fs::create_dir_all(&rootdir).map_err(io_err(&rootdir, "create"))?;
                oci::unpack_layers(source, m, &rootdir)?;
                (rootdir, Some(config))
            }
            SourceKind::OciArchive => {
                let layout = staging.join("layout");
                std::fs::create_dir_all(&layout).map_err(io_err(&layout, "create"))?;
                oci::unpack_archive(source, &layout)?;
                let m = oci::read_manifest(&layout)?;
                let config = oci::read_config(&layout, &m)?;
                let rootdir = staging.join("rootfs");
                std::fs::create_dir_all(&rootdir).map_err(io_err(&rootdir, "create"))?;
                oci::unpack_layers(&layout, &m, &rootdir)?;
                (rootdir, Some(config))
            }
        };
        // The user is resolved here, where the image's /etc is unpacked.
        let exec_user = match &config {
            Some(c) => Some(resolve_user(&root, &c.user).map_err(|e| Error::User {
                image: source.display().to_string(),
                user: c.user.clone(),
                source: e,
            })?),
            None => None,
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
            config,
            exec_user,
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
        let md = oci::tests::make_layout(&layout, &[l], "{}");
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

    fn strs(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// A layer with /etc/passwd and /etc/group (`app` 1000:1000, also in
    /// wheel), and an image config JSON with `config`.
    fn etc_layer() -> Vec<u8> {
        oci::tests::layer(
            &[
                ("etc", None),
                (
                    "etc/passwd",
                    Some(b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n"),
                ),
                (
                    "etc/group",
                    Some(b"root:x:0:\nwheel:x:10:app\napp:x:1000:\nstaff:x:50:\n"),
                ),
            ],
            true,
        )
    }

    fn config_json(config: serde_json::Value) -> String {
        serde_json::json!({"architecture":"amd64","os":"linux","config":config,
            "rootfs":{"type":"layers","diff_ids":[]}})
        .to_string()
    }

    fn archive_of(layout: &Path, archive: &Path) {
        let mut b = tar::Builder::new(File::create(archive).unwrap());
        b.append_dir_all(".", layout).unwrap();
        b.finish().unwrap();
    }

    #[test]
    fn image_config_is_kept_with_the_image() {
        let t = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(t.path().join("cache"));
        let layout = t.path().join("layout");
        let cfg = config_json(serde_json::json!({
            "Entrypoint": ["/bin/tini", "--"], "Cmd": ["sh", "-c", "echo hi"],
            "Env": ["PATH=/bin", "A=b=c"], "WorkingDir": "/srv", "User": "app"}));
        oci::tests::make_layout(&layout, &[etc_layer()], &cfg);
        let (img, _) = cache.build(&layout).unwrap();
        let c = img.config();
        assert_eq!(c.entrypoint, strs(&["/bin/tini", "--"]));
        assert_eq!(c.cmd, strs(&["sh", "-c", "echo hi"]));
        assert_eq!(c.env, strs(&["PATH=/bin", "A=b=c"]));
        assert_eq!((c.working_dir.as_str(), c.user.as_str()), ("/srv", "app"));
        let app = ExecUser {
            uid: 1000,
            gid: 1000,
            additional_gids: vec![10],
            home: "/home/app".into(),
        };
        assert_eq!(img.exec_user(), &app);
        assert_eq!(
            img.args(&[]).unwrap(),
            strs(&["/bin/tini", "--", "sh", "-c", "echo hi"])
        );
        assert_eq!(
            img.args(&strs(&["id"])).unwrap(),
            strs(&["/bin/tini", "--", "id"])
        );
        // In the sidecar: a fresh open reads the same.
        let again = Image::open(&img.path).unwrap();
        assert_eq!(again.config(), c);
        assert_eq!(again.exec_user(), &app);
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(img.path.with_extension("json")).unwrap())
                .unwrap();
        assert_eq!(json["config"]["cmd"][0], "sh");
        assert_eq!(json["exec_user"]["additional_gids"][0], 10);

        // The same layout as an archive, with Docker's config media type.
        let dlayout = t.path().join("docker");
        oci::tests::make_layout_typed(
            &dlayout,
            &[etc_layer()],
            &cfg,
            "application/vnd.docker.container.image.v1+json",
        );
        let archive = t.path().join("image.tar");
        archive_of(&dlayout, &archive);
        let (aimg, _) = cache.build(&archive).unwrap();
        assert_eq!(aimg.meta.kind, "oci-archive");
        assert_eq!(aimg.config(), c);
        assert_eq!(aimg.exec_user(), &app);
        // With burstvm's init: the same config.
        let (iimg, _) = cache.build_with(&archive, true).unwrap();
        assert_eq!((iimg.config(), iimg.exec_user()), (c, &app));

        // No config fields: Docker's defaults; nothing to run without a command.
        let bare = t.path().join("bare");
        oci::tests::make_layout(&bare, &[etc_layer()], &config_json(serde_json::json!({})));
        let (b, _) = cache.build(&bare).unwrap();
        assert_eq!(b.meta.config.as_ref(), Some(&ImageConfig::default()));
        assert_eq!(b.config().working_dir, "/");
        assert_eq!(
            b.exec_user(),
            &ExecUser {
                home: "/root".into(),
                ..ExecUser::root()
            }
        );
        let e = b.args(&[]).unwrap_err().to_string();
        assert!(
            e.contains(bare.to_str().unwrap()) && e.contains("no command"),
            "{e}"
        );
        assert_eq!(b.args(&strs(&["ls"])).unwrap(), strs(&["ls"]));

        // A directory has no config: nothing to run, in /, as root.
        let src = t.path().join("src");
        tree(&src);
        let (d, _) = cache.build(&src).unwrap();
        assert!(d.meta.config.is_none() && d.meta.exec_user.is_none());
        assert_eq!(d.config(), &ImageConfig::default());
        assert_eq!(d.exec_user(), &ExecUser::root());
        assert!(d.args(&[]).is_err());
    }

    #[test]
    fn image_users_resolve_from_the_layers() {
        let t = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(t.path().join("cache"));
        // The files may come from a later layer (this one replaces passwd).
        let top = oci::tests::layer(
            &[(
                "etc/passwd",
                Some(b"root:x:0:0::/root:\napp:x:1000:1000::/home/app:\nsvc:x:7:50::/svc:\n"),
            )],
            false,
        );
        let cases: &[(&str, u32, u32, &[u32])] = &[
            ("", 0, 0, &[]),
            ("app", 1000, 1000, &[10]),
            ("1000", 1000, 1000, &[10]),
            ("1000:50", 1000, 50, &[]),
            ("app:wheel", 1000, 10, &[]),
            ("svc", 7, 50, &[]),
            ("4242", 4242, 0, &[]),
            ("4242:4243", 4242, 4243, &[]),
        ];
        for (i, (spec, uid, gid, gids)) in cases.iter().enumerate() {
            let layout = t.path().join(format!("l{i}"));
            let cfg = config_json(serde_json::json!({"Cmd":["sh"],"User":spec}));
            oci::tests::make_layout(&layout, &[etc_layer(), top.clone()], &cfg);
            let (img, _) = cache.build(&layout).unwrap();
            let u = img.exec_user();
            assert_eq!(
                (u.uid, u.gid, u.additional_gids.as_slice()),
                (*uid, *gid, *gids),
                "user {spec:?}"
            );
        }
        // Unknown names are errors naming the image and the user.
        for (i, spec) in ["nobody", "app:nogroup", "nobody:0"].iter().enumerate() {
            let layout = t.path().join(format!("bad{i}"));
            let cfg = config_json(serde_json::json!({"Cmd":["sh"],"User":spec}));
            oci::tests::make_layout(&layout, &[etc_layer()], &cfg);
            let e = cache.build(&layout).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, Error::User { .. }), "{msg}");
            assert!(
                msg.contains(layout.to_str().unwrap()) && msg.contains(&format!("{spec:?}")),
                "{msg}"
            );
        }
        // A numeric user needs no /etc/passwd; a name does.
        let empty = oci::tests::layer(&[("bin", None)], true);
        let layout = t.path().join("nopasswd");
        let cfg = config_json(serde_json::json!({"Cmd":["sh"],"User":"1000:1000"}));
        oci::tests::make_layout(&layout, std::slice::from_ref(&empty), &cfg);
        let (img, _) = cache.build(&layout).unwrap();
        assert_eq!((img.exec_user().uid, img.exec_user().gid), (1000, 1000));
        let layout = t.path().join("nopasswd-name");
        let cfg = config_json(serde_json::json!({"Cmd":["sh"],"User":"app"}));
        oci::tests::make_layout(&layout, &[empty], &cfg);
        let e = cache.build(&layout).unwrap_err().to_string();
        assert!(e.contains("no user \"app\" in /etc/passwd"), "{e}");
    }

    #[test]
    fn a_bad_config_blob_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(t.path().join("cache"));
        let layout = t.path().join("layout");
        let cfg = config_json(serde_json::json!({"Cmd":["sh"]}));
        oci::tests::make_layout(&layout, &[etc_layer()], &cfg);
        // A changed byte in the config blob: its digest no longer matches.
        let m = oci::read_manifest(&layout).unwrap();
        let blob = layout
            .join("blobs/sha256")
            .join(m.config.digest.strip_prefix("sha256:").unwrap());
        std::fs::write(&blob, cfg.replace("sh", "zz")).unwrap();
        let e = cache.build(&layout).unwrap_err().to_string();
        assert!(
            e.contains("digest is") && e.contains(&m.config.digest),
            "{e}"
        );
        // So in an archive.
        let archive = t.path().join("image.tar");
        archive_of(&layout, &archive);
        let e = cache.build(&archive).unwrap_err().to_string();
        assert!(e.contains("digest is"), "{e}");
        // A config of another media type (an artifact) is not an image.
        let other = t.path().join("artifact");
        oci::tests::make_layout_typed(
            &other,
            &[etc_layer()],
            &cfg,
            "application/vnd.cncf.helm.config.v1+json",
        );
        let e = cache.build(&other).unwrap_err().to_string();
        assert!(e.contains("is not an image config"), "{e}");
        // Cmd as a string is not an image config's Cmd.
        let wrong = t.path().join("wrong");
        oci::tests::make_layout(&wrong, &[etc_layer()], r#"{"config":{"Cmd":"sh"}}"#);
        let e = cache.build(&wrong).unwrap_err();
        assert!(matches!(e, Error::Config { .. }), "{e}");
    }

    #[test]
    fn sidecars_from_before_the_config_still_open() {
        let t = tempfile::tempdir().unwrap();
        // A sidecar as this crate wrote it before the image config was kept.
        let erofs = t.path().join("sha256-old.erofs");
        std::fs::write(&erofs, b"image").unwrap();
        std::fs::write(
            erofs.with_extension("json"),
            r#"{"digest":"sha256:old","source":"/img/old.tar","kind":"oci-archive",
                "erofs_bytes":5,"build_ms":1.0,
                "files":{"/etc/os-release":{"size":7,"checksum":1}}}"#,
        )
        .unwrap();
        let img = Image::open(&erofs).unwrap();
        assert!(img.meta.config.is_none());
        assert_eq!(img.file("/etc/os-release").unwrap().size, 7);
        assert_eq!(img.config(), &ImageConfig::default());
        assert_eq!(img.exec_user(), &ExecUser::root());
        let e = img.args(&[]).unwrap_err().to_string();
        assert!(e.contains("/img/old.tar"), "{e}");

        // The cache builds an OCI image whose sidecar lacks the config again.
        let cache = ImageCache::new(t.path().join("cache"));
        let layout = t.path().join("layout");
        let cfg = config_json(serde_json::json!({"Cmd":["sh"],"User":"app"}));
        oci::tests::make_layout(&layout, &[etc_layer()], &cfg);
        let (img, _) = cache.build(&layout).unwrap();
        let sidecar = img.path.with_extension("json");
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&sidecar).unwrap()).unwrap();
        let o = json.as_object_mut().unwrap();
        o.remove("config");
        o.remove("exec_user");
        std::fs::write(&sidecar, serde_json::to_vec(&json).unwrap()).unwrap();
        assert!(Image::open(&img.path).unwrap().meta.config.is_none());
        let (again, built) = cache.build(&layout).unwrap();
        assert_eq!(built, Built::Now);
        assert_eq!(again.config().cmd, strs(&["sh"]));
        assert_eq!(again.exec_user().uid, 1000);
        let (_, built) = cache.build(&layout).unwrap();
        assert_eq!(built, Built::Cached);
    }
}
