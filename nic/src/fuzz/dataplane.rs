//! Fuzz body (a): descriptor chains and frames. A VF's split rings in guest
//! memory as the input left them, one dataplane round over them with the
//! switch in between; the hand-made seeds (`dataplane_seeds`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use vhost::vhost_user::message::VhostUserMemoryRegion;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::memfd;
use crate::dataplane::mempool::{Mempool, BUF_SIZE};
use crate::dataplane::switch::{self, PortId, Switch, VfView};
use crate::dataplane::virtio::{fill_guest_rx, take_guest_tx};
use crate::memory::VfMemory;
use crate::port::{Port, RXQ, TXQ};

/// Guest memory of the dataplane target, at GPA 0.
pub const DP_MEM: usize = 64 << 10;
/// Bytes of the dataplane input before the guest memory image.
pub const DP_HDR: usize = 24;
/// Where in the image the uplink frames start (frame k at +128 k).
pub const UPLINK_FRAMES: usize = 0xc000;
/// VF 0's MAC (the VF whose rings are fuzzed); VF i has `..:0i+1`.
pub const VF0_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];

/// The dataplane input, decoded: ring geometry and negotiated features
/// from the header, then the guest memory image.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DpInput {
    /// bit 0 EVENT_IDX, bit 1 10-byte header (legacy), bit 2
    /// VIRTIO_F_INDIRECT_DESC negotiated, bit 3 the VF is in VLAN 12.
    pub flags: u8,
    /// Frames per queue per round, minus one (mod 64).
    pub batch: u8,
    /// log2 of the queue sizes (mod 9), receive then transmit.
    pub log2: [u8; 2],
    /// Descriptor table, avail ring, used ring, per queue (byte offsets).
    pub rings: [[u16; 3]; 2],
    pub next_avail: [u16; 2],
    /// Frames coming from the uplink, switched and queued for the guest (mod 8).
    pub frames: u8,
    pub frame_len: u8,
    /// Bit i set: VF i+1 is not open (assigned, no VMM, or its VMM died).
    pub closed: u8,
    pub image: Vec<u8>,
}

impl DpInput {
    pub fn decode(data: &[u8]) -> DpInput {
        let mut h = [0u8; DP_HDR];
        let n = data.len().min(DP_HDR);
        h[..n].copy_from_slice(&data[..n]);
        let u16_at = |i: usize| u16::from_le_bytes([h[i], h[i + 1]]);
        DpInput {
            flags: h[0],
            batch: h[1],
            log2: [h[2], h[3]],
            rings: [
                [u16_at(4), u16_at(6), u16_at(8)],
                [u16_at(10), u16_at(12), u16_at(14)],
            ],
            next_avail: [u16_at(16), u16_at(18)],
            frames: h[20],
            frame_len: h[21],
            closed: h[22],
            image: data.get(DP_HDR..).unwrap_or_default().to_vec(),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![self.flags, self.batch, self.log2[0], self.log2[1]];
        for q in self.rings {
            for a in q {
                v.extend_from_slice(&a.to_le_bytes());
            }
        }
        for a in self.next_avail {
            v.extend_from_slice(&a.to_le_bytes());
        }
        v.extend_from_slice(&[self.frames, self.frame_len, self.closed, 0]);
        v.extend_from_slice(&self.image);
        v
    }

    fn image_mut(&mut self, end: usize) -> &mut [u8] {
        if self.image.len() < end {
            self.image.resize(end, 0);
        }
        &mut self.image
    }

    /// Writes descriptor `i` of queue `q`'s table.
    pub fn desc(&mut self, q: usize, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = self.rings[q][0] as usize + 16 * i as usize;
        let m = self.image_mut(at + 16);
        m[at..at + 8].copy_from_slice(&addr.to_le_bytes());
        m[at + 8..at + 12].copy_from_slice(&len.to_le_bytes());
        m[at + 12..at + 14].copy_from_slice(&flags.to_le_bytes());
        m[at + 14..at + 16].copy_from_slice(&next.to_le_bytes());
    }

    /// Publishes `heads` in queue `q`'s avail ring (idx = their number).
    pub fn avail(&mut self, q: usize, heads: &[u16]) {
        let at = self.rings[q][1] as usize;
        let m = self.image_mut(at + 4 + 2 * heads.len());
        m[at + 2..at + 4].copy_from_slice(&(heads.len() as u16).to_le_bytes());
        for (k, h) in heads.iter().enumerate() {
            m[at + 4 + 2 * k..at + 6 + 2 * k].copy_from_slice(&h.to_le_bytes());
        }
    }

    pub fn bytes(&mut self, at: usize, data: &[u8]) {
        let m = self.image_mut(at + data.len());
        m[at..at + data.len()].copy_from_slice(data);
    }
}

/// One guest VF's memory, mapped as the NIC maps a VMM's (`VfMemory::map`),
/// kept across inputs: mapping and locking it each time would dominate.
pub(super) fn dp_memory() -> &'static Mutex<Option<Arc<VfMemory>>> {
    static MEM: std::sync::OnceLock<Mutex<Option<Arc<VfMemory>>>> = std::sync::OnceLock::new();
    MEM.get_or_init(|| {
        let f = memfd("burstvm-fuzz-vf", DP_MEM as u64);
        let region = VhostUserMemoryRegion::new(0, DP_MEM as u64, 0x7000_0000_0000, 0);
        Mutex::new(Some(Arc::new(
            VfMemory::map("fuzz", &[region], vec![f], &[]).expect("map the fuzz VF memory"),
        )))
    })
}

