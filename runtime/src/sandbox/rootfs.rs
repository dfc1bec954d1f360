//! A sandbox's root filesystem (RunD §4.2, docs/rootfs.md): the shared
//! read-only EROFS image (built once, before any sandbox) and a writable
//! layer made in the `rootfs` stage — a reflink of the runtime's ext4
//! template, or a full copy for comparison — handed to the VMM, which opens
//! and unlinks it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ::rootfs::{Image, Layer, WritableLayers};

/// How the guest sees the read-only layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImageMode {
    /// A read-only virtio-blk disk.
    #[default]
    Blk,
    /// Copied into the guest's image region (pmem-style; DMA-mapped with it
    /// unless the variant skips the image region). Built-in agent only.
    Pmem,
}

impl ImageMode {
    pub const ALL: [ImageMode; 2] = [ImageMode::Blk, ImageMode::Pmem];

    pub fn name(self) -> &'static str {
        match self {
            ImageMode::Blk => "blk",
            ImageMode::Pmem => "pmem",
        }
    }
}

impl std::fmt::Display for ImageMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ImageMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|v| v.name() == s)
            .ok_or_else(|| format!("unknown image mode {s:?} (blk, pmem)"))
    }
}

/// How the writable layer is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerMode {
    /// FICLONE of the template (RunD).
    #[default]
    Reflink,
    /// A full copy of the template's data (the baseline RunD replaces).
    Copy,
}

impl LayerMode {
    pub fn name(self) -> &'static str {
        match self {
            LayerMode::Reflink => "reflink",
            LayerMode::Copy => "copy",
        }
    }
}

/// `--rootfs-file` names no regular file of the image.
#[derive(Debug, thiserror::Error)]
#[error("{file} is not a regular file of {}", .image.display())]
pub struct NotAFile {
    pub file: String,
    pub image: PathBuf,
}

/// The rootfs part of a sandbox's spec.
#[derive(Debug, Clone)]
pub struct RootfsSpec {
    pub image: Arc<Image>,
    /// File of the image the guest reads, with its checksum.
    pub check: Option<(String, u32)>,
    pub image_mode: ImageMode,
    pub layer_mode: LayerMode,
}

impl RootfsSpec {
    /// `file` (default: the image's default check file) must be a regular
    /// file of the image.
    pub fn new(
        image: Arc<Image>,
        file: Option<&str>,
        image_mode: ImageMode,
        layer_mode: LayerMode,
    ) -> Result<RootfsSpec, NotAFile> {
        let file = file
            .map(str::to_string)
            .or_else(|| image.default_check_file());
        let check = match file {
            Some(f) => {
                let sum = image.file(&f).ok_or_else(|| NotAFile {
                    file: f.clone(),
                    image: image.path.clone(),
                })?;
                Some((f, sum.checksum))
            }
            None => None,
        };
        Ok(RootfsSpec {
            image,
            check,
            image_mode,
            layer_mode,
        })
    }

    /// Guest memory the image takes in pmem mode.
    pub fn guest_bytes(&self) -> u64 {
        match self.image_mode {
            ImageMode::Pmem => self.image.meta.erofs_bytes.next_multiple_of(4096),
            ImageMode::Blk => 0,
        }
    }
}

/// What the `rootfs` stage made for one sandbox.
#[derive(Debug)]
pub struct Prepared {
    pub layer: Layer,
    pub wall_ns: u64,
    /// Host CPU time of the stage (this thread: the ioctl or the copy).
    pub cpu_ns: u64,
}

/// The `rootfs` stage: the sandbox's writable layer.
pub fn prepare(
    layers: &WritableLayers,
    id: &str,
    mode: LayerMode,
) -> Result<Prepared, ::rootfs::Error> {
    let (t0, c0) = (trace::monotonic_ns(), procutil::schedstat::this_thread_ns());
    let layer = match mode {
        LayerMode::Reflink => layers.clone_for(id),
        LayerMode::Copy => layers.copy_for(id),
    }?;
    Ok(Prepared {
        layer,
        wall_ns: trace::monotonic_ns() - t0,
        cpu_ns: procutil::schedstat::this_thread_ns().saturating_sub(c0),
    })
}

/// The VMM's parameters for the image and the layer. The image is the
/// first disk (Linux's /dev/vda), the writable layer the next (/dev/vdb).
pub fn vm_params(spec: &RootfsSpec, layer: &Path, vm: &mut vmm::VmParams) {
    match spec.image_mode {
        ImageMode::Blk => vm.disk.push(vmm::DiskSpec {
            read_only: true,
            id: Some("rootfs".into()),
            ..vmm::DiskSpec::file(&spec.image.path)
        }),
        ImageMode::Pmem => vm.rootfs_pmem = Some(spec.image.path.clone()),
    }
    vm.disk.push(vmm::DiskSpec {
        unlink: true,
        id: Some("rw".into()),
        ..vmm::DiskSpec::file(layer)
    });
    vm.rootfs_check = spec.check.clone();
}

/// The Linux command line for a kernel with this rootfs (the VMM adds the
/// console, the devices and what a kvm_pvm host needs).
pub fn linux_cmdline() -> String {
    "reboot=k panic=1 pci=off nomodules root=/dev/vda rootfstype=erofs ro".into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn image() -> Arc<Image> {
        let mut files = BTreeMap::new();
        files.insert(
            "/bin/app".to_string(),
            ::rootfs::image::FileSum {
                size: 5,
                checksum: 0xabc,
            },
        );
        Arc::new(Image {
            path: "/cache/x.erofs".into(),
            meta: ::rootfs::ImageMeta {
                digest: "dir-sha256:00".into(),
                source: "/src".into(),
                kind: "directory".into(),
                erofs_bytes: 5000,
                build_ms: 1.0,
                files,
                config: None,
                exec_user: None,
            },
        })
    }

    #[test]
    fn vmm_args_name_both_layers_and_the_check() {
        // The rootfs's part of the VMM's command line, as the launch contract renders it.
        let vmm_args = |s: &RootfsSpec, layer: &Path| -> Vec<String> {
            let mut vm = vmm::VmParams::new("sb");
            vm_params(s, layer, &mut vm);
            vm.to_args()[2..]
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect()
        };
        let s = RootfsSpec::new(image(), None, ImageMode::Blk, LayerMode::Reflink).unwrap();
        assert_eq!(s.check, Some(("/bin/app".into(), 0xabc)));
        assert_eq!(s.guest_bytes(), 0);
        let a = vmm_args(&s, Path::new("/mnt/sb.rw"));
        assert_eq!(
            a,
            [
                "--disk",
                "path=/cache/x.erofs,ro,id=rootfs",
                "--disk",
                "path=/mnt/sb.rw,unlink,id=rw",
                "--rootfs-check",
                "/bin/app=00000abc"
            ]
        );
        let p =
            RootfsSpec::new(image(), Some("/bin/app"), ImageMode::Pmem, LayerMode::Copy).unwrap();
        assert_eq!(p.guest_bytes(), 8192);
        assert_eq!(
            vmm_args(&p, Path::new("/l"))[..2],
            ["--rootfs-pmem", "/cache/x.erofs"]
        );
        let e =
            RootfsSpec::new(image(), Some("/nope"), ImageMode::Blk, LayerMode::Copy).unwrap_err();
        assert_eq!(e.file, "/nope");
        assert!(e.to_string().contains("/nope"), "{e}");
    }
}
