//! Legacy devices of the VM core: the serial console, the agent port and
//! the i8042 reset line.

pub mod agent_port;
pub mod i8042;
pub mod serial;
