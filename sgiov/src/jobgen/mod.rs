//! The job generator (SG-IOV §5.2, Fig. 9-10): a pure function from the data
//! in a source ring, the space in a sink ring, a transformation and a
//! maximum job size to a list of jobs whose input and output are each
//! contiguous (the continuity constraint of hardware engines).
//!
//! Recursive strategy: take the first contiguous data chunk of the source
//! (up to its wrap point) and the first contiguous space chunk of the sink,
//! make one job from them, and recurse on what remains. That covers the
//! eight cases (source wraps or not × sink wraps or not × the transform
//! grows or shrinks the data):
//!
//! - `Copy`/`Direct` (size-preserving): the job is as long as the shorter
//!   chunk; at most three jobs cross both wrap points.
//! - `Encrypt` (grows by header, tag and padding): the record's payload is
//!   sized so the record fits the sink chunk; bytes before the sink's end
//!   that cannot hold a record become one `Pad` job.
//! - `Decrypt` (shrinks): one job per record. Records never straddle the
//!   source's end (the encryptor padded), so a source wrap falls between
//!   records. When a record's plaintext would straddle the sink's end — the
//!   one case recursion cannot cover (Fig. 10: shrinking, contiguous source,
//!   wrapping sink) — the record is decrypted *in place* inside the source
//!   and two copy jobs move the plaintext to both sides of the sink's end.
//!
//! No byte goes through a scratch buffer. Jobs are listed in stream order;
//! each carries how far the source tail and sink head may move once it and
//! every job before it completed, so pointers are published in job order.

use crate::exec::crypto::{self, RecordHeader, HDR, KIND_DATA, KIND_PAD, OVERHEAD};
use crate::job::{Buf, JobDesc, Op};
use crate::layout::{limits, ErrorCode};
use crate::mem::MemError;
use crate::ring::RingView;

/// Bytes of one ring: `len` bytes from free-running pointer `ptr` in a ring
/// of `size` bytes (data of a source, space of a sink).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub size: u32,
    pub ptr: u32,
    pub len: u32,
}

impl Span {
    pub fn new(size: u32, ptr: u32, len: u32) -> Span {
        debug_assert!(size.is_power_of_two() && len <= size);
        Span { size, ptr, len }
    }

    /// Contiguous bytes from `ptr` (up to the wrap point).
    pub fn chunk(&self) -> u32 {
        self.len.min(self.size - (self.ptr & (self.size - 1)))
    }

    pub fn off(&self) -> u32 {
        self.ptr & (self.size - 1)
    }

    pub fn advance(&self, n: u32) -> Span {
        Span {
            size: self.size,
            ptr: self.ptr.wrapping_add(n),
            len: self.len - n,
        }
    }

    pub fn wraps(&self, used: u32) -> bool {
        used > self.size - self.off()
    }
}

/// The transformation of a pipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Xf {
    Copy,
    Direct,
    Encrypt,
    Decrypt,
}

impl Xf {
    pub fn grows(self) -> bool {
        self == Xf::Encrypt
    }

    pub fn name(self) -> &'static str {
        match self {
            Xf::Copy => "copy",
            Xf::Direct => "direct",
            Xf::Encrypt => "encrypt",
            Xf::Decrypt => "decrypt",
        }
    }
}

impl std::str::FromStr for Xf {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "copy" => Ok(Xf::Copy),
            "direct" => Ok(Xf::Direct),
            "encrypt" => Ok(Xf::Encrypt),
            "decrypt" => Ok(Xf::Decrypt),
            _ => Err(format!(
                "unknown transformation {s:?} (copy, direct, encrypt, decrypt)"
            )),
        }
    }
}

/// Which ring a job's range is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Src,
    Sink,
}

/// A contiguous range of one of the two rings: ring offset and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loc {
    pub side: Side,
    pub off: u32,
    pub len: u32,
}

/// One generated job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedJob {
    pub op: Op,
    pub src: Option<Loc>,
    pub dst: Option<Loc>,
    pub seq: u64,
    /// Source bytes consumed / sink bytes produced once this job and all
    /// jobs before it are complete.
    pub src_adv: u32,
    pub sink_adv: u32,
    /// Runs only after every earlier job of the pipe, and before any later
    /// one (the in-place decrypt of Fig. 10, which the two copies read).
    pub barrier: bool,
}

