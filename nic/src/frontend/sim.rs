//! [`SimFrontend`]: a VF driven over a [`VuFrontend`] session as a guest's
//! virtio-net driver would (receive buffers posted, frames sent and taken,
//! malformed chains on purpose, bursts for the benchmarks).

use std::path::Path;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_ring::{VRING_AVAIL_F_NO_INTERRUPT, VRING_USED_F_NO_NOTIFY};

use super::{FrontendError, FrontendMemory, VuFrontend, BUF, BUFFERS, HDR_LEN, QSIZE};

#[derive(Debug)]
pub struct SimFrontend {
    vu: VuFrontend,
    rx_used_seen: u16,
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

    /// See [`VuFrontend::move_started_ring`].
    pub fn move_started_ring(&mut self, q: usize, by: u64) -> Result<(), FrontendError> {
        self.vu.move_started_ring(q, by)
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
