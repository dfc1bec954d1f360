//! The one descriptor-chain walk shared by every device that reads
//! guest-written split virtqueues: the NIC's dataplane and the VMM's own
//! virtio devices (virtio-net, virtio-blk).
//!
//! Per burst a device resolves its queue's rings once into host slices
//! ([`RingView`], through the translation cache [`Xlat`]); it takes the
//! available heads from the view ([`RingView::avail_heads`], in place of
//! virtio-queue's `AvailIter`, whose chain iterator would also follow an
//! indirect descriptor whatever was negotiated and end a malformed chain
//! silently), walks and splits each chain ([`RingView::walk`],
//! [`RingView::split_into`]), checks and copies its buffers
//! ([`Split::check_in_keep`], [`read_kept`]/[`write_kept`]) and returns the
//! burst with one used-index store ([`RingView::complete_used`]).
//! virtio-queue's `Queue` stays the holder of the queue state (addresses,
//! size, ready, next_avail, next_used).
//!
//! [`RingView::walk`] reads each descriptor exactly once (so a guest
//! rewriting the table meanwhile cannot slip a flag past a check) and ends
//! with an error when the chain is malformed:
//! - an indirect descriptor without VIRTIO_F_INDIRECT_DESC (virtio 1.2
//!   §2.7.5.3.2: the driver MUST NOT set the flag unless negotiated), a
//!   nested indirect table or one whose length is not a multiple of 16;
//! - a next index outside the table, a chain longer than the table (a
//!   loop), an indirect table not inside one memory region;
//! - more than 2^32 bytes in total (§2.7.5.2).

mod one;
mod segments;
#[cfg(test)]
mod testing;
mod used;
mod view;
mod xlat;

pub use one::OneBuf;
pub use segments::{
    read_bufs, read_kept, total, write_bufs, write_kept, Buf, CopyError, Kept, Prepare, Split,
    SplitError, KEPT,
};
use view::Slice;
pub use view::{AvailHeads, RingError, RingView};
use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT};
pub use virtio_queue::desc::split::Descriptor;
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestMemory, VolatileMemory};
pub use xlat::{HostRange, Xlat, XlatSlices};

/// Feature bit VIRTIO_F_INDIRECT_DESC (named VIRTIO_RING_F_INDIRECT_DESC in Linux).
pub const VIRTIO_F_INDIRECT_DESC: u32 = virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC;

/// Size of one split-ring descriptor.
const DESC_SIZE: u64 = 16;

/// Whether `features` (the negotiated set) allow indirect descriptors.
pub fn indirect_negotiated(features: u64) -> bool {
    features & (1u64 << VIRTIO_F_INDIRECT_DESC) != 0
}

/// How a chain is malformed. `head` is the chain's head index, `index` the
/// descriptor (in the table being walked) where the walk stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    #[error(
        "descriptor chain {head}: descriptor {index} is indirect (VRING_DESC_F_INDIRECT) \
         but VIRTIO_F_INDIRECT_DESC was not negotiated"
    )]
    IndirectNotNegotiated { head: u16, index: u16 },
    #[error("descriptor chain {head}: descriptor {index}: bad indirect table ({what})")]
    BadIndirect {
        head: u16,
        index: u16,
        what: &'static str,
    },
    #[error("descriptor chain {head}: next index {index} outside a table of {size}")]
    NextOutOfRange { head: u16, index: u16, size: u16 },
    #[error("descriptor chain {head}: longer than its table of {size} (a loop)")]
    Loop { head: u16, size: u16 },
    #[error("descriptor chain {head}: descriptor {index} at {addr:#x} is not in guest memory")]
    Unreadable { head: u16, index: u16, addr: u64 },
    #[error("descriptor chain {head}: more than 2^32 bytes")]
    TooLong { head: u16 },
}

/// Where one queue's rings are, how big, and what was negotiated: what a
/// device needs to resolve a [`RingView`] and walk its chains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ring {
    pub desc_table: GuestAddress,
    pub avail_ring: GuestAddress,
    pub used_ring: GuestAddress,
    pub size: u16,
    pub features: u64,
    /// VIRTIO_F_EVENT_IDX negotiated: the rings carry `used_event`/`avail_event`.
    pub event_idx: bool,
}

