//! The long-lived runtime process: it owns the page-pool server (a thread),
//! the NIC daemon (a child), the server netns with the echo server, the CNI
//! network config, and the state directory. Sandboxes borrow it.
//!
//! This file holds the `Runtime`, its creation and its drop (which removes
//! everything it made, in reverse order, on every exit path); each concern
//! has its own file: `cni_networks` (the CNI networks it writes), `nic` (its NIC
//! daemon), `pooled` (its network pool), `signals` (SIGINT/SIGTERM),
//! `stages` (the stages a variant goes through), `stale` (names derived
//! from its tag, and reaping what dead runtimes left).

mod cni_networks;
mod nic;
mod pooled;
mod signals;
mod stages;
mod stale;

pub use cni_networks::{cni_path, pf_plan, PF};
pub use nic::{NicRestarts, NIC_WATCH_PERIOD};
pub use signals::{install_sigint_handler, sigint_received};
pub use stages::{expected_stages, expected_stages_with};
pub use stale::{
    cgroup_pool_of, reap_stale, sandbox_prefix_of, server_netns_of, state_dir_of, state_root_fs,
    state_root_note, RUNTIME_LOCK, STATE_ROOT,
};

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use guestmem::pool::{Pool, PoolServer};

use crate::cgroup::{Cgroup, CgroupError, CgroupPool, Layout, Limits};
use crate::cni_exec::CniNetwork;
use crate::nicd::NicDaemon;
use crate::sandbox::files::keep_logs;
use crate::server_netns::{self, Addressing, ServerNet};

