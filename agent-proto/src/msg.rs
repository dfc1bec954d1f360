//! The messages: requests and their replies on the control port, the stream
//! hello on the stdio port, and the OCI `process` subset (field names as in
//! OCI's config.json; fields the agent does not know are ignored).

use std::fmt;

use serde::{Deserialize, Serialize};

/// One request on the control port; each is answered by one [`Response`].
/// On the wire: `{"op": "<variant>", ...fields}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op")]
pub enum Request {
    /// Must be the first request of a control connection. Reply: [`HelloReply`].
    Hello { version: u32 },
    /// Registers a process (not started). Reply: [`Empty`].
    CreateProcess(CreateProcess),
    /// Starts a created process once every stream it declared is attached.
    /// Reply: [`Started`].
    StartProcess { id: String },
    /// Blocks until the process has exited. Reply: [`Exit`].
    WaitProcess { id: String },
    /// Sends `signal` to a running process. Reply: [`Empty`].
    SignalProcess { id: String, signal: i32 },
    /// Sets a terminal process's window size. Reply: [`Empty`].
    ResizePty { id: String, rows: u16, cols: u16 },
    /// Reply: [`ProcessList`].
    ListProcesses,
    /// Reply: [`Stats`].
    Stats,
    /// The agent answers, then powers the guest off. Reply: [`Empty`].
    Shutdown,
    /// Pod sandbox: mounts container `id`'s root from the virtio-blk disk
    /// whose serial is `disk` (its EROFS image, inserted by the host into an
    /// empty slot) with a writable layer of its own; processes created with
    /// `container: id` run in it. Reply: [`Empty`].
    MountContainer { id: String, disk: String },
    /// Kills what still runs in container `id` and unmounts its root; the
    /// host may eject its disk after the reply. Reply: [`Empty`].
    UnmountContainer { id: String },
}

impl Request {
    /// The `op` name, for messages.
    pub fn op(&self) -> &'static str {
        match self {
            Request::Hello { .. } => "Hello",
            Request::CreateProcess(_) => "CreateProcess",
            Request::StartProcess { .. } => "StartProcess",
            Request::WaitProcess { .. } => "WaitProcess",
            Request::SignalProcess { .. } => "SignalProcess",
            Request::ResizePty { .. } => "ResizePty",
            Request::ListProcesses => "ListProcesses",
            Request::Stats => "Stats",
            Request::Shutdown => "Shutdown",
            Request::MountContainer { .. } => "MountContainer",
            Request::UnmountContainer { .. } => "UnmountContainer",
        }
    }
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// `CreateProcess`: a process of the sandbox and the streams it declares.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateProcess {
    /// Unique within the sandbox (the host's name: container id, exec id).
    pub id: String,
    pub process: Process,
    /// The container's main process: when it exits the guest powers off
    /// (docs/guest.md, power-off rule). At most one per sandbox.
    #[serde(default, skip_serializing_if = "is_false")]
    pub main: bool,
    /// Declares a `stdin` stream (without it stdin is /dev/null).
    #[serde(default, skip_serializing_if = "is_false")]
    pub stdin: bool,
    /// Declares a `stdout` stream (default true; false: /dev/null).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub stdout: bool,
    /// Declares a `stderr` stream (default true; false: /dev/null).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub stderr: bool,
    /// Runs in this container's root (`MountContainer`) instead of the
    /// sandbox's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
}

impl CreateProcess {
    /// A non-main process with stdout and stderr streams and no stdin.
    pub fn new(id: impl Into<String>, process: Process) -> CreateProcess {
        CreateProcess {
            id: id.into(),
            process,
            main: false,
            stdin: false,
            stdout: true,
            stderr: true,
            container: None,
        }
    }

    /// The streams the process is started with: `pty` alone for a terminal
    /// process, else those of `stdin`, `stdout`, `stderr` that are set.
    pub fn streams(&self) -> Vec<StreamKind> {
        if self.process.terminal {
            return vec![StreamKind::Pty];
        }
        [
            (self.stdin, StreamKind::Stdin),
            (self.stdout, StreamKind::Stdout),
            (self.stderr, StreamKind::Stderr),
        ]
        .into_iter()
        .filter_map(|(on, k)| on.then_some(k))
        .collect()
    }
}

/// The OCI runtime spec's `process` object, the subset the agent honours.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Process {
    #[serde(default, skip_serializing_if = "is_false")]
    pub terminal: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub console_size: Option<ConsoleSize>,
    #[serde(default)]
    pub user: User,
    pub args: Vec<String>,
    /// `KEY=VALUE` strings; the process gets exactly these.
    #[serde(default)]
    pub env: Vec<String>,
    /// Absolute; default `/`.
    #[serde(default = "root_dir")]
    pub cwd: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rlimits: Vec<Rlimit>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub no_new_privileges: bool,
}

