//! The blocking CRI client: one connection to containerd's socket, the
//! runtime and image services on it, every call bounded by a deadline and
//! its error naming the call, the object and the socket.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use hyper_util::rt::TokioIo;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    Container, ContainerConfig, ContainerFilter, ContainerState, ContainerStatus,
    ContainerStatusRequest, CreateContainerRequest, ExecRequest, ExecSyncRequest, ExecSyncResponse,
    Image, ListContainersRequest, ListImagesRequest, ListPodSandboxRequest, PodSandbox,
    PodSandboxConfig, PodSandboxStatus, PodSandboxStatusRequest, RemoveContainerRequest,
    RemovePodSandboxRequest, RunPodSandboxRequest, StartContainerRequest, StopContainerRequest,
    StopPodSandboxRequest,
};
use tonic::transport::{Channel, Endpoint, Uri};

use super::pod::PodArgs;

/// A blocking CRI client: every call bounded by the timeout.
pub struct CriClient {
    rt: tokio::runtime::Runtime,
    client: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
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
        // No per-request timeout on the channel: `call_within` sets each
        // call's own (ExecSync and StopContainer may need longer).
        let channel = rt
            .block_on(async {
                Endpoint::try_from("http://[::]:50051")?
                    .connect_timeout(Duration::from_secs(10))
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
            client: RuntimeServiceClient::new(channel.clone()),
            images: ImageServiceClient::new(channel),
            endpoint: endpoint.to_path_buf(),
            timeout,
        })
    }

    fn call<T>(
        &self,
        what: &str,
        f: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T> {
        self.call_within(what, self.timeout, f)
    }

    fn call_within<T>(
        &self,
        what: &str,
        timeout: Duration,
        f: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T> {
        let r = self
            .rt
            .block_on(async { tokio::time::timeout(timeout, f).await })
            .map_err(|_| {
                anyhow!(
                    "{what} on {}: no answer within {} s",
                    self.endpoint.display(),
                    timeout.as_secs()
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
            .call(
                &format!("RunPodSandbox {}/{}", pod.namespace, pod.name),
                c.run_pod_sandbox(req),
            )?
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
            &format!("StopPodSandbox {id}"),
            c.stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: id.to_string(),
            }),
        )
        .map(|_| ())
    }

    pub fn rmp(&self, id: &str) -> Result<()> {
        let mut c = self.client.clone();
        self.call(
            &format!("RemovePodSandbox {id}"),
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

    pub fn pods(&self) -> Result<Vec<PodSandbox>> {
        let mut c = self.client.clone();
        Ok(self
            .call(
                "ListPodSandbox",
                c.list_pod_sandbox(ListPodSandboxRequest { filter: None }),
            )?
            .items)
    }

    pub fn inspectp(&self, id: &str) -> Result<PodSandboxStatus> {
        Ok(self.inspectp_verbose(id, false)?.0)
    }

    /// PodSandboxStatus with, when `verbose`, the runtime's `info` map
    /// (containerd: "info" → JSON holding the pod's whole config).
    pub fn inspectp_verbose(
        &self,
        id: &str,
        verbose: bool,
    ) -> Result<(PodSandboxStatus, HashMap<String, String>)> {
        let mut c = self.client.clone();
        let r = self.call(
            &format!("PodSandboxStatus {id}"),
            c.pod_sandbox_status(PodSandboxStatusRequest {
                pod_sandbox_id: id.to_string(),
                verbose,
            }),
        )?;
        let status = r
            .status
            .ok_or_else(|| anyhow!("PodSandboxStatus {id}: no status"))?;
        Ok((status, r.info))
    }

    /// Returns the container id.
    pub fn create(
        &self,
        pod_id: &str,
        config: ContainerConfig,
        sandbox_config: PodSandboxConfig,
    ) -> Result<String> {
        let mut c = self.client.clone();
        let name = config.metadata.as_ref().map(|m| m.name.clone());
        Ok(self
            .call(
                &format!(
                    "CreateContainer {} in pod {pod_id}",
                    name.unwrap_or_default()
                ),
                c.create_container(CreateContainerRequest {
                    pod_sandbox_id: pod_id.to_string(),
                    config: Some(config),
                    sandbox_config: Some(sandbox_config),
                }),
            )?
            .container_id)
    }

    pub fn start(&self, id: &str) -> Result<()> {
        let mut c = self.client.clone();
        self.call(
            &format!("StartContainer {id}"),
            c.start_container(StartContainerRequest {
                container_id: id.to_string(),
            }),
        )
        .map(|_| ())
    }

    /// `grace`: seconds between the stop signal and SIGKILL (0: SIGKILL).
    pub fn stop(&self, id: &str, grace: u64) -> Result<()> {
        let mut c = self.client.clone();
        self.call_within(
            &format!("StopContainer {id}"),
            self.timeout + Duration::from_secs(grace),
            c.stop_container(StopContainerRequest {
                container_id: id.to_string(),
                timeout: grace as i64,
            }),
        )
        .map(|_| ())
    }

    /// Waits (bounded by the client's timeout) until the container is no
    /// longer running. containerd's StopContainer returns at once, without
    /// waiting, when it races the container's own exit: its exit handler has
    /// deleted the task but not yet marked the container exited, and a
    /// RemoveContainer in that window fails with "still running".
    pub fn wait_not_running(&self, id: &str) -> Result<()> {
        let deadline = std::time::Instant::now() + self.timeout;
        loop {
            if self.inspect(id)?.state != ContainerState::ContainerRunning as i32 {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                anyhow::bail!(
                    "container {id} on {}: still running {} s after StopContainer",
                    self.endpoint.display(),
                    self.timeout.as_secs()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn rm(&self, id: &str) -> Result<()> {
        let mut c = self.client.clone();
        self.call(
            &format!("RemoveContainer {id}"),
            c.remove_container(RemoveContainerRequest {
                container_id: id.to_string(),
            }),
        )
        .map(|_| ())
    }

    pub fn containers(&self, filter: Option<ContainerFilter>) -> Result<Vec<Container>> {
        let mut c = self.client.clone();
        Ok(self
            .call(
                "ListContainers",
                c.list_containers(ListContainersRequest { filter }),
            )?
            .containers)
    }

    pub fn inspect(&self, id: &str) -> Result<ContainerStatus> {
        let mut c = self.client.clone();
        self.call(
            &format!("ContainerStatus {id}"),
            c.container_status(ContainerStatusRequest {
                container_id: id.to_string(),
                verbose: false,
            }),
        )?
        .status
        .ok_or_else(|| anyhow!("ContainerStatus {id}: no status"))
    }

    /// `limit`: seconds the command may run (0: no limit but the call's).
    pub fn exec_sync(&self, id: &str, cmd: &[String], limit: u64) -> Result<ExecSyncResponse> {
        let mut c = self.client.clone();
        self.call_within(
            &format!("ExecSync {cmd:?} in container {id}"),
            self.timeout + Duration::from_secs(limit),
            c.exec_sync(ExecSyncRequest {
                container_id: id.to_string(),
                cmd: cmd.to_vec(),
                timeout: limit as i64,
            }),
        )
    }

    /// The streaming server's URL for an interactive exec.
    pub fn exec(&self, req: ExecRequest) -> Result<String> {
        let mut c = self.client.clone();
        let what = format!("Exec {:?} in container {}", req.cmd, req.container_id);
        Ok(self.call(&what, c.exec(req))?.url)
    }

    pub fn images(&self) -> Result<Vec<Image>> {
        let mut c = self.images.clone();
        Ok(self
            .call(
                "ListImages",
                c.list_images(ListImagesRequest { filter: None }),
            )?
            .images)
    }
}
