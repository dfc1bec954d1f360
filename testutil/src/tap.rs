//! The virtio tests' network side (cli's virtio_*, vmm_* and nic_vm tests): a tap made
//! by the test, the test's end of the wire (AF_PACKET on that tap), and the server side
//! of the agent's request/reply exchange.
//!
//! The test plays the server with an AF_PACKET socket, so the host's IP
//! stack is not involved and no address is configured anywhere.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const GUEST_MAC: [u8; 6] = [0x02, 0, 0, 0x77, 0, 2];
pub const SERVER_MAC: [u8; 6] = [0x02, 0, 0, 0x77, 0, 1];
pub const GUEST_IP: [u8; 4] = [10, 77, 0, 2];
pub const SERVER_IP: [u8; 4] = [10, 77, 0, 1];
pub const SERVER_PORT: u16 = 7777;

/// VMM memory flags of the `vanilla` variant: both regions DMA-mapped, fresh memory.
pub const VANILLA_DMA: &[&str] = &[
    "--dma-ram",
    "true",
    "--dma-image",
    "true",
    "--memory-policy",
    "vanilla",
];
/// VMM memory flags of the `fastiov` variant: RAM lazily zeroed, image region not mapped.
pub const LAZY_DMA: &[&str] = &[
    "--dma-ram",
    "true",
    "--dma-image",
    "false",
    "--memory-policy",
    "lazy",
];

pub fn mac_str(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

pub fn ip(args: &[&str]) {
    let st = Command::new("ip").args(args).status().expect("run ip");
    assert!(st.success(), "ip {args:?} failed");
}

/// A persistent tap made by the test, deleted when dropped.
#[derive(Debug)]
pub struct TestTap(pub String);

impl TestTap {
    pub fn new(tag: &str) -> TestTap {
        let name = format!("bv{tag}{}", std::process::id() % 100_000);
        assert!(name.len() < 16);
        let _ = Command::new("ip")
            .args(["link", "del", &name])
            .stderr(Stdio::null())
            .status();
        ip(&["tuntap", "add", "dev", &name, "mode", "tap"]);
        let tap = TestTap(name);
        // No IPv6 chatter from the host on the guest's wire.
        let _ = std::fs::write(
            format!("/proc/sys/net/ipv6/conf/{}/disable_ipv6", tap.0),
            "1",
        );
        ip(&["link", "set", &tap.0, "up"]);
        tap
    }
}

impl Drop for TestTap {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.0]).status();
    }
}

/// The test's end of the wire: an AF_PACKET socket bound to the tap.
#[derive(Debug)]
pub struct Wire(OwnedFd);

impl Wire {
    pub fn open(ifname: &str) -> Wire {
        Wire::open_with_timeout(ifname, Duration::from_millis(200))
    }

    /// `open` whose receives give up after `timeout`.
    pub fn open_with_timeout(ifname: &str, timeout: Duration) -> Wire {
        let proto = (libc::ETH_P_ALL as u16).to_be() as i32;
        // SAFETY: plain socket(2) call; the fd is owned right away.
        let fd =
            unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) };
        assert!(
            fd >= 0,
            "AF_PACKET socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: fd is a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let cname = CString::new(ifname).unwrap();
        // SAFETY: cname is a valid C string.
        let index = unsafe { libc::if_nametoindex(cname.as_ptr()) };
        assert!(index > 0, "if_nametoindex {ifname}");
        // SAFETY: sockaddr_ll is plain data; zero is a valid start.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto as u16;
        sll.sll_ifindex = index as i32;
        // SAFETY: sll is a valid sockaddr_ll of the size passed.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &sll as *const _ as *const libc::sockaddr,
                size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(
            r,
            0,
            "bind AF_PACKET to {ifname}: {}",
            std::io::Error::last_os_error()
        );
        let tv = libc::timeval {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_usec: timeout.subsec_micros() as libc::suseconds_t,
        };
        // SAFETY: tv is a valid timeval of the size passed.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const _ as *const libc::c_void,
                size_of::<libc::timeval>() as u32,
            )
        };
        assert_eq!(r, 0, "SO_RCVTIMEO: {}", std::io::Error::last_os_error());
        Wire(fd)
    }

    pub fn send(&self, frame: &[u8]) {
        // SAFETY: frame is a valid buffer of the length passed.
        let n = unsafe {
            libc::send(
                self.0.as_raw_fd(),
                frame.as_ptr() as *const libc::c_void,
                frame.len(),
                0,
            )
        };
        assert_eq!(
            n,
            frame.len() as isize,
            "send: {}",
            std::io::Error::last_os_error()
        );
    }

    /// The next frame the guest sent that `want` accepts, waiting at most
    /// `secs`. `resend` goes out every half second meanwhile, as a real peer
    /// retries: right after the VMM attaches, the kernel may still drop
    /// frames sent to the tap until it has processed the carrier change.
    pub fn expect(
        &self,
        secs: u64,
        child: &mut Child,
        what: &str,
        resend: Option<&[u8]>,
        want: impl Fn(&[u8]) -> bool,
    ) -> Vec<u8> {
        let end = Instant::now() + Duration::from_secs(secs);
        let mut next_send = Instant::now();
        let mut buf = [0u8; 2048];
        while Instant::now() < end {
            if let Some(st) = child.try_wait().unwrap() {
                panic!("VMM exited ({st}) while the test waited for {what}");
            }
            if let Some(frame) = resend.filter(|_| Instant::now() >= next_send) {
                self.send(frame);
                next_send = Instant::now() + Duration::from_millis(500);
            }
            // SAFETY: buf is a valid writable buffer of the length passed.
            let n = unsafe {
                libc::recv(
                    self.0.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    0,
                )
            };
            if n > 0 && want(&buf[..n as usize]) {
                return buf[..n as usize].to_vec();
            }
        }
        let _ = child.kill();
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        panic!("no {what} from the guest within {secs} s; VMM stderr:\n{err}");
    }
}

