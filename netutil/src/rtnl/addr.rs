//! Addresses and routes of a link.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use netlink_packet_core::{NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL};
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressMessage, AddressScope};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteMetric, RouteProtocol,
    RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

use super::Rtnl;
use crate::IpNet;

/// A route to add: `gw` None means on-link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteSpec {
    pub dst: IpNet,
    pub gw: Option<IpAddr>,
    pub mtu: Option<u32>,
    pub advmss: Option<u32>,
    pub priority: Option<u32>,
    pub table: Option<u32>,
    pub scope: Option<u8>,
}

impl RouteSpec {
    /// A route to `dst` with nothing else set.
    pub fn to(dst: IpNet, gw: Option<IpAddr>) -> RouteSpec {
        RouteSpec {
            dst,
            gw,
            mtu: None,
            advmss: None,
            priority: None,
            table: None,
            scope: None,
        }
    }
}

/// A route found on a link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteEntry {
    pub dst: IpNet,
    pub gw: Option<IpAddr>,
    pub table: u32,
    pub from_kernel: bool,
}

pub(super) fn family(a: IpAddr) -> AddressFamily {
    if a.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    }
}

fn route_ip(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

impl Rtnl {
    pub fn add_address(&mut self, index: u32, net: IpNet) -> io::Result<()> {
        let mut m = AddressMessage::default();
        m.header.family = family(net.addr);
        m.header.prefix_len = net.prefix;
        m.header.index = index;
        m.header.scope = AddressScope::Universe;
        if net.addr.is_ipv4() {
            m.attributes.push(AddressAttribute::Local(net.addr));
        } else {
            // A link without carrier would leave the address tentative under DAD.
            m.attributes
                .push(AddressAttribute::Flags(AddressFlags::Nodad));
        }
        m.attributes.push(AddressAttribute::Address(net.addr));
        self.call(
            RouteNetlinkMessage::NewAddress(m),
            NLM_F_CREATE | NLM_F_EXCL,
        )
        .map(drop)
    }

    /// The global addresses of link `index`.
    pub fn addresses(&mut self, index: u32) -> io::Result<Vec<IpNet>> {
        let replies = self.call(
            RouteNetlinkMessage::GetAddress(AddressMessage::default()),
            NLM_F_DUMP,
        )?;
        let mut out = Vec::new();
        for r in replies {
            let RouteNetlinkMessage::NewAddress(a) = r else {
                continue;
            };
            if a.header.index != index || a.header.scope != AddressScope::Universe {
                continue;
            }
            let local = a.attributes.iter().find_map(|x| match x {
                AddressAttribute::Local(ip) => Some(*ip),
                _ => None,
            });
            let addr = local.or_else(|| {
                a.attributes.iter().find_map(|x| match x {
                    AddressAttribute::Address(ip) => Some(*ip),
                    _ => None,
                })
            });
            if let Some(net) = addr.and_then(|ip| IpNet::new(ip, a.header.prefix_len)) {
                out.push(net);
            }
        }
        Ok(out)
    }

    pub fn add_route(&mut self, index: u32, r: &RouteSpec) -> io::Result<()> {
        let mut m = RouteMessage::default();
        m.header.address_family = family(r.dst.addr);
        m.header.destination_prefix_length = r.dst.prefix;
        let table = r.table.unwrap_or(RouteHeader::RT_TABLE_MAIN as u32);
        m.header.table = u8::try_from(table).unwrap_or(RouteHeader::RT_TABLE_UNSPEC);
        m.header.protocol = RouteProtocol::Boot;
        m.header.kind = RouteType::Unicast;
        m.header.scope = match (r.scope, r.gw) {
            (Some(s), _) => RouteScope::from(s),
            (None, Some(_)) => RouteScope::Universe,
            (None, None) => RouteScope::Link,
        };
        m.attributes.push(RouteAttribute::Table(table));
        m.attributes
            .push(RouteAttribute::Destination(r.dst.addr.into()));
        if let Some(gw) = r.gw {
            m.attributes.push(RouteAttribute::Gateway(gw.into()));
        }
        m.attributes.push(RouteAttribute::Oif(index));
        if let Some(p) = r.priority {
            m.attributes.push(RouteAttribute::Priority(p));
        }
        let mut metrics = Vec::new();
        if let Some(mtu) = r.mtu {
            metrics.push(RouteMetric::Mtu(mtu));
        }
        if let Some(mss) = r.advmss {
            metrics.push(RouteMetric::Advmss(mss));
        }
        if !metrics.is_empty() {
            m.attributes.push(RouteAttribute::Metrics(metrics));
        }
        self.call(RouteNetlinkMessage::NewRoute(m), NLM_F_CREATE | NLM_F_EXCL)
            .map(drop)
    }

    /// The unicast routes through link `index`, in every table.
    pub fn routes(&mut self, index: u32) -> io::Result<Vec<RouteEntry>> {
        let replies = self.call(
            RouteNetlinkMessage::GetRoute(RouteMessage::default()),
            NLM_F_DUMP,
        )?;
        let mut out = Vec::new();
        for r in replies {
            let RouteNetlinkMessage::NewRoute(m) = r else {
                continue;
            };
            if m.header.kind != RouteType::Unicast {
                continue;
            }
            let (mut dst, mut gw, mut oif, mut table) = (None, None, None, m.header.table as u32);
            for a in &m.attributes {
                match a {
                    RouteAttribute::Destination(d) => dst = route_ip(d),
                    RouteAttribute::Gateway(g) => gw = route_ip(g),
                    RouteAttribute::Oif(o) => oif = Some(*o),
                    RouteAttribute::Table(t) => table = *t,
                    _ => {}
                }
            }
            if oif != Some(index) {
                continue;
            }
            let dst = dst.unwrap_or(match m.header.address_family {
                AddressFamily::Inet6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
                _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            });
            if let Some(dst) = IpNet::new(dst, m.header.destination_prefix_length) {
                out.push(RouteEntry {
                    dst,
                    gw,
                    table,
                    from_kernel: m.header.protocol == RouteProtocol::Kernel,
                });
            }
        }
        Ok(out)
    }
}