fn root_dir() -> String {
    "/".into()
}

impl Process {
    /// `args` run as root in `/` with an empty environment.
    pub fn from_args<S: Into<String>>(args: impl IntoIterator<Item = S>) -> Process {
        Process {
            args: args.into_iter().map(Into::into).collect(),
            cwd: root_dir(),
            ..Process::default()
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct User {
    #[serde(default)]
    pub uid: u32,
    #[serde(default)]
    pub gid: u32,
    /// Supplementary groups (none when empty: root's are dropped too).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub additional_gids: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub umask: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleSize {
    pub height: u16,
    pub width: u16,
}

/// One `rlimits` entry: `type` is the OCI name (`RLIMIT_NOFILE`, ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rlimit {
    #[serde(rename = "type")]
    pub kind: String,
    pub hard: u64,
    pub soft: u64,
}

/// A stream of a process on the stdio port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StreamKind {
    /// host → process; the host's half-close is the process's EOF.
    Stdin,
    /// process → host; EOF once every holder of the process's stdout closed it.
    Stdout,
    /// process → host, as stdout.
    Stderr,
    /// both ways: the terminal of a `terminal` process.
    Pty,
}

impl StreamKind {
    pub const ALL: [StreamKind; 4] = [
        StreamKind::Stdin,
        StreamKind::Stdout,
        StreamKind::Stderr,
        StreamKind::Pty,
    ];

    pub fn name(self) -> &'static str {
        match self {
            StreamKind::Stdin => "stdin",
            StreamKind::Stdout => "stdout",
            StreamKind::Stderr => "stderr",
            StreamKind::Pty => "pty",
        }
    }
}

impl fmt::Display for StreamKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The one frame a stdio connection starts with; answered by a
/// `Response<Empty>`, after which raw bytes flow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamHello {
    pub id: String,
    pub stream: StreamKind,
}

/// The answer to every request: `{"ok": reply}` or `{"error": {...}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Response<T> {
    Ok(T),
    Error(AgentError),
}

/// What the agent says when it refuses a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct AgentError {
    pub code: ErrorCode,
    pub message: String,
}

impl AgentError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> AgentError {
        AgentError {
            code,
            message: message.into(),
        }
    }
}

/// Error codes (`snake_case` on the wire); a code this side does not know
/// reads as `Unknown`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Not JSON, or not a request this agent knows.
    BadRequest,
    /// The frame was over the limit; the agent closes the connection.
    FrameTooLarge,
    /// A request before `Hello`.
    HelloRequired,
    /// `Hello` with another protocol version.
    VersionMismatch,
    /// No process with that id.
    NotFound,
    /// The id (or a main process) exists already, or the stream is attached already.
    Exists,
    /// The process is not in a state for this (started twice, not a terminal, ...).
    State,
    /// `StartProcess` waited too long for the declared streams.
    StreamsMissing,
    /// The process spec is invalid (empty args, unknown rlimit, ...).
    Invalid,
    /// The process could not be started (exec, user, cwd, ...).
    Spawn,
    /// A system call failed.
    Io,
    #[serde(other)]
    Unknown,
}

impl ErrorCode {
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::FrameTooLarge => "frame_too_large",
            ErrorCode::HelloRequired => "hello_required",
            ErrorCode::VersionMismatch => "version_mismatch",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Exists => "exists",
            ErrorCode::State => "state",
            ErrorCode::StreamsMissing => "streams_missing",
            ErrorCode::Invalid => "invalid",
            ErrorCode::Spawn => "spawn",
            ErrorCode::Io => "io",
            ErrorCode::Unknown => "unknown",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reply to `Hello`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloReply {
    pub version: u32,
    /// The agent's build (crate version).
    pub agent: String,
}

/// Reply with nothing to say: `{}`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Empty {}

/// Reply to `StartProcess`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Started {
    pub pid: i32,
}

/// How a process ended: `status` is its exit code, or 128+N for a death by
/// signal N (then `signal` is N).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exit {
    pub status: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
}

impl Exit {
    pub fn code(status: i32) -> Exit {
        Exit {
            status,
            signal: None,
        }
    }

