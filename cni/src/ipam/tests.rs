use super::*;
use std::path::Path;

fn conf(dir: &Path, ipam: Value) -> IpamConf {
    let mut ipam = ipam;
    ipam["type"] = json!(TYPE);
    ipam["dataDir"] = json!(dir);
    let raw = json!({"cniVersion": "1.1.0", "name": "net", "type": "x", "ipam": ipam});
    parse(raw.to_string().as_bytes(), None).unwrap()
}

fn small(dir: &Path) -> IpamConf {
    conf(
        dir,
        json!({"subnet": "10.9.0.0/24", "rangeStart": "10.9.0.1", "rangeEnd": "10.9.0.4",
               "routes": [{"dst": "0.0.0.0/0"}]}),
    )
}

fn owner(id: &str) -> Owner<'_> {
    Owner { id, ifname: "eth0" }
}

fn addrs(r: &CniResult) -> Vec<String> {
    r.ips.iter().map(|i| i.address.to_string()).collect()
}

#[test]
fn parse_reads_host_locals_config() {
    let raw = json!({
        "cniVersion": "0.4.0", "name": "n1",
        "ipam": {"type": TYPE, "subnet": "10.1.0.0/16", "gateway": "10.1.0.254",
                 "ranges": [[{"subnet": "fd00::/64"}]],
                 "routes": [{"dst": "0.0.0.0/0"}, {"dst": "10.2.0.0/16", "gw": "10.1.0.9"}]},
        "runtimeConfig": {"ipRanges": [[{"subnet": "10.3.0.0/24"}]], "ips": ["10.1.0.7/16"]},
        "args": {"cni": {"ips": ["fd00::9"]}},
    });
    let c = parse(
        raw.to_string().as_bytes(),
        Some("K8S_POD_NAME=p;IP=10.3.0.5"),
    )
    .unwrap();
    assert_eq!(c.version, Version::V0_4_0);
    assert_eq!(c.network, "n1");
    assert_eq!(c.data_dir, Path::new(DEFAULT_DATA_DIR));
    let sets: Vec<String> = c.sets.iter().map(|s| s.to_string()).collect();
    // The runtime's ranges first, then the shorthand, then `ranges`.
    assert_eq!(
        sets,
        [
            "10.3.0.1-10.3.0.254",
            "10.1.0.1-10.1.255.254",
            "fd00::1-fd00::ffff:ffff:ffff:ffff"
        ]
    );
    assert_eq!(c.sets[1].0[0].gateway.to_string(), "10.1.0.254");
    assert_eq!(c.routes.len(), 2);
    assert_eq!(c.routes[1].gw.unwrap().to_string(), "10.1.0.9");
    let req: Vec<String> = c.requested.iter().map(|a| a.to_string()).collect();
    assert_eq!(req, ["10.3.0.5", "fd00::9", "10.1.0.7"]);
}

#[test]
fn parse_refuses_what_host_local_refuses_and_names_the_field() {
    let base = json!({"cniVersion": "1.1.0", "name": "n", "ipam": {"type": TYPE, "subnet": "10.1.0.0/24"}});
    let with = |f: &dyn Fn(&mut Value)| {
        let mut v = base.clone();
        f(&mut v);
        parse(v.to_string().as_bytes(), None).unwrap_err()
    };
    let cases: Vec<(PluginError, &str)> = vec![
        (with(&|v| v["name"] = json!("../etc")), "\"name\""),
        (with(&|v| v["ipam"] = json!("x")), "\"ipam\""),
        (
            with(&|v| v["ipam"] = json!({"type": TYPE})),
            "\"ipam.ranges\"",
        ),
        (
            with(&|v| v["ipam"]["ranges"] = json!([[{"subnet": "10.1.0.0/25"}]])),
            "\"ipam.ranges\"",
        ),
        (
            with(&|v| v["ipam"]["routes"] = json!([{"dst": "nope"}])),
            "\"ipam.routes\"",
        ),
        (
            with(&|v| v["ipam"]["dataDir"] = json!(3)),
            "\"ipam.dataDir\"",
        ),
        (
            with(&|v| v["runtimeConfig"] = json!({"ips": ["x"]})),
            "\"runtimeConfig.ips\"",
        ),
    ];
    for (e, field) in cases {
        assert_eq!(e.code, code::INVALID_CONFIG, "{e}");
        assert!(e.msg.contains(field), "{field}: {e}");
    }
    let e = with(&|v| v["cniVersion"] = json!("0.2.0"));
    assert_eq!(e.code, code::INCOMPATIBLE_VERSION);
    assert_eq!(parse(b"{", None).unwrap_err().code, code::DECODE_FAILURE);
    let e = parse(base.to_string().as_bytes(), Some("IP=10.1.0.300")).unwrap_err();
    assert!(e.msg.contains("CNI_ARGS IP"), "{e}");
}

