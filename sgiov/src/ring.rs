//! Byte rings over untrusted memory: the validated geometry of a ring (read
//! once from its descriptor), the device's shadow of its head and tail, and
//! reads/writes that wrap at the ring end.
//!
//! A ring is `size` bytes (a power of two) at `base`. `head` and `tail` are
//! free-running u32 byte counters: the producer owns `head`, the consumer
//! owns `tail`, `head - tail` (wrapping) is the data in the ring and never
//! exceeds `size`. Offset of a pointer: `ptr & (size - 1)`.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::layout::{limits, ErrorCode, RingDesc, RingRole};
use crate::mem::{MemError, Memory};

#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error("{ring}: descriptor base {base:#x} size {size:#x}: {what}")]
    BadDesc {
        ring: String,
        base: u64,
        size: u64,
        what: &'static str,
    },
    #[error("{ring}: [{base:#x}, +{size:#x}) overlaps {other}")]
    Overlap {
        ring: String,
        base: u64,
        size: u64,
        other: String,
    },
    #[error(
        "{ring}: {which} {new:#x} out of range (head {head:#x}, tail {tail:#x}, size {size:#x})"
    )]
    BadPointer {
        ring: String,
        which: &'static str,
        new: u32,
        head: u32,
        tail: u32,
        size: u32,
    },
    #[error("{ring}: memory access")]
    Memory {
        ring: String,
        #[source]
        source: MemError,
    },
}

impl RingError {
    pub fn code(&self) -> ErrorCode {
        match self {
            RingError::BadDesc { .. } => ErrorCode::BadRing,
            RingError::Overlap { .. } => ErrorCode::Overlap,
            RingError::BadPointer { .. } => ErrorCode::BadPointer,
            RingError::Memory { .. } => ErrorCode::Memory,
        }
    }
}

/// A ring's validated place in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingGeom {
    pub base: u64,
    pub size: u32,
}

impl RingGeom {
    /// Checks a ring's base and size: size a power of two within limits,
    /// base aligned, the whole ring inside one mapping of `mem`.
    pub fn validate(
        ring: &str,
        mem: &dyn Memory,
        base: u64,
        size: u64,
    ) -> Result<RingGeom, RingError> {
        let bad = |what| RingError::BadDesc {
            ring: ring.to_string(),
            base,
            size,
            what,
        };
        if !size.is_power_of_two()
            || size < limits::MIN_RING as u64
            || size > limits::MAX_RING as u64
        {
            return Err(bad("size is not a power of two in 4 KiB..64 MiB"));
        }
        if !base.is_multiple_of(limits::RING_ALIGN) {
            return Err(bad("base is not 64-byte aligned"));
        }
        if base.checked_add(size).is_none() || mem.slice(base, size as usize).is_none() {
            return Err(bad("ring is not inside guest memory"));
        }
        Ok(RingGeom {
            base,
            size: size as u32,
        })
    }

    /// Validates a guest descriptor (already read once) with the role the
    /// request gives it.
    pub fn from_desc(
        ring: &str,
        mem: &dyn Memory,
        d: &RingDesc,
        role: RingRole,
    ) -> Result<RingGeom, RingError> {
        if RingRole::from_u32(d.role) != Some(role) {
            return Err(RingError::BadDesc {
                ring: ring.to_string(),
                base: d.base,
                size: d.size as u64,
                what: "role does not match the request",
            });
        }
        RingGeom::validate(ring, mem, d.base, d.size as u64)
    }

    pub fn mask(&self) -> u32 {
        self.size - 1
    }

    pub fn off(&self, ptr: u32) -> u32 {
        ptr & self.mask()
    }

    /// Bytes from `ptr` to the ring end.
    pub fn to_end(&self, ptr: u32) -> u32 {
        self.size - self.off(ptr)
    }

    pub fn end(&self) -> u64 {
        self.base + self.size as u64
    }
}

/// The device's own record of a ring's head and tail. Pointers from the
/// other side are checked against it before anything uses them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingPtrs {
    pub head: u32,
    pub tail: u32,
    pub size: u32,
}

impl RingPtrs {
    pub fn new(size: u32) -> RingPtrs {
        RingPtrs {
            head: 0,
            tail: 0,
            size,
        }
    }

