//! The driver's data and signal path: bytes into TX and out of RX rings,
//! the signal words it pushes (Cross-FIFO, or a socket's own channel in the
//! `dedicated` mode), the doorbell (`flush`), and the interrupt handler that
//! applies the device's words and control replies.

use super::*;

impl Driver {
    /// A word on channel `k` (its doorbell rings at the next flush).
    pub(super) fn channel_word(&mut self, k: u16, w: SignalWord) -> Result<(), DriverError> {
        if let Some(c) = self.chans.get_mut(&k) {
            c.push(w)?;
            self.dirty_chans.push(k);
        }
        Ok(())
    }

    /// Fault injection for tests: pushes any word on socket `sock`'s own
    /// channel (`dedicated` mode).
    pub fn push_channel_word(&mut self, sock: RingId, w: SignalWord) -> Result<(), DriverError> {
        let k = self
            .socks
            .get(&sock)
            .and_then(|s| s.chan)
            .ok_or(DriverError::NoSocket(sock))?;
        self.channel_word(k, w)
    }

    /// The socket's signal channel index (`dedicated` mode).
    pub fn channel(&self, sock: RingId) -> Option<u16> {
        self.socks.get(&sock).and_then(|s| s.chan)
    }

    /// The channels whose doorbells must ring (after [`Driver::flush`]).
    pub fn take_channel_kicks(&mut self) -> Vec<u16> {
        std::mem::take(&mut self.chan_kicks)
    }

    /// Fault injection for tests: pushes any word.
    pub fn push_word(&mut self, w: SignalWord) -> Result<(), DriverError> {
        if !self.g2d.push(w)? {
            self.backlog.push(w);
        }
        Ok(())
    }

    /// Writes as much of `data` as fits into the socket's TX ring and
    /// publishes the new head.
    pub fn send(&mut self, sock: RingId, data: &[u8]) -> Result<usize, DriverError> {
        let s = self
            .socks
            .get_mut(&sock)
            .ok_or(DriverError::NoSocket(sock))?;
        let free = s.tx.view.geom.size - s.tx.ours.wrapping_sub(s.tx.theirs);
        let n = (data.len() as u32).min(free);
        if n == 0 {
            return Ok(0);
        }
        s.tx.view.write(s.tx.ours, &data[..n as usize])?;
        s.tx.ours = s.tx.ours.wrapping_add(n);
        let (id, ptr) = (s.tx.id, s.tx.ours);
        self.mirror(id, ptr)?;
        self.signal(SignalType::Head, id, ptr)?;
        Ok(n as usize)
    }

    /// Reads what arrived (up to `buf.len()`) and publishes the new tail.
    pub fn recv(&mut self, sock: RingId, buf: &mut [u8]) -> Result<usize, DriverError> {
        let s = self
            .socks
            .get_mut(&sock)
            .ok_or(DriverError::NoSocket(sock))?;
        let avail = s.rx.theirs.wrapping_sub(s.rx.ours);
        let n = (buf.len() as u32).min(avail);
        if n == 0 {
            return Ok(0);
        }
        s.rx.view.read(s.rx.ours, &mut buf[..n as usize])?;
        s.rx.ours = s.rx.ours.wrapping_add(n);
        let (id, ptr) = (s.rx.id, s.rx.ours);
        self.mirror(id, ptr)?;
        self.signal(SignalType::Tail, id, ptr)?;
        Ok(n as usize)
    }

    /// The guest's pointer in its descriptor (for a reader of the table).
    fn mirror(&self, id: RingId, ptr: u32) -> Result<(), DriverError> {
        let s = self
            .mem
            .get(self.area + self.layout.desc_off(id), rd::BYTES as usize)?;
        let _ = s.store(
            ptr,
            rd::GUEST_PTR as usize,
            std::sync::atomic::Ordering::Release,
        );
        Ok(())
    }

    pub fn rx_ready(&self, sock: RingId) -> u32 {
        self.socks
            .get(&sock)
            .map_or(0, |s| s.rx.theirs.wrapping_sub(s.rx.ours))
    }

    pub fn tx_space(&self, sock: RingId) -> u32 {
        self.socks.get(&sock).map_or(0, |s| {
            s.tx.view.geom.size - s.tx.ours.wrapping_sub(s.tx.theirs)
        })
    }

    /// Bytes sent but not yet taken by the device.
    pub fn tx_pending(&self, sock: RingId) -> u32 {
        self.socks
            .get(&sock)
            .map_or(0, |s| s.tx.ours.wrapping_sub(s.tx.theirs))
    }

    pub fn state(&self, sock: RingId) -> Option<SockState> {
        self.socks.get(&sock).map(|s| s.state)
    }

    pub fn sockets(&self) -> usize {
        self.socks.len()
    }

    /// The reply to request `req`, once it arrived.
    pub fn reply(&mut self, req: u32) -> Option<CtrlMsg> {
        self.replies.remove(&req)
    }

