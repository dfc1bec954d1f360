//! The host's client: one control connection (requests answered in order)
//! plus stdio connections opened per stream.
//!
//! Transport: the VMM's hybrid vsock socket (Firecracker's model: connect to
//! the Unix socket, write `CONNECT <port>\n`, read `OK <hostport>\n`, then the
//! stream is the guest's vsock connection), or any connected stream
//! ([`Client::connect_stream`], tests). Every socket operation is bounded by
//! the client's timeout; errors name the socket and the step.

use std::fmt;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use serde::de::DeserializeOwned;

use crate::frame::{read_frame, write_frame, FrameError};
use crate::msg::*;
use crate::{PROTOCOL_VERSION, STDIO_PORT};

/// How long the agent lets `StartProcess` wait for the process's declared
/// streams before it answers `streams_missing`. The client waits this much
/// longer than its timeout for that reply.
pub const STREAM_WAIT: Duration = Duration::from_secs(10);
/// How long the agent lets `MountContainer` wait for the disk's media
/// (and `UnmountContainer` for the container's processes to end).
pub const MOUNT_WAIT: Duration = Duration::from_secs(10);

/// Where a connection goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// The VMM's hybrid vsock socket and the guest port to `CONNECT` to.
    Hybrid { path: PathBuf, port: u32 },
    /// A plain Unix socket whose server is the agent's listener itself (tests).
    Unix(PathBuf),
}

impl Endpoint {
    /// Connects (and does the hybrid handshake): the stream is then the
    /// agent's connection, with read and write timeouts of `timeout`.
    pub fn connect(&self, timeout: Duration) -> Result<UnixStream, ClientError> {
        let socket = self.to_string();
        let path = match self {
            Endpoint::Hybrid { path, .. } | Endpoint::Unix(path) => path,
        };
        let io = |step| {
            let socket = socket.clone();
            move |source| ClientError::Io {
                socket,
                step,
                source,
            }
        };
        let mut stream = connect_unix(path, timeout).map_err(io(Step::Connect))?;
        set_timeouts(&stream, Some(timeout)).map_err(io(Step::SetTimeout))?;
        if let Endpoint::Hybrid { port, .. } = self {
            stream
                .write_all(format!("CONNECT {port}\n").as_bytes())
                .map_err(io(Step::SendConnect))?;
            let line = read_line(&mut stream).map_err(io(Step::ReadOk))?;
            let ok = line
                .strip_prefix("OK ")
                .is_some_and(|p| p.trim_end().parse::<u32>().is_ok());
            if !ok {
                return Err(ClientError::Handshake {
                    socket,
                    reply: line,
                });
            }
        }
        Ok(stream)
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Hybrid { path, port } => write!(f, "{} (vsock port {port})", path.display()),
            Endpoint::Unix(path) => write!(f, "{}", path.display()),
        }
    }
}

/// A Unix connect bounded by `timeout` (std's blocks while the listener's
/// backlog is full): the connect runs on a helper thread.
fn connect_unix(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    let (tx, rx) = mpsc::channel();
    let p = path.to_owned();
    thread::Builder::new()
        .name("agent-connect".into())
        .spawn(move || {
            let _ = tx.send(UnixStream::connect(p));
        })?;
    rx.recv_timeout(timeout).unwrap_or_else(|_| {
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("not connected within {timeout:?}"),
        ))
    })
}

fn set_timeouts(s: &UnixStream, t: Option<Duration>) -> io::Result<()> {
    s.set_read_timeout(t)?;
    s.set_write_timeout(t)
}

/// Reads the handshake's reply line byte by byte (nothing past the newline is
/// consumed).
fn read_line(s: &mut UnixStream) -> io::Result<String> {
    let mut line = Vec::new();
    let mut b = [0u8];
    while line.len() < 64 {
        match s.read(&mut b) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "closed after {:?} (nothing listening on that guest port?)",
                        String::from_utf8_lossy(&line)
                    ),
                ))
            }
            Ok(_) if b[0] == b'\n' => return Ok(String::from_utf8_lossy(&line).into_owned()),
            Ok(_) => line.push(b[0]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(String::from_utf8_lossy(&line).into_owned())
}

