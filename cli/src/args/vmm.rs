//! `burstvm vmm` / `burstvm-vmm`: the VMM's command line, parsed into
//! [`vmm::VmParams`]; [`vmm::VmConfig::from_params`] validates it. Here,
//! not in the `burstvm` binary, because `burstvm-vmm` uses it too.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;

use guestmem::MemoryPolicy;
use netutil::MacAddr;
use vmm::args;
use vmm::devspec::{DiskSpec, NetBackend, VfInit};
use vmm::VmParams;
use vmm::{AgentMode, SgXf};

use super::choice;

fn memory(s: &str) -> Result<u64, vmm::Error> {
    args::parse_size("--memory", s)
}

fn dma_window(s: &str) -> Result<u64, vmm::Error> {
    args::parse_size("--dma-window", s)
}

fn app_size(s: &str) -> Result<u64, vmm::Error> {
    args::parse_size("--app-size", s)
}

fn mac(s: &str) -> Result<MacAddr, vmm::Error> {
    args::parse_mac("--mac", s)
}

fn server_mac(s: &str) -> Result<MacAddr, vmm::Error> {
    args::parse_mac("--server-mac", s)
}

/// Command line of `burstvm vmm` and `burstvm-vmm` (docs/design.md, "VMM command line").
#[derive(Debug, Clone, clap::Args)]
pub struct VmmArgs {
    /// Sandbox id (at most 63 bytes); names trace lines and seeds the app payload.
    #[arg(long)]
    pub sandbox: String,
    /// Guest RAM size, e.g. 64M, 1G (at most 3G).
    #[arg(long, default_value = "64M", value_parser = memory)]
    pub memory: u64,
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
    #[arg(long)]
    pub net: Vec<NetBackend>,
    /// Block device: path=FILE[,ro][,unlink][,id=ID] (virtio-blk); repeatable.
    /// The rootfs: the EROFS image read-only, the writable layer with unlink.
    /// `empty,id=ID[,ro]`: a slot without media until `--api` inserts some.
    #[arg(long)]
    pub disk: Vec<DiskSpec>,
    /// Built-in agent: put this EROFS image into the image region (a
    /// pmem-style mapping, DMA-mapped with it) instead of a virtio-blk disk.
    #[arg(long, conflicts_with = "kernel")]
    pub rootfs_pmem: Option<PathBuf>,
    /// virtio-vsock device (Firecracker's hybrid model): the VMM listens on
    /// this Unix socket; a host process connects and writes `CONNECT
    /// <port>\n`, gets `OK <hostport>\n` once the guest accepted, then a
    /// byte stream. Guest connections to host port P go to `PATH_P`.
    #[arg(long)]
    pub vsock: Option<PathBuf>,
    /// The guest's vsock CID (with --vsock).
    #[arg(long, requires = "vsock", default_value_t = vmm::virtio::vsock::DEFAULT_GUEST_CID)]
    pub vsock_cid: u64,
    /// Entropy device (virtio-rng, Firecracker's `entropy`): the guest's
    /// buffers come back full of the host's getrandom(2) bytes, which a
    /// Linux guest credits to its entropy pool (its CRNG is ready at boot).
    #[arg(long, requires = "kernel")]
    pub entropy: bool,
    /// Control socket (Firecracker's drive update): JSON lines
    /// `{"op":"insert_disk","slot":ID,"path":FILE}` and
    /// `{"op":"eject_disk","slot":ID}` for the `--disk empty,id=ID` slots.
    #[arg(long)]
    pub api: Option<PathBuf>,
    /// PATH=CHECKSUM: a file of the EROFS image the guest reads and
    /// checksums (the agent, or burstvm's Linux init, given
    /// burstvm_check=PATH); the VMM checks it as it does the app checksum.
    #[arg(long, value_parser = args::parse_rootfs_check)]
    pub rootfs_check: Option<(String, u32)>,
    /// Guest MAC address (default: a VF's own MAC from the NIC; for a tap, derived from the sandbox id).
    #[arg(long, value_parser = mac)]
    pub mac: Option<MacAddr>,
    /// Guest address, CIDR (e.g. 10.0.0.2/24).
    #[arg(long, value_parser = args::parse_cidr)]
    pub ip: Option<(Ipv4Addr, Ipv4Addr)>,
    /// Default gateway.
    #[arg(long)]
    pub gateway: Option<Ipv4Addr>,
    /// Server the agent sends its first request to, IP:PORT.
    #[arg(long)]
    pub server: Option<SocketAddrV4>,
    /// MAC of the server (default: broadcast).
    #[arg(long, requires = "server", value_parser = server_mac)]
    pub server_mac: Option<MacAddr>,
    /// Memory policy: vanilla, pre10, pre50, pre100, lazy.
    #[arg(long, default_value = "vanilla")]
    pub memory_policy: MemoryPolicy,
    /// DMA-map the ram region (times the dma-ram stage).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub dma_ram: bool,
    /// DMA-map the image region (times the dma-image stage).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub dma_image: bool,
    /// A DMA window of this size (e.g. 2M; 0: none): the only memory a VF
    /// maps besides --dma-ram/--dma-image; the built-in agent keeps its
    /// rings and packet buffers there (times the dma-window stage).
    #[arg(long, default_value = "0", value_parser = dma_window)]
    pub dma_window: u64,
    /// Take guest memory from the page-pool server at this socket.
    #[arg(long)]
    pub pool_socket: Option<PathBuf>,
    /// A cgroup-v1 cpu cgroup with cpu.idle set (the runtime's
    /// `burstvm-idle`): the lazy policy's background zeroer moves its
    /// thread there, so it runs only while nothing else wants the CPU.
    #[arg(long)]
    pub idle_cgroup: Option<PathBuf>,
    /// Back guest memory with 2 MiB hugetlb pages.
    #[arg(long)]
    pub hugepages: bool,
    /// VF driver init: sync or async.
    #[arg(long, value_parser = choice::<VfInit>(VfInit::ALL.map(VfInit::name)), default_value_t = VfInit::Sync)]
    pub vf_init: VfInit,
    /// Seconds a VF may stay without its backend (the NIC daemon restarting) before the
    /// VMM gives up reconnecting and reports the VF lost (0: never reconnect).
    #[arg(long, default_value_t = 30)]
    pub vf_reconnect: u64,
    /// What the built-in agent does on the network: one request (once), keep exchanging
    /// requests after READY (echo), reset and re-initialise its device once before READY
    /// (reset), or first make its VF fail with a bad descriptor, then reset (fault).
    #[arg(long, value_parser = choice::<AgentMode>(AgentMode::ALL.map(AgentMode::name)), default_value_t = AgentMode::Once)]
    pub agent_mode: AgentMode,
    /// The built-in agent does all its work at CPL0 instead of CPL3 (on kvm_pvm every
    /// CPL0 instruction is emulated: an A/B of the switch, docs/guest.md).
    #[arg(long, conflicts_with = "kernel")]
    pub agent_cpl0: bool,
    /// Every virtio register read exits to the VMM: no read-only register page over the
    /// devices' windows (an A/B of the pages, docs/vmm.md "The register page").
    #[arg(long)]
    pub no_register_pages: bool,
    /// `--agent-mode sg|sg-echo`: warp pipes (echo sockets) the agent opens, 1..4096.
    #[arg(long, default_value_t = 64)]
    pub sg_pipes: u32,
    /// `--agent-mode sg|sg-echo`: bytes the agent sends through each pipe, a multiple of 8
    /// in 8..4096.
    #[arg(long, default_value_t = 1024)]
    pub sg_bytes: u32,
    /// `--agent-mode sg-send|sg-recv`: the port of the chain (1..; the NIC's control API
    /// must have linked the two sandboxes, `sg_link`).
    #[arg(long, default_value_t = 0)]
    pub sg_port: u32,
    /// `--agent-mode sg-send`: what the chain does to the bytes (crypto: AES-GCM into the
    /// daemon's staging ring and out of it).
    #[arg(long, value_parser = choice::<SgXf>(SgXf::ALL.map(SgXf::name)), default_value_t = SgXf::Crypto)]
    pub sg_xf: SgXf,
    /// Size of the app payload the agent checksums (e.g. 4M).
    #[arg(long, default_value = "0", value_parser = app_size)]
    pub app_size: u64,
    /// Use this file as the app payload instead of generated bytes (a container's entrypoint).
    #[arg(long, conflicts_with = "app_size")]
    pub app_file: Option<PathBuf>,
    /// Probe mode: guest-physical addresses the agent reads and reports.
    #[arg(long, value_delimiter = ',', value_parser = args::parse_gpa)]
    pub probe: Vec<u64>,
    /// Append trace lines (JSON) to this file.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Write the guest serial console here instead of stdout.
    #[arg(long)]
    pub serial_log: Option<PathBuf>,
    /// Write "ready vcpu-ns=N\n" to this inherited file descriptor when the
    /// guest is ready (N: the CPU its vCPU threads have run until then).
    #[arg(long)]
    pub ready_fd: Option<i32>,
    /// Keep the VM running after READY (until SIGTERM or guest exit).
    #[arg(long)]
    pub keep_running: bool,
    /// Stay up after READY until the guest's EXIT and exit with the guest's status (a task).
    #[arg(long, conflicts_with = "keep_running")]
    pub until_exit: bool,
    /// Seconds until READY before giving up (0 = no limit).
    #[arg(long, default_value_t = 30)]
    pub timeout: u64,
    /// KVM device node.
    #[arg(long, default_value = "/dev/kvm")]
    pub kvm_device: PathBuf,
    /// KVM's supported CPUID from this file (written once by the runtime for all of
    /// its VMMs) instead of asking KVM: on a nested host each CPUID leaf is an exit.
    #[arg(long)]
    pub supported_cpuid: Option<PathBuf>,
    /// Boot the built-in agent to its template checkpoint, save the VM
    /// (vCPU, LAPIC, irqchip, PIT, clock state and guest memory) as a
    /// template in this new directory, and exit (docs/templates.md).
    #[arg(long, conflicts_with_all = ["kernel", "template", "pool_socket", "hugepages"])]
    pub template_save: Option<PathBuf>,
    /// Like --template-save, but only check which KVM state get/set calls
    /// work here: save and restore each at the checkpoint, report, then
    /// resume to READY.
    #[arg(long, conflicts_with_all = ["kernel", "template", "template_save"])]
    pub template_probe: bool,
    /// Start from the template in this directory instead of booting: its
    /// memory mapped copy-on-write, its state restored, this sandbox's
    /// boot info and devices attached after the restore.
    #[arg(long, conflicts_with_all = ["kernel", "rootfs_pmem", "hugepages"])]
    pub template: Option<PathBuf>,
}

