//! Thin wrappers over the Linux calls guestmem needs (memfd, mmap, mlock, limits).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// Size of a hugetlb page as used by burstvm (`MFD_HUGE_2MB`).
pub const HUGE_PAGE_SIZE: u64 = 2 << 20;
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
const MADV_POPULATE_WRITE: i32 = 23;
const CAP_IPC_LOCK: u32 = 14;

pub fn base_page_size() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if v > 0 {
        v as u64
    } else {
        4096
    }
}

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
    let mut flags = libc::MFD_CLOEXEC;
    if hugepages {
        flags |= libc::MFD_HUGETLB | libc::MFD_HUGE_2MB;
    }
    // SAFETY: cname is a valid NUL-terminated string.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by the kernel and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub fn ftruncate(fd: BorrowedFd<'_>, len: u64) -> io::Result<()> {
    // SAFETY: plain syscall on a valid fd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

pub fn file_size(fd: BorrowedFd<'_>) -> io::Result<u64> {
    // SAFETY: stat is plain-old-data; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.st_size as u64)
}

/// Page size of the file system backing `fd` (2 MiB for hugetlbfs memfds).
pub fn fd_page_size(fd: BorrowedFd<'_>) -> io::Result<u64> {
    // SAFETY: statfs is plain-old-data; fstatfs fills it.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and out-pointer.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) } < 0 {
        return Err(io::Error::last_os_error());
    }
    if st.f_type as i64 == HUGETLBFS_MAGIC {
        Ok(st.f_bsize as u64)
    } else {
        Ok(base_page_size())
    }
}

/// One `MAP_SHARED` mapping of a file, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; concurrent access is governed by the
// page-state protocol of the users, not by this owner.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    pub fn new(fd: BorrowedFd<'_>, offset: u64, len: u64, prot: i32) -> io::Result<Mapping> {
        // SAFETY: a fresh mapping chosen by the kernel; it aliases nothing in this process.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: p as *mut u8,
            len: len as usize,
        })
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn protect(&self, prot: i32) -> io::Result<()> {
        // SAFETY: the range is exactly our own mapping.
        if unsafe { libc::mprotect(self.ptr as *mut libc::c_void, self.len, prot) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Allocates (kernel-zeroes) every page of `[off, off+len)` that is not resident yet.
    pub fn populate_write(&self, off: usize, len: usize) -> io::Result<()> {
        // SAFETY: the range lies inside our own mapping.
        let r = unsafe {
            libc::madvise(
                self.ptr.add(off) as *mut libc::c_void,
                len,
                MADV_POPULATE_WRITE,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn lock(&self, off: usize, len: usize) -> io::Result<()> {
        // SAFETY: the range lies inside our own mapping.
        if unsafe { libc::mlock(self.ptr.add(off) as *const libc::c_void, len) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: we own this mapping; nobody uses it after drop.
        unsafe {
            libc::munmap(self.ptr as *mut libc::c_void, self.len);
        }
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
    // SAFETY: rlimit is plain-old-data; getrlimit fills it.
    let mut rl: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } < 0 {
        return None;
    }
    if rl.rlim_cur == libc::RLIM_INFINITY {
        None
    } else {
        Some(rl.rlim_cur)
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

/// Sets the calling thread's scheduling policy (SCHED_IDLE or SCHED_OTHER).
pub fn set_thread_sched(idle: bool) -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    let policy = if idle {
        libc::SCHED_IDLE
    } else {
        libc::SCHED_OTHER
    };
    // SAFETY: pid 0 = calling thread; param is valid.
    if unsafe { libc::sched_setscheduler(0, policy, &param) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Lowest nice value for the calling thread (fallback when SCHED_IDLE is refused).
pub fn set_thread_nice(nice: i32) {
    // SAFETY: gettid/setpriority on our own thread.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, nice);
    }
}

/// An eventfd used to wake a thread blocked in poll.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: plain syscall.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh fd owned by nobody else.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64.
        unsafe {
            libc::write(
                self.0.as_raw_fd(),
                &one as *const u64 as *const libc::c_void,
                8,
            );
        }
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.0.as_fd()
    }
}

/// Waits until one of `fds` is readable; returns the readiness (revents != 0) of each.
pub fn poll_readable(fds: &[BorrowedFd<'_>], timeout_ms: i32) -> io::Result<Vec<bool>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|f| libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        // SAFETY: pfds is a valid array of pollfd.
        let r = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout_ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(pfds.iter().map(|p| p.revents != 0).collect());
    }
}
