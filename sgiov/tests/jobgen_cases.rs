//! The job generator over all eight cases (source wraps × sink wraps ×
//! grows/shrinks) and Fig. 10, with seeded random sizes: the generated jobs
//! are run by the executors (in shuffled order inside each barrier segment)
//! and the sink is compared byte for byte with a reference transform
//! computed with the aes-gcm crate directly.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::collections::HashSet;
use std::sync::Arc;

use aes_gcm::aead::{AeadInPlace, KeyInit};
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};
use sgiov::exec::crypto::{self, KeyStore, RecordHeader, HDR, KIND_DATA, KIND_PAD};
use sgiov::exec::execute;
use sgiov::jobgen::{generate, Params, Plan, PlannedJob, Span, Xf};
use sgiov::mem::{GuestMem, Memory};
use sgiov::ring::{RingGeom, RingView};

struct Rings {
    src: RingView,
    sink: RingView,
}

fn rings(src_size: u32, sink_size: u32) -> Rings {
    let (g, _f) = GuestMem::memfd("t-jobgen", 0, 16 << 20).unwrap();
    let m: Arc<dyn Memory> = Arc::new(g);
    let src = RingView::new(
        m.clone(),
        RingGeom::validate("src", &*m, 0, src_size as u64).unwrap(),
    );
    let sink = RingView::new(
        m.clone(),
        RingGeom::validate("sink", &*m, 8 << 20, sink_size as u64).unwrap(),
    );
    Rings { src, sink }
}

/// Runs the jobs in a random order that respects barriers.
fn run_shuffled(jobs: &[PlannedJob], r: &Rings, keys: &KeyStore, slot: u16, rng: &mut impl Rng) {
    let mut seg: Vec<&PlannedJob> = Vec::new();
    let flush = |seg: &mut Vec<&PlannedJob>, rng: &mut dyn RngCore| {
        seg.shuffle(rng);
        for j in seg.drain(..) {
            execute(&j.desc(&r.src, &r.sink, slot), keys).unwrap();
        }
    };
    for j in jobs {
        if j.barrier {
            flush(&mut seg, rng);
            execute(&j.desc(&r.src, &r.sink, slot), keys).unwrap();
        } else {
            seg.push(j);
        }
    }
    flush(&mut seg, rng);
}

fn read(v: &RingView, ptr: u32, len: u32) -> Vec<u8> {
    let mut b = vec![0u8; len as usize];
    v.read(ptr, &mut b).unwrap();
    b
}

/// Parses records from `bytes` (starting at ring offset `off` of a ring of
/// `size`), checks their layout and decrypts them with aes-gcm directly.
fn reference_decrypt(
    bytes: &[u8],
    off: u32,
    size: u32,
    key: &[u8; 32],
    slot: u16,
    seq0: u64,
) -> Vec<u8> {
    let cipher = aes_gcm::Aes256Gcm::new_from_slice(key).unwrap();
    let mut out = Vec::new();
    let mut i = 0usize;
    let mut seq = seq0;
    while i < bytes.len() {
        let h = RecordHeader::decode(bytes[i..i + 16].try_into().unwrap());
        let total = h.total() as usize;
        let at = (off as usize + i) % size as usize;
        assert!(at.is_multiple_of(16), "record at {at} misaligned");
        assert!(
            at + total <= size as usize,
            "record at {at} (+{total}) straddles the ring end"
        );
        if h.kind == KIND_PAD {
            assert_eq!(
                at + total,
                size as usize,
                "padding must end at the ring end"
            );
        } else {
            assert_eq!(h.kind, KIND_DATA);
            assert_eq!(h.seq, seq);
            let n = h.len as usize;
            let mut buf = bytes[i + 16..i + 16 + n].to_vec();
            let tag = aes_gcm::Tag::clone_from_slice(&bytes[i + 16 + n..i + 32 + n]);
            cipher
                .decrypt_in_place_detached(
                    aes_gcm::Nonce::from_slice(&crypto::nonce(slot, seq)),
                    &bytes[i..i + 16],
                    &mut buf,
                    &tag,
                )
                .expect("independent AES-GCM decrypt");
            out.extend_from_slice(&buf);
            seq += 1;
        }
        i += total;
    }
    out
}

