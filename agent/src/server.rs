//! The process and stdio server: the agent's protocol (docs/design.md,
//! "Guest agent protocol") on any stream listener — vsock in the guest, a
//! Unix socket in tests. Nothing here mounts, configures or powers off: the
//! PID 1 steps are in `boot` and `main.rs`; [`Agent::wait_power_off`] only
//! says when.
//!
//! Each connection is served on its own thread, so a blocking `WaitProcess`
//! on one does not hold up another. A process's stdio sockets are handed to
//! it as its fds 0/1/2 (no copy through the agent: a chatty process fills its
//! own socket and nothing else); a terminal process gets its pty's slave and
//! two pump threads copy between the master and its `pty` stream.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::thread;
use std::time::{Duration, Instant};

use agent_proto::{
    read_frame_bytes, version_compatible, write_frame, AgentError, CreateProcess, Empty, ErrorCode,
    Exit, FrameError, HelloReply, ProcessInfo, ProcessList, ProcessState, ProcessStats, Reply,
    Request, Response, Started, Stats, StreamHello, StreamKind, PROTOCOL_VERSION,
};
use nix::sys::signal::Signal;

use crate::process::{self, Stdio3};
use crate::pty::Pty;
use crate::reaper::reaper;

/// A source of connected streams: the guest's vsock listener, or a Unix
/// listener in tests. A vsock connection is held as a `UnixStream`: std's
/// stream methods are plain socket calls (read, write, shutdown,
/// SO_RCVTIMEO) that work on any stream socket.
pub trait Listener: Send + 'static {
    fn accept(&self) -> io::Result<UnixStream>;
    /// Names it in messages.
    fn describe(&self) -> String;
}

impl Listener for UnixListener {
    fn accept(&self) -> io::Result<UnixStream> {
        UnixListener::accept(self).map(|(s, _)| s)
    }

    fn describe(&self) -> String {
        match self
            .local_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(|p| p.to_owned()))
        {
            Some(p) => p.display().to_string(),
            None => "unix listener".into(),
        }
    }
}

/// How the agent runs processes and when it powers off.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Root every process is chrooted into; None: the agent's own root (the
    /// guest agent switched root to the container's before serving).
    pub root: Option<PathBuf>,
    /// The devpts multiplexer terminals come from.
    pub ptmx: PathBuf,
    /// Pod sandbox: stays up until `Shutdown`, whatever its processes do.
    pub pod: bool,
    /// How long `StartProcess` waits for the declared streams.
    pub stream_wait: Duration,
    /// After the main process exited: the longest wait for `Shutdown`, the
    /// last control connection to close and its terminal output to drain.
    pub exit_grace: Duration,
    /// Drop the agent port's I/O permission in every child.
    pub drop_ioperm: bool,
    /// Keep glibc off AVX in every process (`process::NO_AVX_TUNABLES`): the guest kernel
    /// cannot save the AVX state its processes would use (kvm_pvm, docs/guest.md).
    pub no_avx: bool,
    /// Timeout for a stdio connection's hello frame.
    pub hello_timeout: Duration,
    /// Where the main process's exec is reported (`app-launch`).
    pub port: crate::port::AgentPort,
    /// A pod sandbox's container roots (`MountContainer`); None: refused.
    pub containers: Option<crate::pod::Roots>,
}

impl Default for AgentConfig {
    fn default() -> AgentConfig {
        AgentConfig {
            root: None,
            ptmx: "/dev/pts/ptmx".into(),
            pod: false,
            stream_wait: agent_proto::client::STREAM_WAIT,
            exit_grace: Duration::from_secs(10),
            drop_ioperm: false,
            no_avx: false,
            hello_timeout: Duration::from_secs(10),
            port: crate::port::AgentPort::disabled(),
            containers: None,
        }
    }
}

