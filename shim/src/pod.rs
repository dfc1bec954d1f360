//! Pods as Kata runs them (docs/shim.md, "Pods"): the CRI pod sandbox is
//! the microVM (a Linux guest whose agent runs in pod mode and whose pause
//! container runs no process), each CRI container of the pod a process in
//! that VM with its own root.
//!
//! A container's image is not known when the pod's VM boots, so the VM
//! boots with empty disk slots (`SandboxSpec::pod_slots`). Starting a
//! container inserts its EROFS image (built from the snapshotter's layers,
//! cached by the image's chain) into a free slot through the VMM's control
//! socket (as Firecracker's drive update), asks the agent to mount it as the
//! container's root with a writable layer of its own, then creates and
//! starts its process there. Deleting the container unmounts the root and
//! ejects the image, which frees the slot for the next container.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use runtime::Sandbox;

use crate::guest::{Agent, DRAIN_LIMIT};
use crate::task::{OnExit, Status, Task, TaskError};

/// Calls on the VMM's control socket must end within this.
const API_TIMEOUT: Duration = Duration::from_secs(10);

/// What a pod's containers need of its VM, known once it is ready.
#[derive(Debug)]
pub struct PodVm {
    vsock: OnceLock<PathBuf>,
    api: OnceLock<PathBuf>,
    /// The container holding each disk slot.
    slots: Mutex<Vec<Option<String>>>,
}

impl PodVm {
    pub fn new(slots: u8) -> PodVm {
        PodVm {
            vsock: OnceLock::new(),
            api: OnceLock::new(),
            slots: Mutex::new(vec![None; slots as usize]),
        }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<Option<String>>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A free slot for `container`, or None when all are taken.
    fn claim(&self, container: &str) -> Option<u8> {
        let mut slots = self.slots();
        let i = slots.iter().position(Option::is_none)?;
        slots[i] = Some(container.to_string());
        Some(i as u8)
    }

    fn release(&self, i: u8) {
        if let Some(s) = self.slots().get_mut(i as usize) {
            *s = None;
        }
    }
}

/// What a pod's container is created with.
#[derive(Debug)]
pub struct MemberParams {
    /// The pod sandbox's task (in this shim: one shim per pod).
    pub pod: Arc<Task>,
    /// The container's process (config.json's, resolved against its image).
    pub process: agent_proto::Process,
    /// Its EROFS image (held: the cache entry stays in use while it runs).
    pub image: Arc<::rootfs::Image>,
}

/// A pod's container, as its task keeps it.
#[derive(Debug)]
pub struct Member {
    pod_id: String,
    pod: Arc<PodVm>,
    process: Mutex<Option<agent_proto::Process>>,
    image: Arc<::rootfs::Image>,
    /// The disk slot its image is in, while it is.
    slot: Mutex<Option<u8>>,
}

impl Member {
    pub fn new(p: MemberParams) -> Member {
        Member {
            pod_id: p.pod.id.clone(),
            pod: Arc::clone(
                p.pod
                    .pod
                    .as_ref()
                    .expect("checked by the caller: a Linux pod"),
            ),
            process: Mutex::new(Some(p.process)),
            image: p.image,
            slot: Mutex::new(None),
        }
    }
}

/// Why a pod's container could not start.
#[derive(Debug, thiserror::Error)]
pub enum MemberError {
    #[error("container {task}: pod {pod} is not running")]
    PodNotRunning { task: String, pod: String },
    #[error(
        "container {task}: pod {pod} has no free disk slot (all {slots} hold containers; \
         shim.json pod_slots)"
    )]
    NoSlot {
        task: String,
        pod: String,
        slots: usize,
    },
    #[error("container {task}: {source}")]
    Api {
        task: String,
        #[source]
        source: vmm::api::ApiError,
    },
}

impl Task {
    /// A Linux guest's pod sandbox: the VM is the task (its pid the VMM's);
    /// it runs until it is killed or its agent powers it off.
    pub(crate) fn serve_pod(
        &self,
        sb: &mut Sandbox<'_>,
        pod: &PodVm,
        agent: &Arc<Agent>,
        start_tx: &std::sync::mpsc::Sender<Result<u32, TaskError>>,
        on_exit: &OnExit,
    ) {
        let vmm_pid = sb.vmm_pid().unwrap_or(0);
        if let Some(v) = sb.vsock_path() {
            agent.ready(v.to_path_buf());
            let _ = pod.vsock.set(v.to_path_buf());
        }
        if let Some(a) = sb.api_path() {
            let _ = pod.api.set(a.to_path_buf());
        }
        {
            let mut s = self.lock();
            s.status = Status::Running;
            s.pid = vmm_pid;
        }
        let _ = start_tx.send(Ok(vmm_pid));
        if self.cancel.load(Ordering::SeqCst) {
            let _s = self.lock();
            // SAFETY: kill(2) on our VMM child, reaped only below under this lock.
            unsafe { libc::kill(vmm_pid as i32, libc::SIGKILL) };
        }
        // Reaped under the state lock, so a kill never hits a recycled pid.
        crate::task::wait_exited(vmm_pid);
        let e = {
            let mut s = self.lock();
            let code = sb.wait_status().map(crate::task::exit_code).unwrap_or(255);
            self.finish(&mut s, code)
        };
        agent.release(128 + libc::SIGKILL as u32);
        on_exit(self, "", &e, vmm_pid);
    }

