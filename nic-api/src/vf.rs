//! What the control API shows of a VF or SG function: its state, counters
//! and assignment ([`VfInfo`]).

use std::path::PathBuf;

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
    pub mac: String,
    pub vlan: Option<u16>,
    pub socket: PathBuf,
    pub state: VfState,
    pub sandbox: Option<String>,
    pub counters: Counters,
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
