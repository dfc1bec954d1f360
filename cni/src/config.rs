//! The network configuration on stdin (docs/design.md "CNI").

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::error::{code, PluginError};
use crate::version::{self, Version};
use netutil::cni::CniResult;
use nic_api::DevKind;

pub const DEFAULT_NIC_SOCKET: &str = "/run/burstvm/nic.sock";
/// Most seconds `nicTimeout` may ask for: ADD must not hang a runtime for longer.
pub const MAX_NIC_TIMEOUT_SECS: f64 = 300.0;

/// `cni.dev/valid-attachments` entry of a GC request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    pub container_id: String,
    pub ifname: String,
}

#[derive(Debug, Clone)]
pub struct NetConf {
    /// The exact bytes read from stdin: delegated plugins get them unchanged.
    pub raw: Vec<u8>,
    pub version: Version,
    pub nic_socket: PathBuf,
    /// Bound on every exchange with the NIC daemon (`nicTimeout`, seconds).
    pub nic_timeout: Duration,
    /// `pf`: the physical function(s) whose VFs this network hands out, in
    /// the order ADD tries them (an array spans PFs, as an SR-IOV resource
    /// pool does).
    pub pfs: Vec<String>,
    /// `kind`: a VF (default) or an SG function (SG-IOV, docs/sgiov.md).
    pub kind: DevKind,
    pub mac: Option<String>,
    pub vlan: Option<u16>,
    /// `ipam.type`, when the config delegates address management.
    pub ipam: Option<String>,
    pub prev_result: Option<CniResult>,
    pub valid_attachments: Vec<Attachment>,
}

/// The `cniVersion` of a config, if it has a string one (for error results).
pub fn peek_version(raw: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(raw).ok()?;
    v.get("cniVersion")?.as_str().map(str::to_string)
}

/// `pf`: a PF name, or a non-empty array of distinct PF names.
fn pf_list(v: Option<&Value>) -> Result<Vec<String>, PluginError> {
    let bad = |why: String| PluginError::invalid_config("pf", why);
    let name = |v: &Value| match v {
        Value::String(s) if !s.is_empty() => Ok(s.clone()),
        other => Err(bad(format!("{other} is not a non-empty string"))),
    };
    let pfs = match v {
        None | Some(Value::Null) => {
            return Err(bad(
                "missing: name the physical function(s) to take VFs from".into(),
            ))
        }
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(bad("an empty array names no physical function".into()))
        }
        Some(Value::Array(a)) => a.iter().map(name).collect::<Result<Vec<_>, _>>()?,
        Some(one) => vec![name(one)?],
    };
    for (i, p) in pfs.iter().enumerate() {
        if pfs[..i].contains(p) {
            return Err(bad(format!("{p:?} is given twice")));
        }
    }
    Ok(pfs)
}

