//! The `dedicated` signal plane, for comparison with the Cross-FIFO: every
//! pipe has its own pair of signal FIFOs and its own two eventfds (doorbell
//! and interrupt), as an SR-IOV VF has its own queues, doorbell and MSI-X
//! vector. The device finds work by polling every channel, so its cost per
//! round and its fd count grow with the number of pipes — the scaling the
//! Cross-FIFO removes. Stage 2's `bench sgiov latency` runs both.
//!
//! The FIFOs use the same [`FifoCtl`](crate::layout::FifoCtl) layout and
//! protocol as the Cross-FIFO, one pair per channel.

use std::sync::Arc;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::fifo::{FifoConsumer, FifoError, FifoProducer};
use crate::layout::fifo;
use crate::mem::Memory;
use crate::signal::{RingId, SignalWord};

#[derive(Debug, thiserror::Error)]
pub enum DedicatedError {
    #[error("dedicated channel {0}: FIFO")]
    Fifo(RingId, #[source] FifoError),
    #[error("dedicated channel {0}: eventfd")]
    EventFd(RingId, #[source] std::io::Error),
}

/// Guest memory of one channel: two FIFOs of `entries` slots.
pub fn channel_bytes(entries: u32) -> u64 {
    2 * fifo::bytes(entries)
}

/// One pipe's own signal channel, device side.
pub struct Channel {
    pub ring: RingId,
    g2d: FifoConsumer,
    d2g: FifoProducer,
    /// Doorbell (guest → device) and interrupt (device → guest).
    pub kick: EventFd,
    pub call: EventFd,
}

/// All channels of the device.
#[derive(Default)]
pub struct DedicatedPlane {
    chans: Vec<Channel>,
    scanned: u64,
}

impl DedicatedPlane {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a channel whose two FIFOs are at `at` in `mem` (guest → device
    /// first, then device → guest, [`channel_bytes`] in all).
    pub fn add(
        &mut self,
        ring: RingId,
        mem: Arc<dyn Memory>,
        at: u64,
        entries: u32,
    ) -> Result<usize, DedicatedError> {
        let e = |x| DedicatedError::Fifo(ring, x);
        let g2d = FifoConsumer::new(format!("channel {ring} g2d"), mem.clone(), at, entries, 1)
            .map_err(e)?;
        let d2g = FifoProducer::new(
            format!("channel {ring} d2g"),
            mem,
            at + fifo::bytes(entries),
            entries,
        )
        .map_err(e)?;
        let fd = || EventFd::new(EFD_NONBLOCK).map_err(|x| DedicatedError::EventFd(ring, x));
        self.chans.push(Channel {
            ring,
            g2d,
            d2g,
            kick: fd()?,
            call: fd()?,
        });
        Ok(self.chans.len() - 1)
    }

    pub fn len(&self) -> usize {
        self.chans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.chans.is_empty()
    }

    /// File descriptors the plane holds: two per channel.
    pub fn fds(&self) -> usize {
        2 * self.chans.len()
    }

    /// Channels looked at so far (the polling cost).
    pub fn scanned(&self) -> u64 {
        self.scanned
    }

    /// One polling round over every channel: collects the words found as
    /// (channel, word). Returns the words found.
    pub fn poll(&mut self, out: &mut Vec<(usize, SignalWord)>) -> Result<usize, DedicatedError> {
        let mut found = 0;
        let mut words = Vec::new();
        for (i, c) in self.chans.iter_mut().enumerate() {
            self.scanned += 1;
            words.clear();
            found += c
                .g2d
                .pop(usize::MAX, &mut words)
                .map_err(|e| DedicatedError::Fifo(c.ring, e))?;
            out.extend(words.iter().map(|w| (i, *w)));
        }
        Ok(found)
    }

    /// Sends a word to channel `i`'s guest and raises its interrupt if the
    /// guest asked for one. Returns false if its FIFO is full.
    pub fn send(&mut self, i: usize, w: SignalWord) -> Result<bool, DedicatedError> {
        let c = &mut self.chans[i];
        let e = |x| DedicatedError::Fifo(c.ring, x);
        if !c.d2g.push(w).map_err(e)? {
            return Ok(false);
        }
        if c.d2g.flush().map_err(e)? {
            c.call
                .write(1)
                .map_err(|x| DedicatedError::EventFd(c.ring, x))?;
        }
        Ok(true)
    }

    pub fn channel(&self, i: usize) -> &Channel {
        &self.chans[i]
    }
}

/// The guest end of one channel.
pub struct GuestChannel {
    g2d: FifoProducer,
    d2g: FifoConsumer,
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
        })
    }

    /// Pushes a word; returns whether the doorbell must be rung.
    pub fn signal(&mut self, w: SignalWord) -> Result<bool, FifoError> {
        self.g2d.push(w)?;
        self.g2d.flush()
    }

    pub fn receive(&mut self, out: &mut Vec<SignalWord>) -> Result<usize, FifoError> {
        let n = self.d2g.pop(usize::MAX, out)?;
        self.d2g.arm()?;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::GuestMem;
    use crate::signal::SignalType;

    #[test]
    fn every_channel_is_polled_and_has_its_own_fds() {
        let (g, _f) = GuestMem::memfd("t-dedicated", 0, 1 << 20).unwrap();
        let mem: Arc<dyn Memory> = Arc::new(g);
        let mut plane = DedicatedPlane::new();
        let mut guests = Vec::new();
        for i in 0..64u16 {
            let at = i as u64 * channel_bytes(64);
            guests.push(GuestChannel::new(mem.clone(), at, 64).unwrap());
            plane.add(i + 2, mem.clone(), at, 64).unwrap();
        }
        assert_eq!(plane.fds(), 128);
        for i in [3usize, 17, 60] {
            let kick = guests[i]
                .signal(SignalWord::encode(SignalType::Head, i as u16 + 2, 100))
                .unwrap();
            assert!(kick);
        }
        let mut out = Vec::new();
        assert_eq!(plane.poll(&mut out).unwrap(), 3);
        assert_eq!(plane.scanned(), 64, "one round looks at every channel");
        assert_eq!(
            out.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            vec![3, 17, 60]
        );
        // Device → guest: the interrupt eventfd of that channel fires.
        assert!(plane
            .send(17, SignalWord::encode(SignalType::Tail, 19, 100))
            .unwrap());
        assert_eq!(plane.channel(17).call.read().unwrap(), 1);
        let mut got = Vec::new();
        assert_eq!(guests[17].receive(&mut got).unwrap(), 1);
        assert_eq!(got[0].ptr(), 100);
    }
}
