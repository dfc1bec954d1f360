//! A private containerd (own root, state, sockets and config, CRI plugin on,
//! burstvm as its default runtime and runc beside it, burstvm-cni in its CNI
//! conf dir) for the tests and `burstvm bench startup --via cri`. Nothing of
//! it touches the host's containerd, if any.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum ContainerdError {
    #[error("containerd in {dir}: {what}: {source}")]
    Io {
        dir: PathBuf,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("containerd in {dir}: {reason}")]
    Failed { dir: PathBuf, reason: String },
    #[error("containerd in {dir}: PATH: {source}")]
    Path {
        dir: PathBuf,
        #[source]
        source: std::env::JoinPathsError,
    },
}

/// How to set a private containerd up.
#[derive(Debug, Clone)]
pub struct ContainerdConfig {
    /// Everything goes under here (root, state, sockets, config, log).
    pub dir: PathBuf,
    /// Put first on containerd's PATH: must hold `containerd-shim-burstvm-v2`.
    pub shim_dir: PathBuf,
    /// The shim config (`ConfigPath` of the runtime options).
    pub shim_config: PathBuf,
    /// CNI plugins (burstvm-cni, whose IPAM runs in its process; loopback;
    /// host-local for networks that name it) and the conf dir.
    pub cni_bin_dir: PathBuf,
    pub cni_conf_dir: PathBuf,
    /// The CRI plugin's pause image (imported locally, never pulled).
    pub sandbox_image: String,
}

/// A running private containerd; stopped (and its directory removed) on drop.
#[derive(Debug)]
pub struct Containerd {
    child: Option<Child>,
    cfg: ContainerdConfig,
    socket: PathBuf,
}

