//! The L2 switch between the VFs of one PF and its uplink (a VEB, as in an
//! SR-IOV NIC). Each VF has a fixed MAC (frames with another source MAC are
//! dropped: spoof check) and an optional VLAN; VFs and uplink traffic with the
//! same VLAN (or none) form one segment. As in an SR-IOV NIC every VF MAC is
//! known, so unicast goes to exactly one place and is never flooded: a
//! tenant's frames reach no other tenant, also while its VF is not open.

pub const ETH_P_8021Q: u16 = 0x8100;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortId {
    Uplink,
    Vf(usize),
}

/// What the switch knows about a VF (from its config and session).
#[derive(Debug, Clone, Copy)]
pub struct VfView {
    pub mac: [u8; 6],
    pub vlan: Option<u16>,
    pub active: bool,
}

/// Where the switch sends one frame ([`Switch::decide`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Refused: the source MAC is not the sending VF's (spoof check).
    Refused,
    /// Unicast, taken: to this port, or nowhere (a VF that is not open, or
    /// in another segment; an unknown address from the uplink).
    To(Option<PortId>),
    /// Broadcast or multicast, taken: to the ports written to `out`.
    Flood,
}

#[derive(Debug, Default)]
pub struct Switch {
    vfs: Vec<VfView>,
    /// Per VF, its MAC as a 48-bit number (`mac48`), and the same only
    /// while the VF is active (else `INACTIVE`, which no unicast address
    /// equals): the per-frame lookups compare one word per VF.
    macs: Vec<u64>,
    active_macs: Vec<u64>,
}

/// No unicast MAC: the group bit is set.
const INACTIVE: u64 = u64::MAX;

/// The low 48 bits of a word: a MAC address read as the 8 bytes from its first.
const MAC48: u64 = (1 << 48) - 1;

/// A frame's two addresses as the switch compares them: each MAC a 48-bit
/// number (its 6 bytes little-endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Macs {
    pub dst: u64,
    pub src: u64,
}

impl Macs {
    /// Of a frame of at least 14 bytes: two 8-byte loads, bytes 0..8 and
    /// 6..14, the words a 14-byte copy into the frame was stored as.
    #[inline]
    pub fn of(frame: &[u8]) -> Macs {
        let word =
            |at: usize| u64::from_le_bytes(frame[at..at + 8].try_into().expect("checked length"));
        Macs::of_words(word(0), word(6))
    }

    /// Of an Ethernet header held as two little-endian words: `lo` its
    /// bytes 0..8, `hi` its bytes 6..14 (the destination's and the source's
    /// MAC, each with the bytes after it).
    #[inline]
    pub fn of_words(lo: u64, hi: u64) -> Macs {
        Macs {
            dst: lo & MAC48,
            src: hi & MAC48,
        }
    }

    /// Broadcast or multicast: the group bit, the first byte's lowest.
    #[inline]
    pub fn group(&self) -> bool {
        self.dst & 1 != 0
    }
}

/// `mac` as the switch compares it.
fn mac48(mac: &[u8; 6]) -> u64 {
    let mut w = [0u8; 8];
    w[..6].copy_from_slice(mac);
    u64::from_le_bytes(w)
}

pub fn src_mac(frame: &[u8]) -> [u8; 6] {
    frame[6..12].try_into().expect("frame has 14 bytes")
}

impl Switch {
    pub fn new(n_vfs: usize) -> Self {
        Switch {
            vfs: vec![
                VfView {
                    mac: [0; 6],
                    vlan: None,
                    active: false
                };
                n_vfs
            ],
            macs: vec![0; n_vfs],
            active_macs: vec![INACTIVE; n_vfs],
        }
    }

    pub fn set_vf(&mut self, i: usize, v: VfView) {
        self.vfs[i] = v;
        self.macs[i] = mac48(&v.mac);
        self.active_macs[i] = if v.active { self.macs[i] } else { INACTIVE };
    }

    pub fn vf_mac(&self, i: usize) -> [u8; 6] {
        self.vfs[i].mac
    }

    pub fn vf_vlan(&self, i: usize) -> Option<u16> {
        self.vfs[i].vlan
    }

