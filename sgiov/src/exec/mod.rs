//! Stateless executors (§6.2): each runs one [`JobDesc`] using nothing but
//! its fields and the key slot it names. Buffer tracking, ordering and QoS
//! belong to the pipes and the scheduler.
//!
//! Every destination range goes through [`Memory::for_write`] (the NIC's
//! device-write preparation) before a byte is written. Guest bytes are read
//! once: `Encrypt` copies the plaintext into the destination and seals it
//! there, so the tag covers exactly the bytes that were encrypted;
//! `Decrypt` copies the ciphertext into the destination, checks the tag and
//! only then decrypts; a failed record is wiped from the destination and
//! reported, and the pipe publishes nothing more.

pub mod capacity;
pub mod crypto;
pub mod pool;

use vm_memory::{Bytes, VolatileSlice};

use crate::job::{Buf, JobDesc, Op};
use crate::layout::ErrorCode;
use crate::mem::MemError;
use crypto::{CryptoError, KeyStore, RecordHeader, HDR, KIND_DATA, OVERHEAD, TAG};

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("{op} job: memory")]
    Memory {
        op: &'static str,
        #[source]
        source: MemError,
    },
    #[error("{op} job: {source}")]
    Crypto {
        op: &'static str,
        #[source]
        source: CryptoError,
    },
    #[error("{op} job: {what}")]
    Malformed { op: &'static str, what: String },
    /// A record field outside the job's destination (its length does not fit the record).
    #[error("{op} job: {source}")]
    Record {
        op: &'static str,
        #[source]
        source: vm_memory::VolatileMemoryError,
    },
}

impl ExecError {
    pub fn code(&self) -> ErrorCode {
        match self {
            ExecError::Memory { .. } => ErrorCode::Memory,
            ExecError::Crypto { .. } => ErrorCode::Auth,
            ExecError::Malformed { .. } | ExecError::Record { .. } => ErrorCode::Record,
        }
    }
}

fn need<'a>(b: &'a Option<Buf>, op: &'static str, which: &str) -> Result<&'a Buf, ExecError> {
    b.as_ref().ok_or_else(|| ExecError::Malformed {
        op,
        what: format!("no {which}"),
    })
}

/// Runs one job.
pub fn execute(job: &JobDesc, keys: &KeyStore) -> Result<(), ExecError> {
    let op = job.op.name();
    let mem = |source| ExecError::Memory { op, source };
    let bad = |what: String| ExecError::Malformed { op, what };
    let record = |source| ExecError::Record { op, source };
    let need = |b, which| need(b, op, which);
    match job.op {
        Op::Skip => Ok(()),
        Op::Copy | Op::Direct => {
            let (s, d) = (need(&job.src, "source")?, need(&job.dst, "destination")?);
            if s.len != d.len {
                return Err(bad(format!(
                    "source {} and destination {} lengths differ",
                    s.len, d.len
                )));
            }
            let src = s.mem.get(s.addr, s.len as usize).map_err(mem)?;
            let dst = d.mem.for_write(d.addr, d.len as usize).map_err(mem)?;
            src.copy_to_volatile_slice(dst);
            Ok(())
        }
        Op::Pad => {
            let d = need(&job.dst, "destination")?;
            if d.len < HDR || d.len % 16 != 0 {
                return Err(bad(format!("pad of {} bytes", d.len)));
            }
            let dst = d.mem.for_write(d.addr, d.len as usize).map_err(mem)?;
            dst.write_slice(&RecordHeader::pad(d.len - HDR).encode(), 0)
                .map_err(record)?;
            Ok(())
        }
        Op::Encrypt => {
            let (s, d) = (need(&job.src, "source")?, need(&job.dst, "destination")?);
            let n = s.len;
            if d.len != crypto::data_record_len(n) {
                return Err(bad(format!(
                    "record of {} bytes for {n} bytes of payload",
                    d.len
                )));
            }
            let cipher = keys
                .get(job.key_slot)
                .map_err(|source| ExecError::Crypto { op, source })?;
            let src = s.mem.get(s.addr, n as usize).map_err(mem)?;
            let dst = d.mem.for_write(d.addr, d.len as usize).map_err(mem)?;
            let hdr = RecordHeader::data(n, job.seq).encode();
            let body = dst.subslice(HDR as usize, n as usize).map_err(record)?;
            src.copy_to_volatile_slice(body);
            // SAFETY: see `bytes_mut`; the destination range belongs to this job.
            let tag = crypto::seal(&cipher, job.key_slot, job.seq, &hdr, unsafe {
                bytes_mut(&body)
            })
            .map_err(|source| ExecError::Crypto { op, source })?;
            let mut tail = vec![0u8; (d.len - HDR - n) as usize];
            tail[..TAG as usize].copy_from_slice(&tag);
            dst.write_slice(&hdr, 0).map_err(record)?;
            dst.write_slice(&tail, (HDR + n) as usize).map_err(record)?;
            Ok(())
        }
        Op::Decrypt => {
            let (s, d) = (need(&job.src, "source")?, need(&job.dst, "destination")?);
            let n = d.len;
            if s.len != crypto::data_record_len(n) {
                return Err(bad(format!(
                    "record of {} bytes for {n} bytes of plaintext",
                    s.len
                )));
            }
            let cipher = keys
                .get(job.key_slot)
                .map_err(|source| ExecError::Crypto { op, source })?;
            let src = s.mem.get(s.addr, s.len as usize).map_err(mem)?;
            let mut hdr = [0u8; 16];
            src.read_slice(&mut hdr, 0).map_err(record)?;
            // The header was read (once) by the job generator to size this
            // job; this read is the one the tag authenticates, and it must
            // agree with the descriptor.
            let h = RecordHeader::decode(&hdr);
            if h.kind != KIND_DATA || h.len != n || h.seq != job.seq {
                return Err(ExecError::Crypto {
                    op,
                    source: CryptoError::Auth {
                        slot: job.key_slot,
                        seq: job.seq,
                    },
                });
            }
            let mut tag = [0u8; 16];
            src.read_slice(&mut tag, (HDR + n) as usize)
                .map_err(record)?;
            let in_place = s.same_place(d, HDR as u64);
            let dst = if in_place {
                d.mem.for_write(d.addr, n as usize).map_err(mem)?
            } else {
                let dst = d.mem.for_write(d.addr, n as usize).map_err(mem)?;
                let ct = src.subslice(HDR as usize, n as usize).map_err(record)?;
                ct.copy_to_volatile_slice(dst);
                dst
            };
            // SAFETY: see `bytes_mut`.
            let r = crypto::open(
                &cipher,
                job.key_slot,
                job.seq,
                &hdr,
                unsafe { bytes_mut(&dst) },
                &tag,
            );
            if let Err(source) = r {
                if !in_place {
                    // Nothing of a forged record stays in the receiver's ring.
                    dst.write_slice(&vec![0u8; n as usize], 0).map_err(record)?;
                }
                return Err(ExecError::Crypto { op, source });
            }
            Ok(())
        }
    }
}