impl Containerd {
    pub fn config_toml(cfg: &ContainerdConfig) -> String {
        let d = cfg.dir.display();
        format!(
            r#"version = 2
root = "{d}/root"
state = "{d}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{img}"
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  netns_mounts_under_state_dir = true
  # The sandbox's -998 needs CAP_SYS_RESOURCE, which a test host may lack
  # (runc then fails to start the pause container).
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "burstvm"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.burstvm]
      runtime_type = "io.containerd.burstvm.v2"
      pod_annotations = ["io.burstvm.*"]
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.burstvm.options]
        ConfigPath = "{shim}"
    # For pods with runtime handler "runc" (tests of the CRI client); the
    # default stays burstvm. runc's state under ours, not /run/containerd/runc.
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "{d}/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{bin}"
    conf_dir = "{conf}"
    max_conf_num = 1
"#,
            img = cfg.sandbox_image,
            shim = cfg.shim_config.display(),
            bin = cfg.cni_bin_dir.display(),
            conf = cfg.cni_conf_dir.display(),
        )
    }

    /// Writes the config and starts `containerd`; returns once its socket answers.
    pub fn start(cfg: ContainerdConfig) -> Result<Containerd, ContainerdError> {
        let io = |what: &str| {
            let dir = cfg.dir.clone();
            let what = what.to_string();
            move |source| ContainerdError::Io { dir, what, source }
        };
        std::fs::create_dir_all(&cfg.dir).map_err(io("create directory"))?;
        let toml = cfg.dir.join("config.toml");
        std::fs::write(&toml, Containerd::config_toml(&cfg)).map_err(io("write config.toml"))?;
        let log = std::fs::File::create(cfg.dir.join("containerd.log"))
            .map_err(io("create containerd.log"))?;
        let path = std::env::join_paths(std::iter::once(cfg.shim_dir.clone()).chain(
            std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
        ))
        .map_err(|source| ContainerdError::Path {
            dir: cfg.dir.clone(),
            source,
        })?;
        let mut cmd = Command::new("containerd");
        cmd.arg("--config")
            .arg(&toml)
            .env("PATH", path)
            .env("BURSTVM_SHIM_CONFIG", &cfg.shim_config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        // containerd dies with its owner.
        procutil::die_with_parent(&mut cmd);
        let child = cmd
            .spawn()
            .map_err(io("spawn containerd (apt install containerd)"))?;
        let socket = cfg.dir.join("containerd.sock");
        let mut c = Containerd {
            child: Some(child),
            cfg,
            socket,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if std::os::unix::net::UnixStream::connect(&c.socket).is_ok()
                && c.ctr("default", &["version"])
                    .output()
                    .is_ok_and(|o| o.status.success())
            {
                return Ok(c);
            }
            if let Some(Ok(Some(st))) = c.child.as_mut().map(|ch| ch.try_wait()) {
                c.child = None;
                return Err(ContainerdError::Failed {
                    dir: c.cfg.dir.clone(),
                    reason: format!("exited with {st}: {}", c.log_tail()),
                });
            }
            if Instant::now() > deadline {
                return Err(ContainerdError::Failed {
                    dir: c.cfg.dir.clone(),
                    reason: format!("socket did not answer within 30 s: {}", c.log_tail()),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub fn dir(&self) -> &Path {
        &self.cfg.dir
    }

    /// The bundle containerd makes for a task (runtime v2 layout).
    pub fn bundle(&self, namespace: &str, id: &str) -> PathBuf {
        self.cfg
            .dir
            .join("state/io.containerd.runtime.v2.task")
            .join(namespace)
            .join(id)
    }

    /// `ctr --address <socket> -n <namespace> ARGS`.
    pub fn ctr(&self, namespace: &str, args: &[&str]) -> Command {
        let mut c = Command::new("ctr");
        c.arg("--address")
            .arg(&self.socket)
            .args(["-n", namespace])
            .args(args)
            .stdin(Stdio::null());
        c
    }

    /// `ctr image import` of a local OCI tarball.
    pub fn import(&self, namespace: &str, tarball: &Path) -> Result<(), ContainerdError> {
        let out = self
            .ctr(namespace, &["image", "import", "--all-platforms"])
            .arg(tarball)
            .output()
            .map_err(|source| ContainerdError::Io {
                dir: self.cfg.dir.clone(),
                what: "run ctr".into(),
                source,
            })?;
        if !out.status.success() {
            return Err(ContainerdError::Failed {
                dir: self.cfg.dir.clone(),
                reason: format!(
                    "ctr image import {}: {}",
                    tarball.display(),
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            });
        }
        Ok(())
    }

    /// The last lines of containerd's log.
    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(self.cfg.dir.join("containerd.log")).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// Pids of the shims this containerd started (their `-address` is our socket).
    pub fn shim_pids(&self) -> Vec<u32> {
        let want = self.socket.to_string_lossy().into_owned();
        processes(|args| {
            args.first()
                .is_some_and(|a| a.ends_with("containerd-shim-burstvm-v2"))
                && args.windows(2).any(|w| w[0] == "-address" && w[1] == want)
        })
    }

    /// Stops containerd (SIGTERM, SIGKILL after 10 s), kills shims it left,
    /// unmounts what is left under its directory and removes it.
    pub fn stop(&mut self) -> Vec<String> {
        let mut left = Vec::new();
        if let Some(c) = self.child.take() {
            runtime::sandbox::stop_child(c, Duration::from_secs(10));
        }
        for pid in self.shim_pids() {
            left.push(format!("shim process {pid}"));
            // SAFETY: kill(2) on a shim our containerd started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        for m in mounts_under(&self.cfg.dir) {
            left.push(format!("mount {}", m.display()));
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
        if std::env::var_os("BURSTVM_KEEP_LOGS").is_none() {
            let _ = std::fs::remove_dir_all(&self.cfg.dir);
        }
        left
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Mount points at or below `dir`, deepest first.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let want = dir.to_string_lossy().into_owned();
    let mut v: Vec<PathBuf> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|mp| mp.starts_with(&want))
        .map(PathBuf::from)
        .collect();
    v.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    v
}

/// Pids of processes whose argv matches.
pub fn processes(matches: impl Fn(&[String]) -> bool) -> Vec<u32> {
    runtime::vmmproc::all_argv()
        .into_iter()
        .filter(|(_, args)| matches(args))
        .map(|(pid, _)| pid)
        .collect()
}

/// Writes a shim config (`shim.json`) for `services`.
pub fn write_shim_config(
    path: &Path,
    services: &Path,
    variant: &str,
    memory_bytes: u64,
    trace_copy: Option<&Path>,
) -> std::io::Result<()> {
    let mut v = serde_json::json!({
        "services": services,
        "variant": variant,
        "memory": format!("{}K", memory_bytes >> 10),
        "timeout_secs": 120,
    });
    if let Some(t) = trace_copy {
        v["trace_copy"] = serde_json::json!(t);
    }
    let mut f = std::fs::File::create(path)?;
    f.write_all(&serde_json::to_vec_pretty(&v).expect("json"))
}
