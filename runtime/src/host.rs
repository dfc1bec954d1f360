//! What a sandbox borrows from the host, and the two ways to provide it.
//!
//! `Runtime` (runtime/mod.rs) is *self-hosted*: one long-lived process owns the
//! page-pool server, the NIC daemon, the server netns and the CNI config, and
//! its sandboxes borrow them (`burstvm run`, `burstvm bench startup`).
//! `HostServices` is *attached*: a process that lives only as long as its
//! sandbox (containerd's shim, one per pod) uses host-wide services that were
//! started separately and described in a `services.json` file: a NIC daemon on
//! its control socket, a page-pool server, the burstvm-cni config (the one
//! containerd's CRI plugin executes). `burstvm services` starts them all from
//! one self-hosted `Runtime` and writes that file (`export`).
//!
//! `Sandbox` only sees the `SandboxHost` trait, so every stage, variant and
//! trace of `burstvm run` applies to both.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};

use crate::cgroup::{Cgroup, CgroupError, Layout, Limits};
use crate::cni_exec::{CniNetwork, FORWARDER};
use crate::instance::Runtime;
use crate::server_netns::{self, Addressing};
use netutil::MacAddr;

// A host is a runtime or a test double: `Sandbox`'s Debug only names it.
impl std::fmt::Debug for dyn SandboxHost + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SandboxHost")
    }
}

/// Everything a `Sandbox` needs from the host it runs on.
pub trait SandboxHost: Sync {
    /// The `burstvm` binary spawned as `burstvm vmm`.
    fn bin(&self) -> &Path;
    /// The trace file the sandbox's stages (and its VMM's) are appended to.
    fn trace_path(&self) -> &Path;
    /// Where per-sandbox files (VMM stderr) go.
    fn state_dir(&self) -> &Path;
    /// Set when every sandbox of this host must stop (SIGINT/SIGTERM).
    fn interrupted(&self) -> bool;
    fn cgroup_for(&self, id: &str, limits: Limits) -> Result<Cgroup, CgroupError>;
    /// The CNI network the runtime executes itself (None: no network).
    fn cni(&self) -> Option<&CniNetwork>;
    fn pool_socket(&self) -> Option<&Path>;
    /// The VF's vhost-user socket, asked from the NIC daemon.
    fn vf_socket(&self, vf_id: &str) -> Result<PathBuf, HostCallError>;
    /// The server side of the sandbox network (the guest's request goes there).
    fn addressing(&self) -> Addressing;
    /// A permanent neighbour entry for the guest on the server side (so no ARP).
    fn add_neighbor(&self, ip: Ipv4Addr, mac: MacAddr) -> Result<(), HostCallError>;
    fn del_neighbor(&self, ip: Ipv4Addr) -> Result<(), HostCallError>;
    /// The `tap` variant's software CNI (the reference `bridge` plugin),
    /// run by the self-hosted runtime as an engine runs it.
    fn tap_cni(&self) -> Result<&CniNetwork, HostCallError> {
        Err(HostCallError::TapNeedsRuntime)
    }
    /// The SG network (`"kind":"sg"`) the self-hosted runtime executes for sandboxes
    /// with `SandboxSpec::sg`; None: the host has none (`sgfs` 0, or attached).
    fn sg_cni(&self) -> Option<&CniNetwork> {
        None
    }
    /// RunD's writable layers (the `rootfs` stage); None: no rootfs stage possible.
    fn writable_layers(&self) -> Option<&::rootfs::WritableLayers> {
        None
    }
    /// A ready VF attachment from the network pool (`RuntimeConfig::net_pool`).
    fn claim_net(&self) -> Option<crate::netpool::Pooled> {
        None
    }
    /// Held while a sandbox starts (the network pool refills only when idle).
    fn net_pool_busy(&self) -> Option<crate::netpool::Busy> {
        None
    }
    /// KVM's supported CPUID, asked once for every VMM of this host (None:
    /// each VMM asks KVM itself).
    fn supported_cpuid(&self) -> Option<&Path> {
        None
    }
    /// The idle cpu cgroup VMMs' background zeroers join (`--idle-cgroup`).
    fn idle_cgroup(&self) -> Option<&Path> {
        None
    }
}

