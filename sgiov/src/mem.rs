//! The address spaces rings live in, as the device sees them: a sandbox's
//! guest memory (untrusted: the guest writes it concurrently), or the
//! daemon's staging memory (one memfd per device, never mapped by a guest).
//!
//! Every access is a [`VolatileSlice`] of a range checked to lie inside one
//! mapping. Before the device accesses guest bytes it calls
//! [`Memory::prepare`], the hook through which the NIC runs guestmem's
//! device-write preparation (lazy zeroing zeroes still-dirty pages first, so
//! a device write is not lost and a device read never sees a previous
//! sandbox's bytes).

use std::error::Error as StdError;
use std::fmt;
use std::fs::File;
use std::sync::Mutex;

use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, MmapRegion, VolatileMemory,
    VolatileSlice,
};

/// Error from a preparation hook, kept as the source of [`MemError::Prepare`].
pub type HookError = Box<dyn StdError + Send + Sync>;

/// The NIC's device-write preparation, called with `(addr, len)` before the
/// device touches `[addr, addr+len)`.
pub type PrepareHook = Box<dyn Fn(u64, u64) -> Result<(), HookError> + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum MemError {
    #[error("{mem}: range {addr:#x}+{len:#x} is not inside one mapping")]
    OutOfRange { mem: String, addr: u64, len: u64 },
    #[error("{mem}: preparing {addr:#x}+{len:#x} for device access")]
    Prepare {
        mem: String,
        addr: u64,
        len: u64,
        #[source]
        source: HookError,
    },
    #[error("{mem}: {what}")]
    Setup {
        mem: String,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{mem}: {what}")]
    Map {
        mem: String,
        what: &'static str,
        #[source]
        source: vm_memory::mmap::FromRangesError,
    },
    #[error("{mem}: {what}")]
    Region {
        mem: String,
        what: &'static str,
        #[source]
        source: vm_memory::mmap::MmapRegionError,
    },
    #[error("{mem}: {what}")]
    Field {
        mem: String,
        what: &'static str,
        #[source]
        source: vm_memory::VolatileMemoryError,
    },
}

/// One address space the device can access.
/// Names the memory (the trait objects are shared as `Arc<dyn Memory>`).
impl fmt::Debug for dyn Memory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Memory")
            .field("name", &self.name())
            .finish_non_exhaustive()
    }
}

// The prepare hook is a closure: Debug says only whether there is one.
impl fmt::Debug for GuestMem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuestMem")
            .field("name", &self.name)
            .field("gm", &self.gm)
            .field("hook", &self.hook.is_some())
            .finish()
    }
}

impl fmt::Debug for RawMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawMemory")
            .field("name", &self.name)
            .field("ptr", &self.ptr)
            .field("base", &self.base)
            .field("len", &self.len)
            .field("hook", &self.hook.is_some())
            .field("untrusted", &self.untrusted)
            .finish()
    }
}

pub trait Memory: Send + Sync {
    /// Names the memory in errors (sandbox, SGF or "staging").
    fn name(&self) -> &str;

    /// `[addr, addr+len)` if it lies inside one mapping. No preparation.
    fn slice(&self, addr: u64, len: usize) -> Option<VolatileSlice<'_>>;

    /// Makes `[addr, addr+len)` safe for device access (lazy zeroing).
    fn prepare(&self, _addr: u64, _len: u64) -> Result<(), MemError> {
        Ok(())
    }

    /// Whether a guest can write this memory concurrently.
    fn untrusted(&self) -> bool {
        true
    }

    /// A checked slice for reading bytes already prepared (inside an open ring).
    fn get(&self, addr: u64, len: usize) -> Result<VolatileSlice<'_>, MemError> {
        self.slice(addr, len).ok_or_else(|| MemError::OutOfRange {
            mem: self.name().to_string(),
            addr,
            len: len as u64,
        })
    }

    /// A checked slice for a device write: the hook runs first, every time.
    fn for_write(&self, addr: u64, len: usize) -> Result<VolatileSlice<'_>, MemError> {
        let s = self.get(addr, len)?;
        self.prepare(addr, len as u64)?;
        Ok(s)
    }
}

