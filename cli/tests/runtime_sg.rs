//! Sandboxes on an SG network through the runtime (docs/runtime.md, "SG networks"):
//! the runtime's NIC daemon serves SG functions (`--sgfs`), its `"kind":"sg"` CNI
//! network gives each sandbox one, and the guest agent moves data over its warp pipes;
//! the VMM checks the count and checksum before READY. Needs root, /dev/kvm and the
//! CNI plugins (as runtime_startup.rs).
//!
//! - `burstvm run --net-kind sg`, the way a user starts one: READY, leak check clean.
//! - Two sandboxes on SG at once through the library, both moving data (sg-echo)
//!   at the same time: each gets its own SGF holding exactly its own pipes and
//!   requests; canary: the payloads are salted per sandbox, so a pipe handing back
//!   the other's bytes fails the agent's byte-exact check (its VMM ends: check_alive)
//!   and the VMM's checksum; a third finds no free SGF; after teardown (VMMs stopped
//!   mid-transfer) both SGFs are free and detached, the PF holds no pipe or ring, and
//!   the runtime's leak check is clean.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::sync::Mutex;
use std::time::{Duration, Instant};

use nic_api::{DevKind, VfInfo};
use runtime::{Runtime, Sandbox, SandboxSpec, SgSpec, Variant};

mod cli_common;
use cli_common::{burstvm, networked_runtime, nic_devices, text};

/// Both tests boot VMs on a 2-core machine: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Pipes of `burstvm run` (`BURSTVM_SG_PIPES` runs the same test at another count,
/// e.g. 4096; the agent takes up to vmm::args::SG_MAX_PIPES).
fn run_pipes() -> String {
    std::env::var("BURSTVM_SG_PIPES").unwrap_or_else(|_| "1024".into())
}

#[test]
fn burstvm_run_on_an_sg_network_moves_data_over_its_pipes() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pipes = run_pipes();
    let t = Instant::now();
    let o = burstvm(&[
        "run",
        "--net-kind",
        "sg",
        "--sg-pipes",
        &pipes,
        "--sg-bytes",
        "64",
        "--memory",
        "64M",
    ]);
    let all = text(&o);
    assert!(o.status.success(), "{all}");
    assert!(
        all.contains(&format!(
            "SG function: {pipes} warp pipes x 64 bytes echoed, checksum verified by the VMM"
        )),
        "{all}"
    );
    assert!(all.contains("leak check: clean"), "{all}");
    eprintln!("burstvm run, {pipes} pipes: {:?}", t.elapsed());
}

fn sg_devices(rt: &Runtime) -> Vec<VfInfo> {
    nic_devices(rt, DevKind::Sg)
}

