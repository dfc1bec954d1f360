//! Test set-up shared by the crate's unit tests: a descriptor table at
//! `TABLE` in guest memory, and the ring that points at it.

use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::Ring;

pub const TABLE: u64 = 0x1000;
pub const NEXT: u16 = VRING_DESC_F_NEXT as u16;
pub const WRITE: u16 = 2;
pub const INDIRECT: u16 = VRING_DESC_F_INDIRECT as u16;
/// Size of the one-region memory of [`mem_with`].
pub const MEM: u64 = 0x10000;

/// Writes `descs` ((addr, len, flags, next) each) as a table at `at`.
pub fn write_table(m: &GuestMemoryMmap, at: u64, descs: &[(u64, u32, u16, u16)]) {
    for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
        let d = Descriptor::new(addr, len, flags, next);
        m.write_obj(d, GuestAddress(at + 16 * i as u64)).unwrap();
    }
}

/// One region of `MEM` bytes at 0 with `descs` at `TABLE`.
pub fn mem_with(descs: &[(u64, u32, u16, u16)]) -> GuestMemoryMmap {
    let m = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
    write_table(&m, TABLE, descs);
    m
}

/// A ring of `size` with its table at `TABLE` (avail 0x2000, used 0x3000).
pub const fn ring(size: u16, features: u64) -> Ring {
    Ring {
        desc_table: GuestAddress(TABLE),
        avail_ring: GuestAddress(0x2000),
        used_ring: GuestAddress(0x3000),
        size,
        features,
        event_idx: false,
    }
}
