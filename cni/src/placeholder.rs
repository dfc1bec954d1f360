//! The placeholder link (FastIOV §5): a persistent tap named CNI_IFNAME in
//! the sandbox netns whose alias is the VF id and whose MAC is the VF MAC,
//! carrying the IPAM addresses and routes. The VF itself never leaves the
//! NIC; the runtime reads the placeholder back (as Kata does with the VF's
//! host interface) to learn which VF and which IP configuration to give the guest.

use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use netutil::{IpNet, MacAddr, Netns, NetnsError, RouteEntry, RouteSpec, Rtnl, Tap, TapError};

#[derive(Debug, thiserror::Error)]
pub enum PlaceholderError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("interface {ifname} in {netns}: already exists")]
    Exists { netns: PathBuf, ifname: String },
    #[error("interface {ifname} in {netns}: not found")]
    NotFound { netns: PathBuf, ifname: String },
    #[error("interface {ifname} in {netns}: not a burstvm placeholder ({why})")]
    NotPlaceholder {
        netns: PathBuf,
        ifname: String,
        why: String,
    },
    #[error("interface {ifname} in {netns}: {op}: {source}")]
    Io {
        netns: PathBuf,
        ifname: String,
        op: String,
        source: io::Error,
    },
}

/// What the runtime needs from a sandbox's placeholder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placeholder {
    pub ifname: String,
    pub index: u32,
    /// The VF id (PCI address form, e.g. `0000:b1:00.3`), from the alias.
    pub vf_id: String,
    pub mac: MacAddr,
    pub mtu: u32,
    pub addresses: Vec<IpNet>,
    /// Routes through the placeholder that are not the kernel's connected routes.
    pub routes: Vec<PlaceholderRoute>,
    /// The gateway of the IPv4 default route, else of the IPv6 one.
    pub gateway: Option<IpAddr>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlaceholderRoute {
    pub dst: IpNet,
    pub gw: Option<IpAddr>,
    pub table: u32,
}

impl Placeholder {
    pub fn mac_string(&self) -> String {
        self.mac.to_string()
    }
}

/// Reads the placeholder `ifname` in the netns at `netns`.
pub fn read_placeholder(netns: &Path, ifname: &str) -> Result<Placeholder, PlaceholderError> {
    let ns = Netns::open(netns)?;
    ns.run(|| read_here(netns, ifname))?
}

fn io_err(netns: &Path, ifname: &str, op: &str) -> impl FnOnce(io::Error) -> PlaceholderError {
    let (netns, ifname, op) = (netns.to_path_buf(), ifname.to_string(), op.to_string());
    move |source| PlaceholderError::Io {
        netns,
        ifname,
        op,
        source,
    }
}

fn read_here(netns: &Path, ifname: &str) -> Result<Placeholder, PlaceholderError> {
    let mut nl = Rtnl::open().map_err(io_err(netns, ifname, "open rtnetlink"))?;
    let link = nl
        .link_by_name(ifname)
        .map_err(io_err(netns, ifname, "get link"))?
        .ok_or_else(|| PlaceholderError::NotFound {
            netns: netns.into(),
            ifname: ifname.into(),
        })?;
    let not = |why: &str| PlaceholderError::NotPlaceholder {
        netns: netns.into(),
        ifname: ifname.into(),
        why: why.into(),
    };
    if !link.is_tun() {
        return Err(not("not a tap"));
    }
    let vf_id = link
        .alias
        .clone()
        .filter(|a| !a.is_empty())
        .ok_or_else(|| not("no alias"))?;
    let mac = link.mac.ok_or_else(|| not("no MAC address"))?;
    let addresses = nl
        .addresses(link.index)
        .map_err(io_err(netns, ifname, "list addresses"))?;
    let routes: Vec<PlaceholderRoute> = nl
        .routes(link.index)
        .map_err(io_err(netns, ifname, "list routes"))?
        .into_iter()
        .filter(|r: &RouteEntry| !r.from_kernel)
        .map(|r| PlaceholderRoute {
            dst: r.dst,
            gw: r.gw,
            table: r.table,
        })
        .collect();
    let default_gw = |v4: bool| {
        routes
            .iter()
            .find(|r| r.dst.prefix == 0 && r.dst.addr.is_ipv4() == v4)
            .and_then(|r| r.gw)
    };
    let gateway = default_gw(true).or_else(|| default_gw(false));
    Ok(Placeholder {
        ifname: ifname.into(),
        index: link.index,
        vf_id,
        mac,
        mtu: link.mtu,
        addresses,
        routes,
        gateway,
    })
}