/// The step a client error happened in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Connect,
    SetTimeout,
    SendConnect,
    ReadOk,
    SendRequest,
    ReadResponse,
    SendStreamHello,
    ReadStreamReply,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::Connect => "connect",
            Step::SetTimeout => "set the socket's timeouts",
            Step::SendConnect => "send `CONNECT <port>`",
            Step::ReadOk => "read `OK <port>`",
            Step::SendRequest => "send a request",
            Step::ReadResponse => "read the response",
            Step::SendStreamHello => "send the stream hello",
            Step::ReadStreamReply => "read the stream hello's reply",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{socket}: {step}")]
    Io {
        socket: String,
        step: Step,
        #[source]
        source: io::Error,
    },
    #[error("{socket}: {step}")]
    Frame {
        socket: String,
        step: Step,
        #[source]
        source: FrameError,
    },
    #[error("{socket}: vsock handshake: expected `OK <port>`, got {reply:?}")]
    Handshake { socket: String, reply: String },
    #[error("{socket}: the agent refused {what}")]
    Agent {
        socket: String,
        what: String,
        #[source]
        source: AgentError,
    },
    #[error("{socket}: the agent speaks protocol version {agent}, this client {ours}")]
    Version {
        socket: String,
        agent: u32,
        ours: u32,
    },
    #[error("{socket}: connection unusable after an earlier failure")]
    Broken { socket: String },
    #[error(
        "{socket}: this client has no stdio endpoint (made by connect_stream without with_stdio)"
    )]
    NoStdioEndpoint { socket: String },
}

impl ClientError {
    /// The agent's error code, when the agent refused the request.
    pub fn agent_code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Agent { source, .. } => Some(source.code),
            _ => None,
        }
    }
}

/// A control connection to the agent, `Hello` done.
#[derive(Debug)]
pub struct Client {
    stream: UnixStream,
    socket: String,
    timeout: Duration,
    stdio: Option<Endpoint>,
    broken: bool,
    agent: HelloReply,
}

impl Client {
    /// Connects to guest port `port` through the VMM's hybrid vsock socket at
    /// `vmm_vsock_path` and says `Hello`. Streams are attached through the
    /// same socket's [`STDIO_PORT`].
    pub fn connect_uds(
        vmm_vsock_path: &Path,
        port: u32,
        timeout: Duration,
    ) -> Result<Client, ClientError> {
        let control = Endpoint::Hybrid {
            path: vmm_vsock_path.to_owned(),
            port,
        };
        let stdio = Endpoint::Hybrid {
            path: vmm_vsock_path.to_owned(),
            port: STDIO_PORT,
        };
        Client::connect(&control, Some(stdio), timeout)
    }

    /// Connects to `control` and says `Hello`; streams are attached through
    /// `stdio`.
    pub fn connect(
        control: &Endpoint,
        stdio: Option<Endpoint>,
        timeout: Duration,
    ) -> Result<Client, ClientError> {
        let stream = control.connect(timeout)?;
        Client::start(stream, control.to_string(), timeout, stdio)
    }

