//! A minimal vhost-user frontend that drives one device like a guest driver
//! would: memfd-backed "guest" memory, split virtqueues written by hand
//! ([`VuFrontend`], two queues). [`SimFrontend`] drives a VF with it; the SG
//! frontend (`sg::frontend`) an SG function. Used by `bench devset`, `bench
//! sgiov` (real vhost-user sessions) and by the daemon tests; it is not the
//! VMM's frontend (vmm/src/virtio/).

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{fence, Ordering};

use vhost::vhost_user::message::{VhostUserHeaderFlag, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

mod memory;
mod sim;

pub use memory::FrontendMemory;
pub use sim::SimFrontend;

/// Queue size of both rings.
pub const QSIZE: u16 = 256;
/// The virtio-net header the NIC puts before each received frame.
pub const HDR_LEN: usize = 12;
/// Bytes of each buffer the frontends post.
pub const BUF: u64 = 2048;
/// Per queue: descriptor table, avail ring at +0x1000, used ring at +0x2000.
pub const RING_AREA: u64 = 0x10000;
pub const BUFFERS: u64 = 2 * RING_AREA; // then QSIZE rx buffers, QSIZE tx buffers
/// Smallest memory a frontend needs.
pub const MIN_MEM: usize = (BUFFERS + 2 * QSIZE as u64 * BUF) as usize;

#[derive(Debug, thiserror::Error)]
pub enum FrontendError {
    #[error("test frontend on {socket}: {what}: {source}")]
    Io {
        socket: String,
        what: &'static str,
        source: io::Error,
    },
    #[error("test frontend on {socket}: {what}: {source}")]
    Vhost {
        socket: String,
        what: &'static str,
        source: vhost::Error,
    },
    #[error("test frontend: memory size {0} below the minimum {MIN_MEM}")]
    Size(usize),
}

/// One vhost-user session with two split virtqueues in its own memory: queue
/// q's descriptor table at `q * RING_AREA`, avail ring at +0x1000, used ring
/// at +0x2000; everything from [`BUFFERS`] on is the user's.
pub struct VuFrontend {
    socket: String,
    fe: Frontend,
    mem: FrontendMemory,
    kick: [EventFd; 2],
    call: [EventFd; 2],
    avail: [u16; 2],
    /// Signal-only vrings 2 + k (an SG function's `dedicated` channels):
    /// (kick, call) each.
    chans: Vec<(EventFd, EventFd)>,
}

// vhost's Frontend has no Debug: the socket names the connection.
impl std::fmt::Debug for VuFrontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VuFrontend")
            .field("socket", &self.socket)
            .field("mem", &self.mem)
            .field("avail", &self.avail)
            .field("chans", &self.chans.len())
            .finish_non_exhaustive()
    }
}

impl VuFrontend {
    /// Connects and sets both vrings up; posts no buffers.
    pub fn connect_mem(socket: &Path, mem: FrontendMemory) -> Result<Self, FrontendError> {
        Self::connect_channels(socket, mem, 0)
    }

