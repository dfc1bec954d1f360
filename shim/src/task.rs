//! One task of the shim: a burstvm sandbox created through the runtime
//! library (`Sandbox::start_attached`), owned by a thread of its own. On the
//! built-in agent the task is the VMM (its exit status is the guest's); in a
//! Linux guest it is the bundle's OCI process under the guest agent
//! (`crate::guest`), and the VM ends with it.
//!
//! The VMM is forked on a keeper thread its `Sandbox` owns (`runtime::child`),
//! so its `PR_SET_PDEATHSIG` is tied to the sandbox's life (not to a ttrpc
//! worker that may exit), and to the shim process: a SIGKILLed shim takes its
//! VMMs with it.
//! What such a shim leaves (cgroup, own netns and CNI attachment, rootfs
//! mount) is named in `<bundle>/burstvm.json` and removed by `shim delete`,
//! which containerd runs after a shim dies.

use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use runtime::{Attach, HostServices, Sandbox, SandboxHost, SandboxSpec};
use serde::{Deserialize, Serialize};

use crate::bundle_rootfs::{self, GuestRootfs, Prepared};
use crate::guest::{Agent, GuestError, DRAIN_LIMIT};

/// After the main process of a Linux guest exited and `Shutdown` was sent,
/// the VMM has this long to exit before it is killed.
const VMM_EXIT_LIMIT: Duration = Duration::from_secs(20);

/// What `<bundle>/burstvm.json` records for `shim delete` after a crash.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Record {
    pub sandbox_id: String,
    /// The sandbox made its own netns and ran CNI itself (`ctr run`).
    pub owned_netns: bool,
    /// A pod's container: no sandbox of its own (its pod's record has it).
    #[serde(default)]
    pub member: bool,
    /// `<bundle>/rootfs` was mounted by the shim.
    pub mounted: bool,
    /// The services file, for the CNI config a cleanup needs.
    pub services: PathBuf,
    /// The guest's neighbour entry in the services' server netns (once started).
    #[serde(default)]
    pub guest_ip: Option<std::net::Ipv4Addr>,
    /// A Linux guest's state directory (`/run/burstvm/shim-<sandbox>`: the
    /// VMM's files, its vsock socket, the writable layers' mount).
    #[serde(default)]
    pub state_dir: Option<PathBuf>,
}

pub const RECORD: &str = "burstvm.json";

impl Record {
    pub fn write(&self, bundle: &Path) -> std::io::Result<()> {
        std::fs::write(
            bundle.join(RECORD),
            serde_json::to_vec(self).expect("record serializes"),
        )
    }

