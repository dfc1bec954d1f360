//! A devset: all VFs of one PF, with VFIO's devset locking (FastIOV §3.2.2).
//!
//! The devset (parent) has a global state, its total open count; each VF (child)
//! has a local state: lifecycle state, own open count and the device payload `T`.
//! Invariants, whatever the interleaving:
//! - the devset open count equals the sum of the VFs' open counts;
//! - a VF in state `open` has open count 1; `free`, `assigned`, `closed`, `reset` have 0;
//! - a VF is reset only while its own open count is zero; the whole devset
//!   (`try_reset`, a bus-level reset) only while the devset's is zero.
//!
//! How the locks are taken is decided in one place, [`LockPolicy`] and the two
//! functions `vf_side` / `devset_side`: `global` uses one mutex for everything
//! (VFIO today), `hierarchical` uses FastIOV's parent rwlock plus a mutex per VF
//! (§4.2.1). VF-local work (open, memory-table mapping, ring set-up) takes the
//! VF side; the close, whose open-count decrement is a parent-child operation,
//! and a devset reset take the devset side.
//!
//! A closed VF is reset on its own at once, as SR-IOV VFs are (function-level
//! reset), inside the close's critical section: it never waits for the other
//! VFs of its PF to close, so a long-lived sandbox does not keep crashed
//! sandboxes' VFs out of use. By then its memory table is unmapped and its
//! rings are forgotten (`VfDevice::on_close`), and the reset clears what is
//! left of its previous tenant (`VfDevice::reset`) before anybody can open it.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use nic_api::VfState;
use serde::{Deserialize, Serialize};

/// How a devset serializes its operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LockPolicy {
    /// One mutex for the devset and all its VFs (vanilla VFIO).
    Global,
    /// Devset rwlock + one mutex per VF (FastIOV).
    Hierarchical,
}

impl LockPolicy {
    pub const ALL: [LockPolicy; 2] = [LockPolicy::Global, LockPolicy::Hierarchical];

    pub fn name(self) -> &'static str {
        match self {
            LockPolicy::Global => "global",
            LockPolicy::Hierarchical => "hierarchical",
        }
    }
}

impl std::fmt::Display for LockPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for LockPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "global" => Ok(Self::Global),
            "hierarchical" => Ok(Self::Hierarchical),
            _ => Err(format!(
                "unknown devset lock policy {s:?} (global|hierarchical)"
            )),
        }
    }
}

/// The device behind a VF: what open, close and reset do to it.
pub trait VfDevice: Send {
    /// VF-local initialisation of an open (state init, ring scrub).
    fn on_open(&mut self);
    /// VF-local teardown of a close (drop the memory table, the rings).
    fn on_close(&mut self);
    /// Reset of this VF (function-level, or as part of a devset reset):
    /// nothing of its previous tenant may survive it. Called only while the
    /// VF's open count is 0.
    fn reset(&mut self);
}

/// Local state of one VF (child node).
#[derive(Debug)]
pub struct VfLocal<T> {
    pub state: VfState,
    pub open_count: u32,
    pub sandbox: Option<String>,
    pub dev: T,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DevsetError {
    #[error("devset {devset}: VF index {index} does not exist")]
    NoSuchVf { devset: String, index: usize },
    #[error("devset {devset}: VF {index} is {state:?}, expected {expected}")]
    BadState {
        devset: String,
        index: usize,
        state: VfState,
        expected: &'static str,
    },
    #[error("devset {devset}: reset refused, {open} VF(s) open")]
    Busy { devset: String, open: u32 },
    #[error("devset {devset}: invariant violated: {what}")]
    Invariant { devset: String, what: String },
}

/// A guard of one side of the devset lock; dropping it releases the lock.
enum SideGuard<'a> {
    Global(#[allow(dead_code)] MutexGuard<'a, ()>),
    Read(#[allow(dead_code)] RwLockReadGuard<'a, ()>),
    Write(#[allow(dead_code)] RwLockWriteGuard<'a, ()>),
}

#[derive(Debug)]
pub struct Devset<T> {
    name: String,
    policy: LockPolicy,
    global: Mutex<()>,
    parent: RwLock<()>,
    /// Devset open count. Incremented on the VF side (an open cannot trigger a
    /// reset), decremented on the devset side; writers of the devset side see it
    /// equal to the VFs' sum because every change happens together with the VF's
    /// own count inside one VF-side or devset-side critical section.
    open_count: AtomicU32,
    resets: AtomicU64,
    vfs: Vec<Mutex<VfLocal<T>>>,
}

/// What a close did: the VF was closed and reset on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CloseOutcome {
    /// Where the reset left it: `Reset` (still assigned) or `Free` (released meanwhile).
    pub state: VfState,
}

fn lock<M>(m: &Mutex<M>) -> MutexGuard<'_, M> {
    // A panic while holding a VF lock must not wedge the devset: the state is
    // plain data that every operation re-validates.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<T: VfDevice> Devset<T> {
    pub fn new(name: &str, n: usize, policy: LockPolicy, mut make: impl FnMut(usize) -> T) -> Self {
        Devset {
            name: name.to_string(),
            policy,
            global: Mutex::new(()),
            parent: RwLock::new(()),
            open_count: AtomicU32::new(0),
            resets: AtomicU64::new(0),
            vfs: (0..n)
                .map(|i| {
                    Mutex::new(VfLocal {
                        state: VfState::Free,
                        open_count: 0,
                        sandbox: None,
                        dev: make(i),
                    })
                })
                .collect(),
        }
    }

    /// The one place where the two policies differ. VF side:
    fn vf_side(&self) -> SideGuard<'_> {
        match self.policy {
            LockPolicy::Global => SideGuard::Global(lock(&self.global)),
            LockPolicy::Hierarchical => {
                SideGuard::Read(self.parent.read().unwrap_or_else(|e| e.into_inner()))
            }
        }
    }

