//! virtio-blk (virtio 1.2 §5.2) over a host file: the rootfs layers (RunD
//! §4.2) — the shared read-only EROFS image and the per-sandbox writable
//! layer, a reflink that was unlinked once open.
//!
//! One request queue, served by a worker thread asleep in epoll on the
//! queue's ioeventfd (the device thread model of net.rs). Everything in a
//! request is untrusted: a bad header, an out-of-range sector, a write to a
//! read-only disk or a data buffer outside guest memory fails that request
//! with IOERR (or UNSUPP), and a chain without a status byte is returned
//! unused; neither touches the VMM or any other device.
//!
//! State for snapshot/restore (templates, later): the device has none of its
//! own beyond the transport's registers and the queue (`Queue::state()`); the
//! worker holds only the queue copy it was activated with, and the disk is
//! re-attached from its spec (the writable layer is per sandbox anyway).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_ID_BYTES,
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_VRING;
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestMemory, GuestMemoryMmap};
use vmm_sys_util::epoll::{Epoll, EpollEvent};
use vmm_sys_util::eventfd::EventFd;

use super::chain::{self, PrepareWrite, Split};
use super::net::read_config_bytes;
use super::worker::{Worker, STOP_TOKEN};
use super::{Interrupt, VirtioDevice, VirtioError, QUEUE_MAX_SIZE};
use crate::bus::{DeviceContext, DiskSpec};

pub const SECTOR: u64 = 512;
/// Request header: type (le32), reserved (le32), sector (le64).
const HDR_LEN: usize = 16;
/// Data moves between the file and guest memory through a bounce buffer of
/// this size, so a request of any length allocates nothing.
const BOUNCE: usize = 64 << 10;
/// Segments per request we accept (the driver keeps two descriptors for
/// header and status).
const SEG_MAX: u32 = QUEUE_MAX_SIZE as u32 - 2;
const TOKEN_QUEUE: u64 = 0;

/// An opened disk: the file, its geometry and what the guest may do with it.
pub struct Disk {
    file: File,
    name: String,
    read_only: bool,
    /// Unlinked (RunD's volatile writable layer): flush has nothing to make durable.
    volatile: bool,
    sectors: u64,
    id: [u8; VIRTIO_BLK_ID_BYTES as usize],
}

/// Per-device counters (tests and diagnostics).
#[derive(Default)]
pub struct BlkCounters {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub flushes: AtomicU64,
    /// Requests answered with IOERR or UNSUPP.
    pub failed: AtomicU64,
    /// Chains without a status byte (nothing could be answered).
    pub bad_chains: AtomicU64,
}

/// Why a request failed; becomes its status byte (IOERR or UNSUPP) and a
/// log line.
#[derive(Debug, thiserror::Error)]
enum ReqError {
    #[error("{what}: {source}")]
    Guest {
        what: &'static str,
        #[source]
        source: chain::CopyError,
    },
    #[error("{what} at byte {offset}: {source}")]
    File {
        what: &'static str,
        offset: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("data length {0} is not a multiple of {SECTOR}")]
    Unaligned(u64),
    #[error("sectors {sector}..+{count} beyond the disk's {sectors} sectors")]
    Beyond {
        sector: u64,
        count: u64,
        sectors: u64,
    },
    #[error("write to a read-only disk")]
    ReadOnly,
    #[error("request type {0} unsupported")]
    Unsupported(u32),
}

