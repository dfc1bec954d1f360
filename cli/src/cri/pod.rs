//! A pod's PodSandboxConfig: made from `runp`'s flags, and made again from
//! the pod's status for CreateContainer (which takes the pod's config
//! again: containerd joins its log directory and the container's log path).

use std::collections::HashMap;
use std::path::PathBuf;

use k8s_cri::v1::{
    LinuxPodSandboxConfig, LinuxSandboxSecurityContext, NamespaceMode, NamespaceOption,
    PodSandboxConfig, PodSandboxMetadata, PodSandboxStatus,
};

/// Where a pod's container logs go unless `--log-dir` says otherwise
/// (kubelet's /var/log/pods layout under a name of our own).
pub const LOG_ROOT: &str = "/var/log/burstvm-pods";

#[derive(Debug, Clone, clap::Args)]
pub struct PodArgs {
    /// Pod name (metadata.name).
    #[arg(long, default_value = "burstvm-pod")]
    pub name: String,
    /// Kubernetes namespace (metadata.namespace).
    #[arg(long, default_value = "default")]
    pub namespace: String,
    /// Pod uid (default: derived from name and namespace).
    #[arg(long)]
    pub uid: Option<String>,
    /// The CRI runtime handler (the RuntimeClass's handler).
    #[arg(long, default_value = "burstvm")]
    pub runtime: String,
    /// Pod annotations, KEY=VALUE (e.g. io.burstvm.variant=vanilla).
    #[arg(long = "annotation", value_parser = parse_kv)]
    pub annotations: Vec<(String, String)>,
    /// The host's network (no pod netns, no CNI): for the no-net variant.
    #[arg(long)]
    pub host_network: bool,
    /// The pod's log directory, containers' log paths are relative to it
    /// (default: /var/log/burstvm-pods/NAMESPACE_NAME_UID).
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
}

pub fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

pub fn default_log_dir(m: &PodSandboxMetadata) -> String {
    format!("{LOG_ROOT}/{}_{}_{}", m.namespace, m.name, m.uid)
}

impl PodArgs {
    pub fn config(&self) -> PodSandboxConfig {
        let metadata = PodSandboxMetadata {
            name: self.name.clone(),
            uid: self
                .uid
                .clone()
                .unwrap_or_else(|| format!("{}-{}", self.namespace, self.name)),
            namespace: self.namespace.clone(),
            attempt: 0,
        };
        let log_directory = match &self.log_dir {
            Some(d) => d.display().to_string(),
            None => default_log_dir(&metadata),
        };
        PodSandboxConfig {
            metadata: Some(metadata),
            // As kubelet: a host-network pod has the host's UTS namespace,
            // where runc refuses to set a hostname.
            hostname: if self.host_network {
                String::new()
            } else {
                self.name.clone()
            },
            log_directory,
            annotations: self.annotations.iter().cloned().collect::<HashMap<_, _>>(),
            linux: self.host_network.then(|| LinuxPodSandboxConfig {
                security_context: Some(LinuxSandboxSecurityContext {
                    namespace_options: Some(NamespaceOption {
                        network: NamespaceMode::Node as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

/// The config a pod was run with, as far as a container's creation uses
/// it: metadata, labels, annotations and namespace modes from its status;
/// log directory and hostname from containerd's verbose `info` (its stored
/// config), else the default log directory.
pub fn config_from_status(
    status: &PodSandboxStatus,
    info: &HashMap<String, String>,
) -> PodSandboxConfig {
    let metadata = status.metadata.clone().unwrap_or_default();
    let stored: Option<serde_json::Value> = info
        .get("info")
        .and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok())
        .and_then(|v| v.get("config").cloned());
    let field = |k: &str| {
        stored
            .as_ref()
            .and_then(|c| c.get(k))
            .and_then(|v| v.as_str())
            .filter(|s| !s.is_empty())
            .map(str::to_string)
    };
    let namespace_options = status
        .linux
        .as_ref()
        .and_then(|l| l.namespaces.as_ref())
        .and_then(|n| n.options.clone());
    PodSandboxConfig {
        log_directory: field("log_directory").unwrap_or_else(|| default_log_dir(&metadata)),
        hostname: field("hostname").unwrap_or_default(),
        metadata: Some(metadata),
        labels: status.labels.clone(),
        annotations: status.annotations.clone(),
        linux: namespace_options.map(|o| LinuxPodSandboxConfig {
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: Some(o),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_cri::v1::{LinuxPodSandboxStatus, Namespace};

    fn status(host_network: bool) -> PodSandboxStatus {
        PodSandboxStatus {
            id: "p".into(),
            metadata: Some(PodSandboxMetadata {
                name: "web".into(),
                uid: "u1".into(),
                namespace: "ns".into(),
                attempt: 2,
            }),
            annotations: [("a".to_string(), "b".to_string())].into(),
            labels: [("l".to_string(), "v".to_string())].into(),
            linux: Some(LinuxPodSandboxStatus {
                namespaces: Some(Namespace {
                    options: Some(NamespaceOption {
                        network: if host_network {
                            NamespaceMode::Node as i32
                        } else {
                            NamespaceMode::Pod as i32
                        },
                        ..Default::default()
                    }),
                }),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn config_from_status_keeps_identity_and_takes_the_stored_log_directory() {
        let info: HashMap<String, String> = [(
            "info".to_string(),
            r#"{"pid":1,"config":{"hostname":"h","log_directory":"/tmp/logs/x"}}"#.to_string(),
        )]
        .into();
        let c = config_from_status(&status(true), &info);
        let m = c.metadata.clone().unwrap();
        assert_eq!(
            (m.name.as_str(), m.uid.as_str(), m.attempt),
            ("web", "u1", 2)
        );
        assert_eq!(c.log_directory, "/tmp/logs/x");
        assert_eq!(c.hostname, "h");
        assert_eq!(c.annotations["a"], "b");
        assert_eq!(c.labels["l"], "v");
        let ns = c.linux.unwrap().security_context.unwrap().namespace_options;
        assert_eq!(ns.unwrap().network, NamespaceMode::Node as i32);
    }

    #[test]
    fn config_from_status_without_info_falls_back_to_the_default_log_directory() {
        let c = config_from_status(&status(false), &HashMap::new());
        assert_eq!(c.log_directory, "/var/log/burstvm-pods/ns_web_u1");
    }

    #[test]
    fn runp_config_has_the_log_directory() {
        let p = PodArgs {
            name: "n".into(),
            namespace: "d".into(),
            uid: None,
            runtime: "runc".into(),
            annotations: vec![],
            host_network: false,
            log_dir: None,
        };
        assert_eq!(p.config().log_directory, "/var/log/burstvm-pods/d_n_d-n");
        let p = PodArgs {
            log_dir: Some("/tmp/l".into()),
            ..p
        };
        assert_eq!(p.config().log_directory, "/tmp/l");
    }
}
