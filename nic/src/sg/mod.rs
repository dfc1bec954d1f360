//! SG-IOV in the NIC (docs/sgiov.md §8): SG functions served beside the VFs.
//!
//! An SGF slot is a [`Port`] in a devset of its own (the same lifecycle as
//! a VF: free → assigned → open → closed → reset), with its own vhost-user
//! socket served by the VF session code under the [`PROFILE`] profile.
//! One thread per PF ([`serve::SgLoop`]) owns the `sgiov` device and waits
//! on the PF's wake eventfd (session changes), the engine's completion
//! eventfd, and, per SGF, its two kick eventfds (setup queue, doorbell):
//! fds and threads grow with SGFs, never with pipes.

pub mod frontend;
pub mod mem;
pub mod serve;

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use nic_api::SgCounters;
use sgiov::device::DeviceConfig;
use sgiov::engine::EngineConfig;
use sgiov::exec::capacity::Capacities;
use sgiov::links::Links;
use sgiov::sched::{Policy, SchedConfig};
use vhost::vhost_user::message::VhostUserVirtioFeatures;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::devset::{Devset, LockPolicy};
use crate::port::{Port, VfHw};
use crate::session::Profile;
use crate::Error;

/// Most SG functions per PF (one per sandbox).
pub const MAX_SGFS: usize = 256;

/// The SGF over vhost-user: virtio 1.0, no device features, no config space.
pub static PROFILE: Profile = Profile {
    features: (1 << VIRTIO_F_VERSION_1) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits(),
    config: |_| Vec::new(),
    // `dedicated` signal mode: one signal-only vring per pipe (docs/sgiov.md).
    channels: sgiov::dedicated::MAX_CHANNELS,
};

/// The SG functions (SG-IOV) of `burstvm nic` (its `--sg*` flags).
#[derive(Debug, Clone)]
pub struct SgConfig {
    /// SG functions per PF (SG-IOV, docs/sgiov.md); 0 = none.
    pub sgfs: usize,
    /// Job scheduling of each PF's SG engine: rr, prio or drf.
    pub policy: Policy,
    /// Executor capacities per class, e.g. copy=400M,crypto=160M (bytes/s); none = unlimited.
    pub capacity: Capacities,
    /// Executor threads per PF (0: jobs run on the PF's SG thread).
    pub workers: usize,
    /// Backlogged pipes whose jobs the SG thread generates per round before
    /// it reads the doorbells again (0: the whole backlog; priority-0 pipes
    /// under --sg-policy prio always go first).
    pub gen_budget: usize,
}

impl Default for SgConfig {
    fn default() -> Self {
        SgConfig {
            sgfs: 0,
            policy: Policy::RoundRobin,
            capacity: Capacities::unlimited(),
            workers: 2,
            gen_budget: 32,
        }
    }
}

impl SgConfig {
    pub fn validate(&self) -> Result<(), Error> {
        if self.sgfs > MAX_SGFS {
            return Err(Error::Config(format!(
                "--sgfs {}: at most {MAX_SGFS} per PF",
                self.sgfs
            )));
        }
        if self.workers > 64 {
            return Err(Error::Config(format!(
                "--sg-workers {}: at most 64",
                self.workers
            )));
        }
        Ok(())
    }

    /// The device configuration these flags describe.
    pub fn device_config(&self) -> DeviceConfig {
        DeviceConfig {
            engine: EngineConfig {
                sched: SchedConfig {
                    policy: self.policy,
                    nominal: self.capacity.nominal(),
                    ..Default::default()
                },
                capacity: self.capacity,
                workers: self.workers,
                gen_budget: self.gen_budget,
                ..Default::default()
            },
            ..Default::default()
        }
    }
}

/// The SG functions of one PF.
#[derive(Debug)]
pub struct SgPf {
    pub devset: Arc<Devset<VfHw>>,
    pub ports: Vec<Arc<Port>>,
    /// Wakes the PF's SG thread (sessions bump their port).
    pub wake: Arc<EventFd>,
    pub counters: Arc<Mutex<Vec<SgCounters>>>,
    pub config: DeviceConfig,
    /// Slot pairs allowed to connect (tenant = slot index + 1), edited by
    /// the control API's `sg_link` and `release`.
    pub links: Arc<Links>,
    /// The engine's policy and capacities (`--sg-policy`, `--sg-capacity`,
    /// then the control API's `sg_sched`).
    pub sched: Arc<Mutex<SchedSetting>>,
}

/// The control thread writes `want` and wakes the SG thread, which applies
/// it to its device and moves it to `now` (what `get`/`list` show).
#[derive(Debug, Clone, Copy)]
pub struct SchedSetting {
    pub want: Option<(Policy, Capacities)>,
    pub now: (Policy, Capacities),
}

/// The device's tenant of SGF slot `i` (DRF and links count per tenant).
pub fn tenant_of(i: usize) -> u32 {
    i as u32 + 1
}

/// Id of SGF slot `i` of PF `pf`.
pub fn sgf_id(pf: &str, i: usize) -> String {
    format!("{pf}-sg{i}")
}

impl SgPf {
    pub fn new(
        pf: &str,
        args: &SgConfig,
        policy: LockPolicy,
        socket_dir: &Path,
    ) -> Result<Option<SgPf>, Error> {
        if args.sgfs == 0 {
            return Ok(None);
        }
        let wake = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(|e| Error::Io {
            what: format!("PF {pf}: SG eventfd"),
            source: e,
        })?);
        let ports: Vec<Arc<Port>> = (0..args.sgfs)
            .map(|i| {
                let id = sgf_id(pf, i);
                let socket = socket_dir.join(format!("{id}.sock"));
                Arc::new(Port::new(pf, i, id, socket, [0; 6], wake.clone()))
            })
            .collect();
        let devset = Arc::new(Devset::new(&format!("{pf}-sg"), args.sgfs, policy, |i| {
            VfHw {
                port: ports[i].clone(),
            }
        }));
        Ok(Some(SgPf {
            devset,
            ports,
            wake,
            counters: Arc::new(Mutex::new(vec![SgCounters::default(); args.sgfs])),
            config: args.device_config(),
            links: Arc::new(Links::default()),
            sched: Arc::new(Mutex::new(SchedSetting {
                want: None,
                now: (args.policy, args.capacity),
            })),
        }))
    }

    pub fn sched(&self) -> MutexGuard<'_, SchedSetting> {
        self.sched.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn counters(&self) -> MutexGuard<'_, Vec<SgCounters>> {
        self.counters.lock().unwrap_or_else(|e| e.into_inner())
    }
}
