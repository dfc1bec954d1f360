//! Fuzz bodies of the NIC: what guests (descriptor chains, frames), VMMs
//! (vhost-user messages) and local clients (control requests) can send it.
//! Each `fuzz_*` takes arbitrary bytes and must neither panic nor hang; it
//! is called by the cargo-fuzz targets in `fuzz/` and, on stable, by tests
//! that replay the corpus in `fuzz/corpus/<target>/` (docs/fuzzing.md).
//! The entry points stay small (bytes in, nothing out) so that the
//! dataplane behind them can be rewritten without touching the targets.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vhost::vhost_user::message::VhostUserMemoryRegion;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::control::server::answer;
use crate::control::{parse_request, Request, Response};
use crate::daemon::Nic;
use crate::dataplane::mempool::{Mempool, BUF_SIZE};
use crate::dataplane::switch::{self, PortId, Switch, VfView};
use crate::dataplane::virtio::{fill_guest_rx, take_guest_tx};
use crate::devset::{Devset, LockPolicy};
use crate::memory::VfMemory;
use crate::port::{Port, VfHw, RXQ, TXQ};

fn memfd(name: &str, size: u64) -> File {
    let fd = nix::sys::memfd::memfd_create(
        &std::ffi::CString::new(name).expect("no NUL"),
        nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
    )
    .expect("memfd_create");
    let f = File::from(fd);
    f.set_len(size).expect("memfd size");
    f
}