/// A chain that could not be answered at all (no status byte to write).
#[derive(Debug, thiserror::Error)]
pub enum BlkChainError {
    #[error("request without a device-writable status byte")]
    NoStatus,
    #[error("status byte: {0}")]
    Status(#[source] chain::CopyError),
}

impl Disk {
    /// Opens `spec.path` (read-only if `spec.read_only`), unlinking it if asked.
    pub fn open(spec: &DiskSpec) -> Result<Disk, VirtioError> {
        let name = spec.path.display().to_string();
        let err = |what: &'static str| {
            let name = name.clone();
            move |source: std::io::Error| VirtioError::Disk {
                path: name,
                what,
                source,
            }
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(!spec.read_only)
            .open(&spec.path)
            .map_err(err("open"))?;
        let meta = file.metadata().map_err(err("stat"))?;
        let size = if meta.file_type().is_file() {
            meta.len()
        } else {
            // A block device: its size is where a seek to the end lands.
            use std::io::Seek;
            (&file)
                .seek(std::io::SeekFrom::End(0))
                .map_err(err("size"))?
        };
        if spec.unlink {
            std::fs::remove_file(&spec.path).map_err(err("unlink"))?;
        }
        let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
        let label = spec.id.clone().unwrap_or_else(|| {
            spec.path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        });
        let n = label.len().min(id.len());
        id[..n].copy_from_slice(&label.as_bytes()[..n]);
        Ok(Disk {
            file,
            name,
            read_only: spec.read_only,
            volatile: spec.unlink,
            sectors: size / SECTOR,
            id,
        })
    }

    pub fn sectors(&self) -> u64 {
        self.sectors
    }

    /// virtio-blk config: capacity (le64), size_max (unused), seg_max (le32).
    fn config(&self) -> [u8; 16] {
        let mut c = [0u8; 16];
        c[..8].copy_from_slice(&self.sectors.to_le_bytes());
        c[12..].copy_from_slice(&SEG_MAX.to_le_bytes());
        c
    }

    fn features(&self) -> u64 {
        let mut f = 1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_BLK_F_FLUSH | 1 << VIRTIO_BLK_F_SEG_MAX;
        if self.read_only {
            f |= 1 << VIRTIO_BLK_F_RO;
        }
        f
    }

    /// Byte offset of `len` bytes at `sector`, if they lie on the disk.
    fn range(&self, sector: u64, len: u64) -> Result<u64, ReqError> {
        if !len.is_multiple_of(SECTOR) {
            return Err(ReqError::Unaligned(len));
        }
        match sector.checked_add(len / SECTOR) {
            // end <= sectors, so sector * SECTOR cannot overflow.
            Some(end) if end <= self.sectors => Ok(sector * SECTOR),
            _ => Err(ReqError::Beyond {
                sector,
                count: len / SECTOR,
                sectors: self.sectors,
            }),
        }
    }

    /// Serves one request; returns the used length (bytes written into the
    /// chain). A chain with no status byte is an error of its own.
    pub fn serve<M, P>(
        &self,
        mem: &M,
        prepare: &P,
        c: &Split,
        bounce: &mut [u8],
        counters: &BlkCounters,
    ) -> Result<u32, BlkChainError>
    where
        M: GuestMemory + ?Sized,
        P: Fn(u64, u64) -> Result<(), guestmem::Error> + ?Sized,
    {
        let wtotal = chain::total(&c.writable);
        if wtotal == 0 {
            counters.bad_chains.fetch_add(1, Ordering::Relaxed);
            return Err(BlkChainError::NoStatus);
        }
        let status_at = wtotal - 1;
        let (status, written) = match self.execute(mem, prepare, c, status_at, bounce, counters) {
            Ok(n) => (VIRTIO_BLK_S_OK, n),
            Err(e) => {
                counters.failed.fetch_add(1, Ordering::Relaxed);
                if let ReqError::Unsupported(_) = e {
                    tracing::debug!("disk {}: {e}", self.name);
                    (VIRTIO_BLK_S_UNSUPP, 0)
                } else {
                    tracing::warn!("disk {}: request failed: {e}", self.name);
                    (VIRTIO_BLK_S_IOERR, 0)
                }
            }
        };
        virtq::write_bufs(mem, prepare, &c.writable, status_at, &[&[status as u8]])
            .map_err(BlkChainError::Status)?;
        Ok(written + 1)
    }