    /// A pod's container: its image into a free slot of the pod's VM, its
    /// root mounted, its process created and started; a thread waits for it.
    pub(crate) fn start_member(self: &Arc<Task>, on_exit: Arc<OnExit>) -> Result<u32, TaskError> {
        let m = self.member.as_ref().expect("start_member of a member");
        let agent = Arc::clone(self.agent.as_ref().expect("a member has an agent"));
        let process = self.begin_start(&m.process)?;
        let main = agent.main();
        let started = (|| -> Result<u32, TaskError> {
            let not_running = || MemberError::PodNotRunning {
                task: self.id.clone(),
                pod: m.pod_id.clone(),
            };
            let (vsock, api) = match (m.pod.vsock.get(), m.pod.api.get()) {
                (Some(v), Some(a)) => (v.clone(), a.clone()),
                _ => return Err(not_running().into()),
            };
            agent.ready(vsock);
            let slot = m.pod.claim(&self.id).ok_or_else(|| MemberError::NoSlot {
                task: self.id.clone(),
                pod: m.pod_id.clone(),
                slots: m.pod.slots().len(),
            })?;
            *m.slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(slot);
            let api_err = |source| MemberError::Api {
                task: self.id.clone(),
                source,
            };
            vmm::api::Client::connect(&api, API_TIMEOUT)
                .and_then(|mut c| c.insert_disk(&runtime::pod_slot(slot), &m.image.path))
                .map_err(api_err)?;
            agent.mount_container(&runtime::pod_slot(slot))?;
            if self.cancel.load(Ordering::SeqCst) {
                return Err(TaskError::Cancelled {
                    task: self.id.clone(),
                });
            }
            agent.launch(&main, process, false)?;
            Ok(agent.start(&main)?)
        })();
        let pid = match started {
            Ok(pid) => pid,
            Err(err) => {
                let e = self.start_failed(&agent, &err);
                on_exit(self, "", &e, 0);
                return Err(err);
            }
        };
        {
            let mut s = self.lock();
            s.status = Status::Running;
            s.pid = pid;
        }
        if self.cancel.load(Ordering::SeqCst) {
            let _ = agent.signal(&main, libc::SIGKILL as u32);
        }
        let task = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name(format!("ctr-{}", &self.id[..self.id.len().min(11)]))
            .spawn(move || task.wait_member(&agent, pid, &on_exit));
        if let Err(e) = spawned {
            tracing::warn!("container {}: waiter thread: {e}", self.id);
        }
        Ok(pid)
    }

    fn wait_member(&self, agent: &Agent, pid: u32, on_exit: &OnExit) {
        let main = agent.main();
        let status = match agent.wait_exit(&main) {
            Ok(x) => x.status.max(0) as u32,
            // The pod's VM went away under it: killed with it.
            Err(e) => {
                tracing::warn!("{e}");
                128 + libc::SIGKILL as u32
            }
        };
        main.drain(DRAIN_LIMIT);
        main.finish(status);
        let e = {
            let mut s = self.lock();
            self.finish(&mut s, status)
        };
        on_exit(self, "", &e, pid);
    }

    /// A container's part of a teardown: its root unmounted in the guest
    /// (what still runs there killed), its image ejected, its slot freed.
    /// Best effort: a pod's VM that is gone took all of it along.
    pub(crate) fn teardown_member(&self) {
        let Some(m) = &self.member else { return };
        let Some(slot) = m.slot.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return;
        };
        let agent = self.agent.as_ref().expect("a member has an agent");
        let unmounted = match agent.unmount_container() {
            Ok(()) => true,
            Err(e) if e.is_not_found() => true,
            Err(e) => {
                tracing::warn!("{}", crate::describe(&e));
                false
            }
        };
        if let Some(api) = m.pod.api.get() {
            // Media mounted in the guest are never pulled from under it.
            if unmounted {
                let r = vmm::api::Client::connect(api, API_TIMEOUT)
                    .and_then(|mut c| c.eject_disk(&runtime::pod_slot(slot)));
                match r {
                    Ok(_) => m.pod.release(slot),
                    Err(e) => tracing::warn!("container {}: {}", self.id, crate::describe(&e)),
                }
            }
        }
    }
}

impl From<MemberError> for TaskError {
    fn from(e: MemberError) -> TaskError {
        TaskError::Member(e)
    }
}
