//! Running the daemon: its threads (vhost-user acceptors, sessions, control
//! server, dataplanes, SG threads), the signal wait and the shutdown that
//! undoes everything.

use super::*;

use std::os::fd::AsRawFd;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

/// Threads and sockets of a running daemon; `shutdown` undoes everything.
#[derive(Debug)]
struct Running {
    stop: Arc<AtomicBool>,
    stop_fd: Arc<EventFd>,
    threads: Vec<JoinHandle<()>>,
    sessions: Arc<Mutex<Sessions>>,
    sockets: Vec<PathBuf>,
    /// Every dataplane thread's wake eventfd (a stop wakes them all).
    wakes: Vec<Arc<EventFd>>,
}

fn bind(path: &Path) -> Result<UnixListener, Error> {
    let io = |e| Error::Io {
        what: format!("socket {}", path.display()),
        source: e,
    };
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    let l = UnixListener::bind(path).map_err(io)?;
    l.set_nonblocking(true).map_err(io)?;
    Ok(l)
}

/// One acceptor thread per PF: a connection on VF i's socket is served on a
/// session thread of its own (concurrent opens really run concurrently; a
/// thread serves one session after another: `sessions`). The listeners
/// are in one epoll set, so a connection costs the same with 8 VFs as with
/// 256 (a poll over every listener per wake-up would not).
fn acceptor(
    pf_devset: Arc<Devset<VfHw>>,
    ports: Vec<Arc<Port>>,
    (profile, pools): (&'static Profile, Arc<[PathBuf]>),
    listeners: Vec<UnixListener>,
    stop: Arc<AtomicBool>,
    stop_fd: Arc<EventFd>,
    sessions: Arc<Mutex<Sessions>>,
) {
    let epoll = match listener_set(&listeners, &stop_fd) {
        Ok(e) => e,
        Err(e) => {
            tracing::error!("nic: acceptor: epoll: {e}; no VF of this PF can be opened");
            return;
        }
    };
    let mut events = vec![EpollEvent::default(); 64];
    while !stop.load(Ordering::Relaxed) {
        let n = epoll.wait(1000, &mut events).unwrap_or(0);
        for ev in &events[..n] {
            let i = ev.data() as usize;
            let Some(l) = listeners.get(i) else {
                continue; // the stop eventfd
            };
            while let Ok((stream, _)) = l.accept() {
                let _ = stream.set_nonblocking(false);
                let (d, p, pools) = (pf_devset.clone(), ports[i].clone(), pools.clone());
                let s2 = match stream.try_clone() {
                    Ok(s) => s,
                    Err(_) => continue,
                };
                Sessions::spawn(&sessions, &stream, format!("dev-{}", p.id), move || {
                    crate::session::serve(d, p, pools, i, s2, profile)
                });
            }
        }
    }
}

/// An epoll set of `listeners` (data: the index) and `stop_fd` (data: one past them).
fn listener_set(listeners: &[UnixListener], stop_fd: &EventFd) -> std::io::Result<Epoll> {
    let epoll = Epoll::new()?;
    let fds = listeners.iter().map(|l| l.as_raw_fd());
    for (i, fd) in fds.chain([stop_fd.as_raw_fd()]).enumerate() {
        epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(EventSet::IN, i as u64),
        )?;
    }
    Ok(epoll)
}

fn control_server(
    nic: Arc<Nic>,
    listener: UnixListener,
    stop: Arc<AtomicBool>,
    stop_fd: Arc<EventFd>,
    limits: Limits,
) {
    let mut handle = |req| nic.handle(req);
    match Server::new(listener, &stop_fd, limits, &mut handle) {
        Ok(mut srv) => srv.run(&stop),
        Err(e) => tracing::error!("nic control: cannot start the server: {e}"),
    }
}

pub fn run(args: &NicConfig) -> Result<(), Error> {
    // Signals are taken synchronously through a signalfd; block them before any
    // thread exists so that every thread inherits the mask.
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGTERM);
    mask.add(Signal::SIGINT);
    mask.thread_block().map_err(|e| Error::Io {
        what: "sigprocmask".into(),
        source: e.into(),
    })?;
    let sigfd = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC).map_err(|e| Error::Io {
        what: "signalfd".into(),
        source: e.into(),
    })?;
    run_until(args, move || {
        let _ = sigfd.read_signal();
    })
}

