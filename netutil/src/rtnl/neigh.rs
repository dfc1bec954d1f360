//! Neighbour (ARP/NDP) table entries.

use std::io;
use std::net::IpAddr;

use netlink_packet_core::{NLM_F_CREATE, NLM_F_DUMP, NLM_F_REPLACE};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::RouteNetlinkMessage;

use super::addr::family;
use super::Rtnl;
use crate::MacAddr;

fn neigh_msg(index: u32, ip: IpAddr) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.family = family(ip);
    m.header.ifindex = index;
    m.attributes.push(NeighbourAttribute::Destination(match ip {
        IpAddr::V4(a) => NeighbourAddress::Inet(a),
        IpAddr::V6(a) => NeighbourAddress::Inet6(a),
    }));
    m
}

impl Rtnl {
    /// A permanent entry `ip` → `mac` on link `index` (replaces an existing one).
    pub fn set_neighbour(&mut self, index: u32, ip: IpAddr, mac: MacAddr) -> io::Result<()> {
        let mut m = neigh_msg(index, ip);
        m.header.state = NeighbourState::Permanent;
        m.attributes
            .push(NeighbourAttribute::LinkLayerAddress(mac.bytes().to_vec()));
        self.call(
            RouteNetlinkMessage::NewNeighbour(m),
            NLM_F_CREATE | NLM_F_REPLACE,
        )
        .map(drop)
    }

    /// Removes the entry for `ip` on link `index`; ENOENT if there is none.
    pub fn delete_neighbour(&mut self, index: u32, ip: IpAddr) -> io::Result<()> {
        self.call(RouteNetlinkMessage::DelNeighbour(neigh_msg(index, ip)), 0)
            .map(drop)
    }

    /// The entry for `ip` on link `index`: its MAC and whether it is permanent.
    pub fn neighbour(&mut self, index: u32, ip: IpAddr) -> io::Result<Option<(MacAddr, bool)>> {
        let mut q = NeighbourMessage::default();
        q.header.family = family(ip);
        let replies = self.call(RouteNetlinkMessage::GetNeighbour(q), NLM_F_DUMP)?;
        let want = match ip {
            IpAddr::V4(a) => NeighbourAddress::Inet(a),
            IpAddr::V6(a) => NeighbourAddress::Inet6(a),
        };
        for r in replies {
            let RouteNetlinkMessage::NewNeighbour(n) = r else {
                continue;
            };
            if n.header.ifindex != index
                || !n
                    .attributes
                    .iter()
                    .any(|a| matches!(a, NeighbourAttribute::Destination(d) if *d == want))
            {
                continue;
            }
            let mac = n.attributes.iter().find_map(|a| match a {
                NeighbourAttribute::LinkLayerAddress(b) => MacAddr::from_slice(b),
                _ => None,
            });
            if let Some(mac) = mac {
                return Ok(Some((mac, n.header.state == NeighbourState::Permanent)));
            }
        }
        Ok(None)
    }
}
