//! The register page: a read-only copy of one virtio-mmio device's registers
//! and config space that KVM maps over the device's window
//! (KVM_MEM_READONLY), so that the guest's register reads are loads from
//! memory instead of exits to the VMM. Writes still exit (KVM turns a store
//! to a read-only slot into an MMIO exit, or into a coalesced-ring entry or
//! an ioeventfd where one is registered), and the transport publishes what
//! they changed before the vCPU resumes (docs/vmm.md "The register page").
//!
//! Three writers keep it exact:
//! - the transport (vCPU thread), after every write it handles: every
//!   register word but InterruptStatus, and the config space;
//! - the device's [`Interrupt`](crate::virtio::Interrupt), whose
//!   InterruptStatus bits live in this page;
//! - a config interrupt (the device changed on its own: link, failure,
//!   media), which republishes the config space and DEVICE_NEEDS_RESET from
//!   the device's [`DeviceView`] before the guest is interrupted.

use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use virtio_bindings::virtio_config::VIRTIO_CONFIG_S_NEEDS_RESET;
use vm_memory::MmapRegion;

use super::{CONFIG, CONFIG_GENERATION, STATUS};

/// One page per device: the registers (0x000..0x100) and the config space.
pub const PAGE_SIZE: usize = 0x1000;
/// Config bytes published; every device's config space is shorter, and a
/// read past its end is zero in the page as through an exit.
pub const CONFIG_LEN: usize = 0x100;

/// The state a device changes on its own, readable from any thread without
/// blocking: what a config interrupt republishes.
pub trait DeviceView: Send + Sync {
    fn read_config(&self, offset: u64, data: &mut [u8]);
    fn needs_reset(&self) -> bool {
        false
    }
}

#[derive(Debug, thiserror::Error)]
#[error("register page: anonymous mapping of {PAGE_SIZE} bytes: {source}")]
pub struct PageError {
    #[source]
    source: vm_memory::mmap::MmapRegionError,
}

pub struct RegisterPage {
    map: MmapRegion<()>,
    /// Orders config publications (transport and config interrupts), so
    /// that the last one reads the newest device state.
    publish: Mutex<()>,
    view: OnceLock<Arc<dyn DeviceView>>,
}

impl std::fmt::Debug for RegisterPage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisterPage")
            .field("host_addr", &self.host_addr())
            .finish_non_exhaustive()
    }
}

impl RegisterPage {
    /// A zeroed page (every register reads 0 until the transport publishes).
    pub fn new() -> Result<Self, PageError> {
        let map = MmapRegion::new(PAGE_SIZE).map_err(|source| PageError { source })?;
        Ok(RegisterPage {
            map,
            publish: Mutex::new(()),
            view: OnceLock::new(),
        })
    }

    /// Where KVM maps it from.
    pub fn host_addr(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    /// The 32-bit word at register `offset` (4-byte aligned, < CONFIG).
    pub fn word(&self, offset: u64) -> &AtomicU32 {
        assert!(
            offset < CONFIG && offset.is_multiple_of(4),
            "register offset {offset:#x}"
        );
        // SAFETY: the mapping is PAGE_SIZE bytes, page aligned, and lives as
        // long as `self`; `offset` is in bounds and 4-byte aligned. Every
        // access in the VMM is atomic; the guest only reads.
        unsafe { &*(self.map.as_ptr().add(offset as usize) as *const AtomicU32) }
    }

    fn config_byte(&self, i: usize) -> &AtomicU8 {
        assert!(i < CONFIG_LEN);
        // SAFETY: CONFIG + CONFIG_LEN <= PAGE_SIZE; see `word`.
        unsafe { &*(self.map.as_ptr().add(CONFIG as usize + i) as *const AtomicU8) }
    }

    pub fn load(&self, offset: u64) -> u32 {
        self.word(offset).load(Ordering::SeqCst)
    }

    /// Bytes `offset..offset + data.len()` of the page, as the guest reads them.
    pub fn read(&self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            let at = offset as usize + i;
            *b = if at < CONFIG as usize {
                self.load(at as u64 & !3).to_le_bytes()[at % 4]
            } else if at < CONFIG as usize + CONFIG_LEN {
                self.config_byte(at - CONFIG as usize)
                    .load(Ordering::SeqCst)
            } else {
                0
            };
        }
    }

    /// The device state a config interrupt republishes (`publish_view`).
    pub fn set_view(&self, view: Arc<dyn DeviceView>) {
        let _ = self.view.set(view);
    }

