//! A container's ContainerConfig from `create`/`run` flags, and the `ps` table.

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use k8s_cri::v1::{
    Container, ContainerConfig, ContainerMetadata, ContainerState, ImageSpec, KeyValue,
    LinuxContainerConfig, LinuxContainerSecurityContext, NamespaceMode, NamespaceOption,
    PodSandboxConfig,
};

use super::pod::parse_kv;

/// What `create` and `run` share.
#[derive(Debug, Clone, clap::Args)]
pub struct ContainerOpts {
    /// Environment variables, KEY=VALUE.
    #[arg(long = "env", short = 'e', value_parser = parse_kv)]
    pub envs: Vec<(String, String)>,
    /// Working directory (default: the image's).
    #[arg(long)]
    pub workdir: Option<String>,
    /// Give the container a terminal.
    #[arg(long, short = 't')]
    pub tty: bool,
    /// Keep the container's stdin open.
    #[arg(long, short = 'i')]
    pub stdin: bool,
    /// Log file, relative to the pod's log directory (default: NAME_0.log).
    #[arg(long)]
    pub log_path: Option<String>,
}

#[derive(Debug, Clone, clap::Args)]
pub struct CreateArgs {
    /// The pod sandbox to create the container in.
    pub pod: String,
    /// An image ref containerd has (k8s.io namespace); nothing is pulled.
    pub image: String,
    /// The command and its arguments (default: the image's entrypoint and cmd).
    #[arg(last = true)]
    pub cmd: Vec<String>,
    /// Container name (metadata.name; default: the image's base name).
    #[arg(long)]
    pub name: Option<String>,
    /// Container annotations, KEY=VALUE.
    #[arg(long = "annotation", value_parser = parse_kv)]
    pub annotations: Vec<(String, String)>,
    /// Container labels, KEY=VALUE.
    #[arg(long = "label", value_parser = parse_kv)]
    pub labels: Vec<(String, String)>,
    #[command(flatten)]
    pub opts: ContainerOpts,
}

/// `burstvm.local/busybox:1` → `busybox`.
fn image_base_name(image: &str) -> String {
    let last = image.rsplit('/').next().unwrap_or(image);
    let last = last.split('@').next().unwrap_or(last);
    last.split(':').next().unwrap_or(last).to_string()
}

