//! Returning a burst of chains to the driver: every used element written,
//! then the used index published once (one release store, not one per
//! chain), then one notification decision for the whole burst (virtio 1.2
//! §2.7.7.2 and §2.7.10): with VIRTIO_F_EVENT_IDX the driver's `used_event`
//! decides; without it the device does not notify while the driver set
//! VRING_AVAIL_F_NO_INTERRUPT (a poll-mode driver, e.g. DPDK's virtio PMD),
//! which virtio-queue's own `needs_notification` ignores.

use std::num::Wrapping;
use std::sync::atomic::{fence, Ordering};

use virtio_bindings::virtio_ring::VRING_AVAIL_F_NO_INTERRUPT;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestMemory, VolatileMemory};

use crate::view::{AVAIL_ENTRY, HEADER, IDX};
use crate::{RingError, RingView};

impl<M: GuestMemory + ?Sized> RingView<'_, M> {
    /// Adds `used` ((head, written length) per chain, in order) to `q`'s
    /// used ring, publishes the new used index once and moves `q`'s next
    /// used index. Returns whether the driver wants a notification for
    /// them. Nothing is written when a head is out of range.
    pub fn complete_used(
        &self,
        q: &mut impl QueueT,
        used: &[(u16, u32)],
    ) -> Result<bool, RingError> {
        let (next, notify) = self.complete(q.next_used(), used)?;
        q.set_next_used(next);
        Ok(notify)
    }

    /// Writes the burst's used elements ((head, written length) per chain,
    /// in order) from `next_used` on, publishes the new used index with one
    /// Release store, and returns it with whether the driver wants a
    /// notification (virtio 1.2 §2.7.7.2, §2.7.10: with EVENT_IDX its
    /// `used_event` decides, otherwise VRING_AVAIL_F_NO_INTERRUPT). Nothing
    /// is written when a head is out of range.
    fn complete(&self, next_used: u16, used: &[(u16, u32)]) -> Result<(u16, bool), RingError> {
        if used.is_empty() {
            return Ok((next_used, false));
        }
        let size = self.ring.size;
        if let Some(&(head, _)) = used.iter().find(|&&(h, _)| h >= size) {
            return Err(RingError::HeadOutOfRange { head, size });
        }
        let old = Wrapping(next_used);
        let mut next = old;
        for &(head, len) in used {
            self.put_used(next.0, head, len);
            next += Wrapping(1);
        }
        if self
            .used
            .store(next.0.to_le(), IDX, Ordering::Release)
            .is_err()
        {
            fence(Ordering::Release);
            self.used
                .get_ref::<u16>(IDX)
                .expect("resolved header")
                .store(next.0.to_le());
        }
        // The index is visible before the driver's notification wish is read
        // (pairs with the driver's barrier between its flag/event write and
        // its used-index read).
        fence(Ordering::SeqCst);
        let notify = if self.ring.event_idx {
            let off = HEADER + usize::from(size) * AVAIL_ENTRY;
            let event = Wrapping(self.load_u16(&self.avail, off, Ordering::Relaxed));
            // vring_need_event: `event` lies in [old, next).
            next - event - Wrapping(1) < next - old
        } else {
            let flags = self.load_u16(&self.avail, 0, Ordering::Relaxed);
            u32::from(flags) & VRING_AVAIL_F_NO_INTERRUPT == 0
        };
        Ok((next.0, notify))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Ring;
    use virtio_queue::Queue;
    use vm_memory::{GuestAddress, GuestMemoryMmap};

    fn complete_used(
        q: &mut Queue,
        m: &GuestMemoryMmap,
        used: &[(u16, u32)],
    ) -> Result<bool, RingError> {
        RingView::resolve(&Ring::of(q, 0), m)
            .unwrap()
            .complete_used(q, used)
    }

    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;
    const SIZE: u16 = 4;

    fn ring(event_idx: bool) -> (GuestMemoryMmap, Queue) {
        let m = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let mut q = Queue::new(SIZE).unwrap();
        q.set_size(SIZE);
        q.set_desc_table_address(Some(0x1000), Some(0));
        q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
        q.set_used_ring_address(Some(USED as u32), Some(0));
        q.set_event_idx(event_idx);
        q.set_ready(true);
        (m, q)
    }

    fn used_idx(m: &GuestMemoryMmap) -> u16 {
        m.read_obj(GuestAddress(USED + 2)).unwrap()
    }

    #[test]
    fn a_burst_is_written_in_order_and_published_once_across_the_wrap() {
        let (m, mut q) = ring(false);
        q.set_next_used(3);
        assert!(complete_used(&mut q, &m, &[(1, 60), (2, 0), (0, 1514)]).unwrap());
        assert_eq!((q.next_used(), used_idx(&m)), (6, 6));
        // Slots 3, 0, 1 of a 4-entry ring.
        for (slot, id, len) in [(3u64, 1u32, 60u32), (0, 2, 0), (1, 0, 1514)] {
            let e = USED + 4 + slot * 8;
            assert_eq!(m.read_obj::<u32>(GuestAddress(e)).unwrap(), id);
            assert_eq!(m.read_obj::<u32>(GuestAddress(e + 4)).unwrap(), len);
        }
        // Nothing to return: no write, no notification.
        assert!(!complete_used(&mut q, &m, &[]).unwrap());
        // A head out of range refuses the whole burst before writing.
        assert!(matches!(
            complete_used(&mut q, &m, &[(0, 1), (SIZE, 1)]),
            Err(RingError::HeadOutOfRange {
                head: SIZE,
                size: SIZE
            })
        ));
        assert_eq!((q.next_used(), used_idx(&m)), (6, 6));
    }

    #[test]
    fn no_interrupt_flag_suppresses_the_notification() {
        let (m, mut q) = ring(false);
        m.write_obj(VRING_AVAIL_F_NO_INTERRUPT as u16, GuestAddress(AVAIL))
            .unwrap();
        assert!(!complete_used(&mut q, &m, &[(0, 1)]).unwrap());
        assert_eq!(used_idx(&m), 1, "still published");
        m.write_obj(0u16, GuestAddress(AVAIL)).unwrap();
        assert!(complete_used(&mut q, &m, &[(1, 1)]).unwrap());
    }

    #[test]
    fn event_idx_notifies_when_used_event_was_crossed() {
        let (m, mut q) = ring(true);
        let used_event = GuestAddress(AVAIL + 4 + 2 * u64::from(SIZE));
        // The driver wants a notification once entry 2 is used (index 3).
        m.write_obj(2u16, used_event).unwrap();
        assert!(!complete_used(&mut q, &m, &[(0, 1), (1, 1)]).unwrap()); // 0 -> 2
        assert!(complete_used(&mut q, &m, &[(2, 1), (3, 1)]).unwrap()); // 2 -> 4
        assert!(!complete_used(&mut q, &m, &[(0, 1)]).unwrap()); // 4 -> 5
                                                                 // The flag does not matter with EVENT_IDX.
        m.write_obj(VRING_AVAIL_F_NO_INTERRUPT as u16, GuestAddress(AVAIL))
            .unwrap();
        m.write_obj(5u16, used_event).unwrap();
        assert!(complete_used(&mut q, &m, &[(1, 1)]).unwrap()); // 5 -> 6
    }
}
