//! Containers in a Linux guest (docs/runtime.md, "Containers"): the guest
//! agent's initramfs (written once per agent binary), the kernel command
//! line that configures the agent, the OCI `process` of an image, and the
//! host side of one process run through the agent over the VMM's vsock
//! socket: its stdio relayed to ours, Ctrl-C forwarded, its exit status.

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agent_proto::{Client, ClientError, CreateProcess, Process, StreamKind, CONTROL_PORT};

use crate::Error;

/// How long connecting to the agent and each control request may take.
pub const AGENT_TIMEOUT: Duration = Duration::from_secs(30);

/// The guest agent binary when none is named: `$BURSTVM_AGENT`, else where
/// `scripts/build-agent.sh` leaves it beside this build of burstvm
/// (`target/x86_64-unknown-linux-gnu/agent/burstvm-agent` for
/// `target/x86_64-unknown-linux-gnu/{debug,release}/burstvm`), else
/// `burstvm-agent` beside the binary.
pub fn default_agent() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("BURSTVM_AGENT") {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    let candidates = [
        dir.join("../agent/burstvm-agent"),
        dir.join("burstvm-agent"),
    ];
    candidates.into_iter().find(|p| p.is_file())
}

/// The initramfs holding `agent` as /init, written once per agent binary
/// (by content) into `cache`: `cache/agent-<sha256 prefix>.cpio`.
pub fn initramfs(agent: &Path, cache: &Path) -> Result<PathBuf, Error> {
    let f = std::fs::File::open(agent).map_err(|source| Error::File {
        path: agent.to_path_buf(),
        what: "open the guest agent",
        source,
    })?;
    let digest = ::rootfs::oci::sha256_of(std::io::BufReader::new(f), agent)?;
    let hex = digest.trim_start_matches("sha256:");
    let out = cache.join(format!("agent-{}.cpio", &hex[..16]));
    if out.is_file() {
        return Ok(out);
    }
    std::fs::create_dir_all(cache).map_err(|source| Error::File {
        path: cache.to_path_buf(),
        what: "create the initramfs cache",
        source,
    })?;
    // Written aside and renamed: a concurrent run never reads half a file.
    let tmp = cache.join(format!(".agent-{}.{}.tmp", &hex[..16], std::process::id()));
    agent_proto::write_initramfs(agent, &tmp)?;
    std::fs::rename(&tmp, &out).map_err(|source| Error::File {
        path: out.clone(),
        what: "rename the initramfs into place",
        source,
    })?;
    Ok(out)
}

/// The guest's network as the agent configures it (the VMM's `ip` and
/// `gateway` of the sandbox's attachment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentNet {
    pub ip: std::net::Ipv4Addr,
    pub prefix_len: u32,
    pub gateway: Option<std::net::Ipv4Addr>,
}

impl AgentNet {
    /// The address and gateway of the VMM's parameters, if it has an address.
    pub fn from_params(vm: &vmm::VmParams) -> Option<AgentNet> {
        let (ip, mask) = vm.ip?;
        Some(AgentNet {
            ip,
            prefix_len: u32::from(mask).leading_ones(),
            gateway: vm.gateway,
        })
    }
}

/// The kernel command line of a container sandbox: the initramfs's agent
/// as init, the image (`/dev/vda`, EROFS) under the writable layer
/// (`/dev/vdb`, ext4), the network, the host name. `quiet`: every console
/// byte is a port-I/O exit, and the container's output goes over vsock.
pub fn agent_cmdline(net: Option<&AgentNet>, hostname: &str, pod: bool) -> String {
    let mut s = String::from(
        "reboot=k panic=1 pci=off nomodules quiet rdinit=/init \
         burstvm_ro=/dev/vda burstvm_rw=/dev/vdb",
    );
    if pod {
        s.push_str(" burstvm_pod=1");
    }
    if let Some(n) = net {
        s.push_str(&format!(" burstvm_net={}/{}", n.ip, n.prefix_len));
        if let Some(gw) = &n.gateway {
            s.push_str(&format!(" burstvm_gw={gw}"));
        }
    }
    let host: String = hostname
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .take(63)
        .collect();
    if !host.is_empty() {
        s.push_str(&format!(" burstvm_hostname={host}"));
    }
    s
}

