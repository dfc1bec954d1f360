//! Cross-FIFO (SG-IOV §5.1, Fig. 8): a pair of SPSC FIFOs of 64-bit signal
//! words, guest → device and device → guest, in the guest's memory. Both
//! ends use these two types; the device is the consumer of one FIFO and the
//! producer of the other, the guest driver the reverse.
//!
//! Notification suppression, so that one doorbell or interrupt carries many
//! words:
//! - the consumer publishes `event_idx` (notify me when `prod` passes it,
//!   as virtio's event index) and can set `CF_NO_NOTIFY` while it polls;
//! - the producer pushes a burst and then calls [`FifoProducer::flush`],
//!   which says whether this burst crossed `event_idx`: at most one
//!   notification per arming of the consumer;
//! - during a long burst the producer may flush early once the consumer's
//!   `watermark` of words is pending ([`FifoProducer::past_watermark`]), so
//!   the consumer starts draining while the burst goes on.
//!
//! A full FIFO never blocks the device: it sets `PF_BACKLOG`, keeps the
//! words (coalesced per ring by its caller) and the consumer notifies it
//! after freeing slots.
//!
//! Every index the other side writes is read once per operation and checked
//! (`prod - cons` may never exceed the slot count); each side keeps its own
//! copy of the index it owns and never reads it back.

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use vm_memory::Bytes;

use crate::layout::{fifo, ErrorCode};
use crate::mem::{MemError, Memory};
use crate::signal::SignalWord;

#[derive(Debug, thiserror::Error)]
pub enum FifoError {
    #[error("{fifo}: corrupt indices: prod {prod:#x}, cons {cons:#x} with {entries} slots")]
    Corrupt {
        fifo: String,
        prod: u32,
        cons: u32,
        entries: u32,
    },
    #[error("{fifo}: memory access")]
    Memory {
        fifo: String,
        #[source]
        source: MemError,
    },
}

impl FifoError {
    pub fn code(&self) -> ErrorCode {
        match self {
            FifoError::Corrupt { .. } => ErrorCode::FifoCorrupt,
            FifoError::Memory { .. } => ErrorCode::Memory,
        }
    }
}

/// The shared part of both ends: where the FIFO is and how to touch it.
#[derive(Debug)]
struct Fifo {
    label: String,
    mem: Arc<dyn Memory>,
    ctl: u64,
    entries: u32,
}

impl Fifo {
    fn new(label: String, mem: Arc<dyn Memory>, ctl: u64, entries: u32) -> Fifo {
        Fifo {
            label,
            mem,
            ctl,
            entries,
        }
    }

    fn err(&self) -> impl Fn(MemError) -> FifoError + '_ {
        move |source| FifoError::Memory {
            fifo: self.label.clone(),
            source,
        }
    }

    fn load(&self, field: u64, order: Ordering) -> Result<u32, FifoError> {
        let s = self.mem.get(self.ctl + field, 4).map_err(self.err())?;
        s.load::<u32>(0, order)
            .map_err(|e| (self.err())(out_of_range(&self.label, e)))
    }

    fn store(&self, field: u64, v: u32, order: Ordering) -> Result<(), FifoError> {
        let s = self.mem.get(self.ctl + field, 4).map_err(self.err())?;
        s.store(v, 0, order)
            .map_err(|e| (self.err())(out_of_range(&self.label, e)))
    }

    fn slot_addr(&self, idx: u32) -> u64 {
        self.ctl + fifo::SLOTS + 8 * (idx & (self.entries - 1)) as u64
    }

    fn corrupt(&self, prod: u32, cons: u32) -> FifoError {
        FifoError::Corrupt {
            fifo: self.label.clone(),
            prod,
            cons,
            entries: self.entries,
        }
    }
}

fn out_of_range(label: &str, source: vm_memory::VolatileMemoryError) -> MemError {
    MemError::Field {
        mem: label.to_string(),
        what: "misaligned FIFO field",
        source,
    }
}

/// virtio's `vring_need_event`: did the move from `old` to `new` pass `event`?
pub fn need_event(event: u32, new: u32, old: u32) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}

/// The producing end of one FIFO.
#[derive(Debug)]
pub struct FifoProducer {
    f: Fifo,
    prod: u32,
    last_flush: u32,
    backlog: bool,
    pushed: u64,
    notifies: u64,
}

