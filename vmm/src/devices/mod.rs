//! Legacy devices of the VM core: the serial console and the agent port.

pub mod agent_port;
pub mod serial;
