//! The long-lived runtime process: it owns the page-pool server (a thread),
//! the NIC daemon (a child), the server netns with the echo server, the CNI
//! network config, and the state directory. Sandboxes borrow it.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use guestmem::pool::{Pool, PoolServer};
use netutil::netns;
use trace::Stage;

use crate::cgroup::{Cgroup, CgroupError, CgroupPool, Layout, Limits};
use crate::cni::CniNetwork;
use crate::failures::Failures;
use crate::netpool::PoolError;
use crate::nicd::NicDaemon;
use crate::uplink::{self, Addressing, ServerNet};
use crate::variant::{NetKind, Variant};

pub use crate::guestnet::TAP_IF;
/// The PF the runtime's NIC daemon serves.
pub const PF: &str = "pf0";
/// VF-variant guests get addresses from host-local in this part of the /16 …
const VF_RANGE: (&str, &str) = ("10.77.1.1", "10.77.127.254");
/// … and `tap` guests (the reference `bridge` plugin's host-local) in this part.
const TAP_RANGE: (&str, &str) = ("10.77.128.1", "10.77.255.254");

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("runtime state directory {path}: {source}")]
    StateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Uplink(#[from] uplink::UplinkError),
    #[error(transparent)]
    Cni(#[from] crate::cni::CniError),
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
}

/// `burstvm run --sgfs` when the sandbox runs on the SG network: the sandbox's own
/// SGF and a spare (the same margin `run` gives VFs).
pub const DEFAULT_SGFS: usize = 4;

/// One runtime instance; everything it created is removed on drop.
pub struct Runtime {
    cfg: RuntimeConfig,
    /// Short unique tag in every name this runtime creates (netns, links, cgroups).
    tag: String,
    state_dir: PathBuf,
    trace_path: PathBuf,
    layout: Layout,
    cgroup_pool: Option<Arc<CgroupPool>>,
    pool: Option<PoolServer>,
    nic: Mutex<Option<NicDaemon>>,
    cni: Option<CniNetwork>,
    /// The SG network (`"kind":"sg"`), when the NIC daemon serves SG functions.
    sg_cni: Option<CniNetwork>,
    server: Option<ServerNet>,
    /// The `tap` variant's network: the reference `bridge` plugin, run in
    /// the server netns (Err: the plugin is not installed).
    tap_cni: Option<Result<CniNetwork, Arc<crate::cni::CniError>>>,
    interrupted: Arc<AtomicBool>,
    /// The managed filesystem of writable layers, and its template's digest.
    layers: Option<(::rootfs::WritableLayers, String)>,
    /// Ready VF attachments (`RuntimeConfig::net_pool`), once the NIC daemon runs.
    net_pool: Mutex<Option<crate::netpool::NetPool>>,
}

static SIGINT: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    SIGINT.store(true, Ordering::SeqCst);
}

/// Ctrl-C sets a flag that every wait loop checks; teardown then runs normally.
pub fn install_sigint_handler() {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_sigint as *const () as libc::sighandler_t);
    }
}

pub fn sigint_received() -> bool {
    SIGINT.load(Ordering::SeqCst)
}

