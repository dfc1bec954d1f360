//! The guest's network through rtnetlink (no `ip`), with the workspace's
//! rtnetlink client (`netutil::Rtnl`): `lo` up; with an address, the first
//! ethernet link (`eth0` if there is one) up with it and a default route via
//! the gateway.

use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use netutil::{IpNet, Link, RouteSpec, Rtnl};

use super::{BootConfig, BootError};

fn is_loopback(l: &Link) -> bool {
    l.name == "lo"
}

/// An ethernet link: a real MAC, no kind (not a bridge, veth or tun).
fn is_ether(l: &Link) -> bool {
    !is_loopback(l) && l.kind.is_none() && l.mac.is_some_and(|m| <[u8; 6]>::from(m) != [0; 6])
}

/// The link to configure: `eth0`, else the first ethernet link that is not
/// the loopback.
pub fn pick_link(links: &[Link]) -> Option<&Link> {
    links
        .iter()
        .find(|l| l.name == "eth0")
        .or_else(|| links.iter().find(|l| is_ether(l)))
}

/// Brings `lo` up and, with `burstvm_net`, configures the ethernet link.
/// Returns the configured link's name. `wait` bounds the wait for the link
/// to appear (its driver probes during the kernel's boot, normally before).
pub fn configure(cfg: &BootConfig, wait: Duration) -> Result<Option<String>, BootError> {
    let e = |step, link: &str| {
        let link = link.to_string();
        move |source| BootError::Net { step, link, source }
    };
    let mut nl = Rtnl::open().map_err(e("open rtnetlink", "-"))?;
    let links = nl.links().map_err(e("list links", "-"))?;
    if let Some(lo) = links.iter().find(|l| is_loopback(l)) {
        nl.set_up(lo.index, true).map_err(e("set up", &lo.name))?;
    }
    let Some((addr, prefix)) = cfg.net else {
        return Ok(None);
    };
    let deadline = Instant::now() + wait;
    let link = loop {
        let links = nl.links().map_err(e("list links", "-"))?;
        if let Some(l) = pick_link(&links) {
            break l.clone();
        }
        if Instant::now() >= deadline {
            return Err(e("find an ethernet link", "eth0")(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no ethernet link within {wait:?}"),
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let net = IpNet::new(addr, prefix).ok_or_else(|| {
        e("add address", &link.name)(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("prefix /{prefix} too long for {addr}"),
        ))
    })?;
    nl.add_address(link.index, net)
        .map_err(e("add address", &link.name))?;
    nl.set_up(link.index, true)
        .map_err(e("set up", &link.name))?;
    if let Some(gw) = cfg.gw {
        let any = IpNet::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0).expect("/0 is valid");
        nl.add_route(link.index, &RouteSpec::to(any, Some(gw)))
            .map_err(e("add the default route", &link.name))?;
    }
    Ok(Some(link.name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(index: u32, name: &str, mac: Option<[u8; 6]>) -> Link {
        Link {
            index,
            name: name.into(),
            mac: mac.map(netutil::MacAddr::from),
            alias: None,
            mtu: 1500,
            up: false,
            master: None,
            kind: None,
        }
    }

    #[test]
    fn picks_eth0_else_first_ethernet() {
        let ls = vec![
            link(1, "lo", Some([0; 6])),
            link(2, "ens3", Some([2, 0, 0, 0, 0, 1])),
            link(3, "eth0", Some([2, 0, 0, 0, 0, 2])),
        ];
        assert_eq!(pick_link(&ls).unwrap().index, 3);
        assert_eq!(pick_link(&ls[..2]).unwrap().index, 2);
        assert!(pick_link(&ls[..1]).is_none());
    }

    /// In a network namespace of its own (a thread's): lo comes up; an
    /// address without an ethernet link fails naming it.
    #[test]
    fn configures_a_fresh_netns() {
        let t = std::thread::spawn(|| {
            if let Err(e) = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET) {
                eprintln!("skipped: unshare(CLONE_NEWNET): {e}");
                return;
            }
            let cfg = BootConfig::default();
            assert_eq!(configure(&cfg, Duration::ZERO).unwrap(), None);
            let mut nl = Rtnl::open().unwrap();
            let lo = nl.links().unwrap().into_iter().find(is_loopback).unwrap();
            assert!(lo.up);
            let cfg = BootConfig {
                net: Some(("192.0.2.5".parse().unwrap(), 24)),
                ..BootConfig::default()
            };
            let err = configure(&cfg, Duration::from_millis(50)).unwrap_err();
            assert!(err.to_string().contains("ethernet"), "{err}");
        });
        t.join().unwrap();
    }
}
