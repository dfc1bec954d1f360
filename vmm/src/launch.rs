//! The launch contract: a process that starts a VMM (the runtime) builds a
//! [`VmParams`] and renders it with [`VmParams::to_args`], the one place
//! that spells the VMM's flags for it; the VMM parses them back into the
//! same value (`burstvm vmm`'s clap arguments, cli/src/args/vmm.rs, where a
//! round-trip test checks every field). [`VmParams::new`] holds the
//! command line's defaults; a field at its default is not rendered.

use std::ffi::OsString;
use std::net::Ipv4Addr;
use std::path::PathBuf;

use crate::args::{AgentMode, SgXf, VmParams};
use crate::devspec::VfInit;

impl VmParams {
    /// Sandbox `sandbox` with every other parameter at the command line's default.
    pub fn new(sandbox: impl Into<String>) -> VmParams {
        VmParams {
            sandbox: sandbox.into(),
            memory: 64 << 20,
            vcpus: 1,
            kernel: None,
            initrd: None,
            cmdline: None,
            net: Vec::new(),
            disk: Vec::new(),
            rootfs_pmem: None,
            vsock: None,
            vsock_cid: crate::virtio::vsock::DEFAULT_GUEST_CID,
            entropy: false,
            api: None,
            rootfs_check: None,
            mac: None,
            ip: None,
            gateway: None,
            server: None,
            server_mac: None,
            memory_policy: guestmem::MemoryPolicy::Vanilla,
            dma_ram: false,
            dma_image: false,
            dma_window: 0,
            pool_socket: None,
            idle_cgroup: None,
            hugepages: false,
            vf_init: VfInit::Sync,
            vf_reconnect: 30,
            agent_mode: AgentMode::Once,
            agent_cpl0: false,
            no_register_pages: false,
            sg_pipes: 64,
            sg_bytes: 1024,
            sg_port: 0,
            sg_xf: SgXf::Crypto,
            app_size: 0,
            app_file: None,
            probe: Vec::new(),
            trace: None,
            serial_log: None,
            ready_fd: None,
            keep_running: false,
            until_exit: false,
            timeout: 30,
            kvm_device: PathBuf::from("/dev/kvm"),
            supported_cpuid: None,
            template_save: None,
            template_probe: false,
            template: None,
        }
    }

    /// The VMM's command line for these parameters (without the program).
    pub fn to_args(&self) -> Vec<OsString> {
        let d = VmParams::new(self.sandbox.clone());
        let mut a = Args(Vec::new());
        a.val("--sandbox", &self.sandbox);
        if self.memory != d.memory {
            a.val("--memory", self.memory);
        }
        if self.vcpus != d.vcpus {
            a.val("--vcpus", self.vcpus);
        }
        a.path("--kernel", &self.kernel);
        a.path("--initrd", &self.initrd);
        if let Some(c) = &self.cmdline {
            a.val("--cmdline", c);
        }
        for n in &self.net {
            a.val("--net", n);
        }
        // The image before the disks, as the rootfs gives them (image, layer).
        a.path("--rootfs-pmem", &self.rootfs_pmem);
        for disk in &self.disk {
            a.val("--disk", disk);
        }
        a.path("--vsock", &self.vsock);
        if self.vsock_cid != d.vsock_cid {
            a.val("--vsock-cid", self.vsock_cid);
        }
        a.flag("--entropy", self.entropy);
        a.path("--api", &self.api);
        if let Some((path, sum)) = &self.rootfs_check {
            a.val("--rootfs-check", format!("{path}={sum:08x}"));
        }
        if let Some(m) = &self.mac {
            a.val("--mac", m);
        }
        if let Some((ip, mask)) = &self.ip {
            a.val("--ip", format!("{ip}/{}", prefix_len(*mask)));
        }
        if let Some(g) = &self.gateway {
            a.val("--gateway", g);
        }
        if let Some(s) = &self.server {
            a.val("--server", s);
        }
        if let Some(m) = &self.server_mac {
            a.val("--server-mac", m);
        }
        if self.memory_policy != d.memory_policy {
            a.val("--memory-policy", self.memory_policy);
        }
        if self.dma_ram {
            a.val("--dma-ram", true);
        }
        if self.dma_image {
            a.val("--dma-image", true);
        }
        if self.dma_window != d.dma_window {
            a.val("--dma-window", self.dma_window);
        }
        a.path("--pool-socket", &self.pool_socket);
        a.flag("--hugepages", self.hugepages);
        if self.vf_init != d.vf_init {
            a.val("--vf-init", self.vf_init);
        }
        if self.vf_reconnect != d.vf_reconnect {
            a.val("--vf-reconnect", self.vf_reconnect);
        }
        if self.agent_mode != d.agent_mode {
            a.val("--agent-mode", self.agent_mode.name());
        }
        a.flag("--agent-cpl0", self.agent_cpl0);
        a.flag("--no-register-pages", self.no_register_pages);
        if self.sg_pipes != d.sg_pipes {
            a.val("--sg-pipes", self.sg_pipes);
        }
        if self.sg_bytes != d.sg_bytes {
            a.val("--sg-bytes", self.sg_bytes);
        }
        if self.sg_port != d.sg_port {
            a.val("--sg-port", self.sg_port);
        }
        if self.sg_xf != d.sg_xf {
            a.val("--sg-xf", self.sg_xf);
        }
        if self.app_size != d.app_size {
            a.val("--app-size", self.app_size);
        }
        a.path("--app-file", &self.app_file);
        if !self.probe.is_empty() {
            let list: Vec<String> = self.probe.iter().map(|g| format!("{g:#x}")).collect();
            a.val("--probe", list.join(","));
        }
        a.path("--trace", &self.trace);
        a.path("--serial-log", &self.serial_log);
        if let Some(fd) = self.ready_fd {
            a.val("--ready-fd", fd);
        }
        a.flag("--keep-running", self.keep_running);
        a.flag("--until-exit", self.until_exit);
        if self.timeout != d.timeout {
            a.val("--timeout", self.timeout);
        }
        if self.kvm_device != d.kvm_device {
            a.path("--kvm-device", &Some(self.kvm_device.clone()));
        }
        a.path("--supported-cpuid", &self.supported_cpuid);
        a.path("--idle-cgroup", &self.idle_cgroup);
        a.path("--template-save", &self.template_save);
        a.flag("--template-probe", self.template_probe);
        a.path("--template", &self.template);
        a.0
    }
}

