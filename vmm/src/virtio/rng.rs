//! virtio-rng (virtio 1.2 §5.4), Firecracker's entropy device: the guest
//! posts device-writable buffers on its one queue and gets them back full of
//! the host's getrandom(2) bytes. A Linux guest's hw_random core credits
//! them to the kernel's entropy pool, so its CRNG is ready as soon as the
//! driver probes, instead of never (the guest has no other source it trusts
//! here: no RDRAND under kvm_pvm's emulated kernel) or after seconds of
//! jitter entropy, which a blocking getrandom(2) or /dev/random read in a
//! container would otherwise wait for (docs/vmm.md, "Entropy device").
//!
//! Every chain is untrusted: readable descriptors are refused (returned
//! with length 0 and counted), and one request fills at most
//! [`MAX_REQUEST`] bytes, so a guest cannot make the worker copy without
//! bound. No state of its own: a reset stops the worker.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_RNG;
use virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_VRING;
use virtio_queue::Queue;
use vm_memory::{GuestMemory, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::chain::{self, PrepareWrite, Split};
use super::worker::{serve_notifications, take_request_queue, Worker};
use super::{Interrupt, VirtioError, QUEUE_MAX_SIZE};
use crate::bus::DeviceContext;

/// Bytes one request gets at most; the rest of a longer chain stays unwritten
/// (the used length says how much is valid, as the spec allows).
pub const MAX_REQUEST: usize = 64 << 10;
const TOKEN_QUEUE: u64 = 0;
/// How errors and logs name the device.
const DEVICE: &str = "entropy device";

/// Per-device counters (tests and diagnostics).
#[derive(Debug, Default)]
pub struct RngCounters {
    pub requests: AtomicU64,
    pub bytes: AtomicU64,
    /// Chains refused: malformed, readable descriptors, or memory outside the guest.
    pub bad_chains: AtomicU64,
}

/// Why a request chain got nothing.
#[derive(Debug, thiserror::Error)]
pub enum RngChainError {
    #[error("request with device-readable descriptors ({0} bytes)")]
    Readable(u64),
    #[error("request without a device-writable buffer")]
    Empty,
    #[error("host getrandom: {0}")]
    Source(getrandom::Error),
    #[error("buffer: {0}")]
    Copy(#[source] chain::CopyError),
}

/// Fills `c`'s writable buffers (at most [`MAX_REQUEST`] bytes) with
/// random bytes through `bounce`; returns the used length.
pub fn serve<M, P>(mem: &M, prepare: &P, c: &Split, bounce: &mut [u8]) -> Result<u32, RngChainError>
where
    M: GuestMemory + ?Sized,
    P: Fn(u64, u64) -> Result<(), guestmem::Error> + ?Sized,
{
    let readable = chain::total(&c.readable);
    if readable > 0 {
        return Err(RngChainError::Readable(readable));
    }
    let want = chain::total(&c.writable).min(bounce.len() as u64) as usize;
    if want == 0 {
        return Err(RngChainError::Empty);
    }
    getrandom::getrandom(&mut bounce[..want]).map_err(RngChainError::Source)?;
    virtq::write_bufs(mem, prepare, &c.writable, 0, &[&bounce[..want]])
        .map_err(RngChainError::Copy)?;
    Ok(want as u32)
}

pub struct Rng {
    mem: GuestMemoryMmap,
    prepare: Arc<PrepareWrite>,
    queue_evt: EventFd,
    interrupt: Arc<Interrupt>,
    counters: Arc<RngCounters>,
    worker: Option<Worker>,
}

// The prepare hook is a closure and guest memory is large: Debug leaves them out.
impl std::fmt::Debug for Rng {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rng")
            .field("counters", &self.counters)
            .field("worker", &self.worker.is_some())
            .finish_non_exhaustive()
    }
}

impl Rng {
    pub fn new(ctx: &DeviceContext, queue_evt: EventFd, interrupt: Arc<Interrupt>) -> Self {
        Rng {
            mem: ctx.mem.clone(),
            prepare: chain::prepare_for(ctx),
            queue_evt,
            interrupt,
            counters: Arc::default(),
            worker: None,
        }
    }

    pub fn counters(&self) -> Arc<RngCounters> {
        self.counters.clone()
    }
}

impl Drop for Rng {
    fn drop(&mut self) {
        self.worker = None;
        let c = &self.counters;
        tracing::debug!(
            "entropy device: requests {} bytes {} bad_chains {}",
            c.requests.load(Ordering::Relaxed),
            c.bytes.load(Ordering::Relaxed),
            c.bad_chains.load(Ordering::Relaxed)
        );
    }
}

impl super::VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_RNG
    }
    fn features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_MAX_SIZE]
    }
    /// No configuration space (§5.4.4).
    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }
    fn activate(&mut self, features: u64, queues: Vec<Queue>) -> Result<(), VirtioError> {
        let (queue, evt) = take_request_queue(DEVICE, queues, &*self.prepare, &self.queue_evt)?;
        let mut state = WorkerState {
            mem: self.mem.clone(),
            prepare: self.prepare.clone(),
            queue,
            features,
            interrupt: self.interrupt.clone(),
            counters: self.counters.clone(),
            bounce: vec![0; MAX_REQUEST],
            used: Vec::new(),
        };
        let fds = [(evt.as_raw_fd(), TOKEN_QUEUE)];
        let worker = Worker::spawn("virtio-rng".into(), &fds, move |epoll| {
            serve_notifications(&epoll, &evt, DEVICE, || state.process())
        })
        .map_err(|source| VirtioError::RngWorker { source })?;
        self.worker = Some(worker);
        Ok(())
    }
    fn reset(&mut self) {
        self.worker = None; // stops and joins
    }
}

