//! The shim's configuration: a JSON file named by the runtime options
//! (`ConfigPath`, as Kata does), overridable per pod by annotations.

use std::path::{Path, PathBuf};

use runtime::Variant;
use serde::{Deserialize, Serialize};

/// Where the config is when containerd passes no `ConfigPath`.
pub const DEFAULT_CONFIG: &str = "/etc/burstvm/shim.json";
/// The pod/container annotation that selects the variant (`io.burstvm.variant=vanilla`).
pub const ANNOTATION_VARIANT: &str = "io.burstvm.variant";
/// The annotation that selects the guest: `builtin` (the built-in agent's
/// app payload) or `linux` (the config's kernel and the guest agent). A path
/// is never taken from an annotation: the kernel is the host's choice.
pub const ANNOTATION_GUEST: &str = "io.burstvm.guest";
/// The runtime options type containerd 1.6 sends for runtimes other than runc.
const RUNTIME_OPTIONS_TYPE: &str = "runtimeoptions.v1.Options";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("shim config {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("shim config {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("shim config {path}: field variant: {source}")]
    Variant {
        path: PathBuf,
        #[source]
        source: runtime::variant::UnknownVariant,
    },
    /// A size field (`memory`, `layer_size`) that does not parse.
    #[error("shim config {path}: field {field}: {source}")]
    Size {
        path: PathBuf,
        field: &'static str,
        #[source]
        source: Box<runtime::Error>,
    },
    #[error("shim config {path}: field {field}: {reason}")]
    Field {
        path: PathBuf,
        field: &'static str,
        reason: String,
    },
    #[error("runtime options ({type_url}): {reason}")]
    Options { type_url: String, reason: String },
    #[error("runtime options ({type_url}): {source}")]
    OptionsDecode {
        type_url: String,
        #[source]
        source: containerd_shim::protos::protobuf::Error,
    },
    #[error("annotation {key}={value:?}: {source}")]
    AnnotationVariant {
        key: &'static str,
        value: String,
        #[source]
        source: runtime::variant::UnknownVariant,
    },
    #[error("annotation {key}={value:?}: {reason}")]
    Annotation {
        key: &'static str,
        value: String,
        reason: String,
    },
}

/// `shim.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ShimConfig {
    /// The `services.json` written by `burstvm services`.
    pub services: PathBuf,
    /// Default variant (annotation `io.burstvm.variant` overrides it).
    #[serde(default = "default_variant")]
    pub variant: String,
    /// Guest memory per sandbox, e.g. "64M".
    #[serde(default = "default_memory")]
    pub memory: String,
    /// CPU limit of each sandbox's cgroup.
    #[serde(default = "default_cpus")]
    pub cpus: f64,
    /// Seconds a guest may take to become ready.
    #[serde(default = "default_timeout")]
    pub timeout_secs: u64,
    /// Also append each sandbox's trace lines here once it is ready (a
    /// benchmark's merged trace); the bundle's `trace.jsonl` is always written.
    #[serde(default)]
    pub trace_copy: Option<PathBuf>,
    /// The condensed Linux kernel (`scripts/build-guest-kernel.sh`): with it,
    /// a task runs the bundle's OCI process in a Linux guest under the guest
    /// agent (docs/shim.md, "Two guests"); without it, the built-in agent.
    #[serde(default)]
    pub kernel: Option<PathBuf>,
    /// The static guest agent (`scripts/build-agent.sh`); default: as
    /// `burstvm run --kernel` finds it (`$BURSTVM_AGENT`, else beside the build).
    #[serde(default)]
    pub agent: Option<PathBuf>,
    /// Where container images (EROFS, by digest) and the agent's initramfs
    /// are cached; default `$BURSTVM_IMAGE_CACHE`, else /var/lib/burstvm/images.
    #[serde(default)]
    pub image_cache: Option<PathBuf>,
    /// Capacity of a Linux guest's writable layer (the ext4 template).
    #[serde(default = "default_layer_size")]
    pub layer_size: String,
    /// Empty disk slots of a Linux guest's pod VM: how many of its
    /// containers can hold an image at once (docs/shim.md, "Pods").
    #[serde(default = "default_pod_slots")]
    pub pod_slots: u8,
}

