//! Shared by the tests that run `burstvm nic` with real microVMs (nic_vm, nic_restart): the
//! NIC daemon process, `burstvm vmm` guests on its VFs, and the test's end of the PF's
//! uplink tap, where the test plays the guests' server.
#![allow(dead_code, unused_imports)] // each test file uses a different subset

use std::cell::RefCell;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nic_api::{Counters, Request, Response, VfInfo, VfState};
pub use testutil::tap::{
    ip_checksum, mac_str, stop_child, udp_reply_to, TestTap, Wire, LAZY_DMA, SERVER_MAC,
    SERVER_PORT, VANILLA_DMA,
};

pub const BURSTVM: &str = env!("CARGO_BIN_EXE_burstvm");
/// Bound of every wait for a guest (nested KVM on a loaded 2-core machine).
pub const GUEST_WAIT: Duration = Duration::from_secs(90);
/// Bound of every wait for the NIC to reflect something already done.
pub const NIC_WAIT: Duration = Duration::from_secs(20);

pub const SERVER_IP: [u8; 4] = [10, 78, 0, 1];
pub const MAC_A: [u8; 6] = [0x02, 0, 0, 0x78, 0, 2];
pub const MAC_B: [u8; 6] = [0x02, 0, 0, 0x78, 0, 3];
pub const MAC_C: [u8; 6] = [0x02, 0, 0, 0x78, 0, 4];
pub const IP_A: [u8; 4] = [10, 78, 0, 2];
pub const IP_B: [u8; 4] = [10, 78, 0, 3];
pub const IP_C: [u8; 4] = [10, 78, 0, 4];

pub fn ip_str(ip: [u8; 4]) -> String {
    format!("{}.{}.{}.{}", ip[0], ip[1], ip[2], ip[3])
}

pub fn src_mac(f: &[u8]) -> [u8; 6] {
    f[6..12].try_into().unwrap()
}

/// A UDP/IPv4 request of the agent (to any server port).
pub fn is_udp(f: &[u8]) -> bool {
    f.len() >= 42 && f[12..14] == [8, 0] && f[23] == 17
}

/// The frame the agent sends: Ethernet + IPv4 + UDP + the sandbox id.
pub fn request_len(sandbox: &str) -> u64 {
    (14 + 20 + 8 + sandbox.len()) as u64
}

/// The test's end of the uplink: an AF_PACKET socket on the tap that keeps
/// every frame the NIC put on the wire (the test's own sends are skipped).
pub struct Uplink {
    pub wire: Wire,
    pub seen: Vec<Vec<u8>>,
}

impl Uplink {
    pub fn open(ifname: &str) -> Uplink {
        Uplink {
            wire: Wire::open_with_timeout(ifname, Duration::from_millis(50)),
            seen: Vec::new(),
        }
    }

    pub fn send(&self, frame: &[u8]) {
        self.wire.send(frame);
    }