/// Writes `msgs` as records into a ring at `ptr` with aes-gcm directly,
/// padding before the ring end as a producer must; returns bytes written.
fn reference_encrypt(
    v: &RingView,
    mut ptr: u32,
    msgs: &[Vec<u8>],
    key: &[u8; 32],
    slot: u16,
) -> u32 {
    let cipher = aes_gcm::Aes256Gcm::new_from_slice(key).unwrap();
    let start = ptr;
    for (seq, m) in msgs.iter().enumerate() {
        let total = crypto::data_record_len(m.len() as u32);
        let to_end = v.geom.to_end(ptr);
        if to_end < total {
            v.write(ptr, &RecordHeader::pad(to_end - HDR).encode())
                .unwrap();
            ptr = ptr.wrapping_add(to_end);
        }
        let hdr = RecordHeader::data(m.len() as u32, seq as u64).encode();
        let mut buf = m.clone();
        let tag = cipher
            .encrypt_in_place_detached(
                aes_gcm::Nonce::from_slice(&crypto::nonce(slot, seq as u64)),
                &hdr,
                &mut buf,
            )
            .unwrap();
        let mut rec = hdr.to_vec();
        rec.extend_from_slice(&buf);
        rec.extend_from_slice(&tag);
        rec.resize(total as usize, 0);
        v.write(ptr, &rec).unwrap();
        ptr = ptr.wrapping_add(total);
    }
    ptr.wrapping_sub(start)
}

fn random_bytes(rng: &mut impl Rng, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rng.fill_bytes(&mut v);
    v
}

/// A random start pointer, sometimes just below u32::MAX so the free-running
/// pointers wrap too, aligned to 16 (record producers keep 16-alignment).
fn start_ptr(rng: &mut impl Rng) -> u32 {
    let p: u32 = if rng.gen_bool(0.3) {
        u32::MAX - rng.gen_range(0..100_000)
    } else {
        rng.gen()
    };
    p & !15
}

type Case = (bool, bool, bool);

fn record_case(plan: &Plan, xf: Xf, seen: &mut HashSet<Case>, in_place: &mut usize) {
    if !plan.jobs.is_empty() {
        seen.insert((plan.src_wrapped, plan.sink_wrapped, xf.grows()));
    }
    *in_place += plan.in_place as usize;
}

