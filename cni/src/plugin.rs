//! The CNI commands: ADD, DEL, CHECK, STATUS, VERSION, GC.

use std::collections::HashSet;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::config::{self, NetConf};
use crate::delegate;
use crate::env::{Command, Env};
use crate::error::{code, PluginError};
use crate::placeholder::{self, PlaceholderError};
use crate::version::{Version, SUPPORTED};
use netutil::cni::{CniResult, Interface};
use netutil::{MacAddr, Netns, NetnsError, RouteSpec};
use nic::control::{Client, ClientError, DevKind, ErrorCode, VfInfo as Vf};
use nic::devset::VfState;

/// Reads env and stdin, runs the command, prints its result or error
/// result; returns the exit status.
pub fn main() -> i32 {
    let env = Env::from_process();
    let mut stdin = Vec::new();
    let result = match std::io::stdin().read_to_end(&mut stdin) {
        Ok(_) => run(&env, &stdin),
        Err(e) => Err(PluginError::new(
            code::IO_FAILURE,
            "cannot read the network config from stdin",
            e.to_string(),
        )),
    };
    match result {
        Ok(Some(out)) => {
            println!("{out}");
            0
        }
        Ok(None) => 0,
        Err(e) => {
            let version =
                config::peek_version(&stdin).unwrap_or_else(|| Version::V1_1_0.as_str().into());
            println!("{}", e.to_json(&version));
            eprintln!("burstvm-cni {}: {e}", env.command.as_deref().unwrap_or("?"));
            1
        }
    }
}

/// One invocation; `Ok(None)` means success without output (DEL, STATUS, GC).
pub fn run(env: &Env, stdin: &[u8]) -> Result<Option<Value>, PluginError> {
    let cmd = env.command()?;
    if cmd == Command::Version {
        return version(stdin).map(Some);
    }
    let conf = config::parse(stdin)?;
    match cmd {
        Command::Add => add(env, &conf).map(Some),
        Command::Del => del(env, &conf).map(|()| None),
        Command::Check => check(env, &conf).map(|()| None),
        Command::Status => status(env, &conf).map(|()| None),
        Command::Gc => gc(env, &conf).map(|()| None),
        Command::Version => unreachable!("handled above"),
    }
}

fn version(stdin: &[u8]) -> Result<Value, PluginError> {
    let asked = if stdin.iter().all(u8::is_ascii_whitespace) {
        Version::V1_1_0.as_str().to_string()
    } else {
        let v: Value = serde_json::from_slice(stdin)
            .map_err(|e| PluginError::decode_json("VERSION input", e))?;
        v.get("cniVersion")
            .and_then(Value::as_str)
            .unwrap_or(Version::V1_1_0.as_str())
            .to_string()
    };
    Ok(json!({"cniVersion": asked, "supportedVersions": SUPPORTED}))
}

fn nic_error(e: ClientError) -> PluginError {
    if e.is_lost() {
        // Killed mid-call; the runtime restarts it on its state file. DEL must
        // say "try again" so that the runtime repeats it against the new
        // daemon: a 5 would end the retries with the VF still assigned.
        return PluginError::caused(
            code::TRY_AGAIN_LATER,
            "NIC daemon went away mid-call, try again later",
            e,
        );
    }
    if e.is_transient() {
        // Not running, overloaded or not answering within the timeout.
        return PluginError::caused(
            code::TRY_AGAIN_LATER,
            "NIC daemon unavailable, try again later",
            e,
        );
    }
    let refused = match &e {
        ClientError::Refused { code, .. } => Some(*code),
        _ => None,
    };
    match refused {
        None => PluginError::caused(code::IO_FAILURE, "NIC daemon I/O failure", e),
        Some(Some(ErrorCode::NoFreeVf)) => {
            PluginError::caused(code::TRY_AGAIN_LATER, "no free VF", e)
        }
        Some(Some(ErrorCode::UnknownPf)) => PluginError::invalid_config_caused("pf", e),
        Some(Some(ErrorCode::BadRequest)) => PluginError::invalid_config_caused("mac/vlan", e),
        Some(Some(ErrorCode::AlreadyAssigned)) => {
            PluginError::caused(code::VF_CONFLICT, "the container already has a VF", e)
        }
        _ => PluginError::caused(code::IO_FAILURE, "NIC daemon refused", e),
    }
}

