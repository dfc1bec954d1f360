//! Container root filesystems the RunD way (RunD §4.2, docs/rootfs.md):
//! the rootfs is split into a read-only layer shared by every sandbox of an
//! image — an EROFS image built once per image and cached by digest
//! ([`image`], from an OCI image layout or archive ([`oci`]) or a plain
//! directory) — and a volatile writable layer per sandbox: a reflink of a
//! pre-made ext4 template on an XFS filesystem burstvm manages ([`layers`]),
//! which the VMM opens and unlinks, so nothing persists after the sandbox.
//! An OCI image's run configuration ([`config`]: entrypoint, cmd, env, cwd,
//! and its user resolved to numeric ids at build time) is kept with the
//! built image ([`Image::config`], [`Image::exec_user`], [`Image::args`]).

pub mod config;
pub mod image;
pub mod layers;
pub mod oci;

use std::path::PathBuf;

pub use config::{resolve_user, ExecUser, ImageConfig, NoCommand, UserError};
pub use image::{Image, ImageCache, ImageMeta};
pub use layers::{Layer, LayerConfig, WritableLayers};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{tool} ({args}): cannot run: {source} (scripts/setup.sh installs it)")]
    ToolSpawn {
        tool: &'static str,
        args: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{tool} ({args}): {reason}")]
    Tool {
        tool: &'static str,
        args: String,
        reason: String,
    },
    #[error("image source {path}: {reason}")]
    Source { path: PathBuf, reason: String },
    #[error("image metadata {path}: {source}")]
    Meta {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("image config {path}: {source}")]
    Config {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("image {image}: user {user:?}: {source}")]
    User {
        image: String,
        user: String,
        #[source]
        source: UserError,
    },
    #[error("image {image}: {source}")]
    Command {
        image: String,
        #[source]
        source: NoCommand,
    },
    #[error("writable layers in {path}: {reason}")]
    Layers { path: PathBuf, reason: String },
}

pub(crate) fn io_err(
    path: impl Into<PathBuf>,
    what: &'static str,
) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { path, what, source }
}

/// Runs a tool to completion; its stderr names the failure.
pub(crate) fn run_tool(tool: &'static str, cmd: &mut std::process::Command) -> Result<(), Error> {
    let args = format!("{cmd:?}");
    let out = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|source| Error::ToolSpawn {
            tool,
            args: args.clone(),
            source,
        })?;
    if out.status.success() {
        return Ok(());
    }
    Err(Error::Tool {
        tool,
        args,
        reason: format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ),
    })
}
