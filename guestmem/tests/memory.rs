//! GuestMemory API, policies and the canary tests (no old byte ever visible).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use std::sync::Arc;

use common::*;
use guestmem::{DeviceMemory, Error, GuestMemory, MemoryPolicy, MemorySource, RegionSpec};
use vm_memory::{Bytes, GuestAddress};

fn image(size: u64, dma: bool) -> RegionSpec {
    RegionSpec {
        name: "image".into(),
        gpa: 0xC000_0000,
        size,
        dma,
    }
}

#[test]
fn fresh_vanilla_regions_and_views() {
    let specs = [ram(4 << 20, true), image(2 << 20, false)];
    let mut gm =
        GuestMemory::new(&specs, MemoryPolicy::Vanilla, MemorySource::Fresh, false).unwrap();
    let r = gm.regions();
    assert_eq!(r.len(), 2);
    assert_eq!(
        (r[0].name(), r[0].gpa(), r[0].size(), r[0].dma()),
        ("ram", 0, 4 << 20, true)
    );
    assert_eq!(
        (r[1].name(), r[1].gpa(), r[1].size(), r[1].dma()),
        ("image", 0xC000_0000, 2 << 20, false)
    );
    assert!(!r[0].pooled() && !r[1].pooled());
    assert!(r[0].memfd_size() > r[0].size());
    assert_ne!(r[0].guest_view_ptr(), r[0].device_view_ptr());

    gm.write_instant(0x7000, b"bootinfo").unwrap();
    gm.write_instant(0xC000_0010, b"agent").unwrap();
    gm.dma_map("ram").unwrap();
    assert!(gm.regions()[0].dma_mapped());
    assert!(matches!(gm.dma_map("image"), Err(Error::NotDma(n)) if n == "image"));
    assert!(matches!(gm.dma_map("nope"), Err(Error::UnknownRegion(_))));
    gm.start_lazy_zeroing().unwrap(); // no-op for vanilla

    // Both views and the vm-memory view show the same bytes.
    let r = &gm.regions()[0];
    // SAFETY: the range lies inside a mapping that the memory object of this scope keeps mapped for the whole access.
    let guest = unsafe { std::slice::from_raw_parts(r.guest_view_ptr().add(0x7000), 8) };
    assert_eq!(guest, b"bootinfo");
    let mem = gm.device_guest_memory().unwrap();
    let mut buf = [0u8; 5];
    mem.read_slice(&mut buf, GuestAddress(0xC000_0010)).unwrap();
    assert_eq!(&buf, b"agent");
    mem.write_slice(b"dev", GuestAddress(0x2000)).unwrap();
    // SAFETY: the range lies inside a mapping that the memory object of this scope keeps mapped for the whole access.
    let guest = unsafe { std::slice::from_raw_parts(r.guest_view_ptr().add(0x2000), 3) };
    assert_eq!(guest, b"dev");

    // Out-of-range and spanning accesses are errors, not crashes.
    assert!(matches!(
        gm.write_instant((4 << 20) - 2, b"abcd"),
        Err(Error::OutOfRange { .. })
    ));
    assert!(gm.prepare_for_device_write(0xB000_0000, 16).is_err());
    assert!(gm.prepare_for_device_write(u64::MAX - 4, 16).is_err());
}

#[test]
fn bad_specs_are_rejected() {
    let f = |specs: &[RegionSpec]| {
        GuestMemory::new(specs, MemoryPolicy::Vanilla, MemorySource::Fresh, false).unwrap_err()
    };
    assert!(matches!(f(&[]), Error::InvalidSpec { .. }));
    assert!(matches!(f(&[ram(4097, true)]), Error::InvalidSpec { region, .. } if region == "ram"));
    let mut a = image(1 << 20, true);
    a.gpa = 0x1000;
    assert!(matches!(f(&[ram(1 << 20, true), a]), Error::Overlap { .. }));
    let mut b = ram(1 << 20, true);
    b.gpa = 0x4000_0000;
    assert!(matches!(
        f(&[ram(1 << 20, true), b]),
        Error::InvalidSpec { .. }
    ));
}

#[test]
fn more_than_the_host_can_lock_is_refused_up_front() {
    let e = GuestMemory::new(
        &[ram(1 << 50, true)],
        MemoryPolicy::Vanilla,
        MemorySource::Fresh,
        false,
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::NotEnoughMemory { .. } | Error::MemlockLimit { .. }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("MemAvailable") || e.to_string().contains("RLIMIT_MEMLOCK"));
}

