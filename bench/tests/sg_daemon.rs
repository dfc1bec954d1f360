//! SG functions served by the daemon over real vhost-user sessions: the
//! control API, attach through the setup queue, an echo through warp pipes,
//! detach on disconnect and on a SIGKILLed frontend, nothing leaked.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use testutil::nic as common;

use std::path::Path;
use std::time::{Duration, Instant};

use bench::sg::open_echo_pipes;
use common::{sg_of, wait_sg, TestNic};
use nic::sg::frontend::SgFrontend;
use nic_api::{DevKind, VfInfo, VfState};
use sgiov::driver::DriverConfig;
use sgiov::layout::{PathKind, Transform};

const MEM: usize = 64 << 20;
const T: Duration = Duration::from_secs(10);

fn start(name: &str, sgfs: usize) -> TestNic {
    TestNic::start_sg(name, 2, sgfs)
}

/// Opens `n` echo sockets and checks one message through each.
fn echo(fe: &mut SgFrontend, n: usize, payload: impl Fn(usize) -> Vec<u8>) -> Vec<u16> {
    let socks = open_echo_pipes(fe, n, 4096, 1).expect("OPEN + CONNECT echo");
    for (i, &s) in socks.iter().enumerate() {
        let p = payload(i);
        assert_eq!(fe.drv.send(s, &p).unwrap(), p.len());
    }
    let t0 = Instant::now();
    while !socks
        .iter()
        .enumerate()
        .all(|(i, &s)| fe.drv.rx_ready(s) as usize == payload(i).len())
    {
        assert!(t0.elapsed() < T, "echoes did not come back");
        fe.pump(Duration::from_millis(5)).unwrap();
    }
    for (i, &s) in socks.iter().enumerate() {
        let p = payload(i);
        let mut b = vec![0u8; p.len()];
        assert_eq!(fe.drv.recv(s, &mut b).unwrap(), p.len());
        assert_eq!(b, p, "socket {s}: bytes differ");
    }
    socks
}

fn no_leak(v: &VfInfo) -> bool {
    let c = v.sg.unwrap();
    !c.attached && c.pf_sgfs == 0 && c.pf_pipes == 0 && c.pf_rings == 0 && c.pf_staging_bytes == 0
}

