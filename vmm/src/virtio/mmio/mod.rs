//! virtio-mmio transport, version 2 (virtio 1.2 §4.2.2).
//!
//! The register file is kept here; the device-type specific part sits behind
//! [`VirtioDevice`]. Everything the guest writes is untrusted: bad values are
//! ignored or turn into DEVICE_NEEDS_RESET, never into a panic.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FAILED,
    VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_mmio::{self as mmio, VIRTIO_MMIO_INT_VRING};
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;

pub mod page;

use super::{Interrupt, VirtioDevice};
use page::RegisterPage;

// Register offsets (virtio 1.2 §4.2.2), from virtio-bindings.
pub const MAGIC_VALUE: u64 = mmio::VIRTIO_MMIO_MAGIC_VALUE as u64;
pub const VERSION: u64 = mmio::VIRTIO_MMIO_VERSION as u64;
pub const DEVICE_ID: u64 = mmio::VIRTIO_MMIO_DEVICE_ID as u64;
pub const VENDOR_ID: u64 = mmio::VIRTIO_MMIO_VENDOR_ID as u64;
pub const DEVICE_FEATURES: u64 = mmio::VIRTIO_MMIO_DEVICE_FEATURES as u64;
pub const DEVICE_FEATURES_SEL: u64 = mmio::VIRTIO_MMIO_DEVICE_FEATURES_SEL as u64;
pub const DRIVER_FEATURES: u64 = mmio::VIRTIO_MMIO_DRIVER_FEATURES as u64;
pub const DRIVER_FEATURES_SEL: u64 = mmio::VIRTIO_MMIO_DRIVER_FEATURES_SEL as u64;
pub const QUEUE_SEL: u64 = mmio::VIRTIO_MMIO_QUEUE_SEL as u64;
pub const QUEUE_NUM_MAX: u64 = mmio::VIRTIO_MMIO_QUEUE_NUM_MAX as u64;
pub const QUEUE_NUM: u64 = mmio::VIRTIO_MMIO_QUEUE_NUM as u64;
pub const QUEUE_READY: u64 = mmio::VIRTIO_MMIO_QUEUE_READY as u64;
pub const QUEUE_NOTIFY: u64 = mmio::VIRTIO_MMIO_QUEUE_NOTIFY as u64;
pub const INTERRUPT_STATUS: u64 = mmio::VIRTIO_MMIO_INTERRUPT_STATUS as u64;
pub const INTERRUPT_ACK: u64 = mmio::VIRTIO_MMIO_INTERRUPT_ACK as u64;
pub const STATUS: u64 = mmio::VIRTIO_MMIO_STATUS as u64;
pub const QUEUE_DESC_LOW: u64 = mmio::VIRTIO_MMIO_QUEUE_DESC_LOW as u64;
pub const QUEUE_DESC_HIGH: u64 = mmio::VIRTIO_MMIO_QUEUE_DESC_HIGH as u64;
pub const QUEUE_DRIVER_LOW: u64 = mmio::VIRTIO_MMIO_QUEUE_AVAIL_LOW as u64;
pub const QUEUE_DRIVER_HIGH: u64 = mmio::VIRTIO_MMIO_QUEUE_AVAIL_HIGH as u64;
pub const QUEUE_DEVICE_LOW: u64 = mmio::VIRTIO_MMIO_QUEUE_USED_LOW as u64;
pub const QUEUE_DEVICE_HIGH: u64 = mmio::VIRTIO_MMIO_QUEUE_USED_HIGH as u64;
pub const SHM_LEN_LOW: u64 = mmio::VIRTIO_MMIO_SHM_LEN_LOW as u64;
pub const SHM_LEN_HIGH: u64 = mmio::VIRTIO_MMIO_SHM_LEN_HIGH as u64;
pub const SHM_BASE_LOW: u64 = mmio::VIRTIO_MMIO_SHM_BASE_LOW as u64;
pub const SHM_BASE_HIGH: u64 = mmio::VIRTIO_MMIO_SHM_BASE_HIGH as u64;
pub const CONFIG_GENERATION: u64 = mmio::VIRTIO_MMIO_CONFIG_GENERATION as u64;
pub const CONFIG: u64 = mmio::VIRTIO_MMIO_CONFIG as u64;
/// QueueReset (virtio 1.2); not offered (no VIRTIO_F_RING_RESET), reads 0.
pub const QUEUE_RESET: u64 = 0x0c0;