    fn execute<M, P>(
        &self,
        mem: &M,
        prepare: &P,
        c: &Split,
        data_len_in: u64,
        bounce: &mut [u8],
        counters: &BlkCounters,
    ) -> Result<u32, ReqError>
    where
        M: GuestMemory + ?Sized,
        P: Fn(u64, u64) -> Result<(), guestmem::Error> + ?Sized,
    {
        let mut hdr = [0u8; HDR_LEN];
        virtq::read_bufs(mem, prepare, &c.readable, 0, &mut hdr).map_err(|source| {
            ReqError::Guest {
                what: "request header",
                source,
            }
        })?;
        let kind = u32::from_le_bytes(hdr[..4].try_into().expect("4 bytes"));
        let sector = u64::from_le_bytes(hdr[8..].try_into().expect("8 bytes"));
        let io = |what: &'static str, offset: u64, source: std::io::Error| ReqError::File {
            what,
            offset,
            source,
        };
        let guest = |what: &'static str| move |source| ReqError::Guest { what, source };
        match kind {
            VIRTIO_BLK_T_IN => {
                let len = data_len_in;
                let base = self.range(sector, len)?;
                let mut done = 0u64;
                while done < len {
                    let n = ((len - done) as usize).min(bounce.len());
                    self.file
                        .read_exact_at(&mut bounce[..n], base + done)
                        .map_err(|e| io("read", base + done, e))?;
                    virtq::write_bufs(mem, prepare, &c.writable, done, &[&bounce[..n]])
                        .map_err(guest("read data"))?;
                    done += n as u64;
                }
                counters.reads.fetch_add(1, Ordering::Relaxed);
                Ok(len as u32)
            }
            VIRTIO_BLK_T_OUT => {
                if self.read_only {
                    return Err(ReqError::ReadOnly);
                }
                let len = chain::total(&c.readable).saturating_sub(HDR_LEN as u64);
                let base = self.range(sector, len)?;
                let mut done = 0u64;
                while done < len {
                    let n = ((len - done) as usize).min(bounce.len());
                    virtq::read_bufs(
                        mem,
                        prepare,
                        &c.readable,
                        HDR_LEN as u64 + done,
                        &mut bounce[..n],
                    )
                    .map_err(guest("write data"))?;
                    self.file
                        .write_all_at(&bounce[..n], base + done)
                        .map_err(|e| io("write", base + done, e))?;
                    done += n as u64;
                }
                counters.writes.fetch_add(1, Ordering::Relaxed);
                Ok(0)
            }
            VIRTIO_BLK_T_FLUSH => {
                // Writes reach the file before their status does; only a
                // disk that outlives the VMM has anything to make durable.
                if !self.volatile && !self.read_only {
                    self.file.sync_data().map_err(|e| io("flush", 0, e))?;
                }
                counters.flushes.fetch_add(1, Ordering::Relaxed);
                Ok(0)
            }
            VIRTIO_BLK_T_GET_ID => {
                let n = (data_len_in as usize).min(self.id.len());
                virtq::write_bufs(mem, prepare, &c.writable, 0, &[&self.id[..n]])
                    .map_err(guest("id"))?;
                Ok(n as u32)
            }
            t => Err(ReqError::Unsupported(t)),
        }
    }
}

pub struct Blk {
    disk: Arc<Disk>,
    mem: GuestMemoryMmap,
    prepare: Arc<PrepareWrite>,
    queue_evt: EventFd,
    interrupt: Arc<Interrupt>,
    counters: Arc<BlkCounters>,
    worker: Option<Worker>,
}

