//! `containerd-shim-burstvm-v2`: containerd's runtime v2 shim for burstvm
//! (task API v2, containerd 1.6). A pod sandbox is one microVM created
//! through the runtime library against host-wide services (`burstvm
//! services`); see docs/shim.md.

pub mod config;
pub mod containerd;
pub mod guest;
pub mod rootfs;
pub mod service;
pub mod spec;
pub mod task;

pub use service::{cleanup_bundle, sandbox_id};

/// The runtime name containerd maps to this binary (`containerd-shim-burstvm-v2`).
pub const RUNTIME_ID: &str = "io.containerd.burstvm.v2";

/// The shim binary's main.
pub fn run() {
    containerd_shim::run::<service::Shim>(
        RUNTIME_ID,
        Some(containerd_shim::Config {
            // The crate's SIGCHLD reaper would reap the VMM before its owner
            // thread could read its exit status.
            no_reaper: true,
            // VMMs are our direct children; nothing else needs reaping.
            no_sub_reaper: true,
            ..Default::default()
        }),
    );
}