    pub fn used(&self) -> u32 {
        self.head.wrapping_sub(self.tail)
    }

    pub fn free(&self) -> u32 {
        self.size - self.used()
    }

    /// The producer moved `head` to `new`: it may only move forward, and not
    /// past `tail + size`. Returns the bytes added.
    pub fn publish_head(&mut self, ring: &str, new: u32) -> Result<u32, RingError> {
        let add = new.wrapping_sub(self.head);
        if add > self.free() {
            return Err(self.bad(ring, "head", new));
        }
        self.head = new;
        Ok(add)
    }

    /// The consumer moved `tail` to `new`: forward, and not past `head`.
    pub fn publish_tail(&mut self, ring: &str, new: u32) -> Result<u32, RingError> {
        let add = new.wrapping_sub(self.tail);
        if add > self.used() {
            return Err(self.bad(ring, "tail", new));
        }
        self.tail = new;
        Ok(add)
    }

    fn bad(&self, ring: &str, which: &'static str, new: u32) -> RingError {
        RingError::BadPointer {
            ring: ring.to_string(),
            which,
            new,
            head: self.head,
            tail: self.tail,
            size: self.size,
        }
    }
}

/// A ring's bytes: reads and writes at a free-running pointer, split at the
/// ring end. Used for control messages and by the guest-side driver; the
/// data path uses jobs instead.
#[derive(Debug, Clone)]
pub struct RingView {
    pub mem: Arc<dyn Memory>,
    pub geom: RingGeom,
}

impl RingView {
    pub fn new(mem: Arc<dyn Memory>, geom: RingGeom) -> RingView {
        RingView { mem, geom }
    }

    /// The (at most two) address ranges of `[ptr, ptr+len)`.
    pub fn ranges(&self, ptr: u32, len: u32) -> [(u64, u32); 2] {
        let first = len.min(self.geom.to_end(ptr));
        [
            (self.geom.base + self.geom.off(ptr) as u64, first),
            (self.geom.base, len - first),
        ]
    }

    pub fn read(&self, ptr: u32, buf: &mut [u8]) -> Result<(), MemError> {
        debug_assert!(buf.len() <= self.geom.size as usize);
        let mut done = 0usize;
        for (addr, n) in self.ranges(ptr, buf.len() as u32) {
            if n > 0 {
                let s = self.mem.get(addr, n as usize)?;
                s.copy_to(&mut buf[done..done + n as usize]);
                done += n as usize;
            }
        }
        Ok(())
    }

    /// Writes `data` at `ptr` (the preparation hook runs for each range).
    pub fn write(&self, ptr: u32, data: &[u8]) -> Result<(), MemError> {
        debug_assert!(data.len() <= self.geom.size as usize);
        let mut done = 0usize;
        for (addr, n) in self.ranges(ptr, data.len() as u32) {
            if n > 0 {
                let s = self.mem.for_write(addr, n as usize)?;
                s.copy_from(&data[done..done + n as usize]);
                done += n as usize;
            }
        }
        Ok(())
    }
}

/// The address ranges an SGF has given the device (its area and its open
/// rings), so a new ring that overlaps any of them is refused.
#[derive(Debug, Default)]
pub struct RangeSet {
    /// start → (end, owner label)
    ranges: BTreeMap<u64, (u64, String)>,
}

/// A range overlaps one already in the set; `owner` labels that one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("overlaps {owner}")]
pub struct Overlap {
    pub owner: String,
}

impl RangeSet {
    /// Inserts `[start, end)` unless it overlaps a range already there.
    pub fn insert(&mut self, start: u64, end: u64, owner: String) -> Result<(), Overlap> {
        if let Some((_, (e, o))) = self.ranges.range(..end).next_back() {
            if *e > start {
                return Err(Overlap { owner: o.clone() });
            }
        }
        self.ranges.insert(start, (end, owner));
        Ok(())
    }

    pub fn remove(&mut self, start: u64) {
        self.ranges.remove(&start);
    }

    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::GuestMem;

    fn mem() -> Arc<dyn Memory> {
        let (g, _f) = GuestMem::memfd("t-ring", 0x10_0000, 1 << 20).unwrap();
        Arc::new(g)
    }

