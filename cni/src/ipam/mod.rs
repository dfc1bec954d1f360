//! `burstvm-ipam`: IPAM with the reference `host-local` plugin's
//! configuration, allocation order and on-disk store (the two can share a
//! data directory), in Rust. `burstvm-cni` runs it in its own process when
//! a network's `ipam.type` is `burstvm-ipam`: an ADD then starts one
//! process, not two (host-local, a Go program, costs ~5 ms of CPU per start
//! on the README's host, most of a CNI ADD). The `burstvm-ipam` executable
//! serves other plugins (e.g. `bridge`) as any IPAM plugin does.

mod known;
mod range;
mod store;

pub use range::{Range, RangeSet};
pub use store::{Owner, Store, StoreError, DEFAULT_DATA_DIR};

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};

use crate::config::{self, Attachment};
use crate::env::{Command, Env};
use crate::error::{code, PluginError};
use crate::version::Version;
use netutil::cni::{CniResult, IpConfig, Route};
use netutil::IpNet;

/// The `ipam.type` that names this plugin.
pub const TYPE: &str = "burstvm-ipam";
/// Longest wait for the store's lock: every ADD of a burst takes it in turn
/// for well under a millisecond; one stuck holder must not hang the rest.
const LOCK_WAIT: Duration = Duration::from_secs(10);

/// A network config as this plugin reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpamConf {
    pub version: Version,
    /// The network's name: its leases' directory under `data_dir`.
    pub network: String,
    pub data_dir: PathBuf,
    /// One address is taken from each set, in order.
    pub sets: Vec<RangeSet>,
    pub routes: Vec<Route>,
    pub resolv_conf: Option<PathBuf>,
    /// Addresses asked for (CNI_ARGS `IP=`, `args.cni.ips`, `runtimeConfig.ips`).
    pub requested: Vec<IpAddr>,
    pub valid_attachments: Vec<Attachment>,
}

/// The spec's network name (§1): a directory name, never a path.
fn valid_network_name(n: &str) -> bool {
    let mut c = n.chars();
    c.next().is_some_and(|f| f.is_ascii_alphanumeric())
        && c.all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '_' | '.' | '-'))
}

/// An address of `ips`/`IP=`: plain or with a prefix (which is dropped).
fn requested_ip(s: &str, field: &str) -> Result<IpAddr, PluginError> {
    s.split('/')
        .next()
        .unwrap_or(s)
        .parse::<IpAddr>()
        .map(range::canonical)
        .map_err(|e| PluginError::invalid_config_caused(field, e))
}

fn ip_list(v: Option<&Value>, field: &str) -> Result<Vec<IpAddr>, PluginError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|i| match i {
                Value::String(s) => requested_ip(s, field),
                other => Err(PluginError::invalid_config(
                    field,
                    format!("{other} is not an address string"),
                )),
            })
            .collect(),
        Some(other) => Err(PluginError::invalid_config(
            field,
            format!("{other} is not an array"),
        )),
    }
}

fn set_list(v: Option<&Value>, field: &str) -> Result<Vec<RangeSet>, PluginError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, s)| RangeSet::parse(s, &format!("{field}[{i}]")))
            .collect(),
        Some(other) => Err(PluginError::invalid_config(
            field,
            format!("{other} is not an array of range sets"),
        )),
    }
}

