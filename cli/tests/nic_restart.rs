//! Faults of the NIC under running microVMs (issue #9 items 2 and 5), with `burstvm nic`
//! and `burstvm vmm` processes and the built-in agent; the test is the guests' server on
//! the PF's uplink tap and answers every request at once.
//!
//! - SIGKILL of the NIC daemon and a restart on its state directory: both guests' traffic
//!   resumes (the VMMs reconnect and restore their sessions).
//! - A NIC that does not come back: the VMM gives up after its deadline and says so, and the
//!   guest sees DEVICE_NEEDS_RESET.
//! - A guest that resets its device reaches READY again on the same VF; a guest whose VF the
//!   NIC put in `error` is told (DEVICE_NEEDS_RESET), resets, and works again. Neither
//!   touches the other VF of the devset.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod nic_vm_common;

use std::time::{Duration, Instant};

use nic_api::VfState;
use nic_vm_common::*;

/// The guests' server: answers every request on the uplink at once and logs
/// (when, guest MAC, sequence number of an echo-mode request).
struct Responder {
    up: Uplink,
    handled: usize,
    log: Vec<(Instant, [u8; 6], u32)>,
}

impl Responder {
    fn new(up: Uplink) -> Responder {
        Responder {
            up,
            handled: 0,
            log: Vec::new(),
        }
    }

    fn run(&mut self, d: Duration) {
        let end = Instant::now() + d;
        while Instant::now() < end {
            self.up.pump(Duration::from_millis(5));
            while self.handled < self.up.seen.len() {
                let f = self.up.seen[self.handled].clone();
                self.handled += 1;
                if !is_udp(&f) || f[36..38] != SERVER_PORT.to_be_bytes() {
                    continue;
                }
                let end = (34 + u16::from_be_bytes([f[38], f[39]]) as usize).min(f.len());
                let payload = &f[42..end.max(42)];
                let seq = payload
                    .len()
                    .checked_sub(4)
                    .map_or(0, |i| u32::from_be_bytes(payload[i..].try_into().unwrap()));
                self.log.push((Instant::now(), src_mac(&f), seq));
                let reply = udp_reply_to(
                    src_mac(&f),
                    f[30..34].try_into().unwrap(),
                    f[26..30].try_into().unwrap(),
                    u16::from_be_bytes([f[34], f[35]]),
                    b"echo",
                );
                self.up.send(&reply);
            }
        }
    }

    /// Answers until no frame has arrived for `quiet` (bounded by GUEST_WAIT).
    fn run_until_quiet(&mut self, quiet: Duration) {
        let end = Instant::now() + GUEST_WAIT;
        loop {
            let seen = self.up.seen.len();
            self.run(quiet);
            if self.up.seen.len() == seen {
                return;
            }
            assert!(Instant::now() < end, "the uplink never went quiet");
        }
    }

    /// Requests of `mac` logged at or after `since`.
    fn after(&self, mac: [u8; 6], since: Instant) -> Vec<(Instant, u32)> {
        self.log
            .iter()
            .filter(|(t, m, _)| *m == mac && *t >= since)
            .map(|(t, _, s)| (*t, *s))
            .collect()
    }

    fn max_seq(&self, mac: [u8; 6]) -> Option<u32> {
        self.log
            .iter()
            .filter(|(_, m, _)| *m == mac)
            .map(|e| e.2)
            .max()
    }

    /// When `mac`'s traffic had resumed after `since`: the first request whose sequence
    /// number is beyond the first one seen after `since` (a reply got through).
    fn resumed(&self, mac: [u8; 6], since: Instant) -> Option<Instant> {
        let after = self.after(mac, since);
        let first = after.first()?.1;
        after.iter().find(|(_, s)| *s > first).map(|e| e.0)
    }

    /// Answers until `done` holds; the VMMs must stay alive meanwhile.
    fn until(&mut self, vmms: &mut [&mut Vmm], what: &str, done: impl Fn(&Responder) -> bool) {
        let end = Instant::now() + GUEST_WAIT;
        while !done(self) {
            for v in vmms.iter_mut() {
                v.check_alive(what);
            }
            assert!(
                Instant::now() < end,
                "never {what}; VMM stderr: {}",
                vmms.iter()
                    .map(|v| v.stderr())
                    .collect::<Vec<_>>()
                    .join(" | ")
            );
            self.run(Duration::from_millis(20));
        }
    }
}

