//! OCI images (image-spec v1.1): an image layout directory (`oci-layout`,
//! `index.json`, `blobs/`), or its tar archive (`skopeo copy ... oci-archive:`,
//! `docker save` since 25.0), unpacked into a directory layer by layer with
//! whiteouts applied, and its image config read ([`read_config`]). Every
//! blob's digest is checked before it is used, and no path of a layer may
//! reach outside the destination.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Stdio};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::{io_err, Error, ImageConfig};

const MT_INDEX: &[&str] = &[
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];
/// Image config media types: OCI's and Docker's.
const MT_CONFIG: &[&str] = &[
    "application/vnd.oci.image.config.v1+json",
    "application/vnd.docker.container.image.v1+json",
];
const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";

/// What a build source is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    /// A plain directory: the rootfs as is.
    Directory,
    /// An OCI image layout directory.
    OciLayout,
    /// A tar archive of an OCI image layout.
    OciArchive,
}

impl SourceKind {
    pub fn name(self) -> &'static str {
        match self {
            SourceKind::Directory => "directory",
            SourceKind::OciLayout => "oci-layout",
            SourceKind::OciArchive => "oci-archive",
        }
    }
}

pub fn kind_of(path: &Path) -> Result<SourceKind, Error> {
    let meta = std::fs::metadata(path).map_err(io_err(path, "stat"))?;
    Ok(if meta.is_dir() {
        if path.join("oci-layout").is_file() {
            SourceKind::OciLayout
        } else {
            SourceKind::Directory
        }
    } else {
        SourceKind::OciArchive
    })
}

#[derive(Debug, Clone, Deserialize)]
pub struct Descriptor {
    #[serde(rename = "mediaType", default)]
    pub media_type: String,
    pub digest: String,
    #[serde(default)]
    pub platform: Option<Platform>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Platform {
    pub architecture: String,
    pub os: String,
}

#[derive(Deserialize)]
struct Index {
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct ManifestJson {
    config: Descriptor,
    layers: Vec<Descriptor>,
}

/// The image manifest chosen from the layout (linux/amd64, or the only one).
#[derive(Debug, Clone)]
pub struct Manifest {
    /// The manifest's digest: the image's identity.
    pub digest: String,
    /// The image config blob.
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
}

fn bad(path: &Path, reason: impl Into<String>) -> Error {
    Error::Source {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// `blobs/<alg>/<hex>` for a digest; only sha256 with 64 hex digits, so a
/// digest can never name a path outside the layout.
fn blob_path(layout: &Path, digest: &str) -> Result<PathBuf, Error> {
    match digest.split_once(':') {
        Some(("sha256", hex)) if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
            Ok(layout.join("blobs/sha256").join(hex))
        }
        _ => Err(bad(layout, format!("unsupported digest {digest:?}"))),
    }
}

/// sha256 of a stream, as an OCI digest string.
pub fn sha256_of(mut r: impl Read, path: &Path) -> Result<String, Error> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = r.read(&mut buf).map_err(io_err(path, "read"))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("sha256:{}", hex(&h.finalize())))
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Reads a blob whose digest must match.
fn read_blob(layout: &Path, digest: &str) -> Result<Vec<u8>, Error> {
    let p = blob_path(layout, digest)?;
    let data = std::fs::read(&p).map_err(io_err(&p, "read blob"))?;
    let got = sha256_of(&data[..], &p)?;
    if got != digest {
        return Err(bad(&p, format!("digest is {got}, expected {digest}")));
    }
    Ok(data)
}

fn platform_ok(d: &Descriptor) -> bool {
    d.platform
        .as_ref()
        .is_none_or(|p| p.os == "linux" && p.architecture == "amd64")
}

/// The image manifest of an OCI layout: index.json, through at most one
/// nested index, to the first linux/amd64 (or platform-less) manifest.
pub fn read_manifest(layout: &Path) -> Result<Manifest, Error> {
    let ip = layout.join("index.json");
    let data = std::fs::read(&ip).map_err(io_err(&ip, "read"))?;
    let mut index: Index =
        serde_json::from_slice(&data).map_err(|source| Error::Meta { path: ip, source })?;
    for _depth in 0..2 {
        let d = index
            .manifests
            .iter()
            .find(|d| platform_ok(d))
            .cloned()
            .ok_or_else(|| bad(layout, "no linux/amd64 manifest in index.json"))?;
        let blob = read_blob(layout, &d.digest)?;
        let meta_err = |source| Error::Meta {
            path: layout.join(&d.digest),
            source,
        };
        if MT_INDEX.contains(&d.media_type.as_str()) {
            index = serde_json::from_slice(&blob).map_err(meta_err)?;
            continue;
        }
        let m: ManifestJson = serde_json::from_slice(&blob).map_err(meta_err)?;
        return Ok(Manifest {
            digest: d.digest,
            config: m.config,
            layers: m.layers,
        });
    }
    Err(bad(layout, "image indexes nested deeper than two levels"))
}

/// The image config (Entrypoint, Cmd, Env, WorkingDir, User) of the
/// manifest: its blob digest-checked, its media type an image config's.
pub fn read_config(layout: &Path, m: &Manifest) -> Result<ImageConfig, Error> {
    let d = &m.config;
    if !d.media_type.is_empty() && !MT_CONFIG.contains(&d.media_type.as_str()) {
        return Err(bad(
            layout,
            format!(
                "config {}: media type {:?} is not an image config",
                d.digest, d.media_type
            ),
        ));
    }
    let blob = read_blob(layout, &d.digest)?;
    ImageConfig::from_blob(&blob).map_err(|source| Error::Config {
        path: blob_path(layout, &d.digest).unwrap_or_else(|_| layout.join(&d.digest)),
        source,
    })
}

/// `rel` joined onto `root` if every existing component up to its parent is
/// a real directory (no symlink), so a whiteout never deletes outside `root`.
fn inside(root: &Path, rel: &Path) -> Option<PathBuf> {
    let mut p = root.to_path_buf();
    let comps: Vec<Component> = rel.components().collect();
    for (i, c) in comps.iter().enumerate() {
        match c {
            Component::Normal(n) => p.push(n),
            Component::CurDir => continue,
            _ => return None,
        }
        if i + 1 < comps.len() {
            let m = std::fs::symlink_metadata(&p).ok()?;
            if !m.is_dir() {
                return None;
            }
        }
    }
    Some(p)
}

fn remove_any(p: &Path) -> Result<(), Error> {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p).map_err(io_err(p, "whiteout")),
        Ok(_) => std::fs::remove_file(p).map_err(io_err(p, "whiteout")),
        Err(_) => Ok(()),
    }
}

