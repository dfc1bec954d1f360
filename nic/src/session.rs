//! The vhost-user backend of one device slot (a VF, or an SG function: the
//! same session code and devset lifecycle; a [`Profile`] says what differs):
//! one session per frontend connection.
//!
//! The session is the "open" of the VF: the connection is accepted only if the
//! devset lets the VF be opened, every message that touches VF-local state runs
//! under the devset's VF-side lock (so the lock policy wraps the whole session
//! set-up, memory table mapping included), and the end of the connection, also a
//! killed frontend, closes the VF (and resets it).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use vhost::vhost_user::message::*;
use vhost::vhost_user::{
    Backend, BackendReqHandler, Error as VuError, GpuBackend, VhostUserBackendReqHandlerMut,
};
use vhost::VhostUserMemoryRegionBase;
use virtio_bindings::virtio_config::{VIRTIO_F_IN_ORDER, VIRTIO_F_VERSION_1};
use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_MAC, VIRTIO_NET_F_MRG_RXBUF, VIRTIO_NET_F_STATUS, VIRTIO_NET_S_LINK_UP,
};
use virtio_queue::QueueT;
use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::EventFd;

use crate::devset::{Devset, VfLocal};
use crate::memory::VfMemory;
use crate::port::{AtomicCounters, Port, VfHw, MAX_QUEUE_SIZE};

type Result<T> = std::result::Result<T, VuError>;

pub const VIRTIO_FEATURES: u64 = (1 << VIRTIO_F_VERSION_1)
    | (1u64 << VIRTIO_F_IN_ORDER)
    | (1 << VIRTIO_NET_F_MAC)
    | (1 << VIRTIO_NET_F_STATUS)
    | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();

fn fail(what: String) -> VuError {
    tracing::warn!("{what}");
    VuError::ReqHandlerError(io::Error::other(what))
}

/// A request that failed on an error of its own: the vhost crate wants an
/// io::Error, which carries this one as its inner error.
#[derive(Debug, thiserror::Error)]
enum RequestError {
    #[error("VF {vf}: vring {q} {what} fd: {source}")]
    VringFd {
        vf: String,
        q: usize,
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("VF {vf}: vring {q} addresses: {source}")]
    VringAddr {
        vf: String,
        q: usize,
        #[source]
        source: virtio_queue::Error,
    },
}

fn failed(e: RequestError) -> VuError {
    tracing::warn!("{e}");
    VuError::ReqHandlerError(io::Error::other(e))
}

/// What a device kind offers over vhost-user: its virtio features and its
/// config space. Memory table, vrings and lifecycle are shared.
#[derive(Debug)]
pub struct Profile {
    pub features: u64,
    pub config: fn(&Port) -> Vec<u8>,
    /// Signal-only vrings accepted past the two queues (vrings 2..2+n:
    /// KICK, CALL and ENABLE only, never a virtqueue).
    pub channels: usize,
}

/// virtio-net: a VF.
pub static NET: Profile = Profile {
    features: VIRTIO_FEATURES,
    config: net_config,
    channels: 0,
};

/// A vring index of a SET_VRING_KICK/CALL/ENABLE message.
#[derive(Debug, Clone, Copy)]
enum Vq {
    Queue(usize),
    Channel(usize),
}

fn net_config(port: &Port) -> Vec<u8> {
    // struct virtio_net_config: mac[6], status u16, max_virtqueue_pairs u16, mtu u16.
    let mut cfg = Vec::with_capacity(12);
    cfg.extend_from_slice(&port.config().mac);
    cfg.extend_from_slice(&(VIRTIO_NET_S_LINK_UP as u16).to_le_bytes());
    cfg.extend_from_slice(&1u16.to_le_bytes());
    cfg.extend_from_slice(&1500u16.to_le_bytes());
    cfg
}

/// As [`fail`], keeping `e` as the typed cause inside the `io::Error`.
fn fail_with(e: impl std::error::Error + Send + Sync + 'static) -> VuError {
    tracing::warn!("{e}");
    VuError::ReqHandlerError(io::Error::other(e))
}

#[derive(Debug)]
pub struct VfSession {
    devset: Arc<Devset<VfHw>>,
    profile: &'static Profile,
    port: Arc<Port>,
    /// Pool servers the memory table's pool memory is registered with.
    pools: Arc<[PathBuf]>,
    index: usize,
    acked_features: u64,
    acked_protocol: u64,
}

