//! `VmConfig`: the validated, resolved configuration of one microVM, built
//! from `VmParams` by `VmConfig::from_params`. Every cross-field rule and
//! every host check (memory available, app file size) lives here, so a
//! VmConfig that exists is one the builder can boot.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;

use netutil::MacAddr;

use crate::args::{invalid, AgentMode, SgXf, VmParams, SG_MAX_BYTES, SG_MAX_PIPES};
use crate::devspec::{DiskSpec, NetBackend, VfInit, VsockSpec};
use crate::error::Error;
use crate::layout;

/// What to boot.
#[derive(Debug, Clone)]
pub enum BootSource {
    Agent,
    Linux {
        kernel: PathBuf,
        initrd: Option<PathBuf>,
        cmdline: Option<String>,
    },
}

/// Guest network configuration handed to the agent in the boot info.
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// `--mac`, else derived from the sandbox id — except for VFs, which
    /// then use their own MAC from the NIC (`mac_from_vf`).
    pub mac: MacAddr,
    /// No `--mac` with a `--net vf:`: the VF's MAC is the guest's; the boot
    /// info carries none, so the agent reads it from the device.
    pub mac_from_vf: bool,
    /// All-zero: broadcast.
    pub server_mac: MacAddr,
    pub ip: Ipv4Addr,
    pub netmask: Ipv4Addr,
    pub gateway: Ipv4Addr,
    pub server: Option<SocketAddrV4>,
}

/// A validated VMM configuration.
#[derive(Debug, Clone)]
pub struct VmConfig {
    pub sandbox: String,
    pub ram_size: u64,
    pub vcpus: u8,
    pub boot: BootSource,
    pub net: Vec<NetBackend>,
    pub disks: Vec<DiskSpec>,
    /// The virtio-vsock device (`--vsock`), in the slot after the disks.
    pub vsock: Option<VsockSpec>,
    /// The entropy device (`--entropy`, Linux guests), in the last slot.
    pub entropy: bool,
    /// The control socket (`--api`): media changes of empty disk slots.
    pub api: Option<PathBuf>,
    pub rootfs_pmem: Option<PathBuf>,
    /// File the agent checksums in the EROFS image, and the host's checksum.
    pub rootfs_check: Option<(String, u32)>,
    pub netcfg: NetConfig,
    pub policy: guestmem::MemoryPolicy,
    pub dma_ram: bool,
    pub dma_image: bool,
    /// Bytes of the DMA window region (0: none), a multiple of 4 KiB (2 MiB
    /// with hugepages).
    pub dma_window: u64,
    pub pool_socket: Option<PathBuf>,
    /// Where the background zeroer's thread goes (`VmParams::idle_cgroup`).
    pub idle_cgroup: Option<PathBuf>,
    pub hugepages: bool,
    pub vf_init: VfInit,
    pub vf_reconnect: std::time::Duration,
    pub agent_mode: AgentMode,
    /// The built-in agent stays at CPL0 (`--agent-cpl0`).
    pub agent_cpl0: bool,
    /// Virtio devices get register pages (unless `--no-register-pages`).
    pub register_pages: bool,
    /// Warp pipes and bytes per pipe of the SG agent modes.
    pub sg_pipes: u32,
    pub sg_bytes: u32,
    /// The chain's port and transform (`sg-send`/`sg-recv`).
    pub sg_port: u32,
    pub sg_xf: SgXf,
    pub app_size: u64,
    /// The app payload read from `--app-file` (None: generated from the sandbox id).
    pub app_bytes: Option<Vec<u8>>,
    pub probe: Vec<u64>,
    pub trace: Option<PathBuf>,
    pub serial_log: Option<PathBuf>,
    pub ready_fd: Option<i32>,
    pub keep_running: bool,
    pub until_exit: bool,
    pub timeout_secs: u64,
    pub kvm_device: PathBuf,
    pub supported_cpuid: Option<PathBuf>,
    pub template: Option<TemplateMode>,
}

/// What a VMM does with a template (docs/templates.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateMode {
    /// Boot to the checkpoint and save the template into this directory.
    Save(PathBuf),
    /// Boot to the checkpoint, round-trip every KVM state there, resume.
    Probe,
    /// Restore from this template directory.
    Restore(PathBuf),
}

/// The `--app-file` payload: a regular file no larger than the image region allows.
fn read_app_file(p: &std::path::Path) -> Result<Vec<u8>, Error> {
    let bad = |msg: String| invalid("--app-file", format!("{}: {msg}", p.display()));
    let io_err = |source| Error::File {
        what: "--app-file",
        path: p.to_path_buf(),
        source,
    };
    let md = std::fs::metadata(p).map_err(io_err)?;
    if !md.is_file() {
        return Err(bad("not a regular file".into()));
    }
    if md.len() > layout::MAX_APP_SIZE {
        return Err(bad(format!(
            "{} bytes exceeds the image region limit of {} bytes",
            md.len(),
            layout::MAX_APP_SIZE
        )));
    }
    std::fs::read(p).map_err(io_err)
}

