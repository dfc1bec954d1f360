//! The control server: one thread, epoll, non-blocking connections, and
//! bounds on everything a client can make it hold — the number of
//! connections, the length of a request line, the output queued for a
//! client that does not read, and the time a connection may sit idle.
//! Requests are few and short (the daemon serializes them anyway), so one
//! thread serves them all and a flood of connections costs one fd each, up
//! to the cap, and no thread.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use nic_api::{parse_request, ErrorCode, Request, Response};

/// What one client may cost the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Open control connections; a new one beyond this closes the least
    /// recently active one (with a `busy` error line), so idle connections
    /// can never lock real clients out.
    pub max_connections: usize,
    /// Longest request line in bytes; a longer one is answered `bad-request`
    /// and the connection closed, after reading at most this much of it.
    pub max_line: usize,
    /// A connection with no byte read or written for this long is closed.
    pub idle_timeout: Duration,
}

pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
pub const DEFAULT_MAX_LINE: usize = 64 << 10;
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_line: DEFAULT_MAX_LINE,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

/// Responses queued for a client beyond this stop the reading of its
/// further requests until it has read them (a client pipelining `list`
/// requests without reading cannot grow the daemon).
const OUT_HIGH_WATER: usize = 256 << 10;
const READ_CHUNK: usize = 16 << 10;
const LISTENER: u64 = u64::MAX;
const STOP: u64 = u64::MAX - 1;

/// The answer to one request line (without its newline), `None` for a
/// blank line. Never panics, whatever the bytes.
pub fn answer(line: &[u8], handle: &mut dyn FnMut(Request) -> Response) -> Option<Response> {
    let line = line.trim_ascii();
    if line.is_empty() {
        return None;
    }
    Some(match parse_request(line) {
        Ok(req) => handle(req),
        Err(resp) => *resp,
    })
}

fn encode(resp: &Response, out: &mut Vec<u8>) {
    serde_json::to_writer(&mut *out, resp).expect("responses serialize");
    out.push(b'\n');
}

#[derive(Debug)]
struct Conn {
    stream: UnixStream,
    /// Unprocessed input: `inbuf[start..]`; `inbuf[start..scanned]` has no newline.
    inbuf: Vec<u8>,
    start: usize,
    scanned: usize,
    out: Vec<u8>,
    out_off: usize,
    last: Instant,
    /// No more requests are read (EOF, over-long line): flush, then close.
    closing: bool,
    interest: EventSet,
}

impl Conn {
    fn pending_out(&self) -> usize {
        self.out.len() - self.out_off
    }

    /// Answers the complete lines of `inbuf` while the output stays below
    /// the high-water mark; enforces the line limit on what is left.
    fn process(&mut self, limits: &Limits, handle: &mut dyn FnMut(Request) -> Response) {
        while self.pending_out() < OUT_HIGH_WATER && !self.closing {
            let Some(nl) = self.inbuf[self.scanned..].iter().position(|&b| b == b'\n') else {
                self.scanned = self.inbuf.len();
                break;
            };
            let end = self.scanned + nl;
            if end - self.start > limits.max_line {
                self.refuse_long_line(limits);
                break;
            }
            if let Some(r) = answer(&self.inbuf[self.start..end], handle) {
                encode(&r, &mut self.out);
            }
            self.start = end + 1;
            self.scanned = self.start;
        }
        if !self.closing && self.scanned - self.start > limits.max_line {
            self.refuse_long_line(limits);
        }
        // Compact: keep only the unprocessed tail.
        if self.start > 0 {
            self.inbuf.drain(..self.start);
            self.scanned -= self.start;
            self.start = 0;
        }
    }

    fn refuse_long_line(&mut self, limits: &Limits) {
        let r = Response::err(
            ErrorCode::BadRequest,
            format!(
                "request line longer than {} bytes; closing the connection",
                limits.max_line
            ),
        );
        encode(&r, &mut self.out);
        self.inbuf.clear();
        (self.start, self.scanned) = (0, 0);
        self.closing = true;
    }

