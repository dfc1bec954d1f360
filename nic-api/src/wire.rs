//! Requests and responses of the control API: what each op carries, the
//! checks a request must pass (`parse_request`), the error codes.

use serde::{Deserialize, Serialize};

use crate::VfInfo;

/// What a device slot is: a VF (virtio-net) or an SG function (SG-IOV).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DevKind {
    #[default]
    Vf,
    Sg,
}

impl DevKind {
    pub fn is_vf_kind(&self) -> bool {
        *self == DevKind::Vf
    }
}

impl std::str::FromStr for DevKind {
    type Err = String;
    /// The wire spelling (`"vf"`, `"sg"`), as in configs and results.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "vf" => Ok(DevKind::Vf),
            "sg" => Ok(DevKind::Sg),
            k => Err(format!("{k:?} is neither \"vf\" nor \"sg\"")),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase", deny_unknown_fields)]
pub enum Request {
    /// Take a free VF of `pf` for `sandbox`, optionally with its own MAC and
    /// VLAN; with `"kind":"sg"` a free SG function instead (no MAC or VLAN).
    Alloc {
        pf: String,
        sandbox: String,
        #[serde(default, skip_serializing_if = "DevKind::is_vf_kind")]
        kind: DevKind,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mac: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vlan: Option<u16>,
    },
    /// End the sandbox's assignment (idempotent).
    Release { sandbox: String },
    /// One VF, by sandbox or by VF id.
    Get {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sandbox: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vf: Option<String>,
    },
    /// Let the SG functions of sandboxes `a` and `b` (same PF) connect to
    /// each other: a chain between two tenants (docs/sgiov.md §14.1).
    /// Without it a CONNECT to another sandbox's port is refused. Ends with
    /// the release of either sandbox.
    #[serde(rename = "sg_link")]
    SgLink { a: String, b: String },
    /// Change the scheduling policy (`rr`, `prio`, `drf`) and/or the
    /// executor class capacities (`copy=400M,crypto=160M`, `none`) of the
    /// SG device of `pf` at run time (docs/sgiov.md §10).
    #[serde(rename = "sg_sched")]
    SgSched {
        pf: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        policy: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        capacity: Option<String>,
    },
    /// A struct variant, not a unit one: serde's `deny_unknown_fields` only
    /// applies to fields of struct variants of an internally tagged enum.
    List {},
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
    /// Too many control connections: this one was closed to serve a newer
    /// one (try again).
    Busy,
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

/// Longest sandbox id the NIC accepts (CNI container ids are 64 hex digits).
pub const MAX_SANDBOX_ID: usize = 256;
/// Longest PF name (the daemon's `--pf` rule).
pub const MAX_PF_NAME: usize = 32;
/// Longest VF id (`0000:b1:00.3` is 12 bytes).
pub const MAX_VF_ID: usize = 32;

/// Why a sandbox id is refused, or `None` if it is fine: 1..=256 bytes, no
/// control character (NUL, newline, ...) and no `/` — ids name files and
/// log lines elsewhere.
pub fn sandbox_id_problem(id: &str) -> Option<String> {
    if id.is_empty() || id.len() > MAX_SANDBOX_ID {
        return Some(format!(
            "sandbox id must be 1..{MAX_SANDBOX_ID} bytes, not {}",
            id.len()
        ));
    }
    if let Some(c) = id.chars().find(|c| c.is_control() || *c == '/') {
        return Some(format!(
            "sandbox id {id:?} contains {c:?} (no control characters or '/')"
        ));
    }
    None
}

fn bounded_name_problem(what: &str, s: &str, max: usize, extra: &[char]) -> Option<String> {
    let ok = !s.is_empty()
        && s.len() <= max
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || extra.contains(&c));
    (!ok).then(|| format!("{what} {s:?} is not 1..{max} characters [A-Za-z0-9_-]"))
}

impl Request {
    /// Field checks that JSON decoding cannot express; the answer to a
    /// request that fails them is `bad-request`.
    pub fn validate(&self) -> Result<(), String> {
        let sandbox = |id: &str| sandbox_id_problem(id).map_or(Ok(()), Err);
        match self {
            Request::Alloc {
                pf, sandbox: id, ..
            } => {
                if let Some(p) = bounded_name_problem("pf", pf, MAX_PF_NAME, &[]) {
                    return Err(p);
                }
                sandbox(id)
            }
            Request::Release { sandbox: id } => sandbox(id),
            Request::SgLink { a, b } => {
                sandbox(a)?;
                sandbox(b)?;
                if a == b {
                    return Err(format!(
                        "sg_link: {a:?} with itself (a sandbox needs no link)"
                    ));
                }
                Ok(())
            }
            Request::SgSched {
                pf,
                policy,
                capacity,
            } => {
                if let Some(p) = bounded_name_problem("pf", pf, MAX_PF_NAME, &[]) {
                    return Err(p);
                }
                if policy.is_none() && capacity.is_none() {
                    return Err("sg_sched: give \"policy\" and/or \"capacity\"".into());
                }
                if let Some(p) = policy {
                    p.parse::<sgiov::sched::Policy>()
                        .map_err(|e| format!("sg_sched policy: {e}"))?;
                }
                if let Some(c) = capacity {
                    c.parse::<sgiov::exec::capacity::Capacities>()
                        .map_err(|e| format!("sg_sched capacity: {e}"))?;
                }
                Ok(())
            }
            Request::Get {
                sandbox: Some(id),
                vf: None,
            } => sandbox(id),
            Request::Get {
                sandbox: None,
                vf: Some(id),
            } => bounded_name_problem("vf", id, MAX_VF_ID, &[':', '.']).map_or(Ok(()), Err),
            Request::Get { .. } => Err("get: give exactly one of \"sandbox\" or \"vf\"".into()),
            Request::List {} => Ok(()),
        }
    }
}

fn bad_request(what: String) -> Box<Response> {
    Box::new(Response::err(ErrorCode::BadRequest, what))
}

/// Parses and validates one request line (without its newline); anything
/// malformed — not UTF-8, not JSON, an unknown op or field, a bad field
/// value — becomes a `bad-request` response.
pub fn parse_request(line: &[u8]) -> Result<Request, Box<Response>> {
    let text =
        std::str::from_utf8(line).map_err(|e| bad_request(format!("request is not UTF-8: {e}")))?;
    let req: Request =
        serde_json::from_str(text).map_err(|e| bad_request(format!("malformed request: {e}")))?;
    req.validate().map_err(bad_request)?;
    Ok(req)
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
                kind: DevKind::Vf,
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
        let r: Request =
            serde_json::from_str(r#"{"op":"alloc","kind":"sg","pf":"pf0","sandbox":"s2"}"#)
                .unwrap();
        assert!(matches!(
            r,
            Request::Alloc {
                kind: DevKind::Sg,
                ..
            }
        ));
        assert!(parse_request(br#"{"op":"alloc","kind":"pci","pf":"pf0","sandbox":"s"}"#).is_err());
        assert_eq!(
            serde_json::to_string(&Request::List {}).unwrap(),
            r#"{"op":"list"}"#
        );
        let e = serde_json::to_string(&Response::err(ErrorCode::NoFreeVf, "x")).unwrap();
        assert_eq!(e, r#"{"ok":false,"code":"no-free-vf","error":"x"}"#);
        let r: Request = serde_json::from_str(r#"{"op":"sg_link","a":"x","b":"y"}"#).unwrap();
        assert_eq!(
            r,
            Request::SgLink {
                a: "x".into(),
                b: "y".into()
            }
        );
        assert!(bad(br#"{"op":"sg_link","a":"x","b":"x"}"#).contains("itself"));
        assert!(bad(br#"{"op":"sg_link","a":"x"}"#).contains("missing field"));
        assert!(parse_request(br#"{"op":"sg_sched","pf":"pf0","policy":"drf"}"#).is_ok());
        assert!(parse_request(
            br#"{"op":"sg_sched","pf":"pf0","capacity":"copy=400M,crypto=160M"}"#
        )
        .is_ok());
        assert!(bad(br#"{"op":"sg_sched","pf":"pf0","policy":"fifo"}"#)
            .contains("unknown scheduling policy \"fifo\""));
        assert!(bad(br#"{"op":"sg_sched","pf":"pf0","capacity":"dma=1M"}"#).contains("capacity"));
        assert!(bad(br#"{"op":"sg_sched","pf":"pf0","capacity":"copy=0"}"#).contains("bad rate"));
        assert!(bad(br#"{"op":"sg_sched","pf":"pf0"}"#).contains("and/or"));
        assert!(parse_request(b"{nope").is_err());
        assert!(parse_request(br#"{"op":"explode"}"#).is_err());
    }

    fn bad(line: &[u8]) -> String {
        let r = parse_request(line).expect_err("must be refused");
        assert_eq!(r.code, Some(ErrorCode::BadRequest), "{line:?}");
        r.error.unwrap()
    }

    #[test]
    fn malformed_requests_are_bad_requests() {
        assert!(bad(b"{\"op\":\"release\",\"sandbox\":\"\xff\"}").contains("UTF-8"));
        assert!(bad(br#"{"op":"list","extra":1}"#).contains("unknown field"));
        assert!(bad(br#"{"op":"release","sandbox":"a","x":1}"#).contains("unknown field"));
        assert!(
            bad(br#"{"op":"alloc","pf":"pf0","sandbox":"a","vlan":1,"color":2}"#)
                .contains("unknown field")
        );
        for id in [
            "a\\u0000b",
            "a/b",
            "a\\nb",
            "a\\rb",
            "\\u001b[31m",
            "\\u007f",
            "",
        ] {
            let line = format!(r#"{{"op":"release","sandbox":"{id}"}}"#);
            assert!(bad(line.as_bytes()).contains("sandbox id"), "{line}");
            let line = format!(r#"{{"op":"alloc","pf":"pf0","sandbox":"{id}"}}"#);
            assert!(bad(line.as_bytes()).contains("sandbox id"), "{line}");
            let line = format!(r#"{{"op":"get","sandbox":"{id}"}}"#);
            assert!(bad(line.as_bytes()).contains("sandbox id"), "{line}");
        }
        let long = "x".repeat(MAX_SANDBOX_ID + 1);
        bad(format!(r#"{{"op":"release","sandbox":"{long}"}}"#).as_bytes());
        let ok = "x".repeat(MAX_SANDBOX_ID);
        assert!(
            parse_request(format!(r#"{{"op":"release","sandbox":"{ok}"}}"#).as_bytes()).is_ok()
        );
        assert!(bad(br#"{"op":"alloc","pf":"p/f","sandbox":"a"}"#).contains("pf"));
        assert!(bad(br#"{"op":"get","vf":"0000:b1:00.3/../x"}"#).contains("vf"));
        assert!(bad(br#"{"op":"get"}"#).contains("exactly one"));
        assert!(bad(br#"{"op":"get","sandbox":"a","vf":"0000:b1:00.0"}"#).contains("exactly one"));
        // Still fine: a VF id, a unicode sandbox id.
        assert!(parse_request(br#"{"op":"get","vf":"0000:b1:00.3"}"#).is_ok());
        assert!(parse_request("{\"op\":\"get\",\"sandbox\":\"säß-1\"}".as_bytes()).is_ok());
    }
}
