//! Fuzz bodies of the VMM. `fuzz_mmio`: the virtio-mmio register
//! interface, what a guest can do to a device through its MMIO window, and
//! the descriptor chains it then hands the device (target `mmio`).
//! `fuzz_vsock`: the virtio-vsock device between a hostile guest and host
//! (target `vsock`; its body is `virtio/vsock/fuzz.rs`). Called by the
//! cargo-fuzz targets in `fuzz/` and by the corpus replay test
//! (docs/fuzzing.md).

use std::sync::Arc;

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::virtio::mmio::{self, MmioTransport};
use crate::virtio::net::{
    net_config, read_config_bytes, read_tx_chain, write_rx_chain, NET_FEATURES, VNET_HDR_LEN,
};
use crate::virtio::{Interrupt, RegisterPage, VirtioDevice, VirtioError};

/// Guest memory of the target, at GPA 0.
pub const MEM: usize = 64 << 10;
/// One register access: kind, offset (u16), size code, value (u32).
pub const OP_LEN: usize = 8;

/// A virtio-net device whose queues are worked through the VMM's own chain
/// code (`write_rx_chain`, `read_tx_chain`) when the guest "kicks".
struct FuzzNet {
    config: [u8; 8],
    mem: GuestMemoryMmap,
    queues: Vec<Queue>,
    features: u64,
}

impl VirtioDevice for FuzzNet {
    fn device_type(&self) -> u32 {
        virtio_bindings::virtio_ids::VIRTIO_ID_NET
    }
    fn features(&self) -> u64 {
        NET_FEATURES
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[256, 256]
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data)
    }
    fn activate(&mut self, features: u64, queues: Vec<Queue>) -> Result<(), VirtioError> {
        // The transport's promises to every device.
        assert_eq!(features & !NET_FEATURES, 0, "unoffered features acked");
        assert_ne!(features & (1 << VIRTIO_F_VERSION_1), 0);
        assert_eq!(queues.len(), 2);
        for q in &queues {
            assert!(!q.ready() || q.is_valid(&self.mem), "invalid ready queue");
        }
        self.features = features;
        self.queues = queues;
        Ok(())
    }
    fn reset(&mut self) {
        self.queues.clear();
    }
}

impl FuzzNet {
    /// What the device's worker does on a kick: fill RX buffers, drain TX.
    fn kick(&mut self) {
        let frame = [0xa5u8; VNET_HDR_LEN + 60];
        let mut buf = Vec::new();
        let mem = self.mem.clone();
        let features = self.features;
        for (i, q) in self.queues.iter_mut().enumerate() {
            if !q.ready() {
                continue;
            }
            let Ok(view) = virtq::RingView::resolve(&virtq::Ring::of(&*q, features), &mem) else {
                continue;
            };
            let Ok(heads) = view.avail_heads(q, usize::from(q.size())) else {
                continue;
            };
            let mut used = Vec::new();
            for head in heads {
                let len = if i == 0 {
                    write_rx_chain(&view, &|_, _| Ok(()), head, &frame).unwrap_or(0)
                } else {
                    let n = read_tx_chain(&view, &|_, _| Ok(()), head, &mut buf).unwrap_or(0);
                    assert!(n <= 65536 + VNET_HDR_LEN, "TX frame of {n} bytes");
                    0
                };
                used.push((head, len));
            }
            let _ = view.complete_used(q, &used);
        }
    }
}

/// `data` = number of register accesses n, n accesses of [`OP_LEN`] bytes
/// (kind: 0 read, 1 write, 2 kick; offset; size 1/2/4/8; value), then the
/// guest memory image.
pub fn fuzz_mmio(data: &[u8]) {
    let n = data.first().copied().unwrap_or(0) as usize;
    let ops_end = (1 + n * OP_LEN).min(data.len());
    let ops = &data[1.min(data.len())..ops_end];
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM)]).expect("guest memory");
    let image = &data[ops_end..];
    mem.write_slice(&image[..image.len().min(MEM)], GuestAddress(0))
        .expect("image fits");
    // With a register page: after every access, the page must read as the
    // exits would (what a guest that reads the page sees).
    let page = Arc::new(RegisterPage::new().expect("register page"));
    let irq = Arc::new(Interrupt::with_page(
        EventFd::new(EFD_NONBLOCK).expect("eventfd"),
        Some(page.clone()),
    ));
    let dev = FuzzNet {
        config: net_config(&[2, 0, 0, 0, 0, 1], 1),
        mem: mem.clone(),
        queues: Vec::new(),
        features: 0,
    };
    let mut t = MmioTransport::new(dev, mem, irq, 0xd000_0000, Some(page));
    for op in ops.chunks(OP_LEN) {
        let mut op = op.to_vec();
        op.resize(OP_LEN, 0);
        let offset = u64::from(u16::from_le_bytes([op[1], op[2]])) & 0xfff;
        let size = [1usize, 2, 4, 8][op[3] as usize % 4];
        let value = u64::from(u32::from_le_bytes(
            op[4..8].try_into().expect("a 4-byte slice"),
        ));
        match op[0] % 3 {
            0 => {
                let mut buf = vec![0xeeu8; size];
                t.read(offset, &mut buf);
                if offset == mmio::MAGIC_VALUE && size == 4 {
                    assert_eq!(buf, b"virt");
                }
            }
            1 => t.write(offset, &value.to_le_bytes()[..size]),
            _ => t.device_mut().kick(),
        }
        assert_eq!(t.page_mismatch(), None, "register page after {op:?}");
    }
}