/// A locally administered unicast MAC derived from the sandbox id.
fn default_mac(sandbox: &str) -> MacAddr {
    let h = crate::app::fnv1a64(sandbox.as_bytes()).to_le_bytes();
    MacAddr::new([0x02, 0xb5, h[0], h[1], h[2], h[3]])
}

/// Available memory on the host (MemAvailable, bytes).
fn host_available_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// `--vsock PATH` and `--vsock-cid CID`: `PATH_<port>` must fit a Unix
/// socket address, the CID must be a guest's (not 0-2, not VMADDR_CID_ANY;
/// Linux keeps CIDs in 32 bits).
fn vsock_spec(a: &VmParams) -> Result<Option<VsockSpec>, Error> {
    let Some(path) = &a.vsock else {
        if a.vsock_cid != crate::virtio::vsock::DEFAULT_GUEST_CID {
            return Err(invalid("--vsock-cid", "needs --vsock"));
        }
        return Ok(None);
    };
    let len = path.as_os_str().len();
    let max = crate::virtio::vsock::MAX_PATH_LEN;
    if len == 0 || len > max || path.as_os_str().as_encoded_bytes().contains(&0) {
        return Err(invalid(
            "--vsock",
            format!(
                "{}: the socket path must be 1..={max} bytes (PATH_<port> must fit a Unix socket address)",
                path.display()
            ),
        ));
    }
    if !(3..u64::from(u32::MAX)).contains(&a.vsock_cid) {
        return Err(invalid(
            "--vsock-cid",
            format!(
                "{}: a guest CID is 3..={} (0-2 are reserved, {} is VMADDR_CID_ANY)",
                a.vsock_cid,
                u32::MAX - 1,
                u32::MAX
            ),
        ));
    }
    Ok(Some(VsockSpec {
        path: path.clone(),
        cid: a.vsock_cid,
    }))
}

impl VmConfig {
    /// The MAC `backend` is given; `None`: the device's own (a VF's).
    pub fn device_mac(&self, backend: &NetBackend) -> Option<[u8; 6]> {
        match backend {
            NetBackend::VhostUser(_) if self.netcfg.mac_from_vf => None,
            _ => Some(self.netcfg.mac.bytes()),
        }
    }

    /// The MAC in the boot info: none (zero) when the first device is a VF
    /// whose MAC comes from the NIC — the agent then reads the device's.
    pub fn boot_mac(&self) -> [u8; 6] {
        match self.net.first() {
            Some(b) => self.device_mac(b).unwrap_or([0; 6]),
            None => self.netcfg.mac.bytes(),
        }
    }