    /// Says `Hello` over an already connected stream (no handshake). Attach
    /// streams after [`Client::with_stdio`], or with [`attach_over`].
    pub fn connect_stream(stream: UnixStream, timeout: Duration) -> Result<Client, ClientError> {
        let socket = match stream
            .peer_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(Path::to_owned))
        {
            Some(p) => p.display().to_string(),
            None => "agent stream".to_string(),
        };
        set_timeouts(&stream, Some(timeout)).map_err(|source| ClientError::Io {
            socket: socket.clone(),
            step: Step::SetTimeout,
            source,
        })?;
        Client::start(stream, socket, timeout, None)
    }

    fn start(
        stream: UnixStream,
        socket: String,
        timeout: Duration,
        stdio: Option<Endpoint>,
    ) -> Result<Client, ClientError> {
        let mut c = Client {
            stream,
            socket,
            timeout,
            stdio,
            broken: false,
            agent: HelloReply {
                version: PROTOCOL_VERSION,
                agent: String::new(),
            },
        };
        c.agent = c.hello()?;
        Ok(c)
    }

    /// Where [`Client::attach_stream`] connects.
    pub fn with_stdio(mut self, stdio: Endpoint) -> Client {
        self.stdio = Some(stdio);
        self
    }

    /// What the agent said to `Hello`.
    pub fn agent(&self) -> &HelloReply {
        &self.agent
    }

    /// Sends `req` and reads its reply as `T`. A transport failure leaves the
    /// connection unusable (its replies would be out of step); a refusal by
    /// the agent does not.
    pub fn call<T: DeserializeOwned>(&mut self, req: &Request) -> Result<T, ClientError> {
        self.call_for(req, Some(self.timeout))
    }

    fn call_for<T: DeserializeOwned>(
        &mut self,
        req: &Request,
        timeout: Option<Duration>,
    ) -> Result<T, ClientError> {
        if self.broken {
            return Err(ClientError::Broken {
                socket: self.socket.clone(),
            });
        }
        let r = self.exchange(req, timeout);
        if let Err(ClientError::Io { .. } | ClientError::Frame { .. }) = &r {
            if !matches!(&r, Err(ClientError::Frame { source, .. }) if source.recoverable()) {
                self.broken = true;
            }
        }
        match r? {
            Response::Ok(v) => Ok(v),
            Response::Error(source) => Err(ClientError::Agent {
                socket: self.socket.clone(),
                what: req.op().to_string(),
                source,
            }),
        }
    }

    fn exchange<T: DeserializeOwned>(
        &mut self,
        req: &Request,
        timeout: Option<Duration>,
    ) -> Result<Response<T>, ClientError> {
        let frame = |step| {
            let socket = self.socket.clone();
            move |source| ClientError::Frame {
                socket,
                step,
                source,
            }
        };
        write_frame(&mut self.stream, req).map_err(frame(Step::SendRequest))?;
        if timeout != Some(self.timeout) {
            self.stream
                .set_read_timeout(timeout)
                .map_err(|source| ClientError::Io {
                    socket: self.socket.clone(),
                    step: Step::SetTimeout,
                    source,
                })?;
        }
        let r = read_frame(&mut self.stream).map_err(frame(Step::ReadResponse));
        if timeout != Some(self.timeout) {
            self.stream
                .set_read_timeout(Some(self.timeout))
                .map_err(|source| ClientError::Io {
                    socket: self.socket.clone(),
                    step: Step::SetTimeout,
                    source,
                })?;
        }
        r
    }

    /// `Hello` (done by every constructor; may be repeated).
    pub fn hello(&mut self) -> Result<HelloReply, ClientError> {
        let r: HelloReply = self.call(&Request::Hello {
            version: PROTOCOL_VERSION,
        })?;
        if !crate::version_compatible(r.version) {
            self.broken = true;
            return Err(ClientError::Version {
                socket: self.socket.clone(),
                agent: r.version,
                ours: PROTOCOL_VERSION,
            });
        }
        Ok(r)
    }

    pub fn create_process(&mut self, req: &CreateProcess) -> Result<(), ClientError> {
        self.call::<Empty>(&Request::CreateProcess(req.clone()))
            .map(drop)
    }

    /// Starts the process; the agent waits up to [`STREAM_WAIT`] for its
    /// declared streams. Returns its pid in the guest.
    pub fn start_process(&mut self, id: &str) -> Result<i32, ClientError> {
        let req = Request::StartProcess { id: id.into() };
        let r: Started = self.call_for(&req, Some(self.timeout + STREAM_WAIT))?;
        Ok(r.pid)
    }

    /// Waits for the process to exit, at most `timeout` (None: forever). A
    /// timeout leaves the connection unusable: wait on a connection of its
    /// own when it may time out.
    pub fn wait_process(
        &mut self,
        id: &str,
        timeout: Option<Duration>,
    ) -> Result<Exit, ClientError> {
        self.call_for(&Request::WaitProcess { id: id.into() }, timeout)
    }

    pub fn signal_process(&mut self, id: &str, signal: i32) -> Result<(), ClientError> {
        self.call::<Empty>(&Request::SignalProcess {
            id: id.into(),
            signal,
        })
        .map(drop)
    }

    pub fn resize_pty(&mut self, id: &str, rows: u16, cols: u16) -> Result<(), ClientError> {
        self.call::<Empty>(&Request::ResizePty {
            id: id.into(),
            rows,
            cols,
        })
        .map(drop)
    }

    pub fn list_processes(&mut self) -> Result<Vec<ProcessInfo>, ClientError> {
        let r: ProcessList = self.call(&Request::ListProcesses)?;
        Ok(r.processes)
    }

    pub fn stats(&mut self) -> Result<Stats, ClientError> {
        self.call(&Request::Stats)
    }

    /// Mounts container `id`'s root from the disk with serial `disk`.
    pub fn mount_container(&mut self, id: &str, disk: &str) -> Result<(), ClientError> {
        let req = Request::MountContainer {
            id: id.into(),
            disk: disk.into(),
        };
        // The disk may take a moment to show its new capacity.
        self.call_for::<Empty>(&req, Some(self.timeout + MOUNT_WAIT))
            .map(drop)
    }

    /// Ends what runs in container `id` and unmounts its root.
    pub fn unmount_container(&mut self, id: &str) -> Result<(), ClientError> {
        let req = Request::UnmountContainer { id: id.into() };
        self.call_for::<Empty>(&req, Some(self.timeout + MOUNT_WAIT))
            .map(drop)
    }

    /// Asks the agent to power the guest off (it answers first).
    pub fn shutdown(&mut self) -> Result<(), ClientError> {
        self.call::<Empty>(&Request::Shutdown).map(drop)
    }

    /// Opens a stdio connection for stream `kind` of process `id`: the
    /// returned stream carries the raw bytes (no timeouts set). Shut its write
    /// half down to send EOF to a `stdin` stream.
    pub fn attach_stream(&self, id: &str, kind: StreamKind) -> Result<UnixStream, ClientError> {
        let Some(ep) = &self.stdio else {
            return Err(ClientError::NoStdioEndpoint {
                socket: self.socket.clone(),
            });
        };
        let stream = ep.connect(self.timeout)?;
        attach_over(stream, &ep.to_string(), id, kind)
    }

    /// The control stream, for a caller that takes over.
    pub fn into_stream(self) -> UnixStream {
        self.stream
    }
}