    /// Publishes the Status register: the driver's bits, plus
    /// DEVICE_NEEDS_RESET while `needs_reset()` says so. A failure reported
    /// between the two reads is not lost: the reporter sets its flag before
    /// it publishes, and this looks again after its own store.
    pub fn publish_status(&self, driver_bits: u32, needs_reset: impl Fn() -> bool) {
        let nr = |on: bool| if on { VIRTIO_CONFIG_S_NEEDS_RESET } else { 0 };
        self.word(STATUS)
            .store(driver_bits | nr(needs_reset()), Ordering::SeqCst);
        if needs_reset() {
            self.word(STATUS)
                .fetch_or(VIRTIO_CONFIG_S_NEEDS_RESET, Ordering::SeqCst);
        }
    }

    /// Publishes the config space as `read` fills it. When it changed, the
    /// generation moves before and after the new bytes, so a driver that
    /// reads it around its config reads (virtio 1.2 §4.2.2.1) retries.
    pub fn publish_config(&self, read: impl FnOnce(&mut [u8])) {
        let _g = self.publish.lock().unwrap_or_else(|e| e.into_inner());
        let mut new = [0u8; CONFIG_LEN];
        read(&mut new);
        if (0..CONFIG_LEN).all(|i| self.config_byte(i).load(Ordering::SeqCst) == new[i]) {
            return;
        }
        let gen = self.word(CONFIG_GENERATION);
        gen.fetch_add(1, Ordering::SeqCst);
        for (i, b) in new.iter().enumerate() {
            self.config_byte(i).store(*b, Ordering::SeqCst);
        }
        gen.fetch_add(1, Ordering::SeqCst);
    }

    /// Publishes the config space from the device's view, or, for a device
    /// without one (whose config changes only through the transport), as
    /// `read` fills it. The view never waits (a VF's MAC not yet learned).
    pub fn publish_device_config(&self, read: impl FnOnce(&mut [u8])) {
        match self.view.get() {
            Some(view) => self.publish_config(|b| view.read_config(0, b)),
            None => self.publish_config(read),
        }
    }

    /// A config interrupt: the device changed on its own. Its config space
    /// and DEVICE_NEEDS_RESET are republished before the guest is told.
    pub fn publish_view(&self) {
        // A device without a view changes only through the transport,
        // which published the change already.
        let Some(view) = self.view.get() else {
            return;
        };
        self.publish_config(|b| view.read_config(0, b));
        if view.needs_reset() {
            self.word(STATUS)
                .fetch_or(VIRTIO_CONFIG_S_NEEDS_RESET, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_changes_move_the_generation_around_the_bytes() {
        let p = RegisterPage::new().unwrap();
        p.publish_config(|b| b[..2].copy_from_slice(&[1, 2]));
        assert_eq!(p.load(CONFIG_GENERATION), 2);
        let mut got = [0u8; 4];
        p.read(CONFIG, &mut got);
        assert_eq!(got, [1, 2, 0, 0]);
        // The same bytes again: no change, no new generation.
        p.publish_config(|b| b[..2].copy_from_slice(&[1, 2]));
        assert_eq!(p.load(CONFIG_GENERATION), 2);
        // Reads past the published bytes are zero, as through an exit.
        let mut tail = [9u8; 8];
        p.read(CONFIG + CONFIG_LEN as u64 - 4, &mut tail);
        assert_eq!(tail, [0; 8]);
    }

    #[test]
    fn needs_reset_reported_during_a_status_store_survives_it() {
        let p = RegisterPage::new().unwrap();
        // The device fails between the transport's first look and its store.
        let calls = std::cell::Cell::new(0);
        p.publish_status(0x7, || {
            calls.set(calls.get() + 1);
            calls.get() > 1
        });
        assert_eq!(p.load(STATUS), 0x7 | VIRTIO_CONFIG_S_NEEDS_RESET);
        p.publish_status(0x7, || false);
        assert_eq!(p.load(STATUS), 0x7);
    }

    struct Failed(std::sync::atomic::AtomicBool);
    impl DeviceView for Failed {
        fn read_config(&self, _offset: u64, data: &mut [u8]) {
            data[0] = 0xaa;
        }
        fn needs_reset(&self) -> bool {
            self.0.load(Ordering::SeqCst)
        }
    }

    #[test]
    fn a_config_interrupt_republishes_the_view() {
        let p = RegisterPage::new().unwrap();
        let view = Arc::new(Failed(false.into()));
        p.set_view(view.clone());
        p.publish_status(0xf, || false);
        view.0.store(true, Ordering::SeqCst);
        p.publish_view();
        assert_eq!(p.load(STATUS), 0xf | VIRTIO_CONFIG_S_NEEDS_RESET);
        let mut b = [0u8; 1];
        p.read(CONFIG, &mut b);
        assert_eq!(b, [0xaa]);
    }
}
