//! The VMM's parameters as the command line gives them (`VmParams`, filled
//! by cli's clap struct) and the field parsers; `config.rs` validates them
//! into a `VmConfig`.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;

use netutil::MacAddr;

use crate::devspec::{DiskSpec, NetBackend, VfInit};
use crate::error::Error;

pub use crate::config::{BootSource, NetConfig, TemplateMode, VmConfig};

/// The parameters of one VMM, as `burstvm vmm` takes them (docs/design.md,
/// "VMM command line"): the CLI fills this in (cli/src/args/vmm.rs) and
/// [`VmConfig::from_params`] validates it, as Cloud Hypervisor's `VmParams`.
/// Each field is parsed (by the `pub` parsers below, which name the flag in
/// their errors); what needs several fields or the host is checked there.
#[derive(Debug, Clone, PartialEq)]
pub struct VmParams {
    /// Sandbox id (at most 63 bytes); names trace lines and seeds the app payload.
    pub sandbox: String,
    /// Guest RAM size in bytes (at most 3G).
    pub memory: u64,
    /// Number of vCPUs.
    pub vcpus: u8,
    /// Boot a Linux vmlinux ELF instead of the built-in agent.
    pub kernel: Option<PathBuf>,
    /// Initrd for --kernel.
    pub initrd: Option<PathBuf>,
    /// Kernel command line for --kernel (console=ttyS0 and virtio_mmio.device= are added).
    pub cmdline: Option<String>,
    /// Network device: tap:NAME (virtio-net over a tap) or vf:SOCKET (vhost-user VF).
    pub net: Vec<NetBackend>,
    /// Block device: path=FILE[,ro][,unlink][,id=ID] (virtio-blk); repeatable.
    /// The rootfs: the EROFS image read-only, the writable layer with unlink.
    /// `empty,id=ID[,ro]`: a slot without media until `--api` inserts some.
    pub disk: Vec<DiskSpec>,
    /// Built-in agent: put this EROFS image into the image region (a
    /// pmem-style mapping, DMA-mapped with it) instead of a virtio-blk disk.
    pub rootfs_pmem: Option<PathBuf>,
    /// virtio-vsock device (Firecracker's hybrid model): host processes
    /// connect to this Unix socket and write `CONNECT <port>\n`; guest
    /// connections to host port P go to the socket `PATH_P`.
    pub vsock: Option<PathBuf>,
    /// The guest's vsock CID (with `vsock`): 3..=2^32-2.
    pub vsock_cid: u64,
    /// The entropy device (virtio-rng, Firecracker's `entropy`): the host's
    /// getrandom bytes for a Linux guest's entropy pool.
    pub entropy: bool,
    /// Control socket (Firecracker's drive update): insert a file into an
    /// empty disk slot, eject it (`vmm::api`).
    pub api: Option<PathBuf>,
    /// PATH=CHECKSUM: a file of the EROFS image the guest reads and
    /// checksums (the agent, or burstvm's Linux init, given
    /// burstvm_check=PATH); the VMM checks it as it does the app checksum.
    pub rootfs_check: Option<(String, u32)>,
    /// Guest MAC address (default: a VF's own MAC from the NIC; for a tap, derived from the sandbox id).
    pub mac: Option<MacAddr>,
    /// Guest address and netmask (`--ip` is a CIDR, e.g. 10.0.0.2/24).
    pub ip: Option<(Ipv4Addr, Ipv4Addr)>,
    /// Default gateway.
    pub gateway: Option<Ipv4Addr>,
    /// Server the agent sends its first request to, IP:PORT.
    pub server: Option<SocketAddrV4>,
    /// MAC of the server (default: broadcast).
    pub server_mac: Option<MacAddr>,
    /// Memory policy: vanilla, pre10, pre50, pre100, lazy.
    pub memory_policy: guestmem::MemoryPolicy,
    /// DMA-map the ram region (times the dma-ram stage).
    pub dma_ram: bool,
    /// DMA-map the image region (times the dma-image stage).
    pub dma_image: bool,
    /// Bytes of the DMA window (0: none): a small fresh region, DMA-mapped,
    /// where the built-in agent keeps its rings and packet buffers; with it
    /// a VF needs neither dma-ram nor dma-image (times the dma-window stage).
    pub dma_window: u64,
    /// Take guest memory from the page-pool server at this socket.
    pub pool_socket: Option<PathBuf>,
    /// A cgroup-v1 cpu cgroup with `cpu.idle` set: the lazy policy's
    /// background zeroer moves its thread there when it starts, so that it
    /// runs only when nothing else on the host wants the CPU (SCHED_IDLE
    /// within the VMM's own cgroup would still compete at that cgroup's weight).
    pub idle_cgroup: Option<PathBuf>,
    /// Back guest memory with 2 MiB hugetlb pages.
    pub hugepages: bool,
    /// VF driver init: sync or async.
    pub vf_init: VfInit,
    /// Seconds a VF may stay without its backend (the NIC daemon restarting) before the
    /// VMM gives up reconnecting and reports the VF lost (0: never reconnect).
    pub vf_reconnect: u64,
    /// What the built-in agent does on the network: one request (once), keep exchanging
    /// requests after READY (echo), reset and re-initialise its device once before READY
    /// (reset), or first make its VF fail with a bad descriptor, then reset (fault).
    pub agent_mode: AgentMode,
    /// The built-in agent does all its work at CPL0 instead of switching to CPL3 after
    /// its boot report (an A/B of the switch: on kvm_pvm CPL0 code is emulated;
    /// docs/guest.md, "The agent at CPL3").
    pub agent_cpl0: bool,
    /// Every virtio register read exits to the VMM, as without a register
    /// page (an A/B of the pages: docs/vmm.md, "The register page").
    pub no_register_pages: bool,
    /// `--agent-mode sg|sg-echo`: warp pipes (echo sockets) the agent opens, 1..4096.
    pub sg_pipes: u32,
    /// `--agent-mode sg|sg-echo`: bytes the agent sends through each pipe, a multiple of 8
    /// in 8..4096.
    pub sg_bytes: u32,
    /// `--agent-mode sg-send|sg-recv`: the port of the chain (1..; the NIC's control API
    /// must have linked the two sandboxes, `sg_link`).
    pub sg_port: u32,
    /// `--agent-mode sg-send`: what the chain does to the bytes (crypto: AES-GCM into the
    /// daemon's staging ring and out of it).
    pub sg_xf: SgXf,
    /// Size of the app payload the agent checksums, bytes.
    pub app_size: u64,
    /// Use this file as the app payload instead of generated bytes (a container's entrypoint).
    pub app_file: Option<PathBuf>,
    /// Probe mode: guest-physical addresses the agent reads and reports.
    pub probe: Vec<u64>,
    /// Append trace lines (JSON) to this file.
    pub trace: Option<PathBuf>,
    /// Write the guest serial console here instead of stdout.
    pub serial_log: Option<PathBuf>,
    /// Write "ready vcpu-ns=N\n" to this inherited file descriptor when the
    /// guest is ready (`launch::Ready`; N: the vCPU threads' CPU until then),
    /// and "zeroed\n" once the zeroing deferred past READY is over.
    pub ready_fd: Option<i32>,
    /// Keep the VM running after READY (until SIGTERM or guest exit).
    pub keep_running: bool,
    /// Stay up after READY until the guest's EXIT and exit with the guest's status (a task).
    pub until_exit: bool,
    /// Seconds until READY before giving up (0 = no limit).
    pub timeout: u64,
    /// KVM device node.
    pub kvm_device: PathBuf,
    /// KVM's supported CPUID as written by `supported_cpuid::write` (a runtime asks
    /// once for all of its VMMs); without it the VMM asks KVM itself.
    pub supported_cpuid: Option<PathBuf>,
    /// Boot the built-in agent to its template checkpoint, save the VM
    /// (vCPU, LAPIC, irqchip, PIT, clock state and guest memory) as a
    /// template in this new directory, and exit (docs/templates.md).
    pub template_save: Option<PathBuf>,
    /// Like --template-save, but only check which KVM state get/set calls
    /// work here: save and restore each at the checkpoint, report, then
    /// resume to READY.
    pub template_probe: bool,
    /// Start from the template in this directory instead of booting: its
    /// memory mapped copy-on-write, its state restored, this sandbox's
    /// boot info and devices attached after the restore.
    pub template: Option<PathBuf>,
}