/// Registers whose writes only store a value (offset, bytes): KVM may batch
/// them in the coalesced-MMIO ring (`crate::coalesced`), since the transport
/// acts on none of them until a later access that exits (a read, QueueReady,
/// Status). Two zones, each one KVM I/O-bus device: DeviceFeaturesSel up to
/// QueueNum (0x014..0x03c: the selectors, the driver's features, the queue
/// size, and the reserved words and QueueNumMax between them, where a write
/// does nothing) and the three ring addresses (0x080..0x0a8, reserved words
/// included). Reads in a zone still exit: the ring takes only writes.
pub const COALESCED_ZONES: [(u64, u32); 2] = [
    (
        DEVICE_FEATURES_SEL,
        (QUEUE_NUM + 4 - DEVICE_FEATURES_SEL) as u32,
    ),
    (
        QUEUE_DESC_LOW,
        (QUEUE_DEVICE_HIGH + 4 - QUEUE_DESC_LOW) as u32,
    ),
];

/// The zones of a device with a register page: its reads never exit, so a
/// write that changes what a register reads must exit and be published
/// before the next read. The two selectors (DeviceFeaturesSel picks what
/// DeviceFeatures reads, QueueSel what QueueNumMax and QueueReady read)
/// leave the ring; the driver's features, QueueNum and the ring addresses,
/// which no register reads back, stay in it.
pub const COALESCED_ZONES_WITH_PAGE: [(u64, u32); 3] = [
    (
        DRIVER_FEATURES,
        (DRIVER_FEATURES_SEL + 4 - DRIVER_FEATURES) as u32,
    ),
    (QUEUE_NUM_MAX, (QUEUE_NUM + 4 - QUEUE_NUM_MAX) as u32),
    (
        QUEUE_DESC_LOW,
        (QUEUE_DEVICE_HIGH + 4 - QUEUE_DESC_LOW) as u32,
    ),
];

/// The coalesced zones of a device with (`page`) or without a register page.
pub fn coalesced_zones(page: bool) -> &'static [(u64, u32)] {
    if page {
        &COALESCED_ZONES_WITH_PAGE
    } else {
        &COALESCED_ZONES
    }
}

const MMIO_MAGIC: u32 = 0x7472_6976; // "virt"
const MMIO_VERSION: u32 = 2;
const VENDOR: u32 = 0x4d56_5542; // "BUVM"

#[derive(Debug)]
pub struct MmioTransport<D: VirtioDevice> {
    device: D,
    mem: GuestMemoryMmap,
    interrupt: Arc<Interrupt>,
    base: u64,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    queue_sel: u32,
    queues: Vec<Queue>,
    active: bool,
    /// Queue registers the guest wrote after DRIVER_OK (ignored: the device
    /// runs on the queues it was given; counted and logged as hostile).
    late_queue_writes: AtomicU64,
    /// Mapped read-only over the device's window: the guest reads registers
    /// there, and every write is published to it before the vCPU resumes.
    page: Option<Arc<RegisterPage>>,
}

impl<D: VirtioDevice> MmioTransport<D> {
    /// `page`: the device's register page, when the guest reads its
    /// registers from one; it must be the one `interrupt` keeps its status in.
    pub fn new(
        device: D,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
        base: u64,
        page: Option<Arc<RegisterPage>>,
    ) -> Self {
        let queues = device
            .queue_max_sizes()
            .iter()
            .map(|&max| Queue::new(max).expect("queue max size is a power of two"))
            .collect();
        if let (Some(p), Some(view)) = (&page, device.view()) {
            p.set_view(view);
        }
        let mut t = MmioTransport {
            device,
            mem,
            interrupt,
            base,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            queue_sel: 0,
            queues,
            active: false,
            late_queue_writes: AtomicU64::new(0),
            page,
        };
        t.publish();
        t
    }

    /// The first place where the register page differs from what a read
    /// through an exit returns (offset, page, exit), if any: for the fuzz
    /// target and tests. ConfigGeneration is the page's own counter.
    pub fn page_mismatch(&mut self) -> Option<(u64, u32, u32)> {
        let page = self.page.clone()?;
        let regs = (0..CONFIG).step_by(4).filter(|&o| o != CONFIG_GENERATION);
        for offset in regs {
            let (p, e) = (page.load(offset), self.read_reg(offset));
            if p != e {
                return Some((offset, p, e));
            }
        }
        let len = page::CONFIG_LEN as u64;
        for offset in (CONFIG..CONFIG + len).step_by(4) {
            let (mut p, mut e) = ([0u8; 4], [0u8; 4]);
            page.read(offset, &mut p);
            self.device.read_config(offset - CONFIG, &mut e);
            if p != e {
                return Some((offset, u32::from_le_bytes(p), u32::from_le_bytes(e)));
            }
        }
        None
    }

