//! The test frontend's "guest memory": a memfd mapped shared, made fresh,
//! taken from an existing memfd, or viewed a second time.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};

use super::{FrontendError, MIN_MEM};

/// The frontend's "guest memory": a memfd mapped shared; `populate` touches
/// every page first (as a VMM that DMA-mapped its RAM itself), otherwise the
/// NIC's mapping allocates and zeroes the pages (fresh memory, vanilla).
#[derive(Debug)]
pub struct FrontendMemory {
    pub(super) memfd: File,
    pub(super) base: *mut u8,
    pub(super) size: usize,
}

// SAFETY: `base` is a shared mapping owned by this struct.
unsafe impl Send for FrontendMemory {}

impl FrontendMemory {
    /// The mapping's address and length (the frontend's "guest-physical" 0).
    pub fn host(&self) -> (*mut u8, usize) {
        (self.base, self.size)
    }

    pub fn new(size: usize, populate: bool) -> Result<Self, FrontendError> {
        if size < MIN_MEM {
            return Err(FrontendError::Size(size));
        }
        let io = |what: &'static str| {
            move |source| FrontendError::Io {
                socket: String::new(),
                what,
                source,
            }
        };
        // SAFETY: memfd_create with a valid name.
        let fd = unsafe { libc::memfd_create(c"nic-test-frontend".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io("memfd_create")(io::Error::last_os_error()));
        }
        // SAFETY: fd was just created and is owned here.
        let memfd = unsafe { File::from_raw_fd(fd) };
        memfd.set_len(size as u64).map_err(io("ftruncate"))?;
        Self::map(memfd, size, populate)
    }

    /// The first `size` bytes of an existing memfd (e.g. memory taken from a page pool,
    /// whose page-state table follows the guest bytes), mapped shared.
    pub fn from_memfd(memfd: File, size: usize) -> Result<Self, FrontendError> {
        if size < MIN_MEM {
            return Err(FrontendError::Size(size));
        }
        Self::map(memfd, size, false)
    }

    /// A second mapping of the same memory (shared pages): lets a test look
    /// at memory a frontend gave up.
    pub fn second_view(&self) -> Result<Self, FrontendError> {
        let memfd = self.memfd.try_clone().map_err(|source| FrontendError::Io {
            socket: String::new(),
            what: "dup memfd",
            source,
        })?;
        Self::map(memfd, self.size, false)
    }

    fn map(memfd: File, size: usize, populate: bool) -> Result<Self, FrontendError> {
        // SAFETY: shared mapping of the first `size` bytes of a memfd we own.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 },
                memfd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(FrontendError::Io {
                socket: String::new(),
                what: "mmap",
                source: io::Error::last_os_error(),
            });
        }
        Ok(FrontendMemory {
            memfd,
            base: base.cast(),
            size,
        })
    }
}

impl Drop for FrontendMemory {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.base.cast(), self.size) };
    }
}
