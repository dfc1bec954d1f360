//! A pool of ready network attachments (issue 11 §2), in the spirit of
//! RunD's cgroup pool: while the host is idle the runtime creates network
//! namespaces and runs CNI ADD for them (VF taken, placeholder link in
//! place, address leased), so a sandbox start claims a ready netns in
//! microseconds (`net-claim` stage) instead of `netns` + `cni-add`.
//!
//! Every entry is a real CNI attachment whose container id is
//! `bv<tag>-pool<n>`: the pool DELs what it still holds when it stops, a
//! claimed entry is DELed by its sandbox's teardown like any other, and a
//! runtime that dies (SIGKILL) leaves netns carrying its tag, which the next
//! runtime's `reap_stale` removes with the dead runtime's state directory
//! (its IPAM leases and NIC state; its NIC daemon died with it).

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use netutil::NamedNetns;

use crate::cni_exec::{CniError, CniNetwork};
use crate::failures::Failures;
use crate::guestnet::{GuestLink, GuestNetError};
use crate::server_netns::{NeighborTable, ServerNetError};
// Stopping the pool retries a DEL answered "try again later" as a teardown does.
use crate::sandbox::{DEL_PATIENCE, IFNAME};

/// The refill waits until no sandbox is starting and none finished starting
/// for this long: the pool is filled while the host is idle, never during a
/// burst of starts (its ADDs would take the NIC daemon's devset lock and CPU
/// from them). A host that never idles falls back to per-start ADDs.
const QUIET: Duration = Duration::from_millis(100);
/// After a failed ADD (e.g. the NIC daemon killed mid-call; one replaced
/// for another lock policy waits for the ADD in flight, `quiesce`) the
/// refill tries again after this.
const RETRY: Duration = Duration::from_millis(500);

/// Making or releasing one pooled attachment failed: which one, which step.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("pooled attachment {id}: {source}")]
    Netns {
        id: String,
        #[source]
        source: netutil::NetnsError,
    },
    #[error("pooled attachment {id}: {source}")]
    Cni {
        id: String,
        #[source]
        source: Box<CniError>,
    },
    #[error("pooled attachment {id}: {source}")]
    Link {
        id: String,
        #[source]
        source: GuestNetError,
    },
    #[error("pooled attachment {id}: {source}")]
    Neighbor {
        id: String,
        #[source]
        source: ServerNetError,
    },
    /// A failed make and what its undo could not remove.
    #[error("{cause}; undo: {undo}")]
    Undone {
        #[source]
        cause: Box<PoolError>,
        undo: Failures<PoolError>,
    },
}

/// A ready attachment: its netns (with the placeholder link `IFNAME`), the
/// CNI container id it was added under, and the link the guest gets, whose
/// neighbour entry on the server is in place (the claiming sandbox's
/// teardown removes it with the rest).
#[derive(Debug)]
pub struct Pooled {
    pub id: String,
    pub netns: NamedNetns,
    pub link: GuestLink,
    /// The VF's vhost-user socket from the ADD result (None: ask the NIC daemon).
    pub vf_socket: Option<std::path::PathBuf>,
}