/// Canary test for one policy: pool memory full of a previous tenant's bytes.
fn canary(policy: MemoryPolicy, background: bool) {
    const SIZE: u64 = 8 << 20;
    let server = canary_pool(&policy.to_string(), SIZE, 1);
    let specs = [ram(SIZE, true), image(2 << 20, false)];
    let mut gm =
        GuestMemory::new(&specs, policy, MemorySource::Pool(client(&server)), false).unwrap();
    let pooled = gm.regions()[0].pooled();
    assert_eq!(pooled, policy != MemoryPolicy::Vanilla);
    // A region no device maps comes from the pool only under lazy, as
    // host-only memory (its guest faults zero it); otherwise it is fresh.
    assert_eq!(
        gm.regions()[1].pooled(),
        policy == MemoryPolicy::Lazy,
        "{policy}: the dma=false region"
    );
    if policy == MemoryPolicy::Vanilla {
        assert_eq!(
            server.pool().stats().lent_memfds,
            0,
            "vanilla took pool memory"
        );
    } else {
        assert_eq!(server.pool().stats().hits, 1);
        assert!(gm.regions()[0].page_stats().dirty > 0);
    }

    // Instant-zero list: boot info at 0x7000 and page tables across a page boundary.
    let boot = vec![0x42u8; 100];
    let tables = vec![0x17u8; 3 * PAGE as usize];
    gm.write_instant(0x7000 + 8, &boot).unwrap();
    gm.write_instant(0x9000 + 16, &tables).unwrap();
    gm.dma_map("ram").unwrap();
    if background {
        gm.start_lazy_zeroing().unwrap();
    }
    if policy == MemoryPolicy::Lazy {
        // Lazy: nothing zeroed at map time beyond the instant pages' 64 KiB block
        // (mapped ahead of the guest).
        if !background {
            let st = gm.regions()[0].page_stats();
            assert_eq!(st.dirty, SIZE / PAGE - (64 << 10) / PAGE, "{st:?}");
        }
    } else {
        assert_eq!(gm.regions()[0].page_stats().dirty, 0);
    }

    // A device writes into a never-touched page after preparing it, and reads another.
    let dev_gpa = 0x40_0000;
    gm.prepare_for_device_write(dev_gpa, 2 * PAGE).unwrap();
    let r = &gm.regions()[0];
    // SAFETY: the range lies inside a mapping that the memory object of this scope keeps mapped for the whole access.
    unsafe { std::ptr::write_bytes(r.device_view_ptr().add(dev_gpa as usize), 0x3C, 100) };
    gm.prepare_for_device_write(0x50_0000, PAGE).unwrap();
    assert_eq!(
        // SAFETY: the range lies inside a mapping that the memory object of this scope keeps mapped for the whole access.
        count_byte(unsafe { r.device_view_ptr().add(0x50_0000) }, PAGE, CANARY),
        0
    );

    // The guest (host threads reading the guest view fault like KVM would) reads it all.
    let gm = Arc::new(gm);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let gm = gm.clone();
            std::thread::spawn(move || {
                let r = &gm.regions()[0];
                let quarter = SIZE / 4;
                count_byte(
                    // SAFETY: the range lies inside a mapping that the memory object of this scope keeps mapped for the whole access.
                    unsafe { r.guest_view_ptr().add((t * quarter) as usize) },
                    quarter,
                    CANARY,
                )
            })
        })
        .collect();
    let seen: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(seen, 0, "{policy}: guest saw {seen} canary bytes");
    gm.wait_background_zeroing();
    assert!(gm.lazy_error().is_none());

    let r = &gm.regions()[0];
    // SAFETY: the range lies inside a mapping that the memory object of this scope keeps mapped for the whole access.
    let g = |off: u64, len: usize| unsafe {
        std::slice::from_raw_parts(r.guest_view_ptr().add(off as usize), len).to_vec()
    };
    assert_eq!(g(0x7000 + 8, 100), boot, "{policy}: instant write wiped");
    assert_eq!(g(0x7000, 8), vec![0; 8]);
    assert_eq!(
        g(0x9000 + 16, tables.len()),
        tables,
        "{policy}: instant write wiped"
    );
    assert_eq!(
        g(dev_gpa, 100),
        vec![0x3C; 100],
        "{policy}: device write wiped"
    );
    assert_eq!(g(dev_gpa + 100, 100), vec![0; 100]);
    assert_eq!(gm.regions()[0].page_stats().dirty, 0);
    if policy == MemoryPolicy::Lazy {
        let s = gm.lazy_stats();
        assert!(s.faults > 0 || s.background_mapped > 0, "{s:?}");
    }

    // The image region (host-only pool memory under lazy, else fresh) reads as zero too.
    let img = &gm.regions()[1];
    assert_eq!(count_byte(img.guest_view_ptr(), img.size(), CANARY), 0);
    drop(gm);
    wait_no_clients(&server);
    let st = server.pool().stats();
    assert_eq!(st.lent_memfds, 0);
    // Back in the cache: what was taken (the canary memfd stays cached under
    // vanilla), each without a device unmap to wait for (no device mapped it).
    let taken = match policy {
        MemoryPolicy::Vanilla => 0,
        MemoryPolicy::Lazy => 2,
        _ => 1,
    };
    assert_eq!(st.cached_memfds, taken.max(1), "{policy}");
    assert_eq!(
        (st.returns_without_unmap, st.returns_after_unmap),
        (taken, 0)
    );
}

