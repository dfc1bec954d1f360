//! The CNI result model (spec §5 "ADD Success") and its encoding per spec version.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use serde::{Deserialize, Deserializer};
use serde_json::{json, Map, Value};

use crate::version::Version;

/// An address with its prefix length, e.g. `10.1.0.5/16` (host bits kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpNet {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl IpNet {
    pub fn new(addr: IpAddr, prefix: u8) -> Option<IpNet> {
        let max = if addr.is_ipv4() { 32 } else { 128 };
        (prefix <= max).then_some(IpNet { addr, prefix })
    }
}

impl FromStr for IpNet {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, p) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?} is not in CIDR notation (address/prefix)"))?;
        let addr: IpAddr = a
            .parse()
            .map_err(|_| format!("{s:?}: {a:?} is not an IP address"))?;
        let prefix: u8 = p
            .parse()
            .map_err(|_| format!("{s:?}: {p:?} is not a prefix length"))?;
        IpNet::new(addr, prefix).ok_or_else(|| format!("{s:?}: prefix length {prefix} too long"))
    }
}

impl fmt::Display for IpNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl<'de> Deserialize<'de> for IpNet {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Interface {
    pub name: String,
    #[serde(default)]
    pub mac: Option<String>,
    #[serde(default)]
    pub mtu: Option<u32>,
    #[serde(default)]
    pub sandbox: Option<String>,
    #[serde(default, rename = "socketPath")]
    pub socket_path: Option<String>,
    #[serde(default, rename = "pciID")]
    pub pci_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct IpConfig {
    pub address: IpNet,
    #[serde(default)]
    pub gateway: Option<IpAddr>,
    #[serde(default)]
    pub interface: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Route {
    pub dst: IpNet,
    #[serde(default)]
    pub gw: Option<IpAddr>,
    #[serde(default)]
    pub mtu: Option<u32>,
    #[serde(default)]
    pub advmss: Option<u32>,
    #[serde(default)]
    pub priority: Option<u32>,
    #[serde(default)]
    pub table: Option<u32>,
    #[serde(default)]
    pub scope: Option<u8>,
}

/// A Success result (or an IPAM plugin's abbreviated one: no interfaces).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
pub struct CniResult {
    #[serde(default)]
    pub interfaces: Vec<Interface>,
    #[serde(default)]
    pub ips: Vec<IpConfig>,
    #[serde(default)]
    pub routes: Vec<Route>,
    #[serde(default)]
    pub dns: Option<Value>,
}

impl CniResult {
    /// Decodes a result of any supported version (0.3/0.4's `ips[].version` is ignored).
    pub fn from_json(v: &Value) -> Result<CniResult, String> {
        serde_json::from_value(v.clone()).map_err(|e| e.to_string())
    }

    /// Encodes the result for `version`: older versions get `ips[].version`
    /// and lose the 1.1.0 fields.
    pub fn to_json(&self, version: Version) -> Value {
        let v11 = version.has_1_1_fields();
        let interfaces: Vec<Value> = self
            .interfaces
            .iter()
            .map(|i| {
                let mut o = Map::new();
                o.insert("name".into(), json!(i.name));
                put(&mut o, "mac", i.mac.as_ref().map(|m| json!(m)));
                if v11 {
                    put(&mut o, "mtu", i.mtu.map(|m| json!(m)));
                }
                put(&mut o, "sandbox", i.sandbox.as_ref().map(|s| json!(s)));
                if v11 {
                    put(
                        &mut o,
                        "socketPath",
                        i.socket_path.as_ref().map(|s| json!(s)),
                    );
                    put(&mut o, "pciID", i.pci_id.as_ref().map(|s| json!(s)));
                }
                Value::Object(o)
            })
            .collect();
        let ips: Vec<Value> = self
            .ips
            .iter()
            .map(|ip| {
                let mut o = Map::new();
                if version.ips_have_version() {
                    o.insert(
                        "version".into(),
                        json!(if ip.address.addr.is_ipv4() { "4" } else { "6" }),
                    );
                }
                o.insert("address".into(), json!(ip.address.to_string()));
                put(&mut o, "gateway", ip.gateway.map(|g| json!(g.to_string())));
                put(&mut o, "interface", ip.interface.map(|i| json!(i)));
                Value::Object(o)
            })
            .collect();
        let routes: Vec<Value> = self
            .routes
            .iter()
            .map(|r| {
                let mut o = Map::new();
                o.insert("dst".into(), json!(r.dst.to_string()));
                put(&mut o, "gw", r.gw.map(|g| json!(g.to_string())));
                if v11 {
                    put(&mut o, "mtu", r.mtu.map(|x| json!(x)));
                    put(&mut o, "advmss", r.advmss.map(|x| json!(x)));
                    put(&mut o, "priority", r.priority.map(|x| json!(x)));
                    put(&mut o, "table", r.table.map(|x| json!(x)));
                    put(&mut o, "scope", r.scope.map(|x| json!(x)));
                }
                Value::Object(o)
            })
            .collect();
        let mut o = Map::new();
        o.insert("cniVersion".into(), json!(version.as_str()));
        if !interfaces.is_empty() {
            o.insert("interfaces".into(), Value::Array(interfaces));
        }
        if !ips.is_empty() {
            o.insert("ips".into(), Value::Array(ips));
        }
        if !routes.is_empty() {
            o.insert("routes".into(), Value::Array(routes));
        }
        o.insert("dns".into(), self.dns.clone().unwrap_or_else(|| json!({})));
        Value::Object(o)
    }
}

fn put(o: &mut Map<String, Value>, k: &str, v: Option<Value>) {
    if let Some(v) = v {
        o.insert(k.into(), v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipnet_parses_and_rejects() {
        let n: IpNet = "10.1.0.5/16".parse().unwrap();
        assert_eq!(n.to_string(), "10.1.0.5/16");
        assert_eq!("fd00::5/64".parse::<IpNet>().unwrap().prefix, 64);
        for bad in ["10.1.0.5", "10.1.0.5/33", "x/8", "10.0.0.1/x", "::1/129"] {
            assert!(bad.parse::<IpNet>().is_err(), "{bad}");
        }
    }

    #[test]
    fn decodes_old_ipam_result_and_encodes_per_version() {
        let ipam = json!({"cniVersion":"0.3.1","ips":[{"version":"4","address":"10.1.0.5/16","gateway":"10.1.0.1"}],
                          "routes":[{"dst":"0.0.0.0/0"}],"dns":{}});
        let mut r = CniResult::from_json(&ipam).unwrap();
        assert_eq!(r.ips[0].gateway, Some("10.1.0.1".parse().unwrap()));
        r.interfaces.push(Interface {
            name: "eth0".into(),
            mac: Some("02:42:bf:00:00:03".into()),
            mtu: Some(1500),
            sandbox: Some("/run/netns/x".into()),
            socket_path: Some("/run/burstvm/nic/pf0-vf3.sock".into()),
            pci_id: Some("0000:b1:00.3".into()),
        });
        r.ips[0].interface = Some(0);
        let v11 = r.to_json(Version::V1_1_0);
        assert_eq!(v11["cniVersion"], "1.1.0");
        assert_eq!(v11["interfaces"][0]["pciID"], "0000:b1:00.3");
        assert_eq!(
            v11["interfaces"][0]["socketPath"],
            "/run/burstvm/nic/pf0-vf3.sock"
        );
        assert!(v11["ips"][0].get("version").is_none());
        assert_eq!(v11["ips"][0]["interface"], 0);
        let v04 = r.to_json(Version::V0_4_0);
        assert_eq!(v04["ips"][0]["version"], "4");
        assert!(v04["interfaces"][0].get("pciID").is_none());
        assert!(v04["interfaces"][0].get("mtu").is_none());
        let v10 = r.to_json(Version::V1_0_0);
        assert!(v10["ips"][0].get("version").is_none());
        assert!(v10["interfaces"][0].get("socketPath").is_none());
        // what we encode, we decode back
        assert_eq!(CniResult::from_json(&v11).unwrap(), r);
    }
}