#[test]
fn add_hands_out_addresses_round_robin_and_del_gives_them_back() {
    let d = tempfile::tempdir().unwrap();
    let c = small(d.path());
    // 10.9.0.1 is the gateway: never handed out.
    let a = add(&c, owner("a")).unwrap();
    assert_eq!(addrs(&a), ["10.9.0.2/24"]);
    assert_eq!(a.ips[0].gateway.unwrap().to_string(), "10.9.0.1");
    assert_eq!(a.routes.len(), 1);
    assert_eq!(addrs(&add(&c, owner("b")).unwrap()), ["10.9.0.3/24"]);
    del(&c, owner("a")).unwrap();
    del(&c, owner("a")).unwrap();
    // After the last reservation, not the freed one; then round to the start.
    assert_eq!(addrs(&add(&c, owner("c")).unwrap()), ["10.9.0.4/24"]);
    assert_eq!(addrs(&add(&c, owner("d")).unwrap()), ["10.9.0.2/24"]);
    let leased = std::fs::read_to_string(d.path().join("net/10.9.0.4")).unwrap();
    assert_eq!(leased, "c\r\neth0");
    check(&c, owner("c")).unwrap();
    assert_eq!(check(&c, owner("a")).unwrap_err().code, code::CHECK_FAILED);
}

#[test]
fn a_full_range_a_second_add_and_a_taken_request_get_no_address_and_lose_nothing() {
    let d = tempfile::tempdir().unwrap();
    let c = small(d.path());
    status(&c).unwrap();
    for id in ["a", "b", "c"] {
        add(&c, owner(id)).unwrap();
    }
    let full = add(&c, owner("d")).unwrap_err();
    assert_eq!(full.code, code::NO_ADDRESS, "{full}");
    assert!(full.details.contains("full"), "{full}");
    assert_eq!(status(&c).unwrap_err().code, code::NOT_AVAILABLE);
    let twice = add(&c, owner("a")).unwrap_err();
    assert_eq!(twice.code, code::NO_ADDRESS);
    assert!(twice.details.contains("10.9.0.2"), "{twice}");
    check(&c, owner("a")).unwrap();

    let mut req = c.clone();
    req.requested = vec!["10.9.0.3".parse().unwrap()];
    del(&c, owner("a")).unwrap();
    let taken = add(&req, owner("e")).unwrap_err();
    assert!(taken.details.contains("leased"), "{taken}");
    req.requested = vec!["10.9.0.1".parse().unwrap()];
    assert!(add(&req, owner("e"))
        .unwrap_err()
        .details
        .contains("gateway"));
    req.requested = vec!["10.9.0.2".parse().unwrap()];
    assert_eq!(addrs(&add(&req, owner("e")).unwrap()), ["10.9.0.2/24"]);
}

#[test]
fn every_range_set_gives_one_address_or_none_is_kept() {
    let d = tempfile::tempdir().unwrap();
    let c = conf(
        d.path(),
        json!({"ranges": [[{"subnet": "10.8.0.0/24"}], [{"subnet": "fd08::/120", "rangeEnd": "fd08::2"}]]}),
    );
    let r = add(&c, owner("a")).unwrap();
    assert_eq!(addrs(&r), ["10.8.0.2/24", "fd08::2/120"]);
    // The IPv6 set is full: b's IPv4 address is given back.
    let e = add(&c, owner("b")).unwrap_err();
    assert_eq!(e.code, code::NO_ADDRESS);
    let store = c.open().unwrap();
    assert_eq!(store.leases().unwrap().len(), 2);
    drop(store);
    // A request in no range: refused after the sets, nothing kept.
    let mut req = c.clone();
    req.requested = vec!["10.99.0.1".parse().unwrap()];
    del(&c, owner("a")).unwrap();
    let e = add(&req, owner("c")).unwrap_err();
    assert!(e.details.contains("10.99.0.1"), "{e}");
    assert!(c.open().unwrap().leases().unwrap().is_empty());
}

