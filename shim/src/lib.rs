//! `containerd-shim-burstvm-v2`: containerd's runtime v2 shim for burstvm
//! (task API v2, containerd 1.6). A pod sandbox is one microVM created
//! through the runtime library against host-wide services (`burstvm
//! services`); see docs/shim.md.

pub mod bundle_rootfs;
pub mod config;
pub mod containerd;
pub mod guest;
pub mod pod;
pub mod service;
pub mod spec;
pub mod task;

pub use service::{cleanup_bundle, sandbox_id};

/// An error with its chain of sources, as containerd's client shows one
/// message: each source after a colon, unless the text so far already
/// says it (errors that print their source themselves).
pub fn describe(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = c.source();
    }
    s
}

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

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] Middle);
    #[derive(Debug, thiserror::Error)]
    #[error("middle: {0}")]
    struct Middle(#[source] std::io::Error);

    #[test]
    fn an_error_is_described_with_its_sources_once() {
        let e = Outer(Middle(std::io::Error::other("inner")));
        // Middle prints its source itself: it is not repeated.
        assert_eq!(super::describe(&e), "outer: middle: inner");
    }
}
