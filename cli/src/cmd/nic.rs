//! `burstvm nic`, `burstvm bench devset` and `burstvm bench dataplane`: their
//! arguments, parsed into `nic`'s configs.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::anyhow;
use bench::dataplane::{BenchDataplaneConfig, Peer, Topology};
use bench::devset::BenchDevsetConfig;
use burstvm::args::choice;
use nic::dataplane::uplink::UplinkSpec;
use nic::sg::SgConfig;
use nic::{LockPolicy, NicConfig};
use sgiov::exec::capacity::Capacities;
use sgiov::sched::Policy;

/// Seconds given as a float flag, as a `Duration` (negative or NaN: an error naming the flag).
pub fn secs(flag: &str, v: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(v).map_err(|e| anyhow!("--{flag} {v}: not a duration ({e})"))
}

/// A byte count with guestmem's syntax (`4096`, `64K`, `32M`).
pub fn bytes(s: &str) -> Result<usize, String> {
    guestmem::parse_bytes(s)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| format!("{s:?}: expected BYTES[K|M|G|T]"))
}

fn lock_policy() -> impl clap::builder::TypedValueParser<Value = LockPolicy> {
    choice::<LockPolicy>(LockPolicy::ALL.map(LockPolicy::name))
}

#[derive(Debug, Clone, clap::Args)]
pub struct NicArgs {
    /// A physical function (PF) name; repeat for several PFs.
    #[arg(long = "pf", required = true)]
    pub pf: Vec<String>,
    /// VFs per PF: once for all PFs, or once per --pf in the same order.
    #[arg(long = "vfs", default_value = "8")]
    pub vfs: Vec<usize>,
    /// Uplink of a PF: tap:NAME, veth:NETNS/IF or none; once per --pf in order (or omitted).
    #[arg(long = "uplink", value_parser = nic::parse_uplink)]
    pub uplink: Vec<Option<UplinkSpec>>,
    /// Control socket (line-delimited JSON, docs/nic.md).
    #[arg(long, default_value = "/run/burstvm/nic.sock")]
    pub control: PathBuf,
    /// Directory of the state file (nic-state.json).
    #[arg(long, default_value = "/run/burstvm/nic")]
    pub state_dir: PathBuf,
    /// Devset lock policy: global (VFIO) or hierarchical (FastIOV).
    #[arg(long, default_value = "hierarchical", value_parser = lock_policy())]
    pub devset_lock: LockPolicy,
    /// Directory of the VF vhost-user sockets <pf>-vf<i>.sock (default: --state-dir).
    #[arg(long)]
    pub socket_dir: Option<PathBuf>,
    /// Dataplane batch size (frames per queue per round).
    #[arg(long, default_value_t = nic::dataplane::DEFAULT_BATCH)]
    pub batch: usize,
    /// Dataplane threads per PF: VF i is served by thread i % N, the uplink's
    /// receive side by thread 0.
    #[arg(long, default_value_t = 1)]
    pub dataplane_threads: usize,
    /// Page-pool server whose memory VMMs may give a VF (repeat for several): the NIC
    /// registers every pool memfd it maps there, so that the pool never recycles it while
    /// the NIC maps it. Pool memory of no listed pool is refused.
    #[arg(long = "pool-socket", value_name = "PATH")]
    pub pool_socket: Vec<PathBuf>,
    /// Most open control connections; a new one beyond closes the least recently active.
    #[arg(long, default_value_t = nic::control::server::DEFAULT_MAX_CONNECTIONS)]
    pub control_max_connections: usize,
    /// Seconds a control connection may stay idle before the daemon closes it.
    #[arg(long, default_value_t = nic::control::server::DEFAULT_IDLE_TIMEOUT.as_secs_f64())]
    pub control_idle_timeout: f64,
    /// SG functions per PF (SG-IOV, docs/sgiov.md); 0 = none.
    #[arg(long = "sgfs", default_value_t = 0)]
    pub sgfs: usize,
    /// Job scheduling of each PF's SG engine: rr, prio or drf.
    #[arg(long = "sg-policy", default_value = "rr")]
    pub sg_policy: Policy,
    /// Executor capacities per class, e.g. copy=400M,crypto=160M (bytes/s); none = unlimited.
    #[arg(long = "sg-capacity", default_value = "none")]
    pub sg_capacity: Capacities,
    /// Executor threads per PF (0: jobs run on the PF's SG thread).
    #[arg(long = "sg-workers", default_value_t = 2)]
    pub sg_workers: usize,
    /// Backlogged pipes whose jobs the SG thread generates per round before
    /// it reads the doorbells again (0: the whole backlog; priority-0 pipes
    /// under --sg-policy prio always go first).
    #[arg(long = "sg-gen-budget", default_value_t = 32)]
    pub sg_gen_budget: usize,
    /// Serve burstvm-cni's commands on this socket, for `burstvm-cni-thin`
    /// (a network config's `cniSocket`; docs/cni.md, "The CNI server").
    #[arg(long, value_name = "PATH")]
    pub cni_socket: Option<PathBuf>,
}

