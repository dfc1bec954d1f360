//! DPDK's `dpdk-testpmd` as a foreign peer of the NIC (Debian's `dpdk-dev`):
//! a child process driven through its interactive prompt on stdin, and the
//! 2 MiB hugepages it needs, reserved for the peer's lifetime and given back.
//! Used by `bench dataplane --peer dpdk` and the interop test
//! (nic/tests/dpdk_virtio_user.rs).
//!
//! testpmd runs with `--no-pci --in-memory --single-file-segments`: no device
//! is touched, no file is left in /dev/hugepages or /var/run/dpdk (its memory
//! is hugetlb memfds, which is what its virtio-user ports give a vhost-user
//! backend), one fd per memory segment list so the memory table fits the
//! protocol's 8 regions.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

pub use crate::hugepages::Hugepages;

/// The binary, found on PATH.
pub const TESTPMD: &str = "dpdk-testpmd";
/// Hugepages one testpmd of ours takes at most (4096 mbufs of 2 KiB data
/// room plus rings and EAL heap: about 15 are used).
pub const PAGES_PER_TESTPMD: u64 = 48;

#[derive(Debug, thiserror::Error)]
pub enum TestpmdError {
    #[error("CPU time of process {pid}: {source}")]
    Cpu {
        pid: u32,
        #[source]
        source: procutil::schedstat::SchedstatError,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Hugepages(#[from] crate::hugepages::HugepagesError),
    #[error("testpmd {name}: {reason}; its output ends with:\n{tail}")]
    Peer {
        name: String,
        reason: String,
        tail: String,
    },
}

/// Whether `dpdk-testpmd` is on PATH (the interop test says why it skips).
pub fn find() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(TESTPMD))
        .find(|p| p.is_file())
}

/// Everything the child printed, shared with the thread that reads it.
#[derive(Debug, Default)]
struct Output {
    /// stdout: prompts and command output, in order.
    text: Mutex<String>,
    /// stderr, apart: written concurrently, it could split a prompt.
    err: Mutex<String>,
    grew: Condvar,
}

/// A running `dpdk-testpmd -i`; killed and reaped on drop.
#[derive(Debug)]
pub struct Testpmd {
    name: String,
    child: Child,
    stdin: ChildStdin,
    out: Arc<Output>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

/// The frontend's or backend's port counters (`show port stats`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PortStats {
    pub rx_packets: u64,
    pub tx_packets: u64,
}

const PROMPT: &str = "testpmd> ";
const T: Duration = Duration::from_secs(20);