#[test]
fn canary_lazy() {
    canary(MemoryPolicy::Lazy, false);
}

#[test]
fn canary_lazy_with_background_zeroer() {
    canary(MemoryPolicy::Lazy, true);
}

#[test]
fn canary_pre50() {
    canary(MemoryPolicy::Pre(50), false);
}

#[test]
fn canary_vanilla() {
    canary(MemoryPolicy::Vanilla, false);
}

#[test]
fn pre_policy_zeroes_only_what_was_not_zeroed_ahead() {
    const SIZE: u64 = 4 << 20;
    let server = canary_pool("pre10", SIZE, 1);
    server.pool().prezero_now(10).unwrap();
    let st = server.pool().stats();
    assert_eq!(st.classes[0].zeroed_ahead_bytes, SIZE / 10 / PAGE * PAGE);
    let mut gm = pool_ram(&server, SIZE, MemoryPolicy::Pre(10));
    let s = gm.regions()[0].page_stats();
    assert_eq!(s.zero, SIZE / PAGE / 10);
    assert_eq!(s.dirty, SIZE / PAGE - SIZE / PAGE / 10);
    gm.dma_map("ram").unwrap();
    let r = &gm.regions()[0];
    assert_eq!(r.page_stats().zero, SIZE / PAGE);
    assert_eq!(count_byte(r.guest_view_ptr(), SIZE, CANARY), 0);
}

const MIB: u64 = 1 << 20;
/// Pages in lazy zeroing's fault-around block (64 KiB).
const BLOCK: u64 = (64 << 10) / PAGE;

/// 1 MiB of lazy guest RAM from a pool whose memory is full of a previous tenant's canary.
/// The server is returned first, so it outlives the memory.
fn dirty_lazy_mib(tag: &str) -> (guestmem::pool::PoolServer, GuestMemory) {
    let server = canary_pool(tag, MIB, 1);
    let gm = pool_ram(&server, MIB, MemoryPolicy::Lazy);
    (server, gm)
}

/// The byte at `off` of the first region, read through the guest view (a fault, if lazy
/// zeroing has not mapped it yet, as a KVM access would take).
fn guest_byte(gm: &GuestMemory, off: u64) -> u8 {
    let r = &gm.regions()[0];
    assert!(off < r.size());
    // SAFETY: `off` lies inside the guest view (checked), mapped while `gm` lives.
    unsafe { std::ptr::read_volatile(r.guest_view_ptr().add(off as usize)) }
}