/// Decodes a network config as host-local does; `cni_args` is CNI_ARGS.
pub fn parse(raw: &[u8], cni_args: Option<&str>) -> Result<IpamConf, PluginError> {
    let o = &config::decode_object(raw)?;
    let version = config::version_of(o)?;
    let network = match o.get("name") {
        Some(Value::String(n)) if valid_network_name(n) => n.clone(),
        other => {
            return Err(PluginError::invalid_config(
                "name",
                format!(
                    "{} is not a network name (a letter or digit, then letters, digits, '_', '.' or '-')",
                    config::shown(other)
                ),
            ))
        }
    };
    let ipam = match o.get("ipam") {
        Some(Value::Object(i)) => i,
        other => {
            return Err(PluginError::invalid_config(
                "ipam",
                format!("{} is not an object", config::shown(other)),
            ))
        }
    };
    let path_field = |key: &str| -> Result<Option<PathBuf>, PluginError> {
        match ipam.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s.is_empty() => Ok(None),
            Some(Value::String(s)) => Ok(Some(PathBuf::from(s))),
            Some(other) => Err(PluginError::invalid_config(
                &format!("ipam.{key}"),
                format!("{other} is not a path string"),
            )),
        }
    };
    let data_dir = path_field("dataDir")?.unwrap_or_else(|| DEFAULT_DATA_DIR.into());
    let resolv_conf = path_field("resolvConf")?;

    // host-local's order: the runtime's ipRanges, the `subnet` shorthand, `ranges`.
    let runtime = o.get("runtimeConfig");
    let mut sets = set_list(
        runtime.and_then(|r| r.get("ipRanges")),
        "runtimeConfig.ipRanges",
    )?;
    if ipam.get("subnet").is_some_and(|s| !s.is_null()) {
        let r = Range::parse(&Value::Object(ipam.clone()), "ipam")?;
        sets.push(RangeSet::new(vec![r], "ipam")?);
    }
    sets.extend(set_list(ipam.get("ranges"), "ipam.ranges")?);
    if sets.is_empty() {
        return Err(PluginError::invalid_config(
            "ipam.ranges",
            "no IP ranges: give ipam.subnet or ipam.ranges",
        ));
    }
    for (i, a) in sets.iter().enumerate() {
        if let Some(j) = sets[i + 1..].iter().position(|b| a.overlaps(b)) {
            return Err(PluginError::invalid_config(
                "ipam.ranges",
                format!("range set {i} overlaps range set {}", i + 1 + j),
            ));
        }
    }
    let routes: Vec<Route> = match ipam.get("routes") {
        None | Some(Value::Null) => Vec::new(),
        Some(r) => serde_json::from_value(r.clone())
            .map_err(|e| PluginError::invalid_config_caused("ipam.routes", e))?,
    };

    let mut requested = Vec::new();
    for pair in cni_args.unwrap_or("").split(';') {
        if let Some(("IP", ip)) = pair.split_once('=') {
            requested.push(requested_ip(ip, "CNI_ARGS IP")?);
        }
    }
    requested.extend(ip_list(
        o.get("args")
            .and_then(|a| a.get("cni"))
            .and_then(|c| c.get("ips")),
        "args.cni.ips",
    )?);
    requested.extend(ip_list(
        runtime.and_then(|r| r.get("ips")),
        "runtimeConfig.ips",
    )?);

    Ok(IpamConf {
        version,
        network,
        data_dir,
        sets,
        routes,
        resolv_conf,
        requested,
        valid_attachments: config::valid_attachments(o.get("cni.dev/valid-attachments"))?,
    })
}

fn store_error(e: StoreError) -> PluginError {
    match e {
        StoreError::Busy { .. } => {
            PluginError::caused(code::TRY_AGAIN_LATER, "IPAM store busy, try again later", e)
        }
        StoreError::Io { .. } => PluginError::caused(code::IO_FAILURE, "IPAM store I/O failure", e),
    }
}

fn unavailable(details: String) -> PluginError {
    PluginError::new(code::NO_ADDRESS, "no address for the attachment", details)
}

impl IpamConf {
    fn open(&self) -> Result<Store, PluginError> {
        Store::open(&self.data_dir, &self.network, LOCK_WAIT).map_err(store_error)
    }
}

