//! What a sandbox is asked to be: the spec of its VM, workload and network
//! (`SandboxSpec`, `SgSpec`), what an engine brings on top (`Attach`), and
//! what its `rootfs` stage cost (`RootfsCost`). Plain data: nothing here
//! owns a resource, so a spec can be cloned and sent between threads.

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::sandbox::rootfs::RootfsSpec;
use crate::variant::Variant;

/// What to create.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    pub id: String,
    pub variant: Variant,
    pub memory_bytes: u64,
    pub cpus: f64,
    pub app_size: u64,
    pub keep_running: bool,
    /// Seconds the VMM may take to reach READY.
    pub timeout_secs: u64,
    /// Root filesystem (RunD split); None: the agent runs without one.
    pub rootfs: Option<RootfsSpec>,
    /// Boot this Linux kernel instead of the built-in agent.
    pub kernel: Option<PathBuf>,
    /// With `kernel`: boot it with this initramfs, the guest agent's
    /// (`container::initramfs`). The sandbox then runs containers: the VMM
    /// serves vsock at `Sandbox::vsock_path` and the agent takes processes
    /// there (docs/runtime.md, "Containers").
    pub agent_initrd: Option<PathBuf>,
    /// With `agent_initrd`: a pod sandbox. Its agent stays up until
    /// `Shutdown` (`burstvm_pod=1`) and takes containers; the VM gets this
    /// many empty disk slots ([`pod_slot`]) for their images, filled and
    /// emptied through the VMM's control socket at `Sandbox::api_path`.
    pub pod_slots: Option<u8>,
    /// The guest keeps exchanging requests with the echo server after READY (agent echo
    /// mode; with `keep_running`).
    pub echo: bool,
    /// Probe mode: guest addresses the agent reads (before its first
    /// request) and the VMM reports when it exits (`Sandbox::probe_values`).
    pub probe: Vec<u64>,
    /// Start from this template directory instead of booting.
    pub template: Option<PathBuf>,
    /// A VF variant claims its network from the runtime's network pool
    /// when one is ready (`net-claim` instead of `netns` + `cni-add`).
    pub net_pool: bool,
    /// Attach to the host's SG network (`SandboxHost::sg_cni`, an SG function instead
    /// of a VF) and run the agent's warp pipes (VF variants only).
    pub sg: Option<SgSpec>,
    /// Every guest memory region in 2 MiB hugetlb pages (`burstvm vmm
    /// --hugepages`; FastIOV's setting), which the caller has reserved.
    pub hugepages: bool,
    /// The built-in agent does all its work at CPL0 (`burstvm vmm --agent-cpl0`: the
    /// A/B of its switch to CPL3, docs/guest.md).
    pub agent_cpl0: bool,
    /// Keep the VMM's ready pipe after READY (one descriptor per sandbox), so
    /// `Sandbox::wait_background_zeroing` can wait for its "zeroed" line
    /// (`vmm::ZEROED_LINE`); benchmarks that count the deferred zeroing.
    pub watch_zeroing: bool,
}

/// The id (virtio serial) of a pod sandbox's empty disk slot `i`.
pub fn pod_slot(i: u8) -> String {
    format!("ctr-slot-{i}")
}

/// What the agent does on an SG function (`burstvm vmm --sg-pipes/--sg-bytes`): open
/// `pipes` echo sockets and send `bytes` through each; the VMM checks the checksum
/// before READY (docs/sgiov.md, "The agent's SG mode").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SgSpec {
    pub pipes: u32,
    pub bytes: u32,
}

impl Default for SgSpec {
    /// The VMM's defaults.
    fn default() -> Self {
        SgSpec {
            pipes: 64,
            bytes: 1024,
        }
    }
}

impl SandboxSpec {
    /// An idle sandbox of one vCPU running the built-in agent without an app
    /// payload, root filesystem, probe or template; that exits after READY
    /// (callers set what they need with `..SandboxSpec::new(..)`).
    pub fn new(id: String, variant: Variant, memory_bytes: u64, timeout_secs: u64) -> Self {
        SandboxSpec {
            id,
            variant,
            memory_bytes,
            cpus: 1.0,
            app_size: 0,
            keep_running: false,
            timeout_secs,
            rootfs: None,
            kernel: None,
            agent_initrd: None,
            pod_slots: None,
            echo: false,
            probe: Vec::new(),
            template: None,
            net_pool: false,
            sg: None,
            hugepages: false,
            agent_cpl0: false,
            watch_zeroing: false,
        }
    }
}

/// What the `rootfs` stage cost this sandbox (bench statistics).
#[derive(Debug, Clone, Copy, Default)]
pub struct RootfsCost {
    pub wall_ns: u64,
    pub cpu_ns: u64,
    pub bytes_copied: u64,
}

/// What an engine brings to a sandbox beyond its spec (containerd's shim;
/// `burstvm run` and the bench use the default: nothing).
#[derive(Debug, Default)]
pub struct Attach {
    /// A netns the engine made and already ran CNI ADD in (containerd's CRI
    /// plugin): the `netns` and `cni-add` stages are the engine's, the
    /// sandbox reads the placeholder link `IFNAME` from it and attaches the
    /// VF. The netns is neither CNI-deleted nor removed at teardown.
    pub netns: Option<PathBuf>,
    /// The app payload (a container image's entrypoint) instead of generated bytes.
    pub app_file: Option<PathBuf>,
    /// The VMM lives until the guest's EXIT and exits with its status (a task).
    pub until_exit: bool,
    /// The VMM's stdout (guest serial console and stage summary).
    pub stdout: Option<OwnedFd>,
    /// Set by the engine to abandon a start in progress (a task killed while booting).
    pub cancel: Option<Arc<AtomicBool>>,
}