/// The bytes of a job's destination as a mutable slice, for the AEAD's
/// in-place API.
///
/// # Safety
/// The range belongs to the running job: the ring protocol gives the device
/// `[head, tail + size)` of a sink (and `[tail, head)` of a source it decrypts
/// in place) until the job's pointer is published, and the scheduler runs
/// no two jobs on overlapping ranges. The other side may still write the
/// bytes concurrently in violation of the protocol; u8 has no invalid values,
/// so that only corrupts that side's own data (or fails the tag).
unsafe fn bytes_mut<'a>(s: &'a VolatileSlice<'a>) -> &'a mut [u8] {
    std::slice::from_raw_parts_mut(s.ptr_guard_mut().as_ptr(), s.len())
}

/// Payload bytes one record of `total` ring bytes can carry (records are
/// 16-aligned), for producers sizing records to a contiguous space.
pub fn max_payload_for(total: u32) -> u32 {
    (total / 16 * 16).saturating_sub(OVERHEAD)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::{GuestMem, Memory, StagingMemory};
    use std::sync::Arc;

    type Setup = (Arc<dyn Memory>, Arc<dyn Memory>, KeyStore, u16, [u8; 32]);

    fn setup() -> Setup {
        let (g, _f) = GuestMem::memfd("t-exec-guest", 0, 1 << 20).unwrap();
        let s = StagingMemory::new("t-exec-staging", 1 << 20).unwrap();
        let ks = KeyStore::new(8);
        let (slot, key) = ks.alloc_random().unwrap();
        (Arc::new(g), Arc::new(s), ks, slot, key)
    }

    fn buf(m: &Arc<dyn Memory>, addr: u64, len: u32) -> Option<Buf> {
        Some(Buf {
            mem: m.clone(),
            addr,
            len,
        })
    }

    #[test]
    fn encrypt_then_decrypt_and_reject_flips() {
        let (g, s, ks, slot, key) = setup();
        let msg: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        g.get(0x1000, msg.len()).unwrap().copy_from(&msg);
        let rec = crypto::data_record_len(1000);
        let enc = JobDesc {
            op: Op::Encrypt,
            src: buf(&g, 0x1000, 1000),
            dst: buf(&s, 0, rec),
            key_slot: slot,
            seq: 5,
        };
        execute(&enc, &ks).unwrap();
        // Independent check with the aes-gcm crate directly.
        let mut raw = vec![0u8; rec as usize];
        s.get(0, rec as usize).unwrap().copy_to(&mut raw);
        {
            use aes_gcm::aead::{Aead, KeyInit, Payload};
            let c = aes_gcm::Aes256Gcm::new_from_slice(&key).unwrap();
            let mut ct_tag = raw[16..16 + 1000].to_vec();
            ct_tag.extend_from_slice(&raw[1016..1032]);
            let pt = c
                .decrypt(
                    aes_gcm::Nonce::from_slice(&crypto::nonce(slot, 5)),
                    Payload {
                        msg: &ct_tag,
                        aad: &raw[..16],
                    },
                )
                .unwrap();
            assert_eq!(pt, msg);
        }
        assert_ne!(&raw[16..1016], &msg[..]);
        let dec = JobDesc {
            op: Op::Decrypt,
            src: buf(&s, 0, rec),
            dst: buf(&g, 0x8000, 1000),
            key_slot: slot,
            seq: 5,
        };
        execute(&dec, &ks).unwrap();
        let mut out = vec![0u8; 1000];
        g.get(0x8000, 1000).unwrap().copy_to(&mut out);
        assert_eq!(out, msg);
        // Wrong expected sequence: refused.
        let mut wrong = dec.clone();
        wrong.seq = 6;
        assert_eq!(execute(&wrong, &ks).unwrap_err().code(), ErrorCode::Auth);
        // A flipped byte anywhere in the record: refused, nothing delivered.
        for pos in [3usize, 20, 500, 1020] {
            let sl = s.get(pos as u64, 1).unwrap();
            let b: u8 = sl.read_obj(0).unwrap();
            sl.write_obj(b ^ 0x40, 0).unwrap();
            let dst = buf(&g, 0x10000, 1000);
            let e = execute(&JobDesc { dst, ..dec.clone() }, &ks).unwrap_err();
            assert_eq!(e.code(), ErrorCode::Auth, "flip at {pos}");
            let mut out = vec![1u8; 1000];
            g.get(0x10000, 1000).unwrap().copy_to(&mut out);
            assert!(out.iter().all(|&b| b == 0), "flip at {pos} delivered bytes");
            sl.write_obj(b, 0).unwrap();
        }
        // In place, inside the source.
        let inplace = JobDesc {
            dst: buf(&s, 16, 1000),
            ..dec.clone()
        };
        execute(&inplace, &ks).unwrap();
        let mut out = vec![0u8; 1000];
        s.get(16, 1000).unwrap().copy_to(&mut out);
        assert_eq!(out, msg);
    }

    #[test]
    fn copy_pad_and_malformed_jobs() {
        let (g, s, ks, _, _) = setup();
        g.get(0, 4).unwrap().copy_from(b"abcd");
        execute(
            &JobDesc {
                op: Op::Copy,
                src: buf(&g, 0, 4),
                dst: buf(&s, 100, 4),
                key_slot: 0,
                seq: 0,
            },
            &ks,
        )
        .unwrap();
        let mut b = [0u8; 4];
        s.get(100, 4).unwrap().copy_to(&mut b);
        assert_eq!(&b, b"abcd");
        execute(
            &JobDesc {
                op: Op::Pad,
                src: None,
                dst: buf(&s, 4096 - 48, 48),
                key_slot: 0,
                seq: 0,
            },
            &ks,
        )
        .unwrap();
        let mut h = [0u8; 16];
        s.get(4096 - 48, 16).unwrap().copy_to(&mut h);
        assert_eq!(RecordHeader::decode(&h), RecordHeader::pad(32));
        let bad = JobDesc {
            op: Op::Copy,
            src: buf(&g, 0, 4),
            dst: buf(&s, 0, 5),
            key_slot: 0,
            seq: 0,
        };
        assert!(execute(&bad, &ks).is_err());
        let oob = JobDesc {
            op: Op::Copy,
            src: buf(&g, (1 << 20) - 2, 4),
            dst: buf(&s, 0, 4),
            key_slot: 0,
            seq: 0,
        };
        assert_eq!(execute(&oob, &ks).unwrap_err().code(), ErrorCode::Memory);
        let nokey = JobDesc {
            op: Op::Encrypt,
            src: buf(&g, 0, 4),
            dst: buf(&s, 0, 48),
            key_slot: 7,
            seq: 0,
        };
        assert_eq!(execute(&nokey, &ks).unwrap_err().code(), ErrorCode::Auth);
    }
}
