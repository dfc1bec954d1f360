//! The parts of a bundle's OCI `config.json` the shim uses: what kind of
//! container it is (CRI's annotations), its process (the entrypoint of the
//! built-in agent; the guest agent's `CreateProcess` in a Linux guest), its
//! netns, and the resources that size its microVM.

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
    /// A JSON value that does not decode as the field's type.
    #[error("{field}: {source}")]
    FieldJson {
        field: String,
        #[source]
        source: serde_json::Error,
    },
}

fn field(field: impl Into<String>, reason: impl Into<String>) -> ParseError {
    ParseError::Field {
        field: field.into(),
        reason: reason.into(),
    }
}

/// What a container is to the shim.
/// The bind mounts the CRI plugin adds to every sandbox and container, which
/// the guest provides itself (Kata does the same): the agent writes /etc/hosts,
/// /etc/hostname and /etc/resolv.conf from the pod's settings, /dev/shm is
/// the guest's tmpfs, and /dev/termination-log is a file in the container's
/// own /dev (kubelet does not read it back from a microVM).
pub const GUEST_PROVIDED: [&str; 5] = [
    "/etc/hosts",
    "/etc/hostname",
    "/etc/resolv.conf",
    "/dev/shm",
    "/dev/termination-log",
];

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
    /// `process.env`.
    pub env: Vec<String>,
    /// `process` as config.json has it (the guest agent's OCI subset).
    pub process: Option<Value>,
    /// Destinations of `mounts` that bind a host path (`--mount type=bind`,
    /// volumes).
    pub bind_mounts: Vec<String>,
    /// The network namespace path the engine made (CRI), if any.
    pub netns: Option<PathBuf>,
    pub resources: Resources,
}

/// `linux.resources`, the parts that size a microVM.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resources {
    /// `memory.limit` (bytes; `ctr run --memory-limit`).
    pub memory_limit: Option<u64>,
    /// `cpu.quota` and `cpu.period` (µs; `ctr run --cpus`).
    pub cpu_quota: Option<i64>,
    pub cpu_period: Option<u64>,
    /// `cpu.cpus` (`--cpuset-cpus`).
    pub cpuset: Option<String>,
}

/// Environment variables an engine sets on every process (containerd's
/// default PATH, CRI's HOSTNAME, a terminal's TERM, HOME): they do not change
/// what the built-in agent's app does, so they are not refused there.
const CONVENTIONAL_ENV: [&str; 4] = ["PATH", "HOSTNAME", "TERM", "HOME"];

/// The smallest guest RAM a memory limit may give a sandbox.
pub const MIN_MEMORY: u64 = 32 << 20;

