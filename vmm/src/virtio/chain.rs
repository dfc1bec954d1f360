//! Descriptor chains: the VMM's devices' door to `virtq` (shared with the
//! NIC's dataplane). Per burst a device resolves its queue's rings once
//! ([`View`], through the translation cache), takes the available heads
//! from it and returns them with one `complete_used`; `virtq` walks each
//! chain and refuses malformed ones
//! (indirect without the feature, loops, bad next indexes), splits it into its device-readable head and
//! device-writable tail (virtio 1.2 §2.7.4.2) and moves bytes between it and
//! the device one segment at a time, each checked by vm-memory. Every range
//! is prepared before
//! the device reads or writes it (`GuestMemory::prepare_for_device_write`):
//! a page the guest never touched may still hold a previous tenant's bytes
//! under lazy zeroing, and a device write must not be wiped by a later fault.

use vm_memory::GuestMemoryMmap;

/// Called with (gpa, len) before the device reads or writes there; an error stops the access.
pub type PrepareWrite = dyn Fn(u64, u64) -> Result<(), guestmem::Error> + Send + Sync;

/// The device's `PrepareWrite`: `GuestMemory::prepare_for_device_write` of its VM.
pub fn prepare_for(ctx: &crate::bus::DeviceContext) -> std::sync::Arc<PrepareWrite> {
    let guestmem = ctx.guestmem.clone();
    std::sync::Arc::new(move |gpa, len| guestmem.prepare_for_device_write(gpa, len))
}

pub use virtq::{total, CopyError, Split, SplitError};

/// A VM's memory table through the translation cache, for one burst.
pub type Xlat<'m> = virtq::Xlat<'m, GuestMemoryMmap>;
/// One queue's rings resolved in it, for one burst.
pub type View<'v, 'm> = virtq::RingView<'v, Xlat<'m>>;

/// `q`'s rings resolved in `gm` for one burst, or `None` (logged, naming
/// `queue`) when they are not inside one memory region.
pub fn view<'v, 'm>(
    gm: &'v Xlat<'m>,
    q: &virtio_queue::Queue,
    features: u64,
    queue: &dyn std::fmt::Display,
) -> Option<View<'v, 'm>> {
    View::resolve(&virtq::Ring::of(q, features), gm)
        .inspect_err(|e| tracing::warn!("{queue}: {e}"))
        .ok()
}

/// Serves every available chain of `queue` in bursts (virtio-blk,
/// virtio-rng): `serve` answers one head with its used length, and each
/// burst's heads go back with one used-index store; a head outside the ring
/// has no used slot to return. Returns whether the guest asked to be
/// interrupted. `what` names the queue in logs.
pub fn serve_available(
    view: &View<'_, '_>,
    queue: &mut virtio_queue::Queue,
    used: &mut Vec<(u16, u32)>,
    what: &dyn std::fmt::Display,
    mut serve: impl FnMut(u16) -> u32,
) -> bool {
    let mut notify = false;
    loop {
        let heads = match view.avail_heads(queue, usize::MAX) {
            Ok(h) if !h.is_empty() => h,
            Ok(_) => break,
            Err(e) => {
                tracing::warn!("{what}: {e}");
                break;
            }
        };
        used.clear();
        for head in heads {
            let len = serve(head);
            if head < view.size() {
                used.push((head, len));
            }
        }
        match view.complete_used(queue, used) {
            Ok(n) => notify |= n,
            Err(e) => tracing::warn!("{what}: used ring: {e}"),
        }
    }
    notify
}

#[cfg(test)]
pub(crate) mod tests {
    use virtio_queue::{Queue, QueueT};
    use vm_memory::{Bytes, GuestAddress};

    use super::*;
    use virtq::Buf;

    pub const DESC: u64 = 0x1000;
    pub const AVAIL: u64 = 0x2000;
    pub const USED: u64 = 0x3000;
    pub const MEM_SIZE: u64 = 0x10000;
    pub const F_NEXT: u16 = 1;
    pub const F_WRITE: u16 = 2;