impl Testpmd {
    /// Starts testpmd with both of its lcores (main, forwarding) on `cpu`,
    /// the `vdevs` as its ports and `app` as testpmd's own arguments (after
    /// `-- -i`), and waits for its prompt. `name` makes its file prefix
    /// unique (with our pid).
    pub fn spawn(
        name: &str,
        cpu: usize,
        vdevs: &[String],
        app: &[&str],
    ) -> Result<Self, TestpmdError> {
        // testpmd prints with stdio, the prompt and the echo of the command
        // line with write(2): unbuffered stdout keeps them in order on a pipe
        // (stdbuf execs testpmd, so the child's pid is testpmd's).
        let mut cmd = Command::new("stdbuf");
        cmd.args(["-o0", TESTPMD])
            .arg(format!("--lcores=0@{cpu},1@{cpu}"))
            .args(["--no-pci", "--in-memory", "--single-file-segments"])
            .arg(format!(
                "--file-prefix=burstvm-{name}-{}",
                std::process::id()
            ))
            .args(["--log-level=lib.eal:warning"]);
        for v in vdevs {
            cmd.arg(format!("--vdev={v}"));
        }
        cmd.args(["--", "-i", "--total-num-mbufs=4096"])
            .args(app)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // The peer dies with us.
        procutil::die_with_parent(&mut cmd);
        let mut child = cmd.spawn().map_err(|source| TestpmdError::Io {
            what: format!("spawn {TESTPMD} ({name})"),
            source,
        })?;
        let out = Arc::new(Output::default());
        let mut readers = Vec::new();
        let pipes: [Box<dyn Read + Send>; 2] = [
            Box::new(child.stdout.take().expect("piped")),
            Box::new(child.stderr.take().expect("piped")),
        ];
        for (is_stdout, mut pipe) in [true, false].into_iter().zip(pipes) {
            let out = out.clone();
            readers.push(std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    let into = if is_stdout { &out.text } else { &out.err };
                    into.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push_str(&String::from_utf8_lossy(&buf[..n]));
                    out.grew.notify_all();
                }
            }));
        }
        let stdin = child.stdin.take().expect("piped");
        let mut t = Testpmd {
            name: name.into(),
            child,
            stdin,
            out,
            readers,
        };
        t.wait_for(0, PROMPT, T)?;
        Ok(t)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn fail(&self, reason: String) -> TestpmdError {
        let text = format!(
            "{}\n[stderr]\n{}",
            self.out.text.lock().unwrap_or_else(PoisonError::into_inner),
            self.out.err.lock().unwrap_or_else(PoisonError::into_inner)
        );
        let tail: String = text
            .lines()
            .rev()
            .take(25)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        TestpmdError::Peer {
            name: self.name.clone(),
            reason,
            tail,
        }
    }

    /// Waits until the output after byte `from` contains `pat`; returns the
    /// end of the match.
    fn wait_for(
        &mut self,
        from: usize,
        pat: &str,
        timeout: Duration,
    ) -> Result<usize, TestpmdError> {
        let end = Instant::now() + timeout;
        let mut text = self.out.text.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(i) = text.get(from..).and_then(|t| t.find(pat)) {
                return Ok(from + i + pat.len());
            }
            let now = Instant::now();
            let exited = matches!(self.child.try_wait(), Ok(Some(_)));
            if now >= end || exited {
                drop(text);
                let why = if exited { "exited" } else { "timed out" };
                return Err(self.fail(format!("{why} waiting for {pat:?}")));
            }
            text = self
                .out
                .grew
                .wait_timeout(text, end - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Sends one command line and waits for the next prompt; returns what
    /// the command printed.
    pub fn cmd(&mut self, line: &str) -> Result<String, TestpmdError> {
        let from = self
            .out
            .text
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len();
        writeln!(self.stdin, "{line}").map_err(|source| TestpmdError::Io {
            what: format!("testpmd {}: write {line:?}", self.name),
            source,
        })?;
        // The echo of the command line is followed by its output and a prompt.
        let done = self.wait_for(from, PROMPT, T)?;
        let text = self.out.text.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(text[from..done].to_string())
    }

    /// `show port stats PORT`.
    pub fn port_stats(&mut self, port: u16) -> Result<PortStats, TestpmdError> {
        let out = self.cmd(&format!("show port stats {port}"))?;
        let field = |name: &str| {
            out.split(name)
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
        };
        match (field("RX-packets:"), field("TX-packets:")) {
            (Some(rx_packets), Some(tx_packets)) => Ok(PortStats {
                rx_packets,
                tx_packets,
            }),
            _ => Err(self.fail(format!("no port {port} statistics in {out:?}"))),
        }
    }

    /// `quit`: testpmd stops its ports (closing its vhost-user sessions) and
    /// exits; killed if it does not within the bound.
    pub fn quit(mut self) -> Result<(), TestpmdError> {
        let _ = writeln!(self.stdin, "quit");
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            if let Ok(Some(_)) = self.child.try_wait() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(self.fail("did not exit within 10 s of quit".into()))
    }
}

impl Drop for Testpmd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }
}

/// CPU time (ns) all threads of process `pid` have run.
pub fn process_cpu_ns(pid: u32) -> Result<u64, TestpmdError> {
    procutil::schedstat::live_threads_ns(pid).map_err(|source| TestpmdError::Cpu { pid, source })
}
