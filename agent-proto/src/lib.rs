//! The guest agent's API over virtio-vsock (docs/design.md, "Guest agent protocol").
//!
//! - [`frame`]: the framing (4-byte big-endian length, at most [`MAX_FRAME`]
//!   bytes of JSON) both sides use.
//! - [`msg`]: requests, replies, the OCI `process` subset, stream hellos.
//! - [`client`]: the host's client, over the VMM's hybrid vsock socket
//!   (`CONNECT <port>`) or any connected stream.
//! - [`initramfs`]: the guest's initramfs (the agent as `/init`).
//!
//! std + serde only: the host links it into the runtime, the guest into the agent.

pub mod client;
pub mod frame;
pub mod initramfs;
pub mod msg;

pub use client::{attach_over, Client, ClientError, Endpoint, Step};
pub use frame::{read_frame, read_frame_bytes, write_frame, FrameError};
pub use initramfs::{write_initramfs, InitramfsError};
pub use msg::*;

/// The protocol's version: the agent refuses a `Hello` with another one.
/// Bumped on any change that an older peer would misread; additions that an
/// older peer ignores (a new optional field, a new request it answers with
/// `bad_request`) keep it.
pub const PROTOCOL_VERSION: u32 = 1;

/// The agent's control port (requests and replies).
pub const CONTROL_PORT: u32 = 1024;

/// The agent's stdio port (one connection per stream of a process).
pub const STDIO_PORT: u32 = 1025;

/// The largest frame body, in bytes: a longer frame is an error that closes
/// the connection.
pub const MAX_FRAME: usize = 1 << 20;

/// Whether an agent speaking `PROTOCOL_VERSION` serves a peer announcing
/// `version`.
pub fn version_compatible(version: u32) -> bool {
    version == PROTOCOL_VERSION
}
