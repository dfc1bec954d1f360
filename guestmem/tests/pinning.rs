//! The pool's pin: resident pool memory stays locked by the pool, once per memfd, through
//! every lease; a taker's DMA mapping then locks nothing, and a device registering the
//! memory is told so. Memory with holes is never pinned (pinning would allocate it).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;

use common::*;
use guestmem::pool::{self, Pool, PoolServer};
use guestmem::MemoryPolicy;

const SIZE: u64 = 1 << 20;

fn inode(fd: BorrowedFd<'_>) -> u64 {
    std::fs::metadata(format!(
        "/proc/self/fd/{}",
        std::os::fd::AsRawFd::as_raw_fd(&fd)
    ))
    .unwrap()
    .ino()
}

/// This process's mappings of inode `ino`: (start address, writable, locked), from
/// /proc/self/smaps ("lo" in VmFlags: VM_LOCKED, mlock). The pool server runs in this
/// process, so its pin shows here too.
fn mappings_of(ino: u64) -> Vec<(usize, bool, bool)> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut out = Vec::new();
    let mut cur: Option<(usize, bool)> = None;
    for line in smaps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() >= 5 && f[0].contains('-') && f[1].len() == 4 {
            cur = (f[4].parse::<u64>().ok() == Some(ino)).then(|| {
                let start = usize::from_str_radix(f[0].split('-').next().unwrap(), 16).unwrap();
                (start, f[1].as_bytes()[1] == b'w')
            });
        } else if let (Some((start, w)), Some(&"VmFlags:")) = (cur, f.first()) {
            out.push((start, w, f.contains(&"lo")));
        }
    }
    out
}

/// The pool's own pin of `ino`: a read-only mapping, locked.
fn pool_pin(ino: u64) -> bool {
    mappings_of(ino).iter().any(|&(_, w, locked)| !w && locked)
}

fn stats(server: &PoolServer) -> pool::PoolStats {
    server.pool().stats()
}

#[test]
fn filled_memory_is_pinned_by_the_pool_and_its_dma_mapping_locks_nothing() {
    let server = canary_pool("pinned", SIZE, 1);
    let st = stats(&server);
    assert_eq!((st.pins_made, st.cached_pinned), (1, 1), "{st:?}");

    let mem = pool_ram(&server, SIZE, MemoryPolicy::Lazy);
    let r = mem.region("ram").unwrap();
    assert!(r.pooled() && r.pool_pinned());
    let ino = inode(r.memfd());
    assert!(pool_pin(ino), "{:?}", mappings_of(ino));
    mem.dma_map_shared("ram").unwrap();
    assert!(r.dma_mapped());
    // The VMM's device view: mapped, writable, and not locked by this DMA mapping.
    let dev = r.device_view_ptr() as usize;
    let views = mappings_of(ino);
    let view = views
        .iter()
        .find(|m| m.0 == dev)
        .expect("device view in smaps");
    assert_eq!((view.1, view.2), (true, false), "{views:?}");
    // Still the previous tenant's bytes underneath, never visible to the guest.
    assert_eq!(count_byte(r.guest_view_ptr(), SIZE, 0), SIZE);

    // Back in the pool: pinned already, not pinned again, and still locked.
    drop(mem);
    wait_no_clients(&server);
    let st = stats(&server);
    assert_eq!(
        (st.cached_memfds, st.pins_made, st.cached_pinned),
        (1, 1, 1),
        "{st:?}"
    );
    assert!(pool_pin(ino));

    // Shrinking drops the memfd and its pin.
    assert_eq!(server.pool().shrink_count(1), 1);
    assert!(mappings_of(ino).is_empty(), "{:?}", mappings_of(ino));
    assert_eq!(stats(&server).cached_pinned, 0);
}

#[test]
fn a_miss_is_locked_by_its_dma_mapping_and_pinned_by_the_pool_once_it_comes_back() {
    let server =
        PoolServer::start_with(socket_path("miss"), Arc::new(Pool::new(None)), false).unwrap();
    let mem = pool_ram(&server, SIZE, MemoryPolicy::Lazy);
    let r = mem.region("ram").unwrap();
    assert!(
        r.pooled() && !r.pool_pinned(),
        "a pool miss is sparse, not pinned"
    );
    let ino = inode(r.memfd());
    mem.dma_map_shared("ram").unwrap();
    let dev = r.device_view_ptr() as usize;
    let views = mappings_of(ino);
    assert_eq!(
        views.iter().find(|m| m.0 == dev).map(|m| m.2),
        Some(true),
        "the DMA mapping pins it itself: {views:?}"
    );
    drop(mem);
    wait_no_clients(&server);
    let st = stats(&server);
    assert_eq!((st.pins_made, st.cached_pinned), (1, 1), "{st:?}");
    assert!(pool_pin(ino), "{:?}", mappings_of(ino));

    // A miss that comes back with holes stays unpinned: pinning would allocate it.
    let c = client(&server);
    let sparse = {
        let a = c.take_memfd_as(SIZE, false, MemoryPolicy::Lazy, pool::PageUse::Device);
        let b = c.take_memfd_as(SIZE, false, MemoryPolicy::Lazy, pool::PageUse::Device);
        let (a, b) = (a.unwrap(), b.unwrap());
        assert!(a.pinned && a.recycled, "the cached memfd comes pinned");
        assert!(!b.pinned && !b.recycled);
        inode(b.memfd.as_fd())
    };
    drop(c);
    wait_no_clients(&server);
    let st = stats(&server);
    assert_eq!(
        (st.cached_memfds, st.pins_made, st.cached_pinned),
        (2, 1, 1),
        "{st:?}"
    );
    assert!(!pool_pin(sparse));
}

#[test]
fn a_device_registering_pool_memory_learns_which_is_pinned() {
    let server = canary_pool("register", SIZE, 1);
    let vmm = client(&server);
    let pinned = vmm
        .take_memfd_as(SIZE, false, MemoryPolicy::Lazy, pool::PageUse::Device)
        .unwrap();
    let sparse = vmm
        .take_memfd_as(SIZE, false, MemoryPolicy::Lazy, pool::PageUse::Device)
        .unwrap();
    assert!(pinned.pinned && !sparse.pinned);
    let fresh = fresh_ram(SIZE);
    let hold = pool::DeviceHold::register(
        &[server.path().to_path_buf()],
        &[
            sparse.memfd.as_fd(),
            fresh.memfd("ram").unwrap(),
            pinned.memfd.as_fd(),
        ],
    )
    .unwrap()
    .expect("pool memory is registered");
    assert_eq!(
        (
            hold.pinned(0),
            hold.pinned(1),
            hold.pinned(2),
            hold.pinned(3)
        ),
        (false, false, true, false)
    );
}
