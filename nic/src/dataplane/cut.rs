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

use super::mempool::{Pkt, BUF_SIZE};
use super::switch::{PortId, Route};
use super::virtio::{self, Chain, Fault, Scratch, View, Xlat, MIN_FRAME, VLAN_ROOM};
use super::Dataplane;
use crate::memory::VfMemory;
use crate::port::{AtomicCounters, Runtime, RXQ, TXQ};

const ETH_HDR: usize = 14;

/// A fault of the destination VF met while serving a source's burst: the
/// destination goes to error once the source's runtime is back.
pub(super) struct DestFault(pub usize, pub Fault);

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
        let hdr_len = src.hdr_len as u64;
        let gm = Xlat::new(&mem.gm);
        let view = virtio::view(src, &gm, TXQ)?;
        let prepare = virtio::preparer(mem);
        let Scratch {
            split, used, heads, ..
        } = scratch;
        used.clear();
        virtio::take_heads(&view, src, TXQ, self.batch, heads)?;
        let vlan = self.switch.vf_vlan(i);
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
                let cut = self.try_cut(i, vlan, hdr_len, &chain, (&view, &prepare), heads, k);
                // A destination failed: it goes to error after the burst, and
                // no more frames are cut through in this one.
                if let Some(f) = self.cut_fault.take() {
                    *dest_fault = Some(f);
                    cutting = false;
                }
                match cut {
                    Ok(Some((n, bytes))) => {
                        used.extend(heads[k..k + n].iter().map(|&h| (h, 0)));
                        count.1 += n as u64;
                        count.2 += bytes;
                        k += n;
                        continue;
                    }
                    Ok(None) => {}
                    Err((f, n, bytes)) => {
                        // The source failed after `n` frames went through.
                        count.1 += n as u64;
                        count.2 += bytes;
                        break Err(f);
                    }
                }
            }
            // The packet-buffer path, for this frame and the rest of the burst.
            cutting = false;
            used.push((head, 0));
            match virtio::copy_out(
                &chain,
                (&gm, &prepare, split),
                hdr_len,
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

    /// Frame `heads[k]` (its chain `chain`) and the ones after it cut
    /// through to their destination, if the first can be: `Some((frames,
    /// bytes))`, or `None` for the packet-buffer path. A destination's
    /// fault is left in `cut_fault`; the source's comes back as the error,
    /// with the frames and bytes that went through before it.
    #[allow(clippy::too_many_arguments)]
    fn try_cut(
        &mut self,
        i: usize,
        vlan: Option<u16>,
        hdr_len: u64,
        chain: &Chain<'_, '_>,
        (view, prepare): (&View<'_, '_>, &impl virtq::Prepare),
        heads: &[u16],
        k: usize,
    ) -> Result<Option<(usize, u64)>, (Fault, usize, u64)> {
        let Chain::One(one) = chain else {
            return Ok(None);
        };
        let Some(eth) = read_eth(one, prepare, hdr_len).map_err(|f| (f, 0, 0))? else {
            return Ok(None);
        };
        let j = match self.route_unicast(i, vlan, &eth) {
            Some(j) if self.cut_ok(j) => j,
            _ => return Ok(None),
        };
        match self.cut_run(j, (i, vlan, hdr_len), (view, prepare), &heads[k..]) {
            (0, _, None) => Ok(None),
            (n, bytes, None) => Ok(Some((n, bytes))),
            (n, bytes, Some(f)) => Err((f, n, bytes)),
        }
    }

    /// The VF a unicast frame with Ethernet header `eth` from VF `i` goes
    /// to, if the switch sends it to one.
    fn route_unicast(&self, i: usize, vlan: Option<u16>, eth: &[u8; ETH_HDR]) -> Option<usize> {
        if eth[0] & 1 != 0 {
            return None;
        }
        // Unicast: `decide` writes no destination list.
        match self
            .switch
            .decide(PortId::Vf(i), vlan, eth, &mut Vec::new())
        {
            Route::To(Some(PortId::Vf(j))) => Some(j),
            _ => None,
        }
    }

    /// Whether VF `j` can take a frame straight into its receive queue now.
    fn cut_ok(&self, j: usize) -> bool {
        self.peers.mine(j)
            && self.backlog[j].is_empty()
            && self.owned[j]
                .as_ref()
                .is_some_and(|rt| rt.active && !rt.failed && rt.vrings[RXQ].usable())
    }

    /// Cuts frames `heads[0..]` of the source's burst through to VF `j`
    /// while they are one-descriptor frames for `j` and `j` has a simple
    /// receive buffer big enough for each (in the order it posted them).
    /// Returns how many went, their bytes, and the source's fault if its
    /// chain or memory failed; a fault of `j` is left in `cut_fault`.
    fn cut_run(
        &mut self,
        j: usize,
        (i, vlan, hdr_len): (usize, Option<u16>, u64),
        (view, prepare): (&View<'_, '_>, &impl virtq::Prepare),
        heads: &[u16],
    ) -> (usize, u64, Option<Fault>) {
        let rt = self.owned[j].as_mut().expect("cut_ok");
        virtio::quiet(rt, RXQ);
        let mem_j: Arc<VfMemory> = rt.mem.clone().expect("usable ring implies a memory table");
        let gm_j = Xlat::new(&mem_j.gm);
        let view_j = match virtio::view(rt, &gm_j, RXQ) {
            Ok(v) => v,
            Err(f) => {
                self.cut_fault = Some(DestFault(j, f));
                return (0, 0, None);
            }
        };
        let prep_j = virtio::preparer(&mem_j);
        let next = rt.vrings[RXQ].queue.next_avail();
        let pending = match view_j.pending(next) {
            Ok(n) => usize::from(n),
            Err(source) => {
                self.cut_fault = Some(DestFault(j, Fault::Ring { q: RXQ, source }));
                return (0, 0, None);
            }
        };
        let hdr_j = rt.hdr_len;
        // virtio_net_hdr: all zero (no offloads), num_buffers = 1 when present.
        let mut vnet = [0u8; 12];
        if hdr_j == 12 {
            vnet[10] = 1;
        }
        let max = heads.len().min(pending).min(MAX_RUN);
        for n in 0..max {
            view_j.prefetch_desc(view_j.avail_head(next.wrapping_add(n as u16)));
        }
        let mut rx_used = [(0u16, 0u32); MAX_RUN];
        let (mut n, mut bytes, mut src_fault) = (0usize, 0u64, None);
        while n < max {
            let head = heads[n];
            let src = match Chain::take(view, TXQ, head, &mut self.scratch_split) {
                Ok(Chain::One(one)) => one,
                Ok(Chain::Split(_)) => break,
                Err(f) => {
                    src_fault = Some(f);
                    break;
                }
            };
            let frame_len = (u64::from(src.buf.len).saturating_sub(hdr_len)) as usize;
            if !(MIN_FRAME..=BUF_SIZE - VLAN_ROOM).contains(&frame_len) {
                break;
            }
            let eth = match read_eth(&src, prepare, hdr_len) {
                Ok(Some(eth)) => eth,
                Ok(None) => break,
                Err(f) => {
                    src_fault = Some(f);
                    break;
                }
            };
            if self.route_unicast(i, vlan, &eth) != Some(j) {
                break;
            }
            let dhead = view_j.avail_head(next.wrapping_add(n as u16));
            let len = hdr_j + frame_len;
            // Anything but one writable buffer big enough: the receive path
            // (which drops a frame on a short buffer, faults a bad chain).
            let Some(dst) = view_j
                .one_buf(dhead)
                .filter(|d| d.writable && d.buf.len as usize >= len)
            else {
                break;
            };
            // The checked header first (from our copy), then the rest of the
            // frame guest to guest.
            let copied = dst
                .write(&prep_j, 0, &[&vnet[..hdr_j], &eth])
                .map_err(|source| (false, source))
                .and_then(|()| {
                    src.copy_to(
                        prepare,
                        hdr_len + ETH_HDR as u64,
                        &dst,
                        &prep_j,
                        (hdr_j + ETH_HDR) as u64,
                        frame_len - ETH_HDR,
                    )
                    .map_err(|source| (true, source))
                });
            match copied {
                Ok(()) => {}
                // Which side refused: `copy_to` prepares the source's range first.
                Err((_, source @ virtq::CopyError::Prepare { addr, .. }))
                    if addr >= src.buf.addr && addr < src.buf.addr + u64::from(src.buf.len) =>
                {
                    src_fault = Some(Fault::Copy {
                        q: TXQ,
                        head,
                        source,
                    });
                    break;
                }
                Err((_, source)) => {
                    self.cut_fault = Some(DestFault(
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
            bytes += frame_len as u64;
            n += 1;
        }
        let rt = self.owned[j].as_mut().expect("cut_ok");
        rt.vrings[RXQ]
            .queue
            .set_next_avail(next.wrapping_add(n as u16));
        if let Err(f) = virtio::complete(rt, &view_j, RXQ, &rx_used[..n]) {
            self.cut_fault = Some(DestFault(j, f));
        }
        let c = &self.ports[j].counters;
        AtomicCounters::add_burst([(&c.rx_packets, n as u64), (&c.rx_bytes, bytes)]);
        (n, bytes, src_fault)
    }
}

/// Frames cut through to one destination in one go (its used entries are
/// kept on the stack).
const MAX_RUN: usize = 64;

/// The Ethernet header of a one-descriptor transmit frame (our copy: what
/// the switch routes by is what the destination gets), if the frame has one.
fn read_eth(
    one: &virtq::OneBuf<'_, Xlat<'_>>,
    prepare: &impl virtq::Prepare,
    hdr_len: u64,
) -> Result<Option<[u8; ETH_HDR]>, Fault> {
    if u64::from(one.buf.len) < hdr_len + ETH_HDR as u64 {
        return Ok(None);
    }
    let mut eth = [0u8; ETH_HDR];
    one.read(prepare, hdr_len, &mut eth)
        .map_err(|source| Fault::Copy {
            q: TXQ,
            head: one.head,
            source,
        })?;
    Ok(Some(eth))
}
