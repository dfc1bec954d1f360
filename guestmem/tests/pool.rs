//! Page pool: accounting, shrinking, the socket protocol and a killed client.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use std::io::{BufRead, BufReader};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use guestmem::pool::{self, Pool, PoolClient, PoolServer, SizeClass};
use guestmem::{DeviceMemory, GuestMemory, MemoryPolicy, MemorySource, RegionSpec};

fn class(mib: u64) -> SizeClass {
    SizeClass {
        size: mib << 20,
        hugepages: false,
    }
}

#[test]
fn take_return_shrink_accounting() {
    let pool = Pool::new(None);
    let (a, b, c) = (class(1), class(2), class(4));
    pool.fill(a, 4, None).unwrap();
    pool.fill(b, 2, Some(CANARY)).unwrap();
    let st = pool.stats();
    assert_eq!(st.cached_memfds, 6);
    assert_eq!(st.cached_bytes, 4 * a.memfd_size() + 2 * b.memfd_size());
    assert_eq!(st.classes.len(), 2);

    assert!(matches!(
        pool.take(a, MemoryPolicy::Vanilla),
        Err(pool::Error::VanillaFromPool)
    ));
    let la = pool.take(a, MemoryPolicy::Lazy).unwrap();
    assert!(la.recycled);
    let lc = pool.take(c, MemoryPolicy::Lazy).unwrap();
    assert!(!lc.recycled, "empty class must create a new memfd");
    let st = pool.stats();
    assert_eq!(
        (st.hits, st.misses, st.lent_memfds, st.cached_memfds),
        (1, 1, 2, 5)
    );
    assert_eq!(st.lent_bytes, a.memfd_size() + c.memfd_size());

    // A returned memfd is marked dirty (nothing zeroed): its table says so.
    let dm = DeviceMemory::attach(AsFd::as_fd(la.memfd()), 0, a.size).unwrap();
    dm.prepare_for_device_write(0, a.size).unwrap();
    assert_eq!(dm.page_stats().unwrap().zero, a.size / PAGE);
    pool.give_back(la);
    let s = dm.page_stats().unwrap();
    assert_eq!((s.dirty, s.zeroed_total), (a.size / PAGE, 0));
    drop(dm);
    pool.give_back(lc);
    let st = pool.stats();
    assert_eq!((st.returned, st.lent_memfds, st.cached_memfds), (2, 0, 7));

    // Shrink by count (from the class holding the most bytes: 4 x 1 MiB), by percentage,
    // and by threshold.
    assert_eq!(pool.shrink_count(1), 1);
    let st = pool.stats();
    assert_eq!(
        st.classes
            .iter()
            .find(|c| c.size == 1 << 20)
            .unwrap()
            .cached,
        3
    );
    assert_eq!(pool.shrink_percent(50), 3); // ceil(6 * 50%)
    assert_eq!(pool.stats().cached_memfds, 3);
    let released = pool.set_max_bytes(Some(a.memfd_size()));
    assert_eq!(released, 2);
    let st = pool.stats();
    assert!(st.cached_bytes <= a.memfd_size());
    assert_eq!(st.released, 6);
    // Above the threshold after a return: shrinks by itself.
    let l = pool.take(b, MemoryPolicy::Lazy).unwrap();
    pool.give_back(l);
    assert!(pool.stats().cached_bytes <= a.memfd_size());
    let left = pool.stats().cached_memfds;
    assert_eq!(pool.shrink_percent(100), left);
    assert_eq!(pool.stats().cached_memfds, 0);
    assert_eq!(pool.shrink_count(5), 0);
}