    pub fn signaled(signal: i32) -> Exit {
        Exit {
            status: 128 + signal,
            signal: Some(signal),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcessState {
    Created,
    Running,
    Exited,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfo {
    pub id: String,
    pub pid: Option<i32>,
    pub state: ProcessState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<Exit>,
    #[serde(default)]
    pub main: bool,
}

/// Reply to `ListProcesses`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessList {
    pub processes: Vec<ProcessInfo>,
}

/// Per-process figures of `Stats` (from /proc/PID/stat and statm).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessStats {
    pub id: String,
    pub pid: i32,
    pub rss_kib: u64,
    pub utime_ms: u64,
    pub stime_ms: u64,
}

/// Reply to `Stats`: the guest's memory (/proc/meminfo) and its running
/// processes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    pub mem_total_kib: u64,
    pub mem_available_kib: u64,
    pub processes: Vec<ProcessStats>,
}

/// Any reply, for the agent's side (serialized as the bare reply object).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Reply {
    Hello(HelloReply),
    Empty(Empty),
    Started(Started),
    Exit(Exit),
    Processes(ProcessList),
    Stats(Stats),
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requests_are_tagged_by_op() {
        let r = Request::SignalProcess {
            id: "c1".into(),
            signal: 9,
        };
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            json!({"op": "SignalProcess", "id": "c1", "signal": 9})
        );
        assert_eq!(
            serde_json::to_value(Request::ListProcesses).unwrap(),
            json!({"op": "ListProcesses"})
        );
        let unknown = serde_json::from_value::<Request>(json!({"op": "Reboot"}));
        assert!(unknown.is_err());
    }

    #[test]
    fn create_process_reads_an_oci_process() {
        let v = json!({
            "op": "CreateProcess", "id": "c1", "main": true, "stdin": true,
            "process": {
                "terminal": true,
                "consoleSize": {"height": 24, "width": 80},
                "user": {"uid": 1000, "gid": 100, "additionalGids": [10, 20]},
                "args": ["sh", "-c", "echo hi"],
                "env": ["PATH=/bin"],
                "cwd": "/srv",
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 512}],
                "noNewPrivileges": true,
                "capabilities": {"bounding": ["CAP_KILL"]}
            }
        });
        let Request::CreateProcess(c) = serde_json::from_value(v).unwrap() else {
            panic!()
        };
        assert!(c.main && c.stdin && c.stdout && c.stderr);
        let p = &c.process;
        assert!(p.terminal && p.no_new_privileges);
        assert_eq!(
            p.console_size,
            Some(ConsoleSize {
                height: 24,
                width: 80
            })
        );
        assert_eq!(p.user.additional_gids, vec![10, 20]);
        assert_eq!(p.rlimits[0].kind, "RLIMIT_NOFILE");
        assert_eq!(p.cwd, "/srv");
        assert_eq!(c.streams(), vec![StreamKind::Pty]);
        // Round trip.
        let back = serde_json::to_value(Request::CreateProcess(c.clone())).unwrap();
        assert_eq!(back["process"]["user"]["additionalGids"], json!([10, 20]));
        assert_eq!(
            serde_json::from_value::<Request>(back).unwrap(),
            Request::CreateProcess(c)
        );
    }

    #[test]
    fn process_defaults() {
        let p: Process = serde_json::from_value(json!({"args": ["true"]})).unwrap();
        assert_eq!(p, Process::from_args(["true"]));
        assert_eq!(p.cwd, "/");
        let c = CreateProcess::new("x", p);
        assert_eq!(c.streams(), vec![StreamKind::Stdout, StreamKind::Stderr]);
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(
            v,
            json!({"id": "x", "process": {"user": {"uid": 0, "gid": 0}, "args": ["true"], "env": [], "cwd": "/"}})
        );
    }

    #[test]
    fn responses() {
        let ok: Response<Reply> = Response::Ok(Reply::Exit(Exit::signaled(9)));
        let v = serde_json::to_value(&ok).unwrap();
        assert_eq!(v, json!({"ok": {"status": 137, "signal": 9}}));
        assert_eq!(
            serde_json::from_value::<Response<Exit>>(v).unwrap(),
            Response::Ok(Exit::signaled(9))
        );
        let empty = serde_json::to_value(Response::<Reply>::Ok(Reply::Empty(Empty {}))).unwrap();
        assert_eq!(empty, json!({"ok": {}}));
        let err: Response<Empty> = serde_json::from_value(
            json!({"error": {"code": "not_found", "message": "no process x"}}),
        )
        .unwrap();
        assert_eq!(
            err,
            Response::Error(AgentError::new(ErrorCode::NotFound, "no process x"))
        );
        let future: Response<Empty> =
            serde_json::from_value(json!({"error": {"code": "quota", "message": "m"}})).unwrap();
        assert_eq!(
            future,
            Response::Error(AgentError::new(ErrorCode::Unknown, "m"))
        );
        for c in [ErrorCode::BadRequest, ErrorCode::StreamsMissing] {
            assert_eq!(serde_json::to_value(c).unwrap(), json!(c.name()));
        }
    }

    #[test]
    fn stream_hello() {
        let h = StreamHello {
            id: "c1".into(),
            stream: StreamKind::Pty,
        };
        assert_eq!(
            serde_json::to_value(&h).unwrap(),
            json!({"id": "c1", "stream": "pty"})
        );
    }
}
