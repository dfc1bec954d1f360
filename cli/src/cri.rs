//! `burstvm cri runp|stopp|rmp|pods|inspectp`: a CRI client (k8s-cri, CRI
//! v1 over gRPC on containerd's socket) doing what `crictl` does for pod
//! sandboxes. crictl itself cannot be installed here (docs/shim.md).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use hyper_util::rt::TokioIo;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    LinuxPodSandboxConfig, LinuxSandboxSecurityContext, ListPodSandboxRequest, NamespaceMode,
    NamespaceOption, PodSandboxConfig, PodSandboxMetadata, PodSandboxStatus,
    PodSandboxStatusRequest, RemovePodSandboxRequest, RunPodSandboxRequest, StopPodSandboxRequest,
};
use tonic::transport::{Channel, Endpoint, Uri};

/// `burstvm cri`.
#[derive(Debug, clap::Args)]
pub struct CriArgs {
    /// containerd's CRI socket.
    #[arg(long, default_value = "/run/containerd/containerd.sock")]
    pub endpoint: PathBuf,
    /// Seconds any one call may take.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    #[command(subcommand)]
    pub command: CriCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum CriCommand {
    /// Create and start a pod sandbox (RunPodSandbox); prints its id.
    Runp(PodArgs),
    /// Stop pod sandboxes (StopPodSandbox).
    Stopp { ids: Vec<String> },
    /// Remove pod sandboxes (RemovePodSandbox).
    Rmp { ids: Vec<String> },
    /// List pod sandboxes (ListPodSandbox).
    Pods {
        /// One JSON object per pod instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// A pod sandbox's status as JSON (PodSandboxStatus), e.g. its IP.
    Inspectp { id: String },
}

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
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

impl PodArgs {
    pub fn config(&self) -> PodSandboxConfig {
        PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: self.name.clone(),
                uid: self
                    .uid
                    .clone()
                    .unwrap_or_else(|| format!("{}-{}", self.namespace, self.name)),
                namespace: self.namespace.clone(),
                attempt: 0,
            }),
            hostname: self.name.clone(),
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

/// A blocking CRI client: every call bounded by the timeout.
pub struct CriClient {
    rt: tokio::runtime::Runtime,
    client: RuntimeServiceClient<Channel>,
    endpoint: PathBuf,
    timeout: Duration,
}

impl CriClient {
    pub fn connect(endpoint: &Path, timeout: Duration) -> Result<CriClient> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("tokio runtime")?;
        let path = endpoint.to_path_buf();
        let channel = rt
            .block_on(async {
                Endpoint::try_from("http://[::]:50051")?
                    .connect_timeout(Duration::from_secs(10))
                    .timeout(timeout)
                    .connect_with_connector(tower::service_fn(move |_: Uri| {
                        let path = path.clone();
                        async move {
                            Ok::<_, std::io::Error>(TokioIo::new(
                                tokio::net::UnixStream::connect(path).await?,
                            ))
                        }
                    }))
                    .await
            })
            .with_context(|| format!("CRI endpoint {}", endpoint.display()))?;
        Ok(CriClient {
            rt,
            client: RuntimeServiceClient::new(channel),
            endpoint: endpoint.to_path_buf(),
            timeout,
        })
    }

    fn call<T>(
        &self,
        what: &str,
        f: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T> {
        let r = self
            .rt
            .block_on(async { tokio::time::timeout(self.timeout, f).await })
            .map_err(|_| {
                anyhow!(
                    "{what} on {}: no answer within {} s",
                    self.endpoint.display(),
                    self.timeout.as_secs()
                )
            })?;
        r.map(tonic::Response::into_inner).map_err(|s| {
            anyhow!(
                "{what} on {}: {:?}: {}",
                self.endpoint.display(),
                s.code(),
                s.message()
            )
        })
    }

    pub fn runp(&self, pod: &PodArgs) -> Result<String> {
        let mut c = self.client.clone();
        let req = RunPodSandboxRequest {
            config: Some(pod.config()),
            runtime_handler: pod.runtime.clone(),
        };
        Ok(self
            .call("RunPodSandbox", c.run_pod_sandbox(req))?
            .pod_sandbox_id)
    }

    /// `pods` RunPodSandbox calls issued at once; per call its result and
    /// the CLOCK_MONOTONIC instant it returned. Returns (issue instant, results).
    pub fn runp_concurrent(&self, pods: &[PodArgs]) -> (u64, Vec<(Result<String>, u64)>) {
        let timeout = self.timeout;
        self.rt.block_on(async {
            let issue = trace::monotonic_ns();
            let mut set = tokio::task::JoinSet::new();
            for (i, pod) in pods.iter().enumerate() {
                let mut c = self.client.clone();
                let req = RunPodSandboxRequest {
                    config: Some(pod.config()),
                    runtime_handler: pod.runtime.clone(),
                };
                set.spawn(async move {
                    let r = tokio::time::timeout(timeout, c.run_pod_sandbox(req)).await;
                    let end = trace::monotonic_ns();
                    let r = match r {
                        Err(_) => Err(anyhow!(
                            "RunPodSandbox: no answer within {} s",
                            timeout.as_secs()
                        )),
                        Ok(Err(s)) => {
                            Err(anyhow!("RunPodSandbox: {:?}: {}", s.code(), s.message()))
                        }
                        Ok(Ok(r)) => Ok(r.into_inner().pod_sandbox_id),
                    };
                    (i, r, end)
                });
            }
            let mut out: Vec<Option<(Result<String>, u64)>> =
                (0..pods.len()).map(|_| None).collect();
            while let Some(j) = set.join_next().await {
                if let Ok((i, r, end)) = j {
                    out[i] = Some((r, end));
                }
            }
            let results = out
                .into_iter()
                .map(|o| o.unwrap_or_else(|| (Err(anyhow!("RunPodSandbox task panicked")), 0)))
                .collect();
            (issue, results)
        })
    }

    pub fn stopp(&self, id: &str) -> Result<()> {
        let mut c = self.client.clone();
        self.call(
            "StopPodSandbox",
            c.stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: id.to_string(),
            }),
        )
        .map(|_| ())
    }

