//! The VMM's control socket (`--api PATH`): media changes of the empty disk
//! slots after boot, as Firecracker's `PATCH /drives/{id}` updates a drive's
//! backing file. One JSON object per line each way; a connection may send
//! any number of requests. A pod's shim uses it to give a container's image
//! to a VM that booted before the container existed (docs/shim.md).
//!
//! Clients are untrusted like any socket peer: a line is bounded, a silent
//! client times out, and a bad request gets an error answer, never a crash.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::virtio::blk::DiskSlot;

/// The longest request line (a path and a slot id fit many times over).
pub const MAX_LINE: u64 = 8 << 10;
/// A connection idle this long is closed by the VMM.
const IDLE_LIMIT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Puts `path` into the empty slot `slot` (opened read-only if the slot is).
    InsertDisk { slot: String, path: PathBuf },
    /// Empties slot `slot` (the guest must have stopped using it).
    EjectDisk { slot: String },
    /// The slots and what each holds.
    ListDisks,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotInfo {
    pub slot: String,
    /// 0: empty.
    pub sectors: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Response {
    Error { error: String },
    Inserted { sectors: u64 },
    Ejected { ejected: bool },
    Slots { slots: Vec<SlotInfo> },
}

/// Answers one request against `slots`.
pub fn handle(slots: &[DiskSlot], req: Request) -> Response {
    let find = |id: &str| {
        slots
            .iter()
            .find(|s| s.id == id)
            .ok_or_else(|| Response::Error {
                error: format!("no empty-slot disk {id:?} (--disk empty,id={id})"),
            })
    };
    match req {
        Request::InsertDisk { slot, path } => match find(&slot) {
            Ok(s) => match s.insert(&path) {
                Ok(sectors) => Response::Inserted { sectors },
                Err(e) => Response::Error {
                    error: error_chain(&e),
                },
            },
            Err(r) => r,
        },
        Request::EjectDisk { slot } => match find(&slot) {
            Ok(s) => Response::Ejected { ejected: s.eject() },
            Err(r) => r,
        },
        Request::ListDisks => Response::Slots {
            slots: slots
                .iter()
                .map(|s| SlotInfo {
                    slot: s.id.clone(),
                    sectors: s.sectors(),
                })
                .collect(),
        },
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(": ");
        s.push_str(&x.to_string());
        src = x.source();
    }
    s
}

/// Pause after a failed accept (e.g. out of file descriptors), which a
/// retry at once would only repeat.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Serves `listener` on a thread of its own, each connection on another.
/// The thread sleeps in accept(2): the listener is made blocking here
/// (`vsock::bind` makes its sockets non-blocking for the vsock device's
/// epoll). A non-blocking one made this thread spin on EAGAIN: half of the
/// sandbox's one-CPU quota, and a pod's guest booted in 32 s instead of 14.
pub fn serve(listener: std::os::unix::net::UnixListener, slots: Vec<DiskSlot>, sandbox: &str) {
    let slots = std::sync::Arc::new(slots);
    let sb = sandbox.to_string();
    if let Err(e) = listener.set_nonblocking(false) {
        tracing::warn!("sandbox {sb}: api socket: not served: {e}");
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("vmm-api".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let conn = match conn {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!("sandbox {sb}: api accept: {e}");
                        std::thread::sleep(ACCEPT_BACKOFF);
                        continue;
                    }
                };
                let slots = std::sync::Arc::clone(&slots);
                let conn_sb = sb.clone();
                let r = std::thread::Builder::new()
                    .name("vmm-api-conn".into())
                    .spawn(move || {
                        if let Err(e) = serve_conn(conn, &slots) {
                            tracing::debug!("sandbox {conn_sb}: api connection: {e}");
                        }
                    });
                if let Err(e) = r {
                    tracing::warn!("sandbox {sb}: api connection thread: {e}");
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("sandbox {sandbox}: api thread: {e}");
    }
}

fn serve_conn(conn: UnixStream, slots: &[DiskSlot]) -> std::io::Result<()> {
    conn.set_read_timeout(Some(IDLE_LIMIT))?;
    conn.set_write_timeout(Some(IDLE_LIMIT))?;
    let mut out = conn.try_clone()?;
    let mut lines = BufReader::new(conn);
    loop {
        let mut line = Vec::new();
        let n = (&mut lines)
            .take(MAX_LINE + 1)
            .read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(());
        }
        if line.last() != Some(&b'\n') {
            let resp = Response::Error {
                error: format!("request line over {MAX_LINE} bytes or unterminated (closing)"),
            };
            write_line(&mut out, &resp)?;
            return Ok(());
        }
        let resp = match serde_json::from_slice::<Request>(&line) {
            Ok(req) => handle(slots, req),
            Err(e) => Response::Error {
                error: format!("not a request: {e}"),
            },
        };
        write_line(&mut out, &resp)?;
    }
}

fn write_line<T: Serialize>(w: &mut impl Write, v: &T) -> std::io::Result<()> {
    let mut b = serde_json::to_vec(v).map_err(std::io::Error::other)?;
    b.push(b'\n');
    w.write_all(&b)
}

/// Why a call on the control socket failed; each names the socket.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("VMM api {path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("VMM api {path}: answer {line:?}: {source}")]
    Answer {
        path: PathBuf,
        line: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("VMM api {path}: {error}")]
    Refused { path: PathBuf, error: String },
    #[error("VMM api {path}: unexpected answer {answer:?}")]
    Unexpected { path: PathBuf, answer: Response },
}

