//! Fuzz bodies of the CNI plugin's input: the CNI_* environment and the
//! network config on stdin, as a container runtime hands them over
//! (`cni_config`), and a request to the CNI server as a client sends it
//! (`cni_server`). Called by the cargo-fuzz targets in `fuzz/` and by the
//! corpus replay test (docs/fuzzing.md).

use crate::config;
use crate::env::Env;
use crate::error::code;
use crate::plugin;
use crate::version::Version;

/// `data` = environment lines `KEY=VALUE` (CNI_COMMAND, CNI_CONTAINERID,
/// CNI_NETNS, CNI_IFNAME, CNI_PATH), a NUL byte, then stdin. Parses both as
/// the plugin does, checks that what was accepted is what the spec allows,
/// that results re-encode in every version, and that every error is a CNI
/// error result. Nothing is executed, no netns or NIC is touched.
pub fn fuzz_config(data: &[u8]) {
    let (env_part, stdin) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (&[][..], data),
    };
    let env = Env::from_vars(
        String::from_utf8_lossy(env_part)
            .lines()
            .filter_map(|line| {
                let (k, v) = line.split_once('=')?;
                Some((k.to_string(), v.to_string()))
            }),
    );
    let _ = env.command();
    if let Ok(id) = env.container_id() {
        assert!(id.chars().next().is_some_and(|c| c.is_ascii_alphanumeric()));
        assert!(id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')));
    }
    if let Ok(name) = env.ifname() {
        assert!(!name.is_empty() && name.len() <= 15 && !name.contains('/'));
    }
    let _ = env.netns();
    let _ = env.path();

    let _ = config::peek_version(stdin);
    match config::parse(stdin) {
        Ok(c) => {
            assert!(!c.pfs.is_empty() && c.pfs.iter().all(|p| !p.is_empty()));
            assert!(c.vlan.is_none_or(|v| (1..=4094).contains(&v)));
            assert!(!c.nic_timeout.is_zero());
            assert!(c.nic_timeout.as_secs_f64() <= config::MAX_NIC_TIMEOUT_SECS);
            if let Some(t) = &c.ipam {
                assert!(!t.is_empty() && !t.contains('/'));
            }
            if let Some(r) = &c.prev_result {
                for v in crate::SUPPORTED_VERSIONS {
                    let v: Version = v.parse().expect("supported versions parse");
                    let json = r.to_json(v);
                    let back = netutil::cni::CniResult::from_json(&json)
                        .expect("a result re-encodes to something it can read");
                    assert_eq!(back.interfaces.len(), r.interfaces.len());
                }
            }
        }
        Err(e) => assert!(e.code != 0, "{e}"),
    }
    // burstvm-ipam reads the same config: what it accepts is canonical.
    match crate::ipam::parse(stdin, env.args.as_deref()) {
        Ok(c) => {
            assert!(!c.sets.is_empty() && !c.network.contains('/'));
            for set in &c.sets {
                assert!(set
                    .0
                    .iter()
                    .all(|r| r.contains(r.start) && r.contains(r.end)));
                assert!(set.0.iter().all(|r| r.start.is_ipv4() == set.is_ipv4()));
            }
        }
        Err(e) => assert!(e.code != 0, "{e}"),
    }
    // VERSION needs nothing but stdin: the whole command runs.
    let version_env = Env {
        command: Some("VERSION".into()),
        ..Env::default()
    };
    match plugin::run(&version_env, stdin) {
        Ok(Some(v)) => assert!(v["supportedVersions"].is_array()),
        Ok(None) => unreachable!("VERSION always answers"),
        Err(e) => assert_eq!(e.code, code::DECODE_FAILURE, "{e}"),
    }
}

