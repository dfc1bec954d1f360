//! `burstvm nic` with real microVMs: `burstvm vmm` processes running the
//! built-in agent on VFs of one PF (not the test frontend). The test's tap is
//! the PF's uplink; the test reads it with an AF_PACKET socket and plays the
//! server there.
//!
//! - Two guests on two VFs: guest B's request leaves through the uplink, the
//!   test answers it; guest A's server is guest B, so A's request crosses the
//!   switch VF to VF (never the uplink); the test answers A from the uplink.
//!   The per-VF counters of the control API match exactly what was sent.
//! - A VMM killed with SIGKILL while its VF is open: the VF is closed, stays
//!   closed while another VF of the devset is open, is reset with the devset,
//!   and after release is allocated again and used by a new VMM to READY.

mod virtio_common;

use std::cell::RefCell;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nic::control::{Counters, Request, Response, VfInfo};
use nic::devset::VfState;
use virtio_common::{
    ip_checksum, mac_str, stop_child, udp_reply_to, TestTap, Wire, LAZY_DMA, SERVER_MAC,
    SERVER_PORT, VANILLA_DMA,
};

const BURSTVM: &str = env!("CARGO_BIN_EXE_burstvm");
/// Bound of every wait for a guest (nested KVM on a loaded 2-core machine).
const GUEST_WAIT: Duration = Duration::from_secs(90);
/// Bound of every wait for the NIC to reflect something already done.
const NIC_WAIT: Duration = Duration::from_secs(20);

const SERVER_IP: [u8; 4] = [10, 78, 0, 1];
const MAC_A: [u8; 6] = [0x02, 0, 0, 0x78, 0, 2];
const MAC_B: [u8; 6] = [0x02, 0, 0, 0x78, 0, 3];
const MAC_C: [u8; 6] = [0x02, 0, 0, 0x78, 0, 4];
const IP_A: [u8; 4] = [10, 78, 0, 2];
const IP_B: [u8; 4] = [10, 78, 0, 3];
const IP_C: [u8; 4] = [10, 78, 0, 4];

fn ip_str(ip: [u8; 4]) -> String {
    format!("{}.{}.{}.{}", ip[0], ip[1], ip[2], ip[3])
}

fn src_mac(f: &[u8]) -> [u8; 6] {
    f[6..12].try_into().unwrap()
}

/// A UDP/IPv4 request of the agent (to any server port).
fn is_udp(f: &[u8]) -> bool {
    f.len() >= 42 && f[12..14] == [8, 0] && f[23] == 17
}

/// The frame the agent sends: Ethernet + IPv4 + UDP + the sandbox id.
fn request_len(sandbox: &str) -> u64 {
    (14 + 20 + 8 + sandbox.len()) as u64
}

/// The test's end of the uplink: an AF_PACKET socket on the tap that keeps
/// every frame the NIC put on the wire (the test's own sends are skipped).
struct Uplink {
    wire: Wire,
    seen: Vec<Vec<u8>>,
}

impl Uplink {
    fn open(ifname: &str) -> Uplink {
        Uplink {
            wire: Wire::open_with_timeout(ifname, Duration::from_millis(50)),
            seen: Vec::new(),
        }
    }

    fn send(&self, frame: &[u8]) {
        self.wire.send(frame);
    }

    /// Reads the wire for `d`, keeping the frames that came from the NIC.
    fn pump(&mut self, d: Duration) {
        let end = Instant::now() + d;
        let mut buf = [0u8; 2048];
        loop {
            // SAFETY: sockaddr_ll is plain data.
            let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut sl = std::mem::size_of::<libc::sockaddr_ll>() as u32;
            // SAFETY: buf and sll are valid writable buffers of the sizes passed.
            let n = unsafe {
                libc::recvfrom(
                    self.wire.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    0,
                    &mut sll as *mut _ as *mut libc::sockaddr,
                    &mut sl,
                )
            };
            if n > 0 && sll.sll_pkttype != libc::PACKET_OUTGOING {
                self.seen.push(buf[..n as usize].to_vec());
            }
            if Instant::now() >= end {
                return;
            }
        }
    }

    /// Frames from `mac` seen so far.
    fn from(&self, mac: [u8; 6]) -> Vec<&Vec<u8>> {
        self.seen.iter().filter(|f| src_mac(f) == mac).collect()
    }
}

