//! Executes a CNI plugin as a container engine does (CNI spec 1.x): the
//! network config from a file on stdin, the `CNI_*` environment, the result
//! or error JSON on stdout.

use std::ffi::OsStr;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use procutil::spawn::{Command, Stdio};

use netutil::cni::CniResult;
use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum CniError {
    #[error("CNI config {path}: {reason}")]
    Config { path: PathBuf, reason: String },
    /// A CNI_PATH directory cannot be joined into the variable (it holds a ':').
    #[error("CNI config {path}: CNI_PATH: {source}")]
    CniPath {
        path: PathBuf,
        #[source]
        source: std::env::JoinPathsError,
    },
    #[error("CNI config {path}: {source}")]
    ConfigRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("CNI config {path}: not JSON: {source}")]
    ConfigJson {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "CNI network {name} ({}) has \"kind\":\"sg\": {what} serves VF networks only \
         (it reads a placeholder link with the VF's MAC and address, and an SG function has \
         none); start SG sandboxes with the runtime's own ADD (burstvm run --net-kind sg)",
        .path.display()
    )]
    NotVf {
        name: String,
        path: PathBuf,
        what: &'static str,
    },
    #[error("CNI plugin {plugin}: cannot run: {source}")]
    Exec {
        plugin: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("CNI {command} of sandbox {container}: plugin {plugin} failed with code {code}: {msg}{details}")]
    Plugin {
        command: &'static str,
        container: String,
        plugin: PathBuf,
        code: u64,
        msg: String,
        details: String,
    },
    #[error("CNI {command} of sandbox {container}: plugin {plugin} exited with {status} and no error JSON: {output}")]
    Status {
        command: &'static str,
        container: String,
        plugin: PathBuf,
        status: ExitStatus,
        output: String,
    },
    #[error("CNI ADD of sandbox {container}: result: {source}: {output}")]
    ResultJson {
        container: String,
        output: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("CNI ADD of sandbox {container}: result: {source}")]
    Result {
        container: String,
        #[source]
        source: NoInterface,
    },
}

/// The CNI result has no interface of the name the sandbox asked for.
#[derive(Debug, thiserror::Error)]
#[error("no interface {ifname:?} in the result")]
pub struct NoInterface {
    pub ifname: String,
}

/// burstvm-cni's forwarder to the NIC daemon's CNI server (docs/cni.md).
pub const FORWARDER: &str = "burstvm-cni-thin";

#[derive(Debug, Deserialize)]
struct ErrorJson {
    code: u64,
    #[serde(default)]
    msg: String,
    #[serde(default)]
    details: String,
}

/// One network: a config file and the plugin binary it names.
#[derive(Debug, Clone)]
pub struct CniNetwork {
    pub config_path: PathBuf,
    config: Vec<u8>,
    /// The config's `name`, and burstvm-cni's `kind` (a VF unless `"sg"`).
    name: String,
    kind: nic_api::DevKind,
    plugin: PathBuf,
    /// Directories searched for plugins (`CNI_PATH`).
    path: Vec<PathBuf>,
    /// The namespace the engine runs the plugin in (its "host" netns);
    /// None: the runtime's own.
    host_netns: Option<PathBuf>,
    /// The NIC daemon's CNI server, when the plugin is its forwarder
    /// (`burstvm-cni-thin` with a `cniSocket`): the runtime asks it itself,
    /// sparing the forwarder's exec.
    served: Option<PathBuf>,
}

/// What a sandbox's ADD returned, reduced to what the VMM needs.
#[derive(Debug, Clone)]
pub struct Attachment {
    pub ifname: String,
    pub mac: Option<String>,
    pub ip_cidr: Option<String>,
    pub gateway: Option<String>,
    pub vf_id: Option<String>,
    /// The VF's (or SG function's) vhost-user socket.
    pub vf_socket: Option<PathBuf>,
    /// A VF, or an SG function (`"kind":"sg"` in the result: no link or address).
    pub kind: nic_api::DevKind,
}