/// A guest's first touch under `lazy` zeroes and maps the aligned 64 KiB block around
/// it (the kernel's fault-around size), no more: a touch in the same block takes no
/// second fault, a touch in the next block takes one, and the rest stays dirty.
#[test]
fn a_guest_touch_zeroes_and_maps_its_64_kib_block() {
    let (_server, gm) = dirty_lazy_mib("faultaround");
    let r = &gm.regions()[0];
    let total = MIB / PAGE;
    assert_eq!(r.page_stats().dirty, total);
    let read = |page: u64| guest_byte(&gm, page * PAGE + 100);

    assert_eq!(read(BLOCK + 5), 0, "the canary reached the guest");
    let s = gm.lazy_stats();
    assert_eq!((s.faults, s.fault_zeroed), (1, BLOCK), "{s:?}");
    // The handler wakes the guest before it marks the block MAPPED: ZERO or MAPPED.
    let st = r.page_stats();
    assert_eq!(
        (st.zero + st.mapped, st.dirty),
        (BLOCK, total - BLOCK),
        "{st:?}"
    );

    assert_eq!(read(BLOCK), 0);
    assert_eq!(read(2 * BLOCK - 1), 0);
    assert_eq!(
        gm.lazy_stats().faults,
        1,
        "a page of the mapped block faulted"
    );

    assert_eq!(read(2 * BLOCK), 0);
    let s = gm.lazy_stats();
    assert_eq!((s.faults, s.fault_zeroed), (2, 2 * BLOCK), "{s:?}");
    assert_eq!(r.page_stats().dirty, total - 2 * BLOCK);
    assert!(gm.lazy_error().is_none(), "{:?}", gm.lazy_error());
}

/// The end hook runs once the background zeroer has gone over every page, on its
/// thread; one given after that runs at once; memory with nothing lazy runs it at once.
#[test]
fn the_zeroing_end_hook_runs_when_every_page_is_zeroed() {
    let (_server, gm) = dirty_lazy_mib("endhook");
    let (tx, rx) = std::sync::mpsc::channel();
    let t = tx.clone();
    gm.on_zeroing_end(Box::new(move || {
        t.send(std::thread::current().name().map(String::from))
            .unwrap();
    }));
    assert!(
        rx.recv_timeout(std::time::Duration::from_millis(200))
            .is_err(),
        "ran before the zeroer started"
    );
    assert_eq!(gm.regions()[0].page_stats().dirty, MIB / PAGE);
    gm.start_lazy_zeroing_shared().unwrap();
    let thread = rx.recv_timeout(std::time::Duration::from_secs(30)).unwrap();
    assert_eq!(thread.as_deref(), Some(guestmem::ZEROER_THREAD));
    // The zeroer had gone over every page before it ran the hook.
    assert_eq!(gm.regions()[0].page_stats().dirty, 0);
    let t = tx.clone();
    gm.on_zeroing_end(Box::new(move || t.send(None).unwrap()));
    assert_eq!(rx.try_recv().unwrap(), None, "a late hook runs at once");

    let fresh = fresh_ram(MIB);
    fresh.on_zeroing_end(Box::new(move || tx.send(Some("fresh".into())).unwrap()));
    assert_eq!(
        rx.try_recv().unwrap().as_deref(),
        Some("fresh"),
        "nothing lazy: at once"
    );
}

/// Pages the VMM writes before the guest runs (the instant-zero list) are not lazy
/// zeroing's to manage: `write_instant` maps their 64 KiB blocks into the guest view, so
/// the guest reads them (and the rest of those blocks, zeroed) without a fault, while the
/// next block is still lazy.
#[test]
fn instant_writes_map_their_blocks_ahead_of_the_guest() {
    let (_server, gm) = dirty_lazy_mib("mapahead");
    let r = &gm.regions()[0];
    let total = MIB / PAGE;
    let read = |off: u64| guest_byte(&gm, off);

    // Straddles the boundary of blocks 1 and 2.
    let at = 2 * BLOCK * PAGE - 2;
    gm.write_instant(at, b"boot").unwrap();
    // The two written pages were zeroed before the write; the blocks' other pages now.
    let s = gm.lazy_stats();
    assert_eq!(
        (s.instant_mapped, s.instant_zeroed),
        (2, 2 * BLOCK - 2),
        "{s:?}"
    );
    let st = r.page_stats();
    assert_eq!(
        (st.mapped, st.dirty),
        (2 * BLOCK, total - 2 * BLOCK),
        "{st:?}"
    );

    assert_eq!([read(at), read(at + 3)], [b'b', b't']);
    assert_eq!(read(BLOCK * PAGE + 100), 0, "the canary reached the guest");
    assert_eq!(read(3 * BLOCK * PAGE - 100), 0);
    assert_eq!(gm.lazy_stats().faults, 0, "a page written ahead faulted");
    // Writing into mapped blocks again maps nothing more.
    gm.write_instant(at + 8, b"more").unwrap();
    assert_eq!(gm.lazy_stats().instant_mapped, 2);

    assert_eq!(read(3 * BLOCK * PAGE + 100), 0);
    let s = gm.lazy_stats();
    assert_eq!((s.faults, s.fault_zeroed), (1, BLOCK), "{s:?}");
    assert!(gm.lazy_error().is_none(), "{:?}", gm.lazy_error());
}

