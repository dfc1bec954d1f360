//! containerd's runtime v2 task API (ttrpc, task API v2 of containerd 1.6)
//! over burstvm sandboxes. See docs/shim.md.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use containerd_shim as shim;
use shim::api;
use shim::protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskStart,
};
use shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use shim::protos::protobuf::MessageField;
use shim::protos::topics;
use shim::protos::ttrpc::{self, Code};
use shim::publisher::RemotePublisher;
use shim::{Config, DeleteResponse, ExitSignal, Flags, StartOpts, TtrpcContext, TtrpcResult};

use runtime::{HostServices, SandboxSpec, ServicesInfo};

use crate::bundle_rootfs::{self, GuestRootfs, MountSpec, Want};
use crate::config::{self, Guest, ShimConfig};
use crate::guest::{GuestError, Proc, StdioPaths, DRAIN_LIMIT};
use crate::spec::{Kind, Spec};
use crate::task::{Exit, KillError, LinuxParams, OnExit, Record, Status, Task, TaskParams};

/// A teardown (VMM stop, CNI DEL, cgroup removal) must end within this.
const TEARDOWN_LIMIT: Duration = Duration::from_secs(30);
/// Publishing an event to containerd must not hang the shim.
const PUBLISH_TIMEOUT_NS: i64 = 5_000_000_000;
/// A Linux guest's state directory is `shim-<sandbox>` under this (short
/// enough for the VMM's vsock socket path; `burstvm exec SANDBOX` finds it).
pub const STATE_ROOT: &str = "/run/burstvm";
/// The managed filesystem of a Linux guest's writable layers (sparse).
const LAYERS_FS_BYTES: u64 = 1 << 30;
/// The smallest guest RAM of a Linux guest (its kernel and agent).
const MIN_LINUX_MEMORY: u64 = 64 << 20;

fn rpc_err(code: Code, msg: impl ToString) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg))
}