impl VmmArgs {
    pub fn into_params(self) -> VmParams {
        VmParams {
            sandbox: self.sandbox,
            memory: self.memory,
            vcpus: self.vcpus,
            kernel: self.kernel,
            initrd: self.initrd,
            cmdline: self.cmdline,
            net: self.net,
            disk: self.disk,
            rootfs_pmem: self.rootfs_pmem,
            vsock: self.vsock,
            vsock_cid: self.vsock_cid,
            entropy: self.entropy,
            api: self.api.clone(),
            rootfs_check: self.rootfs_check,
            mac: self.mac,
            ip: self.ip,
            gateway: self.gateway,
            server: self.server,
            server_mac: self.server_mac,
            memory_policy: self.memory_policy,
            dma_ram: self.dma_ram,
            dma_image: self.dma_image,
            dma_window: self.dma_window,
            pool_socket: self.pool_socket,
            idle_cgroup: self.idle_cgroup,
            hugepages: self.hugepages,
            vf_init: self.vf_init,
            vf_reconnect: self.vf_reconnect,
            agent_mode: self.agent_mode,
            agent_cpl0: self.agent_cpl0,
            no_register_pages: self.no_register_pages,
            sg_pipes: self.sg_pipes,
            sg_bytes: self.sg_bytes,
            sg_port: self.sg_port,
            sg_xf: self.sg_xf,
            app_size: self.app_size,
            app_file: self.app_file,
            probe: self.probe,
            trace: self.trace,
            serial_log: self.serial_log,
            ready_fd: self.ready_fd,
            keep_running: self.keep_running,
            until_exit: self.until_exit,
            timeout: self.timeout,
            kvm_device: self.kvm_device,
            supported_cpuid: self.supported_cpuid,
            template_save: self.template_save,
            template_probe: self.template_probe,
            template: self.template,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use vmm::VmConfig;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: VmmArgs,
    }

    /// The config of `burstvm vmm --sandbox sb1 EXTRA`, or the error of the
    /// argument parser or of `VmConfig::from_params`.
    fn cfg(extra: &[&str]) -> Result<VmConfig, String> {
        let mut argv = vec!["x", "--sandbox", "sb1"];
        argv.extend_from_slice(extra);
        let a = Cli::try_parse_from(argv).map_err(|e| e.to_string())?.a;
        VmConfig::from_params(&a.into_params()).map_err(|e| e.to_string())
    }

    #[test]
    fn app_file_is_the_payload() {
        let dir = std::env::temp_dir().join(format!("burstvm-appfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("app");
        std::fs::write(&f, b"BVMAPP01\x03\0\0\0").unwrap();
        let p = f.to_str().unwrap();
        let c = cfg(&["--app-file", p, "--until-exit"]).unwrap();
        assert_eq!(c.app_size, 12);
        assert_eq!(c.app_bytes.as_deref(), Some(&b"BVMAPP01\x03\0\0\0"[..]));
        assert!(c.until_exit && !c.keep_running);
        for bad in [dir.to_str().unwrap(), "/nonexistent/app"] {
            let e = cfg(&["--app-file", bad]).unwrap_err().to_string();
            assert!(e.contains("--app-file") && e.contains(bad), "{e}");
        }
        assert!(
            Cli::try_parse_from(["x", "--sandbox", "s", "--app-file", p, "--app-size", "4K"])
                .is_err()
        );
        assert!(
            Cli::try_parse_from(["x", "--sandbox", "s", "--until-exit", "--keep-running"]).is_err()
        );
        std::fs::remove_dir_all(&dir).unwrap();
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
    fn dma_window_is_whole_pages_or_swiotlb_segments() {
        let c = cfg(&["--dma-window", "2M", "--net", "vf:/vf.sock"]).unwrap();
        assert_eq!((c.dma_window, c.dma_ram), (2 << 20, false));
        let c = cfg(&["--dma-window", "128K", "--net", "vf:/vf.sock"]).unwrap();
        assert_eq!(c.dma_window, 128 << 10);
        let linux = [
            "--dma-window",
            "768K",
            "--kernel",
            "/vmlinux",
            "--net",
            "vf:/vf.sock",
        ];
        assert_eq!(cfg(&linux).unwrap().dma_window, 768 << 10);
        const GRANULE: &str =
            "a multiple of 4 KiB (256 KiB with --kernel, 2 MiB with --hugepages) up to 16 MiB";
        for (args, want) in [
            (&["--dma-window", "6000"][..], GRANULE),
            (&["--dma-window", "128K", "--hugepages"][..], GRANULE),
            (&["--dma-window", "32M"][..], GRANULE),
            (
                &["--dma-window", "128K", "--kernel", "/vmlinux"][..],
                GRANULE,
            ),
            (
                &[
                    "--dma-window",
                    "2M",
                    "--net",
                    "sg:/sg.sock",
                    "--agent-mode",
                    "sg",
                ][..],
                "the SG agent modes",
            ),
        ] {
            let e = cfg(args).unwrap_err();
            assert!(
                e.contains("--dma-window") && e.contains(want),
                "{args:?}: {e}"
            );
            assert!(!e.contains("  "), "{e}");
        }
    }

    #[test]
    fn vsock_flags() {
        let c = cfg(&["--vsock", "/run/sb1.vsock"]).unwrap();
        let v = c.vsock.unwrap();
        assert_eq!(v.path, PathBuf::from("/run/sb1.vsock"));
        assert_eq!(v.cid, 3);
        let c = cfg(&["--vsock", "/v.sock", "--vsock-cid", "42"]).unwrap();
        assert_eq!(c.vsock.unwrap().cid, 42);
        assert!(cfg(&[]).unwrap().vsock.is_none());
        assert!(Cli::try_parse_from(["x", "--sandbox", "s", "--vsock-cid", "4"]).is_err());
        for cid in ["0", "2", "4294967295", "4294967296"] {
            let e = cfg(&["--vsock", "/v.sock", "--vsock-cid", cid]).unwrap_err();
            assert!(e.contains("--vsock-cid"), "{cid}: {e}");
        }
        let long = format!("/{}", "x".repeat(100));
        let e = cfg(&["--vsock", &long]).unwrap_err();
        assert!(e.contains("--vsock") && e.contains(&long), "{e}");
        // The device takes a slot: net + disks + vsock together at most 4.
        let mut four: Vec<&str> = ["--disk", "path=/a"].repeat(4);
        assert!(cfg(&four).is_ok());
        four.extend(["--vsock", "/v.sock"]);
        let e = cfg(&four).unwrap_err();
        assert!(e.contains("--vsock") && e.contains("at most 4"), "{e}");
    }

    #[test]
    fn sg_agent_modes_need_one_sg_function_and_bounded_sizes() {
        let c = cfg(&["--net", "sg:/sg.sock", "--agent-mode", "sg"]).unwrap();
        assert_eq!((c.sg_pipes, c.sg_bytes), (64, 1024));
        assert!(!c.netcfg.mac_from_vf, "an SG function has no MAC");
        let c = cfg(&[
            "--net",
            "sg:/a",
            "--agent-mode",
            "sg-recv",
            "--sg-port",
            "7",
        ])
        .unwrap();
        assert_eq!(
            (c.agent_mode, c.sg_port, c.sg_xf),
            (AgentMode::SgRecv, 7, SgXf::Crypto)
        );
        for bad in [
            &["--agent-mode", "sg"][..],
            &["--net", "vf:/s.sock", "--agent-mode", "sg-echo"],
            &["--net", "sg:/a", "--net", "tap:t0", "--agent-mode", "sg"],
            &["--net", "sg:/a", "--agent-mode", "sg", "--sg-pipes", "0"],
            &["--net", "sg:/a", "--agent-mode", "sg", "--sg-pipes", "4097"],
            &["--net", "sg:/a", "--agent-mode", "sg", "--sg-bytes", "12"],
            &["--net", "sg:/a", "--agent-mode", "sg", "--sg-bytes", "8192"],
            &["--net", "sg:/a", "--agent-mode", "sg-send"],
            &["--net", "sg:/a", "--agent-mode", "sg", "--sg-port", "7"],
        ] {
            assert!(cfg(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn a_vf_without_mac_uses_the_vfs_own() {
        let vf = NetBackend::VhostUser("/s.sock".into());
        let tap = NetBackend::Tap("t0".into());
        let c = cfg(&["--net", "vf:/s.sock"]).unwrap();
        assert!(c.netcfg.mac_from_vf);
        assert_eq!(c.device_mac(&vf), None);
        assert_eq!(c.boot_mac(), [0; 6], "the agent asks the device");
        let c = cfg(&["--net", "vf:/s.sock", "--mac", "02:00:00:00:00:07"]).unwrap();
        assert_eq!(c.device_mac(&vf), Some([2, 0, 0, 0, 0, 7]));
        assert_eq!(c.boot_mac(), [2, 0, 0, 0, 0, 7]);
        let c = cfg(&["--net", "tap:t0"]).unwrap();
        assert!(!c.netcfg.mac_from_vf);
        assert_eq!(c.device_mac(&tap), Some(c.netcfg.mac.bytes()));
        assert_eq!(c.boot_mac(), c.netcfg.mac.bytes());
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
        assert!(VmConfig::from_params(&a.into_params())
            .unwrap_err()
            .to_string()
            .contains("--sandbox"));
    }

    /// The launch contract: `VmParams::to_args` parses back into the same
    /// value, for every field set away from its default (four cases, as
    /// the flags' conflicts allow), and `VmParams::new` is what a bare
    /// command line gives.
    #[test]
    fn launch_contract_round_trips_every_field() {
        let parse = |p: &VmParams| {
            let mut argv: Vec<std::ffi::OsString> = vec!["x".into()];
            argv.extend(p.to_args());
            Cli::try_parse_from(argv)
                .unwrap_or_else(|e| panic!("{:?}: {e}", p.to_args()))
                .a
                .into_params()
        };
        assert_eq!(parse(&VmParams::new("sb")), VmParams::new("sb"));
        let linux = VmParams {
            memory: 96 << 20,
            vcpus: 2,
            kernel: Some("/k/vmlinux".into()),
            initrd: Some("/k/initrd".into()),
            cmdline: Some("quiet rdinit=/init -- sh -c 'echo a b'".into()),
            net: vec![
                "vf:/run/n/pf0-vf1.sock".parse().unwrap(),
                "tap:t0".parse().unwrap(),
            ],
            disk: vec![
                "path=/i.erofs,ro,id=rootfs".parse().unwrap(),
                "path=/l.ext4,unlink,id=rw".parse().unwrap(),
                DiskSpec::empty_slot("ctr-slot-0", true),
            ],
            vsock: Some("/run/sb.vsock".into()),
            vsock_cid: 7,
            entropy: true,
            api: Some("/run/sb.api".into()),
            rootfs_check: Some(("/etc/os-release".into(), 0xdead_beef)),
            mac: Some("02:00:00:00:00:05".parse().unwrap()),
            ip: Some((
                "10.1.0.5".parse().unwrap(),
                "255.255.255.0".parse().unwrap(),
            )),
            gateway: Some("10.1.0.1".parse().unwrap()),
            server: Some("10.1.0.1:7777".parse().unwrap()),
            server_mac: Some("02:00:00:00:00:01".parse().unwrap()),
            memory_policy: MemoryPolicy::Pre(50),
            dma_ram: true,
            dma_image: true,
            dma_window: 2 << 20,
            pool_socket: Some("/run/pool.sock".into()),
            idle_cgroup: Some("/sys/fs/cgroup/cpu/burstvm-idle".into()),
            vf_init: VfInit::Async,
            vf_reconnect: 5,
            agent_mode: AgentMode::SgSend,
            sg_pipes: 8,
            sg_bytes: 64,
            sg_port: 3,
            sg_xf: SgXf::Copy,
            app_file: Some("/app".into()),
            probe: vec![0x1000, 0x2000],
            trace: Some("/t.jsonl".into()),
            serial_log: Some("/c.log".into()),
            ready_fd: Some(9),
            until_exit: true,
            timeout: 300,
            kvm_device: "/dev/kvm2".into(),
            supported_cpuid: Some("/run/cpuid.json".into()),
            ..VmParams::new("sb-linux")
        };
        let builtin = VmParams {
            rootfs_pmem: Some("/i.erofs".into()),
            hugepages: true,
            app_size: 4 << 20,
            keep_running: true,
            template_probe: true,
            agent_cpl0: true,
            memory_policy: MemoryPolicy::Lazy,
            ..VmParams::new("sb-builtin")
        };
        let save = VmParams {
            template_save: Some("/tpl/a".into()),
            ..VmParams::new("sb-save")
        };
        let restore = VmParams {
            template: Some("/tpl/a".into()),
            ..VmParams::new("sb-restore")
        };
        for p in [&linux, &builtin, &save, &restore] {
            assert_eq!(&parse(p), p);
        }
    }
}
