//! The Linux calls guestmem needs, on nix and vmm-sys-util (memfd, mmap, mlock, limits,
//! eventfd, poll); only what those crates lack is done here (MADV_POPULATE_WRITE, SCHED_IDLE,
//! /proc and /sys reads).

use std::ffi::CString;
use std::io;
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::memfd::{memfd_create as nix_memfd_create, MemFdCreateFlag};
use nix::sys::mman::{self, MapFlags, ProtFlags};
use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
use nix::sys::statfs::{fstatfs, HUGETLBFS_MAGIC};
use nix::unistd::{sysconf, SysconfVar};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Size of a hugetlb page as used by burstvm (`MFD_HUGE_2MB`).
pub const HUGE_PAGE_SIZE: u64 = 2 << 20;
const CAP_IPC_LOCK: u32 = 14;

pub fn base_page_size() -> u64 {
    match sysconf(SysconfVar::PAGE_SIZE) {
        Ok(Some(v)) if v > 0 => v as u64,
        _ => 4096,
    }
}

/// The page size a region gets: [`HUGE_PAGE_SIZE`] with `hugepages`, else the
/// base page size (`sysconf(PAGE_SIZE)`).
pub fn page_size_for(hugepages: bool) -> u64 {
    if hugepages {
        HUGE_PAGE_SIZE
    } else {
        base_page_size()
    }
}

pub fn round_up(v: u64, align: u64) -> u64 {
    v.div_ceil(align) * align
}

pub fn memfd_create(name: &str, hugepages: bool) -> io::Result<OwnedFd> {
    let cname = CString::new(format!("burstvm-{name}"))
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in memfd name"))?;
    let mut flags = MemFdCreateFlag::MFD_CLOEXEC;
    if hugepages {
        flags |= MemFdCreateFlag::MFD_HUGETLB | MemFdCreateFlag::MFD_HUGE_2MB;
    }
    Ok(nix_memfd_create(&cname, flags)?)
}

pub fn ftruncate(fd: BorrowedFd<'_>, len: u64) -> io::Result<()> {
    Ok(nix::unistd::ftruncate(fd, len as libc::off_t)?)
}

pub fn file_size(fd: BorrowedFd<'_>) -> io::Result<u64> {
    Ok(nix::sys::stat::fstat(fd.as_raw_fd())?.st_size as u64)
}

/// Page size of the file system backing `fd` (2 MiB for hugetlbfs memfds).
pub fn fd_page_size(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let st = fstatfs(fd)?;
    if st.filesystem_type() == HUGETLBFS_MAGIC {
        Ok(st.block_size() as u64)
    } else {
        Ok(base_page_size())
    }
}

/// One `MAP_SHARED` mapping of a file, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<libc::c_void>,
    len: usize,
    /// False for an alias of another mapping (unmapped by its owner).
    owned: bool,
}

// SAFETY: the mapping is plain shared memory; concurrent access is governed by the
// page-state protocol of the users, not by this owner.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

fn prot_flags(prot: i32) -> ProtFlags {
    ProtFlags::from_bits_truncate(prot)
}

impl Mapping {
    pub fn new(fd: BorrowedFd<'_>, offset: u64, len: u64, prot: i32) -> io::Result<Mapping> {
        Mapping::with_flags(fd, offset, len, prot, MapFlags::MAP_SHARED)
    }

    /// A copy-on-write mapping: writes go to anonymous pages of this process,
    /// never to the file (templates).
    pub fn new_private(fd: BorrowedFd<'_>, len: u64, prot: i32) -> io::Result<Mapping> {
        Mapping::with_flags(fd, 0, len, prot, MapFlags::MAP_PRIVATE)
    }

    /// The first `len` bytes of `self`, not unmapped on drop. The caller
    /// drops the alias before (or with) `self`.
    pub fn alias(&self, len: u64) -> Mapping {
        Mapping {
            ptr: self.ptr,
            len: (len as usize).min(self.len),
            owned: false,
        }
    }