/// Runs the daemon until `wait` returns, then shuts it down: every session
/// ends (closing its VF), threads are joined, sockets removed.
pub fn run_until(args: &NicConfig, wait: impl FnOnce()) -> Result<(), Error> {
    run_with(args, |_| wait())
}

/// As `run_until`; `wait` also gets the running `Nic` (tests inspect its devsets).
pub fn run_with(args: &NicConfig, wait: impl FnOnce(&Arc<Nic>)) -> Result<(), Error> {
    let pfs = args.pf_list()?;
    let uplinks = args.uplink_list(pfs.len())?;
    let socket_dir = args
        .socket_dir
        .clone()
        .unwrap_or_else(|| args.state_dir.clone());
    for d in [&args.state_dir, &socket_dir] {
        std::fs::create_dir_all(d).map_err(|e| Error::Io {
            what: format!("directory {}", d.display()),
            source: e,
        })?;
    }
    if let Some(parent) = args.control.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::Io {
            what: format!("directory {}", parent.display()),
            source: e,
        })?;
    }
    // Held until this function returns, before anything in them is touched:
    // a second daemon on them stops here, its first's sockets and state intact.
    let _locks = lock_dirs(&args.state_dir, &socket_dir)?;
    match nic_api::connect_timeout(&args.control, Duration::from_secs(2)) {
        Ok(_) => {
            return Err(Error::Config(format!(
                "control socket {}: another nic daemon is running",
                args.control.display()
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
            return Err(Error::Config(format!(
                "control socket {}: another nic daemon holds it but does not accept ({e})",
                args.control.display()
            )))
        }
        Err(_) => {}
    }
    let mut nic = Nic::new(
        &pfs,
        args.devset_lock,
        &socket_dir,
        args.state_dir.join("nic-state.json"),
        &args.sg,
    )?;
    nic.pool_sockets = Arc::from(args.pool_socket.clone());
    let nic = Arc::new(nic);
    let mut run = Running::new()?;
    let r = start(&nic, args, uplinks, &mut run);
    if r.is_ok() {
        tracing::info!(
            "nic: {} PF(s) up, control at {}",
            nic.pfs.len(),
            args.control.display()
        );
        wait(&nic);
    }
    run.shutdown(&nic);
    r
}

/// The lock file (`procutil::DirLock`) in the state directory and in the
/// socket directory: one daemon per directory.
pub const LOCK_FILE: &str = "nic.lock";

/// Takes `LOCK_FILE` in the state directory and, if it is another one, in
/// the socket directory.
fn lock_dirs(state_dir: &Path, socket_dir: &Path) -> Result<Vec<procutil::DirLock>, Error> {
    let canon = |d: &Path| std::fs::canonicalize(d).unwrap_or_else(|_| d.to_path_buf());
    let mut dirs = vec![("state directory", state_dir)];
    if canon(socket_dir) != canon(state_dir) {
        dirs.push(("socket directory", socket_dir));
    }
    dirs.into_iter()
        .map(|(what, dir)| {
            procutil::DirLock::acquire(dir, LOCK_FILE).map_err(|source| Error::Owned {
                what,
                dir: dir.to_path_buf(),
                source,
            })
        })
        .collect()
}

fn start(
    nic: &Arc<Nic>,
    args: &NicConfig,
    uplinks: Vec<Option<UplinkSpec>>,
    run: &mut Running,
) -> Result<(), Error> {
    for (pf, up) in nic.pfs.iter().zip(uplinks) {
        let uplink = up
            .map(|u| Uplink::open(&u))
            .transpose()
            .map_err(|e| Error::Uplink {
                pf: pf.name.clone(),
                source: Box::new(e),
            })?;
        let dps = Dataplane::sharded(
            pf.devset.clone(),
            pf.ports.clone(),
            uplink,
            pf.wake.clone(),
            args.batch,
            args.dataplane_threads,
        )
        .map_err(|e| Error::Io {
            what: format!("PF {}: dataplane eventfd", pf.name),
            source: e,
        })?;
        for (k, dp) in dps.into_iter().enumerate() {
            run.wakes.push(dp.wake());
            let stop = run.stop.clone();
            let name = match k {
                0 => format!("dp-{}", pf.name),
                _ => format!("dp-{}-{k}", pf.name),
            };
            run.threads.push(spawn(name, move || dp.run(&stop))?);
        }
    }
    start_vfs(nic, run)?;
    let l = bind(&args.control)?;
    run.sockets.push(args.control.clone());
    let (n, s, sf, limits) = (
        nic.clone(),
        run.stop.clone(),
        run.stop_fd.clone(),
        args.control_limits(),
    );
    run.threads.push(spawn("nic-control".into(), move || {
        control_server(n, l, s, sf, limits)
    })?);
    Ok(())
}

/// Binds every VF's (and SG function's) vhost-user socket and starts one
/// acceptor per PF and kind, and the SG thread of each PF that has SGFs.
fn start_vfs(nic: &Arc<Nic>, run: &mut Running) -> Result<(), Error> {
    for pf in &nic.pfs {
        start_acceptor(
            &format!("accept-{}", pf.name),
            &pf.devset,
            &pf.ports,
            &crate::session::NET,
            nic,
            run,
        )?;
        let Some(sg) = &pf.sg else { continue };
        start_acceptor(
            &format!("accept-{}-sg", pf.name),
            &sg.devset,
            &sg.ports,
            &crate::sg::PROFILE,
            nic,
            run,
        )?;
        let lp = crate::sg::serve::SgLoop::new(&pf.name, sg).map_err(|e| Error::SgDevice {
            pf: pf.name.clone(),
            source: Box::new(e),
        })?;
        let (s, sf) = (run.stop.clone(), run.stop_fd.clone());
        run.threads
            .push(spawn(format!("sg-{}", pf.name), move || lp.run(&s, &sf))?);
    }
    Ok(())
}

fn start_acceptor(
    name: &str,
    devset: &Arc<Devset<VfHw>>,
    ports: &[Arc<Port>],
    profile: &'static Profile,
    nic: &Nic,
    run: &mut Running,
) -> Result<(), Error> {
    let mut listeners = Vec::new();
    for port in ports {
        listeners.push(bind(&port.socket)?);
        run.sockets.push(port.socket.clone());
    }
    let (d, p, s, sf, ss, pools) = (
        devset.clone(),
        ports.to_vec(),
        run.stop.clone(),
        run.stop_fd.clone(),
        run.sessions.clone(),
        nic.pool_sockets.clone(),
    );
    run.threads.push(spawn(name.into(), move || {
        acceptor(d, p, (profile, pools), listeners, s, sf, ss)
    })?);
    Ok(())
}

/// The VF sockets of a `Nic` served in the background, without dataplane or
/// control socket: what `bench devset` measures.
#[derive(Debug)]
pub struct BackgroundServer {
    nic: Arc<Nic>,
    run: Running,
}

impl BackgroundServer {
    pub fn start(nic: Arc<Nic>) -> Result<Self, Error> {
        let mut run = Running::new()?;
        if let Err(e) = start_vfs(&nic, &mut run) {
            run.shutdown(&nic);
            return Err(e);
        }
        Ok(BackgroundServer { nic, run })
    }
    pub fn stop(self) {
        self.run.shutdown(&self.nic);
    }
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, Error> {
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(f)
        .map_err(|e| Error::Io {
            what: format!("thread {name}"),
            source: e,
        })
}

impl Running {
    fn new() -> Result<Self, Error> {
        Ok(Running {
            stop: Arc::new(AtomicBool::new(false)),
            stop_fd: Arc::new(EventFd::new(EFD_NONBLOCK).map_err(|e| Error::Io {
                what: "eventfd".into(),
                source: e,
            })?),
            threads: vec![],
            sessions: Default::default(),
            sockets: vec![],
            wakes: vec![],
        })
    }

    fn shutdown(self, nic: &Nic) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.stop_fd.write(1);
        for pf in &nic.pfs {
            let _ = pf.wake.write(1);
        }
        for w in &self.wakes {
            let _ = w.write(1);
        }
        for t in self.threads {
            let _ = t.join();
        }
        // Ends every vhost-user and control session; each closes its VF.
        for t in Sessions::close(&self.sessions) {
            let _ = t.join();
        }
        for p in &self.sockets {
            let _ = std::fs::remove_file(p);
        }
        tracing::info!("nic: shut down");
    }
}