#[test]
fn device_process_attaches_by_fd_and_prepares_pages() {
    const SIZE: u64 = 2 << 20;
    if let Ok(fd) = std::env::var("GUESTMEM_CHILD_DEVICE_FD") {
        // Child: the "NIC" process with only the memfd.
        let fd: i32 = fd.parse().unwrap();
        // SAFETY: the parent passed this fd open; it stays open for the child's life.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let dm = DeviceMemory::attach(fd, 0, SIZE).unwrap();
        assert!(dm.tracked());
        assert!(dm.prepare_for_device_write(SIZE - 10, 20).is_err());
        dm.prepare_for_device_write(0x3000, 2 * PAGE).unwrap();
        // SAFETY: the range lies inside a mapping that the memory object of this scope keeps mapped for the whole access.
        unsafe { std::ptr::write_bytes(dm.as_ptr().add(0x3000), 0x61, 2 * PAGE as usize) };
        dm.prepare_for_device_write(0x8000, PAGE).unwrap();
        // SAFETY: the range lies inside a mapping that the memory object of this scope keeps mapped for the whole access.
        let seen = count_byte(unsafe { dm.as_ptr().add(0x8000) }, PAGE, CANARY);
        assert_eq!(seen, 0);
        return;
    }
    let server = canary_pool("device", SIZE, 1);
    let gm = pool_ram(&server, SIZE, MemoryPolicy::Lazy);
    let fd = inheritable(gm.regions()[0].memfd());
    let status = child(
        "device_process_attaches_by_fd_and_prepares_pages",
        &[("GUESTMEM_CHILD_DEVICE_FD", fd.to_string())],
    )
    .output()
    .unwrap();
    close_fd(fd);
    assert!(
        status.status.success(),
        "device child failed: {}\n{}",
        status.status,
        String::from_utf8_lossy(&status.stdout)
    );
    let r = &gm.regions()[0];
    // The guest's first touch of the device-written pages must not wipe them.
    let data =
        // SAFETY: the range lies inside a mapping that the memory object of this scope keeps mapped for the whole access.
        unsafe { std::slice::from_raw_parts(r.guest_view_ptr().add(0x3000), 2 * PAGE as usize) };
    assert!(data.iter().all(|b| *b == 0x61));
    assert_eq!(count_byte(r.guest_view_ptr(), SIZE, CANARY), 0);

    // A fresh (vanilla) memfd has a table too, with nothing to do.
    let v = fresh_ram(SIZE);
    let dm = DeviceMemory::attach(v.regions()[0].memfd(), 0, SIZE).unwrap();
    dm.prepare_for_device_write(0, SIZE).unwrap();
    assert_eq!(v.regions()[0].page_stats().zero, SIZE / PAGE);
}

#[test]
fn device_attach_ignores_guest_forged_trailer() {
    // A plain memfd (no table) whose last bytes a guest filled with a forged trailer.
    const SIZE: u64 = 1 << 20;
    let v = GuestMemory::new(
        &[ram(SIZE, true)],
        MemoryPolicy::Vanilla,
        MemorySource::Fresh,
        false,
    )
    .unwrap();
    let r = &v.regions()[0];
    // Attach only to a range that covers the real table: it must not be trusted.
    let dm = DeviceMemory::attach(r.memfd(), 0, r.memfd_size()).unwrap();
    assert!(!dm.tracked());
}