/// The VF assigned to `cid`, None if it has none.
fn assigned_vf(nic: &mut Client, cid: &str) -> Result<Option<Vf>, ClientError> {
    match nic.get_by_sandbox(cid) {
        Err(ClientError::Refused {
            code: Some(ErrorCode::NotFound),
            ..
        }) => Ok(None),
        r => r.map(Some),
    }
}

fn link_error(e: PlaceholderError) -> PluginError {
    match e {
        PlaceholderError::Netns(NetnsError::Gone { .. } | NetnsError::NotNetns { .. }) => {
            PluginError::invalid_env_caused("CNI_NETNS", e)
        }
        PlaceholderError::Exists { .. } => {
            PluginError::caused(code::LINK_FAILURE, "interface already exists", e)
        }
        _ => PluginError::caused(code::LINK_FAILURE, "placeholder link", e),
    }
}

const CHECK_FAILED_MSG: &str = "attachment differs from the ADD result";

fn check_failed(details: impl Into<String>) -> PluginError {
    PluginError::new(code::CHECK_FAILED, CHECK_FAILED_MSG, details)
}

fn parse_mac(s: &str) -> Option<MacAddr> {
    s.parse().ok()
}

/// The IPAM plugin's path, if the config has one (needs CNI_PATH).
fn ipam_plugin(env: &Env, conf: &NetConf) -> Result<Option<PathBuf>, PluginError> {
    conf.ipam
        .as_deref()
        .map(|t| delegate::find(t, &env.path()?))
        .transpose()
}

fn connect(conf: &NetConf) -> Result<Client, PluginError> {
    Client::connect_with_timeout(&conf.nic_socket, conf.nic_timeout).map_err(nic_error)
}

fn add(env: &Env, conf: &NetConf) -> Result<Value, PluginError> {
    let cid = env.container_id()?;
    let netns_path = env.netns()?;
    let ifname = env.ifname()?;
    let ipam = ipam_plugin(env, conf)?;
    let ns =
        Netns::open(netns_path).map_err(|e| PluginError::invalid_env_caused("CNI_NETNS", e))?;
    if ns
        .is_current()
        .map_err(|e| PluginError::invalid_env_caused("CNI_NETNS", e))?
    {
        return Err(PluginError::invalid_env(
            "CNI_NETNS",
            format!(
                "{} is the plugin's own network namespace",
                netns_path.display()
            ),
        ));
    }
    let mut nic = connect(conf)?;
    let alloc = match conf.kind {
        DevKind::Vf => nic.alloc(&conf.pf, cid, conf.mac.as_deref(), conf.vlan),
        DevKind::Sg => nic.alloc_sg(&conf.pf, cid),
    };
    let vf = match alloc {
        Ok(vf) => vf,
        Err(e) => {
            if e.is_lost() {
                // The daemon may have stored the alloc before it died; a
                // daemon already back releases it now, else the runtime's DEL does.
                if let Err(r) = connect(conf).and_then(|mut n| n.release(cid).map_err(nic_error)) {
                    eprintln!("burstvm-cni ADD cleanup: releasing the device of {cid}: {r}");
                }
            }
            return Err(nic_error(e));
        }
    };
    let result = match conf.kind {
        DevKind::Vf => add_with_vf(conf, &ns, ifname, &vf, ipam.as_deref()),
        DevKind::Sg => Ok(sg_result(conf, &ns, ifname, &vf)),
    };
    if result.is_err() {
        // Leave nothing behind: IPAM DEL (spec §4), then give the VF back.
        if let Some(p) = &ipam {
            if let Err(e) = delegate::exec(p, Command::Del, &conf.raw) {
                eprintln!("burstvm-cni ADD cleanup: {e}");
            }
        }
        if let Err(e) = nic.release(cid) {
            eprintln!("burstvm-cni ADD cleanup: releasing the device of {cid}: {e}");
        }
    }
    result
}

