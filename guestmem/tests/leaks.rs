//! Every fd, mapping and thread is released when a GuestMemory, client and server go away.
//! (Its own test binary: counts are per process.)
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use common::*;
use guestmem::{GuestMemory, MemoryPolicy, MemorySource, RegionSpec};

fn count_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn count_threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

fn count_maps(needle: &str) -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

#[test]
fn nothing_leaks_across_policies() {
    let specs = [
        RegionSpec {
            name: "ram".into(),
            gpa: 0,
            size: 4 << 20,
            dma: true,
        },
        RegionSpec {
            name: "image".into(),
            gpa: 0xC000_0000,
            size: 2 << 20,
            dma: false,
        },
    ];
    // Warm up lazily initialised process state (allocator arenas, etc.).
    drop(GuestMemory::new(&specs, MemoryPolicy::Vanilla, MemorySource::Fresh, false).unwrap());
    let (fds, threads) = (count_fds(), count_threads());
    for policy in [
        MemoryPolicy::Vanilla,
        MemoryPolicy::Pre(50),
        MemoryPolicy::Lazy,
    ] {
        let server = canary_pool("leak", 4 << 20, 1);
        let mut gm =
            GuestMemory::new(&specs, policy, MemorySource::Pool(client(&server)), false).unwrap();
        gm.dma_map("ram").unwrap();
        gm.start_lazy_zeroing().unwrap();
        let mem = gm.device_guest_memory().unwrap();
        assert_eq!(
            count_byte(gm.regions()[0].guest_view_ptr(), 4 << 20, CANARY),
            0
        );
        gm.wait_background_zeroing();
        drop(mem);
        drop(gm);
        wait_no_clients(&server);
        server.shutdown();
        assert_eq!(count_maps("memfd:burstvm"), 0, "{policy}: mappings left");
        assert_eq!(count_fds(), fds, "{policy}: fds left");
        assert_eq!(count_threads(), threads, "{policy}: threads left");
    }
}
