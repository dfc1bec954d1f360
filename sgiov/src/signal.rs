//! The 64-bit signal word of the Cross-FIFO (SG-IOV §5.1): 16-bit type,
//! 16-bit ring id, 32-bit head-or-tail pointer, most significant field first.
//!
//! ```text
//!  63        48 47        32 31                         0
//! +------------+------------+----------------------------+
//! |    type    |  ring id   |  head / tail pointer (u32) |
//! +------------+------------+----------------------------+
//! ```
//!
//! Pointers are free-running byte counters that wrap at 2^32 (a ring's offset
//! is `ptr & (size - 1)`), so a word never needs a wrap flag.

use std::fmt;

/// A ring id of one SG function; `0xFFFF` ([`RING_NONE`]) is never a ring.
pub type RingId = u16;

/// Not a ring: the largest valid id is `0xFFFE`.
pub const RING_NONE: RingId = 0xFFFF;

/// The kinds of signal. Guest → device words are `Head` (a guest-produced ring
/// has data up to `ptr`) and `Tail` (a guest-consumed ring was read up to
/// `ptr`); device → guest words are `Head`, `Tail`, `Error` and `Closed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum SignalType {
    /// The producer of the ring published a new head.
    Head = 1,
    /// The consumer of the ring published a new tail.
    Tail = 2,
    /// Device → guest: the ring is in error; `ptr` is an [`crate::layout::ErrorCode`].
    Error = 3,
    /// Device → guest: the ring was closed (by the peer or the device).
    Closed = 4,
}

impl SignalType {
    pub fn from_u16(v: u16) -> Option<SignalType> {
        Some(match v {
            1 => SignalType::Head,
            2 => SignalType::Tail,
            3 => SignalType::Error,
            4 => SignalType::Closed,
            _ => return None,
        })
    }
}

/// An encoded signal word, exactly as it sits in a FIFO slot.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SignalWord(pub u64);

impl SignalWord {
    pub const fn encode(ty: SignalType, ring: RingId, ptr: u32) -> SignalWord {
        SignalWord(((ty as u64) << 48) | ((ring as u64) << 32) | ptr as u64)
    }

    /// The raw type field (also for unknown types, to count them).
    pub const fn raw_type(self) -> u16 {
        (self.0 >> 48) as u16
    }

    pub const fn ring(self) -> RingId {
        (self.0 >> 32) as u16
    }

    pub const fn ptr(self) -> u32 {
        self.0 as u32
    }

    /// Decodes the word; an unknown type or the reserved ring id is an error
    /// naming the offending field.
    pub fn decode(self) -> Result<Signal, BadSignal> {
        let ty = SignalType::from_u16(self.raw_type()).ok_or(BadSignal::Type(self.raw_type()))?;
        if self.ring() == RING_NONE {
            return Err(BadSignal::Ring(self.ring()));
        }
        Ok(Signal {
            ty,
            ring: self.ring(),
            ptr: self.ptr(),
        })
    }
}

impl fmt::Debug for SignalWord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SignalWord(type {}, ring {}, ptr {:#x})",
            self.raw_type(),
            self.ring(),
            self.ptr()
        )
    }
}

/// A decoded signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Signal {
    pub ty: SignalType,
    pub ring: RingId,
    pub ptr: u32,
}

impl Signal {
    pub fn new(ty: SignalType, ring: RingId, ptr: u32) -> Signal {
        Signal { ty, ring, ptr }
    }

    pub fn word(self) -> SignalWord {
        SignalWord::encode(self.ty, self.ring, self.ptr)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BadSignal {
    #[error("signal word: unknown type {0:#x}")]
    Type(u16),
    #[error("signal word: reserved ring id {0:#x}")]
    Ring(u16),
}

/// Distance from `from` to `to` on free-running u32 pointers.
pub fn distance(from: u32, to: u32) -> u32 {
    to.wrapping_sub(from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn round_trip_edges() {
        for ty in [
            SignalType::Head,
            SignalType::Tail,
            SignalType::Error,
            SignalType::Closed,
        ] {
            for ring in [0u16, 1, 2, 0x7fff, 0x8000, 0xFFFE] {
                for ptr in [0u32, 1, 0x7fff_ffff, 0x8000_0000, u32::MAX - 1, u32::MAX] {
                    let w = SignalWord::encode(ty, ring, ptr);
                    let s = w.decode().unwrap();
                    assert_eq!((s.ty, s.ring, s.ptr), (ty, ring, ptr), "{w:?}");
                    assert_eq!(s.word(), w);
                }
            }
        }
    }

    #[test]
    fn field_positions_match_the_paper() {
        // type in the top 16 bits, ring id next, pointer in the low 32 bits.
        let w = SignalWord::encode(SignalType::Tail, 0xFFFE, 0xDEAD_BEEF);
        assert_eq!(w.0, 0x0002_FFFE_DEAD_BEEF);
    }

    #[test]
    fn pointers_near_u32_max_wrap() {
        // A producer at u32::MAX - 100 that publishes 300 more bytes sends a
        // pointer that wrapped; the distance is still 300.
        let old = u32::MAX - 100;
        let new = old.wrapping_add(300);
        assert_eq!(new, 199);
        let s = SignalWord::encode(SignalType::Head, 0xFFFE, new)
            .decode()
            .unwrap();
        assert_eq!(distance(old, s.ptr), 300);
        assert_eq!(s.ring, 0xFFFE);
    }

    #[test]
    fn rejects_unknown_type_and_reserved_ring() {
        assert_eq!(SignalWord(0).decode(), Err(BadSignal::Type(0)));
        assert_eq!(
            SignalWord(0x0009_0001_0000_0000).decode(),
            Err(BadSignal::Type(9))
        );
        assert_eq!(
            SignalWord::encode(SignalType::Head, RING_NONE, 5).decode(),
            Err(BadSignal::Ring(0xFFFF))
        );
    }

    #[test]
    fn random_round_trips() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(13);
        for _ in 0..10_000 {
            let ty = SignalType::from_u16(rng.gen_range(1..=4)).unwrap();
            let ring = rng.gen_range(0..=0xFFFE);
            let ptr = rng.gen();
            let s = SignalWord::encode(ty, ring, ptr).decode().unwrap();
            assert_eq!(s, Signal::new(ty, ring, ptr));
        }
    }
}