fn add_with_vf(
    conf: &NetConf,
    ns: &Netns,
    ifname: &str,
    vf: &Vf,
    ipam: Option<&Path>,
) -> Result<Value, PluginError> {
    let mac = parse_mac(&vf.mac).ok_or_else(|| {
        PluginError::new(
            code::IO_FAILURE,
            "NIC daemon sent a bad VF",
            format!("VF {} has MAC {:?}", vf.id, vf.mac),
        )
    })?;
    let ipam_result = match ipam {
        None => CniResult::default(),
        Some(p) => {
            let out = delegate::exec(p, Command::Add, &conf.raw)?.ok_or_else(|| {
                PluginError::decode(
                    &format!("result of IPAM plugin {}", p.display()),
                    "empty output",
                )
            })?;
            CniResult::from_json(&out).map_err(|e| {
                PluginError::decode(
                    &format!("result of IPAM plugin {}", p.display()),
                    e.to_string(),
                )
            })?
        }
    };
    let gateway = |v4: bool| {
        ipam_result
            .ips
            .iter()
            .filter(|i| i.address.addr.is_ipv4() == v4)
            .find_map(|i| i.gateway)
    };
    let addresses: Vec<_> = ipam_result.ips.iter().map(|i| i.address).collect();
    let routes: Vec<RouteSpec> = ipam_result
        .routes
        .iter()
        .map(|r| RouteSpec {
            dst: r.dst,
            gw: r.gw.or_else(|| gateway(r.dst.addr.is_ipv4())),
            mtu: r.mtu,
            advmss: r.advmss,
            priority: r.priority,
            table: r.table,
            scope: r.scope,
        })
        .collect();
    let (_, mtu) =
        placeholder::create(ns, ifname, &vf.id, mac, &addresses, &routes).map_err(link_error)?;

    // Chained after another plugin: extend its result (spec §2 ADD).
    let mut result = conf.prev_result.clone().unwrap_or_default();
    let index = result.interfaces.len();
    result.interfaces.push(Interface {
        name: ifname.into(),
        mac: Some(mac.to_string()),
        mtu: Some(mtu),
        sandbox: Some(ns.path().display().to_string()),
        socket_path: Some(vf.socket.display().to_string()),
        pci_id: Some(vf.id.clone()),
        kind: None,
    });
    result.ips.extend(ipam_result.ips.into_iter().map(|mut ip| {
        ip.interface = Some(index);
        ip
    }));
    result.routes.extend(ipam_result.routes);
    if ipam_result
        .dns
        .as_ref()
        .is_some_and(|d| d.as_object().is_some_and(|o| !o.is_empty()))
    {
        result.dns = ipam_result.dns;
    }
    Ok(result.to_json(conf.version))
}

/// An SG function has no link, MAC or address (config.rs refuses `ipam`
/// with it): the interface names its vhost-user socket and the SGF's id.
fn sg_result(conf: &NetConf, ns: &Netns, ifname: &str, sgf: &Vf) -> Value {
    let mut result = conf.prev_result.clone().unwrap_or_default();
    result.interfaces.push(Interface {
        name: ifname.into(),
        mac: None,
        mtu: None,
        sandbox: Some(ns.path().display().to_string()),
        socket_path: Some(sgf.socket.display().to_string()),
        pci_id: Some(sgf.id.clone()),
        kind: Some("sg".into()),
    });
    result.to_json(conf.version)
}

/// Best effort and idempotent: every step runs, the first error is returned.
fn del(env: &Env, conf: &NetConf) -> Result<(), PluginError> {
    let cid = env.container_id()?;
    let ifname = env.ifname()?;
    let mut errors = Vec::new();
    match ipam_plugin(env, conf) {
        Ok(Some(p)) => {
            if let Err(e) = delegate::exec(&p, Command::Del, &conf.raw) {
                errors.push(e);
            }
        }
        Ok(None) => {}
        // Still release what is ours; the runtime retries DEL with a fixed environment.
        Err(e) => errors.push(e),
    }
    if let Err(e) = connect(conf).and_then(|mut nic| nic.release(cid).map_err(nic_error)) {
        errors.push(e);
    }
    if let Some(netns) = env.netns_opt() {
        if let Err(e) = placeholder::remove(netns, ifname) {
            errors.push(link_error(e));
        }
    }
    for e in errors.iter().skip(1) {
        eprintln!("burstvm-cni DEL: also: {e}");
    }
    errors.into_iter().next().map_or(Ok(()), Err)
}

