//! containerd's runtime v2 task API (ttrpc, task API v2 of containerd 1.6)
//! over burstvm sandboxes. See docs/shim.md.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use containerd_shim as shim;
use shim::api;
use shim::protos::events::task::{TaskCreate, TaskDelete, TaskExit, TaskStart};
use shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use shim::protos::protobuf::MessageField;
use shim::protos::topics;
use shim::protos::ttrpc::{self, Code};
use shim::publisher::RemotePublisher;
use shim::{Config, DeleteResponse, ExitSignal, Flags, StartOpts, TtrpcContext, TtrpcResult};

use runtime::{HostServices, SandboxSpec, ServicesInfo};

use crate::config::{self, ShimConfig};
use crate::rootfs::{self, MountSpec};
use crate::spec::{Kind, Spec};
use crate::task::{Exit, KillError, OnExit, Record, Status, Task, TaskParams};

/// A teardown (VMM stop, CNI DEL, cgroup removal) must end within this.
const TEARDOWN_LIMIT: Duration = Duration::from_secs(30);
/// Publishing an event to containerd must not hang the shim.
const PUBLISH_TIMEOUT_NS: i64 = 5_000_000_000;

fn rpc_err(code: Code, msg: impl ToString) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg))
}

/// Why a task could not be created; `code` is its ttrpc status.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error("burstvm: a terminal is not supported")]
    Terminal,
    #[error("burstvm: checkpoints are not supported")]
    Checkpoint,
    #[error(transparent)]
    Spec(#[from] crate::spec::SpecError),
    #[error(
        "burstvm: container {container} in pod {pod}: a pod is one microVM running one app, \
         the pod sandbox's image (see docs/shim.md); containers inside a pod are not supported"
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
    Rootfs(#[from] rootfs::RootfsError),
    #[error("sandbox {sandbox}: host services: {source}")]
    Attach {
        sandbox: String,
        #[source]
        source: runtime::host::HostError,
    },
}

impl CreateError {
    pub fn code(&self) -> Code {
        match self {
            CreateError::PodContainer { .. } => Code::UNIMPLEMENTED,
            CreateError::Services(_) | CreateError::Attach { .. } => Code::FAILED_PRECONDITION,
            _ => Code::INVALID_ARGUMENT,
        }
    }
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
        .and_then(|i| runtime::cni::CniNetwork::load(&i.cni_config, i.cni_path.clone()).ok());
    if let (Some(ip), Some(i)) = (rec.guest_ip, &info) {
        let r = runtime::uplink::NeighborTable::open(&i.server_netns).and_then(|t| t.del(ip));
        match r {
            Ok(()) => done.push(format!("neighbour entry {ip}")),
            Err(e) => tracing::warn!("{e}"),
        }
    }
    match runtime::cgroup::Layout::detect() {
        Ok(layout) => done.extend(runtime::host::reap_sandbox(
            &layout,
            cni.as_ref(),
            &rec.sandbox_id,
            rec.owned_netns,
        )),
        Err(e) => tracing::warn!("{e}"),
    }
    let rootfs = bundle.join("rootfs");
    if rec.mounted && rootfs::is_mounted(&rootfs) && rootfs::unmount(&rootfs).is_ok() {
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

impl Inner {
    fn publish(&self, topic: &str, event: Box<dyn shim::protos::protobuf::MessageDyn>) {
        let p = self.publisher.lock().unwrap_or_else(|e| e.into_inner());
        let ctx = ttrpc::context::with_timeout(PUBLISH_TIMEOUT_NS);
        if let Err(e) = p.publish(ctx, topic, &self.namespace, event) {
            tracing::warn!("publish {topic}: {e}");
        }
    }

    fn task(&self, id: &str, exec_id: &str) -> TtrpcResult<Arc<Task>> {
        if !exec_id.is_empty() {
            return Err(rpc_err(
                Code::UNIMPLEMENTED,
                "burstvm: exec is not supported (the built-in agent runs one app)",
            ));
        }
        self.tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
            .ok_or_else(|| rpc_err(Code::NOT_FOUND, format!("task {id} not found")))
    }
}

#[derive(Clone)]
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
        if req.terminal {
            return Err(CreateError::Terminal);
        }
        if !req.checkpoint.is_empty() {
            return Err(CreateError::Checkpoint);
        }
        let spec = Spec::load(&bundle)?;
        let until_exit = match &spec.kind {
            Kind::PodSandbox => false,
            Kind::Task => true,
            Kind::PodContainer { sandbox } => {
                return Err(CreateError::PodContainer {
                    container: req.id.clone(),
                    pod: sandbox.clone(),
                })
            }
        };
        let (type_url, value) = req
            .options
            .as_ref()
            .map(|a| (a.type_url.as_str(), a.value.as_slice()))
            .unwrap_or(("", &[]));
        let cfg_path = config::config_path(type_url, value)?;
        let cfg = ShimConfig::load(&cfg_path)?;
        let variant = cfg.variant_for(&spec.annotations)?;
        let info = ServicesInfo::load(&cfg.services).map_err(CreateError::Services)?;
        let entry = spec.args.first().ok_or(CreateError::NoEntrypoint)?.clone();
        let sandbox = sandbox_id(&self.inner.namespace, &req.id);
        let netns = spec.netns.clone();
        // Recorded before anything exists, so that `shim delete` after a
        // crash removes whatever part was made.
        let rec = Record {
            sandbox_id: sandbox.clone(),
            // The sandbox makes its own netns (and runs CNI for a VF variant).
            owned_netns: netns.is_none(),
            mounted: !req.rootfs.is_empty(),
            services: cfg.services.clone(),
            guest_ip: None,
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
        let prepared = rootfs::prepare(&bundle, &mounts, &entry)?;
        let host = match HostServices::attach(info, bundle.clone(), bundle.join("trace.jsonl")) {
            Ok(h) => Box::leak(Box::new(h)),
            Err(source) => {
                if prepared.mounted {
                    let _ = rootfs::unmount(&prepared.rootfs);
                }
                return Err(CreateError::Attach {
                    sandbox: rec.sandbox_id,
                    source,
                });
            }
        };
        let params = TaskParams {
            id: req.id.clone(),
            bundle: bundle.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            // No rootfs: the RunD split from the snapshot is the seam of
            // rootfs.rs; today the entrypoint is the agent's app payload.
            spec: SandboxSpec {
                cpus: cfg.cpus,
                keep_running: true,
                ..SandboxSpec::new(sandbox, variant, cfg.memory_bytes(), cfg.timeout_secs)
            },
            netns,
            until_exit,
            prepared,
            trace_copy: cfg.trace_copy.clone(),
        };
        Ok(Arc::new(Task::new(host, params)))
    }

    fn on_exit(&self) -> Arc<OnExit> {
        let inner = Arc::clone(&self.inner);
        Arc::new(Box::new(move |t: &Task, e: &Exit, pid: u32| {
            let mut ev = TaskExit::new();
            ev.container_id = t.id.clone();
            ev.id = t.id.clone();
            ev.pid = pid;
            ev.exit_status = e.status;
            ev.exited_at = timestamp(e.at);
            inner.publish(topics::TASK_EXIT_EVENT_TOPIC, Box::new(ev));
        }))
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
                return Err(rpc_err(e.code(), e));
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
        let t = self.inner.task(&req.id, &req.exec_id)?;
        let limit = Duration::from_secs(t.timeout_secs.saturating_add(30));
        let pid = t
            .start(limit, self.on_exit())
            .map_err(|e| rpc_err(Code::UNKNOWN, e))?;
        let mut ev = TaskStart::new();
        ev.container_id = req.id.clone();
        ev.pid = pid;
        self.inner
            .publish(topics::TASK_START_EVENT_TOPIC, Box::new(ev));
        let mut r = api::StartResponse::new();
        r.pid = pid;
        Ok(r)
    }

    fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        let t = self.inner.task(&req.id, &req.exec_id)?;
        match t.kill(req.signal) {
            Ok(()) => Ok(api::Empty::new()),
            Err(KillError::Finished) => Err(rpc_err(
                Code::NOT_FOUND,
                format!("task {}: process already finished", req.id),
            )),
            Err(e) => Err(rpc_err(Code::UNKNOWN, format!("task {}: {e}", req.id))),
        }
    }

    fn wait(&self, _ctx: &TtrpcContext, req: api::WaitRequest) -> TtrpcResult<api::WaitResponse> {
        let t = self.inner.task(&req.id, &req.exec_id)?;
        let e = t.wait();
        let mut r = api::WaitResponse::new();
        r.exit_status = e.status;
        r.exited_at = timestamp(e.at);
        Ok(r)
    }

    fn delete(
        &self,
        _ctx: &TtrpcContext,
        req: api::DeleteRequest,
    ) -> TtrpcResult<api::DeleteResponse> {
        let t = self.inner.task(&req.id, &req.exec_id)?;
        let (_, pid, _) = t.status();
        let exit = t
            .delete(TEARDOWN_LIMIT)
            .map_err(|e| rpc_err(Code::FAILED_PRECONDITION, e))?;
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
        let mut r = api::DeleteResponse::new();
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
        let t = self.inner.task(&req.id, &req.exec_id)?;
        let (status, pid, exit) = t.status();
        let mut r = api::StateResponse::new();
        r.id = t.id.clone();
        r.bundle = t.bundle.display().to_string();
        r.pid = pid;
        r.status = match status {
            Status::Created | Status::Starting => api::Status::CREATED,
            Status::Running => api::Status::RUNNING,
            Status::Stopped => api::Status::STOPPED,
        }
        .into();
        r.stdout = t.stdout.clone();
        r.stderr = t.stderr.clone();
        if let Some(e) = exit {
            r.exit_status = e.status;
            r.exited_at = timestamp(e.at);
        }
        Ok(r)
    }

    fn pids(&self, _ctx: &TtrpcContext, req: api::PidsRequest) -> TtrpcResult<api::PidsResponse> {
        let t = self.inner.task(&req.id, "")?;
        let (status, pid, _) = t.status();
        let mut r = api::PidsResponse::new();
        if status == Status::Running {
            let mut p = shim::protos::types::task::ProcessInfo::new();
            p.pid = pid;
            r.processes.push(p);
        }
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
        if let Ok(t) = self.inner.task(&req.id, "") {
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
