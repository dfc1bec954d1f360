//! `burstvm-ipam`: the IPAM burstvm-cni runs in its own process, and the
//! executable other plugins run. Both share a data directory with the
//! reference `host-local` (same files, same lock), so the tests mix them:
//! each frees what the other leased, and parallel ADDs of both never
//! collide. Set-up is cni_common's.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod cni_common;

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use cni_common::*;
use serde_json::{json, Value};

const IPAM: &str = env!("CARGO_BIN_EXE_burstvm-ipam");

/// Runs an IPAM plugin executable; returns (exit status, stdout JSON or Null).
fn ipam(bin: &Path, cmd: &str, cid: &str, conf: &Value) -> (i32, Value) {
    let mut child = Command::new(bin)
        .env("CNI_COMMAND", cmd)
        .env("CNI_CONTAINERID", cid)
        .env("CNI_NETNS", "/run/netns/unused-by-ipam")
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/nonexistent")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(conf.to_string().as_bytes())
        .unwrap();
    finish_plugin(child)
}

fn address(r: &Value) -> String {
    r["ips"][0]["address"].as_str().unwrap().to_string()
}

#[test]
fn burstvm_ipam_runs_in_the_plugins_process_and_shares_host_locals_store() {
    let nic = NicDaemon::start(4);
    let net = Network::with_ipam(&nic, "10.81.0.0/16", "burstvm-ipam", json!({}));
    let conf = net.config();
    let ns = Netns::new();
    let ns_path = ns.path();
    let host_local = tool("host-local");

    // No IPAM executable is reachable: the plugin serves it itself.
    let empty = tempfile::tempdir().unwrap();
    let mut e = env("ADD", "c1", &ns_path);
    e.push(("CNI_PATH", empty.path().to_str().unwrap()));
    let (st, r) = finish_plugin(start_plugin(&e, &conf.to_string()));
    assert_eq!(st, 0, "{r}");
    assert_eq!(address(&r), "10.81.0.2/16");
    assert_eq!(r["ips"][0]["gateway"], "10.81.0.1");
    assert_eq!(r["routes"].as_array().unwrap().len(), 2);
    let p = cni::read_placeholder(Path::new(&ns.path()), "eth0").unwrap();
    assert_eq!(p.addresses[0].to_string(), "10.81.0.2/16");
    // CHECK and STATUS reach the in-process IPAM too.
    let mut check = conf.clone();
    check["prevResult"] = r.clone();
    let mut e = env("CHECK", "c1", &ns_path);
    e.push(("CNI_PATH", empty.path().to_str().unwrap()));
    let (st, out) = finish_plugin(start_plugin(&e, &check.to_string()));
    assert_eq!(st, 0, "{out}");
    let (ok, out, err) = net.cnitool("status", &ns_path);
    assert!(ok, "cnitool status: {out} {err}");

    // host-local continues the round robin in the same store, and so does the executable.
    let (st, r) = ipam(&host_local, "ADD", "hl1", &conf);
    assert_eq!((st, address(&r)), (0, "10.81.0.3/16".into()), "{r}");
    let (st, r) = ipam(Path::new(IPAM), "ADD", "bi1", &conf);
    assert_eq!((st, address(&r)), (0, "10.81.0.4/16".into()), "{r}");
    let mut leases = net.leases();
    leases.sort();
    assert_eq!(leases, ["10.81.0.2", "10.81.0.3", "10.81.0.4"]);

    // Each releases what the other leased.
    assert_eq!(ipam(&host_local, "DEL", "c1", &conf).0, 0);
    assert_eq!(ipam(Path::new(IPAM), "DEL", "hl1", &conf).0, 0);
    assert_eq!(net.leases(), ["10.81.0.4"]);
    // The plugin's CHECK now fails in its IPAM: c1 holds no lease.
    let mut e = env("CHECK", "c1", &ns_path);
    e.push(("CNI_PATH", empty.path().to_str().unwrap()));
    let (st, out) = finish_plugin(start_plugin(&e, &check.to_string()));
    assert_eq!(error_code(st, &out), 102, "{out}");
    assert!(
        out["details"]
            .as_str()
            .unwrap()
            .contains("holds no address"),
        "{out}"
    );
    let (st, r) = ipam(Path::new(IPAM), "CHECK", "bi1", &conf);
    assert_eq!(st, 0, "{r}");
    let (st, r) = ipam(Path::new(IPAM), "CHECK", "hl1", &conf);
    assert_eq!(error_code(st, &r), 102, "{r}");
    assert_eq!(ipam(Path::new(IPAM), "DEL", "bi1", &conf).0, 0);

    // The plugin's DEL still releases the VF and the link (its lease is gone already).
    let mut e = env("DEL", "c1", &ns_path);
    e.push(("CNI_PATH", empty.path().to_str().unwrap()));
    let (st, r) = finish_plugin(start_plugin(&e, &conf.to_string()));
    assert_eq!(st, 0, "{r}");
    assert_nothing_left(&nic, &net, &ns);
}