    /// ... and devset side.
    fn devset_side(&self) -> SideGuard<'_> {
        match self.policy {
            LockPolicy::Global => SideGuard::Global(lock(&self.global)),
            LockPolicy::Hierarchical => {
                SideGuard::Write(self.parent.write().unwrap_or_else(|e| e.into_inner()))
            }
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn policy(&self) -> LockPolicy {
        self.policy
    }
    pub fn len(&self) -> usize {
        self.vfs.len()
    }
    pub fn is_empty(&self) -> bool {
        self.vfs.is_empty()
    }
    pub fn resets(&self) -> u64 {
        self.resets.load(Ordering::Relaxed)
    }
    pub fn open_count(&self) -> u32 {
        self.open_count.load(Ordering::SeqCst)
    }

    fn slot(&self, i: usize) -> Result<&Mutex<VfLocal<T>>, DevsetError> {
        self.vfs.get(i).ok_or(DevsetError::NoSuchVf {
            devset: self.name.clone(),
            index: i,
        })
    }

    fn bad_state(&self, i: usize, state: VfState, expected: &'static str) -> DevsetError {
        DevsetError::BadState {
            devset: self.name.clone(),
            index: i,
            state,
            expected,
        }
    }

    /// VF-local operation: runs `f` under the VF side of the lock.
    pub fn with_vf<R>(
        &self,
        i: usize,
        f: impl FnOnce(&mut VfLocal<T>) -> R,
    ) -> Result<R, DevsetError> {
        let slot = self.slot(i)?;
        let _side = self.vf_side();
        let mut vf = lock(slot);
        Ok(f(&mut vf))
    }

    /// free → assigned.
    pub fn assign(&self, i: usize, sandbox: &str) -> Result<(), DevsetError> {
        self.with_vf(i, |vf| {
            if vf.state != VfState::Free {
                return Err(self.bad_state(i, vf.state, "free"));
            }
            vf.state = VfState::Assigned;
            vf.sandbox = Some(sandbox.to_string());
            Ok(())
        })?
    }

    /// Takes the first free VF for `sandbox`; `None` if all are taken.
    pub fn assign_any(&self, sandbox: &str) -> Option<usize> {
        (0..self.vfs.len()).find(|&i| self.assign(i, sandbox).is_ok())
    }

    /// Ends the assignment. assigned/reset → free at once; an open VF keeps
    /// its state and becomes free when it is closed (and reset).
    pub fn release(&self, i: usize) -> Result<(), DevsetError> {
        self.with_vf(i, |vf| {
            vf.sandbox = None;
            if matches!(vf.state, VfState::Assigned | VfState::Reset) {
                vf.state = VfState::Free;
            }
        })
    }

    /// assigned|reset → open, then the VF-local work of the open (`work`), all
    /// in one VF-side critical section. If `work` fails the VF goes to `error`
    /// with open count 0 and waits for a devset reset (`try_reset`).
    pub fn open<R, E>(
        &self,
        i: usize,
        work: impl FnOnce(&mut VfLocal<T>) -> Result<R, E>,
    ) -> Result<Result<R, E>, DevsetError> {
        self.with_vf(i, |vf| {
            if !matches!(vf.state, VfState::Assigned | VfState::Reset) {
                return Err(self.bad_state(i, vf.state, "assigned or reset"));
            }
            vf.state = VfState::Open;
            vf.open_count += 1;
            self.open_count.fetch_add(1, Ordering::SeqCst);
            vf.dev.on_open();
            let r = work(vf);
            if r.is_err() {
                vf.dev.on_close();
                vf.state = VfState::Error;
                vf.open_count -= 1;
                self.open_count.fetch_sub(1, Ordering::SeqCst);
            }
            Ok(r)
        })?
    }

    /// Puts an open VF into the error state (malformed descriptors). It stays
    /// counted as open until its frontend goes away.
    pub fn mark_error(&self, i: usize) -> Result<(), DevsetError> {
        self.mark_error_with(i, |_| {})
    }

    /// `mark_error`, running `work` (the device's side of it) in the same VF-side
    /// critical section, so that a `recover` sees both or neither.
    pub fn mark_error_with(
        &self,
        i: usize,
        work: impl FnOnce(&mut VfLocal<T>),
    ) -> Result<(), DevsetError> {
        self.with_vf(i, |vf| {
            if vf.state == VfState::Open {
                vf.state = VfState::Error;
            }
            work(vf);
        })
    }

    /// A VF-level reset by its own frontend (the guest reset its device): `work` resets
    /// the device, and an `error` VF still open (counted) becomes `open` again, in one
    /// VF-side critical section. Other VFs are not touched. Returns whether it was in
    /// error.
    pub fn recover(
        &self,
        i: usize,
        work: impl FnOnce(&mut VfLocal<T>),
    ) -> Result<bool, DevsetError> {
        self.with_vf(i, |vf| {
            work(vf);
            let was = vf.state == VfState::Error && vf.open_count == 1;
            if was {
                vf.state = VfState::Open;
            }
            was
        })
    }

    /// open|error(open) → closed, then the VF's own reset → reset|free, in one
    /// devset-side critical section (the decrement is a parent-child
    /// operation): nobody sees the VF closed, and it is never opened again
    /// before its reset. The other VFs of the devset are not touched.
    pub fn close(&self, i: usize) -> Result<CloseOutcome, DevsetError> {
        let slot = self.slot(i)?;
        let _side = self.devset_side();
        let mut vf = lock(slot);
        if vf.open_count == 0 {
            return Err(self.bad_state(i, vf.state, "open"));
        }
        vf.dev.on_close();
        vf.open_count -= 1;
        vf.state = VfState::Closed;
        self.open_count.fetch_sub(1, Ordering::SeqCst);
        Self::reset_vf(&mut vf);
        self.resets.fetch_add(1, Ordering::Relaxed);
        Ok(CloseOutcome { state: vf.state })
    }

    /// Resets one VF with open count 0: its device, then `reset` (still
    /// assigned) or `free`.
    fn reset_vf(vf: &mut VfLocal<T>) {
        vf.dev.reset();
        vf.state = if vf.sandbox.is_some() {
            VfState::Reset
        } else {
            VfState::Free
        };
    }

    /// Explicit devset (bus-level) reset of every closed or failed VF;
    /// refused while any VF is open.
    pub fn try_reset(&self) -> Result<usize, DevsetError> {
        let _side = self.devset_side();
        let open = self.open_count.load(Ordering::SeqCst);
        if open != 0 {
            return Err(DevsetError::Busy {
                devset: self.name.clone(),
                open,
            });
        }
        Ok(self.reset_locked())
    }

    /// Bus-level reset with the devset side held and open count 0: every VF that
    /// needs it (closed, error) is reset together. Returns how many.
    fn reset_locked(&self) -> usize {
        let mut n = 0;
        let mut guards: Vec<_> = self.vfs.iter().map(lock).collect();
        if guards.iter().any(|vf| vf.open_count != 0) {
            // Cannot happen while the invariants hold; refuse rather than reset
            // a device in use.
            return 0;
        }
        for vf in guards.iter_mut() {
            if matches!(vf.state, VfState::Closed | VfState::Error) {
                Self::reset_vf(vf);
                n += 1;
            }
        }
        if n > 0 {
            self.resets.fetch_add(1, Ordering::Relaxed);
        }
        n
    }

    /// Checks the invariants under the devset side (a consistent snapshot).
    pub fn check_invariants(&self) -> Result<(), DevsetError> {
        let _side = self.devset_side();
        let guards: Vec<_> = self.vfs.iter().map(lock).collect();
        let bad = |what: String| {
            Err(DevsetError::Invariant {
                devset: self.name.clone(),
                what,
            })
        };
        let sum: u32 = guards.iter().map(|vf| vf.open_count).sum();
        let total = self.open_count.load(Ordering::SeqCst);
        if sum != total {
            return bad(format!(
                "devset open count {total} != sum of VF open counts {sum}"
            ));
        }
        for (i, vf) in guards.iter().enumerate() {
            let ok = match vf.state {
                VfState::Open => vf.open_count == 1,
                VfState::Error => vf.open_count <= 1,
                _ => vf.open_count == 0,
            };
            if !ok {
                return bad(format!(
                    "VF {i} is {:?} with open count {}",
                    vf.state, vf.open_count
                ));
            }
            if vf.state == VfState::Free && vf.sandbox.is_some() {
                return bad(format!("VF {i} is free but assigned to {:?}", vf.sandbox));
            }
        }
        Ok(())
    }

    /// A copy of every VF's lifecycle state and sandbox.
    pub fn snapshot(&self) -> Vec<(VfState, Option<String>)> {
        (0..self.vfs.len())
            .map(|i| {
                self.with_vf(i, |vf| (vf.state, vf.sandbox.clone()))
                    .expect("index in range")
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Dev {
        opens: u32,
        resets: u32,
    }
    impl VfDevice for Dev {
        fn on_open(&mut self) {
            self.opens += 1;
        }
        fn on_close(&mut self) {}
        fn reset(&mut self) {
            self.resets += 1;
        }
    }

    #[test]
    fn lifecycle_and_reset_rules() {
        for policy in [LockPolicy::Global, LockPolicy::Hierarchical] {
            let d = Devset::new("pf0", 2, policy, |_| Dev::default());
            assert!(
                d.open(0, |_| Ok::<_, ()>(())).is_err(),
                "free VF cannot be opened"
            );
            d.assign(0, "a").unwrap();
            d.assign(1, "b").unwrap();
            assert!(d.assign(0, "c").is_err());
            d.open(0, |_| Ok::<_, ()>(())).unwrap().unwrap();
            d.open(1, |_| Ok::<_, ()>(())).unwrap().unwrap();
            assert_eq!(d.open_count(), 2);
            // A VF-level reset takes an open VF out of error, and only that VF.
            d.mark_error(0).unwrap();
            assert!(!d.recover(1, |_| {}).unwrap(), "VF 1 was not in error");
            assert!(d.recover(0, |vf| vf.dev.opens += 10).unwrap());
            assert_eq!(d.snapshot()[0].0, VfState::Open);
            d.with_vf(0, |vf| assert_eq!(vf.dev.opens, 11)).unwrap();
            d.check_invariants().unwrap();
            assert!(matches!(
                d.try_reset(),
                Err(DevsetError::Busy { open: 2, .. })
            ));
            // Closed with VF 1 still open: reset on its own, VF 1 untouched.
            assert_eq!(d.close(0).unwrap().state, VfState::Reset);
            assert_eq!(d.snapshot()[0].0, VfState::Reset);
            d.with_vf(0, |vf| assert_eq!(vf.dev.resets, 1)).unwrap();
            d.with_vf(1, |vf| assert_eq!(vf.dev.resets, 0)).unwrap();
            assert_eq!(d.snapshot()[1].0, VfState::Open);
            d.release(0).unwrap();
            assert_eq!(d.snapshot()[0], (VfState::Free, None));
            // Released while open: free at its close.
            d.release(1).unwrap();
            assert_eq!(d.snapshot()[1], (VfState::Open, None));
            assert_eq!(d.close(1).unwrap().state, VfState::Free);
            d.with_vf(1, |vf| assert_eq!(vf.dev.resets, 1)).unwrap();
            d.assign(1, "b").unwrap();
            // A failed open leaves the VF in error, not counted.
            d.open(1, |_| Err::<(), _>("boom")).unwrap().unwrap_err();
            assert_eq!(d.snapshot()[1].0, VfState::Error);
            assert_eq!(d.open_count(), 0);
            d.check_invariants().unwrap();
            assert_eq!(d.try_reset().unwrap(), 1);
            assert_eq!(d.snapshot()[1].0, VfState::Reset);
        }
    }
}