#[test]
fn socket_protocol_and_bad_requests() {
    let server = canary_pool("proto", 2 << 20, 2);
    let ctl = client(&server);
    let st = ctl.stats().unwrap();
    assert_eq!(st.cached_memfds, 2);
    // The server's threads count the CPU of what they serve, each right
    // after its answer (the client may read before the add): once the
    // count is still, a request's work must show in it.
    let still = || loop {
        let c = server.cpu_ns();
        std::thread::sleep(Duration::from_millis(20));
        if server.cpu_ns() == c {
            return c;
        }
    };
    let cpu0 = still();
    ctl.fill(1 << 20, false, 3, None).unwrap();
    assert_eq!(ctl.stats().unwrap().cached_memfds, 5);
    assert!(still() > cpu0, "the requests' CPU was not counted");
    assert!(ctl.take(1 << 20, false, MemoryPolicy::Vanilla).is_err());
    let e = ctl.take(12345, false, MemoryPolicy::Lazy).unwrap_err();
    assert!(e.to_string().contains("page size"), "{e}");
    let fd = ctl.take(1 << 20, false, MemoryPolicy::Lazy).unwrap();
    assert_eq!(
        std::fs::metadata(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&fd)
        ))
        .unwrap()
        .len(),
        class(1).memfd_size()
    );
    assert_eq!(ctl.stats().unwrap().lent_memfds, 1);
    assert_eq!(ctl.shrink_count(1).unwrap(), 1);
    assert_eq!(ctl.shrink_percent(50).unwrap(), 2);
    assert!(ctl.shrink_percent(101).is_err());
    ctl.prezero(50).unwrap();
    let st = ctl.stats().unwrap();
    assert_eq!(st.prezero_percent, 50);
    // The canary class is now half zeroed; the filled-without-pattern class was all zero.
    for c in &st.classes {
        let want = if c.size == 2 << 20 {
            c.size / 2
        } else {
            c.size
        };
        assert_eq!(c.zeroed_ahead_bytes, c.cached * want, "{c:?}");
    }
    assert_eq!(ctl.shrink_to(0).unwrap(), st.cached_memfds);
    drop(fd);
    drop(ctl);
    wait_no_clients(&server);
    assert_eq!(server.pool().stats().lent_memfds, 0);
    assert_eq!(server.pool().stats().cached_memfds, 1);

    // Garbage on the socket gets an error answer, not a crash.
    use nix::sys::socket::*;
    let s = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::empty(),
        None,
    )
    .unwrap();
    connect(
        std::os::fd::AsRawFd::as_raw_fd(&s),
        &UnixAddr::new(server.path()).unwrap(),
    )
    .unwrap();
    send(
        std::os::fd::AsRawFd::as_raw_fd(&s),
        b"{not json",
        MsgFlags::empty(),
    )
    .unwrap();
    let mut buf = [0u8; 4096];
    let n = recv(
        std::os::fd::AsRawFd::as_raw_fd(&s),
        &mut buf,
        MsgFlags::empty(),
    )
    .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&buf[..n]).unwrap();
    assert_eq!(v["ok"], false);
    assert!(v["error"].as_str().unwrap().contains("bad request"));
    let path = server.path().to_path_buf();
    server.shutdown();
    assert!(!path.exists(), "socket file left behind");
}