/// Creates and configures the placeholder; on failure removes what it made.
/// Returns (ifindex, mtu).
pub(crate) fn create(
    ns: &Netns,
    ifname: &str,
    vf_id: &str,
    mac: MacAddr,
    addresses: &[IpNet],
    routes: &[RouteSpec],
) -> Result<(u32, u32), PlaceholderError> {
    let netns = ns.path();
    // The plugin's process is single-threaded and nothing attaches to the
    // placeholder: no thread for the namespace, none for the tap's fd.
    ns.run_here(|| {
        let mut nl = Rtnl::open().map_err(io_err(netns, ifname, "open rtnetlink"))?;
        match Tap::create_persistent_here(ifname) {
            Err(TapError::Busy { .. }) => {
                return Err(PlaceholderError::Exists {
                    netns: netns.into(),
                    ifname: ifname.into(),
                })
            }
            r => {
                r.map_err(|e| io_err(netns, ifname, "create persistent tap")(io::Error::other(e)))?
            }
        }
        let configured = (|| {
            let link = nl
                .link_by_name(ifname)
                .map_err(io_err(netns, ifname, "get link"))?
                .ok_or_else(|| PlaceholderError::NotFound {
                    netns: netns.into(),
                    ifname: ifname.into(),
                })?;
            nl.configure(link.index, mac, vf_id).map_err(io_err(
                netns,
                ifname,
                "set MAC, alias and up",
            ))?;
            for a in addresses {
                nl.add_address(link.index, *a).map_err(io_err(
                    netns,
                    ifname,
                    &format!("add address {a}"),
                ))?;
            }
            for r in routes {
                let op = format!(
                    "add route {} via {}",
                    r.dst,
                    r.gw.map_or("link".into(), |g| g.to_string())
                );
                nl.add_route(link.index, r)
                    .map_err(io_err(netns, ifname, &op))?;
            }
            Ok((link.index, link.mtu))
        })();
        if configured.is_err() {
            let _ = nl.delete_link_by_name(ifname);
        }
        configured
    })?
}