#[derive(Debug)]
struct Proc {
    req: CreateProcess,
    /// Streams attached and not yet handed to the process.
    attached: HashMap<StreamKind, UnixStream>,
    pty: Option<Arc<Pty>>,
    /// A `StartProcess` is waiting for streams or spawning.
    starting: bool,
    /// The streams were handed over (no attaching from then on).
    launched: bool,
    pid: Option<i32>,
    exit: Option<Exit>,
    /// Running pty output pumps (the power-off waits for the main's).
    pumps: usize,
}

impl Proc {
    fn state(&self) -> ProcessState {
        match (self.exit, self.pid) {
            (Some(_), _) => ProcessState::Exited,
            (None, Some(_)) => ProcessState::Running,
            (None, None) => ProcessState::Created,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    procs: BTreeMap<String, Proc>,
    /// Mounted container roots (pod sandbox).
    containers: BTreeMap<String, PathBuf>,
    /// Containers being mounted or unmounted (one request each at a time).
    busy: std::collections::BTreeSet<String>,
    main: Option<String>,
    main_exited: Option<(Exit, Instant)>,
    control_conns: usize,
    shutdown: bool,
}

/// Why [`Agent::wait_power_off`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PowerOffReason {
    /// The host sent `Shutdown`.
    Shutdown,
    /// The main process exited, its terminal output drained and the last
    /// control connection closed.
    MainExited,
    /// The main process exited and the grace period ran out.
    Grace,
}

/// When and with what status the guest should power off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PowerOff {
    pub reason: PowerOffReason,
    /// The `EXIT` status: the main process's, 128+SIGKILL for a main still
    /// running (the power-off kills it), 0 without a main process.
    pub status: i32,
}

/// The server's state: the sandbox's processes.
#[derive(Debug)]
pub struct Agent {
    cfg: AgentConfig,
    state: Mutex<State>,
    cv: Condvar,
}

fn err(code: ErrorCode, message: impl Into<String>) -> AgentError {
    AgentError::new(code, message)
}

fn not_found(id: &str) -> AgentError {
    err(ErrorCode::NotFound, format!("no process {id}"))
}

/// Makes a thread (the connection's) and logs when that fails.
fn spawn_named(name: String, f: impl FnOnce() + Send + 'static) {
    if let Err(e) = thread::Builder::new().name(name.clone()).spawn(f) {
        eprintln!("burstvm-agent: spawning thread {name}: {e}");
    }
}

impl Agent {
    pub fn new(cfg: AgentConfig) -> Arc<Agent> {
        Arc::new(Agent {
            cfg,
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
        })
    }

    pub fn config(&self) -> &AgentConfig {
        &self.cfg
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.cv.wait(g).unwrap_or_else(PoisonError::into_inner)
    }

