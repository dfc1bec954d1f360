//! Encrypted records (AES-256-GCM through the `aes-gcm` crate) and the key
//! slots the crypto executors use.
//!
//! A record in a ring (little-endian):
//!
//! ```text
//! DATA: | kind=1 u16 | 0 u16 | len u32 | seq u64 | ciphertext[len] | tag[16] | zero pad to 16 |
//! PAD:  | kind=2 u16 | 0 u16 | len u32 | 0 u64   | len bytes (multiple of 16, ignored)        |
//! ```
//!
//! A DATA record takes `32 + align16(len)` bytes, a PAD record `16 + len`.
//! Records start at multiples of 16 and never straddle the ring end: a
//! producer that has fewer bytes left before the end than a record needs
//! fills them with a PAD record. The header is the AEAD's associated data;
//! the 96-bit nonce is `key_slot` (u32, big-endian) followed by `seq` (u64,
//! big-endian). A key slot belongs to one encrypting pipe, whose sequence
//! numbers count up from 0, and a slot gets a fresh random key whenever it is
//! reused, so a (key, nonce) pair is never used twice.

use std::sync::{Arc, RwLock};

use aes_gcm::aead::{AeadInPlace, KeyInit};
use aes_gcm::{Aes256Gcm, Key, Nonce, Tag};

pub const HDR: u32 = 16;
pub const TAG: u32 = 16;
pub const OVERHEAD: u32 = HDR + TAG;
pub const KIND_DATA: u16 = 1;
pub const KIND_PAD: u16 = 2;

/// A parsed record header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub kind: u16,
    pub flags: u16,
    pub len: u32,
    pub seq: u64,
}

impl RecordHeader {
    pub fn data(len: u32, seq: u64) -> Self {
        RecordHeader {
            kind: KIND_DATA,
            flags: 0,
            len,
            seq,
        }
    }

    pub fn pad(len: u32) -> Self {
        RecordHeader {
            kind: KIND_PAD,
            flags: 0,
            len,
            seq: 0,
        }
    }

    pub fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..2].copy_from_slice(&self.kind.to_le_bytes());
        b[2..4].copy_from_slice(&self.flags.to_le_bytes());
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; 16]) -> Self {
        RecordHeader {
            kind: u16::from_le_bytes([b[0], b[1]]),
            flags: u16::from_le_bytes([b[2], b[3]]),
            len: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            seq: u64::from_le_bytes(b[8..16].try_into().unwrap_or([0; 8])),
        }
    }

    /// Bytes the record takes in a ring.
    pub fn total(&self) -> u64 {
        match self.kind {
            KIND_PAD => HDR as u64 + self.len as u64,
            _ => data_record_len(self.len) as u64,
        }
    }
}

/// Bytes a DATA record of `len` payload bytes takes.
pub fn data_record_len(len: u32) -> u32 {
    OVERHEAD + len.next_multiple_of(16)
}

/// The nonce of record `seq` under key slot `slot`.
pub fn nonce(slot: u16, seq: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[0..4].copy_from_slice(&(slot as u32).to_be_bytes());
    n[4..12].copy_from_slice(&seq.to_be_bytes());
    n
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CryptoError {
    #[error("record seq {seq} under key slot {slot}: authentication failed")]
    Auth { slot: u16, seq: u64 },
    #[error("key slot {0}: no key installed")]
    NoKey(u16),
}

/// Encrypts `buf` in place; returns the tag.
pub fn seal(
    cipher: &Aes256Gcm,
    slot: u16,
    seq: u64,
    aad: &[u8; 16],
    buf: &mut [u8],
) -> Result<[u8; 16], CryptoError> {
    let n = nonce(slot, seq);
    let tag = cipher
        .encrypt_in_place_detached(Nonce::from_slice(&n), aad, buf)
        .map_err(|_| CryptoError::Auth { slot, seq })?;
    Ok(tag.into())
}

/// Verifies `tag` over `buf` and the header, then decrypts `buf` in place
/// (the crate checks the tag before it decrypts, so a failed record leaves
/// `buf` as it was).
pub fn open(
    cipher: &Aes256Gcm,
    slot: u16,
    seq: u64,
    aad: &[u8; 16],
    buf: &mut [u8],
    tag: &[u8; 16],
) -> Result<(), CryptoError> {
    let n = nonce(slot, seq);
    cipher
        .decrypt_in_place_detached(Nonce::from_slice(&n), aad, buf, Tag::from_slice(tag))
        .map_err(|_| CryptoError::Auth { slot, seq })
}

/// Key slots, shared by the device (which installs keys) and the executors
/// (which only look them up by the slot a job names).
pub struct KeyStore {
    slots: RwLock<Vec<Option<Arc<Aes256Gcm>>>>,
}

// Never prints a key.
impl std::fmt::Debug for KeyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyStore").finish_non_exhaustive()
    }
}

