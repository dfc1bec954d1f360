//! `burstvm nic`: the PFs and their VFs, the vhost-user listeners (one socket
//! per VF, bound once at start), the control server, the dataplane threads,
//! and a clean shutdown on SIGTERM/SIGINT.

mod requests;
mod serve;
mod sessions;

pub use serve::{run, run_until, run_with, BackgroundServer, LOCK_FILE};

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use netutil::MacAddr;
use nic_api::{DevKind, ErrorCode, Request, Response, VfInfo, VfState};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::control::server::{Limits, Server};
use crate::dataplane::uplink::{Uplink, UplinkSpec};
use crate::dataplane::Dataplane;
use crate::devset::{Devset, LockPolicy};
use crate::ids::{default_mac, vf_id};
use crate::port::{Port, PortConfig, VfHw};
use crate::session::Profile;
use crate::sg::{SgConfig, SgPf};
use crate::state::{self, Assignment, StateFile};
use crate::{Error, NicConfig};
use sessions::Sessions;

#[derive(Debug)]
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
#[derive(Debug)]
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
        sg: &SgConfig,
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
            mac: Some(MacAddr::from(cfg.mac)),
            vlan: cfg.vlan,
            socket: port.socket.clone(),
            state,
            sandbox,
            counters: port.counters.snapshot(),
            mapped_bytes: port.mapped_bytes(),
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
            mac: None,
            vlan: None,
            socket: port.socket.clone(),
            state,
            sandbox,
            counters: port.counters.snapshot(),
            mapped_bytes: port.mapped_bytes(),
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
}

/// The bytes of a MAC in `aa:bb:cc:dd:ee:ff` form (state file, control API).
fn parse_mac(s: &str) -> Option<[u8; 6]> {
    s.parse::<MacAddr>().ok().map(MacAddr::bytes)
}
