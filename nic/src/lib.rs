//! `burstvm nic`: a software SR-IOV NIC. Each PF owns a devset of VFs; each VF
//! is a vhost-user-net backend a VMM connects to; an ixy-style dataplane
//! switches frames between the VFs of a PF and its uplink. See docs/nic.md.

pub mod control;
pub mod daemon;
pub mod dataplane;
pub mod devset;
pub mod frontend;
#[doc(hidden)]
pub mod fuzz;
pub mod ids;
pub mod memory;
pub mod poll;
pub mod port;
pub mod session;
pub mod sg;
pub mod state;

use std::path::PathBuf;
use std::time::Duration;

use dataplane::uplink::UplinkSpec;
pub use devset::LockPolicy;

/// What `burstvm nic` runs (the `burstvm` CLI parses its flags into this;
/// the errors of [`NicConfig::pf_list`] name the flags).
#[derive(Debug, Clone)]
pub struct NicConfig {
    /// A physical function (PF) name; repeat for several PFs.
    pub pf: Vec<String>,
    /// VFs per PF: once for all PFs, or once per --pf in the same order.
    pub vfs: Vec<usize>,
    /// Uplink of each PF (`None`: no uplink); once per --pf in order, or empty.
    pub uplink: Vec<Option<UplinkSpec>>,
    /// Control socket (line-delimited JSON, docs/nic.md).
    pub control: PathBuf,
    /// Directory of the state file (nic-state.json).
    pub state_dir: PathBuf,
    /// Devset lock policy: global (VFIO) or hierarchical (FastIOV).
    pub devset_lock: LockPolicy,
    /// Directory of the VF vhost-user sockets <pf>-vf<i>.sock (default: --state-dir).
    pub socket_dir: Option<PathBuf>,
    /// Dataplane batch size (frames per queue per round).
    pub batch: usize,
    /// Dataplane threads per PF: VF i is served by thread i % N, the uplink's
    /// receive side by thread 0.
    pub dataplane_threads: usize,
    /// Page-pool server whose memory VMMs may give a VF (repeat for several): the NIC
    /// registers every pool memfd it maps there, so that the pool never recycles it while
    /// the NIC maps it. Pool memory of no listed pool is refused.
    pub pool_socket: Vec<PathBuf>,
    /// Most open control connections; a new one beyond closes the least recently active.
    pub control_max_connections: usize,
    /// How long a control connection may stay idle before the daemon closes it.
    pub control_idle_timeout: Duration,
    /// SG functions (SG-IOV) beside the VFs.
    pub sg: sg::SgConfig,
}

pub use nic_api::MAX_VFS;

impl Default for NicConfig {
    fn default() -> Self {
        NicConfig {
            pf: Vec::new(),
            vfs: vec![8],
            uplink: Vec::new(),
            control: PathBuf::from("/run/burstvm/nic.sock"),
            state_dir: PathBuf::from("/run/burstvm/nic"),
            devset_lock: LockPolicy::Hierarchical,
            socket_dir: None,
            batch: dataplane::DEFAULT_BATCH,
            dataplane_threads: 1,
            pool_socket: Vec::new(),
            control_max_connections: control::server::DEFAULT_MAX_CONNECTIONS,
            control_idle_timeout: control::server::DEFAULT_IDLE_TIMEOUT,
            sg: sg::SgConfig::default(),
        }
    }
}

/// An `--uplink` value: `none`, or a [`UplinkSpec`] (`tap:NAME`, `veth:NETNS/IF`).
pub fn parse_uplink(s: &str) -> Result<Option<UplinkSpec>, String> {
    if s == "none" {
        Ok(None)
    } else {
        s.parse().map(Some)
    }
}

impl NicConfig {
    pub fn pf_list(&self) -> Result<Vec<(String, usize)>, Error> {
        let n = self.pf.len();
        if self.vfs.len() != 1 && self.vfs.len() != n {
            return Err(Error::Config(format!(
                "--vfs given {} times for {n} --pf: give it once or once per PF",
                self.vfs.len()
            )));
        }
        if n > 64 {
            return Err(Error::Config(format!(
                "--pf given {n} times: at most 64 PFs (bus 0xb1..)"
            )));
        }
        let mut out = Vec::new();
        for (k, name) in self.pf.iter().enumerate() {
            let vfs = if self.vfs.len() == 1 {
                self.vfs[0]
            } else {
                self.vfs[k]
            };
            let ok_name = !name.is_empty()
                && name.len() <= 32
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
            if !ok_name {
                return Err(Error::Config(format!(
                    "--pf {name:?}: use 1..32 characters [A-Za-z0-9_-]"
                )));
            }
            if out.iter().any(|(p, _)| p == name) {
                return Err(Error::Config(format!("--pf {name}: given twice")));
            }
            if vfs == 0 || vfs > MAX_VFS {
                return Err(Error::Config(format!(
                    "--vfs {vfs} for PF {name}: must be 1..{MAX_VFS}"
                )));
            }
            out.push((name.clone(), vfs));
        }
        if self.control_max_connections == 0 || self.control_max_connections > 65536 {
            return Err(Error::Config(format!(
                "--control-max-connections {}: must be 1..65536",
                self.control_max_connections
            )));
        }
        let idle = Duration::from_millis(10)..=Duration::from_secs(86400);
        if !idle.contains(&self.control_idle_timeout) {
            return Err(Error::Config(format!(
                "--control-idle-timeout {}: must be 0.01..86400 seconds",
                self.control_idle_timeout.as_secs_f64()
            )));
        }
        self.sg.validate()?;
        if self.dataplane_threads == 0 || self.dataplane_threads > 64 {
            return Err(Error::Config(format!(
                "--dataplane-threads {}: must be 1..64",
                self.dataplane_threads
            )));
        }
        if self.batch == 0 || self.batch > 1024 {
            return Err(Error::Config(format!(
                "--batch {}: must be 1..1024",
                self.batch
            )));
        }
        Ok(out)
    }

    pub fn control_limits(&self) -> control::server::Limits {
        control::server::Limits {
            max_connections: self.control_max_connections,
            idle_timeout: self.control_idle_timeout,
            ..Default::default()
        }
    }

    pub fn uplink_list(&self, n: usize) -> Result<Vec<Option<UplinkSpec>>, Error> {
        if self.uplink.is_empty() {
            return Ok(vec![None; n]);
        }
        if self.uplink.len() != n {
            return Err(Error::Config(format!(
                "--uplink given {} times for {n} --pf: give it once per PF (none for no uplink)",
                self.uplink.len()
            )));
        }
        Ok(self.uplink.clone())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("nic configuration: {0}")]
    Config(String),
    #[error("nic: {what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    /// Another daemon owns the directory (its pid is in the lock error).
    #[error("nic: {what} {} belongs to another daemon", .dir.display())]
    Owned {
        what: &'static str,
        dir: PathBuf,
        #[source]
        source: procutil::LockError,
    },
    #[error(transparent)]
    State(#[from] state::StateError),
    #[error("nic configuration: PF {pf}: SG device: {source}")]
    SgDevice {
        pf: String,
        #[source]
        source: Box<sgiov::device::DeviceError>,
    },
    #[error("PF {pf}: {source}")]
    Uplink {
        pf: String,
        #[source]
        source: Box<dataplane::uplink::UplinkError>,
    },
}

/// Runs the daemon until SIGTERM/SIGINT.
pub fn run_cli(args: &NicConfig) -> Result<(), Error> {
    daemon::run(args)
}
