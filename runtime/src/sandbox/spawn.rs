//! Spawning the VMM process of a sandbox (`vmm-spawn`, recorded by the VMM
//! from the instant passed in BURSTVM_SPAWN_NS). Between fork and exec the
//! child only makes async-signal-safe calls: its own process group, death
//! with the sandbox's keeper thread (PR_SET_PDEATHSIG, `crate::child`), the
//! sandbox netns, every cgroup hierarchy, and the ready pipe's write end kept
//! across exec (the parent drops its copy, so EOF on the read end means the
//! VMM is gone).

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;

use procutil::spawn::Stdio;

use super::error::file_err;
use super::{Sandbox, StageError, VmmSpawnError};
use crate::cgroup;

impl Sandbox<'_> {
    pub(super) fn spawn_vmm(
        &mut self,
        mut vm: vmm::VmParams,
        ready_w: OwnedFd,
    ) -> Result<(), StageError> {
        let policy = self.spec.variant.policy();
        let ns = self.netns_path();
        let ns_file = File::open(ns).map_err(file_err(ns))?;
        let procs = self
            .cgroup
            .as_ref()
            .expect("cgroup stage ran")
            .open_procs()?;
        let stderr = File::create(&self.files.stderr).map_err(file_err(&self.files.stderr))?;
        vm.memory = self.spec.memory_bytes;
        vm.memory_policy = policy.memory_policy.parse::<guestmem::MemoryPolicy>()?;
        vm.dma_ram = policy.dma_ram;
        vm.dma_image = policy.dma_image;
        vm.hugepages = self.spec.hugepages;
        vm.agent_cpl0 = self.spec.agent_cpl0;
        if policy.dma_window {
            vm.dma_window =
                crate::variant::dma_window_bytes(self.spec.hugepages, self.spec.kernel.is_some());
        }
        vm.timeout = self.spec.timeout_secs;
        vm.trace = Some(self.rt.trace_path().to_path_buf());
        vm.ready_fd = Some(ready_w.as_raw_fd());
        if let Some(vi) = policy.vf_init {
            vm.vf_init = vi.parse().map_err(StageError::from)?;
        }
        if let Some(k) = &self.spec.kernel {
            vm.kernel = Some(k.clone());
            match &self.spec.agent_initrd {
                Some(initrd) => {
                    let net = crate::container::AgentNet::from_params(&vm);
                    let pod = self.spec.pod_slots.is_some();
                    vm.cmdline = Some(crate::container::agent_cmdline(
                        net.as_ref(),
                        &self.spec.id,
                        pod,
                    ));
                    vm.initrd = Some(initrd.clone());
                    vm.vsock = Some(self.files.vsock.clone());
                    if let Some(n) = self.spec.pod_slots {
                        // After the rootfs disks: vda and vdb stay theirs.
                        for i in 0..n {
                            vm.disk
                                .push(vmm::DiskSpec::empty_slot(super::spec::pod_slot(i), true));
                        }
                        vm.api = Some(self.files.api.clone());
                    }
                }
                None => vm.cmdline = Some(crate::sandbox::rootfs::linux_cmdline()),
            }
            vm.serial_log = Some(self.files.console.clone());
            vm.entropy = true;
        }
        vm.template = self.spec.template.clone();
        vm.pool_socket = self.rt.pool_socket().map(Into::into);
        vm.supported_cpuid = self.rt.supported_cpuid().map(Into::into);
        vm.idle_cgroup = self.rt.idle_cgroup().map(Into::into);
        match &self.attach.app_file {
            Some(app) => vm.app_file = Some(app.clone()),
            None => vm.app_size = self.spec.app_size,
        };
        if self.attach.until_exit {
            vm.until_exit = true;
        } else if self.spec.keep_running {
            vm.keep_running = true;
        }
        let stdout = match (self.attach.stdout.take(), &self.files.stdout) {
            (Some(fd), _) => Stdio::from(fd),
            (None, Some(p)) => {
                vm.probe = self.spec.probe.clone();
                Stdio::from(File::create(p).map_err(file_err(p))?)
            }
            (None, None) => Stdio::Null,
        };
        if self.sg {
            let sg = self.spec.sg.unwrap_or_default();
            vm.agent_mode = if self.spec.echo {
                vmm::AgentMode::SgEcho
            } else {
                vmm::AgentMode::Sg
            };
            vm.sg_pipes = sg.pipes;
            vm.sg_bytes = sg.bytes;
        } else if self.spec.echo {
            vm.agent_mode = vmm::AgentMode::Echo;
        }
        let mut cmd = crate::vmmproc::command(self.rt.bin());
        cmd.args(vm.to_args());
        cmd.env("RUST_BACKTRACE", "0")
            .env("NO_COLOR", "1")
            .env("RUST_LIB_BACKTRACE", "0")
            .env("BURSTVM_SPAWN_NS", trace::monotonic_ns().to_string())
            .stdin(Stdio::Null)
            .stdout(stdout)
            .stderr(stderr);
        let ns_fd = ns_file.as_raw_fd();
        let w_fd = ready_w.as_raw_fd();
        let cg_fds = procs.raw_fds();
        // SAFETY: the closure only makes async-signal-safe system calls.
        unsafe {
            cmd.pre_exec(move || child_setup(ns_fd, w_fd, &cg_fds));
        }
        // Forked on a keeper thread the sandbox owns, not on the caller's: the
        // VMM lives as long as the sandbox even if this thread ends first.
        let program = PathBuf::from(cmd.get_program());
        let (child, keeper) = crate::child::spawn_kept(cmd, &self.spec.id)
            .map_err(|source| VmmSpawnError::Spawn { program, source })?;
        self.vmm = Some(child);
        self.keeper = Some(keeper);
        drop(ready_w); // the VMM holds the only write end now
        Ok(())
    }
}

/// Runs in the child between fork and exec: only async-signal-safe calls.
fn child_setup(ns_fd: RawFd, ready_fd: RawFd, cg_fds: &[RawFd]) -> std::io::Result<()> {
    // A VMM never outlives its sandbox's keeper thread (nor the runtime).
    crate::child::own_group_dying_with_parent()?;
    crate::child::enter_netns(ns_fd)?;
    // SAFETY: plain system calls on a descriptor the parent keeps open.
    unsafe {
        let flags = libc::fcntl(ready_fd, libc::F_GETFD);
        if flags < 0 || libc::fcntl(ready_fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    cgroup::join_self(cg_fds)
}

pub(super) fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two fds that we take ownership of.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}