impl KeyStore {
    pub fn new(nslots: usize) -> KeyStore {
        KeyStore {
            slots: RwLock::new(vec![None; nslots.min(1 << 16)]),
        }
    }

    /// Installs `key` in a free slot.
    pub fn alloc(&self, key: &[u8; 32]) -> Option<u16> {
        let mut s = self.slots.write().unwrap_or_else(|e| e.into_inner());
        let i = s.iter().position(Option::is_none)?;
        s[i] = Some(Arc::new(Aes256Gcm::new(Key::<Aes256Gcm>::from_slice(key))));
        Some(i as u16)
    }

    /// A fresh random key in a free slot; returns the slot and the key (so a
    /// test or a peer outside the daemon can check records independently).
    pub fn alloc_random(&self) -> Option<(u16, [u8; 32])> {
        use rand::RngCore;
        let mut key = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut key);
        self.alloc(&key).map(|s| (s, key))
    }

    pub fn remove(&self, slot: u16) {
        let mut s = self.slots.write().unwrap_or_else(|e| e.into_inner());
        if let Some(x) = s.get_mut(slot as usize) {
            *x = None;
        }
    }

    pub fn get(&self, slot: u16) -> Result<Arc<Aes256Gcm>, CryptoError> {
        let s = self.slots.read().unwrap_or_else(|e| e.into_inner());
        s.get(slot as usize)
            .and_then(|k| k.clone())
            .ok_or(CryptoError::NoKey(slot))
    }

    pub fn in_use(&self) -> usize {
        let s = self.slots.read().unwrap_or_else(|e| e.into_inner());
        s.iter().filter(|k| k.is_some()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_lengths() {
        let h = RecordHeader::data(1000, u64::MAX - 1);
        assert_eq!(RecordHeader::decode(&h.encode()), h);
        assert_eq!(h.total(), 32 + 1008);
        assert_eq!(RecordHeader::pad(48).total(), 64);
        assert_eq!(data_record_len(16), 48);
        assert_eq!(data_record_len(1), 48);
    }

    #[test]
    fn nonces_differ_by_slot_and_seq() {
        assert_ne!(nonce(1, 0), nonce(0, 1));
        assert_ne!(nonce(1, 1), nonce(1, 2));
        assert_eq!(&nonce(0x0102, 3)[..4], &[0, 0, 1, 2]);
    }

    #[test]
    fn seal_open_and_tamper() {
        let ks = KeyStore::new(4);
        let (slot, _) = ks.alloc_random().unwrap();
        let c = ks.get(slot).unwrap();
        let aad = RecordHeader::data(11, 7).encode();
        let mut buf = *b"hello world";
        let tag = seal(&c, slot, 7, &aad, &mut buf).unwrap();
        assert_ne!(&buf, b"hello world");
        let mut bad = buf;
        bad[3] ^= 1;
        let before = bad;
        assert!(open(&c, slot, 7, &aad, &mut bad, &tag).is_err());
        assert_eq!(bad, before, "a failed record is left untouched");
        assert!(open(&c, slot, 8, &aad, &mut buf.clone(), &tag).is_err());
        open(&c, slot, 7, &aad, &mut buf, &tag).unwrap();
        assert_eq!(&buf, b"hello world");
        ks.remove(slot);
        assert_eq!(ks.get(slot).err(), Some(CryptoError::NoKey(slot)));
        assert_eq!(ks.in_use(), 0);
    }
}
