//! `exec -i`/`-t`: the Exec call's URL is containerd's streaming server
//! (kubelet's, vendored), which takes SPDY or WebSocket. This speaks the
//! WebSocket side with the `v4.channel.k8s.io` protocol: each binary
//! message is one channel byte (0 stdin, 1 stdout, 2 stderr, 3 the final
//! status as JSON, 4 terminal size as JSON) and its data. The protocol has
//! no way to close stdin alone (v5 added one; containerd 1.6 predates it):
//! a command that reads to EOF does not see it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

const PROTOCOL: &str = "v4.channel.k8s.io";
const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const STATUS: u8 = 3;
const RESIZE: u8 = 4;
/// No sane message is bigger; a larger length means a broken stream.
const MAX_MESSAGE: u64 = 64 << 20;

fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    // SAFETY: getrandom(2) writes at most N bytes into the buffer.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), N, 0) };
    if n != N as isize {
        // Masking keys and the nonce need not be secret on a local
        // connection; the clock will do if getrandom cannot.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
            .to_le_bytes();
        for (i, x) in b.iter_mut().enumerate() {
            *x = t[i % t.len()];
        }
    }
    b
}

fn base64(b: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for c in b.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                s.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

/// One client frame (FIN set, masked as a client must).
fn frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(payload.len() + 14);
    f.push(0x80 | opcode);
    let n = payload.len();
    if n < 126 {
        f.push(0x80 | n as u8);
    } else if n <= 0xffff {
        f.push(0x80 | 126);
        f.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        f.push(0x80 | 127);
        f.extend_from_slice(&(n as u64).to_be_bytes());
    }
    let mask: [u8; 4] = random();
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

/// One frame from the server: (fin, opcode, payload).
fn read_frame(r: &mut impl Read) -> std::io::Result<(bool, u8, Vec<u8>)> {
    let mut h = [0u8; 2];
    r.read_exact(&mut h)?;
    let mut n = (h[1] & 0x7f) as u64;
    if n == 126 {
        let mut b = [0u8; 2];
        r.read_exact(&mut b)?;
        n = u16::from_be_bytes(b) as u64;
    } else if n == 127 {
        let mut b = [0u8; 8];
        r.read_exact(&mut b)?;
        n = u64::from_be_bytes(b);
    }
    if n > MAX_MESSAGE {
        return Err(std::io::Error::other(format!("a {n}-byte WebSocket frame")));
    }
    let mask = if h[1] & 0x80 != 0 {
        let mut m = [0u8; 4];
        r.read_exact(&mut m)?;
        Some(m)
    } else {
        None
    };
    let mut p = vec![0u8; n as usize];
    r.read_exact(&mut p)?;
    if let Some(m) = mask {
        p.iter_mut().enumerate().for_each(|(i, b)| *b ^= m[i % 4]);
    }
    Ok((h[0] & 0x80 != 0, h[0] & 0x0f, p))
}

/// The exit status in the final status message: 0 for Success, the
/// command's for NonZeroExitCode, an error for anything else.
pub fn exit_status(json: &[u8]) -> Result<u8> {
    let v: serde_json::Value =
        serde_json::from_slice(json).with_context(|| format!("status {json:?}"))?;
    if v["status"] == "Success" {
        return Ok(0);
    }
    if v["reason"] == "NonZeroExitCode" {
        if let Some(code) = v["details"]["causes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["reason"] == "ExitCode")
            .and_then(|c| c["message"].as_str())
            .and_then(|m| m.parse::<i64>().ok())
        {
            return Ok(code.clamp(0, 255) as u8);
        }
    }
    bail!("{}", v["message"].as_str().unwrap_or(&v.to_string()))
}

/// The terminal size of stdout, if it is one.
fn window_size() -> Option<(u16, u16)> {
    let mut w = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes a winsize into `w`.
    let r = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut w) };
    (r == 0 && w.ws_col > 0).then_some((w.ws_col, w.ws_row))
}

/// Puts stdin's terminal into raw mode while alive (keys go to the
/// container's terminal as typed, ^C and ^D included).
struct RawMode(Option<nix::sys::termios::Termios>);

impl RawMode {
    fn enter() -> RawMode {
        use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg};
        let stdin = std::io::stdin();
        let Ok(old) = tcgetattr(stdin.as_fd()) else {
            return RawMode(None);
        };
        let mut raw = old.clone();
        cfmakeraw(&mut raw);
        if tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw).is_err() {
            return RawMode(None);
        }
        RawMode(Some(old))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if let Some(old) = &self.0 {
            let _ = nix::sys::termios::tcsetattr(
                std::io::stdin().as_fd(),
                nix::sys::termios::SetArg::TCSANOW,
                old,
            );
        }
    }
}

