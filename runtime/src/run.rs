//! `burstvm run`: one sandbox through every startup stage, by hand. Its
//! config (`RunConfig`, filled by cli's clap struct) and `run_cli`, which
//! owns the sandbox's runtime, network pool and teardown for that one run.

use std::path::PathBuf;
use std::time::Duration;

use crate::{
    bad, burstvm_bin, cgroup, instance, leaks, template, variant, Error, RootfsConfig, Runtime,
    RuntimeConfig, Sandbox, SandboxConfig, SandboxSpec, SgSpec, Variant,
};

/// `burstvm run`: one sandbox through every stage.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// Variant: no-net, tap, vanilla, fastiov, fastiov-L/-S/-D/-A, pre10/50/100.
    pub variant: Variant,
    pub sandbox: SandboxConfig,
    pub rootfs: RootfsConfig,
    /// Boot this Linux kernel (vmlinux) with the guest agent instead of the
    /// built-in agent, and run the image's process in it (`container`).
    pub kernel: Option<PathBuf>,
    /// With `kernel`: the container's process and its stdio.
    pub container: ContainerRun,
    /// The writable layer is a full copy of the template, not a reflink.
    pub rootfs_copy: bool,
    pub template: template::TemplateConfig,
    /// Keep the sandbox running after READY until Ctrl-C.
    pub keep_running: bool,
    /// Append the trace (JSON lines) to this file.
    pub trace: Option<PathBuf>,
    /// Seconds the guest may take to become ready.
    pub timeout: u64,
    /// The burstvm binary to spawn VMMs and the NIC daemon from (default: this one).
    pub burstvm_bin: Option<PathBuf>,
    /// Keep this many VF network attachments ready (netns + CNI ADD done in
    /// the background); a VF sandbox claims one (`net-claim` stage).
    pub net_pool: usize,
    /// The sandbox's network: `vf` (burstvm-cni's VF, the variant's) or `sg` (an SG
    /// function: the runtime's `"kind":"sg"` network; the agent moves `--sg-bytes`
    /// through each of `--sg-pipes` warp pipes and the VMM checks the checksum).
    pub net_kind: NetKindArg,
    /// SG functions the runtime's NIC daemon serves (`burstvm nic --sgfs`);
    /// default 4 with `--net-kind sg`, else 0.
    pub sgfs: Option<usize>,
    /// With `--net-kind sg`: warp pipes (echo sockets) the agent opens.
    pub sg_pipes: u32,
    /// With `--net-kind sg`: bytes through each pipe (a multiple of 8, at most 4096).
    pub sg_bytes: u32,
}

/// What `burstvm run --kernel` runs in the sandbox (docs/runtime.md, "Containers").
#[derive(Debug, Clone, Default)]
pub struct ContainerRun {
    /// The command (after `--`): replaces the image's cmd (Docker's rule);
    /// empty: the image's own.
    pub command: Vec<String>,
    /// Pipe our stdin to the process (`-i`).
    pub interactive: bool,
    /// Give the process a terminal (`-t`).
    pub tty: bool,
    /// The guest agent binary (default: `container::default_agent`).
    pub agent: Option<PathBuf>,
}

/// `burstvm run --net-kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetKindArg {
    Vf,
    Sg,
}

impl NetKindArg {
    pub const ALL: [NetKindArg; 2] = [NetKindArg::Vf, NetKindArg::Sg];

    pub fn name(self) -> &'static str {
        match self {
            NetKindArg::Vf => "vf",
            NetKindArg::Sg => "sg",
        }
    }
}

impl std::fmt::Display for NetKindArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for NetKindArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|v| v.name() == s)
            .ok_or_else(|| format!("unknown network kind {s:?} (vf, sg)"))
    }
}

