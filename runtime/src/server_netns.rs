//! The far side of the NIC: the runtime's own netns ("server netns") holding
//! one end of a veth pair, whose other end is the NIC daemon's uplink, a
//! small UDP echo server that answers each guest's first request, and an
//! HTTP file server containers fetch from (`fileserver`).

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use netutil::{netns, IpNet, MacAddr, NamedNetns, NetnsError, Rtnl};

/// The server end of PF k's uplink veth is `bvs{k}`, a port of
/// `SERVER_BRIDGE`; the NIC's end is `bvu{k}`. Both live in the server
/// netns, so the names need not be unique on the host.
fn server_if(k: usize) -> String {
    format!("bvs{k}")
}
fn uplink_if(k: usize) -> String {
    format!("bvu{k}")
}
/// The bridge in the server netns that holds the server address; the uplink
/// veths (one per PF: the bridge is the switch the PFs share) and the `tap`
/// variant's veths are its ports.
pub const SERVER_BRIDGE: &str = "brs0";
pub const ECHO_PORT: u16 = 7777;
/// Largest datagram echoed; guests send one small request.
const MAX_DGRAM: usize = 2048;

#[derive(Debug, thiserror::Error)]
pub enum ServerNetError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("server network: {what}: {source}")]
    Sys {
        what: String,
        #[source]
        source: io::Error,
    },
}

fn sys(what: impl Into<String>) -> impl FnOnce(io::Error) -> ServerNetError {
    let what = what.into();
    move |source| ServerNetError::Sys { what, source }
}

/// Addressing of the sandbox network.
#[derive(Debug, Clone, Copy)]
pub struct Addressing {
    pub server_ip: Ipv4Addr,
    pub prefix_len: u8,
    pub server_mac: MacAddr,
}

impl Default for Addressing {
    fn default() -> Self {
        Addressing {
            server_ip: Ipv4Addr::new(10, 77, 0, 1),
            prefix_len: 16,
            server_mac: MacAddr::new([0x02, 0x42, 0xbf, 0xff, 0x00, 0x01]),
        }
    }
}

/// The server netns, its veth pair and the echo server.
#[derive(Debug)]
pub struct ServerNet {
    netns: NamedNetns,
    /// The veth ends the NIC daemon uses as its PFs' uplinks (in the server netns).
    uplink_ifs: Vec<String>,
    addr: Addressing,
    echo: Option<EchoServer>,
    files: Option<crate::fileserver::FileServer>,
    /// rtnetlink of the server netns (the socket stays bound to it); shared
    /// with the network pool, which adds its attachments' entries.
    neigh: Arc<NeighborTable>,
}

/// Permanent neighbour entries on the server bridge, through an rtnetlink
/// socket bound to the server netns: the runtime that owns it has one, and
/// so has an attached sandbox (the shim), which opens it by path.
#[derive(Debug)]
pub struct NeighborTable {
    nl: Mutex<Rtnl>,
    bridge_index: u32,
}

impl NeighborTable {
    /// Opens the neighbour table of the server netns at `netns` (another process's).
    pub fn open(netns: &std::path::Path) -> Result<NeighborTable, ServerNetError> {
        let ns = netutil::Netns::open(netns)?;
        let (nl, bridge_index) = ns.run(|| -> Result<_, ServerNetError> {
            let mut nl = Rtnl::open().map_err(sys("open rtnetlink"))?;
            let br = nl
                .index_of(SERVER_BRIDGE)
                .map_err(sys(format!("index of {SERVER_BRIDGE}")))?;
            Ok((nl, br))
        })??;
        Ok(NeighborTable {
            nl: Mutex::new(nl),
            bridge_index,
        })
    }

    /// A permanent neighbour entry so that replies reach a guest without ARP.
    pub fn add(&self, ip: Ipv4Addr, mac: MacAddr) -> Result<(), ServerNetError> {
        self.nl
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .set_neighbour(self.bridge_index, IpAddr::V4(ip), mac)
            .map_err(sys(format!("add neighbour {ip}")))
    }