#[test]
fn sg_function_alloc_attach_echo_and_detach_on_disconnect() {
    let nic = start("sg-echo", 2);
    let mut c = nic.client();
    let info = c.alloc_sg("pf0", "sb-a").unwrap();
    assert_eq!(info.kind, DevKind::Sg);
    assert_eq!(info.id, "pf0-sg0");
    assert!(info.socket.exists());
    // Control API: one SGF per sandbox, no MAC/VLAN, bounded slots, VFs unaffected.
    assert!(c.alloc_sg("pf0", "sb-a").is_err());
    let raw = c
        .call_raw(r#"{"op":"alloc","kind":"sg","pf":"pf0","sandbox":"sb-x","vlan":3}"#)
        .unwrap();
    assert!(raw.contains("bad-request"), "{raw}");
    c.alloc_sg("pf0", "sb-b").unwrap();
    assert!(c.alloc_sg("pf0", "sb-c").is_err(), "only 2 SGFs");
    let vf = c.alloc("pf0", "sb-a", None, None).unwrap();
    assert_eq!(vf.kind, DevKind::Vf);

    let mut fe = SgFrontend::connect(&info.socket, MEM, DriverConfig::default()).unwrap();
    echo(&mut fe, 8, |i| {
        format!("message {i} through the daemon").into_bytes()
    });
    let v = wait_sg(&mut c, "sb-a", "attached", |v| {
        v.sg.is_some_and(|s| s.attached && s.sockets == 8 && s.pf_pipes == 8)
    });
    let st = v.sg.unwrap();
    assert!(
        st.sgf.signals_in > st.sgf.kicks,
        "several signals per doorbell: {st:?}"
    );
    // A second frontend on an open SGF is refused (the devset's open).
    assert!(SgFrontend::connect(&info.socket, MEM, DriverConfig::default()).is_err());
    // Explicit detach, re-attach, then a disconnect detaches.
    fe.detach().unwrap();
    wait_sg(&mut c, "sb-a", "detached", no_leak);
    drop(fe);
    // The daemon refuses a second open while it still serves the first
    // session; reconnect once it has seen the hang-up (a VMM retries too).
    wait_sg(&mut c, "sb-a", "closed", |v| v.state != VfState::Open);
    let mut fe = SgFrontend::connect(&info.socket, MEM, DriverConfig::default()).unwrap();
    echo(&mut fe, 2, |i| vec![i as u8; 3000]);
    drop(fe);
    wait_sg(&mut c, "sb-a", "detached after disconnect", no_leak);
    c.release("sb-a").unwrap();
    c.release("sb-b").unwrap();
    assert!(c.list().unwrap().iter().all(|v| v.sandbox.is_none()));
    nic.stop();
}

#[test]
fn bad_setup_commands_are_refused_and_counted() {
    let nic = start("sg-bad", 1);
    let mut c = nic.client();
    let info = c.alloc_sg("pf0", "sb-bad").unwrap();
    let mut fe = SgFrontend::connect(&info.socket, MEM, DriverConfig::default()).unwrap();
    // Attached already: a second attach is Busy; a bad magic is BadRequest.
    let cmd = sgiov::layout::SetupCmd {
        magic: sgiov::layout::SETUP_MAGIC,
        op: sgiov::layout::SETUP_ATTACH,
        area_gpa: nic::sg::frontend::AREA,
        ..Default::default()
    };
    assert!(fe.setup(cmd).is_err());
    assert!(fe
        .setup(sgiov::layout::SetupCmd { magic: 1, ..cmd })
        .is_err());
    fe.detach().unwrap();
    // An area outside memory is refused.
    assert!(fe
        .setup(sgiov::layout::SetupCmd {
            area_gpa: 1 << 40,
            ..cmd
        })
        .is_err());
    let v = wait_sg(&mut c, "sb-bad", "counted", |v| {
        v.sg.is_some_and(|s| s.setup_errors == 3)
    });
    assert!(no_leak(&v));
    drop(fe);
    nic.stop();
}

/// Setup chains written by hand on a raw vhost-user session: a command and
/// its status spread over several descriptors are read and written whole; a
/// chain with a bad descriptor puts that SGF (only) in error, and the daemon
/// serves the next one.
#[test]
fn setup_chains_over_several_descriptors_and_a_bad_descriptor() {
    use nic::frontend::{FrontendMemory, VuFrontend, BUFFERS, QSIZE};
    use sgiov::layout::{ErrorCode, SetupCmd, SETUP_DETACH, SETUP_MAGIC, SETUP_QUEUE};
    use vm_memory::ByteValued;
    const Q: usize = SETUP_QUEUE as usize;
    const CMD: u64 = BUFFERS;
    const STATUS: u64 = BUFFERS + 0x100;
    const NEXT: u16 = 1;
    const WRITE: u16 = 2;
    let nic = start("sg-raw", 2);
    let mut c = nic.client();
    let info = c.alloc_sg("pf0", "sb-raw").unwrap();
    let mem = FrontendMemory::new(MEM, false).unwrap();
    let mut vu = VuFrontend::connect_mem(&info.socket, mem).unwrap();
    // A DETACH before any attach is answered State; a command read wrong
    // (pieces out of order or short) would have a bad magic: BadRequest.
    let cmd = SetupCmd {
        magic: SETUP_MAGIC,
        op: SETUP_DETACH,
        ..Default::default()
    };
    let bytes = cmd.as_slice();
    // SAFETY: both ranges are in the frontend's own memory (ptr checks bounds).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), vu.ptr(CMD, bytes.len()), bytes.len());
        std::ptr::write_volatile(vu.ptr(STATUS, 4) as *mut u32, u32::MAX);
    }
    // Readable 5 + 11 + 16 bytes, then the status as 1 + 3 writable bytes.
    vu.write_desc(Q, 0, CMD, 5, NEXT, 1);
    vu.write_desc(Q, 1, CMD + 5, 11, NEXT, 2);
    vu.write_desc(Q, 2, CMD + 16, 16, NEXT, 3);
    vu.write_desc(Q, 3, STATUS, 1, NEXT | WRITE, 4);
    vu.write_desc(Q, 4, STATUS + 1, 3, WRITE, 0);
    vu.publish(Q, 0);
    testutil::poll_until("the split setup chain's used entry", T, || {
        (vu.used_idx(Q) == 1)
            .then_some(())
            .ok_or(format!("used index {}", vu.used_idx(Q)))
    });
    assert_eq!(vu.used_elem(Q, 0), (0, 4), "head 0, 4 status bytes written");
    // SAFETY: in our own memory.
    let status = u32::from_le(unsafe { std::ptr::read_volatile(vu.ptr(STATUS, 4) as *const u32) });
    assert_eq!(status, ErrorCode::State as u32);
    wait_sg(&mut c, "sb-raw", "counted", |v| {
        v.sg.is_some_and(|s| s.setup_errors == 1)
    });

    // A next index outside the table: this SGF goes to error, no used entry.
    vu.write_desc(Q, 8, CMD, 32, NEXT, QSIZE + 3);
    vu.publish(Q, 8);
    let v = wait_sg(&mut c, "sb-raw", "in error", |v| v.state == VfState::Error);
    assert_eq!(v.counters.bad_descriptors, 1);
    assert_eq!(vu.used_idx(Q), 1, "the bad chain is not returned");

    // The daemon lives: another sandbox's SGF attaches and echoes.
    let ok = c.alloc_sg("pf0", "sb-ok").unwrap();
    let mut fe = SgFrontend::connect(&ok.socket, MEM, DriverConfig::default()).unwrap();
    echo(&mut fe, 1, |_| b"after a bad setup chain".to_vec());
    drop(fe);
    drop(vu);
    wait_sg(&mut c, "sb-ok", "detached", no_leak);
    nic.stop();
}