/// The OCI `process` of `image` running `cmd` (Docker's rule: the
/// entrypoint, then `cmd` if given, else the image's cmd), with the image's
/// env (plus `HOME` from the user's passwd entry and `HOSTNAME` unless set),
/// working directory and user.
pub fn image_process(
    image: &::rootfs::Image,
    cmd: &[String],
    terminal: bool,
) -> Result<Process, Error> {
    let cfg = image.config();
    let user = image.exec_user();
    let mut env = cfg.env.clone();
    let has = |env: &[String], k: &str| env.iter().any(|e| e.split('=').next() == Some(k));
    if !has(&env, "PATH") {
        env.push("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    }
    if !has(&env, "HOME") {
        env.push(format!("HOME={}", user.home));
    }
    if terminal && !has(&env, "TERM") {
        env.push("TERM=xterm".into());
    }
    Ok(Process {
        terminal,
        args: image.args(cmd)?,
        env,
        cwd: if cfg.working_dir.is_empty() {
            "/".into()
        } else {
            cfg.working_dir.clone()
        },
        user: agent_proto::User {
            uid: user.uid,
            gid: user.gid,
            additional_gids: user.additional_gids.clone(),
            umask: None,
        },
        ..Process::default()
    })
}

/// The vsock socket of the running container sandbox `sandbox` (a
/// `burstvm run --kernel --keep-running`): `<state dir>/<sandbox>.vsock`
/// under any runtime's state directory in `/run/burstvm`.
pub fn find_vsock(sandbox: &str) -> Result<PathBuf, Error> {
    let bad_name = sandbox.is_empty() || sandbox.contains('/') || sandbox.starts_with('.');
    if bad_name {
        return Err(crate::bad(
            "SANDBOX",
            format!("{sandbox:?} is not a sandbox id"),
        ));
    }
    let root = Path::new(crate::instance::STATE_ROOT);
    let found = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.path().join(format!("{sandbox}.vsock")))
        .find(|p| p.exists());
    found.ok_or_else(|| {
        crate::bad(
            "SANDBOX",
            format!(
                "no running container sandbox {sandbox:?} (no {sandbox}.vsock under {})",
                root.display()
            ),
        )
    })
}

/// How a process's stdio meets ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stdio {
    /// Our stdin is piped to the process (`-i`); else it reads EOF.
    pub stdin: bool,
}

/// Runs one process through the agent of the sandbox whose VMM serves
/// `vsock`: creates it, relays its streams to our stdout/stderr (and our
/// stdin to it), starts it, forwards SIGTERM to it when `interrupted`
/// turns true, and returns its exit status (code, or 128+N after signal N)
/// once it exited and its output is drained. With `main`, the agent powers
/// the guest off afterwards (the caller's VMM then exits).
pub fn run_process(
    vsock: &Path,
    create: CreateProcess,
    stdio: Stdio,
    interrupted: &(dyn Fn() -> bool + Sync),
) -> Result<i32, Error> {
    let id = create.id.clone();
    let mut control = Client::connect_uds(vsock, CONTROL_PORT, AGENT_TIMEOUT)?;
    let mut create = create;
    create.stdin = stdio.stdin && !create.process.terminal;
    // A terminal gets our window's size, and our terminal goes raw meanwhile
    // (the guest's line discipline does the echo and editing).
    let _raw = match create.process.terminal {
        true => {
            if create.process.console_size.is_none() {
                create.process.console_size = window_size();
            }
            RawTerminal::enter()
        }
        false => None,
    };
    control.create_process(&create)?;
    let mut pumps = Vec::new();
    for kind in create.streams() {
        let s = control.attach_stream(&id, kind)?;
        match kind {
            StreamKind::Stdout => pumps.push(pump_out(s, std::io::stdout())),
            StreamKind::Stderr => pumps.push(pump_out(s, std::io::stderr())),
            StreamKind::Stdin => pump_in(s, stdio.stdin),
            StreamKind::Pty => {
                let input = s.try_clone().map_err(|source| Error::File {
                    path: vsock.to_path_buf(),
                    what: "clone the terminal stream",
                    source,
                })?;
                pump_in(input, stdio.stdin);
                pumps.push(pump_out(s, std::io::stdout()));
            }
        }
    }
    control.start_process(&id)?;
    // The wait blocks its connection: one of its own, so that the control
    // connection stays free for signals.
    let mut waiter = Client::connect_uds(vsock, CONTROL_PORT, AGENT_TIMEOUT)?;
    let done = Arc::new(AtomicBool::new(false));
    let exit = std::thread::scope(|scope| {
        let forward = scope.spawn(|| -> Result<(), ClientError> {
            while !done.load(Ordering::Acquire) {
                if interrupted() {
                    control.signal_process(&id, libc::SIGTERM)?;
                    // One signal per interrupt; a second Ctrl-C sends another.
                    while interrupted() && !done.load(Ordering::Acquire) {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(())
        });
        let exit = waiter.wait_process(&id, None);
        done.store(true, Ordering::Release);
        let fwd = forward.join().expect("signal forwarder panicked");
        (exit, fwd)
    });
    let status = exit.0?.status;
    // A signal that raced with the exit is not an error of the run.
    let _ = exit.1;
    for p in pumps {
        let _ = p.join();
    }
    if create.main {
        control.shutdown()?;
    }
    Ok(status)
}

/// `burstvm exec`: a further process in a running container sandbox.
#[derive(Debug, Clone)]
pub struct ExecConfig {
    /// The sandbox id (its socket is found with `find_vsock`), unless `vsock`.
    pub sandbox: Option<String>,
    /// The sandbox VMM's vsock socket.
    pub vsock: Option<PathBuf>,
    pub command: Vec<String>,
    /// `KEY=VALUE` added to the default environment (PATH, HOME=/).
    pub env: Vec<String>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    pub interactive: bool,
    pub tty: bool,
}

/// Runs `cfg.command` in the sandbox; its exit status.
pub fn exec_cli(cfg: &ExecConfig) -> Result<i32, Error> {
    crate::instance::install_sigint_handler();
    let vsock = match (&cfg.vsock, &cfg.sandbox) {
        (Some(p), _) => p.clone(),
        (None, Some(sb)) => find_vsock(sb)?,
        (None, None) => return Err(crate::bad("SANDBOX", "name the sandbox or its --vsock")),
    };
    if cfg.command.is_empty() {
        return Err(crate::bad("CMD", "nothing to run (give it after --)"));
    }
    let mut env = vec![
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
        "HOME=/".to_string(),
    ];
    if cfg.tty {
        env.push("TERM=xterm".into());
    }
    env.extend(cfg.env.iter().cloned());
    let process = Process {
        terminal: cfg.tty,
        args: cfg.command.clone(),
        env,
        cwd: cfg.cwd.clone(),
        user: agent_proto::User {
            uid: cfg.uid,
            gid: cfg.gid,
            ..Default::default()
        },
        ..Process::default()
    };
    static EXECS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let id = format!(
        "exec-{}-{}",
        std::process::id(),
        EXECS.fetch_add(1, Ordering::Relaxed)
    );
    run_process(
        &vsock,
        CreateProcess::new(id, process),
        Stdio {
            stdin: cfg.interactive,
        },
        &crate::instance::sigint_received,
    )
}

/// Our terminal's size (stdout's), if it is one.
fn window_size() -> Option<agent_proto::ConsoleSize> {
    let mut ws = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one winsize into `ws`, which outlives the call.
    let r = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut ws) };
    (r == 0 && ws.ws_row > 0).then_some(agent_proto::ConsoleSize {
        height: ws.ws_row,
        width: ws.ws_col,
    })
}

/// Our stdin in raw mode while a terminal process runs; restored on drop.
struct RawTerminal(nix::sys::termios::Termios);

impl RawTerminal {
    fn enter() -> Option<RawTerminal> {
        use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg};
        let stdin = std::io::stdin();
        let saved = tcgetattr(&stdin).ok()?;
        let mut raw = saved.clone();
        cfmakeraw(&mut raw);
        tcsetattr(&stdin, SetArg::TCSANOW, &raw).ok()?;
        Some(RawTerminal(saved))
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        use nix::sys::termios::{tcsetattr, SetArg};
        let _ = tcsetattr(std::io::stdin(), SetArg::TCSANOW, &self.0);
    }
}