impl Blk {
    pub fn new(
        disk: Disk,
        ctx: &DeviceContext,
        queue_evt: EventFd,
        interrupt: Arc<Interrupt>,
    ) -> Self {
        let prepare = chain::prepare_for(ctx);
        Blk {
            disk: Arc::new(disk),
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
            self.disk.name,
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
    fn features(&self) -> u64 {
        self.disk.features()
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_MAX_SIZE]
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.disk.config(), offset, data)
    }
    fn activate(&mut self, features: u64, queues: Vec<Queue>) -> Result<(), VirtioError> {
        let name = self.disk.name.clone();
        let device = || format!("disk {name}");
        let Some(queue) = queues.into_iter().next().filter(|q| q.ready()) else {
            return Err(VirtioError::QueuesNotReady {
                device: device(),
                need: "request queue",
            });
        };
        let len = 6 + 8 * queue.size() as u64;
        (self.prepare)(queue.used_ring(), len).map_err(|source| VirtioError::UsedRing {
            device: device(),
            source,
        })?;
        let evt = self
            .queue_evt
            .try_clone()
            .map_err(|source| VirtioError::DupEventFd {
                device: device(),
                source,
            })?;
        let mut state = WorkerState {
            disk: self.disk.clone(),
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
        let worker = Worker::spawn(thread, &fds, move |epoll| state.run(epoll, evt))
            .map_err(|source| VirtioError::DiskWorker { path: name, source })?;
        self.worker = Some(worker);
        Ok(())
    }
    fn reset(&mut self) {
        self.worker = None; // stops and joins
    }
}

impl Blk {
    /// A short thread-name tag: the file name (comm holds 15 bytes).
    fn thread_tag(&self) -> String {
        std::path::Path::new(&self.disk.name)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

struct WorkerState {
    disk: Arc<Disk>,
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
    fn run(&mut self, epoll: Epoll, evt: EventFd) {
        let mut events = [EpollEvent::default(); 4];
        // Requests may have been queued before the worker started.
        self.process();
        loop {
            let n = match epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("disk {}: epoll wait: {e}", self.disk.name);
                    return;
                }
            };
            for ev in &events[..n] {
                match ev.data() {
                    STOP_TOKEN => return,
                    _ => {
                        let _ = evt.read();
                        self.process();
                    }
                }
            }
        }
    }