#[derive(Default, Debug)]
struct State {
    ready: VecDeque<Pooled>,
    /// Ids the pool owns: ready or being made (leak checks skip them).
    owned: HashSet<String>,
    /// The last claim or end of a start.
    last_activity: Option<Instant>,
    /// Sandbox starts in progress (`NetPool::busy`).
    busy: usize,
    /// An attachment is being made (its ADD may be in the NIC daemon).
    making: bool,
    last_error: Option<Arc<PoolError>>,
    stop: bool,
    /// Attachments made, and the host CPU that took: the refill thread's
    /// own and its CNI plugins' (`cpuacct`), off every start's path.
    made: u64,
    made_cpu_ns: u64,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    /// Wakes the refill thread (a claim, stop).
    wake: Condvar,
    /// Wakes `wait_full`.
    changed: Condvar,
    target: usize,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `NetPool::quiesce`.
    fn quiesce(this: &Arc<Shared>, bound: Duration) -> Busy {
        let mut st = this.lock();
        st.busy += 1;
        let busy = Busy(this.clone());
        let end = Instant::now() + bound;
        while st.making {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            st = this
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        busy
    }
}

/// The pool and its refill thread; dropping it DELs every entry it holds.
#[derive(Debug)]
pub struct NetPool {
    shared: Arc<Shared>,
    cni: CniNetwork,
    neigh: Arc<NeighborTable>,
    thread: Option<JoinHandle<()>>,
    stopped: bool,
}

/// The CPU (ns) the NIC daemon's CNI server has run so far (`NetPool::start`).
pub type ServedCpu = Box<dyn Fn() -> u64 + Send>;

impl NetPool {
    /// Starts the refill thread: `target` attachments of `cni`, named
    /// `<prefix>pool<n>`, each with its entry in `neigh` (the server's).
    /// `served` reads the CPU (ns) the NIC daemon's CNI server has run so
    /// far: the part of an ADD that ran there (docs/cni.md "The CNI server").
    pub fn start(
        cni: CniNetwork,
        neigh: Arc<NeighborTable>,
        prefix: String,
        target: usize,
        served: ServedCpu,
    ) -> std::io::Result<NetPool> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            changed: Condvar::new(),
            target,
        });
        let thread = {
            let (shared, cni, neigh) = (shared.clone(), cni.clone(), neigh.clone());
            std::thread::Builder::new()
                .name("net-pool".into())
                .spawn(move || refill(&shared, &cni, &neigh, &prefix, &*served))?
        };
        Ok(NetPool {
            shared,
            cni,
            neigh,
            thread: Some(thread),
            stopped: false,
        })
    }

    /// Takes a ready attachment (None: the pool is empty; the sandbox sets
    /// its network up itself). The caller owns it from here: its teardown
    /// DELs `id` and deletes the netns.
    pub fn claim(&self) -> Option<Pooled> {
        let mut st = self.shared.lock();
        let p = st.ready.pop_front()?;
        st.owned.remove(&p.id);
        st.last_activity = Some(Instant::now());
        drop(st);
        self.shared.wake.notify_all();
        Some(p)
    }

    /// Held by a sandbox while it starts: the pool does not refill meanwhile.
    pub fn busy(&self) -> Busy {
        self.shared.lock().busy += 1;
        Busy(self.shared.clone())
    }

    /// As `busy`, after the attachment being made, if any, is done (waited
    /// for at most `bound`): held while the NIC daemon is replaced, so that
    /// no ADD is cut off by it (it would fail, TRY_AGAIN_LATER, and be undone).
    pub fn quiesce(&self, bound: Duration) -> Busy {
        Shared::quiesce(&self.shared, bound)
    }

    pub fn target(&self) -> usize {
        self.shared.target
    }

    /// Attachments made so far and the host CPU they took (ns): the start
    /// path's `net-claim` is cheap because this was paid while the host was
    /// idle, and a bench reports it apart.
    pub fn refill_cpu(&self) -> (u64, u64) {
        let st = self.shared.lock();
        (st.made, st.made_cpu_ns)
    }

    pub fn ready(&self) -> usize {
        self.shared.lock().ready.len()
    }

    /// Names (netns and CNI container ids) the pool holds or is making.
    pub fn owned(&self) -> HashSet<String> {
        self.shared.lock().owned.clone()
    }

    /// Waits until the pool is full, for at most `bound`; returns how many
    /// are ready and the last refill error, if any.
    pub fn wait_full(&self, bound: Duration) -> (usize, Option<Arc<PoolError>>) {
        let end = Instant::now() + bound;
        let mut st = self.shared.lock();
        while st.ready.len() < self.shared.target {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        (st.ready.len(), st.last_error.clone())
    }

    /// Stops the refill thread and DELs every attachment still pooled.
    pub fn stop(&mut self) -> Result<(), Failures<PoolError>> {
        if std::mem::replace(&mut self.stopped, true) {
            return Ok(());
        }
        self.shared.lock().stop = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let left: Vec<Pooled> = self.shared.lock().ready.drain(..).collect();
        let mut errs = Vec::new();
        for mut p in left {
            if let Err(source) = self.neigh.del(p.link.ip) {
                errs.push(PoolError::Neighbor {
                    id: p.id.clone(),
                    source,
                });
            }
            errs.extend(release(&self.cni, &p.id, &mut p.netns));
        }
        self.shared.lock().owned.clear();
        Failures::check(|| "network pool".to_string(), errs)
    }
}

/// A sandbox start in progress (see `NetPool::busy`).
#[derive(Debug)]
pub struct Busy(Arc<Shared>);

impl Drop for Busy {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.busy -= 1;
        st.last_activity = Some(Instant::now());
        drop(st);
        self.0.wake.notify_all();
    }
}

impl Drop for NetPool {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!("{e}");
        }
    }
}

