//! The NIC daemon the runtime starts (`burstvm nic`, a child process in its
//! own process group that dies with the runtime: forked on a keeper thread
//! the `NicDaemon` owns, `crate::child`), one per devset lock policy.

use procutil::spawn::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::child::Keeper;
use crate::instance::{pf_plan, Runtime, RuntimeError};
use crate::variant::DevsetLock;

/// How long `exited_or_exiting` waits for a daemon that refuses connections to exit.
const DYING_WAIT: Duration = Duration::from_secs(5);

/// The NIC daemon child, with the lock policy it was started with.
#[derive(Debug)]
pub struct NicDaemon {
    child: Child,
    /// The thread the daemon was forked on; dropped after it is reaped.
    _keeper: Keeper,
    pub lock: DevsetLock,
}

impl NicDaemon {
    pub(crate) fn spawn(rt: &Runtime, lock: DevsetLock) -> Result<NicDaemon, RuntimeError> {
        let err = |reason: String| RuntimeError::Nic {
            bin: rt.bin().to_path_buf(),
            reason,
        };
        let sock = rt.nic_socket();
        let _ = std::fs::remove_file(&sock);
        // Appended: the log of a daemon that crashed stays for the one restarted after it.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(rt.state_dir().join("nic.log"))
            .map_err(|source| RuntimeError::NicLog {
                bin: rt.bin().to_path_buf(),
                source,
            })?;
        let mut cmd = Command::new(rt.bin());
        cmd.arg("nic");
        // One uplink per PF, each a port of the server bridge.
        for ((pf, vfs), uplink) in pf_plan(rt.config().vfs)
            .iter()
            .zip(rt.server().uplink_ifs())
        {
            cmd.args(["--pf", pf, "--vfs", &vfs.to_string()])
                .arg("--uplink")
                .arg(format!("veth:{}/{uplink}", rt.server().netns_name()));
        }
        cmd.args(["--devset-lock", lock.as_arg()])
            .args(["--sgfs", &rt.config().sgfs.to_string()])
            .arg("--control")
            .arg(&sock)
            .arg("--cni-socket")
            .arg(rt.cni_socket())
            .arg("--state-dir")
            .arg(rt.state_dir().join("nic"))
            // VF memory tables hold pool memory: the NIC registers it with our pool so
            // that it is never recycled while the NIC maps it.
            .args(
                rt.pool_socket()
                    .map(|p| ["--pool-socket".as_ref(), p.as_os_str()])
                    .into_iter()
                    .flatten(),
            )
            .stdin(Stdio::Null)
            .stdout(Stdio::Null)
            .stderr(log);
        // SAFETY: the closure only makes async-signal-safe system calls.
        unsafe {
            cmd.pre_exec(crate::child::own_group_dying_with_parent);
        }
        // Not on the caller's thread: the daemon lives as long as its handle.
        let (mut child, keeper) =
            crate::child::spawn_kept(cmd, "nic").map_err(|source| RuntimeError::NicSpawn {
                bin: rt.bin().to_path_buf(),
                source,
            })?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if nic_api::Client::connect(&sock).is_ok() {
                return Ok(NicDaemon {
                    child,
                    _keeper: keeper,
                    lock,
                });
            }
            if let Ok(Some(st)) = child.try_wait() {
                let log =
                    std::fs::read_to_string(rt.state_dir().join("nic.log")).unwrap_or_default();
                return Err(err(format!("exited with {st}: {}", log.trim())));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(err(format!(
                    "control socket {} did not appear within 20 s",
                    sock.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL and reap (a crash); returns the instant of the kill.
    pub(crate) fn kill(mut self) -> Instant {
        let t = Instant::now();
        let _ = self.child.kill();
        let _ = self.child.wait();
        t
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the daemon has exited (it is reaped then).
    pub(crate) fn exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// As `exited`, for a daemon killed a moment ago: one whose control
    /// socket `control` refuses connections has closed its files but may
    /// not be reapable yet, so its exit is waited for (`DYING_WAIT` at most).
    pub(crate) fn exited_or_exiting(&mut self, control: &std::path::Path) -> bool {
        if self.exited() {
            return true;
        }
        match nic_api::connect_timeout(control, Duration::from_millis(500)) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
            _ => return false,
        }
        let end = Instant::now() + DYING_WAIT;
        while Instant::now() < end {
            if self.exited() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }

    pub(crate) fn stop(self) {
        // SIGTERM first so that it removes its sockets; SIGKILL if it hangs.
        crate::child::stop_child(self.child, Duration::from_secs(5));
    }
}
