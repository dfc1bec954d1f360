//! 2 MiB hugetlb pages: a clear error when not reserved, and lazy zeroing when they are.
//! Reserves a few pages in /proc/sys/vm/nr_hugepages for the test and restores it.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use common::*;
use guestmem::{Error, GuestMemory, MemoryPolicy, MemorySource, HUGE_PAGE_SIZE};

const NR: &str = "/proc/sys/vm/nr_hugepages";
const FREE: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages";

fn read(path: &str) -> u64 {
    std::fs::read_to_string(path)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Restores nr_hugepages on every exit path of the test.
struct Reserve(u64);

impl Drop for Reserve {
    fn drop(&mut self) {
        let _ = std::fs::write(NR, self.0.to_string());
    }
}

#[test]
fn hugepages_error_then_lazy_canary() {
    // More than is free, whatever the machine has reserved: a clear error.
    let size = (read(FREE) + 8) * HUGE_PAGE_SIZE;
    let e = GuestMemory::new(
        &[ram(size, true)],
        MemoryPolicy::Vanilla,
        MemorySource::Fresh,
        true,
    )
    .unwrap_err();
    assert!(matches!(e, Error::HugepagesNotReserved { .. }), "{e}");
    assert!(e.to_string().contains("/proc/sys/vm/nr_hugepages"), "{e}");

    // Reserve: 8 MiB guest (4 pages) + 1 table page, for the pool and for a vanilla VM.
    let old = read(NR);
    let _restore = Reserve(old);
    std::fs::write(NR, (old + 12).to_string()).unwrap();
    assert!(read(FREE) >= 10, "could not reserve huge pages");

    const SIZE: u64 = 8 << 20;
    let server = canary_pool_with("huge", SIZE, 1, true);
    let mut gm = GuestMemory::new(
        &[ram(SIZE, true)],
        MemoryPolicy::Lazy,
        MemorySource::Pool(client(&server)),
        true,
    )
    .unwrap();
    let r = &gm.regions()[0];
    assert_eq!(
        (r.page_size(), r.hugepages(), r.pooled()),
        (HUGE_PAGE_SIZE, true, true)
    );
    assert_eq!(r.page_stats().dirty, 4);
    gm.write_instant(0x7000, b"boot").unwrap();
    gm.dma_map("ram").unwrap();
    gm.prepare_for_device_write(3 * HUGE_PAGE_SIZE + 5, 10)
        .unwrap();
    let r = &gm.regions()[0];
    // SAFETY: the 10 bytes lie inside the mapped device view of `gm`.
    unsafe {
        std::ptr::write_bytes(
            r.device_view_ptr().add((3 * HUGE_PAGE_SIZE + 5) as usize),
            0x77,
            10,
        )
    };
    assert_eq!(count_byte(r.guest_view_ptr(), SIZE, CANARY), 0);
    // SAFETY: reads inside the mapped guest view of `gm`, which outlives the slices.
    let boot = unsafe { std::slice::from_raw_parts(r.guest_view_ptr().add(0x7000), 4) };
    assert_eq!(boot, b"boot");
    // SAFETY: as above.
    let dev = unsafe {
        std::slice::from_raw_parts(
            r.guest_view_ptr().add((3 * HUGE_PAGE_SIZE + 5) as usize),
            10,
        )
    };
    assert!(dev.iter().all(|b| *b == 0x77));
    assert_eq!(r.page_stats().zeroed_total, 4);

    // Vanilla on fresh huge pages.
    let mut v = GuestMemory::new(
        &[ram(SIZE, true)],
        MemoryPolicy::Vanilla,
        MemorySource::Fresh,
        true,
    )
    .unwrap();
    v.dma_map("ram").unwrap();
    assert_eq!(count_byte(v.regions()[0].guest_view_ptr(), SIZE, 0), SIZE);
    drop(v);
    drop(gm);
    wait_no_clients(&server);
    server.shutdown();
}
