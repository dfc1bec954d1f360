//! `burstvm-cni` against a real `burstvm nic` daemon, the real `cnitool` and
//! the reference `host-local` IPAM plugin, in network namespaces made here.
//!
//! cnitool and host-local are looked up in $CNI_PATH, /opt/cni/bin and
//! ~/go/bin (docs/cni.md says how to install them).

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use nic::control::{Client, DevKind, VfInfo};
use serde_json::{json, Value};

const PLUGIN: &str = env!("CARGO_BIN_EXE_burstvm-cni");
const BURSTVM: &str = env!("CARGO_BIN_EXE_burstvm");

fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{tag}{}x{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A CNI tool or plugin from $CNI_PATH, /opt/cni/bin or ~/go/bin.
fn tool(name: &str) -> PathBuf {
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
struct Netns {
    name: String,
}

impl Netns {
    fn new() -> Netns {
        let name = unique("cnit");
        let st = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .expect("run ip");
        assert!(st.success(), "ip netns add {name}");
        Netns { name }
    }

    fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    /// Names of the links in the netns other than loopback.
    fn links(&self) -> Vec<String> {
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

    fn ip(&self, args: &[&str]) {
        let st = Command::new("ip")
            .arg("-n")
            .arg(&self.name)
            .args(args)
            .status()
            .expect("run ip");
        assert!(st.success(), "ip -n {} {args:?}", self.name);
    }

    fn delete(&mut self) {
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

/// A `burstvm nic` daemon with one PF `pf0`, killed on drop.
struct NicDaemon {
    child: Option<Child>,
    socket: PathBuf,
    vfs: usize,
    /// SG functions of pf0 (`--sgfs`).
    sgfs: usize,
    dir: tempfile::TempDir,
}

impl NicDaemon {
    fn start(vfs: usize) -> NicDaemon {
        Self::start_with_sgfs(vfs, 0)
    }

    fn start_with_sgfs(vfs: usize, sgfs: usize) -> NicDaemon {
        let dir = tempfile::tempdir().unwrap();
        let mut d = NicDaemon {
            child: None,
            socket: dir.path().join("nic.sock"),
            vfs,
            sgfs,
            dir,
        };
        d.spawn();
        d
    }

    fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// Starts the daemon (again, on the same state dir and sockets) and waits
    /// until it answers.
    fn spawn(&mut self) {
        assert!(self.child.is_none(), "the daemon is still running");
        let child = Command::new(BURSTVM)
            .args(["nic", "--pf", "pf0", "--vfs", &self.vfs.to_string()])
            .args(["--sgfs", &self.sgfs.to_string()])
            .arg("--control")
            .arg(&self.socket)
            .arg("--state-dir")
            .arg(self.state_dir())
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn burstvm nic");
        let child = self.child.insert(child);
        for _ in 0..400 {
            if Client::connect(&self.socket).is_ok() {
                return;
            }
            if let Some(st) = child.try_wait().unwrap() {
                panic!("burstvm nic exited early: {st}");
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!(
            "burstvm nic did not open {} within 10 s",
            self.socket.display()
        );
    }

    fn signal(&self, sig: libc::c_int) {
        let pid = self.child.as_ref().expect("daemon running").id();
        // SAFETY: kill(2) on our own child, not yet reaped.
        assert_eq!(unsafe { libc::kill(pid as i32, sig) }, 0);
    }

    fn client(&self) -> Client {
        Client::connect(&self.socket).expect("connect to the NIC control socket")
    }

    fn vfs(&self) -> Vec<VfInfo> {
        self.client().list().expect("list VFs")
    }

    fn assigned(&self) -> Vec<VfInfo> {
        self.vfs()
            .into_iter()
            .filter(|v| v.sandbox.is_some())
            .collect()
    }

    fn stop(&mut self) {
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
struct Network {
    name: String,
    dir: tempfile::TempDir,
    cni_path: String,
}

impl Network {
    /// `extra` is merged into the plugin config (e.g. a different cniVersion).
    fn new(nic: &NicDaemon, subnet: &str, extra: Value) -> Network {
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
                "type": "host-local",
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

    fn conf_dir(&self) -> PathBuf {
        self.dir.path().join("net.d")
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("ipam")
    }

    fn config(&self) -> Value {
        let f = self.conf_dir().join(format!("{}.conf", self.name));
        serde_json::from_slice(&std::fs::read(f).unwrap()).unwrap()
    }

    /// host-local's lease files: one per allocated address.
    fn leases(&self) -> Vec<String> {
        match std::fs::read_dir(self.data_dir().join(&self.name)) {
            Err(_) => Vec::new(),
            Ok(rd) => rd
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .filter(|n| n != "lock" && !n.starts_with("last_reserved_ip"))
                .collect(),
        }
    }

    /// Runs `cnitool VERB NAME NETNS`; returns (success, stdout, stderr).
    fn cnitool(&self, verb: &str, netns: &str) -> (bool, String, String) {
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

    fn add(&self, ns: &Netns) -> Value {
        let (ok, out, err) = self.cnitool("add", &ns.path());
        assert!(ok, "cnitool add {}: {out} {err}", ns.path());
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("cnitool add printed {out:?}: {e}"))
    }

    fn del(&self, ns_path: &str) {
        let (ok, out, err) = self.cnitool("del", ns_path);
        assert!(ok, "cnitool del {ns_path}: {out} {err}");
    }

    /// Runs the plugin directly with `env` and `stdin`; returns (exit status, stdout JSON or Null).
    fn plugin(&self, env: &[(&str, &str)], stdin: &str) -> (i32, Value) {
        let mut env = env.to_vec();
        env.insert(0, ("CNI_PATH", self.cni_path.as_str()));
        finish_plugin(start_plugin(&env, stdin))
    }
}

/// Starts burstvm-cni with only the `CNI_*` variables of `env` and `stdin`,
/// without waiting for it.
fn start_plugin(env: &[(&str, &str)], stdin: &str) -> Child {
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
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child
}

/// Exit status and stdout JSON (Null if empty) of a plugin run.
fn finish_plugin(child: Child) -> (i32, Value) {
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

fn env<'a>(cmd: &'a str, cid: &'a str, ns: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("CNI_COMMAND", cmd),
        ("CNI_CONTAINERID", cid),
        ("CNI_NETNS", ns),
        ("CNI_IFNAME", "eth0"),
    ]
}

/// The error result's code, after checking it is a spec error object.
fn error_code(status: i32, out: &Value) -> u64 {
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

fn assert_nothing_left(nic: &NicDaemon, net: &Network, ns: &Netns) {
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

#[test]
fn cni_add_check_del_round_trip() {
    let nic = NicDaemon::start(4);
    let net = Network::new(&nic, "10.77.0.0/16", json!({}));
    let ns = Netns::new();

    let r = net.add(&ns);
    assert_eq!(r["cniVersion"], "1.1.0");
    let vf = nic.assigned();
    assert_eq!(vf.len(), 1, "one VF assigned: {vf:?}");
    let vf = &vf[0];
    let iface = &r["interfaces"][0];
    assert_eq!(r["interfaces"].as_array().unwrap().len(), 1);
    assert_eq!(iface["name"], "eth0");
    assert_eq!(iface["sandbox"], ns.path());
    assert_eq!(iface["mac"], vf.mac.as_str());
    assert_eq!(iface["pciID"], vf.id.as_str());
    assert_eq!(iface["socketPath"], vf.socket.to_str().unwrap());
    assert_eq!(iface["mtu"], 1500);
    let ips = r["ips"].as_array().unwrap();
    assert_eq!(ips.len(), 1);
    assert_eq!(ips[0]["interface"], 0);
    assert!(ips[0].get("version").is_none(), "1.1.0 ips have no version");
    let addr: cni::IpNet = ips[0]["address"].as_str().unwrap().parse().unwrap();
    assert!(
        addr.to_string().starts_with("10.77.") && addr.prefix == 16,
        "{addr}"
    );
    assert_eq!(ips[0]["gateway"], "10.77.0.1");
    let dsts: Vec<&str> = r["routes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["dst"].as_str().unwrap())
        .collect();
    assert_eq!(dsts, ["0.0.0.0/0", "198.51.100.0/24"]);
    assert_eq!(net.leases(), vec![addr.addr.to_string()]);

    // The runtime's view: the placeholder names the VF and carries the IP configuration.
    let p = cni::read_placeholder(Path::new(&ns.path()), "eth0").unwrap();
    assert_eq!(p.vf_id, vf.id);
    assert_eq!(p.mac_string(), vf.mac);
    assert_eq!(p.addresses, vec![addr]);
    assert_eq!(p.gateway, Some("10.77.0.1".parse().unwrap()));
    assert!(
        p.routes
            .iter()
            .any(|r| r.dst.to_string() == "198.51.100.0/24"),
        "{:?}",
        p.routes
    );

    let (ok, out, err) = net.cnitool("check", &ns.path());
    assert!(ok, "cnitool check: {out} {err}");
    let (ok, out, err) = net.cnitool("status", &ns.path());
    assert!(ok, "cnitool status: {out} {err}");

    // CHECK notices a placeholder that lost its address.
    ns.ip(&["addr", "del", &addr.to_string(), "dev", "eth0"]);
    let (ok, _, err) = net.cnitool("check", &ns.path());
    assert!(
        !ok && err.contains(&format!("lacks address {addr}")),
        "check after address removal: {err}"
    );

    net.del(&ns.path());
    assert_nothing_left(&nic, &net, &ns);
    // DEL is idempotent.
    net.del(&ns.path());
    assert_nothing_left(&nic, &net, &ns);
}

#[test]
fn cni_older_versions_work_without_1_1_fields() {
    let nic = NicDaemon::start(2);
    for version in ["0.3.0", "0.3.1", "0.4.0", "1.0.0"] {
        let net = Network::new(&nic, "10.78.0.0/24", json!({"cniVersion": version}));
        let ns = Netns::new();
        let r = net.add(&ns);
        assert_eq!(r["cniVersion"], version);
        let iface = &r["interfaces"][0];
        assert_eq!(iface["name"], "eth0");
        assert_eq!(iface["mac"], nic.assigned()[0].mac.as_str());
        for field in ["pciID", "socketPath", "mtu"] {
            assert!(
                iface.get(field).is_none(),
                "{version} result has {field}: {r}"
            );
        }
        let ip = &r["ips"][0];
        assert_eq!(ip["interface"], 0, "{version}: {r}");
        if version == "1.0.0" {
            assert!(ip.get("version").is_none(), "{r}");
        } else {
            assert_eq!(ip["version"], "4", "{version}: {r}");
        }
        let cid = "older-check";
        let (status, out) = net.plugin(&env("CHECK", cid, &ns.path()), &net.config().to_string());
        if version.starts_with("0.3") {
            assert_eq!(error_code(status, &out), 1, "CHECK is not in {version}");
        } else {
            let (ok, out, err) = net.cnitool("check", &ns.path());
            assert!(ok, "{version} check: {out} {err}");
        }
        net.del(&ns.path());
        assert_nothing_left(&nic, &net, &ns);
    }
}

#[test]
fn cni_fifty_parallel_adds_get_distinct_vfs_and_addresses() {
    const N: usize = 50;
    let nic = NicDaemon::start(N);
    let net = Network::new(&nic, "10.79.0.0/16", json!({}));
    let namespaces: Vec<Netns> = (0..N).map(|_| Netns::new()).collect();

    let results: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = namespaces
            .iter()
            .map(|ns| s.spawn(|| net.add(ns)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let vf_ids: HashSet<&str> = results
        .iter()
        .map(|r| r["interfaces"][0]["pciID"].as_str().unwrap())
        .collect();
    let addrs: HashSet<&str> = results
        .iter()
        .map(|r| r["ips"][0]["address"].as_str().unwrap())
        .collect();
    assert_eq!(vf_ids.len(), N, "distinct VFs");
    assert_eq!(addrs.len(), N, "distinct addresses");
    let assigned = nic.assigned();
    assert_eq!(assigned.len(), N);
    assert!(assigned.iter().all(|v| vf_ids.contains(v.id.as_str())));
    assert_eq!(net.leases().len(), N);
    for (ns, r) in namespaces.iter().zip(&results) {
        let p = cni::read_placeholder(Path::new(&ns.path()), "eth0").unwrap();
        assert_eq!(p.vf_id, r["interfaces"][0]["pciID"].as_str().unwrap());
    }

    std::thread::scope(|s| {
        for ns in &namespaces {
            s.spawn(|| net.del(&ns.path()));
        }
    });
    assert!(nic.assigned().is_empty(), "VFs left: {:?}", nic.assigned());
    assert!(net.leases().is_empty(), "leases left: {:?}", net.leases());
    for ns in &namespaces {
        assert!(
            ns.links().is_empty(),
            "links left in {}: {:?}",
            ns.name,
            ns.links()
        );
    }
}

#[test]
fn cni_bad_input_gets_the_spec_code_and_leaves_nothing() {
    let nic = NicDaemon::start(2);
    let net = Network::new(&nic, "10.80.0.0/24", json!({}));
    let ns = Netns::new();
    let conf = net.config().to_string();
    let path = ns.path();

    let (status, out) = net.plugin(&env("ADD", "bad1", &path), "{\"cniVersion\": \"1.1.0\", ");
    assert_eq!(error_code(status, &out), 6, "malformed JSON: {out}");
    assert_nothing_left(&nic, &net, &ns);

    let mut no_pf = net.config();
    no_pf.as_object_mut().unwrap().remove("pf");
    let (status, out) = net.plugin(&env("ADD", "bad2", &path), &no_pf.to_string());
    assert_eq!(error_code(status, &out), 7, "config without pf: {out}");
    assert!(out["msg"].as_str().unwrap().contains("pf"), "{out}");
    assert_nothing_left(&nic, &net, &ns);

    let mut future = net.config();
    future["cniVersion"] = json!("9.9.9");
    let (status, out) = net.plugin(&env("ADD", "bad3", &path), &future.to_string());
    assert_eq!(error_code(status, &out), 1, "unknown cniVersion: {out}");
    assert_nothing_left(&nic, &net, &ns);

    let no_netns: Vec<_> = env("ADD", "bad4", &path)
        .into_iter()
        .filter(|(k, _)| *k != "CNI_NETNS")
        .collect();
    let (status, out) = net.plugin(&no_netns, &conf);
    assert_eq!(error_code(status, &out), 4, "missing CNI_NETNS: {out}");
    assert!(out["msg"].as_str().unwrap().contains("CNI_NETNS"), "{out}");
    assert_nothing_left(&nic, &net, &ns);

    let (status, out) = net.plugin(&env("ADD", "own", "/proc/self/ns/net"), &conf);
    assert_eq!(error_code(status, &out), 4, "the plugin's own netns: {out}");
    assert_nothing_left(&nic, &net, &ns);

    let (status, out) = net.plugin(&env("EXPLODE", "bad5", &path), &conf);
    assert_eq!(error_code(status, &out), 4, "unknown CNI_COMMAND: {out}");

    let (status, out) = net.plugin(&[("CNI_COMMAND", "VERSION")], r#"{"cniVersion":"1.0.0"}"#);
    assert_eq!(status, 0);
    assert_eq!(out["cniVersion"], "1.0.0");
    assert_eq!(
        out["supportedVersions"],
        json!(["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"])
    );

    // The interface name is taken: the VF and the address are given back, the
    // existing link stays.
    ns.ip(&[
        "link", "add", "eth0", "type", "veth", "peer", "name", "peer0",
    ]);
    let (status, out) = net.plugin(&env("ADD", "taken", &path), &conf);
    assert_eq!(error_code(status, &out), 101, "interface exists: {out}");
    assert!(
        nic.assigned().is_empty() && net.leases().is_empty(),
        "{:?} {:?}",
        nic.assigned(),
        net.leases()
    );
    assert_eq!(ns.links().len(), 2, "the veth pair is not ours to delete");
    ns.ip(&["link", "del", "eth0"]);
    assert_nothing_left(&nic, &net, &ns);
}

#[test]
fn cni_exhaustion_and_unreachable_nic() {
    let mut nic = NicDaemon::start(2);
    let net = Network::new(&nic, "10.81.0.0/24", json!({}));
    let (ns1, ns2, ns3) = (Netns::new(), Netns::new(), Netns::new());

    let addrs: Vec<String> = [&ns1, &ns2]
        .iter()
        .map(|ns| {
            net.add(ns)["ips"][0]["address"]
                .as_str()
                .unwrap()
                .split('/')
                .next()
                .unwrap()
                .to_string()
        })
        .collect();
    let (status, out) = net.plugin(&env("ADD", "third", &ns3.path()), &net.config().to_string());
    assert_eq!(error_code(status, &out), 11, "PF exhausted: {out}");
    assert_eq!(nic.assigned().len(), 2);
    let mut leases = net.leases();
    leases.sort();
    let mut want = addrs.clone();
    want.sort();
    assert_eq!(leases, want, "no address for the third container");
    assert!(ns3.links().is_empty());

    // STATUS says the plugin cannot serve ADD now.
    let (status, out) = net.plugin(&[("CNI_COMMAND", "STATUS")], &net.config().to_string());
    assert_eq!(
        error_code(status, &out),
        50,
        "STATUS with no free VF: {out}"
    );

    net.del(&ns1.path());
    net.del(&ns2.path());
    assert_nothing_left(&nic, &net, &ns1);
    assert_nothing_left(&nic, &net, &ns2);

    // IPAM fails after the VF was taken: the VF goes back.
    let mut tiny = net.config();
    tiny["ipam"]["rangeStart"] = json!("10.81.0.9");
    tiny["ipam"]["rangeEnd"] = json!("10.81.0.9");
    let tiny = tiny.to_string();
    let (status, out) = net.plugin(&env("ADD", "first", &ns1.path()), &tiny);
    assert_eq!(status, 0, "{out}");
    let (status, out) = net.plugin(&env("ADD", "noaddr", &ns2.path()), &tiny);
    error_code(status, &out);
    assert!(
        out["msg"].as_str().unwrap().contains("host-local ADD"),
        "second ADD in a one-address range: {out}"
    );
    let assigned = nic.assigned();
    assert_eq!(assigned.len(), 1);
    assert_eq!(assigned[0].sandbox.as_deref(), Some("first"));
    assert!(ns2.links().is_empty());
    assert_eq!(net.leases(), vec!["10.81.0.9".to_string()]);
    let (status, out) = net.plugin(&env("DEL", "first", &ns1.path()), &tiny);
    assert_eq!(status, 0, "{out}");
    assert_nothing_left(&nic, &net, &ns1);

    // The NIC daemon is down: try again later, no address taken, no link.
    nic.stop();
    let (status, out) = net.plugin(&env("ADD", "nonic", &ns1.path()), &net.config().to_string());
    assert_eq!(error_code(status, &out), 11, "NIC down: {out}");
    assert!(
        out["details"]
            .as_str()
            .unwrap()
            .contains(&nic.socket.display().to_string()),
        "the error names the socket: {out}"
    );
    assert!(
        ns1.links().is_empty() && net.leases().is_empty(),
        "{:?} {:?}",
        ns1.links(),
        net.leases()
    );
    let (status, out) = net.plugin(&[("CNI_COMMAND", "STATUS")], &net.config().to_string());
    assert_eq!(
        error_code(status, &out),
        50,
        "STATUS with the NIC down: {out}"
    );
}

#[test]
fn cni_del_after_netns_is_gone_and_gc() {
    let nic = NicDaemon::start(3);
    let net = Network::new(&nic, "10.82.0.0/24", json!({}));
    let mut ns = Netns::new();
    let path = ns.path();
    net.add(&ns);
    ns.delete();
    net.del(&path);
    assert!(nic.assigned().is_empty(), "{:?}", nic.assigned());
    assert!(net.leases().is_empty(), "{:?}", net.leases());
    net.del(&path);

    // DEL without CNI_PATH cannot run IPAM DEL but still frees the VF and the link.
    let ns = Netns::new();
    let conf = net.config().to_string();
    assert_eq!(net.plugin(&env("ADD", "nopath", &ns.path()), &conf).0, 0);
    let ns_path = ns.path();
    let mut no_path = env("DEL", "nopath", &ns_path);
    no_path.push(("CNI_PATH", ""));
    let (status, out) = net.plugin(&no_path, &conf);
    assert_eq!(error_code(status, &out), 4, "DEL without CNI_PATH: {out}");
    assert!(nic.assigned().is_empty() && ns.links().is_empty());
    assert_eq!(net.leases().len(), 1);
    assert_eq!(net.plugin(&env("DEL", "nopath", &ns.path()), &conf).0, 0);
    assert_nothing_left(&nic, &net, &ns);

    // GC releases the VFs of containers that are no longer valid.
    let (a, b) = (Netns::new(), Netns::new());
    assert_eq!(net.plugin(&env("ADD", "keep", &a.path()), &conf).0, 0);
    assert_eq!(net.plugin(&env("ADD", "stale", &b.path()), &conf).0, 0);
    let mut gc = net.config();
    gc["cni.dev/valid-attachments"] = json!([{"containerID": "keep", "ifname": "eth0"}]);
    let (status, out) = net.plugin(&[("CNI_COMMAND", "GC")], &gc.to_string());
    assert_eq!(status, 0, "GC: {out}");
    let left: Vec<Option<String>> = nic.assigned().into_iter().map(|v| v.sandbox).collect();
    assert_eq!(left, vec![Some("keep".to_string())]);
    for (cid, ns) in [("keep", &a), ("stale", &b)] {
        let (status, out) = net.plugin(&env("DEL", cid, &ns.path()), &conf);
        assert_eq!(status, 0, "DEL {cid}: {out}");
    }
    assert_nothing_left(&nic, &net, &a);
    assert_nothing_left(&nic, &net, &b);
}

#[test]
fn cni_chained_add_extends_prev_result() {
    let nic = NicDaemon::start(1);
    let net = Network::new(&nic, "10.83.0.0/24", json!({}));
    let ns = Netns::new();
    let mut conf = net.config();
    conf["prevResult"] = json!({
        "cniVersion": "1.1.0",
        "interfaces": [{"name": "host-side", "mac": "02:00:00:00:00:99"}],
        "ips": [{"address": "192.0.2.5/24", "interface": 0}],
        "dns": {"nameservers": ["192.0.2.53"]}
    });
    let (status, r) = net.plugin(&env("ADD", "chained", &ns.path()), &conf.to_string());
    assert_eq!(status, 0, "{r}");
    let names: Vec<&str> = r["interfaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["host-side", "eth0"]);
    let ips = r["ips"].as_array().unwrap();
    assert_eq!(ips.len(), 2);
    assert_eq!(ips[0]["interface"], 0);
    assert_eq!(ips[1]["interface"], 1);
    assert!(
        ips[1]["address"].as_str().unwrap().starts_with("10.83.0."),
        "{r}"
    );
    assert_eq!(r["dns"]["nameservers"][0], "192.0.2.53");
    assert_eq!(r["interfaces"][1]["pciID"], nic.assigned()[0].id.as_str());

    // CHECK finds its own interface by name in the chained result.
    conf["prevResult"] = r.clone();
    let (status, out) = net.plugin(&env("CHECK", "chained", &ns.path()), &conf.to_string());
    assert_eq!(status, 0, "CHECK: {out}");
    // ... and notices when the NIC no longer agrees.
    nic.client().release("chained").unwrap();
    let (status, out) = net.plugin(&env("CHECK", "chained", &ns.path()), &conf.to_string());
    assert_eq!(
        error_code(status, &out),
        102,
        "CHECK after the VF was released: {out}"
    );
    let (status, out) = net.plugin(&env("DEL", "chained", &ns.path()), &conf.to_string());
    assert_eq!(status, 0, "{out}");
    assert_nothing_left(&nic, &net, &ns);
}

/// A control socket that accepts connections and never answers (a frozen or
/// wedged NIC daemon): ADD and DEL fail with 11 and name the socket, after
/// the config's `nicTimeout` instead of hanging the runtime.
#[test]
fn cni_silent_nic_fails_with_try_again_later() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("silent.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    listener.set_nonblocking(true).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let acceptor = std::thread::spawn(move || {
        let mut held = Vec::new();
        while !stop2.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((s, _)) => held.push(s),
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        held.len()
    });
    let ns = Netns::new();
    let conf = json!({
        "cniVersion": "1.1.0", "name": unique("silent"), "type": "burstvm-cni",
        "nicSocket": socket, "pf": "pf0", "nicTimeout": 1
    })
    .to_string();
    let ns_path = ns.path();
    let run = |cmd: &str| finish_plugin(start_plugin(&env(cmd, "silent1", &ns_path), &conf));
    for cmd in ["ADD", "DEL"] {
        let (status, out) = run(cmd);
        assert_eq!(error_code(status, &out), 11, "{cmd} on a silent NIC: {out}");
        assert!(
            out["details"]
                .as_str()
                .unwrap()
                .contains(&socket.display().to_string()),
            "{cmd}: the error names the socket: {out}"
        );
    }
    assert!(ns.links().is_empty(), "{:?}", ns.links());
    stop.store(true, Ordering::Relaxed);
    assert!(
        acceptor.join().unwrap() >= 2,
        "both commands reached the socket"
    );
}

/// CNI_NETNS that exists but is not a network namespace: code 4 before any
/// VF is taken, for a regular file, a directory and a missing path.
#[test]
fn cni_netns_that_is_not_a_netns_is_invalid_env() {
    let nic = NicDaemon::start(2);
    let net = Network::new(&nic, "10.82.0.0/24", json!({}));
    let conf = net.config().to_string();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-netns");
    std::fs::write(&file, b"").unwrap();
    let missing = dir.path().join("missing");
    for (what, path) in [
        ("regular file", file.as_path()),
        ("directory", dir.path()),
        ("missing path", missing.as_path()),
    ] {
        let p = path.to_str().unwrap();
        let (status, out) = net.plugin(&env("ADD", "nsbad", p), &conf);
        assert_eq!(error_code(status, &out), 4, "{what}: {out}");
        assert!(out["msg"].as_str().unwrap().contains("CNI_NETNS"), "{out}");
        assert!(nic.assigned().is_empty(), "{what}: {:?}", nic.assigned());
        assert!(net.leases().is_empty(), "{what}: {:?}", net.leases());
    }
    // DEL with a CNI_NETNS that is a regular file still frees what ADD took.
    let ns = Netns::new();
    let (status, out) = net.plugin(&env("ADD", "nsdel", &ns.path()), &conf);
    assert_eq!(status, 0, "{out}");
    let (status, out) = net.plugin(&env("DEL", "nsdel", file.to_str().unwrap()), &conf);
    assert_eq!(error_code(status, &out), 4, "DEL, regular file: {out}");
    assert!(nic.assigned().is_empty() && net.leases().is_empty());
    let (status, out) = net.plugin(&env("DEL", "nsdel", &ns.path()), &conf);
    assert_eq!(status, 0, "{out}");
    assert_nothing_left(&nic, &net, &ns);
}

/// Waits until `pid` sleeps reading a socket (read or recvfrom on a socket
/// fd): its request went out and it waits for the daemon's answer.
fn wait_until_reading_a_socket(pid: u32) {
    for _ in 0..1000 {
        let sc = std::fs::read_to_string(format!("/proc/{pid}/syscall")).unwrap_or_default();
        let mut f = sc.split_whitespace();
        if let (Some("0" | "45"), Some(fd)) = (f.next(), f.next()) {
            let fd = i64::from_str_radix(fd.trim_start_matches("0x"), 16).unwrap_or(-1);
            if std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))
                .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
            {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("burstvm-cni (pid {pid}) never waited on the NIC socket");
}

/// The chaos leak of issue 9 (`bench chaos --seed 923`): the NIC daemon is
/// SIGKILLed while a sandbox's DEL and another's ADD are in its hands, and
/// after it stored an alloc it never answered. DEL and ADD must answer 11
/// (the runtime repeats DEL on 11 only; a 5 ended its retries with the VF
/// still assigned), and DEL against the restarted daemon frees every VF:
/// the one whose release was lost, the one whose alloc was lost before it
/// was done, and the one stored but never answered.
#[test]
fn cni_nic_killed_mid_call_then_del_against_the_restarted_daemon_frees_every_vf() {
    let mut nic = NicDaemon::start(4);
    let conf = json!({
        "cniVersion": "1.1.0", "name": unique("crash"), "type": "burstvm-cni",
        "nicSocket": nic.socket, "pf": "pf0", "nicTimeout": 10
    })
    .to_string();
    let (del_ns, add_ns, half_ns) = (Netns::new(), Netns::new(), Netns::new());
    let (status, out) = finish_plugin(start_plugin(&env("ADD", "lostdel", &del_ns.path()), &conf));
    assert_eq!(status, 0, "ADD lostdel: {out}");

    // Frozen daemon: the kernel queues the connections, the requests wait.
    nic.signal(libc::SIGSTOP);
    let del = start_plugin(&env("DEL", "lostdel", &del_ns.path()), &conf);
    wait_until_reading_a_socket(del.id());
    let add = start_plugin(&env("ADD", "lostadd", &add_ns.path()), &conf);
    wait_until_reading_a_socket(add.id());
    nic.signal(libc::SIGKILL);
    nic.stop();
    for (what, child) in [("DEL", del), ("ADD", add)] {
        let (status, out) = finish_plugin(child);
        assert_eq!(
            error_code(status, &out),
            11,
            "{what} cut off by the daemon's death: {out}"
        );
        assert!(out["msg"].as_str().unwrap().contains("mid-call"), "{out}");
    }
    assert!(add_ns.links().is_empty(), "{:?}", add_ns.links());

    // What the killed daemon did for an ADD it never answered: the alloc
    // stored in its state file (the daemon's own request handler, no reply).
    {
        let stored = nic::daemon::Nic::new(
            &[("pf0".to_string(), nic.vfs)],
            nic::devset::LockPolicy::Hierarchical,
            &nic.state_dir(),
            nic.state_dir().join("nic-state.json"),
            &Default::default(),
        )
        .expect("open the state dir");
        let r = stored.handle(nic::control::Request::Alloc {
            pf: "pf0".into(),
            sandbox: "halfadd".into(),
            kind: Default::default(),
            mac: None,
            vlan: None,
        });
        assert!(r.ok, "{r:?}");
    }

    nic.spawn();
    let mut held: Vec<String> = nic
        .assigned()
        .into_iter()
        .filter_map(|v| v.sandbox)
        .collect();
    held.sort();
    assert_eq!(held, ["halfadd", "lostdel"], "restored from the state file");
    // The runtime's retried DELs (and the DEL after the failed ADDs).
    for (cid, ns) in [
        ("lostdel", &del_ns),
        ("lostadd", &add_ns),
        ("halfadd", &half_ns),
    ] {
        let (status, out) = finish_plugin(start_plugin(&env("DEL", cid, &ns.path()), &conf));
        assert_eq!(status, 0, "DEL {cid} against the restarted daemon: {out}");
        assert!(ns.links().is_empty(), "{cid}: {:?}", ns.links());
    }
    assert!(nic.assigned().is_empty(), "{:?}", nic.assigned());
    let state = std::fs::read_to_string(nic.state_dir().join("nic-state.json")).unwrap();
    let state: Value = serde_json::from_str(&state).unwrap();
    assert_eq!(state["assignments"], json!([]), "{state}");
}

#[test]
fn cni_kind_sg_adds_an_sg_function_without_link_or_address_and_del_releases_it() {
    let nic = NicDaemon::start_with_sgfs(1, 2);
    let net = Network::new(&nic, "10.79.0.0/16", json!({"kind": "sg", "ipam": null}));
    let ns = Netns::new();
    let cid = unique("sgcni");
    let conf = net.config().to_string();

    let (st, r) = net.plugin(&env("ADD", &cid, &ns.path()), &conf);
    assert_eq!(st, 0, "ADD: {r}");
    let held = nic.assigned();
    assert_eq!(held.len(), 1, "one device assigned: {held:?}");
    let sgf = &held[0];
    assert_eq!(sgf.kind, DevKind::Sg, "{sgf:?}");
    assert_eq!(sgf.sandbox.as_deref(), Some(cid.as_str()));
    assert!(sgf.socket.exists(), "{sgf:?}");
    // The result names the SGF's socket and nothing a link would have.
    let iface = &r["interfaces"][0];
    assert_eq!(r["interfaces"].as_array().unwrap().len(), 1, "{r}");
    assert_eq!(iface["name"], "eth0");
    assert_eq!(iface["kind"], "sg");
    assert_eq!(iface["sandbox"], ns.path());
    assert_eq!(iface["socketPath"], sgf.socket.to_str().unwrap());
    assert_eq!(iface["pciID"], sgf.id.as_str());
    assert!(
        iface.get("mac").is_none() && iface.get("mtu").is_none(),
        "{r}"
    );
    assert!(
        r.get("ips")
            .is_none_or(|i| i.as_array().unwrap().is_empty()),
        "{r}"
    );
    assert!(ns.links().is_empty(), "no placeholder: {:?}", ns.links());

    // CHECK against the ADD result; a socket the NIC does not have fails it.
    let mut with_prev = net.config();
    with_prev["prevResult"] = r.clone();
    let (st, out) = net.plugin(&env("CHECK", &cid, &ns.path()), &with_prev.to_string());
    assert_eq!(st, 0, "CHECK: {out}");
    with_prev["prevResult"]["interfaces"][0]["socketPath"] = json!("/elsewhere.sock");
    let (st, out) = net.plugin(&env("CHECK", &cid, &ns.path()), &with_prev.to_string());
    assert_eq!(
        error_code(st, &out),
        cni::code::CHECK_FAILED as u64,
        "{out}"
    );

    // DEL gives it back, and again (idempotent), also with the netns gone.
    for _ in 0..2 {
        let (st, out) = net.plugin(&env("DEL", &cid, &ns.path()), &conf);
        assert_eq!(st, 0, "DEL: {out}");
        assert!(nic.assigned().is_empty(), "{:?}", nic.assigned());
    }
    let (st, out) = net.plugin(&env("DEL", &cid, "/run/netns/gone-sgcni"), &conf);
    assert_eq!(st, 0, "DEL without netns: {out}");

    // An SG network with IPAM is a config error, before the NIC is asked.
    let mut bad = net.config();
    bad["ipam"] = json!({"type": "host-local", "subnet": "10.79.0.0/16"});
    let (st, out) = net.plugin(&env("ADD", &cid, &ns.path()), &bad.to_string());
    assert_eq!(
        error_code(st, &out),
        cni::code::INVALID_CONFIG as u64,
        "{out}"
    );
    assert!(out["msg"].as_str().unwrap().contains("ipam"), "{out}");
    assert!(nic.assigned().is_empty(), "{:?}", nic.assigned());

    // Through the reference cnitool (libcni v1.3.1): libcni re-encodes the result
    // with its own types and drops burstvm's `kind`; the SGF's socketPath and pciID
    // survive, and the runtime still reads an SG function from them (docs/cni.md).
    let ns2 = Netns::new();
    let r = net.add(&ns2);
    let iface = &r["interfaces"][0];
    let sgf = nic.assigned().pop().expect("cnitool ADD took an SGF");
    assert_eq!(sgf.kind, DevKind::Sg, "{sgf:?}");
    assert_eq!(iface["socketPath"], sgf.socket.to_str().unwrap(), "{r}");
    assert_eq!(iface["pciID"], sgf.id.as_str(), "{r}");
    assert!(iface.get("kind").is_none(), "libcni kept kind now: {r}");
    let parsed: netutil::cni::CniResult = serde_json::from_value(r.clone()).unwrap();
    let att = runtime::cni::attachment(&parsed, "eth0").unwrap();
    assert_eq!(att.kind, DevKind::Sg, "{r}");
    net.del(&ns2.path());
    assert!(nic.assigned().is_empty(), "{:?}", nic.assigned());
}
