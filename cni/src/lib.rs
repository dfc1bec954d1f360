//! `burstvm-cni`: FastIOV's CNI plugin (fastiov.txt §2.3, §5).
//!
//! VFs are created and bound to the software NIC once, when `burstvm nic`
//! starts; ADD only takes a free VF from the NIC daemon and puts a
//! placeholder link carrying the VF id into the sandbox netns (no rebinding),
//! plus the addresses and routes the IPAM plugin hands out. The runtime reads
//! the placeholder back with [`read_placeholder`] to find the VF and the IP
//! configuration it passes to the guest.

mod config;
mod delegate;
mod env;
mod error;
#[doc(hidden)]
pub mod fuzz;
pub mod ipam;
pub mod placeholder;
mod plugin;
pub mod server;
mod version;

pub use env::Env;
pub use error::{code, PluginError};
pub use netutil::IpNet;
pub use netutil::NetnsError;
pub use placeholder::{read_placeholder, Placeholder, PlaceholderError, PlaceholderRoute};
pub use plugin::{Outcome, MAX_STDIN};
pub use version::SUPPORTED as SUPPORTED_VERSIONS;

/// The plugin executable's main: reads the CNI_* environment and the config
/// on stdin, prints the result (or error result) on stdout, returns the
/// exit status.
pub fn plugin_main() -> i32 {
    plugin::main()
}
