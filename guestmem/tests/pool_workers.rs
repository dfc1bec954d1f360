//! The pool server's workers: many clients on a few threads, and clients that
//! stop reading their replies neither stall the others nor lose their memory.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use common::*;
use guestmem::MemoryPolicy;
use nix::sys::socket::{self, AddressFamily, MsgFlags, SockFlag, SockType, UnixAddr};

/// Threads of this process whose name starts with "pool-".
fn pool_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.starts_with("pool-"))
        .count()
}

/// A client without `PoolClient`: a raw SOCK_SEQPACKET connection.
fn raw_client(path: &std::path::Path) -> OwnedFd {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    socket::connect(fd.as_raw_fd(), &UnixAddr::new(path).unwrap()).unwrap();
    fd
}

/// A hundred connected clients, each holding a lease, take no thread each.
#[test]
fn many_clients_share_a_few_server_threads() {
    const SIZE: u64 = 1 << 20;
    let server = canary_pool("many", SIZE, 0);
    let before = pool_threads();
    let clients: Vec<_> = (0..100)
        .map(|_| {
            let c = client(&server);
            let fd = c.take(SIZE, false, MemoryPolicy::Lazy).unwrap();
            (c, fd)
        })
        .collect();
    assert_eq!(server.clients(), 100);
    assert_eq!(server.pool().stats().lent_memfds, 100);
    let during = pool_threads();
    // Other tests of this binary may start a server meanwhile (a few threads).
    assert!(
        during < before + 10,
        "{before} pool threads before, {during} with 100 clients"
    );
    drop(clients);
    wait_no_clients(&server);
    let st = server.pool().stats();
    assert_eq!((st.lent_memfds, st.returned), (0, 100));
}

/// Clients that send requests without reading the replies (more of them
/// than the server has workers) are not served any more once their replies
/// fill their sockets: the others still are, and what those clients took
/// stays theirs until they go away (the server never closes a client's
/// connection itself: that would free memory its process still maps).
#[test]
fn clients_that_stop_reading_stall_nobody_and_keep_their_memory() {
    const SIZE: u64 = 1 << 20;
    let server = canary_pool("flood", SIZE, 0);
    let take = format!(r#"{{"op":"take","size":{SIZE},"hugepages":false,"policy":"lazy"}}"#);
    let floods: Vec<OwnedFd> = (0..8)
        .map(|_| {
            let fd = raw_client(server.path());
            socket::send(fd.as_raw_fd(), take.as_bytes(), MsgFlags::empty()).unwrap();
            // The reply (and the memfd in it, closed by the kernel unreceived).
            let mut buf = [0u8; 4096];
            let n = socket::recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).unwrap();
            assert!(
                std::str::from_utf8(&buf[..n])
                    .unwrap()
                    .contains("\"ok\":true"),
                "{:?}",
                String::from_utf8_lossy(&buf[..n])
            );
            let mut sent = 0u32;
            loop {
                match socket::send(fd.as_raw_fd(), br#"{"op":"stats"}"#, MsgFlags::MSG_DONTWAIT) {
                    Ok(_) => sent += 1,
                    // The server no longer reads this client: its queue is full.
                    Err(nix::errno::Errno::EAGAIN) => break,
                    Err(e) => panic!("send: {e}"),
                }
                if sent.is_multiple_of(64) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert!(
                    sent < 1_000_000,
                    "the server kept reading a client that reads nothing"
                );
            }
            fd
        })
        .collect();
    // Everyone else is still served.
    let c = client(&server);
    let fd = c.take(SIZE, false, MemoryPolicy::Lazy).unwrap();
    let st = c.stats().unwrap();
    assert_eq!(st.lent_memfds, 9);
    assert_eq!(server.clients(), 9);
    drop((fd, c));
    // A stalled client that goes away gives its memory back.
    drop(floods);
    wait_no_clients(&server);
    let st = server.pool().stats();
    assert_eq!((st.lent_memfds, st.returned), (0, 9));
}
