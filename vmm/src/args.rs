//! `burstvm vmm` command line and its validation into a `VmConfig`.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;

use netutil::MacAddr;

use crate::bus::{DiskSpec, NetBackend, VfInit};
use crate::error::Error;
use crate::layout;

/// Command line of `burstvm vmm` (docs/design.md, "VMM command line").
#[derive(Debug, Clone, clap::Args)]
pub struct VmmArgs {
    /// Sandbox id (at most 63 bytes); names trace lines and seeds the app payload.
    #[arg(long)]
    pub sandbox: String,
    /// Guest RAM size, e.g. 64M, 1G (at most 3G).
    #[arg(long, default_value = "64M")]
    pub memory: String,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    pub vcpus: u8,
    /// Boot a Linux vmlinux ELF instead of the built-in agent.
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Initrd for --kernel.
    #[arg(long, requires = "kernel")]
    pub initrd: Option<PathBuf>,
    /// Kernel command line for --kernel (console=ttyS0 and virtio_mmio.device= are added).
    #[arg(long, requires = "kernel")]
    pub cmdline: Option<String>,
    /// Network device: tap:NAME (virtio-net over a tap) or vf:SOCKET (vhost-user VF).
    #[arg(long, value_parser = parse_net)]
    pub net: Vec<NetBackend>,
    /// Block device: path=FILE[,ro][,unlink][,id=ID] (virtio-blk); repeatable.
    /// The rootfs: the EROFS image read-only, the writable layer with unlink.
    #[arg(long, value_parser = parse_disk)]
    pub disk: Vec<DiskSpec>,
    /// Built-in agent: put this EROFS image into the image region (a
    /// pmem-style mapping, DMA-mapped with it) instead of a virtio-blk disk.
    #[arg(long, conflicts_with = "kernel")]
    pub rootfs_pmem: Option<PathBuf>,
    /// PATH=CHECKSUM: a file of the EROFS image the guest reads and
    /// checksums (the agent, or burstvm's Linux init, given
    /// burstvm_check=PATH); the VMM checks it as it does the app checksum.
    #[arg(long)]
    pub rootfs_check: Option<String>,
    /// Guest MAC address (default: derived from the sandbox id).
    #[arg(long)]
    pub mac: Option<String>,
    /// Guest address, CIDR (e.g. 10.0.0.2/24).
    #[arg(long)]
    pub ip: Option<String>,
    /// Default gateway.
    #[arg(long)]
    pub gateway: Option<Ipv4Addr>,
    /// Server the agent sends its first request to, IP:PORT.
    #[arg(long)]
    pub server: Option<SocketAddrV4>,
    /// MAC of the server (default: broadcast).
    #[arg(long, requires = "server")]
    pub server_mac: Option<String>,
    /// Memory policy: vanilla, pre10, pre50, pre100, lazy.
    #[arg(long, default_value = "vanilla")]
    pub memory_policy: String,
    /// DMA-map the ram region (times the dma-ram stage).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub dma_ram: bool,
    /// DMA-map the image region (times the dma-image stage).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub dma_image: bool,
    /// Take guest memory from the page-pool server at this socket.
    #[arg(long)]
    pub pool_socket: Option<PathBuf>,
    /// Back guest memory with 2 MiB hugetlb pages.
    #[arg(long)]
    pub hugepages: bool,
    /// VF driver init: sync or async.
    #[arg(long, value_enum, default_value_t = VfInit::Sync)]
    pub vf_init: VfInit,
    /// Size of the app payload the agent checksums (e.g. 4M).
    #[arg(long, default_value = "0")]
    pub app_size: String,
    /// Probe mode: guest-physical addresses the agent reads and reports.
    #[arg(long, value_delimiter = ',')]
    pub probe: Vec<String>,
    /// Append trace lines (JSON) to this file.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Write the guest serial console here instead of stdout.
    #[arg(long)]
    pub serial_log: Option<PathBuf>,
    /// Write "ready\n" to this inherited file descriptor when the guest is ready.
    #[arg(long)]
    pub ready_fd: Option<i32>,
    /// Keep the VM running after READY (until SIGTERM or guest exit).
    #[arg(long)]
    pub keep_running: bool,
    /// Seconds until READY before giving up (0 = no limit).
    #[arg(long, default_value_t = 30)]
    pub timeout: u64,
    /// KVM device node.
    #[arg(long, default_value = "/dev/kvm")]
    pub kvm_device: PathBuf,
}

fn parse_net(s: &str) -> Result<NetBackend, String> {
    s.parse()
}

