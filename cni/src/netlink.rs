//! Just enough rtnetlink for the placeholder link: one synchronous request
//! at a time on a NETLINK_ROUTE socket of the calling thread's netns.

use std::io;
use std::net::IpAddr;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL,
    NLM_F_REQUEST,
};
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressMessage, AddressScope};
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteMetric, RouteProtocol,
    RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

use crate::types::IpNet;

pub struct Rtnl {
    sock: Socket,
    seq: u32,
}

/// A link as the placeholder code needs it.
#[derive(Debug, Clone)]
pub struct Link {
    pub index: u32,
    pub mac: Option<[u8; 6]>,
    pub alias: Option<String>,
    pub mtu: u32,
    pub is_tun: bool,
}

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

/// A route found on a link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteEntry {
    pub dst: IpNet,
    pub gw: Option<IpAddr>,
    pub table: u32,
    pub from_kernel: bool,
}

fn family(a: IpAddr) -> AddressFamily {
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
    /// Opens a socket in the netns of the calling thread.
    pub fn open() -> io::Result<Rtnl> {
        let mut sock = Socket::new(NETLINK_ROUTE)?;
        sock.bind_auto()?;
        sock.connect(&SocketAddr::new(0, 0))?;
        Ok(Rtnl { sock, seq: 0 })
    }

    /// Sends one request and collects the replies up to its ACK or DONE.
    fn call(
        &mut self,
        msg: RouteNetlinkMessage,
        flags: u16,
    ) -> io::Result<Vec<RouteNetlinkMessage>> {
        self.seq += 1;
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
        header.sequence_number = self.seq;
        let mut req = NetlinkMessage::new(header, NetlinkPayload::from(msg));
        req.finalize();
        let mut buf = vec![0; req.header.length as usize];
        req.serialize(&mut buf);
        self.sock.send(&buf, 0)?;
        let bad =
            |e: String| io::Error::new(io::ErrorKind::InvalidData, format!("rtnetlink reply: {e}"));
        let mut replies = Vec::new();
        loop {
            let (data, _) = self.sock.recv_from_full()?;
            let mut off = 0;
            while off < data.len() {
                let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&data[off..])
                    .map_err(|e| bad(e.to_string()))?;
                let len = msg.header.length as usize;
                if len == 0 {
                    return Err(bad("zero-length message".into()));
                }
                off += (len + 3) & !3;
                if msg.header.sequence_number != self.seq {
                    continue;
                }
                match msg.payload {
                    NetlinkPayload::InnerMessage(m) => replies.push(m),
                    NetlinkPayload::Done(d) if d.code < 0 => {
                        return Err(io::Error::from_raw_os_error(-d.code))
                    }
                    NetlinkPayload::Done(_) => return Ok(replies),
                    NetlinkPayload::Error(e) => match e.code {
                        None => return Ok(replies),
                        Some(c) => return Err(io::Error::from_raw_os_error(-c.get())),
                    },
                    _ => {}
                }
            }
        }
    }

    /// The link called `name`, or None.
    pub fn link(&mut self, name: &str) -> io::Result<Option<Link>> {
        let mut m = LinkMessage::default();
        m.attributes.push(LinkAttribute::IfName(name.into()));
        let replies = match self.call(RouteNetlinkMessage::GetLink(m), 0) {
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return Ok(None),
            r => r?,
        };
        let Some(RouteNetlinkMessage::NewLink(l)) = replies.into_iter().next() else {
            return Ok(None);
        };
        let mut link = Link {
            index: l.header.index,
            mac: None,
            alias: None,
            mtu: 0,
            is_tun: false,
        };
        for a in l.attributes {
            match a {
                LinkAttribute::Address(b) if b.len() == 6 => {
                    link.mac = Some(b.try_into().expect("length checked"))
                }
                LinkAttribute::IfAlias(s) => link.alias = Some(s),
                LinkAttribute::Mtu(m) => link.mtu = m,
                LinkAttribute::LinkInfo(infos) => {
                    link.is_tun |= infos.contains(&LinkInfo::Kind(InfoKind::Tun))
                }
                _ => {}
            }
        }
        Ok(Some(link))
    }

    /// Sets MAC and alias and brings the link up, in one request.
    pub fn set_link(&mut self, index: u32, mac: [u8; 6], alias: &str) -> io::Result<()> {
        let mut m = LinkMessage::default();
        m.header.index = index;
        m.header.flags = LinkFlags::Up;
        m.header.change_mask = LinkFlags::Up;
        m.attributes.push(LinkAttribute::Address(mac.to_vec()));
        m.attributes.push(LinkAttribute::IfAlias(alias.into()));
        self.call(RouteNetlinkMessage::SetLink(m), 0).map(drop)
    }

    pub fn delete_link(&mut self, name: &str) -> io::Result<()> {
        let mut m = LinkMessage::default();
        m.attributes.push(LinkAttribute::IfName(name.into()));
        self.call(RouteNetlinkMessage::DelLink(m), 0).map(drop)
    }

    pub fn add_address(&mut self, index: u32, net: IpNet) -> io::Result<()> {
        let mut m = AddressMessage::default();
        m.header.family = family(net.addr);
        m.header.prefix_len = net.prefix;
        m.header.index = index;
        m.header.scope = AddressScope::Universe;
        if net.addr.is_ipv4() {
            m.attributes.push(AddressAttribute::Local(net.addr));
        } else {
            // No carrier ever comes on a placeholder: DAD would leave it tentative.
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
                AddressFamily::Inet6 => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
                _ => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
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

/// Creates a persistent tap `name` in the calling thread's netns; EBUSY if
/// a link of that name exists (IFF_TUN_EXCL).
pub fn create_persistent_tap(name: &str) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")?;
    // SAFETY: ifreq is plain data; zeroed is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(name.as_bytes()) {
        *dst = *src as libc::c_char;
    }
    ifr.ifr_ifru.ifru_flags =
        (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_TUN_EXCL) as libc::c_short;
    // SAFETY: TUNSETIFF reads and writes the ifreq we own; the fd is open.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut ifr) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: TUNSETPERSIST takes an int by value.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETPERSIST, 1 as libc::c_ulong) } < 0 {
        // Closing `tun` destroys the not yet persistent device.
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
