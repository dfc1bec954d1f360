//! The control API of `burstvm nic`: line-delimited JSON over a unix socket
//! (docs/design.md "NIC control API", docs/nic.md). One request object per
//! line, one response object per line, every response carries `"ok"`.
//!
//! - [`wire`]: requests, responses, error codes, the request checks.
//! - [`vf`]: what a response shows of a VF or SG function.
//! - [`client`]: the client, every step bounded by its timeout.
//!
//! The daemon (`nic`) serves it and converts its internal state into these
//! types; its clients (burstvm-cni, the runtime, the tests) need only this crate.

pub mod client;
pub mod vf;
pub mod wire;

pub use client::{connect_timeout, vf_socket, Client, ClientError, DEFAULT_TIMEOUT, MAX_RESPONSE};
pub use vf::{Counters, SgCounters, SgLat, VfInfo, VfState};
pub use wire::{
    parse_request, sandbox_id_problem, DevKind, ErrorCode, Request, Response, MAX_PF_NAME,
    MAX_SANDBOX_ID, MAX_VF_ID,
};

/// Most VFs a PF can have: 32 PCI devices × 8 functions on its bus.
pub const MAX_VFS: usize = 256;
