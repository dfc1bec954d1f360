//! SG-IOV with a real microVM: `burstvm vmm --net sg:SOCKET` runs the built-in agent's
//! warp-pipe driver against an SG function of a spawned `burstvm nic --sgfs 2`
//! (docs/sgiov.md, "The agent's SG mode").
//!
//! - 64 echo pipes, a payload through each: the agent reports how many came back
//!   byte-exact and the checksum of all of it; the VMM checks both and exits 0.
//! - A VMM SIGKILLed while its pipes keep moving (`sg-echo`): the daemon detaches
//!   the SGF, holds no more pipes, rings, descriptors or guest mappings than before,
//!   and the same SGF serves the next VMM.
//! - A chain between two microVMs (docs/sgiov.md §14.1): A → encrypt → the daemon's
//!   staging ring → decrypt → B and back, after the control API linked the two
//!   sandboxes; B's VMM verifies what B received, A's what came back.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod nic_vm_common;

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use nic_api::{ErrorCode, Request, VfInfo};
use nic_vm_common::*;

const PIPES: &str = "64";

fn sg_args(socket: &std::path::Path, mode: &str) -> Vec<String> {
    let mut a: Vec<String> = vec![
        "--net".into(),
        format!("sg:{}", socket.display()),
        "--agent-mode".into(),
        mode.into(),
        "--sg-pipes".into(),
        PIPES.into(),
        "--sg-bytes".into(),
        "1024".into(),
    ];
    a.extend(VANILLA_DMA.iter().map(|s| s.to_string()));
    a
}

/// Nothing of a guest left in the daemon's SG device.
fn detached(v: &VfInfo) -> bool {
    let c = v.sg.expect("an SG function has SG counters");
    !c.attached && c.pf_sgfs == 0 && c.pf_sockets == 0 && c.pf_pipes == 0 && c.pf_rings == 0
}

/// A VMM in `sg` mode on `sgf`: it must exit 0 (the VMM verified the agent's report).
fn run_to_exit(nic: &Nic, sgf: &VfInfo, sandbox: &str) {
    let mut vmm = Vmm::spawn(&nic.dir, sandbox, &sg_args(&sgf.socket, "sg"));
    let st = vmm.wait_exit_within(GUEST_WAIT);
    let err = vmm.stderr();
    assert!(
        st.success(),
        "VMM {sandbox}: {st}: {err}\nnic log:\n{}",
        nic.log()
    );
    let v = nic.wait_vf(sgf, "detached after the VMM's exit", detached);
    let c = v.sg.unwrap();
    assert_eq!(
        c.sgf.ring_errors + c.sgf.bad_signals + c.sgf.unknown_ring,
        0,
        "{c:?}"
    );
    assert_eq!(c.sgf.ctrl_errors + c.setup_errors, 0, "{c:?}");
}