    /// [`VuFrontend::connect_mem`] plus `channels` signal-only vrings (2..2+n:
    /// kick and call eventfds, enabled, no virtqueue).
    pub fn connect_channels(
        socket: &Path,
        mem: FrontendMemory,
        channels: usize,
    ) -> Result<Self, FrontendError> {
        let sock = socket.display().to_string();
        let io = |what: &'static str| {
            let s = sock.clone();
            move |source| FrontendError::Io {
                socket: s,
                what,
                source,
            }
        };
        let vu = |what: &'static str| {
            let s = sock.clone();
            move |source| FrontendError::Vhost {
                socket: s,
                what,
                source,
            }
        };
        let mk = || EventFd::new(EFD_NONBLOCK).map_err(io("eventfd"));
        let (kick, call) = ([mk()?, mk()?], [mk()?, mk()?]);
        let chans = (0..channels)
            .map(|_| Ok((mk()?, mk()?)))
            .collect::<Result<Vec<_>, FrontendError>>()?;
        let fe = Frontend::connect(socket, 2 + channels as u64).map_err(vu("connect"))?;
        let mut me = VuFrontend {
            socket: sock.clone(),
            fe,
            mem,
            kick,
            call,
            avail: [0; 2],
            chans,
        };
        me.setup().map_err(vu("session set-up"))?;
        for (k, (kick, call)) in me.chans.iter().enumerate() {
            let q = 2 + k;
            (|| {
                me.fe.set_vring_call(q, call)?;
                me.fe.set_vring_kick(q, kick)?;
                me.fe.set_vring_enable(q, true)
            })()
            .map_err(vu("channel set-up"))?;
        }
        Ok(me)
    }

    fn setup(&mut self) -> Result<(), vhost::Error> {
        self.fe.set_owner()?;
        let features = self.fe.get_features()?;
        let want = (1u64 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1)
            | vhost::vhost_user::message::VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        self.fe.set_features(features & want)?;
        let proto = self.fe.get_protocol_features()?;
        let proto =
            proto & (VhostUserProtocolFeatures::REPLY_ACK | VhostUserProtocolFeatures::CONFIG);
        self.fe.set_protocol_features(proto)?;
        // Every later message waits for the backend's ack (as Cloud Hypervisor's
        // frontend does): set-up returns once the VF is up, so a frame sent
        // right after it is not raced against the session's own work.
        if proto.contains(VhostUserProtocolFeatures::REPLY_ACK) {
            self.fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        }
        self.set_up_memory()
    }

    /// Memory table and both vrings (fresh, index 0) in `self.mem`.
    fn set_up_memory(&mut self) -> Result<(), vhost::Error> {
        let memfd = self.mem.memfd.as_raw_fd();
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: self.mem.size as u64,
            userspace_addr: self.mem.base as u64,
            mmap_offset: 0,
            mmap_handle: memfd,
        };
        self.fe.set_mem_table(&[region])?;
        for q in 0..2usize {
            let area = self.mem.base as u64 + q as u64 * RING_AREA;
            self.fe.set_vring_num(q, QSIZE)?;
            self.fe.set_vring_addr(q, &rings_at(area))?;
            self.fe.set_vring_base(q, 0)?;
            self.fe.set_vring_call(q, &self.call[q])?;
            self.fe.set_vring_kick(q, &self.kick[q])?;
            self.fe.set_vring_enable(q, true)?;
        }
        Ok(())
    }

    /// Moves the session to `mem`, as a VMM whose memory layout changed:
    /// stops both rings (GET_VRING_BASE: once answered, the backend no longer
    /// touches them), sends the new memory table and sets the rings up again
    /// in it. Returns the old memory.
    pub fn switch_memory(&mut self, mem: FrontendMemory) -> Result<FrontendMemory, FrontendError> {
        let sock = self.socket.clone();
        let err = |what| {
            let socket = sock.clone();
            move |source| FrontendError::Vhost {
                socket,
                what,
                source,
            }
        };
        for q in 0..2 {
            self.fe.get_vring_base(q).map_err(err("GET_VRING_BASE"))?;
        }
        let old = std::mem::replace(&mut self.mem, mem);
        self.avail = [0; 2];
        self.set_up_memory().map_err(err("memory switch"))?;
        Ok(old)
    }

    /// Misbehaves on purpose, as a guest that changes a queue after
    /// DRIVER_OK would if its VMM relayed it: with both rings started, asks
    /// to move queue `q`'s rings by `by` bytes (still inside the memory) and
    /// to halve its size, without stopping it first.
    pub fn move_started_ring(&mut self, q: usize, by: u64) -> Result<(), FrontendError> {
        let sock = self.socket.clone();
        let err = |what| {
            let socket = sock.clone();
            move |source| FrontendError::Vhost {
                socket,
                what,
                source,
            }
        };
        let area = self.mem.base as u64 + q as u64 * RING_AREA + by;
        self.fe
            .set_vring_addr(q, &rings_at(area))
            .map_err(err("SET_VRING_ADDR"))?;
        self.fe
            .set_vring_num(q, QSIZE / 2)
            .map_err(err("SET_VRING_NUM"))
    }

    pub fn ptr(&self, gpa: u64, len: usize) -> *mut u8 {
        assert!(
            gpa as usize + len <= self.mem.size,
            "test frontend: own layout stays in memory"
        );
        // SAFETY: in bounds (asserted).
        unsafe { self.mem.base.add(gpa as usize) }
    }
    fn w16(&self, gpa: u64, v: u16) {
        // SAFETY: in-bounds, aligned ring field.
        unsafe { std::ptr::write_volatile(self.ptr(gpa, 2) as *mut u16, v.to_le()) }
    }
    fn w32(&self, gpa: u64, v: u32) {
        // SAFETY: in-bounds, aligned ring field.
        unsafe { std::ptr::write_volatile(self.ptr(gpa, 4) as *mut u32, v.to_le()) }
    }
    fn w64(&self, gpa: u64, v: u64) {
        // SAFETY: in-bounds, aligned ring field.
        unsafe { std::ptr::write_volatile(self.ptr(gpa, 8) as *mut u64, v.to_le()) }
    }
    fn r16(&self, gpa: u64) -> u16 {
        // SAFETY: in-bounds, aligned ring field.
        u16::from_le(unsafe { std::ptr::read_volatile(self.ptr(gpa, 2) as *const u16) })
    }
    fn r32(&self, gpa: u64) -> u32 {
        // SAFETY: in-bounds, aligned ring field.
        u32::from_le(unsafe { std::ptr::read_volatile(self.ptr(gpa, 4) as *const u32) })
    }

    pub fn write_desc(&self, q: usize, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let d = q as u64 * RING_AREA + i as u64 * 16;
        self.w64(d, addr);
        self.w32(d + 8, len);
        self.w16(d + 12, flags);
        self.w16(d + 14, next);
    }

    /// Publishes descriptor head `head` in queue `q`'s avail ring and kicks.
    pub fn publish(&mut self, q: usize, head: u16) {
        self.put_avail(q, 0, head);
        self.advance_avail(q, 1);
        self.kick(q);
    }

    /// Writes `head` into queue `q`'s avail ring `k` entries past its index
    /// (not yet visible to the device: see [`VuFrontend::advance_avail`]).
    pub fn put_avail(&self, q: usize, k: u16, head: u16) {
        let at = self.avail[q].wrapping_add(k);
        self.w16(
            q as u64 * RING_AREA + 0x1000 + 4 + (at % QSIZE) as u64 * 2,
            head,
        );
    }

    /// Makes the next `n` avail entries visible (one index update, no kick).
    pub fn advance_avail(&mut self, q: usize, n: u16) {
        if n == 0 {
            return;
        }
        self.avail[q] = self.avail[q].wrapping_add(n);
        fence(Ordering::SeqCst);
        self.w16(q as u64 * RING_AREA + 0x1000 + 2, self.avail[q]);
        fence(Ordering::SeqCst);
    }

    /// Sets queue `q`'s avail-ring flags (VRING_AVAIL_F_NO_INTERRUPT = 1).
    pub fn set_avail_flags(&self, q: usize, flags: u16) {
        self.w16(q as u64 * RING_AREA + 0x1000, flags);
    }

    /// Avail index of queue `q` (heads published so far).
    pub fn avail_idx(&self, q: usize) -> u16 {
        self.avail[q]
    }

    pub fn kick(&self, q: usize) {
        let _ = self.kick[q].write(1);
    }

    /// Next free avail slot of queue `q` (its descriptor index in this layout).
    pub fn next_slot(&self, q: usize) -> u16 {
        self.avail[q] % QSIZE
    }

    /// Queue `q`'s used-ring flags (the NIC's VRING_USED_F_NO_NOTIFY).
    pub fn used_flags(&self, q: usize) -> u16 {
        self.r16(q as u64 * RING_AREA + 0x2000)
    }

    pub fn used_idx(&self, q: usize) -> u16 {
        fence(Ordering::SeqCst);
        self.r16(q as u64 * RING_AREA + 0x2000 + 2)
    }

    /// Entry `i` of queue `q`'s used ring: (id, len).
    pub fn used_elem(&self, q: usize, i: u16) -> (u32, u32) {
        let e = q as u64 * RING_AREA + 0x2000 + 4 + (i % QSIZE) as u64 * 8;
        (self.r32(e), self.r32(e + 4))
    }

    pub fn kick_fd(&self, q: usize) -> &EventFd {
        &self.kick[q]
    }

    pub fn call_fd(&self, q: usize) -> &EventFd {
        &self.call[q]
    }

    /// Channel `k`'s (kick, call) eventfds (vring 2 + k).
    pub fn channel_fds(&self, k: usize) -> Option<&(EventFd, EventFd)> {
        self.chans.get(k)
    }

    pub fn channels(&self) -> usize {
        self.chans.len()
    }

    pub fn mem(&self) -> &FrontendMemory {
        &self.mem
    }

    pub fn socket(&self) -> &str {
        &self.socket
    }
}

/// The ring addresses of a queue whose area starts at `area`: descriptor
/// table, avail ring and used ring a page apart, QSIZE entries.
fn rings_at(area: u64) -> VringConfigData {
    VringConfigData {
        queue_max_size: QSIZE,
        queue_size: QSIZE,
        flags: 0,
        desc_table_addr: area,
        avail_ring_addr: area + 0x1000,
        used_ring_addr: area + 0x2000,
        log_addr: None,
    }
}
