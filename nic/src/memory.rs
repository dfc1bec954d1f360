//! A VF's memory table: the sandbox memory the frontend sent in SET_MEM_TABLE,
//! mapped into the NIC and kept resident (populated and locked) while the VF is
//! open. That is the software equivalent of the IOMMU DMA mapping, and the
//! dominant cost of opening a VF.

use std::fs::File;
use std::os::fd::AsFd;
use std::path::PathBuf;

use vhost::vhost_user::message::VhostUserMemoryRegion;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap};

/// What is wrong with one region of a memory table, or which step of
/// mapping it failed.
#[derive(Debug, thiserror::Error)]
pub enum RegionCause {
    #[error("size too large")]
    TooLarge,
    #[error("empty region")]
    Empty,
    #[error("guest address overflows")]
    AddressOverflow,
    #[error("fallocate: {0}")]
    Fallocate(#[source] std::io::Error),
    #[error("mlock: {0}")]
    Mlock(#[source] std::io::Error),
    #[error("memory region: {0}")]
    Mmap(#[source] vm_memory::mmap::MmapRegionError),
}

#[derive(Debug, thiserror::Error)]
pub enum MemError {
    #[error("VF {vf}: SET_MEM_TABLE has {regions} regions but {files} fds")]
    FdCount {
        vf: String,
        regions: usize,
        files: usize,
    },
    #[error("VF {vf}: memory region {index} (gpa {gpa:#x}, size {size:#x}): {cause}")]
    Region {
        vf: String,
        index: usize,
        gpa: u64,
        size: u64,
        #[source]
        cause: RegionCause,
    },
    #[error(
        "VF {vf}: memory region {index} (gpa {gpa:#x}, size {size:#x}): guestmem attach: {source}"
    )]
    Attach {
        vf: String,
        index: usize,
        gpa: u64,
        size: u64,
        #[source]
        source: guestmem::Error,
    },
    #[error("VF {vf}: memory table larger than {max_gib} GiB")]
    Table { vf: String, max_gib: u64 },
    #[error("VF {vf}: memory table: {source}")]
    Collection {
        vf: String,
        #[source]
        source: vm_memory::GuestRegionCollectionError,
    },
    #[error("VF {vf}: memory table: {source}")]
    Pool {
        vf: String,
        #[source]
        source: guestmem::pool::Error,
    },
    #[error("VF {vf}: guest write preparation at gpa {gpa:#x}+{len}: outside the memory table")]
    Outside { vf: String, gpa: u64, len: u64 },
    #[error("VF {vf}: guest write preparation at gpa {gpa:#x}+{len}: {source}")]
    Prepare {
        vf: String,
        gpa: u64,
        len: u64,
        #[source]
        source: guestmem::Error,
    },
}

#[derive(Debug)]
struct RegionInfo {
    gpa: u64,
    size: u64,
    user_addr: u64,
    dev: guestmem::DeviceMemory,
}

/// Most memory one VF maps (sandbox RAM is at most 3 GiB, design.md): a
/// frontend cannot make the NIC pin more than this.
pub const MAX_TABLE_BYTES: u64 = 16 << 30;

/// Allocates the pages of `[offset, offset+len)` of `file` (shmem, hugetlbfs);
/// a file system without fallocate gets its pages populated by reading them
/// through a temporary mapping instead.
fn allocate(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: fallocate (allocate, keep size) on a valid fd.
    let r = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            0,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if r == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
        return Err(e);
    }
    // SAFETY: a private read-only populate mapping of the range, unmapped at once.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            file.as_raw_fd(),
            offset as libc::off_t,
        );
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        libc::munmap(p, len as usize);
    }
    Ok(())
}

/// The mapped, resident memory of one open VF.
#[derive(Debug)]
pub struct VfMemory {
    vf: String,
    /// Declared before `regions`: dropped first, its regions borrow their mappings.
    pub gm: GuestMemoryMmap,
    regions: Vec<RegionInfo>,
    /// The pool registration of the table's pool memory. Declared last: dropped (its pool
    /// connection closed) only after every mapping above is unmapped, so the pool never
    /// recycles a page this process can still write.
    _hold: Option<guestmem::pool::DeviceHold>,
}