#[test]
fn burstvm_ipam_and_host_local_in_parallel_never_hand_out_one_address_twice() {
    const N: usize = 16;
    let data = tempfile::tempdir().unwrap();
    let conf = json!({
        "cniVersion": "1.1.0", "name": "mixed", "type": "burstvm-cni",
        "ipam": {"type": "burstvm-ipam", "subnet": "10.82.0.0/24", "dataDir": data.path()},
    });
    let host_local = tool("host-local");
    let results: Vec<(String, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..N)
            .map(|i| {
                let (conf, host_local) = (&conf, &host_local);
                s.spawn(move || {
                    let bin = if i % 2 == 0 {
                        host_local.as_path()
                    } else {
                        Path::new(IPAM)
                    };
                    let cid = format!("c{i}");
                    let (st, r) = ipam(bin, "ADD", &cid, conf);
                    assert_eq!(st, 0, "{} ADD {cid}: {r}", bin.display());
                    (cid, r)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let addrs: HashSet<String> = results.iter().map(|(_, r)| address(r)).collect();
    assert_eq!(addrs.len(), N, "{addrs:?}");

    // GC keeps the valid half.
    let mut gc = conf.clone();
    let valid: Vec<Value> = (0..N / 2)
        .map(|i| json!({"containerID": format!("c{i}"), "ifname": "eth0"}))
        .collect();
    gc["cni.dev/valid-attachments"] = json!(valid);
    let (st, r) = ipam(Path::new(IPAM), "GC", "unused", &gc);
    assert_eq!(st, 0, "{r}");
    let left: HashSet<String> = std::fs::read_dir(data.path().join("mixed"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.parse::<std::net::IpAddr>().is_ok())
        .collect();
    let kept: HashSet<String> = results[..N / 2]
        .iter()
        .map(|(_, r)| address(r).split('/').next().unwrap().to_string())
        .collect();
    assert_eq!(left, kept);
}

#[test]
fn a_full_range_fails_add_and_gives_the_vf_back() {
    let nic = NicDaemon::start(4);
    let net = Network::with_ipam(&nic, "10.83.0.0/24", "burstvm-ipam", json!({}));
    let mut conf = net.config();
    conf["ipam"]["rangeStart"] = json!("10.83.0.2");
    conf["ipam"]["rangeEnd"] = json!("10.83.0.2");
    let (a, b) = (Netns::new(), Netns::new());
    let (st, r) = net.plugin(&env("ADD", "a", &a.path()), &conf.to_string());
    assert_eq!(st, 0, "{r}");
    let (st, r) = net.plugin(&env("ADD", "b", &b.path()), &conf.to_string());
    assert_eq!(error_code(st, &r), cni::code::NO_ADDRESS as u64, "{r}");
    assert!(r["details"].as_str().unwrap().contains("full"), "{r}");
    // b holds nothing: no VF, no link, no lease.
    let held: Vec<_> = nic
        .assigned()
        .into_iter()
        .map(|v| v.sandbox.unwrap())
        .collect();
    assert_eq!(held, ["a"]);
    assert!(b.links().is_empty(), "{:?}", b.links());
    assert_eq!(net.leases(), ["10.83.0.2"]);
    let (st, r) = net.plugin(&env("DEL", "a", &a.path()), &conf.to_string());
    assert_eq!(st, 0, "{r}");
    assert_nothing_left(&nic, &net, &a);
}
