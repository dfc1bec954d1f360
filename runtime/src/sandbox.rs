//! One sandbox through its startup stages, and its teardown on every exit
//! path: `cgroup`, `netns`, `cni-add`, `rootfs` are recorded here; the VMM
//! records `vmm-spawn` (from the spawn instant this side passes in
//! BURSTVM_SPAWN_NS) and `dma-ram` .. `ready` in the same trace file.

use std::fs::File;
use std::io::Read;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use trace::{Stage, TraceWriter};

use crate::cgroup::{self, Cgroup, Limits};
use crate::rootfs::RootfsSpec;
use crate::runtime::Runtime;
use crate::variant::{NetKind, Variant};
use netutil::NamedNetns;

/// The interface name the CNI plugin creates in the sandbox netns.
pub const IFNAME: &str = "eth0";

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
}

/// What the `rootfs` stage cost this sandbox (bench statistics).
#[derive(Debug, Clone, Copy, Default)]
pub struct RootfsCost {
    pub wall_ns: u64,
    pub cpu_ns: u64,
    pub bytes_copied: u64,
}

/// A sandbox that failed: in which stage, and why.
#[derive(Debug, Clone, thiserror::Error, serde::Serialize)]
#[error("sandbox {sandbox}: stage {stage}: {error}")]
pub struct SandboxFailure {
    pub sandbox: String,
    pub stage: String,
    pub error: String,
}

/// A live sandbox. Dropping it tears it down.
pub struct Sandbox<'rt> {
    rt: &'rt Runtime,
    spec: SandboxSpec,
    trace: TraceWriter,
    cgroup: Option<Cgroup>,
    netns: Option<NamedNetns>,
    cni_added: bool,
    tap_added: bool,
    neighbor: Option<Ipv4Addr>,
    tap_ip: Option<Ipv4Addr>,
    vmm: Option<Child>,
    layer: Option<::rootfs::Layer>,
    /// The writable layer's cost, when the sandbox has a rootfs.
    pub rootfs_cost: Option<RootfsCost>,
    stderr_path: PathBuf,
    /// Address the guest was given (network variants).
    pub guest_ip: Option<Ipv4Addr>,
    torn_down: bool,
}

