// Set-up shared by the `burstvm-cni` tests (cni_plugin.rs, cni_plugin_faults.rs;
// included with `mod`): a `burstvm nic` daemon, network namespaces, a CNI network
// (config, host-local data dir, CNI_PATH), running the plugin directly or through
// cnitool, and the leak check every test ends with.
//
// cnitool and host-local are looked up in $CNI_PATH, /opt/cni/bin and
// ~/go/bin (docs/cni.md says how to install them).
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use nic_api::{Client, VfInfo};
use serde_json::{json, Value};

pub const PLUGIN: &str = env!("CARGO_BIN_EXE_burstvm-cni");
pub const THIN: &str = env!("CARGO_BIN_EXE_burstvm-cni-thin");
pub const BURSTVM: &str = env!("CARGO_BIN_EXE_burstvm");

pub fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{tag}{}x{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A CNI tool or plugin from $CNI_PATH, /opt/cni/bin or ~/go/bin.
pub fn tool(name: &str) -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::env::var_os("CNI_PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.push("/opt/cni/bin".into());
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(Path::new(&home).join("go/bin"));
    }
    dirs.iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} not found in $CNI_PATH, /opt/cni/bin or ~/go/bin: install it as docs/cni.md says"))
}

/// A network namespace made with `ip netns add`, deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new() -> Netns {
        let name = unique("cnit");
        let st = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .expect("run ip");
        assert!(st.success(), "ip netns add {name}");
        Netns { name }
    }

    pub fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    /// Names of the links in the netns other than loopback.
    pub fn links(&self) -> Vec<String> {
        let out = Command::new("ip")
            .args(["-n", &self.name, "-o", "link", "show"])
            .output()
            .expect("run ip");
        assert!(out.status.success(), "ip -n {} link show", self.name);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| {
                l.split(':')
                    .nth(1)
                    .map(|n| n.trim().split('@').next().unwrap().to_string())
            })
            .filter(|n| n != "lo")
            .collect()
    }

    pub fn ip(&self, args: &[&str]) {
        let st = Command::new("ip")
            .arg("-n")
            .arg(&self.name)
            .args(args)
            .status()
            .expect("run ip");
        assert!(st.success(), "ip -n {} {args:?}", self.name);
    }

    pub fn delete(&mut self) {
        if !self.name.is_empty() {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.name])
                .status();
            self.name.clear();
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        self.delete();
    }
}

/// A `burstvm nic` daemon with PF `pf0` (and `pf1`, ... with `start_pfs`),
/// killed on drop.
pub struct NicDaemon {
    child: Option<Child>,
    pub socket: PathBuf,
    /// VFs of pf0.
    pub vfs: usize,
    /// VFs of pf1, pf2, ...
    more_pfs: Vec<usize>,
    /// SG functions of pf0 (`--sgfs`).
    pub sgfs: usize,
    dir: tempfile::TempDir,
}

impl NicDaemon {
    pub fn start(vfs: usize) -> NicDaemon {
        Self::start_with_sgfs(vfs, 0)
    }

    /// PFs `pf0`, `pf1`, ... with these numbers of VFs.
    pub fn start_pfs(vfs: &[usize]) -> NicDaemon {
        Self::start_full(vfs, 0)
    }

    pub fn start_with_sgfs(vfs: usize, sgfs: usize) -> NicDaemon {
        Self::start_full(&[vfs], sgfs)
    }