/// The network behaviour of the built-in agent (boot-info flags, docs/guest.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AgentMode {
    #[default]
    Once,
    Echo,
    Reset,
    Fault,
    /// Warp pipes on the SG function (`--net sg:`): open `--sg-pipes` echo sockets, send
    /// `--sg-bytes` through each, check what comes back, report the checksum (docs/sgiov.md).
    Sg,
    /// As `sg`, and after READY keep moving the same bytes through the pipes.
    SgEcho,
    /// One end of a chain to another sandbox (docs/sgiov.md §14.1): CONNECT `--sg-pipes`
    /// sockets to `--sg-port` with `--sg-xf`, send `--sg-bytes` through each, check the
    /// echo the receiver sends back.
    SgSend,
    /// The other end: LISTEN on `--sg-port`, accept `--sg-pipes` connections, check what
    /// arrives, echo it back.
    SgRecv,
}

/// The transform of a chain's connections (the CONNECT's `xf`, docs/sgiov.md §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SgXf {
    Copy = 0,
    #[default]
    Crypto = 1,
}

impl SgXf {
    pub const ALL: [SgXf; 2] = [SgXf::Copy, SgXf::Crypto];

    pub fn name(self) -> &'static str {
        match self {
            SgXf::Copy => "copy",
            SgXf::Crypto => "crypto",
        }
    }
}