/// A directory on tmpfs if there is one (state files are fsynced).
fn scratch_dir(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let base = if std::path::Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    base.join(format!(
        "burstvm-fuzz-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

// ---------------------------------------------------------------------------
// (a) Descriptor chains and frames: a VF's split rings in guest memory, the
// switch in between.

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
fn dp_memory() -> &'static Mutex<Option<Arc<VfMemory>>> {
    static MEM: std::sync::OnceLock<Mutex<Option<Arc<VfMemory>>>> = std::sync::OnceLock::new();
    MEM.get_or_init(|| {
        let f = memfd("burstvm-fuzz-vf", DP_MEM as u64);
        let region = VhostUserMemoryRegion::new(0, DP_MEM as u64, 0x7000_0000_0000, 0);
        Mutex::new(Some(Arc::new(
            VfMemory::map("fuzz", &[region], vec![f], &[]).expect("map the fuzz VF memory"),
        )))
    })
}

fn vf_port(i: usize, wake: &Arc<EventFd>) -> Port {
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

// ---------------------------------------------------------------------------
// (c) vhost-user messages from a frontend (the VMM) to a VF's session.

/// Requests that carry file descriptors; the harness attaches real ones so
/// that the handlers behind them run (memfd for memory, eventfd otherwise).
fn fds_for(request: u32, body: &[u8]) -> usize {
    match request {
        5 => body
            .get(..4)
            .map_or(0, |n| u32::from_le_bytes(n.try_into().unwrap()) as usize)
            .min(8), // SET_MEM_TABLE: one per region
        6 | 7 | 12 | 13 | 14 | 21 | 32 | 37 | 42 => 1,
        _ => 0,
    }
}

/// A VF's vhost-user session fed `data` as the frontend's byte stream
/// (messages split at their headers' sizes, with descriptors attached to
/// the messages that take them), then the end of the connection. The VF
/// must end up closed with its memory unmapped and the devset consistent.
pub fn fuzz_vhost_user(data: &[u8]) {
    let wake = Arc::new(EventFd::new(EFD_NONBLOCK).expect("eventfd"));
    let ports: Vec<Arc<Port>> = (0..2).map(|i| Arc::new(vf_port(i, &wake))).collect();
    let devset = Arc::new(Devset::new("pf0", 2, LockPolicy::Hierarchical, |i| VfHw {
        port: ports[i].clone(),
    }));
    devset.assign(0, "fz").expect("a free VF");
    let (frontend, backend) = UnixStream::pair().expect("socketpair");
    let mem = memfd("burstvm-fuzz-vu", 1 << 20);
    let evt = EventFd::new(EFD_NONBLOCK).expect("eventfd");

    let server = {
        let (d, p) = (devset.clone(), ports[0].clone());
        std::thread::spawn(move || {
            crate::session::serve(
                d,
                p,
                Arc::from(Vec::new()),
                0,
                backend,
                &crate::session::NET,
            )
        })
    };
    // Replies are read (and dropped) as they come, so the backend never
    // blocks on a full socket.
    let reader = {
        let mut r = frontend.try_clone().expect("dup");
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while matches!(std::io::Read::read(&mut r, &mut buf), Ok(n) if n > 0) {}
        })
    };
    let mut off = 0;
    let mut sent = 0;
    while off < data.len() && sent < 256 {
        let hdr = &data[off..(off + 12).min(data.len())];
        let (req, size) = if hdr.len() == 12 {
            (
                u32::from_le_bytes(hdr[0..4].try_into().unwrap()),
                u32::from_le_bytes(hdr[8..12].try_into().unwrap()) as usize,
            )
        } else {
            (0, 0)
        };
        let end = (off + 12).saturating_add(size).min(data.len());
        let msg = &data[off..end];
        let nfds = fds_for(req, msg.get(12..).unwrap_or_default());
        let fds: Vec<i32> = (0..nfds)
            .map(|_| {
                if req == 5 || req == 37 {
                    mem.as_raw_fd()
                } else {
                    evt.as_raw_fd()
                }
            })
            .collect();
        let cmsg = [nix::sys::socket::ControlMessage::ScmRights(&fds)];
        let iov = [std::io::IoSlice::new(msg)];
        let r = nix::sys::socket::sendmsg::<()>(
            frontend.as_raw_fd(),
            &iov,
            if fds.is_empty() { &[] } else { &cmsg },
            nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
            None,
        );
        if r.is_err() {
            break; // the backend ended the session
        }
        off = end;
        sent += 1;
    }
    let _ = frontend.shutdown(std::net::Shutdown::Write);
    server.join().expect("the session thread panicked");
    let _ = frontend.shutdown(std::net::Shutdown::Both);
    reader.join().expect("reader");
    devset.check_invariants().expect("devset invariants");
    let rt = ports[0].runtime();
    assert!(
        rt.mem.is_none(),
        "memory still mapped after the session ended"
    );
    assert_eq!(devset.open_count(), 0);
}

/// vhost-user message seeds: a frontend's normal set-up and broken ones.
pub fn vhost_user_seeds() -> Vec<Vec<u8>> {
    fn msg(req: u32, body: &[u8]) -> Vec<u8> {
        let mut m = req.to_le_bytes().to_vec();
        m.extend_from_slice(&1u32.to_le_bytes()); // version 1
        m.extend_from_slice(&(body.len() as u32).to_le_bytes());
        m.extend_from_slice(body);
        m
    }
    let u64b = |v: u64| v.to_le_bytes().to_vec();
    let state = |i: u32, n: u32| [i.to_le_bytes(), n.to_le_bytes()].concat();
    let mem_table = |size: u64, offset: u64| {
        let mut b = 1u32.to_le_bytes().to_vec();
        b.extend_from_slice(&0u32.to_le_bytes());
        for v in [0u64, size, 0x7f00_0000_0000, offset] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    };
    let vring_addr = |i: u32, d: u64, u: u64, a: u64| {
        let mut b = i.to_le_bytes().to_vec();
        b.extend_from_slice(&0u32.to_le_bytes());
        for v in [d, u, a, 0u64] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    };
    let features = (1u64 << 32) | (1 << 5) | (1 << 16) | (1 << 30);
    let setup = || {
        let mut s = Vec::new();
        s.extend(msg(3, &[])); // SET_OWNER
        s.extend(msg(1, &[])); // GET_FEATURES
        s.extend(msg(2, &u64b(features))); // SET_FEATURES
        s.extend(msg(15, &[])); // GET_PROTOCOL_FEATURES
        s.extend(msg(16, &u64b(1 << 9))); // SET_PROTOCOL_FEATURES (CONFIG)
        s.extend(msg(5, &mem_table(1 << 20, 0))); // SET_MEM_TABLE
        for q in 0..2u32 {
            let base = 0x7f00_0000_0000 + q as u64 * 0x4000;
            s.extend(msg(8, &state(q, 256))); // SET_VRING_NUM
            s.extend(msg(9, &vring_addr(q, base, base + 0x2000, base + 0x1000)));
            s.extend(msg(10, &state(q, 0))); // SET_VRING_BASE
            s.extend(msg(13, &u64b(q as u64))); // SET_VRING_CALL
            s.extend(msg(12, &u64b(q as u64))); // SET_VRING_KICK
            s.extend(msg(18, &state(q, 1))); // SET_VRING_ENABLE
        }
        s
    };
    let mut seeds = vec![setup()];
    let mut s = setup();
    s.extend(msg(24, &[0, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0])); // GET_CONFIG mac
    s.extend(msg(11, &state(0, 0))); // GET_VRING_BASE
    seeds.push(s);
    for bad in [
        msg(2, &u64b(u64::MAX)),                           // unoffered features
        msg(5, &mem_table(1 << 40, 0)),                    // region beyond the file
        msg(5, &mem_table(4096, 123)),                     // unaligned offset
        msg(5, &[8, 0, 0, 0]),                             // 8 regions, no bodies
        msg(8, &state(7, 256)),                            // queue index out of range
        msg(8, &state(0, 1000)),                           // size not a power of two
        msg(9, &vring_addr(0, 1, 2, 3)),                   // before SET_MEM_TABLE
        msg(12, &u64b(1 << 8)),                            // polling mode
        msg(24, &[0, 0, 0, 0, 0xff, 0, 0, 0, 0, 0, 0, 0]), // config too long
        msg(25, &[0; 16]),                                 // SET_CONFIG
        msg(999, &[]),                                     // unknown request
        msg(1, &[0; 3]),                                   // body on GET_FEATURES
        vec![1, 0, 0, 0, 1],                               // partial header
        [
            1u32.to_le_bytes(),
            1u32.to_le_bytes(),
            0x1000_0000u32.to_le_bytes(),
        ]
        .concat(), // huge size
    ] {
        let mut s = setup();
        s.extend(bad.clone());
        seeds.push(s);
        seeds.push(bad);
    }
    // Rings outside the table, then set-up messages after a failed one.
    let mut s = Vec::new();
    s.extend(msg(2, &u64b(features)));
    s.extend(msg(5, &mem_table(1 << 20, 0)));
    s.extend(msg(9, &vring_addr(0, 0x1000, 0x2000, 0x3000)));
    s.extend(msg(12, &u64b(0)));
    seeds.push(s);
    seeds
}

// ---------------------------------------------------------------------------
// (d) Control requests from local clients.

/// Request lines, each answered by a fresh daemon state (two PFs, four VFs),
/// exactly as the control server answers them. Every answer serializes and
/// parses back; every accepted request round-trips and is valid; the devset
/// invariants hold after each request.
pub fn fuzz_control_request(data: &[u8]) {
    let dir = scratch_dir("ctl");
    if std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    let nic = Nic::new(
        &[("pf0".into(), 3), ("pf1".into(), 1)],
        LockPolicy::Hierarchical,
        &dir,
        dir.join("nic-state.json"),
        // SG functions too, so `alloc` of kind sg is fuzzed beside VFs.
        &crate::sg::SgConfig {
            sgfs: 1,
            ..Default::default()
        },
    )
    .expect("a fresh daemon state");
    let mut handle = |r: Request| nic.handle(r);
    for line in data.split(|&b| b == b'\n').take(64) {
        if let Some(resp) = answer(line, &mut handle) {
            assert!(resp.ok != resp.code.is_some(), "{resp:?}");
            let text = serde_json::to_string(&resp).expect("responses serialize");
            assert!(!text.contains('\n'), "a response spans lines: {text}");
            let back: Response = serde_json::from_str(&text).expect("responses parse");
            assert_eq!(back, resp);
        }
        if let Ok(req) = parse_request(line.trim_ascii()) {
            req.validate().expect("parse_request validates");
            let again = serde_json::to_vec(&req).expect("requests serialize");
            assert_eq!(parse_request(&again).ok(), Some(req));
        }
        for pf in &nic.pfs {
            pf.devset.check_invariants().expect("devset invariants");
            for (_, sb) in pf.devset.snapshot() {
                if let Some(id) = sb {
                    assert_eq!(crate::control::sandbox_id_problem(&id), None);
                }
            }
        }
    }
    drop(nic);
    let _ = std::fs::remove_dir_all(&dir);
}

pub fn control_seeds() -> Vec<Vec<u8>> {
    let lines: &[&[u8]] = &[
        br#"{"op":"list"}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"a"}"#,
        b"{\"op\":\"alloc\",\"pf\":\"pf0\",\"sandbox\":\"a\"}\n{\"op\":\"alloc\",\"pf\":\"pf0\",\"sandbox\":\"a\"}\n{\"op\":\"get\",\"sandbox\":\"a\"}\n{\"op\":\"release\",\"sandbox\":\"a\"}\n{\"op\":\"list\"}",
        br#"{"op":"alloc","pf":"pf0","sandbox":"b","mac":"02:11:22:33:44:55","vlan":12}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"b","mac":"01:11:22:33:44:55"}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"b","vlan":4095}"#,
        br#"{"op":"alloc","pf":"pf9","sandbox":"b"}"#,
        br#"{"op":"get","vf":"0000:b1:00.1"}"#,
        br#"{"op":"get","vf":"0000:b2:00.0","sandbox":"x"}"#,
        br#"{"op":"get"}"#,
        br#"{"op":"release","sandbox":"nobody"}"#,
        br#"{"op":"list","extra":1}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"a\u0000b"}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"a/b"}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"a\nb"}"#,
        b"{\"op\":\"alloc\",\"pf\":\"pf0\",\"sandbox\":\"\xff\"}",
        b"{\"op\":\"list\"}\r\n\r\n   \n{",
        br#"{"op":"explode"}"#,
        br#"[1,2,3]"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"s1"}
{"op":"alloc","pf":"pf0","sandbox":"s2"}
{"op":"alloc","pf":"pf0","sandbox":"s3"}
{"op":"alloc","pf":"pf0","sandbox":"s4"}
{"op":"alloc","pf":"pf1","sandbox":"s4","mac":"02:00:00:00:00:09"}
{"op":"release","sandbox":"s2"}
{"op":"alloc","pf":"pf0","sandbox":"s5","mac":"02:42:bf:00:00:00"}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"sss","mac":"02:42:bf:00:00:00"}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"\u00e4\u00f6\u00fc"}"#,
        br#"{"op":"alloc","pf":"","sandbox":"x"}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"x","vlan":-1}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"x","vlan":1e3}"#,
        br#"{"op":"alloc","pf":"pf0","sandbox":"x","mac":null}"#,
        br#"{"op":"release"}"#,
        br#"{"op":"release","sandbox":1}"#,
        br#"{"sandbox":"x"}"#,
        br#"{"op":"list","op":"get"}"#,
    ];
    lines.iter().map(|l| l.to_vec()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn used_idx(q: usize, seed: &[u8]) -> u16 {
        let d = DpInput::decode(seed);
        let g = dp_memory().lock().unwrap();
        let mem = g.as_ref().unwrap();
        mem.gm
            .read_obj::<u16>(GuestAddress(d.rings[q][2] as u64 + 2))
            .unwrap()
    }

    /// The harness is not vacuous: the hand-made chains really move frames.
    #[test]
    fn dataplane_seeds_move_frames_and_faults_stop_them() {
        let seeds = dataplane_seeds();
        let _serial = dp_memory(); // one memory for all: run these in order
        fuzz_dataplane(&seeds[0]);
        assert_eq!(used_idx(TXQ, &seeds[0]), 1, "one frame sent");
        fuzz_dataplane(&seeds[1]);
        assert_eq!(
            used_idx(TXQ, &seeds[1]),
            1,
            "one three-descriptor frame sent"
        );
        fuzz_dataplane(&seeds[3]);
        assert_eq!(used_idx(TXQ, &seeds[3]), 2, "batch of 2 of 5 chains");
        // Indirect: refused without the feature (no used entry), used with it.
        let indirect = seeds.len() - 11;
        fuzz_dataplane(&seeds[indirect]);
        assert_eq!(used_idx(TXQ, &seeds[indirect]), 0);
        fuzz_dataplane(&seeds[indirect + 1]);
        assert_eq!(used_idx(TXQ, &seeds[indirect + 1]), 1);
        // Receive: three uplink frames, two posted buffers.
        let rx = indirect + 3;
        fuzz_dataplane(&seeds[rx]);
        assert_eq!(used_idx(RXQ, &seeds[rx]), 2);
        let g = dp_memory().lock().unwrap();
        let mut mac = [0u8; 6];
        g.as_ref()
            .unwrap()
            .gm
            .read_slice(&mut mac, GuestAddress(0x9000 + 12))
            .unwrap();
        assert_eq!(mac, VF0_MAC, "frame written after the header");
    }
}
