//! `burstvm nic`: the PFs and their VFs, the vhost-user listeners (one socket
//! per VF, bound once at start), the control server, the dataplane threads,
//! and a clean shutdown on SIGTERM/SIGINT.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use netutil::MacAddr;
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::control::server::{Limits, Server};
use crate::control::{DevKind, ErrorCode, Request, Response, VfInfo};
use crate::dataplane::uplink::{Uplink, UplinkSpec};
use crate::dataplane::Dataplane;
use crate::devset::{Devset, LockPolicy, VfState};
use crate::ids::{default_mac, vf_id};
use crate::poll::{eventfd_fd, wait_readable};
use crate::port::{Port, PortConfig, VfHw};
use crate::session::Profile;
use crate::sg::{SgArgs, SgPf};
use crate::state::{self, Assignment, StateFile};
use crate::{Error, NicArgs};

pub struct Pf {
    pub index: usize,
    pub name: String,
    pub devset: Arc<Devset<VfHw>>,
    pub ports: Vec<Arc<Port>>,
    pub wake: Arc<EventFd>,
    /// The PF's SG functions (`--sgfs`), if any.
    pub sg: Option<SgPf>,
}

/// Everything the control server and the acceptors share.
pub struct Nic {
    pub pfs: Vec<Pf>,
    /// Pool servers the memory of VF memory tables is registered with (`--pool-socket`).
    pub pool_sockets: Arc<[PathBuf]>,
    state_path: PathBuf,
    /// Serializes control operations: an assignment and its state-file write
    /// happen together.
    control: Mutex<()>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Nic {
    pub fn new(
        pfs: &[(String, usize)],
        policy: LockPolicy,
        socket_dir: &Path,
        state_path: PathBuf,
        sg: &SgArgs,
    ) -> Result<Self, Error> {
        let mut out = Vec::new();
        for (k, (name, n)) in pfs.iter().enumerate() {
            let wake = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(|e| Error::Io {
                what: format!("PF {name}: eventfd"),
                source: e,
            })?);
            let ports: Vec<Arc<Port>> = (0..*n)
                .map(|i| {
                    let socket = socket_dir.join(format!("{name}-vf{i}.sock"));
                    Arc::new(Port::new(
                        name,
                        i,
                        vf_id(k, i),
                        socket,
                        default_mac(k, i),
                        wake.clone(),
                    ))
                })
                .collect();
            let devset = Arc::new(Devset::new(name, *n, policy, |i| VfHw {
                port: ports[i].clone(),
            }));
            out.push(Pf {
                index: k,
                name: name.clone(),
                devset,
                ports,
                wake,
                sg: SgPf::new(name, sg, policy, socket_dir)?,
            });
        }
        let nic = Nic {
            pfs: out,
            pool_sockets: Arc::from(Vec::new()),
            state_path,
            control: Mutex::new(()),
        };
        nic.restore()?;
        Ok(nic)
    }

    /// Re-applies the assignments of the state file (daemon restart).
    fn restore(&self) -> Result<(), Error> {
        let st = state::load(&self.state_path)?;
        for a in st.assignments {
            let Some(pf) = self.pfs.iter().find(|p| p.name == a.pf) else {
                tracing::warn!(
                    "state {}: PF {} no longer configured; assignment of {} dropped",
                    self.state_path.display(),
                    a.pf,
                    a.sandbox
                );
                continue;
            };
            if a.kind == DevKind::Sg {
                let r = pf
                    .sg
                    .as_ref()
                    .filter(|sg| a.index < sg.ports.len())
                    .map(|sg| sg.devset.assign(a.index, &a.sandbox));
                match r {
                    Some(Ok(())) => {}
                    Some(Err(e)) => tracing::warn!("state {}: {e}", self.state_path.display()),
                    None => tracing::warn!(
                        "state {}: SGF {}/{} no longer configured; assignment of {} dropped",
                        self.state_path.display(),
                        a.pf,
                        a.index,
                        a.sandbox
                    ),
                }
                continue;
            }
            let (Some(port), Some(mac)) = (pf.ports.get(a.index), parse_mac(&a.mac)) else {
                tracing::warn!(
                    "state {}: VF {}/{} invalid; assignment of {} dropped",
                    self.state_path.display(),
                    a.pf,
                    a.index,
                    a.sandbox
                );
                continue;
            };
            if let Err(e) = pf.devset.assign(a.index, &a.sandbox) {
                tracing::warn!("state {}: {e}", self.state_path.display());
                continue;
            }
            port.set_config(PortConfig { mac, vlan: a.vlan });
        }
        self.save()
    }