impl VfSession {
    /// VF-local operation under the devset's VF-side lock.
    fn vf<R>(&self, f: impl FnOnce(&mut VfLocal<VfHw>) -> Result<R>) -> Result<R> {
        self.devset.with_vf(self.index, f).map_err(fail_with)?
    }

    fn queue_index(&self, index: u32) -> Result<usize> {
        match self.vring_index(index)? {
            Vq::Queue(q) => Ok(q),
            // No virtqueue there: the daemon never walks a ring the
            // frontend placed on a signal channel.
            Vq::Channel(_) => Err(fail(format!(
                "VF {}: vring {index} is a signal channel (KICK, CALL and ENABLE only)",
                self.port.id
            ))),
        }
    }

    fn vring_index(&self, index: u32) -> Result<Vq> {
        let n = self.profile.channels;
        match index as usize {
            q @ (0 | 1) => Ok(Vq::Queue(q)),
            i if i - 2 < n => Ok(Vq::Channel(i - 2)),
            _ => Err(fail(format!(
                "VF {}: vring index {index} out of range (2 queues, {n} channels)",
                self.port.id
            ))),
        }
    }

    /// The ring and the (non-blocking) eventfd of a SET_VRING_KICK/CALL/ERR message.
    fn ring_eventfd(
        &self,
        index: u8,
        fd: Option<File>,
        what: &str,
    ) -> Result<(usize, Option<EventFd>)> {
        let q = self.queue_index(index as u32)?;
        let efd = fd.map(eventfd_from).transpose().map_err(|source| {
            failed(RequestError::VringFd {
                vf: self.port.id.clone(),
                q,
                what: what.to_string(),
                source,
            })
        })?;
        Ok((q, efd))
    }

    /// The (non-blocking) eventfd of a channel's SET_VRING_KICK/CALL.
    fn channel_eventfd(&self, index: u8, fd: Option<File>, what: &str) -> Result<Option<EventFd>> {
        fd.map(eventfd_from).transpose().map_err(|e| {
            fail(format!(
                "VF {}: channel vring {index} {what} fd: {e}",
                self.port.id
            ))
        })
    }

    /// A started ring (ready since SET_VRING_KICK, until GET_VRING_BASE or a
    /// device reset) asked to move or change size: the guest changed a queue
    /// after DRIVER_OK, which the VMM never relays. Counted (`bad_requests`)
    /// and logged; the ring stays as it was validated and the session goes
    /// on, as the VMM ignores such a register write.
    fn moved_started_ring(&self, q: usize, what: std::fmt::Arguments<'_>) {
        AtomicCounters::note(
            &self.port.counters.bad_requests,
            format_args!(
                "VF {}: vring {q} is started: {what} ignored (frontend misbehaviour)",
                self.port.id
            ),
        );
    }

    fn protocol_features_acked(&self) -> bool {
        self.acked_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0
    }
}

