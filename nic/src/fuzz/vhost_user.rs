//! Fuzz body (c): vhost-user messages from a frontend (the VMM) to a VF's
//! session, and their seeds.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::dataplane::vf_port;
use super::memfd;
use crate::devset::{Devset, LockPolicy};
use crate::port::{Port, VfHw};

/// Requests that carry file descriptors; the harness attaches real ones so
/// that the handlers behind them run (memfd for memory, eventfd otherwise).
fn fds_for(request: u32, body: &[u8]) -> usize {
    match request {
        5 => body
            .get(..4)
            .map_or(0, |n| {
                u32::from_le_bytes(n.try_into().expect("a 4-byte slice")) as usize
            })
            .min(8), // SET_MEM_TABLE: one per region
        6 | 7 | 12 | 13 | 14 | 21 | 32 | 37 | 42 => 1,
        _ => 0,
    }
}

/// A VF's vhost-user session fed `data` as the frontend's byte stream
/// (messages split at their headers' sizes, with descriptors attached to
/// the messages that take them), then the end of the connection. The VF
/// must end up closed with its memory unmapped and the devset consistent.
pub fn fuzz_vhost_user(data: &[u8]) {
    let wake = Arc::new(EventFd::new(EFD_NONBLOCK).expect("eventfd"));
    let ports: Vec<Arc<Port>> = (0..2).map(|i| Arc::new(vf_port(i, &wake))).collect();
    let devset = Arc::new(Devset::new("pf0", 2, LockPolicy::Hierarchical, |i| VfHw {
        port: ports[i].clone(),
    }));
    devset.assign(0, "fz").expect("a free VF");
    let (frontend, backend) = UnixStream::pair().expect("socketpair");
    let mem = memfd("burstvm-fuzz-vu", 1 << 20);
    let evt = EventFd::new(EFD_NONBLOCK).expect("eventfd");

    let server = {
        let (d, p) = (devset.clone(), ports[0].clone());
        std::thread::spawn(move || {
            crate::session::serve(
                d,
                p,
                Arc::from(Vec::new()),
                0,
                backend,
                &crate::session::NET,
            )
        })
    };
    // Replies are read (and dropped) as they come, so the backend never
    // blocks on a full socket.
    let reader = {
        let mut r = frontend.try_clone().expect("dup");
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while matches!(std::io::Read::read(&mut r, &mut buf), Ok(n) if n > 0) {}
        })
    };
    let mut off = 0;
    let mut sent = 0;
    while off < data.len() && sent < 256 {
        let hdr = &data[off..(off + 12).min(data.len())];
        let (req, size) = if hdr.len() == 12 {
            (
                u32::from_le_bytes(hdr[0..4].try_into().expect("a 4-byte slice")),
                u32::from_le_bytes(hdr[8..12].try_into().expect("a 4-byte slice")) as usize,
            )
        } else {
            (0, 0)
        };
        let end = (off + 12).saturating_add(size).min(data.len());
        let msg = &data[off..end];
        let nfds = fds_for(req, msg.get(12..).unwrap_or_default());
        let fds: Vec<i32> = (0..nfds)
            .map(|_| {
                if req == 5 || req == 37 {
                    mem.as_raw_fd()
                } else {
                    evt.as_raw_fd()
                }
            })
            .collect();
        let cmsg = [nix::sys::socket::ControlMessage::ScmRights(&fds)];
        let iov = [std::io::IoSlice::new(msg)];
        let r = nix::sys::socket::sendmsg::<()>(
            frontend.as_raw_fd(),
            &iov,
            if fds.is_empty() { &[] } else { &cmsg },
            nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
            None,
        );
        if r.is_err() {
            break; // the backend ended the session
        }
        off = end;
        sent += 1;
    }
    let _ = frontend.shutdown(std::net::Shutdown::Write);
    server.join().expect("the session thread panicked");
    let _ = frontend.shutdown(std::net::Shutdown::Both);
    reader.join().expect("reader");
    devset.check_invariants().expect("devset invariants");
    let rt = ports[0].runtime();
    assert!(
        rt.mem.is_none(),
        "memory still mapped after the session ended"
    );
    assert_eq!(devset.open_count(), 0);
}