/// One address of set `idx` for `owner`: `want` if asked for, else the
/// next free one in host-local's round-robin order.
fn allocate(
    store: &Store,
    set: &RangeSet,
    idx: usize,
    owner: Owner,
    want: Option<IpAddr>,
) -> Result<IpConfig, PluginError> {
    let found = |ip: IpAddr, r: &Range| IpConfig {
        address: IpNet::new(ip, r.subnet.prefix).expect("a prefix of the address's family"),
        gateway: Some(r.gateway),
        interface: None,
    };
    if let Some(ip) = want {
        let r = set
            .range_for(ip)
            .expect("the caller picked an address of this set");
        if ip == r.gateway {
            return Err(unavailable(format!(
                "requested address {ip} is the gateway of {}",
                r.subnet
            )));
        }
        if !store.reserve(owner, ip, idx).map_err(store_error)? {
            return Err(unavailable(format!(
                "requested address {ip} is leased in range set {set}"
            )));
        }
        return Ok(found(ip, r));
    }
    // The spec allows one allocation per attachment.
    if let Some(ip) = store
        .owned_by(owner)
        .map_err(store_error)?
        .into_iter()
        .find(|ip| set.range_for(*ip).is_some())
    {
        return Err(unavailable(format!(
            "{ip} is already leased to {} {}: a second allocation is not allowed",
            owner.id, owner.ifname
        )));
    }
    for (ip, r) in set.candidates(store.last_reserved(idx)) {
        if store.reserve(owner, ip, idx).map_err(store_error)? {
            return Ok(found(ip, r));
        }
    }
    Err(unavailable(format!("range set {set} is full")))
}

/// ADD: an address of every range set, the routes, and the DNS of
/// `resolvConf`. Nothing stays leased when any of it fails.
pub fn add(conf: &IpamConf, owner: Owner) -> Result<CniResult, PluginError> {
    let mut result = CniResult::default();
    if let Some(p) = &conf.resolv_conf {
        result.dns = Some(resolv_conf(p)?);
    }
    let store = conf.open()?;
    let mut requested = conf.requested.clone();
    for (idx, set) in conf.sets.iter().enumerate() {
        let want = requested
            .iter()
            .position(|a| set.range_for(*a).is_some())
            .map(|k| requested.remove(k));
        match allocate(&store, set, idx, owner, want) {
            Ok(ip) => result.ips.push(ip),
            Err(e) => return Err(undo(&store, &result, e)),
        }
    }
    if !requested.is_empty() {
        let list: Vec<String> = requested.iter().map(IpAddr::to_string).collect();
        let e = unavailable(format!(
            "requested addresses {} are in none of the ranges",
            list.join(", ")
        ));
        return Err(undo(&store, &result, e));
    }
    result.routes = conf.routes.clone();
    Ok(result)
}

/// Gives back what this ADD leased before `e`, and returns `e`.
fn undo(store: &Store, done: &CniResult, e: PluginError) -> PluginError {
    let ours: Vec<IpAddr> = done.ips.iter().map(|i| i.address.addr).collect();
    let leases = store.leases().unwrap_or_default();
    let mine: Vec<(IpAddr, String)> = leases
        .into_iter()
        .filter(|(ip, _)| ours.contains(ip))
        .collect();
    if let Err(r) = store.remove_where(&mine, |_| true) {
        eprintln!("{TYPE} ADD cleanup: {r}");
    }
    e
}

/// DEL: the attachment's leases go; none is no error.
pub fn del(conf: &IpamConf, owner: Owner) -> Result<(), PluginError> {
    conf.open()?.release(owner).map(|_| ()).map_err(store_error)
}

/// CHECK: the attachment still holds a lease.
pub fn check(conf: &IpamConf, owner: Owner) -> Result<(), PluginError> {
    if conf
        .open()?
        .owned_by(owner)
        .map_err(store_error)?
        .is_empty()
    {
        return Err(PluginError::new(
            code::CHECK_FAILED,
            "attachment differs from the ADD result",
            format!(
                "{} {} holds no address of network {}",
                owner.id, owner.ifname, conf.network
            ),
        ));
    }
    Ok(())
}

