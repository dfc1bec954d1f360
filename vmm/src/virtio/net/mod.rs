//! virtio-net over a tap device (the software-CNI baseline).
//!
//! A worker thread per device sleeps in epoll on the tap fd, the two queue
//! eventfds (ioeventfds the guest kicks) and a stop eventfd. It copies frames
//! between the tap and the guest's descriptor chains through checked
//! guest-memory accessors: a bad chain is returned to the guest empty and
//! counted, never trusted.

use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::Arc;

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_VRING;
use virtio_bindings::virtio_net::{VIRTIO_NET_F_MAC, VIRTIO_NET_F_STATUS, VIRTIO_NET_S_LINK_UP};
use virtio_queue::{Queue, QueueT};
use virtq::RingView;
use vm_memory::{GuestMemory, GuestMemoryMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::chain;
pub use super::chain::PrepareWrite;
use super::worker::{Worker, STOP_TOKEN};
use super::{Interrupt, VirtioDevice, VirtioError, QUEUE_MAX_SIZE};
use crate::bus::DeviceContext;
use netutil::Tap;

/// With VIRTIO_F_VERSION_1 every frame is preceded by a 12-byte header
/// (`virtio_net_hdr_v1`, num_buffers included).
pub const VNET_HDR_LEN: usize = 12;
/// Largest frame we move: an untagged 1500-byte MTU frame plus VLAN tag,
/// with room to spare.
const MAX_FRAME: usize = 65536;

pub const NET_FEATURES: u64 =
    1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_NET_F_MAC | 1 << VIRTIO_NET_F_STATUS;

/// virtio-net config space: mac[6], status (le16).
pub fn net_config(mac: &[u8; 6], status: u16) -> [u8; 8] {
    let mut c = [0u8; 8];
    c[..6].copy_from_slice(mac);
    c[6..].copy_from_slice(&status.to_le_bytes());
    c
}

/// Copy `config[offset..]` into `data`; bytes past the end read as zero.
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    if let Some(src) = config.get(offset as usize..) {
        let n = src.len().min(data.len());
        data[..n].copy_from_slice(&src[..n]);
    }
}

/// Per-device counters (for tests and diagnostics).
#[derive(Default)]
pub struct NetCounters {
    pub rx_frames: AtomicU64,
    pub tx_frames: AtomicU64,
    pub rx_dropped: AtomicU64,
    pub bad_chains: AtomicU64,
}