/// vhost-user message seeds: a frontend's normal set-up and broken ones.
pub fn vhost_user_seeds() -> Vec<Vec<u8>> {
    fn msg(req: u32, body: &[u8]) -> Vec<u8> {
        let mut m = req.to_le_bytes().to_vec();
        m.extend_from_slice(&1u32.to_le_bytes()); // version 1
        m.extend_from_slice(&(body.len() as u32).to_le_bytes());
        m.extend_from_slice(body);
        m
    }
    let u64b = |v: u64| v.to_le_bytes().to_vec();
    let state = |i: u32, n: u32| [i.to_le_bytes(), n.to_le_bytes()].concat();
    let mem_table = |size: u64, offset: u64| {
        let mut b = 1u32.to_le_bytes().to_vec();
        b.extend_from_slice(&0u32.to_le_bytes());
        for v in [0u64, size, 0x7f00_0000_0000, offset] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    };
    let vring_addr = |i: u32, d: u64, u: u64, a: u64| {
        let mut b = i.to_le_bytes().to_vec();
        b.extend_from_slice(&0u32.to_le_bytes());
        for v in [d, u, a, 0u64] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    };
    let features = (1u64 << 32) | (1 << 5) | (1 << 16) | (1 << 30);
    let setup = || {
        let mut s = Vec::new();
        s.extend(msg(3, &[])); // SET_OWNER
        s.extend(msg(1, &[])); // GET_FEATURES
        s.extend(msg(2, &u64b(features))); // SET_FEATURES
        s.extend(msg(15, &[])); // GET_PROTOCOL_FEATURES
        s.extend(msg(16, &u64b(1 << 9))); // SET_PROTOCOL_FEATURES (CONFIG)
        s.extend(msg(5, &mem_table(1 << 20, 0))); // SET_MEM_TABLE
        for q in 0..2u32 {
            let base = 0x7f00_0000_0000 + q as u64 * 0x4000;
            s.extend(msg(8, &state(q, 256))); // SET_VRING_NUM
            s.extend(msg(9, &vring_addr(q, base, base + 0x2000, base + 0x1000)));
            s.extend(msg(10, &state(q, 0))); // SET_VRING_BASE
            s.extend(msg(13, &u64b(q as u64))); // SET_VRING_CALL
            s.extend(msg(12, &u64b(q as u64))); // SET_VRING_KICK
            s.extend(msg(18, &state(q, 1))); // SET_VRING_ENABLE
        }
        s
    };
    let mut seeds = vec![setup()];
    let mut s = setup();
    s.extend(msg(24, &[0, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0])); // GET_CONFIG mac
    s.extend(msg(11, &state(0, 0))); // GET_VRING_BASE
    seeds.push(s);
    for bad in [
        msg(2, &u64b(u64::MAX)),                           // unoffered features
        msg(5, &mem_table(1 << 40, 0)),                    // region beyond the file
        msg(5, &mem_table(4096, 123)),                     // unaligned offset
        msg(5, &[8, 0, 0, 0]),                             // 8 regions, no bodies
        msg(8, &state(7, 256)),                            // queue index out of range
        msg(8, &state(0, 1000)),                           // size not a power of two
        msg(9, &vring_addr(0, 1, 2, 3)),                   // before SET_MEM_TABLE
        msg(12, &u64b(1 << 8)),                            // polling mode
        msg(24, &[0, 0, 0, 0, 0xff, 0, 0, 0, 0, 0, 0, 0]), // config too long
        msg(25, &[0; 16]),                                 // SET_CONFIG
        msg(999, &[]),                                     // unknown request
        msg(1, &[0; 3]),                                   // body on GET_FEATURES
        vec![1, 0, 0, 0, 1],                               // partial header
        [
            1u32.to_le_bytes(),
            1u32.to_le_bytes(),
            0x1000_0000u32.to_le_bytes(),
        ]
        .concat(), // huge size
    ] {
        let mut s = setup();
        s.extend(bad.clone());
        seeds.push(s);
        seeds.push(bad);
    }
    // Rings outside the table, then set-up messages after a failed one.
    let mut s = Vec::new();
    s.extend(msg(2, &u64b(features)));
    s.extend(msg(5, &mem_table(1 << 20, 0)));
    s.extend(msg(9, &vring_addr(0, 0x1000, 0x2000, 0x3000)));
    s.extend(msg(12, &u64b(0)));
    seeds.push(s);
    seeds
}
