//! `burstvm-cni` when things go wrong, against a real `burstvm nic` daemon and
//! network namespaces made here: bad input, VF exhaustion, an unreachable,
//! silent or SIGKILLed daemon, a netns that is gone or not a netns. Each must
//! answer the spec's error code and leave nothing behind (cni_common's
//! `assert_nothing_left`). The working paths are in cni_plugin.rs.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod cni_common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use cni_common::*;
use serde_json::{json, Value};

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

    // A 2 MB config (valid JSON, padded): refused with a decode error before
    // anything is taken. The bound is 1 MiB (docs/cni.md).
    let mut huge = net.config();
    huge["padding"] = json!("x".repeat(2 << 20));
    let (status, out) = net.plugin(&env("ADD", "huge", &path), &huge.to_string());
    assert_eq!(error_code(status, &out), 6, "2 MB config: {out}");
    assert!(
        out["details"].as_str().unwrap().contains("1048576"),
        "{out}"
    );
    assert_nothing_left(&nic, &net, &ns);
}

/// A network over two PFs takes a VF of the second once the first has
/// none free, and is exhausted only when both are; STATUS sees both.
#[test]
fn cni_network_over_two_pfs_spills_to_the_second() {
    let nic = NicDaemon::start_pfs(&[1, 1]);
    let net = Network::new(&nic, "10.86.0.0/24", json!({"pf": ["pf0", "pf1"]}));
    let (ns1, ns2, ns3) = (Netns::new(), Netns::new(), Netns::new());
    net.add(&ns1);
    let first: Vec<String> = nic.assigned().into_iter().map(|v| v.pf).collect();
    assert_eq!(first, ["pf0"], "the first PF is tried first");
    let (status, out) = net.plugin(&[("CNI_COMMAND", "STATUS")], &net.config().to_string());
    assert_eq!(status, 0, "pf1 still has a free VF: {out}");
    net.add(&ns2);
    let mut pfs: Vec<String> = nic.assigned().into_iter().map(|v| v.pf).collect();
    pfs.sort();
    assert_eq!(pfs, ["pf0", "pf1"], "the second ADD spilled to pf1");
    let (status, out) = net.plugin(&env("ADD", "third", &ns3.path()), &net.config().to_string());
    assert_eq!(error_code(status, &out), 11, "both PFs exhausted: {out}");
    assert!(ns3.links().is_empty());
    let (status, out) = net.plugin(&[("CNI_COMMAND", "STATUS")], &net.config().to_string());
    assert_eq!(
        error_code(status, &out),
        50,
        "no free VF on either PF: {out}"
    );

    net.del(&ns1.path());
    net.del(&ns2.path());
    assert_nothing_left(&nic, &net, &ns1);
    assert_nothing_left(&nic, &net, &ns2);
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
    testutil::poll_until(
        &format!("burstvm-cni (pid {pid}) waiting on the NIC socket"),
        Duration::from_secs(10),
        || {
            let sc = std::fs::read_to_string(format!("/proc/{pid}/syscall")).unwrap_or_default();
            let mut f = sc.split_whitespace();
            if let (Some("0" | "45"), Some(fd)) = (f.next(), f.next()) {
                let fd = i64::from_str_radix(fd.trim_start_matches("0x"), 16).unwrap_or(-1);
                if std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))
                    .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
                {
                    return Ok(());
                }
            }
            Err(format!("/proc/{pid}/syscall: {:?}", sc.trim()))
        },
    )
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
    // All its threads must have stopped first: kill(SIGSTOP) returns before
    // they do, and a control thread still running answered the DEL (the
    // flake under load: "never waited on the NIC socket").
    nic.freeze();
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
        let r = stored.handle(nic_api::Request::Alloc {
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