impl<'rt> Sandbox<'rt> {
    /// Creates the sandbox and waits until its guest reports READY.
    pub fn start(rt: &'rt Runtime, spec: SandboxSpec) -> Result<Sandbox<'rt>, SandboxFailure> {
        let id = spec.id.clone();
        let fail = move |stage: &str, error: String| SandboxFailure {
            sandbox: id.clone(),
            stage: stage.to_string(),
            error,
        };
        let trace = TraceWriter::new(spec.id.clone(), Some(rt.trace_path()))
            .map_err(|e| fail("cgroup", e.to_string()))?;
        let mut sb = Sandbox {
            rt,
            stderr_path: rt.state_dir().join(format!("{}.stderr", spec.id)),
            spec,
            trace,
            cgroup: None,
            netns: None,
            cni_added: false,
            tap_added: false,
            neighbor: None,
            tap_ip: None,
            vmm: None,
            layer: None,
            rootfs_cost: None,
            guest_ip: None,
            torn_down: false,
        };
        // On any error below, `sb` is dropped and torn down.
        sb.stage(Stage::Cgroup, |sb| {
            let limits = Limits {
                // The image region (agent + app payload + a pmem rootfs
                // image, 2 MiB aligned) is guest memory too.
                memory_bytes: sb.spec.memory_bytes
                    + (sb.spec.app_size
                        + sb.spec.rootfs.as_ref().map_or(0, |r| r.guest_bytes())
                        + (4 << 20))
                        .next_multiple_of(2 << 20),
                cpus: sb.spec.cpus,
            };
            sb.cgroup = Some(
                sb.rt
                    .cgroup_for(&sb.spec.id, limits)
                    .map_err(|e| e.to_string())?,
            );
            Ok(())
        })?;
        sb.stage(Stage::Netns, |sb| {
            sb.netns = Some(NamedNetns::create(&sb.spec.id).map_err(|e| e.to_string())?);
            Ok(())
        })?;
        let policy = sb.spec.variant.policy();
        let mut net_args: Vec<String> = Vec::new();
        match policy.net {
            NetKind::None => {}
            NetKind::Vf => sb.stage(Stage::CniAdd, |sb| {
                net_args = sb.cni_add_vf()?;
                Ok(())
            })?,
            NetKind::Tap => sb.stage(Stage::CniAdd, |sb| {
                net_args = sb.tap_add()?;
                Ok(())
            })?,
        }
        if let Some(r) = sb.spec.rootfs.clone() {
            sb.stage(Stage::Rootfs, |sb| {
                let layers = sb
                    .rt
                    .writable_layers()
                    .ok_or("this runtime was created without writable layers")?;
                let p = crate::rootfs::prepare(layers, &sb.spec.id, r.layer_mode)?;
                net_args.extend(crate::rootfs::vmm_args(&r, p.layer.path()));
                sb.rootfs_cost = Some(RootfsCost {
                    wall_ns: p.wall_ns,
                    cpu_ns: p.cpu_ns,
                    bytes_copied: p.layer.bytes_copied(),
                });
                sb.layer = Some(p.layer);
                Ok(())
            })?;
        }
        let (ready_r, ready_w) =
            pipe().map_err(|e| fail("vmm-spawn", format!("ready pipe: {e}")))?;
        // `vmm-spawn` is recorded by the VMM itself, from the instant passed in
        // BURSTVM_SPAWN_NS to its memory being set up.
        sb.spawn_vmm(&net_args, ready_w)
            .map_err(|e| sb.failure("vmm-spawn", e))?;
        sb.wait_ready(ready_r)?;
        Ok(sb)
    }

    pub fn id(&self) -> &str {
        &self.spec.id
    }

    pub fn vmm_pid(&self) -> Option<u32> {
        self.vmm.as_ref().map(|c| c.id())
    }

    fn stage(
        &mut self,
        stage: Stage,
        f: impl FnOnce(&mut Self) -> Result<(), String>,
    ) -> Result<(), SandboxFailure> {
        let start = trace::monotonic_ns();
        let r = f(self);
        let end = trace::monotonic_ns();
        match r {
            Ok(()) => {
                self.trace
                    .record(stage, start, end)
                    .map_err(|e| self.failure(stage.name(), e.to_string()))?;
                Ok(())
            }
            Err(e) => Err(self.failure(stage.name(), e)),
        }
    }

    fn failure(&self, stage: &str, error: String) -> SandboxFailure {
        SandboxFailure {
            sandbox: self.spec.id.clone(),
            stage: stage.to_string(),
            error,
        }
    }

    /// CNI ADD through burstvm-cni; the placeholder link gives VF, MAC and IP.
    fn cni_add_vf(&mut self) -> Result<Vec<String>, String> {
        let ns = self
            .netns
            .as_ref()
            .expect("netns stage ran")
            .path()
            .to_path_buf();
        let cni = self.rt.cni().ok_or("no CNI network configured")?;
        // Marked before the call: a half-done ADD is undone by DEL too.
        self.cni_added = true;
        let att = cni
            .add(&self.spec.id, &ns, IFNAME)
            .map_err(|e| e.to_string())?;
        let link = crate::guestnet::read_link(&ns, IFNAME, &att).map_err(|e| e.to_string())?;
        let socket = match att.vf_socket.clone() {
            Some(s) => s,
            None => self.rt.vf_socket(&link.vf_id)?,
        };
        self.guest_ip = Some(link.ip);
        self.rt
            .server()
            .add_neighbor(link.ip, link.mac)
            .map_err(|e| e.to_string())?;
        self.neighbor = Some(link.ip);
        Ok(self.net_args(format!("vf:{}", socket.display()), &link))
    }

    /// Software CNI baseline: a tap bridged to a veth into the server netns.
    fn tap_add(&mut self) -> Result<Vec<String>, String> {
        let ip = self
            .rt
            .alloc_tap_ip()
            .ok_or("tap address range exhausted")?;
        self.tap_ip = Some(ip);
        self.tap_added = true;
        let ns = self.netns.as_ref().expect("netns stage ran").netns();
        let link = self.rt.tap_attach(&self.spec.id, ns, ip)?;
        self.guest_ip = Some(ip);
        self.rt
            .server()
            .add_neighbor(ip, link.mac)
            .map_err(|e| e.to_string())?;
        self.neighbor = Some(ip);
        Ok(self.net_args(format!("tap:{}", crate::runtime::TAP_IF), &link))
    }

    fn net_args(&self, backend: String, link: &crate::guestnet::GuestLink) -> Vec<String> {
        let a = self.rt.server().addressing();
        vec![
            "--net".into(),
            backend,
            "--mac".into(),
            link.mac.to_string(),
            "--ip".into(),
            format!("{}/{}", link.ip, link.prefix_len),
            "--gateway".into(),
            link.gateway.unwrap_or(a.server_ip).to_string(),
            "--server".into(),
            format!("{}:{}", a.server_ip, crate::uplink::ECHO_PORT),
            "--server-mac".into(),
            a.server_mac.to_string(),
        ]
    }

    /// The serial console of a Linux guest (kept with the VMM's stderr).
    pub fn console_path(&self) -> PathBuf {
        self.rt
            .state_dir()
            .join(format!("{}.console", self.spec.id))
    }

    fn spawn_vmm(&mut self, net_args: &[String], ready_w: OwnedFd) -> Result<(), String> {
        let policy = self.spec.variant.policy();
        let ns = self.netns.as_ref().expect("netns stage ran");
        let ns_file = File::open(ns.path()).map_err(|e| format!("{}: {e}", ns.path().display()))?;
        let procs = self
            .cgroup
            .as_ref()
            .expect("cgroup stage ran")
            .open_procs()
            .map_err(|e| e.to_string())?;
        let stderr = File::create(&self.stderr_path)
            .map_err(|e| format!("{}: {e}", self.stderr_path.display()))?;
        let mut cmd = Command::new(self.rt.bin());
        cmd.arg("vmm")
            .args(["--sandbox", &self.spec.id])
            .args(["--memory", &format!("{}K", self.spec.memory_bytes >> 10)])
            .args(["--memory-policy", policy.memory_policy])
            .args(["--dma-ram", &policy.dma_ram.to_string()])
            .args(["--dma-image", &policy.dma_image.to_string()])
            .args(["--app-size", &self.spec.app_size.to_string()])
            .args(["--timeout", &self.spec.timeout_secs.to_string()])
            .arg("--trace")
            .arg(self.rt.trace_path())
            .args(["--ready-fd", &ready_w.as_raw_fd().to_string()])
            .args(net_args);
        if let Some(vi) = policy.vf_init {
            cmd.args(["--vf-init", vi]);
        }
        if let Some(k) = &self.spec.kernel {
            cmd.arg("--kernel").arg(k);
            cmd.args(["--cmdline", &crate::rootfs::linux_cmdline()]);
            cmd.arg("--serial-log").arg(self.console_path());
        }
        if let Some(sock) = self.rt.pool_socket() {
            cmd.arg("--pool-socket").arg(sock);
        }
        if self.spec.keep_running {
            cmd.arg("--keep-running");
        }
        cmd.env("RUST_BACKTRACE", "0")
            .env("NO_COLOR", "1")
            .env("RUST_LIB_BACKTRACE", "0")
            .env("BURSTVM_SPAWN_NS", trace::monotonic_ns().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        let ns_fd = ns_file.as_raw_fd();
        let w_fd = ready_w.as_raw_fd();
        let cg_fds = procs.raw_fds();
        // SAFETY: the closure only makes async-signal-safe system calls.
        unsafe {
            cmd.pre_exec(move || child_setup(ns_fd, w_fd, &cg_fds));
        }
        let child = cmd
            .spawn()
            .map_err(|e| format!("spawn {} vmm: {e}", self.rt.bin().display()))?;
        self.vmm = Some(child);
        drop(ready_w); // the VMM holds the only write end now
        Ok(())
    }

    /// Waits for "ready" on the pipe; EOF means the VMM ended without it.
    fn wait_ready(&mut self, ready_r: OwnedFd) -> Result<(), SandboxFailure> {
        let deadline = Instant::now() + Duration::from_secs(self.spec.timeout_secs + 10);
        let mut f = File::from(ready_r);
        let mut got = Vec::new();
        loop {
            if self.rt.interrupted() {
                return Err(self.failure(&self.next_stage(), "interrupted (SIGINT)".into()));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(
                    self.failure(&self.next_stage(), "no READY from the VMM in time".into())
                );
            }
            match poll_in(f.as_fd(), left.min(Duration::from_millis(200))) {
                Ok(false) => continue,
                Ok(true) => {}
                Err(e) => return Err(self.failure("vmm-spawn", format!("ready pipe: {e}"))),
            }
            let mut buf = [0u8; 64];
            match f.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    got.extend_from_slice(&buf[..n]);
                    if got.starts_with(b"ready\n") {
                        return Ok(());
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.failure("vmm-spawn", format!("ready pipe: {e}"))),
            }
        }
        // The VMM closed the pipe without READY: it failed. Name its error.
        let status = self.vmm.as_mut().and_then(|c| c.wait().ok());
        let err = std::fs::read_to_string(&self.stderr_path).unwrap_or_default();
        let line = stderr_summary(&err);
        let status = status
            .map(|s| s.to_string())
            .unwrap_or_else(|| "unknown status".into());
        // A Linux guest says on its console how far it got.
        let line = match &self.spec.kernel {
            Some(_) => {
                let console = std::fs::read_to_string(self.console_path()).unwrap_or_default();
                let tail: Vec<&str> = console
                    .lines()
                    .filter(|l| !l.trim().is_empty())
                    .rev()
                    .take(3)
                    .collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                format!("{line} | console: {}", tail.join(" | "))
            }
            None => line,
        };
        Err(self.failure(
            &self.next_stage(),
            format!("VMM exited ({status}) without READY: {line}"),
        ))
    }

    /// The first VMM stage this sandbox has not completed (from the trace).
    fn next_stage(&self) -> String {
        let done: Vec<Stage> = trace::read_trace(self.rt.trace_path())
            .map(|evs| {
                evs.into_iter()
                    .filter(|e| e.sandbox == self.spec.id)
                    .map(|e| e.stage)
                    .collect()
            })
            .unwrap_or_default();
        let expected =
            crate::runtime::expected_stages(self.spec.variant, self.spec.rootfs.is_some());
        expected
            .into_iter()
            .find(|s| !done.contains(s))
            .map(|s| s.name().to_string())
            .unwrap_or_else(|| "ready".into())
    }

    /// After READY with --keep-running: the VMM must still be running.
    pub fn check_alive(&mut self) -> Result<(), SandboxFailure> {
        let Some(c) = self.vmm.as_mut() else {
            return Ok(());
        };
        match c.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(st)) => {
                self.vmm = None;
                let err = std::fs::read_to_string(&self.stderr_path).unwrap_or_default();
                Err(self.failure(
                    "ready",
                    format!("VMM exited with {st} after READY: {}", stderr_summary(&err)),
                ))
            }
            Err(e) => Err(self.failure("ready", format!("VMM status: {e}"))),
        }
    }

    /// Waits for the VMM to exit (after READY without --keep-running).
    pub fn wait_exit(&mut self) -> Result<(), SandboxFailure> {
        if let Some(c) = self.vmm.as_mut() {
            let st = c
                .wait()
                .map_err(|e| self.failure("ready", format!("wait for VMM: {e}")))?;
            self.vmm = None;
            if !st.success() {
                let err = std::fs::read_to_string(&self.stderr_path).unwrap_or_default();
                return Err(self.failure(
                    "ready",
                    format!("VMM exited with {st} after READY: {}", stderr_summary(&err)),
                ));
            }
        }
        Ok(())
    }

    /// Tears everything down in reverse order; collects every error.
    pub fn teardown(&mut self) -> Result<(), String> {
        if self.torn_down {
            return Ok(());
        }
        self.torn_down = true;
        let mut errs = Vec::new();
        if let Some(c) = self.vmm.take() {
            stop_child(c, Duration::from_secs(2));
        }
        // The VMM unlinked its layer once open; if it never got there, the
        // layer removes its file now.
        self.layer = None;
        if let Some(ip) = self.neighbor.take() {
            if let Err(e) = self.rt.server().del_neighbor(ip) {
                errs.push(e.to_string());
            }
        }
        if self.cni_added {
            self.cni_added = false;
            if let (Some(cni), Some(ns)) = (self.rt.cni(), self.netns.as_ref()) {
                if let Err(e) = cni.del(&self.spec.id, ns.path(), IFNAME) {
                    errs.push(e.to_string());
                }
            }
        }
        if self.tap_added {
            self.tap_added = false;
            if let Err(e) = self.rt.tap_detach(&self.spec.id) {
                errs.push(e);
            }
        }
        if let Some(ip) = self.tap_ip.take() {
            self.rt.free_tap_ip(ip);
        }
        if let Some(mut ns) = self.netns.take() {
            if let Err(e) = ns.delete() {
                errs.push(e.to_string());
            }
        }
        if let Some(mut cg) = self.cgroup.take() {
            if let Err(e) = cg.delete() {
                errs.push(e.to_string());
            }
        }
        if std::env::var_os("BURSTVM_KEEP_LOGS").is_none() {
            let _ = std::fs::remove_file(&self.stderr_path);
            let _ = std::fs::remove_file(self.console_path());
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "sandbox {} teardown: {}",
                self.spec.id,
                errs.join("; ")
            ))
        }
    }
}

