//! The `dedicated` signal plane, for comparison with the Cross-FIFO (the
//! SR-IOV model): every pipe (socket) has its own pair of signal FIFOs in
//! its guest's memory and its own doorbell and interrupt eventfds (over
//! vhost-user: vrings 2 + k of the SGF session, KICK/CALL only), as an
//! SR-IOV VF has its own queues, doorbell and MSI-X vector. The device
//! finds work by polling every channel of the SGF, so its cost per round
//! and the daemon's fd count grow with the number of pipes: the scaling the
//! Cross-FIFO removes. `bench sgiov latency --modes dedicated` runs it.
//!
//! A channel word may only name its own pipe's two ring ids: anything else
//! is counted and puts that pipe into error (see `Sgf::consume`). Control
//! messages stay on the Cross-FIFO's control rings.
//!
//! The FIFOs use the same [`FifoCtl`](crate::layout::FifoCtl) layout and
//! protocol as the Cross-FIFO, one pair per channel.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::fifo::{FifoConsumer, FifoError, FifoProducer};
use crate::layout::fifo;
use crate::mem::Memory;
use crate::signal::{RingId, SignalWord};

/// vhost-user carries a vring index in 8 bits: 256 vrings per session, of
/// which the SGF's setup and signal queues take two.
pub const MAX_CHANNELS: usize = 254;

/// Guest memory of one channel: two FIFOs of `entries` slots (guest →
/// device first).
pub fn channel_bytes(entries: u32) -> u64 {
    2 * fifo::bytes(entries)
}

/// One pipe's own signal channel, device side.
#[derive(Debug)]
pub struct Channel {
    /// The pipe's rings: the only ids its words may name.
    pub tx: RingId,
    pub rx: RingId,
    pub base: u64,
    g2d: FifoConsumer,
    d2g: FifoProducer,
    /// Words were pushed to its guest since the last flush.
    pushed: bool,
    /// A push found its FIFO full during the current flush.
    full: bool,
}

impl Channel {
    /// Takes over the device-owned fields of the channel at `at`.
    pub fn new(
        mem: Arc<dyn Memory>,
        at: u64,
        entries: u32,
        tx: RingId,
        rx: RingId,
    ) -> Result<Channel, FifoError> {
        Ok(Channel {
            tx,
            rx,
            base: at,
            g2d: FifoConsumer::new(
                format!("channel of ring {tx} g2d"),
                mem.clone(),
                at,
                entries,
                1,
            )?,
            d2g: FifoProducer::new(
                format!("channel of ring {tx} d2g"),
                mem,
                at + fifo::bytes(entries),
                entries,
            )?,
            pushed: false,
            full: false,
        })
    }

    /// Whether a word of this channel may name `ring`.
    pub fn owns(&self, ring: RingId) -> bool {
        ring == self.tx || ring == self.rx
    }
}

/// The channels of one SGF, by channel index.
#[derive(Debug, Default)]
pub struct DedicatedPlane {
    chans: BTreeMap<u16, Channel>,
    scanned: u64,
}

impl DedicatedPlane {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&mut self, k: u16, c: Channel) {
        self.chans.insert(k, c);
    }

    pub fn remove(&mut self, k: u16) -> Option<Channel> {
        self.chans.remove(&k)
    }

    pub fn contains(&self, k: u16) -> bool {
        self.chans.contains_key(&k)
    }

    pub fn get(&self, k: u16) -> Option<&Channel> {
        self.chans.get(&k)
    }

    pub fn len(&self) -> usize {
        self.chans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.chans.is_empty()
    }

    /// Channels looked at so far (the polling cost).
    pub fn scanned(&self) -> u64 {
        self.scanned
    }

    /// One polling round over every channel: collects the words found as
    /// (channel, word) and re-arms each channel; a channel whose FIFO is
    /// corrupt goes to `bad`. Returns whether words raced in after a
    /// re-arm (poll again).
    pub fn poll(&mut self, out: &mut Vec<(u16, SignalWord)>, bad: &mut Vec<u16>) -> bool {
        let mut again = false;
        let mut words = Vec::new();
        for (&k, c) in self.chans.iter_mut() {
            self.scanned += 1;
            words.clear();
            let r = c.g2d.pop(usize::MAX, &mut words).and_then(|_| c.g2d.arm());
            match r {
                Ok(raced) => again |= raced,
                Err(_) => bad.push(k),
            }
            out.extend(words.iter().map(|w| (k, *w)));
        }
        again
    }

    /// Pushes a word to channel `k`'s guest. `Ok(false)`: its FIFO is full
    /// (or the channel is gone); the caller keeps the word pending.
    pub fn push(&mut self, k: u16, w: SignalWord) -> Result<bool, FifoError> {
        let Some(c) = self.chans.get_mut(&k) else {
            return Ok(false);
        };
        if c.full || !c.d2g.push(w)? {
            c.full = true;
            return Ok(false);
        }
        c.pushed = true;
        Ok(true)
    }

    /// Ends a flush: the channels whose guests asked to be interrupted for
    /// what was pushed (their call eventfds fire).
    pub fn flush(&mut self, irqs: &mut Vec<u16>) -> Result<(), FifoError> {
        for (&k, c) in self.chans.iter_mut() {
            if !c.full {
                c.d2g.clear_backlog()?;
            }
            let pushed = std::mem::take(&mut c.pushed);
            c.full = false;
            if pushed && c.d2g.flush()? {
                irqs.push(k);
            }
        }
        Ok(())
    }

    /// The guest waits for room in channel `k`'s guest → device FIFO.
    pub fn producer_backlog(&self, k: u16) -> bool {
        self.chans
            .get(&k)
            .is_some_and(|c| c.g2d.producer_backlog().unwrap_or(false))
    }
}