pub use crate::guestnet::TAP_IF;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("runtime state directory {path}: {source}")]
    StateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Another live process holds the state directory's lock (its pid is in the error).
    #[error("runtime state directory {} belongs to another runtime", .path.display())]
    StateDirOwned {
        path: PathBuf,
        #[source]
        source: procutil::LockError,
    },
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    ServerNet(#[from] server_netns::ServerNetError),
    #[error(transparent)]
    Cni(#[from] crate::cni_exec::CniError),
    #[error(transparent)]
    Pool(#[from] guestmem::pool::Error),
    #[error("NIC daemon ({bin} nic): {reason}")]
    Nic { bin: PathBuf, reason: String },
    #[error("NIC daemon ({bin} nic): {source}")]
    NicLog {
        bin: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("NIC daemon ({bin} nic): spawn: {source}")]
    NicSpawn {
        bin: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("CNI plugin burstvm-cni not found next to {bin} nor in {path:?}")]
    NoCniPlugin { bin: PathBuf, path: Vec<PathBuf> },
    #[error(transparent)]
    Rootfs(#[from] ::rootfs::Error),
}

/// A state-directory file (or the directory itself) could not be written.
fn state_err(path: &Path) -> impl FnOnce(std::io::Error) -> RuntimeError + '_ {
    move |source| RuntimeError::StateDir {
        path: path.to_path_buf(),
        source,
    }
}

/// How to set the runtime up.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// The `burstvm` binary spawned as `burstvm vmm` / `burstvm nic`.
    pub bin: PathBuf,
    /// Trace file every stage of every sandbox is appended to.
    pub trace_path: Option<PathBuf>,
    /// Number of VFs the NIC daemon creates (≥ the largest concurrency).
    pub vfs: usize,
    /// Whether any variant with a network will run (starts NIC, server netns, CNI).
    pub network: bool,
    /// Pre-create this many cgroups and take them by rename (RunD); 0 = mkdir per sandbox.
    pub cgroup_pool: usize,
    /// Cgroup limits of pooled groups (must match the sandboxes').
    pub cgroup_limits: Limits,
    /// Make writable rootfs layers of this size (the ext4 template); None: no rootfs.
    pub rootfs_layer_bytes: Option<u64>,
    /// Keep this many VF network attachments ready (`--net-pool`, see
    /// `netpool`); 0: every sandbox makes its own. Started with the NIC daemon.
    pub net_pool: usize,
    /// SG functions the NIC daemon serves (`burstvm nic --sgfs`, docs/sgiov.md); with
    /// more than 0 the runtime also writes its SG network (`sg.conf`, `"kind":"sg"`),
    /// which sandboxes with `SandboxSpec::sg` are attached to. One per live SG sandbox.
    pub sgfs: usize,
    /// Run burstvm-cni's commands in the NIC daemon's CNI server, through
    /// `burstvm-cni-thin` (when it is installed beside burstvm-cni), instead
    /// of in a burstvm-cni process per call (docs/cni.md, "The CNI server").
    pub cni_server: bool,
}

impl RuntimeConfig {
    /// A runtime with the network (NIC daemon with `vfs` VFs, server netns,
    /// CNI) for sandboxes of `limits`, and nothing else: no trace file, no
    /// cgroup or network pool, no rootfs layers, no SG functions.
    pub fn networked(bin: PathBuf, vfs: usize, limits: Limits) -> Self {
        RuntimeConfig {
            bin,
            trace_path: None,
            vfs,
            network: true,
            cgroup_pool: 0,
            cgroup_limits: limits,
            rootfs_layer_bytes: None,
            net_pool: 0,
            sgfs: 0,
            cni_server: true,
        }
    }
}

/// `burstvm run --sgfs` when the sandbox runs on the SG network: the sandbox's own
/// SGF and a spare (the same margin `run` gives VFs).
pub const DEFAULT_SGFS: usize = 4;

/// One runtime instance; everything it created is removed on drop.
#[derive(Debug)]
pub struct Runtime {
    cfg: RuntimeConfig,
    /// Short unique tag in every name this runtime creates (netns, links, cgroups).
    tag: String,
    state_dir: PathBuf,
    trace_path: PathBuf,
    layout: Layout,
    cgroup_pool: Option<Arc<CgroupPool>>,
    pool: Option<PoolServer>,
    /// Shared with the network pool's refill thread (its CNI server's CPU).
    nic: Arc<Mutex<Option<NicDaemon>>>,
    cni: Option<CniNetwork>,
    /// The SG network (`"kind":"sg"`), when the NIC daemon serves SG functions.
    sg_cni: Option<CniNetwork>,
    server: Option<ServerNet>,
    /// The `tap` variant's network: the reference `bridge` plugin, run in
    /// the server netns (Err: the plugin is not installed).
    tap_cni: Option<Result<CniNetwork, Arc<crate::cni_exec::CniError>>>,
    interrupted: Arc<AtomicBool>,
    /// The managed filesystem of writable layers, and its template's digest.
    layers: Option<(::rootfs::WritableLayers, String)>,
    /// Ready VF attachments (`RuntimeConfig::net_pool`), once the NIC daemon runs.
    net_pool: Mutex<Option<crate::netpool::NetPool>>,
    /// Locks of other directories this runtime owns while it lives (the
    /// services directory it exported, `host::export`).
    dir_locks: Mutex<Vec<procutil::DirLock>>,
    /// KVM's supported CPUID in the state directory, asked at the first VMM
    /// start for all of them (None: KVM could not answer; each VMM asks).
    supported_cpuid: std::sync::OnceLock<Option<PathBuf>>,
    /// The idle cpu cgroup of VMMs' background zeroers (`Layout::ensure_idle_cgroup`).
    idle_cgroup: Option<PathBuf>,
    /// `RUNTIME_LOCK` in the state directory: this runtime is alive (the
    /// reapers of later runtimes look at it, `stale`). Dropped last.
    _lock: procutil::DirLock,
}

impl Runtime {
    pub fn new(cfg: RuntimeConfig) -> Result<Runtime, RuntimeError> {
        let tag = stale::unique_tag();
        let layout = Layout::detect()?;
        let dynmods = crate::cgroup::favordynmods();
        if dynmods == Some(false) {
            tracing::warn!("{}", crate::cgroup::favordynmods_note(dynmods));
        }
        for r in reap_stale(&layout) {
            tracing::warn!("removed what a dead runtime left: {r}");
        }
        let (state_dir, lock) = stale::claim_state_dir(&tag)?;
        let root_fs = state_root_fs();
        if root_fs != Some(nix::sys::statfs::TMPFS_MAGIC) {
            tracing::warn!("{}", state_root_note(root_fs));
        }
        let trace_path = cfg
            .trace_path
            .clone()
            .unwrap_or_else(|| state_dir.join("trace.jsonl"));
        let mut rt = Runtime {
            tag: tag.clone(),
            trace_path,
            layout: layout.clone(),
            cgroup_pool: None,
            pool: None,
            nic: Arc::new(Mutex::new(None)),
            cni: None,
            sg_cni: None,
            server: None,
            tap_cni: None,
            interrupted: Arc::new(AtomicBool::new(false)),
            layers: None,
            net_pool: Mutex::new(None),
            state_dir,
            cfg,
            dir_locks: Mutex::new(Vec::new()),
            supported_cpuid: std::sync::OnceLock::new(),
            idle_cgroup: None,
            _lock: lock,
        };
        // From here on, a failure drops `rt`, which removes what was made.
        rt.layout.ensure_parents()?;
        rt.idle_cgroup = rt.layout.idle_cgroup_or_warn();
        if rt.cfg.cgroup_pool > 0 {
            rt.cgroup_pool = Some(CgroupPool::new(
                &layout,
                &cgroup_pool_of(&tag),
                rt.cfg.cgroup_pool,
                rt.cfg.cgroup_limits,
            )?);
        }
        // The pool is filled by the tenants themselves; pre-zeroing only on request, so that
        // every variant starts from the same state.
        rt.pool = Some(PoolServer::start_with(
            rt.state_dir.join("pool.sock"),
            Arc::new(Pool::new(None)),
            false,
        )?);
        if rt.cfg.network {
            let pfs = pf_plan(rt.cfg.vfs).len();
            rt.server = Some(ServerNet::create(&tag, Addressing::default(), pfs)?);
            rt.write_cni_config()?;
            rt.write_tap_cni_config()?;
        }
        if let Some(bytes) = rt.cfg.rootfs_layer_bytes {
            let mut lc = ::rootfs::LayerConfig::new(rt.state_dir.join("rootfs"));
            lc.template_bytes = bytes;
            let l = ::rootfs::WritableLayers::create(&lc)?;
            let digest = l.template_digest()?;
            rt.layers = Some((l, digest));
        }
        Ok(rt)
    }

    /// The writable layers (when the runtime was made with `rootfs_layer_bytes`).
    pub fn writable_layers(&self) -> Option<&::rootfs::WritableLayers> {
        self.layers.as_ref().map(|(l, _)| l)
    }

    /// Leak check of the writable layers: clone files nobody removed, and
    /// whether the template still has the bytes it was made with.
    pub fn layer_leaks(&self) -> (Vec<String>, Option<String>) {
        let Some((l, digest)) = &self.layers else {
            return (Vec::new(), None);
        };
        let files = l
            .leftovers()
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        let changed = match l.template_digest() {
            Ok(d) if d == *digest => None,
            Ok(d) => Some(format!("template digest {d}, made as {digest}")),
            Err(e) => Some(e.to_string()),
        };
        (files, changed)
    }

    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// Keeps `lock` (a directory this runtime owns) until the runtime drops.
    pub fn hold_dir_lock(&self, lock: procutil::DirLock) {
        self.dir_locks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(lock);
    }

    /// Whether this runtime holds the lock file `path` (`hold_dir_lock`).
    pub fn holds_dir_lock(&self, path: &Path) -> bool {
        self.dir_locks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|l| l.path() == path)
    }

    pub fn bin(&self) -> &Path {
        &self.cfg.bin
    }

    pub fn config(&self) -> &RuntimeConfig {
        &self.cfg
    }

    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// The idle cpu cgroup the VMMs' background zeroers join (None: none here).
    pub fn idle_cgroup(&self) -> Option<&Path> {
        self.idle_cgroup.as_deref()
    }

    /// KVM's supported CPUID for the VMMs this runtime starts
    /// (`vmm::supported_cpuid`): one KVM_GET_SUPPORTED_CPUID for a burst instead
    /// of one per VMM, each of whose CPUID leaves exits to the outer hypervisor on
    /// a nested host. None if KVM cannot answer here: each VMM then asks itself
    /// and reports the error with its sandbox's name.
    pub fn supported_cpuid(&self) -> Option<&Path> {
        self.supported_cpuid
            .get_or_init(|| {
                let path = self.state_dir.join("supported-cpuid.json");
                match vmm::supported_cpuid::write_from_dev_kvm(&path) {
                    Ok(()) => Some(path),
                    Err(e) => {
                        tracing::debug!("each VMM asks KVM for its CPUID: {e}");
                        None
                    }
                }
            })
            .as_deref()
    }

    pub fn trace_path(&self) -> &Path {
        &self.trace_path
    }

    pub fn interrupted(&self) -> bool {
        sigint_received() || self.interrupted.load(Ordering::Relaxed)
    }

    pub fn pool(&self) -> &Arc<Pool> {
        self.pool
            .as_ref()
            .expect("pool server runs while the runtime lives")
            .pool()
    }

    pub fn pool_socket(&self) -> Option<&Path> {
        self.pool.as_ref().map(|p| p.path())
    }

    /// CPU (ns) the page-pool server's threads have run so far (its share of
    /// every start: lending the VMMs their memory, the NIC's registrations).
    pub fn pool_server_cpu_ns(&self) -> u64 {
        self.pool.as_ref().map_or(0, |p| p.cpu_ns())
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn cni(&self) -> Option<&CniNetwork> {
        self.cni.as_ref()
    }

    /// The SG network (None: the runtime was made with `sgfs` 0, or without network).
    pub fn sg_cni(&self) -> Option<&CniNetwork> {
        self.sg_cni.as_ref()
    }

    pub fn server(&self) -> &ServerNet {
        self.server
            .as_ref()
            .expect("network variants run with the server netns")
    }

    pub fn has_network(&self) -> bool {
        self.server.is_some()
    }

    pub fn cgroup_for(&self, id: &str, limits: Limits) -> Result<Cgroup, CgroupError> {
        match &self.cgroup_pool {
            Some(p) => p.take(id),
            None => Cgroup::create(&self.layout, id, limits),
        }
    }

    /// Sandbox names made by this runtime start with this.
    pub fn sandbox_prefix(&self) -> String {
        sandbox_prefix_of(&self.tag)
    }

    pub fn pool_clients(&self) -> usize {
        self.pool.as_ref().map_or(0, |p| p.clients())
    }

    /// Ports of the server bridge other than the server's own: `tap`
    /// sandboxes' veth ends left behind.
    pub fn leftover_links(&self) -> Result<Vec<String>, server_netns::ServerNetError> {
        let Some(srv) = &self.server else {
            return Ok(Vec::new());
        };
        let links = srv
            .rtnl()
            .links()
            .map_err(|source| server_netns::ServerNetError::Sys {
                what: format!("list links of {}", srv.netns_name()),
                source,
            })?;
        Ok(links
            .into_iter()
            .filter(|l| l.master == Some(srv.bridge_index()) && !srv.is_uplink_port(&l.name))
            .map(|l| l.name)
            .collect())
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // Its DELs need the NIC daemon.
        if let Err(e) = self.stop_net_pool() {
            tracing::warn!("{e}");
        }
        if let Some(n) = self.nic().take() {
            n.stop();
        }
        self.cni = None;
        self.sg_cni = None;
        self.tap_cni = None;
        self.server = None;
        if let Some(p) = self.pool.take() {
            p.shutdown();
        }
        self.cgroup_pool = None;
        // Unmounted (with its loop device) before the state directory goes.
        self.layers = None;
        // BURSTVM_KEEP_LOGS=1 keeps the state directory (NIC log, VMM stderr) for debugging.
        if !keep_logs() {
            let _ = std::fs::remove_dir_all(&self.state_dir);
        }
    }
}