    /// `q`'s rings resolved in `m`, and the first available head.
    pub fn first_chain<'m>(
        m: &'m GuestMemoryMmap,
        q: &mut Queue,
        features: u64,
    ) -> (virtq::RingView<'m, GuestMemoryMmap>, u16) {
        let v = virtq::RingView::resolve(&virtq::Ring::of(&*q, features), m).unwrap();
        let head = v.avail_heads(q, 1).unwrap().next().unwrap();
        (v, head)
    }

    pub fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap()
    }

    /// Write descriptors 0.. and make descriptor 0 the only available chain.
    pub fn queue_with(mem: &GuestMemoryMmap, descs: &[(u64, u32, u16, u16)]) -> Queue {
        for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
            let at = GuestAddress(DESC + 16 * i as u64);
            mem.write_obj(addr, at).unwrap();
            mem.write_obj(len, GuestAddress(at.0 + 8)).unwrap();
            mem.write_obj(flags, GuestAddress(at.0 + 12)).unwrap();
            mem.write_obj(next, GuestAddress(at.0 + 14)).unwrap();
        }
        mem.write_obj(0u16, GuestAddress(AVAIL)).unwrap();
        mem.write_obj(1u16, GuestAddress(AVAIL + 2)).unwrap();
        mem.write_obj(0u16, GuestAddress(AVAIL + 4)).unwrap();
        let mut q = Queue::new(16).unwrap();
        q.set_size(8);
        q.set_desc_table_address(Some(DESC as u32), Some(0));
        q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
        q.set_used_ring_address(Some(USED as u32), Some(0));
        q.set_ready(true);
        assert!(q.is_valid(mem));
        q
    }

    #[test]
    fn split_orders_and_pieces_cover_ranges() {
        let m = mem();
        let mut q = queue_with(
            &m,
            &[
                (0x4000, 16, F_NEXT, 1),
                (0x5000, 8, F_WRITE | F_NEXT, 2),
                (0x6000, 1, F_WRITE, 0),
            ],
        );
        let (v, head) = first_chain(&m, &mut q, 0);
        let s = v.split(head).unwrap();
        assert_eq!(
            s.readable,
            vec![Buf {
                addr: 0x4000,
                len: 16
            }]
        );
        assert_eq!(s.writable.len(), 2);
        assert_eq!(total(&s.writable), 9);
        let pieces = std::sync::Mutex::new(Vec::new());
        let record = |a, n| {
            pieces.lock().unwrap().push((a, n));
            Ok::<(), guestmem::Error>(())
        };
        virtq::read_bufs(&m, &record, &s.writable, 6, &mut [0u8; 3]).unwrap();
        assert_eq!(*pieces.lock().unwrap(), vec![(0x5006, 2), (0x6000, 1)]);
        assert!(virtq::read_bufs(&m, &record, &s.writable, 6, &mut [0u8; 4]).is_err());
        assert!(virtq::read_bufs(&m, &record, &s.writable, u64::MAX, &mut [0u8; 2]).is_err());

        // Readable after writable: malformed.
        let mut q = queue_with(&m, &[(0x5000, 8, F_WRITE | F_NEXT, 1), (0x4000, 16, 0, 0)]);
        let (v, head) = first_chain(&m, &mut q, 0);
        assert!(matches!(
            v.split(head),
            Err(SplitError::ReadableAfterWritable { .. })
        ));

        // Cut short (next index outside the table) or a loop: malformed,
        // not the descriptors up to the cut.
        for descs in [
            vec![(0x4000, 16, F_NEXT, 300)],
            vec![(0x4000, 16, F_NEXT, 1), (0x5000, 8, F_NEXT, 0)],
        ] {
            let mut q = queue_with(&m, &descs);
            let (v, head) = first_chain(&m, &mut q, 0);
            let e = v.split(head).unwrap_err();
            assert!(
                matches!(
                    e,
                    SplitError::Walk(
                        virtq::ChainError::NextOutOfRange { .. } | virtq::ChainError::Loop { .. }
                    )
                ),
                "{e}"
            );
        }
    }

    /// VIRTIO_F_INDIRECT_DESC is never offered: an indirect descriptor is
    /// a malformed chain, wherever it sits.
    #[test]
    fn indirect_chains_are_refused_without_the_feature() {
        const F_INDIRECT: u16 = 4;
        let m = mem();
        let table = virtio_queue::desc::split::Descriptor::new(0x4000, 64, F_WRITE, 0);
        m.write_obj(table, GuestAddress(0x6000)).unwrap();
        for descs in [
            vec![(0x6000, 16, F_INDIRECT, 0)],
            vec![(0x5000, 8, F_NEXT, 1), (0x6000, 16, F_INDIRECT, 0)],
        ] {
            let mut q = queue_with(&m, &descs);
            let (v, head) = first_chain(&m, &mut q, 0);
            let e = v.split(head).unwrap_err();
            assert!(
                matches!(
                    e,
                    SplitError::Walk(virtq::ChainError::IndirectNotNegotiated { .. })
                ),
                "{e}"
            );
            // Negotiated, the same chain is followed into its table.
            let mut q = queue_with(&m, &descs);
            let (v, head) = first_chain(&m, &mut q, 1 << virtq::VIRTIO_F_INDIRECT_DESC);
            let s = v.split(head).unwrap();
            assert_eq!(
                s.writable,
                vec![Buf {
                    addr: 0x4000,
                    len: 64
                }]
            );
        }
    }
}
