//! Switching one frame: the switch's routing decision for it, then its
//! buffer handed to each destination (the uplink at once, a VF of this
//! thread through its backlog, another thread's VF through the channel to
//! it), with the counters the dataplane keeps exact.

use super::mempool::Pkt;
use super::switch::{self, PortId, Route};
use super::{Dataplane, BACKLOG_MAX};
use crate::port::AtomicCounters;

impl Dataplane {
    /// Switches one frame: to the uplink at once, to VFs through their
    /// backlog. Returns whether the switch took it (a VF's frame then counts
    /// as the source's `tx_packets`, else as its `tx_drops`: the caller adds
    /// them per burst); each VF it reaches counts it as `rx_packets` when
    /// written into its ring (or `rx_drops`).
    pub(super) fn forward(&mut self, from: PortId, mut pkt: Pkt, out: &mut Vec<PortId>) -> bool {
        let vlan = match from {
            PortId::Uplink => {
                let l = pkt.len;
                let (vid, len) = switch::untag(pkt.buf_mut(), l);
                pkt.len = len;
                vid
            }
            PortId::Vf(i) => self.switch.vf_vlan(i),
        };
        out.clear();
        let route = if pkt.len >= 14 {
            self.switch.decide(from, vlan, pkt.data(), out)
        } else {
            Route::Refused
        };
        match route {
            // A unicast frame, the common case, is just handed on.
            Route::To(Some(dest)) => self.deliver(dest, pkt, vlan),
            // Nowhere to go: a drop at the source, as a refused frame.
            Route::To(None) => {
                self.pool.free(pkt);
                false
            }
            Route::Refused => {
                if let PortId::Vf(i) = from {
                    self.spoofed(i, &pkt);
                }
                self.pool.free(pkt);
                false
            }
            // One buffer per destination: copies first, the original goes last.
            Route::Flood => {
                let copies = out.len().saturating_sub(1);
                let mut taken = false;
                for &dest in &out[..copies] {
                    if let Some(p) = self.pool.clone_pkt(&pkt) {
                        taken |= self.deliver(dest, p, vlan);
                    }
                }
                match out.last() {
                    Some(&dest) => taken | self.deliver(dest, pkt, vlan),
                    None => {
                        self.pool.free(pkt);
                        taken
                    }
                }
            }
        }
    }

    /// Hands `p` to destination `dest` (its buffer goes with it); whether
    /// the switch took it there.
    #[inline]
    fn deliver(&mut self, dest: PortId, mut p: Pkt, vlan: Option<u16>) -> bool {
        match dest {
            PortId::Uplink => {
                if let Some(v) = vlan {
                    let l = p.len;
                    p.len = switch::tag(p.buf_mut(), l, v);
                }
                let sent = self.uplink.as_ref().is_some_and(|u| u.send(p.data()));
                self.pool.free(p);
                sent
            }
            PortId::Vf(j) if !self.peers.mine(j) => {
                if let Err(p) = self.peers.send(j, self.session[j], p) {
                    AtomicCounters::add(&self.ports[j].counters.rx_drops, 1);
                    self.pool.free(p);
                }
                true
            }
            PortId::Vf(j) => {
                if self.backlog[j].len() >= BACKLOG_MAX {
                    AtomicCounters::add(&self.ports[j].counters.rx_drops, 1);
                    self.pool.free(p);
                } else {
                    self.backlog[j].push_back(p);
                }
                true
            }
        }
    }

    /// A frame VF `i` sent that the switch refused: its source MAC is not the
    /// VF's. Said once per VF session (a frontend without `mac=` does it on
    /// every frame).
    fn spoofed(&mut self, i: usize, pkt: &Pkt) {
        let frame = pkt.data();
        if frame.len() < 14 || self.spoof_warned[i] {
            return;
        }
        self.spoof_warned[i] = true;
        let mac = netutil::MacAddr::new;
        tracing::warn!(
            "VF {}: dropping frames with source MAC {} (the VF's MAC is {}): spoof check; \
             a DPDK virtio-user frontend needs mac={}",
            self.ports[i].id,
            mac(switch::src_mac(frame)),
            mac(self.switch.vf_mac(i)),
            mac(self.switch.vf_mac(i)),
        );
    }
}