impl FifoProducer {
    /// Takes over the FIFO at `ctl` (a [`crate::layout::FifoCtl`] followed by
    /// `entries` slots), resetting the producer-owned fields.
    pub fn new(
        label: String,
        mem: Arc<dyn Memory>,
        ctl: u64,
        entries: u32,
    ) -> Result<Self, FifoError> {
        let f = Fifo::new(label, mem, ctl, entries);
        f.store(fifo::PROD, 0, Ordering::Release)?;
        f.store(fifo::PFLAGS, 0, Ordering::Release)?;
        Ok(FifoProducer {
            f,
            prod: 0,
            last_flush: 0,
            backlog: false,
            pushed: 0,
            notifies: 0,
        })
    }

    /// Pushes one word; `Ok(false)` if the FIFO is full (the backlog flag is
    /// then set and the consumer will notify after it frees slots).
    pub fn push(&mut self, w: SignalWord) -> Result<bool, FifoError> {
        let cons = self.f.load(fifo::CONS, Ordering::Acquire)?;
        let fill = self.prod.wrapping_sub(cons);
        if fill > self.f.entries {
            return Err(self.f.corrupt(self.prod, cons));
        }
        if fill == self.f.entries {
            if !self.backlog {
                self.backlog = true;
                self.f
                    .store(fifo::PFLAGS, fifo::PF_BACKLOG, Ordering::Release)?;
            }
            return Ok(false);
        }
        let s = self
            .f
            .mem
            .get(self.f.slot_addr(self.prod), 8)
            .map_err(self.f.err())?;
        s.store(w.0, 0, Ordering::Relaxed)
            .map_err(|e| (self.f.err())(out_of_range(&self.f.label, e)))?;
        self.prod = self.prod.wrapping_add(1);
        self.f.store(fifo::PROD, self.prod, Ordering::Release)?;
        self.pushed += 1;
        Ok(true)
    }

    /// Pushes words held back for lack of room, in order, as far as they
    /// fit; clears the backlog flag once none is left.
    pub fn push_held(&mut self, held: &mut Vec<SignalWord>) -> Result<(), FifoError> {
        let mut pushed = 0;
        for w in held.iter() {
            if !self.push(*w)? {
                break;
            }
            pushed += 1;
        }
        held.drain(..pushed);
        if held.is_empty() {
            self.clear_backlog()?;
        }
        Ok(())
    }

    /// Clears the backlog flag once everything held back has been pushed.
    pub fn clear_backlog(&mut self) -> Result<(), FifoError> {
        if self.backlog {
            self.backlog = false;
            self.f.store(fifo::PFLAGS, 0, Ordering::Release)?;
        }
        Ok(())
    }

    /// Ends a burst: whether the consumer asked to be notified for it.
    pub fn flush(&mut self) -> Result<bool, FifoError> {
        // Pairs with the consumer's fence between arming and re-reading prod.
        fence(Ordering::SeqCst);
        let cflags = self.f.load(fifo::CFLAGS, Ordering::Acquire)?;
        let event = self.f.load(fifo::EVENT_IDX, Ordering::Acquire)?;
        let old = std::mem::replace(&mut self.last_flush, self.prod);
        let notify = cflags & fifo::CF_NO_NOTIFY == 0 && need_event(event, self.prod, old);
        if notify {
            self.notifies += 1;
        }
        Ok(notify)
    }

    /// Whether at least the consumer's watermark of words is pending (a
    /// producer in a long burst flushes then).
    pub fn past_watermark(&self) -> Result<bool, FifoError> {
        let cons = self.f.load(fifo::CONS, Ordering::Acquire)?;
        let wm = self.f.load(fifo::WATERMARK, Ordering::Acquire)?.max(1);
        Ok(self.prod.wrapping_sub(cons) >= wm && self.prod != self.last_flush)
    }

    pub fn prod(&self) -> u32 {
        self.prod
    }

    /// Words pushed and notifications asked for since creation.
    pub fn stats(&self) -> (u64, u64) {
        (self.pushed, self.notifies)
    }
}

/// The consuming end of one FIFO.
#[derive(Debug)]
pub struct FifoConsumer {
    f: Fifo,
    cons: u32,
}