impl AsRawFd for Wire {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

pub use crate::stop_child;

pub fn is_udp_request(f: &[u8]) -> bool {
    f.len() >= 42 && f[12..14] == [8, 0] && f[23] == 17 && f[36..38] == SERVER_PORT.to_be_bytes()
}

pub fn is_arp_reply(f: &[u8]) -> bool {
    f.len() >= 42 && f[12..14] == [8, 6] && f[20..22] == [0, 2]
}

pub fn ip_checksum(h: &[u8]) -> u16 {
    let mut s: u32 = h
        .chunks(2)
        .map(|c| u16::from_be_bytes([c[0], c[1]]) as u32)
        .sum();
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

pub fn arp_request() -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&[0xff; 6]);
    f.extend_from_slice(&SERVER_MAC);
    f.extend_from_slice(&[8, 6, 0, 1, 8, 0, 6, 4, 0, 1]);
    f.extend_from_slice(&SERVER_MAC);
    f.extend_from_slice(&SERVER_IP);
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&GUEST_IP);
    f
}

pub fn udp_reply(dst_port: u16, payload: &[u8]) -> Vec<u8> {
    udp_reply_to(GUEST_MAC, SERVER_IP, GUEST_IP, dst_port, payload)
}

/// A UDP reply from `src_ip:SERVER_PORT` (Ethernet source: the test's MAC)
/// to `dst_mac`/`dst_ip:dst_port`.
pub fn udp_reply_to(
    dst_mac: [u8; 6],
    src_ip: [u8; 4],
    dst_ip: [u8; 4],
    dst_port: u16,
    payload: &[u8],
) -> Vec<u8> {
    let mut f = dst_mac.to_vec();
    f.extend_from_slice(&SERVER_MAC);
    f.extend_from_slice(&[8, 0]);
    let total = (20 + 8 + payload.len()) as u16;
    let mut iph = vec![0x45, 0];
    iph.extend_from_slice(&total.to_be_bytes());
    iph.extend_from_slice(&[0, 0, 0x40, 0, 64, 17, 0, 0]);
    iph.extend_from_slice(&src_ip);
    iph.extend_from_slice(&dst_ip);
    let c = ip_checksum(&iph);
    iph[10..12].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&iph);
    f.extend_from_slice(&SERVER_PORT.to_be_bytes());
    f.extend_from_slice(&dst_port.to_be_bytes());
    f.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(payload);
    f
}

/// `burstvm vmm` with the test network: guest 10.77.0.2, server 10.77.0.1:7777.
pub fn vmm_command(
    burstvm: &str,
    sandbox: &str,
    net: &str,
    vf_init: &str,
    trace: &Path,
) -> Command {
    vmm_command_mac(burstvm, sandbox, net, vf_init, trace, Some(GUEST_MAC))
}

