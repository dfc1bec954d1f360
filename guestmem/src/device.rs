//! The device side (e.g. the NIC process): attach to a memfd received over vhost-user
//! SET_MEM_TABLE and zero still-dirty pages before touching them.

use std::os::fd::BorrowedFd;

use crate::sys::{self, Mapping};
use crate::table::{PageStats, PageTable, TRAILER_SIZE};
use crate::Error;

const RW: i32 = libc::PROT_READ | libc::PROT_WRITE;

/// A device process's mapping of one region of a sandbox's memory.
#[derive(Debug)]
pub struct DeviceMemory {
    data: Mapping,
    // Mapping of the page-state table; None for memfds without the burstvm magic.
    _table_map: Option<Mapping>,
    table: Option<PageTable>,
    size: u64,
    /// The pool lease the fd was received under (pool memory only): pages are prepared only
    /// while the memory is still lent under it.
    lease: Option<u64>,
}

impl DeviceMemory {
    /// Maps `[mmap_offset, mmap_offset + size)` of `fd` and, if the memfd carries the
    /// burstvm page-state table (magic in its last page), the table too.
    pub fn attach(fd: BorrowedFd<'_>, mmap_offset: u64, size: u64) -> Result<DeviceMemory, Error> {
        let what = || {
            format!("fd {} (offset {mmap_offset:#x}, size {size:#x})", {
                use std::os::fd::AsRawFd;
                fd.as_raw_fd()
            })
        };
        let len = sys::file_size(fd).map_err(|e| Error::io(format!("fstat {}", what()), e))?;
        let page =
            sys::fd_page_size(fd).map_err(|e| Error::io(format!("fstatfs {}", what()), e))?;
        let end = mmap_offset.checked_add(size).filter(|e| *e <= len);
        if size == 0
            || end.is_none()
            || !mmap_offset.is_multiple_of(page)
            || !size.is_multiple_of(page)
        {
            return Err(Error::BadMemfd {
                what: what(),
                reason: format!("range does not fit a file of {len} bytes with page size {page}"),
            });
        }
        let end = end.unwrap_or(len);
        let data = Mapping::new(fd, mmap_offset, size, RW)
            .map_err(|e| Error::io(format!("mmap {}", what()), e))?;
        let (table_map, table) = match Self::find_table(fd, len, page, end)? {
            None => (None, None),
            Some((data_size, table_map)) => {
                // The table maps pages [0, data_size); ours start at mmap_offset.
                let first = (mmap_offset / page) as usize;
                // SAFETY: table_map covers one state byte per page of data_size; `data`
                // covers size bytes from mmap_offset <= data_size - size.
                let t =
                    unsafe { PageTable::new(data.ptr(), table_map.ptr().add(first), size, page) };
                let _ = data_size;
                (Some(table_map), Some(t))
            }
        };
        let lease = crate::pool::lease_of(fd)?
            .map(|k| k.lease)
            .filter(|l| *l != 0);
        if let (Some(l), Some(t)) = (lease, &table) {
            if t.lease() != l {
                return Err(Error::StaleLease {
                    lease: l,
                    now: t.lease(),
                });
            }
        }
        Ok(DeviceMemory {
            data,
            _table_map: table_map,
            table,
            size,
            lease,
        })
    }

    /// Finds the table from the trailer; only trusted if the whole range lies before it (so
    /// guest-controlled bytes are never read as a trailer).
    fn find_table(
        fd: BorrowedFd<'_>,
        len: u64,
        page: u64,
        end: u64,
    ) -> Result<Option<(u64, Mapping)>, Error> {
        if len < page || !len.is_multiple_of(page) || end > len - page {
            return Ok(None);
        }
        let last = Mapping::new(fd, len - page, page, libc::PROT_READ)
            .map_err(|e| Error::io("mmap last page of memfd", e))?;
        // SAFETY: the trailer is the last TRAILER_SIZE bytes of this page.
        let trailer =
            unsafe { PageTable::read_trailer(last.ptr().add((page - TRAILER_SIZE) as usize)) };
        let Some((data_size, table_page)) = trailer else {
            return Ok(None);
        };
        let tsize = crate::table::table_size(data_size, page);
        if table_page != page
            || !data_size.is_multiple_of(page)
            || data_size + tsize != len
            || end > data_size
        {
            return Ok(None);
        }
        let table = Mapping::new(fd, data_size, tsize, RW)
            .map_err(|e| Error::io("mmap page-state table of memfd", e))?;
        Ok(Some((data_size, table)))
    }

    /// True if the memfd has a page-state table (pool memory that may hold old bytes).
    pub fn tracked(&self) -> bool {
        self.table.is_some()
    }

    /// Pages per state, if the memfd has a table.
    pub fn page_stats(&self) -> Option<PageStats> {
        self.table.as_ref().map(|t| t.stats())
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.data.ptr()
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The pool lease the memory was received under (None: not lent by a pool server).
    pub fn lease(&self) -> Option<u64> {
        self.lease
    }

    /// Zeroes still-dirty pages of `[offset, offset+len)` (relative to the attached range)
    /// and marks them; call before reading or writing guest pages. No-op without a table.
    /// Fails with `StaleLease` once the pool took the memory back (its tenant is gone).
    pub fn prepare_for_device_write(&self, offset: u64, len: u64) -> Result<(), Error> {
        if offset.checked_add(len).is_none_or(|e| e > self.size) {
            return Err(Error::OutOfRange { gpa: offset, len });
        }
        if let Some(t) = &self.table {
            t.ensure_range_for(offset, len, self.lease)?;
        }
        Ok(())
    }
}
