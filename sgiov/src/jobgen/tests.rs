//! Tests of the job generator: splits at wrap points, the job size bound,
//! encrypt padding, bad records.

use super::*;

fn no_headers(addr: u32) -> Result<[u8; 16], MemError> {
    Err(MemError::OutOfRange {
        mem: "no headers here".into(),
        addr: addr.into(),
        len: 16,
    })
}

fn params(xf: Xf) -> Params {
    Params {
        xf,
        max_job: 1 << 16,
        max_jobs: 128,
    }
}

#[test]
fn copy_splits_at_both_wrap_points() {
    // Source wraps after 100 bytes, sink after 300: three jobs.
    let src = Span::new(4096, 4096 * 3 - 100, 1000);
    let sink = Span::new(4096, 4096 - 300, 2000);
    let plan = generate(src, sink, &params(Xf::Copy), &mut 0, &mut no_headers).unwrap();
    let lens: Vec<_> = plan.jobs.iter().map(|j| j.src.unwrap().len).collect();
    assert_eq!(lens, vec![100, 200, 700]);
    assert_eq!((plan.src_used, plan.sink_used), (1000, 1000));
    assert!(plan.src_wrapped && plan.sink_wrapped);
    assert_eq!(plan.jobs[1].src.unwrap().off, 0);
    assert_eq!(plan.jobs[1].dst.unwrap().off, 4096 - 200);
    assert_eq!(plan.jobs[2].dst.unwrap().off, 0);
}

#[test]
fn max_job_bounds_every_job() {
    let src = Span::new(1 << 20, 0, 1 << 20);
    let sink = Span::new(1 << 20, 0, 1 << 20);
    let p = Params {
        max_job: 4096,
        ..params(Xf::Copy)
    };
    let plan = generate(src, sink, &p, &mut 0, &mut no_headers).unwrap();
    assert_eq!(plan.jobs.len(), 128, "max_jobs stops the recursion");
    assert!(plan.jobs.iter().all(|j| j.src.unwrap().len == 4096));
}

#[test]
fn encrypt_pads_a_short_tail() {
    // 32 bytes before the sink's end: too few for a record.
    let src = Span::new(4096, 0, 100);
    let sink = Span::new(4096, 4096 - 32, 2000);
    let mut seq = 9;
    let plan = generate(src, sink, &params(Xf::Encrypt), &mut seq, &mut no_headers).unwrap();
    assert_eq!(plan.jobs[0].op, Op::Pad);
    assert_eq!(plan.jobs[0].dst.unwrap().len, 32);
    assert_eq!(plan.jobs[1].op, Op::Encrypt);
    assert_eq!(
        plan.jobs[1].dst.unwrap(),
        Loc {
            side: Side::Sink,
            off: 0,
            len: 32 + 112
        }
    );
    assert_eq!(plan.jobs[1].seq, 9);
    assert_eq!(seq, 10);
    // Without space after the end, it waits instead of padding.
    let sink = Span::new(4096, 4096 - 32, 32);
    let plan = generate(src, sink, &params(Xf::Encrypt), &mut seq, &mut no_headers).unwrap();
    assert!(plan.jobs.is_empty());
}

#[test]
fn decrypt_rejects_bad_records() {
    let mut seq = 0;
    let hdr = |h: RecordHeader| move |_: u32| Ok::<_, MemError>(h.encode());
    let src = Span::new(4096, 0, 4096);
    let sink = Span::new(4096, 0, 4096);
    let p = params(Xf::Decrypt);
    let e = generate(src, sink, &p, &mut seq, &mut hdr(RecordHeader::data(0, 0))).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Record);
    let e = generate(
        src,
        sink,
        &p,
        &mut seq,
        &mut hdr(RecordHeader::data(5000, 0)),
    )
    .unwrap_err();
    assert_eq!(e.code(), ErrorCode::Record);
    let e = generate(src, sink, &p, &mut seq, &mut hdr(RecordHeader::data(10, 3))).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Auth);
    let mut bogus = RecordHeader::data(10, 0);
    bogus.kind = 7;
    assert!(generate(src, sink, &p, &mut seq, &mut hdr(bogus)).is_err());
    // A record that would straddle the source's end.
    let near_end = Span::new(4096, 4096 - 64, 4096);
    let e = generate(
        near_end,
        sink,
        &p,
        &mut seq,
        &mut hdr(RecordHeader::data(100, 0)),
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            JobGenError::Record {
                off: 4032,
                what: "record straddles the ring end"
            }
        ),
        "{e:?}"
    );
    // A misaligned record start.
    let odd = Span::new(4096, 8, 100);
    assert!(generate(odd, sink, &p, &mut seq, &mut hdr(RecordHeader::data(10, 0))).is_err());
    // An incomplete record waits.
    let short = Span::new(4096, 0, 40);
    let plan = generate(
        short,
        sink,
        &p,
        &mut seq,
        &mut hdr(RecordHeader::data(10, 0)),
    )
    .unwrap();
    assert!(plan.jobs.is_empty());
    assert_eq!(seq, 0);
}

#[test]
fn fig10_in_place_chunking() {
    // One record of 3 units (48 bytes payload) with 32 bytes of sink before its end.
    let mut seq = 0;
    let rec = RecordHeader::data(48, 0);
    let src = Span::new(4096, 256, crypto::data_record_len(48));
    let sink = Span::new(4096, 4096 - 32, 1000);
    let plan = generate(src, sink, &params(Xf::Decrypt), &mut seq, &mut |_| {
        Ok(rec.encode())
    })
    .unwrap();
    assert!(plan.in_place && plan.sink_wrapped && !plan.src_wrapped);
    let ops: Vec<_> = plan.jobs.iter().map(|j| (j.op, j.barrier)).collect();
    assert_eq!(
        ops,
        vec![(Op::Decrypt, true), (Op::Copy, false), (Op::Copy, false)]
    );
    assert_eq!(
        plan.jobs[0].dst.unwrap(),
        Loc {
            side: Side::Src,
            off: 256 + 16,
            len: 48
        }
    );
    assert_eq!(
        plan.jobs[1].dst.unwrap(),
        Loc {
            side: Side::Sink,
            off: 4096 - 32,
            len: 32
        }
    );
    assert_eq!(
        plan.jobs[2].src.unwrap(),
        Loc {
            side: Side::Src,
            off: 256 + 16 + 32,
            len: 16
        }
    );
    assert_eq!(
        plan.jobs[2].dst.unwrap(),
        Loc {
            side: Side::Sink,
            off: 0,
            len: 16
        }
    );
    assert_eq!((plan.src_used, plan.sink_used), (80, 48));
}