    fn save(&self) -> Result<(), Error> {
        let mut st = StateFile {
            version: 1,
            assignments: vec![],
        };
        for pf in &self.pfs {
            for (i, (_, sandbox)) in pf.devset.snapshot().into_iter().enumerate() {
                if let Some(sandbox) = sandbox {
                    let cfg = pf.ports[i].config();
                    st.assignments.push(Assignment {
                        kind: DevKind::Vf,
                        pf: pf.name.clone(),
                        index: i,
                        sandbox,
                        mac: MacAddr::from(cfg.mac).to_string(),
                        vlan: cfg.vlan,
                    });
                }
            }
            let Some(sg) = &pf.sg else { continue };
            for (i, (_, sandbox)) in sg.devset.snapshot().into_iter().enumerate() {
                if let Some(sandbox) = sandbox {
                    st.assignments.push(Assignment {
                        kind: DevKind::Sg,
                        pf: pf.name.clone(),
                        index: i,
                        sandbox,
                        mac: String::new(),
                        vlan: None,
                    });
                }
            }
        }
        state::save(&self.state_path, &st)?;
        Ok(())
    }

    fn info(&self, pf: &Pf, i: usize, state: VfState, sandbox: Option<String>) -> VfInfo {
        let port = &pf.ports[i];
        let cfg = port.config();
        VfInfo {
            kind: DevKind::Vf,
            id: port.id.clone(),
            pf: pf.name.clone(),
            index: i,
            mac: MacAddr::from(cfg.mac).to_string(),
            vlan: cfg.vlan,
            socket: port.socket.clone(),
            state,
            sandbox,
            counters: port.counters.snapshot(),
            sg: None,
            sg_policy: None,
            sg_capacity: None,
        }
    }

    fn sg_info(
        &self,
        pf: &Pf,
        sg: &SgPf,
        i: usize,
        state: VfState,
        sandbox: Option<String>,
    ) -> VfInfo {
        let port = &sg.ports[i];
        // One lock at a time: guards in a struct literal live to its end.
        let sched = sg.sched().now;
        VfInfo {
            kind: DevKind::Sg,
            id: port.id.clone(),
            pf: pf.name.clone(),
            index: i,
            mac: String::new(),
            vlan: None,
            socket: port.socket.clone(),
            state,
            sandbox,
            counters: port.counters.snapshot(),
            sg: sg.counters().get(i).copied(),
            sg_policy: Some(sched.0.to_string()),
            sg_capacity: Some(sched.1.to_string()),
        }
    }

    fn all(&self) -> Vec<VfInfo> {
        let mut v = Vec::new();
        for pf in &self.pfs {
            for (i, (st, sb)) in pf.devset.snapshot().into_iter().enumerate() {
                v.push(self.info(pf, i, st, sb));
            }
            if let Some(sg) = &pf.sg {
                for (i, (st, sb)) in sg.devset.snapshot().into_iter().enumerate() {
                    v.push(self.sg_info(pf, sg, i, st, sb));
                }
            }
        }
        v
    }

    fn find_sg(&self, sandbox: &str) -> Option<(&Pf, &SgPf, usize)> {
        self.pfs.iter().find_map(|pf| {
            let sg = pf.sg.as_ref()?;
            sg.devset
                .snapshot()
                .iter()
                .position(|(_, sb)| sb.as_deref() == Some(sandbox))
                .map(|i| (pf, sg, i))
        })
    }

    fn find_sandbox(&self, sandbox: &str) -> Option<(&Pf, usize)> {
        self.pfs.iter().find_map(|pf| {
            pf.devset
                .snapshot()
                .iter()
                .position(|(_, sb)| sb.as_deref() == Some(sandbox))
                .map(|i| (pf, i))
        })
    }