/// Makes an eventfd from the frontend non-blocking so that draining it never blocks.
fn eventfd_from(file: File) -> io::Result<EventFd> {
    let fd: OwnedFd = file.into();
    // SAFETY: fcntl on a valid fd we own.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0
        // SAFETY: fcntl on a valid fd we own, setting file status flags only.
        || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0
    {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the fd is owned and valid; EventFd takes ownership.
    Ok(unsafe { EventFd::from_raw_fd(fd.into_raw_fd()) })
}

impl VhostUserBackendReqHandlerMut for VfSession {
    fn set_owner(&mut self) -> Result<()> {
        Ok(())
    }
    fn reset_owner(&mut self) -> Result<()> {
        Ok(())
    }
    fn reset_device(&mut self) -> Result<()> {
        // The guest reset its device: stop and forget the rings (the dataplane sees them
        // unusable under the runtime lock), leave the error state; the session, the memory
        // table and every other VF of the devset stay as they are.
        let was_error = self
            .devset
            .recover(self.index, |vf| vf.dev.port.runtime().reset_device())
            .map_err(fail_with)?;
        if was_error {
            tracing::info!("VF {}: reset by its frontend, out of error", self.port.id);
        }
        self.port.bump();
        Ok(())
    }
    fn get_features(&mut self) -> Result<u64> {
        Ok(self.profile.features)
    }
    fn set_features(&mut self, features: u64) -> Result<()> {
        if features & !self.profile.features != 0 {
            return Err(fail(format!(
                "VF {}: frontend acked unoffered features {features:#x}",
                self.port.id
            )));
        }
        self.acked_features = features;
        let hdr_len = if features & ((1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_NET_F_MRG_RXBUF)) != 0
        {
            12
        } else {
            10
        };
        let start_enabled = !self.protocol_features_acked();
        self.vf(|vf| {
            let mut rt = vf.dev.port.runtime();
            rt.hdr_len = hdr_len;
            rt.features = features;
            // Without VHOST_USER_F_PROTOCOL_FEATURES rings start enabled.
            for vr in rt.vrings.iter_mut() {
                vr.enabled = start_enabled;
            }
            Ok(())
        })
    }
    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        _postcopy: Option<bool>,
    ) -> Result<Option<Vec<VhostUserMemoryRegionBase>>> {
        let id = self.port.id.clone();
        // The DMA mapping: mmap + populate + mlock, under the VF-side lock.
        self.vf(|vf| {
            let mem = VfMemory::map(&id, ctx, files, &self.pools).map_err(fail_with)?;
            vf.dev.port.set_memory(mem);
            Ok(())
        })?;
        Ok(None)
    }
    fn set_vring_num(&mut self, index: u32, num: u32) -> Result<()> {
        let q = self.queue_index(index)?;
        let id = self.port.id.clone();
        self.vf(|vf| {
            let mut rt = vf.dev.port.runtime();
            if num == 0 || num > MAX_QUEUE_SIZE as u32 || !num.is_power_of_two() {
                return Err(fail(format!("VF {id}: vring {q} size {num} invalid")));
            }
            let queue = &mut rt.vrings[q].queue;
            if queue.ready() {
                if queue.size() != num as u16 {
                    self.moved_started_ring(q, format_args!("size {} -> {num}", queue.size()));
                }
                return Ok(());
            }
            queue.set_size(num as u16);
            Ok(())
        })
    }
    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> Result<()> {
        let q = self.queue_index(index)?;
        let id = self.port.id.clone();
        self.vf(|vf| {
            let mut rt = vf.dev.port.runtime();
            let mem = rt
                .mem
                .as_ref()
                .ok_or_else(|| fail(format!("VF {id}: SET_VRING_ADDR before SET_MEM_TABLE")))?;
            let tr = |va: u64, what: &str| {
                mem.va_to_gpa(va).ok_or_else(|| {
                    fail(format!(
                        "VF {id}: vring {q} {what} address {va:#x} not in the memory table"
                    ))
                })
            };
            let (d, a, u): (GuestAddress, GuestAddress, GuestAddress) = (
                tr(descriptor, "descriptor")?,
                tr(available, "avail")?,
                tr(used, "used")?,
            );
            let queue = &mut rt.vrings[q].queue;
            if queue.ready() {
                let now = (queue.desc_table(), queue.avail_ring(), queue.used_ring());
                let asked = (d.0, a.0, u.0);
                if now != asked {
                    self.moved_started_ring(
                        q,
                        format_args!("desc/avail/used {now:#x?} -> {asked:#x?}"),
                    );
                }
                return Ok(());
            }
            queue
                .try_set_desc_table_address(d)
                .and_then(|_| queue.try_set_avail_ring_address(a))
                .and_then(|_| queue.try_set_used_ring_address(u))
                .map_err(|source| {
                    failed(RequestError::VringAddr {
                        vf: id.clone(),
                        q,
                        source,
                    })
                })?;
            Ok(())
        })
    }
    fn set_vring_base(&mut self, index: u32, base: u32) -> Result<()> {
        let q = self.queue_index(index)?;
        self.vf(|vf| {
            let mut rt = vf.dev.port.runtime();
            rt.vrings[q].queue.set_next_avail(base as u16);
            rt.vrings[q].queue.set_next_used(base as u16);
            Ok(())
        })
    }
    fn get_vring_base(&mut self, index: u32) -> Result<VhostUserVringState> {
        let q = self.queue_index(index)?;
        // GET_VRING_BASE stops the ring.
        let base = self.vf(|vf| {
            let mut rt = vf.dev.port.runtime();
            let vr = &mut rt.vrings[q];
            vr.queue.set_ready(false);
            vr.kick = None;
            Ok(vr.queue.next_avail())
        })?;
        self.port.bump();
        Ok(VhostUserVringState::new(index, base as u32))
    }
    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> Result<()> {
        if let Vq::Channel(k) = self.vring_index(index as u32)? {
            let kick = self.channel_eventfd(index, fd, "kick")?;
            self.vf(|vf| {
                vf.dev.port.runtime().channel_mut(k).kick = kick.map(Arc::new);
                Ok(())
            })?;
            self.port.bump();
            return Ok(());
        }
        let (q, kick) = self.ring_eventfd(index, fd, "kick")?;
        let id = self.port.id.clone();
        let kick = kick.ok_or_else(|| {
            fail(format!(
                "VF {id}: vring {q}: polling mode (no kick fd) not supported"
            ))
        })?;
        self.vf(|vf| {
            let mut rt = vf.dev.port.runtime();
            let rt = &mut *rt;
            let mem = rt
                .mem
                .as_ref()
                .ok_or_else(|| fail(format!("VF {id}: SET_VRING_KICK before SET_MEM_TABLE")))?;
            let vr = &mut rt.vrings[q];
            // The rings must lie in the memory table (checked on a ready queue).
            vr.queue.set_ready(true);
            if !vr.queue.is_valid(&mem.gm) {
                vr.queue.set_ready(false);
                return Err(fail(format!(
                    "VF {id}: vring {q} is not valid in the memory table"
                )));
            }
            vr.kick = Some(Arc::new(kick));
            Ok(())
        })?;
        self.port.bump();
        Ok(())
    }
    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> Result<()> {
        if let Vq::Channel(k) = self.vring_index(index as u32)? {
            let call = self.channel_eventfd(index, fd, "call")?;
            return self.vf(|vf| {
                vf.dev.port.runtime().channel_mut(k).call = call;
                Ok(())
            });
        }
        let (q, call) = self.ring_eventfd(index, fd, "call")?;
        self.vf(|vf| {
            vf.dev.port.runtime().vrings[q].call = call;
            Ok(())
        })
    }
    fn set_vring_err(&mut self, index: u8, fd: Option<File>) -> Result<()> {
        let (q, err) = self.ring_eventfd(index, fd, "err")?;
        self.vf(|vf| {
            let mut rt = vf.dev.port.runtime();
            // A ring that failed before the frontend asked is reported at once.
            if rt.failed {
                if let Some(e) = &err {
                    let _ = e.write(1);
                }
            }
            rt.vrings[q].err = err;
            Ok(())
        })
    }
    fn get_protocol_features(&mut self) -> Result<VhostUserProtocolFeatures> {
        // REPLY_ACK: a frontend can wait until RESET_DEVICE (or SET_MEM_TABLE) is done.
        Ok(VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::RESET_DEVICE
            | VhostUserProtocolFeatures::REPLY_ACK)
    }
    fn set_protocol_features(&mut self, features: u64) -> Result<()> {
        self.acked_protocol = features;
        Ok(())
    }
    fn get_queue_num(&mut self) -> Result<u64> {
        Ok(2 + self.profile.channels as u64)
    }
    fn set_vring_enable(&mut self, index: u32, enable: bool) -> Result<()> {
        if let Vq::Channel(k) = self.vring_index(index)? {
            self.vf(|vf| {
                vf.dev.port.runtime().channel_mut(k).enabled = enable;
                Ok(())
            })?;
            self.port.bump();
            return Ok(());
        }
        let q = self.queue_index(index)?;
        self.vf(|vf| {
            vf.dev.port.runtime().vrings[q].enabled = enable;
            Ok(())
        })?;
        self.port.bump();
        Ok(())
    }
    fn get_config(
        &mut self,
        offset: u32,
        size: u32,
        _flags: VhostUserConfigFlags,
    ) -> Result<Vec<u8>> {
        let cfg = (self.profile.config)(&self.port);
        let (o, s) = (offset as usize, size as usize);
        if o.checked_add(s).is_none_or(|end| end > cfg.len()) {
            return Err(fail(format!(
                "VF {}: GET_CONFIG {offset}+{size} beyond the {}-byte config",
                self.port.id,
                cfg.len()
            )));
        }
        Ok(cfg[o..o + s].to_vec())
    }
    fn set_config(
        &mut self,
        _offset: u32,
        _buf: &[u8],
        _flags: VhostUserConfigFlags,
    ) -> Result<()> {
        Err(fail(format!(
            "VF {}: config space is read-only",
            self.port.id
        )))
    }
    fn set_backend_req_fd(&mut self, _backend: Backend) {}
    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> Result<()> {
        Err(VuError::InvalidOperation("VF: no GPU socket"))
    }
    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> Result<File> {
        Err(VuError::InvalidOperation("VF: no shared objects"))
    }
    fn get_inflight_fd(
        &mut self,
        _inflight: &VhostUserInflight,
    ) -> Result<(VhostUserInflight, File)> {
        Err(VuError::InvalidOperation("VF: no inflight fd"))
    }
    fn set_inflight_fd(&mut self, _inflight: &VhostUserInflight, _file: File) -> Result<()> {
        Err(VuError::InvalidOperation("VF: no inflight fd"))
    }
    fn get_max_mem_slots(&mut self) -> Result<u64> {
        Err(VuError::InvalidOperation("VF: no memory slots"))
    }
    fn add_mem_region(
        &mut self,
        _region: &VhostUserSingleMemoryRegion,
        _fd: File,
        _postcopy: Option<bool>,
    ) -> Result<Option<VhostUserMemoryRegionBase>> {
        Err(VuError::InvalidOperation("VF: ADD_MEM_REG not supported"))
    }
    fn remove_mem_region(&mut self, _region: &VhostUserSingleMemoryRegion) -> Result<()> {
        Err(VuError::InvalidOperation("VF: REM_MEM_REG not supported"))
    }
    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> Result<Option<File>> {
        Err(VuError::InvalidOperation("VF: no device state transfer"))
    }
    fn check_device_state(&mut self) -> Result<()> {
        Err(VuError::InvalidOperation("VF: no device state transfer"))
    }
    fn get_shmem_config(&mut self) -> Result<VhostUserShMemConfig> {
        Err(VuError::InvalidOperation("VF: no shared memory regions"))
    }
    fn set_log_base(&mut self, _log: &VhostUserLog, _file: File) -> Result<()> {
        Err(VuError::InvalidOperation("VF: no dirty logging"))
    }
}

