//! The server side of the control API; the protocol's types and its client
//! are the `nic-api` crate (docs/nic.md, "Control API").

pub mod server;