impl Drop for Sandbox<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            tracing::warn!("{e}");
        }
    }
}

/// SIGTERM (the VMM closes its devices and exits), SIGKILL after `grace`.
fn stop_child(mut c: Child, grace: Duration) {
    if c.try_wait().ok().flatten().is_none() {
        // SAFETY: kill(2) on our own, not yet reaped child.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = c.kill();
    }
    let _ = c.wait();
}

/// The VMM's error as one line: its non-empty stderr lines, joined.
fn stderr_summary(err: &str) -> String {
    let lines: Vec<&str> = err
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let s = lines.join(" | ");
    if s.len() > 600 {
        let mut cut = 600;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        format!("{}…", &s[..cut])
    } else {
        s
    }
}

/// Runs in the child between fork and exec: only async-signal-safe calls.
fn child_setup(ns_fd: RawFd, ready_fd: RawFd, cg_fds: &[RawFd]) -> std::io::Result<()> {
    // SAFETY: plain system calls on descriptors the parent keeps open.
    unsafe {
        // Own process group: a terminal Ctrl-C reaches only the runtime, which tears down in order.
        if libc::setpgid(0, 0) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // A VMM never outlives the runtime thread that started it.
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::setns(ns_fd, libc::CLONE_NEWNET) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let flags = libc::fcntl(ready_fd, libc::F_GETFD);
        if flags < 0 || libc::fcntl(ready_fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    cgroup::join_self(cg_fds)
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two fds that we take ownership of.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn poll_in(fd: BorrowedFd<'_>, timeout: Duration) -> std::io::Result<bool> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut p = [PollFd::new(fd, PollFlags::POLLIN)];
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    match poll(
        &mut p,
        PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
    ) {
        Ok(n) => Ok(n > 0),
        Err(nix::Error::EINTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}
