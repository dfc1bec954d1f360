//! The virtio-blk device: its transport face (features, config, activate,
//! reset) and the worker thread that serves the request queue in bursts.

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_VRING;
use virtio_queue::Queue;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::{Blk, BlkCounters, Disk, Media, BOUNCE, TOKEN_QUEUE};
use crate::bus::DeviceContext;
use crate::virtio::chain::{self, PrepareWrite};
use crate::virtio::worker::{serve_notifications, take_request_queue, Worker};
use crate::virtio::{Interrupt, VirtioDevice, VirtioError, QUEUE_MAX_SIZE};

impl Blk {
    pub fn new(
        disk: Disk,
        ctx: &DeviceContext,
        queue_evt: EventFd,
        interrupt: Arc<Interrupt>,
    ) -> Self {
        let prepare = chain::prepare_for(ctx);
        Blk {
            features: disk.features(),
            media: Arc::new(Media::new(disk)),
            mem: ctx.mem.clone(),
            prepare,
            queue_evt,
            interrupt,
            counters: Arc::default(),
            worker: None,
        }
    }
}

impl Drop for Blk {
    fn drop(&mut self) {
        self.worker = None;
        let c = &self.counters;
        tracing::debug!(
            "disk {}: reads {} writes {} flushes {} failed {} bad_chains {}",
            self.media.get().name,
            c.reads.load(Ordering::Relaxed),
            c.writes.load(Ordering::Relaxed),
            c.flushes.load(Ordering::Relaxed),
            c.failed.load(Ordering::Relaxed),
            c.bad_chains.load(Ordering::Relaxed)
        );
    }
}

impl VirtioDevice for Blk {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }
    /// Fixed at creation: media inserted later keep the slot's features.
    fn features(&self) -> u64 {
        self.features
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_MAX_SIZE]
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        crate::virtio::DeviceView::read_config(&*self.media, offset, data)
    }
    fn view(&self) -> Option<Arc<dyn crate::virtio::DeviceView>> {
        Some(self.media.clone())
    }
    fn config_generation(&self) -> u32 {
        self.media.generation()
    }
    fn activate(&mut self, features: u64, queues: Vec<Queue>) -> Result<(), VirtioError> {
        let name = self.media.get().name.clone();
        let (queue, evt) = take_request_queue(
            &format!("disk {name}"),
            queues,
            &*self.prepare,
            &self.queue_evt,
        )?;
        let mut state = WorkerState {
            media: self.media.clone(),
            mem: self.mem.clone(),
            prepare: self.prepare.clone(),
            queue,
            features,
            interrupt: self.interrupt.clone(),
            counters: self.counters.clone(),
            bounce: vec![0; BOUNCE],
            used: Vec::new(),
        };
        let fds = [(evt.as_raw_fd(), TOKEN_QUEUE)];
        let thread = format!("virtio-blk-{}", self.thread_tag());
        let worker = Worker::spawn(thread, &fds, move |epoll| {
            let device = format!("disk {}", state.media.get().name);
            serve_notifications(&epoll, &evt, &device, || state.process())
        })
        .map_err(|source| VirtioError::DiskWorker { path: name, source })?;
        self.worker = Some(worker);
        Ok(())
    }
    fn reset(&mut self) {
        self.worker = None; // stops and joins
    }
}

impl Blk {
    /// The handle that changes this device's media (`--api`).
    pub fn slot(&self, id: String, read_only: bool) -> super::DiskSlot {
        super::DiskSlot::new(id, read_only, self.media.clone(), self.interrupt.clone())
    }

    /// A short thread-name tag: the file name (comm holds 15 bytes).
    fn thread_tag(&self) -> String {
        std::path::Path::new(&self.media.get().name)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

struct WorkerState {
    media: Arc<Media>,
    mem: GuestMemoryMmap,
    prepare: Arc<PrepareWrite>,
    queue: Queue,
    /// Negotiated features (indirect descriptors only if they include it).
    features: u64,
    interrupt: Arc<Interrupt>,
    counters: Arc<BlkCounters>,
    bounce: Vec<u8>,
    /// (head, used length) of one burst, returned together.
    used: Vec<(u16, u32)>,
}

impl WorkerState {
    /// Serves every available request, returns them with one used-index
    /// store per burst, then interrupts the guest once if it asked.
    fn process(&mut self) {
        let WorkerState {
            media,
            mem,
            prepare,
            queue,
            features,
            interrupt,
            counters,
            bounce,
            used,
        } = self;
        // The disk of this burst: a media change takes effect at the next.
        let disk: Arc<Disk> = media.get();
        let gm = chain::Xlat::new(mem);
        let what = format_args!("disk {}: request queue", disk.name);
        let Some(view) = chain::view(&gm, queue, *features, &what) else {
            counters.bad_chains.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let notify = chain::serve_available(&view, queue, used, &what, |head| {
            // Copies go through the burst's translation cache, as the rings do.
            match view.split(head) {
                Ok(split) => disk
                    .serve(&gm, &**prepare, &split, bounce, counters)
                    .unwrap_or_else(|e| {
                        tracing::warn!("disk {}: bad request chain: {e}", disk.name);
                        0
                    }),
                Err(e) => {
                    counters.bad_chains.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("disk {}: bad request chain: {e}", disk.name);
                    0
                }
            }
        });
        if notify {
            interrupt.signal(VIRTIO_MMIO_INT_VRING);
        }
    }
}
