//! The far side of the NIC: the runtime's own netns ("server netns") holding
//! one end of a veth pair, whose other end is the NIC daemon's uplink, and a
//! small UDP echo server that answers each guest's first request.

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::netns::{self, Netns, NetnsError};

/// The server end of the uplink veth, inside the server netns.
pub const SERVER_IF: &str = "bvs0";
/// The bridge in the server netns that holds the server address; the uplink
/// veth and the `tap` variant's veths are its ports.
pub const SERVER_BRIDGE: &str = "brs0";
pub const ECHO_PORT: u16 = 7777;
/// Largest datagram echoed; guests send one small request.
const MAX_DGRAM: usize = 2048;

#[derive(Debug, thiserror::Error)]
pub enum UplinkError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("server network: `ip {args}` failed: {output}")]
    Ip { args: String, output: String },
    #[error("server network: {what}: {source}")]
    Sys {
        what: String,
        #[source]
        source: io::Error,
    },
}

fn sys(what: impl Into<String>) -> impl FnOnce(io::Error) -> UplinkError {
    let what = what.into();
    move |source| UplinkError::Sys { what, source }
}

/// Runs `ip ARGS`; used for the one-time setup of the server network only.
pub fn ip(args: &[&str]) -> Result<(), UplinkError> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(sys("run ip (install iproute2)"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(UplinkError::Ip {
            args: args.join(" "),
            output: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Addressing of the sandbox network.
#[derive(Debug, Clone, Copy)]
pub struct Addressing {
    pub server_ip: Ipv4Addr,
    pub prefix_len: u8,
    pub server_mac: [u8; 6],
}

impl Default for Addressing {
    fn default() -> Self {
        Addressing {
            server_ip: Ipv4Addr::new(10, 77, 0, 1),
            prefix_len: 16,
            server_mac: [0x02, 0x42, 0xbf, 0xff, 0x00, 0x01],
        }
    }
}

pub fn format_mac(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let v: Vec<u8> = s
        .split(':')
        .map(|p| u8::from_str_radix(p, 16))
        .collect::<Result<_, _>>()
        .ok()?;
    v.try_into().ok()
}

/// The server netns, its veth pair and the echo server.
pub struct ServerNet {
    netns: Netns,
    /// The veth end the NIC daemon uses as its uplink (in the server netns).
    uplink_if: String,
    addr: Addressing,
    echo: Option<EchoServer>,
    neigh: Mutex<Neigh>,
}

impl ServerNet {
    /// `tag` makes names unique per runtime (at most 11 characters).
    pub fn create(tag: &str, addr: Addressing) -> Result<ServerNet, UplinkError> {
        let netns = Netns::create(&format!("bvsrv-{tag}"))?;
        let uplink_if = format!("bvu{tag}");
        let ns = netns.name().to_string();
        let mac = format_mac(&addr.server_mac);
        let mut net = ServerNet {
            netns,
            uplink_if: uplink_if.clone(),
            addr,
            echo: None,
            neigh: Mutex::new(Neigh {
                fd: None,
                ifindex: 0,
                seq: 0,
            }),
        };
        // Both veth ends live in the server netns: the NIC opens `uplink_if`
        // there (AF_PACKET), `SERVER_IF` is a port of the server bridge.
        ip(&[
            "-n", &ns, "link", "add", &uplink_if, "type", "veth", "peer", "name", SERVER_IF,
        ])?;
        ip(&[
            "-n",
            &ns,
            "link",
            "add",
            SERVER_BRIDGE,
            "address",
            &mac,
            "type",
            "bridge",
            "forward_delay",
            "0",
        ])?;
        ip(&["-n", &ns, "link", "set", SERVER_IF, "master", SERVER_BRIDGE])?;
        let cidr = format!("{}/{}", addr.server_ip, addr.prefix_len);
        ip(&["-n", &ns, "addr", "add", &cidr, "dev", SERVER_BRIDGE])?;
        ip(&["-n", &ns, "link", "set", SERVER_IF, "up"])?;
        ip(&["-n", &ns, "link", "set", SERVER_BRIDGE, "up"])?;
        ip(&["-n", &ns, "link", "set", &uplink_if, "up"])?;
        let up = uplink_if.clone();
        let (sock, fd, ifindex) = net.netns.run_in(move || -> Result<_, UplinkError> {
            let uplink_if = up;
            // No IPv6 chatter (router solicitations, MLD) into the NIC's switch.
            for i in [uplink_if.as_str(), SERVER_IF, SERVER_BRIDGE] {
                let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{i}/disable_ipv6"), "1");
            }
            let sock = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, ECHO_PORT))
                .map_err(sys("bind UDP echo port"))?;
            let fd = netlink_socket().map_err(sys("open netlink socket"))?;
            let ifindex = nix::net::if_::if_nametoindex(SERVER_BRIDGE)
                .map_err(|e| sys(format!("index of {SERVER_BRIDGE}"))(e.into()))?;
            Ok((sock, fd, ifindex))
        })??;
        *net.neigh.lock().unwrap() = Neigh {
            fd: Some(fd),
            ifindex,
            seq: 0,
        };
        net.echo = Some(EchoServer::start(sock)?);
        Ok(net)
    }

    pub fn netns_path(&self) -> PathBuf {
        self.netns.path().to_path_buf()
    }

    pub fn netns_name(&self) -> &str {
        self.netns.name()
    }

    pub fn uplink_if(&self) -> &str {
        &self.uplink_if
    }

    pub fn addressing(&self) -> Addressing {
        self.addr
    }

    /// A permanent neighbour entry so that replies reach a guest without ARP.
    pub fn add_neighbor(&self, ip: Ipv4Addr, mac: [u8; 6]) -> Result<(), UplinkError> {
        self.neigh
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .set(true, ip, mac)
            .map_err(sys(format!("add neighbour {ip}")))
    }

    pub fn del_neighbor(&self, ip: Ipv4Addr) -> Result<(), UplinkError> {
        match self
            .neigh
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .set(false, ip, [0; 6])
        {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            r => r.map_err(sys(format!("delete neighbour {ip}"))),
        }
    }

    /// Requests the echo server answered, per source address.
    pub fn replies(&self) -> HashMap<Ipv4Addr, u64> {
        self.echo.as_ref().map(|e| e.replies()).unwrap_or_default()
    }
}

impl Drop for ServerNet {
    fn drop(&mut self) {
        if let Some(e) = self.echo.take() {
            e.stop();
        }
        // Deleting the netns removes the veth pair and the bridge with it.
        if let Err(e) = self.netns.delete() {
            tracing::warn!("{e}");
        }
    }
}

/// UDP echo: every datagram goes back to its sender unchanged.
pub struct EchoServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    replies: Arc<Mutex<HashMap<Ipv4Addr, u64>>>,
}

impl EchoServer {
    pub fn start(sock: UdpSocket) -> Result<EchoServer, UplinkError> {
        // The loop checks `stop` at least every 100 ms.
        sock.set_read_timeout(Some(Duration::from_millis(100)))
            .map_err(sys("set echo socket timeout"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let replies = Arc::new(Mutex::new(HashMap::new()));
        let (s, r) = (stop.clone(), replies.clone());
        let thread = std::thread::Builder::new()
            .name("echo-server".into())
            .spawn(move || {
                let mut buf = [0u8; MAX_DGRAM];
                while !s.load(Ordering::Relaxed) {
                    match sock.recv_from(&mut buf) {
                        Ok((n, from)) => {
                            // Counted before the reply leaves: a guest that has
                            // its reply is always already counted.
                            if let SocketAddr::V4(a) = from {
                                *r.lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .entry(*a.ip())
                                    .or_insert(0) += 1;
                            }
                            if let Err(e) = sock.send_to(&buf[..n], from) {
                                tracing::warn!("echo server: reply to {from}: {e}");
                            }
                        }
                        Err(e)
                            if matches!(
                                e.kind(),
                                io::ErrorKind::WouldBlock
                                    | io::ErrorKind::TimedOut
                                    | io::ErrorKind::Interrupted
                            ) => {}
                        Err(e) => {
                            tracing::warn!("echo server: {e}");
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                }
            })
            .map_err(sys("spawn echo server"))?;
        Ok(EchoServer {
            stop,
            thread: Some(thread),
            replies,
        })
    }

    pub fn replies(&self) -> HashMap<Ipv4Addr, u64> {
        self.replies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn netlink_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the fd is owned by the returned OwnedFd.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just created and is not owned elsewhere.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// rtnetlink neighbour table updates on one interface of the server netns.
struct Neigh {
    fd: Option<OwnedFd>,
    ifindex: u32,
    seq: u32,
}

impl Neigh {
    fn set(&mut self, add: bool, ip: Ipv4Addr, mac: [u8; 6]) -> io::Result<()> {
        let fd = self
            .fd
            .as_ref()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotConnected))?;
        self.seq = self.seq.wrapping_add(1);
        const NUD_PERMANENT: u16 = 0x80;
        let mut flags = (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16;
        if add {
            flags |= (libc::NLM_F_CREATE | libc::NLM_F_REPLACE) as u16;
        }
        let mut m = Vec::with_capacity(64);
        m.extend_from_slice(&0u32.to_ne_bytes()); // length, patched below
        m.extend_from_slice(
            &(if add {
                libc::RTM_NEWNEIGH
            } else {
                libc::RTM_DELNEIGH
            })
            .to_ne_bytes(),
        );
        m.extend_from_slice(&flags.to_ne_bytes());
        m.extend_from_slice(&self.seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        // struct ndmsg
        m.push(libc::AF_INET as u8);
        m.extend_from_slice(&[0, 0, 0]);
        m.extend_from_slice(&(self.ifindex as i32).to_ne_bytes());
        m.extend_from_slice(&NUD_PERMANENT.to_ne_bytes());
        m.extend_from_slice(&[0, 0]);
        // NDA_DST
        m.extend_from_slice(&8u16.to_ne_bytes());
        m.extend_from_slice(&1u16.to_ne_bytes());
        m.extend_from_slice(&ip.octets());
        if add {
            // NDA_LLADDR, padded to 4 bytes
            m.extend_from_slice(&10u16.to_ne_bytes());
            m.extend_from_slice(&2u16.to_ne_bytes());
            m.extend_from_slice(&mac);
            m.extend_from_slice(&[0, 0]);
        }
        let len = m.len() as u32;
        m[..4].copy_from_slice(&len.to_ne_bytes());
        // SAFETY: send/recv on our socket with buffers we own.
        let r = unsafe { libc::send(fd.as_raw_fd(), m.as_ptr().cast(), m.len(), 0) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = [0u8; 1024];
        loop {
            let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            if (n as usize) < 20 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "short netlink reply",
                ));
            }
            let ty = u16::from_ne_bytes([buf[4], buf[5]]);
            let seq = u32::from_ne_bytes([buf[8], buf[9], buf[10], buf[11]]);
            if ty == libc::NLMSG_ERROR as u16 && seq == self.seq {
                let err = i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]);
                return if err == 0 {
                    Ok(())
                } else {
                    Err(io::Error::from_raw_os_error(-err))
                };
            }
        }
    }
}

/// Whether the server netns of this runtime tag is left.
pub fn leftovers(tag: &str) -> Vec<String> {
    netns::list(&format!("bvsrv-{tag}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echo_and_neighbors_in_server_netns() {
        let tag = format!("t{}", std::process::id() % 1_000_000);
        let net = ServerNet::create(&tag, Addressing::default()).expect("server net (run as root)");
        // A client in a second namespace behind the uplink end: move the
        // uplink veth end there, as the NIC would forward frames from it.
        let client = Netns::create(&format!("bvcli-{tag}")).unwrap();
        ip(&[
            "-n",
            net.netns_name(),
            "link",
            "set",
            net.uplink_if(),
            "netns",
            client.name(),
        ])
        .unwrap();
        let cns = client.name().to_string();
        ip(&[
            "-n",
            &cns,
            "addr",
            "add",
            "10.77.3.4/16",
            "dev",
            net.uplink_if(),
        ])
        .unwrap();
        ip(&["-n", &cns, "link", "set", net.uplink_if(), "up"]).unwrap();
        let guest = Ipv4Addr::new(10, 77, 9, 9);
        net.add_neighbor(guest, [0x02, 0, 0, 0, 9, 9]).unwrap();
        let show = || {
            let o = Command::new("ip")
                .args(["-n", net.netns_name(), "neigh", "show", "10.77.9.9"])
                .output()
                .unwrap();
            String::from_utf8_lossy(&o.stdout).to_string()
        };
        let s = show();
        assert!(
            s.contains("02:00:00:00:09:09") && s.contains("PERMANENT"),
            "{s}"
        );
        net.del_neighbor(guest).unwrap();
        assert!(show().trim().is_empty());
        net.del_neighbor(guest).unwrap(); // idempotent
        let reply = client
            .run_in(|| {
                let s = UdpSocket::bind("0.0.0.0:0").unwrap();
                s.set_read_timeout(Some(Duration::from_millis(200)))
                    .unwrap();
                for _ in 0..10 {
                    s.send_to(b"hello", "10.77.0.1:7777").unwrap();
                    let mut b = [0u8; 64];
                    if let Ok((n, _)) = s.recv_from(&mut b) {
                        return Some(b[..n].to_vec());
                    }
                }
                None
            })
            .unwrap();
        assert_eq!(reply.as_deref(), Some(&b"hello"[..]));
        assert!(net.replies()[&Ipv4Addr::new(10, 77, 3, 4)] >= 1);
        drop(net);
        drop(client);
        assert!(leftovers(&tag).is_empty(), "{:?}", leftovers(&tag));
    }
}
