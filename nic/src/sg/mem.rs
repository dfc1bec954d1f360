//! `sgiov::mem::Memory` over a NIC memory table: the SG device reads and
//! writes a sandbox's rings through the same mapping a VF uses, and every
//! device write first runs guestmem's device-write preparation (lazy
//! zeroing stays correct). The `Arc` keeps the mapping alive for as long as
//! a pipe or a running job holds this memory, also after the session ended.

use std::sync::Arc;

use sgiov::mem::{MemError, Memory};
use vm_memory::{GuestAddress, GuestMemoryBackend, VolatileSlice};

use crate::memory::VfMemory;

#[derive(Debug)]
pub struct SgMemory {
    name: String,
    mem: Arc<VfMemory>,
}

impl SgMemory {
    pub fn new(name: String, mem: Arc<VfMemory>) -> Self {
        SgMemory { name, mem }
    }

    /// The memory table this view was made from (a new table means a new view).
    pub fn table(&self) -> &Arc<VfMemory> {
        &self.mem
    }
}

impl Memory for SgMemory {
    fn name(&self) -> &str {
        &self.name
    }

    fn slice(&self, addr: u64, len: usize) -> Option<VolatileSlice<'_>> {
        self.mem.gm.get_slice(GuestAddress(addr), len).ok()
    }

    fn prepare(&self, addr: u64, len: u64) -> Result<(), MemError> {
        self.mem
            .prepare_for_device_write(addr, len)
            .map_err(|e| MemError::Prepare {
                mem: self.name.clone(),
                addr,
                len,
                source: Box::new(e),
            })
    }
}