fn guest<'a>(
    name: &str,
    mac: [u8; 6],
    ip: [u8; 4],
    mode: (&'a str, &'a [&'a str]),
    extra: &'a [&'a str],
) -> Guest<'a> {
    Guest {
        sandbox: format!("nicrs-{name}-{}", std::process::id()),
        mac,
        ip,
        server: (SERVER_IP, SERVER_MAC),
        mode,
        extra,
    }
}

const ECHO: &[&str] = &["--agent-mode", "echo"];

#[test]
fn nic_sigkill_and_restart_resumes_two_guests() {
    let tap = TestTap::new("nr");
    let mut nic = Nic::start("restart", &tap.0, "hierarchical");
    let mut srv = Responder::new(Uplink::open(&tap.0));
    let a = guest("a", MAC_A, IP_A, SYNC_VANILLA, ECHO);
    let b = guest("b", MAC_B, IP_B, ASYNC_LAZY, ECHO);
    let (vf_a, vf_b) = (nic.alloc(&a.sandbox, a.mac), nic.alloc(&b.sandbox, b.mac));
    let mut vmm_a = Vmm::start(&nic.dir, &vf_a, &a);
    let mut vmm_b = Vmm::start(&nic.dir, &vf_b, &b);
    srv.until(&mut [&mut vmm_a, &mut vmm_b], "steady traffic", |r| {
        r.max_seq(MAC_A) >= Some(3) && r.max_seq(MAC_B) >= Some(3)
    });
    assert!(vmm_a.is_ready() && vmm_b.is_ready());

    // The NIC crashes; nothing gets through while it is gone. The responder logs a frame
    // when it reads it, so the frames the NIC sent before it died are read first: until
    // the uplink has been quiet for a while (a loaded host may read them late).
    nic.kill();
    srv.run_until_quiet(Duration::from_millis(50));
    let killed = Instant::now();
    srv.run(Duration::from_millis(300));
    let restarted = Instant::now();
    assert_eq!(srv.after(MAC_A, killed), Vec::new());
    assert_eq!(srv.after(MAC_B, killed), Vec::new());
    nic.restart();
    let up = Instant::now();
    srv.until(&mut [&mut vmm_a, &mut vmm_b], "resumed traffic", |r| {
        r.resumed(MAC_A, restarted).is_some() && r.resumed(MAC_B, restarted).is_some()
    });
    for (who, mac) in [("A", MAC_A), ("B", MAC_B)] {
        let t = srv.resumed(mac, restarted).unwrap();
        eprintln!(
            "guest {who}: resumed {} ms after the kill, {} ms after the restart",
            (t - killed).as_millis(),
            t.saturating_duration_since(up).as_millis()
        );
    }
    // The VMMs said what happened; the restarted NIC has both VFs open again.
    for vmm in [&vmm_a, &vmm_b] {
        let err = vmm.stderr();
        assert!(
            err.contains("backend disconnected") && err.contains("backend reconnected after"),
            "{}: {err}",
            vmm.sandbox
        );
        assert!(!err.contains("not restored"), "{err}");
    }
    for vf in [&vf_a, &vf_b] {
        nic.wait_vf(vf, "open", |v| v.state == VfState::Open);
    }
    vmm_a.terminate();
    vmm_b.terminate();
    for vf in [&vf_a, &vf_b] {
        nic.wait_vf(vf, "reset", |v| v.state == VfState::Reset);
    }
    // The restarted daemon maps no guest memory once both VFs are closed.
    let end = Instant::now() + NIC_WAIT;
    while nic.resources().1 != 0 {
        assert!(Instant::now() < end, "NIC still maps guest memory");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn vf_lost_when_the_nic_does_not_come_back() {
    let tap = TestTap::new("nl");
    let mut nic = Nic::start("lost", &tap.0, "global");
    let mut srv = Responder::new(Uplink::open(&tap.0));
    let extra = &["--agent-mode", "echo", "--vf-reconnect", "1"];
    let a = guest("l", MAC_A, IP_A, SYNC_VANILLA, extra);
    let vf = nic.alloc(&a.sandbox, a.mac);
    let mut vmm = Vmm::start(&nic.dir, &vf, &a);
    srv.until(&mut [&mut vmm], "traffic", |r| r.max_seq(MAC_A) >= Some(1));
    nic.kill();
    // Within its 1 s deadline and the guest's next interrupt the VMM gives up, tells the
    // guest, and the agent stops with ERR_DEVICE_FAILED.
    let end = Instant::now() + NIC_WAIT;
    let status = loop {
        if let Some(st) = vmm.child.as_mut().unwrap().try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < end, "VMM still running: {}", vmm.stderr());
        srv.run(Duration::from_millis(50));
    };
    vmm.child = None;
    let err = vmm.stderr();
    assert!(!status.success(), "{err}");
    let lost = err
        .lines()
        .find(|l| l.contains("not restored"))
        .unwrap_or_else(|| panic!("no loss report: {err}"));
    assert!(
        lost.contains(&format!("VF socket {}", vf.socket.display()))
            && lost.contains("no backend within 1 s"),
        "{lost}"
    );
    assert!(err.contains("ERR_DEVICE_FAILED"), "{err}");
    let trace =
        std::fs::read_to_string(nic.dir.join(format!("{}.trace", a.sandbox))).unwrap_or_default();
    assert!(trace.contains("\"vf-lost\""), "{trace}");
}

#[test]
fn guest_reset_and_vf_error_each_bring_their_vf_back() {
    let tap = TestTap::new("nx");
    let nic = Nic::start("reset", &tap.0, "hierarchical");
    let mut srv = Responder::new(Uplink::open(&tap.0));
    // A reloads its driver once; B first sends a descriptor outside its memory.
    let a = guest("r", MAC_A, IP_A, SYNC_VANILLA, &["--agent-mode", "reset"]);
    let b = guest("f", MAC_B, IP_B, ASYNC_LAZY, &["--agent-mode", "fault"]);
    let (vf_a, vf_b) = (nic.alloc(&a.sandbox, a.mac), nic.alloc(&b.sandbox, b.mac));
    let mut vmm_a = Vmm::start(&nic.dir, &vf_a, &a);
    let mut vmm_b = Vmm::start(&nic.dir, &vf_b, &b);
    let (mut ready_a, mut ready_b) = (false, false);
    let end = Instant::now() + GUEST_WAIT;
    while !(ready_a && ready_b) {
        ready_a = ready_a || vmm_a.is_ready();
        ready_b = ready_b || vmm_b.is_ready();
        vmm_a.check_alive("READY after its reset");
        vmm_b.check_alive("READY after its VF error and reset");
        assert!(Instant::now() < end, "not READY: {ready_a} {ready_b}");
        srv.run(Duration::from_millis(20));
    }
    // READY came after the second exchange, on the same VFs, which are open (never closed
    // and reset by the devset), each having sent its two requests; B's fault was counted.
    let va = nic.wait_vf(&vf_a, "counted", |v| v.counters.tx_packets >= 2);
    let vb = nic.wait_vf(&vf_b, "counted", |v| v.counters.tx_packets >= 2);
    assert_eq!(
        (va.state, vb.state),
        (VfState::Open, VfState::Open),
        "{va:?} {vb:?}"
    );
    assert_eq!(va.counters.bad_descriptors, 0);
    assert_eq!(vb.counters.bad_descriptors, 1);
    assert!(
        vmm_b.stderr().contains("put the VF in error"),
        "{}",
        vmm_b.stderr()
    );
    assert!(!vmm_a.stderr().contains("error"), "{}", vmm_a.stderr());
    assert!(nic.log().contains("out of error"), "{}", nic.log());
    vmm_a.terminate();
    vmm_b.terminate();
    for vf in [&vf_a, &vf_b] {
        nic.wait_vf(vf, "reset", |v| v.state == VfState::Reset);
    }
}