impl std::fmt::Display for SgXf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for SgXf {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|v| v.name() == s)
            .ok_or_else(|| format!("unknown transform {s:?} (copy, crypto)"))
    }
}

impl AgentMode {
    pub const ALL: [AgentMode; 8] = [
        AgentMode::Once,
        AgentMode::Echo,
        AgentMode::Reset,
        AgentMode::Fault,
        AgentMode::Sg,
        AgentMode::SgEcho,
        AgentMode::SgSend,
        AgentMode::SgRecv,
    ];

    pub fn name(self) -> &'static str {
        match self {
            AgentMode::Once => "once",
            AgentMode::Echo => "echo",
            AgentMode::Reset => "reset",
            AgentMode::Fault => "fault",
            AgentMode::Sg => "sg",
            AgentMode::SgEcho => "sg-echo",
            AgentMode::SgSend => "sg-send",
            AgentMode::SgRecv => "sg-recv",
        }
    }
}

impl std::fmt::Display for AgentMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for AgentMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|v| v.name() == s)
            .ok_or_else(|| format!("unknown agent mode {s:?} (once, echo, reset, fault, sg, sg-echo, sg-send, sg-recv)"))
    }
}

impl AgentMode {
    pub fn is_sg(self) -> bool {
        matches!(
            self,
            AgentMode::Sg | AgentMode::SgEcho | AgentMode::SgSend | AgentMode::SgRecv
        )
    }
}

/// Bounds of `--sg-pipes` and `--sg-bytes` (the agent's tables and one ring per direction).
pub const SG_MAX_PIPES: u32 = 4096;
pub const SG_MAX_BYTES: u32 = 4096;

pub(crate) fn invalid(field: &'static str, msg: impl Into<String>) -> Error {
    Error::InvalidArg {
        field,
        msg: msg.into(),
    }
}

/// Parses `64M`, `1G`, `4096`, `512K` into bytes (0 allowed).
pub fn parse_size(field: &'static str, s: &str) -> Result<u64, Error> {
    guestmem::parse_bytes(s)
        .ok_or_else(|| invalid(field, format!("{s:?} is not a size (e.g. 64M)")))
}

pub fn parse_mac(field: &'static str, s: &str) -> Result<MacAddr, Error> {
    s.parse()
        .map_err(|source| Error::InvalidMac { field, source })
}

pub fn parse_cidr(s: &str) -> Result<(Ipv4Addr, Ipv4Addr), Error> {
    let bad = || {
        invalid(
            "--ip",
            format!("{s:?} is not an IPv4 CIDR (e.g. 10.0.0.2/24)"),
        )
    };
    let (ip, len) = s.split_once('/').unwrap_or((s, "32"));
    let ip: Ipv4Addr = ip.parse().map_err(|_| bad())?;
    let len: u32 = len.parse().map_err(|_| bad())?;
    if len > 32 {
        return Err(bad());
    }
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    Ok((ip, Ipv4Addr::from(mask)))
}

/// `PATH=CHECKSUM`: an absolute path (fits the boot info) and a hex checksum.
pub fn parse_rootfs_check(s: &str) -> Result<(String, u32), Error> {
    let bad = |why: &str| invalid("--rootfs-check", format!("{s:?}: {why}"));
    let (path, sum) = s
        .rsplit_once('=')
        .ok_or_else(|| bad("expected PATH=CHECKSUM"))?;
    if !path.starts_with('/')
        || path.len() >= crate::bootinfo::ROOTFS_FILE_MAX
        || path.contains('\0')
    {
        return Err(bad("PATH must be absolute and under 128 bytes"));
    }
    let hex = sum.trim_start_matches("0x");
    let sum = u32::from_str_radix(hex, 16).map_err(|_| bad("CHECKSUM must be 32-bit hex"))?;
    Ok((path.to_string(), sum))
}

pub fn parse_gpa(s: &str) -> Result<u64, Error> {
    let t = s.trim();
    let r = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => t.parse(),
    };
    r.map_err(|_| invalid("--probe", format!("{s:?} is not an address")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("f", "64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("f", "1g").unwrap(), 1 << 30);
        assert_eq!(parse_size("f", "4096").unwrap(), 4096);
        assert!(parse_size("f", "12Q").is_err());
        assert!(parse_size("f", "M").is_err());
        assert!(parse_size("f", "99999999999T").is_err());
    }
}