impl VfMemory {
    /// Maps every region (guestmem's device view, with its page-state table),
    /// allocates its pages and locks them. Pool memory is first registered with the
    /// pool of `pools` that lent it (refused if none does).
    pub fn map(
        vf: &str,
        table: &[VhostUserMemoryRegion],
        files: Vec<File>,
        pools: &[PathBuf],
    ) -> Result<Self, MemError> {
        if table.len() != files.len() || table.is_empty() {
            return Err(MemError::FdCount {
                vf: vf.into(),
                regions: table.len(),
                files: files.len(),
            });
        }
        let total = table
            .iter()
            .try_fold(0u64, |t, r| t.checked_add(r.memory_size));
        if total.is_none_or(|t| t > MAX_TABLE_BYTES) {
            return Err(MemError::Table {
                vf: vf.into(),
                max_gib: MAX_TABLE_BYTES >> 30,
            });
        }
        // Before any mapping: memory whose lease already ended is never touched.
        let fds: Vec<_> = files.iter().map(|f| f.as_fd()).collect();
        let hold =
            guestmem::pool::DeviceHold::register(pools, &fds).map_err(|source| MemError::Pool {
                vf: vf.into(),
                source,
            })?;
        let mut mmaps = Vec::with_capacity(table.len());
        let mut regions = Vec::with_capacity(table.len());
        for (index, (r, file)) in table.iter().zip(files).enumerate() {
            let err = |cause: RegionCause| MemError::Region {
                vf: vf.into(),
                index,
                gpa: r.guest_phys_addr,
                size: r.memory_size,
                cause,
            };
            let size = usize::try_from(r.memory_size).map_err(|_| err(RegionCause::TooLarge))?;
            if size == 0 {
                return Err(err(RegionCause::Empty));
            }
            // guestmem maps the range (and its page-state table, if any); the
            // memory table uses that mapping.
            let dev = guestmem::DeviceMemory::attach(file.as_fd(), r.mmap_offset, r.memory_size)
                .map_err(|source| MemError::Attach {
                    vf: vf.into(),
                    index,
                    gpa: r.guest_phys_addr,
                    size: r.memory_size,
                    source,
                })?;
            // After attach checked the range lies inside the file.
            // Resident for the device, as a DMA mapping pins pages. The pages
            // are allocated (and zeroed, if fresh) through the file, which
            // does not hold this process's mmap lock, so opens of different
            // VFs can really run in parallel. Memory the pool keeps pinned is
            // resident and locked already: walking it again would cost a
            // page-cache lookup per page for nothing.
            if !hold.as_ref().is_some_and(|h| h.pinned(index)) {
                allocate(&file, r.mmap_offset, r.memory_size)
                    .map_err(|e| err(RegionCause::Fallocate(e)))?;
            }
            // Locked: a page stays in memory once the device has touched it.
            // SAFETY: the range is exactly guestmem's mapping, alive as long as `dev`.
            if unsafe {
                libc::mlock2(
                    dev.as_ptr() as *const libc::c_void,
                    size,
                    libc::MLOCK_ONFAULT,
                )
            } != 0
            {
                return Err(err(RegionCause::Mlock(std::io::Error::last_os_error())));
            }
            // SAFETY: `dev` owns the mapping of `size` bytes at this pointer and
            // outlives `gm` (field order of VfMemory).
            let mapping =
                unsafe { MmapRegionBuilder::new(size).with_raw_mmap_pointer(dev.as_ptr()) }
                    .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                    .with_mmap_flags(libc::MAP_SHARED)
                    .build()
                    .map_err(|e| err(RegionCause::Mmap(e)))?;
            let region = GuestRegionMmap::new(mapping, GuestAddress(r.guest_phys_addr))
                .ok_or_else(|| err(RegionCause::AddressOverflow))?;
            mmaps.push(region);
            regions.push(RegionInfo {
                gpa: r.guest_phys_addr,
                size: r.memory_size,
                user_addr: r.user_addr,
                dev,
            });
        }
        let gm = GuestMemoryMmap::from_regions(mmaps).map_err(|source| MemError::Collection {
            vf: vf.into(),
            source,
        })?;
        Ok(VfMemory {
            vf: vf.into(),
            gm,
            regions,
            _hold: hold,
        })
    }