fn run_hook(hook: &Option<PrepareHook>, name: &str, addr: u64, len: u64) -> Result<(), MemError> {
    match hook {
        None => Ok(()),
        Some(h) => h(addr, len).map_err(|source| MemError::Prepare {
            mem: name.to_string(),
            addr,
            len,
            source,
        }),
    }
}

/// A sandbox's memory as vm-memory regions (what the NIC builds from
/// SET_MEM_TABLE), addressed by guest-physical address.
pub struct GuestMem {
    name: String,
    gm: GuestMemoryMmap,
    hook: Option<PrepareHook>,
}

impl GuestMem {
    pub fn new(name: impl Into<String>, gm: GuestMemoryMmap, hook: Option<PrepareHook>) -> Self {
        GuestMem {
            name: name.into(),
            gm,
            hook,
        }
    }

    /// A fresh memfd of `size` bytes mapped at guest address `gpa`, and the
    /// memfd itself (for another mapping of the same pages: the other side).
    pub fn memfd(name: &str, gpa: u64, size: usize) -> Result<(GuestMem, File), MemError> {
        let file = memfd(name, size)?;
        let gm = Self::map_file(name, &file, gpa, size)?;
        Ok((GuestMem::new(name, gm, None), file))
    }

    /// Maps `size` bytes of `file` from offset 0 at guest address `gpa`.
    pub fn map_file(
        name: &str,
        file: &File,
        gpa: u64,
        size: usize,
    ) -> Result<GuestMemoryMmap, MemError> {
        let setup = |what, source| MemError::Setup {
            mem: name.to_string(),
            what,
            source,
        };
        let f = file.try_clone().map_err(|e| setup("dup memfd", e))?;
        GuestMemoryMmap::from_ranges_with_files([(
            GuestAddress(gpa),
            size,
            Some(FileOffset::new(f, 0)),
        )])
        .map_err(|source| MemError::Map {
            mem: name.to_string(),
            what: "mmap",
            source,
        })
    }

    pub fn inner(&self) -> &GuestMemoryMmap {
        &self.gm
    }
}

impl Memory for GuestMem {
    fn name(&self) -> &str {
        &self.name
    }

    fn slice(&self, addr: u64, len: usize) -> Option<VolatileSlice<'_>> {
        self.gm.get_slice(GuestAddress(addr), len).ok()
    }

    fn prepare(&self, addr: u64, len: u64) -> Result<(), MemError> {
        run_hook(&self.hook, &self.name, addr, len)
    }
}

/// A memory region given as a host pointer and a length, addressed from `base`.
pub struct RawMemory {
    name: String,
    ptr: *mut u8,
    base: u64,
    len: usize,
    hook: Option<PrepareHook>,
    untrusted: bool,
}

// SAFETY: RawMemory only hands out volatile slices of a mapping that the
// creator promised stays valid and shared; it holds no thread-affine state.
unsafe impl Send for RawMemory {}
// SAFETY: as above; all access is through volatile slices.
unsafe impl Sync for RawMemory {}

impl RawMemory {
    /// # Safety
    /// `[ptr, ptr+len)` must stay mapped and writable for the life of the
    /// returned value (and of every job that holds it).
    pub unsafe fn new(
        name: impl Into<String>,
        ptr: *mut u8,
        base: u64,
        len: usize,
        hook: Option<PrepareHook>,
    ) -> Self {
        RawMemory {
            name: name.into(),
            ptr,
            base,
            len,
            hook,
            untrusted: true,
        }
    }
}

impl Memory for RawMemory {
    fn name(&self) -> &str {
        &self.name
    }

