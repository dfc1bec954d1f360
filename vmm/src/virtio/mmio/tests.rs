//! Tests of the virtio-mmio transport.

use std::sync::Mutex;

use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use crate::virtio::{DeviceView, VirtioError, INT_CONFIG, INT_USED_RING};

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

/// A transport with a register page: every write below (`w`) also checks
/// that the page reads as the exits do, so each test covers both paths.
fn transport() -> (MmioTransport<TestDev>, Arc<Mutex<Log>>, Arc<Interrupt>) {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
    let log = Arc::new(Mutex::new(Log::default()));
    let page = Arc::new(RegisterPage::new().unwrap());
    let irq = Arc::new(Interrupt::with_page(
        EventFd::new(EFD_NONBLOCK).unwrap(),
        Some(page.clone()),
    ));
    let dev = TestDev {
        log: log.clone(),
        config: [1, 2, 3, 4, 5, 6, 0, 0],
    };
    (
        MmioTransport::new(dev, mem, irq.clone(), 0xd000_0000, Some(page)),
        log,
        irq,
    )
}

/// The page as the guest reads it: registers and published config.
fn page_bytes(t: &MmioTransport<TestDev>) -> Vec<u8> {
    let mut b = vec![0u8; CONFIG as usize + page::CONFIG_LEN];
    t.page.as_ref().expect("a page").read(0, &mut b);
    b
}

fn r(t: &mut MmioTransport<TestDev>, off: u64) -> u32 {
    let mut d = [0xffu8; 4];
    t.read(off, &mut d);
    u32::from_le_bytes(d)
}

