//! The PF's uplink: a tap device, or an AF_PACKET socket bound to an interface
//! (a veth end) inside a network namespace. Both are non-blocking fds that
//! carry one Ethernet frame per read/write; the packet socket receives
//! through a mapped TPACKET_V2 ring (`netutil::PacketOptions::rx_ring`).

use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use netutil::{Netns, PacketOptions, PacketSocket, Rtnl, Tap, TapOptions};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UplinkSpec {
    Tap(String),
    Veth { netns: String, ifname: String },
}

impl std::str::FromStr for UplinkSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(name) = s.strip_prefix("tap:") {
            if name.is_empty() || name.len() >= libc::IFNAMSIZ {
                return Err(format!("uplink {s:?}: tap name must be 1..15 bytes"));
            }
            return Ok(UplinkSpec::Tap(name.into()));
        }
        if let Some(rest) = s.strip_prefix("veth:") {
            if let Some((ns, ifname)) = rest.split_once('/') {
                if !ns.is_empty() && !ifname.is_empty() && ifname.len() < libc::IFNAMSIZ {
                    return Ok(UplinkSpec::Veth {
                        netns: ns.into(),
                        ifname: ifname.into(),
                    });
                }
            }
        }
        Err(format!("uplink {s:?}: expected tap:NAME or veth:NETNS/IF"))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UplinkError {
    #[error("uplink tap:{name}: {source}")]
    Tap {
        name: String,
        #[source]
        source: netutil::TapError,
    },
    #[error("uplink veth:{netns}/{ifname}: {source}")]
    Netns {
        netns: String,
        ifname: String,
        #[source]
        source: netutil::NetnsError,
    },
    #[error("uplink veth:{netns}/{ifname}: {source}")]
    Packet {
        netns: String,
        ifname: String,
        #[source]
        source: netutil::PacketError,
    },
    #[error("uplink {what}: set link up: {source}")]
    LinkUp {
        what: String,
        #[source]
        source: io::Error,
    },
}

/// The fd the uplink carries frames on.
#[derive(Debug)]
enum Wire {
    Tap(Tap),
    Packet(PacketSocket),
}

#[derive(Debug)]
pub struct Uplink {
    wire: Wire,
}

/// Sets the link up in the calling thread's netns.
fn set_up(what: &str, ifname: &str) -> Result<(), UplinkError> {
    Rtnl::open()
        .and_then(|mut nl| nl.set_up_by_name(ifname, true))
        .map_err(|source| UplinkError::LinkUp {
            what: what.to_string(),
            source,
        })
}

impl Uplink {
    pub fn open(spec: &UplinkSpec) -> Result<Self, UplinkError> {
        match spec {
            UplinkSpec::Tap(name) => {
                // Attaches to the tap, or makes one that lives as long as we do.
                let tap =
                    Tap::open(name, TapOptions::default()).map_err(|source| UplinkError::Tap {
                        name: name.clone(),
                        source,
                    })?;
                set_up(&format!("tap:{name}"), name)?;
                Ok(Uplink {
                    wire: Wire::Tap(tap),
                })
            }
            UplinkSpec::Veth { netns, ifname } => {
                let ns_err = |source| UplinkError::Netns {
                    netns: netns.clone(),
                    ifname: ifname.clone(),
                    source,
                };
                // The socket stays bound to the netns; the daemon's own
                // threads stay in the host namespace.
                let ns = Netns::open_named(netns).map_err(ns_err)?;
                let sock = ns
                    .run(|| {
                        // Up before the bind: a packet socket bound to a
                        // down link keeps a pending ENETDOWN that would fail
                        // the first send (a ring reader never consumes it).
                        set_up(&format!("veth:{netns}/{ifname}"), ifname)?;
                        // Frames in a mapped ring: the dataplane's idle
                        // rounds look at it without a system call.
                        let opts = PacketOptions {
                            nonblocking: true,
                            vlan_aux: true,
                            recv_timeout: None,
                            rx_ring: true,
                        };
                        let sock = PacketSocket::open(ifname, opts).map_err(|source| {
                            UplinkError::Packet {
                                netns: netns.clone(),
                                ifname: ifname.clone(),
                                source,
                            }
                        })?;
                        Ok(sock)
                    })
                    .map_err(ns_err)??;
                Ok(Uplink {
                    wire: Wire::Packet(sock),
                })
            }
        }
    }

    pub fn as_fd(&self) -> BorrowedFd<'_> {
        match &self.wire {
            Wire::Tap(t) => t.as_fd(),
            Wire::Packet(p) => p.as_fd(),
        }
    }

    /// Reads one frame; `None` when nothing is pending.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        loop {
            let r = match &self.wire {
                Wire::Packet(p) => match p.recv(buf) {
                    // Our own transmissions and the host's are not input.
                    Ok(Some(r)) if r.outgoing => continue,
                    Ok(r) => Ok(r.map(|r| r.len)),
                    Err(e) => Err(e),
                },
                Wire::Tap(t) => t.read_frame(buf).map(Some),
            };
            return match r {
                Ok(Some(n)) if n > buf.len() => continue, // larger than a packet buffer: dropped
                Ok(r) => Ok(r),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => Err(e),
            };
        }
    }

    /// Writes one frame; false if it was dropped (queue full).
    pub fn send(&self, frame: &[u8]) -> bool {
        let r = match &self.wire {
            Wire::Tap(t) => t.write_frame(frame),
            Wire::Packet(p) => p.send(frame),
        };
        r.is_ok_and(|n| n == frame.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn parses_specs() {
        assert_eq!(
            "tap:up0".parse::<UplinkSpec>(),
            Ok(UplinkSpec::Tap("up0".into()))
        );
        assert_eq!(
            "veth:ns1/eth0".parse::<UplinkSpec>(),
            Ok(UplinkSpec::Veth {
                netns: "ns1".into(),
                ifname: "eth0".into()
            })
        );
        assert!("veth:ns1".parse::<UplinkSpec>().is_err());
        assert!("tap:".parse::<UplinkSpec>().is_err());
        assert!("eth0".parse::<UplinkSpec>().is_err());
    }
}