    pub fn from_params(a: &VmParams) -> Result<Self, Error> {
        if a.sandbox.is_empty() || a.sandbox.len() > 63 || a.sandbox.contains('\0') {
            return Err(invalid(
                "--sandbox",
                format!("{:?} must be 1..63 bytes", a.sandbox),
            ));
        }
        let ram_size = a.memory;
        if ram_size == 0 {
            return Err(invalid(
                "--memory",
                "guest memory size must be greater than 0",
            ));
        }
        let app_bytes = match &a.app_file {
            Some(p) => Some(read_app_file(p)?),
            None => None,
        };
        let app_size = match &app_bytes {
            Some(b) => b.len() as u64,
            None => a.app_size,
        };
        if app_size > layout::MAX_APP_SIZE {
            return Err(invalid(
                "--app-size",
                format!(
                    "{app_size} bytes exceeds the image region limit of {} bytes",
                    layout::MAX_APP_SIZE
                ),
            ));
        }
        let total = ram_size.saturating_add(app_size);
        if let Some(avail) = host_available_bytes() {
            if total > avail {
                return Err(invalid(
                    "--memory",
                    format!(
                        "{} MiB requested but the host can back only {} MiB (MemAvailable in /proc/meminfo)",
                        total >> 20,
                        avail >> 20
                    ),
                ));
            }
        }
        if ram_size > layout::MAX_RAM {
            return Err(invalid(
                "--memory",
                format!("{} MiB exceeds the 3 GiB guest RAM limit (RAM must end below the image region at 0xC000_0000)", ram_size >> 20),
            ));
        }
        if ram_size < layout::MIN_RAM {
            return Err(invalid(
                "--memory",
                format!("{ram_size} bytes is below the 2 MiB minimum"),
            ));
        }
        if !ram_size.is_multiple_of(4096) {
            return Err(invalid(
                "--memory",
                format!("{ram_size} bytes is not a multiple of 4 KiB"),
            ));
        }
        if a.vcpus == 0 || a.vcpus > 32 {
            return Err(invalid("--vcpus", format!("{} must be 1..32", a.vcpus)));
        }
        let vsock = vsock_spec(a)?;
        let max_devices = if a.kernel.is_some() {
            layout::MAX_DEVICES
        } else {
            layout::MAX_AGENT_DEVICES
        };
        if a.entropy && a.kernel.is_none() {
            return Err(invalid(
                "--entropy",
                "only a Linux guest (--kernel) drives the entropy device",
            ));
        }
        let devices =
            a.net.len() + a.disk.len() + usize::from(vsock.is_some()) + usize::from(a.entropy);
        if devices > max_devices {
            return Err(invalid(
                "--disk",
                format!(
                    "at most {max_devices} devices (--net, --disk, --vsock and --entropy together)"
                ),
            ));
        }
        if a.disk.iter().any(|d| d.empty) && a.api.is_none() {
            return Err(invalid(
                "--disk",
                "an empty slot takes media only through --api",
            ));
        }
        let rootfs_check = a.rootfs_check.clone();
        let policy = a.memory_policy;
        let mac = a.mac.unwrap_or_else(|| default_mac(&a.sandbox));
        let mac_from_vf =
            a.mac.is_none() && a.net.iter().any(|n| matches!(n, NetBackend::VhostUser(_)));
        if mac.is_multicast() {
            return Err(invalid("--mac", "guest MAC must be unicast"));
        }
        let server_mac = a.server_mac.unwrap_or(MacAddr::ZERO);
        let (ip, netmask) =
            a.ip.unwrap_or((Ipv4Addr::UNSPECIFIED, Ipv4Addr::UNSPECIFIED));
        let probe = a.probe.clone();
        if probe.len() > layout::MAX_PROBES {
            return Err(invalid(
                "--probe",
                format!("at most {} addresses", layout::MAX_PROBES),
            ));
        }
        let boot = match &a.kernel {
            Some(k) => {
                if app_size > 0 || !probe.is_empty() || a.agent_mode != AgentMode::Once {
                    return Err(invalid(
                        "--kernel",
                        "--app-size, --probe and --agent-mode need the built-in agent, not a Linux kernel",
                    ));
                }
                BootSource::Linux {
                    kernel: k.clone(),
                    initrd: a.initrd.clone(),
                    cmdline: a.cmdline.clone(),
                }
            }
            None => BootSource::Agent,
        };
        let dma_window = a.dma_window;
        if dma_window > 0 {
            if a.agent_mode.is_sg() {
                return Err(invalid(
                    "--dma-window",
                    "the SG agent modes keep their rings in RAM (the window holds virtio-net's)",
                ));
            }
            // Pages, or hugepages when guest memory is hugetlb-backed; a
            // Linux guest's swiotlb pool takes whole segments.
            let granule = match (a.hugepages, &boot) {
                (true, _) => layout::ALIGN_2M,
                (false, BootSource::Linux { .. }) => layout::LINUX_DMA_WINDOW_GRANULE,
                (false, BootSource::Agent) => 4096,
            };
            if !dma_window.is_multiple_of(granule) || dma_window > layout::MAX_DMA_WINDOW {
                return Err(invalid(
                    "--dma-window",
                    format!(
                        "a multiple of 4 KiB (256 KiB with --kernel, 2 MiB with --hugepages) \
                         up to {} MiB",
                        layout::MAX_DMA_WINDOW >> 20
                    ),
                ));
            }
        }
        if a.agent_mode.is_sg() {
            let sgfs = a
                .net
                .iter()
                .filter(|n| matches!(n, NetBackend::Sg(_)))
                .count();
            if sgfs != 1 || a.net.len() != 1 {
                return Err(invalid(
                    "--agent-mode",
                    "the sg modes need exactly one --net sg:SOCKET and no other network device",
                ));
            }
            if !(1..=SG_MAX_PIPES).contains(&a.sg_pipes) {
                return Err(invalid("--sg-pipes", format!("1..={SG_MAX_PIPES}")));
            }
            if !(8..=SG_MAX_BYTES).contains(&a.sg_bytes) || !a.sg_bytes.is_multiple_of(8) {
                return Err(invalid(
                    "--sg-bytes",
                    format!("a multiple of 8 in 8..={SG_MAX_BYTES}"),
                ));
            }
            let chain = matches!(a.agent_mode, AgentMode::SgSend | AgentMode::SgRecv);
            if chain != (a.sg_port != 0) {
                return Err(invalid(
                    "--sg-port",
                    "1.. with --agent-mode sg-send|sg-recv (and only with them)",
                ));
            }
            if chain && a.sg_pipes >= SG_MAX_PIPES {
                return Err(invalid(
                    "--sg-pipes",
                    format!("1..{SG_MAX_PIPES} with sg-send|sg-recv (one socket is the listener)"),
                ));
            }
        }
        if let Some(fd) = a.ready_fd {
            // SAFETY: F_GETFD only queries the descriptor table.
            if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
                return Err(invalid(
                    "--ready-fd",
                    format!("{fd} is not an open file descriptor"),
                ));
            }
        }
        VmConfig {
            sandbox: a.sandbox.clone(),
            ram_size,
            vcpus: a.vcpus,
            boot,
            net: a.net.clone(),
            disks: a.disk.clone(),
            vsock,
            entropy: a.entropy,
            api: a.api.clone(),
            rootfs_pmem: a.rootfs_pmem.clone(),
            rootfs_check,
            netcfg: NetConfig {
                mac,
                mac_from_vf,
                server_mac,
                ip,
                netmask,
                gateway: a.gateway.unwrap_or(Ipv4Addr::UNSPECIFIED),
                server: a.server,
            },
            policy,
            dma_ram: a.dma_ram,
            dma_image: a.dma_image,
            dma_window,
            pool_socket: a.pool_socket.clone(),
            idle_cgroup: a.idle_cgroup.clone(),
            hugepages: a.hugepages,
            vf_init: a.vf_init,
            vf_reconnect: std::time::Duration::from_secs(a.vf_reconnect),
            agent_mode: a.agent_mode,
            agent_cpl0: a.agent_cpl0,
            register_pages: !a.no_register_pages,
            sg_pipes: a.sg_pipes,
            sg_bytes: a.sg_bytes,
            sg_port: a.sg_port,
            sg_xf: a.sg_xf,
            app_size,
            app_bytes,
            probe,
            trace: a.trace.clone(),
            serial_log: a.serial_log.clone(),
            ready_fd: a.ready_fd,
            keep_running: a.keep_running,
            until_exit: a.until_exit,
            timeout_secs: a.timeout,
            kvm_device: a.kvm_device.clone(),
            supported_cpuid: a.supported_cpuid.clone(),
            template: None,
        }
        .with_template(a)
    }

    /// Checks and applies the template flags. A template is made from the
    /// built-in agent with one vCPU and no device (it checkpoints before it
    /// touches any), in fresh memory under `vanilla`: never pool pages,
    /// which could hold another tenant's bytes the guest has not yet
    /// overwritten (docs/guestmem.md, "Templates").
    fn with_template(mut self, a: &VmParams) -> Result<Self, Error> {
        let mode = match (&a.template_save, a.template_probe, &a.template) {
            (Some(d), false, None) => TemplateMode::Save(d.clone()),
            (None, true, None) => TemplateMode::Probe,
            (None, false, Some(d)) => TemplateMode::Restore(d.clone()),
            (None, false, None) => return Ok(self),
            _ => {
                return Err(invalid(
                    "--template",
                    "give one of --template, --template-save, --template-probe",
                ))
            }
        };
        if self.vcpus != 1 {
            return Err(invalid(
                "--vcpus",
                "templates hold one vCPU (the built-in agent runs on vCPU 0 only)",
            ));
        }
        if !matches!(mode, TemplateMode::Restore(_)) {
            if !self.net.is_empty()
                || !self.disks.is_empty()
                || self.vsock.is_some()
                || self.rootfs_pmem.is_some()
            {
                return Err(invalid(
                    "--template-save",
                    "a template has no devices: they are per sandbox, attached after the restore",
                ));
            }
            self.policy = guestmem::MemoryPolicy::Vanilla;
            self.pool_socket = None;
            self.dma_ram = false;
            self.dma_image = false;
            self.dma_window = 0;
            if matches!(mode, TemplateMode::Save(_)) {
                // The app payload is per sandbox: the template's image
                // region is sized for --app-size but holds none.
                self.app_bytes = Some(Vec::new());
            }
        } else {
            if self.net.iter().any(|n| n.is_vhost_user()) && self.dma_window == 0 {
                return Err(invalid(
                    "--template",
                    "a VF (vhost-user) maps guest memory from a shared fd, and a template's \
                     memory is private copy-on-write: give the VF a --dma-window (fresh per \
                     restore), or use a tap or no network with templates",
                ));
            }
            // Restored memory is the template's file, mapped copy-on-write:
            // no pool, no zeroing, no DMA map (docs/guestmem.md).
            self.pool_socket = None;
            self.dma_ram = false;
            self.dma_image = false;
            self.policy = guestmem::MemoryPolicy::Vanilla;
        }
        self.template = Some(mode);
        Ok(self)
    }
}