struct WorkerState {
    mem: GuestMemoryMmap,
    prepare: Arc<PrepareWrite>,
    queue: Queue,
    features: u64,
    interrupt: Arc<Interrupt>,
    counters: Arc<RngCounters>,
    bounce: Vec<u8>,
    /// (head, used length) of one burst, returned together.
    used: Vec<(u16, u32)>,
}

impl WorkerState {
    /// Serves every available request, returns them with one used-index
    /// store per burst, then interrupts the guest once if it asked.
    fn process(&mut self) {
        let gm = chain::Xlat::new(&self.mem);
        let Some(view) = chain::view(&gm, &self.queue, self.features, &DEVICE) else {
            self.counters.bad_chains.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let (prepare, bounce, counters) = (&*self.prepare, &mut self.bounce, &self.counters);
        let notify =
            chain::serve_available(&view, &mut self.queue, &mut self.used, &DEVICE, |head| {
                let served = view
                    .split(head)
                    .map_err(|e| e.to_string())
                    .and_then(|s| serve(&gm, prepare, &s, bounce).map_err(|e| e.to_string()));
                match served {
                    Ok(n) => {
                        counters.requests.fetch_add(1, Ordering::Relaxed);
                        counters.bytes.fetch_add(n.into(), Ordering::Relaxed);
                        n
                    }
                    Err(e) => {
                        super::note(
                            &counters.bad_chains,
                            format_args!("{DEVICE}: bad request chain: {e}"),
                        );
                        0
                    }
                }
            });
        if notify {
            self.interrupt.signal(VIRTIO_MMIO_INT_VRING);
        }
    }
}

#[cfg(test)]
mod tests {
    use vm_memory::{Bytes, GuestAddress};

    use super::*;
    use crate::virtio::chain::tests::{first_chain, mem, queue_with, F_NEXT, F_WRITE};

    fn no_prepare(_: u64, _: u64) -> Result<(), guestmem::Error> {
        Ok(())
    }

    /// A writable chain of two buffers comes back full: different bytes each
    /// time, the used length their sum; bytes past a buffer stay untouched.
    #[test]
    fn writable_buffers_are_filled_with_fresh_bytes() {
        let m = mem();
        m.write_slice(&[0xa5; 0x300], GuestAddress(0x4000)).unwrap();
        let mut q = queue_with(
            &m,
            &[
                (0x4000, 0x100, F_WRITE | F_NEXT, 1),
                (0x4200, 0x80, F_WRITE, 0),
            ],
        );
        let (v, head) = first_chain(&m, &mut q, 0);
        let mut bounce = vec![0; MAX_REQUEST];
        let n = serve(&m, &no_prepare, &v.split(head).unwrap(), &mut bounce).unwrap();
        assert_eq!(n, 0x180);
        let mut a = [0u8; 0x100];
        m.read_slice(&mut a, GuestAddress(0x4000)).unwrap();
        let mut gap = [0u8; 0x100];
        m.read_slice(&mut gap, GuestAddress(0x4100)).unwrap();
        assert_eq!(gap, [0xa5; 0x100], "between the buffers nothing is written");
        assert!(a.iter().filter(|&&b| b == 0xa5).count() < 16, "filled");
        // Again: other bytes.
        let mut q = queue_with(&m, &[(0x4000, 0x100, F_WRITE, 0)]);
        let (v, head) = first_chain(&m, &mut q, 0);
        serve(&m, &no_prepare, &v.split(head).unwrap(), &mut bounce).unwrap();
        let mut b = [0u8; 0x100];
        m.read_slice(&mut b, GuestAddress(0x4000)).unwrap();
        assert_ne!(a, b);
    }

    /// Readable descriptors, an empty chain and a buffer outside guest
    /// memory get nothing; a long chain gets at most MAX_REQUEST bytes; each
    /// write is prepared (lazy zeroing) before it happens.
    #[test]
    fn hostile_chains_get_nothing_and_long_ones_are_capped() {
        let m = mem();
        let mut bounce = vec![0; MAX_REQUEST];
        let mut q = queue_with(&m, &[(0x4000, 16, 0, 0)]);
        let (v, head) = first_chain(&m, &mut q, 0);
        let e = serve(&m, &no_prepare, &v.split(head).unwrap(), &mut bounce).unwrap_err();
        assert!(matches!(e, RngChainError::Readable(16)), "{e}");
        let mut q = queue_with(&m, &[(0x4000, 0, F_WRITE, 0)]);
        let (v, head) = first_chain(&m, &mut q, 0);
        let e = serve(&m, &no_prepare, &v.split(head).unwrap(), &mut bounce).unwrap_err();
        assert!(matches!(e, RngChainError::Empty), "{e}");
        let mut q = queue_with(&m, &[(0xf000_0000, 64, F_WRITE, 0)]);
        let (v, head) = first_chain(&m, &mut q, 0);
        let e = serve(&m, &no_prepare, &v.split(head).unwrap(), &mut bounce).unwrap_err();
        assert!(matches!(e, RngChainError::Copy(_)), "{e}");

        let mut small = vec![0; 32];
        let mut q = queue_with(&m, &[(0x4000, 0x1000, F_WRITE, 0)]);
        let (v, head) = first_chain(&m, &mut q, 0);
        let prepared = std::sync::Mutex::new(Vec::new());
        let record = |a, n| {
            prepared.lock().unwrap().push((a, n));
            Ok(())
        };
        assert_eq!(
            serve(&m, &record, &v.split(head).unwrap(), &mut small).unwrap(),
            32
        );
        assert_eq!(*prepared.lock().unwrap(), vec![(0x4000, 32)]);
    }
}