    /// Serves every available request, returns them with one used-index
    /// store per burst, then interrupts the guest once if it asked.
    fn process(&mut self) {
        let WorkerState {
            disk,
            mem,
            prepare,
            queue,
            features,
            interrupt,
            counters,
            bounce,
            used,
        } = self;
        let gm = chain::Xlat::new(mem);
        let what = format_args!("disk {}: request queue", disk.name);
        let Some(view) = chain::view(&gm, queue, *features, &what) else {
            counters.bad_chains.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let mut notify = false;
        loop {
            let heads = match view.avail_heads(queue, usize::MAX) {
                Ok(h) if !h.is_empty() => h,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!("disk {}: request queue: {e}", disk.name);
                    break;
                }
            };
            used.clear();
            for head in heads {
                // Copies go through the burst's translation cache, as the rings do.
                let len = match view.split(head) {
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
                };
                // A head outside the ring has no used slot to return.
                if head < view.size() {
                    used.push((head, len));
                }
            }
            match view.complete_used(queue, used) {
                Ok(n) => notify |= n,
                Err(e) => tracing::warn!("disk {}: used ring: {e}", disk.name),
            }
        }
        if notify {
            interrupt.signal(VIRTIO_MMIO_INT_VRING);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use vm_memory::{Bytes, GuestAddress};

    use super::*;
    use crate::virtio::chain::tests::{first_chain, mem, queue_with, F_NEXT, F_WRITE, MEM_SIZE};

    const HDR: u64 = 0x4000;
    const DATA: u64 = 0x5000;
    const STATUS: u64 = 0x7000;

    fn disk(ro: bool, sectors: u64) -> (tempfile::TempDir, Disk) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        let mut f = File::create(&path).unwrap();
        for s in 0..sectors {
            f.write_all(&[s as u8; SECTOR as usize]).unwrap();
        }
        let d = Disk::open(&DiskSpec {
            path,
            read_only: ro,
            unlink: false,
            id: Some("rootfs-test".into()),
        })
        .unwrap();
        (dir, d)
    }

    fn header(m: &GuestMemoryMmap, kind: u32, sector: u64) {
        m.write_obj(kind, GuestAddress(HDR)).unwrap();
        m.write_obj(0u32, GuestAddress(HDR + 4)).unwrap();
        m.write_obj(sector, GuestAddress(HDR + 8)).unwrap();
        m.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    }

    /// Serves the one chain `descs`; returns (used length, status byte).
    fn serve(
        m: &GuestMemoryMmap,
        d: &Disk,
        descs: &[(u64, u32, u16, u16)],
    ) -> (Result<u32, String>, u8) {
        let mut q = queue_with(m, descs);
        let (v, head) = first_chain(m, &mut q, 0);
        let split = v.split(head).unwrap();
        let counters = BlkCounters::default();
        let mut bounce = vec![0u8; 1024]; // small: requests span several rounds
        let r = d
            .serve(m, &|_, _| Ok(()), &split, &mut bounce, &counters)
            .map_err(|e| e.to_string());
        (r, m.read_obj::<u8>(GuestAddress(STATUS)).unwrap())
    }

    fn rw(kind_data_flags: u16, len: u32) -> [(u64, u32, u16, u16); 3] {
        [
            (HDR, 16, F_NEXT, 1),
            (DATA, len, kind_data_flags | F_NEXT, 2),
            (STATUS, 1, F_WRITE, 0),
        ]
    }

    #[test]
    fn reads_writes_flush_and_id() {
        let m = mem();
        let (_dir, d) = disk(false, 8);
        assert_eq!(d.sectors(), 8);
        // Read sectors 2..6 (4 sectors span the 1 KiB bounce buffer twice).
        header(&m, VIRTIO_BLK_T_IN, 2);
        let (r, st) = serve(&m, &d, &rw(F_WRITE, 2048));
        assert_eq!((r, st), (Ok(2049), VIRTIO_BLK_S_OK as u8));
        let mut got = vec![0u8; 2048];
        m.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert!(got[..512].iter().all(|&b| b == 2) && got[1536..].iter().all(|&b| b == 5));
        // Write sector 7, read it back.
        m.write_slice(&[0xab; 512], GuestAddress(DATA)).unwrap();
        header(&m, VIRTIO_BLK_T_OUT, 7);
        let (r, st) = serve(&m, &d, &rw(0, 512));
        assert_eq!((r, st), (Ok(1), VIRTIO_BLK_S_OK as u8));
        let mut back = [0u8; 512];
        d.file.read_exact_at(&mut back, 7 * 512).unwrap();
        assert_eq!(back, [0xab; 512]);
        // Flush.
        header(&m, VIRTIO_BLK_T_FLUSH, 0);
        let (r, st) = serve(&m, &d, &[(HDR, 16, F_NEXT, 1), (STATUS, 1, F_WRITE, 0)]);
        assert_eq!((r, st), (Ok(1), VIRTIO_BLK_S_OK as u8));
        // Get id.
        header(&m, VIRTIO_BLK_T_GET_ID, 0);
        let (r, st) = serve(&m, &d, &rw(F_WRITE, 20));
        assert_eq!((r, st), (Ok(21), VIRTIO_BLK_S_OK as u8));
        let mut id = [0u8; 11];
        m.read_slice(&mut id, GuestAddress(DATA)).unwrap();
        assert_eq!(&id, b"rootfs-test");
    }

    #[test]
    fn bad_requests_fail_only_themselves() {
        let m = mem();
        let (_dir, d) = disk(false, 8);
        let ioerr = VIRTIO_BLK_S_IOERR as u8;
        // Out of range, past the end and overflowing.
        for sector in [8, 7, u64::MAX / 512, u64::MAX] {
            header(&m, VIRTIO_BLK_T_IN, sector);
            assert_eq!(
                serve(&m, &d, &rw(F_WRITE, 1024)),
                (Ok(1), ioerr),
                "{sector}"
            );
            header(&m, VIRTIO_BLK_T_OUT, sector);
            assert_eq!(serve(&m, &d, &rw(0, 1024)), (Ok(1), ioerr), "{sector}");
        }
        // Not a whole sector.
        header(&m, VIRTIO_BLK_T_IN, 0);
        assert_eq!(serve(&m, &d, &rw(F_WRITE, 100)), (Ok(1), ioerr));
        // Data buffer outside guest memory.
        header(&m, VIRTIO_BLK_T_IN, 0);
        let bad = [
            (HDR, 16, F_NEXT, 1),
            (MEM_SIZE - 256, 512, F_WRITE | F_NEXT, 2),
            (STATUS, 1, F_WRITE, 0),
        ];
        assert_eq!(serve(&m, &d, &bad), (Ok(1), ioerr));
        // Header too short.
        let short = [(HDR, 8, F_NEXT, 1), (STATUS, 1, F_WRITE, 0)];
        m.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        assert_eq!(serve(&m, &d, &short), (Ok(1), ioerr));
        // Unknown type.
        header(&m, 0x77, 0);
        assert_eq!(
            serve(&m, &d, &[(HDR, 16, F_NEXT, 1), (STATUS, 1, F_WRITE, 0)]),
            (Ok(1), VIRTIO_BLK_S_UNSUPP as u8)
        );
        // No status byte: nothing can be answered.
        header(&m, VIRTIO_BLK_T_IN, 0);
        let (r, st) = serve(&m, &d, &[(HDR, 16, 0, 0)]);
        assert!(r.unwrap_err().contains("status"));
        assert_eq!(st, 0xff);
        // Status byte outside guest memory.
        let (r, _) = serve(
            &m,
            &d,
            &[(HDR, 16, F_NEXT, 1), (MEM_SIZE + 8, 1, F_WRITE, 0)],
        );
        assert!(r.is_err());
        // The disk still serves good requests.
        header(&m, VIRTIO_BLK_T_IN, 1);
        assert_eq!(serve(&m, &d, &rw(F_WRITE, 512)), (Ok(513), 0));
    }

    #[test]
    fn read_only_disk_refuses_writes() {
        let m = mem();
        let (_dir, d) = disk(true, 4);
        assert_ne!(d.features() & (1 << VIRTIO_BLK_F_RO), 0);
        m.write_slice(&[0xcd; 512], GuestAddress(DATA)).unwrap();
        header(&m, VIRTIO_BLK_T_OUT, 0);
        assert_eq!(
            serve(&m, &d, &rw(0, 512)),
            (Ok(1), VIRTIO_BLK_S_IOERR as u8)
        );
        let mut back = [0u8; 512];
        d.file.read_exact_at(&mut back, 0).unwrap();
        assert_eq!(back, [0; 512]);
        header(&m, VIRTIO_BLK_T_IN, 3);
        assert_eq!(serve(&m, &d, &rw(F_WRITE, 512)), (Ok(513), 0));
    }

    #[test]
    fn unlink_removes_the_name_and_config_reports_capacity() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("clone.ext4");
        std::fs::write(&path, vec![0u8; 4096 + 100]).unwrap();
        let d = Disk::open(&DiskSpec {
            path: path.clone(),
            read_only: false,
            unlink: true,
            id: None,
        })
        .unwrap();
        assert!(!path.exists());
        assert_eq!(d.sectors(), 8);
        assert_eq!(&d.id[..10], b"clone.ext4");
        let mut cap = [0u8; 8];
        read_config_bytes(&d.config(), 0, &mut cap);
        assert_eq!(u64::from_le_bytes(cap), 8);
        let e = Disk::open(&DiskSpec {
            path,
            read_only: true,
            unlink: false,
            id: None,
        })
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("clone.ext4") && e.contains("open"), "{e}");
    }

