//! The CNI networks a runtime writes into its state directory and executes
//! itself: `net.conf` (burstvm-cni, the VF network), `sg.conf` (burstvm-cni
//! `"kind":"sg"`, when the NIC daemon serves SG functions) and `tap.conf`
//! (the reference `bridge` plugin, run in the server netns). The VF and tap
//! networks lease disjoint ranges of the server's /16 (burstvm-ipam and
//! host-local, one store format), so their guests never get the same address.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{state_err, Runtime, RuntimeError};
use crate::cni_exec::CniNetwork;
use crate::server_netns;

/// The plugin executable, and the forwarder to the NIC daemon's CNI server.
const PLUGIN: &str = "burstvm-cni";
const THIN: &str = crate::cni_exec::FORWARDER;

/// The runtime's first PF (its SG functions' PF).
pub const PF: &str = "pf0";

/// The PFs the runtime's NIC daemon serves, with their VFs: `pf0`, `pf1`, ...
/// as many as `vfs` needs at `nic_api::MAX_VFS` each (a PF has at most
/// that many). The VF network spans them all: ADD takes a VF of the first
/// with one free (docs/cni.md).
pub fn pf_plan(vfs: usize) -> Vec<(String, usize)> {
    let vfs = vfs.max(1);
    (0..vfs.div_ceil(nic_api::MAX_VFS))
        .map(|k| {
            let n = (vfs - k * nic_api::MAX_VFS).min(nic_api::MAX_VFS);
            (format!("pf{k}"), n)
        })
        .collect()
}
/// VF-variant guests get addresses from burstvm-ipam (in burstvm-cni's
/// process: one exec per ADD, not two) in this part of the /16 …
const VF_RANGE: (&str, &str) = ("10.77.1.1", "10.77.127.254");
/// … and `tap` guests (the reference `bridge` plugin's host-local) in this part.
const TAP_RANGE: (&str, &str) = ("10.77.128.1", "10.77.255.254");

impl Runtime {
    /// IPAM plugin `plugin` (host-local's config: burstvm-ipam reads the
    /// same) over `range` of the server subnet.
    fn ipam(&self, plugin: &str, range: (&str, &str)) -> serde_json::Value {
        let a = self.server().addressing();
        let mask = !((1u32 << (32 - a.prefix_len)) - 1);
        serde_json::json!({
            "type": plugin,
            "dataDir": self.ipam_dir(),
            "ranges": [[{
                "subnet": format!("{}/{}", Ipv4Addr::from(u32::from(a.server_ip) & mask), a.prefix_len),
                "rangeStart": range.0,
                "rangeEnd": range.1,
                "gateway": a.server_ip.to_string(),
            }]],
            "routes": [{"dst": "0.0.0.0/0"}],
        })
    }

    fn write_conf(&self, file: &str, conf: &serde_json::Value) -> Result<PathBuf, RuntimeError> {
        let path = self.state_dir.join(file);
        std::fs::write(&path, serde_json::to_vec_pretty(conf).expect("json"))
            .map_err(state_err(&path))?;
        Ok(path)
    }

    /// The `tap` network: the reference `bridge` plugin puts a veth into the
    /// sandbox netns whose peer joins the server bridge (which stands for
    /// the host's), with an address from host-local. The runtime then joins
    /// the VMM's tap to that veth with tc, as Kata does.
    pub(super) fn write_tap_cni_config(&mut self) -> Result<(), RuntimeError> {
        let conf = serde_json::json!({
            "cniVersion": "1.1.0",
            "name": format!("burstvm-tap-{}", self.tag),
            "type": "bridge",
            "bridge": server_netns::SERVER_BRIDGE,
            "isGateway": false,
            "ipMasq": false,
            "ipam": self.ipam("host-local", TAP_RANGE),
        });
        let path = self.write_conf("tap.conf", &conf)?;
        let srv = self.server().netns_path();
        self.tap_cni = Some(
            CniNetwork::load(&path, cni_path(&self.cfg.bin))
                .map(|n| n.in_netns(&srv))
                .map_err(Arc::new),
        );
        Ok(())
    }