/// `vmm_command` with `--mac` only if `mac` is given.
pub fn vmm_command_mac(
    burstvm: &str,
    sandbox: &str,
    net: &str,
    vf_init: &str,
    trace: &Path,
    mac: Option<[u8; 6]>,
) -> Command {
    let mut c = Command::new(burstvm);
    c.args(["vmm", "--sandbox", sandbox, "--net", net]);
    if let Some(m) = mac {
        c.args(["--mac", &mac_str(&m)]);
    }
    c.args(["--ip", "10.77.0.2/24"])
        .args(["--server", &format!("10.77.0.1:{SERVER_PORT}")])
        .args(["--server-mac", &mac_str(&SERVER_MAC)])
        .args([
            "--vf-init",
            vf_init,
            "--app-size",
            "16K",
            "--timeout",
            "120",
        ])
        .arg("--trace")
        .arg(trace)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

pub fn wait_output(child: Child) -> Output {
    child.wait_with_output().expect("wait for burstvm vmm")
}

pub fn stages(trace: &Path) -> Vec<(String, u64, u64)> {
    std::fs::read_to_string(trace)
        .expect("trace file")
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("trace line is JSON");
            (
                v["stage"].as_str().unwrap().to_string(),
                v["start_ns"].as_u64().unwrap(),
                v["end_ns"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Be the agent's server on `wire`: check its request, answer its ARP and
/// UDP, then check that the VMM ended with READY and the stages are in order.
pub fn serve_agent(wire: &Wire, mut child: Child, sandbox: &str, trace: &Path, vf_init: &str) {
    // The guest's request: from its MAC/IP to the server's, payload = sandbox id.
    let req = wire.expect(60, &mut child, "UDP request", None, is_udp_request);
    assert_eq!(req[0..6], SERVER_MAC, "destination MAC");
    assert_eq!(req[6..12], GUEST_MAC, "source MAC");
    assert_eq!(req[26..30], GUEST_IP, "source IP");
    assert_eq!(req[30..34], SERVER_IP, "destination IP");
    assert_eq!(ip_checksum(&req[14..34]), 0, "IPv4 header checksum");
    let udp_len = u16::from_be_bytes([req[38], req[39]]) as usize;
    assert_eq!(
        &req[42..34 + udp_len],
        sandbox.as_bytes(),
        "UDP payload is the sandbox id"
    );
    let client_port = u16::from_be_bytes([req[34], req[35]]);

    // Linux peers resolve the guest before replying: the agent must answer.
    let arp = wire.expect(
        30,
        &mut child,
        "ARP reply",
        Some(&arp_request()),
        is_arp_reply,
    );
    assert_eq!(arp[0..6], SERVER_MAC);
    assert_eq!(arp[22..28], GUEST_MAC, "sender MAC");
    assert_eq!(arp[28..32], GUEST_IP, "sender IP");
    assert_eq!(arp[32..38], SERVER_MAC, "target MAC");

    // A frame for someone else must not satisfy the guest; the real reply does.
    let mut stray = udp_reply(client_port, b"not for you");
    stray[30..34].copy_from_slice(&[10, 77, 0, 99]); // other destination IP
    wire.send(&stray);
    let reply = udp_reply(client_port, b"pong from the test");
    let end = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() && Instant::now() < end {
        wire.send(&reply);
        std::thread::sleep(Duration::from_millis(200));
    }

    let out = wait_output(child);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "burstvm vmm failed: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("ready"), "summary shows ready: {stdout}");

    let st = stages(trace);
    let get = |name: &str| {
        st.iter()
            .find(|s| s.0 == name)
            .unwrap_or_else(|| panic!("stage {name} missing in {st:?}"))
            .clone()
    };
    let (vf, app, ready) = (get("vf-driver"), get("app-launch"), get("ready"));
    assert!(vf.1 <= vf.2 && app.1 <= app.2 && ready.1 <= ready.2);
    // Sync: the driver (link up) finishes before the app starts; both
    // modes: READY comes after both.
    if vf_init == "sync" {
        assert!(
            vf.2 <= app.1,
            "sync: vf-driver ends before app-launch starts: {st:?}"
        );
    }
    assert!(ready.2 >= vf.2 && ready.2 >= app.2, "{st:?}");
}

/// Attach to `name` like the VMM does (IFF_TAP | IFF_NO_PI, no multiqueue).
pub fn open_tap(name: &str) -> Result<netutil::Tap, netutil::TapError> {
    netutil::Tap::open_existing(name)
}