    fn start_full(vfs: &[usize], sgfs: usize) -> NicDaemon {
        let dir = tempfile::tempdir().unwrap();
        let mut d = NicDaemon {
            child: None,
            socket: dir.path().join("nic.sock"),
            vfs: vfs[0],
            more_pfs: vfs[1..].to_vec(),
            sgfs,
            dir,
        };
        d.spawn();
        d
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// Where the daemon serves burstvm-cni's commands (`--cni-socket`).
    pub fn cni_socket(&self) -> PathBuf {
        self.dir.path().join("cni.sock")
    }

    /// Starts the daemon (again, on the same state dir and sockets) and waits
    /// until it answers.
    pub fn spawn(&mut self) {
        assert!(self.child.is_none(), "the daemon is still running");
        let mut cmd = Command::new(BURSTVM);
        cmd.arg("nic");
        for (k, n) in std::iter::once(self.vfs)
            .chain(self.more_pfs.iter().copied())
            .enumerate()
        {
            cmd.args(["--pf", &format!("pf{k}"), "--vfs", &n.to_string()]);
        }
        let child = cmd
            .args(["--sgfs", &self.sgfs.to_string()])
            .arg("--control")
            .arg(&self.socket)
            .arg("--state-dir")
            .arg(self.state_dir())
            .arg("--cni-socket")
            .arg(self.cni_socket())
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn burstvm nic");
        let child = self.child.insert(child);
        let socket = &self.socket;
        testutil::poll_until(
            &format!("burstvm nic opening {}", socket.display()),
            Duration::from_secs(10),
            || {
                if let Some(st) = child.try_wait().unwrap() {
                    panic!("burstvm nic exited early: {st}");
                }
                Client::connect(socket).map_err(|e| e.to_string())
            },
        );
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("daemon running").id()
    }

    pub fn signal(&self, sig: libc::c_int) {
        let pid = self.child.as_ref().expect("daemon running").id();
        // SAFETY: kill(2) on our own child, not yet reaped.
        assert_eq!(unsafe { libc::kill(pid as i32, sig) }, 0);
    }

    /// SIGSTOP, and waits until every thread of the daemon has stopped: only
    /// then does a new request stay unanswered in the socket's backlog.
    pub fn freeze(&self) {
        self.signal(libc::SIGSTOP);
        testutil::wait_stopped(self.child.as_ref().expect("daemon running").id());
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.socket).expect("connect to the NIC control socket")
    }

    pub fn vfs(&self) -> Vec<VfInfo> {
        self.client().list().expect("list VFs")
    }