    /// Ends a burst of sends: pushes held-back words and says whether the
    /// doorbell must be rung.
    pub fn flush(&mut self) -> Result<bool, DriverError> {
        self.g2d.push_held(&mut self.backlog)?;
        let notify = self.g2d.flush()?;
        let mut dirty = std::mem::take(&mut self.dirty_chans);
        dirty.sort_unstable();
        dirty.dedup();
        for k in dirty {
            if let Some(c) = self.chans.get_mut(&k) {
                if c.flush()? {
                    self.chan_kicks.push(k);
                }
            }
        }
        Ok(notify || std::mem::take(&mut self.kick))
    }

    /// Handles the device's interrupt: drains device → guest words, reads
    /// control replies, then re-arms (and drains again if words raced in).
    pub fn interrupt(&mut self) -> Result<usize, DriverError> {
        let mut total = 0;
        loop {
            let mut words = Vec::new();
            let n = self.d2g.pop(usize::MAX, &mut words)?;
            total += n;
            for w in words {
                self.on_word(w)?;
            }
            self.read_replies()?;
            if self.d2g.producer_backlog()? {
                self.kick = true;
            }
            if !self.d2g.arm()? {
                break;
            }
        }
        // `dedicated` mode: every channel is drained (a guest with one
        // vector per channel would look at the one that fired; the cost is
        // on the guest side, not the device's).
        let mut words = Vec::new();
        let ks: Vec<u16> = self.chans.keys().copied().collect();
        for k in ks {
            words.clear();
            let Some(c) = self.chans.get_mut(&k) else {
                continue;
            };
            if c.receive(&mut words)? {
                // The device holds words back: tell it there is room.
                self.dirty_chans.push(k);
                self.chan_kicks.push(k);
            }
            total += words.len();
            for &w in &words {
                self.on_word(w)?;
            }
        }
        Ok(total)
    }

    fn on_word(&mut self, w: SignalWord) -> Result<(), DriverError> {
        let Ok(s) = w.decode() else { return Ok(()) };
        match (s.ty, s.ring) {
            (SignalType::Tail, CTRL_REQ_RING) => self.req.theirs = s.ptr,
            (SignalType::Head, CTRL_REPLY_RING) => self.rep.theirs = s.ptr,
            (ty, ring) => {
                let sock = self.ring_sock.get(&ring).copied();
                let Some(sk) = sock.and_then(|k| self.socks.get_mut(&k)) else {
                    return Ok(());
                };
                match ty {
                    SignalType::Tail if sk.tx.id == ring => sk.tx.theirs = s.ptr,
                    SignalType::Head if sk.rx.id == ring => sk.rx.theirs = s.ptr,
                    // A socket being closed keeps that state until the reply.
                    SignalType::Error if sk.state != SockState::Closing => {
                        sk.state = SockState::Error(
                            ErrorCode::from_u32(s.ptr).unwrap_or(ErrorCode::BadRequest),
                        );
                    }
                    SignalType::Closed if sk.state != SockState::Closing => {
                        sk.state = SockState::Closed;
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    fn read_replies(&mut self) -> Result<(), DriverError> {
        let mut any = false;
        while self.rep.theirs.wrapping_sub(self.rep.ours) >= ctrl::MSG_BYTES {
            let mut m = CtrlMsg::default();
            self.rep.view.read(self.rep.ours, m.as_mut_slice())?;
            self.rep.ours = self.rep.ours.wrapping_add(ctrl::MSG_BYTES);
            any = true;
            self.on_reply(&m);
            self.replies.insert(m.req_id, m);
        }
        if any {
            self.signal(SignalType::Tail, CTRL_REPLY_RING, self.rep.ours)?;
        }
        Ok(())
    }

    fn on_reply(&mut self, m: &CtrlMsg) {
        match CtrlOp::from_u16(m.op & !ctrl::REPLY) {
            Some(CtrlOp::Open) => {
                if m.status == 0 {
                    if let Some(s) = self.socks.get_mut(&m.sock) {
                        s.state = SockState::Open;
                    }
                } else if self.state(m.sock) == Some(SockState::Opening) {
                    self.forget(m.sock);
                }
            }
            Some(CtrlOp::Close) if m.status == 0 => self.forget(m.sock),
            _ => {}
        }
    }

    /// Frees a socket's ring ids and memory (after the CLOSE reply, or a
    /// refused OPEN): the device no longer touches them.
    fn forget(&mut self, sock: RingId) {
        if let Some(s) = self.socks.remove(&sock) {
            if let Some(k) = s.chan {
                self.chans.remove(&k);
                self.free_chans.push(k);
            }
            for r in [s.tx, s.rx] {
                self.ring_sock.remove(&r.id);
                self.heap.free(r.view.geom.base, r.view.geom.size as u64);
                self.free_ids.push(r.id);
            }
        }
    }
}
