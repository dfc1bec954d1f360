//! A VF's memory table: the sandbox memory the frontend sent in SET_MEM_TABLE,
//! mapped into the NIC and kept resident (populated and locked) while the VF is
//! open. That is the software equivalent of the IOMMU DMA mapping, and the
//! dominant cost of opening a VF.

use std::fs::File;
use std::os::fd::AsFd;

use vhost::vhost_user::message::VhostUserMemoryRegion;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap};

#[derive(Debug, thiserror::Error)]
pub enum MemError {
    #[error("VF {vf}: SET_MEM_TABLE has {regions} regions but {files} fds")]
    FdCount {
        vf: String,
        regions: usize,
        files: usize,
    },
    #[error("VF {vf}: memory region {index} (gpa {gpa:#x}, size {size:#x}): {what}")]
    Region {
        vf: String,
        index: usize,
        gpa: u64,
        size: u64,
        what: String,
    },
    #[error("VF {vf}: memory table: {what}")]
    Table { vf: String, what: String },
    #[error("VF {vf}: guest write preparation at gpa {gpa:#x}+{len}: {what}")]
    Prepare {
        vf: String,
        gpa: u64,
        len: u64,
        what: String,
    },
}

struct RegionInfo {
    gpa: u64,
    size: u64,
    user_addr: u64,
    dev: guestmem::DeviceMemory,
}

/// The mapped, resident memory of one open VF.
pub struct VfMemory {
    vf: String,
    /// Declared before `regions`: dropped first, its regions borrow their mappings.
    pub gm: GuestMemoryMmap,
    regions: Vec<RegionInfo>,
}

impl VfMemory {
    /// Maps every region with MAP_POPULATE and locks it, and attaches guestmem's
    /// page-state table of each region (lazy zeroing).
    pub fn map(
        vf: &str,
        table: &[VhostUserMemoryRegion],
        files: Vec<File>,
    ) -> Result<Self, MemError> {
        if table.len() != files.len() || table.is_empty() {
            return Err(MemError::FdCount {
                vf: vf.into(),
                regions: table.len(),
                files: files.len(),
            });
        }
        let mut mmaps = Vec::with_capacity(table.len());
        let mut regions = Vec::with_capacity(table.len());
        for (index, (r, file)) in table.iter().zip(files).enumerate() {
            let err = |what: String| MemError::Region {
                vf: vf.into(),
                index,
                gpa: r.guest_phys_addr,
                size: r.memory_size,
                what,
            };
            let size = usize::try_from(r.memory_size).map_err(|_| err("size too large".into()))?;
            if size == 0 {
                return Err(err("empty region".into()));
            }
            // guestmem maps the range (and its page-state table, if any); the
            // memory table uses that mapping.
            let dev = guestmem::DeviceMemory::attach(file.as_fd(), r.mmap_offset, r.memory_size)
                .map_err(|e| err(format!("guestmem attach: {e}")))?;
            // Resident for the device, as a DMA mapping pins pages: mlock
            // populates every page and keeps it.
            // SAFETY: the range is exactly guestmem's mapping, alive as long as `dev`.
            if unsafe { libc::mlock(dev.as_ptr() as *const libc::c_void, size) } != 0 {
                return Err(err(format!("mlock: {}", std::io::Error::last_os_error())));
            }
            // SAFETY: `dev` owns the mapping of `size` bytes at this pointer and
            // outlives `gm` (field order of VfMemory).
            let mapping =
                unsafe { MmapRegionBuilder::new(size).with_raw_mmap_pointer(dev.as_ptr()) }
                    .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                    .with_mmap_flags(libc::MAP_SHARED)
                    .build()
                    .map_err(|e| err(format!("memory region: {e}")))?;
            let region = GuestRegionMmap::new(mapping, GuestAddress(r.guest_phys_addr))
                .ok_or_else(|| err("guest address overflows".into()))?;
            mmaps.push(region);
            regions.push(RegionInfo {
                gpa: r.guest_phys_addr,
                size: r.memory_size,
                user_addr: r.user_addr,
                dev,
            });
        }
        let gm = GuestMemoryMmap::from_regions(mmaps).map_err(|e| MemError::Table {
            vf: vf.into(),
            what: e.to_string(),
        })?;
        Ok(VfMemory {
            vf: vf.into(),
            gm,
            regions,
        })
    }

    /// Translates a frontend virtual address (vring addresses) to a guest address.
    pub fn va_to_gpa(&self, va: u64) -> Option<GuestAddress> {
        self.regions
            .iter()
            .find(|r| va >= r.user_addr && va - r.user_addr < r.size)
            .map(|r| GuestAddress(r.gpa + (va - r.user_addr)))
    }

    /// Whether `[gpa, gpa+len)` lies inside one region of the table.
    pub fn check(&self, gpa: u64, len: usize) -> bool {
        GuestMemoryBackend::check_range(&self.gm, GuestAddress(gpa), len)
    }

    /// Must be called before the NIC writes into (or reads from) guest pages:
    /// with lazy zeroing a still-dirty page is zeroed first (proactive fault),
    /// so a write is not lost and a read never sees a previous sandbox's bytes.
    pub fn prepare_for_device_write(&self, gpa: u64, len: u64) -> Result<(), MemError> {
        let err = |what: String| MemError::Prepare {
            vf: self.vf.clone(),
            gpa,
            len,
            what,
        };
        let r = self
            .regions
            .iter()
            .find(|r| gpa >= r.gpa && gpa - r.gpa < r.size && len <= r.size - (gpa - r.gpa))
            .ok_or_else(|| err("outside the memory table".into()))?;
        r.dev
            .prepare_for_device_write(gpa - r.gpa, len)
            .map_err(|e| err(e.to_string()))
    }
}