impl FifoConsumer {
    /// Takes over the FIFO at `ctl`, resetting the consumer-owned fields:
    /// armed at index 0 (notify on the first word), watermark `watermark`.
    pub fn new(
        label: String,
        mem: Arc<dyn Memory>,
        ctl: u64,
        entries: u32,
        watermark: u32,
    ) -> Result<Self, FifoError> {
        let f = Fifo::new(label, mem, ctl, entries);
        f.store(fifo::CONS, 0, Ordering::Release)?;
        f.store(fifo::EVENT_IDX, 0, Ordering::Release)?;
        f.store(fifo::CFLAGS, 0, Ordering::Release)?;
        f.store(fifo::WATERMARK, watermark.max(1), Ordering::Release)?;
        Ok(FifoConsumer { f, cons: 0 })
    }

    /// Takes up to `max` words (each slot read once). A producer index that
    /// claims more words than slots is corruption: the caller puts the
    /// whole FIFO's owner into error.
    pub fn pop(&mut self, max: usize, out: &mut Vec<SignalWord>) -> Result<usize, FifoError> {
        let prod = self.f.load(fifo::PROD, Ordering::Acquire)?;
        let avail = prod.wrapping_sub(self.cons);
        if avail > self.f.entries {
            return Err(self.f.corrupt(prod, self.cons));
        }
        let n = (avail as usize).min(max);
        for _ in 0..n {
            let s = self
                .f
                .mem
                .get(self.f.slot_addr(self.cons), 8)
                .map_err(self.f.err())?;
            let w = s
                .load::<u64>(0, Ordering::Relaxed)
                .map_err(|e| (self.f.err())(out_of_range(&self.f.label, e)))?;
            out.push(SignalWord(w));
            self.cons = self.cons.wrapping_add(1);
        }
        if n > 0 {
            self.f.store(fifo::CONS, self.cons, Ordering::Release)?;
        }
        Ok(n)
    }

    /// Sets or clears `CF_NO_NOTIFY` (the consumer polls while it is set).
    pub fn set_polling(&self, on: bool) -> Result<(), FifoError> {
        let v = if on { fifo::CF_NO_NOTIFY } else { 0 };
        self.f.store(fifo::CFLAGS, v, Ordering::Release)
    }

    /// Asks to be notified for the next word, then re-checks: `Ok(true)` if
    /// words arrived meanwhile (keep consuming instead of sleeping).
    pub fn arm(&self) -> Result<bool, FifoError> {
        self.f
            .store(fifo::EVENT_IDX, self.cons, Ordering::Release)?;
        self.f.store(fifo::CFLAGS, 0, Ordering::Release)?;
        fence(Ordering::SeqCst);
        let prod = self.f.load(fifo::PROD, Ordering::Acquire)?;
        Ok(prod != self.cons)
    }

    /// Whether the producer is holding words back for lack of space (then
    /// the consumer notifies it after consuming).
    pub fn producer_backlog(&self) -> Result<bool, FifoError> {
        Ok(self.f.load(fifo::PFLAGS, Ordering::Acquire)? & fifo::PF_BACKLOG != 0)
    }

    pub fn set_watermark(&self, w: u32) -> Result<(), FifoError> {
        self.f.store(fifo::WATERMARK, w.max(1), Ordering::Release)
    }