pub fn config_seeds() -> Vec<Vec<u8>> {
    let env = "CNI_COMMAND=ADD\nCNI_CONTAINERID=abc-1\nCNI_NETNS=/run/netns/x\nCNI_IFNAME=eth0\nCNI_PATH=/opt/cni/bin";
    let confs = [
        r#"{"cniVersion":"1.1.0","name":"n","type":"burstvm-cni","pf":"pf0"}"#,
        r#"{"cniVersion":"1.1.0","name":"n","type":"burstvm-cni","pf":"pf0","nicSocket":"/run/x.sock","nicTimeout":2.5,"mac":"02:00:00:00:00:01","vlan":12,"ipam":{"type":"host-local","subnet":"10.77.0.0/16"}}"#,
        r#"{"cniVersion":"0.3.1","name":"n","type":"burstvm-cni","pf":"pf0"}"#,
        r#"{"cniVersion":"0.4.0","name":"n","type":"burstvm-cni","pf":"pf0","prevResult":{"cniVersion":"0.4.0","interfaces":[{"name":"eth0","sandbox":"/run/netns/x"}],"ips":[{"version":"4","address":"10.1.0.2/16","gateway":"10.1.0.1","interface":0}],"routes":[{"dst":"0.0.0.0/0"}]}}"#,
        r#"{"cniVersion":"1.1.0","name":"n","type":"burstvm-cni","pf":"pf0","prevResult":{"cniVersion":"1.1.0","interfaces":[{"name":"eth0","mac":"02:00:00:00:00:01","mtu":1500,"sandbox":"/run/netns/x","socketPath":"/s","pciID":"0000:b1:00.0"}],"ips":[{"address":"fd00::2/64","interface":0}],"dns":{"nameservers":["10.0.0.1"]}}}"#,
        r#"{"cniVersion":"1.1.0","name":"n","type":"burstvm-cni","pf":"pf0","cni.dev/valid-attachments":[{"containerID":"a","ifname":"eth0"}]}"#,
        r#"{"cniVersion":"9.9.9","name":"n","pf":"pf0"}"#,
        r#"{"name":"n","pf":"pf0"}"#,
        r#"{"cniVersion":"1.1.0","name":"n","pf":"pf0","vlan":4095}"#,
        r#"{"cniVersion":"1.1.0","name":"n","pf":"pf0","mac":"03:00:00:00:00:01"}"#,
        r#"{"cniVersion":"1.1.0","name":"n","pf":"pf0","ipam":{"type":"../x"}}"#,
        r#"{"cniVersion":"1.1.0","name":"n","pf":"pf0","nicTimeout":-1}"#,
        r#"{"cniVersion":"1.1.0","name":"n","pf":"pf0","prevResult":{"ips":[{"address":"10.0.0.1/99"}]}}"#,
        r#"{"cniVersion":1}"#,
        "{not json",
        "[]",
        "",
    ];
    let envs = [
        env,
        "CNI_COMMAND=DEL\nCNI_CONTAINERID=-bad\nCNI_IFNAME=0123456789abcdefg",
        "CNI_COMMAND=VERSION",
        "CNI_COMMAND=EXPLODE\nCNI_IFNAME=a/b\nCNI_PATH=::",
        "",
    ];
    let mut seeds = Vec::new();
    for (i, c) in confs.iter().enumerate() {
        let e = envs[i % envs.len()];
        let mut s = e.as_bytes().to_vec();
        s.push(0);
        s.extend_from_slice(c.as_bytes());
        seeds.push(s);
    }
    seeds
}

/// `data` = the bytes a client of the CNI server (`crate::server`) sends.
/// Parses them as the server does, within its bounds, and checks what it
/// accepts; nothing is run (the command is the plugin's, `fuzz_config`).
pub fn fuzz_server_request(data: &[u8]) {
    let mut r = data;
    let Ok((env, config)) = crate::server::read_request(&mut r) else {
        return;
    };
    assert!(data.starts_with(crate::server::MAGIC));
    let env_len = u32::from_le_bytes(data[4..8].try_into().expect("4 bytes")) as usize;
    assert!(env_len <= crate::server::MAX_ENV);
    match config {
        Ok(c) => assert!(c.len() <= plugin::MAX_STDIN),
        Err(e) => assert_eq!(e.code, code::DECODE_FAILURE),
    }
    for (_, v) in env.vars() {
        assert!(v.is_none_or(|v| !v.is_empty() && !v.contains('\0')));
    }
}

/// Seeds of `cni_server`: a VERSION and an ADD request, and one cut short.
pub fn server_seeds() -> Vec<Vec<u8>> {
    let request = |vars: &str, config: &str| {
        let vars = vars.replace('\n', "\0");
        let mut r = crate::server::MAGIC.to_vec();
        r.extend_from_slice(&(vars.len() as u32).to_le_bytes());
        r.extend_from_slice(vars.as_bytes());
        r.extend_from_slice(&(config.len() as u32).to_le_bytes());
        r.extend_from_slice(config.as_bytes());
        r
    };
    let conf = r#"{"cniVersion":"1.1.0","name":"n","type":"burstvm-cni-thin","cniSocket":"/run/burstvm/cni.sock","pf":"pf0"}"#;
    let add = request(
        "CNI_COMMAND=ADD\nCNI_CONTAINERID=abc-1\nCNI_NETNS=/run/netns/x\nCNI_IFNAME=eth0\nCNI_PATH=/opt/cni/bin\n",
        conf,
    );
    let mut short = add.clone();
    short.truncate(add.len() - 5);
    vec![request("CNI_COMMAND=VERSION\n", conf), add, short]
}