    pub fn handle(&self, req: Request) -> Response {
        // Also for requests that did not come through `parse_request`.
        if let Err(e) = req.validate() {
            return Response::err(ErrorCode::BadRequest, e);
        }
        let _g = lock(&self.control);
        match req {
            Request::Alloc {
                pf,
                sandbox,
                kind: DevKind::Vf,
                mac,
                vlan,
            } => self.alloc(&pf, &sandbox, mac.as_deref(), vlan),
            Request::Alloc {
                pf,
                sandbox,
                kind: DevKind::Sg,
                mac,
                vlan,
            } => self.alloc_sg(&pf, &sandbox, mac.is_some() || vlan.is_some()),
            Request::Release { sandbox } => {
                // A sandbox may hold a VF and an SG function: both go.
                if let Some((_, sg, i)) = self.find_sg(&sandbox) {
                    sg.links.unlink_all(crate::sg::tenant_of(i));
                    if let Err(e) = sg.devset.release(i) {
                        return Response::err(ErrorCode::Internal, e.to_string());
                    }
                }
                if let Some((pf, i)) = self.find_sandbox(&sandbox) {
                    if let Err(e) = pf.devset.release(i) {
                        return Response::err(ErrorCode::Internal, e.to_string());
                    }
                    if pf.devset.snapshot()[i].0 == VfState::Free {
                        pf.ports[i].set_config(PortConfig {
                            mac: pf.ports[i].default_mac,
                            vlan: None,
                        });
                    }
                }
                match self.save() {
                    Ok(()) => Response::ok(),
                    Err(e) => Response::err(ErrorCode::Internal, e.to_string()),
                }
            }
            Request::SgLink { a, b } => self.sg_link(&a, &b),
            Request::SgSched {
                pf,
                policy,
                capacity,
            } => self.sg_sched(&pf, policy.as_deref(), capacity.as_deref()),
            Request::Get { sandbox, vf } => {
                let (found, what) = match (sandbox, vf) {
                    (Some(sb), None) => (
                        self.find_sandbox(&sb)
                            .map(|(pf, i)| {
                                let (st, owner) = pf.devset.snapshot().swap_remove(i);
                                self.info(pf, i, st, owner)
                            })
                            .or_else(|| {
                                self.find_sg(&sb).map(|(pf, sg, i)| {
                                    let (st, owner) = sg.devset.snapshot().swap_remove(i);
                                    self.sg_info(pf, sg, i, st, owner)
                                })
                            }),
                        format!("sandbox {sb:?} has no VF or SG function"),
                    ),
                    (None, Some(id)) => (
                        self.all().into_iter().find(|v| v.id == id),
                        format!("no VF {id:?}"),
                    ),
                    _ => {
                        return Response::err(
                            ErrorCode::BadRequest,
                            "get: give exactly one of \"sandbox\" or \"vf\"",
                        )
                    }
                };
                match found {
                    Some(v) => Response::with_vf(v),
                    None => Response::err(ErrorCode::NotFound, format!("get: {what}")),
                }
            }
            Request::List {} => Response::with_vfs(self.all()),
        }
    }

    /// The PF an `alloc` names (both kinds; the sandbox id was validated).
    fn alloc_target(&self, pf_name: &str) -> Result<&Pf, Box<Response>> {
        self.pfs.iter().find(|p| p.name == pf_name).ok_or_else(|| {
            Box::new(Response::err(
                ErrorCode::UnknownPf,
                format!("alloc: unknown PF {pf_name:?}"),
            ))
        })
    }

    /// Links two sandboxes' SG functions (same PF) so they may connect.
    fn sg_link(&self, a: &str, b: &str) -> Response {
        let ((pa, sg, ia), (pb, _, ib)) = match (self.find_sg(a), self.find_sg(b)) {
            (Some(x), Some(y)) => (x, y),
            (x, _) => {
                let sb = if x.is_none() { a } else { b };
                return Response::err(
                    ErrorCode::NotFound,
                    format!("sg_link: sandbox {sb:?} has no SG function"),
                );
            }
        };
        if pa.name != pb.name {
            return Response::err(
                ErrorCode::BadRequest,
                format!(
                    "sg_link: {a:?} is on PF {}, {b:?} on PF {}: a chain stays on one PF",
                    pa.name, pb.name
                ),
            );
        }
        sg.links
            .link(crate::sg::tenant_of(ia), crate::sg::tenant_of(ib));
        tracing::info!(
            "SG link {} <-> {} ({a} <-> {b})",
            sg.ports[ia].id,
            sg.ports[ib].id
        );
        Response::ok()
    }