impl CniNetwork {
    /// Loads the config file; the plugin (`type`) is looked up in `path`.
    pub fn load(config_path: &Path, path: Vec<PathBuf>) -> Result<CniNetwork, CniError> {
        let bad = |reason: String| CniError::Config {
            path: config_path.to_path_buf(),
            reason,
        };
        let config = std::fs::read(config_path).map_err(|source| CniError::ConfigRead {
            path: config_path.to_path_buf(),
            source,
        })?;
        let v: serde_json::Value =
            serde_json::from_slice(&config).map_err(|source| CniError::ConfigJson {
                path: config_path.to_path_buf(),
                source,
            })?;
        let ty = v
            .get("type")
            .and_then(|t| t.as_str())
            .ok_or_else(|| bad("missing string field \"type\"".into()))?;
        if ty.contains('/') {
            return Err(bad(format!("plugin type {ty:?} must be a bare name")));
        }
        let plugin = path
            .iter()
            .map(|d| d.join(ty))
            .find(|p| p.is_file())
            .ok_or_else(|| bad(format!("plugin {ty:?} not found in CNI_PATH {path:?}")))?;
        let field = |key: &str| v.get(key).and_then(|x| x.as_str());
        let served = (ty == FORWARDER)
            .then(|| field("cniSocket").map(PathBuf::from))
            .flatten();
        Ok(CniNetwork {
            config_path: config_path.to_path_buf(),
            name: field("name").unwrap_or_default().to_string(),
            kind: field("kind")
                .and_then(|k| k.parse().ok())
                .unwrap_or_default(),
            config,
            plugin,
            path,
            host_netns: None,
            served,
        })
    }

    /// The network's `name`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// burstvm-cni's `kind`: an SG function for `"sg"`, else a VF (its default).
    pub fn kind(&self) -> nic_api::DevKind {
        self.kind
    }

    /// Refuses an SG network for `what`, a path that reads the VF's placeholder link
    /// (the network pool, an engine's ADD attached by the shim).
    pub fn require_vf(&self, what: &'static str) -> Result<(), CniError> {
        match self.kind() {
            nic_api::DevKind::Vf => Ok(()),
            nic_api::DevKind::Sg => Err(CniError::NotVf {
                name: self.name.clone(),
                path: self.config_path.clone(),
                what,
            }),
        }
    }

    /// Runs the plugin inside `netns` (where its host-side links go).
    pub fn in_netns(mut self, netns: &Path) -> CniNetwork {
        self.host_netns = Some(netns.to_path_buf());
        self
    }