pub(super) fn vf_port(i: usize, wake: &Arc<EventFd>) -> Port {
    let mut mac = VF0_MAC;
    mac[5] = i as u8 + 1;
    Port::new(
        "pf0",
        i,
        format!("fz{i}"),
        PathBuf::new(),
        mac,
        wake.clone(),
    )
}

/// A VF's two rings as the guest left them, one dataplane round over them:
/// its transmit queue into the switch (spoof check, VLAN, learning), uplink
/// frames switched and written into its receive queue.
pub fn fuzz_dataplane(data: &[u8]) {
    let input = DpInput::decode(data);
    let mut slot = dp_memory().lock().unwrap_or_else(|e| e.into_inner());
    let Some(mem) = slot.take() else { return };
    let mut image = input.image.clone();
    image.resize(DP_MEM, 0);
    mem.gm
        .write_slice(&image, GuestAddress(0))
        .expect("the image fits the memory");

    let wake = Arc::new(EventFd::new(EFD_NONBLOCK).expect("eventfd"));
    let port = vf_port(0, &wake);
    let vlan = (input.flags & 8 != 0).then_some(12);
    let mut rt = port.runtime();
    rt.active = true;
    rt.hdr_len = if input.flags & 2 != 0 { 10 } else { 12 };
    rt.features = (1 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1)
        | if input.flags & 4 != 0 {
            1 << virtq::VIRTIO_F_INDIRECT_DESC
        } else {
            0
        };
    for q in [RXQ, TXQ] {
        let vr = &mut rt.vrings[q];
        let [d, a, u] = input.rings[q].map(u64::from);
        vr.queue.set_size(1 << (input.log2[q] % 9));
        vr.queue.set_desc_table_address(Some(d as u32), Some(0));
        vr.queue.set_avail_ring_address(Some(a as u32), Some(0));
        vr.queue.set_used_ring_address(Some(u as u32), Some(0));
        vr.queue.set_event_idx(input.flags & 1 != 0);
        vr.queue.set_next_avail(input.next_avail[q]);
        vr.queue.set_ready(true);
        // As SET_VRING_KICK: only rings that lie in the memory table run.
        if !vr.queue.is_valid(&mem.gm) {
            vr.queue.set_ready(false);
        }
        vr.kick = Some(Arc::new(EventFd::new(EFD_NONBLOCK).expect("eventfd")));
        vr.enabled = true;
    }
    rt.mem = Some(mem);

    let batch = 1 + input.batch as usize % 64;
    let mut pool = Mempool::new(64);
    let total = pool.available();
    let mut sw = Switch::new(4);
    for i in 0..4 {
        let mut mac = VF0_MAC;
        mac[5] = i as u8 + 1;
        let v = if i == 0 { vlan } else { None };
        sw.set_vf(
            i,
            VfView {
                mac,
                vlan: v,
                active: i == 0 || input.closed & (1 << (i - 1)) == 0,
            },
        );
    }

    // Guest → NIC → switch.
    let mut scratch = crate::dataplane::virtio::Scratch::default();
    let mut pkts = Vec::new();
    let mut backlog = std::collections::VecDeque::new();
    let mut out = Vec::new();
    if let Ok(n) = take_guest_tx(&port, &mut rt, &mut pool, &mut scratch, batch, &mut pkts) {
        assert!(n <= batch && pkts.len() <= n, "{n} chains, batch {batch}");
    }
    for p in pkts.drain(..) {
        let len = p.data().len();
        assert!((14..=BUF_SIZE).contains(&len), "frame of {len} bytes");
        let unicast = p.data()[0] & 1 == 0;
        sw.route(PortId::Vf(0), vlan, p.data(), &mut out);
        assert!(!out.contains(&PortId::Vf(0)), "a frame went back to its VF");
        assert!(!unicast || out.len() <= 1, "unicast flooded: {out:?}");
        pool.free(p);
    }
    // Uplink → switch → the VF's receive queue.
    for k in 0..(input.frames % 8) as usize {
        let Some(mut p) = pool.alloc() else { break };
        let start = UPLINK_FRAMES + k * 128;
        let len = 14 + (input.frame_len as usize + 37 * k) % (BUF_SIZE - 32);
        p.buf_mut()[..len].copy_from_slice(&image[start..start + len]);
        let (vid, len) = switch::untag(p.buf_mut(), len);
        p.len = len;
        if len >= 14 && p.data()[0] & 1 == 0 {
            sw.route(PortId::Uplink, vid, p.data(), &mut out);
            assert!(out.len() <= 1, "unicast from the uplink flooded: {out:?}");
        }
        if len >= 14
            && sw.route(PortId::Uplink, vid, p.data(), &mut out)
            && out.contains(&PortId::Vf(0))
        {
            backlog.push_back(p);
            continue;
        }
        pool.free(p);
    }
    let _ = fill_guest_rx(&port, &mut rt, &mut pool, &mut scratch, batch, &mut backlog);
    for p in backlog.drain(..) {
        pool.free(p);
    }
    assert_eq!(pool.available(), total, "packet buffers leaked");
    *slot = rt.mem.take();
}