/// Says the stream hello over an already connected stdio connection (its
/// timeouts as set by the caller) and returns it with its timeouts cleared.
/// `socket` names it in errors.
pub fn attach_over(
    mut stream: UnixStream,
    socket: &str,
    id: &str,
    kind: StreamKind,
) -> Result<UnixStream, ClientError> {
    let frame = |step| {
        move |source| ClientError::Frame {
            socket: socket.to_string(),
            step,
            source,
        }
    };
    let hello = StreamHello {
        id: id.into(),
        stream: kind,
    };
    write_frame(&mut stream, &hello).map_err(frame(Step::SendStreamHello))?;
    match read_frame::<Response<Empty>>(&mut stream).map_err(frame(Step::ReadStreamReply))? {
        Response::Ok(_) => {}
        Response::Error(source) => {
            return Err(ClientError::Agent {
                socket: socket.to_string(),
                what: format!("{kind} of {id}"),
                source,
            })
        }
    }
    set_timeouts(&stream, None).map_err(|source| ClientError::Io {
        socket: socket.to_string(),
        step: Step::SetTimeout,
        source,
    })?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A socket path in a fresh directory, removed with the returned guard.
    fn temp_sock(name: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::Builder::new()
            .prefix(&format!("agent-proto-{name}-"))
            .tempdir()
            .unwrap();
        let path = dir.path().join("vsock.sock");
        (dir, path)
    }

    /// A fake VMM + agent: answers the handshake with `reply`, then Hello
    /// with `version`.
    fn fake(path: &Path, reply: &'static str, version: u32) -> thread::JoinHandle<String> {
        let l = UnixListener::bind(path).unwrap();
        thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let line = read_line(&mut s).unwrap();
            s.write_all(reply.as_bytes()).unwrap();
            if reply.starts_with("OK") {
                let req: Request = read_frame(&mut s).unwrap();
                assert_eq!(req, Request::Hello { version: 1 });
                let r = Response::Ok(HelloReply {
                    version,
                    agent: "test".into(),
                });
                write_frame(&mut s, &r).unwrap();
                let _ = read_frame::<Request>(&mut s);
            }
            line
        })
    }

    #[test]
    fn hybrid_handshake_then_hello() {
        let (_dir, path) = temp_sock("ok");
        let t = fake(&path, "OK 1073741824\n", PROTOCOL_VERSION);
        let c = Client::connect_uds(&path, 1024, Duration::from_secs(5)).unwrap();
        assert_eq!(c.agent().agent, "test");
        drop(c);
        assert_eq!(t.join().unwrap(), "CONNECT 1024");
    }

    #[test]
    fn handshake_refused_names_socket() {
        let (_dir, path) = temp_sock("refused");
        let t = fake(&path, "NO\n", PROTOCOL_VERSION);
        let err = Client::connect_uds(&path, 1024, Duration::from_secs(5)).unwrap_err();
        assert!(matches!(err, ClientError::Handshake { ref reply, .. } if reply == "NO"));
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
        assert!(err.to_string().contains("port 1024"), "{err}");
        t.join().unwrap();
    }

    #[test]
    fn version_mismatch_is_an_error() {
        let (_dir, path) = temp_sock("version");
        let t = fake(&path, "OK 5\n", PROTOCOL_VERSION + 1);
        let err = Client::connect_uds(&path, 1024, Duration::from_secs(5)).unwrap_err();
        assert!(
            matches!(err, ClientError::Version { agent, ours, .. } if agent == PROTOCOL_VERSION + 1 && ours == PROTOCOL_VERSION),
            "{err}"
        );
        t.join().unwrap();
    }

    #[test]
    fn missing_socket_names_step() {
        let (_dir, path) = temp_sock("none");
        let err = Client::connect_uds(&path, 1024, Duration::from_secs(1)).unwrap_err();
        assert!(
            matches!(
                err,
                ClientError::Io {
                    step: Step::Connect,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn silent_peer_times_out() {
        let (_dir, path) = temp_sock("silent");
        let l = UnixListener::bind(&path).unwrap();
        let t = thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            thread::sleep(Duration::from_millis(500));
            drop(s);
        });
        let err = Client::connect_uds(&path, 1024, Duration::from_millis(100)).unwrap_err();
        match &err {
            ClientError::Io { step, source, .. } => {
                assert_eq!(*step, Step::ReadOk);
                assert!(
                    matches!(
                        source.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ),
                    "{source:?}"
                );
            }
            other => panic!("{other}"),
        }
        t.join().unwrap();
    }
}
