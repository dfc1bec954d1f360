//! An rtnetlink handle on netlink-packet-route: one synchronous request at a
//! time on a NETLINK_ROUTE socket of the netns the opening thread is in
//! (open it inside [`crate::Netns::run`] to work in another namespace).
//!
//! Links (lookup, create tap/veth/bridge, up/down, MTU, master, alias, MAC,
//! move to a netns, delete) are here; addresses and routes in `addr`,
//! neighbours in `neigh`, tc ingress redirects in `tc`.

mod addr;
mod neigh;
mod tc;

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL,
    NLM_F_REQUEST,
};
use netlink_packet_route::link::{
    InfoBridge, InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

pub use addr::{RouteEntry, RouteSpec};

use crate::MacAddr;

#[derive(Debug)]
pub struct Rtnl {
    sock: Socket,
    seq: u32,
}

/// A link as rtnetlink reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    pub mac: Option<MacAddr>,
    pub alias: Option<String>,
    pub mtu: u32,
    pub up: bool,
    /// The bridge (or other master) it is a port of.
    pub master: Option<u32>,
    pub kind: Option<InfoKind>,
}

impl Link {
    pub fn is_tun(&self) -> bool {
        self.kind == Some(InfoKind::Tun)
    }
}

fn link_msg(index: u32) -> LinkMessage {
    let mut m = LinkMessage::default();
    m.header.index = index;
    m
}