    /// Output ports for a frame that entered at `from` in VLAN segment `vlan`
    /// (the frame is untagged here), in `out` (cleared first). `false`
    /// means: drop (spoofed source). See [`Switch::decide`].
    pub fn route(
        &mut self,
        from: PortId,
        vlan: Option<u16>,
        frame: &[u8],
        out: &mut Vec<PortId>,
    ) -> bool {
        out.clear();
        match self.decide(from, vlan, frame, out) {
            Route::Refused => false,
            Route::To(port) => {
                out.extend(port);
                true
            }
            Route::Flood => true,
        }
    }

    /// Where a frame (at least 14 bytes, untagged) that entered at `from` in
    /// VLAN segment `vlan` goes; for a flood, the ports are pushed to `out`.
    ///
    /// Unicast to an open VF of the segment goes to that VF; to the MAC of a
    /// VF that is not open (not yet, or its VMM died) or in another segment,
    /// nowhere; to any other address, to the uplink (from a VF) or nowhere
    /// (from the uplink). Broadcast and multicast flood the segment.
    #[inline]
    pub fn decide(
        &self,
        from: PortId,
        vlan: Option<u16>,
        frame: &[u8],
        out: &mut Vec<PortId>,
    ) -> Route {
        self.decide_macs(from, vlan, Macs::of(frame), out)
    }

    /// [`Switch::decide`] on a frame's addresses. (Inlined: a call's
    /// register saves are stores, queued behind the copies into receive
    /// buffers that wait for their cache lines.)
    #[inline(always)]
    pub fn decide_macs(
        &self,
        from: PortId,
        vlan: Option<u16>,
        m: Macs,
        out: &mut Vec<PortId>,
    ) -> Route {
        if let PortId::Vf(i) = from {
            if self.macs[i] != m.src {
                return Route::Refused;
            }
        }
        if !m.group() {
            let dst = m.dst;
            let hit = self
                .active_macs
                .iter()
                .zip(&self.vfs)
                .position(|(&m, v)| m == dst && v.vlan == vlan);
            return Route::To(match hit {
                Some(i) if PortId::Vf(i) != from => Some(PortId::Vf(i)),
                Some(_) => None,
                None if from != PortId::Uplink && !self.macs.contains(&dst) => Some(PortId::Uplink),
                None => None,
            });
        }
        for (i, v) in self.vfs.iter().enumerate() {
            if v.active && v.vlan == vlan && PortId::Vf(i) != from {
                out.push(PortId::Vf(i));
            }
        }
        if from != PortId::Uplink {
            out.push(PortId::Uplink);
        }
        Route::Flood
    }
}

/// Removes an 802.1Q tag in place; returns the VLAN id and the new length.
pub fn untag(buf: &mut [u8], len: usize) -> (Option<u16>, usize) {
    if len >= 18 && u16::from_be_bytes([buf[12], buf[13]]) == ETH_P_8021Q {
        let vid = u16::from_be_bytes([buf[14], buf[15]]) & 0x0fff;
        buf.copy_within(16..len, 12);
        (Some(vid), len - 4)
    } else {
        (None, len)
    }
}