impl Ring {
    pub fn of(q: &impl QueueT, features: u64) -> Self {
        Ring {
            desc_table: GuestAddress(q.desc_table()),
            avail_ring: GuestAddress(q.avail_ring()),
            used_ring: GuestAddress(q.used_ring()),
            size: q.size(),
            features,
            event_idx: q.event_idx_enabled(),
        }
    }
}

impl<'m, M: GuestMemory + ?Sized> RingView<'m, M> {
    /// The descriptors of the chain starting at `head`, in order; an `Err`
    /// is the last item. Direct descriptors come from the resolved table,
    /// an indirect table is resolved (in one region) when the walk enters it.
    pub fn walk<'v>(&'v self, head: u16) -> Walk<'v, 'm, M> {
        Walk {
            view: self,
            indirect_ok: indirect_negotiated(self.ring.features),
            head,
            indirect: None,
            size: self.ring.size,
            next: Some(head),
            ttl: self.ring.size,
            bytes: 0,
        }
    }
}

/// Iterator of [`RingView::walk`]; fused after the chain's end or an error.
#[derive(Debug)]
pub struct Walk<'v, 'm, M: GuestMemory + ?Sized> {
    view: &'v RingView<'m, M>,
    indirect_ok: bool,
    head: u16,
    /// The indirect table being walked, once the chain entered one.
    indirect: Option<Slice<'m, M>>,
    size: u16,
    next: Option<u16>,
    /// Descriptors left before the chain counts as a loop.
    ttl: u16,
    bytes: u32,
}

impl<M: GuestMemory + ?Sized> Walk<'_, '_, M> {
    /// Descriptor `index` (< size) of the table being walked: one volatile load.
    fn load(&self, index: u16) -> Option<Descriptor> {
        match &self.indirect {
            None => self.view.descriptor(index),
            Some(t) => t
                .get_ref::<Descriptor>(usize::from(index) * DESC_SIZE as usize)
                .ok()
                .map(|r| r.load()),
        }
    }

    fn step(&mut self, index: u16) -> Result<Descriptor, ChainError> {
        let head = self.head;
        if index >= self.size {
            return Err(ChainError::NextOutOfRange {
                head,
                index,
                size: self.size,
            });
        }
        if self.ttl == 0 {
            return Err(ChainError::Loop {
                head,
                size: self.size,
            });
        }
        self.ttl -= 1;
        let d = self.load(index).ok_or(ChainError::Unreadable {
            head,
            index,
            addr: self.view.ring.desc_table.0 + u64::from(index) * DESC_SIZE,
        })?;
        let flags = u32::from(d.flags());
        if flags & VRING_DESC_F_INDIRECT != 0 {
            if !self.indirect_ok {
                return Err(ChainError::IndirectNotNegotiated { head, index });
            }
            let bad = |what| ChainError::BadIndirect { head, index, what };
            if self.indirect.is_some() {
                return Err(bad("indirect descriptor inside an indirect table"));
            }
            if flags & VRING_DESC_F_NEXT != 0 {
                return Err(bad("indirect descriptor with NEXT"));
            }
            let len = u64::from(d.len());
            if len == 0 || len % DESC_SIZE != 0 || len / DESC_SIZE > u64::from(u16::MAX) {
                return Err(bad(
                    "length not a non-zero multiple of 16 up to 65535 entries",
                ));
            }
            // The whole table in one region, resolved once for the walk.
            let table = view::contiguous(self.view.mem, d.addr().0, len as usize).ok_or(
                ChainError::Unreadable {
                    head,
                    index,
                    addr: d.addr().0,
                },
            )?;
            self.indirect = Some(table);
            self.size = (len / DESC_SIZE) as u16;
            self.ttl = self.size;
            return self.step(0);
        }
        self.bytes = self
            .bytes
            .checked_add(d.len())
            .ok_or(ChainError::TooLong { head })?;
        self.next = (flags & VRING_DESC_F_NEXT != 0).then(|| d.next());
        Ok(d)
    }
}

impl<M: GuestMemory + ?Sized> Iterator for Walk<'_, '_, M> {
    type Item = Result<Descriptor, ChainError>;