    /// Translates a frontend virtual address (vring addresses) to a guest address.
    /// Bytes of guest memory this table maps.
    pub fn mapped_bytes(&self) -> u64 {
        self.regions.iter().map(|r| r.size).sum()
    }

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

    /// Whether any region is pool memory with a page-state table (lazy
    /// zeroing); without one, preparing a range is only a bounds check.
    pub fn tracked(&self) -> bool {
        self.regions.iter().any(|r| r.dev.tracked())
    }

    /// Must be called before the NIC writes into (or reads from) guest pages:
    /// with lazy zeroing a still-dirty page is zeroed first (proactive fault),
    /// so a write is not lost and a read never sees a previous sandbox's bytes.
    pub fn prepare_for_device_write(&self, gpa: u64, len: u64) -> Result<(), MemError> {
        let r = self
            .regions
            .iter()
            .find(|r| gpa >= r.gpa && gpa - r.gpa < r.size && len <= r.size - (gpa - r.gpa))
            .ok_or_else(|| MemError::Outside {
                vf: self.vf.clone(),
                gpa,
                len,
            })?;
        r.dev
            .prepare_for_device_write(gpa - r.gpa, len)
            .map_err(|source| MemError::Prepare {
                vf: self.vf.clone(),
                gpa,
                len,
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;
    use vm_memory::Bytes;

    fn memfd(size: u64) -> File {
        // SAFETY: memfd_create with a valid name; the fd is owned by the File.
        let f = unsafe {
            File::from_raw_fd(libc::memfd_create(
                c"nic-mem-test".as_ptr(),
                libc::MFD_CLOEXEC,
            ))
        };
        f.set_len(size).unwrap();
        f
    }

    #[test]
    fn maps_checks_and_translates() {
        let f = memfd(1 << 20);
        let r = VhostUserMemoryRegion::new(0x10_0000, 1 << 20, 0x7000_0000, 0);
        let m = VfMemory::map("vf-t", &[r], vec![f.try_clone().unwrap()], &[]).unwrap();
        assert_eq!(m.va_to_gpa(0x7000_0010), Some(GuestAddress(0x10_0010)));
        assert_eq!(m.va_to_gpa(0x7010_0000), None);
        assert!(m.check(0x10_0000, 1 << 20));
        assert!(!m.check(0x10_0000, (1 << 20) + 1));
        assert!(!m.check(0, 16));
        m.gm.write_slice(b"abc", GuestAddress(0x10_0000)).unwrap();
        m.prepare_for_device_write(0x10_0000, 4096).unwrap();
        assert!(m.prepare_for_device_write(0x1f_f000, 8192).is_err());
        // The write went to the shared file.
        let mut buf = [0u8; 3];
        use std::os::unix::fs::FileExt;
        f.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(&buf, b"abc");
    }

    #[test]
    fn rejects_bad_tables() {
        let f = memfd(1 << 20);
        let c = || vec![f.try_clone().unwrap()];
        // Beyond the end of the file: refused, and the file did not grow.
        let r = VhostUserMemoryRegion::new(0, 2 << 20, 0, 0);
        assert!(VfMemory::map("vf-t", &[r], c(), &[]).is_err());
        assert_eq!(f.metadata().unwrap().len(), 1 << 20);
        // Unaligned offset, fd count mismatch, too large a table.
        assert!(VfMemory::map(
            "vf-t",
            &[VhostUserMemoryRegion::new(0, 4096, 0, 100)],
            c(),
            &[]
        )
        .is_err());
        assert!(VfMemory::map(
            "vf-t",
            &[VhostUserMemoryRegion::new(0, 4096, 0, 0)],
            vec![],
            &[]
        )
        .is_err());
        let huge = VhostUserMemoryRegion::new(0, MAX_TABLE_BYTES + 4096, 0, 0);
        assert!(matches!(
            VfMemory::map("vf-t", &[huge], c(), &[]),
            Err(MemError::Table { .. })
        ));
        // Overlapping regions.
        let (a, b) = (
            VhostUserMemoryRegion::new(0, 8192, 0, 0),
            VhostUserMemoryRegion::new(4096, 8192, 8192, 8192),
        );
        assert!(VfMemory::map(
            "vf-t",
            &[a, b],
            vec![f.try_clone().unwrap(), f.try_clone().unwrap()],
            &[]
        )
        .is_err());
    }
}
