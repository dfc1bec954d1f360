//! Fault handler, background zeroer and device writers racing on the same pages.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use std::sync::Arc;

use common::*;
use guestmem::{DeviceMemory, MemoryPolicy};

const PAGES: u64 = 4096;
const SIZE: u64 = PAGES * PAGE;

/// The byte a device writer puts into page `p` (never the canary, never zero).
fn pattern(p: u64) -> u8 {
    0x10 + (p % 64) as u8
}

/// Pages written by a writer: a stride permutation so writers and readers cross often.
fn writer_pages(seed: u64, stride: u64) -> Vec<u64> {
    (0..PAGES)
        .map(|i| (seed + i * stride) % PAGES)
        .filter(|p| p % 3 != 0)
        .collect()
}

fn round(round: u64) {
    let server = canary_pool(&format!("conc{round}"), SIZE, 1);
    let gm = Arc::new(pool_ram(&server, SIZE, MemoryPolicy::Lazy));
    gm.dma_map_shared("ram").unwrap();
    assert_eq!(gm.regions()[0].page_stats().dirty, PAGES);
    let barrier = Arc::new(std::sync::Barrier::new(5));
    let mut threads = Vec::new();

    // Two "guest" readers (uffd handler path), in opposite orders; they only look for the
    // canary, since a page may be half-written by a device at the time.
    for dir in 0..2u64 {
        let (gm, barrier) = (gm.clone(), barrier.clone());
        threads.push(std::thread::spawn(move || {
            barrier.wait();
            let base = gm.regions()[0].guest_view_ptr();
            let mut seen = 0;
            for i in 0..PAGES {
                let p = if dir == 0 { i } else { PAGES - 1 - i };
                // SAFETY: page p lies inside the mapped view `base` points into.
                seen += count_byte(unsafe { base.add((p * PAGE) as usize) }, PAGE, CANARY);
            }
            (Vec::new(), seen)
        }));
    }
    // Device writer 1 through the VMM API and the device view.
    {
        let (gm, barrier) = (gm.clone(), barrier.clone());
        threads.push(std::thread::spawn(move || {
            barrier.wait();
            let dev = gm.regions()[0].device_view_ptr();
            let pages = writer_pages(round, 7);
            let mine: Vec<u64> = pages.into_iter().filter(|p| p % 2 == 0).collect();
            for &p in &mine {
                gm.prepare_for_device_write(p * PAGE, PAGE).unwrap();
                // SAFETY: the page lies inside the mapped device view of `gm`.
                unsafe {
                    std::ptr::write_bytes(dev.add((p * PAGE) as usize), pattern(p), PAGE as usize)
                };
            }
            (mine, 0)
        }));
    }
    // Device writer 2 through its own attachment (as the NIC process does).
    {
        let (gm, barrier) = (gm.clone(), barrier.clone());
        threads.push(std::thread::spawn(move || {
            let dm = DeviceMemory::attach(gm.regions()[0].memfd(), 0, SIZE).unwrap();
            assert!(dm.tracked());
            barrier.wait();
            let pages = writer_pages(round * 13 + 5, 11);
            let mine: Vec<u64> = pages.into_iter().filter(|p| p % 2 == 1).collect();
            for &p in &mine {
                dm.prepare_for_device_write(p * PAGE, PAGE).unwrap();
                // SAFETY: the page lies inside the attached device mapping `dm`.
                unsafe {
                    std::ptr::write_bytes(
                        dm.as_ptr().add((p * PAGE) as usize),
                        pattern(p),
                        PAGE as usize,
                    )
                };
            }
            (mine, 0)
        }));
    }
    // Background zeroer: idle priority in even rounds, normal priority in odd rounds so it
    // really competes with the others on this 2-core machine.
    gm.start_lazy_zeroing_with_priority(round.is_multiple_of(2))
        .unwrap();
    barrier.wait();

    let mut written = vec![false; PAGES as usize];
    let mut canary_seen = 0;
    for t in threads {
        let (pages, seen) = t.join().unwrap();
        canary_seen += seen;
        for p in pages {
            written[p as usize] = true;
        }
    }
    gm.wait_background_zeroing();
    assert!(gm.lazy_error().is_none(), "{:?}", gm.lazy_error());
    assert_eq!(canary_seen, 0, "round {round}: readers saw the canary");

    let r = &gm.regions()[0];
    assert_eq!(r.page_stats().dirty, 0);
    assert_eq!(r.page_stats().zeroing, 0);
    let mut n_written = 0;
    for p in 0..PAGES {
        // SAFETY: the page lies inside the mapped guest view, alive for the loop.
        let page = unsafe {
            std::slice::from_raw_parts(r.guest_view_ptr().add((p * PAGE) as usize), PAGE as usize)
        };
        let want = if written[p as usize] {
            n_written += 1;
            pattern(p)
        } else {
            0
        };
        assert!(
            page.iter().all(|b| *b == want),
            "round {round}: page {p} (written: {}) holds {:?}, want all {want:#x}",
            written[p as usize],
            page.iter().find(|b| **b != want)
        );
    }
    assert!(n_written > PAGES / 2);
    // Every page was zeroed exactly once, whoever did it.
    assert_eq!(
        r.page_stats().zeroed_total,
        PAGES,
        "round {round}: {:?}",
        r.page_stats()
    );
    let s = gm.lazy_stats();
    assert!(s.fault_zeroed + s.background_zeroed <= PAGES, "{s:?}");
    eprintln!("round {round}: {s:?}, device-written pages {n_written}");
}

#[test]
fn handler_zeroer_and_device_writers_race() {
    for r in 0..4 {
        round(r);
    }
}