/// Why a task could not be created; `code` is its ttrpc status.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error(
        "burstvm: task {task}: a terminal needs a Linux guest (shim.json kernel); \
         the built-in agent runs an app payload without one"
    )]
    Terminal { task: String },
    #[error("burstvm: task {task}: checkpoints are not supported (a microVM cannot be restored from one)")]
    Checkpoint { task: String },
    /// What the task's guest cannot honour.
    #[error("burstvm: task {task}: {reason}")]
    Refused { task: String, reason: String },
    #[error(transparent)]
    Spec(#[from] crate::spec::SpecError),
    #[error("burstvm: task {task}: OCI spec: {source}")]
    Resources {
        task: String,
        #[source]
        source: crate::spec::ParseError,
    },
    #[error(
        "burstvm: container {container} in pod {pod}: containers run in a pod whose sandbox boots \
         the Linux guest (shim.json kernel) in this shim; on the built-in agent a pod is one \
         microVM running one app, the pod sandbox's image (see docs/shim.md)"
    )]
    PodContainer { container: String, pod: String },
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    /// The host services file (the error names it).
    #[error("{0}")]
    Services(#[source] runtime::host::HostError),
    #[error("process.args is empty: no entrypoint")]
    NoEntrypoint,
    #[error("{path}: {source}")]
    Record {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Rootfs(#[from] bundle_rootfs::RootfsError),
    #[error("sandbox {sandbox}: host services: {source}")]
    Attach {
        sandbox: String,
        #[source]
        source: runtime::host::HostError,
    },
    #[error("task {task}: the guest agent's initramfs: {source}")]
    Initramfs {
        task: String,
        #[source]
        source: Box<runtime::Error>,
    },
    #[error("task {task}: writable layers in {dir}: {source}")]
    Layers {
        task: String,
        dir: PathBuf,
        #[source]
        source: Box<::rootfs::Error>,
    },
}

impl CreateError {
    pub fn code(&self) -> Code {
        match self {
            CreateError::PodContainer { .. }
            | CreateError::Terminal { .. }
            | CreateError::Checkpoint { .. } => Code::UNIMPLEMENTED,
            CreateError::Services(_)
            | CreateError::Attach { .. }
            | CreateError::Initramfs { .. }
            | CreateError::Layers { .. } => Code::FAILED_PRECONDITION,
            _ => Code::INVALID_ARGUMENT,
        }
    }
}

/// What the built-in agent cannot do, and why (docs/shim.md).
fn builtin_unsupported(task: &str, what: &str) -> ttrpc::Error {
    rpc_err(
        Code::UNIMPLEMENTED,
        format!(
            "burstvm: task {task}: {what} is not supported on the built-in agent, which runs \
             one app payload and nothing else; a Linux guest (shim.json kernel) runs processes"
        ),
    )
}

fn guest_err(e: GuestError) -> ttrpc::Error {
    let code = match &e {
        GuestError::NoExec { .. } => Code::NOT_FOUND,
        GuestError::ExecExists { .. } => Code::ALREADY_EXISTS,
        GuestError::ExecState { .. } | GuestError::NotReady { .. } => Code::FAILED_PRECONDITION,
        GuestError::ExecSpec { .. } => Code::INVALID_ARGUMENT,
        e if e.is_not_found() => Code::NOT_FOUND,
        _ => Code::UNKNOWN,
    };
    rpc_err(code, crate::describe(&e))
}

fn timestamp((secs, nanos): (i64, u32)) -> MessageField<Timestamp> {
    let mut t = Timestamp::new();
    t.seconds = secs;
    t.nanos = nanos as i32;
    MessageField::some(t)
}

/// The shim process (one per pod or standalone task).
pub struct Shim {
    namespace: String,
    id: String,
    exit: Arc<ExitSignal>,
}

// containerd-shim's ExitSignal and RemotePublisher have no Debug.
impl std::fmt::Debug for Shim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shim")
            .field("namespace", &self.namespace)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl shim::Shim for Shim {
    type T = TaskService;

    fn new(_runtime_id: &str, args: &Flags, config: &mut Config) -> Self {
        // The crate's reaper would steal the VMM's exit status.
        config.no_reaper = true;
        Shim {
            namespace: args.namespace.clone(),
            id: args.id.clone(),
            exit: Arc::new(ExitSignal::default()),
        }
    }

    fn start_shim(&mut self, opts: StartOpts) -> shim::Result<String> {
        // One shim per pod (Kata's model): a pod's containers join its sandbox's shim.
        let bundle = std::env::current_dir().map_err(|err| shim::Error::IoError {
            context: "bundle directory".into(),
            err,
        })?;
        let grouping = crate::spec::grouping(&bundle, &opts.id);
        let (_pid, address) = shim::spawn(opts, &grouping, Vec::new())?;
        shim::util::write_address(&address)?;
        Ok(address)
    }

    /// After a shim died (containerd runs `shim delete` in the bundle):
    /// remove what its sandbox left and report the task as killed.
    fn delete_shim(&mut self) -> shim::Result<DeleteResponse> {
        let bundle = std::env::current_dir().map_err(|err| shim::Error::IoError {
            context: "bundle directory".into(),
            err,
        })?;
        cleanup_bundle(&bundle);
        let mut r = DeleteResponse::new();
        r.exit_status = 128 + libc::SIGKILL as u32;
        r.exited_at = timestamp(crate::task::now());
        Ok(r)
    }

    fn wait(&mut self) {
        self.exit.wait();
    }

    fn create_task_service(&self, publisher: RemotePublisher) -> TaskService {
        TaskService {
            inner: Arc::new(Inner {
                namespace: self.namespace.clone(),
                shim_id: self.id.clone(),
                exit: Arc::clone(&self.exit),
                publisher: Mutex::new(publisher),
                tasks: Mutex::new(HashMap::new()),
            }),
        }
    }
}

/// Removes a dead shim's leftovers named by `<bundle>/burstvm.json`.
pub fn cleanup_bundle(bundle: &Path) -> Vec<String> {
    let Some(rec) = Record::read(bundle) else {
        return Vec::new();
    };
    let mut done = Vec::new();
    let info = ServicesInfo::load(&rec.services).ok();
    let cni = info
        .as_ref()
        .and_then(|i| runtime::cni_exec::CniNetwork::load(&i.cni_config, i.cni_path.clone()).ok());
    if let (Some(ip), Some(i)) = (rec.guest_ip, &info) {
        let r = runtime::server_netns::NeighborTable::open(&i.server_netns).and_then(|t| t.del(ip));
        match r {
            Ok(()) => done.push(format!("neighbour entry {ip}")),
            Err(e) => tracing::warn!("{e}"),
        }
    }
    match runtime::cgroup::Layout::detect() {
        // A pod's container has no sandbox: its pod's bundle reaps the pod's.
        _ if rec.member => {}
        Ok(layout) => done.extend(runtime::host::reap_sandbox(
            &layout,
            cni.as_ref(),
            &rec.sandbox_id,
            rec.owned_netns,
        )),
        Err(e) => tracing::warn!("{e}"),
    }
    // After the VMMs are gone: a Linux guest's layers and files.
    if let Some(dir) = rec.state_dir.as_deref().filter(|d| d.exists()) {
        crate::task::remove_state_dir(dir);
        done.push(format!("state directory {}", dir.display()));
    }
    let rootfs = bundle.join("rootfs");
    if rec.mounted && bundle_rootfs::is_mounted(&rootfs) && bundle_rootfs::unmount(&rootfs).is_ok()
    {
        done.push(format!("mount {}", rootfs.display()));
    }
    let _ = std::fs::remove_file(bundle.join(crate::task::RECORD));
    done
}

struct Inner {
    namespace: String,
    shim_id: String,
    exit: Arc<ExitSignal>,
    publisher: Mutex<RemotePublisher>,
    tasks: Mutex<HashMap<String, Arc<Task>>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner")
            .field("namespace", &self.namespace)
            .field("shim_id", &self.shim_id)
            .field("tasks", &self.tasks)
            .finish_non_exhaustive()
    }
}

impl Inner {
    fn publish(&self, topic: &str, event: Box<dyn shim::protos::protobuf::MessageDyn>) {
        let p = self.publisher.lock().unwrap_or_else(|e| e.into_inner());
        let ctx = ttrpc::context::with_timeout(PUBLISH_TIMEOUT_NS);
        if let Err(e) = p.publish(ctx, topic, &self.namespace, event) {
            tracing::warn!("publish {topic}: {e}");
        }
    }

    fn task(&self, id: &str) -> TtrpcResult<Arc<Task>> {
        self.tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
            .ok_or_else(|| rpc_err(Code::NOT_FOUND, format!("task {id} not found")))
    }
}

/// The exec `exec_id` of `t`: only a Linux guest has execs.
fn exec_of(t: &Task, exec_id: &str) -> TtrpcResult<Arc<Proc>> {
    let agent = t
        .agent
        .as_ref()
        .ok_or_else(|| builtin_unsupported(&t.id, &format!("exec {exec_id}")))?;
    agent.exec_proc(exec_id).map_err(guest_err)
}

#[derive(Debug, Clone)]
pub struct TaskService {
    inner: Arc<Inner>,
}

/// The sandbox id of a container: short enough for netns, cgroup and trace
/// names, and the same in `shim delete` (which sees only namespace and id).
pub fn sandbox_id(namespace: &str, id: &str) -> String {
    let h = vmm_fnv(format!("{namespace}/{id}").as_bytes());
    format!("bvs-{h:016x}")
}

fn vmm_fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

impl TaskService {
    fn create_task(&self, req: &api::CreateTaskRequest) -> Result<Arc<Task>, CreateError> {
        let bundle = PathBuf::from(&req.bundle);
        let task = req.id.clone();
        if !req.checkpoint.is_empty() {
            return Err(CreateError::Checkpoint { task });
        }
        let spec = Spec::load(&bundle)?;
        let until_exit = !matches!(spec.kind, Kind::PodSandbox);
        // A pod's container runs in its pod's VM (this shim serves the pod).
        let pod_task = match &spec.kind {
            Kind::PodContainer { sandbox } => {
                let pod = self
                    .inner
                    .tasks
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(sandbox)
                    .filter(|t| t.pod.is_some())
                    .cloned();
                Some(pod.ok_or_else(|| CreateError::PodContainer {
                    container: req.id.clone(),
                    pod: sandbox.clone(),
                })?)
            }
            _ => None,
        };
        let (type_url, value) = req
            .options
            .as_ref()
            .map(|a| (a.type_url.as_str(), a.value.as_slice()))
            .unwrap_or(("", &[]));
        let cfg_path = config::config_path(type_url, value)?;
        let cfg = ShimConfig::load(&cfg_path)?;
        let variant = cfg.variant_for(&spec.annotations)?;
        // A pod's container runs where its pod runs: in a Linux guest.
        let guest = match &pod_task {
            Some(pod) => cfg.linux_guest().ok_or_else(|| CreateError::PodContainer {
                container: req.id.clone(),
                pod: pod.id.clone(),
            })?,
            None => cfg.guest_for(&spec.annotations)?,
        };
        let min_memory = match guest {
            Guest::Builtin => crate::spec::MIN_MEMORY,
            Guest::Linux { .. } => MIN_LINUX_MEMORY,
        };
        let size = spec
            .sizing(cfg.memory_bytes(), cfg.cpus, min_memory)
            .map_err(|source| CreateError::Resources {
                task: task.clone(),
                source,
            })?;
        let refusal = match guest {
            Guest::Builtin if req.terminal => return Err(CreateError::Terminal { task }),
            Guest::Builtin => spec.builtin_refusal(),
            Guest::Linux { .. } => spec.linux_refusal(),
        };
        if let Some(reason) = refusal {
            return Err(CreateError::Refused { task, reason });
        }
        let info = ServicesInfo::load(&cfg.services).map_err(CreateError::Services)?;
        let entry = spec.args.first().ok_or(CreateError::NoEntrypoint)?.clone();
        let sandbox = sandbox_id(&self.inner.namespace, &req.id);
        let netns = spec.netns.clone();
        let state_dir = match guest {
            Guest::Linux { .. } if pod_task.is_none() => {
                Some(Path::new(STATE_ROOT).join(format!("shim-{sandbox}")))
            }
            _ => None,
        };
        // Recorded before anything exists, so that `shim delete` after a
        // crash removes whatever part was made.
        let rec = Record {
            sandbox_id: sandbox.clone(),
            // The sandbox makes its own netns (and runs CNI for a VF variant).
            owned_netns: netns.is_none() && pod_task.is_none(),
            member: pod_task.is_some(),
            mounted: !req.rootfs.is_empty(),
            services: cfg.services.clone(),
            guest_ip: None,
            state_dir: state_dir.clone(),
        };
        rec.write(&bundle).map_err(|source| CreateError::Record {
            path: bundle.join(crate::task::RECORD),
            source,
        })?;
        let mounts: Vec<MountSpec> = req
            .rootfs
            .iter()
            .map(|m| MountSpec {
                fstype: m.type_.clone(),
                source: m.source.clone(),
                options: m.options.clone(),
            })
            .collect();
        let cache = cfg.image_cache_dir();
        let want = match guest {
            Guest::Builtin => Want::Payload { entry: &entry },
            Guest::Linux { .. } => Want::Image { cache: &cache },
        };
        // From here on an error leaves a mount, layers or files that the
        // caller's `cleanup_bundle` removes by the record.
        let prepared = bundle_rootfs::prepare(&bundle, &mounts, want)?;
        let mut sandbox_spec = SandboxSpec {
            cpus: size.cpus,
            keep_running: true,
            ..SandboxSpec::new(sandbox, variant, size.memory_bytes, cfg.timeout_secs)
        };
        let mut linux = None;
        let mut member = None;
        let mut host_state = bundle.clone();
        // A Linux guest's process (config.json's against the image) and image.
        let linux_parts = || -> Result<_, CreateError> {
            let process =
                spec.agent_process(&prepared.rootfs)
                    .map_err(|source| CreateError::Resources {
                        task: task.clone(),
                        source,
                    })?;
            let GuestRootfs::Image { image, .. } = &prepared.guest else {
                unreachable!("a Linux guest's rootfs is an image");
            };
            Ok((process, image))
        };
        if let Some(pod) = pod_task {
            let (process, image) = linux_parts()?;
            // It runs in the pod's sandbox: named by it in traces and messages.
            sandbox_spec.id = pod.sandbox_id.clone();
            member = Some(crate::pod::MemberParams {
                pod,
                process,
                image: Arc::clone(image),
            });
        } else if let (Guest::Linux { kernel, agent }, Some(dir)) = (&guest, &state_dir) {
            let (process, image) = linux_parts()?;
            let initrd = runtime::container::initramfs(agent, &cache).map_err(|source| {
                CreateError::Initramfs {
                    task: task.clone(),
                    source: Box::new(source),
                }
            })?;
            let mut lc = ::rootfs::LayerConfig::new(dir.join("layers"));
            lc.fs_bytes = LAYERS_FS_BYTES;
            lc.template_bytes = cfg.layer_bytes();
            let layers =
                ::rootfs::WritableLayers::create(&lc).map_err(|source| CreateError::Layers {
                    task: task.clone(),
                    dir: lc.dir.clone(),
                    source: Box::new(source),
                })?;
            sandbox_spec.kernel = Some(kernel.clone());
            sandbox_spec.agent_initrd = Some(initrd);
            // The agent reads no check file: the container's process is the proof.
            sandbox_spec.rootfs = Some(runtime::sandbox::rootfs::RootfsSpec {
                image: Arc::clone(image),
                check: None,
                image_mode: runtime::sandbox::rootfs::ImageMode::Blk,
                layer_mode: runtime::sandbox::rootfs::LayerMode::Reflink,
            });
            host_state = dir.clone();
            if spec.kind == Kind::PodSandbox {
                sandbox_spec.pod_slots = Some(cfg.pod_slots);
            }
            linux = Some(LinuxParams {
                process,
                layers,
                state_dir: dir.clone(),
            });
        }
        let host = match HostServices::attach(info, host_state, bundle.join("trace.jsonl")) {
            Ok(h) => Box::leak(Box::new(h)),
            Err(source) => {
                return Err(CreateError::Attach {
                    sandbox: rec.sandbox_id,
                    source,
                });
            }
        };
        let params = TaskParams {
            id: req.id.clone(),
            bundle: bundle.clone(),
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
            spec: sandbox_spec,
            netns,
            until_exit,
            prepared,
            trace_copy: cfg.trace_copy.clone(),
            linux,
            member,
        };
        Ok(Arc::new(Task::new(host, params)))
    }

    fn on_exit(&self) -> Arc<OnExit> {
        let inner = Arc::clone(&self.inner);
        Arc::new(Box::new(
            move |t: &Task, exec_id: &str, e: &Exit, pid: u32| {
                let mut ev = TaskExit::new();
                ev.container_id = t.id.clone();
                ev.id = if exec_id.is_empty() {
                    t.id.clone()
                } else {
                    exec_id.to_string()
                };
                ev.pid = pid;
                ev.exit_status = e.status;
                ev.exited_at = timestamp(e.at);
                inner.publish(topics::TASK_EXIT_EVENT_TOPIC, Box::new(ev));
            },
        ))
    }

    /// Starts exec `exec_id` of `t` and waits for it on a thread of its own
    /// (its output drained, then TaskExit); its pid.
    fn start_exec(&self, t: &Arc<Task>, exec_id: &str) -> TtrpcResult<u32> {
        let proc = exec_of(t, exec_id)?;
        let agent = Arc::clone(t.agent.as_ref().expect("exec_of checked"));
        let pid = match agent.start(&proc) {
            Ok(pid) => pid,
            Err(e) => {
                // It never ran: a pending Wait returns (127: not found or
                // not executable, as a shell says), Delete removes it.
                proc.finish(if e.is_spawn_failure() { 127 } else { 1 });
                return Err(guest_err(e));
            }
        };
        let (task, on_exit) = (Arc::clone(t), self.on_exit());
        let spawned = std::thread::Builder::new()
            .name(format!("exec-{exec_id}"))
            .spawn(move || {
                let status = match agent.wait_exit(&proc) {
                    Ok(x) => x.status.max(0) as u32,
                    // The guest went away under it: killed with the VM.
                    Err(e) => {
                        tracing::warn!("{e}");
                        128 + libc::SIGKILL as u32
                    }
                };
                proc.drain(DRAIN_LIMIT);
                if let Some(e) = proc.finish(status) {
                    on_exit(&task, &proc.exec_id, &e, pid);
                }
            });
        if let Err(e) = spawned {
            return Err(rpc_err(
                Code::UNKNOWN,
                format!("task {}: exec {exec_id}: waiter thread: {e}", t.id),
            ));
        }
        Ok(pid)
    }
}

fn status_of(s: Status) -> api::Status {
    match s {
        Status::Created | Status::Starting => api::Status::CREATED,
        Status::Running => api::Status::RUNNING,
        Status::Stopped => api::Status::STOPPED,
    }
}

impl shim::Task for TaskService {
    fn create(
        &self,
        _ctx: &TtrpcContext,
        req: api::CreateTaskRequest,
    ) -> TtrpcResult<api::CreateTaskResponse> {
        if self
            .inner
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&req.id)
        {
            return Err(rpc_err(
                Code::ALREADY_EXISTS,
                format!("task {} exists", req.id),
            ));
        }
        let task = match self.create_task(&req) {
            Ok(t) => t,
            Err(e) => {
                // Nothing of it may stay: the record names what was made.
                cleanup_bundle(Path::new(&req.bundle));
                return Err(rpc_err(e.code(), crate::describe(&e)));
            }
        };
        self.inner
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(req.id.clone(), task);
        let pid = std::process::id();
        let mut ev = TaskCreate::new();
        ev.container_id = req.id.clone();
        ev.bundle = req.bundle.clone();
        ev.rootfs = req.rootfs.clone();
        ev.pid = pid;
        self.inner
            .publish(topics::TASK_CREATE_EVENT_TOPIC, Box::new(ev));
        let mut r = api::CreateTaskResponse::new();
        r.pid = pid;
        Ok(r)
    }

    fn start(
        &self,
        _ctx: &TtrpcContext,
        req: api::StartRequest,
    ) -> TtrpcResult<api::StartResponse> {
        let t = self.inner.task(&req.id)?;
        let mut r = api::StartResponse::new();
        if !req.exec_id.is_empty() {
            r.pid = self.start_exec(&t, &req.exec_id)?;
            let mut ev = TaskExecStarted::new();
            ev.container_id = req.id.clone();
            ev.exec_id = req.exec_id.clone();
            ev.pid = r.pid;
            self.inner
                .publish(topics::TASK_EXEC_STARTED_EVENT_TOPIC, Box::new(ev));
            return Ok(r);
        }
        let limit = Duration::from_secs(t.timeout_secs.saturating_add(30));
        let pid = t
            .start(limit, self.on_exit())
            .map_err(|e| rpc_err(Code::UNKNOWN, crate::describe(&e)))?;
        let mut ev = TaskStart::new();
        ev.container_id = req.id.clone();
        ev.pid = pid;
        self.inner
            .publish(topics::TASK_START_EVENT_TOPIC, Box::new(ev));
        r.pid = pid;
        Ok(r)
    }

    fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        let t = self.inner.task(&req.id)?;
        let finished = |what: &str| {
            rpc_err(
                Code::NOT_FOUND,
                format!("task {}: {what}: process already finished", req.id),
            )
        };
        if !req.exec_id.is_empty() {
            let proc = exec_of(&t, &req.exec_id)?;
            let agent = t.agent.as_ref().expect("exec_of checked");
            return match agent.signal(&proc, req.signal) {
                Ok(()) => Ok(api::Empty::new()),
                Err(e) if e.is_not_found() => Err(finished(&format!("exec {}", req.exec_id))),
                Err(e) => Err(guest_err(e)),
            };
        }
        if req.all {
            // Every exec too (the main one's exit ends the VM with them anyway).
            if let Some(agent) = &t.agent {
                for p in agent.execs() {
                    if p.status().0 == Status::Running {
                        let _ = agent.signal(&p, req.signal);
                    }
                }
            }
        }
        match t.kill(req.signal) {
            Ok(()) => Ok(api::Empty::new()),
            Err(KillError::Finished) => Err(finished("main process")),
            Err(e) => Err(rpc_err(
                Code::UNKNOWN,
                format!("task {}: {}", req.id, crate::describe(&e)),
            )),
        }
    }

    fn wait(&self, _ctx: &TtrpcContext, req: api::WaitRequest) -> TtrpcResult<api::WaitResponse> {
        let t = self.inner.task(&req.id)?;
        let e = if req.exec_id.is_empty() {
            t.wait()
        } else {
            exec_of(&t, &req.exec_id)?.wait()
        };
        let mut r = api::WaitResponse::new();
        r.exit_status = e.status;
        r.exited_at = timestamp(e.at);
        Ok(r)
    }

    fn delete(&self, _ctx: &TtrpcContext, req: api::DeleteRequest) -> TtrpcResult<DeleteResponse> {
        let t = self.inner.task(&req.id)?;
        let mut r = DeleteResponse::new();
        if !req.exec_id.is_empty() {
            exec_of(&t, &req.exec_id)?;
            let agent = t.agent.as_ref().expect("exec_of checked");
            let (pid, exit) = agent.delete_exec(&req.exec_id).map_err(guest_err)?;
            r.pid = pid;
            r.exit_status = exit.status;
            r.exited_at = timestamp(exit.at);
            return Ok(r);
        }
        let (_, pid, _) = t.status();
        let exit = t
            .delete(TEARDOWN_LIMIT)
            .map_err(|e| rpc_err(Code::FAILED_PRECONDITION, crate::describe(&e)))?;
        self.inner
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&req.id);
        let mut ev = TaskDelete::new();
        ev.container_id = req.id.clone();
        ev.id = req.id.clone();
        ev.pid = pid;
        ev.exit_status = exit.status;
        ev.exited_at = timestamp(exit.at);
        self.inner
            .publish(topics::TASK_DELETE_EVENT_TOPIC, Box::new(ev));
        r.pid = pid;
        r.exit_status = exit.status;
        r.exited_at = timestamp(exit.at);
        Ok(r)
    }

    fn state(
        &self,
        _ctx: &TtrpcContext,
        req: api::StateRequest,
    ) -> TtrpcResult<api::StateResponse> {
        let t = self.inner.task(&req.id)?;
        let mut r = api::StateResponse::new();
        r.id = t.id.clone();
        r.bundle = t.bundle.display().to_string();
        let (status, pid, exit) = if req.exec_id.is_empty() {
            r.stdin = t.stdin.clone();
            r.stdout = t.stdout.clone();
            r.stderr = t.stderr.clone();
            r.terminal = t.terminal;
            t.status()
        } else {
            let p = exec_of(&t, &req.exec_id)?;
            r.exec_id = req.exec_id.clone();
            r.stdin = p.io.stdin.clone();
            r.stdout = p.io.stdout.clone();
            r.stderr = p.io.stderr.clone();
            r.terminal = p.io.terminal;
            p.status()
        };
        r.pid = pid;
        r.status = status_of(status).into();
        if let Some(e) = exit {
            r.exit_status = e.status;
            r.exited_at = timestamp(e.at);
        }
        Ok(r)
    }

    fn pids(&self, _ctx: &TtrpcContext, req: api::PidsRequest) -> TtrpcResult<api::PidsResponse> {
        let t = self.inner.task(&req.id)?;
        let (status, pid, _) = t.status();
        let mut r = api::PidsResponse::new();
        if status != Status::Running {
            return Ok(r);
        }
        let pids = match &t.agent {
            // The guest pids of the task's processes (main and execs).
            Some(agent) => agent.pids().map_err(guest_err)?,
            None => vec![pid],
        };
        for pid in pids {
            let mut p = shim::protos::types::task::ProcessInfo::new();
            p.pid = pid;
            r.processes.push(p);
        }
        Ok(r)
    }

    fn exec(&self, _ctx: &TtrpcContext, req: api::ExecProcessRequest) -> TtrpcResult<api::Empty> {
        let t = self.inner.task(&req.id)?;
        let agent = t
            .agent
            .as_ref()
            .ok_or_else(|| builtin_unsupported(&t.id, "exec"))?;
        if t.status().0 != Status::Running {
            return Err(rpc_err(
                Code::FAILED_PRECONDITION,
                format!("task {}: not running", t.id),
            ));
        }
        let spec_json = req.spec.as_ref().map(|a| a.value.as_slice()).unwrap_or(b"");
        let spec: serde_json::Value = serde_json::from_slice(spec_json).map_err(|e| {
            rpc_err(
                Code::INVALID_ARGUMENT,
                format!("task {}: exec {}: spec: {e}", t.id, req.exec_id),
            )
        })?;
        let io = StdioPaths {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        agent.exec(&req.exec_id, io, spec).map_err(guest_err)?;
        let mut ev = TaskExecAdded::new();
        ev.container_id = req.id.clone();
        ev.exec_id = req.exec_id.clone();
        self.inner
            .publish(topics::TASK_EXEC_ADDED_EVENT_TOPIC, Box::new(ev));
        Ok(api::Empty::new())
    }

    fn resize_pty(
        &self,
        _ctx: &TtrpcContext,
        req: api::ResizePtyRequest,
    ) -> TtrpcResult<api::Empty> {
        let t = self.inner.task(&req.id)?;
        let agent = t
            .agent
            .as_ref()
            .ok_or_else(|| builtin_unsupported(&t.id, "a terminal"))?;
        let proc = if req.exec_id.is_empty() {
            agent.main()
        } else {
            exec_of(&t, &req.exec_id)?
        };
        agent
            .resize(&proc, req.width, req.height)
            .map_err(guest_err)?;
        Ok(api::Empty::new())
    }

    fn close_io(&self, _ctx: &TtrpcContext, req: api::CloseIORequest) -> TtrpcResult<api::Empty> {
        let t = self.inner.task(&req.id)?;
        // The built-in agent's app reads no stdin: nothing to close.
        let Some(agent) = &t.agent else {
            return Ok(api::Empty::new());
        };
        let proc = if req.exec_id.is_empty() {
            agent.main()
        } else {
            exec_of(&t, &req.exec_id)?
        };
        if req.stdin {
            proc.close_stdin();
        }
        Ok(api::Empty::new())
    }

    fn pause(&self, _ctx: &TtrpcContext, req: api::PauseRequest) -> TtrpcResult<api::Empty> {
        self.inner.task(&req.id)?;
        Err(rpc_err(
            Code::UNIMPLEMENTED,
            format!(
                "burstvm: task {}: pause is not supported (the VMM cannot pause its vCPUs; \
                 see docs/shim.md)",
                req.id
            ),
        ))
    }

    fn resume(&self, _ctx: &TtrpcContext, req: api::ResumeRequest) -> TtrpcResult<api::Empty> {
        self.inner.task(&req.id)?;
        Err(rpc_err(
            Code::UNIMPLEMENTED,
            format!(
                "burstvm: task {}: resume is not supported (nothing is ever paused)",
                req.id
            ),
        ))
    }

    fn checkpoint(
        &self,
        _ctx: &TtrpcContext,
        req: api::CheckpointTaskRequest,
    ) -> TtrpcResult<api::Empty> {
        self.inner.task(&req.id)?;
        Err(rpc_err(
            Code::UNIMPLEMENTED,
            format!(
                "burstvm: task {}: checkpoint is not supported (a microVM's state is not \
                 saved; templates are made before a sandbox runs, docs/templates.md)",
                req.id
            ),
        ))
    }

    fn update(&self, _ctx: &TtrpcContext, req: api::UpdateTaskRequest) -> TtrpcResult<api::Empty> {
        self.inner.task(&req.id)?;
        Err(rpc_err(
            Code::UNIMPLEMENTED,
            format!(
                "burstvm: task {}: update is not supported (the memory limit is the microVM's \
                 RAM and its CPU quota the sandbox cgroup's, both fixed at create)",
                req.id
            ),
        ))
    }

    fn stats(
        &self,
        _ctx: &TtrpcContext,
        req: api::StatsRequest,
    ) -> TtrpcResult<api::StatsResponse> {
        let t = self.inner.task(&req.id)?;
        let agent = t
            .agent
            .as_ref()
            .ok_or_else(|| builtin_unsupported(&t.id, "stats"))?;
        if t.status().0 != Status::Running {
            return Err(rpc_err(
                Code::FAILED_PRECONDITION,
                format!("task {}: not running", t.id),
            ));
        }
        let m = agent.metrics().map_err(guest_err)?;
        let mut r = api::StatsResponse::new();
        r.stats = MessageField::some(crate::guest::metrics_any(&m));
        Ok(r)
    }

    fn connect(
        &self,
        _ctx: &TtrpcContext,
        req: api::ConnectRequest,
    ) -> TtrpcResult<api::ConnectResponse> {
        let mut r = api::ConnectResponse::new();
        r.shim_pid = std::process::id();
        r.version = env!("CARGO_PKG_VERSION").into();
        if let Ok(t) = self.inner.task(&req.id) {
            r.task_pid = t.status().1;
        }
        Ok(r)
    }

    fn shutdown(&self, _ctx: &TtrpcContext, req: api::ShutdownRequest) -> TtrpcResult<api::Empty> {
        let tasks: Vec<Arc<Task>> = {
            let map = self.inner.tasks.lock().unwrap_or_else(|e| e.into_inner());
            if !map.is_empty() && !req.now {
                // containerd asks after each delete; the shim stays while tasks remain.
                return Ok(api::Empty::new());
            }
            map.values().cloned().collect()
        };
        for t in tasks {
            let _ = t.kill(libc::SIGKILL as u32);
            if let Err(e) = t.teardown(TEARDOWN_LIMIT) {
                tracing::warn!("shutdown of {}: {e}", self.inner.shim_id);
            }
        }
        self.inner.exit.signal();
        Ok(api::Empty::new())
    }
}