    /// Reads once (level-triggered epoll calls again if more is there).
    /// Returns false if the connection is broken.
    fn read_some(&mut self, limits: &Limits, handle: &mut dyn FnMut(Request) -> Response) -> bool {
        let mut chunk = [0u8; READ_CHUNK];
        match self.stream.read(&mut chunk) {
            Ok(0) => {
                // EOF: a last line without newline still counts, as with `lines()`.
                self.process(limits, handle);
                if !self.closing && self.inbuf.len() > self.start {
                    self.inbuf.push(b'\n');
                    self.process(limits, handle);
                }
                self.closing = true;
                true
            }
            Ok(n) => {
                self.last = Instant::now();
                self.inbuf.extend_from_slice(&chunk[..n]);
                self.process(limits, handle);
                true
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => true,
            Err(_) => false,
        }
    }

    /// Writes what it can; false if the connection is broken.
    fn flush(&mut self, limits: &Limits, handle: &mut dyn FnMut(Request) -> Response) -> bool {
        loop {
            while self.out_off < self.out.len() {
                match self.stream.write(&self.out[self.out_off..]) {
                    Ok(0) => return false,
                    Ok(n) => {
                        self.out_off += n;
                        self.last = Instant::now();
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
                    Err(_) => return false,
                }
            }
            self.out.clear();
            self.out_off = 0;
            // Requests held back by the high-water mark.
            self.process(limits, handle);
            if self.out.is_empty() {
                return true;
            }
        }
    }

    /// What to wait for next; `None` when the connection is done.
    fn wanted(&self) -> Option<EventSet> {
        if self.pending_out() > 0 {
            Some(EventSet::OUT)
        } else if self.closing {
            None
        } else {
            Some(EventSet::IN)
        }
    }
}

/// Serves the control socket until `stop` is set (and `stop_fd` written).
pub struct Server<'a> {
    epoll: Epoll,
    listener: UnixListener,
    limits: Limits,
    conns: HashMap<u64, Conn>,
    next: u64,
    handle: &'a mut dyn FnMut(Request) -> Response,
    /// Connections closed to make room for newer ones (diagnostics).
    pub evicted: u64,
}

// The handler is a closure: Debug leaves it out.
impl std::fmt::Debug for Server<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("listener", &self.listener)
            .field("limits", &self.limits)
            .field("conns", &self.conns.len())
            .field("evicted", &self.evicted)
            .finish_non_exhaustive()
    }
}