    pub fn rmp(&self, id: &str) -> Result<()> {
        let mut c = self.client.clone();
        self.call(
            "RemovePodSandbox",
            c.remove_pod_sandbox(RemovePodSandboxRequest {
                pod_sandbox_id: id.to_string(),
            }),
        )
        .map(|_| ())
    }

    /// Stop and remove all of `ids` concurrently (bench teardown).
    pub fn stop_remove_concurrent(&self, ids: &[String]) -> Vec<String> {
        let timeout = self.timeout;
        self.rt.block_on(async {
            let mut set = tokio::task::JoinSet::new();
            for id in ids {
                let mut c = self.client.clone();
                let id = id.clone();
                set.spawn(async move {
                    let stop = StopPodSandboxRequest {
                        pod_sandbox_id: id.clone(),
                    };
                    let rm = RemovePodSandboxRequest {
                        pod_sandbox_id: id.clone(),
                    };
                    match tokio::time::timeout(timeout, c.stop_pod_sandbox(stop)).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(s)) => return Some(format!("StopPodSandbox {id}: {}", s.message())),
                        Err(_) => return Some(format!("StopPodSandbox {id}: timeout")),
                    }
                    match tokio::time::timeout(timeout, c.remove_pod_sandbox(rm)).await {
                        Ok(Ok(_)) => None,
                        Ok(Err(s)) => Some(format!("RemovePodSandbox {id}: {}", s.message())),
                        Err(_) => Some(format!("RemovePodSandbox {id}: timeout")),
                    }
                });
            }
            let mut errs = Vec::new();
            while let Some(j) = set.join_next().await {
                if let Ok(Some(e)) = j {
                    errs.push(e);
                }
            }
            errs
        })
    }

    pub fn pods(&self) -> Result<Vec<k8s_cri::v1::PodSandbox>> {
        let mut c = self.client.clone();
        Ok(self
            .call(
                "ListPodSandbox",
                c.list_pod_sandbox(ListPodSandboxRequest { filter: None }),
            )?
            .items)
    }

    pub fn inspectp(&self, id: &str) -> Result<PodSandboxStatus> {
        let mut c = self.client.clone();
        self.call(
            "PodSandboxStatus",
            c.pod_sandbox_status(PodSandboxStatusRequest {
                pod_sandbox_id: id.to_string(),
                verbose: false,
            }),
        )?
        .status
        .ok_or_else(|| anyhow!("PodSandboxStatus {id}: no status"))
    }
}

fn state_name(s: i32) -> &'static str {
    match s {
        0 => "Ready",
        1 => "NotReady",
        _ => "?",
    }
}

pub fn run_cli(a: &CriArgs) -> Result<()> {
    let c = CriClient::connect(&a.endpoint, Duration::from_secs(a.timeout))?;
    match &a.command {
        CriCommand::Runp(p) => println!("{}", c.runp(p)?),
        CriCommand::Stopp { ids } => {
            for id in ids {
                c.stopp(id)?;
                println!("Stopped sandbox {id}");
            }
        }
        CriCommand::Rmp { ids } => {
            for id in ids {
                c.rmp(id)?;
                println!("Removed sandbox {id}");
            }
        }
        CriCommand::Pods { json } => {
            let pods = c.pods()?;
            if *json {
                for p in &pods {
                    println!("{}", serde_json::to_string(p).context("pod as JSON")?);
                }
            } else {
                println!(
                    "{:<64}  {:<8}  {:<20}  {:<12}  RUNTIME",
                    "POD ID", "STATE", "NAME", "NAMESPACE"
                );
                for p in &pods {
                    let m = p.metadata.clone().unwrap_or_default();
                    println!(
                        "{:<64}  {:<8}  {:<20}  {:<12}  {}",
                        p.id,
                        state_name(p.state),
                        m.name,
                        m.namespace,
                        p.runtime_handler
                    );
                }
            }
        }
        CriCommand::Inspectp { id } => {
            println!(
                "{}",
                serde_json::to_string_pretty(&c.inspectp(id)?).context("status as JSON")?
            );
        }
    }
    Ok(())
}
