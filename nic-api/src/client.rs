//! The client side of the control API. Every step — connect, write, read —
//! is bounded by the client's timeout, so a daemon that is gone, frozen or
//! silent makes a call fail with an error naming the socket instead of
//! hanging its caller (CNI ADD/DEL, the runtime).

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::{DevKind, ErrorCode, Request, Response, VfInfo};

/// How long a call may take unless the caller says otherwise. Control
/// requests are answered in milliseconds; under a 200-way burst on two CPUs
/// the daemon may queue a request for seconds, hence the margin.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest response line a client reads (`list` of 64 PFs × 256 VFs fits).
pub const MAX_RESPONSE: usize = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing serves the socket: it does not exist, refuses connections,
    /// or its backlog stayed full for the whole timeout.
    #[error("nic control socket {path}: daemon unavailable: {source}")]
    Unavailable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("nic control socket {path}: no {what} within {after:?} (daemon not answering)")]
    Timeout {
        path: PathBuf,
        what: &'static str,
        after: Duration,
    },
    #[error("nic control socket {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("nic control socket {path}: daemon closed the connection")]
    Closed { path: PathBuf },
    /// The connection broke in the middle of the call (reset, broken pipe):
    /// the daemon died after accepting it. Whether it acted on the request
    /// is unknown.
    #[error("nic control socket {path}: daemon went away mid-call: {source}")]
    Lost {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("nic control socket {path}: response longer than {max} bytes")]
    ResponseTooLong { path: PathBuf, max: usize },
    #[error("nic control socket {path}: bad response {line:?}: {source}")]
    BadResponse {
        path: PathBuf,
        line: String,
        source: serde_json::Error,
    },
    #[error("nic control socket {path}: {code:?}: {error}")]
    Refused {
        path: PathBuf,
        code: Option<ErrorCode>,
        error: String,
    },
}

impl ClientError {
    /// The daemon may well answer a retry: it is not there yet, overloaded,
    /// did not answer in time, or went away mid-call (a crashed daemon is
    /// restarted on its state file). Repeating is safe: `release`, `get` and
    /// `list` are idempotent, and an `alloc` whose answer was lost is undone
    /// by the `release` that follows a failed ADD (CNI DEL).
    pub fn is_transient(&self) -> bool {
        self.is_lost()
            || matches!(
                self,
                ClientError::Unavailable { .. }
                    | ClientError::Timeout { .. }
                    | ClientError::Refused {
                        code: Some(ErrorCode::Busy),
                        ..
                    }
            )
    }

    /// The daemon accepted the call and then went away before the whole
    /// response arrived (closed, reset): the request may or may not have
    /// been done — an `alloc` may be in the daemon's state file.
    pub fn is_lost(&self) -> bool {
        matches!(self, ClientError::Closed { .. } | ClientError::Lost { .. })
    }
}

pub use netutil::unixsock::connect_timeout;

/// A connection to the daemon's control socket.
#[derive(Debug)]
pub struct Client {
    path: PathBuf,
    stream: UnixStream,
    /// Bytes read past the end of the last response line.
    pending: Vec<u8>,
    timeout: Duration,
}

impl Client {
    /// Connects with [`DEFAULT_TIMEOUT`] for the connect and for every call.
    pub fn connect(path: &Path) -> Result<Self, ClientError> {
        Self::connect_with_timeout(path, DEFAULT_TIMEOUT)
    }