    pub fn assigned(&self) -> Vec<VfInfo> {
        self.vfs()
            .into_iter()
            .filter(|v| v.sandbox.is_some())
            .collect()
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for NicDaemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One CNI network: its config file (for cnitool), a host-local data dir,
/// and CNI_PATH with burstvm-cni and host-local.
pub struct Network {
    name: String,
    dir: tempfile::TempDir,
    cni_path: String,
}

impl Network {
    /// `extra` is merged into the plugin config (e.g. a different cniVersion).
    pub fn new(nic: &NicDaemon, subnet: &str, extra: Value) -> Network {
        Self::with_ipam(nic, subnet, "host-local", extra)
    }

    /// A network whose `ipam.type` is `ipam` (host-local's config either way).
    pub fn with_ipam(nic: &NicDaemon, subnet: &str, ipam: &str, extra: Value) -> Network {
        let name = unique("burstnet");
        let dir = tempfile::tempdir().unwrap();
        let cni_path = std::env::join_paths([
            Path::new(PLUGIN).parent().unwrap(),
            tool("host-local").parent().unwrap(),
        ])
        .unwrap()
        .into_string()
        .unwrap();
        let net = Network {
            name,
            dir,
            cni_path,
        };
        let mut conf = json!({
            "cniVersion": "1.1.0",
            "name": net.name,
            "type": "burstvm-cni",
            "nicSocket": nic.socket,
            "pf": "pf0",
            "ipam": {
                "type": ipam,
                "subnet": subnet,
                "dataDir": net.data_dir(),
                "routes": [{"dst": "0.0.0.0/0"}, {"dst": "198.51.100.0/24"}]
            }
        });
        for (k, v) in extra.as_object().unwrap() {
            conf[k] = v.clone();
        }
        std::fs::create_dir_all(net.conf_dir()).unwrap();
        std::fs::write(
            net.conf_dir().join(format!("{}.conf", net.name)),
            conf.to_string(),
        )
        .unwrap();
        net
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Plugins are looked up in `dirs` only (instead of burstvm-cni's and host-local's).
    pub fn set_cni_path(&mut self, dirs: &[&Path]) {
        self.cni_path = std::env::join_paths(dirs).unwrap().into_string().unwrap();
    }

    pub fn conf_dir(&self) -> PathBuf {
        self.dir.path().join("net.d")
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("ipam")
    }

    pub fn config(&self) -> Value {
        let f = self.conf_dir().join(format!("{}.conf", self.name));
        serde_json::from_slice(&std::fs::read(f).unwrap()).unwrap()
    }

    /// The IPAM's lease files (host-local's format): one per allocated address.
    pub fn leases(&self) -> Vec<String> {
        match std::fs::read_dir(self.data_dir().join(&self.name)) {
            Err(_) => Vec::new(),
            Ok(rd) => rd
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .filter(|n| n != "lock" && !n.starts_with("last_reserved_ip"))
                .collect(),
        }
    }

    /// Runs `cnitool VERB NAME NETNS`; returns (success, stdout, stderr).
    pub fn cnitool(&self, verb: &str, netns: &str) -> (bool, String, String) {
        let out = Command::new(tool("cnitool"))
            .args([verb, &self.name, netns])
            .env("NETCONFPATH", self.conf_dir())
            .env("CNI_PATH", &self.cni_path)
            .env("CNI_IFNAME", "eth0")
            .output()
            .expect("run cnitool");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into(),
            String::from_utf8_lossy(&out.stderr).into(),
        )
    }

    pub fn add(&self, ns: &Netns) -> Value {
        let (ok, out, err) = self.cnitool("add", &ns.path());
        assert!(ok, "cnitool add {}: {out} {err}", ns.path());
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("cnitool add printed {out:?}: {e}"))
    }

    pub fn del(&self, ns_path: &str) {
        let (ok, out, err) = self.cnitool("del", ns_path);
        assert!(ok, "cnitool del {ns_path}: {out} {err}");
    }

    /// Runs the plugin directly with `env` and `stdin`; returns (exit status, stdout JSON or Null).
    pub fn plugin(&self, env: &[(&str, &str)], stdin: &str) -> (i32, Value) {
        let mut env = env.to_vec();
        env.insert(0, ("CNI_PATH", self.cni_path.as_str()));
        finish_plugin(start_plugin(&env, stdin))
    }
}

/// Starts burstvm-cni with only the `CNI_*` variables of `env` and `stdin`,
/// without waiting for it.
pub fn start_plugin(env: &[(&str, &str)], stdin: &str) -> Child {
    let mut child = Command::new(PLUGIN)
        .env_remove("CNI_COMMAND")
        .env_remove("CNI_NETNS")
        .env_remove("CNI_CONTAINERID")
        .env_remove("CNI_IFNAME")
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn burstvm-cni");
    match child.stdin.take().unwrap().write_all(stdin.as_bytes()) {
        Ok(()) => {}
        // It stopped reading (an oversized config) and answered already.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(e) => panic!("write the plugin's stdin: {e}"),
    }
    child
}

/// Exit status and stdout JSON (Null if empty) of a plugin run.
pub fn finish_plugin(child: Child) -> (i32, Value) {
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let v = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"))
    };
    (out.status.code().unwrap_or(-1), v)
}

impl Drop for Network {
    fn drop(&mut self) {
        // libcni caches ADD results under /var/lib/cni; drop what a failed test left.
        if let Ok(rd) = std::fs::read_dir("/var/lib/cni/results") {
            for e in rd.flatten() {
                if e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!("{}-", self.name))
                {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }
}

pub fn env<'a>(cmd: &'a str, cid: &'a str, ns: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("CNI_COMMAND", cmd),
        ("CNI_CONTAINERID", cid),
        ("CNI_NETNS", ns),
        ("CNI_IFNAME", "eth0"),
    ]
}

/// The error result's code, after checking it is a spec error object.
pub fn error_code(status: i32, out: &Value) -> u64 {
    assert_ne!(status, 0, "expected a failure, got {out}");
    assert!(out["msg"].is_string(), "error result without msg: {out}");
    assert!(
        out["cniVersion"].is_string(),
        "error result without cniVersion: {out}"
    );
    out["code"]
        .as_u64()
        .unwrap_or_else(|| panic!("error result without code: {out}"))
}

pub fn assert_nothing_left(nic: &NicDaemon, net: &Network, ns: &Netns) {
    assert!(
        nic.assigned().is_empty(),
        "VFs still assigned: {:?}",
        nic.assigned()
    );
    assert!(
        ns.links().is_empty(),
        "links left in {}: {:?}",
        ns.name,
        ns.links()
    );
    assert!(
        net.leases().is_empty(),
        "IPAM leases left: {:?}",
        net.leases()
    );
}