impl CreateArgs {
    pub fn name(&self) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| image_base_name(&self.image))
    }

    /// The container's config in the pod `pod` was run with.
    pub fn config(&self, pod: &PodSandboxConfig) -> ContainerConfig {
        let name = self.name();
        let o = &self.opts;
        // As kubelet does: the pod's network (the host's for a host-network
        // pod), the pod's IPC, a PID namespace of the container's own.
        let pod_network = pod
            .linux
            .as_ref()
            .and_then(|l| l.security_context.as_ref())
            .and_then(|s| s.namespace_options.as_ref())
            .map(|n| n.network)
            .unwrap_or(NamespaceMode::Pod as i32);
        ContainerConfig {
            metadata: Some(ContainerMetadata {
                name: name.clone(),
                attempt: 0,
            }),
            image: Some(ImageSpec {
                image: self.image.clone(),
                ..Default::default()
            }),
            command: self.cmd.clone(),
            working_dir: o.workdir.clone().unwrap_or_default(),
            envs: o
                .envs
                .iter()
                .map(|(k, v)| KeyValue {
                    key: k.clone(),
                    value: v.clone(),
                })
                .collect(),
            labels: self.labels.iter().cloned().collect::<HashMap<_, _>>(),
            annotations: self.annotations.iter().cloned().collect::<HashMap<_, _>>(),
            log_path: o
                .log_path
                .clone()
                .unwrap_or_else(|| format!("{name}_0.log")),
            stdin: o.stdin,
            tty: o.tty,
            linux: Some(LinuxContainerConfig {
                security_context: Some(LinuxContainerSecurityContext {
                    namespace_options: Some(NamespaceOption {
                        network: pod_network,
                        pid: NamespaceMode::Container as i32,
                        ipc: NamespaceMode::Pod as i32,
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

pub fn state_name(s: i32) -> &'static str {
    match ContainerState::try_from(s) {
        Ok(ContainerState::ContainerCreated) => "Created",
        Ok(ContainerState::ContainerRunning) => "Running",
        Ok(ContainerState::ContainerExited) => "Exited",
        Ok(ContainerState::ContainerUnknown) => "Unknown",
        Err(_) => "?",
    }
}

/// `ns` (ns since the epoch) as "N units ago", as crictl prints CREATED.
pub fn ago(ns: i64) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0);
    let s = (now - ns).max(0) / 1_000_000_000;
    let (n, unit) = match s {
        0..=59 => (s, "second"),
        60..=3599 => (s / 60, "minute"),
        3600..=86399 => (s / 3600, "hour"),
        _ => (s / 86400, "day"),
    };
    format!("{n} {unit}{} ago", if n == 1 { "" } else { "s" })
}

/// crictl's short form of an id.
fn short(id: &str, trunc: bool) -> &str {
    if trunc {
        &id[..id.len().min(13)]
    } else {
        id
    }
}

pub fn ps_table(cs: &[Container], trunc: bool) -> String {
    let idw = if trunc { 13 } else { 64 };
    let mut out = format!(
        "{:<idw$}  {:<28}  {:<16}  {:<8}  {:<20}  POD ID\n",
        "CONTAINER", "IMAGE", "CREATED", "STATE", "NAME"
    );
    for c in cs {
        let image = c
            .image
            .as_ref()
            .map(|i| i.image.as_str())
            .filter(|i| !i.is_empty())
            .unwrap_or(&c.image_ref);
        out += &format!(
            "{:<idw$}  {:<28}  {:<16}  {:<8}  {:<20}  {}\n",
            short(&c.id, trunc),
            image,
            ago(c.created_at),
            state_name(c.state),
            c.metadata.as_ref().map(|m| m.name.as_str()).unwrap_or(""),
            short(&c.pod_sandbox_id, trunc),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: CreateArgs,
    }

    #[test]
    fn create_flags_make_the_container_config() {
        let t = T::try_parse_from([
            "t",
            "POD",
            "burstvm.local/busybox:1",
            "--env",
            "A=1",
            "-t",
            "--workdir",
            "/tmp",
            "--label",
            "l=v",
            "--",
            "sh",
            "-c",
            "echo hi",
        ])
        .unwrap();
        let pod = PodSandboxConfig::default();
        let c = t.a.config(&pod);
        assert_eq!(t.a.pod, "POD");
        assert_eq!(c.metadata.unwrap().name, "busybox");
        assert_eq!(c.image.unwrap().image, "burstvm.local/busybox:1");
        assert_eq!(c.command, ["sh", "-c", "echo hi"]);
        assert_eq!(c.envs[0].key, "A");
        assert_eq!(c.working_dir, "/tmp");
        assert_eq!(c.log_path, "busybox_0.log");
        assert!(c.tty && !c.stdin);
        assert_eq!(c.labels["l"], "v");
        let ns = c
            .linux
            .unwrap()
            .security_context
            .unwrap()
            .namespace_options
            .unwrap();
        assert_eq!(ns.network, NamespaceMode::Pod as i32);
    }

    #[test]
    fn image_base_names() {
        assert_eq!(image_base_name("burstvm.local/busybox:1"), "busybox");
        assert_eq!(image_base_name("docker.io/library/nginx"), "nginx");
        assert_eq!(image_base_name("x/y@sha256:ab"), "y");
    }

    #[test]
    fn ago_counts_in_the_largest_unit() {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos() as i64;
        assert_eq!(ago(now - 1_000_000_000), "1 second ago");
        assert_eq!(ago(now - 150 * 1_000_000_000), "2 minutes ago");
        assert_eq!(ago(now - 2 * 86400 * 1_000_000_000), "2 days ago");
    }
}
