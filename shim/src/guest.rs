//! The agent side of a task in a Linux guest (docs/shim.md, "Two guests"):
//! the bundle's OCI process and exec'd processes run under the guest agent,
//! driven over the VMM's vsock socket with `agent_proto::Client`, and
//! containerd's stdio FIFOs are pumped to and from the agent's streams.
//!
//! One control connection serves short requests (create, start, signal,
//! resize, list, stats, shutdown) under a lock; each wait has a connection
//! of its own, since `WaitProcess` blocks its connection. A request that
//! fails in transport drops the control connection; the next one reconnects.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use agent_proto::{Client, ClientError, CreateProcess, ErrorCode, Process, StreamKind};
use shim_protos::cgroups::metrics;
use shim_protos::protobuf::{Message, MessageField};

use containerd_shim::protos as shim_protos;

use crate::task::{now, Exit, Status};

/// How long an output FIFO may take to get its reader (ctr and the CRI
/// plugin open theirs before Create); after that the output is discarded.
const FIFO_OPEN_LIMIT: Duration = Duration::from_secs(10);
/// How long a process's output may take to drain after it exited (a
/// background child can hold stdout open for ever).
pub const DRAIN_LIMIT: Duration = Duration::from_secs(5);
/// containerd's type for cgroup v1 metrics, the one `Stats` answers with.
pub const METRICS_TYPE: &str = "io.containerd.cgroups.v1.Metrics";

/// Why an agent-side operation failed; each names the task and process.
#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    #[error("task {task}: process {process}: {step}")]
    Agent {
        task: String,
        process: String,
        step: &'static str,
        #[source]
        source: Box<ClientError>,
    },
    #[error("task {task}: the guest agent is not serving yet (the task is not running)")]
    NotReady { task: String },
    #[error("task {task}: exec {exec} exists")]
    ExecExists { task: String, exec: String },
    #[error("task {task}: exec {exec} not found")]
    NoExec { task: String, exec: String },
    #[error("task {task}: exec {exec} is {status:?}")]
    ExecState {
        task: String,
        exec: String,
        status: Status,
    },
    #[error("task {task}: exec {exec}: spec: {source}")]
    ExecSpec {
        task: String,
        exec: String,
        #[source]
        source: crate::spec::ParseError,
    },
}

impl GuestError {
    /// The agent could not start the program (not found, not executable,
    /// its cwd or user steps failed).
    pub fn is_spawn_failure(&self) -> bool {
        matches!(self, GuestError::Agent { source, .. }
            if source.agent_code() == Some(ErrorCode::Spawn))
    }

    /// The process is gone or never ran (containerd's NotFound).
    pub fn is_not_found(&self) -> bool {
        match self {
            GuestError::NoExec { .. } => true,
            GuestError::Agent { source, .. } => matches!(
                source.agent_code(),
                Some(ErrorCode::NotFound) | Some(ErrorCode::State)
            ),
            _ => false,
        }
    }
}

/// The stdio of a process as containerd gives it (FIFO paths; empty: none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StdioPaths {
    pub stdin: String,
    pub stdout: String,
    pub stderr: String,
    pub terminal: bool,
}

#[derive(Debug)]
struct ProcState {
    status: Status,
    pid: u32,
    exit: Option<Exit>,
    /// The write end of the agent's stdin (or pty) stream, for CloseIO.
    stdin: Option<UnixStream>,
}

/// A count of running output pumps, waited for with a bound.
#[derive(Debug, Clone, Default)]
struct Pumps(Arc<(Mutex<usize>, Condvar)>);

