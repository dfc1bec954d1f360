//! The faults of a chaos round: a random plan of timed actions (kill VMMs,
//! freeze or kill the NIC daemon, kill the worker), the processes they hit
//! (found by their argv), and injecting them.

use super::*;

/// `(pid, sandbox)` of the running `burstvm <sub>` processes whose argument
/// after `flag` starts with `prefix`.
pub(super) fn processes(sub: &str, flag: &str, prefix: &str) -> Vec<(u32, String)> {
    runtime::vmmproc::all_argv()
        .into_iter()
        .filter(|(_, args)| {
            // A VMM runs as `burstvm-vmm ...` or `burstvm vmm ...` (vmmproc decides).
            if sub == "vmm" {
                runtime::vmmproc::is_vmm(args)
            } else {
                args.get(1).map(String::as_str) == Some(sub)
            }
        })
        .filter_map(|(pid, args)| {
            let w = args
                .windows(2)
                .find(|w| w[0] == flag && w[1].starts_with(prefix))?;
            Some((pid, w[1].clone()))
        })
        .collect()
}

pub(super) fn nic_pid(tag: &str) -> Option<u32> {
    processes(
        "nic",
        "--control",
        &format!("{}/", runtime::instance::state_dir_of(tag).display()),
    )
    .first()
    .map(|p| p.0)
}

/// Sandboxes in the middle of their request/reply exchange (VF driver up,
/// not ready): the NIC is writing into their memory right now.
fn mid_exchange(tag: &str) -> BTreeSet<String> {
    let evs = trace::read_trace(&runtime::instance::state_dir_of(tag).join("trace.jsonl"))
        .unwrap_or_default();
    let driver: BTreeSet<String> = evs
        .iter()
        .filter(|e| e.stage == trace::Stage::VfDriver)
        .map(|e| e.sandbox.clone())
        .collect();
    let ready: BTreeSet<String> = evs
        .iter()
        .filter(|e| e.stage == trace::Stage::Ready)
        .map(|e| e.sandbox.clone())
        .collect();
    driver.difference(&ready).cloned().collect()
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) on a process of our worker's runtime.
    unsafe { libc::kill(pid as i32, sig) };
}

/// SIGKILLs up to `n` VMMs of the worker, preferring those mid-exchange;
/// returns the sandboxes hit (`*` = mid-exchange).
fn kill_vmms(w: &Worker, n: usize, rng: &mut StdRng) -> Vec<String> {
    let mut vmms = processes("vmm", "--sandbox", &w.prefix());
    let busy = mid_exchange(&w.tag);
    vmms.shuffle(rng);
    // Keys drawn once: mid-exchange first (most of the time), then the rest.
    let mut keyed: Vec<(bool, u32, String)> = vmms
        .into_iter()
        .map(|(pid, sb)| (!busy.contains(&sb) || rng.gen_bool(0.3), pid, sb))
        .collect();
    keyed.sort_by_key(|k| k.0);
    keyed
        .into_iter()
        .take(n)
        .map(|(_, pid, sb)| {
            signal(pid, libc::SIGKILL);
            let star = if busy.contains(&sb) { "*" } else { "" };
            format!("{sb}{star}")
        })
        .collect()
}

/// One timed action of a round.
#[derive(Debug, Clone, Copy)]
pub(super) enum Action {
    KillVmm,
    Freeze,
    KillNic,
    KillWorker,
}

/// The round's faults, each at a share of the round's tenants started: the
/// faults land inside the round however fast this host runs it.
pub(super) fn plan(a: &BenchChaosConfig, round: u32, rng: &mut StdRng) -> Vec<(f64, Action)> {
    let mut p: Vec<(f64, Action)> = (0..a.kills)
        .map(|_| (rng.gen_range(0.05..0.9), Action::KillVmm))
        .collect();
    let extra: Vec<FaultKind> = a
        .faults
        .iter()
        .copied()
        .filter(|f| *f != FaultKind::Vmm)
        .collect();
    if !extra.is_empty() {
        p.push(match extra[round as usize % extra.len()] {
            FaultKind::Freeze => (rng.gen_range(0.05..0.8), Action::Freeze),
            FaultKind::Nic => (rng.gen_range(0.05..0.8), Action::KillNic),
            FaultKind::Worker => (rng.gen_range(0.4..0.9), Action::KillWorker),
            FaultKind::Vmm => unreachable!("filtered"),
        });
    }
    p.sort_by(|x, y| x.0.total_cmp(&y.0));
    p
}