const CHILD_ENV: &str = "NIC_SG_CHILD_SOCKET";

#[test]
fn sigkilled_frontend_mid_transfer_leaves_nothing() {
    const NAME: &str = "sigkilled_frontend_mid_transfer_leaves_nothing";
    if let Ok(sock) = std::env::var(CHILD_ENV) {
        // The child: attach, open pipes, keep data flowing until killed.
        let mut fe = SgFrontend::connect(Path::new(&sock), MEM, DriverConfig::default()).unwrap();
        let socks = echo(&mut fe, 16, |i| vec![i as u8; 100]);
        println!("CHILD-READY");
        let data = vec![7u8; 4096];
        let mut buf = vec![0u8; 4096];
        loop {
            for &s in &socks {
                let _ = fe.drv.send(s, &data);
                let _ = fe.drv.recv(s, &mut buf);
            }
            let _ = fe.pump(Duration::from_millis(1));
        }
    }
    let nic = start("sg-kill", 1);
    let mut c = nic.client();
    let info = c.alloc_sg("pf0", "sb-kill").unwrap();
    let mut child = common::spawn_child(NAME, CHILD_ENV, &info.socket);
    wait_sg(&mut c, "sb-kill", "busy", |v| {
        v.sg.is_some_and(|s| s.attached && s.pf_pipes == 16)
    });
    // SAFETY: killing our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().unwrap();
    let v = wait_sg(&mut c, "sb-kill", "detached", no_leak);
    assert_eq!(v.sg.unwrap().pf_key_slots, 0);
    // The slot is usable again by a new frontend.
    let mut fe = SgFrontend::connect(&info.socket, MEM, DriverConfig::default()).unwrap();
    echo(&mut fe, 1, |_| b"after the kill".to_vec());
    drop(fe);
    wait_sg(&mut c, "sb-kill", "detached again", no_leak);
    nic.stop();
}

/// A and B (two sandboxes' SGFs) connect through port 7 with `xf`: the
/// CONNECT's status, and on success 3000 bytes A → B checked.
fn chain(a: &mut SgFrontend, b: &mut SgFrontend, xf: Transform) -> u32 {
    let (l, r) = b.drv.open(4096, 4096, 0).unwrap();
    assert_eq!(b.wait_reply(r, T).unwrap(), 0, "OPEN");
    let r = b.drv.listen(l, 7).unwrap();
    assert_eq!(b.wait_reply(r, T).unwrap(), 0, "LISTEN");
    let (sb, r) = b.drv.open(4096, 4096, 0).unwrap();
    assert_eq!(b.wait_reply(r, T).unwrap(), 0, "OPEN");
    let acc = b.drv.accept(l, sb).unwrap();
    b.flush().unwrap();
    let (sa, r) = a.drv.open(4096, 4096, 0).unwrap();
    assert_eq!(a.wait_reply(r, T).unwrap(), 0, "OPEN");
    let r = a.drv.connect(sa, 7, xf, PathKind::Staged).unwrap();
    let st = a.wait_reply(r, T).unwrap();
    if st == 0 {
        assert_eq!(b.wait_reply(acc, T).unwrap(), 0, "ACCEPT");
        let msg: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
        assert_eq!(a.drv.send(sa, &msg).unwrap(), msg.len());
        let t0 = Instant::now();
        while (b.drv.rx_ready(sb) as usize) < msg.len() {
            assert!(t0.elapsed() < T, "the chain did not deliver");
            a.pump(Duration::from_millis(2)).unwrap();
            b.pump(Duration::from_millis(2)).unwrap();
        }
        let mut got = vec![0u8; msg.len()];
        assert_eq!(b.drv.recv(sb, &mut got).unwrap(), msg.len());
        assert_eq!(got, msg, "bytes through the chain");
    }
    for (fe, s) in [(&mut *a, sa), (&mut *b, l)] {
        let r = fe.drv.close(s).unwrap();
        assert_eq!(fe.wait_reply(r, T).unwrap(), 0, "CLOSE");
    }
    st
}

