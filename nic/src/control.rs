//! The control API of `burstvm nic`: line-delimited JSON over a unix socket
//! (docs/design.md "NIC control API", docs/nic.md). One request object per
//! line, one response object per line, every response carries `"ok"`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::devset::VfState;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase", deny_unknown_fields)]
pub enum Request {
    /// Take a free VF of `pf` for `sandbox`, optionally with its own MAC and VLAN.
    Alloc {
        pf: String,
        sandbox: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mac: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vlan: Option<u16>,
    },
    /// End the sandbox's assignment (idempotent).
    Release {
        sandbox: String,
    },
    /// One VF, by sandbox or by VF id.
    Get {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sandbox: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vf: Option<String>,
    },
    List,
}

/// Per-VF counters. `tx` is guest → NIC, `rx` is NIC → guest.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub rx_drops: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub tx_drops: u64,
    pub bad_descriptors: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VfInfo {
    pub id: String,
    pub pf: String,
    pub index: usize,
    pub mac: String,
    pub vlan: Option<u16>,
    pub socket: PathBuf,
    pub state: VfState,
    pub sandbox: Option<String>,
    pub counters: Counters,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorCode {
    NoFreeVf,
    UnknownPf,
    BadRequest,
    AlreadyAssigned,
    NotFound,
    /// The daemon could not do it (e.g. the state file could not be written).
    Internal,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vf: Option<VfInfo>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vfs: Option<Vec<VfInfo>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<ErrorCode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Response {
    pub fn ok() -> Self {
        Response {
            ok: true,
            vf: None,
            vfs: None,
            code: None,
            error: None,
        }
    }
    pub fn with_vf(vf: VfInfo) -> Self {
        Response {
            vf: Some(vf),
            ..Self::ok()
        }
    }
    pub fn with_vfs(vfs: Vec<VfInfo>) -> Self {
        Response {
            vfs: Some(vfs),
            ..Self::ok()
        }
    }
    pub fn err(code: ErrorCode, error: impl Into<String>) -> Self {
        Response {
            ok: false,
            vf: None,
            vfs: None,
            code: Some(code),
            error: Some(error.into()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("nic control socket {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("nic control socket {path}: daemon closed the connection")]
    Closed { path: PathBuf },
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

/// A connection to the daemon's control socket.
pub struct Client {
    path: PathBuf,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Client {
    pub fn connect(path: &Path) -> Result<Self, ClientError> {
        let io = |source| ClientError::Io {
            path: path.to_path_buf(),
            source,
        };
        let writer = UnixStream::connect(path).map_err(io)?;
        let reader = BufReader::new(writer.try_clone().map_err(io)?);
        Ok(Client {
            path: path.to_path_buf(),
            reader,
            writer,
        })
    }

    /// Sends one raw line and returns the raw response line (for tests of malformed input).
    pub fn call_raw(&mut self, line: &str) -> Result<String, ClientError> {
        let io = |source| ClientError::Io {
            path: self.path.clone(),
            source,
        };
        self.writer
            .write_all(format!("{}\n", line.trim_end()).as_bytes())
            .map_err(io)?;
        let mut resp = String::new();
        let n = self
            .reader
            .read_line(&mut resp)
            .map_err(|source| ClientError::Io {
                path: self.path.clone(),
                source,
            })?;
        if n == 0 {
            return Err(ClientError::Closed {
                path: self.path.clone(),
            });
        }
        Ok(resp)
    }

    /// Sends a request and returns the response as is (`ok` may be false).
    pub fn call(&mut self, req: &Request) -> Result<Response, ClientError> {
        let line = serde_json::to_string(req).expect("requests always serialize");
        let resp = self.call_raw(&line)?;
        serde_json::from_str(&resp).map_err(|source| ClientError::BadResponse {
            path: self.path.clone(),
            line: resp.trim_end().to_string(),
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
            mac: mac.map(Into::into),
            vlan,
        })?;
        self.vf_of(r)
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
        Ok(self.call_ok(&Request::List)?.vfs.unwrap_or_default())
    }
}

/// Parses one request line; a malformed line becomes a `bad-request` response.
pub fn parse_request(line: &str) -> Result<Request, Box<Response>> {
    serde_json::from_str(line).map_err(|e| {
        Box::new(Response::err(
            ErrorCode::BadRequest,
            format!("malformed request: {e}"),
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format_matches_design() {
        let r: Request =
            serde_json::from_str(r#"{"op":"alloc","pf":"pf0","sandbox":"s1","vlan":12}"#).unwrap();
        assert_eq!(
            r,
            Request::Alloc {
                pf: "pf0".into(),
                sandbox: "s1".into(),
                mac: None,
                vlan: Some(12)
            }
        );
        let r: Request = serde_json::from_str(r#"{"op":"get","vf":"0000:b1:00.3"}"#).unwrap();
        assert_eq!(
            r,
            Request::Get {
                sandbox: None,
                vf: Some("0000:b1:00.3".into())
            }
        );
        assert_eq!(
            serde_json::to_string(&Request::List).unwrap(),
            r#"{"op":"list"}"#
        );
        let e = serde_json::to_string(&Response::err(ErrorCode::NoFreeVf, "x")).unwrap();
        assert_eq!(e, r#"{"ok":false,"code":"no-free-vf","error":"x"}"#);
        assert!(parse_request("{nope").is_err());
        assert!(parse_request(r#"{"op":"explode"}"#).is_err());
    }
}