    /// Reads the wire for `d`, keeping the frames that came from the NIC.
    pub fn pump(&mut self, d: Duration) {
        let end = Instant::now() + d;
        let mut buf = [0u8; 2048];
        loop {
            // SAFETY: sockaddr_ll is plain data.
            let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut sl = size_of::<libc::sockaddr_ll>() as u32;
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
    pub fn from(&self, mac: [u8; 6]) -> Vec<&Vec<u8>> {
        self.seen.iter().filter(|f| src_mac(f) == mac).collect()
    }
}

/// `burstvm nic` (one PF, uplink = the test's tap) with its state directory;
/// SIGTERM, then SIGKILL, and the directory removed when dropped.
/// All control requests go over one connection, opened at start, so the
/// daemon's descriptors do not change with the test's queries.
pub struct Nic {
    pub child: Child,
    pub dir: PathBuf,
    args: Vec<String>,
    pub ctl: RefCell<(BufReader<UnixStream>, UnixStream)>,
}

impl Nic {
    pub fn start(tag: &str, uplink: &str, policy: &str) -> Nic {
        let uplink = format!("tap:{uplink}");
        Self::start_with(
            tag,
            &["--vfs", "2", "--devset-lock", policy, "--uplink", &uplink],
        )
    }

    /// One PF with `sgfs` SG functions (and one VF, unused), no uplink.
    pub fn start_sg(tag: &str, sgfs: usize) -> Nic {
        Self::start_with(tag, &["--vfs", "1", "--sgfs", &sgfs.to_string()])
    }

    /// `burstvm nic --pf pf0 PF_ARGS` with its control socket and state in a fresh directory.
    fn start_with(tag: &str, pf_args: &[&str]) -> Nic {
        let dir = testutil::fresh_dir("nic-vm", tag);
        let mut args: Vec<String> = ["nic", "--pf", "pf0"].map(String::from).to_vec();
        args.extend(pf_args.iter().map(|s| s.to_string()));
        args.extend([
            "--control".to_string(),
            dir.join("ctl.sock").display().to_string(),
            "--state-dir".into(),
            dir.display().to_string(),
        ]);
        let (child, ctl) = Self::spawn(&dir, &args);
        Nic {
            child,
            dir,
            args,
            ctl: RefCell::new(ctl),
        }
    }

    /// Starts the daemon and connects to its control socket (bounded).
    fn spawn(dir: &Path, args: &[String]) -> (Child, (BufReader<UnixStream>, UnixStream)) {
        let control = dir.join("ctl.sock");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("nic.log"))
            .unwrap();
        let mut child = Command::new(BURSTVM)
            .args(args)
            // The one control connection may sit idle while guests boot.
            .args(["--control-idle-timeout", "3600"])
            .env("BURSTVM_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn burstvm nic");
        let end = Instant::now() + NIC_WAIT;
        let conn = loop {
            if let Ok(c) = UnixStream::connect(&control) {
                break c;
            }
            if let Some(st) = child.try_wait().unwrap() {
                let log = std::fs::read_to_string(dir.join("nic.log")).unwrap_or_default();
                let _ = std::fs::remove_dir_all(dir);
                panic!("burstvm nic exited at start ({st}): {log}");
            }
            if Instant::now() >= end {
                let _ = child.kill();
                let _ = child.wait();
                let _ = std::fs::remove_dir_all(dir);
                panic!("burstvm nic never came up");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        conn.set_read_timeout(Some(NIC_WAIT)).unwrap();
        let reader = BufReader::new(conn.try_clone().unwrap());
        (child, (reader, conn))
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Starts the daemon again on the same state directory and sockets (after `kill`).
    pub fn restart(&mut self) {
        let (child, ctl) = Self::spawn(&self.dir, &self.args);
        self.child = child;
        *self.ctl.borrow_mut() = ctl;
    }

    /// One request, one response line (bounded by the read timeout); must succeed.
    pub fn call(&self, req: &Request) -> Response {
        let r = self.call_any(req);
        assert!(r.ok, "{req:?} refused: {r:?}");
        r
    }

    /// One request, whatever the answer.
    pub fn call_any(&self, req: &Request) -> Response {
        let mut ctl = self.ctl.borrow_mut();
        let (reader, writer) = &mut *ctl;
        writeln!(writer, "{}", serde_json::to_string(req).unwrap()).expect("nic control write");
        let mut line = String::new();
        reader.read_line(&mut line).expect("nic control response");
        let r: Response =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("nic response {line:?}: {e}"));
        r
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("nic.log")).unwrap_or_default()
    }

    pub fn alloc(&self, sandbox: &str, mac: [u8; 6]) -> VfInfo {
        let vf = self
            .call(&Request::Alloc {
                pf: "pf0".into(),
                sandbox: sandbox.into(),
                kind: Default::default(),
                mac: Some(mac_str(&mac)),
                vlan: None,
            })
            .vf
            .expect("alloc response has the VF");
        assert_eq!(vf.state, VfState::Assigned, "{vf:?}");
        vf
    }

    /// The sandbox's SG function (`kind: sg`).
    pub fn alloc_sg(&self, sandbox: &str) -> VfInfo {
        self.call(&Request::Alloc {
            pf: "pf0".into(),
            sandbox: sandbox.into(),
            kind: nic_api::DevKind::Sg,
            mac: None,
            vlan: None,
        })
        .vf
        .expect("alloc response has the SG function")
    }

    pub fn release(&self, sandbox: &str) {
        self.call(&Request::Release {
            sandbox: sandbox.into(),
        });
    }

    pub fn get(&self, vf: &VfInfo) -> VfInfo {
        self.call(&Request::Get {
            sandbox: None,
            vf: Some(vf.id.clone()),
        })
        .vf
        .expect("get response has the VF")
    }

    pub fn list(&self) -> Vec<VfInfo> {
        self.call(&Request::List {})
            .vfs
            .expect("list response has VFs")
    }

    /// Polls the VF until `f` holds (bounded); returns its last view.
    pub fn wait_vf(&self, vf: &VfInfo, what: &str, f: impl Fn(&VfInfo) -> bool) -> VfInfo {
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
    pub fn resources(&self) -> (Vec<String>, usize) {
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
    pub fn expect_resources(&self, idle: &(Vec<String>, usize)) {
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
        // Not after `kill`: its pid may belong to another process by now.
        if self.child.try_wait().ok().flatten().is_none() {
            stop_child(&mut self.child);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One guest's network identity and VMM flags.
pub struct Guest<'a> {
    pub sandbox: String,
    pub mac: [u8; 6],
    pub ip: [u8; 4],
    pub server: ([u8; 4], [u8; 6]),
    pub mode: (&'a str, &'a [&'a str]),
    /// More `burstvm vmm` flags (e.g. `--agent-mode echo`).
    pub extra: &'a [&'a str],
}

/// `--vf-init` mode and memory flags of a guest.
pub const SYNC_VANILLA: (&str, &[&str]) = ("sync", VANILLA_DMA);
pub const ASYNC_LAZY: (&str, &[&str]) = ("async", LAZY_DMA);

/// A `burstvm vmm --keep-running` on a VF, with the read end of its
/// `--ready-fd` pipe; SIGKILLed and reaped when dropped if still running.
pub struct Vmm {
    pub child: Option<Child>,
    pub sandbox: String,
    pub ready: File,
    /// What the ready pipe gave so far (the READY line may come in parts).
    ready_got: Vec<u8>,
    pub stderr: PathBuf,
}

impl Vmm {
    pub fn start(dir: &Path, vf: &VfInfo, g: &Guest) -> Vmm {
        let mut args: Vec<String> = vec![
            "--net".into(),
            format!("vf:{}", vf.socket.display()),
            "--mac".into(),
            mac_str(&g.mac),
            "--ip".into(),
            format!("{}/24", ip_str(g.ip)),
            "--server".into(),
            format!("{}:{SERVER_PORT}", ip_str(g.server.0)),
            "--server-mac".into(),
            mac_str(&g.server.1),
            "--vf-init".into(),
            g.mode.0.into(),
        ];
        args.extend(g.mode.1.iter().map(|s| s.to_string()));
        args.extend(["--app-size", "16K", "--keep-running"].map(String::from));
        args.extend(g.extra.iter().map(|s| s.to_string()));
        Vmm::spawn(dir, &g.sandbox, &args)
    }

    /// `burstvm vmm --sandbox SANDBOX --memory 32M --timeout 120 ARGS`, with the ready pipe
    /// and a trace file.
    pub fn spawn(dir: &Path, sandbox: &str, args: &[String]) -> Vmm {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: pipe2 writes two descriptors into the array.
        let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) };
        assert_eq!(r, 0, "pipe2: {}", std::io::Error::last_os_error());
        // SAFETY: both descriptors were just created and are owned here.
        let (ready, wr) = unsafe { (File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let wr_fd = wr.as_raw_fd();
        let stderr = dir.join(format!("{sandbox}.err"));
        let mut cmd = Command::new(BURSTVM);
        cmd.args(["vmm", "--sandbox", sandbox, "--memory", "32M"])
            .args(["--timeout", "120"])
            .args(args)
            .args(["--ready-fd", &wr_fd.to_string()])
            .arg("--trace")
            .arg(dir.join(format!("{sandbox}.trace")))
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
            sandbox: sandbox.to_string(),
            ready,
            ready_got: Vec::new(),
            stderr,
        }
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Panics (with the VMM's stderr) if the VMM has exited.
    pub fn check_alive(&mut self, what: &str) {
        let child = self.child.as_mut().expect("VMM running");
        if let Some(st) = child.try_wait().unwrap() {
            panic!(
                "VMM {} exited ({st}) while the test waited for {what}: {}",
                self.sandbox,
                self.stderr()
            );
        }
    }

    /// True once the VMM wrote its READY line (`vmm::Ready`) to its ready pipe.
    pub fn is_ready(&mut self) -> bool {
        let mut buf = [0u8; 64];
        match self.ready.read(&mut buf) {
            Ok(n) if n > 0 => {
                self.ready_got.extend_from_slice(&buf[..n]);
                match vmm::Ready::parse(&self.ready_got) {
                    Some(r) => {
                        let r = r.unwrap_or_else(|e| panic!("{}: ready pipe: {e}", self.sandbox));
                        assert!(r.vcpu_ns > 0, "{}: {r:?}", self.sandbox);
                        true
                    }
                    None => false,
                }
            }
            _ => false,
        }
    }

    pub fn signal(&mut self, sig: i32) {
        let child = self.child.as_ref().expect("VMM running");
        // SAFETY: signalling our own child by its pid.
        assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
    }

    /// Waits (bounded) for the VMM to exit and returns its status.
    pub fn wait_exit(&mut self) -> std::process::ExitStatus {
        self.wait_exit_within(NIC_WAIT)
    }

    /// As `wait_exit`, for a guest still at work (`GUEST_WAIT`).
    pub fn wait_exit_within(&mut self, bound: Duration) -> std::process::ExitStatus {
        let end = Instant::now() + bound;
        let child = self.child.as_mut().expect("VMM running");
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                self.child = None;
                return st;
            }
            assert!(
                Instant::now() < end,
                "VMM {} did not exit within {bound:?}",
                self.sandbox
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM a kept-running VMM: it must exit 0.
    pub fn terminate(&mut self) {
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
pub fn wait_request(up: &mut Uplink, vmm: &mut Vmm, mac: [u8; 6]) -> Vec<u8> {
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
pub fn reply_until_ready(up: &mut Uplink, vmm: &mut Vmm, reply: &[u8]) -> u64 {
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
pub fn check_request(req: &[u8], g: &Guest) -> u16 {
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
pub fn expect_counters(nic: &Nic, vf: &VfInfo, who: &str, want: Counters) -> VfInfo {
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
