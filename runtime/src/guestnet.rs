//! The guest's network link, as the sandbox's VMM gets it: read back from
//! the CNI placeholder in the sandbox netns (VF variants), or made here
//! for the `tap` variant (software CNI: a tap bridged to a veth whose peer
//! is a port of the server bridge). All of it through rtnetlink, no `ip`.

use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsFd;
use std::path::Path;

use netutil::{MacAddr, Netns, Rtnl};

use crate::cni::Attachment;
use crate::uplink::{ServerNet, SERVER_BRIDGE};

/// The guest-side interface for the `tap` variant, inside the sandbox netns.
pub const TAP_IF: &str = "tap0";
/// Server-side veth ends of `tap` sandboxes start with this.
pub const TAP_PEER_PREFIX: &str = "vt";
const SANDBOX_BRIDGE: &str = "br0";
const SANDBOX_VETH: &str = "eth0";

/// The guest's link parameters.
#[derive(Debug, Clone)]
pub struct GuestLink {
    pub vf_id: String,
    pub mac: MacAddr,
    pub ip: Ipv4Addr,
    pub prefix_len: u8,
    pub gateway: Option<Ipv4Addr>,
}

#[derive(Debug, thiserror::Error)]
pub enum GuestNetError {
    /// Names the netns and the interface itself.
    #[error(transparent)]
    Placeholder(Box<cni::PlaceholderError>),
    #[error("placeholder {ifname} in {netns}: no IPv4 address")]
    NoIpv4 { netns: String, ifname: String },
    #[error(transparent)]
    Netns(#[from] netutil::NetnsError),
    #[error("tap network of sandbox {sandbox}: {what}: {source}")]
    Link {
        sandbox: String,
        what: String,
        #[source]
        source: io::Error,
    },
}

/// The placeholder link the CNI plugin left in the sandbox netns: VF id,
/// MAC, address and gateway (as Kata reads a VF's host interface).
pub fn read_link(netns: &Path, ifname: &str, att: &Attachment) -> Result<GuestLink, GuestNetError> {
    let p = cni::read_placeholder(netns, ifname)
        .map_err(|e| GuestNetError::Placeholder(Box::new(e)))?;
    let (ip, prefix_len) = p
        .addresses
        .iter()
        .find_map(|a| match a.addr {
            IpAddr::V4(ip) => Some((ip, a.prefix)),
            _ => None,
        })
        .ok_or_else(|| GuestNetError::NoIpv4 {
            netns: netns.display().to_string(),
            ifname: ifname.to_string(),
        })?;
    let gateway = match p.gateway {
        Some(IpAddr::V4(g)) => Some(g),
        _ => att.gateway.as_deref().and_then(|g| g.parse().ok()),
    };
    Ok(GuestLink {
        vf_id: p.vf_id,
        mac: p.mac,
        ip,
        prefix_len,
        gateway,
    })
}

/// A locally administered MAC for a `tap` guest, derived from its address.
pub fn tap_guest_mac(ip: Ipv4Addr) -> MacAddr {
    let o = ip.octets();
    MacAddr::new([0x02, 0x42, 0xb7, o[1], o[2], o[3]])
}

/// The server-side veth end of sandbox `id` (IFNAMSIZ: a hash of the id).
fn tap_peer_name(id: &str) -> String {
    let h = id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    format!("{TAP_PEER_PREFIX}{:012x}", h & 0xffff_ffff_ffff)
}

/// Software CNI for `tap`: in the sandbox netns `ns` a tap and a veth
/// bridged together; the veth's peer joins the server bridge.
pub fn tap_attach(
    srv: &ServerNet,
    id: &str,
    ns: &Netns,
    ip: Ipv4Addr,
) -> Result<GuestLink, GuestNetError> {
    let peer = tap_peer_name(id);
    let err = |what: String| {
        let sandbox = id.to_string();
        move |source| GuestNetError::Link {
            sandbox,
            what,
            source,
        }
    };
    ns.run(|| -> Result<(), GuestNetError> {
        let mut nl = Rtnl::open().map_err(err("open rtnetlink".into()))?;
        let tap = nl
            .create_tap(TAP_IF)
            .map_err(err(format!("create tap {TAP_IF}")))?;
        nl.create_bridge(SANDBOX_BRIDGE, None)
            .map_err(err(format!("create bridge {SANDBOX_BRIDGE}")))?;
        nl.create_veth(SANDBOX_VETH, &peer, Some(srv.netns().as_fd()))
            .map_err(err(format!("create veth {SANDBOX_VETH} / {peer}")))?;
        let br = nl
            .index_of(SANDBOX_BRIDGE)
            .map_err(err(format!("index of {SANDBOX_BRIDGE}")))?;
        let veth = nl
            .index_of(SANDBOX_VETH)
            .map_err(err(format!("index of {SANDBOX_VETH}")))?;
        for (name, index) in [(TAP_IF, tap), (SANDBOX_VETH, veth)] {
            nl.set_master(index, br)
                .map_err(err(format!("put {name} on {SANDBOX_BRIDGE}")))?;
        }
        for (name, index) in [(TAP_IF, tap), (SANDBOX_VETH, veth), (SANDBOX_BRIDGE, br)] {
            nl.set_up(index, true)
                .map_err(err(format!("set {name} up")))?;
        }
        Ok(())
    })??;
    {
        let mut nl = srv.rtnl();
        let p = nl
            .index_of(&peer)
            .map_err(err(format!("index of {peer} in the server netns")))?;
        nl.set_master(p, srv.bridge_index())
            .map_err(err(format!("put {peer} on {SERVER_BRIDGE}")))?;
        nl.set_up(p, true).map_err(err(format!("set {peer} up")))?;
    }
    let a = srv.addressing();
    Ok(GuestLink {
        vf_id: String::new(),
        mac: tap_guest_mac(ip),
        ip,
        prefix_len: a.prefix_len,
        gateway: Some(a.server_ip),
    })
}

/// Removes the server-side veth end of sandbox `id` (gone already: fine).
pub fn tap_detach(srv: &ServerNet, id: &str) -> Result<(), GuestNetError> {
    let peer = tap_peer_name(id);
    let mut nl = srv.rtnl();
    let r = match nl.link_by_name(&peer) {
        Ok(None) => return Ok(()),
        Ok(Some(l)) => nl.delete_link(l.index),
        Err(e) => Err(e),
    };
    match r {
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(()),
        r => r.map_err(|source| GuestNetError::Link {
            sandbox: id.to_string(),
            what: format!("delete {peer}"),
            source,
        }),
    }
}
