//! Helpers for the NIC tests (nic's own and cli's nic_daemon): an in-process `burstvm nic`
//! daemon on its own directory, test frames, a frontend held by a child process.
//! Behind the `nic` feature, so that crates below nic can use the rest of testutil.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use netutil::MacAddr;
use nic::daemon::Nic;
use nic::frontend::{SimFrontend, MIN_MEM};
use nic::{LockPolicy, NicConfig};
use nic_api::{Client, VfInfo};

#[derive(Debug)]
pub struct TestNic {
    pub dir: PathBuf,
    pub control: PathBuf,
    /// The running daemon's state (devsets, ports).
    pub nic: Arc<Nic>,
    /// Dropping it stops the daemon.
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<Result<(), nic::Error>>>,
}

impl TestNic {
    pub fn start(name: &str, vfs: usize, uplink: Option<String>, policy: LockPolicy) -> TestNic {
        Self::start_full(name, vfs, uplink, policy, vec![], Default::default())
    }

    /// As `start`, registering pool memory with the pool servers at `pools`.
    pub fn start_with_pools(
        name: &str,
        vfs: usize,
        uplink: Option<String>,
        policy: LockPolicy,
        pools: Vec<PathBuf>,
    ) -> TestNic {
        Self::start_full(name, vfs, uplink, policy, pools, Default::default())
    }

    /// As `start`, with SG functions (`--sgfs` and friends).
    pub fn start_with(
        name: &str,
        vfs: usize,
        uplink: Option<String>,
        policy: LockPolicy,
        sg: nic::sg::SgConfig,
    ) -> TestNic {
        Self::start_full(name, vfs, uplink, policy, vec![], sg)
    }

    /// As `start` (hierarchical locks, no uplink), with `sgfs` SG functions
    /// per PF and the SG defaults.
    pub fn start_sg(name: &str, vfs: usize, sgfs: usize) -> TestNic {
        let sg = nic::sg::SgConfig {
            sgfs,
            ..Default::default()
        };
        Self::start_with(name, vfs, None, LockPolicy::Hierarchical, sg)
    }

    pub fn start_full(
        name: &str,
        vfs: usize,
        uplink: Option<String>,
        policy: LockPolicy,
        pools: Vec<PathBuf>,
        sg: nic::sg::SgConfig,
    ) -> TestNic {
        Self::start_threads(name, vfs, uplink, policy, pools, sg, 1)
    }

    /// As `start_full`, with `--dataplane-threads`.
    pub fn start_threads(
        name: &str,
        vfs: usize,
        uplink: Option<String>,
        policy: LockPolicy,
        pools: Vec<PathBuf>,
        sg: nic::sg::SgConfig,
        dataplane_threads: usize,
    ) -> TestNic {
        let dir = crate::fresh_dir("nic-t", name);
        let control = dir.join("ctl.sock");
        let args = NicConfig {
            pf: vec!["pf0".into()],
            vfs: vec![vfs],
            uplink: uplink
                .iter()
                .map(|u| nic::parse_uplink(u).expect("a valid --uplink"))
                .collect(),
            control: control.clone(),
            state_dir: dir.clone(),
            devset_lock: policy,
            socket_dir: None,
            batch: 32,
            dataplane_threads,
            pool_socket: pools,
            control_max_connections: 256,
            control_idle_timeout: Duration::from_secs(60),
            sg,
        };
        let (stop, stopped) = mpsc::channel::<()>();
        let (up, running) = mpsc::channel::<Arc<Nic>>();
        let thread = std::thread::spawn(move || {
            nic::daemon::run_with(&args, move |nic| {
                let _ = up.send(nic.clone());
                let _ = stopped.recv();
            })
        });
        let nic = match running.recv_timeout(Duration::from_secs(10)) {
            Ok(nic) => nic,
            Err(_) => panic!("daemon did not start: {:?}", thread.join()),
        };
        let t0 = Instant::now();
        while Client::connect(&control).is_err() {
            assert!(!thread.is_finished(), "daemon exited: {:?}", thread.join());
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "daemon did not come up"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        TestNic {
            dir,
            control,
            nic,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.control).unwrap()
    }

    pub fn wait_vf(&self, sandbox: &str, what: &str, f: impl Fn(&VfInfo) -> bool) -> VfInfo {
        wait_vf(&self.control, sandbox, what, f)
    }

    pub fn stop(mut self) {
        self.stop.take();
        self.thread.take().unwrap().join().unwrap().unwrap();
        // Clean shutdown: no socket left behind.
        let socks: Vec<_> = std::fs::read_dir(&self.dir)
            .unwrap()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "sock"))
            .collect();
        assert!(socks.is_empty(), "sockets left: {socks:?}");
        std::fs::remove_dir_all(&self.dir).unwrap();
    }
}