impl RunConfig {
    /// The SG network's sandbox spec and the NIC daemon's SG function count.
    fn sg(&self) -> Result<(Option<SgSpec>, usize), Error> {
        if self.net_kind == NetKindArg::Vf {
            return Ok((None, self.sgfs.unwrap_or(0)));
        }
        if self.variant.policy().net != variant::NetKind::Vf {
            return Err(bad(
                "--net-kind",
                format!(
                    "sg replaces the VF of a VF variant; {} has none",
                    self.variant
                ),
            ));
        }
        if self.net_pool > 0 {
            return Err(bad(
                "--net-pool",
                "the network pool holds VF attachments; an SG sandbox cannot claim one",
            ));
        }
        let sgfs = self.sgfs.unwrap_or(instance::DEFAULT_SGFS);
        if sgfs == 0 {
            return Err(bad("--sgfs", "--net-kind sg needs at least 1"));
        }
        Ok((
            Some(SgSpec {
                pipes: self.sg_pipes,
                bytes: self.sg_bytes,
            }),
            sgfs,
        ))
    }
}

/// How long `run` waits for the network pool to fill before its sandbox starts.
const NET_POOL_FILL_BOUND: Duration = Duration::from_secs(60);

/// Runs one sandbox; its exit status: the container's (with `--kernel`),
/// else 0.
pub fn run_cli(a: &RunConfig) -> Result<i32, Error> {
    instance::install_sigint_handler();
    let (memory, app_size) = a.sandbox.bytes()?;
    let policy = a.variant.policy();
    if a.kernel.is_some() && a.rootfs.rootfs_image == crate::sandbox::rootfs::ImageMode::Pmem {
        return Err(bad(
            "--rootfs-image",
            "pmem is for the built-in agent; a Linux guest reads the image from virtio-blk",
        ));
    }
    let (sg, sgfs) = a.sg()?;
    // A Linux guest runs the image under the guest agent (its initramfs):
    // the image itself stays as built, shared with every other sandbox.
    let image = a.rootfs.image(false)?;
    let agent_initrd = match &a.kernel {
        Some(_) => {
            if image.is_none() {
                return Err(bad(
                    "IMAGE",
                    "a Linux guest runs a container image: name one",
                ));
            }
            let agent = a
                .container
                .agent
                .clone()
                .or_else(crate::container::default_agent)
                .ok_or_else(|| {
                    bad(
                        "--agent",
                        "no guest agent found (build it with scripts/build-agent.sh, or name it)",
                    )
                })?;
            Some(crate::container::initramfs(
                &agent,
                &a.rootfs.image_cache_dir(),
            )?)
        }
        None => None,
    };
    let layer_mode = if a.rootfs_copy {
        crate::sandbox::rootfs::LayerMode::Copy
    } else {
        crate::sandbox::rootfs::LayerMode::Reflink
    };
    let mut rootfs = image
        .as_ref()
        .map(|(img, _)| a.rootfs.spec(img, layer_mode))
        .transpose()?;
    if agent_initrd.is_some() {
        // The agent reads no check file: the container's own process is the proof.
        if let Some(r) = rootfs.as_mut() {
            r.check = None;
        }
    }
    let process = match (&agent_initrd, &image) {
        (Some(_), Some((img, _))) => Some(crate::container::image_process(
            img,
            &a.container.command,
            a.container.tty,
        )?),
        _ => None,
    };
    let rt = Runtime::new(RuntimeConfig {
        bin: burstvm_bin(&a.burstvm_bin)?,
        trace_path: a.trace.clone(),
        vfs: 4 + a.net_pool,
        network: policy.net != variant::NetKind::None,
        cgroup_pool: 0,
        cgroup_limits: cgroup::Limits {
            memory_bytes: memory,
            cpus: a.sandbox.cpus,
        },
        rootfs_layer_bytes: image.as_ref().map(|(_, b)| *b),
        net_pool: a.net_pool,
        sgfs,
        cni_server: true,
    })?;
    rt.prepare_variant(a.variant)?;
    if let Some((ready, target, err)) = rt.wait_net_pool(NET_POOL_FILL_BOUND) {
        println!(
            "net pool: {ready} of {target} attachments ready{}",
            err.map(|e| format!(" (last refill error: {e})"))
                .unwrap_or_default()
        );
    }
    let id = format!(
        "{}run-{}",
        rt.sandbox_prefix(),
        a.variant.name().to_lowercase()
    );
    let spec = SandboxSpec {
        cpus: a.sandbox.cpus,
        app_size,
        keep_running: a.keep_running,
        rootfs,
        kernel: a.kernel.clone(),
        agent_initrd: agent_initrd.clone(),
        template: a.template.resolve()?,
        net_pool: a.net_pool > 0,
        sg,
        ..SandboxSpec::new(id.clone(), a.variant, memory, a.timeout)
    };
    let start = trace::monotonic_ns();
    let result = (|| -> Result<i32, Error> {
        if let Some(process) = process {
            return run_container(&rt, spec, process, a);
        }
        let mut sb = Sandbox::start(&rt, spec)?;
        let evs: Vec<_> = trace::read_trace(rt.trace_path())?
            .into_iter()
            .filter(|e| e.sandbox == id)
            .collect();
        println!("sandbox {id} ({}) ready", a.variant);
        if let Some(sg) = sg {
            // READY came after the VMM checked the agent's count and checksum.
            println!(
                "  SG function: {} warp pipes x {} bytes echoed, checksum verified by the VMM",
                sg.pipes, sg.bytes
            );
        }
        for e in &evs {
            println!(
                "  {:<11} {:>10.3} ms  (+{:.3} ms)",
                e.stage.name(),
                e.duration_ns() as f64 / 1e6,
                e.start_ns.saturating_sub(start) as f64 / 1e6
            );
        }
        let total = evs.iter().map(|e| e.end_ns).max().unwrap_or(start) - start;
        println!("  end-to-end  {:>10.3} ms", total as f64 / 1e6);
        if let Some(ip) = sb.guest_ip {
            let n = rt.server().replies().get(&ip).copied().unwrap_or(0);
            println!("  guest {ip}: {n} request(s) answered by the echo server");
        }
        if a.keep_running {
            println!("running; Ctrl-C to stop");
            run_until_interrupted(&rt, &mut sb)?;
        } else {
            sb.wait_exit()?;
            sb.teardown()?;
        }
        Ok(0)
    })();
    let lc = leaks::check(&rt, Duration::from_secs(5));
    // A container's stdout is its own: the leak report goes to stderr.
    if agent_initrd.is_some() {
        eprintln!("{}", lc.describe());
    } else {
        println!("{}", lc.describe());
    }
    let status = result?;
    if !lc.is_clean() {
        return Err(Error::Leaks(lc.describe()));
    }
    Ok(status)
}