/// The prefix length of a contiguous netmask (`parse_cidr` makes only those).
fn prefix_len(mask: Ipv4Addr) -> u32 {
    u32::from(mask).leading_ones()
}

struct Args(Vec<OsString>);

impl Args {
    fn val(&mut self, flag: &str, v: impl std::fmt::Display) {
        self.0.push(flag.into());
        self.0.push(v.to_string().into());
    }

    fn path(&mut self, flag: &str, p: &Option<PathBuf>) {
        if let Some(p) = p {
            self.0.push(flag.into());
            self.0.push(p.clone().into_os_string());
        }
    }

    fn flag(&mut self, flag: &str, on: bool) {
        if on {
            self.0.push(flag.into());
        }
    }
}

/// What the VMM writes to `--ready-fd` at READY, one line: `ready
/// vcpu-ns=N`, N the CPU its vCPU threads have run until then (the guest,
/// KVM serving its exits, the VMM's exit handlers). The VMM reads it from
/// the threads' CPU clocks itself: a VMM that exits after READY takes them
/// with it before its parent could look in /proc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ready {
    pub vcpu_ns: u64,
}

/// The line the VMM writes to `--ready-fd` after the READY line, once the
/// zeroing it deferred past READY is over: its background zeroer has ended
/// (its pass done, or cut short by the VM's end), or at once if it has none.
/// Its parent waits for it on the pipe instead of looking for the zeroer
/// thread in /proc.
pub const ZEROED_LINE: &str = "zeroed\n";

impl Ready {
    pub fn line(&self) -> String {
        format!("ready vcpu-ns={}\n", self.vcpu_ns)
    }

    /// The message, once `got` holds its whole line; None before.
    pub fn parse(got: &[u8]) -> Option<Result<Ready, String>> {
        let end = got.iter().position(|&b| b == b'\n')?;
        let line = String::from_utf8_lossy(&got[..end]);
        Some(
            line.strip_prefix("ready vcpu-ns=")
                .and_then(|n| n.parse().ok())
                .map(|vcpu_ns| Ready { vcpu_ns })
                .ok_or_else(|| format!("unexpected READY line {line:?}")),
        )
    }
}

#[cfg(test)]
mod ready_tests {
    use super::Ready;

    #[test]
    fn the_ready_line_round_trips_and_waits_for_its_end() {
        let r = Ready { vcpu_ns: 1_234_567 };
        assert_eq!(r.line(), "ready vcpu-ns=1234567\n");
        assert_eq!(Ready::parse(r.line().as_bytes()), Some(Ok(r)));
        assert_eq!(
            Ready::parse(b"ready vcpu-ns=12"),
            None,
            "no end of line yet"
        );
        assert!(matches!(Ready::parse(b"ready\n"), Some(Err(e)) if e.contains("ready")));
        assert!(Ready::parse(b"ready vcpu-ns=x\n").unwrap().is_err());
    }
}