/// A layer blob as an uncompressed tar stream (gzip and zstd by magic).
fn layer_stream(path: &Path) -> Result<Box<dyn Read>, Error> {
    let mut f = File::open(path).map_err(io_err(path, "open layer"))?;
    let mut magic = [0u8; 4];
    let n = f.read(&mut magic).map_err(io_err(path, "read layer"))?;
    let f = File::open(path).map_err(io_err(path, "open layer"))?;
    Ok(match &magic[..n] {
        [0x1f, 0x8b, ..] => Box::new(flate2::read::GzDecoder::new(BufReader::new(f))),
        [0x28, 0xb5, 0x2f, 0xfd] => {
            let child = Command::new("zstd")
                .args(["-dc", "--"])
                .arg(path)
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .map_err(io_err(path, "zstd -dc (apt zstd)"))?;
            Box::new(ChildStdout(child))
        }
        _ => Box::new(BufReader::new(f)),
    })
}

/// A decompressor's stdout; the child is reaped when dropped.
struct ChildStdout(std::process::Child);

impl Read for ChildStdout {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self.0.stdout.as_mut() {
            Some(s) => s.read(buf),
            None => Ok(0),
        }
    }
}

impl Drop for ChildStdout {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn archive<R: Read>(r: R) -> tar::Archive<R> {
    let mut a = tar::Archive::new(r);
    a.set_preserve_permissions(true);
    a.set_preserve_ownerships(true);
    a.set_unpack_xattrs(false);
    a.set_overwrite(true);
    a
}

/// Applies one layer onto `dest`: its whiteouts first (they hide lower
/// layers only), then its entries.
fn apply_layer(blob: &Path, dest: &Path) -> Result<(), Error> {
    let ioe = |what| io_err(blob, what);
    // Pass 1: whiteouts.
    let mut a = archive(layer_stream(blob)?);
    let mut whiteouts: Vec<(PathBuf, bool)> = Vec::new();
    for e in a.entries().map_err(ioe("read layer"))? {
        let e = e.map_err(ioe("read layer entry"))?;
        let path = e.path().map_err(ioe("layer entry path"))?.into_owned();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let parent = path.parent().unwrap_or(Path::new("")).to_path_buf();
        if name == OPAQUE {
            whiteouts.push((parent, true));
        } else if let Some(hidden) = name.strip_prefix(WHITEOUT) {
            whiteouts.push((parent.join(hidden), false));
        }
    }
    for (rel, opaque) in whiteouts {
        let Some(p) = inside(dest, &rel) else {
            continue;
        };
        if opaque {
            if std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()) {
                for c in std::fs::read_dir(&p).map_err(io_err(&p, "opaque dir"))? {
                    let c = c.map_err(io_err(&p, "opaque dir"))?;
                    remove_any(&c.path())?;
                }
            }
        } else {
            remove_any(&p)?;
        }
    }
    // Pass 2: contents. unpack_in refuses paths that leave `dest`.
    let mut a = archive(layer_stream(blob)?);
    for e in a.entries().map_err(ioe("read layer"))? {
        let mut e = e.map_err(ioe("read layer entry"))?;
        let path = e.path().map_err(ioe("layer entry path"))?.into_owned();
        if path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(WHITEOUT))
        {
            continue;
        }
        if !e.unpack_in(dest).map_err(ioe("unpack layer entry"))? {
            tracing::warn!(
                "{}: skipped {} (outside the rootfs)",
                blob.display(),
                path.display()
            );
        }
    }
    Ok(())
}