#[test]
fn sg_link_gates_chains_and_sg_sched_switches_policy_at_run_time() {
    let nic = start("sg-link", 3);
    let mut c = nic.client();
    let ia = c.alloc_sg("pf0", "sb-a").unwrap();
    let ib = c.alloc_sg("pf0", "sb-b").unwrap();
    let mut a = SgFrontend::connect(&ia.socket, MEM, DriverConfig::default()).unwrap();
    let mut b = SgFrontend::connect(&ib.socket, MEM, DriverConfig::default()).unwrap();
    // Not linked: another sandbox's port is refused.
    assert_eq!(chain(&mut a, &mut b, Transform::Crypto), 10, "Refused");
    let raw = c
        .call_raw(r#"{"op":"sg_link","a":"sb-a","b":"sb-nobody"}"#)
        .unwrap();
    assert!(raw.contains("not-found"), "{raw}");
    c.sg_link("sb-b", "sb-a").unwrap();
    assert_eq!(chain(&mut a, &mut b, Transform::Crypto), 0);
    let v = sg_of(&mut c, "sb-a");
    assert_eq!(v.sg_policy.as_deref(), Some("rr"), "--sg-policy default");
    assert_eq!(v.sg_capacity.as_deref(), Some("none"));

    // Policy and capacities at run time, validated.
    for (req, want) in [
        (
            r#"{"op":"sg_sched","pf":"pf0","policy":"fifo"}"#,
            "bad-request",
        ),
        (
            r#"{"op":"sg_sched","pf":"pf0","capacity":"copy=1Q"}"#,
            "bad-request",
        ),
        (
            r#"{"op":"sg_sched","pf":"pf9","policy":"drf"}"#,
            "unknown-pf",
        ),
    ] {
        let raw = c.call_raw(req).unwrap();
        assert!(raw.contains(want), "{req}: {raw}");
    }
    let raw = c
        .call_raw(
            r#"{"op":"sg_sched","pf":"pf0","policy":"drf","capacity":"copy=400M,crypto=160M"}"#,
        )
        .unwrap();
    assert!(raw.contains(r#""ok":true"#), "{raw}");
    wait_sg(&mut c, "sb-a", "under drf with capacities", |v| {
        v.sg_policy.as_deref() == Some("drf")
            && v.sg_capacity.as_deref() == Some("copy=400M,crypto=160M")
    });
    assert_eq!(chain(&mut a, &mut b, Transform::Crypto), 0, "still moves");
    let raw = c
        .call_raw(r#"{"op":"sg_sched","pf":"pf0","policy":"prio"}"#)
        .unwrap();
    assert!(raw.contains(r#""ok":true"#), "{raw}");
    wait_sg(&mut c, "sb-a", "under prio, capacities kept", |v| {
        v.sg_policy.as_deref() == Some("prio")
            && v.sg_capacity.as_deref() == Some("copy=400M,crypto=160M")
    });
    assert_eq!(chain(&mut a, &mut b, Transform::Copy), 0);

    // Only the pair named: a third sandbox is refused by B.
    let ic = c.alloc_sg("pf0", "sb-c").unwrap();
    let mut cc = SgFrontend::connect(&ic.socket, MEM, DriverConfig::default()).unwrap();
    assert_eq!(chain(&mut cc, &mut b, Transform::Copy), 10, "Refused");
    drop((a, b, cc));
    for sb in ["sb-a", "sb-b", "sb-c"] {
        wait_sg(&mut c, sb, "detached", no_leak);
        c.release(sb).unwrap();
    }
    nic.stop();
}