#[test]
fn gc_keeps_only_valid_attachments() {
    let d = tempfile::tempdir().unwrap();
    let mut c = small(d.path());
    add(&c, owner("a")).unwrap();
    // Another interface of the same container is another attachment.
    add(
        &c,
        Owner {
            id: "a",
            ifname: "eth1",
        },
    )
    .unwrap();
    add(&c, owner("b")).unwrap();
    // host-local's old format: the id alone.
    std::fs::write(d.path().join("net/10.9.0.9"), "old").unwrap();
    std::fs::write(d.path().join("net/10.9.0.10"), "b").unwrap();
    c.valid_attachments = vec![Attachment {
        container_id: "b".into(),
        ifname: "eth0".into(),
    }];
    let mut gone = gc(&c).unwrap();
    gone.sort();
    let gone: Vec<String> = gone.iter().map(|a| a.to_string()).collect();
    assert_eq!(gone, ["10.9.0.2", "10.9.0.3", "10.9.0.9"]);
    check(&c, owner("b")).unwrap();
    assert_eq!(c.open().unwrap().leases().unwrap().len(), 2);
}

#[test]
fn resolv_conf_becomes_the_results_dns() {
    let d = tempfile::tempdir().unwrap();
    let rc = d.path().join("resolv.conf");
    std::fs::write(
        &rc,
        "# c\nnameserver 10.0.0.53\nnameserver fd00::53\ndomain example\nsearch a b\noptions ndots:2\n",
    )
    .unwrap();
    let mut c = small(d.path());
    c.resolv_conf = Some(rc);
    let r = add(&c, owner("a")).unwrap();
    assert_eq!(
        r.dns.unwrap(),
        json!({"nameservers": ["10.0.0.53", "fd00::53"], "domain": "example",
               "search": ["a", "b"], "options": ["ndots:2"]})
    );
    c.resolv_conf = Some(d.path().join("missing"));
    let e = add(&c, owner("b")).unwrap_err();
    assert_eq!(e.code, code::IO_FAILURE);
    assert!(e.msg.contains("missing"), "{e}");
}

#[test]
fn the_executable_speaks_every_version_and_gates_commands() {
    let d = tempfile::tempdir().unwrap();
    let env = |cmd: &str| Env {
        command: Some(cmd.into()),
        container_id: Some("c1".into()),
        ifname: Some("eth0".into()),
        args: Some("IP=10.7.0.9".into()),
        ..Env::default()
    };
    let raw = |v: &str| {
        json!({"cniVersion": v, "name": "n",
               "ipam": {"type": TYPE, "dataDir": d.path(), "subnet": "10.7.0.0/24"}})
        .to_string()
    };
    let out = run(&env("ADD"), raw("0.3.1").as_bytes()).unwrap().unwrap();
    assert_eq!(out["cniVersion"], "0.3.1");
    assert_eq!(out["ips"][0]["version"], "4");
    assert_eq!(out["ips"][0]["address"], "10.7.0.9/24");
    assert_eq!(run(&env("CHECK"), raw("0.4.0").as_bytes()).unwrap(), None);
    let e = run(&env("CHECK"), raw("0.3.1").as_bytes()).unwrap_err();
    assert_eq!(e.code, code::INCOMPATIBLE_VERSION);
    assert_eq!(run(&env("STATUS"), raw("1.1.0").as_bytes()).unwrap(), None);
    assert_eq!(run(&env("DEL"), raw("1.1.0").as_bytes()).unwrap(), None);
    let v = run(&env("VERSION"), b"").unwrap().unwrap();
    assert!(v["supportedVersions"].is_array());
    let mut bad = env("ADD");
    bad.container_id = None;
    assert_eq!(
        run(&bad, raw("1.1.0").as_bytes()).unwrap_err().code,
        code::INVALID_ENV
    );
}
