//! burstvm-cni as a service: the plugin's commands run in a long-lived
//! process (the NIC daemon, `burstvm nic --cni-socket`), asked over a unix
//! socket by `burstvm-cni-thin`, a forwarder without libc that the caller
//! execs in the plugin's place (as Multus' thick plugin and Cilium's do).
//!
//! Why: every exec of a static glibc executable here costs ~0.25 ms of CPU
//! before `main` (43 trapped CPUIDs at 3.55 µs in glibc's CPU-feature and
//! cache set-up, its relocations and first faults), the plugin's own binary
//! another ~0.1 ms to map, fault in and tear down; a burst pays that per
//! attachment (docs/results.md, "Startup CPU, round 18").
//!
//! The served command is the exec'd plugin's own code (`plugin::outcome`):
//! the same result, error result, exit status and stderr line, sent back
//! for the forwarder to print. Before it runs anything, the server sends
//! the error result the forwarder prints if the server then goes away
//! (TRY_AGAIN_LATER, in the config's `cniVersion`); a forwarder that gets
//! no such frame knows nothing was done and execs the full plugin instead.
//!
//! Wire format (little-endian lengths): request `MAGIC`, u32 + the CNI_*
//! variables as `NAME=VALUE` entries each ended by a NUL, u32 + the config;
//! reply u32 + the error result for a lost server, then i32 exit status,
//! u32 + stdout, u32 + stderr. `call` is the client for callers that are
//! processes of their own already (the runtime): no forwarder exec at all.

use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::env::Env;
use crate::error::{code, PluginError};
use crate::plugin::{self, MAX_STDIN};

mod client;
pub use client::{call, encode_request, NotServed, REPLY_TIMEOUT};

/// The first bytes of a request (version 1 of this format).
pub const MAGIC: &[u8; 4] = b"BVC1";
/// Most bytes of CNI_* variables a request may carry.
pub const MAX_ENV: usize = 64 << 10;
/// Requests served at once. Their work is mostly under the kernel's rtnl
/// lock and the NIC daemon's request loop, both one at a time: more
/// workers would only wait there.
pub const WORKERS: usize = 4;
/// Threads of the server are named `cni-serve-N` (the benches count their CPU by it).
pub const THREAD_PREFIX: &str = "cni-serve";
/// A client must send its request, and read the reply, within this.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("CNI server socket {}: {op}: {source}", .path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

/// The serving threads; dropping it stops them and removes the socket.
#[derive(Debug)]
pub struct CniServer {
    path: PathBuf,
    /// The socket file's (device, inode): a server started on the same path
    /// after this one (a restarted daemon) keeps its socket when this drops.
    file: (u64, u64),
    listener: UnixListener,
    stop: Arc<AtomicBool>,
    workers: Vec<JoinHandle<()>>,
}