/// Hand-made dataplane inputs: valid and malformed chains of every kind.
pub fn dataplane_seeds() -> Vec<Vec<u8>> {
    let base = |log2: u8| {
        let mut d = DpInput {
            batch: 31,
            log2: [log2, log2],
            rings: [[0x0000, 0x1000, 0x2000], [0x3000, 0x4000, 0x5000]],
            ..DpInput::default()
        };
        d.bytes(0x6000, &[0]);
        d
    };
    let frame = |src: [u8; 6], dst: [u8; 6], len: usize| {
        let mut f = vec![0u8; 12];
        f.extend_from_slice(&dst);
        f.extend_from_slice(&src);
        f.extend_from_slice(&[0x88, 0xb5]);
        f.resize(12 + len, 0x5a);
        f
    };
    const NEXT: u16 = 1;
    const WRITE: u16 = 2;
    const INDIRECT: u16 = 4;
    let bcast = [0xff; 6];
    let mut seeds = Vec::new();

    // One frame in one descriptor, broadcast.
    let mut d = base(4);
    d.bytes(0x8000, &frame(VF0_MAC, bcast, 60));
    d.desc(TXQ, 0, 0x8000, 72, 0, 0);
    d.avail(TXQ, &[0]);
    seeds.push(d.clone());
    // The same frame split over three descriptors, unicast to VF 2.
    let mut d = base(4);
    let f = frame(VF0_MAC, [2, 0, 0, 0, 0, 3], 100);
    d.bytes(0x8000, &f[..5]);
    d.bytes(0x8100, &f[5..40]);
    d.bytes(0x8200, &f[40..]);
    d.desc(TXQ, 0, 0x8000, 5, NEXT, 1);
    d.desc(TXQ, 1, 0x8100, 35, NEXT, 2);
    d.desc(TXQ, 2, 0x8200, (f.len() - 40) as u32, 0, 0);
    d.avail(TXQ, &[0]);
    seeds.push(d.clone());
    // Spoofed source MAC.
    let mut d = base(4);
    d.bytes(0x8000, &frame([2, 9, 9, 9, 9, 9], bcast, 60));
    d.desc(TXQ, 0, 0x8000, 72, 0, 0);
    d.avail(TXQ, &[0]);
    seeds.push(d.clone());
    // Several chains, batch 2, VLAN, event idx.
    let mut d = base(5);
    d.flags = 1 | 8;
    d.batch = 1;
    for i in 0..5u16 {
        d.bytes(
            0x8000 + 0x100 * i as usize,
            &frame(VF0_MAC, bcast, 50 + i as usize),
        );
        d.desc(TXQ, i, 0x8000 + 0x100 * i as u64, 62 + i as u32, 0, 0);
    }
    d.avail(TXQ, &[0, 1, 2, 3, 4]);
    seeds.push(d.clone());
    // Malformed transmit chains: writable buffer, outside memory, overflowing
    // address, loop, next out of range, too short, too long, empty avail slot.
    for (addr, len, flags, next) in [
        (0x8000u64, 72u32, WRITE, 0u16),
        (DP_MEM as u64 + 0x1000, 72, 0, 0),
        (u64::MAX - 16, 72, 0, 0),
        (0x8000, 72, NEXT, 0),
        (0x8000, 72, NEXT, 300),
        (0x8000, 4, 0, 0),
        (0x8000, 0xffff_ffff, 0, 0),
        (0x8000, 0, 0, 0),
    ] {
        let mut d = base(4);
        d.bytes(0x8000, &frame(VF0_MAC, bcast, 60));
        d.desc(TXQ, 0, addr, len, flags, next);
        d.avail(TXQ, &[0]);
        seeds.push(d.clone());
    }
    // A head index beyond the queue, and next_avail far ahead.
    let mut d = base(4);
    d.avail(TXQ, &[40]);
    seeds.push(d.clone());
    let mut d = base(4);
    d.avail(TXQ, &[0]);
    d.next_avail = [0, 0x8000];
    seeds.push(d.clone());
    // Indirect table: refused without the feature, followed with it; nested.
    for (flags, inner) in [(0u8, 0u16), (4, 0), (4, INDIRECT)] {
        let mut d = base(4);
        d.flags = flags;
        d.bytes(0x8100, &frame(VF0_MAC, bcast, 60));
        let mut t = Vec::new();
        t.extend_from_slice(&0x8100u64.to_le_bytes());
        t.extend_from_slice(&72u32.to_le_bytes());
        t.extend_from_slice(&inner.to_le_bytes());
        t.extend_from_slice(&0u16.to_le_bytes());
        d.bytes(0x8000, &t);
        d.desc(TXQ, 0, 0x8000, 16, INDIRECT, 0);
        d.avail(TXQ, &[0]);
        seeds.push(d.clone());
    }
    // Receive side: uplink frames into posted buffers (fits, too small,
    // read-only buffer, split over two buffers, legacy header).
    for (len, flags, two, hdr10) in [
        (2048u32, WRITE, false, false),
        (20, WRITE, false, false),
        (2048, 0, false, false),
        (40, WRITE, true, false),
        (2048, WRITE, false, true),
    ] {
        let mut d = base(4);
        d.frames = 3;
        d.frame_len = 50;
        if hdr10 {
            d.flags |= 2;
        }
        // Uplink frames for VF 0.
        for k in 0..3 {
            let mut f = frame([2, 7, 7, 7, 7, 7], VF0_MAC, 60);
            f.drain(..12);
            d.bytes(UPLINK_FRAMES + k * 128, &f);
        }
        if two {
            d.desc(RXQ, 0, 0x9000, len, flags | NEXT, 1);
            d.desc(RXQ, 1, 0xa000, 2048, flags, 0);
        } else {
            d.desc(RXQ, 0, 0x9000, len, flags, 0);
        }
        d.desc(RXQ, 2, 0xb000, 2048, WRITE, 0);
        d.avail(RXQ, &[0, 2]);
        seeds.push(d.clone());
    }
    // Regression (found by `bench chaos`): unicast from the uplink and from
    // VF 0 to VF 2 while VF 2 is not open was flooded to every other VF.
    let mut d = base(4);
    d.closed = 2;
    d.frames = 1;
    d.frame_len = 50;
    let mut f = frame([2, 7, 7, 7, 7, 7], [2, 0, 0, 0, 0, 3], 60);
    f.drain(..12);
    d.bytes(UPLINK_FRAMES, &f);
    d.bytes(0x8000, &frame(VF0_MAC, [2, 0, 0, 0, 0, 3], 60));
    d.desc(TXQ, 0, 0x8000, 72, 0, 0);
    d.avail(TXQ, &[0]);
    d.desc(RXQ, 0, 0x9000, 2048, WRITE, 0);
    d.avail(RXQ, &[0]);
    seeds.push(d.clone());
    // Rings overlapping each other and the frames; rings not in memory.
    let mut d = base(8);
    d.rings = [[0, 0, 0], [16, 16, 16]];
    d.avail(TXQ, &[0, 1, 2]);
    seeds.push(d.clone());
    let mut d = base(4);
    d.rings = [[0xfff0, 0xfffe, 0xfffc], [0xffff, 1, 3]];
    seeds.push(d.clone());
    seeds.iter().map(DpInput::encode).collect()
}