    pub fn cons(&self) -> u32 {
        self.cons
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::GuestMem;
    use crate::signal::SignalType;

    fn pair(entries: u32) -> (FifoProducer, FifoConsumer, Arc<dyn Memory>) {
        let (g, _f) = GuestMem::memfd("t-fifo", 0, 1 << 20).unwrap();
        let m: Arc<dyn Memory> = Arc::new(g);
        let c = FifoConsumer::new("c".into(), m.clone(), 4096, entries, 1).unwrap();
        let p = FifoProducer::new("p".into(), m.clone(), 4096, entries).unwrap();
        (p, c, m)
    }

    fn w(i: u32) -> SignalWord {
        SignalWord::encode(SignalType::Head, (i % 0xFFFF) as u16, i)
    }

    #[test]
    fn words_pass_in_order_and_wrap() {
        let (mut p, mut c, _m) = pair(64);
        let mut out = Vec::new();
        for round in 0..10u32 {
            for i in 0..50 {
                assert!(p.push(w(round * 50 + i)).unwrap());
            }
            out.clear();
            assert_eq!(c.pop(1000, &mut out).unwrap(), 50);
            assert_eq!(out, (0..50).map(|i| w(round * 50 + i)).collect::<Vec<_>>());
        }
    }

    #[test]
    fn one_notification_per_arming() {
        let (mut p, mut c, _m) = pair(64);
        // Armed at 0: the first burst notifies once, however long.
        for i in 0..10 {
            p.push(w(i)).unwrap();
        }
        assert!(p.flush().unwrap());
        p.push(w(10)).unwrap();
        assert!(!p.flush().unwrap(), "not re-armed yet");
        // Consumer drains and re-arms: the next burst notifies again.
        let mut out = Vec::new();
        c.pop(100, &mut out).unwrap();
        assert!(!c.arm().unwrap());
        p.push(w(11)).unwrap();
        p.push(w(12)).unwrap();
        assert!(p.flush().unwrap());
        // Polling consumer: never notified.
        c.pop(100, &mut out).unwrap();
        c.set_polling(true).unwrap();
        p.push(w(13)).unwrap();
        assert!(!p.flush().unwrap());
        // Arming while words are pending reports them instead of sleeping.
        assert!(c.arm().unwrap());
        assert_eq!(p.stats(), (14, 2));
    }

    #[test]
    fn watermark_triggers_early_flush() {
        let (mut p, c, _m) = pair(64);
        c.set_watermark(8).unwrap();
        for i in 0..7 {
            p.push(w(i)).unwrap();
            assert!(!p.past_watermark().unwrap());
        }
        p.push(w(7)).unwrap();
        assert!(p.past_watermark().unwrap());
        assert!(p.flush().unwrap());
        assert!(!p.past_watermark().unwrap(), "nothing new since the flush");
    }

    #[test]
    fn full_fifo_sets_backlog_instead_of_blocking() {
        let (mut p, mut c, _m) = pair(64);
        for i in 0..64 {
            assert!(p.push(w(i)).unwrap());
        }
        assert!(!p.push(w(64)).unwrap());
        assert!(c.producer_backlog().unwrap());
        let mut out = Vec::new();
        c.pop(10, &mut out).unwrap();
        assert!(p.push(w(64)).unwrap());
        p.clear_backlog().unwrap();
        assert!(!c.producer_backlog().unwrap());
    }

    #[test]
    fn flooded_or_corrupt_indices_are_errors() {
        let (_p, mut c, m) = pair(64);
        // A producer claiming 65 words in a 64-slot FIFO.
        m.get(4096 + fifo::PROD, 4)
            .unwrap()
            .store(65u32, 0, Ordering::Release)
            .unwrap();
        let mut out = Vec::new();
        assert!(matches!(
            c.pop(1000, &mut out),
            Err(FifoError::Corrupt { .. })
        ));
        assert!(out.is_empty());
        // A consumer index ahead of the producer, seen by the producer.
        let (mut p, _c, m) = pair(64);
        m.get(4096 + fifo::CONS, 4)
            .unwrap()
            .store(1000u32, 0, Ordering::Release)
            .unwrap();
        assert!(matches!(p.push(w(0)), Err(FifoError::Corrupt { .. })));
    }

    #[test]
    fn indices_wrap_at_u32_max() {
        let (mut p, mut c, m) = pair(64);
        // Start both ends just below u32::MAX.
        let start = u32::MAX - 20;
        p.prod = start;
        p.last_flush = start;
        c.cons = start;
        for (f, v) in [
            (fifo::PROD, start),
            (fifo::CONS, start),
            (fifo::EVENT_IDX, start),
        ] {
            m.get(4096 + f, 4)
                .unwrap()
                .store(v, 0, Ordering::Release)
                .unwrap();
        }
        for i in 0..50 {
            p.push(w(i)).unwrap();
        }
        assert!(p.flush().unwrap());
        let mut out = Vec::new();
        assert_eq!(c.pop(100, &mut out).unwrap(), 50);
        assert_eq!(out[49], w(49));
        assert_eq!(c.cons(), start.wrapping_add(50));
    }
}
