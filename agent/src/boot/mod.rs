//! PID 1's steps in the guest: configuration, mounts and root switch,
//! network, vsock listeners. Each returns a [`BootError`] naming its step.

pub mod config;
pub mod containers;
pub mod mounts;
pub mod net;
pub mod vsock;

use std::path::PathBuf;

pub use config::BootConfig;

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("kernel command line: {key}={value:?}: {what}")]
    Config {
        key: String,
        value: String,
        what: &'static str,
    },
    #[error("{step} {path}")]
    Mount {
        step: &'static str,
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("{step} {path}")]
    File {
        step: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("network: {step} ({link})")]
    Net {
        step: &'static str,
        link: String,
        #[source]
        source: std::io::Error,
    },
    #[error("vsock port {port}: {step}")]
    Vsock {
        step: &'static str,
        port: u32,
        #[source]
        source: nix::Error,
    },
}