fn parse_disk(s: &str) -> Result<DiskSpec, String> {
    s.parse()
}

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
    pub mac: MacAddr,
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
    pub rootfs_pmem: Option<PathBuf>,
    /// File the agent checksums in the EROFS image, and the host's checksum.
    pub rootfs_check: Option<(String, u32)>,
    pub netcfg: NetConfig,
    pub policy: guestmem::MemoryPolicy,
    pub dma_ram: bool,
    pub dma_image: bool,
    pub pool_socket: Option<PathBuf>,
    pub hugepages: bool,
    pub vf_init: VfInit,
    pub app_size: u64,
    pub probe: Vec<u64>,
    pub trace: Option<PathBuf>,
    pub serial_log: Option<PathBuf>,
    pub ready_fd: Option<i32>,
    pub keep_running: bool,
    pub timeout_secs: u64,
    pub kvm_device: PathBuf,
}

fn invalid(field: &'static str, msg: impl Into<String>) -> Error {
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
        .map_err(|e: netutil::MacParseError| invalid(field, e.to_string()))
}

/// A locally administered unicast MAC derived from the sandbox id.
fn default_mac(sandbox: &str) -> MacAddr {
    let h = crate::app::fnv1a64(sandbox.as_bytes()).to_le_bytes();
    MacAddr::new([0x02, 0xb5, h[0], h[1], h[2], h[3]])
}