    fn exec(
        &self,
        command: &'static str,
        container: &str,
        netns: &Path,
        ifname: &str,
    ) -> Result<Vec<u8>, CniError> {
        let cni_path = std::env::join_paths(&self.path).map_err(|source| CniError::CniPath {
            path: self.config_path.clone(),
            source,
        })?;
        // The forwarder's own path, without its exec: in the runtime's netns
        // only, where the forwarder would have run.
        if let (Some(socket), None) = (&self.served, &self.host_netns) {
            let mut vars = vec![
                ("CNI_COMMAND", OsStr::new(command)),
                ("CNI_CONTAINERID", OsStr::new(container)),
                ("CNI_NETNS", netns.as_os_str()),
                ("CNI_IFNAME", OsStr::new(ifname)),
                ("CNI_PATH", &cni_path),
            ];
            // The exec'd plugin would inherit the others (CNI_ARGS, say).
            let inherited: Vec<_> = std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v)))
                .filter(|(k, _)| k.starts_with("CNI_") && !vars.iter().any(|(n, _)| n == k))
                .collect();
            vars.extend(inherited.iter().map(|(k, v)| (k.as_str(), v.as_os_str())));
            match cni::server::call(socket, &vars, &self.config) {
                Ok(o) => {
                    let status = ExitStatus::from_raw((o.status & 0xff) << 8);
                    return self.output(command, container, status, o.stdout, o.stderr);
                }
                // Nothing was done: the forwarder, exec'd, tries again and
                // falls back to the full plugin.
                Err(e) => tracing::debug!("{e}; executing {}", self.plugin.display()),
            }
        }
        let mut cmd = Command::new(&self.plugin);
        let host_ns = match &self.host_netns {
            Some(p) => Some(std::fs::File::open(p).map_err(|source| CniError::Exec {
                plugin: self.plugin.clone(),
                source,
            })?),
            None => None,
        };
        if let Some(f) = &host_ns {
            use std::os::fd::AsRawFd;
            let fd = f.as_raw_fd();
            // SAFETY: setns(2) is async-signal-safe; `fd` stays open until
            // spawn returns (it is dropped after).
            unsafe {
                cmd.pre_exec(move || crate::child::enter_netns(fd));
            }
        }
        let mut child = cmd
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", container)
            .env("CNI_NETNS", netns)
            .env("CNI_IFNAME", ifname)
            .env("CNI_PATH", cni_path)
            .stdin(Stdio::Piped)
            .stdout(Stdio::Piped)
            .stderr(Stdio::Piped)
            .spawn()
            .map_err(|source| CniError::Exec {
                plugin: self.plugin.clone(),
                source,
            })?;
        // The config fits a pipe buffer; writing before reading cannot deadlock.
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(&self.config);
        }
        // Reaped with wait4: the plugin's CPU is booked to this sandbox.
        let (status, stdout, stderr) =
            crate::cpuacct::wait_output(child).map_err(|source| CniError::Exec {
                plugin: self.plugin.clone(),
                source,
            })?;
        self.output(command, container, status, stdout, stderr)
    }

    /// The plugin's result on success, else its error result (or its
    /// output, if it printed none).
    fn output(
        &self,
        command: &'static str,
        container: &str,
        status: ExitStatus,
        stdout: Vec<u8>,
        stderr: Vec<u8>,
    ) -> Result<Vec<u8>, CniError> {
        let out = std::process::Output {
            status,
            stdout,
            stderr,
        };
        if out.status.success() {
            return Ok(out.stdout);
        }
        match serde_json::from_slice::<ErrorJson>(&out.stdout) {
            Ok(e) => Err(CniError::Plugin {
                command,
                container: container.to_string(),
                plugin: self.plugin.clone(),
                code: e.code,
                msg: e.msg,
                details: if e.details.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", e.details)
                },
            }),
            Err(_) => Err(CniError::Status {
                command,
                container: container.to_string(),
                plugin: self.plugin.clone(),
                status: out.status,
                output: format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout).trim(),
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            }),
        }
    }

    /// CNI ADD; returns the raw result and what the VMM needs from it.
    pub fn add(&self, container: &str, netns: &Path, ifname: &str) -> Result<Attachment, CniError> {
        let out = self.exec("ADD", container, netns, ifname)?;
        let r: CniResult = serde_json::from_slice(&out).map_err(|source| CniError::ResultJson {
            container: container.to_string(),
            output: String::from_utf8_lossy(&out).into_owned(),
            source,
        })?;
        attachment(&r, ifname).map_err(|source| CniError::Result {
            container: container.to_string(),
            source,
        })
    }

    /// CNI DEL (idempotent by spec).
    pub fn del(&self, container: &str, netns: &Path, ifname: &str) -> Result<(), CniError> {
        self.exec("DEL", container, netns, ifname).map(|_| ())
    }

    /// CNI DEL, repeated while the plugin says "try again later" (code 11:
    /// e.g. the NIC daemon is restarting) for at most `patience`. A DEL that
    /// is given up leaves the VF assigned, so a teardown keeps trying.
    pub fn del_retrying(
        &self,
        container: &str,
        netns: &Path,
        ifname: &str,
        patience: Duration,
    ) -> Result<(), CniError> {
        let end = Instant::now() + patience;
        let mut pause = Duration::from_millis(50);
        loop {
            match self.del(container, netns, ifname) {
                Err(CniError::Plugin { code: 11, .. }) if Instant::now() + pause < end => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                r => return r,
            }
        }
    }
}