    pub fn read(bundle: &Path) -> Option<Record> {
        serde_json::from_slice(&std::fs::read(bundle.join(RECORD)).ok()?).ok()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Created,
    Starting,
    Running,
    Stopped,
}

#[derive(Debug, Clone)]
pub struct Exit {
    pub status: u32,
    /// Wall-clock seconds and nanoseconds (containerd's `exited_at`).
    pub at: (i64, u32),
}

#[derive(Debug)]
pub(crate) struct State {
    pub(crate) status: Status,
    /// The VMM's pid (built-in agent), the main process's in the guest (Linux).
    pub(crate) pid: u32,
    pub(crate) exit: Option<Exit>,
    /// A Linux guest's VMM, until it is reaped (signalled only under this lock).
    pub(crate) vmm_pid: Option<u32>,
}

enum Ctl {
    Teardown(mpsc::Sender<Result<(), runtime::sandbox::TeardownError>>),
}

/// Why a task operation failed; each names the task (or its sandbox).
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    #[error("task {task} is {status:?}, not created")]
    NotCreated { task: String, status: Status },
    #[error("task {task}: already started")]
    AlreadyStarted { task: String },
    #[error("task {task}: spawn sandbox thread: {source}")]
    Spawn {
        task: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{source}")]
    Start {
        task: String,
        #[source]
        source: runtime::SandboxFailure,
    },
    #[error("task {task}: sandbox {sandbox} not ready within {secs} s; cancelled")]
    StartTimeout {
        task: String,
        sandbox: String,
        secs: u64,
    },
    /// The sandbox thread ended without reporting its start.
    #[error("task {task}: sandbox {sandbox} thread ended before it started")]
    StartLost { task: String, sandbox: String },
    /// The sandbox is ready but its main process could not be started.
    #[error(transparent)]
    Guest(#[from] GuestError),
    #[error("task {task}: killed while starting")]
    Cancelled { task: String },
    #[error("task {task} is still running")]
    Running { task: String },
    #[error("{}", join(.0))]
    Teardown(Vec<TeardownError>),
    /// A pod's container could not be placed in the pod's VM.
    #[error(transparent)]
    Member(crate::pod::MemberError),
}

/// One part of a teardown that failed (a teardown tries every part).
#[derive(Debug, thiserror::Error)]
pub enum TeardownError {
    /// The runtime's teardown: every step of it that failed.
    #[error(transparent)]
    Sandbox(runtime::sandbox::TeardownError),
    #[error("sandbox {sandbox}: teardown timed out")]
    TimedOut { sandbox: String },
    #[error(transparent)]
    Unmount(#[from] bundle_rootfs::RootfsError),
}

fn join(errs: &[TeardownError]) -> String {
    errs.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// The parameters a task is created with.
#[derive(Debug)]
pub struct TaskParams {
    pub id: String,
    pub bundle: PathBuf,
    /// containerd's FIFOs (empty: none).
    pub stdin: String,
    pub stdout: String,
    pub stderr: String,
    pub terminal: bool,
    pub spec: SandboxSpec,
    /// The engine's netns (CRI), else the sandbox makes its own.
    pub netns: Option<PathBuf>,
    /// A standalone task ends with its guest; a pod sandbox stays up.
    pub until_exit: bool,
    pub prepared: Prepared,
    pub trace_copy: Option<PathBuf>,
    /// A Linux guest: what only that path has.
    pub linux: Option<LinuxParams>,
    /// A container of a pod: what only that path has (no sandbox of its own).
    pub member: Option<crate::pod::MemberParams>,
}

/// The Linux-guest part of a task's parameters.
#[derive(Debug)]
pub struct LinuxParams {
    /// The main process (config.json's `process`).
    pub process: agent_proto::Process,
    /// The sandbox's writable layers (a reflink of their template per sandbox).
    pub layers: ::rootfs::WritableLayers,
    /// Where the sandbox's files and the layers are (`Record::state_dir`).
    pub state_dir: PathBuf,
}

/// The shim's host services as its sandboxes see them: a Linux guest's
/// writable layers (`HostServices` has none of its own), and the guest's
/// neighbour entry recorded in `<bundle>/burstvm.json` *before* it is made,
/// so that `shim delete` after a crash in the middle of a start removes it.
struct ShimHost<'a> {
    services: &'a HostServices,
    layers: Option<&'a ::rootfs::WritableLayers>,
    bundle: &'a Path,
}

impl SandboxHost for ShimHost<'_> {
    fn bin(&self) -> &Path {
        self.services.bin()
    }
    fn trace_path(&self) -> &Path {
        self.services.trace_path()
    }
    fn state_dir(&self) -> &Path {
        self.services.state_dir()
    }
    fn interrupted(&self) -> bool {
        self.services.interrupted()
    }
    fn cgroup_for(
        &self,
        id: &str,
        limits: runtime::cgroup::Limits,
    ) -> Result<runtime::cgroup::Cgroup, runtime::cgroup::CgroupError> {
        self.services.cgroup_for(id, limits)
    }
    fn cni(&self) -> Option<&runtime::cni_exec::CniNetwork> {
        self.services.cni()
    }
    fn pool_socket(&self) -> Option<&Path> {
        self.services.pool_socket()
    }
    fn vf_socket(&self, vf_id: &str) -> Result<PathBuf, runtime::host::HostCallError> {
        self.services.vf_socket(vf_id)
    }
    fn addressing(&self) -> runtime::server_netns::Addressing {
        self.services.addressing()
    }
    fn add_neighbor(
        &self,
        ip: std::net::Ipv4Addr,
        mac: netutil::MacAddr,
    ) -> Result<(), runtime::host::HostCallError> {
        if let Some(mut rec) = Record::read(self.bundle) {
            rec.guest_ip = Some(ip);
            if let Err(e) = rec.write(self.bundle) {
                tracing::warn!("{}: {e}", self.bundle.join(RECORD).display());
            }
        }
        self.services.add_neighbor(ip, mac)
    }
    fn del_neighbor(&self, ip: std::net::Ipv4Addr) -> Result<(), runtime::host::HostCallError> {
        self.services.del_neighbor(ip)
    }
    fn writable_layers(&self) -> Option<&::rootfs::WritableLayers> {
        self.layers
    }
}

#[derive(Debug)]
pub struct Task {
    pub id: String,
    pub bundle: PathBuf,
    pub stdin: String,
    pub stdout: String,
    pub stderr: String,
    pub terminal: bool,
    pub sandbox_id: String,
    /// Seconds the guest may take to become ready.
    pub timeout_secs: u64,
    /// A Linux guest's agent side (its processes); None on the built-in agent.
    pub agent: Option<Arc<Agent>>,
    /// A Linux guest's pod sandbox: what its containers need of its VM.
    pub pod: Option<Arc<crate::pod::PodVm>>,
    /// A container of a pod (it runs in the pod's VM, `crate::pod`).
    pub(crate) member: Option<crate::pod::Member>,
    host: &'static HostServices,
    params: Mutex<Option<TaskParams>>,
    pub(crate) prepared_rootfs: Mutex<Option<(PathBuf, bool)>>,
    pub(crate) state: Mutex<State>,
    pub(crate) changed: Condvar,
    pub(crate) cancel: Arc<AtomicBool>,
    ctl: Mutex<Option<mpsc::Sender<Ctl>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// Called with the final status when a process of the task exits (the
/// VMM on the built-in agent; the main process or an exec in a Linux
/// guest): the task, the exec id ("" for the task itself), the exit and its
/// pid. Publishes TaskExit.
pub type OnExit = Box<dyn Fn(&Task, &str, &Exit, u32) + Send + Sync>;

pub fn now() -> (i64, u32) {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs() as i64, d.subsec_nanos())
}

/// A process status as a container exit status (128 + signal when killed).
pub(crate) fn exit_code(st: std::process::ExitStatus) -> u32 {
    use std::os::unix::process::ExitStatusExt;
    match (st.code(), st.signal()) {
        (Some(c), _) => c as u32,
        (None, Some(s)) => 128 + s as u32,
        _ => 255,
    }
}

impl Task {
    pub fn new(host: &'static HostServices, mut p: TaskParams) -> Task {
        let io = crate::guest::StdioPaths {
            stdin: p.stdin.clone(),
            stdout: p.stdout.clone(),
            stderr: p.stderr.clone(),
            terminal: p.terminal,
        };
        let member = p.member.take().map(crate::pod::Member::new);
        let agent = (p.linux.is_some() || member.is_some()).then(|| {
            // A pod's container runs in its own root at the pod's agent.
            let container = member.as_ref().map(|_| p.id.clone());
            Arc::new(Agent::in_container(
                &p.id,
                p.prepared.rootfs.clone(),
                io,
                container,
            ))
        });
        let pod = match (&p.linux, p.spec.pod_slots) {
            (Some(_), Some(n)) => Some(Arc::new(crate::pod::PodVm::new(n))),
            _ => None,
        };
        Task {
            agent,
            pod,
            member,
            id: p.id.clone(),
            bundle: p.bundle.clone(),
            stdin: p.stdin.clone(),
            stdout: p.stdout.clone(),
            stderr: p.stderr.clone(),
            terminal: p.terminal,
            sandbox_id: p.spec.id.clone(),
            timeout_secs: p.spec.timeout_secs,
            host,
            prepared_rootfs: Mutex::new(Some((p.prepared.rootfs.clone(), p.prepared.mounted))),
            params: Mutex::new(Some(p)),
            state: Mutex::new(State {
                status: Status::Created,
                pid: 0,
                exit: None,
                vmm_pid: None,
            }),
            changed: Condvar::new(),
            cancel: Arc::new(AtomicBool::new(false)),
            ctl: Mutex::new(None),
            thread: Mutex::new(None),
        }
    }

    /// A Linux guest's process that never ran: the task ends with 137 when
    /// it was killed while starting, 127 when the program could not be
    /// spawned, else 1, and so do its other processes.
    pub(crate) fn start_failed(&self, agent: &Agent, err: &TaskError) -> Exit {
        let code = match err {
            TaskError::Cancelled { .. } => 137,
            TaskError::Guest(e) if e.is_spawn_failure() => 127,
            _ => 1,
        };
        let e = {
            let mut s = self.lock();
            self.finish(&mut s, code)
        };
        agent.release(code);
        e
    }

    /// Created → Starting, taking what the start needs out of `what` (once).
    pub(crate) fn begin_start<T>(&self, what: &Mutex<Option<T>>) -> Result<T, TaskError> {
        let mut s = self.lock();
        if s.status != Status::Created {
            return Err(TaskError::NotCreated {
                task: self.id.clone(),
                status: s.status,
            });
        }
        s.status = Status::Starting;
        what.lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| TaskError::AlreadyStarted {
                task: self.id.clone(),
            })
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn status(&self) -> (Status, u32, Option<Exit>) {
        let s = self.lock();
        (s.status, s.pid, s.exit.clone())
    }

    pub(crate) fn finish(&self, s: &mut State, status: u32) -> Exit {
        let e = Exit { status, at: now() };
        s.status = Status::Stopped;
        s.exit = Some(e.clone());
        self.changed.notify_all();
        e
    }

    /// Creates the sandbox (every startup stage through READY) on the task's
    /// own thread; returns the VMM's pid, or why it failed. Waits at most
    /// `limit`; a start that takes longer is cancelled.
    pub fn start(
        self: &Arc<Task>,
        limit: Duration,
        on_exit: Arc<OnExit>,
    ) -> Result<u32, TaskError> {
        if self.member.is_some() {
            return self.start_member(on_exit);
        }
        let params = self.begin_start(&self.params)?;
        let (start_tx, start_rx) = mpsc::channel::<Result<u32, TaskError>>();
        let (ctl_tx, ctl_rx) = mpsc::channel::<Ctl>();
        *self.ctl.lock().unwrap_or_else(|e| e.into_inner()) = Some(ctl_tx);
        let task = Arc::clone(self);
        let handle = std::thread::Builder::new()
            .name(format!("sandbox-{}", self.sandbox_id))
            .spawn(move || task.run(params, start_tx, ctl_rx, on_exit))
            .map_err(|source| TaskError::Spawn {
                task: self.id.clone(),
                source,
            })?;
        *self.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        match start_rx.recv_timeout(limit) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                self.cancel.store(true, Ordering::SeqCst);
                Err(TaskError::StartTimeout {
                    task: self.id.clone(),
                    sandbox: self.sandbox_id.clone(),
                    secs: limit.as_secs(),
                })
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(TaskError::StartLost {
                task: self.id.clone(),
                sandbox: self.sandbox_id.clone(),
            }),
        }
    }

    /// The sandbox thread: start, serve the task until it exits, tear down on request.
    fn run(
        self: Arc<Task>,
        p: TaskParams,
        start_tx: mpsc::Sender<Result<u32, TaskError>>,
        ctl_rx: mpsc::Receiver<Ctl>,
        on_exit: Arc<OnExit>,
    ) {
        let TaskParams {
            spec,
            netns,
            until_exit,
            prepared,
            trace_copy,
            linux,
            ..
        } = p;
        let (layers, process, state_dir) = match linux {
            Some(l) => (Some(l.layers), Some(l.process), Some(l.state_dir)),
            None => (None, None, None),
        };
        // Declared first, dropped last: after the sandbox and the layers.
        let state_dir = StateDir(state_dir);
        let host = ShimHost {
            services: self.host,
            layers: layers.as_ref(),
            bundle: &self.bundle,
        };
        let cancel = Some(Arc::clone(&self.cancel));
        let attach = match &prepared.guest {
            GuestRootfs::AppPayload(app) => Attach {
                netns,
                app_file: Some(app.clone()),
                until_exit,
                stdout: relay_stdout(&self.stdout),
                cancel,
            },
            // The container's stdout is its process's; the VMM's goes nowhere.
            GuestRootfs::Image { .. } => Attach {
                netns,
                until_exit: true,
                cancel,
                ..Attach::default()
            },
        };
        let sb = match Sandbox::start_attached(&host, spec, attach) {
            Ok(sb) => sb,
            Err(f) => {
                write_fifo(
                    &self.stderr,
                    format!("burstvm: {}\n", crate::describe(&f)).as_bytes(),
                );
                let mut s = self.lock();
                let code = if self.cancel.load(Ordering::SeqCst) {
                    137
                } else {
                    1
                };
                let e = self.finish(&mut s, code);
                drop(s);
                if let Some(a) = &self.agent {
                    a.release(code);
                }
                let _ = start_tx.send(Err(TaskError::Start {
                    task: self.id.clone(),
                    source: f,
                }));
                on_exit(&self, "", &e, 0);
                return;
            }
        };
        if let Some(copy) = &trace_copy {
            copy_trace(self.host, &self.sandbox_id, copy);
        }
        let mut sb = sb;
        match (&self.agent, process, &self.pod) {
            (Some(agent), _, Some(pod)) => self.serve_pod(&mut sb, pod, agent, &start_tx, &on_exit),
            (Some(agent), Some(process), None) => {
                self.serve_container(&mut sb, agent, process, &start_tx, &on_exit)
            }
            _ => self.serve_app(&mut sb, &start_tx, &on_exit),
        }
        if let Ok(Ctl::Teardown(reply)) = ctl_rx.recv() {
            let r = sb.teardown();
            // The layers go after the VMM that held one of them; all of it
            // before the reply.
            drop(sb);
            drop(layers);
            drop(state_dir);
            let _ = reply.send(r);
        }
    }

    /// The built-in agent: the task is the VMM; its status is the task's.
    fn serve_app(
        &self,
        sb: &mut Sandbox<'_>,
        start_tx: &mpsc::Sender<Result<u32, TaskError>>,
        on_exit: &OnExit,
    ) {
        let pid = sb.vmm_pid().unwrap_or(0);
        {
            let mut s = self.lock();
            s.status = Status::Running;
            s.pid = pid;
        }
        let _ = start_tx.send(Ok(pid));
        // Wait without reaping, so that a concurrent kill never signals a
        // recycled pid: the VMM is reaped below under the state lock.
        wait_exited(pid);
        let e = {
            let mut s = self.lock();
            let code = sb.wait_status().map(exit_code).unwrap_or(255);
            self.finish(&mut s, code)
        };
        write_fifo(&self.stderr, sb.vmm_stderr().as_bytes());
        on_exit(self, "", &e, pid);
    }

    /// A Linux guest: the main process is created, started and waited for
    /// through the agent; after it exited and its output drained, the agent
    /// powers the guest off and the VMM exits.
    fn serve_container(
        &self,
        sb: &mut Sandbox<'_>,
        agent: &Arc<Agent>,
        process: agent_proto::Process,
        start_tx: &mpsc::Sender<Result<u32, TaskError>>,
        on_exit: &OnExit,
    ) {
        let vmm_pid = sb.vmm_pid().unwrap_or(0);
        self.lock().vmm_pid = Some(vmm_pid);
        agent.ready(
            sb.vsock_path()
                .expect("a sandbox with the agent's initramfs serves vsock")
                .to_path_buf(),
        );
        let main = agent.main();
        let cancelled = || {
            self.cancel
                .load(Ordering::SeqCst)
                .then(|| TaskError::Cancelled {
                    task: self.id.clone(),
                })
        };
        let started = (|| -> Result<u32, TaskError> {
            if let Some(e) = cancelled() {
                return Err(e);
            }
            agent.launch(&main, process, true)?;
            if let Some(e) = cancelled() {
                return Err(e);
            }
            Ok(agent.start(&main)?)
        })();
        let pid = match started {
            Ok(pid) => {
                let mut s = self.lock();
                s.status = Status::Running;
                s.pid = pid;
                drop(s);
                let _ = start_tx.send(Ok(pid));
                // Killed (or the start given up) while it was being started:
                // a kill in `Starting` only set the flag.
                if self.cancel.load(Ordering::SeqCst) {
                    let _ = agent.signal(&main, libc::SIGKILL as u32);
                }
                pid
            }
            Err(err) => {
                agent.shutdown();
                self.reap_vmm(sb, vmm_pid);
                // The VMM's account too: a guest that failed says why there.
                write_fifo(
                    &self.stderr,
                    format!("burstvm: {}\n{}", crate::describe(&err), sb.vmm_stderr()).as_bytes(),
                );
                let e = self.start_failed(agent, &err);
                let _ = start_tx.send(Err(err));
                on_exit(self, "", &e, 0);
                return;
            }
        };
        let waited = agent.wait_exit(&main);
        // Its output first, then the power-off: the guest's last bytes are
        // in its vsock queues until the streams reach EOF.
        main.drain(DRAIN_LIMIT);
        agent.shutdown();
        let vmm_code = self.reap_vmm(sb, vmm_pid);
        let status = match &waited {
            Ok(x) => x.status.max(0) as u32,
            Err(err) => {
                write_fifo(
                    &self.stderr,
                    format!("burstvm: {}\n{}", crate::describe(err), sb.vmm_stderr()).as_bytes(),
                );
                vmm_code
            }
        };
        // The VMM is gone: every stream is closed, the pumps end.
        main.drain(Duration::from_secs(2));
        main.finish(status);
        let e = {
            let mut s = self.lock();
            self.finish(&mut s, status)
        };
        for (p, pe) in agent.release(128 + libc::SIGKILL as u32) {
            let (_, ppid, _) = p.status();
            on_exit(self, &p.exec_id, &pe, ppid);
        }
        on_exit(self, "", &e, pid);
    }

    /// Waits (bounded) for a Linux guest's VMM to exit after `Shutdown`,
    /// kills it if it does not, and reaps it; its status as a task's.
    fn reap_vmm(&self, sb: &mut Sandbox<'_>, vmm_pid: u32) -> u32 {
        if !wait_exited_for(vmm_pid, VMM_EXIT_LIMIT) {
            tracing::warn!(
                "sandbox {}: VMM {vmm_pid} still running {} s after Shutdown; killed",
                self.sandbox_id,
                VMM_EXIT_LIMIT.as_secs()
            );
            {
                let _s = self.lock();
                // SAFETY: kill(2) on our VMM child, not reaped yet (reaped only below).
                unsafe { libc::kill(vmm_pid as i32, libc::SIGKILL) };
            }
            wait_exited(vmm_pid);
        }
        let mut s = self.lock();
        s.vmm_pid = None;
        sb.wait_status().map(exit_code).unwrap_or(255)
    }

    /// A task's kill: SIGTERM stops the VMM gracefully (it closes its devices
    /// and exits), SIGKILL at once; a start in progress is cancelled.
    pub fn kill(&self, signal: u32) -> Result<(), KillError> {
        let mut s = self.lock();
        // A pod's VM is its task (below); its containers are tasks of their own.
        let agent = self.agent.as_ref().filter(|_| self.pod.is_none());
        if let (Status::Running, Some(agent)) = (s.status, agent) {
            // The main process in the guest; the VM ends with it.
            drop(s);
            return match agent.signal(&agent.main(), signal) {
                Ok(()) => Ok(()),
                Err(e) if e.is_not_found() => Err(KillError::Finished),
                Err(e) => match self.lock().vmm_pid {
                    // The agent is unreachable: SIGKILL ends the VM itself.
                    Some(pid) if signal == libc::SIGKILL as u32 => {
                        // SAFETY: kill(2) on our VMM child; it is reaped only under this lock.
                        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                        Ok(())
                    }
                    _ => Err(KillError::Agent(e)),
                },
            };
        }
        match s.status {
            Status::Created => {
                self.finish(&mut s, 128 + signal);
                Ok(())
            }
            Status::Starting => {
                self.cancel.store(true, Ordering::SeqCst);
                Ok(())
            }
            Status::Running => {
                // SAFETY: kill(2) on our VMM child; it is reaped only under this lock.
                if unsafe { libc::kill(s.pid as i32, signal as i32) } < 0 {
                    return Err(KillError::Os(std::io::Error::last_os_error()));
                }
                Ok(())
            }
            Status::Stopped => Err(KillError::Finished),
        }
    }

    /// Blocks until the task has stopped.
    pub fn wait(&self) -> Exit {
        let mut s = self.lock();
        loop {
            if let Some(e) = &s.exit {
                return e.clone();
            }
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Tears the sandbox down (within `limit`) and unmounts the rootfs.
    /// Refused while the task runs.
    pub fn delete(&self, limit: Duration) -> Result<Exit, TaskError> {
        let exit = {
            let mut s = self.lock();
            match s.status {
                Status::Running | Status::Starting => {
                    return Err(TaskError::Running {
                        task: self.id.clone(),
                    })
                }
                Status::Created => self.finish(&mut s, 128 + libc::SIGKILL as u32),
                Status::Stopped => s.exit.clone().expect("stopped has an exit"),
            }
        };
        self.teardown(limit)?;
        Ok(exit)
    }

    /// Sandbox teardown and rootfs unmount; also for a shim shutting down.
    pub fn teardown(&self, limit: Duration) -> Result<(), TaskError> {
        self.cancel.store(true, Ordering::SeqCst);
        let mut errs = Vec::new();
        // Never started: its writable layers and state directory go here.
        if let Some(p) = self.params.lock().unwrap_or_else(|e| e.into_inner()).take() {
            if let Some(l) = p.linux {
                drop(l.layers);
                remove_state_dir(&l.state_dir);
            }
        }
        if self.member.is_some() {
            self.teardown_member();
        }
        if let Some(a) = &self.agent {
            a.release(128 + libc::SIGKILL as u32);
        }
        if let Some(ctl) = self.ctl.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let (tx, rx) = mpsc::channel();
            if ctl.send(Ctl::Teardown(tx)).is_ok() {
                match rx.recv_timeout(limit) {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => errs.push(TeardownError::Sandbox(e)),
                    // The thread ended (start failed: its sandbox was torn down on drop).
                    Err(mpsc::RecvTimeoutError::Disconnected) => {}
                    Err(mpsc::RecvTimeoutError::Timeout) => errs.push(TeardownError::TimedOut {
                        sandbox: self.sandbox_id.clone(),
                    }),
                }
            }
        }
        if let Some(h) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            if h.is_finished() {
                let _ = h.join();
            }
        }
        if let Some((rootfs, true)) = self
            .prepared_rootfs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            if let Err(e) = bundle_rootfs::unmount(&rootfs) {
                errs.push(e.into());
            }
        }
        let _ = std::fs::remove_file(self.bundle.join(RECORD));
        if errs.is_empty() {
            Ok(())
        } else {
            Err(TaskError::Teardown(errs))
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KillError {
    #[error("process already finished")]
    Finished,
    #[error("kill: {0}")]
    Os(#[source] std::io::Error),
    #[error("kill: {0}")]
    Agent(#[source] GuestError),
}

/// Whether `pid` exited within `limit` (left unreaped; polls waitid WNOHANG|WNOWAIT).
fn wait_exited_for(pid: u32, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        // SAFETY: siginfo is plain data filled by waitid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own child with a valid siginfo pointer.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT | libc::WNOHANG,
            )
        };
        // SAFETY: si_pid is valid for a waitid result (0 when nothing changed).
        if r < 0 || unsafe { info.si_pid() } != 0 {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A Linux guest's state directory, removed on drop (once its sandbox and
/// layers are gone; the layers' mount first, should it still be there).
struct StateDir(Option<PathBuf>);

impl Drop for StateDir {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            remove_state_dir(&dir);
        }
    }
}

/// Removes a Linux guest's state directory (`Record::state_dir`).
pub fn remove_state_dir(dir: &Path) {
    ::rootfs::layers::reap(&dir.join("layers"));
    if ::rootfs::layers::is_mounted(&dir.join("layers/mnt")) {
        return; // never remove files under a live mount
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Blocks until `pid` has exited, leaving it unreaped (waitid WNOWAIT).
pub(crate) fn wait_exited(pid: u32) {
    loop {
        // SAFETY: siginfo is plain data filled by waitid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own child with a valid siginfo pointer.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return;
        }
    }
}

/// Appends the sandbox's trace lines to `to` in one write (O_APPEND), so
/// that concurrent shims' lines never interleave within a line.
fn copy_trace(host: &HostServices, sandbox: &str, to: &Path) {
    use runtime::SandboxHost;
    let Ok(evs) = trace::read_trace(host.trace_path()) else {
        return;
    };
    let mut buf = String::new();
    for e in evs.iter().filter(|e| e.sandbox == sandbox) {
        buf.push_str(&serde_json::to_string(e).expect("event serializes"));
        buf.push('\n');
    }
    let r = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(to)
        .and_then(|mut f| f.write_all(buf.as_bytes()));
    if let Err(e) = r {
        tracing::warn!("trace copy {}: {e}", to.display());
    }
}

/// Opens a task's output FIFO for writing without ever blocking: the
/// reader (ctr, the CRI plugin) opened it before Create; data is dropped
/// when nobody reads or the pipe is full, never stalling the VMM.
fn open_fifo(path: &str) -> Option<std::fs::File> {
    if path.is_empty() {
        return None;
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
        {
            Ok(f) => return Some(f),
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => {
                tracing::warn!("task output {path}: {e}");
                return None;
            }
        }
    }
}

fn write_fifo(path: &str, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    if let Some(mut f) = open_fifo(path) {
        let _ = f.write_all(data);
    }
}

/// A pipe for the VMM's stdout whose far end a thread copies to the task's
/// stdout FIFO (containerd's `io`).
fn relay_stdout(fifo: &str) -> Option<OwnedFd> {
    let out = open_fifo(fifo)?;
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two new descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return None;
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    std::thread::Builder::new()
        .name("stdout-relay".into())
        .spawn(move || {
            let mut r = std::fs::File::from(r);
            let mut out = out;
            let mut buf = [0u8; 4096];
            loop {
                match std::io::Read::read(&mut r, &mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        // EAGAIN (nobody reading, pipe full): drop, never block the VMM.
                        let _ = out.write(&buf[..n]);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        })
        .ok()?;
    Some(w)
}