/// Which guest runs a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Guest {
    /// The built-in agent: the entrypoint is its app payload.
    Builtin,
    /// The Linux kernel with the guest agent running the OCI process.
    Linux { kernel: PathBuf, agent: PathBuf },
}

fn default_variant() -> String {
    "fastiov".into()
}
fn default_memory() -> String {
    "64M".into()
}
fn default_cpus() -> f64 {
    1.0
}
fn default_timeout() -> u64 {
    60
}
fn default_pod_slots() -> u8 {
    4
}

fn default_layer_size() -> String {
    "64M".into()
}

impl ShimConfig {
    pub fn load(path: &Path) -> Result<ShimConfig, ConfigError> {
        let data = std::fs::read(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let c: ShimConfig = serde_json::from_slice(&data).map_err(|source| ConfigError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let field = |field, reason: String| ConfigError::Field {
            path: path.to_path_buf(),
            field,
            reason,
        };
        let v = c
            .variant
            .parse::<Variant>()
            .map_err(|source| ConfigError::Variant {
                path: path.to_path_buf(),
                source,
            })?;
        // A pod VM: a NIC, the rootfs's two disks and vsock besides its slots.
        if !(1..=12).contains(&c.pod_slots) {
            return Err(field(
                "pod_slots",
                format!("{} is not 1..12 (a VM has at most 16 devices)", c.pod_slots),
            ));
        }
        if v == Variant::Tap {
            return Err(field(
                "variant",
                "the tap variant needs the self-hosted runtime (burstvm run)".into(),
            ));
        }
        runtime::parse_size("memory", &c.memory).map_err(|e| ConfigError::Size {
            path: path.to_path_buf(),
            field: "memory",
            source: Box::new(e),
        })?;
        if !c.cpus.is_finite() || c.cpus <= 0.0 {
            return Err(field("cpus", format!("{} must be positive", c.cpus)));
        }
        match runtime::parse_size("layer_size", &c.layer_size) {
            Ok(n) if n >= 8 << 20 => {}
            Ok(n) => return Err(field("layer_size", format!("{n} bytes: at least 8M"))),
            Err(e) => {
                return Err(ConfigError::Size {
                    path: path.to_path_buf(),
                    field: "layer_size",
                    source: Box::new(e),
                })
            }
        }
        if let Some(k) = &c.kernel {
            if !k.is_file() {
                return Err(field("kernel", format!("{} is not a file", k.display())));
            }
            match c.agent_path() {
                Some(a) if a.is_file() => {}
                Some(a) => return Err(field("agent", format!("{} is not a file", a.display()))),
                None => {
                    return Err(field(
                        "agent",
                        "no guest agent found: name it (scripts/build-agent.sh builds it)".into(),
                    ))
                }
            }
        }
        Ok(c)
    }

    /// The guest agent binary of the Linux path.
    pub fn agent_path(&self) -> Option<PathBuf> {
        self.agent
            .clone()
            .or_else(runtime::container::default_agent)
    }

    /// The image (and initramfs) cache.
    pub fn image_cache_dir(&self) -> PathBuf {
        self.image_cache
            .clone()
            .unwrap_or_else(|| ::rootfs::ImageCache::from_env().dir().to_path_buf())
    }

    pub fn layer_bytes(&self) -> u64 {
        runtime::parse_size("layer_size", &self.layer_size).unwrap_or(64 << 20)
    }

    /// The guest of a task: the annotation `io.burstvm.guest` if present
    /// (`linux` needs the config's kernel), else Linux when the config names
    /// a kernel, else the built-in agent.
    /// The Linux guest, if the config names a kernel (and the agent is found).
    pub fn linux_guest(&self) -> Option<Guest> {
        Some(Guest::Linux {
            kernel: self.kernel.clone()?,
            agent: self.agent_path()?,
        })
    }

    pub fn guest_for(
        &self,
        annotations: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Guest, ConfigError> {
        let linux = || self.linux_guest();
        match annotations.get(ANNOTATION_GUEST).and_then(|v| v.as_str()) {
            None => Ok(linux().unwrap_or(Guest::Builtin)),
            Some("builtin") => Ok(Guest::Builtin),
            Some("linux") => linux().ok_or_else(|| ConfigError::Annotation {
                key: ANNOTATION_GUEST,
                value: "linux".into(),
                reason: "the shim config names no kernel".into(),
            }),
            Some(v) => Err(ConfigError::Annotation {
                key: ANNOTATION_GUEST,
                value: v.into(),
                reason: "expected builtin or linux".into(),
            }),
        }
    }

    pub fn memory_bytes(&self) -> u64 {
        runtime::parse_size("memory", &self.memory).unwrap_or(64 << 20)
    }

    /// The variant of a sandbox: the annotation if present, else the config's.
    pub fn variant_for(
        &self,
        annotations: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Variant, ConfigError> {
        match annotations.get(ANNOTATION_VARIANT).and_then(|v| v.as_str()) {
            Some(v) => {
                let variant: Variant =
                    v.parse().map_err(|source| ConfigError::AnnotationVariant {
                        key: ANNOTATION_VARIANT,
                        value: v.to_string(),
                        source,
                    })?;
                if variant == Variant::Tap {
                    return Err(ConfigError::Annotation {
                        key: ANNOTATION_VARIANT,
                        value: v.to_string(),
                        reason: "the tap variant needs the self-hosted runtime (burstvm run)"
                            .into(),
                    });
                }
                Ok(variant)
            }
            None => Ok(self.variant.parse().expect("checked at load")),
        }
    }
}

/// The config path from the task's runtime options (`ConfigPath` of
/// containerd's `runtimeoptions.v1.Options`, or `ctr run
/// --runtime-config-path`), else `BURSTVM_SHIM_CONFIG`, else the default.
pub fn config_path(type_url: &str, value: &[u8]) -> Result<PathBuf, ConfigError> {
    if !type_url.is_empty() {
        let name = type_url.rsplit('/').next().unwrap_or(type_url);
        if name != RUNTIME_OPTIONS_TYPE {
            return Err(ConfigError::Options {
                type_url: type_url.into(),
                reason: format!("expected {RUNTIME_OPTIONS_TYPE} (ConfigPath)"),
            });
        }
        if let Some(p) = decode_config_path(type_url, value)? {
            return Ok(PathBuf::from(p));
        }
    }
    Ok(std::env::var_os("BURSTVM_SHIM_CONFIG")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG)))
}

/// `runtimeoptions.v1.Options { string type_url = 1; string config_path = 2; }`:
/// returns field 2 if set (empty = unset).
fn decode_config_path(type_url: &str, buf: &[u8]) -> Result<Option<String>, ConfigError> {
    use containerd_shim::protos::protobuf::CodedInputStream;
    let decode = |source| ConfigError::OptionsDecode {
        type_url: type_url.into(),
        source,
    };
    let mut is = CodedInputStream::from_bytes(buf);
    let mut path = None;
    while !is.eof().map_err(decode)? {
        let tag = is.read_raw_varint32().map_err(decode)?;
        match (tag >> 3, tag & 7) {
            (2, 2) => path = Some(is.read_string().map_err(decode)?),
            (_, 2) => {
                is.read_bytes().map_err(decode)?;
            }
            (_, 0) => {
                is.read_raw_varint64().map_err(decode)?;
            }
            (f, w) => {
                return Err(ConfigError::Options {
                    type_url: type_url.into(),
                    reason: format!("field {f}: unexpected wire type {w}"),
                })
            }
        }
    }
    Ok(path.filter(|p| !p.is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_options_give_the_config_path() {
        // type_url = "x", config_path = "/etc/b.json", as containerd encodes it.
        let mut buf = vec![0x0a, 1, b'x', 0x12, 11];
        buf.extend_from_slice(b"/etc/b.json");
        let p = config_path("runtimeoptions.v1.Options", &buf).unwrap();
        assert_eq!(p, PathBuf::from("/etc/b.json"));
        let e = config_path("containerd.runc.v1.Options", &buf).unwrap_err();
        assert!(e.to_string().contains("ConfigPath"), "{e}");
        assert!(config_path("runtimeoptions.v1.Options", &[0x12, 5, b'a']).is_err());
        // No options: the environment or the default.
        let p = config_path("", &[]).unwrap();
        assert!(p.ends_with("shim.json") || std::env::var_os("BURSTVM_SHIM_CONFIG").is_some());
    }

    #[test]
    fn config_and_annotations() {
        let dir = std::env::temp_dir().join(format!("burstvm-shimcfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("shim.json");
        std::fs::write(&p, r#"{"services":"/run/s.json","variant":"vanilla"}"#).unwrap();
        let c = ShimConfig::load(&p).unwrap();
        assert_eq!(c.memory_bytes(), 64 << 20);
        let mut ann = serde_json::Map::new();
        assert_eq!(c.variant_for(&ann).unwrap(), Variant::Vanilla);
        ann.insert(ANNOTATION_VARIANT.into(), "no-net".into());
        assert_eq!(c.variant_for(&ann).unwrap(), Variant::NoNet);
        ann.insert(ANNOTATION_VARIANT.into(), "tap".into());
        assert!(c.variant_for(&ann).is_err());
        ann.insert(ANNOTATION_VARIANT.into(), "warp".into());
        let e = c.variant_for(&ann).unwrap_err().to_string();
        assert!(e.contains(ANNOTATION_VARIANT) && e.contains("warp"), "{e}");
        std::fs::write(&p, r#"{"services":"/s","variant":"bogus"}"#).unwrap();
        let e = ShimConfig::load(&p).unwrap_err().to_string();
        assert!(e.contains("variant") && e.contains("shim.json"), "{e}");
        std::fs::write(&p, r#"{"services":"/s","memroy":"1G"}"#).unwrap();
        assert!(ShimConfig::load(&p).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A kernel selects the Linux guest; the annotation picks either guest
    /// (never a path), `linux` without a kernel is refused.
    #[test]
    fn the_guest_is_the_configs_or_the_annotations() {
        let dir = tempfile::tempdir().unwrap();
        let (kernel, agent) = (dir.path().join("vmlinux"), dir.path().join("agent"));
        std::fs::write(&kernel, b"k").unwrap();
        std::fs::write(&agent, b"a").unwrap();
        let p = dir.path().join("shim.json");
        std::fs::write(&p, r#"{"services":"/s"}"#).unwrap();
        let builtin = ShimConfig::load(&p).unwrap();
        let mut ann = serde_json::Map::new();
        assert_eq!(builtin.guest_for(&ann).unwrap(), Guest::Builtin);
        ann.insert(ANNOTATION_GUEST.into(), "linux".into());
        let e = builtin.guest_for(&ann).unwrap_err().to_string();
        assert!(
            e.contains(ANNOTATION_GUEST) && e.contains("no kernel"),
            "{e}"
        );
        std::fs::write(
            &p,
            serde_json::json!({"services": "/s", "kernel": kernel, "agent": agent,
                "layer_size": "32M"})
            .to_string(),
        )
        .unwrap();
        let linux = ShimConfig::load(&p).unwrap();
        assert_eq!(linux.layer_bytes(), 32 << 20);
        let want = Guest::Linux {
            kernel: kernel.clone(),
            agent: agent.clone(),
        };
        assert_eq!(linux.guest_for(&ann).unwrap(), want);
        ann.insert(ANNOTATION_GUEST.into(), "builtin".into());
        assert_eq!(linux.guest_for(&ann).unwrap(), Guest::Builtin);
        ann.insert(ANNOTATION_GUEST.into(), "/boot/vmlinuz".into());
        assert!(linux.guest_for(&ann).is_err());
        ann.clear();
        assert_eq!(linux.guest_for(&ann).unwrap(), want);
        // A kernel or agent that is not a file is named at load.
        std::fs::write(
            &p,
            serde_json::json!({"services": "/s", "kernel": dir.path().join("nope"),
                "agent": agent})
            .to_string(),
        )
        .unwrap();
        let e = ShimConfig::load(&p).unwrap_err().to_string();
        assert!(e.contains("kernel") && e.contains("nope"), "{e}");
        std::fs::write(
            &p,
            serde_json::json!({"services": "/s", "kernel": kernel, "agent": "/no/agent"})
                .to_string(),
        )
        .unwrap();
        let e = ShimConfig::load(&p).unwrap_err().to_string();
        assert!(e.contains("agent") && e.contains("/no/agent"), "{e}");
        std::fs::write(&p, r#"{"services":"/s","layer_size":"1M"}"#).unwrap();
        assert!(ShimConfig::load(&p).is_err());
    }
}