    fn slice(&self, addr: u64, len: usize) -> Option<VolatileSlice<'_>> {
        let off = addr.checked_sub(self.base)?;
        let end = off.checked_add(len as u64)?;
        if end > self.len as u64 {
            return None;
        }
        // SAFETY: the range lies inside the mapping that `new`'s caller keeps alive.
        Some(unsafe { VolatileSlice::new(self.ptr.add(off as usize), len) })
    }

    fn prepare(&self, addr: u64, len: u64) -> Result<(), MemError> {
        run_hook(&self.hook, &self.name, addr, len)
    }

    fn untrusted(&self) -> bool {
        self.untrusted
    }
}

/// A fresh memfd (the one use of memfd_create in this crate).
fn memfd(name: &str, size: usize) -> Result<File, MemError> {
    let setup = |what, source| MemError::Setup {
        mem: name.to_string(),
        what,
        source,
    };
    let cname = std::ffi::CString::new(format!("sgiov-{name}"))
        .map_err(|e| setup("memfd name", std::io::Error::other(e)))?;
    let fd = nix::sys::memfd::memfd_create(&cname, nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC)
        .map_err(|e| setup("memfd_create", e.into()))?;
    let file = File::from(fd);
    file.set_len(size as u64)
        .map_err(|e| setup("ftruncate", e))?;
    Ok(file)
}

/// The daemon's staging memory: one memfd per device, carved into
/// power-of-two blocks for staging rings. Guests never map it, so it needs no
/// preparation; a freed block's pages are punched out, so the next ring
/// starts from zeroes and no byte of one tenant survives into another's ring.
#[derive(Debug)]
pub struct StagingMemory {
    name: String,
    file: File,
    map: MmapRegion,
    alloc: Mutex<BlockAlloc>,
}

/// Power-of-two blocks aligned to their size, carved from `[base, base+cap)`;
/// freed blocks are reused for the same size (rings come in a few sizes).
/// Used for staging rings here and for ring buffers by the guest driver.
#[derive(Debug)]
pub struct BlockAlloc {
    base: u64,
    next: u64,
    end: u64,
    /// Free blocks by log2(size).
    free: Vec<Vec<u64>>,
    in_use: u64,
}

impl BlockAlloc {
    pub fn new(base: u64, cap: u64) -> BlockAlloc {
        BlockAlloc {
            base,
            next: base,
            end: base + cap,
            free: vec![Vec::new(); 64],
            in_use: 0,
        }
    }

    /// A block of `size` bytes (a power of two), aligned to its size
    /// relative to `base`; None when the range is exhausted.
    pub fn alloc(&mut self, size: u64) -> Option<u64> {
        debug_assert!(size.is_power_of_two());
        let order = size.trailing_zeros() as usize;
        let addr = match self.free[order].pop() {
            Some(addr) => addr,
            None => {
                let addr = self.base + (self.next - self.base).next_multiple_of(size);
                if addr.checked_add(size)? > self.end {
                    return None;
                }
                self.next = addr + size;
                addr
            }
        };
        self.in_use += size;
        Some(addr)
    }

    pub fn free(&mut self, addr: u64, size: u64) {
        self.in_use -= size;
        self.free[size.trailing_zeros() as usize].push(addr);
    }

    pub fn in_use(&self) -> u64 {
        self.in_use
    }
}

impl StagingMemory {
    /// `capacity` bytes of address space (pages are allocated on first use).
    pub fn new(name: &str, capacity: usize) -> Result<StagingMemory, MemError> {
        let file = memfd(name, capacity)?;
        let f = file.try_clone().map_err(|e| MemError::Setup {
            mem: name.to_string(),
            what: "dup memfd",
            source: e,
        })?;
        let map = MmapRegion::from_file(FileOffset::new(f, 0), capacity).map_err(|source| {
            MemError::Region {
                mem: name.to_string(),
                what: "mmap",
                source,
            }
        })?;
        Ok(StagingMemory {
            name: name.to_string(),
            file,
            map,
            alloc: Mutex::new(BlockAlloc::new(0, capacity as u64)),
        })
    }