    /// New policy and/or capacities for the SG device of `pf_name`, applied
    /// by its SG thread (woken here) before it serves the next event.
    fn sg_sched(&self, pf_name: &str, policy: Option<&str>, capacity: Option<&str>) -> Response {
        let bad = |m: String| Response::err(ErrorCode::BadRequest, m);
        let Some(pf) = self.pfs.iter().find(|p| p.name == pf_name) else {
            return Response::err(ErrorCode::UnknownPf, format!("sg_sched: no PF {pf_name}"));
        };
        let Some(sg) = &pf.sg else {
            return bad(format!(
                "sg_sched: PF {pf_name} has no SG functions (--sgfs)"
            ));
        };
        let mut s = sg.sched();
        let (mut p, mut c) = s.want.unwrap_or(s.now);
        // Validated by `Request::validate`; parsed again here.
        if let Some(x) = policy {
            match x.parse() {
                Ok(v) => p = v,
                Err(e) => return bad(e),
            }
        }
        if let Some(x) = capacity {
            match x.parse() {
                Ok(v) => c = v,
                Err(e) => return bad(e),
            }
        }
        s.want = Some((p, c));
        drop(s);
        if let Err(e) = sg.wake.write(1) {
            return Response::err(
                ErrorCode::Internal,
                format!("sg_sched: wake PF {pf_name}: {e}"),
            );
        }
        Response::ok()
    }

    fn alloc_sg(&self, pf_name: &str, sandbox: &str, net_fields: bool) -> Response {
        let bad = |m: String| Response::err(ErrorCode::BadRequest, m);
        let pf = match self.alloc_target(pf_name) {
            Ok(pf) => pf,
            Err(r) => return *r,
        };
        if net_fields {
            return bad("alloc: an SG function has no \"mac\" or \"vlan\"".into());
        }
        let Some(sg) = &pf.sg else {
            return Response::err(
                ErrorCode::NoFreeVf,
                format!("alloc: PF {pf_name} has no SG functions (--sgfs)"),
            );
        };
        if let Some((_, sg, i)) = self.find_sg(sandbox) {
            return Response::err(
                ErrorCode::AlreadyAssigned,
                format!(
                    "alloc: sandbox {sandbox} already has SG function {}",
                    sg.ports[i].id
                ),
            );
        }
        let Some(i) = sg.devset.assign_any(sandbox) else {
            return Response::err(
                ErrorCode::NoFreeVf,
                format!("alloc: no free SG function on PF {pf_name}"),
            );
        };
        if let Err(e) = self.save() {
            let _ = sg.devset.release(i);
            return Response::err(ErrorCode::Internal, e.to_string());
        }
        let (st, sb) = sg.devset.snapshot().swap_remove(i);
        Response::with_vf(self.sg_info(pf, sg, i, st, sb))
    }

    fn alloc(
        &self,
        pf_name: &str,
        sandbox: &str,
        mac: Option<&str>,
        vlan: Option<u16>,
    ) -> Response {
        let bad = |m: String| Response::err(ErrorCode::BadRequest, m);
        let pf = match self.alloc_target(pf_name) {
            Ok(pf) => pf,
            Err(r) => return *r,
        };
        if let Some((p, i)) = self.find_sandbox(sandbox) {
            return Response::err(
                ErrorCode::AlreadyAssigned,
                format!("alloc: sandbox {sandbox} already has VF {}", p.ports[i].id),
            );
        }
        if let Some(v) = vlan {
            if !(1..=4094).contains(&v) {
                return bad(format!("alloc: vlan {v} out of range 1..4094"));
            }
        }
        let mac = match mac {
            None => None,
            Some(s) => match parse_mac(s) {
                Some(m) if m[0] & 1 == 0 && m != [0; 6] => Some(m),
                _ => {
                    return bad(format!(
                        "alloc: mac {s:?} is not a unicast MAC aa:bb:cc:dd:ee:ff"
                    ))
                }
            },
        };
        if let Some(m) = mac {
            let snap = pf.devset.snapshot();
            if pf
                .ports
                .iter()
                .enumerate()
                .any(|(i, p)| snap[i].1.is_some() && p.config().mac == m)
            {
                return bad(format!(
                    "alloc: mac {} already used by another VF of {pf_name}",
                    MacAddr::from(m)
                ));
            }
        }
        let Some(i) = pf.devset.assign_any(sandbox) else {
            return Response::err(
                ErrorCode::NoFreeVf,
                format!("alloc: no free VF on PF {pf_name}"),
            );
        };
        let port = &pf.ports[i];
        port.set_config(PortConfig {
            mac: mac.unwrap_or(port.default_mac),
            vlan,
        });
        if let Err(e) = self.save() {
            let _ = pf.devset.release(i);
            return Response::err(ErrorCode::Internal, e.to_string());
        }
        let (st, sb) = pf.devset.snapshot().swap_remove(i);
        Response::with_vf(self.info(pf, i, st, sb))
    }
}