    /// Copies every register the guest may read, and the config space, to
    /// the register page. InterruptStatus is the interrupt's own word there;
    /// ConfigGeneration moves with the config bytes (`RegisterPage::publish_config`).
    fn publish(&mut self) {
        let Some(page) = self.page.clone() else {
            return;
        };
        for offset in (0..CONFIG).step_by(4) {
            if !matches!(offset, INTERRUPT_STATUS | STATUS | CONFIG_GENERATION) {
                page.word(offset)
                    .store(self.read_reg(offset), Ordering::SeqCst);
            }
        }
        page.publish_status(self.status, || self.device.needs_reset());
        page.publish_device_config(|b| self.device.read_config(0, b));
    }

    /// Queue registers written after DRIVER_OK (a queue moved, resized or
    /// readied while the device runs on it), all ignored.
    pub fn late_queue_writes(&self) -> u64 {
        self.late_queue_writes.load(Ordering::Relaxed)
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    pub fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    fn has(&self, bit: u32) -> bool {
        self.status & bit != 0
    }

    /// Queue registers may change only while the driver sets the device up
    /// (after FEATURES_OK, before DRIVER_OK) and the queue is not ready.
    fn queue_writable(&self) -> bool {
        self.has(VIRTIO_CONFIG_S_FEATURES_OK)
            && !self.has(VIRTIO_CONFIG_S_DRIVER_OK)
            && !self.has(VIRTIO_CONFIG_S_FAILED)
    }

    fn status_reg(&self) -> u32 {
        let mut s = self.status;
        if self.device.needs_reset() {
            s |= VIRTIO_CONFIG_S_NEEDS_RESET;
        }
        s
    }

    fn read_reg(&mut self, offset: u64) -> u32 {
        match offset {
            MAGIC_VALUE => MMIO_MAGIC,
            VERSION => MMIO_VERSION,
            DEVICE_ID => self.device.device_type(),
            VENDOR_ID => VENDOR,
            DEVICE_FEATURES => match self.device_features_sel {
                0 => self.device.features() as u32,
                1 => (self.device.features() >> 32) as u32,
                _ => 0,
            },
            QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| q.max_size() as u32),
            QUEUE_READY => self.selected_queue().map_or(0, |q| q.ready() as u32),
            INTERRUPT_STATUS => self.interrupt.status(),
            STATUS => self.status_reg(),
            // No shared memory regions: length all ones means "none".
            SHM_LEN_LOW | SHM_LEN_HIGH | SHM_BASE_LOW | SHM_BASE_HIGH => u32::MAX,
            QUEUE_RESET => 0,
            CONFIG_GENERATION => self.device.config_generation(),
            _ => 0, // write-only or reserved
        }
    }

    fn write_reg(&mut self, offset: u64, v: u32) {
        let queue_reg = matches!(
            offset,
            QUEUE_NUM
                | QUEUE_READY
                | QUEUE_DESC_LOW
                | QUEUE_DESC_HIGH
                | QUEUE_DRIVER_LOW
                | QUEUE_DRIVER_HIGH
                | QUEUE_DEVICE_LOW
                | QUEUE_DEVICE_HIGH
        );
        if queue_reg && self.has(VIRTIO_CONFIG_S_DRIVER_OK) {
            // The device (or the NIC behind a VF) runs on the queue as it was
            // at DRIVER_OK; the driver must reset the device to change it.
            super::note(
                &self.late_queue_writes,
                format_args!(
                    "virtio-mmio {:#x}: queue {} register {offset:#x} written after DRIVER_OK, ignored",
                    self.base, self.queue_sel
                ),
            );
            return;
        }
        let features_writable =
            self.has(VIRTIO_CONFIG_S_DRIVER) && !self.has(VIRTIO_CONFIG_S_FEATURES_OK);
        let queue_writable = self.queue_writable();
        match offset {
            DEVICE_FEATURES_SEL => self.device_features_sel = v,
            DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            DRIVER_FEATURES if features_writable => {
                let (shift, keep) = match self.driver_features_sel {
                    0 => (0, !0xffff_ffffu64),
                    1 => (32, 0xffff_ffff),
                    _ => return,
                };
                self.driver_features = (self.driver_features & keep) | (v as u64) << shift;
            }
            QUEUE_SEL => self.queue_sel = v,
            QUEUE_NUM if queue_writable => {
                if let Some(q) = self.selected_queue().filter(|q| !q.ready()) {
                    // Queue::set_size ignores sizes that are not a power of two <= max.
                    q.set_size(v.min(u16::MAX as u32) as u16);
                }
            }
            QUEUE_READY if queue_writable => {
                let mem = self.mem.clone();
                if let Some(q) = self.selected_queue() {
                    // A queue whose rings do not lie in guest memory never
                    // becomes ready (is_valid looks at ready queues only).
                    q.set_ready(v == 1);
                    if q.ready() && !q.is_valid(&mem) {
                        q.set_ready(false);
                    }
                }
            }
            QUEUE_DESC_LOW | QUEUE_DESC_HIGH | QUEUE_DRIVER_LOW | QUEUE_DRIVER_HIGH
            | QUEUE_DEVICE_LOW | QUEUE_DEVICE_HIGH
                if queue_writable =>
            {
                if let Some(q) = self.selected_queue().filter(|q| !q.ready()) {
                    let (lo, hi) = if offset & 4 == 0 {
                        (Some(v), None)
                    } else {
                        (None, Some(v))
                    };
                    match offset & !4 {
                        QUEUE_DESC_LOW => q.set_desc_table_address(lo, hi),
                        QUEUE_DRIVER_LOW => q.set_avail_ring_address(lo, hi),
                        _ => q.set_used_ring_address(lo, hi),
                    }
                }
            }
            INTERRUPT_ACK => self.interrupt.ack(v),
            STATUS => self.write_status(v),
            // QueueNotify normally ends in the ioeventfd; what reaches us
            // names no queue of this device. Everything else is read-only,
            // reserved, or not writable in the current state.
            _ => {}
        }
    }