/// Tenants of the round whose VMM has started (its `vmm-spawn` is traced).
fn started(tag: &str, round: u32) -> usize {
    let path = format!("/run/burstvm/rt-{tag}/trace.jsonl");
    let prefix = format!("bv{tag}-c{round}-");
    trace::read_trace(Path::new(&path))
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.stage == trace::Stage::VmmSpawn && e.sandbox.starts_with(&prefix))
        .map(|e| e.sandbox)
        .collect::<BTreeSet<_>>()
        .len()
}

/// Sleeps until `until`, unless the worker reports first (the round ended).
fn sleep_or_report(w: &Worker, until: Instant) -> Option<String> {
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        if let Some(l) = w.line(left.min(Duration::from_millis(50))) {
            return Some(l);
        }
    }
}

/// Runs `plan` against the worker's round; returns the worker (None if it
/// was killed) and its report line if the round ended meanwhile.
pub(super) fn inject(
    a: &BenchChaosConfig,
    w: Worker,
    round: u32,
    plan: Vec<(f64, Action)>,
    o: &mut RoundOutcome,
    rng: &mut StdRng,
) -> (Option<Worker>, Option<String>) {
    let total = (a.concurrency * a.tenants) as f64;
    let t0 = Instant::now();
    let n = plan.len();
    for (done, (share, action)) in plan.into_iter().enumerate() {
        loop {
            if let Some(l) = sleep_or_report(&w, Instant::now() + Duration::from_millis(20)) {
                o.events.push(format!(
                    "t+{:.2} s: round over, {} fault(s) not injected",
                    t0.elapsed().as_secs_f64(),
                    n - done
                ));
                return (Some(w), Some(l));
            }
            if started(&w.tag, round) as f64 >= share * total {
                break;
            }
        }
        let t = format!(
            "t+{:.2} s ({:.0}% started)",
            t0.elapsed().as_secs_f64(),
            100.0 * started(&w.tag, round) as f64 / total
        );
        match action {
            Action::KillVmm => {
                let hit = kill_vmms(&w, 1, rng);
                o.vmms_killed += hit.len();
                o.events.push(format!("{t}: SIGKILL VMM {hit:?}"));
            }
            Action::Freeze => match nic_pid(&w.tag) {
                Some(pid) => {
                    signal(pid, libc::SIGSTOP);
                    let hit = kill_vmms(&w, 2, rng);
                    std::thread::sleep(Duration::from_millis(a.freeze_ms));
                    signal(pid, libc::SIGCONT);
                    o.vmms_killed += hit.len();
                    o.nic_frozen_ms += a.freeze_ms;
                    o.events.push(format!(
                        "{t}: NIC frozen {} ms, meanwhile SIGKILL VMM {hit:?}",
                        a.freeze_ms
                    ));
                }
                None => o.events.push(format!("{t}: no NIC daemon to freeze")),
            },
            Action::KillNic => match nic_pid(&w.tag) {
                Some(pid) => {
                    signal(pid, libc::SIGKILL);
                    o.nic_killed = true;
                    o.events.push(format!("{t}: SIGKILL NIC daemon"));
                }
                None => o.events.push(format!("{t}: no NIC daemon to kill")),
            },
            Action::KillWorker => {
                w.kill();
                o.worker_killed = true;
                o.events.push(format!("{t}: SIGKILL worker runtime"));
                return (None, None);
            }
        }
    }
    (Some(w), None)
}