/// A `--keep-running` sandbox: until Ctrl-C, or until its VMM ends (a
/// killed VMM is an error of the run, reported after the teardown).
fn run_until_interrupted(rt: &Runtime, sb: &mut Sandbox<'_>) -> Result<(), Error> {
    let mut alive = Ok(());
    while !rt.interrupted() {
        alive = sb.check_alive();
        if alive.is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    sb.teardown()?;
    Ok(alive?)
}

/// The container path of `run`: the sandbox boots the kernel with the guest
/// agent, the image's process runs there with our stdio, and its exit
/// status is ours. With `--keep-running` the sandbox stays up after it
/// (for `burstvm exec`) until Ctrl-C.
fn run_container(
    rt: &Runtime,
    spec: SandboxSpec,
    process: agent_proto::Process,
    a: &RunConfig,
) -> Result<i32, Error> {
    let id = spec.id.clone();
    let attach = crate::Attach {
        until_exit: !a.keep_running,
        ..Default::default()
    };
    let mut sb = Sandbox::start_attached(rt, spec, attach)?;
    let vsock = sb
        .vsock_path()
        .expect("a sandbox with the agent's initramfs serves vsock")
        .to_path_buf();
    if a.keep_running {
        eprintln!(
            "sandbox {id}: agent at {} (burstvm exec {id} -- CMD)",
            vsock.display()
        );
    }
    let create = agent_proto::CreateProcess {
        main: !a.keep_running,
        ..agent_proto::CreateProcess::new("main", process)
    };
    let stdio = crate::container::Stdio {
        stdin: a.container.interactive,
    };
    let status = crate::container::run_process(&vsock, create, stdio, &|| rt.interrupted());
    let status = match status {
        Ok(s) => s,
        Err(e) => {
            let _ = sb.teardown();
            return Err(e);
        }
    };
    if a.keep_running {
        eprintln!("sandbox {id}: main process exited with {status}; running until Ctrl-C");
        run_until_interrupted(rt, &mut sb)?;
    } else {
        // The agent powers the guest off; the VMM exits with its EXIT status.
        sb.wait_status();
        sb.teardown()?;
    }
    Ok(status)
}