impl Runtime {
    pub fn new(cfg: RuntimeConfig) -> Result<Runtime, RuntimeError> {
        let tag = unique_tag();
        let state_dir = PathBuf::from(format!("/run/burstvm/rt-{tag}"));
        std::fs::create_dir_all(&state_dir).map_err(|source| RuntimeError::StateDir {
            path: state_dir.clone(),
            source,
        })?;
        let trace_path = cfg
            .trace_path
            .clone()
            .unwrap_or_else(|| state_dir.join("trace.jsonl"));
        let layout = Layout::detect()?;
        for r in reap_stale(&layout) {
            tracing::warn!("removed what a dead runtime left: {r}");
        }
        let mut rt = Runtime {
            tag: tag.clone(),
            trace_path,
            layout: layout.clone(),
            cgroup_pool: None,
            pool: None,
            nic: Mutex::new(None),
            cni: None,
            sg_cni: None,
            server: None,
            tap_cni: None,
            interrupted: Arc::new(AtomicBool::new(false)),
            layers: None,
            net_pool: Mutex::new(None),
            state_dir,
            cfg,
        };
        // From here on, a failure drops `rt`, which removes what was made.
        rt.layout.ensure_parents()?;
        if rt.cfg.cgroup_pool > 0 {
            rt.cgroup_pool = Some(CgroupPool::new(
                &layout,
                &format!("pool-{tag}"),
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
            rt.server = Some(ServerNet::create(&tag, Addressing::default())?);
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

    pub fn bin(&self) -> &Path {
        &self.cfg.bin
    }

    pub fn config(&self) -> &RuntimeConfig {
        &self.cfg
    }

    pub fn state_dir(&self) -> &Path {
        &self.state_dir
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
        format!("bv{}-", self.tag)
    }

    /// The server subnet as CIDR, and host-local ranges of it.
    fn ipam(&self, range: (&str, &str)) -> serde_json::Value {
        let a = self.server().addressing();
        let mask = !((1u32 << (32 - a.prefix_len)) - 1);
        serde_json::json!({
            "type": "host-local",
            "dataDir": self.state_dir.join("ipam"),
            "ranges": [[{
                "subnet": format!("{}/{}", Ipv4Addr::from(u32::from(a.server_ip) & mask), a.prefix_len),
                "rangeStart": range.0,
                "rangeEnd": range.1,
                "gateway": a.server_ip.to_string(),
            }]],
            "routes": [{"dst": "0.0.0.0/0"}],
        })
    }

    fn write_conf(&self, file: &str, conf: &serde_json::Value) -> Result<PathBuf, RuntimeError> {
        let path = self.state_dir.join(file);
        std::fs::write(&path, serde_json::to_vec_pretty(conf).expect("json")).map_err(
            |source| RuntimeError::StateDir {
                path: path.clone(),
                source,
            },
        )?;
        Ok(path)
    }

    /// The `tap` network: the reference `bridge` plugin puts a veth into the
    /// sandbox netns whose peer joins the server bridge (which stands for
    /// the host's), with an address from host-local. The runtime then joins
    /// the VMM's tap to that veth with tc, as Kata does.
    fn write_tap_cni_config(&mut self) -> Result<(), RuntimeError> {
        let conf = serde_json::json!({
            "cniVersion": "1.1.0",
            "name": format!("burstvm-tap-{}", self.tag),
            "type": "bridge",
            "bridge": uplink::SERVER_BRIDGE,
            "isGateway": false,
            "ipMasq": false,
            "ipam": self.ipam(TAP_RANGE),
        });
        let path = self.write_conf("tap.conf", &conf)?;
        let srv = self.server().netns_path();
        self.tap_cni = Some(
            CniNetwork::load(&path, cni_path(&self.cfg.bin))
                .map(|n| n.in_netns(&srv))
                .map_err(Arc::new),
        );
        Ok(())
    }

    fn write_cni_config(&mut self) -> Result<(), RuntimeError> {
        let conf = serde_json::json!({
            "cniVersion": "1.1.0",
            "name": format!("burstvm-{}", self.tag),
            "type": "burstvm-cni",
            "nicSocket": self.nic_socket(),
            "pf": PF,
            "ipam": self.ipam(VF_RANGE),
        });
        let path = self.write_conf("net.conf", &conf)?;
        let cni_path = cni_path(&self.cfg.bin);
        if !cni_path.iter().any(|d| d.join("burstvm-cni").is_file()) {
            return Err(RuntimeError::NoCniPlugin {
                bin: self.cfg.bin.clone(),
                path: cni_path,
            });
        }
        self.cni = Some(CniNetwork::load(&path, cni_path.clone())?);
        if self.cfg.sgfs > 0 {
            // An SG function has no MAC, VLAN or address: no IPAM (docs/cni.md).
            let conf = serde_json::json!({
                "cniVersion": "1.1.0",
                "name": format!("burstvm-sg-{}", self.tag),
                "type": "burstvm-cni",
                "kind": "sg",
                "nicSocket": self.nic_socket(),
                "pf": PF,
            });
            let path = self.write_conf("sg.conf", &conf)?;
            self.sg_cni = Some(CniNetwork::load(&path, cni_path)?);
        }
        Ok(())
    }

    pub fn nic_socket(&self) -> PathBuf {
        self.state_dir.join("nic.sock")
    }

    /// The running NIC daemon's pid (CPU accounting).
    pub fn nic_pid(&self) -> Option<u32> {
        let nic = self.nic.lock().unwrap_or_else(|e| e.into_inner());
        nic.as_ref().map(|n| n.pid())
    }

    /// Makes sure the NIC daemon runs with the lock policy `variant` needs;
    /// restarts it when the policy differs (no sandbox may be alive then).
    pub fn prepare_variant(&self, variant: Variant) -> Result<(), RuntimeError> {
        let Some(lock) = variant.policy().devset_lock else {
            return Ok(());
        };
        let mut nic = self.nic.lock().unwrap_or_else(|e| e.into_inner());
        if nic.as_ref().is_some_and(|n| n.lock == lock) {
            return Ok(());
        }
        if let Some(old) = nic.take() {
            old.stop();
        }
        *nic = Some(NicDaemon::spawn(self, lock)?);
        drop(nic);
        self.start_net_pool()
    }

    /// Starts the network pool (once, when configured): its ADDs need the NIC daemon.
    fn start_net_pool(&self) -> Result<(), RuntimeError> {
        let mut pool = self.net_pool.lock().unwrap_or_else(|e| e.into_inner());
        if pool.is_some() || self.cfg.net_pool == 0 {
            return Ok(());
        }
        let Some(cni) = self.cni.clone() else {
            return Ok(());
        };
        cni.require_vf("the network pool (--net-pool)")?;
        *pool = Some(
            crate::netpool::NetPool::start(cni, self.sandbox_prefix(), self.cfg.net_pool).map_err(
                |source| RuntimeError::StateDir {
                    path: self.state_dir.clone(),
                    source,
                },
            )?,
        );
        Ok(())
    }

    /// A ready VF attachment from the network pool (None: no pool, or empty).
    pub fn claim_net(&self) -> Option<crate::netpool::Pooled> {
        let pool = self.net_pool.lock().unwrap_or_else(|e| e.into_inner());
        pool.as_ref()?.claim()
    }

    /// Held while a sandbox starts: the network pool refills only when no
    /// start is in progress (None: no pool).
    pub fn net_pool_busy(&self) -> Option<crate::netpool::Busy> {
        let pool = self.net_pool.lock().unwrap_or_else(|e| e.into_inner());
        pool.as_ref().map(|p| p.busy())
    }

    /// Waits (at most `bound`) until the network pool is full: how many are
    /// ready of how many, and the refill's last error. None: no pool.
    pub fn wait_net_pool(
        &self,
        bound: std::time::Duration,
    ) -> Option<(usize, usize, Option<Arc<PoolError>>)> {
        let pool = self.net_pool.lock().unwrap_or_else(|e| e.into_inner());
        let p = pool.as_ref()?;
        let (ready, err) = p.wait_full(bound);
        Some((ready, p.target(), err))
    }

    /// Names the network pool holds (not leaks while the runtime lives).
    pub fn net_pool_owned(&self) -> std::collections::HashSet<String> {
        let pool = self.net_pool.lock().unwrap_or_else(|e| e.into_inner());
        pool.as_ref().map(|p| p.owned()).unwrap_or_default()
    }

    /// Stops the network pool and DELs what it holds (before a final leak check).
    pub fn stop_net_pool(&self) -> Result<(), Failures<PoolError>> {
        let pool = self
            .net_pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        match pool {
            Some(mut p) => p.stop(),
            None => Ok(()),
        }
    }

    /// SIGKILLs the NIC daemon (a crash) and starts it again on its state directory, with
    /// the same lock policy and pool; running VMMs reconnect to their VF sockets. Returns
    /// the instants of the kill and of the restarted daemon answering on its control
    /// socket, and the new daemon's pid.
    pub fn crash_and_restart_nic(&self) -> Result<(Instant, Instant, u32), RuntimeError> {
        let mut nic = self.nic.lock().unwrap_or_else(|e| e.into_inner());
        let old = nic.take().ok_or_else(|| RuntimeError::Nic {
            bin: self.cfg.bin.clone(),
            reason: "no NIC daemon running".into(),
        })?;
        let lock = old.lock;
        let killed = old.kill();
        let (up, pid) = self.respawn_nic(&mut nic, lock)?;
        Ok((killed, up, pid))
    }

    /// Starts the NIC daemon again if something else killed it (`bench
    /// chaos` does, from outside). Returns whether it did. The daemon dies
    /// with the calling thread (PDEATHSIG): call it from a thread that lives
    /// as long as the runtime.
    pub fn restart_nic_if_dead(&self) -> Result<bool, RuntimeError> {
        let mut nic = self.nic.lock().unwrap_or_else(|e| e.into_inner());
        let Some(n) = nic.as_mut() else {
            return Ok(false);
        };
        if !n.exited() {
            return Ok(false);
        }
        let lock = n.lock;
        self.respawn_nic(&mut nic, lock)?;
        Ok(true)
    }

    /// The one way the NIC daemon is started again: on its state directory
    /// (assignments come back from its state file), same lock policy and
    /// pool. Returns when it answers on its control socket, and its pid.
    fn respawn_nic(
        &self,
        slot: &mut Option<NicDaemon>,
        lock: crate::variant::DevsetLock,
    ) -> Result<(Instant, u32), RuntimeError> {
        let new = NicDaemon::spawn(self, lock)?;
        let up = Instant::now();
        let pid = new.pid();
        *slot = Some(new);
        Ok((up, pid))
    }

    /// host-local's leases of this runtime's network: one file per address,
    /// holding the container id.
    pub fn ipam_lease_dir(&self) -> PathBuf {
        self.state_dir
            .join("ipam")
            .join(format!("burstvm-{}", self.tag))
    }

    /// The VF's vhost-user socket, asked from the NIC daemon.
    pub fn vf_socket(&self, vf_id: &str) -> Result<PathBuf, crate::host::HostCallError> {
        let mut c = nic::control::Client::connect(&self.nic_socket())?;
        Ok(c.get_by_id(vf_id)?.socket)
    }

    /// VFs the NIC daemon still has assigned, with their sandbox (leak check).
    pub fn assigned_vfs(&self) -> Result<Vec<(String, String)>, String> {
        if self.nic.lock().unwrap_or_else(|e| e.into_inner()).is_none() {
            return Ok(Vec::new());
        }
        let mut c = nic::control::Client::connect(&self.nic_socket()).map_err(|e| e.to_string())?;
        Ok(c.list()
            .map_err(|e| e.to_string())?
            .into_iter()
            .filter(|v| v.sandbox.is_some())
            .map(|v| (v.id, v.sandbox.unwrap_or_default()))
            .collect())
    }

    pub fn pool_clients(&self) -> usize {
        self.pool.as_ref().map_or(0, |p| p.clients())
    }

    /// Ports of the server bridge other than the server's own: `tap`
    /// sandboxes' veth ends left behind.
    pub fn leftover_links(&self) -> Result<Vec<String>, String> {
        let Some(srv) = &self.server else {
            return Ok(Vec::new());
        };
        let links = srv
            .rtnl()
            .links()
            .map_err(|e| format!("list links of {}: {e}", srv.netns_name()))?;
        Ok(links
            .into_iter()
            .filter(|l| l.master == Some(srv.bridge_index()) && l.name != uplink::SERVER_IF)
            .map(|l| l.name)
            .collect())
    }

    /// The `tap` variant's CNI network (the reference `bridge` plugin).
    pub fn tap_cni(&self) -> Result<&CniNetwork, crate::host::HostCallError> {
        match &self.tap_cni {
            Some(Ok(n)) => Ok(n),
            Some(Err(e)) => Err(crate::host::HostCallError::TapNetwork { source: e.clone() }),
            None => Err(crate::host::HostCallError::NoTapNetwork),
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // Its DELs need the NIC daemon.
        if let Err(e) = self.stop_net_pool() {
            tracing::warn!("{e}");
        }
        if let Some(n) = self.nic.lock().unwrap_or_else(|e| e.into_inner()).take() {
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
        if std::env::var_os("BURSTVM_KEEP_LOGS").is_none() {
            let _ = std::fs::remove_dir_all(&self.state_dir);
        }
    }
}

/// Directories searched for CNI plugins: next to `burstvm`, then the usual places.
pub fn cni_path(bin: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(d) = bin.parent() {
        v.push(d.to_path_buf());
    }
    if let Some(p) = std::env::var_os("CNI_PATH") {
        v.extend(std::env::split_paths(&p));
    }
    v.push(PathBuf::from("/opt/cni/bin"));
    if let Some(h) = std::env::var_os("HOME") {
        v.push(Path::new(&h).join("go/bin"));
    }
    v
}

/// The stages a sandbox of `variant` goes through, in order (`rootfs`:
/// it has a root filesystem).
pub fn expected_stages(variant: Variant, rootfs: bool) -> Vec<Stage> {
    expected_stages_with(variant, rootfs, false)
}

/// `expected_stages` of a sandbox that claimed (`pooled`) its network from
/// the network pool: `net-claim` instead of `netns` and `cni-add`.
pub fn expected_stages_with(variant: Variant, rootfs: bool, pooled: bool) -> Vec<Stage> {
    let p = variant.policy();
    let mut v = vec![Stage::Cgroup];
    if pooled {
        v.push(Stage::NetClaim);
    } else {
        v.push(Stage::Netns);
        if p.net != NetKind::None {
            v.push(Stage::CniAdd);
        }
    }
    if rootfs {
        v.push(Stage::Rootfs);
    }
    v.push(Stage::VmmSpawn);
    if p.dma_ram {
        v.push(Stage::DmaRam);
    }
    if p.dma_image {
        v.push(Stage::DmaImage);
    }
    if p.net == NetKind::Vf {
        v.push(Stage::VfOpen);
    }
    v.push(Stage::Boot);
    if p.net != NetKind::None {
        v.push(Stage::VfDriver);
    }
    v.push(Stage::AppLaunch);
    if p.net != NetKind::None && p.vf_init == Some("async") {
        v.push(Stage::VfLink);
    }
    v.push(Stage::Ready);
    v
}

/// The pid of the process that made `tag` (see `unique_tag`).
fn tag_pid(tag: &str) -> Option<u32> {
    u64::from_str_radix(tag, 36).ok().map(|n| (n / 64) as u32)
}

/// Removes what runtimes that died without cleaning up (SIGKILL) left:
/// their sandboxes' netns and cgroups, their server netns and state dir.
/// A runtime counts as dead when the pid in its tag no longer exists.
pub fn reap_stale(layout: &Layout) -> Vec<String> {
    let mut reaped = Vec::new();
    let Ok(rd) = std::fs::read_dir("/run/burstvm") else {
        return reaped;
    };
    for e in rd.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(tag) = name.strip_prefix("rt-") else {
            continue;
        };
        let Some(pid) = tag_pid(tag) else { continue };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let prefixes = [
            format!("bv{tag}-"),
            format!("bvsrv-{tag}"),
            format!("pool-{tag}-"),
        ];
        for ns in prefixes.iter().take(2).flat_map(|p| netns::list(p)) {
            if netns::delete_path(&netns::named_path(&ns)).is_ok() {
                reaped.push(format!("netns {ns}"));
            }
        }
        for cg in layout.list() {
            if !(cg.starts_with(&prefixes[0]) || cg.starts_with(&prefixes[2])) {
                continue;
            }
            for d in layout.dirs(&cg).iter().rev() {
                // A VMM of a dead runtime should have died with it (PDEATHSIG).
                if let Ok(procs) = std::fs::read_to_string(d.join("cgroup.procs")) {
                    for p in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                        // SAFETY: kill(2) on a process in the dead runtime's cgroup.
                        unsafe { libc::kill(p, libc::SIGKILL) };
                    }
                }
                if let Err(e) = crate::cgroup::rmdir_retry(d) {
                    tracing::warn!("{e}");
                }
            }
            reaped.push(format!("cgroup {cg}"));
        }
        // Its writable layers are a mount inside the state directory: the
        // mount goes first, so that removing the directory never reaches
        // into the filesystem.
        reaped.extend(::rootfs::layers::reap(&e.path().join("rootfs")));
        if ::rootfs::layers::is_mounted(&e.path().join("rootfs/mnt")) {
            continue;
        }
        let _ = std::fs::remove_dir_all(e.path());
        reaped.push(format!("state {}", e.path().display()));
    }
    reaped
}

fn unique_tag() -> String {
    // pid plus a per-process counter, base 36, short enough for interface names.
    use std::sync::atomic::AtomicU32;
    static N: AtomicU32 = AtomicU32::new(0);
    let n = (std::process::id() as u64) * 64 + (N.fetch_add(1, Ordering::Relaxed) % 64) as u64;
    let mut s = String::new();
    let mut x = n;
    loop {
        s.insert(0, char::from_digit((x % 36) as u32, 36).unwrap());
        x /= 36;
        if x == 0 {
            break;
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_unique_and_name_their_pid() {
        let a = unique_tag();
        let b = unique_tag();
        assert_ne!(a, b);
        assert!(a.len() <= 11, "{a}: fits interface names");
        assert_eq!(tag_pid(&a), Some(std::process::id()));
        assert_eq!(tag_pid("not a tag!"), None);
    }

    #[test]
    fn expected_stages_follow_the_policy() {
        let f = expected_stages(Variant::Fastiov, false);
        assert!(!f.contains(&Stage::DmaImage) && f.contains(&Stage::VfOpen));
        assert!(!f.contains(&Stage::Rootfs));
        assert!(expected_stages(Variant::FastiovS, false).contains(&Stage::DmaImage));
        let n = expected_stages(Variant::NoNet, true);
        assert!(!n.contains(&Stage::CniAdd) && !n.contains(&Stage::VfDriver));
        assert_eq!(n[2], Stage::Rootfs);
        let t = expected_stages(Variant::Tap, false);
        assert!(t.contains(&Stage::CniAdd) && !t.contains(&Stage::VfOpen));
        assert_eq!(f.first(), Some(&Stage::Cgroup));
        assert_eq!(f.last(), Some(&Stage::Ready));
    }
}