    /// Connects within `timeout`; every later call must complete within it too.
    pub fn connect_with_timeout(path: &Path, timeout: Duration) -> Result<Self, ClientError> {
        let stream = connect_timeout(path, timeout).map_err(|source| {
            if source.kind() == ErrorKind::TimedOut {
                ClientError::Timeout {
                    path: path.to_path_buf(),
                    what: "connection accepted",
                    after: timeout,
                }
            } else {
                ClientError::Unavailable {
                    path: path.to_path_buf(),
                    source,
                }
            }
        })?;
        Ok(Client {
            path: path.to_path_buf(),
            stream,
            pending: Vec::new(),
            timeout,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// An I/O error of the established connection: a reset or broken pipe
    /// means the daemon went away mid-call.
    fn io(&self, source: std::io::Error) -> ClientError {
        let path = self.path.clone();
        match source.kind() {
            ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe => {
                ClientError::Lost { path, source }
            }
            _ => ClientError::Io { path, source },
        }
    }

    fn timed_out(&self, what: &'static str) -> ClientError {
        ClientError::Timeout {
            path: self.path.clone(),
            what,
            after: self.timeout,
        }
    }

    /// Time left until `deadline`, or the timeout error for `what`.
    fn left(&self, deadline: Instant, what: &'static str) -> Result<Duration, ClientError> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.timed_out(what));
        }
        Ok(left)
    }

    fn write_line(&mut self, line: &str, deadline: Instant) -> Result<(), ClientError> {
        let mut buf = line.trim_end().as_bytes().to_vec();
        buf.push(b'\n');
        let mut off = 0;
        while off < buf.len() {
            let left = self.left(deadline, "request sent")?;
            self.stream
                .set_write_timeout(Some(left))
                .map_err(|e| self.io(e))?;
            match self.stream.write(&buf[off..]) {
                Ok(0) => {
                    return Err(ClientError::Closed {
                        path: self.path.clone(),
                    })
                }
                Ok(n) => off += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(self.timed_out("request sent"))
                }
                Err(e) => return Err(self.io(e)),
            }
        }
        Ok(())
    }

    fn read_line(&mut self, deadline: Instant) -> Result<String, ClientError> {
        let mut chunk = [0u8; 8192];
        // Bytes of `pending` known to hold no newline.
        let mut scanned = 0;
        loop {
            if let Some(nl) = self.pending[scanned..].iter().position(|&b| b == b'\n') {
                let rest = self.pending.split_off(scanned + nl + 1);
                let line = std::mem::replace(&mut self.pending, rest);
                return Ok(String::from_utf8_lossy(&line).into_owned());
            }
            scanned = self.pending.len();
            if self.pending.len() > MAX_RESPONSE {
                return Err(ClientError::ResponseTooLong {
                    path: self.path.clone(),
                    max: MAX_RESPONSE,
                });
            }
            let left = self.left(deadline, "response")?;
            self.stream
                .set_read_timeout(Some(left))
                .map_err(|e| self.io(e))?;
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    return Err(ClientError::Closed {
                        path: self.path.clone(),
                    })
                }
                Ok(n) => self.pending.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(self.timed_out("response"))
                }
                Err(e) => return Err(self.io(e)),
            }
        }
    }

    /// Sends one raw line and returns the raw response line (for tests of
    /// malformed input); both within the client's timeout.
    pub fn call_raw(&mut self, line: &str) -> Result<String, ClientError> {
        let deadline = Instant::now() + self.timeout;
        self.write_line(line, deadline)?;
        self.read_line(deadline)
    }

    /// Sends a request and returns the response as is (`ok` may be false).
    pub fn call(&mut self, req: &Request) -> Result<Response, ClientError> {
        let line = serde_json::to_string(req).expect("requests always serialize");
        let resp = self.call_raw(&line)?;
        serde_json::from_str(&resp).map_err(|source| ClientError::BadResponse {
            path: self.path.clone(),
            line: resp.trim_end().chars().take(200).collect(),
            source,
        })
    }

    fn call_ok(&mut self, req: &Request) -> Result<Response, ClientError> {
        let r = self.call(req)?;
        if r.ok {
            Ok(r)
        } else {
            Err(ClientError::Refused {
                path: self.path.clone(),
                code: r.code,
                error: r.error.unwrap_or_default(),
            })
        }
    }

    fn vf_of(&self, r: Response) -> Result<VfInfo, ClientError> {
        r.vf.ok_or_else(|| ClientError::Refused {
            path: self.path.clone(),
            code: None,
            error: "response without \"vf\"".into(),
        })
    }

    pub fn alloc(
        &mut self,
        pf: &str,
        sandbox: &str,
        mac: Option<&str>,
        vlan: Option<u16>,
    ) -> Result<VfInfo, ClientError> {
        let r = self.call_ok(&Request::Alloc {
            pf: pf.into(),
            sandbox: sandbox.into(),
            kind: DevKind::Vf,
            mac: mac.map(Into::into),
            vlan,
        })?;
        self.vf_of(r)
    }

    /// Takes a free SG function of `pf` for `sandbox`.
    pub fn alloc_sg(&mut self, pf: &str, sandbox: &str) -> Result<VfInfo, ClientError> {
        let r = self.call_ok(&Request::Alloc {
            pf: pf.into(),
            sandbox: sandbox.into(),
            kind: DevKind::Sg,
            mac: None,
            vlan: None,
        })?;
        self.vf_of(r)
    }

    /// Lets the SG functions of sandboxes `a` and `b` connect to each other.
    pub fn sg_link(&mut self, a: &str, b: &str) -> Result<(), ClientError> {
        self.call_ok(&Request::SgLink {
            a: a.into(),
            b: b.into(),
        })
        .map(|_| ())
    }

    pub fn release(&mut self, sandbox: &str) -> Result<(), ClientError> {
        self.call_ok(&Request::Release {
            sandbox: sandbox.into(),
        })
        .map(|_| ())
    }

    pub fn get_by_sandbox(&mut self, sandbox: &str) -> Result<VfInfo, ClientError> {
        let r = self.call_ok(&Request::Get {
            sandbox: Some(sandbox.into()),
            vf: None,
        })?;
        self.vf_of(r)
    }

    pub fn get_by_id(&mut self, vf: &str) -> Result<VfInfo, ClientError> {
        let r = self.call_ok(&Request::Get {
            sandbox: None,
            vf: Some(vf.into()),
        })?;
        self.vf_of(r)
    }

    pub fn list(&mut self) -> Result<Vec<VfInfo>, ClientError> {
        Ok(self.call_ok(&Request::List {})?.vfs.unwrap_or_default())
    }
}