/// How a task's microVM is sized.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sizing {
    /// Guest RAM.
    pub memory_bytes: u64,
    /// CPU limit of the sandbox's cgroup.
    pub cpus: f64,
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
        let strings = |ptr: &str, name: &str| {
            v.pointer(ptr)
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .map(|s| s.as_str().map(str::to_string))
                        .collect::<Option<Vec<_>>>()
                })
                .unwrap_or(Some(Vec::new()))
                .ok_or_else(|| field(name, "not all strings"))
        };
        let args = strings("/process/args", "process.args")?;
        let env = strings("/process/env", "process.env")?;
        let process = v.get("process").filter(|p| !p.is_null()).cloned();
        let bind_mounts = v
            .get("mounts")
            .and_then(Value::as_array)
            .map(|ms| {
                ms.iter()
                    .filter(|m| {
                        let bind_opt =
                            m.get("options").and_then(Value::as_array).is_some_and(|o| {
                                o.iter().any(|x| {
                                    x.as_str().is_some_and(|x| x == "bind" || x == "rbind")
                                })
                            });
                        m.get("type").and_then(Value::as_str) == Some("bind") || bind_opt
                    })
                    .map(|m| {
                        m.get("destination")
                            .and_then(Value::as_str)
                            .unwrap_or("?")
                            .to_string()
                    })
                    .collect()
            })
            .unwrap_or_default();
        let resources = Resources::parse(v.pointer("/linux/resources"))?;
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
            env,
            process,
            bind_mounts,
            netns,
            resources,
        })
    }

    /// Why a Linux guest cannot honour this spec, if it cannot: a host path
    /// bound into the container (the guest sees its image and its writable
    /// layer only; no file system is shared with the host).
    pub fn linux_refusal(&self) -> Option<String> {
        let host: Vec<&String> = self
            .bind_mounts
            .iter()
            .filter(|d| !GUEST_PROVIDED.contains(&d.as_str()))
            .collect();
        (!host.is_empty()).then(|| {
            format!(
                "mounts {host:?}: a host path bound into the container cannot be honoured: the \
                 microVM sees its image and writable layer only (no shared file system)"
            )
        })
    }

    /// Why the built-in agent cannot honour this process, if it cannot: its
    /// app is the entrypoint's bytes, run with no arguments and no
    /// environment (docs/shim.md), so further args and any environment
    /// variable beyond the conventional ones are refused, never dropped.
    pub fn builtin_refusal(&self) -> Option<String> {
        const HINT: &str = "the built-in agent runs the entrypoint as an app payload without \
                            arguments or environment; a Linux guest runs it (shim.json kernel)";
        if self.args.len() > 1 {
            return Some(format!(
                "process.args {:?}: arguments after the entrypoint cannot be honoured: {HINT}",
                self.args
            ));
        }
        let extra: Vec<&str> = self
            .env
            .iter()
            .map(String::as_str)
            .filter(|e| !CONVENTIONAL_ENV.contains(&e.split('=').next().unwrap_or("")))
            .collect();
        if !extra.is_empty() {
            return Some(format!("process.env {extra:?} cannot be honoured: {HINT}"));
        }
        None
    }

    /// The microVM's size: the memory limit is its guest RAM (at least
    /// `min_memory`), a CPU quota its cgroup's CPU limit; else the
    /// config's. A cpuset is refused (a sandbox's vCPUs are not pinned).
    pub fn sizing(
        &self,
        default_memory: u64,
        default_cpus: f64,
        min_memory: u64,
    ) -> Result<Sizing, ParseError> {
        let r = &self.resources;
        if let Some(set) = &r.cpuset {
            return Err(field(
                "linux.resources.cpu.cpus",
                format!("cpuset {set:?} cannot be honoured: a sandbox's vCPUs are not pinned"),
            ));
        }
        let memory_bytes = match r.memory_limit {
            None => default_memory,
            Some(n) if n < min_memory => {
                return Err(field(
                    "linux.resources.memory.limit",
                    format!(
                        "{n} bytes: the limit is the microVM's RAM, at least {} MiB",
                        min_memory >> 20
                    ),
                ))
            }
            // Whole MiB: the VMM's memory is sized in pages, the cgroup in bytes.
            Some(n) => n.next_multiple_of(1 << 20),
        };
        let cpus = match (r.cpu_quota, r.cpu_period) {
            (Some(q), Some(p)) if q > 0 && p > 0 => q as f64 / p as f64,
            (Some(q), None) if q > 0 => q as f64 / 100_000.0,
            _ => default_cpus,
        };
        Ok(Sizing { memory_bytes, cpus })
    }

    /// The guest agent's OCI process: config.json's `process` (the agent
    /// honours args, env, cwd, user, terminal, consoleSize, rlimits and
    /// noNewPrivileges). Without HOME in `env`, HOME is the user's home
    /// directory from `rootfs`'s /etc/passwd (`/` without one), as runc does.
    pub fn agent_process(&self, rootfs: &Path) -> Result<agent_proto::Process, ParseError> {
        let v = self
            .process
            .clone()
            .ok_or_else(|| field("process", "missing"))?;
        agent_process(v, rootfs, "process")
    }
}