/// The refill thread: keeps `target` attachments ready, one ADD at a time,
/// at the lowest CPU priority (its CNI plugins inherit it).
fn refill(
    shared: &Shared,
    cni: &CniNetwork,
    neigh: &NeighborTable,
    prefix: &str,
    served: &(dyn Fn() -> u64 + Send),
) {
    let _ = procutil::sched::set_thread_nice(19);
    let mut seq = 0u64;
    let mut st = shared.lock();
    loop {
        if st.stop {
            return;
        }
        if st.ready.len() >= shared.target || st.busy > 0 {
            st = shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
            continue;
        }
        let since = st.last_activity.map_or(QUIET, |t| t.elapsed());
        if since < QUIET {
            st = shared
                .wake
                .wait_timeout(st, QUIET - since)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            continue;
        }
        let id = format!("{prefix}pool{seq}");
        seq += 1;
        st.owned.insert(id.clone());
        st.making = true;
        drop(st);
        // A refill runs while no sandbox starts: the CNI server's CPU meanwhile
        // is this ADD's (a teardown's DEL that overlaps it is counted too).
        let cpu = || crate::cpuacct::thread_ns() + crate::cpuacct::thread_children_ns() + served();
        let cpu0 = cpu();
        let made = make(cni, neigh, &id);
        let cpu = cpu().saturating_sub(cpu0);
        st = shared.lock();
        st.making = false;
        match made {
            Ok(p) => {
                st.made += 1;
                st.made_cpu_ns += cpu;
                st.ready.push_back(p);
                st.last_error = None;
                shared.changed.notify_all();
            }
            Err(e) => {
                st.owned.remove(&id);
                tracing::warn!("network pool: {e}");
                st.last_error = Some(Arc::new(e));
                shared.changed.notify_all();
                st = shared
                    .wake
                    .wait_timeout(st, RETRY)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
    }
}

/// One attachment: a netns, CNI ADD in it, the placeholder read back, the
/// server's neighbour entry (off the start path: at 200 starts at once the
/// entries, one rtnetlink request each under the kernel's rtnl lock, made
/// `net-claim` take 150-400 ms). A failure undoes what was done (DEL is
/// idempotent).
fn make(cni: &CniNetwork, neigh: &NeighborTable, id: &str) -> Result<Pooled, PoolError> {
    let mut netns = NamedNetns::create(id).map_err(|source| PoolError::Netns {
        id: id.into(),
        source,
    })?;
    let added = cni
        .add(id, netns.path(), IFNAME)
        .map_err(|e| PoolError::Cni {
            id: id.into(),
            source: Box::new(e),
        })
        .and_then(|att| {
            crate::guestnet::read_link(netns.path(), IFNAME, &att)
                .map(|link| (link, att.vf_socket))
                .map_err(|source| PoolError::Link {
                    id: id.into(),
                    source,
                })
        })
        .and_then(|(link, vf_socket)| {
            neigh
                .add(link.ip, link.mac)
                .map(|()| (link, vf_socket))
                .map_err(|source| PoolError::Neighbor {
                    id: id.into(),
                    source,
                })
        });
    match added {
        Ok((link, vf_socket)) => Ok(Pooled {
            id: id.into(),
            netns,
            link,
            vf_socket,
        }),
        Err(cause) => {
            let undo = release(cni, id, &mut netns);
            match Failures::check(|| format!("pooled attachment {id}"), undo) {
                Ok(()) => Err(cause),
                Err(undo) => Err(PoolError::Undone {
                    cause: Box::new(cause),
                    undo,
                }),
            }
        }
    }
}

/// CNI DEL of a pooled attachment and removal of its netns: what failed
/// (both are tried).
fn release(cni: &CniNetwork, id: &str, netns: &mut NamedNetns) -> Vec<PoolError> {
    let mut errs = Vec::new();
    if let Err(e) = cni.del_retrying(id, netns.path(), IFNAME, DEL_PATIENCE) {
        errs.push(PoolError::Cni {
            id: id.into(),
            source: Box::new(e),
        });
    }
    if let Err(source) = netns.delete() {
        errs.push(PoolError::Netns {
            id: id.into(),
            source,
        });
    }
    errs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `quiesce` holds refills off at once and returns when the attachment
    /// being made is done (or at its bound).
    #[test]
    fn quiesce_waits_for_the_attachment_being_made() {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                making: true,
                ..State::default()
            }),
            wake: Condvar::new(),
            changed: Condvar::new(),
            target: 1,
        });
        let maker = {
            let shared = shared.clone();
            std::thread::spawn(move || {
                // The refill sees the hold before its next attachment.
                while shared.lock().busy == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
                std::thread::sleep(Duration::from_millis(50));
                shared.lock().making = false;
                shared.changed.notify_all();
            })
        };
        let busy = Shared::quiesce(&shared, Duration::from_secs(30));
        assert!(!shared.lock().making, "returned before the ADD was done");
        assert_eq!(shared.lock().busy, 1);
        maker.join().unwrap();
        drop(busy);
        assert_eq!(shared.lock().busy, 0);

        // Never done: the bound.
        shared.lock().making = true;
        let t = Instant::now();
        let busy = Shared::quiesce(&shared, Duration::from_millis(100));
        assert!(t.elapsed() >= Duration::from_millis(100));
        assert!(shared.lock().making);
        drop(busy);
    }
}