/// Why a guest's RX or TX chain was refused (the frame is dropped, the
/// chain returned empty and counted).
#[derive(Debug, thiserror::Error)]
pub enum NetChainError {
    #[error(transparent)]
    Split(#[from] chain::SplitError),
    #[error(transparent)]
    Copy(#[from] chain::CopyError),
    #[error("device-readable descriptor in an RX chain")]
    ReadableInRx,
    #[error("device-writable descriptor in a TX chain")]
    WritableInTx,
    #[error("RX chain holds {capacity} bytes, frame needs {need}")]
    RxTooSmall { capacity: u64, need: usize },
    #[error("TX chain of {len} bytes is longer than {max}")]
    TxTooLong { len: u64, max: usize },
}

/// Write `data` (header + frame) into the device-writable chain at `head`.
/// Returns the number of bytes written; errors name what was wrong with the
/// chain.
pub fn write_rx_chain<M, P>(
    view: &RingView<'_, M>,
    prepare: &P,
    head: u16,
    data: &[u8],
) -> Result<u32, NetChainError>
where
    M: GuestMemory + ?Sized,
    P: Fn(u64, u64) -> Result<(), guestmem::Error> + ?Sized,
{
    let c = view.split(head)?;
    if !c.readable.is_empty() {
        return Err(NetChainError::ReadableInRx);
    }
    let capacity = chain::total(&c.writable);
    if capacity < data.len() as u64 {
        return Err(NetChainError::RxTooSmall {
            capacity,
            need: data.len(),
        });
    }
    virtq::write_bufs(view.mem(), prepare, &c.writable, 0, &[data])?;
    Ok(data.len() as u32)
}

/// Gather the device-readable chain at `head` into `buf`; returns its length.
pub fn read_tx_chain<M, P>(
    view: &RingView<'_, M>,
    prepare: &P,
    head: u16,
    buf: &mut Vec<u8>,
) -> Result<usize, NetChainError>
where
    M: GuestMemory + ?Sized,
    P: Fn(u64, u64) -> Result<(), guestmem::Error> + ?Sized,
{
    buf.clear();
    let c = view.split(head)?;
    if !c.writable.is_empty() {
        return Err(NetChainError::WritableInTx);
    }
    let len = chain::total(&c.readable);
    let max = MAX_FRAME + VNET_HDR_LEN;
    if len > max as u64 {
        return Err(NetChainError::TxTooLong { len, max });
    }
    buf.resize(len as usize, 0);
    virtq::read_bufs(view.mem(), prepare, &c.readable, 0, buf)?;
    Ok(buf.len())
}

pub struct TapNet {
    mac: [u8; 6],
    tap: Arc<Tap>,
    mem: GuestMemoryMmap,
    prepare: Arc<PrepareWrite>,
    queue_evts: Vec<EventFd>,
    interrupt: Arc<Interrupt>,
    link: AtomicU16,
    counters: Arc<NetCounters>,
    worker: Option<Worker>,
}

impl Drop for TapNet {
    fn drop(&mut self) {
        self.worker = None;
        let c = &self.counters;
        tracing::debug!(
            "tap {}: rx {} tx {} rx_dropped {} bad_chains {}",
            self.tap.name(),
            c.rx_frames.load(Ordering::Relaxed),
            c.tx_frames.load(Ordering::Relaxed),
            c.rx_dropped.load(Ordering::Relaxed),
            c.bad_chains.load(Ordering::Relaxed)
        );
    }
}

impl TapNet {
    pub fn new(
        tap: Tap,
        mac: [u8; 6],
        ctx: &DeviceContext,
        queue_evts: Vec<EventFd>,
        interrupt: Arc<Interrupt>,
    ) -> Self {
        let prepare = chain::prepare_for(ctx);
        TapNet {
            mac,
            tap: Arc::new(tap),
            mem: ctx.mem.clone(),
            prepare,
            queue_evts,
            interrupt,
            link: AtomicU16::new(VIRTIO_NET_S_LINK_UP as u16),
            counters: Arc::default(),
            worker: None,
        }
    }
}

impl VirtioDevice for TapNet {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }
    fn features(&self) -> u64 {
        NET_FEATURES
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_MAX_SIZE, QUEUE_MAX_SIZE]
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(
            &net_config(&self.mac, self.link.load(Ordering::SeqCst)),
            offset,
            data,
        )
    }
    fn activate(&mut self, features: u64, queues: Vec<Queue>) -> Result<(), VirtioError> {
        let device = || format!("tap {}", self.tap.name());
        if queues.len() != 2 || !queues.iter().all(|q| q.ready()) {
            return Err(VirtioError::QueuesNotReady {
                device: device(),
                need: "RX and TX queues",
            });
        }
        let evts = self
            .queue_evts
            .iter()
            .map(|e| e.try_clone())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| VirtioError::DupEventFd {
                device: device(),
                source,
            })?;
        let mut queues = queues.into_iter();
        let state = WorkerState {
            tap: self.tap.clone(),
            mem: self.mem.clone(),
            prepare: self.prepare.clone(),
            rx: queues.next().expect("two queues, checked above"),
            tx: queues.next().expect("two queues, checked above"),
            features,
            interrupt: self.interrupt.clone(),
            counters: self.counters.clone(),
            pending: None,
            buf: vec![0; VNET_HDR_LEN + MAX_FRAME],
            txbuf: Vec::with_capacity(VNET_HDR_LEN + MAX_FRAME),
            used: Vec::new(),
        };
        // Used rings the guest never touched must be zeroed before we write them.
        for q in [&state.rx, &state.tx] {
            let len = 6 + 8 * q.size() as u64;
            (self.prepare)(q.used_ring(), len).map_err(|source| VirtioError::UsedRing {
                device: device(),
                source,
            })?;
        }
        let name = self.tap.name().to_string();
        let fds = [
            (self.tap.as_raw_fd(), TOKEN_TAP),
            (evts[0].as_raw_fd(), TOKEN_RX),
            (evts[1].as_raw_fd(), TOKEN_TX),
        ];
        let mut state = state;
        let worker = Worker::spawn(format!("virtio-net-{name}"), &fds, move |epoll| {
            state.run(epoll, evts)
        })
        .map_err(|source| VirtioError::TapWorker { name, source })?;
        self.worker = Some(worker);
        Ok(())
    }
    fn reset(&mut self) {
        self.worker = None; // stops and joins
    }
}

const TOKEN_TAP: u64 = 0;
const TOKEN_RX: u64 = 1;
const TOKEN_TX: u64 = 2;

struct WorkerState {
    tap: Arc<Tap>,
    mem: GuestMemoryMmap,
    prepare: Arc<PrepareWrite>,
    rx: Queue,
    tx: Queue,
    /// Negotiated features (indirect descriptors only if they include it).
    features: u64,
    interrupt: Arc<Interrupt>,
    counters: Arc<NetCounters>,
    /// Length of a frame read from the tap (in `buf`) that found no RX buffer yet.
    pending: Option<usize>,
    buf: Vec<u8>,
    txbuf: Vec<u8>,
    /// (head, used length) of one burst, returned together.
    used: Vec<(u16, u32)>,
}