/// A client of the control socket; every call is bounded by its timeout.
#[derive(Debug)]
pub struct Client {
    path: PathBuf,
    stream: BufReader<UnixStream>,
}

impl Client {
    pub fn connect(path: &Path, timeout: Duration) -> Result<Client, ApiError> {
        let io = |what| {
            move |source| ApiError::Io {
                path: path.to_owned(),
                what,
                source,
            }
        };
        let s = netutil::unixsock::connect_timeout(path, timeout).map_err(io("connect"))?;
        s.set_read_timeout(Some(timeout)).map_err(io("timeout"))?;
        s.set_write_timeout(Some(timeout)).map_err(io("timeout"))?;
        Ok(Client {
            path: path.to_owned(),
            stream: BufReader::new(s),
        })
    }

    pub fn call(&mut self, req: &Request) -> Result<Response, ApiError> {
        let io = |what| {
            let path = self.path.clone();
            move |source| ApiError::Io { path, what, source }
        };
        write_line(self.stream.get_mut(), req).map_err(io("send"))?;
        let mut line = String::new();
        self.stream
            .by_ref()
            .take(1 << 20)
            .read_line(&mut line)
            .map_err(io("receive"))?;
        if line.is_empty() {
            return Err(ApiError::Io {
                path: self.path.clone(),
                what: "receive",
                source: std::io::ErrorKind::UnexpectedEof.into(),
            });
        }
        match serde_json::from_str::<Response>(&line) {
            Ok(Response::Error { error }) => Err(ApiError::Refused {
                path: self.path.clone(),
                error,
            }),
            Ok(r) => Ok(r),
            Err(source) => Err(ApiError::Answer {
                path: self.path.clone(),
                line: line.trim_end().to_string(),
                source,
            }),
        }
    }

    /// Inserts `path` into `slot`; its sectors.
    pub fn insert_disk(&mut self, slot: &str, path: &Path) -> Result<u64, ApiError> {
        match self.call(&Request::InsertDisk {
            slot: slot.into(),
            path: path.into(),
        })? {
            Response::Inserted { sectors } => Ok(sectors),
            answer => Err(ApiError::Unexpected {
                path: self.path.clone(),
                answer,
            }),
        }
    }

    /// Empties `slot`; whether it held media.
    pub fn eject_disk(&mut self, slot: &str) -> Result<bool, ApiError> {
        match self.call(&Request::EjectDisk { slot: slot.into() })? {
            Response::Ejected { ejected } => Ok(ejected),
            answer => Err(ApiError::Unexpected {
                path: self.path.clone(),
                answer,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_answers_on_the_wire() {
        let r: Request =
            serde_json::from_str(r#"{"op":"insert_disk","slot":"c0","path":"/x.erofs"}"#).unwrap();
        assert_eq!(
            r,
            Request::InsertDisk {
                slot: "c0".into(),
                path: "/x.erofs".into()
            }
        );
        let r: Request = serde_json::from_str(r#"{"op":"eject_disk","slot":"c0"}"#).unwrap();
        assert_eq!(r, Request::EjectDisk { slot: "c0".into() });
        assert!(serde_json::from_str::<Request>(r#"{"op":"format_disk"}"#).is_err());
        let a: Response = serde_json::from_str(r#"{"sectors":8}"#).unwrap();
        assert_eq!(a, Response::Inserted { sectors: 8 });
        let a: Response = serde_json::from_str(r#"{"error":"no"}"#).unwrap();
        assert_eq!(a, Response::Error { error: "no".into() });
    }

    /// CPU ticks (utime + stime) of this process's threads named `name`.
    fn thread_ticks(name: &str) -> u64 {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| {
                let t = t.ok()?.path();
                let comm = std::fs::read_to_string(t.join("comm")).ok()?;
                (comm.trim() == name).then(|| std::fs::read_to_string(t.join("stat")).ok())?
            })
            .map(|stat| {
                let (ut, st) = procutil::stat_times(&stat).unwrap();
                ut + st
            })
            .sum()
    }

    /// The api thread sleeps in accept on the (non-blocking) socket that
    /// `vsock::bind` makes, instead of spinning on EAGAIN, and answers.
    #[test]
    fn an_idle_api_thread_sleeps_and_answers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let (listener, _file) = crate::virtio::vsock::bind(&path).unwrap();
        serve(listener, Vec::new(), "sb-api-test");
        std::thread::sleep(Duration::from_millis(500));
        // A spinning thread would have used ~50 ticks of 10 ms by now.
        let ticks = thread_ticks("vmm-api");
        assert!(ticks <= 5, "the idle api thread used {ticks} ticks");
        let mut c = Client::connect(&path, Duration::from_secs(5)).unwrap();
        assert_eq!(
            c.call(&Request::ListDisks).unwrap(),
            Response::Slots { slots: Vec::new() }
        );
    }

    #[test]
    fn an_unknown_slot_is_an_error_answer() {
        let r = handle(&[], Request::EjectDisk { slot: "c9".into() });
        assert!(matches!(r, Response::Error { error } if error.contains("c9")));
        assert_eq!(
            handle(&[], Request::ListDisks),
            Response::Slots { slots: Vec::new() }
        );
    }
}