impl PlannedJob {
    /// The executor's descriptor for this job, with the source and sink
    /// rings it was planned for.
    pub fn desc(&self, src: &RingView, sink: &RingView, key_slot: u16) -> JobDesc {
        let buf = |l: Option<Loc>| {
            l.map(|l| {
                let v = if l.side == Side::Src { src } else { sink };
                Buf {
                    mem: v.mem.clone(),
                    addr: v.geom.base + l.off as u64,
                    len: l.len,
                }
            })
        };
        JobDesc {
            op: self.op,
            src: buf(self.src),
            dst: buf(self.dst),
            key_slot,
            seq: self.seq,
        }
    }
}

/// What one call generated.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub jobs: Vec<PlannedJob>,
    pub src_used: u32,
    pub sink_used: u32,
    /// The case this call fell in, for tests and statistics.
    pub src_wrapped: bool,
    pub sink_wrapped: bool,
    pub in_place: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum JobGenError {
    #[error("record at source offset {off:#x}: {what}")]
    Record { off: u32, what: &'static str },
    #[error("record at source offset {off:#x}: sequence {got}, expected {want}")]
    Sequence { off: u32, got: u64, want: u64 },
    #[error("reading a record header: {0}")]
    Header(#[source] MemError),
}

impl JobGenError {
    pub fn code(&self) -> ErrorCode {
        match self {
            JobGenError::Sequence { .. } => ErrorCode::Auth,
            _ => ErrorCode::Record,
        }
    }
}

/// Generator parameters.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    pub xf: Xf,
    /// Most input bytes per job (bounds head-of-line blocking).
    pub max_job: u32,
    /// Most jobs to generate in this call.
    pub max_jobs: usize,
}

/// Generates jobs for `src` data and `sink` space. `seq` is the pipe's
/// record counter (next to assign for `Encrypt`, next expected for
/// `Decrypt`), advanced for every record planned. `header` reads the 16
/// header bytes at a source pointer (only `Decrypt` calls it, once per record).
pub fn generate(
    src: Span,
    sink: Span,
    p: &Params,
    seq: &mut u64,
    header: &mut dyn FnMut(u32) -> Result<[u8; 16], MemError>,
) -> Result<Plan, JobGenError> {
    let mut plan = Plan::default();
    step(src, sink, p, seq, header, &mut plan)?;
    plan.src_wrapped = src.wraps(plan.src_used);
    plan.sink_wrapped = sink.wraps(plan.sink_used);
    Ok(plan)
}

fn push(plan: &mut Plan, j: PlannedJob) {
    plan.src_used += j.src_adv;
    plan.sink_used += j.sink_adv;
    plan.jobs.push(j);
}

fn loc(side: Side, span: &Span, delta: u32, len: u32) -> Option<Loc> {
    Some(Loc {
        side,
        off: span.ptr.wrapping_add(delta) & (span.size - 1),
        len,
    })
}

/// One level of the recursion: a job from the first contiguous chunks, then
/// the rest.
fn step(
    src: Span,
    sink: Span,
    p: &Params,
    seq: &mut u64,
    header: &mut dyn FnMut(u32) -> Result<[u8; 16], MemError>,
    plan: &mut Plan,
) -> Result<(), JobGenError> {
    if plan.jobs.len() >= p.max_jobs || src.len == 0 {
        return Ok(());
    }
    let (sc, kc) = (src.chunk(), sink.chunk());
    match p.xf {
        Xf::Copy | Xf::Direct => {
            let n = sc.min(kc).min(p.max_job);
            if n == 0 {
                return Ok(());
            }
            let op = if p.xf == Xf::Copy {
                Op::Copy
            } else {
                Op::Direct
            };
            push(
                plan,
                PlannedJob {
                    op,
                    src: loc(Side::Src, &src, 0, n),
                    dst: loc(Side::Sink, &sink, 0, n),
                    seq: 0,
                    src_adv: n,
                    sink_adv: n,
                    barrier: false,
                },
            );
            step(src.advance(n), sink.advance(n), p, seq, header, plan)
        }
        Xf::Encrypt => {
            if !sink.ptr.is_multiple_of(16) {
                return Err(JobGenError::Record {
                    off: sink.off(),
                    what: "sink head is not 16-byte aligned",
                });
            }
            // Records start and end at multiples of 16; the smallest (1..16
            // payload bytes) takes 48.
            let room = kc & !15;
            if room < OVERHEAD + 16 {
                if kc == sink.len {
                    // The space does not continue past the ring end: wait.
                    return Ok(());
                }
                // Too few bytes before the sink's end: pad them, continue after it.
                push(
                    plan,
                    PlannedJob {
                        op: Op::Pad,
                        src: None,
                        dst: loc(Side::Sink, &sink, 0, kc),
                        seq: 0,
                        src_adv: 0,
                        sink_adv: kc,
                        barrier: false,
                    },
                );
                return step(src, sink.advance(kc), p, seq, header, plan);
            }
            let n = sc.min(room - OVERHEAD).min(p.max_job);
            let total = crypto::data_record_len(n);
            push(
                plan,
                PlannedJob {
                    op: Op::Encrypt,
                    src: loc(Side::Src, &src, 0, n),
                    dst: loc(Side::Sink, &sink, 0, total),
                    seq: *seq,
                    src_adv: n,
                    sink_adv: total,
                    barrier: false,
                },
            );
            *seq += 1;
            step(src.advance(n), sink.advance(total), p, seq, header, plan)
        }
        Xf::Decrypt => {
            if src.len < HDR {
                return Ok(());
            }
            let off = src.off();
            let rec = |what| JobGenError::Record { off, what };
            if sc < HDR || !off.is_multiple_of(16) {
                return Err(rec("header straddles the ring end or is misaligned"));
            }
            let h = RecordHeader::decode(&header(src.ptr).map_err(JobGenError::Header)?);
            match h.kind {
                KIND_PAD => {
                    if !h.len.is_multiple_of(16) || h.total() > (src.size - off) as u64 {
                        return Err(rec("bad padding record"));
                    }
                    let total = h.total() as u32;
                    if total > src.len {
                        return Ok(()); // not all published yet
                    }
                    push(
                        plan,
                        PlannedJob {
                            op: Op::Skip,
                            src: loc(Side::Src, &src, 0, total),
                            dst: None,
                            seq: 0,
                            src_adv: total,
                            sink_adv: 0,
                            barrier: false,
                        },
                    );
                    step(src.advance(total), sink, p, seq, header, plan)
                }
                KIND_DATA => {
                    let n = h.len;
                    if n == 0 || n > limits::MAX_RECORD_PAYLOAD || n > sink.size {
                        return Err(rec("payload length out of range"));
                    }
                    let total = crypto::data_record_len(n);
                    if total > src.size - off {
                        return Err(rec("record straddles the ring end"));
                    }
                    if h.seq != *seq {
                        return Err(JobGenError::Sequence {
                            off,
                            got: h.seq,
                            want: *seq,
                        });
                    }
                    if total > src.len || n > sink.len {
                        return Ok(()); // wait for the rest of the record or for space
                    }
                    let s = *seq;
                    *seq += 1;
                    if n <= kc {
                        push(
                            plan,
                            PlannedJob {
                                op: Op::Decrypt,
                                src: loc(Side::Src, &src, 0, total),
                                dst: loc(Side::Sink, &sink, 0, n),
                                seq: s,
                                src_adv: total,
                                sink_adv: n,
                                barrier: false,
                            },
                        );
                    } else {
                        // Fig. 10: decrypt inside the source, then two copies.
                        plan.in_place = true;
                        let jobs = [
                            PlannedJob {
                                op: Op::Decrypt,
                                src: loc(Side::Src, &src, 0, total),
                                dst: loc(Side::Src, &src, HDR, n),
                                seq: s,
                                src_adv: 0,
                                sink_adv: 0,
                                barrier: true,
                            },
                            PlannedJob {
                                op: Op::Copy,
                                src: loc(Side::Src, &src, HDR, kc),
                                dst: loc(Side::Sink, &sink, 0, kc),
                                seq: 0,
                                src_adv: 0,
                                sink_adv: 0,
                                barrier: false,
                            },
                            PlannedJob {
                                op: Op::Copy,
                                src: loc(Side::Src, &src, HDR + kc, n - kc),
                                dst: loc(Side::Sink, &sink, kc, n - kc),
                                seq: 0,
                                src_adv: total,
                                sink_adv: n,
                                barrier: false,
                            },
                        ];
                        for j in jobs {
                            push(plan, j);
                        }
                    }
                    step(src.advance(total), sink.advance(n), p, seq, header, plan)
                }
                _ => Err(rec("unknown record kind")),
            }
        }
    }
}

#[cfg(test)]
mod tests;
