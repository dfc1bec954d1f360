//! A minimal vhost-user frontend that drives one device like a guest driver
//! would: memfd-backed "guest" memory, split virtqueues written by hand
//! ([`VuFrontend`], two queues). [`SimFrontend`] drives a VF with it; the SG
//! frontend (`sg::frontend`) an SG function. Used by `bench devset`, `bench
//! sgiov` (real vhost-user sessions) and by the daemon tests; it is not the
//! VMM's frontend (vmm/src/virtio/).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{VhostUserHeaderFlag, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::virtio_ring::{VRING_AVAIL_F_NO_INTERRUPT, VRING_USED_F_NO_NOTIFY};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Queue size of both rings.
pub const QSIZE: u16 = 256;
const HDR_LEN: usize = 12;
const BUF: u64 = 2048;
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

pub struct SimFrontend {
    vu: VuFrontend,
    rx_used_seen: u16,
}

/// The frontend's "guest memory": a memfd mapped shared; `populate` touches
/// every page first (as a VMM that DMA-mapped its RAM itself), otherwise the
/// NIC's mapping allocates and zeroes the pages (fresh memory, vanilla).
pub struct FrontendMemory {
    memfd: File,
    base: *mut u8,
    size: usize,
}

// SAFETY: `base` is a shared mapping owned by this struct.
unsafe impl Send for FrontendMemory {}

impl FrontendMemory {
    /// The mapping's address and length (the frontend's "guest-physical" 0).
    pub fn host(&self) -> (*mut u8, usize) {
        (self.base, self.size)
    }

    pub fn new(size: usize, populate: bool) -> Result<Self, FrontendError> {
        if size < MIN_MEM {
            return Err(FrontendError::Size(size));
        }
        let io = |what: &'static str| {
            move |source| FrontendError::Io {
                socket: String::new(),
                what,
                source,
            }
        };
        // SAFETY: memfd_create with a valid name.
        let fd = unsafe { libc::memfd_create(c"nic-test-frontend".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io("memfd_create")(io::Error::last_os_error()));
        }
        // SAFETY: fd was just created and is owned here.
        let memfd = unsafe { File::from_raw_fd(fd) };
        memfd.set_len(size as u64).map_err(io("ftruncate"))?;
        Self::map(memfd, size, populate)
    }

    /// The first `size` bytes of an existing memfd (e.g. memory taken from a page pool,
    /// whose page-state table follows the guest bytes), mapped shared.
    pub fn from_memfd(memfd: File, size: usize) -> Result<Self, FrontendError> {
        if size < MIN_MEM {
            return Err(FrontendError::Size(size));
        }
        Self::map(memfd, size, false)
    }

    /// A second mapping of the same memory (shared pages): lets a test look
    /// at memory a frontend gave up.
    pub fn second_view(&self) -> Result<Self, FrontendError> {
        let memfd = self.memfd.try_clone().map_err(|source| FrontendError::Io {
            socket: String::new(),
            what: "dup memfd",
            source,
        })?;
        Self::map(memfd, self.size, false)
    }

    fn map(memfd: File, size: usize, populate: bool) -> Result<Self, FrontendError> {
        // SAFETY: shared mapping of the first `size` bytes of a memfd we own.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 },
                memfd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(FrontendError::Io {
                socket: String::new(),
                what: "mmap",
                source: io::Error::last_os_error(),
            });
        }
        Ok(FrontendMemory {
            memfd,
            base: base.cast(),
            size,
        })
    }
}

impl Drop for FrontendMemory {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.base.cast(), self.size) };
    }
}

impl SimFrontend {
    /// Connects and sets the VF up (the whole "open"): features, memory table
    /// (one region, GPA 0, `mem_size` bytes), both vrings; posts all RX buffers.
    pub fn connect(socket: &Path, mem_size: usize) -> Result<Self, FrontendError> {
        Self::connect_mem(socket, FrontendMemory::new(mem_size, false)?)
    }