/// Picks the sandbox interface named `ifname` and its address.
pub fn attachment(r: &CniResult, ifname: &str) -> Result<Attachment, NoInterface> {
    let (idx, iface) = r
        .interfaces
        .iter()
        .enumerate()
        .find(|(_, i)| i.name == ifname && i.sandbox.is_some())
        .or_else(|| {
            r.interfaces
                .iter()
                .enumerate()
                .find(|(_, i)| i.name == ifname)
        })
        .ok_or_else(|| NoInterface {
            ifname: ifname.to_string(),
        })?;
    let ip = r
        .ips
        .iter()
        .find(|ip| ip.interface == Some(idx))
        .or_else(|| r.ips.first());
    Ok(Attachment {
        ifname: ifname.to_string(),
        mac: iface.mac.clone(),
        ip_cidr: ip.map(|i| i.address.to_string()),
        gateway: ip.and_then(|i| i.gateway).map(|g| g.to_string()),
        vf_id: iface.pci_id.clone(),
        vf_socket: iface.socket_path.as_ref().map(PathBuf::from),
        kind: match iface.kind.as_deref() {
            Some(k) => k.parse().unwrap_or_default(),
            // libcni (cnitool, containerd) re-encodes results without burstvm's `kind`
            // (docs/cni.md): a socket without a MAC is an SG function (a VF always has one).
            None if iface.mac.is_none() && iface.socket_path.is_some() => nic_api::DevKind::Sg,
            None => nic_api::DevKind::Vf,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_parsing_picks_the_sandbox_interface() {
        let json = r#"{"cniVersion":"1.1.0",
            "interfaces":[{"name":"eth0","mac":"02:42:bf:00:00:03","sandbox":"/run/netns/x",
                           "pciID":"0000:b1:00.3","socketPath":"/run/burstvm/nic/pf0-vf3.sock"}],
            "ips":[{"address":"10.77.0.5/16","gateway":"10.77.0.1","interface":0}]}"#;
        let r: CniResult = serde_json::from_str(json).unwrap();
        let a = attachment(&r, "eth0").unwrap();
        assert_eq!(a.mac.as_deref(), Some("02:42:bf:00:00:03"));
        assert_eq!(a.ip_cidr.as_deref(), Some("10.77.0.5/16"));
        assert_eq!(a.gateway.as_deref(), Some("10.77.0.1"));
        assert_eq!(a.vf_id.as_deref(), Some("0000:b1:00.3"));
        assert_eq!(
            a.vf_socket.unwrap(),
            PathBuf::from("/run/burstvm/nic/pf0-vf3.sock")
        );
        assert!(attachment(&r, "eth1").is_err());
        assert_eq!(a.kind, nic_api::DevKind::Vf);
    }

    #[test]
    fn an_sg_function_result_is_an_sg_attachment() {
        let json = r#"{"cniVersion":"1.1.0",
            "interfaces":[{"name":"eth0","sandbox":"/run/netns/x","kind":"sg",
                           "pciID":"pf0-sg1","socketPath":"/run/burstvm/nic/pf0-sg1.sock"}]}"#;
        let r: CniResult = serde_json::from_str(json).unwrap();
        let a = attachment(&r, "eth0").unwrap();
        assert_eq!(a.kind, nic_api::DevKind::Sg);
        assert!(a.mac.is_none() && a.ip_cidr.is_none());
        // As cnitool prints it (libcni dropped `kind`): still an SG function.
        let relayed: CniResult =
            serde_json::from_str(&json.replace(r#""kind":"sg","#, "")).unwrap();
        assert_eq!(
            attachment(&relayed, "eth0").unwrap().kind,
            nic_api::DevKind::Sg
        );
        assert_eq!(
            a.vf_socket.unwrap(),
            PathBuf::from("/run/burstvm/nic/pf0-sg1.sock")
        );
    }

    #[test]
    fn plugin_errors_and_env_are_passed_through() {
        // A shell-script plugin that echoes its env on ADD and fails on DEL.
        let dir = std::env::temp_dir().join(format!("burstvm-cni-exec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let plugin = dir.join("fake-plugin");
        testutil::write_executable(
            &plugin,
            "#!/bin/sh\nread -r cfg\nif [ \"$CNI_COMMAND\" = ADD ]; then\n\
             printf '{\"interfaces\":[{\"name\":\"%s\",\"mac\":\"02:00:00:00:00:01\",\"sandbox\":\"%s\"}],\"ips\":[{\"address\":\"10.9.0.2/24\",\"interface\":0}]}' \"$CNI_IFNAME\" \"$CNI_NETNS\"\n\
             else printf '{\"cniVersion\":\"1.1.0\",\"code\":11,\"msg\":\"busy %s\",\"details\":\"stdin %s bytes\"}' \"$CNI_CONTAINERID\" \"${#cfg}\"; exit 1; fi\n",
        );
        let conf = dir.join("net.conf");
        std::fs::write(
            &conf,
            "{\"cniVersion\":\"1.1.0\",\"name\":\"n\",\"type\":\"fake-plugin\"}\n",
        )
        .unwrap();
        let net =
            CniNetwork::load(&conf, vec![PathBuf::from("/nonexistent"), dir.clone()]).unwrap();
        let a = net.add("sb1", Path::new("/run/netns/sb1"), "eth7").unwrap();
        assert_eq!(a.ifname, "eth7");
        assert_eq!(a.ip_cidr.as_deref(), Some("10.9.0.2/24"));
        let e = net
            .del("sb1", Path::new("/run/netns/sb1"), "eth7")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("code 11") && e.contains("busy sb1") && e.contains("fake-plugin"),
            "{e}"
        );
        let conf_len = std::fs::read_to_string(&conf).unwrap().trim_end().len();
        assert!(
            e.contains(&format!("stdin {conf_len} bytes")),
            "config reached stdin: {e}"
        );
        // 11 is retried until the plugin succeeds; other codes are not.
        let flaky = dir.join("flaky-plugin");
        testutil::write_executable(
            &flaky,
            &format!(
                "#!/bin/sh\ncat >/dev/null\nn=$(cat {d}/count 2>/dev/null || echo 0)\n\
                 echo $((n+1)) > {d}/count\n\
                 if [ $n -lt 2 ]; then printf '{{\"code\":11,\"msg\":\"later\"}}'; exit 1; fi\n\
                 if [ \"$CNI_CONTAINERID\" = bad ]; then printf '{{\"code\":5,\"msg\":\"io\"}}'; exit 1; fi\n",
                d = dir.display()
            ),
        );
        std::fs::write(
            &conf,
            "{\"cniVersion\":\"1.1.0\",\"name\":\"n\",\"type\":\"flaky-plugin\"}",
        )
        .unwrap();
        let net = CniNetwork::load(&conf, vec![dir.clone()]).unwrap();
        let ns = Path::new("/run/netns/sb1");
        net.del_retrying("sb1", ns, "eth0", Duration::from_secs(10))
            .expect("the third DEL succeeds");
        assert_eq!(
            std::fs::read_to_string(dir.join("count")).unwrap().trim(),
            "3"
        );
        let e = net
            .del_retrying("bad", ns, "eth0", Duration::from_secs(10))
            .unwrap_err();
        assert!(matches!(e, CniError::Plugin { code: 5, .. }), "{e}");
        assert_eq!(
            std::fs::read_to_string(dir.join("count")).unwrap().trim(),
            "4"
        );
        std::fs::remove_file(dir.join("count")).unwrap();
        let e = net
            .del_retrying("sb1", ns, "eth0", Duration::from_millis(120))
            .unwrap_err();
        assert!(
            matches!(e, CniError::Plugin { code: 11, .. }),
            "gives up: {e}"
        );

        std::fs::write(&conf, "{\"type\":\"missing-plugin\"}").unwrap();
        let e = CniNetwork::load(&conf, vec![dir.clone()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("missing-plugin") && e.contains("net.conf"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A forwarder network is asked of its server by the runtime itself (the
    /// forwarder is not exec'd), with the variables the forwarder would
    /// send; a server that went away mid-call is TRY_AGAIN_LATER; with no
    /// server, the forwarder is exec'd as before.
    #[test]
    fn a_served_network_is_asked_without_the_forwarders_exec() {
        use std::os::unix::net::UnixListener;
        let dir = tempfile::tempdir().unwrap();
        let execd = dir.path().join("execd");
        testutil::write_executable(
            &dir.path().join(FORWARDER),
            &format!(
                "#!/bin/sh\ncat >/dev/null\necho \"$CNI_COMMAND\" >> {}\n\
                 printf '{{\"interfaces\":[{{\"name\":\"eth0\",\"mac\":\"02:00:00:00:00:02\"}}]}}'\n",
                execd.display()
            ),
        );
        let sock = dir.path().join("cni.sock");
        let conf = dir.path().join("net.conf");
        std::fs::write(
            &conf,
            format!(
                r#"{{"cniVersion":"1.1.0","name":"n","type":"{FORWARDER}","cniSocket":"{}"}}"#,
                sock.display()
            ),
        )
        .unwrap();
        let net = CniNetwork::load(&conf, vec![dir.path().to_path_buf()]).unwrap();
        let ns = Path::new("/run/netns/sb1");
        let frame = |b: &[u8]| [&(b.len() as u32).to_le_bytes()[..], b].concat();
        // A stand-in server: records the request, replies in full or goes away after the
        // result it sends ahead.
        let serve = |full: bool| {
            let l = UnixListener::bind(&sock).unwrap();
            std::thread::spawn(move || {
                let (mut s, _) = l.accept().unwrap();
                let (env, config) = cni::server::read_request(&mut s).unwrap();
                let mut reply = frame(b"{\"code\":11,\"msg\":\"server went away\"}\n");
                if full {
                    reply.extend_from_slice(&0i32.to_le_bytes());
                    reply.extend(frame(
                        br#"{"interfaces":[{"name":"eth0","mac":"02:00:00:00:00:01"}]}"#,
                    ));
                    reply.extend(frame(b""));
                }
                s.write_all(&reply).unwrap();
                (env, config.unwrap())
            })
        };
        let t = serve(true);
        let a = net.add("sb1", ns, "eth0").unwrap();
        let (env, config) = t.join().unwrap();
        assert_eq!(
            a.mac.as_deref(),
            Some("02:00:00:00:00:01"),
            "the server's result"
        );
        assert_eq!(config, std::fs::read(&conf).unwrap());
        assert_eq!(env.command.as_deref(), Some("ADD"));
        assert_eq!(env.container_id.as_deref(), Some("sb1"));
        assert_eq!(env.netns.as_deref(), Some("/run/netns/sb1"));
        assert_eq!(env.ifname.as_deref(), Some("eth0"));
        let cni_path = env.path.unwrap_or_default();
        assert!(
            std::env::split_paths(&cni_path).any(|d| d == dir.path()),
            "{cni_path}"
        );
        assert!(!execd.exists(), "the forwarder was exec'd");

        std::fs::remove_file(&sock).unwrap();
        let t = serve(false);
        let e = net.del("sb1", ns, "eth0").unwrap_err();
        t.join().unwrap();
        assert!(
            matches!(&e, CniError::Plugin { code: 11, msg, .. } if msg == "server went away"),
            "{e}"
        );
        assert!(!execd.exists(), "the forwarder was exec'd");

        // No server: the forwarder runs (and would run burstvm-cni itself).
        std::fs::remove_file(&sock).unwrap();
        let a = net.add("sb1", ns, "eth0").unwrap();
        assert_eq!(
            a.mac.as_deref(),
            Some("02:00:00:00:00:02"),
            "the forwarder's result"
        );
        assert_eq!(std::fs::read_to_string(&execd).unwrap(), "ADD\n");
    }

    /// The network pool and the shim's attach path read a VF's placeholder link: an SG
    /// network is refused, naming the network, its file and the reason.
    #[test]
    fn an_sg_network_is_refused_where_a_vf_link_is_read() {
        let dir = std::env::temp_dir().join(format!("burstvm-cni-kind-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        testutil::write_executable(&dir.join("burstvm-cni"), "#!/bin/sh\nexit 1\n");
        let load = |file: &str, conf: &str| {
            let p = dir.join(file);
            std::fs::write(&p, conf).unwrap();
            CniNetwork::load(&p, vec![dir.clone()]).unwrap()
        };
        let vf = load(
            "vf.conf",
            r#"{"cniVersion":"1.1.0","name":"vfnet","type":"burstvm-cni"}"#,
        );
        let sg = load(
            "sg.conf",
            r#"{"cniVersion":"1.1.0","name":"sgnet","type":"burstvm-cni","kind":"sg"}"#,
        );
        assert_eq!(vf.kind(), nic_api::DevKind::Vf);
        assert_eq!(sg.kind(), nic_api::DevKind::Sg);
        assert_eq!(sg.name(), "sgnet");
        vf.require_vf("the network pool (--net-pool)").unwrap();
        let e = sg
            .require_vf("the network pool (--net-pool)")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("CNI network sgnet")
                && e.contains("sg.conf")
                && e.contains("the network pool (--net-pool) serves VF networks only")
                && e.contains("--net-kind sg"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