/// Unpacks the image's layers, in order, into the empty directory `dest`.
/// Each layer's digest is checked before it is applied.
pub fn unpack_layers(layout: &Path, m: &Manifest, dest: &Path) -> Result<(), Error> {
    let mut seen = HashSet::new();
    for l in &m.layers {
        let p = blob_path(layout, &l.digest)?;
        if seen.insert(l.digest.clone()) {
            let f = File::open(&p).map_err(io_err(&p, "open layer"))?;
            let got = sha256_of(BufReader::new(f), &p)?;
            if got != l.digest {
                return Err(bad(&p, format!("digest is {got}, expected {}", l.digest)));
            }
        }
        apply_layer(&p, dest)?;
    }
    Ok(())
}

/// Unpacks an OCI archive (a tar of a layout) into `dest`.
pub fn unpack_archive(path: &Path, dest: &Path) -> Result<(), Error> {
    let f = File::open(path).map_err(io_err(path, "open"))?;
    let mut a = archive(BufReader::new(f));
    a.set_preserve_ownerships(false);
    a.unpack(dest).map_err(io_err(path, "unpack archive"))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A tar (uncompressed or gzip) of `entries`: (path, contents or None for a dir).
    pub fn layer(entries: &[(&str, Option<&[u8]>)], gzip: bool) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (p, data) in entries {
            let mut h = tar::Header::new_old();
            let d: &[u8] = data.unwrap_or(&[]);
            h.set_entry_type(if data.is_some() {
                tar::EntryType::Regular
            } else {
                tar::EntryType::Directory
            });
            h.set_size(d.len() as u64);
            h.set_mode(if data.is_some() { 0o644 } else { 0o755 });
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            // Raw name bytes: the builder would refuse the hostile ones.
            h.as_old_mut().name[..p.len()].copy_from_slice(p.as_bytes());
            h.set_cksum();
            b.append(&h, d).unwrap();
        }
        let raw = b.into_inner().unwrap();
        if !gzip {
            return raw;
        }
        use std::io::Write;
        let mut g = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        g.write_all(&raw).unwrap();
        g.finish().unwrap()
    }

    fn put_blob(layout: &Path, data: &[u8]) -> String {
        let d = sha256_of(data, layout).unwrap();
        let p = blob_path(layout, &d).unwrap();
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, data).unwrap();
        d
    }

    /// An OCI layout with `layers` (bottom first) and the image config blob
    /// `config` (JSON); returns the manifest digest.
    pub fn make_layout(layout: &Path, layers: &[Vec<u8>], config: &str) -> String {
        make_layout_typed(layout, layers, config, MT_CONFIG[0])
    }

    /// As [`make_layout`], with the config descriptor's media type.
    pub fn make_layout_typed(
        layout: &Path,
        layers: &[Vec<u8>],
        config: &str,
        config_type: &str,
    ) -> String {
        std::fs::create_dir_all(layout).unwrap();
        std::fs::write(
            layout.join("oci-layout"),
            r#"{"imageLayoutVersion":"1.0.0"}"#,
        )
        .unwrap();
        let ls: Vec<serde_json::Value> = layers
            .iter()
            .map(|l| {
                serde_json::json!({"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": put_blob(layout, l), "size": l.len()})
            })
            .collect();
        let cd = put_blob(layout, config.as_bytes());
        let manifest = serde_json::json!({"schemaVersion":2,
            "mediaType":"application/vnd.oci.image.manifest.v1+json",
            "config":{"mediaType":config_type,"digest":cd,"size":config.len()},
            "layers": ls});
        let mb = serde_json::to_vec(&manifest).unwrap();
        let md = put_blob(layout, &mb);
        let index = serde_json::json!({"schemaVersion":2,"manifests":[
            {"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":md,"size":mb.len(),
             "platform":{"architecture":"amd64","os":"linux"}}]});
        std::fs::write(
            layout.join("index.json"),
            serde_json::to_vec(&index).unwrap(),
        )
        .unwrap();
        md
    }

    #[test]
    fn layers_apply_in_order_with_whiteouts() {
        let t = tempfile::tempdir().unwrap();
        let layout = t.path().join("layout");
        let l1 = layer(
            &[
                ("etc", None),
                ("etc/keep", Some(b"1")),
                ("etc/gone", Some(b"2")),
                ("var", None),
                ("var/old", Some(b"3")),
            ],
            true,
        );
        let l2 = layer(
            &[
                ("etc/.wh.gone", Some(b"")),
                ("var/.wh..wh..opq", Some(b"")),
                ("var/new", Some(b"4")),
                ("etc/keep", Some(b"5")),
                ("../escape", Some(b"x")),
                ("etc/.wh.../../x", Some(b"")),
            ],
            false,
        );
        let md = make_layout(&layout, &[l1, l2], "{}");
        let m = read_manifest(&layout).unwrap();
        assert_eq!(m.digest, md);
        assert_eq!(kind_of(&layout).unwrap(), SourceKind::OciLayout);
        let dest = t.path().join("root");
        std::fs::create_dir(&dest).unwrap();
        unpack_layers(&layout, &m, &dest).unwrap();
        assert_eq!(std::fs::read(dest.join("etc/keep")).unwrap(), b"5");
        assert!(!dest.join("etc/gone").exists());
        assert!(!dest.join("var/old").exists());
        assert_eq!(std::fs::read(dest.join("var/new")).unwrap(), b"4");
        assert!(!dest.join("etc/.wh.gone").exists());
        assert!(!t.path().join("escape").exists());

        // A tampered layer is refused before it is applied.
        let blob = blob_path(&layout, &m.layers[0].digest).unwrap();
        let mut b = std::fs::read(&blob).unwrap();
        let last = b.len() - 1;
        b[last] ^= 1;
        std::fs::write(&blob, b).unwrap();
        let e = unpack_layers(&layout, &m, &dest).unwrap_err().to_string();
        assert!(e.contains("digest is"), "{e}");
    }

    #[test]
    fn digests_cannot_name_paths() {
        let p = Path::new("/x");
        assert!(blob_path(p, "sha256:../../etc/passwd").is_err());
        assert!(blob_path(p, "sha512:abcd").is_err());
        assert!(inside(p, Path::new("../a")).is_none());
        assert!(inside(p, Path::new("/a")).is_none());
    }
}