/// The vhost-user socket of VF `vf_id`, asked from the daemon at `control`
/// (one connection, one `get`): where a VMM connects for the VF a CNI
/// result or placeholder names.
pub fn vf_socket(control: &Path, vf_id: &str) -> Result<PathBuf, ClientError> {
    Ok(Client::connect(control)?.get_by_id(vf_id)?.socket)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixListener;

    fn dir() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    #[test]
    fn missing_socket_is_unavailable() {
        let d = dir();
        let e = Client::connect(&d.path().join("nope.sock")).err().unwrap();
        assert!(matches!(e, ClientError::Unavailable { .. }), "{e}");
        assert!(e.is_transient());
        assert!(e.to_string().contains("nope.sock"), "{e}");
    }

    #[test]
    fn silent_server_times_out_naming_the_socket() {
        let d = dir();
        let path = d.path().join("silent.sock");
        let l = UnixListener::bind(&path).unwrap();
        // Accepts (the kernel queues the connection) but never answers.
        let mut c = Client::connect_with_timeout(&path, Duration::from_millis(200)).unwrap();
        let _held = l.accept().unwrap();
        let e = c.list().unwrap_err();
        assert!(
            matches!(
                e,
                ClientError::Timeout {
                    what: "response",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.is_transient());
        assert!(e.to_string().contains("silent.sock"), "{e}");
    }

    #[test]
    fn full_backlog_times_out_the_connect() {
        let d = dir();
        let path = d.path().join("full.sock");
        let fd = socket::socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        socket::bind(fd.as_raw_fd(), &UnixAddr::new(&path).unwrap()).unwrap();
        socket::listen(&fd, socket::Backlog::new(0).unwrap()).unwrap();
        // Fill the backlog with connections nobody accepts.
        let mut held = Vec::new();
        let t = Duration::from_millis(100);
        let err = loop {
            match connect_timeout(&path, t) {
                Ok(s) => held.push(s),
                Err(e) => break e,
            }
            assert!(held.len() < 64, "backlog never filled");
        };
        assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
        let e = Client::connect_with_timeout(&path, t).err().unwrap();
        assert!(matches!(e, ClientError::Timeout { .. }), "{e}");
    }

    #[test]
    fn endless_response_is_cut_off() {
        let d = dir();
        let path = d.path().join("chatty.sock");
        let l = UnixListener::bind(&path).unwrap();
        let mut c = Client::connect_with_timeout(&path, Duration::from_secs(20)).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let writer = std::thread::spawn(move || {
            let junk = vec![b'x'; 1 << 16];
            // Until the client hangs up.
            while s.write_all(&junk).is_ok() {}
        });
        let e = c.list().unwrap_err();
        assert!(matches!(e, ClientError::ResponseTooLong { .. }), "{e}");
        drop(c);
        writer.join().unwrap();
    }

    /// A daemon killed with the request in hand: closed after reading it, or
    /// gone with the connection still in its backlog (reset). Both are
    /// "lost" (outcome unknown) and worth a retry, never an I/O failure.
    #[test]
    fn daemon_going_away_mid_call_is_lost_and_transient() {
        let d = dir();
        let path = d.path().join("dies.sock");
        let l = UnixListener::bind(&path).unwrap();
        let mut c = Client::connect(&path).unwrap();
        let server = answer_once(l, "");
        let e = c.release("sb-lost").unwrap_err();
        assert!(server.join().unwrap().contains("sb-lost"));
        assert!(matches!(e, ClientError::Closed { .. }), "{e}");
        assert!(e.is_lost() && e.is_transient(), "{e}");

        let path = d.path().join("reset.sock");
        let l = UnixListener::bind(&path).unwrap();
        let mut c = Client::connect(&path).unwrap();
        // The connection is still in the backlog: closing the listener resets it.
        drop(l);
        let e = c.release("sb-reset").unwrap_err();
        assert!(matches!(e, ClientError::Lost { .. }), "{e}");
        assert!(e.is_lost() && e.is_transient(), "{e}");
        assert!(e.to_string().contains("reset.sock"), "{e}");
    }

    /// A one-call daemon: accepts one connection, reads one request line,
    /// writes `reply` and hangs up; the thread returns the request.
    fn answer_once(l: UnixListener, reply: &'static str) -> std::thread::JoinHandle<String> {
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut line = String::new();
            std::io::BufRead::read_line(&mut std::io::BufReader::new(&s), &mut line).unwrap();
            s.write_all(reply.as_bytes()).unwrap();
            line
        })
    }

    #[test]
    fn vf_socket_asks_for_the_vf_by_id() {
        let d = dir();
        let path = d.path().join("ctl.sock");
        let server = answer_once(
            UnixListener::bind(&path).unwrap(),
            concat!(
                r#"{"ok":true,"vf":{"id":"0000:b1:00.3","pf":"pf0","index":3,"#,
                r#""mac":"02:42:bf:00:00:03","vlan":null,"socket":"/run/x/pf0-vf3.sock","#,
                r#""state":"assigned","sandbox":"sb","counters":{"rx_packets":0,"rx_bytes":0,"#,
                r#""rx_drops":0,"tx_packets":0,"tx_bytes":0,"tx_drops":0,"bad_descriptors":0}}}"#,
                "\n"
            ),
        );
        let sock = vf_socket(&path, "0000:b1:00.3").unwrap();
        assert_eq!(sock, Path::new("/run/x/pf0-vf3.sock"));
        let req: Request = serde_json::from_str(&server.join().unwrap()).unwrap();
        assert_eq!(
            req,
            Request::Get {
                sandbox: None,
                vf: Some("0000:b1:00.3".into())
            }
        );
        let e = vf_socket(&d.path().join("gone.sock"), "0000:b1:00.3").unwrap_err();
        assert!(matches!(e, ClientError::Unavailable { .. }), "{e}");
    }

    #[test]
    fn pipelined_lines_are_kept_for_the_next_call() {
        let d = dir();
        let path = d.path().join("two.sock");
        let l = UnixListener::bind(&path).unwrap();
        let mut c = Client::connect(&path).unwrap();
        let (mut s, _) = l.accept().unwrap();
        s.write_all(b"{\"ok\":true}\n{\"ok\":false,\"code\":\"busy\",\"error\":\"x\"}\n")
            .unwrap();
        assert!(c.call(&Request::List {}).unwrap().ok);
        let e = c.list().unwrap_err();
        assert!(e.is_transient(), "busy is worth a retry: {e}");
    }
}