    /// A block of `size` bytes (a power of two), aligned to its size; None
    /// when the memory is exhausted.
    pub fn alloc(&self, size: u32) -> Option<u64> {
        self.lock().alloc(size as u64)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BlockAlloc> {
        self.alloc.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Returns a block; its pages are released (they read as zero afterwards).
    pub fn free(&self, addr: u64, size: u32) {
        use std::os::fd::AsRawFd;
        // SAFETY: fallocate on our own memfd; punching a hole only drops pages.
        unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                addr as libc::off_t,
                size as libc::off_t,
            );
        }
        self.lock().free(addr, size as u64);
    }

    /// Bytes currently allocated to rings (leak checks).
    pub fn in_use(&self) -> u64 {
        self.lock().in_use()
    }
}

impl Memory for StagingMemory {
    fn name(&self) -> &str {
        &self.name
    }

    fn slice(&self, addr: u64, len: usize) -> Option<VolatileSlice<'_>> {
        self.map.get_slice(usize::try_from(addr).ok()?, len).ok()
    }

    fn untrusted(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use vm_memory::Bytes;

    #[test]
    fn guest_memory_checks_ranges_and_runs_the_hook() {
        let (g, file) = GuestMem::memfd("t-guest", 0x10_0000, 1 << 20).unwrap();
        let calls = Arc::new(AtomicU64::new(0));
        let c = calls.clone();
        let hook: PrepareHook = Box::new(move |addr, len| {
            c.fetch_add(1, Ordering::SeqCst);
            if addr == 0x10_0000 && len == 5 {
                Err("refused by test".into())
            } else {
                Ok(())
            }
        });
        let g = GuestMem::new("t-guest", g.gm, Some(hook));
        assert!(g.get(0x10_0000, 1 << 20).is_ok());
        assert!(matches!(
            g.get(0x10_0000, (1 << 20) + 1),
            Err(MemError::OutOfRange { .. })
        ));
        assert!(g.get(0, 1).is_err());
        assert!(g.get(u64::MAX - 2, 8).is_err());
        let s = g.for_write(0x10_0010, 4).unwrap();
        s.write_slice(b"abcd", 0).unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        let e = g.for_write(0x10_0000, 5).unwrap_err();
        assert!(matches!(e, MemError::Prepare { .. }));
        assert!(std::error::Error::source(&e).is_some());
        // The other mapping of the memfd sees the write.
        let other = GuestMem::map_file("t-other", &file, 0, 1 << 20).unwrap();
        let mut buf = [0u8; 4];
        other.read_slice(&mut buf, GuestAddress(0x10)).unwrap();
        assert_eq!(&buf, b"abcd");
    }

    #[test]
    fn raw_memory_bounds() {
        let mut v = vec![0u8; 4096];
        // SAFETY: `v` outlives `m`.
        let m = unsafe { RawMemory::new("t-raw", v.as_mut_ptr(), 0x1000, v.len(), None) };
        assert!(m.get(0x1000, 4096).is_ok());
        assert!(m.get(0x1001, 4096).is_err());
        assert!(m.get(0xfff, 1).is_err());
        assert!(m.get(u64::MAX, 2).is_err());
    }

    #[test]
    fn staging_blocks_are_aligned_reused_and_zeroed() {
        let s = StagingMemory::new("t-staging", 1 << 20).unwrap();
        let a = s.alloc(4096).unwrap();
        let b = s.alloc(65536).unwrap();
        assert_eq!(b % 65536, 0);
        assert_ne!(a, b);
        s.get(a, 4096).unwrap().write_slice(&[7u8; 16], 0).unwrap();
        assert_eq!(s.in_use(), 4096 + 65536);
        s.free(a, 4096);
        let c = s.alloc(4096).unwrap();
        assert_eq!(c, a);
        let mut buf = [1u8; 16];
        s.get(c, 16).unwrap().read_slice(&mut buf, 0).unwrap();
        assert_eq!(buf, [0u8; 16], "a reused block starts zeroed");
        // Exhaustion is a None, not a panic.
        assert!(s.alloc(1 << 20).is_none());
        s.free(b, 65536);
        s.free(c, 4096);
        assert_eq!(s.in_use(), 0);
    }
}