impl SandboxHost for Runtime {
    fn bin(&self) -> &Path {
        Runtime::bin(self)
    }
    fn trace_path(&self) -> &Path {
        Runtime::trace_path(self)
    }
    fn state_dir(&self) -> &Path {
        Runtime::state_dir(self)
    }
    fn interrupted(&self) -> bool {
        Runtime::interrupted(self)
    }
    fn cgroup_for(&self, id: &str, limits: Limits) -> Result<Cgroup, CgroupError> {
        Runtime::cgroup_for(self, id, limits)
    }
    fn cni(&self) -> Option<&CniNetwork> {
        Runtime::cni(self)
    }
    fn pool_socket(&self) -> Option<&Path> {
        Runtime::pool_socket(self)
    }
    fn supported_cpuid(&self) -> Option<&Path> {
        Runtime::supported_cpuid(self)
    }
    fn idle_cgroup(&self) -> Option<&Path> {
        Runtime::idle_cgroup(self)
    }
    fn vf_socket(&self, vf_id: &str) -> Result<PathBuf, HostCallError> {
        Runtime::vf_socket(self, vf_id)
    }
    fn addressing(&self) -> Addressing {
        self.server().addressing()
    }
    fn add_neighbor(&self, ip: Ipv4Addr, mac: MacAddr) -> Result<(), HostCallError> {
        Ok(self.server().add_neighbor(ip, mac)?)
    }
    fn del_neighbor(&self, ip: Ipv4Addr) -> Result<(), HostCallError> {
        Ok(self.server().del_neighbor(ip)?)
    }
    fn sg_cni(&self) -> Option<&CniNetwork> {
        Runtime::sg_cni(self)
    }
    fn tap_cni(&self) -> Result<&CniNetwork, HostCallError> {
        Runtime::tap_cni(self)
    }
    fn writable_layers(&self) -> Option<&::rootfs::WritableLayers> {
        Runtime::writable_layers(self)
    }
    fn claim_net(&self) -> Option<crate::netpool::Pooled> {
        Runtime::claim_net(self)
    }
    fn net_pool_busy(&self) -> Option<crate::netpool::Busy> {
        Runtime::net_pool_busy(self)
    }
}

/// A sandbox's call to its host's services (NIC daemon, server neighbours, tap network).
#[derive(Debug, thiserror::Error)]
pub enum HostCallError {
    #[error(transparent)]
    Nic(#[from] nic_api::ClientError),
    #[error(transparent)]
    Neighbor(#[from] server_netns::ServerNetError),
    #[error(
        "tap network: {source} (scripts/setup.sh installs the reference plugins in /opt/cni/bin)"
    )]
    TapNetwork {
        #[source]
        source: std::sync::Arc<crate::cni_exec::CniError>,
    },
    #[error("tap network: this runtime was created without a network")]
    NoTapNetwork,
    #[error("the tap variant needs the self-hosted runtime (burstvm run / bench startup)")]
    TapNeedsRuntime,
}

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("host services file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("host services file {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("host services file {path}: field {field}: {reason}")]
    Field {
        path: PathBuf,
        field: &'static str,
        reason: String,
    },
    #[error("host services file {path}: the services process (pid {pid}) is not running")]
    Gone { path: PathBuf, pid: u32 },
    /// Another live process holds the services directory (its pid is in the error).
    #[error("host services directory {path} belongs to another services process")]
    Owned {
        path: PathBuf,
        #[source]
        source: procutil::LockError,
    },
    #[error("host services directory {path}: {source}")]
    Lock {
        path: PathBuf,
        #[source]
        source: procutil::LockError,
    },
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Cni(#[from] Box<crate::cni_exec::CniError>),
}

/// `services.json`: where the host-wide services are. Written by
/// `burstvm services` (or by `burstvm bench startup --via cri`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ServicesInfo {
    /// The process that owns the services; attached sandboxes refuse a dead one.
    pub owner_pid: u32,
    /// The `burstvm` binary VMMs are spawned from.
    pub bin: PathBuf,
    pub nic_socket: PathBuf,
    pub pool_socket: Option<PathBuf>,
    /// The burstvm-cni network config (cniVersion 1.0.0, what containerd 1.6 executes).
    pub cni_config: PathBuf,
    /// Directories searched for CNI plugins when the sandbox runs CNI itself.
    pub cni_path: Vec<PathBuf>,
    pub server_ip: Ipv4Addr,
    pub prefix_len: u8,
    pub server_mac: String,
    /// The services' server netns (attached sandboxes add their guest's
    /// neighbour entry there, as the self-hosted runtime does).
    pub server_netns: PathBuf,
    /// Where the services write the echo server's answers per guest address.
    pub replies: PathBuf,
}

