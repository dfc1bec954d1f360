//! Cut-through: a unicast frame from one VF to another VF of the same
//! thread goes straight from the source's transmit buffer into the
//! destination's receive buffer, one copy, no packet buffer and no backlog
//! (a hardware VEB does the same: the frame crosses the switch once). The
//! switch decides on a copy of the Ethernet header taken first, and that
//! checked copy is what the destination receives: the source guest can
//! change its buffer meanwhile but not the addresses the frame was routed
//! by. Anything else (flood, uplink, another thread's VF, a destination
//! with frames waiting or no simple receive buffer posted, a chain of more
//! than one descriptor) takes the packet-buffer path, and so does the rest
//! of the burst once one frame took it, so that no frame overtakes another
//! of the same source.

use std::sync::Arc;

use virtio_queue::QueueT;
use virtq::{OneBuf, Split};

use super::mempool::Pkt;
use super::switch::{Macs, PortId, Route};
use super::virtio::{self, Chain, Fault, Scratch, View, Xlat};
use super::Dataplane;
use crate::memory::VfMemory;
use crate::port::{AtomicCounters, Runtime, RXQ, TXQ};

const ETH_HDR: usize = 14;

/// Our copy of a frame's Ethernet header as two overlapping words, `lo`
/// its bytes 0..8 and `hi` its bytes 6..14, read from the guest's buffer
/// straight into registers and written out from them (the way a 14-byte
/// copy moves it): routed on without a round through memory, see
/// `virtq::OneBuf::read_obj`. Stored `lo` first and `hi` second, the
/// destination gets bytes 6..8 from `hi`, whose source MAC the switch
/// checked, so it receives exactly the addresses the frame was routed by.
#[derive(Clone, Copy)]
struct EthWords {
    lo: u64,
    hi: u64,
}

impl EthWords {
    fn macs(self) -> Macs {
        Macs::of_words(self.lo, self.hi)
    }
}

/// A fault of the destination VF met while serving a source's burst: the
/// destination goes to error once the source's runtime is back.
pub(super) struct DestFault(pub usize, pub Fault);

/// A transmit frame that can be cut through: one descriptor, a length the
/// switch takes, a unicast destination VF.
struct Candidate<'v, 'm> {
    src: OneBuf<'v, Xlat<'m>>,
    /// Our copy of its Ethernet header: routed by, and delivered.
    eth: EthWords,
    frame_len: usize,
    dest: usize,
}

/// How a run of frames cut through to one destination ended.
#[derive(Default)]
struct Run {
    frames: usize,
    bytes: u64,
    /// The source's chain or memory failed (after `frames` went through).
    src_fault: Option<Fault>,
    dest_fault: Option<DestFault>,
}

/// What every frame of the source's burst shares.
struct Burst<'a, 'v, 'm, P> {
    i: usize,
    vlan: Option<u16>,
    hdr_len: u64,
    view: &'a View<'v, 'm>,
    prepare: &'a P,
}

impl Dataplane {
    /// VF `i`'s transmit queue: frames cut through to their destination
    /// or copied into `out` for the switch (as `virtio::take_guest_tx`).
    /// Returns how many chains it took, and a destination's fault if one
    /// failed on the way.
    pub(super) fn tx_burst(
        &mut self,
        i: usize,
        src: &mut Runtime,
        out: &mut Vec<Pkt>,
    ) -> (Result<usize, Fault>, Option<DestFault>) {
        if !src.active || src.failed || !src.vrings[TXQ].usable() {
            return (Ok(0), None);
        }
        let mem = src.mem.take().expect("usable ring implies a memory table");
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut dest_fault = None;
        let r = self.tx_burst_inner(i, src, &mem, &mut scratch, out, &mut dest_fault);
        self.scratch = scratch;
        src.mem = Some(mem);
        (r, dest_fault)
    }

