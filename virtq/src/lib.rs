//! Checks on guest-written split virtqueues shared by every device that
//! walks descriptor chains: the NIC's dataplane and the VMM's own virtio
//! devices. virtio-queue's chain iterator follows an indirect descriptor
//! (VRING_DESC_F_INDIRECT) silently, whatever was negotiated; a device that
//! did not offer VIRTIO_F_INDIRECT_DESC must refuse such a chain instead
//! (virtio 1.2 §2.7.5.3.2: the driver MUST NOT set the flag unless the
//! feature was negotiated), so it asks here before it walks the chain.

use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::QueueT;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory};

/// Feature bit VIRTIO_F_INDIRECT_DESC (named VIRTIO_RING_F_INDIRECT_DESC in Linux).
pub const VIRTIO_F_INDIRECT_DESC: u32 = virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC;

/// Whether `features` (the negotiated set) allow indirect descriptors.
pub fn indirect_negotiated(features: u64) -> bool {
    features & (1u64 << VIRTIO_F_INDIRECT_DESC) != 0
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    #[error(
        "descriptor chain {head}: descriptor {index} is indirect (VRING_DESC_F_INDIRECT) \
         but VIRTIO_F_INDIRECT_DESC was not negotiated"
    )]
    IndirectNotNegotiated { head: u16, index: u16 },
}

/// What a device needs to vet the chains of one queue: where its
/// descriptor table is and which features were negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ring {
    pub desc_table: GuestAddress,
    pub size: u16,
    pub features: u64,
}

impl Ring {
    pub fn of(q: &impl QueueT, features: u64) -> Self {
        Ring {
            desc_table: GuestAddress(q.desc_table()),
            size: q.size(),
            features,
        }
    }

    /// Refuses the chain starting at `head` if one of its descriptors is
    /// indirect and the features lack VIRTIO_F_INDIRECT_DESC. Walks the
    /// descriptor table itself, at most `size` steps; a descriptor it cannot
    /// read or a next index out of range ends the walk without error (the
    /// caller's chain walk reports those).
    pub fn check_chain<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        head: u16,
    ) -> Result<(), ChainError> {
        if indirect_negotiated(self.features) {
            return Ok(());
        }
        let mut index = head;
        for _ in 0..self.size {
            if index >= self.size {
                return Ok(());
            }
            let Some(at) = self.desc_table.checked_add(u64::from(index) * 16) else {
                return Ok(());
            };
            let Ok(d) = mem.read_obj::<Descriptor>(at) else {
                return Ok(());
            };
            let flags = u32::from(d.flags());
            if flags & VRING_DESC_F_INDIRECT != 0 {
                return Err(ChainError::IndirectNotNegotiated { head, index });
            }
            if flags & VRING_DESC_F_NEXT == 0 {
                return Ok(());
            }
            index = d.next();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    const TABLE: u64 = 0x1000;

    fn mem_with(descs: &[(u64, u32, u16, u16)]) -> GuestMemoryMmap {
        let m = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
            let d = Descriptor::new(addr, len, flags, next);
            m.write_obj(d, GuestAddress(TABLE + 16 * i as u64)).unwrap();
        }
        m
    }

    const T: Ring = Ring {
        desc_table: GuestAddress(TABLE),
        size: 8,
        features: 0,
    };
    const NEXT: u16 = VRING_DESC_F_NEXT as u16;
    const INDIRECT: u16 = VRING_DESC_F_INDIRECT as u16;

    #[test]
    fn indirect_is_refused_unless_negotiated() {
        let m = mem_with(&[(0x4000, 16, NEXT, 1), (0x5000, 32, INDIRECT, 0)]);
        assert_eq!(
            T.check_chain(&m, 0),
            Err(ChainError::IndirectNotNegotiated { head: 0, index: 1 })
        );
        assert_eq!(
            T.check_chain(&m, 1),
            Err(ChainError::IndirectNotNegotiated { head: 1, index: 1 })
        );
        let negotiated = Ring {
            features: 1 << VIRTIO_F_INDIRECT_DESC,
            ..T
        };
        assert_eq!(negotiated.check_chain(&m, 0), Ok(()));
    }

    #[test]
    fn plain_and_malformed_chains_pass_to_the_walker() {
        // Direct chain.
        let m = mem_with(&[(0x4000, 16, NEXT, 1), (0x5000, 32, 0, 0)]);
        assert_eq!(T.check_chain(&m, 0), Ok(()));
        // A loop ends after `size` steps.
        let m = mem_with(&[(0x4000, 16, NEXT, 0)]);
        assert_eq!(T.check_chain(&m, 0), Ok(()));
        // Next index out of range, head out of range, table outside memory.
        let m = mem_with(&[(0x4000, 16, NEXT, 200)]);
        assert_eq!(T.check_chain(&m, 0), Ok(()));
        assert_eq!(T.check_chain(&m, 9), Ok(()));
        let far = Ring {
            desc_table: GuestAddress(u64::MAX - 8),
            ..T
        };
        assert_eq!(far.check_chain(&m, 1), Ok(()));
    }
}