impl NicArgs {
    pub fn into_config(self) -> anyhow::Result<NicConfig> {
        Ok(NicConfig {
            pf: self.pf,
            vfs: self.vfs,
            uplink: self.uplink,
            control: self.control,
            state_dir: self.state_dir,
            devset_lock: self.devset_lock,
            socket_dir: self.socket_dir,
            batch: self.batch,
            dataplane_threads: self.dataplane_threads,
            pool_socket: self.pool_socket,
            control_max_connections: self.control_max_connections,
            control_idle_timeout: secs("control-idle-timeout", self.control_idle_timeout)?,
            sg: SgConfig {
                sgfs: self.sgfs,
                policy: self.sg_policy,
                capacity: self.sg_capacity,
                workers: self.sg_workers,
                gen_budget: self.sg_gen_budget,
            },
        })
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct BenchDevsetArgs {
    /// VFs opened concurrently (one frontend thread each).
    #[arg(long, default_value_t = 200)]
    pub vfs: usize,
    /// Lock policies to compare.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "global,hierarchical",
        value_parser = lock_policy()
    )]
    pub policy: Vec<LockPolicy>,
    /// Memory table size per VF (bytes, with K/M/G suffix): the DMA-mapped RAM.
    #[arg(long, default_value = "32M", value_parser = bytes)]
    pub mem: usize,
    /// Populate the sandboxes' memory before the opens (the NIC then only maps
    /// it); by default the NIC's mapping allocates and zeroes fresh pages.
    #[arg(long)]
    pub populated: bool,
    /// Work directory for sockets and state (a fresh temporary one by default).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

impl BenchDevsetArgs {
    pub fn into_config(self) -> BenchDevsetConfig {
        BenchDevsetConfig {
            vfs: self.vfs,
            policy: self.policy,
            mem: self.mem,
            populated: self.populated,
            dir: self.dir,
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct BenchDataplaneArgs {
    /// Instead of the built-in frontend: DPDK's testpmd as the frontend of
    /// both burstvm's NIC and DPDK's vhost backend, interleaved, with the
    /// ratio (uses --sizes, --duration, --reps, --dir).
    #[arg(long, value_parser = choice::<Peer>(Peer::ALL.map(Peer::name)))]
    pub peer: Option<Peer>,
    /// VFs driven (at least 2; one-way uses them in pairs).
    #[arg(long, default_value_t = 2)]
    pub vfs: usize,
    /// Idle VFs beside the driven ones (each a live port with a connected
    /// frontend that never sends): one row per count, e.g. `0,64`.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub idle_vfs: Vec<usize>,
    /// Frame sizes in bytes (Ethernet header included, no FCS).
    #[arg(long, value_delimiter = ',', default_value = "64,1500")]
    pub sizes: Vec<usize>,
    /// Batch sizes: the NIC's `--batch` and the frontend's burst.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    pub batch: Vec<usize>,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "loop,one-way",
        value_parser = choice::<Topology>(Topology::ALL.map(Topology::name))
    )]
    pub topology: Vec<Topology>,
    /// The NIC's `--dataplane-threads` (VFs sharded across them; the CPU
    /// counted is all of theirs).
    #[arg(long, default_value_t = 1)]
    pub dataplane_threads: usize,
    /// Seconds per run.
    #[arg(long, default_value_t = 2.0)]
    pub duration: f64,
    /// Runs per configuration (the median is printed).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Work directory for the VF sockets (a fresh temporary one by default).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

impl BenchDataplaneArgs {
    pub fn into_config(self) -> anyhow::Result<BenchDataplaneConfig> {
        Ok(BenchDataplaneConfig {
            peer: self.peer,
            vfs: self.vfs,
            idle_vfs: self.idle_vfs,
            sizes: self.sizes,
            batch: self.batch,
            topology: self.topology,
            dataplane_threads: self.dataplane_threads,
            duration: secs("duration", self.duration)?,
            reps: self.reps,
            dir: self.dir,
        })
    }
}
