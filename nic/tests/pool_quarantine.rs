//! Pool memory a VF maps is never recycled while the NIC can still write it (issue #9 item 1):
//! not when the NIC's session ends late (a lock wait) and the dataplane keeps writing the dead
//! tenant's frames, not when the NIC is stopped or killed; and it does come back once the NIC
//! has unmapped it.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use testutil::nic as common;

use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::{frame, run_nic_if_child, spawn_nic_child, TestNic};
use guestmem::pool::{Pool, PoolClient, PoolServer, PoolStats};
use guestmem::{GuestMemory, MemoryPolicy, MemorySource, RegionSpec};
use nic::frontend::{FrontendMemory, SimFrontend, MIN_MEM};
use nic::LockPolicy;
use nic_api::Client;
use nic_api::VfState;

/// The dead tenant's byte: what the NIC keeps writing into its receive buffers.
const CANARY: u8 = 0xA5;
const SIZE: u64 = MIN_MEM as u64;
const T: Duration = Duration::from_secs(10);

fn pool_server(tag: &str) -> PoolServer {
    let path = format!("/tmp/nic-pool{}-{tag}.sock", std::process::id());
    PoolServer::start_with(path, Arc::new(Pool::new(None)), false).unwrap()
}

/// A "VMM": its pool connection, its memory (to connect again after a NIC restart) and a
/// frontend on `socket` running on that pool memory.
struct Vmm {
    _pool: PoolClient,
    memfd: std::fs::File,
}

impl Vmm {
    fn start(pool: &PoolServer, socket: &std::path::Path) -> (Vmm, SimFrontend) {
        let client = PoolClient::connect(pool.path()).unwrap();
        let (memfd, _) = client.take_memfd(SIZE, false, MemoryPolicy::Lazy).unwrap();
        let vmm = Vmm {
            _pool: client,
            memfd: memfd.into(),
        };
        let fe = vmm.connect(socket);
        (vmm, fe)
    }

    /// A frontend on the same memory (the same lease: a dup of the VMM's fd).
    fn connect(&self, socket: &std::path::Path) -> SimFrontend {
        let mem = FrontendMemory::from_memfd(self.memfd.try_clone().unwrap(), SIZE as usize);
        SimFrontend::connect_mem(socket, mem.unwrap()).unwrap()
    }
}