/// An OCI process (config.json's `process`, or an exec's spec) as the guest
/// agent takes it; `what` names it in errors.
pub fn agent_process(
    v: Value,
    rootfs: &Path,
    what: &str,
) -> Result<agent_proto::Process, ParseError> {
    let mut p: agent_proto::Process =
        serde_json::from_value(v).map_err(|source| ParseError::FieldJson {
            field: what.to_string(),
            source,
        })?;
    if p.args.is_empty() {
        return Err(field(format!("{what}.args"), "empty: nothing to run"));
    }
    if !p.cwd.starts_with('/') {
        return Err(field(
            format!("{what}.cwd"),
            format!("{:?} is not absolute", p.cwd),
        ));
    }
    if !p.env.iter().any(|e| e.starts_with("HOME=")) {
        let home = ::rootfs::resolve_user(rootfs, &p.user.uid.to_string())
            .map(|u| u.home)
            .unwrap_or_else(|_| "/".into());
        p.env.push(format!("HOME={home}"));
    }
    Ok(p)
}

impl Resources {
    fn parse(v: Option<&Value>) -> Result<Resources, ParseError> {
        let Some(v) = v.filter(|v| !v.is_null()) else {
            return Ok(Resources::default());
        };
        let num = |ptr: &str| -> Result<Option<i64>, ParseError> {
            match v.pointer(ptr) {
                None | Some(Value::Null) => Ok(None),
                Some(n) => n.as_i64().map(Some).ok_or_else(|| {
                    field(
                        format!("linux.resources{}", ptr.replace('/', ".")),
                        format!("{n} is not an integer"),
                    )
                }),
            }
        };
        // -1 and 0 mean "no limit" in OCI's cgroup fields.
        let memory_limit = num("/memory/limit")?.filter(|n| *n > 0).map(|n| n as u64);
        let cpu_quota = num("/cpu/quota")?.filter(|n| *n > 0);
        let cpu_period = num("/cpu/period")?.filter(|n| *n > 0).map(|n| n as u64);
        let cpuset = v
            .pointer("/cpu/cpus")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_string);
        Ok(Resources {
            memory_limit,
            cpu_quota,
            cpu_period,
            cpuset,
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

    /// What the built-in agent cannot honour is refused, never dropped:
    /// arguments after the entrypoint, environment beyond the conventional.
    #[test]
    fn the_builtin_agent_refuses_args_and_env_it_cannot_honour() {
        let ok = Spec::parse(
            br#"{"process":{"args":["/app"],"env":["PATH=/bin","HOSTNAME=h","TERM=xterm"]}}"#,
        )
        .unwrap();
        assert_eq!(ok.builtin_refusal(), None);
        let env =
            Spec::parse(br#"{"process":{"args":["/app"],"env":["PATH=/bin","FOO=bar"]}}"#).unwrap();
        let e = env.builtin_refusal().unwrap();
        assert!(e.contains("FOO=bar") && e.contains("kernel"), "{e}");
        let args = Spec::parse(br#"{"process":{"args":["/app","x"]}}"#).unwrap();
        let e = args.builtin_refusal().unwrap();
        assert!(e.contains("arguments") && e.contains("\"x\""), "{e}");
        assert!(Spec::parse(br#"{"process":{"env":[3]}}"#).is_err());
    }

    /// `--memory-limit` is the microVM's RAM, `--cpus` its cgroup's CPU
    /// limit; too little memory and a cpuset are refused with the field named.
    #[test]
    fn memory_limit_and_cpu_quota_size_the_microvm() {
        let s = |json: &str| Spec::parse(json.as_bytes()).unwrap();
        let none = s(r#"{"linux":{"resources":{"memory":{"limit":0},"cpu":{"shares":2}}}}"#);
        assert_eq!(
            none.sizing(64 << 20, 1.0, MIN_MEMORY).unwrap(),
            Sizing {
                memory_bytes: 64 << 20,
                cpus: 1.0
            }
        );
        let sized = s(r#"{"linux":{"resources":{"memory":{"limit":200000000},
            "cpu":{"quota":50000,"period":100000}}}}"#);
        let z = sized.sizing(64 << 20, 1.0, MIN_MEMORY).unwrap();
        assert_eq!(z.memory_bytes, 191 << 20);
        assert_eq!(z.cpus, 0.5);
        let e = sized
            .sizing(64 << 20, 1.0, 256 << 20)
            .unwrap_err()
            .to_string();
        assert!(e.contains("memory.limit") && e.contains("256 MiB"), "{e}");
        let small = s(r#"{"linux":{"resources":{"memory":{"limit":1048576}}}}"#);
        assert!(small.sizing(64 << 20, 1.0, MIN_MEMORY).is_err());
        let set = s(r#"{"linux":{"resources":{"cpu":{"cpus":"0-1"}}}}"#);
        let e = set
            .sizing(64 << 20, 1.0, MIN_MEMORY)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cpu.cpus") && e.contains("0-1"), "{e}");
        assert!(Spec::parse(br#"{"linux":{"resources":{"memory":{"limit":"x"}}}}"#).is_err());
    }

    /// config.json's process becomes the agent's: args, env, cwd, user,
    /// terminal, rlimits, noNewPrivileges; HOME from the image's passwd.
    #[test]
    fn the_oci_process_becomes_the_agents() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("etc")).unwrap();
        std::fs::write(
            d.path().join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n",
        )
        .unwrap();
        let s = Spec::parse(
            br#"{"process":{"terminal":true,"consoleSize":{"height":30,"width":100},
            "user":{"uid":1000,"gid":1000,"additionalGids":[10]},"args":["sh","-c","id"],
            "env":["PATH=/bin","FOO=bar"],"cwd":"/tmp","capabilities":{"bounding":["CAP_KILL"]},
            "rlimits":[{"type":"RLIMIT_NOFILE","hard":1024,"soft":1024}],
            "noNewPrivileges":true}}"#,
        )
        .unwrap();
        let p = s.agent_process(d.path()).unwrap();
        assert!(p.terminal);
        assert_eq!(p.args, ["sh", "-c", "id"]);
        assert_eq!(p.env, ["PATH=/bin", "FOO=bar", "HOME=/home/app"]);
        assert_eq!(p.cwd, "/tmp");
        assert_eq!((p.user.uid, p.user.gid), (1000, 1000));
        assert_eq!(p.user.additional_gids, [10]);
        assert_eq!(p.rlimits.len(), 1);
        assert!(p.no_new_privileges);
        assert_eq!(p.console_size.map(|c| (c.height, c.width)), Some((30, 100)));
        // HOME given is kept; a uid without a passwd entry gets /.
        let p = agent_process(
            serde_json::json!({"args":["x"],"env":["HOME=/h"],"cwd":"/"}),
            d.path(),
            "process",
        )
        .unwrap();
        assert_eq!(p.env, ["HOME=/h"]);
        let p = agent_process(
            serde_json::json!({"args":["x"],"user":{"uid":7},"cwd":"/"}),
            d.path(),
            "process",
        )
        .unwrap();
        assert_eq!(p.env, ["HOME=/"]);
        let e = agent_process(
            serde_json::json!({"args":[],"cwd":"/"}),
            d.path(),
            "exec spec",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("exec spec.args"), "{e}");
        let e = agent_process(
            serde_json::json!({"args":["x"],"cwd":"rel"}),
            d.path(),
            "process",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("cwd") && e.contains("rel"), "{e}");
        assert!(Spec::parse(b"{}").unwrap().agent_process(d.path()).is_err());
    }

    #[test]
    fn host_bind_mounts_are_refused_in_a_linux_guest() {
        let s = Spec::parse(
            br#"{"mounts":[{"destination":"/proc","type":"proc","source":"proc"},
            {"destination":"/dev/shm","type":"tmpfs","source":"shm"}]}"#,
        )
        .unwrap();
        assert_eq!(s.linux_refusal(), None);
        let s = Spec::parse(
            br#"{"mounts":[{"destination":"/data","type":"bind","source":"/srv"},
            {"destination":"/etc/x","source":"/x","options":["rbind","ro"]}]}"#,
        )
        .unwrap();
        let e = s.linux_refusal().unwrap();
        assert!(e.contains("/data") && e.contains("/etc/x"), "{e}");
        // What CRI binds into every container, the guest provides.
        let s = Spec::parse(
            br#"{"mounts":[{"destination":"/etc/resolv.conf","type":"bind","source":"/var/x"},
            {"destination":"/dev/shm","type":"bind","source":"/run/shm"}]}"#,
        )
        .unwrap();
        assert_eq!(s.linux_refusal(), None);
    }
}