/// Serves one frontend connection on VF `index` until it disconnects, then
/// closes the VF. Returns without serving if the devset refuses the open.
pub fn serve(
    devset: Arc<Devset<VfHw>>,
    port: Arc<Port>,
    pools: Arc<[PathBuf]>,
    index: usize,
    stream: UnixStream,
    profile: &'static Profile,
) {
    let id = port.id.clone();
    // The frontend sends its set-up as runs of messages: read each run in
    // one go rather than preempting the sender per message (procutil::sched).
    if let Err(e) = procutil::sched::set_thread_policy(procutil::sched::Policy::Batch) {
        tracing::debug!("VF {id}: session thread stays SCHED_OTHER: {e}");
    }
    match devset.open(index, |_| Ok::<(), ()>(())) {
        Ok(Ok(())) => {}
        Ok(Err(())) => return,
        Err(e) => {
            tracing::warn!("VF {id}: connection refused: {e}");
            return;
        }
    }
    tracing::info!("VF {id}: frontend connected");
    let session = Arc::new(Mutex::new(VfSession {
        devset: devset.clone(),
        profile,
        port: port.clone(),
        pools,
        index,
        acked_features: 0,
        acked_protocol: 0,
    }));
    let mut handler = BackendReqHandler::from_stream(stream, session);
    loop {
        match handler.handle_request() {
            Ok(()) => {}
            Err(VuError::Disconnected | VuError::PartialMessage) => break,
            Err(VuError::SocketBroken(_) | VuError::SocketError(_)) => break,
            // A protocol error from the frontend ends the session, like a disconnect.
            Err(e) => {
                tracing::warn!("VF {id}: vhost-user session ended: {e}");
                break;
            }
        }
    }
    match devset.close(index) {
        Ok(out) => tracing::info!(
            "VF {id}: frontend gone, VF closed and reset ({:?})",
            out.state
        ),
        Err(e) => tracing::warn!("VF {id}: close: {e}"),
    }
}
