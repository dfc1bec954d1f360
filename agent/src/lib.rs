//! burstvm's guest agent for Linux guests (docs/guest.md, "The guest agent
//! (Linux guests)"; protocol in docs/design.md, "Guest agent protocol").
//!
//! - [`server`]: the process and stdio server on any stream listener (vsock
//!   in the guest, Unix sockets in tests), and the power-off rule.
//! - [`process`], [`pty`], [`reaper`], [`stats`]: what the server builds on.
//! - [`boot`]: PID 1's steps in the guest (configuration from the kernel
//!   command line, mounts, root switch, network, vsock listeners), kept apart
//!   so that the server runs on a host.
//! - [`port`]: the agent-port events.
//! - [`pod`]: a pod sandbox's container roots (`MountContainer`).

pub mod boot;
pub mod pod;
pub mod port;
pub mod process;
pub mod pty;
pub mod reaper;
pub mod server;
pub mod stats;

pub use server::{Agent, AgentConfig, Listener, PowerOff, PowerOffReason};
