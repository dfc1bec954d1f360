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
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_ID_BYTES,
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use vm_memory::{GuestMemory, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::chain::{self, PrepareWrite, Split};
use super::worker::Worker;
use super::{Interrupt, VirtioError, QUEUE_MAX_SIZE};
use crate::devspec::DiskSpec;

mod device;
mod media;
#[cfg(test)]
mod tests;

pub use media::{DiskSlot, Media, MediaError};

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

/// An opened disk: the file, its geometry and what the guest may do with
/// it. An empty slot has no file and no sectors (every access is beyond it).
#[derive(Debug)]
pub struct Disk {
    file: Option<File>,
    name: String,
    read_only: bool,
    /// Unlinked (RunD's volatile writable layer): flush has nothing to make durable.
    volatile: bool,
    sectors: u64,
    id: [u8; VIRTIO_BLK_ID_BYTES as usize],
}

/// Per-device counters (tests and diagnostics).
#[derive(Debug, Default)]
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
    #[error("no media in the slot")]
    NoMedia,
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
        if spec.empty {
            return Ok(Disk::empty(
                spec.id.as_deref().unwrap_or(""),
                spec.read_only,
            ));
        }
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
        let label = spec.id.clone().unwrap_or_else(|| {
            spec.path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        });
        Ok(Disk {
            file: Some(file),
            name,
            read_only: spec.read_only,
            volatile: spec.unlink,
            sectors: size / SECTOR,
            id: id_bytes(&label),
        })
    }

    /// The empty slot `id` (no media).
    pub fn empty(id: &str, read_only: bool) -> Disk {
        Disk {
            file: None,
            name: format!("slot {id} (empty)"),
            read_only,
            volatile: false,
            sectors: 0,
            id: id_bytes(id),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.file.is_none()
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The file behind an access (`range` admits none to an empty slot).
    fn file(&self) -> Result<&File, ReqError> {
        self.file.as_ref().ok_or(ReqError::NoMedia)
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
                    self.file()?
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
                    self.file()?
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
                if let Some(f) = self
                    .file
                    .as_ref()
                    .filter(|_| !self.volatile && !self.read_only)
                {
                    f.sync_data().map_err(|e| io("flush", 0, e))?;
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

/// The GET_ID answer: `label`'s first 20 bytes, NUL-padded.
fn id_bytes(label: &str) -> [u8; VIRTIO_BLK_ID_BYTES as usize] {
    let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
    let n = label.len().min(id.len());
    id[..n].copy_from_slice(&label.as_bytes()[..n]);
    id
}

pub struct Blk {
    /// Offered features: the slot's, whatever media it holds later.
    features: u64,
    media: Arc<Media>,
    mem: GuestMemoryMmap,
    prepare: Arc<PrepareWrite>,
    queue_evt: EventFd,
    interrupt: Arc<Interrupt>,
    counters: Arc<BlkCounters>,
    worker: Option<Worker>,
}

// The prepare hook is a closure and guest memory is large: Debug leaves them out.
impl std::fmt::Debug for Blk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blk")
            .field("features", &self.features)
            .field("media", &self.media)
            .field("counters", &self.counters)
            .field("worker", &self.worker.is_some())
            .finish_non_exhaustive()
    }
}