pub fn mmio_seeds() -> Vec<Vec<u8>> {
    use mmio::*;
    let w = |off: u64, v: u32| {
        let mut o = vec![1u8];
        o.extend_from_slice(&(off as u16).to_le_bytes());
        o.push(2); // 4 bytes
        o.extend_from_slice(&v.to_le_bytes());
        o
    };
    let r = |off: u64| {
        let mut o = vec![0u8];
        o.extend_from_slice(&(off as u16).to_le_bytes());
        o.extend_from_slice(&[2, 0, 0, 0, 0]);
        o
    };
    let kick = vec![2u8, 0, 0, 0, 0, 0, 0, 0];
    let setup = |size: u32, features: u32| {
        let mut ops = vec![
            r(MAGIC_VALUE),
            r(VERSION),
            r(DEVICE_ID),
            w(STATUS, 0),
            w(STATUS, 1),
            w(STATUS, 3),
            w(DEVICE_FEATURES_SEL, 1),
            r(DEVICE_FEATURES),
            w(DRIVER_FEATURES_SEL, 0),
            w(DRIVER_FEATURES, features),
            w(DRIVER_FEATURES_SEL, 1),
            w(DRIVER_FEATURES, 1),
            w(STATUS, 11),
            r(STATUS),
        ];
        for q in 0..2u32 {
            let base = 0x4000 * q;
            ops.extend([
                w(QUEUE_SEL, q),
                r(QUEUE_NUM_MAX),
                w(QUEUE_NUM, size),
                w(QUEUE_DESC_LOW, base),
                w(QUEUE_DESC_HIGH, 0),
                w(QUEUE_DRIVER_LOW, base + 0x1000),
                w(QUEUE_DRIVER_HIGH, 0),
                w(QUEUE_DEVICE_LOW, base + 0x2000),
                w(QUEUE_DEVICE_HIGH, 0),
                w(QUEUE_READY, 1),
            ]);
        }
        ops.push(w(STATUS, 15));
        ops
    };
    // Memory: RX desc table at 0 with one writable buffer, TX at 0x4000 with
    // one readable one, both published.
    let mut image = vec![0u8; 0x9000];
    let desc = |img: &mut Vec<u8>, at: usize, addr: u64, len: u32, flags: u16| {
        img[at..at + 8].copy_from_slice(&addr.to_le_bytes());
        img[at + 8..at + 12].copy_from_slice(&len.to_le_bytes());
        img[at + 12..at + 14].copy_from_slice(&flags.to_le_bytes());
    };
    desc(&mut image, 0, 0x8000, 2048, 2);
    desc(&mut image, 0x4000, 0x8800, 80, 0);
    image[0x1002] = 1;
    image[0x5002] = 1;
    let enc = |ops: Vec<Vec<u8>>, image: &[u8]| {
        let mut v = vec![ops.len() as u8];
        for o in ops {
            v.extend(o);
        }
        v.extend_from_slice(image);
        v
    };
    let features = (1 << 5) | (1 << 16);
    let mut seeds = Vec::new();
    let mut ops = setup(16, features);
    ops.push(kick.clone());
    ops.push(r(INTERRUPT_STATUS));
    ops.push(w(INTERRUPT_ACK, 1));
    seeds.push(enc(ops.clone(), &image));
    // Reset after DRIVER_OK and set up again.
    ops.push(w(STATUS, 0));
    ops.extend(setup(8, features));
    ops.push(kick.clone());
    seeds.push(enc(ops, &image));
    // Unoffered features, DRIVER_OK before FEATURES_OK, status dropping bits,
    // queue size not a power of two, rings outside memory, odd accesses.
    let mut bad = setup(16, u32::MAX);
    bad.push(kick.clone());
    seeds.push(enc(bad, &image));
    seeds.push(enc(
        vec![w(STATUS, 1), w(STATUS, 7), w(STATUS, 15), kick.clone()],
        &image,
    ));
    seeds.push(enc(vec![w(STATUS, 15), w(STATUS, 1), r(STATUS)], &image));
    let mut odd = setup(3, features);
    odd.insert(20, w(QUEUE_DESC_LOW, 0xffff_fff0));
    odd.push(kick.clone());
    seeds.push(enc(odd, &image));
    let mut sel = setup(16, features);
    sel.insert(15, w(QUEUE_SEL, 7));
    sel.push(r(QUEUE_NUM_MAX));
    seeds.push(enc(sel, &image));
    // Sub-word and config-space accesses.
    let mut cfg = vec![];
    for (off, size) in [
        (CONFIG, 0u8),
        (CONFIG + 6, 1),
        (CONFIG + 7, 3),
        (0x2, 1),
        (0x1, 0),
    ] {
        let mut o = vec![0u8];
        o.extend_from_slice(&(off as u16).to_le_bytes());
        o.extend_from_slice(&[size, 0, 0, 0, 0]);
        cfg.push(o.clone());
        o[0] = 1;
        cfg.push(o);
    }
    seeds.push(enc(cfg, &[]));
    // A chain loop and an indirect descriptor in the rings.
    let mut img2 = image.clone();
    desc(&mut img2, 0x4000, 0x8800, 80, 1); // NEXT -> itself
    let mut ops = setup(16, features);
    ops.push(kick.clone());
    seeds.push(enc(ops.clone(), &img2));
    let mut img3 = image.clone();
    desc(&mut img3, 0x4000, 0x8800, 16, 4);
    desc(&mut img3, 0, 0x8000, 16, 4);
    seeds.push(enc(ops, &img3));
    seeds
}

/// Fuzz body of the virtio-vsock device (target `vsock`): see
/// `virtio/vsock/fuzz.rs` for the input format and what it checks.
pub fn fuzz_vsock(data: &[u8]) {
    crate::virtio::vsock::fuzz::fuzz_vsock(data)
}

/// The hand-made inputs of the `vsock` corpus.
pub fn vsock_seeds() -> Vec<Vec<u8>> {
    crate::virtio::vsock::fuzz::vsock_seeds()
}