impl ServicesInfo {
    pub fn load(path: &Path) -> Result<ServicesInfo, HostError> {
        let data = std::fs::read(path).map_err(|source| HostError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let info: ServicesInfo =
            serde_json::from_slice(&data).map_err(|source| HostError::Json {
                path: path.to_path_buf(),
                source,
            })?;
        if info.server_mac.parse::<MacAddr>().is_err() {
            return Err(HostError::Field {
                path: path.to_path_buf(),
                field: "server_mac",
                reason: format!("{:?} is not a MAC address", info.server_mac),
            });
        }
        // Alive while it holds the directory's lock (not by its pid, which
        // another process may have by now).
        let dir = path.parent().unwrap_or(Path::new(""));
        match procutil::DirLock::take_over(dir, SERVICES_LOCK) {
            Err(procutil::LockError::Held { .. }) => Ok(info),
            Ok(_) => Err(HostError::Gone {
                path: path.to_path_buf(),
                pid: info.owner_pid,
            }),
            Err(source) => Err(HostError::Lock {
                path: dir.to_path_buf(),
                source,
            }),
        }
    }

    pub fn addressing(&self) -> Addressing {
        Addressing {
            server_ip: self.server_ip,
            prefix_len: self.prefix_len,
            server_mac: self.server_mac.parse().unwrap_or(MacAddr::new([0; 6])),
        }
    }
}

/// The CNI config for an engine's CNI conf dir: the runtime's network with
/// cniVersion 1.0.0 (containerd 1.6's libcni predates 1.1.0; burstvm-cni
/// speaks both, and the VF socket is then asked from the NIC). The engine
/// execs the plugin from its own CNI bin dir, `engine_bin`: when that holds
/// the forwarder and the runtime's network is served, the config keeps the
/// forwarder and the NIC daemon's `cniSocket`, so the engine's ADD and DEL
/// cost the forwarder's exec instead of burstvm-cni's (docs/cni.md, "The CNI
/// server"); otherwise it names burstvm-cni.
pub fn engine_cni_config(rt_conf: &Path, engine_bin: &Path) -> Result<Vec<u8>, HostError> {
    let data = std::fs::read(rt_conf).map_err(|source| HostError::Io {
        path: rt_conf.to_path_buf(),
        source,
    })?;
    let mut v: serde_json::Value =
        serde_json::from_slice(&data).map_err(|source| HostError::Json {
            path: rt_conf.to_path_buf(),
            source,
        })?;
    v["cniVersion"] = "1.0.0".into();
    let served = v["type"] == FORWARDER
        && v["cniSocket"].is_string()
        && engine_bin.join(FORWARDER).is_file();
    if let (false, Some(m)) = (served, v.as_object_mut()) {
        m.insert("type".into(), "burstvm-cni".into());
        m.remove("cniSocket");
    }
    Ok(serde_json::to_vec_pretty(&v).expect("json"))
}

/// The lock file (`procutil::DirLock`) of a services directory: held by
/// the process whose services `services.json` describes, as long as it runs.
pub const SERVICES_LOCK: &str = "services.lock";

/// Makes the services directory `dir` and takes its `SERVICES_LOCK`;
/// refused (naming the holder's pid) while another process serves there.
pub fn claim_services_dir(dir: &Path) -> Result<procutil::DirLock, HostError> {
    std::fs::create_dir_all(dir).map_err(|source| HostError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    procutil::DirLock::acquire(dir, SERVICES_LOCK).map_err(|source| HostError::Owned {
        path: dir.to_path_buf(),
        source,
    })
}

/// Makes `rt`'s services usable by attached sandboxes: writes the engine's
/// CNI config to `cni_conf` (for an engine whose CNI bin dir is
/// `engine_bin`) and `services.json` into `dir`. `rt` must have
/// a network and its NIC daemon running (`prepare_variant`). `rt` holds
/// `dir`'s lock from then on (taken here unless it holds it already,
/// `Runtime::hold_dir_lock`), so the file's readers see it alive.
pub fn export(
    rt: &Runtime,
    dir: &Path,
    cni_conf: &Path,
    engine_bin: &Path,
) -> Result<ServicesInfo, HostError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| HostError::Io { path, source }
    };
    let net = rt.cni().ok_or_else(|| HostError::Field {
        path: dir.join("services.json"),
        field: "cni_config",
        reason: "the runtime has no network".into(),
    })?;
    if !rt.holds_dir_lock(&dir.join(SERVICES_LOCK)) {
        rt.hold_dir_lock(claim_services_dir(dir)?);
    }
    if let Some(parent) = cni_conf.parent() {
        std::fs::create_dir_all(parent).map_err(io(parent))?;
    }
    std::fs::write(cni_conf, engine_cni_config(&net.config_path, engine_bin)?)
        .map_err(io(cni_conf))?;
    let a = rt.server().addressing();
    let info = ServicesInfo {
        owner_pid: std::process::id(),
        bin: rt.bin().to_path_buf(),
        nic_socket: rt.nic_socket(),
        pool_socket: rt.pool_socket().map(Path::to_path_buf),
        cni_config: cni_conf.to_path_buf(),
        cni_path: crate::instance::cni_path(rt.bin()),
        server_ip: a.server_ip,
        prefix_len: a.prefix_len,
        server_mac: a.server_mac.to_string(),
        server_netns: rt.server().netns_path(),
        replies: dir.join("replies.json"),
    };
    let path = dir.join("services.json");
    let tmp = dir.join("services.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&info).expect("json")).map_err(io(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    Ok(info)
}

/// Writes the echo server's answers (guest address → count) for attached
/// sandboxes' owners to read; returns whether the file changed.
pub fn write_replies(rt: &Runtime, info: &ServicesInfo, last: &mut String) -> bool {
    let map: std::collections::BTreeMap<String, u64> = rt
        .server()
        .replies()
        .into_iter()
        .map(|(ip, n)| (ip.to_string(), n))
        .collect();
    let s = serde_json::to_string(&map).expect("json");
    if s == *last {
        return false;
    }
    let tmp = info.replies.with_extension("tmp");
    if std::fs::write(&tmp, &s).is_ok() && std::fs::rename(&tmp, &info.replies).is_ok() {
        *last = s;
        return true;
    }
    false
}

/// Reads what `write_replies` wrote: answers per guest address.
pub fn read_replies(path: &Path) -> std::collections::BTreeMap<String, u64> {
    std::fs::read(path)
        .ok()
        .and_then(|d| serde_json::from_slice(&d).ok())
        .unwrap_or_default()
}

/// Host services used by a sandbox whose process does not own them (the shim).
#[derive(Debug)]
pub struct HostServices {
    info: ServicesInfo,
    layout: Layout,
    cni: CniNetwork,
    state_dir: PathBuf,
    trace_path: PathBuf,
    interrupted: AtomicBool,
    neighbors: std::sync::OnceLock<server_netns::NeighborTable>,
    idle_cgroup: Option<PathBuf>,
}

impl HostServices {
    /// `state_dir` holds per-sandbox files (e.g. the bundle); stages go to `trace_path`.
    pub fn attach(
        info: ServicesInfo,
        state_dir: PathBuf,
        trace_path: PathBuf,
    ) -> Result<HostServices, HostError> {
        let layout = Layout::detect()?;
        layout.ensure_parents()?;
        let idle_cgroup = layout.idle_cgroup_or_warn();
        let cni = CniNetwork::load(&info.cni_config, info.cni_path.clone()).map_err(Box::new)?;
        Ok(HostServices {
            idle_cgroup,
            info,
            layout,
            cni,
            state_dir,
            trace_path,
            interrupted: AtomicBool::new(false),
            neighbors: std::sync::OnceLock::new(),
        })
    }