/// Decodes and validates a network config: 6 if it is not JSON, 1 for an
/// unsupported `cniVersion`, 7 for a missing or wrong field.
pub fn parse(raw: &[u8]) -> Result<NetConf, PluginError> {
    let o = &decode_object(raw)?;
    let version = version_of(o)?;
    let string = |field: &str| -> Result<Option<String>, PluginError> {
        match o.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
            Some(other) => Err(PluginError::invalid_config(
                field,
                format!("{other} is not a non-empty string"),
            )),
        }
    };
    string("name")?.ok_or_else(|| PluginError::invalid_config("name", "missing"))?;
    let pfs = pf_list(o.get("pf"))?;
    let nic_socket =
        PathBuf::from(string("nicSocket")?.unwrap_or_else(|| DEFAULT_NIC_SOCKET.into()));
    let nic_timeout = match o.get("nicTimeout") {
        None | Some(Value::Null) => nic_api::DEFAULT_TIMEOUT,
        Some(v) => match v.as_f64() {
            Some(t) if t > 0.0 && t <= MAX_NIC_TIMEOUT_SECS => Duration::from_secs_f64(t),
            _ => {
                return Err(PluginError::invalid_config(
                    "nicTimeout",
                    format!("{v} is not a number of seconds in (0, {MAX_NIC_TIMEOUT_SECS}]"),
                ))
            }
        },
    };
    let mac = string("mac")?;
    if let Some(m) = &mac {
        if !valid_unicast_mac(m) {
            return Err(PluginError::invalid_config(
                "mac",
                format!("{m:?} is not a unicast MAC address like 02:00:00:00:00:01"),
            ));
        }
    }
    let vlan = match o.get("vlan") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(id @ 1..=4094) => Some(id as u16),
            _ => {
                return Err(PluginError::invalid_config(
                    "vlan",
                    format!("{v} is not a VLAN id in 1..=4094"),
                ))
            }
        },
    };
    let ipam = match o.get("ipam") {
        None | Some(Value::Null) => None,
        Some(Value::Object(i)) => match i.get("type") {
            Some(Value::String(t))
                if !t.is_empty() && !t.contains('/') && t != "." && t != ".." =>
            {
                Some(t.clone())
            }
            other => {
                return Err(PluginError::invalid_config(
                    "ipam.type",
                    format!("{} is not a plugin name", shown(other)),
                ))
            }
        },
        Some(other) => {
            return Err(PluginError::invalid_config(
                "ipam",
                format!("{other} is not an object"),
            ))
        }
    };
    let prev_result = match o.get("prevResult") {
        None | Some(Value::Null) => None,
        Some(p) => {
            Some(CniResult::from_json(p).map_err(|e| PluginError::decode_json("prevResult", e))?)
        }
    };
    let valid_attachments = valid_attachments(o.get("cni.dev/valid-attachments"))?;
    let kind = match string("kind")? {
        None => DevKind::Vf,
        Some(k) => k
            .parse()
            .map_err(|e| PluginError::invalid_config("kind", e))?,
    };
    if kind == DevKind::Sg {
        // An SG function carries sockets, not frames: nothing to address.
        for (field, set) in [
            ("mac", mac.is_some()),
            ("vlan", vlan.is_some()),
            ("ipam", ipam.is_some()),
        ] {
            if set {
                return Err(PluginError::invalid_config(
                    field,
                    "an SG function (\"kind\":\"sg\") has no MAC, VLAN or IP address",
                ));
            }
        }
        // Its only handle is the vhost-user socket, a 1.1.0 result field.
        if !version.has_1_1_fields() {
            return Err(PluginError::invalid_config(
                "kind",
                format!(
                    "\"sg\" needs cniVersion 1.1.0 (the result's socketPath), not {}",
                    version.as_str()
                ),
            ));
        }
    }
    Ok(NetConf {
        raw: raw.to_vec(),
        version,
        nic_socket,
        nic_timeout,
        pfs,
        kind,
        mac,
        vlan,
        ipam,
        prev_result,
        valid_attachments,
    })
}

/// The network config on stdin as a JSON object: 6 if it is not one.
pub fn decode_object(raw: &[u8]) -> Result<serde_json::Map<String, Value>, PluginError> {
    match serde_json::from_slice(raw)
        .map_err(|e| PluginError::decode_json("network config from stdin", e))?
    {
        Value::Object(o) => Ok(o),
        _ => Err(PluginError::decode(
            "network config from stdin",
            "not a JSON object",
        )),
    }
}

/// A field's value as an error message names it: its JSON, or "missing".
pub fn shown(v: Option<&Value>) -> String {
    v.map_or("missing".into(), Value::to_string)
}

/// The config's `cniVersion`: 1 when it is missing or unsupported.
pub fn version_of(o: &serde_json::Map<String, Value>) -> Result<Version, PluginError> {
    match o.get("cniVersion") {
        None => Err(PluginError::new(
            code::INCOMPATIBLE_VERSION,
            "network config has no cniVersion",
            "cniVersion 0.1.0 is implied, burstvm supports 0.3.0 and later",
        )),
        Some(Value::String(s)) => version::parse(s),
        Some(other) => Err(PluginError::decode(
            "network config field \"cniVersion\"",
            format!("{other} is not a string"),
        )),
    }
}

