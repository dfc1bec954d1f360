//! One sandbox through its startup stages, and its teardown on every exit
//! path: `cgroup`, `netns`, `cni-add`, `rootfs` are recorded here; the VMM
//! records `vmm-spawn` (from the spawn instant this side passes in
//! BURSTVM_SPAWN_NS) and `dma-ram` .. `ready` in the same trace file.
//!
//! This file holds the `Sandbox` and the order of its stages; each concern
//! has its own file: `spec` (what to create), `error` (how it fails), `net`
//! (network attach), `spawn` (the VMM process), `watch` (READY, liveness,
//! exit and output of the VMM), `files` (per-sandbox files), `teardown`.
//! Every resource is recorded in a field of `Sandbox` the moment it exists,
//! so that `teardown` (run from `Drop` on every error path) releases exactly
//! what was taken.

mod error;
pub(crate) mod files;
mod net;
pub mod rootfs;
mod spawn;
mod spec;
mod teardown;
mod watch;

pub use crate::child::stop_child;
pub use error::{SandboxFailure, StageError, TeardownError, TeardownStep, VmmSpawnError};
pub use net::IFNAME;
pub use spec::{pod_slot, Attach, RootfsCost, SandboxSpec, SgSpec};
pub(crate) use teardown::DEL_PATIENCE;

use procutil::spawn::Child;
use std::net::Ipv4Addr;
use std::path::PathBuf;

use trace::{Stage, TraceWriter};

use crate::cgroup::{Cgroup, Limits};
use crate::child::Keeper;
use crate::host::SandboxHost;
use crate::variant::NetKind;
use files::Files;
use netutil::NamedNetns;

/// A live sandbox. Dropping it tears it down.
#[derive(Debug)]
pub struct Sandbox<'rt> {
    rt: &'rt dyn SandboxHost,
    spec: SandboxSpec,
    attach: Attach,
    trace: TraceWriter,
    cgroup: Option<Cgroup>,
    netns: Option<NamedNetns>,
    cni_added: bool,
    /// The CNI attachment is an SG function: the agent runs its warp pipes.
    sg: bool,
    /// The CNI container id of a pooled attachment (else the sandbox id).
    pooled_id: Option<String>,
    tap_added: bool,
    neighbor: Option<Ipv4Addr>,
    vmm: Option<Child>,
    /// The thread the VMM was forked on (its PDEATHSIG parent); dropped
    /// after the VMM is reaped.
    keeper: Option<Keeper>,
    layer: Option<::rootfs::Layer>,
    /// The writable layer's cost, when the sandbox has a rootfs.
    pub rootfs_cost: Option<RootfsCost>,
    files: Files,
    probe_values: Option<Vec<u64>>,
    /// Address the guest was given (network variants).
    pub guest_ip: Option<Ipv4Addr>,
    /// Host CPU of the start, by owner (set at READY).
    pub start_cpu: Option<crate::cpuacct::StartCpu>,
    /// The sandbox cgroup's CPU usage at READY.
    vmm_cpu_at_ready: Option<u64>,
    /// With `SandboxSpec::watch_zeroing`: the ready pipe after READY, and
    /// what was read past the READY line.
    ready_pipe: Option<(std::fs::File, Vec<u8>)>,
    torn_down: bool,
}