impl<'a> Server<'a> {
    pub fn new(
        listener: UnixListener,
        stop_fd: &EventFd,
        limits: Limits,
        handle: &'a mut dyn FnMut(Request) -> Response,
    ) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let epoll = Epoll::new()?;
        epoll.ctl(
            ControlOperation::Add,
            listener.as_raw_fd(),
            EpollEvent::new(EventSet::IN, LISTENER),
        )?;
        epoll.ctl(
            ControlOperation::Add,
            stop_fd.as_raw_fd(),
            EpollEvent::new(EventSet::IN, STOP),
        )?;
        Ok(Server {
            epoll,
            listener,
            limits: Limits {
                max_connections: limits.max_connections.max(1),
                max_line: limits.max_line.max(16),
                ..limits
            },
            conns: HashMap::new(),
            next: 0,
            handle,
            evicted: 0,
        })
    }

    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    pub fn run(&mut self, stop: &AtomicBool) {
        let mut events = vec![EpollEvent::default(); 64];
        while !stop.load(Ordering::Relaxed) {
            let n = match self.epoll.wait(self.wait_ms(), &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("nic control: epoll: {e}; control server stops");
                    return;
                }
            };
            for ev in &events[..n] {
                match ev.data() {
                    STOP => return,
                    LISTENER => self.accept_all(),
                    key => self.on_event(key, ev.event_set()),
                }
            }
            self.expire_idle();
        }
    }

    /// Until the next idle deadline, at most a second (the stop flag).
    fn wait_ms(&self) -> i32 {
        let now = Instant::now();
        self.conns
            .values()
            .map(|c| (c.last + self.limits.idle_timeout).saturating_duration_since(now))
            .min()
            .map_or(1000, |d| d.as_millis().min(1000) as i32 + 1)
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => self.add(stream),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => {
                    // Out of fds (EMFILE/ENFILE): free one, or give up this round.
                    tracing::warn!("nic control: accept: {e}");
                    if !self.evict_oldest() {
                        return;
                    }
                }
            }
        }
    }

    fn add(&mut self, stream: UnixStream) {
        if stream.set_nonblocking(true).is_err() {
            return;
        }
        while self.conns.len() >= self.limits.max_connections {
            self.evict_oldest();
        }
        let key = self.next;
        self.next += 1;
        if let Err(e) = self.epoll.ctl(
            ControlOperation::Add,
            stream.as_raw_fd(),
            EpollEvent::new(EventSet::IN, key),
        ) {
            tracing::warn!("nic control: epoll add: {e}");
            return;
        }
        self.conns.insert(
            key,
            Conn {
                stream,
                inbuf: Vec::new(),
                start: 0,
                scanned: 0,
                out: Vec::new(),
                out_off: 0,
                last: Instant::now(),
                closing: false,
                interest: EventSet::IN,
            },
        );
    }

    /// Closes the least recently active connection with a `busy` line.
    fn evict_oldest(&mut self) -> bool {
        let Some(key) = self
            .conns
            .iter()
            .min_by_key(|(k, c)| (c.last, **k))
            .map(|(k, _)| *k)
        else {
            return false;
        };
        if let Some(mut c) = self.conns.remove(&key) {
            let mut line = Vec::new();
            encode(
                &Response::err(
                    ErrorCode::Busy,
                    format!(
                        "more than {} control connections: closing the least recently active one",
                        self.limits.max_connections
                    ),
                ),
                &mut line,
            );
            // Best effort: the socket is non-blocking.
            let _ = c.stream.write(&line);
            self.evicted += 1;
            if self.evicted.is_power_of_two() {
                tracing::warn!(
                    "nic control: {} connections closed so far to stay within {}",
                    self.evicted,
                    self.limits.max_connections
                );
            }
        }
        true
    }

    fn on_event(&mut self, key: u64, set: EventSet) {
        let limits = self.limits;
        let Some(c) = self.conns.get_mut(&key) else {
            return;
        };
        let mut ok = true;
        if set.contains(EventSet::IN) && c.pending_out() == 0 && !c.closing {
            ok = c.read_some(&limits, self.handle);
        } else if set.intersects(EventSet::HANG_UP | EventSet::ERROR) && c.pending_out() == 0 {
            ok = false;
        }
        if ok && c.pending_out() > 0 {
            ok = c.flush(&limits, self.handle);
        }
        let next = if ok { c.wanted() } else { None };
        match next {
            None => {
                self.conns.remove(&key);
            }
            Some(want) if want != c.interest => {
                c.interest = want;
                if self
                    .epoll
                    .ctl(
                        ControlOperation::Modify,
                        c.stream.as_raw_fd(),
                        EpollEvent::new(want, key),
                    )
                    .is_err()
                {
                    self.conns.remove(&key);
                }
            }
            Some(_) => {}
        }
    }

    fn expire_idle(&mut self) {
        let idle = self.limits.idle_timeout;
        let before = self.conns.len();
        self.conns.retain(|_, c| c.last.elapsed() < idle);
        if self.conns.len() < before {
            tracing::debug!(
                "nic control: closed {} idle connection(s)",
                before - self.conns.len()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nic_api::Client;
    use std::io::BufRead;
    use std::sync::Arc;
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    /// A server on a temporary socket answering `list` with no VFs.
    struct Running {
        dir: tempfile::TempDir,
        stop: Arc<AtomicBool>,
        stop_fd: Arc<EventFd>,
        thread: Option<std::thread::JoinHandle<u64>>,
    }

    impl Running {
        fn start(limits: Limits) -> Running {
            let dir = tempfile::tempdir().unwrap();
            let l = UnixListener::bind(dir.path().join("c.sock")).unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let stop_fd = Arc::new(EventFd::new(EFD_NONBLOCK).unwrap());
            let (s, f) = (stop.clone(), stop_fd.clone());
            let thread = std::thread::spawn(move || {
                let mut h = |r: Request| match r {
                    Request::List {} => Response::with_vfs(vec![]),
                    _ => Response::ok(),
                };
                let mut srv = Server::new(l, &f, limits, &mut h).unwrap();
                srv.run(&s);
                srv.evicted
            });
            Running {
                dir,
                stop,
                stop_fd,
                thread: Some(thread),
            }
        }
        fn path(&self) -> std::path::PathBuf {
            self.dir.path().join("c.sock")
        }
        fn stop(&mut self) -> u64 {
            self.stop.store(true, Ordering::SeqCst);
            self.stop_fd.write(1).unwrap();
            self.thread.take().unwrap().join().unwrap()
        }
    }

    impl Drop for Running {
        fn drop(&mut self) {
            if self.thread.is_some() {
                self.stop();
            }
        }
    }

    fn read_line(s: &UnixStream) -> String {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut line = String::new();
        std::io::BufReader::new(s).read_line(&mut line).unwrap();
        line
    }

    #[test]
    fn excess_connections_evict_the_oldest_and_new_clients_are_served() {
        let mut srv = Running::start(Limits {
            max_connections: 4,
            ..Limits::default()
        });
        let held: Vec<UnixStream> = (0..10)
            .map(|_| UnixStream::connect(srv.path()).unwrap())
            .collect();
        let mut c = Client::connect(&srv.path()).unwrap();
        assert!(c.list().unwrap().is_empty());
        // The first of the idle ones was told why it was closed.
        let line = read_line(&held[0]);
        assert!(line.contains("\"busy\""), "{line}");
        drop(held);
        assert!(srv.stop() >= 7);
    }

    #[test]
    fn long_line_is_refused_without_reading_it_all() {
        let srv = Running::start(Limits {
            max_line: 1024,
            ..Limits::default()
        });
        let mut s = UnixStream::connect(srv.path()).unwrap();
        // Far more than the limit and more than the socket buffers hold:
        // the server answers and closes, so the writer fails instead of blocking.
        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
        let junk = vec![b'x'; 1 << 16];
        let mut sent = 0usize;
        while sent < 64 << 20 {
            match s.write(&junk) {
                Ok(n) => sent += n,
                Err(_) => break,
            }
        }
        assert!(sent < 64 << 20, "the server read 64 MiB of one line");
        let line = read_line(&s);
        assert!(
            line.contains("bad-request") && line.contains("longer than 1024"),
            "{line}"
        );
    }

    #[test]
    fn idle_connections_are_closed() {
        let srv = Running::start(Limits {
            idle_timeout: Duration::from_millis(200),
            ..Limits::default()
        });
        let s = UnixStream::connect(srv.path()).unwrap();
        // EOF (not a timeout of this read) once the server closed it.
        assert_eq!(read_line(&s), "");
    }

    #[test]
    fn pipelined_and_split_requests_are_answered_in_order() {
        let srv = Running::start(Limits::default());
        let mut s = UnixStream::connect(srv.path()).unwrap();
        s.write_all(b"{\"op\":\"list\"}\n\n{\"op\":\"nope\"}\n{\"op\":")
            .unwrap();
        s.write_all(b"\"release\",\"sandbox\":\"a\"}").unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let mut r = std::io::BufReader::new(&s);
        let lines: Vec<String> = (&mut r).lines().map(|l| l.unwrap()).collect();
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(lines[0].contains("\"vfs\":[]"));
        assert!(lines[1].contains("bad-request"));
        assert_eq!(lines[2], "{\"ok\":true}");
    }

    #[test]
    fn a_client_that_never_reads_does_not_grow_the_server() {
        let srv = Running::start(Limits {
            idle_timeout: Duration::from_millis(500),
            ..Limits::default()
        });
        let mut s = UnixStream::connect(srv.path()).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
        // Requests keep going in until the server stops reading them (its
        // queued output for us is at the high-water mark); then our writes
        // block, time out, and the idle timeout ends the connection.
        let req = b"{\"op\":\"list\"}\n".repeat(1000);
        let mut sent = 0usize;
        while sent < 256 << 20 {
            match s.write(&req) {
                Ok(n) => sent += n,
                Err(_) => break,
            }
        }
        assert!(sent < 256 << 20, "the server kept reading");
        // Another client is served meanwhile.
        let mut c = Client::connect(&srv.path()).unwrap();
        assert!(c.list().unwrap().is_empty());
    }
}