/// `cni.dev/valid-attachments` of a GC request (absent: none).
pub fn valid_attachments(v: Option<&Value>) -> Result<Vec<Attachment>, PluginError> {
    Ok(match v {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list
            .iter()
            .map(|a| {
                let s = |k: &str| a.get(k).and_then(Value::as_str).map(str::to_string);
                match (s("containerID"), s("ifname")) {
                    (Some(container_id), Some(ifname)) => Ok(Attachment {
                        container_id,
                        ifname,
                    }),
                    _ => Err(PluginError::invalid_config(
                        "cni.dev/valid-attachments",
                        format!("{a} lacks a string containerID or ifname"),
                    )),
                }
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(PluginError::invalid_config(
                "cni.dev/valid-attachments",
                format!("{other} is not an array"),
            ))
        }
    })
}

fn valid_unicast_mac(s: &str) -> bool {
    let parts: Vec<&str> = s.split(':').collect();
    parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && u8::from_str_radix(p, 16).is_ok())
        && u8::from_str_radix(parts[0], 16).is_ok_and(|b| b & 1 == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(extra: &str) -> Result<NetConf, PluginError> {
        parse(
            format!(
                r#"{{"cniVersion":"1.1.0","name":"n","type":"burstvm-cni","pf":"pf0"{extra}}}"#
            )
            .as_bytes(),
        )
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = conf("").unwrap();
        assert_eq!(c.version, Version::V1_1_0);
        assert_eq!(c.nic_socket, PathBuf::from(DEFAULT_NIC_SOCKET));
        assert_eq!(c.nic_timeout, nic_api::DEFAULT_TIMEOUT);
        assert!(c.ipam.is_none() && c.mac.is_none() && c.vlan.is_none());
        assert_eq!(c.kind, DevKind::Vf);
        assert_eq!(conf(r#","kind":"vf""#).unwrap().kind, DevKind::Vf);
        assert_eq!(conf(r#","kind":"sg""#).unwrap().kind, DevKind::Sg);
        assert_eq!(
            conf(r#","nicTimeout":0.5"#).unwrap().nic_timeout,
            Duration::from_millis(500)
        );
        let c = conf(r#","ipam":{"type":"host-local"},"vlan":12,"mac":"02:00:00:00:00:01","nicSocket":"/x.sock""#).unwrap();
        assert_eq!(c.ipam.as_deref(), Some("host-local"));
        assert_eq!(c.vlan, Some(12));
        assert_eq!(c.nic_socket, PathBuf::from("/x.sock"));
        assert_eq!(conf("").unwrap().pfs, ["pf0"]);
    }

    #[test]
    fn pf_is_a_name_or_an_array_of_distinct_names() {
        let with = |pf: &str| {
            parse(format!(r#"{{"cniVersion":"1.1.0","name":"n","pf":{pf}}}"#).as_bytes())
        };
        assert_eq!(with(r#"["pf0","pf1"]"#).unwrap().pfs, ["pf0", "pf1"]);
        assert_eq!(with(r#"["pf1"]"#).unwrap().pfs, ["pf1"]);
        for bad in [
            "[]",
            r#"["pf0","pf0"]"#,
            r#"["pf0",""]"#,
            "[1]",
            r#""""#,
            "7",
        ] {
            let e = with(bad).unwrap_err();
            assert_eq!(e.code, code::INVALID_CONFIG, "{bad}: {e}");
            assert!(e.to_string().contains("pf"), "{bad}: {e}");
        }
    }

    #[test]
    fn errors_carry_the_spec_codes() {
        assert_eq!(parse(b"{not json").unwrap_err().code, code::DECODE_FAILURE);
        assert_eq!(parse(b"[1]").unwrap_err().code, code::DECODE_FAILURE);
        assert_eq!(
            parse(br#"{"cniVersion":"9.9.9","name":"n","pf":"pf0"}"#)
                .unwrap_err()
                .code,
            code::INCOMPATIBLE_VERSION
        );
        assert_eq!(
            parse(br#"{"name":"n","pf":"pf0"}"#).unwrap_err().code,
            code::INCOMPATIBLE_VERSION
        );
        assert_eq!(
            parse(br#"{"cniVersion":"1.1.0","name":"n"}"#)
                .unwrap_err()
                .code,
            code::INVALID_CONFIG
        );
        for bad in [
            r#","vlan":0"#,
            r#","vlan":"12""#,
            r#","mac":"03:00:00:00:00:01""#,
            r#","mac":"zz""#,
            r#","ipam":{}"#,
            r#","ipam":{"type":"../evil"}"#,
            r#","ipam":"host-local""#,
            r#","nicSocket":5"#,
            r#","nicTimeout":0"#,
            r#","nicTimeout":-1"#,
            r#","nicTimeout":1e9"#,
            r#","nicTimeout":"5""#,
            r#","cni.dev/valid-attachments":[{"containerID":"a"}]"#,
            r#","kind":"pf""#,
            r#","kind":1"#,
            r#","kind":"sg","mac":"02:00:00:00:00:01""#,
            r#","kind":"sg","vlan":12"#,
            r#","kind":"sg","ipam":{"type":"host-local"}"#,
        ] {
            let e = conf(bad).unwrap_err();
            assert_eq!(e.code, code::INVALID_CONFIG, "{bad}: {e}");
        }
        assert_eq!(
            conf(r#","prevResult":{"ips":[{"address":"nope"}]}"#)
                .unwrap_err()
                .code,
            code::DECODE_FAILURE
        );
    }

    #[test]
    fn sg_needs_the_1_1_result() {
        let old = br#"{"cniVersion":"1.0.0","name":"n","pf":"pf0","kind":"sg"}"#;
        let e = parse(old).unwrap_err();
        assert!(
            e.code == code::INVALID_CONFIG && e.details.contains("1.1.0"),
            "{e}"
        );
    }

    #[test]
    fn gc_attachments_are_read() {
        let c =
            conf(r#","cni.dev/valid-attachments":[{"containerID":"a","ifname":"eth0"}]"#).unwrap();
        assert_eq!(
            c.valid_attachments,
            vec![Attachment {
                container_id: "a".into(),
                ifname: "eth0".into()
            }]
        );
    }
}