    fn tx_burst_inner(
        &mut self,
        i: usize,
        src: &mut Runtime,
        mem: &VfMemory,
        scratch: &mut Scratch,
        out: &mut Vec<Pkt>,
        dest_fault: &mut Option<DestFault>,
    ) -> Result<usize, Fault> {
        let gm = Xlat::new(&mem.gm);
        let view = virtio::view(src, &gm, TXQ)?;
        let prepare = virtio::preparer(mem);
        let b = Burst {
            i,
            vlan: self.switch.vf_vlan(i),
            hdr_len: src.hdr_len as u64,
            view: &view,
            prepare: &prepare,
        };
        let Scratch { split, used, heads } = scratch;
        used.clear();
        virtio::take_heads(&view, src, TXQ, self.batch, heads)?;
        // (drops, frames cut through, their bytes): added on every way out.
        let mut count = (0u64, 0u64, 0u64);
        let mut cutting = true;
        let mut k = 0;
        let r = loop {
            let Some(&head) = heads.get(k) else {
                break Ok(());
            };
            let chain = match Chain::take(&view, TXQ, head, split) {
                Ok(c) => c,
                Err(f) => break Err(f),
            };
            if cutting {
                let first = match self.candidate(&b, &chain) {
                    Ok(c) => c.filter(|c| self.cut_ok(c.dest)),
                    Err(f) => break Err(f),
                };
                if let Some(first) = first {
                    let run = self.cut_run(&b, first, &heads[k..], split);
                    used.extend(heads[k..k + run.frames].iter().map(|&h| (h, 0)));
                    count.1 += run.frames as u64;
                    count.2 += run.bytes;
                    k += run.frames;
                    // A destination failed: it goes to error after the burst,
                    // and no more frames are cut through in this one.
                    if run.dest_fault.is_some() {
                        *dest_fault = run.dest_fault;
                        cutting = false;
                    }
                    if let Some(f) = run.src_fault {
                        break Err(f);
                    }
                    if run.frames > 0 {
                        continue;
                    }
                }
            }
            // The packet-buffer path, for this frame and the rest of the burst.
            cutting = false;
            used.push((head, 0));
            match virtio::copy_out(
                &chain,
                (&gm, &prepare, split),
                b.hdr_len,
                head,
                &mut self.pool,
            ) {
                Ok(Some(pkt)) => out.push(pkt),
                Ok(None) => count.0 += 1,
                Err(f) => break Err(f),
            }
            k += 1;
        };
        let c = &self.ports[i].counters;
        AtomicCounters::add_burst([
            (&c.tx_drops, count.0),
            (&c.tx_packets, count.1),
            (&c.tx_bytes, count.2),
        ]);
        r?;
        virtio::complete(src, &view, TXQ, used)?;
        Ok(used.len())
    }

    /// `chain` as a cut-through candidate, if it is one; a source fault if
    /// its Ethernet header cannot be read. (Inlined: it is the per-frame
    /// check of every cut frame.)
    #[inline(always)]
    fn candidate<'v, 'm, P: virtq::Prepare>(
        &self,
        b: &Burst<'_, 'v, 'm, P>,
        chain: &Chain<'v, 'm>,
    ) -> Result<Option<Candidate<'v, 'm>>, Fault> {
        let Chain::One(src) = *chain else {
            return Ok(None);
        };
        // At least MIN_FRAME (an Ethernet header) long.
        let Some(frame_len) = virtio::frame_len(u64::from(src.buf.len), b.hdr_len) else {
            return Ok(None);
        };
        let fault = |source| Fault::Copy {
            q: TXQ,
            head: src.head,
            source,
        };
        let eth = EthWords {
            lo: src.read_obj(b.prepare, b.hdr_len).map_err(fault)?,
            hi: src.read_obj(b.prepare, b.hdr_len + 6).map_err(fault)?,
        };
        let macs = eth.macs();
        if macs.group() {
            return Ok(None);
        }
        // Unicast: `decide_macs` writes no destination list.
        let dest = match self
            .switch
            .decide_macs(PortId::Vf(b.i), b.vlan, macs, &mut Vec::new())
        {
            Route::To(Some(PortId::Vf(j))) => j,
            _ => return Ok(None),
        };
        Ok(Some(Candidate {
            src,
            eth,
            frame_len,
            dest,
        }))
    }

    /// Whether VF `j` can take a frame straight into its receive queue now.
    fn cut_ok(&self, j: usize) -> bool {
        self.peers.mine(j)
            && self.backlog[j].is_empty()
            && self.owned[j]
                .as_ref()
                .is_some_and(|rt| rt.active && !rt.failed && rt.vrings[RXQ].usable())
    }