impl<'rt> Sandbox<'rt> {
    /// Creates the sandbox and waits until its guest reports READY.
    pub fn start(
        rt: &'rt dyn SandboxHost,
        spec: SandboxSpec,
    ) -> Result<Sandbox<'rt>, SandboxFailure> {
        Sandbox::start_attached(rt, spec, Attach::default())
    }

    /// `start` with what an engine brings (see `Attach`).
    pub fn start_attached(
        rt: &'rt dyn SandboxHost,
        spec: SandboxSpec,
        attach: Attach,
    ) -> Result<Sandbox<'rt>, SandboxFailure> {
        let id = spec.id.clone();
        let fail = move |stage: &str, error: StageError| SandboxFailure::caused(&id, stage, error);
        // Until READY (or failure) the host is not idle: no pool refill.
        let _busy = rt.net_pool_busy();
        let (cpu0, children0) = (
            crate::cpuacct::thread_ns(),
            crate::cpuacct::thread_children_ns(),
        );
        let trace = TraceWriter::new(spec.id.clone(), Some(rt.trace_path()))
            .map_err(|e| fail("cgroup", e.into()))?;
        let mut sb = Sandbox {
            rt,
            files: Files::new(rt.state_dir(), &spec.id, !spec.probe.is_empty()),
            probe_values: None,
            spec,
            attach,
            trace,
            cgroup: None,
            netns: None,
            cni_added: false,
            sg: false,
            pooled_id: None,
            tap_added: false,
            neighbor: None,
            vmm: None,
            keeper: None,
            layer: None,
            rootfs_cost: None,
            guest_ip: None,
            start_cpu: None,
            vmm_cpu_at_ready: None,
            ready_pipe: None,
            torn_down: false,
        };
        // On any error below, `sb` is dropped and torn down.
        sb.stage(Stage::Cgroup, |sb| {
            let limits = Limits::for_guest(
                sb.spec.memory_bytes,
                sb.spec.app_size + sb.spec.rootfs.as_ref().map_or(0, |r| r.guest_bytes()),
                sb.spec.cpus,
            );
            sb.cgroup = Some(sb.rt.cgroup_for(&sb.spec.id, limits)?);
            Ok(())
        })?;
        // A pooled cgroup has run other sandboxes: count from here.
        let vmm0 = sb.cgroup.as_ref().and_then(|c| c.cpu_usage_ns());
        let policy = sb.spec.variant.policy();
        // The VMM's parameters, filled by the stages (the launch contract).
        let mut vm = vmm::VmParams::new(sb.spec.id.clone());
        // The network pool holds VF attachments only (docs/runtime.md).
        if policy.net == NetKind::Vf
            && sb.spec.net_pool
            && sb.spec.sg.is_none()
            && sb.attach.netns.is_none()
        {
            let start = trace::monotonic_ns();
            if let Some(p) = sb.rt.claim_net() {
                sb.attach_pooled(p, &mut vm)
                    .map_err(|e| sb.failed("net-claim", e))?;
                sb.trace
                    .record(Stage::NetClaim, start, trace::monotonic_ns())
                    .map_err(|e| sb.failed("net-claim", e.into()))?;
            }
        }
        if sb.attach.netns.is_none() && sb.pooled_id.is_none() {
            sb.stage(Stage::Netns, |sb| {
                sb.netns = Some(NamedNetns::create(&sb.spec.id)?);
                Ok(())
            })?;
        }
        match policy.net {
            NetKind::None => {}
            NetKind::Vf if sb.pooled_id.is_some() => {}
            // The engine ran CNI ADD: only the VF attach is ours (no stage of its own).
            NetKind::Vf if sb.attach.netns.is_some() => sb
                .attach_given_vf(&mut vm)
                .map_err(|e| sb.failed("cni-add", e))?,
            NetKind::Vf => sb.stage(Stage::CniAdd, |sb| sb.cni_add_vf(&mut vm))?,
            NetKind::Tap => sb.stage(Stage::CniAdd, |sb| sb.tap_add(&mut vm))?,
        }
        if let Some(r) = sb.spec.rootfs.clone() {
            sb.stage(Stage::Rootfs, |sb| {
                let layers = sb
                    .rt
                    .writable_layers()
                    .ok_or("this runtime was created without writable layers")?;
                let p = rootfs::prepare(layers, &sb.spec.id, r.layer_mode)?;
                rootfs::vm_params(&r, p.layer.path(), &mut vm);
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
            spawn::pipe().map_err(|e| fail("vmm-spawn", VmmSpawnError::ReadyPipe(e).into()))?;
        // `vmm-spawn` is recorded by the VMM itself, from the instant passed in
        // BURSTVM_SPAWN_NS to its memory being set up.
        sb.spawn_vmm(vm, ready_w)
            .map_err(|e| sb.failed("vmm-spawn", e))?;
        // The VMM read its vCPU threads' CPU before it wrote READY, so it
        // never exceeds the cgroup's, read after.
        let vcpu_ns = sb.wait_ready(ready_r)?;
        let vmm1 = sb.cgroup.as_ref().and_then(|c| c.cpu_usage_ns());
        sb.start_cpu = Some(crate::cpuacct::StartCpu {
            // The fork and exec ran on the keeper thread: the runtime's cost too.
            runtime_ns: crate::cpuacct::thread_ns().saturating_sub(cpu0)
                + sb.keeper.as_ref().map_or(0, |k| k.spawn_cpu_ns),
            cni_ns: crate::cpuacct::thread_children_ns().saturating_sub(children0),
            vmm_ns: vmm1.zip(vmm0).map_or(0, |(a, b)| a.saturating_sub(b)),
            vcpu_ns,
            vmm_after_ready_ns: 0,
        });
        sb.vmm_cpu_at_ready = vmm1;
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
        f: impl FnOnce(&mut Self) -> Result<(), StageError>,
    ) -> Result<(), SandboxFailure> {
        let start = trace::monotonic_ns();
        let r = f(self);
        let end = trace::monotonic_ns();
        match r {
            Ok(()) => {
                self.trace
                    .record(stage, start, end)
                    .map_err(|e| self.failed(stage.name(), e.into()))?;
                Ok(())
            }
            Err(e) => Err(self.failed(stage.name(), e)),
        }
    }

    /// A failure that is a condition (no cause to keep).
    pub(super) fn failure(&self, stage: &str, error: String) -> SandboxFailure {
        SandboxFailure {
            sandbox: self.spec.id.clone(),
            stage: stage.to_string(),
            error,
            cause: None,
        }
    }

    /// A failure caused by `error`, kept as its source.
    pub(super) fn failed(&self, stage: &str, error: StageError) -> SandboxFailure {
        SandboxFailure::caused(&self.spec.id, stage, error)
    }

    /// The serial console of a Linux guest (kept with the VMM's stderr).
    pub fn console_path(&self) -> PathBuf {
        self.files.console.clone()
    }

    /// The VMM's vsock socket, where a container sandbox's agent takes
    /// processes (`container::run_process`); None for other sandboxes.
    pub fn vsock_path(&self) -> Option<&std::path::Path> {
        self.spec
            .agent_initrd
            .as_ref()
            .map(|_| self.files.vsock.as_path())
    }

    /// The VMM's control socket of a pod sandbox (its disk slots).
    pub fn api_path(&self) -> Option<&std::path::Path> {
        self.spec
            .agent_initrd
            .as_ref()
            .and(self.spec.pod_slots)
            .map(|_| self.files.api.as_path())
    }
}