fn wait_stats(pool: &PoolServer, what: &str, f: impl Fn(&PoolStats) -> bool) -> PoolStats {
    let t0 = Instant::now();
    loop {
        let st = pool.pool().stats();
        if f(&st) {
            return st;
        }
        assert!(t0.elapsed() < T, "pool never {what}: {st:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A tenant's view of fresh pool memory: bytes that are not zero (the guest view, through
/// the lazy-zeroing fault handler, as a guest reads it). Also whether it was recycled.
fn next_tenant_reads(pool: &PoolServer) -> (usize, bool) {
    let spec = RegionSpec {
        name: "ram".into(),
        gpa: 0,
        size: SIZE,
        dma: true,
    };
    let c = PoolClient::connect(pool.path()).unwrap();
    let hits = pool.pool().stats().hits;
    let gm = GuestMemory::new(&[spec], MemoryPolicy::Lazy, MemorySource::Pool(c), false).unwrap();
    let p = gm.regions()[0].guest_view_ptr();
    // SAFETY: the guest view maps SIZE bytes.
    let bytes = unsafe { std::slice::from_raw_parts(p, SIZE as usize) };
    (
        bytes.iter().filter(|b| **b != 0).count(),
        pool.pool().stats().hits > hits,
    )
}

/// VF A's VMM dies while the NIC's session of A cannot end (its close waits for the devset
/// lock, held as a long VF-side operation would hold it); VF B keeps sending frames to A and
/// the dataplane writes them into A's receive buffers. The next tenant never gets A's memory
/// meanwhile, and never sees a byte of those frames; once the session ends, the memory is
/// back in the pool (no leak), and the tenant that gets it then sees zeros only.
#[test]
fn late_vf_session_never_writes_into_the_next_tenant() {
    let pool = pool_server("late");
    let nic = TestNic::start_with_pools(
        "quarantine",
        3,
        None,
        LockPolicy::Hierarchical,
        vec![pool.path().to_path_buf()],
    );
    let mut c = nic.client();
    let a = c.alloc("pf0", "sb-a", None, None).unwrap();
    let b = c.alloc("pf0", "sb-b", None, None).unwrap();
    let (vmm_a, fa) = Vmm::start(&pool, &a.socket);
    let mut fb = SimFrontend::connect(&b.socket, MIN_MEM).unwrap();
    nic.wait_vf("sb-a", "open", |v| v.state == VfState::Open);
    // SET_MEM_TABLE (where the NIC registers) is not acknowledged to this frontend.
    wait_stats(&pool, "saw the NIC register A's pool memory", |_| {
        pool.registrations() == 1
    });
    // Both sessions set up to the end: their last setup messages have no reply, and
    // one still in flight would queue behind the devset lock taken below (its VF side
    // waits for the close waiting there), leaving that VF without rings. One frame
    // crossing from B to A shows both are live.
    let port_a = nic.nic.pfs[0].ports[a.index].clone();
    let port_b = nic.nic.pfs[0].ports[b.index].clone();
    fb.send(&frame(&a.mac, &b.mac, &[0; 60]));
    let t0 = Instant::now();
    while port_a.counters.snapshot().rx_packets < 1 {
        assert!(t0.elapsed() < T, "A and B never exchanged a frame");
        std::thread::sleep(Duration::from_millis(5));
    }

    // A lock wait: the devset's VF side is held, so A's close (devset side) must wait.
    let devset = nic.nic.pfs[0].devset.clone();
    let (held_tx, held) = mpsc::channel();
    let (release, released) = mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        devset.with_vf(2, |_| {
            held_tx.send(()).unwrap();
            let _ = released.recv();
        })
    });
    held.recv().unwrap();

    // A's VMM dies: vhost-user connection and pool connection gone.
    drop(fa);
    drop(vmm_a);
    wait_stats(&pool, "saw A's VMM go", |s| {
        s.quarantined_memfds == 1 || s.lent_memfds == 0
    });

    // Frames for A keep arriving; the dataplane writes them into A's buffers.
    let canary = frame(&a.mac, &b.mac, &[CANARY; 1200]);
    for _ in 0..8 {
        fb.send(&canary);
    }
    let t0 = Instant::now();
    while port_a.counters.snapshot().rx_packets < 1 + 8 {
        assert!(
            t0.elapsed() < T,
            "frames never reached A's buffers: A {:?}, B {:?}",
            port_a.counters.snapshot(),
            port_b.counters.snapshot()
        );
        std::thread::sleep(Duration::from_millis(5));
    }

    // The next tenant: other memory, all zero.
    let (nonzero, recycled) = next_tenant_reads(&pool);
    assert_eq!(nonzero, 0, "the next tenant sees bytes of A's frames");
    assert!(
        !recycled,
        "A's memory was handed out while the NIC mapped it"
    );
    let st = pool.pool().stats();
    assert_eq!(
        st.quarantined_memfds, 1,
        "A's memory is quarantined: {st:?}"
    );

    // The session ends: the NIC unmaps, the memory comes back (dirty), and whoever gets it
    // next reads zeros.
    release.send(()).unwrap();
    holder.join().unwrap().unwrap();
    nic.wait_vf("sb-a", "closed and reset", |v| v.state == VfState::Reset);
    let st = wait_stats(&pool, "got A's memory back", |s| {
        s.quarantined_memfds == 0 && s.lent_memfds == 0
    });
    assert_eq!(st.cached_memfds, 2, "A's and the next tenant's: {st:?}");
    assert_eq!(pool.registrations(), 0);
    let (nonzero, recycled) = next_tenant_reads(&pool);
    assert!(recycled, "A's memory is used again");
    assert_eq!(nonzero, 0, "A's frames survived the recycling");
    drop(fb);
    nic.stop();
}

/// The NIC as a process: stopped (SIGSTOP) while a VMM dies, A's memory stays quarantined;
/// SIGKILL of the NIC ends its mappings, and the memory comes back. A restarted NIC maps and
/// registers memory of a VMM that lived through the restart; a clean end returns it.
#[test]
fn stopped_then_killed_nic_holds_memory_until_it_is_gone() {
    run_nic_if_child();
    let pool = pool_server("kill");
    let dir = testutil::fresh_dir("nic-t", "poolkill");
    struct Cleanup(PathBuf, Option<std::process::Child>);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            if let Some(mut c) = self.1.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let test = "stopped_then_killed_nic_holds_memory_until_it_is_gone";
    let mut guard = Cleanup(dir.clone(), Some(spawn_nic_child(test, &dir, pool.path())));
    let control = dir.join("ctl.sock");
    let mut c = Client::connect(&control).unwrap();
    let a = c.alloc("pf0", "sb-a", None, None).unwrap();
    let b = c.alloc("pf0", "sb-b", None, None).unwrap();
    let (vmm_a, fa) = Vmm::start(&pool, &a.socket);
    let (vmm_b, fb) = Vmm::start(&pool, &b.socket);
    common::wait_vf(&control, "sb-b", "open", |v| v.state == VfState::Open);
    wait_stats(&pool, "saw the NIC register A's and B's memory", |_| {
        pool.registrations() == 2
    });
    let pid = guard.1.as_ref().unwrap().id() as i32;

    // Stopped NIC, dead VMM: quarantined, not recycled.
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    testutil::wait_stopped(pid as u32);
    drop(fa);
    drop(vmm_a);
    let st = wait_stats(&pool, "saw A's VMM go", |s| {
        s.quarantined_memfds == 1 || s.lent_memfds == 1
    });
    assert_eq!((st.quarantined_memfds, st.cached_memfds), (1, 0), "{st:?}");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(pool.pool().stats().quarantined_memfds, 1);

    // SIGKILL: the kernel unmaps before it closes the NIC's pool connections.
    let mut child = guard.1.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    // Each of the NIC's pool connections closes on its own server thread.
    let st = wait_stats(
        &pool,
        "got A's memory back and dropped the registrations",
        |s| s.quarantined_memfds == 0 && s.cached_memfds == 1 && pool.registrations() == 0,
    );
    assert_eq!(st.lent_memfds, 1, "B's VMM still holds its memory: {st:?}");

    // Restart on the same state: B's VMM, alive through it, opens its VF again on the same
    // memory (its lease is still live) and ends cleanly.
    guard.1 = Some(spawn_nic_child(test, &dir, pool.path()));
    common::wait_vf(&control, "sb-b", "reset or assigned", |v| {
        matches!(v.state, VfState::Assigned | VfState::Reset)
    });
    drop(fb);
    let fb = vmm_b.connect(&b.socket);
    common::wait_vf(&control, "sb-b", "open", |v| v.state == VfState::Open);
    wait_stats(&pool, "saw the restarted NIC register B's memory", |_| {
        pool.registrations() == 1
    });
    drop(fb);
    common::wait_vf(&control, "sb-b", "closed", |v| {
        matches!(v.state, VfState::Closed | VfState::Reset)
    });
    let st = wait_stats(&pool, "dropped the registration", |_| {
        pool.registrations() == 0
    });
    assert_eq!((st.quarantined_memfds, st.lent_memfds), (0, 1), "{st:?}");
    drop(vmm_b);
    wait_stats(&pool, "got B's memory back", |s| {
        s.lent_memfds == 0 && s.cached_memfds == 2
    });
}