impl Pumps {
    fn add(&self) {
        *self.0 .0.lock().unwrap_or_else(|e| e.into_inner()) += 1;
    }
    fn done(&self) {
        *self.0 .0.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        self.0 .1.notify_all();
    }
    /// Whether every pump ended within `limit`.
    fn wait(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut n = self.0 .0.lock().unwrap_or_else(|e| e.into_inner());
        while *n > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            n = self
                .0
                 .1
                .wait_timeout(n, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}

/// One process of the task in the guest: the main one (exec id "") or an exec.
#[derive(Debug)]
pub struct Proc {
    pub exec_id: String,
    /// Its id at the agent: the container id, or `exec:<exec id>`.
    pub agent_id: String,
    pub io: StdioPaths,
    st: Mutex<ProcState>,
    changed: Condvar,
    pumps: Pumps,
}

impl Proc {
    fn new(exec_id: &str, agent_id: String, io: StdioPaths) -> Proc {
        Proc {
            exec_id: exec_id.to_string(),
            agent_id,
            io,
            st: Mutex::new(ProcState {
                status: Status::Created,
                pid: 0,
                exit: None,
                stdin: None,
            }),
            changed: Condvar::new(),
            pumps: Pumps::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, ProcState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn status(&self) -> (Status, u32, Option<Exit>) {
        let s = self.lock();
        (s.status, s.pid, s.exit.clone())
    }

    /// Records its exit; None if it was recorded before (by the waiter or
    /// by `Agent::release`: each exit is reported once).
    pub fn finish(&self, status: u32) -> Option<Exit> {
        let mut s = self.lock();
        if s.exit.is_some() {
            return None;
        }
        let e = Exit { status, at: now() };
        s.status = Status::Stopped;
        s.exit = Some(e.clone());
        s.stdin = None;
        self.changed.notify_all();
        Some(e)
    }

    /// Blocks until it has exited.
    pub fn wait(&self) -> Exit {
        let mut s = self.lock();
        loop {
            if let Some(e) = &s.exit {
                return e.clone();
            }
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Waits (bounded) until its output streams reached EOF and were copied.
    pub fn drain(&self, limit: Duration) -> bool {
        self.pumps.wait(limit)
    }

    /// CloseIO: the process reads EOF on stdin (a terminal's input just
    /// stops). A stdin FIFO nobody opened yet no longer holds its pump.
    pub fn close_stdin(&self) {
        if let Some(s) = self.lock().stdin.take() {
            if !self.io.terminal {
                let _ = s.shutdown(Shutdown::Write);
            }
        }
        unblock_fifo_reader(&self.io.stdin);
    }
}

/// The guest agent of one task's sandbox and the task's processes there.
#[derive(Debug)]
pub struct Agent {
    task: String,
    /// A pod's container: its processes run in this container's root.
    container: Option<String>,
    /// The mounted bundle rootfs (an exec's HOME from its /etc/passwd).
    rootfs: PathBuf,
    vsock: OnceLock<PathBuf>,
    control: Mutex<Option<Client>>,
    procs: Mutex<HashMap<String, Arc<Proc>>>,
}

impl Agent {
    /// The agent side of task `task` whose main process has `io`.
    pub fn new(task: &str, rootfs: PathBuf, io: StdioPaths) -> Agent {
        Agent::in_container(task, rootfs, io, None)
    }

    /// The agent side of container `task` of a pod (`container`: its root
    /// at the agent, `MountContainer`), or of a sandbox's own task (None).
    pub fn in_container(
        task: &str,
        rootfs: PathBuf,
        io: StdioPaths,
        container: Option<String>,
    ) -> Agent {
        let main = Arc::new(Proc::new("", task.to_string(), io));
        Agent {
            container,
            task: task.to_string(),
            rootfs,
            vsock: OnceLock::new(),
            control: Mutex::new(None),
            procs: Mutex::new(HashMap::from([(String::new(), main)])),
        }
    }

    /// The agent is reachable at the VMM's socket `vsock` (the sandbox is READY).
    pub fn ready(&self, vsock: PathBuf) {
        let _ = self.vsock.set(vsock);
    }

    pub fn main(&self) -> Arc<Proc> {
        self.proc("")
            .expect("the main process is always registered")
    }

    pub fn proc(&self, exec_id: &str) -> Option<Arc<Proc>> {
        self.procs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(exec_id)
            .cloned()
    }

    /// Every exec of the task.
    pub fn execs(&self) -> Vec<Arc<Proc>> {
        self.procs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|p| !p.exec_id.is_empty())
            .cloned()
            .collect()
    }

    fn err<'a>(
        &'a self,
        process: &'a str,
        step: &'static str,
    ) -> impl FnOnce(ClientError) -> GuestError + 'a {
        move |source| GuestError::Agent {
            task: self.task.clone(),
            process: process.to_string(),
            step,
            source: Box::new(source),
        }
    }

    fn connect(&self) -> Result<Client, GuestError> {
        let vsock = self.vsock.get().ok_or_else(|| GuestError::NotReady {
            task: self.task.clone(),
        })?;
        Client::connect_uds(
            vsock,
            agent_proto::CONTROL_PORT,
            runtime::container::AGENT_TIMEOUT,
        )
        .map_err(self.err("-", "connect to the agent"))
    }

    /// Runs `f` on the control connection (connected on first use); a
    /// transport failure drops it, a refusal keeps it.
    fn call<T>(
        &self,
        process: &str,
        step: &'static str,
        f: impl FnOnce(&mut Client) -> Result<T, ClientError>,
    ) -> Result<T, GuestError> {
        let mut c = self.control.lock().unwrap_or_else(|e| e.into_inner());
        if c.is_none() {
            *c = Some(self.connect()?);
        }
        let client = c.as_mut().expect("connected above");
        let r = f(client);
        if let Err(e) = &r {
            if e.agent_code().is_none() {
                *c = None;
            }
        }
        r.map_err(self.err(process, step))
    }

    /// Creates `proc` at the agent with `process`, attaches its streams and
    /// starts pumping them to and from its FIFOs. Not started yet.
    pub fn launch(&self, proc: &Proc, mut process: Process, main: bool) -> Result<(), GuestError> {
        process.terminal = proc.io.terminal;
        let create = CreateProcess {
            main,
            container: self.container.clone(),
            stdin: !proc.io.stdin.is_empty(),
            stdout: !proc.io.stdout.is_empty(),
            stderr: !proc.io.stderr.is_empty(),
            ..CreateProcess::new(proc.agent_id.clone(), process)
        };
        let id = &proc.agent_id;
        let streams = self.call(id, "CreateProcess", |c| {
            c.create_process(&create)?;
            create
                .streams()
                .into_iter()
                .map(|k| c.attach_stream(id, k).map(|s| (k, s)))
                .collect::<Result<Vec<_>, _>>()
        })?;
        for (kind, stream) in streams {
            match kind {
                StreamKind::Stdout => pump_out(stream, &proc.io.stdout, &proc.pumps, id),
                StreamKind::Stderr => pump_out(stream, &proc.io.stderr, &proc.pumps, id),
                StreamKind::Stdin => {
                    if let Ok(w) = stream.try_clone() {
                        proc.lock().stdin = Some(w);
                    }
                    pump_in(&proc.io.stdin, stream, true, id);
                }
                StreamKind::Pty => {
                    if let Ok(w) = stream.try_clone() {
                        proc.lock().stdin = Some(w);
                    }
                    if let Ok(input) = stream.try_clone() {
                        if !proc.io.stdin.is_empty() {
                            pump_in(&proc.io.stdin, input, false, id);
                        }
                    }
                    pump_out(stream, &proc.io.stdout, &proc.pumps, id);
                }
            }
        }
        Ok(())
    }

    /// Starts `proc`; its pid in the guest.
    pub fn start(&self, proc: &Proc) -> Result<u32, GuestError> {
        let pid = self.call(&proc.agent_id, "StartProcess", |c| {
            c.start_process(&proc.agent_id)
        })?;
        let mut s = proc.lock();
        s.status = Status::Running;
        s.pid = pid.max(0) as u32;
        Ok(s.pid)
    }

    /// Blocks until `proc` has exited (on a connection of its own); its status.
    pub fn wait_exit(&self, proc: &Proc) -> Result<agent_proto::Exit, GuestError> {
        let mut c = self.connect()?;
        c.wait_process(&proc.agent_id, None)
            .map_err(self.err(&proc.agent_id, "WaitProcess"))
    }

    pub fn signal(&self, proc: &Proc, signal: u32) -> Result<(), GuestError> {
        self.call(&proc.agent_id, "SignalProcess", |c| {
            c.signal_process(&proc.agent_id, signal as i32)
        })
    }

    pub fn resize(&self, proc: &Proc, width: u32, height: u32) -> Result<(), GuestError> {
        let (rows, cols) = (height.min(u16::MAX as u32), width.min(u16::MAX as u32));
        self.call(&proc.agent_id, "ResizePty", |c| {
            c.resize_pty(&proc.agent_id, rows as u16, cols as u16)
        })
    }

    /// Guest pids of the task's running processes (a pod container's: its
    /// own processes only).
    pub fn pids(&self) -> Result<Vec<u32>, GuestError> {
        let list = self.call("-", "ListProcesses", |c| c.list_processes())?;
        let ours: Option<Vec<String>> = self.container.as_ref().map(|_| {
            let procs = self.procs.lock().unwrap_or_else(|e| e.into_inner());
            procs.values().map(|p| p.agent_id.clone()).collect()
        });
        Ok(list
            .into_iter()
            .filter(|p| ours.as_ref().is_none_or(|o| o.contains(&p.id)))
            .filter(|p| p.state == agent_proto::ProcessState::Running)
            .filter_map(|p| p.pid.map(|pid| pid.max(0) as u32))
            .collect())
    }

    /// The guest's figures as containerd's cgroup v1 metrics.
    pub fn metrics(&self) -> Result<metrics::Metrics, GuestError> {
        let s = self.call("-", "Stats", |c| c.stats())?;
        Ok(to_metrics(&s))
    }

    /// Mounts this container's root at the agent from disk slot `disk`.
    pub fn mount_container(&self, disk: &str) -> Result<(), GuestError> {
        let id = self.container.clone().unwrap_or_default();
        self.call(&id, "MountContainer", |c| c.mount_container(&id, disk))
    }

    /// Ends what runs in this container and unmounts its root.
    pub fn unmount_container(&self) -> Result<(), GuestError> {
        let id = self.container.clone().unwrap_or_default();
        self.call(&id, "UnmountContainer", |c| c.unmount_container(&id))
    }

    /// Asks the agent to power the guest off (best effort).
    pub fn shutdown(&self) {
        let _ = self.call("-", "Shutdown", |c| c.shutdown());
    }

    /// Registers exec `exec_id` with `spec` (the OCI process, JSON) and
    /// launches it at the agent (created, not started).
    pub fn exec(
        &self,
        exec_id: &str,
        io: StdioPaths,
        spec: serde_json::Value,
    ) -> Result<Arc<Proc>, GuestError> {
        if self.vsock.get().is_none() {
            return Err(GuestError::NotReady {
                task: self.task.clone(),
            });
        }
        let process =
            crate::spec::agent_process(spec, &self.rootfs, "exec spec").map_err(|source| {
                GuestError::ExecSpec {
                    task: self.task.clone(),
                    exec: exec_id.to_string(),
                    source,
                }
            })?;
        // Exec ids are unique per container, not per pod VM.
        let agent_id = match &self.container {
            Some(c) => format!("exec:{c}:{exec_id}"),
            None => format!("exec:{exec_id}"),
        };
        let proc = Arc::new(Proc::new(exec_id, agent_id, io));
        {
            let mut procs = self.procs.lock().unwrap_or_else(|e| e.into_inner());
            if procs.contains_key(exec_id) {
                return Err(GuestError::ExecExists {
                    task: self.task.clone(),
                    exec: exec_id.to_string(),
                });
            }
            procs.insert(exec_id.to_string(), Arc::clone(&proc));
        }
        if let Err(e) = self.launch(&proc, process, false) {
            self.forget(exec_id);
            return Err(e);
        }
        Ok(proc)
    }

    /// Removes exec `exec_id` (containerd's delete of an exec); refused while it runs.
    pub fn delete_exec(&self, exec_id: &str) -> Result<(u32, Exit), GuestError> {
        let proc = self.exec_proc(exec_id)?;
        let (status, pid, exit) = proc.status();
        let exit = match (status, exit) {
            (Status::Running, _) => {
                return Err(GuestError::ExecState {
                    task: self.task.clone(),
                    exec: exec_id.to_string(),
                    status,
                })
            }
            (_, Some(e)) => e,
            // Created, never started: it ends here.
            (_, None) => proc
                .finish(128 + libc::SIGKILL as u32)
                .unwrap_or_else(|| proc.wait()),
        };
        proc.close_stdin();
        self.forget(exec_id);
        Ok((pid, exit))
    }

    /// The exec `exec_id`, or NotFound.
    pub fn exec_proc(&self, exec_id: &str) -> Result<Arc<Proc>, GuestError> {
        self.proc(exec_id)
            .filter(|p| !p.exec_id.is_empty())
            .ok_or_else(|| GuestError::NoExec {
                task: self.task.clone(),
                exec: exec_id.to_string(),
            })
    }

    fn forget(&self, exec_id: &str) {
        self.procs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(exec_id);
    }

    /// The guest is gone: every process still pending ends (killed with the
    /// VM), stdin pumps are released, the control connection is dropped.
    /// Returns the processes that ended here.
    pub fn release(&self, status: u32) -> Vec<(Arc<Proc>, Exit)> {
        *self.control.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let procs: Vec<Arc<Proc>> = self
            .procs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        let mut ended = Vec::new();
        for p in procs {
            p.close_stdin();
            let started = p.status().0 == Status::Running;
            if let Some(e) = p.finish(status) {
                if started {
                    ended.push((p, e));
                }
            }
        }
        ended
    }
}

/// The agent's `Stats` as cgroup v1 metrics: the guest's memory in use
/// (MemTotal − MemAvailable) against its RAM, the CPU time and RSS of the
/// task's processes, their count.
pub fn to_metrics(s: &agent_proto::Stats) -> metrics::Metrics {
    let ms = |v: u64| v.saturating_mul(1_000_000);
    let (user, kernel, rss) = s.processes.iter().fold((0u64, 0u64, 0u64), |a, p| {
        (a.0 + p.utime_ms, a.1 + p.stime_ms, a.2 + p.rss_kib)
    });
    let mut m = metrics::Metrics::new();
    let mut pids = metrics::PidsStat::new();
    pids.current = s.processes.len() as u64;
    m.pids = MessageField::some(pids);
    let mut usage = metrics::CPUUsage::new();
    usage.user = ms(user);
    usage.kernel = ms(kernel);
    usage.total = ms(user + kernel);
    let mut cpu = metrics::CPUStat::new();
    cpu.usage = MessageField::some(usage);
    m.cpu = MessageField::some(cpu);
    let mut mem = metrics::MemoryStat::new();
    let mut entry = metrics::MemoryEntry::new();
    entry.limit = s.mem_total_kib * 1024;
    entry.usage = s.mem_total_kib.saturating_sub(s.mem_available_kib) * 1024;
    mem.usage = MessageField::some(entry);
    mem.rss = rss * 1024;
    mem.total_rss = rss * 1024;
    mem.hierarchical_memory_limit = s.mem_total_kib * 1024;
    m.memory = MessageField::some(mem);
    m
}

/// `to_metrics` packed as containerd's `Any` (type `METRICS_TYPE`).
pub fn metrics_any(m: &metrics::Metrics) -> shim_protos::protobuf::well_known_types::any::Any {
    let mut any = shim_protos::protobuf::well_known_types::any::Any::new();
    any.type_url = METRICS_TYPE.to_string();
    any.value = m.write_to_bytes().unwrap_or_default();
    any
}

/// Opens an output FIFO for writing: waits (bounded) for its reader, then
/// writes block as a pipe's do (the process is slowed, never its output lost
/// while someone reads).
fn open_output_fifo(path: &str) -> Option<std::fs::File> {
    let deadline = Instant::now() + FIFO_OPEN_LIMIT;
    loop {
        match std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
        {
            Ok(f) => {
                // SAFETY: fcntl on a descriptor `f` owns.
                unsafe {
                    let fl = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
                    if fl >= 0 {
                        libc::fcntl(f.as_raw_fd(), libc::F_SETFL, fl & !libc::O_NONBLOCK);
                    }
                }
                return Some(f);
            }
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

/// Copies an agent stream to an output FIFO until the stream's EOF. When
/// the FIFO has no reader (any more) the rest is read and dropped, so the
/// process never blocks on output nobody can read.
fn pump_out(mut stream: UnixStream, fifo: &str, pumps: &Pumps, id: &str) {
    pumps.add();
    let count = pumps.clone();
    let fifo = fifo.to_string();
    let r = std::thread::Builder::new()
        .name(format!("out-{id}"))
        .spawn(move || {
            let mut out = if fifo.is_empty() {
                None
            } else {
                open_output_fifo(&fifo)
            };
            let mut buf = vec![0u8; 32 << 10];
            loop {
                match stream.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        if let Some(f) = out.as_mut() {
                            if f.write_all(&buf[..n]).is_err() {
                                out = None;
                            }
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            drop(out);
            count.done();
        });
    if r.is_err() {
        // No thread: the stream is dropped (the process's writes fail).
        pumps.done();
    }
}

/// Copies a stdin FIFO into an agent stream. The FIFO is opened blocking
/// (it waits for containerd's client to open its end); at EOF the stream's
/// write half is shut (`half_close`: the process reads EOF).
fn pump_in(fifo: &str, mut stream: UnixStream, half_close: bool, id: &str) {
    let fifo = fifo.to_string();
    let _ = std::thread::Builder::new()
        .name(format!("in-{id}"))
        .spawn(move || {
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&fifo)
            {
                let mut buf = vec![0u8; 32 << 10];
                loop {
                    match f.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => {
                            if stream.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(_) => break,
                    }
                }
            }
            if half_close {
                let _ = stream.shutdown(Shutdown::Write);
            }
        });
}

/// A pump blocked opening the stdin FIFO `path` (nobody opened its write
/// end) gets a writer that closes at once: the pump reads EOF and ends.
fn unblock_fifo_reader(path: &str) {
    if path.is_empty() || !Path::new(path).exists() {
        return;
    }
    let _ = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_become_cgroup_metrics() {
        let s = agent_proto::Stats {
            mem_total_kib: 100_000,
            mem_available_kib: 60_000,
            processes: vec![
                agent_proto::ProcessStats {
                    id: "c".into(),
                    pid: 5,
                    rss_kib: 1000,
                    utime_ms: 30,
                    stime_ms: 10,
                },
                agent_proto::ProcessStats {
                    id: "exec:e".into(),
                    pid: 9,
                    rss_kib: 500,
                    utime_ms: 2,
                    stime_ms: 1,
                },
            ],
        };
        let m = to_metrics(&s);
        assert_eq!(m.pids.current, 2);
        assert_eq!(m.cpu.usage.total, 43_000_000);
        assert_eq!(m.cpu.usage.user, 32_000_000);
        assert_eq!(m.memory.usage.usage, 40_000 * 1024);
        assert_eq!(m.memory.usage.limit, 100_000 * 1024);
        assert_eq!(m.memory.rss, 1500 * 1024);
        let any = metrics_any(&m);
        assert_eq!(any.type_url, METRICS_TYPE);
        let back = metrics::Metrics::parse_from_bytes(&any.value).unwrap();
        assert_eq!(back, m);
    }

    /// The stdio pumps between FIFOs and streams: output copied until EOF
    /// (and the drain reports it), stdin half-closed at the FIFO's EOF, a
    /// stdin FIFO nobody opens released by CloseIO.
    #[test]
    fn fifos_are_pumped_to_and_from_streams() {
        let d = tempfile::tempdir().unwrap();
        let fifo = |name: &str| {
            let p = d.path().join(name);
            nix::unistd::mkfifo(&p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
            p.display().to_string()
        };
        let (out_fifo, in_fifo) = (fifo("out"), fifo("in"));
        let proc = Proc::new(
            "e1",
            "exec:e1".into(),
            StdioPaths {
                stdin: in_fifo.clone(),
                stdout: out_fifo.clone(),
                ..Default::default()
            },
        );
        // Output: the reader opens first, as ctr does.
        let reader = std::thread::spawn({
            let p = out_fifo.clone();
            move || std::fs::read(p).unwrap()
        });
        let (mut guest_out, host_out) = UnixStream::pair().unwrap();
        pump_out(host_out, &proc.io.stdout, &proc.pumps, "t");
        guest_out.write_all(b"hello\n").unwrap();
        assert!(!proc.drain(Duration::from_millis(100)), "not at EOF yet");
        drop(guest_out);
        assert!(proc.drain(Duration::from_secs(5)));
        assert_eq!(reader.join().unwrap(), b"hello\n");

        // Input: bytes then EOF arrive at the stream.
        let (mut guest_in, host_in) = UnixStream::pair().unwrap();
        pump_in(&in_fifo, host_in, true, "t");
        let mut w = std::fs::OpenOptions::new()
            .write(true)
            .open(&in_fifo)
            .unwrap();
        w.write_all(b"typed").unwrap();
        drop(w);
        let mut got = Vec::new();
        guest_in.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"typed");

        // A stdin FIFO nobody opens: CloseIO releases its pump (EOF at the stream).
        let in2 = fifo("in2");
        let (mut guest_in2, host_in2) = UnixStream::pair().unwrap();
        let proc2 = Proc::new(
            "e2",
            "exec:e2".into(),
            StdioPaths {
                stdin: in2.clone(),
                ..Default::default()
            },
        );
        proc2.lock().stdin = Some(host_in2.try_clone().unwrap());
        pump_in(&in2, host_in2, true, "t");
        std::thread::sleep(Duration::from_millis(50));
        proc2.close_stdin();
        let mut got = Vec::new();
        guest_in2
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        guest_in2.read_to_end(&mut got).unwrap();
        assert!(got.is_empty());
    }

    #[test]
    fn an_output_fifo_without_reader_does_not_hold_the_process() {
        // No FIFO at all (null IO): the stream is drained and dropped.
        let pumps = Pumps::default();
        let (mut guest, host) = UnixStream::pair().unwrap();
        pump_out(host, "", &pumps, "t");
        guest.write_all(&vec![b'x'; 1 << 20]).unwrap();
        drop(guest);
        assert!(pumps.wait(Duration::from_secs(5)));
    }
}
