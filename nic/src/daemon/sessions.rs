//! The threads that serve vhost-user sessions. Each connection gets a thread
//! of its own, so concurrent opens really run concurrently; a thread whose
//! session ended waits a while for the next connection instead of exiting, so
//! a burst of sandbox starts does not create and tear down a thread per VF
//! session (stack, clone, exit: tens of µs of CPU each on this host).
//! `close` ends every session and every waiting thread.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::lock;

/// How long a thread without a session waits for the next one before it exits.
const IDLE: Duration = Duration::from_secs(10);

/// A session to serve: the thread's name while it does, its stream's key, the work.
struct Job {
    name: String,
    key: u64,
    serve: Box<dyn FnOnce() + Send>,
}

#[derive(Debug, Default)]
pub(super) struct Sessions {
    /// A clone of every live session's stream (`close` shuts them down).
    streams: HashMap<u64, UnixStream>,
    threads: Vec<JoinHandle<()>>,
    /// Threads waiting for a session: their id and the sender of a channel
    /// only they receive on. Dropping the sender ends the thread.
    idle: Vec<(u64, Sender<Job>)>,
    next: u64,
    /// Threads started so far.
    started: u64,
    closed: bool,
}

impl Sessions {
    /// Serves `stream` with `serve` on a waiting thread, or on a new one if none waits.
    pub(super) fn spawn(
        this: &Arc<Mutex<Sessions>>,
        stream: &UnixStream,
        name: String,
        serve: impl FnOnce() + Send + 'static,
    ) {
        let mut s = lock(this);
        if s.closed {
            return; // shutting down: the connection closes with `stream`
        }
        s.threads.retain(|t| !t.is_finished());
        let key = s.next;
        s.next += 1;
        if let Ok(c) = stream.try_clone() {
            s.streams.insert(key, c);
        }
        let mut job = Job {
            name,
            key,
            serve: Box::new(serve),
        };
        // Sent under the lock: a waiting thread that timed out looks for its
        // entry under the lock too, so it either finds it (nobody sends) or
        // finds this job in its channel.
        while let Some((_, tx)) = s.idle.pop() {
            match tx.send(job) {
                Ok(()) => return,
                Err(mpsc::SendError(j)) => job = j,
            }
        }
        let id = s.started;
        let reg = this.clone();
        let t = std::thread::Builder::new()
            .name(job.name.clone())
            .spawn(move || serve_sessions(reg, id, job));
        match t {
            Ok(t) => {
                s.threads.push(t);
                s.started += 1;
            }
            Err(e) => {
                tracing::warn!("cannot spawn a session thread: {e}");
                s.streams.remove(&key);
            }
        }
    }

    /// Threads started so far (a thread serves many sessions in turn).
    #[cfg(test)]
    fn started(this: &Mutex<Sessions>) -> u64 {
        lock(this).started
    }

    /// Ends every session (its stream shut down) and every waiting thread;
    /// returns the threads to join. Later connections are refused.
    pub(super) fn close(this: &Mutex<Sessions>) -> Vec<JoinHandle<()>> {
        let mut s = lock(this);
        s.closed = true;
        s.idle.clear();
        for st in s.streams.values() {
            let _ = st.shutdown(std::net::Shutdown::Both);
        }
        std::mem::take(&mut s.threads)
    }
}

/// A session thread: serves `job`, then the next one that comes within `IDLE`.
fn serve_sessions(reg: Arc<Mutex<Sessions>>, id: u64, mut job: Job) {
    loop {
        (job.serve)();
        match next_job(&reg, id, job.key) {
            Some(j) => job = j,
            None => return,
        }
        // The name profiles and `ps` show: the VF being served.
        if let Ok(n) = CString::new(job.name.clone()) {
            let _ = nix::sys::prctl::set_name(&n);
        }
    }
}

/// After the session of stream `key`: waits up to `IDLE` for the next one
/// (None: none came, or the daemon closes).
fn next_job(reg: &Mutex<Sessions>, id: u64, key: u64) -> Option<Job> {
    let (tx, rx) = mpsc::channel();
    {
        let mut s = lock(reg);
        s.streams.remove(&key);
        if s.closed {
            return None;
        }
        s.idle.push((id, tx));
    }
    match rx.recv_timeout(IDLE) {
        Ok(j) => Some(j),
        Err(RecvTimeoutError::Disconnected) => None, // closed
        Err(RecvTimeoutError::Timeout) => {
            let mut s = lock(reg);
            match s.idle.iter().position(|(i, _)| *i == id) {
                Some(i) => {
                    s.idle.remove(i);
                    None
                }
                // Taken from the list: its job was sent under the lock.
                None => rx.try_recv().ok(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn wait_idle(s: &Arc<Mutex<Sessions>>, n: usize) {
        let end = Instant::now() + Duration::from_secs(10);
        while lock(s).idle.len() != n {
            assert!(
                Instant::now() < end,
                "{n} threads never waited for a session"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Sessions one after another run on one thread; sessions at the same
    /// time on threads of their own; `close` ends sessions and waiting threads.
    #[test]
    fn a_thread_serves_the_next_session_and_close_ends_them_all() {
        let s = Arc::new(Mutex::new(Sessions::default()));
        let (a, _peer_a) = UnixStream::pair().unwrap();
        let (done_tx, done_rx) = mpsc::channel();
        for round in 0..3 {
            let tx = done_tx.clone();
            Sessions::spawn(&s, &a, format!("dev-{round}"), move || {
                tx.send(std::thread::current().id()).unwrap()
            });
            let who = done_rx.recv_timeout(Duration::from_secs(10)).unwrap();
            wait_idle(&s, 1);
            assert_eq!(
                Sessions::started(&s),
                1,
                "round {round}: {who:?} was not reused"
            );
        }
        assert!(
            lock(&s).streams.is_empty(),
            "an ended session's stream was kept"
        );

        // A session that blocks on its stream does not hold up the next one.
        let (b, peer_b) = UnixStream::pair().unwrap();
        let mut b_read = b.try_clone().unwrap();
        Sessions::spawn(&s, &b, "dev-b".into(), move || {
            use std::io::Read;
            let _ = b_read.read(&mut [0u8; 1]); // until `close` shuts the stream down
        });
        wait_idle(&s, 0);
        let tx = done_tx.clone();
        Sessions::spawn(&s, &a, "dev-c".into(), move || {
            tx.send(std::thread::current().id()).unwrap()
        });
        done_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(Sessions::started(&s), 2);
        wait_idle(&s, 1);

        let threads = Sessions::close(&s);
        assert_eq!(threads.len(), 2);
        let t0 = Instant::now();
        for t in threads {
            t.join().unwrap();
        }
        assert!(
            t0.elapsed() < IDLE,
            "close left a thread waiting out its idle time"
        );
        drop(peer_b);
        // Closed: a later connection is not served.
        let tx = done_tx.clone();
        Sessions::spawn(&s, &a, "dev-d".into(), move || {
            tx.send(std::thread::current().id()).unwrap()
        });
        assert!(done_rx.recv_timeout(Duration::from_millis(200)).is_err());
    }
}