/// Removes the placeholder. Ok(false) if the netns or the link is gone; a
/// link of that name that is not a tap is left alone (not ours).
pub(crate) fn remove(netns: &Path, ifname: &str) -> Result<bool, PlaceholderError> {
    let ns = match Netns::open(netns) {
        Err(NetnsError::Gone { .. }) => return Ok(false),
        r => r?,
    };
    ns.run_here(|| {
        let mut nl = Rtnl::open().map_err(io_err(netns, ifname, "open rtnetlink"))?;
        match nl
            .link_by_name(ifname)
            .map_err(io_err(netns, ifname, "get link"))?
        {
            None => Ok(false),
            Some(l) if !l.is_tun() => Ok(false),
            Some(l) => match nl.delete_link(l.index) {
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(false),
                r => r
                    .map(|()| true)
                    .map_err(io_err(netns, ifname, "delete link")),
            },
        }
    })?
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// A network namespace made by this test, deleted on drop.
    struct TestNetns(netutil::NamedNetns);

    impl TestNetns {
        fn new(tag: &str) -> TestNetns {
            let name = format!("cni-ut-{tag}-{}", std::process::id());
            TestNetns(netutil::NamedNetns::create(&name).expect("create netns (root)"))
        }
        fn path(&self) -> PathBuf {
            self.0.path().to_path_buf()
        }
    }

    fn route(dst: &str, gw: Option<&str>) -> RouteSpec {
        RouteSpec {
            dst: dst.parse().unwrap(),
            gw: gw.map(|g| g.parse().unwrap()),
            mtu: None,
            advmss: None,
            priority: None,
            table: None,
            scope: None,
        }
    }

    #[test]
    fn create_read_remove_round_trip() {
        let ns = TestNetns::new("rt");
        let netns = Netns::open(&ns.path()).unwrap();
        let mac = MacAddr::new([0x02, 0x42, 0xbf, 0, 0, 3]);
        let addrs: Vec<IpNet> = vec![
            "10.22.0.5/16".parse().unwrap(),
            "fd00::5/64".parse().unwrap(),
        ];
        let routes = vec![
            route("0.0.0.0/0", Some("10.22.0.1")),
            route("192.168.7.0/24", None),
            route("::/0", Some("fd00::1")),
        ];
        let (index, mtu) = create(&netns, "eth0", "0000:b1:00.3", mac, &addrs, &routes).unwrap();
        assert_eq!(mtu, 1500);

        let p = read_placeholder(&ns.path(), "eth0").unwrap();
        assert_eq!(p.index, index);
        assert_eq!(p.vf_id, "0000:b1:00.3");
        assert_eq!(p.mac, mac);
        assert_eq!(p.mac_string(), "02:42:bf:00:00:03");
        assert_eq!(p.addresses, addrs);
        assert_eq!(p.gateway, Some("10.22.0.1".parse().unwrap()));
        let dsts: Vec<String> = p.routes.iter().map(|r| r.dst.to_string()).collect();
        for want in ["0.0.0.0/0", "192.168.7.0/24", "::/0"] {
            assert!(
                dsts.contains(&want.to_string()),
                "{want} missing from {dsts:?}"
            );
        }

        // A second placeholder of the same name is refused and the first stays intact.
        let again = create(&netns, "eth0", "0000:b1:00.4", mac, &[], &[]).unwrap_err();
        assert!(matches!(again, PlaceholderError::Exists { .. }), "{again}");
        assert_eq!(
            read_placeholder(&ns.path(), "eth0").unwrap().vf_id,
            "0000:b1:00.3"
        );

        assert!(remove(&ns.path(), "eth0").unwrap());
        assert!(!remove(&ns.path(), "eth0").unwrap());
        assert!(matches!(
            read_placeholder(&ns.path(), "eth0").unwrap_err(),
            PlaceholderError::NotFound { .. }
        ));
    }

    #[test]
    fn failed_configuration_removes_the_link() {
        let ns = TestNetns::new("fail");
        let netns = Netns::open(&ns.path()).unwrap();
        // The gateway is not on any subnet of the link: the route is refused.
        let routes = vec![route("0.0.0.0/0", Some("172.31.0.1"))];
        let err = create(
            &netns,
            "net1",
            "0000:b1:00.1",
            MacAddr::new([2, 0, 0, 0, 0, 1]),
            &["10.9.0.2/24".parse().unwrap()],
            &routes,
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("add route 0.0.0.0/0 via 172.31.0.1"),
            "{err}"
        );
        assert!(matches!(
            read_placeholder(&ns.path(), "net1").unwrap_err(),
            PlaceholderError::NotFound { .. }
        ));
    }

    #[test]
    fn gone_netns_and_foreign_links() {
        let gone = Path::new("/run/netns/cni-ut-never-existed");
        assert!(!remove(gone, "eth0").unwrap());
        assert!(matches!(
            read_placeholder(gone, "eth0").unwrap_err(),
            PlaceholderError::Netns(NetnsError::Gone { .. })
        ));
        // Loopback is not a placeholder: reading refuses, removing leaves it.
        let ns = TestNetns::new("lo");
        assert!(matches!(
            read_placeholder(&ns.path(), "lo").unwrap_err(),
            PlaceholderError::NotPlaceholder { .. }
        ));
        assert!(!remove(&ns.path(), "lo").unwrap());
        let out = Command::new("ip")
            .args(["-n", ns.0.name(), "link", "show", "lo"])
            .output()
            .unwrap();
        assert!(out.status.success());
    }
}