fn parse_cidr(s: &str) -> Result<(Ipv4Addr, Ipv4Addr), Error> {
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
fn parse_rootfs_check(s: &str) -> Result<(String, u32), Error> {
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

fn parse_gpa(s: &str) -> Result<u64, Error> {
    let t = s.trim();
    let r = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => t.parse(),
    };
    r.map_err(|_| invalid("--probe", format!("{s:?} is not an address")))
}

/// Available memory on the host (MemAvailable, bytes).
fn host_available_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

impl VmConfig {
    pub fn from_args(a: &VmmArgs) -> Result<Self, Error> {
        if a.sandbox.is_empty() || a.sandbox.len() > 63 || a.sandbox.contains('\0') {
            return Err(invalid(
                "--sandbox",
                format!("{:?} must be 1..63 bytes", a.sandbox),
            ));
        }
        let ram_size = parse_size("--memory", &a.memory)?;
        if ram_size == 0 {
            return Err(invalid(
                "--memory",
                "guest memory size must be greater than 0",
            ));
        }
        let app_size = parse_size("--app-size", &a.app_size)?;
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
        if ram_size % 4096 != 0 {
            return Err(invalid(
                "--memory",
                format!("{ram_size} bytes is not a multiple of 4 KiB"),
            ));
        }
        if a.vcpus == 0 || a.vcpus > 32 {
            return Err(invalid("--vcpus", format!("{} must be 1..32", a.vcpus)));
        }
        if a.net.len() + a.disk.len() > layout::MAX_DEVICES {
            return Err(invalid(
                "--disk",
                format!(
                    "at most {} devices (--net and --disk together)",
                    layout::MAX_DEVICES
                ),
            ));
        }
        let rootfs_check = a
            .rootfs_check
            .as_deref()
            .map(parse_rootfs_check)
            .transpose()?;
        let policy: guestmem::MemoryPolicy = a
            .memory_policy
            .parse()
            .map_err(|e| invalid("--memory-policy", format!("{:?}: {e}", a.memory_policy)))?;
        let mac = match &a.mac {
            Some(m) => parse_mac("--mac", m)?,
            None => default_mac(&a.sandbox),
        };
        if mac.is_multicast() {
            return Err(invalid("--mac", "guest MAC must be unicast"));
        }
        let server_mac = match &a.server_mac {
            Some(m) => parse_mac("--server-mac", m)?,
            None => MacAddr::ZERO,
        };
        let (ip, netmask) = match &a.ip {
            Some(c) => parse_cidr(c)?,
            None => (Ipv4Addr::UNSPECIFIED, Ipv4Addr::UNSPECIFIED),
        };
        let probe = a
            .probe
            .iter()
            .map(|s| parse_gpa(s))
            .collect::<Result<Vec<_>, _>>()?;
        if probe.len() > layout::MAX_PROBES {
            return Err(invalid(
                "--probe",
                format!("at most {} addresses", layout::MAX_PROBES),
            ));
        }
        let boot = match &a.kernel {
            Some(k) => {
                if app_size > 0 || !probe.is_empty() {
                    return Err(invalid(
                        "--kernel",
                        "--app-size and --probe need the built-in agent, not a Linux kernel",
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
        if let Some(fd) = a.ready_fd {
            // SAFETY: F_GETFD only queries the descriptor table.
            if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
                return Err(invalid(
                    "--ready-fd",
                    format!("{fd} is not an open file descriptor"),
                ));
            }
        }
        Ok(VmConfig {
            sandbox: a.sandbox.clone(),
            ram_size,
            vcpus: a.vcpus,
            boot,
            net: a.net.clone(),
            disks: a.disk.clone(),
            rootfs_pmem: a.rootfs_pmem.clone(),
            rootfs_check,
            netcfg: NetConfig {
                mac,
                server_mac,
                ip,
                netmask,
                gateway: a.gateway.unwrap_or(Ipv4Addr::UNSPECIFIED),
                server: a.server,
            },
            policy,
            dma_ram: a.dma_ram,
            dma_image: a.dma_image,
            pool_socket: a.pool_socket.clone(),
            hugepages: a.hugepages,
            vf_init: a.vf_init,
            app_size,
            probe,
            trace: a.trace.clone(),
            serial_log: a.serial_log.clone(),
            ready_fd: a.ready_fd,
            keep_running: a.keep_running,
            timeout_secs: a.timeout,
            kvm_device: a.kvm_device.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: VmmArgs,
    }

    fn cfg(extra: &[&str]) -> Result<VmConfig, Error> {
        let mut argv = vec!["x", "--sandbox", "sb1"];
        argv.extend_from_slice(extra);
        VmConfig::from_args(&Cli::try_parse_from(argv).unwrap().a)
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("f", "64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("f", "1g").unwrap(), 1 << 30);
        assert_eq!(parse_size("f", "4096").unwrap(), 4096);
        assert!(parse_size("f", "12Q").is_err());
        assert!(parse_size("f", "M").is_err());
        assert!(parse_size("f", "99999999999T").is_err());
    }

    #[test]
    fn memory_limits_name_the_flag() {
        for m in ["0", "4G", "1T", "1M", "5000"] {
            let e = cfg(&["--memory", m]).unwrap_err().to_string();
            assert!(e.contains("--memory"), "{m}: {e}");
        }
        assert_eq!(cfg(&["--memory", "3G"]).unwrap().ram_size, 3 << 30);
    }

    #[test]
    fn network_fields_parse() {
        let c = cfg(&[
            "--mac",
            "02:00:00:00:00:07",
            "--ip",
            "10.1.2.3/24",
            "--gateway",
            "10.1.2.1",
            "--server",
            "10.1.2.1:9000",
            "--server-mac",
            "02:aa:bb:cc:dd:ee",
        ])
        .unwrap();
        assert_eq!(c.netcfg.mac, [2, 0, 0, 0, 0, 7]);
        assert_eq!(c.netcfg.ip, Ipv4Addr::new(10, 1, 2, 3));
        assert_eq!(c.netcfg.netmask, Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(c.netcfg.server_mac, [2, 0xaa, 0xbb, 0xcc, 0xdd, 0xee]);
        assert!(cfg(&["--mac", "01:00:00:00:00:07"]).is_err());
        assert!(cfg(&["--mac", "zz"]).is_err());
        assert!(cfg(&["--ip", "10.0.0.1/40"]).is_err());
        let d = cfg(&[]).unwrap();
        assert_eq!(d.netcfg.mac[0], 0x02);
    }

    #[test]
    fn disks_and_rootfs_flags() {
        let c = cfg(&[
            "--disk",
            "path=/img.erofs,ro,id=rootfs",
            "--disk",
            "path=/rw,unlink",
            "--rootfs-check",
            "/etc/os-release=0x1234abcd",
        ])
        .unwrap();
        assert_eq!(c.disks.len(), 2);
        assert!(c.disks[0].read_only && !c.disks[0].unlink);
        assert_eq!(c.disks[0].id.as_deref(), Some("rootfs"));
        assert!(c.disks[1].unlink && !c.disks[1].read_only);
        assert_eq!(
            c.rootfs_check,
            Some(("/etc/os-release".into(), 0x1234_abcd))
        );
        for bad in ["etc=1", "/x=zz", "/x"] {
            let e = cfg(&["--rootfs-check", bad]).unwrap_err().to_string();
            assert!(e.contains("--rootfs-check"), "{e}");
        }
        assert!(Cli::try_parse_from(["x", "--sandbox", "s", "--disk", "ro"]).is_err());
        assert!(Cli::try_parse_from(["x", "--sandbox", "s", "--disk", "path=/a,rw"]).is_err());
        let five: Vec<&str> = ["--disk", "path=/a"].repeat(5);
        let e = cfg(&five).unwrap_err().to_string();
        assert!(e.contains("at most 4"), "{e}");
    }

    #[test]
    fn probe_and_policy() {
        let c = cfg(&["--probe", "0x1000,8192", "--memory-policy", "lazy"]).unwrap();
        assert_eq!(c.probe, vec![0x1000, 8192]);
        assert!(cfg(&["--memory-policy", "bogus"])
            .unwrap_err()
            .to_string()
            .contains("--memory-policy"));
        let long = "x".repeat(64);
        let a = Cli::try_parse_from(["x", "--sandbox", long.as_str()])
            .unwrap()
            .a;
        assert!(VmConfig::from_args(&a)
            .unwrap_err()
            .to_string()
            .contains("--sandbox"));
    }
}