    pub fn del(&self, ip: Ipv4Addr) -> Result<(), ServerNetError> {
        match self
            .nl
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .delete_neighbour(self.bridge_index, IpAddr::V4(ip))
        {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            r => r.map_err(sys(format!("delete neighbour {ip}"))),
        }
    }
}

impl ServerNet {
    /// `tag` makes names unique per runtime (at most 11 characters);
    /// `uplinks`: one veth pair per PF of the NIC daemon (at least one).
    pub fn create(
        tag: &str,
        addr: Addressing,
        uplinks: usize,
    ) -> Result<ServerNet, ServerNetError> {
        let netns = NamedNetns::create(&crate::instance::server_netns_of(tag))?;
        let uplink_ifs: Vec<String> = (0..uplinks.max(1)).map(uplink_if).collect();
        // Both veth ends live in the server netns: the NIC opens `bvu{k}`
        // there (AF_PACKET), `bvs{k}` is a port of the server bridge.
        let (nl, bridge_index, sock, files) = netns.run(|| -> Result<_, ServerNetError> {
            let mut nl = Rtnl::open().map_err(sys("open rtnetlink"))?;
            nl.create_bridge(SERVER_BRIDGE, Some(addr.server_mac))
                .map_err(sys(format!("create bridge {SERVER_BRIDGE}")))?;
            let br = nl
                .index_of(SERVER_BRIDGE)
                .map_err(sys(format!("index of {SERVER_BRIDGE}")))?;
            let mut ports = Vec::new();
            for (k, up) in uplink_ifs.iter().enumerate() {
                let server_if = server_if(k);
                nl.create_veth(up, &server_if, None)
                    .map_err(sys(format!("create veth {up} / {server_if}")))?;
                let port = nl
                    .index_of(&server_if)
                    .map_err(sys(format!("index of {server_if}")))?;
                nl.set_master(port, br)
                    .map_err(sys(format!("put {server_if} on {SERVER_BRIDGE}")))?;
                ports.push((server_if, port));
            }
            let cidr =
                IpNet::new(IpAddr::V4(addr.server_ip), addr.prefix_len).ok_or_else(|| {
                    sys("server address")(io::Error::other(format!(
                        "prefix length {} too long",
                        addr.prefix_len
                    )))
                })?;
            nl.add_address(br, cidr)
                .map_err(sys(format!("add address {cidr} to {SERVER_BRIDGE}")))?;
            ports.push((SERVER_BRIDGE.to_string(), br));
            let names: Vec<&str> = (ports.iter().map(|(n, _)| n.as_str()))
                .chain(uplink_ifs.iter().map(String::as_str))
                .collect();
            // No IPv6 chatter (router solicitations, MLD) into the NIC's switch.
            for i in &names {
                let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{i}/disable_ipv6"), "1");
            }
            for (name, index) in &ports {
                nl.set_up(*index, true)
                    .map_err(sys(format!("set {name} up")))?;
            }
            // The server netns is the wire behind the uplinks: its frames
            // leave with finished checksums (netutil::set_tx_checksum says why).
            for name in &names {
                netutil::set_tx_checksum(name, false)
                    .map_err(sys(format!("turn off tx checksum offload of {name}")))?;
            }
            for up in &uplink_ifs {
                nl.set_up_by_name(up, true)
                    .map_err(sys(format!("set {up} up")))?;
            }
            let sock = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, ECHO_PORT))
                .map_err(sys("bind UDP echo port"))?;
            let files =
                std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, crate::fileserver::FILE_PORT))
                    .map_err(sys("bind the file server's TCP port"))?;
            Ok((nl, br, sock, files))
        })??;
        let mut net = ServerNet {
            netns,
            uplink_ifs,
            addr,
            echo: None,
            files: None,
            neigh: Arc::new(NeighborTable {
                nl: Mutex::new(nl),
                bridge_index,
            }),
        };
        net.echo = Some(EchoServer::start(sock)?);
        net.files = Some(
            crate::fileserver::FileServer::start(files).map_err(sys("start the file server"))?,
        );
        Ok(net)
    }

    pub fn netns_path(&self) -> PathBuf {
        self.netns.path().to_path_buf()
    }

    pub fn netns_name(&self) -> &str {
        self.netns.name()
    }

    pub fn netns(&self) -> &netutil::Netns {
        self.netns.netns()
    }

    /// Whether `name` is the server end of one of the uplinks (a bridge
    /// port of the runtime's own, not a sandbox's).
    pub fn is_uplink_port(&self, name: &str) -> bool {
        (0..self.uplink_ifs.len()).any(|k| server_if(k) == name)
    }

    /// PF k's uplink (`bvu{k}`), as many as `create` was given.
    pub fn uplink_ifs(&self) -> &[String] {
        &self.uplink_ifs
    }

    pub fn addressing(&self) -> Addressing {
        self.addr
    }

    /// rtnetlink of the server netns, one request at a time.
    pub fn rtnl(&self) -> MutexGuard<'_, Rtnl> {
        self.neigh.nl.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn bridge_index(&self) -> u32 {
        self.neigh.bridge_index
    }

    /// A permanent neighbour entry so that replies reach a guest without ARP.
    pub fn add_neighbor(&self, ip: Ipv4Addr, mac: MacAddr) -> Result<(), ServerNetError> {
        self.neigh.add(ip, mac)
    }

    pub fn del_neighbor(&self, ip: Ipv4Addr) -> Result<(), ServerNetError> {
        self.neigh.del(ip)
    }

    /// The neighbour table, for the network pool.
    pub fn neighbors(&self) -> Arc<NeighborTable> {
        self.neigh.clone()
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
        drop(self.files.take());
        // Deleting the netns removes the veth pair and the bridge with it.
        if let Err(e) = self.netns.delete() {
            tracing::warn!("{e}");
        }
    }
}

