//! The NIC daemon's control API (docs/design.md "NIC control API") as the
//! plugin uses it, over the NIC crate's own client.

use std::path::Path;

pub use nic::control::VfInfo;
use nic::control::{Client, ClientError, ErrorCode};
pub use nic::devset::VfState;

pub type NicError = ClientError;

/// The daemon's refusal code, if it answered with one.
pub fn refused_code(e: &ClientError) -> Option<ErrorCode> {
    match e {
        ClientError::Refused { code, .. } => *code,
        _ => None,
    }
}

pub struct Nic(Client);

impl Nic {
    pub fn connect(path: &Path) -> Result<Nic, NicError> {
        Client::connect(path).map(Nic)
    }

    pub fn alloc(
        &mut self,
        pf: &str,
        sandbox: &str,
        mac: Option<&str>,
        vlan: Option<u16>,
    ) -> Result<VfInfo, NicError> {
        self.0.alloc(pf, sandbox, mac, vlan)
    }

    /// Idempotent: an unknown sandbox is fine.
    pub fn release(&mut self, sandbox: &str) -> Result<(), NicError> {
        self.0.release(sandbox)
    }

    /// The VF assigned to `sandbox`, None if it has none.
    pub fn get(&mut self, sandbox: &str) -> Result<Option<VfInfo>, NicError> {
        match self.0.get_by_sandbox(sandbox) {
            Err(e) if refused_code(&e) == Some(ErrorCode::NotFound) => Ok(None),
            r => r.map(Some),
        }
    }

    pub fn list(&mut self) -> Result<Vec<VfInfo>, NicError> {
        self.0.list()
    }
}