    #[test]
    fn validates_geometry() {
        let m = mem();
        assert!(RingGeom::validate("r", &*m, 0x10_0000, 4096).is_ok());
        assert!(RingGeom::validate("r", &*m, 0x10_0000, 1 << 20).is_ok());
        let err = |b, s| RingGeom::validate("r", &*m, b, s).unwrap_err().code();
        assert_eq!(err(0x10_0000, 4095), ErrorCode::BadRing); // not a power of two
        assert_eq!(err(0x10_0000, 2048), ErrorCode::BadRing); // too small
        assert_eq!(err(0x10_0000, 128 << 20), ErrorCode::BadRing); // too large
        assert_eq!(err(0x10_0008, 4096), ErrorCode::BadRing); // misaligned
        assert_eq!(err(0x1f_f000, 8192), ErrorCode::BadRing); // runs past the end
        assert_eq!(err(0, 4096), ErrorCode::BadRing); // below guest memory
        assert_eq!(err(u64::MAX - 63, 4096), ErrorCode::BadRing); // overflows
        let d = RingDesc {
            base: 0x10_0000,
            size: 4096,
            role: RingRole::DeviceProduces as u32,
            ..Default::default()
        };
        assert!(RingGeom::from_desc("r", &*m, &d, RingRole::GuestProduces).is_err());
        assert!(RingGeom::from_desc("r", &*m, &d, RingRole::DeviceProduces).is_ok());
    }

    #[test]
    fn pointers_only_move_within_bounds() {
        let mut p = RingPtrs::new(4096);
        assert_eq!(p.publish_head("r", 4096).unwrap(), 4096); // full
        assert!(p.publish_head("r", 4097).is_err()); // past tail + size
        assert!(p.publish_tail("r", 4097).is_err()); // past head
        assert_eq!(p.publish_tail("r", 100).unwrap(), 100);
        assert!(p.publish_tail("r", 50).is_err()); // backwards
        assert!(p.publish_head("r", 4000).is_err()); // backwards
        assert_eq!(p.publish_head("r", 4196).unwrap(), 100);
        // Near u32::MAX the pointers wrap and the arithmetic still holds.
        let mut p = RingPtrs {
            head: u32::MAX - 10,
            tail: u32::MAX - 10,
            size: 4096,
        };
        assert_eq!(p.publish_head("r", 20).unwrap(), 31);
        assert_eq!(p.used(), 31);
        assert_eq!(p.publish_tail("r", 20).unwrap(), 31);
        assert!(p.publish_head("r", 20u32.wrapping_add(4097)).is_err());
    }

    #[test]
    fn view_wraps() {
        let m = mem();
        let v = RingView::new(
            m,
            RingGeom::validate("r", &*mem(), 0x10_0000, 4096).unwrap(),
        );
        let data: Vec<u8> = (0..100u8).collect();
        let ptr = u32::MAX - 39; // offset 4056: 40 bytes before the end
        v.write(ptr, &data).unwrap();
        let mut back = vec![0u8; 100];
        v.read(ptr, &mut back).unwrap();
        assert_eq!(back, data);
        let mut head = [0u8; 60];
        v.read(0, &mut head).unwrap();
        assert_eq!(&head[..], &data[40..]);
    }

    #[test]
    fn range_set_refuses_overlaps() {
        let mut s = RangeSet::default();
        let by = |owner: &str| {
            Err(Overlap {
                owner: owner.into(),
            })
        };
        s.insert(0x1000, 0x2000, "area".into()).unwrap();
        s.insert(0x3000, 0x4000, "ring 2".into()).unwrap();
        assert_eq!(s.insert(0x1fff, 0x2100, "x".into()), by("area"));
        assert_eq!(s.insert(0x0, 0x1001, "x".into()), by("area"));
        assert_eq!(s.insert(0x2000, 0x4000, "x".into()), by("ring 2"));
        assert_eq!(s.insert(0x3800, 0x3900, "x".into()), by("ring 2"));
        s.insert(0x2000, 0x3000, "ring 3".into()).unwrap();
        s.remove(0x3000);
        s.insert(0x3000, 0x3100, "ring 4".into()).unwrap();
        assert_eq!(s.len(), 3);
    }
}