#[test]
fn all_eight_cases_and_fig10_are_byte_exact() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5613);
    let keys = KeyStore::new(4);
    let (slot, key) = keys.alloc_random().unwrap();
    let mut seen = HashSet::new();
    let mut in_place = 0;
    for iter in 0..400 {
        let xf = [Xf::Copy, Xf::Encrypt, Xf::Decrypt][iter % 3];
        let src_size = 1u32 << rng.gen_range(12..=16);
        let sink_size = 1u32 << rng.gen_range(12..=16);
        let r = rings(src_size, sink_size);
        let (sp, kp) = (start_ptr(&mut rng), start_ptr(&mut rng));
        let sink_len = rng.gen_range(64..=sink_size);
        let max_job = [256, 4096, 65536][rng.gen_range(0..3)];
        let p = Params {
            xf,
            max_job,
            max_jobs: 10_000,
        };
        match xf {
            Xf::Copy | Xf::Direct => {
                let n = rng.gen_range(1..=src_size);
                let data = random_bytes(&mut rng, n as usize);
                r.src.write(sp, &data).unwrap();
                let plan = generate(
                    Span::new(src_size, sp, n),
                    Span::new(sink_size, kp, sink_len),
                    &p,
                    &mut 0,
                    &mut |_| unreachable!(),
                )
                .unwrap();
                assert_eq!(plan.src_used, n.min(sink_len));
                assert!(plan.jobs.iter().all(|j| j.src.unwrap().len <= max_job));
                run_shuffled(&plan.jobs, &r, &keys, slot, &mut rng);
                assert_eq!(
                    read(&r.sink, kp, plan.sink_used),
                    data[..plan.src_used as usize]
                );
                record_case(&plan, xf, &mut seen, &mut in_place);
            }
            Xf::Encrypt => {
                let n = rng.gen_range(1..=src_size);
                let data = random_bytes(&mut rng, n as usize);
                r.src.write(sp, &data).unwrap();
                let mut seq = 0;
                let plan = generate(
                    Span::new(src_size, sp, n),
                    Span::new(sink_size, kp, sink_len),
                    &p,
                    &mut seq,
                    &mut |_| unreachable!(),
                )
                .unwrap();
                run_shuffled(&plan.jobs, &r, &keys, slot, &mut rng);
                let staged = read(&r.sink, kp, plan.sink_used);
                let plain =
                    reference_decrypt(&staged, r.sink.geom.off(kp), sink_size, &key, slot, 0);
                assert_eq!(plain, data[..plan.src_used as usize]);
                if plan.src_used >= 64 {
                    assert!(
                        !staged.windows(64).any(|w| w == &data[..64]),
                        "plaintext visible in the staging bytes"
                    );
                }
                assert!(plan
                    .jobs
                    .iter()
                    .all(|j| j.src.map_or(0, |l| l.len) <= max_job));
                record_case(&plan, xf, &mut seen, &mut in_place);
            }
            Xf::Decrypt => {
                // Messages encrypted with aes-gcm directly into the source.
                let max_msg = rng.gen_range(1..=(src_size / 4).min(sink_size));
                let mut msgs = Vec::new();
                // Fill the source as far as records (and the padding before
                // its end) fit.
                let (mut at, mut used) = (r.src.geom.off(sp), 0u32);
                loop {
                    let m = rng.gen_range(1..=max_msg);
                    let total = crypto::data_record_len(m);
                    let pad = if src_size - at < total {
                        src_size - at
                    } else {
                        0
                    };
                    if used + pad + total > src_size {
                        break;
                    }
                    used += pad + total;
                    at = (at + pad + total) % src_size;
                    msgs.push(random_bytes(&mut rng, m as usize));
                }
                let written = reference_encrypt(&r.src, sp, &msgs, &key, slot);
                let mut seq = 0;
                let sink_len = sink_len.max(msgs[0].len() as u32);
                let plan = generate(
                    Span::new(src_size, sp, written),
                    Span::new(sink_size, kp, sink_len),
                    &p,
                    &mut seq,
                    &mut |ptr| {
                        let mut h = [0u8; 16];
                        r.src.read(ptr, &mut h).map(|_| h)
                    },
                )
                .unwrap();
                run_shuffled(&plan.jobs, &r, &keys, slot, &mut rng);
                let want: Vec<u8> = msgs[..seq as usize].concat();
                assert_eq!(read(&r.sink, kp, plan.sink_used), want);
                assert!(seq >= 1);
                record_case(&plan, xf, &mut seen, &mut in_place);
            }
        }
    }
    for src_wraps in [false, true] {
        for sink_wraps in [false, true] {
            for grows in [false, true] {
                assert!(seen.contains(&(src_wraps, sink_wraps, grows)), "case src_wraps={src_wraps} sink_wraps={sink_wraps} grows={grows} never generated");
            }
        }
    }
    assert!(
        in_place >= 5,
        "Fig. 10 in-place chunking seen {in_place} times"
    );
}

#[test]
fn shuffled_execution_gives_identical_bytes() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(77);
    let keys = KeyStore::new(4);
    let (slot, _) = keys.alloc_random().unwrap();
    let data = random_bytes(&mut rng, 60_000);
    let p = Params {
        xf: Xf::Encrypt,
        max_job: 1000,
        max_jobs: 10_000,
    };
    let mut outputs = Vec::new();
    for _ in 0..3 {
        let r = rings(65536, 65536);
        r.src.write(100 * 16, &data).unwrap();
        let plan = generate(
            Span::new(65536, 1600, 60_000),
            Span::new(65536, 65536 - 496, 65536),
            &p,
            &mut 0,
            &mut |_| unreachable!(),
        )
        .unwrap();
        run_shuffled(&plan.jobs, &r, &keys, slot, &mut rng);
        outputs.push(read(&r.sink, 65536 - 496, plan.sink_used));
    }
    assert_eq!(outputs[0], outputs[1]);
    assert_eq!(outputs[1], outputs[2]);
}