#[test]
fn agent_moves_data_over_64_warp_pipes_and_a_killed_vmm_leaks_nothing() {
    let nic = Nic::start_sg("sgvm", 2);
    let pid = std::process::id();
    let sandbox = format!("sgvm-a-{pid}");
    let sgf = nic.alloc_sg(&sandbox);
    assert!(sgf.socket.exists(), "{sgf:?}");
    let idle = nic.resources();

    // 64 pipes, checksum verified by the VMM.
    run_to_exit(&nic, &sgf, &sandbox);
    nic.expect_resources(&idle);

    // Killed mid-transfer: READY, then the agent keeps its 64 pipes busy.
    let mut vmm = Vmm::spawn(&nic.dir, &sandbox, &{
        let mut a = sg_args(&sgf.socket, "sg-echo");
        a.push("--keep-running".into());
        a
    });
    let end = Instant::now() + GUEST_WAIT;
    while !vmm.is_ready() {
        vmm.check_alive("READY in sg-echo mode");
        assert!(Instant::now() < end, "not READY: {}", vmm.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    let busy = nic.wait_vf(&sgf, "64 sockets with traffic", |v| {
        v.sg.is_some_and(|c| c.attached && c.sockets == 64 && c.pf_pipes == 64)
    });
    let kicks = busy.sg.unwrap().sgf.kicks;
    nic.wait_vf(&sgf, "more doorbells (pipes still moving)", |v| {
        v.sg.is_some_and(|c| c.sgf.kicks > kicks)
    });
    vmm.signal(libc::SIGKILL);
    assert_eq!(vmm.wait_exit().signal(), Some(libc::SIGKILL));
    nic.wait_vf(&sgf, "detached after SIGKILL", detached);
    nic.expect_resources(&idle);

    // The same SGF serves the next VMM.
    run_to_exit(&nic, &sgf, &sandbox);
    nic.expect_resources(&idle);
    nic.release(&sandbox);
}

fn chain_args(socket: &std::path::Path, mode: &str, port: u32) -> Vec<String> {
    let mut a = sg_args(socket, mode);
    for (k, v) in [("--sg-pipes", "4"), ("--sg-bytes", "4096")] {
        let i = a.iter().position(|x| x == k).unwrap();
        a[i + 1] = v.into();
    }
    a.extend(["--sg-port".into(), port.to_string()]);
    a.extend(["--sg-xf".into(), "crypto".into()]);
    a
}

#[test]
fn two_microvms_exchange_encrypted_data_through_a_linked_chain() {
    let nic = Nic::start_sg("sgchain", 2);
    let pid = std::process::id();
    let (sa, sb) = (format!("sgchain-a-{pid}"), format!("sgchain-b-{pid}"));
    let a = nic.alloc_sg(&sa);
    let b = nic.alloc_sg(&sb);
    let idle = nic.resources();
    // Tenancy: only sandboxes that hold an SG function can be linked, not with themselves.
    let link = |x: &str, y: &str| {
        nic.call_any(&Request::SgLink {
            a: x.into(),
            b: y.into(),
        })
    };
    assert_eq!(link(&sa, "nobody").code, Some(ErrorCode::NotFound));
    assert_eq!(link(&sa, &sa).code, Some(ErrorCode::BadRequest));
    assert!(link(&sb, &sa).ok);

    // B listens first; A retries its CONNECT until B's LISTEN is in (its VM may boot later).
    let mut vb = Vmm::spawn(&nic.dir, &sb, &chain_args(&b.socket, "sg-recv", 4242));
    let mut va = Vmm::spawn(&nic.dir, &sa, &chain_args(&a.socket, "sg-send", 4242));
    for (v, who) in [(&mut vb, "receiver B"), (&mut va, "sender A")] {
        let st = v.wait_exit_within(GUEST_WAIT);
        assert!(
            st.success(),
            "{who}: {st}: {}\nnic log:\n{}",
            v.stderr(),
            nic.log()
        );
    }
    for sgf in [&a, &b] {
        // Detached as of after the chains: the counters before the first
        // session look detached too.
        let v = nic.wait_vf(
            sgf,
            "detached after the VMM's exit, 4 chains counted",
            |v| detached(v) && v.sg.is_some_and(|c| c.pf_chains > 0),
        );
        let c = v.sg.unwrap();
        assert_eq!(c.pf_key_slots + c.pf_staging_bytes, 0, "{c:?}");
        // The 4 connections crossed from A's SGF to B's and encrypted.
        assert_eq!(
            (c.pf_chains, c.pf_crypto_chains),
            (4, 4),
            "{c:?}\nA: {}\nB: {}\nnic log:\n{}",
            va.stderr(),
            vb.stderr(),
            nic.log()
        );
        assert_eq!(c.sgf.ring_errors + c.sgf.bad_signals, 0, "{c:?}");
    }
    nic.expect_resources(&idle);
    nic.release(&sa);
    assert!(nic.log().contains("SG link"), "{}", nic.log());
    nic.release(&sb);
}
