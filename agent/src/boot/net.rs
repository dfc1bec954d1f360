//! The guest's network through rtnetlink (no `ip`): `lo` up; with an
//! address, the first ethernet link (`eth0` if there is one) up with it and a
//! default route via the gateway. A small rtnetlink client on
//! netlink-packet-route (netutil's is the host's and brings host-only
//! dependencies).

use std::io;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL,
    NLM_F_REQUEST,
};
use netlink_packet_route::address::{AddressAttribute, AddressMessage, AddressScope};
use netlink_packet_route::link::{LinkAttribute, LinkFlags, LinkLayerType, LinkMessage};
use netlink_packet_route::route::{
    RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

use super::{BootConfig, BootError};

/// A link as rtnetlink lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    pub ether: bool,
    pub loopback: bool,
    pub up: bool,
}

/// One synchronous request at a time on a NETLINK_ROUTE socket of the
/// calling thread's network namespace.
pub struct Rtnl {
    sock: Socket,
    seq: u32,
}

fn bad_reply(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("rtnetlink reply: {e}"))
}

fn family(a: IpAddr) -> AddressFamily {
    if a.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    }
}

impl Rtnl {
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
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
        header.sequence_number = self.seq;
        let mut req = NetlinkMessage::new(header, NetlinkPayload::from(msg));
        req.finalize();
        let mut buf = vec![0; req.header.length as usize];
        req.serialize(&mut buf);
        self.sock.send(&buf, 0)?;
        let mut replies = Vec::new();
        loop {
            let (data, _) = self.sock.recv_from_full()?;
            let mut off = 0;
            while off < data.len() {
                let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&data[off..])
                    .map_err(bad_reply)?;
                let len = msg.header.length as usize;
                if len == 0 {
                    return Err(bad_reply("zero-length message"));
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

    pub fn links(&mut self) -> io::Result<Vec<Link>> {
        let replies = self.call(
            RouteNetlinkMessage::GetLink(LinkMessage::default()),
            NLM_F_DUMP,
        )?;
        Ok(replies
            .into_iter()
            .filter_map(|r| match r {
                RouteNetlinkMessage::NewLink(l) => Some(Link {
                    index: l.header.index,
                    name: l
                        .attributes
                        .iter()
                        .find_map(|a| match a {
                            LinkAttribute::IfName(n) => Some(n.clone()),
                            _ => None,
                        })
                        .unwrap_or_default(),
                    ether: l.header.link_layer_type == LinkLayerType::Ether,
                    loopback: l.header.flags.contains(LinkFlags::Loopback),
                    up: l.header.flags.contains(LinkFlags::Up),
                }),
                _ => None,
            })
            .collect())
    }

    pub fn set_up(&mut self, index: u32) -> io::Result<()> {
        let mut m = LinkMessage::default();
        m.header.index = index;
        m.header.flags = LinkFlags::Up;
        m.header.change_mask = LinkFlags::Up;
        self.call(RouteNetlinkMessage::SetLink(m), 0).map(drop)
    }

    pub fn add_address(&mut self, index: u32, addr: IpAddr, prefix: u8) -> io::Result<()> {
        let mut m = AddressMessage::default();
        m.header.family = family(addr);
        m.header.prefix_len = prefix;
        m.header.index = index;
        m.header.scope = AddressScope::Universe;
        if addr.is_ipv4() {
            m.attributes.push(AddressAttribute::Local(addr));
        }
        m.attributes.push(AddressAttribute::Address(addr));
        self.call(
            RouteNetlinkMessage::NewAddress(m),
            NLM_F_CREATE | NLM_F_EXCL,
        )
        .map(drop)
    }

    /// The addresses (with prefixes) of link `index`.
    pub fn addresses(&mut self, index: u32) -> io::Result<Vec<(IpAddr, u8)>> {
        let replies = self.call(
            RouteNetlinkMessage::GetAddress(AddressMessage::default()),
            NLM_F_DUMP,
        )?;
        Ok(replies
            .into_iter()
            .filter_map(|r| match r {
                RouteNetlinkMessage::NewAddress(a) if a.header.index == index => {
                    let ip = a.attributes.iter().find_map(|x| match x {
                        AddressAttribute::Address(ip) => Some(*ip),
                        _ => None,
                    })?;
                    Some((ip, a.header.prefix_len))
                }
                _ => None,
            })
            .collect())
    }

    /// The default route via `gw` out of link `index`.
    pub fn add_default_route(&mut self, index: u32, gw: IpAddr) -> io::Result<()> {
        let mut m = RouteMessage::default();
        m.header.address_family = family(gw);
        m.header.destination_prefix_length = 0;
        m.header.table = RouteHeader::RT_TABLE_MAIN;
        m.header.protocol = RouteProtocol::Boot;
        m.header.kind = RouteType::Unicast;
        m.header.scope = RouteScope::Universe;
        m.attributes.push(RouteAttribute::Gateway(gw.into()));
        m.attributes.push(RouteAttribute::Oif(index));
        self.call(RouteNetlinkMessage::NewRoute(m), NLM_F_CREATE | NLM_F_EXCL)
            .map(drop)
    }
}

/// The link to configure: `eth0`, else the first ethernet link that is not
/// the loopback.
pub fn pick_link(links: &[Link]) -> Option<&Link> {
    links
        .iter()
        .find(|l| l.name == "eth0")
        .or_else(|| links.iter().find(|l| l.ether && !l.loopback))
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
    if let Some(lo) = links.iter().find(|l| l.loopback) {
        nl.set_up(lo.index).map_err(e("set up", &lo.name))?;
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
    nl.add_address(link.index, addr, prefix)
        .map_err(e("add address", &link.name))?;
    nl.set_up(link.index).map_err(e("set up", &link.name))?;
    if let Some(gw) = cfg.gw {
        nl.add_default_route(link.index, gw)
            .map_err(e("add the default route", &link.name))?;
    }
    Ok(Some(link.name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(index: u32, name: &str, ether: bool, loopback: bool) -> Link {
        Link {
            index,
            name: name.into(),
            ether,
            loopback,
            up: false,
        }
    }

    #[test]
    fn picks_eth0_else_first_ethernet() {
        let ls = vec![
            link(1, "lo", false, true),
            link(2, "ens3", true, false),
            link(3, "eth0", true, false),
        ];
        assert_eq!(pick_link(&ls).unwrap().index, 3);
        assert_eq!(pick_link(&ls[..2]).unwrap().index, 2);
        assert!(pick_link(&ls[..1]).is_none());
    }

    /// In a network namespace of its own (a thread's): lo comes up and takes
    /// an address; a default route through it is accepted.
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
            let lo = nl
                .links()
                .unwrap()
                .into_iter()
                .find(|l| l.loopback)
                .unwrap();
            assert!(lo.up);
            // No ethernet link here: the configured address fails naming it.
            let cfg = BootConfig {
                net: Some(("192.0.2.5".parse().unwrap(), 24)),
                ..BootConfig::default()
            };
            let err = configure(&cfg, Duration::from_millis(50)).unwrap_err();
            assert!(err.to_string().contains("ethernet"), "{err}");
            // The calls themselves, on lo.
            nl.add_address(lo.index, "192.0.2.5".parse().unwrap(), 24)
                .unwrap();
            assert!(nl
                .addresses(lo.index)
                .unwrap()
                .contains(&("192.0.2.5".parse().unwrap(), 24)));
            nl.add_default_route(lo.index, "192.0.2.1".parse().unwrap())
                .unwrap();
            let routes = std::fs::read_to_string("/proc/thread-self/net/route").unwrap();
            assert!(
                routes
                    .lines()
                    .any(|l| l.starts_with("lo\t00000000\t010200C0")),
                "{routes}"
            );
        });
        t.join().unwrap();
    }
}
