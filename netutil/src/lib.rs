//! Host networking used by every burstvm crate (Cloud Hypervisor's
//! `net_util` plays this part there): tap devices, MAC addresses, network
//! namespaces, an rtnetlink handle, AF_PACKET wires, unix sockets with a
//! bounded connect, and the CNI data model.
//! One home per mechanism: vmm, nic, cni and runtime build on these instead
//! of opening /dev/net/tun, packing netlink messages or running `ip`
//! themselves. See docs/design.md, "netutil".

/// Serializes a type as its `Display` string and parses it back with
/// `FromStr` (MAC and CIDR forms in JSON).
#[macro_export]
#[doc(hidden)]
macro_rules! serde_as_string {
    ($t:ty) => {
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <String as serde::Deserialize>::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

pub mod cni;
mod ethtool;
mod ifreq;
mod ipnet;
mod mac;
pub mod netns;
mod packet;
mod rtnl;
mod tap;
pub mod unixsock;

pub use ethtool::set_tx_checksum;
pub use ipnet::{IpNet, IpNetError};
pub use mac::{MacAddr, MacParseError};
pub use netns::{NamedNetns, Netns, NetnsError};
pub use packet::{PacketError, PacketOptions, PacketSocket, Received};
pub use rtnl::{BadReply, Link, RouteEntry, RouteSpec, Rtnl};
pub use tap::{Tap, TapError, TapOptions};

/// Interface names are 1..IFNAMSIZ-1 bytes without `/` or NUL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name:?} is not a valid interface name (1..15 bytes, no '/')")]
pub struct NameError {
    pub name: String,
}

pub use ifreq::check_name;

/// The kind of a link, as rtnetlink names it.
pub use netlink_packet_route::link::InfoKind as LinkKind;
