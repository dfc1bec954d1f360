//! Media change of a virtio-blk device (Firecracker's `PATCH /drives`): a
//! slot booted empty (`--disk empty,ro,id=ID`) gets a file after boot and
//! gives it back, through the VMM's `--api` socket. The guest learns of it
//! by a configuration change interrupt (virtio 1.2 §4.2.2.1, InterruptStatus
//! bit 1) and rereads the capacity; Linux's virtio_blk resizes the disk.
//!
//! The device serves whatever disk is current at the start of a burst, so a
//! request in flight during an eject finishes on the file it started on.
//! Only an empty slot takes media, and media go only after the guest was
//! told to stop using them (the caller's agent unmounted them): a slot never
//! swaps one file for another under a mounted file system.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use super::Disk;
use crate::devspec::DiskSpec;
use crate::virtio::{Interrupt, VirtioError, INT_CONFIG};

/// The disk a device serves now, and the config generation that counts changes.
#[derive(Debug)]
pub struct Media {
    current: Mutex<Arc<Disk>>,
    generation: AtomicU32,
}

impl Media {
    pub fn new(disk: Disk) -> Media {
        Media {
            current: Mutex::new(Arc::new(disk)),
            generation: AtomicU32::new(0),
        }
    }

    pub fn get(&self) -> Arc<Disk> {
        Arc::clone(&self.current.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn generation(&self) -> u32 {
        self.generation.load(Ordering::SeqCst)
    }
}

/// A media change is a config change (capacity) the device makes on its own.
impl crate::virtio::DeviceView for Media {
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        crate::virtio::net::read_config_bytes(&self.get().config(), offset, data)
    }
}

/// Why a media change was refused; each names the slot.
#[derive(Debug, thiserror::Error)]
pub enum MediaError {
    #[error("disk slot {slot}: holds {current} already (eject it first)")]
    Occupied { slot: String, current: String },
    #[error("disk slot {slot}: {source}")]
    Open {
        slot: String,
        #[source]
        source: VirtioError,
    },
    #[error("disk slot {slot}: {path} is empty (0 sectors)")]
    NoSectors { slot: String, path: PathBuf },
}

/// A device's media, for the `--api` socket: the slot's id, and the
/// interrupt that tells the guest.
#[derive(Debug, Clone)]
pub struct DiskSlot {
    pub id: String,
    read_only: bool,
    media: Arc<Media>,
    interrupt: Arc<Interrupt>,
}

impl DiskSlot {
    pub fn new(id: String, read_only: bool, media: Arc<Media>, interrupt: Arc<Interrupt>) -> Self {
        DiskSlot {
            id,
            read_only,
            media,
            interrupt,
        }
    }

    /// Puts `path` into the empty slot (read-only if the slot is); its sectors.
    pub fn insert(&self, path: &Path) -> Result<u64, MediaError> {
        let spec = DiskSpec {
            path: path.to_owned(),
            read_only: self.read_only,
            unlink: false,
            id: Some(self.id.clone()),
            empty: false,
        };
        let disk = Disk::open(&spec).map_err(|source| MediaError::Open {
            slot: self.id.clone(),
            source,
        })?;
        let sectors = disk.sectors();
        if sectors == 0 {
            return Err(MediaError::NoSectors {
                slot: self.id.clone(),
                path: path.to_owned(),
            });
        }
        {
            let mut cur = self.media.current.lock().unwrap_or_else(|e| e.into_inner());
            if !cur.is_empty() {
                return Err(MediaError::Occupied {
                    slot: self.id.clone(),
                    current: cur.name().to_string(),
                });
            }
            *cur = Arc::new(disk);
        }
        self.changed();
        Ok(sectors)
    }

    /// The sectors of its media (0: empty).
    pub fn sectors(&self) -> u64 {
        self.media.get().sectors()
    }

    /// Empties the slot; whether it held media.
    pub fn eject(&self) -> bool {
        let old = {
            let mut cur = self.media.current.lock().unwrap_or_else(|e| e.into_inner());
            if cur.is_empty() {
                return false;
            }
            std::mem::replace(&mut *cur, Arc::new(Disk::empty(&self.id, self.read_only)))
        };
        self.changed();
        tracing::debug!("disk slot {}: ejected {}", self.id, old.name());
        true
    }

    fn changed(&self) {
        self.media.generation.fetch_add(1, Ordering::SeqCst);
        self.interrupt.signal(INT_CONFIG);
    }
}