/// `burstvm nic` (one PF, uplink = the test's tap) with its state directory;
/// SIGTERM, then SIGKILL, and the directory removed when dropped.
/// All control requests go over one connection, opened at start, so the
/// daemon's descriptors do not change with the test's queries.
struct Nic {
    child: Child,
    dir: PathBuf,
    ctl: RefCell<(BufReader<UnixStream>, UnixStream)>,
}

impl Nic {
    fn start(tag: &str, uplink: &str, policy: &str) -> Nic {
        let dir = PathBuf::from(format!("/tmp/nic-vm{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let control = dir.join("ctl.sock");
        let log = File::create(dir.join("nic.log")).unwrap();
        let child = Command::new(BURSTVM)
            .args(["nic", "--pf", "pf0", "--vfs", "2", "--devset-lock", policy])
            .args(["--uplink", &format!("tap:{uplink}")])
            .arg("--control")
            .arg(&control)
            .arg("--state-dir")
            .arg(&dir)
            .env("BURSTVM_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn burstvm nic");
        let end = Instant::now() + NIC_WAIT;
        let mut child = child;
        let conn = loop {
            if let Ok(c) = UnixStream::connect(&control) {
                break c;
            }
            if let Some(st) = child.try_wait().unwrap() {
                let log = std::fs::read_to_string(dir.join("nic.log")).unwrap_or_default();
                let _ = std::fs::remove_dir_all(&dir);
                panic!("burstvm nic exited at start ({st}): {log}");
            }
            if Instant::now() >= end {
                let _ = child.kill();
                let _ = child.wait();
                let _ = std::fs::remove_dir_all(&dir);
                panic!("burstvm nic never came up");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        conn.set_read_timeout(Some(NIC_WAIT)).unwrap();
        let reader = BufReader::new(conn.try_clone().unwrap());
        Nic {
            child,
            dir,
            ctl: RefCell::new((reader, conn)),
        }
    }

    /// One request, one response line (bounded by the read timeout).
    fn call(&self, req: &Request) -> Response {
        let mut ctl = self.ctl.borrow_mut();
        let (reader, writer) = &mut *ctl;
        writeln!(writer, "{}", serde_json::to_string(req).unwrap()).expect("nic control write");
        let mut line = String::new();
        reader.read_line(&mut line).expect("nic control response");
        let r: Response =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("nic response {line:?}: {e}"));
        assert!(r.ok, "{req:?} refused: {r:?}");
        r
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("nic.log")).unwrap_or_default()
    }

    fn alloc(&self, sandbox: &str, mac: [u8; 6]) -> VfInfo {
        let vf = self
            .call(&Request::Alloc {
                pf: "pf0".into(),
                sandbox: sandbox.into(),
                mac: Some(mac_str(&mac)),
                vlan: None,
            })
            .vf
            .expect("alloc response has the VF");
        assert_eq!(vf.state, VfState::Assigned, "{vf:?}");
        vf
    }

    fn release(&self, sandbox: &str) {
        self.call(&Request::Release {
            sandbox: sandbox.into(),
        });
    }

    fn get(&self, vf: &VfInfo) -> VfInfo {
        self.call(&Request::Get {
            sandbox: None,
            vf: Some(vf.id.clone()),
        })
        .vf
        .expect("get response has the VF")
    }

    fn list(&self) -> Vec<VfInfo> {
        self.call(&Request::List)
            .vfs
            .expect("list response has VFs")
    }

    /// Polls the VF until `f` holds (bounded); returns its last view.
    fn wait_vf(&self, vf: &VfInfo, what: &str, f: impl Fn(&VfInfo) -> bool) -> VfInfo {
        let end = Instant::now() + NIC_WAIT;
        loop {
            let v = self.get(vf);
            if f(&v) {
                return v;
            }
            assert!(
                Instant::now() < end,
                "VF {} never {what}: {v:?}\nnic log:\n{}",
                vf.id,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The daemon's open descriptors (number -> target) and how many guest
    /// memfd mappings it has: the leak check.
    fn resources(&self) -> (Vec<String>, usize) {
        let pid = self.child.id();
        let mut fds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .flatten()
            .map(|e| {
                let t = std::fs::read_link(e.path()).unwrap_or_default();
                format!("{} -> {}", e.file_name().to_string_lossy(), t.display())
            })
            .collect();
        fds.sort();
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        (fds, maps.lines().filter(|l| l.contains("/memfd:")).count())
    }

    /// Waits (bounded) until the daemon holds exactly what it held at `idle`:
    /// a closed session may release its last descriptors just after the
    /// state change the test saw.
    fn expect_resources(&self, idle: &(Vec<String>, usize)) {
        let end = Instant::now() + NIC_WAIT;
        loop {
            let now = self.resources();
            if &now == idle || Instant::now() >= end {
                assert_eq!(&now, idle, "NIC descriptors / guest memfd mappings leaked");
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Nic {
    fn drop(&mut self) {
        stop_child(&mut self.child);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One guest's network identity and VMM flags.
struct Guest<'a> {
    sandbox: String,
    mac: [u8; 6],
    ip: [u8; 4],
    server: ([u8; 4], [u8; 6]),
    mode: (&'a str, &'a [&'a str]),
}

/// `--vf-init` mode and memory flags of a guest.
const SYNC_VANILLA: (&str, &[&str]) = ("sync", VANILLA_DMA);
const ASYNC_LAZY: (&str, &[&str]) = ("async", LAZY_DMA);

/// A `burstvm vmm --keep-running` on a VF, with the read end of its
/// `--ready-fd` pipe; SIGKILLed and reaped when dropped if still running.
struct Vmm {
    child: Option<Child>,
    sandbox: String,
    ready: File,
    stderr: PathBuf,
}

impl Vmm {
    fn start(dir: &Path, vf: &VfInfo, g: &Guest) -> Vmm {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: pipe2 writes two descriptors into the array.
        let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) };
        assert_eq!(r, 0, "pipe2: {}", std::io::Error::last_os_error());
        // SAFETY: both descriptors were just created and are owned here.
        let (ready, wr) = unsafe { (File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let wr_fd = wr.as_raw_fd();
        let stderr = dir.join(format!("{}.err", g.sandbox));
        let mut cmd = Command::new(BURSTVM);
        cmd.args(["vmm", "--sandbox", &g.sandbox, "--memory", "32M"])
            .arg("--net")
            .arg(format!("vf:{}", vf.socket.display()))
            .args(["--mac", &mac_str(&g.mac)])
            .args(["--ip", &format!("{}/24", ip_str(g.ip))])
            .args(["--server", &format!("{}:{SERVER_PORT}", ip_str(g.server.0))])
            .args(["--server-mac", &mac_str(&g.server.1)])
            .args(["--vf-init", g.mode.0])
            .args(g.mode.1)
            .args(["--app-size", "16K", "--timeout", "120", "--keep-running"])
            .args(["--ready-fd", &wr_fd.to_string()])
            .arg("--trace")
            .arg(dir.join(format!("{}.trace", g.sandbox)))
            .stdout(Stdio::null())
            .stderr(File::create(&stderr).unwrap());
        // SAFETY: only fcntl(2), async-signal-safe, between fork and exec:
        // the write end is inherited by this child only (tests run in
        // parallel threads; no other child may hold it).
        unsafe {
            cmd.pre_exec(move || {
                if libc::fcntl(wr_fd, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("spawn burstvm vmm");
        drop(wr);
        Vmm {
            child: Some(child),
            sandbox: g.sandbox.clone(),
            ready,
            stderr,
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Panics (with the VMM's stderr) if the VMM has exited.
    fn check_alive(&mut self, what: &str) {
        let child = self.child.as_mut().expect("VMM running");
        if let Some(st) = child.try_wait().unwrap() {
            panic!(
                "VMM {} exited ({st}) while the test waited for {what}: {}",
                self.sandbox,
                self.stderr()
            );
        }
    }

    /// True once the VMM wrote `ready\n` to its ready pipe.
    fn is_ready(&mut self) -> bool {
        let mut buf = [0u8; 16];
        match self.ready.read(&mut buf) {
            Ok(n) if n > 0 => {
                assert_eq!(&buf[..n], b"ready\n", "{}: ready pipe", self.sandbox);
                true
            }
            _ => false,
        }
    }

    fn signal(&mut self, sig: i32) {
        let child = self.child.as_ref().expect("VMM running");
        // SAFETY: signalling our own child by its pid.
        assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
    }

    /// Waits (bounded) for the VMM to exit and returns its status.
    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let end = Instant::now() + NIC_WAIT;
        let child = self.child.as_mut().expect("VMM running");
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                self.child = None;
                return st;
            }
            assert!(
                Instant::now() < end,
                "VMM {} did not exit after its signal",
                self.sandbox
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM a kept-running VMM: it must exit 0.
    fn terminate(&mut self) {
        self.signal(libc::SIGTERM);
        let st = self.wait_exit();
        assert!(
            st.success(),
            "VMM {}: {st}: {}",
            self.sandbox,
            self.stderr()
        );
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Reads the uplink until `mac`'s UDP request is there; returns it.
fn wait_request(up: &mut Uplink, vmm: &mut Vmm, mac: [u8; 6]) -> Vec<u8> {
    let end = Instant::now() + GUEST_WAIT;
    loop {
        if let Some(f) = up.from(mac).into_iter().find(|f| is_udp(f)) {
            return f.clone();
        }
        vmm.check_alive("its UDP request");
        assert!(
            Instant::now() < end,
            "no UDP request from {} on the uplink: {}",
            vmm.sandbox,
            vmm.stderr()
        );
        up.pump(Duration::from_millis(100));
    }
}

/// Sends `reply` until the VMM reports READY (a resend only every 10 s, in
/// case the guest was not listening yet), reading the uplink meanwhile.
/// Returns how many replies were sent.
fn reply_until_ready(up: &mut Uplink, vmm: &mut Vmm, reply: &[u8]) -> u64 {
    let end = Instant::now() + GUEST_WAIT;
    let mut sent = 0;
    let mut next = Instant::now();
    loop {
        if vmm.is_ready() {
            return sent;
        }
        vmm.check_alive("READY");
        assert!(
            Instant::now() < end,
            "VMM {} not READY after {sent} replies: {}",
            vmm.sandbox,
            vmm.stderr()
        );
        if Instant::now() >= next {
            up.send(reply);
            sent += 1;
            next = Instant::now() + Duration::from_secs(10);
        }
        up.pump(Duration::from_millis(50));
    }
}

/// Checks the agent's request: addresses, checksum, payload = sandbox id.
/// Returns the client port.
fn check_request(req: &[u8], g: &Guest) -> u16 {
    assert_eq!(req[0..6], g.server.1, "{}: destination MAC", g.sandbox);
    assert_eq!(req[26..30], g.ip, "{}: source IP", g.sandbox);
    assert_eq!(req[30..34], g.server.0, "{}: destination IP", g.sandbox);
    assert_eq!(req[36..38], SERVER_PORT.to_be_bytes(), "destination port");
    assert_eq!(ip_checksum(&req[14..34]), 0, "IPv4 header checksum");
    assert_eq!(req.len() as u64, request_len(&g.sandbox));
    assert_eq!(
        &req[42..],
        g.sandbox.as_bytes(),
        "payload is the sandbox id"
    );
    u16::from_be_bytes([req[34], req[35]])
}

/// Polls the VF's counters until they equal `want` (the NIC may still be
/// moving the last frame), then asserts equality.
fn expect_counters(nic: &Nic, vf: &VfInfo, who: &str, want: Counters) -> VfInfo {
    let end = Instant::now() + NIC_WAIT;
    loop {
        let v = nic.get(vf);
        if v.counters == want || Instant::now() >= end {
            assert_eq!(v.counters, want, "counters of {who}'s VF {}", vf.id);
            return v;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn two_guests_talk_through_the_vf_switch_with_exact_counters() {
    let tap = TestTap::new("nv");
    let nic = Nic::start("two", &tap.0, "hierarchical");
    let mut up = Uplink::open(&tap.0);
    let pid = std::process::id();
    // B's server is the test on the uplink; A's server is guest B.
    let b = Guest {
        sandbox: format!("nicvm-b-{pid}"),
        mac: MAC_B,
        ip: IP_B,
        server: (SERVER_IP, SERVER_MAC),
        mode: SYNC_VANILLA,
    };
    let a = Guest {
        sandbox: format!("nicvm-a-{pid}"),
        mac: MAC_A,
        ip: IP_A,
        server: (IP_B, MAC_B),
        mode: ASYNC_LAZY,
    };
    let vf_a = nic.alloc(&a.sandbox, a.mac);
    let vf_b = nic.alloc(&b.sandbox, b.mac);
    assert_ne!(vf_a.id, vf_b.id);
    let idle = nic.resources();

    // Guest B: its request goes out on the uplink (A is not active yet, so
    // the flood of the unknown server MAC reaches only the uplink).
    let mut vmm_b = Vmm::start(&nic.dir, &vf_b, &b);
    let req_b = wait_request(&mut up, &mut vmm_b, b.mac);
    let client_port = check_request(&req_b, &b);
    let reply_b = udp_reply_to(b.mac, SERVER_IP, b.ip, client_port, b"pong B");
    let replies_b = reply_until_ready(&mut up, &mut vmm_b, &reply_b);
    assert_eq!(nic.get(&vf_b).state, VfState::Open);

    // Guest A asks guest B: the switch takes A's frames to B's VF (B's
    // counters show them); the test answers for B from the uplink (the agent
    // checks IPs and ports, not the source MAC).
    let mut vmm_a = Vmm::start(&nic.dir, &vf_a, &a);
    let end = Instant::now() + GUEST_WAIT;
    while nic.get(&vf_b).counters.rx_packets < replies_b + 1 {
        vmm_a.check_alive("its request to reach B's VF");
        assert!(
            Instant::now() < end,
            "A's request never reached B's VF: A {:?} B {:?}: {}",
            nic.get(&vf_a),
            nic.get(&vf_b),
            vmm_a.stderr()
        );
        up.pump(Duration::from_millis(50));
    }
    let reply_a = udp_reply_to(a.mac, IP_B, a.ip, client_port, b"pong A from B");
    let replies_a = reply_until_ready(&mut up, &mut vmm_a, &reply_a);
    assert!(replies_a >= 1 && replies_b >= 1);

    // Both guests are READY and idle: nothing moves any more. The uplink saw
    // B's requests only; A's went VF to VF.
    up.pump(Duration::from_millis(300));
    assert!(
        up.from(a.mac).is_empty(),
        "A's frames reached the uplink: {:?}",
        up.from(a.mac)
    );
    let on_wire_b = up.from(b.mac);
    assert!(
        on_wire_b.iter().all(|f| f[..] == req_b[..]),
        "B sends only its request"
    );
    let n_b = on_wire_b.len() as u64;

    // A's request count is whatever A sent (≥ 1, one per second until its
    // reply); everything else follows from it and from what the test saw
    // and sent. Polled through `list`: the NIC may still be finishing the
    // last frame's accounting.
    let len_a = request_len(&a.sandbox);
    let expected = |n_a: u64| {
        let want_a = Counters {
            tx_packets: n_a,
            tx_bytes: n_a * len_a,
            rx_packets: replies_a,
            rx_bytes: replies_a * reply_a.len() as u64,
            ..Counters::default()
        };
        let want_b = Counters {
            tx_packets: n_b,
            tx_bytes: n_b * req_b.len() as u64,
            rx_packets: replies_b + n_a,
            rx_bytes: replies_b * reply_b.len() as u64 + n_a * len_a,
            ..Counters::default()
        };
        (want_a, want_b)
    };
    let end = Instant::now() + NIC_WAIT;
    loop {
        let all = nic.list();
        let find = |vf: &VfInfo| all.iter().find(|v| v.id == vf.id).expect("VF in list");
        let (va, vb) = (find(&vf_a), find(&vf_b));
        let (want_a, want_b) = expected(va.counters.tx_packets);
        let settled = va.counters == want_a && vb.counters == want_b;
        if settled || Instant::now() >= end {
            assert!(va.counters.tx_packets >= 1, "A sent its request: {va:?}");
            assert_eq!(va.counters, want_a, "counters of A's VF {}", va.id);
            assert_eq!(vb.counters, want_b, "counters of B's VF {}", vb.id);
            for (v, g) in [(va, &a), (vb, &b)] {
                assert_eq!(v.state, VfState::Open, "{v:?}");
                assert_eq!(v.sandbox.as_deref(), Some(g.sandbox.as_str()));
                assert_eq!(v.mac, mac_str(&g.mac));
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(nic.resources().1 > idle.1, "open VFs map guest memory");

    // Both VMMs end: the devset's last close resets both VFs (counters
    // cleared), and the daemon holds nothing of the guests any more.
    vmm_a.terminate();
    vmm_b.terminate();
    for vf in [&vf_a, &vf_b] {
        let v = nic.wait_vf(vf, "reset", |v| v.state == VfState::Reset);
        assert_eq!(v.counters, Counters::default(), "reset clears counters");
    }
    nic.expect_resources(&idle);
}

#[test]
fn sigkilled_vmm_vf_is_closed_reset_and_reused() {
    let tap = TestTap::new("nk");
    let nic = Nic::start("kill", &tap.0, "global");
    let mut up = Uplink::open(&tap.0);
    let pid = std::process::id();
    let guest = |name: &str, mac, ip, mode| Guest {
        sandbox: format!("nicvm-{name}-{pid}"),
        mac,
        ip,
        server: (SERVER_IP, SERVER_MAC),
        mode,
    };
    let a = guest("ka", MAC_A, IP_A, SYNC_VANILLA);
    let b = guest("kb", MAC_B, IP_B, ASYNC_LAZY);
    let c = guest("kc", MAC_C, IP_C, ASYNC_LAZY);
    let vf_a = nic.alloc(&a.sandbox, a.mac);
    let vf_b = nic.alloc(&b.sandbox, b.mac);
    let idle = nic.resources();

    // B keeps its VF open for the whole time A dies.
    let mut vmm_b = Vmm::start(&nic.dir, &vf_b, &b);
    let port = check_request(&wait_request(&mut up, &mut vmm_b, b.mac), &b);
    let reply_b = udp_reply_to(b.mac, SERVER_IP, b.ip, port, b"pong");
    reply_until_ready(&mut up, &mut vmm_b, &reply_b);

    // A is killed while its guest waits for the reply: VF open, rings live.
    let mut vmm_a = Vmm::start(&nic.dir, &vf_a, &a);
    check_request(&wait_request(&mut up, &mut vmm_a, a.mac), &a);
    let before = nic.get(&vf_a);
    assert_eq!(before.state, VfState::Open, "{before:?}");
    assert!(before.counters.tx_packets >= 1, "{before:?}");
    vmm_a.signal(libc::SIGKILL);
    assert_eq!(vmm_a.wait_exit().signal(), Some(libc::SIGKILL));

    // Closed, and not reset while B's VF of the same devset is open.
    nic.wait_vf(&vf_a, "closed", |v| v.state == VfState::Closed);
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(50));
        let (va, vb) = (nic.get(&vf_a), nic.get(&vf_b));
        assert_eq!(va.state, VfState::Closed, "reset while B is open: {va:?}");
        assert_eq!(vb.state, VfState::Open, "{vb:?}");
    }
    // B's last close resets the devset: both VFs, counters cleared.
    vmm_b.terminate();
    for vf in [&vf_a, &vf_b] {
        let v = nic.wait_vf(vf, "reset", |v| v.state == VfState::Reset);
        assert_eq!(v.counters, Counters::default(), "reset clears counters");
    }
    nic.expect_resources(&idle);

    // Released, A's VF is the only free one: a new sandbox gets it and its
    // VMM reaches READY over it.
    nic.release(&a.sandbox);
    let freed = nic.get(&vf_a);
    assert_eq!((freed.state, freed.sandbox), (VfState::Free, None));
    let vf_c = nic.alloc(&c.sandbox, c.mac);
    assert_eq!(vf_c.id, vf_a.id, "the reset VF is allocated again");
    let mut vmm_c = Vmm::start(&nic.dir, &vf_c, &c);
    let req_c = wait_request(&mut up, &mut vmm_c, c.mac);
    let port = check_request(&req_c, &c);
    let reply_c = udp_reply_to(c.mac, SERVER_IP, c.ip, port, b"pong C");
    let replies_c = reply_until_ready(&mut up, &mut vmm_c, &reply_c);
    up.pump(Duration::from_millis(300));
    let n_c = up.from(c.mac).len() as u64;
    let vc = expect_counters(
        &nic,
        &vf_c,
        "C",
        Counters {
            tx_packets: n_c,
            tx_bytes: n_c * req_c.len() as u64,
            rx_packets: replies_c,
            rx_bytes: replies_c * reply_c.len() as u64,
            ..Counters::default()
        },
    );
    assert_eq!(
        (vc.state, vc.sandbox.as_deref()),
        (VfState::Open, Some(c.sandbox.as_str()))
    );
    vmm_c.terminate();
    nic.wait_vf(&vf_c, "reset", |v| v.state == VfState::Reset);
    nic.expect_resources(&idle);
}
