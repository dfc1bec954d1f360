//! The device bus shared by the VM core and the virtio devices.
//!
//! One `Bus` serves port I/O (serial, agent port) and another MMIO (virtio-mmio
//! devices). Both use the same device trait: `offset` is always relative to
//! the base the device was inserted at. Accesses that hit no device are the
//! caller's business (the vCPU loop ignores them), never a crash.

use crate::devspec::VfInit;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A device behind the PIO or MMIO bus.
pub trait BusDevice: Send {
    /// `offset` from the device's base; fill `data` (its length is the access size).
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

impl BusDevice for Box<dyn BusDevice> {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        (**self).read(offset, data)
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        (**self).write(offset, data)
    }
}

/// What a device gets from the VM core when it is created.
#[derive(Debug)]
pub struct DeviceContext {
    /// For irqfd / ioeventfd registration.
    pub vm: Arc<kvm_ioctls::VmFd>,
    /// Device view of every region (VMM writes go here); one view shared by
    /// all devices. It does not own the mapping: keep `guestmem` alive for
    /// as long as a clone of it is kept.
    pub mem: vm_memory::GuestMemoryMmap,
    /// prepare_for_device_write, memfds for SET_MEM_TABLE.
    pub guestmem: Arc<guestmem::GuestMemory>,
    pub mmio_base: u64,
    pub gsi: u32,
    pub trace: Arc<trace::TraceWriter>,
    pub vf_init: VfInit,
    /// How long a vhost-user device may try to reconnect to a vanished backend.
    pub vf_reconnect: std::time::Duration,
    /// The device reaches only the DMA window (`--dma-window`), not guest
    /// RAM: a VF offers VIRTIO_F_ACCESS_PLATFORM, so that the driver keeps
    /// its rings and buffers there.
    pub dma_window: bool,
    /// The device's register page, mapped read-only over its window (None:
    /// every register read exits).
    pub register_page: Option<Arc<crate::virtio::RegisterPage>>,
}

/// A device as the bus holds it: shared between vCPU threads.
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

#[derive(Debug, thiserror::Error)]
#[error("bus range {base:#x}+{len:#x} for {name} overlaps an existing device or is empty")]
pub struct BusError {
    pub name: String,
    pub base: u64,
    pub len: u64,
}

/// Address → device map (non-overlapping ranges).
#[derive(Default, Clone)]
pub struct Bus {
    devices: BTreeMap<u64, (u64, SharedDevice)>,
}

// Devices are trait objects: Debug lists the ranges they hold.
impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(
                self.devices
                    .iter()
                    .map(|(&base, &(len, _))| base..base + len),
            )
            .finish()
    }
}

impl Bus {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(
        &mut self,
        name: &str,
        base: u64,
        len: u64,
        dev: SharedDevice,
    ) -> Result<(), BusError> {
        let err = || BusError {
            name: name.to_string(),
            base,
            len,
        };
        let end = base.checked_add(len).filter(|_| len > 0).ok_or_else(err)?;
        // The closest device below `end` is the only one that can overlap.
        if let Some((&b, &(l, _))) = self.devices.range(..end).next_back() {
            if b + l > base {
                return Err(err());
            }
        }
        self.devices.insert(base, (len, dev));
        Ok(())
    }

    fn find(&self, addr: u64, size: usize) -> Option<(u64, &SharedDevice)> {
        let (&base, (len, dev)) = self.devices.range(..=addr).next_back()?;
        let off = addr - base;
        (off + size as u64 <= *len).then_some((off, dev))
    }

    /// Returns false when no device covers the access.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((off, dev)) => {
                dev.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .read(off, data);
                true
            }
            None => false,
        }
    }

    /// Returns false when no device covers the access.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((off, dev)) => {
                dev.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .write(off, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Reg(Vec<u8>);
    impl BusDevice for Reg {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            let o = offset as usize;
            data.copy_from_slice(&self.0[o..o + data.len()]);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            let o = offset as usize;
            self.0[o..o + data.len()].copy_from_slice(data);
        }
    }

    #[test]
    fn routes_by_offset_and_rejects_overlap_and_misses() {
        let mut bus = Bus::new();
        bus.insert("a", 0x1000, 0x10, Arc::new(Mutex::new(Reg(vec![0; 0x10]))))
            .unwrap();
        bus.insert("b", 0x1010, 0x10, Arc::new(Mutex::new(Reg(vec![0; 0x10]))))
            .unwrap();
        assert!(bus
            .insert("c", 0x100f, 2, Arc::new(Mutex::new(Reg(vec![0; 2]))))
            .is_err());
        assert!(bus
            .insert("d", 0x0ff8, 0x10, Arc::new(Mutex::new(Reg(vec![0; 0x10]))))
            .is_err());
        assert!(bus
            .insert("e", 0x2000, 0, Arc::new(Mutex::new(Reg(vec![]))))
            .is_err());
        assert!(bus.write(0x1014, &[1, 2, 3, 4]));
        let mut d = [0u8; 4];
        assert!(bus.read(0x1014, &mut d));
        assert_eq!(d, [1, 2, 3, 4]);
        assert!(bus.read(0x1000, &mut d));
        assert_eq!(d, [0; 4]);
        // Straddling the end of a device, or hitting nothing: not handled.
        assert!(!bus.read(0x101e, &mut d));
        assert!(!bus.write(0x3000, &[0]));
    }
}