impl WorkerState {
    fn run(&mut self, epoll: Epoll, evts: Vec<EventFd>) {
        let mut events = [EpollEvent::default(); 8];
        let mut tap_armed = true;
        // Buffers may have been posted before the worker started.
        let mut rx_ready = self.process_rx();
        self.process_tx();
        loop {
            // While the guest has no RX buffer, stop listening on the tap so
            // that level-triggered readiness does not spin.
            if rx_ready != tap_armed {
                let set = if rx_ready {
                    EventSet::IN
                } else {
                    EventSet::empty()
                };
                if let Err(e) = epoll.ctl(
                    ControlOperation::Modify,
                    self.tap.as_raw_fd(),
                    EpollEvent::new(set, TOKEN_TAP),
                ) {
                    tracing::error!("tap {}: epoll modify: {e}", self.tap.name());
                    return;
                }
                tap_armed = rx_ready;
            }
            let n = match epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("tap {}: epoll wait: {e}", self.tap.name());
                    return;
                }
            };
            for ev in &events[..n] {
                match ev.data() {
                    STOP_TOKEN => return,
                    TOKEN_RX => {
                        let _ = evts[0].read();
                        rx_ready = self.process_rx();
                    }
                    TOKEN_TX => {
                        let _ = evts[1].read();
                        self.process_tx();
                    }
                    _ => rx_ready = self.process_rx(),
                }
            }
        }
    }

    /// Move frames from the tap into RX buffers, returned to the guest
    /// with one used-index store. Returns false when frames wait but the
    /// guest has no buffer.
    fn process_rx(&mut self) -> bool {
        let WorkerState {
            tap,
            mem,
            prepare,
            rx,
            features,
            interrupt,
            counters,
            pending,
            buf,
            used,
            ..
        } = self;
        let gm = chain::Xlat::new(mem);
        let what = format_args!("tap {}: RX queue", tap.name());
        let Some(view) = chain::view(&gm, rx, *features, &what) else {
            return false;
        };
        used.clear();
        let blocked = loop {
            let len = match *pending {
                Some(n) => n,
                None => match tap.read_frame(&mut buf[VNET_HDR_LEN..]) {
                    Ok(n) => n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break false,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => {
                        tracing::warn!("tap {}: read: {e}", tap.name());
                        break false;
                    }
                },
            };
            *pending = Some(len);
            // One buffer at a time: a head is taken only for a frame.
            let head = match view.avail_heads(&mut *rx, 1) {
                Ok(mut h) => match h.next() {
                    Some(head) => head,
                    None => break true,
                },
                Err(e) => {
                    tracing::warn!("tap {}: RX queue: {e}", tap.name());
                    break true;
                }
            };
            // Header: no offloads; num_buffers = 1 (no mergeable buffers).
            buf[..VNET_HDR_LEN].fill(0);
            buf[10..12].copy_from_slice(&1u16.to_le_bytes());
            let written = match write_rx_chain(&view, &**prepare, head, &buf[..VNET_HDR_LEN + len])
            {
                Ok(n) => {
                    counters.rx_frames.fetch_add(1, Ordering::Relaxed);
                    n
                }
                Err(e) => {
                    tracing::warn!("tap {}: frame dropped: {e}", tap.name());
                    counters.bad_chains.fetch_add(1, Ordering::Relaxed);
                    counters.rx_dropped.fetch_add(1, Ordering::Relaxed);
                    0
                }
            };
            *pending = None;
            // A head outside the ring has no used slot to return.
            if head < view.size() {
                used.push((head, written));
            }
        };
        match view.complete_used(&mut *rx, used) {
            Ok(true) => interrupt.signal(VIRTIO_MMIO_INT_VRING),
            Ok(false) => {}
            Err(e) => tracing::warn!("tap {}: RX used ring: {e}", tap.name()),
        }
        !blocked
    }

    /// Sends every frame the guest queued; each burst returned with one
    /// used-index store, one interrupt at the end if the guest asked.
    fn process_tx(&mut self) {
        let WorkerState {
            tap,
            mem,
            prepare,
            tx,
            features,
            interrupt,
            counters,
            txbuf,
            used,
            ..
        } = self;
        let gm = chain::Xlat::new(mem);
        let what = format_args!("tap {}: TX queue", tap.name());
        let Some(view) = chain::view(&gm, tx, *features, &what) else {
            return;
        };
        let mut notify = false;
        loop {
            let heads = match view.avail_heads(&mut *tx, usize::MAX) {
                Ok(h) if !h.is_empty() => h,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!("tap {}: TX queue: {e}", tap.name());
                    break;
                }
            };
            used.clear();
            for head in heads {
                match read_tx_chain(&view, &**prepare, head, txbuf) {
                    Ok(n) if n > VNET_HDR_LEN => match tap.write_frame(&txbuf[VNET_HDR_LEN..n]) {
                        Ok(_) => {
                            counters.tx_frames.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => tracing::debug!("tap {}: write: {e}", tap.name()),
                    },
                    Ok(_) => {
                        counters.bad_chains.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        tracing::warn!("tap {}: TX chain dropped: {e}", tap.name());
                        counters.bad_chains.fetch_add(1, Ordering::Relaxed);
                    }
                }
                if head < view.size() {
                    used.push((head, 0));
                }
            }
            match view.complete_used(&mut *tx, used) {
                Ok(n) => notify |= n,
                Err(e) => tracing::warn!("tap {}: TX used ring: {e}", tap.name()),
            }
        }
        if notify {
            interrupt.signal(VIRTIO_MMIO_INT_VRING);
        }
    }
}

#[cfg(test)]
mod tests;