/// Sends stdin (and, with a terminal, its size as it changes) until stdin ends.
fn pump_stdin(w: Arc<Mutex<TcpStream>>, stdin: bool, tty: bool) {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let send = |ch: u8, data: &[u8]| {
        let mut m = Vec::with_capacity(data.len() + 1);
        m.push(ch);
        m.extend_from_slice(data);
        let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
        w.write_all(&frame(0x2, &m))
    };
    let mut size = None;
    let mut buf = [0u8; 8192];
    let fd = std::io::stdin();
    loop {
        if tty {
            let now = window_size();
            if now.is_some() && now != size {
                size = now;
                let (w, h) = now.unwrap_or_default();
                let msg = format!(r#"{{"Width":{w},"Height":{h}}}"#);
                if send(RESIZE, msg.as_bytes()).is_err() {
                    return;
                }
            }
        }
        if !stdin {
            // Only the size to watch: a resize shows within this period.
            std::thread::sleep(Duration::from_millis(250));
            continue;
        }
        let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(250u16)) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return,
        }
        match nix::unistd::read(libc::STDIN_FILENO, &mut buf) {
            Ok(0) | Err(_) if !tty => return,
            Ok(0) | Err(_) => {
                // With a terminal there is still the size to watch.
                std::thread::sleep(Duration::from_millis(250));
                continue;
            }
            Ok(n) => {
                if send(STDIN, &buf[..n]).is_err() {
                    return;
                }
            }
        }
    }
}

/// Runs the exec that `url` (from the Exec call) stands for; returns the
/// command's exit status.
pub fn stream(url: &str, stdin: bool, tty: bool) -> Result<u8> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow!("exec URL {url}: only http:// is spoken here"))?;
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let sock = TcpStream::connect(host).with_context(|| format!("connect to {url}"))?;
    let _ = sock.set_nodelay(true);
    let key = base64(&random::<16>());
    write!(
        &sock,
        "GET /{path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\
         Sec-WebSocket-Protocol: {PROTOCOL}\r\n\r\n"
    )
    .with_context(|| format!("WebSocket handshake to {url}"))?;
    let mut r = BufReader::new(sock.try_clone().context("clone socket")?);
    let mut status_line = String::new();
    r.read_line(&mut status_line)
        .with_context(|| format!("WebSocket handshake with {url}"))?;
    let mut headers = Vec::new();
    loop {
        let mut l = String::new();
        if r.read_line(&mut l).context("WebSocket handshake")? == 0 || l.trim().is_empty() {
            break;
        }
        headers.push(l.trim().to_string());
    }
    if status_line.split_whitespace().nth(1) != Some("101") {
        bail!(
            "{url}: the streaming server refused a WebSocket ({PROTOCOL}): {}",
            status_line.trim()
        );
    }
    let w = Arc::new(Mutex::new(sock));
    let _raw = (tty && stdin).then(RawMode::enter);
    if stdin || tty {
        let w = w.clone();
        // Left blocked in poll when the command ends; the process exits.
        std::thread::spawn(move || pump_stdin(w, stdin, tty));
    }
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    let mut message = Vec::new();
    loop {
        let (fin, op, p) = match read_frame(&mut r) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                bail!("{url}: the stream ended without the command's status")
            }
            Err(e) => return Err(e).with_context(|| format!("{url}: read")),
        };
        match op {
            0x0..=0x2 => message.extend_from_slice(&p),
            0x8 => bail!("{url}: the stream was closed without the command's status"),
            0x9 => {
                let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
                w.write_all(&frame(0xA, &p)).context("pong")?;
                continue;
            }
            _ => continue,
        }
        if !fin {
            continue;
        }
        let m = std::mem::take(&mut message);
        let Some((&ch, data)) = m.split_first() else {
            continue;
        };
        match ch {
            STDOUT => {
                out.write_all(data).context("write stdout")?;
                out.flush().context("flush stdout")?;
            }
            STDERR => err.write_all(data).context("write stderr")?,
            // The last message: the stream closes after it.
            STATUS if !data.is_empty() => return exit_status(data),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_pads() {
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(&[0xff; 16]), "/////////////////////w==");
    }

    #[test]
    fn a_client_frame_reads_back_unmasked() {
        for n in [0usize, 5, 125, 126, 70000] {
            let p: Vec<u8> = (0..n).map(|i| i as u8).collect();
            let f = frame(0x2, &p);
            assert_eq!(f[1] & 0x80, 0x80, "masked");
            let (fin, op, back) = read_frame(&mut f.as_slice()).unwrap();
            assert!(fin);
            assert_eq!(op, 0x2);
            assert_eq!(back, p);
        }
    }

    #[test]
    fn exit_status_from_the_status_message() {
        assert_eq!(
            exit_status(br#"{"metadata":{},"status":"Success"}"#).unwrap(),
            0
        );
        let failed = br#"{"metadata":{},"status":"Failure","message":"command terminated with non-zero exit code: exit status 7","reason":"NonZeroExitCode","details":{"causes":[{"reason":"ExitCode","message":"7"}]}}"#;
        assert_eq!(exit_status(failed).unwrap(), 7);
        let e = exit_status(br#"{"status":"Failure","message":"exec: no such file"}"#);
        assert!(e.unwrap_err().to_string().contains("no such file"));
    }
}
