//! The server netns's HTTP file server: what a container fetches over its
//! sandbox's network (VF or tap) to prove that bytes cross it intact. One
//! kind of request, `GET /bytes/N HTTP/1.x`, answered with N bytes of a
//! fixed pattern ([`pattern`]) that the caller can compute too; anything
//! else is a 404. Bounded: a request line of at most 4 KiB, N at most
//! 64 MiB, 5 s of silence per connection, 64 connections at once.

use std::io::{self, BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// The port it listens on, on the server address.
pub const FILE_PORT: u16 = 7780;
/// Largest body served.
pub const MAX_BYTES: u64 = 64 << 20;
const MAX_LINE: u64 = 4096;
const MAX_CONNECTIONS: usize = 64;

/// Byte `i` of every body: a sequence that does not repeat within 64 MiB
/// at any period a copy bug would likely have (not a multiple of 4 KiB).
pub fn pattern(i: u64) -> u8 {
    let x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8 ^ (i / 4093) as u8
}

/// The first `n` bytes of the pattern.
pub fn pattern_bytes(n: u64) -> Vec<u8> {
    (0..n).map(pattern).collect()
}

#[derive(Debug)]
pub struct FileServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FileServer {
    /// Serves on `listener` (bound by the caller inside the server netns).
    pub fn start(listener: TcpListener) -> io::Result<FileServer> {
        // Non-blocking accept: the loop sees `stop` at least every 100 ms.
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let live = Arc::new(AtomicUsize::new(0));
        let thread = std::thread::Builder::new()
            .name("file-server".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((conn, _)) => {
                            if live.load(Ordering::Relaxed) >= MAX_CONNECTIONS {
                                continue; // dropped: closed at once
                            }
                            live.fetch_add(1, Ordering::Relaxed);
                            let mine = live.clone();
                            let spawned = std::thread::Builder::new()
                                .name("file-conn".into())
                                .spawn(move || {
                                    if let Err(e) = serve(conn) {
                                        tracing::debug!("file server: {e}");
                                    }
                                    mine.fetch_sub(1, Ordering::Relaxed);
                                });
                            if spawned.is_err() {
                                live.fetch_sub(1, Ordering::Relaxed);
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(100));
                        }
                        Err(e) => {
                            tracing::warn!("file server: accept: {e}");
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                }
            })?;
        Ok(FileServer {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for FileServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One request on `conn`.
fn serve(conn: TcpStream) -> io::Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    conn.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(io::Read::take(conn.try_clone()?, MAX_LINE));
    let mut line = String::new();
    reader.read_line(&mut line)?;
    // The headers are read and ignored (bounded by the same take).
    let mut h = String::new();
    while reader.read_line(&mut h)? > 2 {
        h.clear();
    }
    let mut out = io::BufWriter::with_capacity(64 << 10, conn);
    match parse(&line) {
        Some(n) => {
            write!(
                out,
                "HTTP/1.0 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {n}\r\n\r\n"
            )?;
            let mut buf = vec![0u8; 64 << 10];
            let mut i = 0u64;
            while i < n {
                let k = (n - i).min(buf.len() as u64) as usize;
                for (j, b) in buf[..k].iter_mut().enumerate() {
                    *b = pattern(i + j as u64);
                }
                out.write_all(&buf[..k])?;
                i += k as u64;
            }
        }
        None => out.write_all(b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n")?,
    }
    out.flush()
}

/// N of `GET /bytes/N HTTP/1.x`, if at most MAX_BYTES.
fn parse(line: &str) -> Option<u64> {
    let mut w = line.split_whitespace();
    let (method, path, version) = (w.next()?, w.next()?, w.next()?);
    if method != "GET" || !version.starts_with("HTTP/1.") {
        return None;
    }
    let n: u64 = path.strip_prefix("/bytes/")?.parse().ok()?;
    (n <= MAX_BYTES).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn requests_are_parsed_strictly() {
        assert_eq!(parse("GET /bytes/100 HTTP/1.1\r\n"), Some(100));
        assert_eq!(parse("GET /bytes/0 HTTP/1.0\r\n"), Some(0));
        assert_eq!(parse("POST /bytes/1 HTTP/1.1\r\n"), None);
        assert_eq!(parse("GET /bytes/-1 HTTP/1.1\r\n"), None);
        assert_eq!(parse("GET /etc/passwd HTTP/1.1\r\n"), None);
        assert_eq!(
            parse(&format!("GET /bytes/{} HTTP/1.1", MAX_BYTES + 1)),
            None
        );
        assert_eq!(parse(""), None);
    }

    #[test]
    fn serves_the_pattern_over_loopback() {
        let l = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let addr = l.local_addr().unwrap();
        let _srv = FileServer::start(l).unwrap();
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(b"GET /bytes/200000 HTTP/1.0\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut got = Vec::new();
        c.read_to_end(&mut got).unwrap();
        let split = got.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        assert!(got.starts_with(b"HTTP/1.0 200 OK"));
        assert_eq!(&got[split..], &pattern_bytes(200_000)[..]);
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(b"GET /nothing HTTP/1.0\r\n\r\n").unwrap();
        let mut got = String::new();
        c.read_to_string(&mut got).unwrap();
        assert!(got.starts_with("HTTP/1.0 404"), "{got}");
    }
}