    fn write_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        // The driver only ever adds bits; anything else is a driver bug.
        if v & self.status != self.status {
            tracing::warn!(
                "virtio-mmio {:#x}: status {:#x} drops bits of {:#x}, ignored",
                self.base,
                v,
                self.status
            );
            return;
        }
        let new = v & !self.status;
        if new & VIRTIO_CONFIG_S_FEATURES_OK != 0 {
            let offered = self.device.features();
            let ok = self.driver_features & !offered == 0
                && self.driver_features & (1 << VIRTIO_F_VERSION_1) != 0;
            if !ok {
                // Leaving FEATURES_OK clear tells the driver we refuse.
                self.status = v & !VIRTIO_CONFIG_S_FEATURES_OK;
                return;
            }
        }
        if new & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            if !self.has(VIRTIO_CONFIG_S_FEATURES_OK) {
                self.status = (v & !VIRTIO_CONFIG_S_DRIVER_OK) | VIRTIO_CONFIG_S_FAILED;
                return;
            }
            self.status = v;
            self.activate();
            return;
        }
        self.status = v;
    }

    fn activate(&mut self) {
        if self.active {
            return;
        }
        // The device gets its own copies; ours keep answering register reads.
        let queues: Vec<Queue> = match self
            .queues
            .iter()
            .map(|q| Queue::try_from(q.state()))
            .collect()
        {
            Ok(q) => q,
            Err(e) => {
                tracing::warn!("virtio-mmio {:#x}: bad queue at DRIVER_OK: {e}", self.base);
                self.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
                return;
            }
        };
        if !queues.iter().any(|q| q.ready()) {
            tracing::warn!(
                "virtio-mmio {:#x}: DRIVER_OK with no ready queue",
                self.base
            );
        }
        match self.device.activate(self.driver_features, queues) {
            Ok(()) => {
                self.active = true;
                // Used-ring interrupts that bypass us (irqfd from the
                // backend) set no bit: it reads set while the device runs.
                if self.device.used_irq_bypasses_status() {
                    self.interrupt.hold(VIRTIO_MMIO_INT_VRING);
                }
            }
            Err(e) => {
                tracing::error!("virtio-mmio {:#x}: activation failed: {e}", self.base);
                self.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
            }
        }
    }

    fn reset(&mut self) {
        if self.active {
            self.device.reset();
            self.active = false;
        }
        self.status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.queue_sel = 0;
        self.queues.iter_mut().for_each(|q| q.reset());
        self.interrupt.clear();
    }

    pub fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG {
            self.device.read_config(offset - CONFIG, data);
            return;
        }
        // Registers are 32 bits wide and must be accessed as such.
        if data.len() != 4 || !offset.is_multiple_of(4) {
            data.fill(0);
            return;
        }
        data.copy_from_slice(&self.read_reg(offset).to_le_bytes());
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG {
            self.device.write_config(offset - CONFIG, data);
        } else if let Ok(word) = <[u8; 4]>::try_from(data) {
            if offset.is_multiple_of(4) {
                self.write_reg(offset, u32::from_le_bytes(word));
            }
        }
        self.publish();
    }
}

#[cfg(test)]
mod tests;
