//! The signals of one SGF over its Cross-FIFO: guest → device words taken
//! and validated against their ring (`consume`), device → guest words
//! coalesced per ring and pushed (`publish`, `ring_error`, `ring_closed`,
//! `flush`).

use super::*;

impl Sgf {
    /// Takes up to `budget` guest → device words and validates each against
    /// its ring. Returns what the device must act on and whether more words
    /// are waiting (call again).
    pub fn consume(&mut self, budget: usize, out: &mut Vec<Inbound>) -> Result<bool, SgfError> {
        if self.state != SgfState::Attached {
            return Ok(false);
        }
        let fifo_err = |name: &str, source| SgfError::Fifo {
            sgf: name.to_string(),
            source,
        };
        let mut words = Vec::new();
        let n = self
            .g2d
            .pop(budget, &mut words)
            .map_err(|e| fifo_err(&self.name, e))?;
        self.stats.signals_in += words.len() as u64;
        let mut ctrl = false;
        for w in words {
            match self.inbound(w) {
                Some(Inbound::Ctrl) => ctrl = true,
                Some(i) => out.push(i),
                None => {}
            }
        }
        if ctrl {
            out.push(Inbound::Ctrl);
        }
        let chan_more = self.consume_channels(out);
        // The guest waits for FIFO space: tell it there is some now.
        if self
            .g2d
            .producer_backlog()
            .map_err(|e| fifo_err(&self.name, e))?
        {
            self.irq = true;
        }
        if n == budget {
            // The budget ran out: more words may wait; the caller comes back.
            return Ok(true);
        }
        Ok(self.g2d.arm().map_err(|e| fifo_err(&self.name, e))? || chan_more)
    }

    pub(super) fn inbound(&mut self, w: SignalWord) -> Option<Inbound> {
        let Ok(Signal { ty, ring, ptr }) = w.decode() else {
            self.stats.bad_signals += 1;
            return None;
        };
        let Some(r) = self.rings.get(&ring) else {
            self.stats.unknown_ring += 1;
            return None;
        };
        if r.state != RingState::Open {
            // A signal racing a close or an error: nothing to do.
            return None;
        }
        let expected = match ty {
            SignalType::Head => RingRole::GuestProduces,
            SignalType::Tail => RingRole::DeviceProduces,
            _ => return Some(self.ring_error(ring, ErrorCode::WrongDirection)),
        };
        if r.role != expected {
            return Some(self.ring_error(ring, ErrorCode::WrongDirection));
        }
        let label = format!("SGF {} ring {ring}", self.name);
        match (ring, r.engine) {
            (CTRL_REQ_RING, _) => match self.req.1.publish_head(&label, ptr) {
                Ok(_) => Some(Inbound::Ctrl),
                Err(e) => Some(self.ring_error(ring, e.code())),
            },
            (CTRL_REPLY_RING, _) => match self.rep.1.publish_tail(&label, ptr) {
                Ok(_) => Some(Inbound::Ctrl),
                Err(e) => Some(self.ring_error(ring, e.code())),
            },
            (_, Some(engine)) if ty == SignalType::Head => {
                Some(Inbound::Head { ring, engine, ptr })
            }
            (_, Some(engine)) => Some(Inbound::Tail { ring, engine, ptr }),
            (_, None) => None,
        }
    }

    /// Puts one ring into error (reported to the guest by an `Error` word and
    /// in its descriptor). An error on a control ring fails the SGF.
    pub fn ring_error(&mut self, ring: RingId, code: ErrorCode) -> Inbound {
        self.stats.ring_errors += 1;
        let opened = self
            .rings
            .get_mut(&ring)
            .filter(|r| r.state == RingState::Open);
        if let Some(dev_ptr) = opened.map(|r| {
            r.state = RingState::Error;
            r.code = code as u32;
            r.dev_ptr
        }) {
            self.write_desc(ring, RingState::Error, code as u32, dev_ptr);
            self.queue(ring, pend::ERROR);
        }
        if ring == CTRL_REQ_RING || ring == CTRL_REPLY_RING {
            self.fail(code);
        }
        Inbound::RingError { ring, code }
    }