#[test]
fn handler_error_stops_the_guest_and_is_reported() {
    const SIZE: u64 = 1 << 20;
    if std::env::var("GUESTMEM_CHILD_HANDLER_ERROR").is_ok() {
        let server = canary_pool("handler", SIZE, 1);
        let gm = Arc::new(pool_ram(&server, SIZE, MemoryPolicy::Lazy));
        let called = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let c2 = called.clone();
        gm.set_lazy_error_callback(Box::new(move |_| {
            c2.store(true, std::sync::atomic::Ordering::SeqCst)
        }));
        // Corrupt the state of page 5 in the shared table (as a buggy device could).
        let r = &gm.regions()[0];
        // SAFETY: the range lies inside a mapping that the memory object of this scope keeps mapped for the whole access.
        unsafe { *r.device_view_ptr().add(SIZE as usize + 5) = 77 };
        let g = gm.clone();
        let reader = std::thread::spawn(move || {
            let r = &g.regions()[0];
            count_byte(
                // SAFETY: the range lies inside a mapping that the memory object of this scope keeps mapped for the whole access.
                unsafe { r.guest_view_ptr().add(5 * PAGE as usize) },
                PAGE,
                CANARY,
            )
        });
        let mut pfd = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(&gm.lazy_error_fd()),
            events: libc::POLLIN,
            revents: 0,
        };
        assert_eq!(
            // SAFETY: poll(2) on pollfds that live on the stack, for fds this scope keeps open.
            unsafe { libc::poll(&mut pfd, 1, 10_000) },
            1,
            "no error reported"
        );
        let e = gm.lazy_error().expect("error set");
        assert!(e.to_string().contains("page 5"), "{e}");
        assert!(called.load(std::sync::atomic::Ordering::SeqCst));
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!reader.is_finished(), "the guest read past a failed fault");
        println!("HANDLER-ERROR-OK");
        let _ = std::fs::remove_file(server.path());
        // _exit skips the server's drop, which would remove its lock file.
        let mut lock = server.path().as_os_str().to_owned();
        lock.push(".lock");
        let _ = std::fs::remove_file(lock);
        // Exit with the reader still blocked: the VMM's way out.
        // SAFETY: _exit ends the child without running the parent's atexit state.
        unsafe { libc::_exit(0) };
    }
    assert_child_prints(
        "handler_error_stops_the_guest_and_is_reported",
        &[("GUESTMEM_CHILD_HANDLER_ERROR", "1".into())],
        "HANDLER-ERROR-OK",
    );
}

#[test]
fn memlock_limit_is_checked_before_anything_is_allocated() {
    if std::env::var("GUESTMEM_CHILD_MEMLOCK").is_ok() {
        // Child: drop CAP_IPC_LOCK from this thread and lower RLIMIT_MEMLOCK to 1 MiB.
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        #[derive(Clone, Copy)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        let h = Header {
            version: 0x2008_0522,
            pid: 0,
        };
        let mut d = [Data {
            effective: 0,
            permitted: 0,
            inheritable: 0,
        }; 2];
        // SAFETY: capget/capset/setrlimit read and write the structs above,
        // which match the kernel's v3 layout and live for the calls.
        unsafe {
            assert_eq!(libc::syscall(libc::SYS_capget, &h, d.as_mut_ptr()), 0);
            d[0].effective &= !(1 << 14); // CAP_IPC_LOCK
            assert_eq!(libc::syscall(libc::SYS_capset, &h, d.as_ptr()), 0);
            let rl = libc::rlimit {
                rlim_cur: 1 << 20,
                rlim_max: 1 << 20,
            };
            assert_eq!(libc::setrlimit(libc::RLIMIT_MEMLOCK, &rl), 0);
        }
        let e = GuestMemory::new(
            &[ram(64 << 20, true), image(2 << 20, false)],
            MemoryPolicy::Vanilla,
            MemorySource::Fresh,
            false,
        )
        .unwrap_err();
        assert!(
            matches!(e, Error::MemlockLimit { needed, limit } if needed == 64 << 20 && limit == 1 << 20),
            "{e}"
        );
        assert!(e.to_string().contains("RLIMIT_MEMLOCK"));
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(
            !maps.contains("memfd:burstvm"),
            "memory created before the check"
        );
        // Within the limit it works (dma=false regions are not locked).
        GuestMemory::new(
            &[ram(2 << 20, false)],
            MemoryPolicy::Vanilla,
            MemorySource::Fresh,
            false,
        )
        .unwrap();
        println!("MEMLOCK-OK");
        return;
    }
    assert_child_prints(
        "memlock_limit_is_checked_before_anything_is_allocated",
        &[("GUESTMEM_CHILD_MEMLOCK", "1".into())],
        "MEMLOCK-OK",
    );
}
