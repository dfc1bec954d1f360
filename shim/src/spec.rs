//! The parts of a bundle's OCI `config.json` the shim uses: what kind of
//! container it is (CRI's annotations), its entrypoint, its netns.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

/// CRI marks each container with these (containerd's pkg/cri/annotations).
pub const CRI_CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
pub const CRI_SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("OCI spec {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("OCI spec {path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: ParseError,
    },
}

/// Why a `config.json` is not a spec the shim can run.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("not JSON: {0}")]
    Json(#[source] serde_json::Error),
    #[error("{field}: {reason}")]
    Field { field: String, reason: String },
}

fn field(field: impl Into<String>, reason: impl Into<String>) -> ParseError {
    ParseError::Field {
        field: field.into(),
        reason: reason.into(),
    }
}

/// What a container is to the shim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// A CRI pod sandbox (the pause container): the pod's microVM.
    PodSandbox,
    /// A container CRI creates inside a pod (`sandbox` = the pod's id).
    PodContainer { sandbox: String },
    /// A standalone task (`ctr run`): a microVM that ends with its guest.
    Task,
}

#[derive(Debug, Clone)]
pub struct Spec {
    pub kind: Kind,
    pub annotations: Map<String, Value>,
    /// `process.args`.
    pub args: Vec<String>,
    /// The network namespace path the engine made (CRI), if any.
    pub netns: Option<PathBuf>,
}

impl Spec {
    pub fn load(bundle: &Path) -> Result<Spec, SpecError> {
        let path = bundle.join("config.json");
        let data = std::fs::read(&path).map_err(|source| SpecError::Read {
            path: path.clone(),
            source,
        })?;
        Spec::parse(&data).map_err(|source| SpecError::Parse { path, source })
    }

    pub fn parse(data: &[u8]) -> Result<Spec, ParseError> {
        let v: Value = serde_json::from_slice(data).map_err(ParseError::Json)?;
        let annotations = match v.get("annotations") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(_) => return Err(field("annotations", "not an object")),
        };
        let kind = match annotations.get(CRI_CONTAINER_TYPE).and_then(Value::as_str) {
            None => Kind::Task,
            Some("sandbox") => Kind::PodSandbox,
            Some("container") => Kind::PodContainer {
                sandbox: annotations
                    .get(CRI_SANDBOX_ID)
                    .and_then(Value::as_str)
                    .ok_or_else(|| field(CRI_SANDBOX_ID, "missing on a pod container"))?
                    .to_string(),
            },
            Some(t) => return Err(field(CRI_CONTAINER_TYPE, format!("unknown type {t:?}"))),
        };
        let args = v
            .pointer("/process/args")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .map(|s| s.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
            })
            .unwrap_or(Some(Vec::new()))
            .ok_or_else(|| field("process.args", "not all strings"))?;
        let netns = v
            .pointer("/linux/namespaces")
            .and_then(Value::as_array)
            .and_then(|nss| {
                nss.iter()
                    .find(|n| n.get("type").and_then(Value::as_str) == Some("network"))
            })
            .and_then(|n| n.get("path").and_then(Value::as_str))
            .filter(|p| !p.is_empty())
            .map(PathBuf::from);
        if let Some(p) = &netns {
            if !p.is_absolute() {
                return Err(field(
                    "linux.namespaces",
                    format!("network namespace path {p:?} is not absolute"),
                ));
            }
        }
        Ok(Spec {
            kind,
            annotations,
            args,
            netns,
        })
    }
}

/// The grouping key of `shim start`: one shim per pod, as Kata does; a
/// standalone task has its own.
pub fn grouping(bundle: &Path, id: &str) -> String {
    match Spec::load(bundle).map(|s| s.kind) {
        Ok(Kind::PodContainer { sandbox }) => sandbox,
        _ => id.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cri_sandbox_container_and_task() {
        let s = Spec::parse(br#"{"process":{"args":["/pause"]},
            "annotations":{"io.kubernetes.cri.container-type":"sandbox","io.burstvm.variant":"vanilla"},
            "linux":{"namespaces":[{"type":"pid"},{"type":"network","path":"/run/netns/cni-1"}]}}"#)
            .unwrap();
        assert_eq!(s.kind, Kind::PodSandbox);
        assert_eq!(s.args, vec!["/pause"]);
        assert_eq!(s.netns, Some(PathBuf::from("/run/netns/cni-1")));
        let s = Spec::parse(
            br#"{"annotations":{"io.kubernetes.cri.container-type":"container",
            "io.kubernetes.cri.sandbox-id":"abc"},"linux":{"namespaces":[{"type":"network"}]}}"#,
        )
        .unwrap();
        assert_eq!(
            s.kind,
            Kind::PodContainer {
                sandbox: "abc".into()
            }
        );
        assert_eq!(s.netns, None);
        let s = Spec::parse(br#"{"process":{"args":["/app","x"]}}"#).unwrap();
        assert_eq!(s.kind, Kind::Task);
        assert!(Spec::parse(br#"{"process":{"args":[1]}}"#).is_err());
        assert!(
            Spec::parse(br#"{"annotations":{"io.kubernetes.cri.container-type":"vm"}}"#).is_err()
        );
        assert!(
            Spec::parse(br#"{"linux":{"namespaces":[{"type":"network","path":"rel"}]}}"#).is_err()
        );
        assert!(Spec::parse(b"[").is_err());
    }
}
