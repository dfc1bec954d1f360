//! The CNI data model (spec 1.x): spec versions and what each changes, and
//! the result of ADD (spec §5 "ADD Success") with its encoding per version.
//! The plugin writes it, the runtime reads it: one model for both.

use std::net::IpAddr;

use serde::Deserialize;
use serde_json::{json, Map, Value};

pub use crate::IpNet;

/// Supported spec versions, oldest first (reported by VERSION).
pub const SUPPORTED: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Version {
    V0_3_0,
    V0_3_1,
    V0_4_0,
    V1_0_0,
    V1_1_0,
}

/// A `cniVersion` this model does not speak.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("incompatible CNI version {0:?}")]
pub struct UnknownVersion(pub String);

impl std::str::FromStr for Version {
    type Err = UnknownVersion;
    fn from_str(s: &str) -> Result<Version, UnknownVersion> {
        Ok(match s {
            "0.3.0" => Version::V0_3_0,
            "0.3.1" => Version::V0_3_1,
            "0.4.0" => Version::V0_4_0,
            "1.0.0" => Version::V1_0_0,
            "1.1.0" => Version::V1_1_0,
            _ => return Err(UnknownVersion(s.to_string())),
        })
    }
}

impl Version {
    pub fn as_str(self) -> &'static str {
        SUPPORTED[self as usize]
    }

    /// CHECK exists since 0.4.0.
    pub fn has_check(self) -> bool {
        self >= Version::V0_4_0
    }

    /// STATUS and GC exist since 1.1.0.
    pub fn has_status_and_gc(self) -> bool {
        self >= Version::V1_1_0
    }

    /// Before 1.0.0 every `ips` entry carries `"version": "4"|"6"`.
    pub fn ips_have_version(self) -> bool {
        self < Version::V1_0_0
    }

    /// Interface `mtu`, `socketPath` and `pciID` and route `mtu`/`advmss`/... are 1.1.0 fields.
    pub fn has_1_1_fields(self) -> bool {
        self >= Version::V1_1_0
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
    /// burstvm's own field: `"sg"` for an SG function (no MAC, no address;
    /// `socketPath` is its vhost-user socket), absent for a VF.
    #[serde(default)]
    pub kind: Option<String>,
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
    pub fn from_json(v: &Value) -> Result<CniResult, serde_json::Error> {
        serde_json::from_value(v.clone())
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
                    put(&mut o, "kind", i.kind.as_ref().map(|s| json!(s)));
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
    fn versions_parse_and_say_what_they_have() {
        for s in SUPPORTED {
            assert_eq!(s.parse::<Version>().unwrap().as_str(), s);
        }
        for bad in ["0.1.0", "0.2.0", "1.2.0", "", "1.0"] {
            assert!(bad.parse::<Version>().is_err(), "{bad}");
        }
        assert!(!Version::V0_3_1.has_check());
        assert!(Version::V0_4_0.has_check());
        assert!(!Version::V1_0_0.has_status_and_gc());
        assert!(Version::V0_4_0.ips_have_version());
        assert!(!Version::V1_0_0.ips_have_version());
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
            kind: Some("sg".into()),
        });
        r.ips[0].interface = Some(0);
        let v11 = r.to_json(Version::V1_1_0);
        assert_eq!(v11["cniVersion"], "1.1.0");
        assert_eq!(v11["interfaces"][0]["pciID"], "0000:b1:00.3");
        assert_eq!(
            v11["interfaces"][0]["socketPath"],
            "/run/burstvm/nic/pf0-vf3.sock"
        );
        assert_eq!(v11["interfaces"][0]["kind"], "sg");
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
