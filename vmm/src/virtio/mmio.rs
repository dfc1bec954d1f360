//! virtio-mmio transport, version 2 (virtio 1.2 §4.2.2).
//!
//! The register file is kept here; the device-type specific part sits behind
//! [`VirtioDevice`]. Everything the guest writes is untrusted: bad values are
//! ignored or turn into DEVICE_NEEDS_RESET, never into a panic.

use std::sync::Arc;

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FAILED,
    VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_mmio::{self as mmio, VIRTIO_MMIO_INT_VRING};
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;

use super::{Interrupt, VirtioDevice};

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

const MMIO_MAGIC: u32 = 0x7472_6976; // "virt"
const MMIO_VERSION: u32 = 2;
const VENDOR: u32 = 0x4d56_5542; // "BUVM"

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
}

impl<D: VirtioDevice> MmioTransport<D> {
    pub fn new(device: D, mem: GuestMemoryMmap, interrupt: Arc<Interrupt>, base: u64) -> Self {
        let queues = device
            .queue_max_sizes()
            .iter()
            .map(|&max| Queue::new(max).expect("queue max size is a power of two"))
            .collect();
        MmioTransport {
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
        }
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
            INTERRUPT_STATUS => {
                let bypass = self.active && self.device.used_irq_bypasses_status();
                self.interrupt.status() | if bypass { VIRTIO_MMIO_INT_VRING } else { 0 }
            }
            STATUS => self.status_reg(),
            // No shared memory regions: length all ones means "none".
            SHM_LEN_LOW | SHM_LEN_HIGH | SHM_BASE_LOW | SHM_BASE_HIGH => u32::MAX,
            QUEUE_RESET => 0,
            CONFIG_GENERATION => self.device.config_generation(),
            _ => 0, // write-only or reserved
        }
    }

    fn write_reg(&mut self, offset: u64, v: u32) {
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
            Ok(()) => self.active = true,
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
        self.interrupt.ack(u32::MAX);
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
            return;
        }
        if data.len() != 4 || !offset.is_multiple_of(4) {
            return;
        }
        self.write_reg(offset, u32::from_le_bytes(data.try_into().unwrap()));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use vm_memory::GuestAddress;
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    use super::*;
    use crate::virtio::{VirtioError, INT_CONFIG, INT_USED_RING};

    const FEATURES: u64 = 1 << VIRTIO_F_VERSION_1 | 1 << 5;

    /// ready, size, desc, avail, used
    type QueueSnapshot = (bool, u16, u64, u64, u64);

    #[derive(Default)]
    struct Log {
        activated: Vec<(u64, Vec<QueueSnapshot>)>,
        resets: usize,
    }

    struct TestDev {
        log: Arc<Mutex<Log>>,
        config: [u8; 8],
    }

    impl VirtioDevice for TestDev {
        fn device_type(&self) -> u32 {
            1
        }
        fn features(&self) -> u64 {
            FEATURES
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16, 16]
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            crate::virtio::net::read_config_bytes(&self.config, offset, data)
        }
        fn write_config(&mut self, offset: u64, data: &[u8]) {
            let o = offset as usize;
            if o + data.len() <= self.config.len() {
                self.config[o..o + data.len()].copy_from_slice(data);
            }
        }
        fn config_generation(&self) -> u32 {
            7
        }
        fn activate(&mut self, features: u64, queues: Vec<Queue>) -> Result<(), VirtioError> {
            let q = queues
                .iter()
                .map(|q| {
                    (
                        q.ready(),
                        q.size(),
                        q.desc_table(),
                        q.avail_ring(),
                        q.used_ring(),
                    )
                })
                .collect();
            self.log.lock().unwrap().activated.push((features, q));
            Ok(())
        }
        fn reset(&mut self) {
            self.log.lock().unwrap().resets += 1;
        }
    }

    fn transport() -> (MmioTransport<TestDev>, Arc<Mutex<Log>>, Arc<Interrupt>) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let log = Arc::new(Mutex::new(Log::default()));
        let irq = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
        let dev = TestDev {
            log: log.clone(),
            config: [1, 2, 3, 4, 5, 6, 0, 0],
        };
        (
            MmioTransport::new(dev, mem, irq.clone(), 0xd000_0000),
            log,
            irq,
        )
    }

    fn r(t: &mut MmioTransport<TestDev>, off: u64) -> u32 {
        let mut d = [0xffu8; 4];
        t.read(off, &mut d);
        u32::from_le_bytes(d)
    }

    fn w(t: &mut MmioTransport<TestDev>, off: u64, v: u32) {
        t.write(off, &v.to_le_bytes());
    }

    const ACK_DRIVER: u32 = 1 | VIRTIO_CONFIG_S_DRIVER;

    fn negotiate(t: &mut MmioTransport<TestDev>, features: u64) -> u32 {
        w(t, STATUS, 0);
        w(t, STATUS, 1);
        w(t, STATUS, ACK_DRIVER);
        w(t, DRIVER_FEATURES_SEL, 0);
        w(t, DRIVER_FEATURES, features as u32);
        w(t, DRIVER_FEATURES_SEL, 1);
        w(t, DRIVER_FEATURES, (features >> 32) as u32);
        w(t, STATUS, ACK_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK);
        r(t, STATUS)
    }

    fn setup_queue(t: &mut MmioTransport<TestDev>, q: u32, size: u32, desc: u64) {
        w(t, QUEUE_SEL, q);
        w(t, QUEUE_NUM, size);
        w(t, QUEUE_DESC_LOW, desc as u32);
        w(t, QUEUE_DESC_HIGH, (desc >> 32) as u32);
        w(t, QUEUE_DRIVER_LOW, (desc + 0x400) as u32);
        w(t, QUEUE_DRIVER_HIGH, 0);
        w(t, QUEUE_DEVICE_LOW, (desc + 0x800) as u32);
        w(t, QUEUE_DEVICE_HIGH, 0);
        w(t, QUEUE_READY, 1);
    }

    #[test]
    fn identity_registers_and_access_width() {
        let (mut t, _, _) = transport();
        assert_eq!(r(&mut t, MAGIC_VALUE), 0x7472_6976);
        assert_eq!(r(&mut t, VERSION), 2);
        assert_eq!(r(&mut t, DEVICE_ID), 1);
        assert_eq!(r(&mut t, VENDOR_ID), VENDOR);
        assert_eq!(r(&mut t, CONFIG_GENERATION), 7);
        assert_eq!(r(&mut t, SHM_LEN_LOW), u32::MAX, "no shared memory region");
        // Registers are 32-bit only: narrower or unaligned accesses read 0.
        let mut b = [0xffu8; 2];
        t.read(MAGIC_VALUE, &mut b);
        assert_eq!(b, [0, 0]);
        let mut d = [0xffu8; 4];
        t.read(MAGIC_VALUE + 2, &mut d);
        assert_eq!(d, [0; 4]);
        // Config space: any width, past its end reads 0, writes go to the device.
        let mut m = [0u8; 6];
        t.read(CONFIG, &mut m);
        assert_eq!(m, [1, 2, 3, 4, 5, 6]);
        t.write(CONFIG + 1, &[9]);
        let mut one = [0u8; 1];
        t.read(CONFIG + 1, &mut one);
        assert_eq!(one, [9]);
        let mut far = [0xffu8; 4];
        t.read(CONFIG + 0x200, &mut far);
        assert_eq!(far, [0; 4]);
    }

    #[test]
    fn feature_negotiation() {
        let (mut t, _, _) = transport();
        w(&mut t, DEVICE_FEATURES_SEL, 0);
        assert_eq!(r(&mut t, DEVICE_FEATURES), FEATURES as u32);
        w(&mut t, DEVICE_FEATURES_SEL, 1);
        assert_eq!(r(&mut t, DEVICE_FEATURES), (FEATURES >> 32) as u32);
        w(&mut t, DEVICE_FEATURES_SEL, 2);
        assert_eq!(r(&mut t, DEVICE_FEATURES), 0);

        // A feature the device does not offer: FEATURES_OK stays clear.
        assert_eq!(negotiate(&mut t, FEATURES | 1 << 6), ACK_DRIVER);
        // Legacy driver (no VERSION_1): refused too.
        assert_eq!(negotiate(&mut t, 1 << 5), ACK_DRIVER);
        // A subset including VERSION_1 is accepted.
        assert_eq!(
            negotiate(&mut t, 1 << VIRTIO_F_VERSION_1),
            ACK_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK
        );
        // Once FEATURES_OK is set, driver features are frozen.
        w(&mut t, DRIVER_FEATURES_SEL, 0);
        w(&mut t, DRIVER_FEATURES, 1 << 5);
        assert_eq!(t.driver_features, 1 << VIRTIO_F_VERSION_1);
    }

    #[test]
    fn driver_features_ignored_before_driver_status() {
        let (mut t, _, _) = transport();
        w(&mut t, DRIVER_FEATURES_SEL, 1);
        w(&mut t, DRIVER_FEATURES, 1);
        assert_eq!(t.driver_features, 0);
    }

    #[test]
    fn queue_setup_and_activation() {
        let (mut t, log, _) = transport();
        // Queue registers are ignored before FEATURES_OK.
        w(&mut t, QUEUE_SEL, 0);
        w(&mut t, QUEUE_NUM, 8);
        w(&mut t, QUEUE_READY, 1);
        assert_eq!(r(&mut t, QUEUE_READY), 0);

        negotiate(&mut t, FEATURES);
        w(&mut t, QUEUE_SEL, 0);
        assert_eq!(r(&mut t, QUEUE_NUM_MAX), 16);
        w(&mut t, QUEUE_SEL, 2);
        assert_eq!(r(&mut t, QUEUE_NUM_MAX), 0, "queue 2 does not exist");
        w(&mut t, QUEUE_NUM, 8); // ignored, no such queue
        setup_queue(&mut t, 0, 8, 0x1000);
        assert_eq!(r(&mut t, QUEUE_READY), 1);
        // Rings outside guest memory: the queue never becomes ready.
        setup_queue(&mut t, 1, 8, 0x20_0000);
        assert_eq!(r(&mut t, QUEUE_READY), 0);
        setup_queue(&mut t, 1, 4, 0x4000);
        assert_eq!(r(&mut t, QUEUE_READY), 1);
        // A ready queue's registers are frozen.
        w(&mut t, QUEUE_DESC_LOW, 0x8000);

        w(
            &mut t,
            STATUS,
            ACK_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK | VIRTIO_CONFIG_S_DRIVER_OK,
        );
        let log = log.lock().unwrap();
        assert_eq!(log.activated.len(), 1);
        let (features, queues) = &log.activated[0];
        assert_eq!(*features, FEATURES);
        assert_eq!(queues[0], (true, 8, 0x1000, 0x1400, 0x1800));
        assert_eq!(queues[1], (true, 4, 0x4000, 0x4400, 0x4800));
    }

    #[test]
    fn invalid_queue_size_is_ignored() {
        let (mut t, _, _) = transport();
        negotiate(&mut t, FEATURES);
        w(&mut t, QUEUE_SEL, 0);
        w(&mut t, QUEUE_NUM, 8);
        w(&mut t, QUEUE_NUM, 5); // not a power of two
        w(&mut t, QUEUE_NUM, 32); // above QueueNumMax
        assert_eq!(t.queues[0].size(), 8);
    }

    #[test]
    fn status_rules_and_reset() {
        let (mut t, log, irq) = transport();
        // DRIVER_OK without FEATURES_OK: the device marks itself FAILED.
        w(&mut t, STATUS, 1);
        w(&mut t, STATUS, ACK_DRIVER | VIRTIO_CONFIG_S_DRIVER_OK);
        assert_eq!(r(&mut t, STATUS), ACK_DRIVER | VIRTIO_CONFIG_S_FAILED);
        assert!(log.lock().unwrap().activated.is_empty());

        negotiate(&mut t, FEATURES);
        setup_queue(&mut t, 0, 8, 0x1000);
        w(
            &mut t,
            STATUS,
            ACK_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK | VIRTIO_CONFIG_S_DRIVER_OK,
        );
        // Clearing bits other than by reset is ignored.
        w(&mut t, STATUS, 1);
        assert_eq!(
            r(&mut t, STATUS),
            ACK_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK | VIRTIO_CONFIG_S_DRIVER_OK
        );

        // Interrupt status and acknowledge.
        irq.signal(INT_USED_RING | INT_CONFIG);
        assert_eq!(r(&mut t, INTERRUPT_STATUS), 3);
        w(&mut t, INTERRUPT_ACK, INT_USED_RING);
        assert_eq!(r(&mut t, INTERRUPT_STATUS), INT_CONFIG);
        assert_eq!(irq.irqfd().read().unwrap(), 1, "one irqfd write per signal");

        // Reset: device stopped, every register back to its initial value.
        w(&mut t, STATUS, 0);
        assert_eq!(log.lock().unwrap().resets, 1);
        assert_eq!(r(&mut t, STATUS), 0);
        assert_eq!(r(&mut t, INTERRUPT_STATUS), 0);
        w(&mut t, QUEUE_SEL, 0);
        assert_eq!(r(&mut t, QUEUE_READY), 0);
        assert_eq!(t.driver_features, 0);
        // The driver can start over and the device is activated again.
        negotiate(&mut t, FEATURES);
        setup_queue(&mut t, 0, 8, 0x1000);
        w(
            &mut t,
            STATUS,
            ACK_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK | VIRTIO_CONFIG_S_DRIVER_OK,
        );
        assert_eq!(log.lock().unwrap().activated.len(), 2);
    }

    #[test]
    fn notify_writes_that_reach_the_transport_are_harmless() {
        let (mut t, log, _) = transport();
        w(&mut t, QUEUE_NOTIFY, 0xffff);
        t.write(QUEUE_NOTIFY, &[0]);
        w(&mut t, 0x200_0000, 1);
        assert!(log.lock().unwrap().activated.is_empty());
    }
}