fn check(env: &Env, conf: &NetConf) -> Result<(), PluginError> {
    if !conf.version.has_check() {
        return Err(PluginError::new(
            code::INCOMPATIBLE_VERSION,
            "CHECK is not part of this CNI version",
            format!(
                "cniVersion {} has no CHECK (0.4.0 and later do)",
                conf.version.as_str()
            ),
        ));
    }
    let cid = env.container_id()?;
    let netns = env.netns()?;
    let ifname = env.ifname()?;
    let ipam = ipam_plugin(env, conf)?;
    let prev = conf.prev_result.as_ref().ok_or_else(|| {
        PluginError::invalid_config("prevResult", "CHECK needs the result of ADD")
    })?;
    let netns_str = netns.display().to_string();
    let (index, iface) = prev
        .interfaces
        .iter()
        .enumerate()
        .find(|(_, i)| i.name == ifname && i.sandbox.as_deref() == Some(netns_str.as_str()))
        .ok_or_else(|| {
            check_failed(format!(
                "prevResult has no interface {ifname} in {netns_str}"
            ))
        })?;

    if let Some(p) = &ipam {
        delegate::exec(p, Command::Check, &conf.raw)?;
    }

    let vf = assigned_vf(&mut connect(conf)?, cid)
        .map_err(nic_error)?
        .ok_or_else(|| check_failed(format!("the NIC has no VF assigned to container {cid}")))?;
    if vf.state == VfState::Free || vf.sandbox.as_deref() != Some(cid) {
        return Err(check_failed(format!(
            "the NIC says VF {} is {:?} for {:?}, not assigned to {cid}",
            vf.id, vf.state, vf.sandbox
        )));
    }
    if vf.kind != conf.kind {
        return Err(check_failed(format!(
            "the NIC assigned {} of kind {:?} to {cid}, the config asks for {:?}",
            vf.id, vf.kind, conf.kind
        )));
    }
    if conf.kind == DevKind::Sg {
        // No link and no address to compare: the socket is the attachment.
        return match iface.socket_path.as_deref() {
            Some(s) if Path::new(s) == vf.socket && iface.pci_id.as_deref() == Some(&vf.id) => {
                Ok(())
            }
            s => Err(check_failed(format!(
                "prevResult has socketPath {s:?} and pciID {:?}, the NIC has {} for SG function {}",
                iface.pci_id,
                vf.socket.display(),
                vf.id
            ))),
        };
    }
    let vf_mac = parse_mac(&vf.mac).ok_or_else(|| {
        check_failed(format!("the NIC reports MAC {:?} for VF {}", vf.mac, vf.id))
    })?;
    if iface.pci_id.as_deref().is_some_and(|p| p != vf.id) {
        return Err(check_failed(format!(
            "prevResult has pciID {:?}, the NIC has VF {}",
            iface.pci_id, vf.id
        )));
    }
    if iface
        .socket_path
        .as_deref()
        .is_some_and(|s| Path::new(s) != vf.socket)
    {
        return Err(check_failed(format!(
            "prevResult has socketPath {:?}, the NIC has {}",
            iface.socket_path,
            vf.socket.display()
        )));
    }
    if iface
        .mac
        .as_deref()
        .is_some_and(|m| parse_mac(m) != Some(vf_mac))
    {
        return Err(check_failed(format!(
            "prevResult has MAC {:?}, VF {} has {}",
            iface.mac, vf.id, vf.mac
        )));
    }

    let ph = placeholder::read_placeholder(netns, ifname)
        .map_err(|e| PluginError::caused(code::CHECK_FAILED, CHECK_FAILED_MSG, e))?;
    if ph.vf_id != vf.id {
        return Err(check_failed(format!(
            "{ifname} in {netns_str} names VF {:?}, the NIC assigned {}",
            ph.vf_id, vf.id
        )));
    }
    if ph.mac != vf_mac {
        return Err(check_failed(format!(
            "{ifname} in {netns_str} has MAC {}, VF {} has {}",
            ph.mac_string(),
            vf.id,
            vf.mac
        )));
    }
    for ip in prev.ips.iter().filter(|ip| ip.interface == Some(index)) {
        if !ph.addresses.contains(&ip.address) {
            return Err(check_failed(format!(
                "{ifname} in {netns_str} lacks address {}",
                ip.address
            )));
        }
    }
    Ok(())
}