/// Copies the process's output to `out` until its EOF.
fn pump_out<W: Write + Send + 'static>(
    mut s: UnixStream,
    mut out: W,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = [0u8; 16 << 10];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if out.write_all(&buf[..n]).and_then(|_| out.flush()).is_err() {
                        break;
                    }
                }
            }
        }
    })
}

/// Copies our stdin to the process (if `pipe`), then half-closes: the
/// process reads EOF. Not joined: our stdin may never end.
fn pump_in(mut s: UnixStream, pipe: bool) {
    std::thread::spawn(move || {
        if pipe {
            let mut stdin = std::io::stdin().lock();
            let mut buf = [0u8; 16 << 10];
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if s.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                }
            }
        }
        let _ = s.shutdown(Shutdown::Write);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_configures_the_agent() {
        let vm = vmm::VmParams {
            net: vec!["vf:/x".parse().unwrap()],
            ip: Some((
                "10.1.0.5".parse().unwrap(),
                "255.255.255.0".parse().unwrap(),
            )),
            gateway: Some("10.1.0.1".parse().unwrap()),
            ..vmm::VmParams::new("sb")
        };
        let net = AgentNet::from_params(&vm).unwrap();
        let s = agent_cmdline(Some(&net), "bvm_run.no-net", false);
        assert!(s.contains("rdinit=/init"), "{s}");
        assert!(s.contains("burstvm_ro=/dev/vda burstvm_rw=/dev/vdb"), "{s}");
        assert!(
            s.contains("burstvm_net=10.1.0.5/24 burstvm_gw=10.1.0.1"),
            "{s}"
        );
        // A host name is letters, digits and dashes.
        assert!(s.ends_with("burstvm_hostname=bvmrunno-net"), "{s}");
        assert!(AgentNet::from_params(&vmm::VmParams::new("sb")).is_none());
        assert!(!agent_cmdline(None, "a", false).contains("burstvm_net"));
        assert!(!s.contains("burstvm_pod"));
        assert!(agent_cmdline(None, "a", true).contains(" burstvm_pod=1"));
    }

    #[test]
    fn the_initramfs_is_written_once_per_agent_binary() {
        let dir = tempfile::tempdir().unwrap();
        let agent = dir.path().join("agent");
        std::fs::write(&agent, b"\x7fELF not really").unwrap();
        let a = initramfs(&agent, &dir.path().join("cache")).unwrap();
        let b = initramfs(&agent, &dir.path().join("cache")).unwrap();
        assert_eq!(a, b);
        std::fs::write(&agent, b"\x7fELF another").unwrap();
        let c = initramfs(&agent, &dir.path().join("cache")).unwrap();
        assert_ne!(a, c);
        let e = initramfs(&dir.path().join("missing"), dir.path())
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing"), "{e}");
    }
}
