//! `burstvm-cni` against a real `burstvm nic` daemon, the real `cnitool` and
//! the reference `host-local` IPAM plugin, in network namespaces made here:
//! what the spec asks of a working plugin (ADD/CHECK/DEL, older versions,
//! parallel ADDs, chaining, SG functions). Failures and faults (bad input,
//! exhaustion, a dead, silent or killed NIC daemon) are in cni_plugin_faults.rs;
//! the set-up both use is cni_common.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod cni_common;

use std::collections::HashSet;
use std::path::Path;

use cni_common::*;
use nic_api::DevKind;
use serde_json::{json, Value};

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
    assert_eq!(iface["mac"], vf.mac.unwrap().to_string());
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
    assert_eq!(Some(p.mac), vf.mac);
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
        assert_eq!(iface["mac"], nic.assigned()[0].mac.unwrap().to_string());
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
    fifty_parallel_adds("host-local", "10.79.0.0/16");
}

/// The same with the IPAM burstvm-cni runs in its own process.
#[test]
fn cni_fifty_parallel_adds_with_burstvm_ipam() {
    fifty_parallel_adds("burstvm-ipam", "10.80.0.0/16");
}

fn fifty_parallel_adds(ipam: &str, subnet: &str) {
    const N: usize = 50;
    let nic = NicDaemon::start(N);
    let net = Network::with_ipam(&nic, subnet, ipam, json!({}));
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
    let att = runtime::cni_exec::attachment(&parsed, "eth0").unwrap();
    assert_eq!(att.kind, DevKind::Sg, "{r}");
    net.del(&ns2.path());
    assert!(nic.assigned().is_empty(), "{:?}", nic.assigned());
}