/// Threads and sockets of a running daemon; `shutdown` undoes everything.
struct Running {
    stop: Arc<AtomicBool>,
    stop_fd: Arc<EventFd>,
    threads: Vec<JoinHandle<()>>,
    sessions: Arc<Mutex<Sessions>>,
    sockets: Vec<PathBuf>,
    /// Every dataplane thread's wake eventfd (a stop wakes them all).
    wakes: Vec<Arc<EventFd>>,
}

#[derive(Default)]
struct Sessions {
    streams: HashMap<u64, UnixStream>,
    threads: Vec<JoinHandle<()>>,
    next: u64,
}

impl Sessions {
    fn spawn(
        this: &Arc<Mutex<Sessions>>,
        stream: &UnixStream,
        name: String,
        f: impl FnOnce() + Send + 'static,
    ) {
        let mut s = lock(this);
        s.threads.retain(|t| !t.is_finished());
        let key = s.next;
        s.next += 1;
        if let Ok(c) = stream.try_clone() {
            s.streams.insert(key, c);
        }
        let reg = this.clone();
        let t = std::thread::Builder::new().name(name).spawn(move || {
            f();
            lock(&reg).streams.remove(&key);
        });
        match t {
            Ok(t) => s.threads.push(t),
            Err(e) => {
                tracing::warn!("cannot spawn a session thread: {e}");
                s.streams.remove(&key);
            }
        }
    }
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

/// One acceptor thread per PF: a connection on VF i's socket becomes a
/// session thread (concurrent opens really run concurrently).
fn acceptor(
    pf_devset: Arc<Devset<VfHw>>,
    ports: Vec<Arc<Port>>,
    (profile, pools): (&'static Profile, Arc<[PathBuf]>),
    listeners: Vec<UnixListener>,
    stop: Arc<AtomicBool>,
    stop_fd: Arc<EventFd>,
    sessions: Arc<Mutex<Sessions>>,
) {
    let mut fds: Vec<BorrowedFd<'_>> = listeners.iter().map(|l| l.as_fd()).collect();
    fds.push(eventfd_fd(&stop_fd));
    while !stop.load(Ordering::Relaxed) {
        let ready = wait_readable(&fds, Duration::from_secs(1));
        for (i, l) in listeners.iter().enumerate() {
            if !ready[i] {
                continue;
            }
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

pub fn run(args: &NicArgs) -> Result<(), Error> {
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
pub fn run_until(args: &NicArgs, wait: impl FnOnce()) -> Result<(), Error> {
    run_with(args, |_| wait())
}

/// As `run_until`; `wait` also gets the running `Nic` (tests inspect its devsets).
pub fn run_with(args: &NicArgs, wait: impl FnOnce(&Arc<Nic>)) -> Result<(), Error> {
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
    match crate::control::connect_timeout(&args.control, std::time::Duration::from_secs(2)) {
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

fn start(
    nic: &Arc<Nic>,
    args: &NicArgs,
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
        let lp = crate::sg::serve::SgLoop::new(&pf.name, sg)
            .map_err(|e| Error::Config(format!("PF {}: SG device: {e}", pf.name)))?;
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
        let threads = {
            let mut s = lock(&self.sessions);
            for st in s.streams.values() {
                let _ = st.shutdown(std::net::Shutdown::Both);
            }
            std::mem::take(&mut s.threads)
        };
        for t in threads {
            let _ = t.join();
        }
        for p in &self.sockets {
            let _ = std::fs::remove_file(p);
        }
        tracing::info!("nic: shut down");
    }
}

/// The bytes of a MAC in `aa:bb:cc:dd:ee:ff` form (state file, control API).
fn parse_mac(s: &str) -> Option<[u8; 6]> {
    s.parse::<MacAddr>().ok().map(MacAddr::bytes)
}