#[test]
fn idle_prezeroer_keeps_the_share_zeroed() {
    let pool = Arc::new(Pool::new(None));
    pool.fill(class(4), 2, Some(CANARY)).unwrap();
    let server = PoolServer::start(socket_path("idle"), pool.clone()).unwrap();
    pool.set_prezero_percent(50);
    let want = 2 * (4 << 20) / 2;
    for _ in 0..5000 {
        if pool.stats().classes[0].zeroed_ahead_bytes == want {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(pool.stats().classes[0].zeroed_ahead_bytes, want);
    // A pre50 sandbox then finds the first half zero, the rest dirty.
    let gm = pool_ram(&server, 4 << 20, MemoryPolicy::Pre(50));
    let s = gm.regions()[0].page_stats();
    assert_eq!((s.zero, s.dirty), (512, 512));
    drop(gm);
    server.shutdown();
}

/// A VMM killed with SIGKILL while holding pool memory gives it back, marked dirty.
#[test]
fn killed_client_returns_its_memory() {
    const SIZE: u64 = 4 << 20;
    let spec = RegionSpec {
        name: "ram".into(),
        gpa: 0,
        size: SIZE,
        dma: true,
    };
    if let Ok(sock) = std::env::var("GUESTMEM_CHILD_POOL_SOCKET") {
        // Child: a "VMM" that takes lazy memory, writes its secrets through the guest view
        // and waits to be killed.
        let c = PoolClient::connect(&sock).unwrap();
        let mut gm =
            GuestMemory::new(&[spec], MemoryPolicy::Lazy, MemorySource::Pool(c), false).unwrap();
        gm.dma_map("ram").unwrap();
        let r = &gm.regions()[0];
        // SAFETY: the guest view maps SIZE writable bytes while `gm` lives.
        unsafe { std::ptr::write_bytes(r.guest_view_ptr(), 0x5E, SIZE as usize) };
        println!("READY");
        std::thread::sleep(Duration::from_secs(60));
        unreachable!("the parent kills this process");
    }
    let server = canary_pool("kill", SIZE, 1);
    let mut child = child(
        "killed_client_returns_its_memory",
        &[(
            "GUESTMEM_CHILD_POOL_SOCKET",
            server.path().display().to_string(),
        )],
    )
    .stdout(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(
        lines.any(|l| l.map(|l| l.contains("READY")).unwrap_or(false)),
        "child never got ready"
    );
    assert_eq!(server.pool().stats().lent_memfds, 1);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    wait_no_clients(&server);
    let st = server.pool().stats();
    assert_eq!((st.lent_memfds, st.returned, st.cached_memfds), (0, 1, 1));

    // The next tenant gets the same memory back; none of the secret is visible.
    let gm = GuestMemory::new(
        &[spec],
        MemoryPolicy::Lazy,
        MemorySource::Pool(client(&server)),
        false,
    )
    .unwrap();
    let r = &gm.regions()[0];
    assert!(r.pooled());
    assert_eq!(r.page_stats().dirty, SIZE / PAGE);
    assert_eq!(count_byte(r.guest_view_ptr(), SIZE, 0x5E), 0);
    assert_eq!(count_byte(r.guest_view_ptr(), SIZE, 0), SIZE);
    assert_eq!(server.pool().stats().hits, 2);
}

/// Stopping the server is not the client leaving: a running VMM's memory is not marked
/// dirty (which would make its own handler wipe it) and not handed to anybody else.
#[test]
fn server_shutdown_leaves_running_clients_alone() {
    const SIZE: u64 = 1 << 20;
    let server = canary_pool("stop", SIZE, 1);
    let pool = server.pool().clone();
    let mut gm = pool_ram(&server, SIZE, MemoryPolicy::Lazy);
    gm.write_instant(0x1000, b"live").unwrap();
    gm.dma_map("ram").unwrap();
    assert_eq!(
        count_byte(gm.regions()[0].guest_view_ptr(), SIZE, CANARY),
        0
    );
    server.shutdown();
    let r = &gm.regions()[0];
    assert_eq!(r.page_stats().dirty, 0);
    // SAFETY: bytes 0x1000..0x1004 are inside the mapped guest view of `gm`.
    let live = unsafe { std::slice::from_raw_parts(r.guest_view_ptr().add(0x1000), 4) };
    assert_eq!(live, b"live");
    let st = pool.stats();
    assert_eq!((st.lent_memfds, st.cached_memfds, st.released), (0, 0, 1));
}

/// Waits (bounded) until the server's stats satisfy `f`; returns them.
fn wait_stats(c: &PoolClient, what: &str, f: impl Fn(&pool::PoolStats) -> bool) -> pool::PoolStats {
    for _ in 0..2500 {
        let st = c.stats().unwrap();
        if f(&st) {
            return st;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    panic!("pool never {what}: {:?}", c.stats().unwrap());
}

/// A device registered on the memory a VMM took: when the VMM goes, the memfd is quarantined,
/// not recycled; the next tenant gets other memory; what the device writes meanwhile is never
/// seen by anyone; once the device lets go the memfd comes back, dirty. A lease that ended
/// can no longer be registered nor prepared for device writes.
#[test]
fn device_mapping_keeps_returned_memory_out_of_the_cache() {
    let size = 1 << 20;
    let server = canary_pool("lease", size, 1);
    let admin = client(&server);
    let vmm = client(&server);
    let (memfd, recycled) = vmm.take_memfd(size, false, MemoryPolicy::Lazy).unwrap();
    assert!(recycled);
    let key = pool::lease_of(memfd.as_fd())
        .unwrap()
        .expect("pool memory has a lease");
    assert_ne!(key.lease, 0);
    // A fresh memfd is not pool memory: nothing to register.
    let fresh = fresh_ram(size);
    assert_eq!(pool::lease_of(fresh.memfd("ram").unwrap()).unwrap(), None);
    assert!(
        pool::DeviceHold::register(&[], &[fresh.memfd("ram").unwrap()])
            .unwrap()
            .is_none()
    );
    // Pool memory with no pool to register it with is refused.
    let e = pool::DeviceHold::register(&[], &[memfd.as_fd()]).unwrap_err();
    assert!(e.to_string().contains("no pool socket"), "{e}");

    let hold = pool::DeviceHold::register(&[server.path().to_path_buf()], &[memfd.as_fd()])
        .unwrap()
        .expect("pool memory is registered");
    assert_eq!(hold.keys(), &[key]);
    assert_eq!(server.registrations(), 1);
    let dev = DeviceMemory::attach(memfd.as_fd(), 0, size).unwrap();
    assert_eq!(dev.lease(), Some(key.lease));
    dev.prepare_for_device_write(0, size).unwrap();

    // The VMM dies: its memory stays lent, quarantined.
    drop(vmm);
    let st = wait_stats(&admin, "quarantined the memfd", |s| {
        s.quarantined_memfds == 1
    });
    assert_eq!((st.lent_memfds, st.cached_memfds), (1, 0), "{st:?}");
    // A late device write lands in the quarantined memory only.
    // SAFETY: inside the device's mapping of `size` bytes.
    unsafe { std::ptr::write_bytes(dev.as_ptr(), CANARY, size as usize) };
    // Nobody can register the dead tenant's lease any more.
    let e =
        pool::DeviceHold::register(&[server.path().to_path_buf()], &[memfd.as_fd()]).unwrap_err();
    assert!(e.to_string().contains("not live"), "{e}");

    // The next tenant gets other memory, zero.
    let next = pool_ram(&server, size, MemoryPolicy::Lazy);
    assert!(!next.regions()[0].pooled() || next.regions()[0].page_stats().dirty == 0);
    assert_eq!(
        count_byte(next.regions()[0].guest_view_ptr(), size, 0),
        size
    );
    let st = admin.stats().unwrap();
    assert_eq!((st.misses, st.quarantined_memfds), (1, 1), "{st:?}");

    // The device unmaps, then lets go: the memfd is back, every page dirty.
    drop(dev);
    drop(hold);
    let st = wait_stats(&admin, "took the memfd back", |s| {
        s.quarantined_memfds == 0 && s.cached_memfds == 1
    });
    assert_eq!((st.lent_memfds, st.quarantined_bytes), (1, 0), "{st:?}");
    assert_eq!(server.registrations(), 0);
    // The old lease's fd is stale: attach and prepare refuse it.
    assert!(matches!(
        DeviceMemory::attach(memfd.as_fd(), 0, size),
        Err(guestmem::Error::StaleLease { .. })
    ));
    // The tenant after that gets the recycled memfd and sees none of the device's bytes.
    let third = pool_ram(&server, size, MemoryPolicy::Lazy);
    assert!(third.regions()[0].pooled());
    assert_eq!(admin.stats().unwrap().hits, 2);
    assert_eq!(
        count_byte(third.regions()[0].guest_view_ptr(), size, CANARY),
        0
    );
    assert_eq!(
        count_byte(third.regions()[0].guest_view_ptr(), size, 0),
        size
    );
}

/// A device attached under a lease stops preparing pages the moment the pool takes the memory
/// back: a page it would write is left dirty, never marked zero.
#[test]
fn stale_lease_never_marks_a_page_zero() {
    let size = 64 * PAGE;
    let server = canary_pool("stale", size, 1);
    let vmm = client(&server);
    let (memfd, _) = vmm.take_memfd(size, false, MemoryPolicy::Lazy).unwrap();
    let dev = DeviceMemory::attach(memfd.as_fd(), 0, size).unwrap();
    dev.prepare_for_device_write(0, PAGE).unwrap();
    let admin = client(&server);
    // No device registered: the memfd goes back as soon as the VMM does.
    drop(vmm);
    wait_stats(&admin, "took the memfd back", |s| s.cached_memfds == 1);
    let e = dev.prepare_for_device_write(PAGE, PAGE).unwrap_err();
    assert!(matches!(e, guestmem::Error::StaleLease { .. }), "{e}");
    let s = dev.page_stats().unwrap();
    assert_eq!(
        (s.dirty, s.zero, s.zeroed_total),
        (size / PAGE, 0, 0),
        "{s:?}"
    );
}

/// PiBooster's third page type (`PageUse::HostOnly`): one sandbox's two memfds, its window
/// (device memory, registered by a device) and its RAM (host-only). When the VMM goes, the
/// host-only memfd is back in the cache at once while the device still maps the window:
/// no unmap to wait for. A device cannot register host-only memory at all (refused and
/// counted). The window comes back only after the device's unmap.
#[test]
fn host_only_memory_returns_without_waiting_for_a_device_unmap() {
    let size = 1 << 20;
    let server = canary_pool("host-only", size, 2);
    let admin = client(&server);
    let vmm = client(&server);
    let ram = vmm
        .take_memfd_as(size, false, MemoryPolicy::Lazy, pool::PageUse::HostOnly)
        .unwrap()
        .memfd;
    let window = vmm
        .take_memfd_as(size, false, MemoryPolicy::Lazy, pool::PageUse::Device)
        .unwrap()
        .memfd;
    let paths = [server.path().to_path_buf()];
    let e = pool::DeviceHold::register(&paths, &[ram.as_fd()]).unwrap_err();
    assert!(e.to_string().contains("host-only"), "{e}");
    let hold = pool::DeviceHold::register(&paths, &[window.as_fd()])
        .unwrap()
        .expect("the window is registered");
    let st = admin.stats().unwrap();
    assert_eq!(
        (st.device_maps_refused, server.registrations()),
        (1, 1),
        "{st:?}"
    );

    // The VMM dies while the device still maps the window.
    drop((ram, window));
    drop(vmm);
    let st = wait_stats(&admin, "took the host-only memfd back", |s| {
        s.cached_memfds == 1
    });
    assert_eq!(
        (
            st.quarantined_memfds,
            st.lent_memfds,
            st.returns_without_unmap,
            st.returns_after_unmap
        ),
        (1, 1, 1, 0),
        "{st:?}"
    );
    // The device unmaps: now the window comes back too.
    drop(hold);
    let st = wait_stats(&admin, "took the window back", |s| s.cached_memfds == 2);
    // Only the window's return waited, from the VMM's exit to the unmap.
    assert!(st.unmap_wait_ns_max > 0 && st.unmap_wait_ns_total == st.unmap_wait_ns_max);
    assert_eq!(
        (
            st.quarantined_memfds,
            st.lent_memfds,
            st.returns_without_unmap,
            st.returns_after_unmap
        ),
        (0, 0, 1, 1),
        "{st:?}"
    );
}