/// Inserts an 802.1Q tag in place (the buffer must have 4 spare bytes).
pub fn tag(buf: &mut [u8], len: usize, vid: u16) -> usize {
    buf.copy_within(12..len, 16);
    buf[12..14].copy_from_slice(&ETH_P_8021Q.to_be_bytes());
    buf[14..16].copy_from_slice(&(vid & 0x0fff).to_be_bytes());
    len + 4
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(dst: [u8; 6], src: [u8; 6]) -> Vec<u8> {
        let mut f = dst.to_vec();
        f.extend_from_slice(&src);
        f.extend_from_slice(&[0x08, 0x00, 1, 2, 3]);
        f
    }

    #[test]
    fn macs_are_the_addresses_as_48_bit_numbers() {
        let f = frame([2, 0xaa, 3, 4, 5, 0xf6], [0x12, 0, 0, 0, 0, 0x99]);
        let m = Macs::of(&f);
        assert_eq!(m.dst, 0xf6_05_04_03_aa_02);
        assert_eq!(m.src, 0x99_00_00_00_00_12);
        assert_eq!(m.dst, mac48(&[2, 0xaa, 3, 4, 5, 0xf6]));
        assert!(!m.group());
        assert!(Macs::of(&frame([3, 0, 0, 0, 0, 0], [2; 6])).group());
        // Exactly an Ethernet header is enough.
        assert_eq!(Macs::of(&f[..14]), m);
    }

    #[test]
    fn forwards_floods_and_checks_spoofing() {
        let (a, b, c, x) = (
            [2, 0, 0, 0, 0, 1],
            [2, 0, 0, 0, 0, 2],
            [2, 0, 0, 0, 0, 3],
            [2, 9, 9, 9, 9, 9],
        );
        let mut s = Switch::new(3);
        s.set_vf(
            0,
            VfView {
                mac: a,
                vlan: None,
                active: true,
            },
        );
        s.set_vf(
            1,
            VfView {
                mac: b,
                vlan: None,
                active: true,
            },
        );
        s.set_vf(
            2,
            VfView {
                mac: c,
                vlan: Some(5),
                active: true,
            },
        );
        let mut out = vec![];
        assert!(s.route(PortId::Vf(0), None, &frame(b, a), &mut out));
        assert_eq!(out, vec![PortId::Vf(1)]);
        assert!(
            !s.route(PortId::Vf(0), None, &frame(b, x), &mut out),
            "spoofed source"
        );
        assert!(s.route(PortId::Vf(0), None, &frame([0xff; 6], a), &mut out));
        assert_eq!(
            out,
            vec![PortId::Vf(1), PortId::Uplink],
            "VLAN 5 VF not flooded"
        );
        assert!(s.route(PortId::Vf(0), None, &frame(x, a), &mut out));
        assert_eq!(out, vec![PortId::Uplink], "unknown unicast: uplink only");
        assert!(s.route(PortId::Uplink, None, &frame(a, x), &mut out));
        assert_eq!(out, vec![PortId::Vf(0)]);
        assert!(s.route(PortId::Uplink, None, &frame(x, x), &mut out));
        assert_eq!(out, vec![], "unknown unicast from the uplink: dropped");
        assert!(s.route(PortId::Uplink, Some(5), &frame(c, x), &mut out));
        assert_eq!(out, vec![PortId::Vf(2)]);
        assert!(s.route(PortId::Uplink, None, &frame(c, x), &mut out));
        assert_eq!(out, vec![], "VLAN mismatch: not flooded either");
        assert!(s.route(PortId::Vf(0), None, &frame(c, a), &mut out));
        assert_eq!(out, vec![], "a VF of another VLAN is not reached");
    }

    /// A frame for a VF that is not open (its VMM not connected yet, or
    /// dead) reaches no other VF: found by `burstvm bench chaos`, where a
    /// dead tenant's traffic landed in the receive buffers of the others.
    #[test]
    fn unicast_for_a_closed_vf_reaches_no_other_tenant() {
        let (a, b, x) = ([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], [2, 9, 9, 9, 9, 9]);
        let mut s = Switch::new(2);
        s.set_vf(
            0,
            VfView {
                mac: a,
                vlan: None,
                active: false,
            },
        );
        s.set_vf(
            1,
            VfView {
                mac: b,
                vlan: None,
                active: true,
            },
        );
        let mut out = vec![PortId::Uplink];
        assert!(s.route(PortId::Uplink, None, &frame(a, x), &mut out));
        assert_eq!(out, vec![], "from the uplink");
        assert!(s.route(PortId::Vf(1), None, &frame(a, b), &mut out));
        assert_eq!(out, vec![], "from another VF: not to the uplink either");
        // Broadcast still reaches every open VF of the segment.
        assert!(s.route(PortId::Uplink, None, &frame([0xff; 6], x), &mut out));
        assert_eq!(out, vec![PortId::Vf(1)]);
    }

    #[test]
    fn tag_untag_roundtrip() {
        let mut buf = vec![0u8; 64];
        let f = frame([1; 6], [2; 6]);
        buf[..f.len()].copy_from_slice(&f);
        let l = tag(&mut buf, f.len(), 42);
        assert_eq!(l, f.len() + 4);
        let (v, l2) = untag(&mut buf, l);
        assert_eq!((v, l2), (Some(42), f.len()));
        assert_eq!(&buf[..l2], &f[..]);
    }
}