impl CniServer {
    /// Binds `path` (a stale socket there is replaced), readable and
    /// writable by the owner only, and starts the workers.
    pub fn start(path: &Path) -> Result<CniServer, ServerError> {
        let err = |op| {
            let path = path.to_path_buf();
            move |source| ServerError::Io { path, op, source }
        };
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(err("remove the old one")(e))
            }
            _ => {}
        }
        let listener = UnixListener::bind(path).map_err(err("bind"))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(err("chmod 600"))?;
        let file = file_id(path).map_err(err("stat"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let mut workers = Vec::with_capacity(WORKERS);
        for i in 0..WORKERS {
            let l = listener.try_clone().map_err(err("clone the listener"))?;
            let (stop, socket) = (stop.clone(), path.to_path_buf());
            let w = std::thread::Builder::new()
                .name(format!("{THREAD_PREFIX}-{i}"))
                .spawn(move || worker(&l, &stop, &socket))
                .map_err(err("start a worker"))?;
            workers.push(w);
        }
        Ok(CniServer {
            path: path.to_path_buf(),
            file,
            listener,
            stop,
            workers,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for CniServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        use std::os::fd::AsRawFd;
        // Wakes every worker blocked in accept (which then fails: EINVAL).
        // SAFETY: shutdown(2) on the listener this value owns.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        if file_id(&self.path).is_ok_and(|f| f == self.file) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn file_id(path: &Path) -> io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).map(|m| (m.dev(), m.ino()))
}

fn worker(listener: &UnixListener, stop: &AtomicBool, socket: &Path) {
    while !stop.load(Ordering::Acquire) {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(_) if stop.load(Ordering::Acquire) => return,
            // EMFILE and the like: the next accept may succeed.
            Err(e) => {
                eprintln!("CNI server {}: accept: {e}", socket.display());
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        // A panic in the plugin's code ends that call (its client sees the
        // server go away), not the worker: the exec'd plugin would exit 101.
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve_one(stream, socket))) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("CNI server {}: {e}", socket.display()),
            Err(_) => eprintln!("CNI server {}: a call panicked", socket.display()),
        }
    }
}

/// One request, answered on `stream`.
fn serve_one(mut stream: UnixStream, socket: &Path) -> io::Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    // Only our own user (root) may have the plugin run for it: the plugin
    // changes network namespaces and takes VFs.
    let peer = nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(io::Error::from)?;
    let me = nix::unistd::geteuid().as_raw();
    if peer.uid() != me {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "client uid {} (pid {}) is not uid {me}; refused",
                peer.uid(),
                peer.pid()
            ),
        ));
    }
    let (env, stdin) = read_request(&mut stream)?;
    // At its caller's priority, as an exec'd plugin runs (the network pool's
    // refills are nice 19, idle-time work).
    let own = procutil::sched::thread_nice().unwrap_or(0);
    let nice = u32::try_from(peer.pid())
        .ok()
        .and_then(|pid| procutil::sched::nice_of(pid).ok())
        .unwrap_or(own);
    if nice != own {
        let _ = procutil::sched::set_thread_nice(nice);
    }
    let result = answer(&mut stream, socket, &env, stdin);
    if nice != own {
        let _ = procutil::sched::set_thread_nice(own);
    }
    result
}

/// The lost-server error result, the call, and its outcome, on `stream`.
fn answer(
    stream: &mut UnixStream,
    socket: &Path,
    env: &Env,
    stdin: Result<Vec<u8>, PluginError>,
) -> io::Result<()> {
    let lost = PluginError::new(
        code::TRY_AGAIN_LATER,
        "burstvm CNI server went away mid-call, try again later",
        format!("server {}", socket.display()),
    );
    let version = plugin::version_or_default(stdin.as_deref().unwrap_or_default());
    let mut reply = Vec::new();
    put_frame(
        &mut reply,
        format!("{}\n", lost.to_json(&version)).as_bytes(),
    );
    stream.write_all(&reply)?;
    let out = plugin::outcome("burstvm-cni", plugin::run, env, stdin);
    reply.clear();
    reply.extend_from_slice(&out.status.to_le_bytes());
    put_frame(&mut reply, &out.stdout);
    put_frame(&mut reply, &out.stderr);
    stream.write_all(&reply)
}

fn put_frame(out: &mut Vec<u8>, bytes: &[u8]) {
    let len = u32::try_from(bytes.len()).expect("a reply frame is far below 4 GiB");
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(bytes);
}

fn bad(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

/// Reads a u32 length, refused above `max`.
fn read_len(r: &mut impl Read, what: &str, max: usize) -> io::Result<usize> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    let n = u32::from_le_bytes(b) as usize;
    if n > max {
        return Err(bad(format!("{what}: {n} bytes, more than {max}; refused")));
    }
    Ok(n)
}

/// A request's environment and config. A config longer than `MAX_STDIN`
/// is refused as the exec'd plugin refuses it (DECODE_FAILURE, nothing
/// done): the forwarder sends at most one byte more than that.
pub fn read_request(r: &mut impl Read) -> io::Result<(Env, Result<Vec<u8>, PluginError>)> {
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Err(bad(format!(
            "not a burstvm CNI request (starts {magic:02x?})"
        )));
    }
    let n = read_len(r, "CNI_* variables", MAX_ENV)?;
    let mut vars = vec![0u8; n];
    r.read_exact(&mut vars)?;
    let n = read_len(r, "network config", MAX_STDIN + 1)?;
    let mut config = vec![0u8; n];
    r.read_exact(&mut config)?;
    let env = Env::from_vars(vars.split(|&b| b == 0).filter_map(|entry| {
        let (k, v) = std::str::from_utf8(entry).ok()?.split_once('=')?;
        Some((k.to_string(), v.to_string()))
    }));
    Ok((env, plugin::read_stdin(&config[..])))
}

#[cfg(test)]
mod tests;