    fn with_flags(
        fd: BorrowedFd<'_>,
        offset: u64,
        len: u64,
        prot: i32,
        flags: MapFlags,
    ) -> io::Result<Mapping> {
        let n = NonZeroUsize::new(len as usize)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty mapping"))?;
        // SAFETY: a fresh mapping chosen by the kernel; it aliases nothing in this process.
        let ptr =
            unsafe { mman::mmap(None, n, prot_flags(prot), flags, fd, offset as libc::off_t) }?;
        Ok(Mapping {
            ptr,
            len: len as usize,
            owned: true,
        })
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr().cast()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn protect(&self, prot: i32) -> io::Result<()> {
        // SAFETY: the range is exactly our own mapping.
        Ok(unsafe { mman::mprotect(self.ptr, self.len, prot_flags(prot)) }?)
    }

    /// Allocates (kernel-zeroes) every page of `[off, off+len)` that is not resident yet.
    pub fn populate_write(&self, off: usize, len: usize) -> io::Result<()> {
        // SAFETY: the range lies inside our own mapping.
        unsafe { populate_write(self.ptr().add(off), len) }
    }

    pub fn lock(&self, off: usize, len: usize) -> io::Result<()> {
        // SAFETY: the range lies inside our own mapping (off < len, so not null).
        let p = unsafe { NonNull::new_unchecked(self.ptr().add(off)) };
        // SAFETY: locking pages of our own mapping.
        Ok(unsafe { mman::mlock(p.cast(), len) }?)
    }
}

/// MADV_POPULATE_WRITE over `[ptr, ptr+len)`: maps every page writable in one call,
/// allocating (kernel-zeroing) any not resident yet. (nix has no MADV_POPULATE_WRITE.)
///
/// # Safety
/// The range must lie inside a shared or private mapping of this process; populating
/// changes no byte of it.
pub unsafe fn populate_write(ptr: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: the caller's range is mapped.
    if unsafe { libc::madvise(ptr.cast(), len, libc::MADV_POPULATE_WRITE) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // SAFETY: we own this mapping; nobody uses it after drop.
        let _ = unsafe { mman::munmap(self.ptr, self.len) };
    }
}

/// A field of /proc/meminfo in bytes (values there are in kB, counts for HugePages_*).
pub fn meminfo(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(field) else {
            continue;
        };
        let Some(rest) = rest.strip_prefix(':') else {
            continue;
        };
        let mut it = rest.split_whitespace();
        let v: u64 = it.next()?.parse().ok()?;
        return Some(match it.next() {
            Some("kB") => v * 1024,
            _ => v,
        });
    }
    None
}

pub fn free_huge_pages() -> u64 {
    std::fs::read_to_string("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .or_else(|| meminfo("HugePages_Free"))
        .unwrap_or(0)
}

/// How many bytes this process may mlock (None = unlimited or CAP_IPC_LOCK).
pub fn memlock_limit() -> Option<u64> {
    if has_cap_ipc_lock() {
        return None;
    }
    match getrlimit(Resource::RLIMIT_MEMLOCK) {
        Ok((cur, _)) if cur != RLIM_INFINITY => Some(cur),
        _ => None,
    }
}

fn has_cap_ipc_lock() -> bool {
    let Ok(text) = std::fs::read_to_string("/proc/thread-self/status") else {
        return false;
    };
    text.lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

/// A non-blocking eventfd used to wake a thread blocked in poll.
pub fn wake_fd() -> io::Result<EventFd> {
    EventFd::new(EFD_NONBLOCK | libc::EFD_CLOEXEC)
}

/// Wakes whoever polls `e` (a full counter still wakes, so the error is ignored).
pub fn signal(e: &EventFd) {
    let _ = e.write(1);
}

/// `e` as a borrowed fd (vmm-sys-util's EventFd has no `AsFd`).
pub fn borrow(e: &EventFd) -> BorrowedFd<'_> {
    // SAFETY: the eventfd lives as long as `e`, which the borrow ties to.
    unsafe { BorrowedFd::borrow_raw(e.as_raw_fd()) }
}

/// Waits until one of `fds` is readable; returns the readiness of each.
pub fn poll_readable(fds: &[BorrowedFd<'_>], timeout: PollTimeout) -> io::Result<Vec<bool>> {
    let mut pfds: Vec<PollFd> = fds
        .iter()
        .map(|f| PollFd::new(*f, PollFlags::POLLIN))
        .collect();
    loop {
        match nix::poll::poll(&mut pfds, timeout) {
            Ok(_) => {
                return Ok(pfds
                    .iter()
                    .map(|p| p.revents().is_none_or(|r| !r.is_empty()))
                    .collect())
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}