/// STATUS: the store can be locked and every range set has a free address.
pub fn status(conf: &IpamConf) -> Result<(), PluginError> {
    let leases = conf.open()?.leases().map_err(store_error)?;
    for set in &conf.sets {
        let used = leases
            .iter()
            .filter(|(ip, _)| set.range_for(*ip).is_some_and(|r| r.gateway != *ip))
            .count() as u128;
        if used >= set.capacity() {
            return Err(PluginError::new(
                code::NOT_AVAILABLE,
                format!("{TYPE} cannot serve ADD"),
                format!("range set {set} is full ({used} addresses leased)"),
            ));
        }
    }
    Ok(())
}

/// GC: every lease of the network whose attachment is not valid goes.
pub fn gc(conf: &IpamConf) -> Result<Vec<IpAddr>, PluginError> {
    let store = conf.open()?;
    let leases = store.leases().map_err(store_error)?;
    let valid = &conf.valid_attachments;
    store
        .remove_where(&leases, |text| match store::parse_owner(text) {
            (id, Some(ifname)) => !valid
                .iter()
                .any(|a| a.container_id == id && a.ifname == ifname),
            (id, None) => !valid.iter().any(|a| a.container_id == id),
        })
        .map_err(store_error)
}

/// The DNS settings of a resolv.conf, as host-local reads them.
fn resolv_conf(path: &std::path::Path) -> Result<Value, PluginError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        PluginError::caused(
            code::IO_FAILURE,
            format!("cannot read ipam.resolvConf {}", path.display()),
            e,
        )
    })?;
    let (mut nameservers, mut domain, mut search, mut options) = (vec![], None, vec![], vec![]);
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            [] => {}
            [c, ..] if c.starts_with('#') || c.starts_with(';') => {}
            ["nameserver", ns, ..] => nameservers.push(*ns),
            ["domain", d, ..] => domain = Some(*d),
            ["search", rest @ ..] => search.extend_from_slice(rest),
            ["options", rest @ ..] => options.extend_from_slice(rest),
            _ => {}
        }
    }
    let mut dns = serde_json::Map::new();
    let mut put = |k: &str, v: Value, empty: bool| {
        if !empty {
            dns.insert(k.into(), v);
        }
    };
    put("nameservers", json!(nameservers), nameservers.is_empty());
    put("domain", json!(domain), domain.is_none());
    put("search", json!(search), search.is_empty());
    put("options", json!(options), options.is_empty());
    Ok(Value::Object(dns))
}

/// The attachment an invocation is about (CNI_CONTAINERID, CNI_IFNAME).
pub(crate) fn owner(env: &Env) -> Result<Owner<'_>, PluginError> {
    Ok(Owner {
        id: env.container_id()?,
        ifname: env.ifname()?,
    })
}

/// The `burstvm-ipam` executable's main.
pub fn plugin_main() -> i32 {
    crate::plugin::serve(TYPE, run)
}

/// One invocation of the executable; `Ok(None)` is success without output.
pub fn run(env: &Env, stdin: &[u8]) -> Result<Option<Value>, PluginError> {
    let cmd = env.command()?;
    if cmd == Command::Version {
        return crate::plugin::version(stdin).map(Some);
    }
    let conf = parse(stdin, env.args.as_deref())?;
    crate::plugin::require(cmd, conf.version)?;
    match cmd {
        Command::Add => add(&conf, owner(env)?).map(|r| Some(r.to_json(conf.version))),
        Command::Del => del(&conf, owner(env)?).map(|()| None),
        Command::Check => check(&conf, owner(env)?).map(|()| None),
        Command::Status => status(&conf).map(|()| None),
        Command::Gc => gc(&conf).map(|_| None),
        Command::Version => unreachable!("handled above"),
    }
}

#[cfg(test)]
mod tests;
