//! What the control API shows of a VF or SG function: its state, counters
//! and assignment ([`VfInfo`]).

use std::path::PathBuf;

use netutil::MacAddr;
use serde::{Deserialize, Serialize};

use crate::DevKind;

/// Lifecycle of a VF: free → assigned → open → closed → reset → free (after release).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VfState {
    Free,
    Assigned,
    Open,
    Closed,
    Reset,
    /// The VF saw a malformed descriptor chain (or its open failed): it does no
    /// more I/O until a reset (by its guest, or at its close).
    Error,
}

/// Per-VF counters. `tx` is guest → NIC, `rx` is NIC → guest.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub rx_drops: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub tx_drops: u64,
    pub bad_descriptors: u64,
    /// vhost-user requests ignored as frontend misbehaviour: a started ring
    /// moved or resized (the guest changed a queue after DRIVER_OK).
    #[serde(default)]
    pub bad_requests: u64,
}

/// One VF or SG function as `get` and `list` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VfInfo {
    #[serde(default, skip_serializing_if = "DevKind::is_vf_kind")]
    pub kind: DevKind,
    pub id: String,
    pub pf: String,
    pub index: usize,
    /// The VF's MAC; an SG function has none (`""` on the wire).
    #[serde(with = "mac_or_empty")]
    pub mac: Option<MacAddr>,
    pub vlan: Option<u16>,
    pub socket: PathBuf,
    pub state: VfState,
    pub sandbox: Option<String>,
    pub counters: Counters,
    /// Bytes of guest memory the current memory table maps (0 without a
    /// session): what the device can reach, e.g. only the sandbox's DMA
    /// window under the `window` variant.
    #[serde(default)]
    pub mapped_bytes: u64,
    /// SG functions only: device counters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sg: Option<SgCounters>,
    /// SG functions only: the PF's scheduling policy and class capacities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sg_policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sg_capacity: Option<String>,
}

/// Counters of one SGF slot and of its PF's device, for the control API.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SgCounters {
    /// The guest's area is attached (setup queue ATTACH succeeded).
    pub attached: bool,
    pub sockets: u64,
    /// The SGF's device counters (flattened: the wire format lists them
    /// beside the others).
    #[serde(flatten)]
    pub sgf: sgiov::sgf::SgfStats,
    /// Setup commands refused (bad magic or op, area refused).
    pub setup_errors: u64,
    /// The whole PF's device: SGFs attached, sockets, pipes, rings, staging
    /// bytes and key slots in use (all 0 when nothing is attached: no leak).
    pub pf_sgfs: u64,
    pub pf_sockets: u64,
    pub pf_pipes: u64,
    pub pf_rings: u64,
    pub pf_staging_bytes: u64,
    pub pf_key_slots: u64,
    /// The PF's SG thread and priority lane (cumulative histograms).
    #[serde(default)]
    pub pf_lat: SgLat,
    /// Connections between two SGFs of the PF since the daemon started,
    /// and those that encrypt (cumulative).
    #[serde(default)]
    pub pf_chains: u64,
    #[serde(default)]
    pub pf_crypto_chains: u64,
}

/// Where a PF's signal-plane latency goes (log2 histograms, cumulative: a
/// reader subtracts two snapshots). A signal waits in its FIFO for at most
/// the round the SG thread is in; then `prio_wait_us` covers the rest up to
/// a worker taking the priority job.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SgLat {
    /// SG thread rounds that had work: doorbells, completions, job generation, µs.
    pub round_us: sgiov::lat::Hist,
    /// Jobs queued for the executors, sampled once per such round.
    pub queue_depth: sgiov::lat::Hist,
    #[serde(flatten)]
    pub prio: sgiov::engine::LatStats,
}

/// `VfInfo::mac` as the wire has it: `"aa:bb:cc:dd:ee:ff"`, or `""` for none.
mod mac_or_empty {
    use netutil::MacAddr;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(mac: &Option<MacAddr>, s: S) -> Result<S::Ok, S::Error> {
        match mac {
            Some(m) => s.collect_str(m),
            None => s.serialize_str(""),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<MacAddr>, D::Error> {
        let text = String::deserialize(d)?;
        if text.is_empty() {
            return Ok(None);
        }
        text.parse().map(Some).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vf(kind: DevKind, mac: Option<MacAddr>) -> VfInfo {
        VfInfo {
            kind,
            id: "0000:b1:00.3".into(),
            pf: "pf0".into(),
            index: 3,
            mac,
            vlan: None,
            socket: "/run/burstvm/nic/pf0-vf3.sock".into(),
            state: VfState::Free,
            sandbox: None,
            counters: Counters::default(),
            mapped_bytes: 0,
            sg: None,
            sg_policy: None,
            sg_capacity: None,
        }
    }

    #[test]
    fn the_mac_is_typed_and_its_wire_form_unchanged() {
        let mac = MacAddr::new([0x02, 0x42, 0xbf, 0, 0, 3]);
        let j = serde_json::to_value(vf(DevKind::Vf, Some(mac))).unwrap();
        assert_eq!(j["mac"], "02:42:bf:00:00:03");
        assert_eq!(serde_json::from_value::<VfInfo>(j).unwrap().mac, Some(mac));
        // An SG function has no MAC: an empty string, as before.
        let j = serde_json::to_value(vf(DevKind::Sg, None)).unwrap();
        assert_eq!((&j["kind"], &j["mac"]), (&"sg".into(), &"".into()));
        assert_eq!(serde_json::from_value::<VfInfo>(j).unwrap().mac, None);

        let mut j = serde_json::to_value(vf(DevKind::Vf, Some(mac))).unwrap();
        j["mac"] = "02:42:bf:00:00".into();
        let e = serde_json::from_value::<VfInfo>(j).unwrap_err();
        assert!(e.to_string().contains("not a MAC address"), "{e}");
    }
}