    fn wait_until<'a>(&self, g: MutexGuard<'a, State>, deadline: Instant) -> MutexGuard<'a, State> {
        let left = deadline.saturating_duration_since(Instant::now());
        self.cv
            .wait_timeout(g, left)
            .unwrap_or_else(PoisonError::into_inner)
            .0
    }

    /// Serves control connections from `l` on an accept thread (each
    /// connection on a thread of its own).
    pub fn serve_control(self: &Arc<Self>, l: impl Listener) {
        self.serve(l, "control", Agent::handle_control);
    }

    /// Serves stdio connections from `l`, as [`Agent::serve_control`].
    pub fn serve_stdio(self: &Arc<Self>, l: impl Listener) {
        self.serve(l, "stdio", Agent::handle_stdio);
    }

    fn serve(
        self: &Arc<Self>,
        l: impl Listener,
        kind: &'static str,
        f: fn(&Arc<Agent>, UnixStream),
    ) {
        let agent = Arc::clone(self);
        spawn_named(format!("{kind}-accept"), move || {
            let mut n = 0u64;
            loop {
                match l.accept() {
                    Ok(s) => {
                        n += 1;
                        let a = Arc::clone(&agent);
                        spawn_named(format!("{kind}-{n}"), move || f(&a, s));
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        eprintln!("burstvm-agent: accept on {}: {e}", l.describe());
                        thread::sleep(Duration::from_millis(50));
                    }
                }
            }
        });
    }

    /// Serves one control connection until the peer closes it (or sends a
    /// frame over the limit).
    pub fn handle_control(self: &Arc<Self>, mut conn: UnixStream) {
        self.lock().control_conns += 1;
        struct Closed<'a>(&'a Agent);
        impl Drop for Closed<'_> {
            fn drop(&mut self) {
                self.0.lock().control_conns -= 1;
                self.0.cv.notify_all();
            }
        }
        let _closed = Closed(self);
        let mut hello = false;
        loop {
            let body = match read_frame_bytes(&mut conn) {
                Ok(b) => b,
                Err(FrameError::TooLarge { len }) => {
                    let e = err(
                        ErrorCode::FrameTooLarge,
                        format!(
                            "frame of {len} bytes over {} (closing)",
                            agent_proto::MAX_FRAME
                        ),
                    );
                    let _ = write_frame(&mut conn, &Response::<Reply>::Error(e));
                    close_after_error(conn);
                    return;
                }
                Err(_) => return,
            };
            let (resp, shutdown) = match serde_json::from_slice::<Request>(&body) {
                Err(e) => (
                    Err(err(ErrorCode::BadRequest, format!("not a request: {e}"))),
                    false,
                ),
                Ok(req) if !hello && !matches!(req, Request::Hello { .. }) => (
                    Err(err(
                        ErrorCode::HelloRequired,
                        format!("{} before Hello", req.op()),
                    )),
                    false,
                ),
                Ok(req) => {
                    let shutdown = matches!(req, Request::Shutdown);
                    let r = self.handle(req);
                    if let Ok(Reply::Hello(_)) = r {
                        hello = true;
                    }
                    (r, shutdown)
                }
            };
            let ok = resp.is_ok();
            let resp = match resp {
                Ok(r) => Response::Ok(r),
                Err(e) => Response::Error(e),
            };
            if write_frame(&mut conn, &resp).is_err() {
                return;
            }
            if shutdown && ok {
                self.lock().shutdown = true;
                self.cv.notify_all();
            }
        }
    }

    /// Answers one request (`Shutdown` is answered here and acted on by the
    /// connection after its reply is out).
    pub fn handle(self: &Arc<Self>, req: Request) -> Result<Reply, AgentError> {
        match req {
            Request::Hello { version } => {
                if !version_compatible(version) {
                    return Err(err(
                        ErrorCode::VersionMismatch,
                        format!("agent speaks protocol {PROTOCOL_VERSION}, peer {version}"),
                    ));
                }
                Ok(Reply::Hello(HelloReply {
                    version: PROTOCOL_VERSION,
                    agent: env!("CARGO_PKG_VERSION").into(),
                }))
            }
            Request::CreateProcess(c) => self.create(c).map(|()| Reply::Empty(Empty {})),
            Request::StartProcess { id } => {
                self.start(&id).map(|pid| Reply::Started(Started { pid }))
            }
            Request::WaitProcess { id } => self.wait_process(&id).map(Reply::Exit),
            Request::SignalProcess { id, signal } => {
                self.signal(&id, signal).map(|()| Reply::Empty(Empty {}))
            }
            Request::ResizePty { id, rows, cols } => self
                .resize(&id, rows, cols)
                .map(|()| Reply::Empty(Empty {})),
            Request::ListProcesses => Ok(Reply::Processes(self.list())),
            Request::Stats => self.stats().map(Reply::Stats),
            Request::Shutdown => Ok(Reply::Empty(Empty {})),
            Request::MountContainer { id, disk } => self
                .mount_container(&id, &disk)
                .map(|()| Reply::Empty(Empty {})),
            Request::UnmountContainer { id } => {
                self.unmount_container(&id).map(|()| Reply::Empty(Empty {}))
            }
        }
    }

    fn roots(&self) -> Result<&crate::pod::Roots, AgentError> {
        self.cfg.containers.as_ref().ok_or_else(|| {
            err(
                ErrorCode::Invalid,
                "containers need a pod sandbox (burstvm_pod=1)",
            )
        })
    }

    /// Marks container `id` busy (mount or unmount in progress) while `f` runs.
    fn with_busy<T>(
        &self,
        id: &str,
        f: impl FnOnce(&mut State) -> Result<(), AgentError>,
        work: impl FnOnce() -> Result<T, AgentError>,
    ) -> Result<T, AgentError> {
        {
            let mut st = self.lock();
            if st.busy.contains(id) {
                return Err(err(
                    ErrorCode::State,
                    format!("container {id} is being mounted or unmounted"),
                ));
            }
            f(&mut st)?;
            st.busy.insert(id.to_string());
        }
        let r = work();
        self.lock().busy.remove(id);
        r
    }

    fn mount_container(&self, id: &str, disk: &str) -> Result<(), AgentError> {
        crate::pod::validate_id(id)?;
        let roots = self.roots()?;
        let exists = |st: &mut State| match st.containers.contains_key(id) {
            true => Err(err(ErrorCode::Exists, format!("container {id} exists"))),
            false => Ok(()),
        };
        self.with_busy(id, exists, || {
            let root = roots.0.mount(id, disk)?;
            self.lock().containers.insert(id.to_string(), root);
            Ok(())
        })
    }

    /// SIGKILLs the container's running processes, waits (bounded) for them,
    /// and unmounts its root.
    fn unmount_container(&self, id: &str) -> Result<(), AgentError> {
        let roots = self.roots()?;
        let known = |st: &mut State| match st.containers.contains_key(id) {
            true => Ok(()),
            false => Err(err(ErrorCode::NotFound, format!("no container {id}"))),
        };
        self.with_busy(id, known, || {
            let deadline = Instant::now() + agent_proto::client::MOUNT_WAIT;
            let mut st = self.lock();
            let ours = |p: &Proc| p.req.container.as_deref() == Some(id);
            for p in st.procs.values().filter(|p| ours(p) && p.exit.is_none()) {
                if let Some(pid) = p.pid {
                    let _ = reaper().kill(pid, Signal::SIGKILL);
                }
            }
            while st
                .procs
                .values()
                .any(|p| ours(p) && p.pid.is_some() && p.exit.is_none())
            {
                if Instant::now() >= deadline {
                    return Err(err(
                        ErrorCode::State,
                        format!("container {id}: processes still running after SIGKILL"),
                    ));
                }
                st = self.wait_until(st, deadline);
            }
            // Only this request (busy) removes it.
            let root = st
                .containers
                .get(id)
                .cloned()
                .ok_or_else(|| err(ErrorCode::NotFound, format!("no container {id}")))?;
            drop(st);
            roots.0.unmount(id, &root)?;
            // Its processes' records stay: a waiter may not have seen the exit yet.
            self.lock().containers.remove(id);
            Ok(())
        })
    }

    fn create(&self, c: CreateProcess) -> Result<(), AgentError> {
        process::validate(&c.id, &c.process)?;
        if let Some(cid) = &c.container {
            if !self.lock().containers.contains_key(cid) {
                return Err(err(
                    ErrorCode::NotFound,
                    format!("process {}: no container {cid}", c.id),
                ));
            }
        }
        let pty = if c.process.terminal {
            let size = c.process.console_size.map(|s| (s.height, s.width));
            let pty = Pty::open(&self.cfg.ptmx, size).map_err(|e| {
                err(
                    ErrorCode::Io,
                    format!(
                        "process {}: terminal from {}: {e}",
                        c.id,
                        self.cfg.ptmx.display()
                    ),
                )
            })?;
            Some(Arc::new(pty))
        } else {
            None
        };
        let mut st = self.lock();
        if st.procs.contains_key(&c.id) {
            return Err(err(ErrorCode::Exists, format!("process {} exists", c.id)));
        }
        if c.main {
            if let Some(m) = &st.main {
                return Err(err(
                    ErrorCode::Exists,
                    format!("process {}: the main process is {m} already", c.id),
                ));
            }
            st.main = Some(c.id.clone());
        }
        st.procs.insert(
            c.id.clone(),
            Proc {
                req: c,
                attached: HashMap::new(),
                pty,
                starting: false,
                launched: false,
                pid: None,
                exit: None,
                pumps: 0,
            },
        );
        Ok(())
    }

    /// Registers a stream (stdio port) for a process not started yet.
    fn attach(&self, hello: &StreamHello, conn: &UnixStream) -> Result<(), AgentError> {
        let id = &hello.id;
        let mut st = self.lock();
        let p = st.procs.get_mut(id).ok_or_else(|| not_found(id))?;
        if !p.req.streams().contains(&hello.stream) {
            return Err(err(
                ErrorCode::State,
                format!("process {id} declares no {} stream", hello.stream),
            ));
        }
        if p.launched {
            return Err(err(
                ErrorCode::State,
                format!("process {id} is started already"),
            ));
        }
        if p.attached.contains_key(&hello.stream) {
            return Err(err(
                ErrorCode::Exists,
                format!("process {id}: {} attached already", hello.stream),
            ));
        }
        let s = conn.try_clone().map_err(|e| {
            err(
                ErrorCode::Io,
                format!("process {id}: {}: {e}", hello.stream),
            )
        })?;
        p.attached.insert(hello.stream, s);
        self.cv.notify_all();
        Ok(())
    }

    fn start(self: &Arc<Self>, id: &str) -> Result<i32, AgentError> {
        let deadline = Instant::now() + self.cfg.stream_wait;
        let mut st = self.lock();
        {
            let p = st.procs.get_mut(id).ok_or_else(|| not_found(id))?;
            if p.launched || p.starting {
                return Err(err(
                    ErrorCode::State,
                    format!("process {id} is started already"),
                ));
            }
            p.starting = true;
        }
        // The rule: a process starts once every stream it declared is attached.
        loop {
            let p = st.procs.get_mut(id).ok_or_else(|| not_found(id))?;
            let missing: Vec<&str> = p
                .req
                .streams()
                .into_iter()
                .filter(|k| !p.attached.contains_key(k))
                .map(StreamKind::name)
                .collect();
            if missing.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                p.starting = false;
                return Err(err(
                    ErrorCode::StreamsMissing,
                    format!(
                        "process {id}: {} not attached within {:?}",
                        missing.join(", "),
                        self.cfg.stream_wait
                    ),
                ));
            }
            st = self.wait_until(st, deadline);
        }
        let p = st.procs.get_mut(id).ok_or_else(|| not_found(id))?;
        p.launched = true;
        let mut streams = std::mem::take(&mut p.attached);
        let req = p.req.clone();
        let pty = p.pty.clone();
        drop(st);

        if req.main {
            self.cfg.port.report(crate::port::Event::AppLaunchStart, 0);
        }
        let spawned = self.spawn(&req, &mut streams, pty.as_deref());
        if req.main && spawned.is_ok() {
            self.cfg.port.report(crate::port::Event::AppLaunchEnd, 0);
        }
        let mut st = self.lock();
        let p = st.procs.get_mut(id).ok_or_else(|| not_found(id))?;
        p.starting = false;
        let pid = match spawned {
            Ok(pid) => pid,
            Err(e) => {
                // The process never ran: it ends as an exec failure would
                // (127), so waiters and the power-off rule see an end.
                p.exit = Some(Exit::code(127));
                if req.main {
                    st.main_exited = Some((Exit::code(127), Instant::now()));
                }
                self.cv.notify_all();
                return Err(e);
            }
        };
        p.pid = Some(pid);
        if let (Some(pty), Some(sock)) = (pty, streams.remove(&StreamKind::Pty)) {
            p.pumps += 1;
            drop(st);
            self.start_pumps(id, pty, sock);
        }
        self.cv.notify_all();
        Ok(pid)
    }

    /// Spawns the process with its streams (taken out of `streams`, except
    /// the pty stream, which stays for the pumps).
    fn spawn(
        self: &Arc<Self>,
        req: &CreateProcess,
        streams: &mut HashMap<StreamKind, UnixStream>,
        pty: Option<&Pty>,
    ) -> Result<i32, AgentError> {
        let id = &req.id;
        let io_err =
            |what: &str, e: io::Error| err(ErrorCode::Io, format!("process {id}: {what}: {e}"));
        let stdio = match pty {
            Some(pty) => {
                let slave = pty.slave().map_err(|e| io_err("terminal slave", e))?;
                let dup = |f: &OwnedFd| f.try_clone().map_err(|e| io_err("terminal slave", e));
                Stdio3 {
                    stdin: dup(&slave)?,
                    stdout: dup(&slave)?,
                    stderr: slave,
                }
            }
            None => {
                let mut take = |k| match streams.remove(&k) {
                    Some(s) => Ok(OwnedFd::from(s)),
                    None => std::fs::File::open("/dev/null")
                        .map(OwnedFd::from)
                        .map_err(|e| io_err("/dev/null", e)),
                };
                Stdio3 {
                    stdin: take(StreamKind::Stdin)?,
                    stdout: take(StreamKind::Stdout)?,
                    stderr: take(StreamKind::Stderr)?,
                }
            }
        };
        let root = match &req.container {
            Some(cid) => Some(self.lock().containers.get(cid).cloned().ok_or_else(|| {
                err(
                    ErrorCode::NotFound,
                    format!("process {id}: no container {cid}"),
                )
            })?),
            None => self.cfg.root.clone(),
        };
        let cmd = process::command(
            id,
            &req.process,
            root.as_deref(),
            stdio,
            process::Extras {
                drop_ioperm: self.cfg.drop_ioperm,
                no_avx: self.cfg.no_avx,
            },
        )?;
        let agent: Weak<Agent> = Arc::downgrade(self);
        let pid_id = id.clone();
        let pid = reaper()
            .spawn(&cmd, move |exit| {
                if let Some(a) = agent.upgrade() {
                    a.exited(&pid_id, exit);
                }
            })
            .map_err(|e| {
                err(
                    ErrorCode::Spawn,
                    format!("process {id}: exec {:?}: {e}", req.process.args[0]),
                )
            })?;
        // Dropping the spawn closes the agent's copies of the streams.
        drop(cmd);
        Ok(pid)
    }

    fn exited(&self, id: &str, exit: Exit) {
        let mut st = self.lock();
        let main = match st.procs.get_mut(id) {
            Some(p) => {
                p.exit = Some(exit);
                p.req.main
            }
            None => false,
        };
        if main {
            st.main_exited = Some((exit, Instant::now()));
        }
        self.cv.notify_all();
    }

    fn start_pumps(self: &Arc<Self>, id: &str, pty: Arc<Pty>, sock: UnixStream) {
        let (out_sock, in_sock) = match sock.try_clone() {
            Ok(c) => (sock, c),
            Err(e) => {
                eprintln!("burstvm-agent: process {id}: pty stream: {e}");
                self.pump_done(id);
                return;
            }
        };
        let (out_pty, in_pty) = (Arc::clone(&pty), pty);
        let agent = Arc::clone(self);
        let out_id = id.to_string();
        spawn_named(format!("pty-out-{id}"), move || {
            let mut sock = out_sock;
            // EIO: every slave fd is closed (the process and its children ended).
            let _ = copy(&mut out_pty.master(), &mut sock);
            // Nobody can read input any more: the input pump's read ends too.
            let _ = sock.shutdown(std::net::Shutdown::Both);
            drop(out_pty);
            agent.pump_done(&out_id);
        });
        spawn_named(format!("pty-in-{id}"), move || {
            let mut sock = in_sock;
            let _ = copy(&mut sock, &mut in_pty.master());
        });
    }

    fn pump_done(&self, id: &str) {
        if let Some(p) = self.lock().procs.get_mut(id) {
            p.pumps -= 1;
            // The terminal is closed: its master goes with the input pump.
            p.pty = None;
        }
        self.cv.notify_all();
    }

    fn wait_process(&self, id: &str) -> Result<Exit, AgentError> {
        let mut st = self.lock();
        loop {
            let p = st.procs.get(id).ok_or_else(|| not_found(id))?;
            if let Some(e) = p.exit {
                return Ok(e);
            }
            st = self.wait(st);
        }
    }

    fn signal(&self, id: &str, signal: i32) -> Result<(), AgentError> {
        let sig = Signal::try_from(signal)
            .map_err(|_| err(ErrorCode::Invalid, format!("no signal {signal}")))?;
        let st = self.lock();
        let p = st.procs.get(id).ok_or_else(|| not_found(id))?;
        let exited = || err(ErrorCode::State, format!("process {id} has exited"));
        if p.exit.is_some() {
            return Err(exited());
        }
        let pid = p
            .pid
            .ok_or_else(|| err(ErrorCode::State, format!("process {id} is not started")))?;
        match reaper().kill(pid, sig) {
            Ok(true) => Ok(()),
            Ok(false) => Err(exited()),
            Err(e) => Err(err(
                ErrorCode::Io,
                format!("process {id}: kill {pid} {sig}: {e}"),
            )),
        }
    }

    fn resize(&self, id: &str, rows: u16, cols: u16) -> Result<(), AgentError> {
        let st = self.lock();
        let p = st.procs.get(id).ok_or_else(|| not_found(id))?;
        let pty = p
            .pty
            .as_ref()
            .ok_or_else(|| err(ErrorCode::State, format!("process {id} has no terminal")))?;
        pty.resize(rows, cols)
            .map_err(|e| err(ErrorCode::Io, format!("process {id}: resize: {e}")))
    }

    fn list(&self) -> ProcessList {
        let st = self.lock();
        ProcessList {
            processes: st
                .procs
                .iter()
                .map(|(id, p)| ProcessInfo {
                    id: id.clone(),
                    pid: p.pid,
                    state: p.state(),
                    exit: p.exit,
                    main: p.req.main,
                })
                .collect(),
        }
    }

    fn stats(&self) -> Result<Stats, AgentError> {
        let meminfo = std::fs::read_to_string("/proc/meminfo")
            .map_err(|e| err(ErrorCode::Io, format!("/proc/meminfo: {e}")))?;
        let (mem_total_kib, mem_available_kib) = crate::stats::meminfo(&meminfo);
        let running: Vec<(String, i32)> = {
            let st = self.lock();
            st.procs
                .iter()
                .filter_map(|(id, p)| Some((id.clone(), p.pid.filter(|_| p.exit.is_none())?)))
                .collect()
        };
        // A process may end between the listing and the read: left out.
        let processes = running
            .into_iter()
            .filter_map(|(id, pid)| {
                let (rss_kib, utime_ms, stime_ms) = crate::stats::process(pid).ok()?;
                Some(ProcessStats {
                    id,
                    pid,
                    rss_kib,
                    utime_ms,
                    stime_ms,
                })
            })
            .collect();
        Ok(Stats {
            mem_total_kib,
            mem_available_kib,
            processes,
        })
    }

    /// Serves one stdio connection: its hello frame, the reply; the socket
    /// then belongs to the process.
    pub fn handle_stdio(self: &Arc<Self>, mut conn: UnixStream) {
        let t = Some(self.cfg.hello_timeout);
        if conn
            .set_read_timeout(t)
            .and(conn.set_write_timeout(t))
            .is_err()
        {
            return;
        }
        let resp = match read_frame_bytes(&mut conn) {
            Ok(body) => match serde_json::from_slice::<StreamHello>(&body) {
                Ok(h) => {
                    // The process gets the socket without our timeouts.
                    if conn
                        .set_read_timeout(None)
                        .and(conn.set_write_timeout(None))
                        .is_err()
                    {
                        return;
                    }
                    self.attach(&h, &conn)
                }
                Err(e) => Err(err(
                    ErrorCode::BadRequest,
                    format!("not a stream hello: {e}"),
                )),
            },
            Err(FrameError::TooLarge { len }) => {
                let e = err(
                    ErrorCode::FrameTooLarge,
                    format!("frame of {len} bytes over {}", agent_proto::MAX_FRAME),
                );
                let _ = write_frame(&mut conn, &Response::<Empty>::Error(e));
                close_after_error(conn);
                return;
            }
            Err(_) => return,
        };
        let resp = match resp {
            Ok(()) => Response::Ok(Empty {}),
            Err(e) => Response::Error(e),
        };
        let _ = write_frame(&mut conn, &resp);
    }

    /// Blocks until the guest should power off (docs/guest.md, power-off
    /// rule): at `Shutdown`; or, outside pod mode, once the main process has
    /// exited, its terminal output has drained and no control connection is
    /// open, bounded by `exit_grace` after its exit.
    pub fn wait_power_off(&self) -> PowerOff {
        let mut st = self.lock();
        loop {
            let main = st.main.as_ref().and_then(|m| st.procs.get(m));
            let status = match (st.main_exited, main) {
                (Some((e, _)), _) => e.status,
                (None, Some(_)) => 128 + libc::SIGKILL,
                (None, None) => 0,
            };
            if st.shutdown {
                return PowerOff {
                    reason: PowerOffReason::Shutdown,
                    status,
                };
            }
            match st.main_exited {
                Some((_, at)) if !self.cfg.pod => {
                    let drained = main.is_none_or(|p| p.pumps == 0);
                    if drained && st.control_conns == 0 {
                        return PowerOff {
                            reason: PowerOffReason::MainExited,
                            status,
                        };
                    }
                    let deadline = at + self.cfg.exit_grace;
                    if Instant::now() >= deadline {
                        return PowerOff {
                            reason: PowerOffReason::Grace,
                            status,
                        };
                    }
                    st = self.wait_until(st, deadline);
                }
                _ => st = self.wait(st),
            }
        }
    }
}

/// Ends a connection whose input is not at a frame boundary: the peer gets
/// our last frame and EOF, and its unread bytes are drained (a socket closed
/// with unread input resets the connection, and the peer could lose the
/// error frame), for at most a second and 4 MiB.
fn close_after_error(mut conn: UnixStream) {
    let _ = conn.shutdown(std::net::Shutdown::Write);
    let _ = conn.set_read_timeout(Some(Duration::from_secs(1)));
    let _ = io::copy(&mut (&mut conn).take(4 << 20), &mut io::sink());
}

/// Copies until EOF or an error (EIO from a pty master whose slaves are all
/// closed ends it like EOF).
fn copy(r: &mut impl Read, w: &mut impl Write) -> io::Result<u64> {
    let mut buf = vec![0u8; 32 * 1024];
    let mut n = 0u64;
    loop {
        let got = match r.read(&mut buf) {
            Ok(0) => return Ok(n),
            Ok(k) => k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if e.raw_os_error() == Some(libc::EIO) => return Ok(n),
            Err(e) => return Err(e),
        };
        w.write_all(&buf[..got])?;
        n += got as u64;
    }
}