fn w(t: &mut MmioTransport<TestDev>, off: u64, v: u32) {
    t.write(off, &v.to_le_bytes());
    assert_eq!(
        t.page_mismatch(),
        None,
        "register page after {v:#x} to {off:#x}"
    );
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

/// A guest that moves, resizes or readies a queue after DRIVER_OK: each
/// write is counted and ignored, the device keeps the queue it was given.
#[test]
fn queue_registers_written_after_driver_ok_are_counted_and_ignored() {
    let (mut t, log, _) = transport();
    negotiate(&mut t, FEATURES);
    setup_queue(&mut t, 0, 8, 0x1000);
    let running = ACK_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK | VIRTIO_CONFIG_S_DRIVER_OK;
    w(&mut t, STATUS, running);
    assert_eq!(t.late_queue_writes(), 0);
    w(&mut t, QUEUE_SEL, 0);
    w(&mut t, QUEUE_DESC_LOW, 0x8000);
    w(&mut t, QUEUE_DRIVER_LOW, 0x8400);
    w(&mut t, QUEUE_NUM, 4);
    w(&mut t, QUEUE_SEL, 1);
    w(&mut t, QUEUE_READY, 1);
    assert_eq!(t.late_queue_writes(), 4);
    assert_eq!(r(&mut t, STATUS), running, "the device runs on");
    assert_eq!(
        (
            t.queues[0].desc_table(),
            t.queues[0].avail_ring(),
            t.queues[0].size()
        ),
        (0x1000, 0x1400, 8)
    );
    assert_eq!(r(&mut t, QUEUE_READY), 0, "queue 1 stays unready");
    assert_eq!(log.lock().unwrap().activated.len(), 1);
    // After a reset the driver may set queues up again: not counted.
    w(&mut t, STATUS, 0);
    negotiate(&mut t, FEATURES);
    setup_queue(&mut t, 0, 8, 0x2000);
    assert_eq!(t.late_queue_writes(), 4);
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

/// A transport set up to `step` of a driver's start: 0 fresh, 1 with its
/// features negotiated, 2 with queue 0 set up as well.
fn set_up_to(step: u32) -> (MmioTransport<TestDev>, Arc<Mutex<Log>>) {
    let (mut t, log, _) = transport();
    if step >= 1 {
        negotiate(&mut t, 1 << VIRTIO_F_VERSION_1);
    }
    if step >= 2 {
        setup_queue(&mut t, 0, 16, 0x1000);
    }
    (t, log)
}

/// What the zone tests write: every word of `zones`, at each set-up step
/// (`set_up_to`), with 1 and with a pattern.
fn zone_writes(zones: &[(u64, u32)]) -> impl Iterator<Item = (u64, u32, u32)> + '_ {
    let words = zones
        .iter()
        .flat_map(|&(base, len)| (base..base + len as u64).step_by(4));
    words.flat_map(|off| {
        (0..3).flat_map(move |step| [1, 0x5a5a_0001].map(|value| (off, step, value)))
    })
}

/// Every word KVM may batch in the coalesced ring only stores a value: a
/// write to it changes no register a read returns until the driver's next
/// exiting access, which is when the VMM applies the ring. Checked by
/// writing each word of the zones at every set-up step and comparing every
/// readable register, and the device's log, before and after.
#[test]
fn coalesced_zones_hold_only_store_only_words() {
    const READABLE: [u64; 9] = [
        MAGIC_VALUE,
        VERSION,
        DEVICE_ID,
        VENDOR_ID,
        QUEUE_READY,
        INTERRUPT_STATUS,
        STATUS,
        CONFIG_GENERATION,
        QUEUE_RESET,
    ];
    // DeviceFeatures and QueueNumMax are left out: they follow the
    // selectors, which are zone words whose effect shows at the next read.
    let snapshot = |t: &mut MmioTransport<TestDev>| -> Vec<u32> {
        READABLE.iter().map(|&o| r(t, o)).collect()
    };
    for (off, step, value) in zone_writes(&COALESCED_ZONES) {
        let (mut t, log) = set_up_to(step);
        let before = snapshot(&mut t);
        let activated = log.lock().unwrap().activated.len();
        w(&mut t, off, value);
        let mut after = snapshot(&mut t);
        // QueueReady follows QueueSel, which is itself in a zone: read
        // it for the queue selected before the write.
        if off == QUEUE_SEL {
            w(&mut t, QUEUE_SEL, 0);
            after = snapshot(&mut t);
        }
        assert_eq!(
            before, after,
            "step {step}: writing {value:#x} to {off:#x} changed a register"
        );
        assert_eq!(
            log.lock().unwrap().activated.len(),
            activated,
            "step {step}: writing {value:#x} to {off:#x} activated the device"
        );
    }
}

/// With a register page the guest's reads never exit, so a write KVM may
/// batch must not change anything the page shows: checked like the zones
/// above, on every byte of the page. The selectors are why the page's zones
/// differ: a QueueSel or DeviceFeaturesSel write changes what a register
/// reads, so it must exit and be published before the next read.
#[test]
fn coalesced_zones_with_a_page_change_no_byte_of_it() {
    for (off, step, value) in zone_writes(&COALESCED_ZONES_WITH_PAGE) {
        let (mut t, _) = set_up_to(step);
        let before = page_bytes(&t);
        w(&mut t, off, value);
        assert!(
            before == page_bytes(&t),
            "step {step}: writing {value:#x} to {off:#x} changed the page"
        );
    }
    // And the selectors do change it (why they exit).
    for sel in [QUEUE_SEL, DEVICE_FEATURES_SEL] {
        let (mut t, _) = set_up_to(2);
        w(&mut t, sel, 0);
        let before = page_bytes(&t);
        w(&mut t, sel, 1);
        assert!(before != page_bytes(&t), "{sel:#x} changed nothing");
    }
}

/// A device that reports a config change and a failure on its own: the
/// page shows both before the config interrupt reaches the guest.
#[test]
fn a_config_interrupt_publishes_the_device_view_first() {
    struct Shared {
        link: std::sync::atomic::AtomicU8,
        failed: std::sync::atomic::AtomicBool,
    }
    impl DeviceView for Shared {
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            let cfg = [9, self.link.load(Ordering::SeqCst)];
            crate::virtio::net::read_config_bytes(&cfg, offset, data)
        }
        fn needs_reset(&self) -> bool {
            self.failed.load(Ordering::SeqCst)
        }
    }
    struct ViewDev(Arc<Shared>);
    impl VirtioDevice for ViewDev {
        fn device_type(&self) -> u32 {
            1
        }
        fn features(&self) -> u64 {
            FEATURES
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16]
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            self.0.read_config(offset, data)
        }
        fn needs_reset(&self) -> bool {
            self.0.needs_reset()
        }
        fn view(&self) -> Option<Arc<dyn DeviceView>> {
            Some(self.0.clone())
        }
        fn activate(&mut self, _: u64, _: Vec<Queue>) -> Result<(), VirtioError> {
            Ok(())
        }
        fn reset(&mut self) {}
    }
    let shared = Arc::new(Shared {
        link: 0.into(),
        failed: false.into(),
    });
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
    let page = Arc::new(RegisterPage::new().unwrap());
    let irq = Arc::new(Interrupt::with_page(
        EventFd::new(EFD_NONBLOCK).unwrap(),
        Some(page.clone()),
    ));
    let mut t = MmioTransport::new(
        ViewDev(shared.clone()),
        mem,
        irq.clone(),
        0,
        Some(page.clone()),
    );
    t.write(STATUS, &1u32.to_le_bytes());
    let gen = page.load(CONFIG_GENERATION);
    let mut cfg = [0u8; 2];
    page.read(CONFIG, &mut cfg);
    assert_eq!(cfg, [9, 0]);

    // The link comes up on another thread.
    shared.link.store(1, Ordering::SeqCst);
    irq.signal(INT_CONFIG);
    page.read(CONFIG, &mut cfg);
    assert_eq!(cfg, [9, 1]);
    assert_ne!(page.load(CONFIG_GENERATION), gen, "the generation moved");
    assert_eq!(page.load(INTERRUPT_STATUS), INT_CONFIG);
    assert_eq!(t.page_mismatch(), None);

    // Then it fails: DEVICE_NEEDS_RESET with the driver's bits.
    shared.failed.store(true, Ordering::SeqCst);
    irq.signal(INT_CONFIG);
    assert_eq!(page.load(STATUS), 1 | VIRTIO_CONFIG_S_NEEDS_RESET);
    assert_eq!(t.page_mismatch(), None);
}

/// A backend's used-ring interrupts (irqfd) set no bit: the bit reads set
/// from DRIVER_OK to the reset whatever the driver acknowledges.
#[test]
fn held_used_ring_bit_survives_acks_until_reset() {
    let irq = Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap());
    irq.hold(INT_USED_RING);
    irq.signal(INT_CONFIG);
    irq.ack(INT_USED_RING | INT_CONFIG);
    assert_eq!(irq.status(), INT_USED_RING);
    irq.clear();
    assert_eq!(irq.status(), 0);
}
