//! The guest's network link, as the sandbox's VMM gets it: read back from
//! the CNI placeholder in the sandbox netns (VF variants), or, for the `tap`
//! variant, the reference `bridge` plugin's veth joined to the VMM's tap by
//! tc as Kata does. All of it through rtnetlink, no `ip`/`tc` processes.

use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use netutil::{MacAddr, Netns, Rtnl};

use crate::cni_exec::Attachment;

/// The guest-side interface for the `tap` variant, inside the sandbox netns.
pub const TAP_IF: &str = "tap0";

/// The guest's link parameters.
#[derive(Debug, Clone)]
pub struct GuestLink {
    pub vf_id: String,
    pub mac: MacAddr,
    pub ip: Ipv4Addr,
    pub prefix_len: u8,
    pub gateway: Option<Ipv4Addr>,
}

impl GuestLink {
    /// The netmask of `prefix_len`.
    pub fn netmask(&self) -> Ipv4Addr {
        let bits = u32::from(self.prefix_len.min(32));
        Ipv4Addr::from(u32::MAX.checked_shl(32 - bits).unwrap_or(0))
    }
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

/// The guest's link: from the ADD result `att` when it names the VF, its
/// MAC and an IPv4 address (burstvm-cni's does), else from the placeholder
/// link the CNI plugin left in the sandbox netns (as Kata reads a VF's host
/// interface: an engine's ADD, whose result the runtime never sees). The
/// result spares a start a thread in the netns and three rtnetlink dumps.
pub fn read_link(netns: &Path, ifname: &str, att: &Attachment) -> Result<GuestLink, GuestNetError> {
    match link_from_result(att) {
        Some(link) => Ok(link),
        None => read_placeholder_link(netns, ifname, att),
    }
}

/// The link an ADD result describes in full: VF id, MAC and IPv4 address.
fn link_from_result(att: &Attachment) -> Option<GuestLink> {
    let (ip, prefix) = att.ip_cidr.as_deref()?.split_once('/')?;
    Some(GuestLink {
        vf_id: att.vf_id.clone()?,
        mac: att.mac.as_deref()?.parse().ok()?,
        ip: ip.parse().ok()?,
        prefix_len: prefix.parse().ok().filter(|p| *p <= 32)?,
        gateway: att.gateway.as_deref().and_then(|g| g.parse().ok()),
    })
}

fn read_placeholder_link(
    netns: &Path,
    ifname: &str,
    att: &Attachment,
) -> Result<GuestLink, GuestNetError> {
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

/// Kata's `tcfilter` join, after the `bridge` plugin's ADD: in the sandbox
/// netns `ns`, a tap for the VMM and two tc redirects, veth ingress -> tap
/// and tap ingress -> veth. The guest takes the veth's MAC and address (the
/// CNI result), so the veth's own stack never sees a frame.
pub fn tap_join(id: &str, ns: &Netns, att: &Attachment) -> Result<GuestLink, GuestNetError> {
    let err = |what: String| {
        let sandbox = id.to_string();
        move |source| GuestNetError::Link {
            sandbox,
            what,
            source,
        }
    };
    let bad = |what: &str| {
        err(format!("CNI result of {}", att.ifname))(io::Error::new(
            io::ErrorKind::InvalidData,
            what.to_string(),
        ))
    };
    let mac: MacAddr = att
        .mac
        .as_deref()
        .and_then(|m| m.parse().ok())
        .ok_or_else(|| bad("no MAC"))?;
    let (ip, prefix_len) = att
        .ip_cidr
        .as_deref()
        .and_then(|c| c.split_once('/'))
        .and_then(|(ip, p)| Some((ip.parse::<Ipv4Addr>().ok()?, p.parse::<u8>().ok()?)))
        .ok_or_else(|| bad("no IPv4 address"))?;
    let gateway = att.gateway.as_deref().and_then(|g| g.parse().ok());
    ns.run(|| -> Result<(), GuestNetError> {
        let mut nl = Rtnl::open().map_err(err("open rtnetlink".into()))?;
        let tap = nl
            .create_tap(TAP_IF)
            .map_err(err(format!("create tap {TAP_IF}")))?;
        let veth = nl
            .index_of(&att.ifname)
            .map_err(err(format!("index of {}", att.ifname)))?;
        nl.redirect_ingress(veth, tap)
            .map_err(err(format!("tc redirect {} -> {TAP_IF}", att.ifname)))?;
        nl.redirect_ingress(tap, veth)
            .map_err(err(format!("tc redirect {TAP_IF} -> {}", att.ifname)))?;
        nl.set_up(tap, true)
            .map_err(err(format!("set {TAP_IF} up")))?;
        Ok(())
    })??;
    Ok(GuestLink {
        vf_id: String::new(),
        mac,
        ip,
        prefix_len,
        gateway,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn att() -> Attachment {
        Attachment {
            ifname: "eth0".into(),
            mac: Some("02:42:bf:00:00:03".into()),
            ip_cidr: Some("10.77.0.5/16".into()),
            gateway: Some("10.77.0.1".into()),
            vf_id: Some("0000:b1:00.3".into()),
            vf_socket: None,
            kind: nic_api::DevKind::Vf,
        }
    }

    /// A complete ADD result is the link: the netns (which does not exist
    /// here) is never read. A result short of any part of it falls back to
    /// the placeholder, whose read names the netns.
    #[test]
    fn a_complete_result_is_the_link_and_anything_less_reads_the_placeholder() {
        let gone = Path::new("/run/netns/burstvm-guestnet-test-does-not-exist");
        let link = read_link(gone, "eth0", &att()).unwrap();
        assert_eq!(link.vf_id, "0000:b1:00.3");
        assert_eq!(link.mac.to_string(), "02:42:bf:00:00:03");
        assert_eq!(link.ip, Ipv4Addr::new(10, 77, 0, 5));
        assert_eq!(link.netmask(), Ipv4Addr::new(255, 255, 0, 0));
        assert_eq!(link.gateway, Some(Ipv4Addr::new(10, 77, 0, 1)));
        let short: [fn(&mut Attachment); 5] = [
            |a| a.vf_id = None,
            |a| a.mac = Some("not-a-mac".into()),
            |a| a.ip_cidr = Some("fd00::5/64".into()),
            |a| a.ip_cidr = Some("10.77.0.5/33".into()),
            |a| a.ip_cidr = None,
        ];
        for cut in short {
            let mut a = att();
            cut(&mut a);
            let e = read_link(gone, "eth0", &a).unwrap_err();
            assert!(e.to_string().contains(&*gone.to_string_lossy()), "{e}");
        }
    }
}