    pub(super) fn write_cni_config(&mut self) -> Result<(), RuntimeError> {
        let cni_path = cni_path(&self.cfg.bin);
        if !cni_path.iter().any(|d| d.join(PLUGIN).is_file()) {
            return Err(RuntimeError::NoCniPlugin {
                bin: self.cfg.bin.clone(),
                path: cni_path,
            });
        }
        // The NIC daemon serves the plugin's commands (cni::server): the
        // forwarder runs in the plugin's place, sparing each ADD and DEL a
        // glibc executable's start-up (docs/cni.md, "The CNI server").
        let served = (self.cfg.cni_server && cni_path.iter().any(|d| d.join(THIN).is_file()))
            .then(|| self.cni_socket().display().to_string());
        let plugin = |conf: serde_json::Value| match (&served, conf) {
            (Some(socket), serde_json::Value::Object(mut m)) => {
                m.insert("type".into(), THIN.into());
                m.insert("cniSocket".into(), socket.as_str().into());
                serde_json::Value::Object(m)
            }
            (_, conf) => conf,
        };
        let conf = plugin(serde_json::json!({
            "cniVersion": "1.1.0",
            "name": format!("burstvm-{}", self.tag),
            "type": PLUGIN,
            "nicSocket": self.nic_socket(),
            "pf": pf_plan(self.cfg.vfs).into_iter().map(|(pf, _)| pf).collect::<Vec<_>>(),
            "ipam": self.ipam(cni::ipam::TYPE, VF_RANGE),
        }));
        let path = self.write_conf("net.conf", &conf)?;
        self.cni = Some(CniNetwork::load(&path, cni_path.clone())?);
        if self.cfg.sgfs > 0 {
            // An SG function has no MAC, VLAN or address: no IPAM (docs/cni.md).
            let conf = plugin(serde_json::json!({
                "cniVersion": "1.1.0",
                "name": format!("burstvm-sg-{}", self.tag),
                "type": PLUGIN,
                "kind": "sg",
                "nicSocket": self.nic_socket(),
                "pf": PF,
            }));
            let path = self.write_conf("sg.conf", &conf)?;
            self.sg_cni = Some(CniNetwork::load(&path, cni_path)?);
        }
        Ok(())
    }

    /// The IPAM data directory (leases of every network of this runtime).
    fn ipam_dir(&self) -> PathBuf {
        self.state_dir.join("ipam")
    }

    /// The leases of this runtime's VF network: one file per address,
    /// holding the container id.
    pub fn ipam_lease_dir(&self) -> PathBuf {
        self.ipam_dir().join(format!("burstvm-{}", self.tag))
    }

    /// The `tap` variant's CNI network (the reference `bridge` plugin).
    pub fn tap_cni(&self) -> Result<&CniNetwork, crate::host::HostCallError> {
        match &self.tap_cni {
            Some(Ok(n)) => Ok(n),
            Some(Err(e)) => Err(crate::host::HostCallError::TapNetwork { source: e.clone() }),
            None => Err(crate::host::HostCallError::NoTapNetwork),
        }
    }
}

/// Directories searched for CNI plugins: next to `burstvm`, then the usual places.
pub fn cni_path(bin: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(d) = bin.parent() {
        v.push(d.to_path_buf());
    }
    if let Some(p) = std::env::var_os("CNI_PATH") {
        v.extend(std::env::split_paths(&p));
    }
    v.push(PathBuf::from("/opt/cni/bin"));
    if let Some(h) = std::env::var_os("HOME") {
        v.push(Path::new(&h).join("go/bin"));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pf_plan_fills_each_pf_before_the_next() {
        let plan = |vfs| -> Vec<(String, usize)> { pf_plan(vfs) };
        assert_eq!(plan(0), [("pf0".into(), 1)]);
        assert_eq!(plan(4), [("pf0".into(), 4)]);
        assert_eq!(plan(256), [("pf0".into(), 256)]);
        assert_eq!(plan(257), [("pf0".into(), 256), ("pf1".into(), 1)]);
        assert_eq!(plan(400), [("pf0".into(), 256), ("pf1".into(), 144)]);
    }
}