/// UDP echo: every datagram goes back to its sender unchanged.
#[derive(Debug)]
pub struct EchoServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    replies: Arc<Mutex<HashMap<Ipv4Addr, u64>>>,
}

impl EchoServer {
    pub fn start(sock: UdpSocket) -> Result<EchoServer, ServerNetError> {
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

/// Whether the server netns of this runtime tag is left.
pub fn leftovers(tag: &str) -> Vec<String> {
    netns::list(&crate::instance::server_netns_of(tag))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echo_and_neighbors_in_server_netns() {
        let tag = format!("t{}", std::process::id() % 1_000_000);
        let net =
            ServerNet::create(&tag, Addressing::default(), 2).expect("server net (run as root)");
        assert_eq!(net.uplink_ifs(), ["bvu0", "bvu1"]);
        // A client in a second namespace behind the uplink end: move the
        // uplink veth end there, as the NIC would forward frames from it.
        let client = NamedNetns::create(&format!("bvcli-{tag}")).unwrap();
        {
            let mut nl = net.rtnl();
            let up = nl.index_of(&net.uplink_ifs()[1]).unwrap();
            nl.set_netns(up, std::os::fd::AsFd::as_fd(client.netns()))
                .unwrap();
        }
        client
            .run(|| {
                let mut nl = Rtnl::open().unwrap();
                let up = nl.index_of(&net.uplink_ifs()[1]).unwrap();
                nl.add_address(up, "10.77.3.4/16".parse().unwrap()).unwrap();
                nl.set_up(up, true).unwrap();
            })
            .unwrap();
        let guest = Ipv4Addr::new(10, 77, 9, 9);
        net.add_neighbor(guest, MacAddr::new([0x02, 0, 0, 0, 9, 9]))
            .unwrap();
        let show = || {
            let o = std::process::Command::new("ip")
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
            .run(|| {
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
