//! `burstvm-cni-thin`, the forwarder to the NIC daemon's CNI server
//! (`cni::server`, `burstvm nic --cni-socket`): a served ADD/CHECK/DEL
//! through `cnitool` as the exec'd plugin's; burstvm-cni run in its place
//! when no server takes the call; a server's reply relayed (exit status,
//! stdout, stderr) and a server lost mid-call reported as TRY_AGAIN_LATER.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod cni_common;

use std::io::Write;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::{Command, Output};

use cni_common::*;
use serde_json::{json, Value};

/// A directory holding only burstvm-cni-thin: a call that succeeds with it
/// as CNI_PATH's plugin directory was served (there is no burstvm-cni to run).
fn thin_only() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(THIN, d.path().join("burstvm-cni-thin")).unwrap();
    d
}

fn served_cpu_ns(nic: &NicDaemon) -> u64 {
    procutil::schedstat::named_threads_ns(nic.pid(), |n| n.starts_with(cni::server::THREAD_PREFIX))
        .unwrap()
}

#[test]
fn a_served_add_check_del_is_the_plugins_and_runs_in_the_daemon() {
    let nic = NicDaemon::start(4);
    let thin = thin_only();
    let mut net = Network::new(
        &nic,
        "10.79.0.0/16",
        json!({"type": "burstvm-cni-thin", "cniSocket": nic.cni_socket()}),
    );
    // host-local stays reachable: the served plugin runs it with the caller's CNI_PATH.
    let host_local = tool("host-local");
    net.set_cni_path(&[thin.path(), host_local.parent().unwrap()]);
    let ns = Netns::new();
    let cpu0 = served_cpu_ns(&nic);

    let r = net.add(&ns);
    let vf = nic.assigned();
    assert_eq!(vf.len(), 1, "one VF assigned: {vf:?}");
    let iface = &r["interfaces"][0];
    assert_eq!(iface["pciID"], vf[0].id.as_str());
    assert_eq!(iface["sandbox"], ns.path());
    let addr = r["ips"][0]["address"].as_str().unwrap();
    assert!(addr.starts_with("10.79."), "{r}");
    assert_eq!(net.leases().len(), 1);
    let p = cni::read_placeholder(Path::new(&ns.path()), "eth0").unwrap();
    assert_eq!(p.vf_id, vf[0].id);
    assert_eq!(p.addresses[0].to_string(), addr);
    let (ok, out, err) = net.cnitool("check", &ns.path());
    assert!(ok, "cnitool check: {out} {err}");
    assert!(
        served_cpu_ns(&nic) > cpu0,
        "the daemon's CNI threads did not run"
    );

    net.del(&ns.path());
    assert_nothing_left(&nic, &net, &ns);
    net.del(&ns.path());
}

#[test]
fn with_no_server_burstvm_cni_runs_in_its_place() {
    let nic = NicDaemon::start(2);
    for extra in [
        json!({"type": "burstvm-cni-thin", "cniSocket": "/nonexistent/cni.sock"}),
        json!({"type": "burstvm-cni-thin"}),
    ] {
        let net = Network::new(&nic, "10.80.0.0/16", extra.clone());
        let ns = Netns::new();
        let r = net.add(&ns);
        assert_eq!(
            r["interfaces"][0]["pciID"],
            nic.assigned()[0].id.as_str(),
            "{extra}"
        );
        net.del(&ns.path());
        assert_nothing_left(&nic, &net, &ns);
    }
}

fn run_thin(env: &[(&str, &str)], stdin: &[u8]) -> Output {
    run_thin_at(Path::new(THIN), env, stdin)
}

/// Runs `exe` as a CNI caller does; one still running after 20 s (a
/// forwarder that would exec itself for ever) is killed and fails the test.
fn run_thin_at(exe: &Path, env: &[(&str, &str)], stdin: &[u8]) -> Output {
    let mut cmd = Command::new(exe);
    cmd.env_clear().envs(env.iter().copied());
    testutil::run_bounded(&mut cmd, stdin, std::time::Duration::from_secs(20))
}

#[test]
fn with_no_server_and_no_burstvm_cni_it_says_so_in_the_configs_version() {
    let thin = thin_only();
    let path = thin.path().to_str().unwrap();
    let conf = br#"{"cniVersion":"0.4.0","name":"n","type":"burstvm-cni-thin","cniSocket":"/nonexistent/cni.sock","pf":"pf0"}"#;
    let out = run_thin(&[("CNI_COMMAND", "VERSION"), ("CNI_PATH", path)], conf);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let e: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(e["cniVersion"], "0.4.0");
    assert_eq!(e["code"], 11);
    assert!(String::from_utf8_lossy(&out.stderr).contains("burstvm-cni is not in CNI_PATH"));
}