impl Drop for TestNic {
    /// A failed test still stops its daemon and removes its directory.
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.stop.take();
            let _ = t.join();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The SG function of `sandbox` as the control API lists it.
pub fn sg_of(c: &mut Client, sandbox: &str) -> VfInfo {
    c.list()
        .unwrap()
        .into_iter()
        .find(|v| v.kind == nic_api::DevKind::Sg && v.sandbox.as_deref() == Some(sandbox))
        .expect("the sandbox has an SG function")
}

/// Lists until the SG function of `sandbox` satisfies `f` (10 s at most).
pub fn wait_sg(c: &mut Client, sandbox: &str, what: &str, f: impl Fn(&VfInfo) -> bool) -> VfInfo {
    poll_until(&format!("SGF of {sandbox}"), what, || sg_of(c, sandbox), f)
}

/// Polls `get` on the daemon at `control` until the VF of `sandbox` satisfies `f`.
pub fn wait_vf(control: &Path, sandbox: &str, what: &str, f: impl Fn(&VfInfo) -> bool) -> VfInfo {
    let mut c = Client::connect(control).unwrap();
    poll_until(
        &format!("VF of {sandbox}"),
        what,
        || c.get_by_sandbox(sandbox).unwrap(),
        f,
    )
}

/// Reads `read` until its device satisfies `f`; fails naming `dev` after 10 s.
fn poll_until(
    dev: &str,
    what: &str,
    mut read: impl FnMut() -> VfInfo,
    f: impl Fn(&VfInfo) -> bool,
) -> VfInfo {
    crate::poll_until(&format!("{dev} {what}"), Duration::from_secs(10), || {
        let v = read();
        if f(&v) {
            Ok(v)
        } else {
            Err(format!("{v:?}"))
        }
    })
}

const CHILD_SOCKET_ENV: &str = "NIC_TEST_CHILD_SOCKET";

/// First line of a test that uses [`spawn_frontend_child`]: in the child,
/// connects a frontend to the VF socket and holds it until killed.
pub fn hold_frontend_if_child() {
    if let Ok(sock) = std::env::var(CHILD_SOCKET_ENV) {
        let _fe = SimFrontend::connect(Path::new(&sock), MIN_MEM).expect("child frontend connects");
        println!("CHILD-READY");
        loop {
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

/// Re-runs `test` of this binary as a child process holding a frontend on
/// `socket` (a process the test can SIGKILL); returns once it is connected.
pub fn spawn_frontend_child(test: &str, socket: &Path) -> Child {
    spawn_child(test, CHILD_SOCKET_ENV, socket)
}

/// Re-runs `test` of this binary with `env=value`; returns once the child
/// printed CHILD-READY.
pub fn spawn_child(test: &str, env: &str, value: &Path) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(env, value)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("CHILD-READY") {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "child frontend exited before connecting"
        );
    }
    child
}

/// A MAC as the tests hold it: text, or a VF's `VfInfo::mac`.
pub trait TestMac {
    fn mac(&self) -> MacAddr;
}

impl TestMac for str {
    fn mac(&self) -> MacAddr {
        self.parse().unwrap()
    }
}

impl TestMac for String {
    fn mac(&self) -> MacAddr {
        self.as_str().mac()
    }
}

impl TestMac for Option<MacAddr> {
    fn mac(&self) -> MacAddr {
        self.expect("a VF has a MAC")
    }
}

pub fn frame(
    dst: &(impl TestMac + ?Sized),
    src: &(impl TestMac + ?Sized),
    payload: &[u8],
) -> Vec<u8> {
    let mut f = dst.mac().to_vec();
    f.extend_from_slice(&*src.mac());
    f.extend_from_slice(&[0x88, 0xb5]); // local experimental ethertype
    f.extend_from_slice(payload);
    f
}

pub fn path_exists(p: &Path) -> bool {
    p.exists()
}

/// A raw AF_PACKET socket on one interface (the test's view of an uplink).
#[derive(Debug)]
pub struct PacketSocket(netutil::PacketSocket);

impl PacketSocket {
    pub fn open(ifname: &str) -> PacketSocket {
        let opts = netutil::PacketOptions {
            vlan_aux: true,
            recv_timeout: Some(Duration::from_millis(50)),
            ..Default::default()
        };
        PacketSocket(netutil::PacketSocket::open(ifname, opts).unwrap())
    }

    pub fn send(&self, frame: &[u8]) {
        let n = self.0.send(frame).unwrap();
        assert_eq!(n, frame.len(), "send on {}", self.0.ifname());
    }

    /// Next incoming frame with `ethertype` (at offset 12, or 16 after a VLAN tag).
    pub fn recv_type(&self, ethertype: u16, timeout: Duration) -> Option<Vec<u8>> {
        let end = Instant::now() + timeout;
        let mut buf = vec![0u8; 4096];
        while Instant::now() < end {
            let n = match self.0.recv(&mut buf) {
                Ok(Some(r)) if !r.outgoing && r.len >= 14 => r.len,
                _ => continue,
            };
            let f = &buf[..n];
            let t = u16::from_be_bytes([f[12], f[13]]);
            let inner = if t == 0x8100 && f.len() >= 18 {
                u16::from_be_bytes([f[16], f[17]])
            } else {
                t
            };
            if inner == ethertype {
                return Some(f.to_vec());
            }
        }
        None
    }
}

pub const TEST_ETHERTYPE: u16 = 0x88b5;

/// Receives frames on a test frontend until one has the test ethertype
/// (the kernel sends IPv6 noise on fresh links).
pub fn recv_test_frame(fe: &mut SimFrontend, timeout: Duration) -> Option<Vec<u8>> {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if let Some(f) = fe.recv(end - Instant::now()) {
            if f.len() >= 14 && u16::from_be_bytes([f[12], f[13]]) == TEST_ETHERTYPE {
                return Some(f);
            }
        }
    }
    None
}

pub fn sh(cmd: &str) {
    let st = Command::new("sh").arg("-c").arg(cmd).status().unwrap();
    assert!(st.success(), "{cmd}");
}

const CHILD_NIC_ENV: &str = "NIC_TEST_CHILD_NIC";

/// First line of a test that uses [`spawn_nic_child`]: in the child, runs a daemon (one PF,
/// two VFs, no uplink) on the directory and pool socket the parent passed, until killed.
pub fn run_nic_if_child() {
    if let Ok(v) = std::env::var(CHILD_NIC_ENV) {
        let (dir, pool) = v.split_once('\n').expect("dir and pool socket");
        let dir = PathBuf::from(dir);
        let args = NicConfig {
            pf: vec!["pf0".into()],
            vfs: vec![2],
            uplink: vec![],
            control: dir.join("ctl.sock"),
            state_dir: dir,
            devset_lock: LockPolicy::Hierarchical,
            socket_dir: None,
            batch: 32,
            dataplane_threads: 1,
            pool_socket: vec![PathBuf::from(pool)],
            control_max_connections: 256,
            control_idle_timeout: Duration::from_secs(60),
            sg: Default::default(),
        };
        let r = nic::daemon::run(&args);
        std::process::exit(i32::from(r.is_err()));
    }
}

/// Re-runs `test` of this binary as a NIC daemon process on `dir` (control socket
/// `dir/ctl.sock`, state kept there across restarts) registering pool memory with `pool`;
/// returns once its control socket answers.
pub fn spawn_nic_child(test: &str, dir: &Path, pool: &Path) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(
            CHILD_NIC_ENV,
            format!("{}\n{}", dir.display(), pool.display()),
        )
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_control(&mut child, &dir.join("ctl.sock"), Duration::from_secs(10));
    child
}

/// Waits (bounded by `limit`) until the NIC daemon `child` answers on its control socket;
/// panics if it exits first.
pub fn wait_control(child: &mut Child, control: &Path, limit: Duration) {
    let t0 = Instant::now();
    while Client::connect(control).is_err() {
        if let Some(st) = child.try_wait().unwrap() {
            panic!("burstvm nic exited: {st}");
        }
        assert!(t0.elapsed() < limit, "burstvm nic did not come up");
        std::thread::sleep(Duration::from_millis(10));
    }
}