fn status(env: &Env, conf: &NetConf) -> Result<(), PluginError> {
    if !conf.version.has_status_and_gc() {
        return Err(PluginError::new(
            code::INCOMPATIBLE_VERSION,
            "STATUS is not part of this CNI version",
            format!(
                "cniVersion {} has no STATUS (1.1.0 does)",
                conf.version.as_str()
            ),
        ));
    }
    const UNAVAILABLE: &str = "burstvm-cni cannot serve ADD";
    let unavailable = |details: String| PluginError::new(code::NOT_AVAILABLE, UNAVAILABLE, details);
    let vfs = Client::connect_with_timeout(&conf.nic_socket, conf.nic_timeout)
        .and_then(|mut n| n.list())
        .map_err(|e| PluginError::caused(code::NOT_AVAILABLE, UNAVAILABLE, e))?;
    let of_pf: Vec<&Vf> = vfs
        .iter()
        .filter(|v| v.pf == conf.pf && v.kind == conf.kind)
        .collect();
    if of_pf.is_empty() {
        return Err(unavailable(format!(
            "the NIC at {} has no PF {:?} with {:?} devices",
            conf.nic_socket.display(),
            conf.pf,
            conf.kind
        )));
    }
    if !of_pf.iter().any(|v| v.state == VfState::Free) {
        return Err(unavailable(format!(
            "all {} VFs of {} are assigned",
            of_pf.len(),
            conf.pf
        )));
    }
    if let Some(p) = ipam_plugin(env, conf)? {
        delegate::exec(&p, Command::Status, &conf.raw)?;
    }
    Ok(())
}