    /// Marks a ring closed by the device (peer gone): a `Closed` word.
    pub fn ring_closed(&mut self, ring: RingId) {
        let live = self
            .rings
            .get_mut(&ring)
            .filter(|r| r.state == RingState::Open || r.state == RingState::Error);
        if let Some((code, dev_ptr)) = live.map(|r| {
            r.state = RingState::Closed;
            (r.code, r.dev_ptr)
        }) {
            self.write_desc(ring, RingState::Closed, code, dev_ptr);
            self.queue(ring, pend::CLOSED);
        }
    }

    /// The device's pointer of a data ring moved (engine event).
    pub fn publish(&mut self, ring: RingId, ptr: u32) {
        if let Some((state, code)) = self.rings.get_mut(&ring).map(|r| {
            r.dev_ptr = ptr;
            (r.state, r.code)
        }) {
            self.write_desc(ring, state, code, ptr);
            self.queue(ring, pend::PTR);
        }
    }

    pub(super) fn queue(&mut self, ring: RingId, what: u8) {
        if let Some(r) = self.rings.get_mut(&ring) {
            if r.pend == 0 {
                self.pending.push_back(ring);
            }
            r.pend |= what;
        }
    }

    /// Pushes the pending device → guest words (the latest of each ring).
    /// Returns whether the guest must be interrupted.
    pub fn flush(&mut self) -> Result<bool, SgfError> {
        let fifo_err = |name: &str, source| SgfError::Fifo {
            sgf: name.to_string(),
            source,
        };
        // Rings whose channel is full: pending again after this flush.
        let mut deferred = Vec::new();
        'rings: while let Some(&id) = self.pending.front() {
            let Some(r) = self.rings.get(&id) else {
                self.pending.pop_front();
                continue;
            };
            let route = r
                .chan
                .filter(|k| self.chans.as_ref().is_some_and(|(_, _, p)| p.contains(*k)));
            let ptr_type = if r.role == RingRole::GuestProduces {
                SignalType::Tail
            } else {
                SignalType::Head
            };
            let mut words = Vec::with_capacity(3);
            if r.pend & pend::PTR != 0 {
                words.push((pend::PTR, Signal::new(ptr_type, id, r.dev_ptr)));
            }
            if r.pend & pend::ERROR != 0 {
                words.push((pend::ERROR, Signal::new(SignalType::Error, id, r.code)));
            }
            if r.pend & pend::CLOSED != 0 {
                words.push((pend::CLOSED, Signal::new(SignalType::Closed, id, 0)));
            }
            for (bit, s) in words {
                let pushed = match (route, self.chans.as_mut()) {
                    (Some(k), Some((_, _, p))) => p.push(k, s.word()),
                    _ => self.d2g.push(s.word()),
                }
                .map_err(|e| fifo_err(&self.name, e))?;
                if !pushed {
                    self.stats.d2g_full += 1;
                    if route.is_some() {
                        // Only this pipe's channel is full.
                        self.pending.pop_front();
                        deferred.push(id);
                        continue 'rings;
                    }
                    self.pending.extend(deferred);
                    return self.finish_flush();
                }
                self.stats.signals_out += 1;
                if let Some(r) = self.rings.get_mut(&id) {
                    r.pend &= !bit;
                }
            }
            self.pending.pop_front();
        }
        self.pending.extend(deferred);
        self.d2g
            .clear_backlog()
            .map_err(|e| fifo_err(&self.name, e))?;
        self.finish_flush()
    }

    fn finish_flush(&mut self) -> Result<bool, SgfError> {
        let err = |source| SgfError::Fifo {
            sgf: self.name.clone(),
            source,
        };
        if let Some((_, _, p)) = self.chans.as_mut() {
            p.flush(&mut self.chan_irqs).map_err(err)?;
        }
        let notify = self.d2g.flush().map_err(err)?;
        let irq = notify || std::mem::take(&mut self.irq);
        if irq {
            self.stats.interrupts += 1;
        }
        Ok(irq)
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty() || self.irq || !self.chan_irqs.is_empty()
    }
}