/// The SG devices once `ok` holds (the daemon publishes SG counters every 100 ms).
fn wait_sg_devices(rt: &Runtime, what: &str, ok: impl Fn(&[VfInfo]) -> bool) -> Vec<VfInfo> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let devs = sg_devices(rt);
        if ok(&devs) {
            return devs;
        }
        assert!(Instant::now() < deadline, "{what}: {devs:#?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn two_sg_sandboxes_at_once_each_see_only_their_own_pipes_and_free_their_sgf() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rt = networked_runtime(2);
    rt.prepare_variant(Variant::Fastiov).unwrap();
    assert_eq!(sg_devices(&rt).len(), 2, "the NIC daemon serves --sgfs 2");
    let pfx = rt.sandbox_prefix();
    // Different pipe counts tie each SGF's counters to its sandbox; `echo`: after
    // READY both agents keep moving their bytes (sg-echo), checking every round.
    let spec = |name: &str, pipes: u32| SandboxSpec {
        keep_running: true,
        echo: true,
        sg: Some(SgSpec { pipes, bytes: 256 }),
        ..SandboxSpec::new(format!("{pfx}sg-{name}"), Variant::Fastiov, 64 << 20, 60)
    };
    let (up_tx, up_rx) = std::sync::mpsc::channel::<Result<(), String>>();
    std::thread::scope(|s| {
        let mut go = Vec::new();
        for (name, pipes) in [("a", 48u32), ("b", 80)] {
            let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
            go.push(go_tx);
            let (up_tx, rt, spec) = (up_tx.clone(), &rt, &spec);
            // This thread holds its sandbox until the checks are done (or the test panicked).
            s.spawn(move || {
                let mut sb = match Sandbox::start(rt, spec(name, pipes)) {
                    Ok(sb) => sb,
                    Err(e) => return up_tx.send(Err(e.to_string())).unwrap(),
                };
                up_tx.send(Ok(())).unwrap();
                let _ = go_rx.recv();
                let alive = sb.check_alive().map_err(|e| e.to_string());
                up_tx
                    .send(alive.and_then(|()| sb.teardown().map_err(|e| e.to_string())))
                    .unwrap();
            });
        }
        for _ in 0..2 {
            up_rx.recv().unwrap().unwrap();
        }

        // Both live and moving: one SGF each, attached, holding exactly its own
        // sandbox's sockets and requests (OPEN and CONNECT per pipe).
        let owned = [(format!("{pfx}sg-a"), 48u64), (format!("{pfx}sg-b"), 80)];
        let moving = |devs: &[VfInfo], min: &[u64]| {
            owned.iter().zip(min).all(|((sb, pipes), &min)| {
                devs.iter().any(|v| {
                    v.sandbox.as_deref() == Some(sb.as_str())
                        && v.sg.is_some_and(|c| {
                            c.attached
                                && c.sockets == *pipes
                                && c.sgf.ctrl_requests == 2 * pipes
                                && c.sgf.signals_in > min
                        })
                })
            })
        };
        let devs = wait_sg_devices(&rt, "each SGF attached with its own pipes", |d| {
            moving(d, &[0, 0])
        });
        let mut seen = Vec::new();
        for (sb, _) in &owned {
            let mine: Vec<&VfInfo> = devs
                .iter()
                .filter(|v| v.sandbox.as_deref() == Some(sb.as_str()))
                .collect();
            assert_eq!(mine.len(), 1, "{sb}: {devs:?}");
            let c = mine[0].sg.unwrap();
            assert_eq!(c.sgf.ctrl_errors + c.sgf.ring_errors, 0, "{sb}: {c:?}");
            assert_eq!(c.sgf.bad_signals + c.sgf.unknown_ring, 0, "{sb}: {c:?}");
            seen.push(c.sgf.signals_in);
        }
        // Both keep moving byte-exact rounds at once (a wrong byte ends that VMM: the
        // threads' check_alive).
        wait_sg_devices(&rt, "both SGFs keep moving", |d| moving(d, &seen));
        // No third SGF: the next SG sandbox is refused at its CNI ADD, nothing taken.
        let e = match Sandbox::start(
            &rt,
            SandboxSpec {
                keep_running: false,
                ..spec("c", 8)
            },
        ) {
            Ok(_) => panic!("a third SG sandbox started on 2 SGFs"),
            Err(e) => e,
        };
        assert_eq!(e.stage, "cni-add", "{e}");
        // Both still alive, then torn down mid-transfer.
        drop(go);
        for _ in 0..2 {
            up_rx.recv().unwrap().unwrap();
        }
    });

    // Free again in the NIC's state: no sandbox, detached, the PF holds nothing.
    wait_sg_devices(&rt, "SGFs freed after teardown", |devs| {
        devs.iter().all(|v| {
            let c = v.sg.unwrap();
            v.sandbox.is_none() && !c.attached && c.pf_pipes + c.pf_rings + c.pf_sockets == 0
        })
    });
    let lc = runtime::leaks::check(&rt, Duration::from_secs(5));
    assert!(lc.is_clean(), "{}", lc.describe());
}