/// Releases every VF of `pf` whose container is not in the valid
/// attachments (a PF belongs to one network), then GCs the IPAM plugin.
fn gc(env: &Env, conf: &NetConf) -> Result<(), PluginError> {
    if !conf.version.has_status_and_gc() {
        return Err(PluginError::new(
            code::INCOMPATIBLE_VERSION,
            "GC is not part of this CNI version",
            format!(
                "cniVersion {} has no GC (1.1.0 does)",
                conf.version.as_str()
            ),
        ));
    }
    let ipam = ipam_plugin(env, conf)?;
    let valid: HashSet<&str> = conf
        .valid_attachments
        .iter()
        .map(|a| a.container_id.as_str())
        .collect();
    let mut errors = Vec::new();
    match connect(conf).and_then(|mut nic| Ok((nic.list().map_err(nic_error)?, nic))) {
        Err(e) => errors.push(e),
        Ok((vfs, mut nic)) => {
            for vf in vfs.iter().filter(|v| v.pf == conf.pf) {
                if let Some(s) = vf.sandbox.as_deref().filter(|s| !valid.contains(s)) {
                    if let Err(e) = nic.release(s) {
                        errors.push(nic_error(e));
                    }
                }
            }
        }
    }
    if let Some(p) = &ipam {
        if let Err(e) = delegate::exec(p, Command::Gc, &conf.raw) {
            errors.push(e);
        }
    }
    for e in errors.iter().skip(1) {
        eprintln!("burstvm-cni GC: also: {e}");
    }
    errors.into_iter().next().map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(cmd: &str) -> Env {
        Env {
            command: Some(cmd.into()),
            container_id: Some("c1".into()),
            netns: Some("/run/netns/does-not-exist-here".into()),
            ifname: Some("eth0".into()),
            path: None,
        }
    }

    const CONF: &str = r#"{"cniVersion":"1.1.0","name":"n","type":"burstvm-cni","pf":"pf0","nicSocket":"/nonexistent/nic.sock"}"#;

    #[test]
    fn version_answers_with_the_asked_version() {
        let v = run(&env("VERSION"), br#"{"cniVersion":"0.4.0"}"#)
            .unwrap()
            .unwrap();
        assert_eq!(v["cniVersion"], "0.4.0");
        assert_eq!(
            v["supportedVersions"].as_array().unwrap().len(),
            SUPPORTED.len()
        );
        assert_eq!(
            run(&env("VERSION"), b"{nope").unwrap_err().code,
            code::DECODE_FAILURE
        );
    }

    #[test]
    fn add_checks_env_before_touching_anything() {
        let mut e = env("ADD");
        e.container_id = None;
        assert_eq!(
            run(&e, CONF.as_bytes()).unwrap_err().code,
            code::INVALID_ENV
        );
        // A netns that does not exist: invalid CNI_NETNS, the NIC is never asked.
        let err = run(&env("ADD"), CONF.as_bytes()).unwrap_err();
        assert_eq!(err.code, code::INVALID_ENV);
        assert!(err.msg.contains("CNI_NETNS"), "{err}");
        // IPAM configured but no CNI_PATH.
        let with_ipam = CONF.replace(
            r#""pf":"pf0""#,
            r#""pf":"pf0","ipam":{"type":"host-local"}"#,
        );
        let err = run(&env("ADD"), with_ipam.as_bytes()).unwrap_err();
        assert!(
            err.code == code::INVALID_ENV && err.msg.contains("CNI_PATH"),
            "{err}"
        );
    }

    #[test]
    fn version_gated_commands() {
        let old = CONF.replace("1.1.0", "0.3.1");
        assert_eq!(
            run(&env("CHECK"), old.as_bytes()).unwrap_err().code,
            code::INCOMPATIBLE_VERSION
        );
        let v10 = CONF.replace("1.1.0", "1.0.0");
        assert_eq!(
            run(&env("STATUS"), v10.as_bytes()).unwrap_err().code,
            code::INCOMPATIBLE_VERSION
        );
        assert_eq!(
            run(&env("GC"), v10.as_bytes()).unwrap_err().code,
            code::INCOMPATIBLE_VERSION
        );
    }

    #[test]
    fn unreachable_nic_maps_to_try_again_and_status_50() {
        // DEL with a gone netns and no NIC: the NIC failure is reported (the runtime retries).
        let e = run(&env("DEL"), CONF.as_bytes()).unwrap_err();
        assert_eq!(e.code, code::TRY_AGAIN_LATER);
        assert!(e.details.contains("/nonexistent/nic.sock"), "{e}");
        assert_eq!(
            run(&env("STATUS"), CONF.as_bytes()).unwrap_err().code,
            code::NOT_AVAILABLE
        );
        assert_eq!(
            run(&env("GC"), CONF.as_bytes()).unwrap_err().code,
            code::TRY_AGAIN_LATER
        );
    }

    #[test]
    fn failures_keep_their_typed_cause() {
        // The NIC client's error is the source, not only the details text.
        let e = run(&env("STATUS"), CONF.as_bytes()).unwrap_err();
        let cause = std::error::Error::source(&e).expect("a cause");
        assert!(cause.downcast_ref::<ClientError>().is_some(), "{cause:?}");
        assert_eq!(e.details, cause.to_string());
        // A JSON input that does not parse keeps serde's error.
        let e = run(&env("ADD"), b"{").unwrap_err();
        assert_eq!(e.code, code::DECODE_FAILURE);
        let cause = std::error::Error::source(&e).expect("a cause");
        assert!(cause.downcast_ref::<serde_json::Error>().is_some());
    }

    #[test]
    fn nic_refusals_map_to_spec_codes() {
        let refused = |c| ClientError::Refused {
            path: "/s".into(),
            code: Some(c),
            error: "x".into(),
        };
        assert_eq!(
            nic_error(refused(ErrorCode::NoFreeVf)).code,
            code::TRY_AGAIN_LATER
        );
        assert_eq!(
            nic_error(refused(ErrorCode::UnknownPf)).code,
            code::INVALID_CONFIG
        );
        assert_eq!(
            nic_error(refused(ErrorCode::AlreadyAssigned)).code,
            code::VF_CONFLICT
        );
        assert_eq!(
            nic_error(refused(ErrorCode::Busy)).code,
            code::TRY_AGAIN_LATER
        );
        let io = ClientError::Io {
            path: "/s".into(),
            source: std::io::ErrorKind::PermissionDenied.into(),
        };
        assert_eq!(nic_error(io).code, code::IO_FAILURE);
        // The daemon died mid-call: retry (DEL must reach the restarted daemon).
        let lost = ClientError::Lost {
            path: "/run/x/nic.sock".into(),
            source: std::io::ErrorKind::ConnectionReset.into(),
        };
        let e = nic_error(lost);
        assert_eq!(e.code, code::TRY_AGAIN_LATER);
        assert!(e.details.contains("/run/x/nic.sock"), "{e}");
        assert_eq!(
            nic_error(ClientError::Closed { path: "/s".into() }).code,
            code::TRY_AGAIN_LATER
        );
        let timeout = ClientError::Timeout {
            path: "/run/x/nic.sock".into(),
            what: "response",
            after: std::time::Duration::from_secs(1),
        };
        let e = nic_error(timeout);
        assert_eq!(e.code, code::TRY_AGAIN_LATER);
        assert!(e.details.contains("/run/x/nic.sock"), "{e}");
        let unavailable = ClientError::Unavailable {
            path: "/s".into(),
            source: std::io::ErrorKind::ConnectionRefused.into(),
        };
        assert_eq!(nic_error(unavailable).code, code::TRY_AGAIN_LATER);
    }
}
