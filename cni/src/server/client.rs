//! The server's client in Rust: what `burstvm-cni-thin` does, for a caller
//! that is already a process of its own (the runtime), so that a served
//! call costs no exec at all. Same wire format, same answers: the plugin's
//! outcome, the error result sent ahead if the server goes away mid-call,
//! and `NotServed` (nothing was done) where the forwarder would exec the
//! full plugin instead.

use std::ffi::OsStr;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{put_frame, read_len, MAGIC, MAX_ENV};
use crate::plugin::{Outcome, MAX_STDIN};

/// How long a reply may take: the forwarder's bound (thin.c's
/// `REPLY_TIMEOUT_S`). An ADD waits behind the rtnl lock and the NIC
/// daemon's request loop, which a 200-way burst keeps busy for seconds.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(120);
/// Most bytes of a result or of stderr taken from a server (the forwarder's `MAX_OUT`).
const MAX_OUT: usize = 2 << 20;
/// Most bytes of the lost-server error result (the forwarder's `MAX_LOST`).
const MAX_LOST: usize = 64 << 10;

/// The server never had the call: nothing was done, the exec'd plugin may run it.
#[derive(Debug, thiserror::Error)]
#[error("CNI server {}: {op}: {source}", .socket.display())]
pub struct NotServed {
    pub socket: PathBuf,
    pub op: &'static str,
    #[source]
    pub source: io::Error,
}

/// A request: the `NAME=VALUE` variables (each NUL-terminated) and the config.
/// A variable holding a NUL cannot be sent (nor exec'd): `InvalidInput`.
pub fn encode_request(vars: &[(&str, &OsStr)], config: &[u8]) -> io::Result<Vec<u8>> {
    let mut env = Vec::new();
    for (k, v) in vars {
        let v = v.as_bytes();
        if k.contains(['\0', '=']) || v.contains(&0) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("variable {k:?} holds a NUL or its name an '='"),
            ));
        }
        env.extend_from_slice(k.as_bytes());
        env.push(b'=');
        env.extend_from_slice(v);
        env.push(0);
    }
    if env.len() > MAX_ENV {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} bytes of variables, more than {MAX_ENV}", env.len()),
        ));
    }
    let mut r = MAGIC.to_vec();
    put_frame(&mut r, &env);
    // One byte over the plugin's bound is enough for the server to refuse it
    // as the exec'd plugin does (DECODE_FAILURE).
    put_frame(&mut r, &config[..config.len().min(MAX_STDIN + 1)]);
    Ok(r)
}

/// Has the server at `socket` run the plugin's command with `vars` (the
/// CNI_* variables) and `config` (its stdin). `Ok` is what to act on as the
/// plugin's exit status, stdout and stderr: if the server took the call
/// and went away before answering, exit status 1 and the TRY_AGAIN_LATER
/// result it sent ahead.
pub fn call(socket: &Path, vars: &[(&str, &OsStr)], config: &[u8]) -> Result<Outcome, NotServed> {
    let not = |op| {
        let socket = socket.to_path_buf();
        move |source| NotServed { socket, op, source }
    };
    let req = encode_request(vars, config).map_err(not("encode the request"))?;
    let mut s = UnixStream::connect(socket).map_err(not("connect"))?;
    s.set_read_timeout(Some(REPLY_TIMEOUT))
        .and_then(|()| s.set_write_timeout(Some(REPLY_TIMEOUT)))
        .map_err(not("set timeouts"))?;
    send_all(&s, &req).map_err(not("send the request"))?;
    let lost = frame(&mut s, "lost-server result", MAX_LOST).map_err(not("read the reply"))?;
    Ok(outcome(&mut s).unwrap_or(Outcome {
        status: 1,
        stdout: lost,
        stderr: Vec::new(),
    }))
}

/// Without SIGPIPE: a server that refuses the request mid-send (a bound it
/// enforces) closes the socket, which is an error here, not a signal.
fn send_all(s: &UnixStream, mut buf: &[u8]) -> io::Result<()> {
    use nix::sys::socket::{send, MsgFlags};
    use std::os::fd::AsRawFd;
    while !buf.is_empty() {
        match send(s.as_raw_fd(), buf, MsgFlags::MSG_NOSIGNAL) {
            Ok(n) => buf = &buf[n..],
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

pub(super) fn frame(r: &mut impl Read, what: &str, max: usize) -> io::Result<Vec<u8>> {
    let n = read_len(r, what, max)?;
    let mut b = vec![0; n];
    r.read_exact(&mut b)?;
    Ok(b)
}

/// The status, stdout and stderr after the lost-server result.
pub(super) fn outcome(r: &mut impl Read) -> io::Result<Outcome> {
    let mut st = [0u8; 4];
    r.read_exact(&mut st)?;
    Ok(Outcome {
        status: i32::from_le_bytes(st),
        stdout: frame(r, "result", MAX_OUT)?,
        stderr: frame(r, "stderr", MAX_OUT)?,
    })
}