/// A stand-in server on `sock` that reads one request per connection and
/// answers with `reply` (None: hangs up at once); returns the requests' environments.
fn fake_server(
    sock: &Path,
    replies: Vec<Option<Vec<u8>>>,
) -> std::thread::JoinHandle<Vec<cni::Env>> {
    let l = UnixListener::bind(sock).unwrap();
    std::thread::spawn(move || {
        let mut envs = Vec::new();
        for reply in replies {
            let (mut s, _) = l.accept().unwrap();
            let (env, config) = cni::server::read_request(&mut s).unwrap();
            assert!(config.unwrap().starts_with(b"{\"cniVersion\":\"1.0.0\""));
            envs.push(env);
            if let Some(r) = reply {
                s.write_all(&r).unwrap();
            }
        }
        envs
    })
}

fn frame(b: &[u8]) -> Vec<u8> {
    let mut v = (b.len() as u32).to_le_bytes().to_vec();
    v.extend_from_slice(b);
    v
}

#[test]
fn a_reply_is_relayed_a_lost_server_is_try_again_and_a_silent_one_runs_the_plugin() {
    let d = tempfile::tempdir().unwrap();
    let sock = d.path().join("cni.sock");
    let lost = b"{\"cniVersion\":\"1.0.0\",\"code\":11,\"msg\":\"lost\"}\n";
    let mut answered = frame(lost);
    answered.extend_from_slice(&3i32.to_le_bytes());
    answered.extend_from_slice(&frame(b"{\"x\":1}\n"));
    answered.extend_from_slice(&frame(b"why\n"));
    let server = fake_server(&sock, vec![Some(answered), Some(frame(lost)), None]);
    let conf = format!(
        r#"{{"cniVersion":"1.0.0","name":"n","ipam":{{"cniSocket":"nested, not ours","x":[1,{{"y":"\"}}"}}]}},"type":"burstvm-cni-thin","cniSocket":"{}","pf":"pf0"}}"#,
        sock.display()
    );
    let plugin_dir = Path::new(PLUGIN).parent().unwrap().to_str().unwrap();
    let env = [
        ("CNI_COMMAND", "VERSION"),
        ("CNI_CONTAINERID", "c9"),
        ("CNI_PATH", plugin_dir),
    ];

    // Answered: status, stdout and stderr as the server sent them.
    let out = run_thin(&env, conf.as_bytes());
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert_eq!(out.stdout, b"{\"x\":1}\n");
    assert_eq!(out.stderr, b"why\n");
    // Gone after it had the request: the error result it sent ahead.
    let out = run_thin(&env, conf.as_bytes());
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(out.stdout, lost);
    // Gone before it said it had the request: burstvm-cni answers VERSION itself.
    let out = run_thin(&env, conf.as_bytes());
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["cniVersion"], "1.0.0");
    assert!(v["supportedVersions"].as_array().unwrap().len() > 3, "{v}");

    let envs = server.join().unwrap();
    assert_eq!(envs.len(), 3);
    for e in envs {
        assert_eq!(e.command.as_deref(), Some("VERSION"));
        assert_eq!(e.container_id.as_deref(), Some("c9"));
        assert_eq!(e.path.as_deref(), Some(plugin_dir));
    }
}

/// The forwarder's bounds are the server's (thin.c has no access to them).
#[test]
fn the_forwarders_bounds_are_the_servers() {
    let src =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/cni-thin/thin.c")).unwrap();
    let define = |name: &str| -> usize {
        let line = src
            .lines()
            .find(|l| l.starts_with(&format!("#define {name} (")))
            .unwrap_or_else(|| panic!("no #define {name} (A << B) in thin.c"));
        let expr = line.split_once('(').unwrap().1.trim_end_matches(')');
        let (a, b) = expr.split_once("<<").unwrap();
        a.trim().parse::<usize>().unwrap() << b.trim().parse::<u32>().unwrap()
    };
    assert_eq!(define("MAX_STDIN"), cni::MAX_STDIN);
    assert_eq!(define("MAX_ENV"), cni::server::MAX_ENV);
    // A result carries a prevResult of up to a whole config.
    assert!(define("MAX_OUT") > cni::MAX_STDIN);
}

/// Installed under the plugin's own name, the forwarder does not exec
/// itself when no server takes the call: it says there is no plugin.
#[test]
fn a_forwarder_named_burstvm_cni_does_not_exec_itself() {
    let d = tempfile::tempdir().unwrap();
    std::fs::copy(THIN, d.path().join("burstvm-cni")).unwrap();
    let conf = br#"{"cniVersion":"1.0.0","name":"n","type":"burstvm-cni","pf":"pf0"}"#;
    let out = run_thin_at(
        &d.path().join("burstvm-cni"),
        &[
            ("CNI_COMMAND", "VERSION"),
            ("CNI_PATH", d.path().to_str().unwrap()),
        ],
        conf,
    );
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let e: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (e["code"].as_u64(), e["cniVersion"].as_str()),
        (Some(11), Some("1.0.0"))
    );
}
