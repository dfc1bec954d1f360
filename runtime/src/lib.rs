//! The burstvm sandbox runtime: sandbox lifecycle through the startup stages,
//! FastIOV's variants, pools, rootfs. The benchmarks, their statistics and
//! plots are the `bench` crate's. See docs/runtime.md.

pub mod cgroup;
pub mod child;
pub mod cni_exec;
pub mod container;
pub mod cpuacct;
pub mod failures;
pub mod fileserver;
pub mod guestnet;
pub mod host;
pub mod leaks;
pub mod netpool;
pub mod nicd;

pub mod instance;
mod run;
pub mod sandbox;
pub mod server_netns;
pub mod services;
pub mod template;
pub mod variant;
pub mod vmmproc;

use std::path::PathBuf;

pub use host::{HostServices, SandboxHost, ServicesInfo};
pub use instance::{Runtime, RuntimeConfig, RuntimeError};
pub use run::{run_cli, ContainerRun, NetKindArg, RunConfig};
pub use sandbox::{pod_slot, Attach, Sandbox, SandboxFailure, SandboxSpec, SgSpec};
pub use services::{services_cli, ServicesConfig};

pub use variant::{Policy, Variant};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{field}: {reason}")]
    BadArg { field: &'static str, reason: String },
    /// A flag's file or program that cannot be used (`--burstvm-bin`, `--dir`).
    #[error("{field}: {}: {source}", .path.display())]
    ArgIo {
        field: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--rootfs-file: {0}")]
    RootfsFile(#[source] sandbox::rootfs::NotAFile),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Sandbox(#[from] SandboxFailure),
    #[error(transparent)]
    Host(#[from] host::HostError),
    #[error(transparent)]
    Trace(#[from] trace::TraceError),
    #[error("{0}")]
    Leaks(String),
    #[error(transparent)]
    Teardown(#[from] sandbox::TeardownError),
    #[error("cannot find the burstvm binary: {0}")]
    Bin(#[source] std::io::Error),
    #[error(transparent)]
    Rootfs(#[from] ::rootfs::Error),
    /// A file the runtime reads or writes itself (the agent, its initramfs).
    #[error("{} ({what}): {source}", .path.display())]
    File {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Initramfs(#[from] agent_proto::InitramfsError),
    /// The guest agent refused a request or its connection failed.
    #[error("guest agent: {0}")]
    Agent(#[from] agent_proto::ClientError),
}

pub(crate) fn bad(field: &'static str, reason: impl Into<String>) -> Error {
    Error::BadArg {
        field,
        reason: reason.into(),
    }
}

/// Parses `64M`, `1G`, `4096`, `512K` into bytes.
pub fn parse_size(field: &'static str, s: &str) -> Result<u64, Error> {
    let t = s.trim();
    let (num, mul) = match t.chars().last() {
        Some(c) if c.is_ascii_alphabetic() => {
            let mul = match c.to_ascii_uppercase() {
                'K' => 1u64 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                _ => return Err(bad(field, format!("{s:?}: unknown size suffix {c:?}"))),
            };
            (&t[..t.len() - 1], mul)
        }
        _ => (t, 1),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| bad(field, format!("{s:?} is not a size (e.g. 64M)")))?;
    n.checked_mul(mul)
        .ok_or_else(|| bad(field, format!("{s:?} is too large")))
}

/// The burstvm binary a runtime spawns (`burstvm vmm`, `burstvm nic`, ...):
/// `given`, else this executable.
pub fn burstvm_bin(given: &Option<PathBuf>) -> Result<PathBuf, Error> {
    match given {
        Some(p) => Ok(p.clone()),
        None => std::env::current_exe().map_err(Error::Bin),
    }
}

/// The size of each sandbox, shared by `run` and `bench startup`.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// Guest memory per sandbox, bytes.
    pub memory: u64,
    /// CPU limit of each sandbox's cgroup, in CPUs.
    pub cpus: f64,
    /// Size of the app payload the guest agent checksums at app launch, bytes.
    pub app_size: u64,
}

impl SandboxConfig {
    /// Checks `--cpus`; returns `--memory` and `--app-size` in bytes.
    pub fn bytes(&self) -> Result<(u64, u64), Error> {
        let (memory, app_size) = (self.memory, self.app_size);
        if !self.cpus.is_finite() || self.cpus <= 0.0 {
            return Err(bad("--cpus", format!("{} must be positive", self.cpus)));
        }
        Ok((memory, app_size))
    }
}

/// The root filesystem of each sandbox, shared by `run` and `bench startup`.
#[derive(Debug, Clone)]
pub struct RootfsConfig {
    /// Container image for the rootfs (RunD split): an OCI image layout,
    /// an OCI archive, a directory, or an image `burstvm rootfs build` made
    /// (X.erofs). Built once and cached by digest.
    pub rootfs: Option<PathBuf>,
    /// File of the image the guest reads and checksums (default:
    /// /etc/os-release, else the smallest file).
    pub rootfs_file: Option<String>,
    /// How the guest gets the read-only layer: blk (virtio-blk) or pmem
    /// (copied into the image region; built-in agent only).
    pub rootfs_image: sandbox::rootfs::ImageMode,
    /// Capacity of each sandbox's writable layer (the ext4 template), bytes.
    pub rootfs_layer_size: u64,
    /// Image cache (default: $BURSTVM_IMAGE_CACHE or /var/lib/burstvm/images).
    pub image_cache: Option<PathBuf>,
}

impl RootfsConfig {
    fn image_cache(&self) -> ::rootfs::ImageCache {
        self.image_cache
            .clone()
            .map(::rootfs::ImageCache::new)
            .unwrap_or_else(::rootfs::ImageCache::from_env)
    }

    /// The image cache's directory (the guest agent's initramfs is kept there too).
    pub fn image_cache_dir(&self) -> PathBuf {
        self.image_cache().dir().to_path_buf()
    }

    /// The image (built or found in the cache; with burstvm's Linux init for
    /// a kernel) and the layer size, if a rootfs was asked for.
    pub fn image(
        &self,
        init: bool,
    ) -> Result<Option<(std::sync::Arc<::rootfs::Image>, u64)>, Error> {
        let Some(src) = &self.rootfs else {
            return Ok(None);
        };
        let cache = self.image_cache();
        let img = cache.resolve(src, init)?;
        let bytes = self.rootfs_layer_size;
        if bytes < (1 << 20) {
            return Err(bad("--rootfs-layer-size", "at least 1M"));
        }
        Ok(Some((std::sync::Arc::new(img), bytes)))
    }

    /// The rootfs of one sandbox on `image` (from [`RootfsConfig::image`]),
    /// with its writable layer made as `layer` says.
    pub fn spec(
        &self,
        image: &std::sync::Arc<::rootfs::Image>,
        layer: sandbox::rootfs::LayerMode,
    ) -> Result<sandbox::rootfs::RootfsSpec, Error> {
        sandbox::rootfs::RootfsSpec::new(
            image.clone(),
            self.rootfs_file.as_deref(),
            self.rootfs_image,
            layer,
        )
        .map_err(Error::RootfsFile)
    }
}