/// A reply the kernel sent that does not decode; carried inside the
/// io::Error (InvalidData) that `Rtnl` returns, so callers can downcast it.
#[derive(Debug, thiserror::Error)]
pub enum BadReply {
    #[error("rtnetlink reply: {0}")]
    Decode(#[source] netlink_packet_core::DecodeError),
    #[error("rtnetlink reply: zero-length message")]
    ZeroLength,
}

fn bad_reply(e: BadReply) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
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
                    .map_err(|e| bad_reply(BadReply::Decode(e)))?;
                let len = msg.header.length as usize;
                if len == 0 {
                    return Err(bad_reply(BadReply::ZeroLength));
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

    fn get_link(&mut self, m: LinkMessage) -> io::Result<Option<Link>> {
        let replies = match self.call(RouteNetlinkMessage::GetLink(m), 0) {
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return Ok(None),
            r => r?,
        };
        Ok(replies.into_iter().find_map(|r| match r {
            RouteNetlinkMessage::NewLink(l) => Some(parse_link(l)),
            _ => None,
        }))
    }

    /// The link called `name`, or None.
    pub fn link_by_name(&mut self, name: &str) -> io::Result<Option<Link>> {
        let mut m = LinkMessage::default();
        m.attributes.push(LinkAttribute::IfName(name.into()));
        self.get_link(m)
    }

    /// The link with index `index`, or None.
    pub fn link_by_index(&mut self, index: u32) -> io::Result<Option<Link>> {
        self.get_link(link_msg(index))
    }

    /// The index of `name`; `NotFound` if there is no such link.
    pub fn index_of(&mut self, name: &str) -> io::Result<u32> {
        self.link_by_name(name)?
            .map(|l| l.index)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no link named {name}")))
    }

    fn new_link(&mut self, m: LinkMessage) -> io::Result<()> {
        self.call(RouteNetlinkMessage::NewLink(m), NLM_F_CREATE | NLM_F_EXCL)
            .map(drop)
    }

    fn set(&mut self, m: LinkMessage) -> io::Result<()> {
        self.call(RouteNetlinkMessage::SetLink(m), 0).map(drop)
    }

    /// A veth pair `name` ↔ `peer`; the peer goes straight into the netns
    /// `peer_netns` when one is given.
    pub fn create_veth(
        &mut self,
        name: &str,
        peer: &str,
        peer_netns: Option<BorrowedFd<'_>>,
    ) -> io::Result<()> {
        let mut p = LinkMessage::default();
        p.attributes.push(LinkAttribute::IfName(peer.into()));
        if let Some(fd) = peer_netns {
            p.attributes.push(LinkAttribute::NetNsFd(fd.as_raw_fd()));
        }
        let mut m = LinkMessage::default();
        m.attributes.push(LinkAttribute::IfName(name.into()));
        m.attributes.push(LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Veth),
            LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(p))),
        ]));
        self.new_link(m)
    }

    /// A bridge with forward delay 0 (ports forward at once), with `mac` if given.
    pub fn create_bridge(&mut self, name: &str, mac: Option<MacAddr>) -> io::Result<()> {
        let mut m = LinkMessage::default();
        m.attributes.push(LinkAttribute::IfName(name.into()));
        if let Some(mac) = mac {
            m.attributes
                .push(LinkAttribute::Address(mac.bytes().to_vec()));
        }
        m.attributes.push(LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Bridge),
            LinkInfo::Data(InfoData::Bridge(vec![InfoBridge::ForwardDelay(0)])),
        ]));
        self.new_link(m)
    }

    /// A persistent tap (see [`crate::Tap::create_persistent`]), returned by index.
    pub fn create_tap(&mut self, name: &str) -> io::Result<u32> {
        crate::Tap::create_persistent(name).map_err(io::Error::other)?;
        self.index_of(name)
    }

    pub fn set_up(&mut self, index: u32, up: bool) -> io::Result<()> {
        let mut m = link_msg(index);
        if up {
            m.header.flags = LinkFlags::Up;
        }
        m.header.change_mask = LinkFlags::Up;
        self.set(m)
    }

    pub fn set_up_by_name(&mut self, name: &str, up: bool) -> io::Result<()> {
        let index = self.index_of(name)?;
        self.set_up(index, up)
    }

    pub fn set_mtu(&mut self, index: u32, mtu: u32) -> io::Result<()> {
        let mut m = link_msg(index);
        m.attributes.push(LinkAttribute::Mtu(mtu));
        self.set(m)
    }

    /// Makes `index` a port of the bridge `master`.
    pub fn set_master(&mut self, index: u32, master: u32) -> io::Result<()> {
        let mut m = link_msg(index);
        m.attributes.push(LinkAttribute::Controller(master));
        self.set(m)
    }

    pub fn set_alias(&mut self, index: u32, alias: &str) -> io::Result<()> {
        let mut m = link_msg(index);
        m.attributes.push(LinkAttribute::IfAlias(alias.into()));
        self.set(m)
    }

    pub fn set_mac(&mut self, index: u32, mac: MacAddr) -> io::Result<()> {
        let mut m = link_msg(index);
        m.attributes
            .push(LinkAttribute::Address(mac.bytes().to_vec()));
        self.set(m)
    }

    /// Sets MAC and alias and brings the link up, in one request.
    pub fn configure(&mut self, index: u32, mac: MacAddr, alias: &str) -> io::Result<()> {
        let mut m = link_msg(index);
        m.header.flags = LinkFlags::Up;
        m.header.change_mask = LinkFlags::Up;
        m.attributes
            .push(LinkAttribute::Address(mac.bytes().to_vec()));
        m.attributes.push(LinkAttribute::IfAlias(alias.into()));
        self.set(m)
    }

    /// Moves the link into the namespace `netns` (it leaves this one).
    pub fn set_netns(&mut self, index: u32, netns: BorrowedFd<'_>) -> io::Result<()> {
        let mut m = link_msg(index);
        m.attributes.push(LinkAttribute::NetNsFd(netns.as_raw_fd()));
        self.set(m)
    }

    pub fn delete_link(&mut self, index: u32) -> io::Result<()> {
        self.call(RouteNetlinkMessage::DelLink(link_msg(index)), 0)
            .map(drop)
    }

    pub fn delete_link_by_name(&mut self, name: &str) -> io::Result<()> {
        let mut m = LinkMessage::default();
        m.attributes.push(LinkAttribute::IfName(name.into()));
        self.call(RouteNetlinkMessage::DelLink(m), 0).map(drop)
    }

    /// Every link of the namespace.
    pub fn links(&mut self) -> io::Result<Vec<Link>> {
        let replies = self.call(
            RouteNetlinkMessage::GetLink(LinkMessage::default()),
            netlink_packet_core::NLM_F_DUMP,
        )?;
        Ok(replies
            .into_iter()
            .filter_map(|r| match r {
                RouteNetlinkMessage::NewLink(l) => Some(parse_link(l)),
                _ => None,
            })
            .collect())
    }
}

fn parse_link(l: LinkMessage) -> Link {
    let mut link = Link {
        index: l.header.index,
        name: String::new(),
        mac: None,
        alias: None,
        mtu: 0,
        up: l.header.flags.contains(LinkFlags::Up),
        master: None,
        kind: None,
    };
    for a in l.attributes {
        match a {
            LinkAttribute::IfName(n) => link.name = n,
            LinkAttribute::Address(b) => link.mac = MacAddr::from_slice(&b),
            LinkAttribute::IfAlias(s) => link.alias = Some(s),
            LinkAttribute::Mtu(m) => link.mtu = m,
            LinkAttribute::Controller(c) => link.master = Some(c),
            LinkAttribute::LinkInfo(infos) => {
                link.kind = infos.into_iter().find_map(|i| match i {
                    LinkInfo::Kind(k) => Some(k),
                    _ => None,
                })
            }
            _ => {}
        }
    }
    link
}