    pub fn info(&self) -> &ServicesInfo {
        &self.info
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Stops every wait of this host's sandboxes (e.g. the shim's shutdown).
    pub fn interrupt(&self) {
        self.interrupted.store(true, Ordering::SeqCst);
    }
}

impl SandboxHost for HostServices {
    fn bin(&self) -> &Path {
        &self.info.bin
    }
    fn trace_path(&self) -> &Path {
        &self.trace_path
    }
    fn state_dir(&self) -> &Path {
        &self.state_dir
    }
    fn interrupted(&self) -> bool {
        self.interrupted.load(Ordering::SeqCst)
    }
    fn cgroup_for(&self, id: &str, limits: Limits) -> Result<Cgroup, CgroupError> {
        Cgroup::create(&self.layout, id, limits)
    }
    fn cni(&self) -> Option<&CniNetwork> {
        Some(&self.cni)
    }
    fn pool_socket(&self) -> Option<&Path> {
        self.info.pool_socket.as_deref()
    }
    fn idle_cgroup(&self) -> Option<&Path> {
        self.idle_cgroup.as_deref()
    }
    fn vf_socket(&self, vf_id: &str) -> Result<PathBuf, HostCallError> {
        Ok(nic_api::vf_socket(&self.info.nic_socket, vf_id)?)
    }
    fn addressing(&self) -> Addressing {
        self.info.addressing()
    }
    // Without the entry the server ARPs for each guest; the NIC floods every
    // broadcast to every VF, and at 200 guests replies were lost (docs/shim.md).
    fn add_neighbor(&self, ip: Ipv4Addr, mac: MacAddr) -> Result<(), HostCallError> {
        let t = match self.neighbors.get() {
            Some(t) => t,
            None => {
                let t = server_netns::NeighborTable::open(&self.info.server_netns)?;
                self.neighbors.get_or_init(|| t)
            }
        };
        Ok(t.add(ip, mac)?)
    }
    fn del_neighbor(&self, ip: Ipv4Addr) -> Result<(), HostCallError> {
        match self.neighbors.get() {
            Some(t) => Ok(t.del(ip)?),
            None => Ok(()),
        }
    }
}

/// Removes what an attached sandbox left when its owner died (a SIGKILLed
/// shim): VMM processes still in its cgroup, the cgroup, and — when the
/// sandbox made its own netns — its CNI attachment and netns. Returns what
/// was removed; each step tolerates a part that is already gone.
pub fn reap_sandbox(
    layout: &Layout,
    cni: Option<&CniNetwork>,
    id: &str,
    owned_netns: bool,
) -> Vec<String> {
    let reaped = crate::cgroup::reap(layout, id);
    let mut done: Vec<String> = reaped
        .killed
        .iter()
        .map(|p| format!("process {p}"))
        .collect();
    done.extend(
        reaped
            .removed
            .iter()
            .map(|d| format!("cgroup {}", d.display())),
    );
    if owned_netns {
        let ns = netutil::netns::named_path(id);
        if ns.exists() {
            match cni.map(|c| c.del(id, &ns, crate::sandbox::IFNAME)) {
                Some(Ok(())) => done.push(format!("CNI attachment of {id}")),
                Some(Err(e)) => tracing::warn!("{e}"),
                None => tracing::warn!("sandbox {id}: no CNI config to delete its attachment"),
            }
            if netutil::netns::delete_path(&ns).is_ok() {
                done.push(format!("netns {}", ns.display()));
            }
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine's config is the runtime's at 1.0.0; it keeps the forwarder
    /// and its server socket only if the engine's CNI bin dir holds the
    /// forwarder, and names burstvm-cni otherwise.
    #[test]
    fn the_engine_config_names_the_forwarder_only_if_the_engine_has_it() {
        let d = tempfile::tempdir().unwrap();
        let conf = d.path().join("net.conf");
        let served = r#"{"cniVersion":"1.1.0","name":"n","type":"burstvm-cni-thin","cniSocket":"/run/x/cni.sock","pf":["pf0"]}"#;
        std::fs::write(&conf, served).unwrap();
        let engine_bin = d.path().join("bin");
        std::fs::create_dir(&engine_bin).unwrap();
        let engine = |bin: &Path| -> serde_json::Value {
            serde_json::from_slice(&engine_cni_config(&conf, bin).unwrap()).unwrap()
        };
        let v = engine(&engine_bin);
        assert_eq!(v["cniVersion"], "1.0.0");
        assert_eq!(v["type"], "burstvm-cni");
        assert!(v.get("cniSocket").is_none(), "{v}");
        assert_eq!(v["pf"][0], "pf0");

        std::fs::write(engine_bin.join(FORWARDER), "").unwrap();
        let v = engine(&engine_bin);
        assert_eq!(v["cniVersion"], "1.0.0");
        assert_eq!(v["type"], FORWARDER);
        assert_eq!(v["cniSocket"], "/run/x/cni.sock");
        assert_eq!(v["pf"][0], "pf0");

        // A runtime whose network is not served: the engine execs burstvm-cni.
        std::fs::write(
            &conf,
            r#"{"cniVersion":"1.1.0","name":"n","type":"burstvm-cni","pf":["pf0"]}"#,
        )
        .unwrap();
        let v = engine(&engine_bin);
        assert_eq!(v["type"], "burstvm-cni");
        assert!(v.get("cniSocket").is_none(), "{v}");
        assert!(engine_cni_config(&d.path().join("missing"), &engine_bin).is_err());
    }
}