    fn next(&mut self) -> Option<Self::Item> {
        let index = self.next.take()?;
        Some(self.step(index))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{mem_with, ring, write_table, INDIRECT, NEXT, WRITE};
    use vm_memory::GuestMemoryMmap;

    const T: Ring = ring(8, 0);

    /// (addr, len) of every descriptor, or the error that ended the walk.
    fn walk(r: &Ring, m: &GuestMemoryMmap, head: u16) -> Result<Vec<(u64, u32)>, ChainError> {
        RingView::resolve(r, m)
            .unwrap()
            .walk(head)
            .map(|d| d.map(|d| (d.addr().0, d.len())))
            .collect()
    }

    #[test]
    fn a_direct_chain_is_walked_in_order() {
        let m = mem_with(&[(0x4000, 16, NEXT, 2), (0, 0, 0, 0), (0x5000, 32, WRITE, 0)]);
        assert_eq!(walk(&T, &m, 0), Ok(vec![(0x4000, 16), (0x5000, 32)]));
        assert_eq!(walk(&T, &m, 2), Ok(vec![(0x5000, 32)]));
    }

    #[test]
    fn indirect_is_refused_unless_negotiated() {
        let m = mem_with(&[(0x4000, 16, NEXT, 1), (0x6000, 32, INDIRECT, 0)]);
        write_table(&m, 0x6000, &[(0x7000, 8, NEXT, 1), (0x8000, 64, WRITE, 0)]);
        assert_eq!(
            walk(&T, &m, 0),
            Err(ChainError::IndirectNotNegotiated { head: 0, index: 1 })
        );
        assert_eq!(
            walk(&T, &m, 1),
            Err(ChainError::IndirectNotNegotiated { head: 1, index: 1 })
        );
        // Negotiated, the table is followed.
        let negotiated = Ring {
            features: 1 << VIRTIO_F_INDIRECT_DESC,
            ..T
        };
        assert_eq!(
            walk(&negotiated, &m, 0),
            Ok(vec![(0x4000, 16), (0x7000, 8), (0x8000, 64)])
        );
        // ... but not a nested one, one with NEXT, or one of a bad length.
        for (table, what) in [
            ((0x6000, 16, INDIRECT, 0), "inside"),
            ((0x7000, 8, 0, 0), ""),
        ] {
            write_table(&m, 0x6000, &[table]);
            let r = walk(&negotiated, &m, 1);
            assert_eq!(r.is_err(), !what.is_empty(), "{r:?}");
        }
        let m = mem_with(&[(0x6000, 16, INDIRECT | NEXT, 1), (0x6000, 24, INDIRECT, 0)]);
        assert!(matches!(
            walk(&negotiated, &m, 0),
            Err(ChainError::BadIndirect { index: 0, .. })
        ));
        assert!(matches!(
            walk(&negotiated, &m, 1),
            Err(ChainError::BadIndirect { index: 1, .. })
        ));
    }

    #[test]
    fn malformed_chains_end_with_an_error() {
        // A loop ends after `size` descriptors.
        let m = mem_with(&[(0x4000, 16, NEXT, 1), (0x4000, 16, NEXT, 0)]);
        assert_eq!(walk(&T, &m, 0), Err(ChainError::Loop { head: 0, size: 8 }));
        // Next index or head out of range.
        let m = mem_with(&[(0x4000, 16, NEXT, 200)]);
        assert_eq!(
            walk(&T, &m, 0),
            Err(ChainError::NextOutOfRange {
                head: 0,
                index: 200,
                size: 8
            })
        );
        assert!(matches!(
            walk(&T, &m, 9),
            Err(ChainError::NextOutOfRange { index: 9, .. })
        ));
        // A table outside guest memory is refused when the view is resolved
        // (view::tests); an indirect table outside it ends the walk.
        let m = mem_with(&[(0x20000, 32, INDIRECT, 0)]);
        let negotiated = Ring {
            features: 1 << VIRTIO_F_INDIRECT_DESC,
            ..T
        };
        assert_eq!(
            walk(&negotiated, &m, 0),
            Err(ChainError::Unreadable {
                head: 0,
                index: 0,
                addr: 0x20000
            })
        );
        // More than 2^32 bytes.
        let m = mem_with(&[(0, u32::MAX, NEXT, 1), (0, 2, 0, 0)]);
        assert_eq!(walk(&T, &m, 0), Err(ChainError::TooLong { head: 0 }));
        // The walk stops after the error.
        let m = mem_with(&[(0x4000, 16, NEXT, 9)]);
        let v = RingView::resolve(&T, &m).unwrap();
        let mut w = v.walk(0);
        assert!(matches!(w.next(), Some(Ok(_))));
        assert!(matches!(w.next(), Some(Err(_))));
        assert!(w.next().is_none());
    }
}