    /// Two disks on their own worker threads: a bad request (out of range,
    /// no status byte) fails on its device only; both keep serving.
    #[test]
    fn workers_serve_each_device_alone() {
        use vmm_sys_util::eventfd::EFD_NONBLOCK;
        let ctx = crate::virtio::tests::ctx(false);
        let m = ctx.mem.clone();
        let (_da, a) = disk(false, 8);
        let (_db, b) = disk(false, 8);
        // Per device: queue at base, header/status/data pages after it.
        struct Dev {
            blk: Blk,
            evt: EventFd,
            base: u64,
            posted: u16,
        }
        let mut devs: Vec<Dev> = [(a, 0x10000u64), (b, 0x20000u64)]
            .into_iter()
            .map(|(d, base)| {
                let evt = EventFd::new(EFD_NONBLOCK).unwrap();
                let irq = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
                let mut blk = Blk::new(d, &ctx, evt.try_clone().unwrap(), irq);
                let mut q = Queue::new(QUEUE_MAX_SIZE).unwrap();
                q.set_size(16);
                q.set_desc_table_address(Some(base as u32), Some(0));
                q.set_avail_ring_address(Some(base as u32 + 0x1000), Some(0));
                q.set_used_ring_address(Some(base as u32 + 0x2000), Some(0));
                q.set_ready(true);
                blk.activate(blk.features(), vec![q]).unwrap();
                Dev {
                    blk,
                    evt,
                    base,
                    posted: 0,
                }
            })
            .collect();
        // Request r of a device: descriptors 3r..3r+2, header/status/data in page r.
        let submit = |d: &mut Dev, kind: u32, sector: u64, with_status: bool| -> u64 {
            let r = d.posted as u64;
            let page = d.base + 0x4000 + r * 0x1000;
            m.write_obj(kind, GuestAddress(page)).unwrap();
            m.write_obj(sector, GuestAddress(page + 8)).unwrap();
            m.write_obj(0xffu8, GuestAddress(page + 16)).unwrap();
            let descs: Vec<(u64, u32, u16)> = if with_status {
                vec![(page, 16, 1), (page + 512, 512, 1 | 2), (page + 16, 1, 2)]
            } else {
                vec![(page, 16, 0)]
            };
            for (i, (addr, len, flags)) in descs.iter().enumerate() {
                let at = d.base + 16 * (3 * r + i as u64);
                m.write_obj(*addr, GuestAddress(at)).unwrap();
                m.write_obj(*len, GuestAddress(at + 8)).unwrap();
                m.write_obj(*flags, GuestAddress(at + 12)).unwrap();
                m.write_obj((3 * r + i as u64 + 1) as u16, GuestAddress(at + 14))
                    .unwrap();
            }
            let slot = d.base + 0x1000 + 4 + 2 * (d.posted as u64 % 16);
            m.write_obj((3 * r) as u16, GuestAddress(slot)).unwrap();
            d.posted += 1;
            m.write_obj(d.posted, GuestAddress(d.base + 0x1002))
                .unwrap();
            d.evt.write(1).unwrap();
            page
        };
        let wait_used = |d: &Dev| {
            let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while m.read_obj::<u16>(GuestAddress(d.base + 0x2002)).unwrap() != d.posted {
                assert!(std::time::Instant::now() < end, "device did not answer");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        };
        let status = |page: u64| m.read_obj::<u8>(GuestAddress(page + 16)).unwrap();

        let bad = submit(&mut devs[0], VIRTIO_BLK_T_IN, 100, true);
        let no_status = submit(&mut devs[0], VIRTIO_BLK_T_IN, 0, false);
        let good_b = submit(&mut devs[1], VIRTIO_BLK_T_IN, 3, true);
        let good_a = submit(&mut devs[0], VIRTIO_BLK_T_IN, 5, true);
        wait_used(&devs[0]);
        wait_used(&devs[1]);
        assert_eq!(status(bad), VIRTIO_BLK_S_IOERR as u8);
        assert_eq!(status(no_status), 0xff);
        assert_eq!((status(good_a), status(good_b)), (0, 0));
        assert_eq!(m.read_obj::<u8>(GuestAddress(good_a + 512)).unwrap(), 5);
        assert_eq!(m.read_obj::<u8>(GuestAddress(good_b + 512)).unwrap(), 3);
        let c = &devs[0].blk.counters;
        assert_eq!(c.failed.load(Ordering::Relaxed), 1);
        assert_eq!(c.bad_chains.load(Ordering::Relaxed), 1);
        assert_eq!(c.reads.load(Ordering::Relaxed), 1);
        assert_eq!(devs[1].blk.counters.failed.load(Ordering::Relaxed), 0);
        // Reset stops the worker; the device is still sound.
        devs[0].blk.reset();
        assert!(devs[0].blk.worker.is_none());
    }
}