    /// Cuts `first` (the frame at `heads[0]`, for a destination `cut_ok`
    /// accepted) and the frames after it through to that destination while
    /// they are candidates for it and it has a one-descriptor receive
    /// buffer big enough for each (in the order it posted them).
    fn cut_run<P: virtq::Prepare>(
        &mut self,
        b: &Burst<'_, '_, '_, P>,
        first: Candidate<'_, '_>,
        heads: &[u16],
        split: &mut Split,
    ) -> Run {
        let j = first.dest;
        let dest_fault = |f| Run {
            dest_fault: Some(DestFault(j, f)),
            ..Run::default()
        };
        let rt = self.owned[j].as_mut().expect("cut_ok");
        virtio::quiet(rt, RXQ);
        let mem_j: Arc<VfMemory> = rt.mem.clone().expect("usable ring implies a memory table");
        let gm_j = Xlat::new(&mem_j.gm);
        let view_j = match virtio::view(rt, &gm_j, RXQ) {
            Ok(v) => v,
            Err(f) => return dest_fault(f),
        };
        let prep_j = virtio::preparer(&mem_j);
        let next = rt.vrings[RXQ].queue.next_avail();
        let pending = match view_j.pending(next) {
            Ok(n) => usize::from(n),
            Err(source) => return dest_fault(Fault::Ring { q: RXQ, source }),
        };
        let hdr_j = rt.hdr_len;
        let vnet = virtio::rx_hdr(hdr_j);
        let max = heads.len().min(pending).min(MAX_RUN);
        for n in 0..max {
            view_j.prefetch_desc(view_j.avail_head(next.wrapping_add(n as u16)));
        }
        let mut rx_used = [(0u16, 0u32); MAX_RUN];
        let mut run = Run::default();
        let mut cand = Some(first);
        while run.frames < max {
            let n = run.frames;
            let c = match cand.take() {
                Some(c) => c,
                None => {
                    let next_cand = Chain::take(b.view, TXQ, heads[n], split)
                        .and_then(|chain| self.candidate(b, &chain));
                    match next_cand {
                        Ok(Some(c)) if c.dest == j => c,
                        Ok(_) => break,
                        Err(f) => {
                            run.src_fault = Some(f);
                            break;
                        }
                    }
                }
            };
            let dhead = view_j.avail_head(next.wrapping_add(n as u16));
            let len = hdr_j + c.frame_len;
            // Anything but one writable buffer big enough: the receive path
            // (which drops a frame on a short buffer, faults a bad chain).
            let Some(dst) = view_j
                .one_buf(dhead)
                .filter(|d| d.writable && d.buf.len as usize >= len)
            else {
                break;
            };
            // The virtio-net header (the usual 12 bytes, MRG_RXBUF or
            // VERSION_1, as stores of a constant; the legacy 10 as bytes),
            // the checked Ethernet header from our registers, then the rest
            // of the frame guest to guest.
            let hdr = match hdr_j {
                12 => dst.write_obj(&prep_j, 0, vnet),
                n => dst.write(&prep_j, 0, &[&vnet[..n]]),
            };
            let copied = hdr
                .and_then(|()| dst.write_obj(&prep_j, hdr_j as u64, c.eth.lo))
                .and_then(|()| dst.write_obj(&prep_j, hdr_j as u64 + 6, c.eth.hi))
                .and_then(|()| {
                    c.src.copy_to(
                        b.prepare,
                        b.hdr_len + ETH_HDR as u64,
                        &dst,
                        &prep_j,
                        (hdr_j + ETH_HDR) as u64,
                        c.frame_len - ETH_HDR,
                    )
                });
            match copied {
                Ok(()) => {}
                // Which side refused: `copy_to` prepares the source's range first.
                Err(source @ virtq::CopyError::Prepare { addr, .. })
                    if addr >= c.src.buf.addr
                        && addr < c.src.buf.addr + u64::from(c.src.buf.len) =>
                {
                    run.src_fault = Some(Fault::Copy {
                        q: TXQ,
                        head: heads[n],
                        source,
                    });
                    break;
                }
                Err(source) => {
                    run.dest_fault = Some(DestFault(
                        j,
                        Fault::Copy {
                            q: RXQ,
                            head: dhead,
                            source,
                        },
                    ));
                    break;
                }
            }
            rx_used[n] = (dhead, len as u32);
            run.bytes += c.frame_len as u64;
            run.frames += 1;
        }
        let rt = self.owned[j].as_mut().expect("cut_ok");
        rt.vrings[RXQ]
            .queue
            .set_next_avail(next.wrapping_add(run.frames as u16));
        if let Err(f) = virtio::complete(rt, &view_j, RXQ, &rx_used[..run.frames]) {
            run.dest_fault = Some(DestFault(j, f));
        }
        let c = &self.ports[j].counters;
        AtomicCounters::add_burst([(&c.rx_packets, run.frames as u64), (&c.rx_bytes, run.bytes)]);
        run
    }
}

/// Frames cut through to one destination in one go (its used entries are
/// kept on the stack).
const MAX_RUN: usize = 64;