    /// As `connect`, with memory made beforehand, as a VMM's is.
    pub fn connect_mem(socket: &Path, mem: FrontendMemory) -> Result<Self, FrontendError> {
        let mut me = SimFrontend {
            vu: VuFrontend::connect_mem(socket, mem)?,
            rx_used_seen: 0,
        };
        me.post_rx(QSIZE);
        Ok(me)
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
            self.fe.set_vring_addr(
                q,
                &VringConfigData {
                    queue_max_size: QSIZE,
                    queue_size: QSIZE,
                    flags: 0,
                    desc_table_addr: area,
                    avail_ring_addr: area + 0x1000,
                    used_ring_addr: area + 0x2000,
                    log_addr: None,
                },
            )?;
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

impl SimFrontend {
    fn post_rx(&mut self, n: u16) {
        for _ in 0..n {
            let slot = self.vu.next_slot(0);
            self.vu.write_desc(
                0,
                slot,
                BUFFERS + slot as u64 * BUF,
                BUF as u32,
                2, /* WRITE */
                0,
            );
            self.vu.publish(0, slot);
        }
    }

    /// See [`VuFrontend::switch_memory`]; all receive buffers are posted again.
    pub fn switch_memory(&mut self, mem: FrontendMemory) -> Result<FrontendMemory, FrontendError> {
        let old = self.vu.switch_memory(mem)?;
        self.rx_used_seen = 0;
        self.post_rx(QSIZE);
        Ok(old)
    }

    /// Disconnects (as a killed VMM) and keeps the memory.
    pub fn into_memory(self) -> FrontendMemory {
        self.vu.mem
    }

    /// Transmits one frame (virtio-net header + frame in one descriptor).
    pub fn send(&mut self, frame: &[u8]) {
        assert!(
            HDR_LEN + frame.len() <= BUF as usize,
            "test frames fit one buffer"
        );
        let slot = self.vu.next_slot(1);
        self.fill_tx_slot(slot, frame);
        self.vu.publish(1, slot);
    }

    /// Writes header + `frame` into transmit buffer `slot` and points its descriptor at it.
    fn fill_tx_slot(&self, slot: u16, frame: &[u8]) {
        let gpa = BUFFERS + (QSIZE as u64 + slot as u64) * BUF;
        let p = self.vu.ptr(gpa, HDR_LEN + frame.len());
        // SAFETY: in-bounds buffer of our own memory.
        unsafe {
            std::ptr::write_bytes(p, 0, HDR_LEN);
            std::ptr::copy_nonoverlapping(frame.as_ptr(), p.add(HDR_LEN), frame.len());
        }
        self.vu
            .write_desc(1, slot, gpa, (HDR_LEN + frame.len()) as u32, 0, 0);
    }

    /// Posts a transmit descriptor whose buffer lies outside the memory table.
    pub fn send_out_of_bounds(&mut self) {
        let slot = self.vu.next_slot(1);
        self.vu
            .write_desc(1, slot, self.vu.mem.size as u64 + 0x10_0000, 64, 0, 0);
        self.vu.publish(1, slot);
    }

    /// Posts a transmit chain whose "next" index lies outside the ring.
    pub fn send_broken_chain(&mut self) {
        let slot = self.vu.next_slot(1);
        let gpa = BUFFERS + (QSIZE as u64 + slot as u64) * BUF;
        self.vu
            .write_desc(1, slot, gpa, 64, 1 /* NEXT */, QSIZE + 5);
        self.vu.publish(1, slot);
    }

    /// Transmits one frame through an indirect descriptor table (one
    /// descriptor in it) although VIRTIO_F_INDIRECT_DESC was never offered.
    pub fn send_indirect(&mut self, frame: &[u8]) {
        assert!(HDR_LEN + frame.len() + 16 <= BUF as usize);
        let slot = self.vu.next_slot(1);
        let gpa = BUFFERS + (QSIZE as u64 + slot as u64) * BUF;
        // The table at the start of the buffer, the frame after it.
        let data = gpa + 16;
        let p = self.vu.ptr(data, HDR_LEN + frame.len());
        // SAFETY: in-bounds buffer of our own memory.
        unsafe {
            std::ptr::write_bytes(p, 0, HDR_LEN);
            std::ptr::copy_nonoverlapping(frame.as_ptr(), p.add(HDR_LEN), frame.len());
        }
        self.vu.w64(gpa, data);
        self.vu.w32(gpa + 8, (HDR_LEN + frame.len()) as u32);
        self.vu.w16(gpa + 12, 0);
        self.vu.w16(gpa + 14, 0);
        self.vu.write_desc(1, slot, gpa, 16, 4 /* INDIRECT */, 0);
        self.vu.publish(1, slot);
    }

    /// Transmit descriptors the VF has consumed.
    pub fn tx_done(&self) -> u16 {
        self.vu.used_idx(1)
    }

    /// Waits up to `timeout` for a received frame (header stripped); the buffer
    /// is posted again.
    pub fn recv(&mut self, timeout: Duration) -> Option<Vec<u8>> {
        let end = Instant::now() + timeout;
        loop {
            if self.vu.used_idx(0) != self.rx_used_seen {
                let e = 0x2000 + 4 + (self.rx_used_seen % QSIZE) as u64 * 8;
                let (id, len) = (self.vu.r32(e) as u16, self.vu.r32(e + 4) as usize);
                self.rx_used_seen = self.rx_used_seen.wrapping_add(1);
                let gpa = BUFFERS + (id % QSIZE) as u64 * BUF;
                let len = len.min(BUF as usize);
                let mut v = vec![0u8; len];
                // SAFETY: in-bounds buffer of our own memory.
                unsafe {
                    std::ptr::copy_nonoverlapping(self.vu.ptr(gpa, len), v.as_mut_ptr(), len)
                };
                self.vu.write_desc(0, id % QSIZE, gpa, BUF as u32, 2, 0);
                self.vu.publish(0, id % QSIZE);
                return Some(v.split_off(HDR_LEN.min(v.len())));
            }
            let now = Instant::now();
            if now >= end {
                return None;
            }
            let ms = (end - now).as_millis().clamp(1, 50) as u64;
            crate::poll::wait_readable(
                &[crate::poll::eventfd_fd(&self.vu.call[0])],
                Duration::from_millis(ms),
            );
            let _ = self.vu.call[0].read();
        }
    }

    /// Poll mode: asks the NIC for no interrupts on either ring
    /// (VRING_AVAIL_F_NO_INTERRUPT), as DPDK's virtio PMD does: the poller
    /// reads the used rings itself.
    pub fn no_interrupts(&mut self) {
        for q in 0..2 {
            self.vu
                .set_avail_flags(q, VRING_AVAIL_F_NO_INTERRUPT as u16);
        }
    }

    /// Poll mode (`bench dataplane`): writes `frame` into every transmit
    /// buffer and its descriptor once, so a burst only publishes heads.
    pub fn prepare_tx(&mut self, frame: &[u8]) {
        assert!(
            HDR_LEN + frame.len() <= BUF as usize,
            "frames fit one buffer"
        );
        for slot in 0..QSIZE {
            self.fill_tx_slot(slot, frame);
        }
    }

    /// Poll mode: publishes up to `n` prepared transmit buffers (as many as
    /// the ring has free), one avail-index update; kicks as a virtio driver
    /// does (see [`SimFrontend::kick_unless_suppressed`]). Returns how many it
    /// published.
    pub fn tx_burst(&mut self, n: usize) -> usize {
        let used = self.vu.used_idx(1);
        let start = self.vu.avail_idx(1);
        let free = QSIZE - start.wrapping_sub(used);
        let n = n.min(free as usize) as u16;
        for k in 0..n {
            self.vu.put_avail(1, k, start.wrapping_add(k) % QSIZE);
        }
        self.vu.advance_avail(1, n);
        self.kick_unless_suppressed(1, n);
        n as usize
    }

    /// Transmit buffers published and not yet used by the NIC.
    pub fn tx_in_flight(&self) -> u16 {
        self.vu.avail_idx(1).wrapping_sub(self.vu.used_idx(1))
    }

    /// Queue `q`'s used-ring flags (the NIC sets VRING_USED_F_NO_NOTIFY while it polls).
    pub fn used_flags(&self, q: usize) -> u16 {
        self.vu.used_flags(q)
    }

    /// Poll mode: counts the frames received since the last call and posts
    /// their buffers again (one avail-index update). Returns (frames, bytes
    /// without the virtio-net header).
    pub fn rx_burst(&mut self) -> (usize, u64) {
        let used = self.vu.used_idx(0);
        let n = used.wrapping_sub(self.rx_used_seen);
        let mut bytes = 0u64;
        for k in 0..n {
            let (id, len) = self.vu.used_elem(0, self.rx_used_seen.wrapping_add(k));
            bytes += u64::from(len).saturating_sub(HDR_LEN as u64);
            // The descriptor of slot `id` still points at its buffer.
            self.vu.put_avail(0, k, id as u16 % QSIZE);
        }
        self.rx_used_seen = used;
        self.vu.advance_avail(0, n);
        self.kick_unless_suppressed(0, n);
        (n as usize, bytes)
    }

    /// After publishing `n` buffers on queue `q`: kicks unless the NIC set
    /// VRING_USED_F_NO_NOTIFY (virtio 1.2 §2.7.10; Linux's and DPDK's
    /// `virtqueue_kick_prepare`). A NIC that polls the ring sets the flag
    /// and costs the frontend no syscall; one about to sleep clears it and
    /// looks at the ring again, so a buffer published here is either seen by
    /// that look or kicked (the fence in `advance_avail` orders the index
    /// store before the flag load).
    fn kick_unless_suppressed(&mut self, q: usize, n: u16) {
        if n > 0 && self.vu.used_flags(q) & VRING_USED_F_NO_NOTIFY as u16 == 0 {
            self.vu.kick(q);
        }
    }

    pub fn socket(&self) -> &str {
        self.vu.socket()
    }
}