/// The guest end of one channel.
#[derive(Debug)]
pub struct GuestChannel {
    g2d: FifoProducer,
    d2g: FifoConsumer,
    /// Words that did not fit the FIFO yet.
    backlog: Vec<SignalWord>,
}

impl GuestChannel {
    /// Initializes the guest-owned fields of the channel at `at`.
    pub fn new(mem: Arc<dyn Memory>, at: u64, entries: u32) -> Result<Self, FifoError> {
        Ok(GuestChannel {
            g2d: FifoProducer::new("guest channel g2d".into(), mem.clone(), at, entries)?,
            d2g: FifoConsumer::new(
                "guest channel d2g".into(),
                mem,
                at + fifo::bytes(entries),
                entries,
                1,
            )?,
            backlog: Vec::new(),
        })
    }

    /// Pushes a word (held back while the FIFO is full).
    pub fn push(&mut self, w: SignalWord) -> Result<(), FifoError> {
        if !self.backlog.is_empty() || !self.g2d.push(w)? {
            self.backlog.push(w);
        }
        Ok(())
    }

    /// Ends a burst: pushes held-back words; whether the doorbell must be rung.
    pub fn flush(&mut self) -> Result<bool, FifoError> {
        self.g2d.push_held(&mut self.backlog)?;
        self.g2d.flush()
    }

    /// Drains device → guest words and re-arms. Returns whether the device
    /// holds words back for lack of room (ring its doorbell).
    pub fn receive(&mut self, out: &mut Vec<SignalWord>) -> Result<bool, FifoError> {
        loop {
            self.d2g.pop(usize::MAX, out)?;
            if !self.d2g.arm()? {
                return self.d2g.producer_backlog();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::GuestMem;
    use crate::signal::SignalType;

    #[test]
    fn every_channel_is_polled_and_interrupts_its_own_guest() {
        let (g, _f) = GuestMem::memfd("t-dedicated", 0, 1 << 20).unwrap();
        let mem: Arc<dyn Memory> = Arc::new(g);
        let mut plane = DedicatedPlane::new();
        let mut guests = Vec::new();
        for k in 0..64u16 {
            let at = k as u64 * channel_bytes(64);
            guests.push(GuestChannel::new(mem.clone(), at, 64).unwrap());
            let (tx, rx) = (2 + 2 * k, 3 + 2 * k);
            plane.insert(k, Channel::new(mem.clone(), at, 64, tx, rx).unwrap());
        }
        for k in [3usize, 17, 60] {
            let tx = 2 + 2 * k as u16;
            guests[k]
                .push(SignalWord::encode(SignalType::Head, tx, 100))
                .unwrap();
            assert!(
                guests[k].flush().unwrap(),
                "an armed channel wants its doorbell"
            );
        }
        let (mut out, mut bad) = (Vec::new(), Vec::new());
        assert!(!plane.poll(&mut out, &mut bad));
        assert!(bad.is_empty());
        assert_eq!(plane.scanned(), 64, "one round looks at every channel");
        assert_eq!(
            out.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
            vec![3, 17, 60]
        );
        // Device → guest: only channel 17 asks for its interrupt.
        assert!(plane
            .push(17, SignalWord::encode(SignalType::Tail, 36, 100))
            .unwrap());
        let mut irqs = Vec::new();
        plane.flush(&mut irqs).unwrap();
        assert_eq!(irqs, vec![17]);
        let mut got = Vec::new();
        assert!(!guests[17].receive(&mut got).unwrap());
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].ptr(), 100);
    }
}
