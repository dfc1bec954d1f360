//! `burstvm bench chaos`: sandbox bursts under SIGKILL. Each round a worker
//! process (a runtime of its own, so it can be killed too) starts a burst
//! of sandboxes the way `bench startup` does, while this controller SIGKILLs
//! random VMMs, freezes the NIC daemon (a NIC thread running late), kills
//! the NIC daemon, or kills the worker, at random moments. Slots whose
//! sandbox died start a later tenant at once, which takes the dead one's
//! recycled memory from the page pool. After each round: nothing may be
//! left (netns, links, cgroups, assigned VFs, VMM processes, lent pool
//! memory, files), and no tenant may have seen another's bytes
//! (`canary`). See docs/runtime.md.//!
//! This file: configuration, the worker process, the leak checks, the
//! round loop and its report; choosing and injecting faults (and finding
//! the processes they hit) is in `faults.rs`.

pub mod canary;
mod faults;
mod worker;

use faults::{inject, nic_pid, plan, processes};

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;

pub use worker::{worker_main, ChaosWorkerConfig};
use worker::{Hello, RoundReport};

use crate::{bad, Error};
use runtime::burstvm_bin;
use runtime::variant::{NetKind, Variant};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// SIGKILL VMMs (every round).
    Vmm,
    /// SIGSTOP the NIC daemon, SIGKILL VMMs meanwhile, SIGCONT.
    Freeze,
    /// SIGKILL the NIC daemon (the worker restarts it on its state).
    Nic,
    /// SIGKILL the worker runtime (the next one reaps what it left).
    Worker,
}

impl FaultKind {
    pub const ALL: [FaultKind; 4] = [
        FaultKind::Vmm,
        FaultKind::Freeze,
        FaultKind::Nic,
        FaultKind::Worker,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Vmm => "vmm",
            FaultKind::Freeze => "freeze",
            FaultKind::Nic => "nic",
            FaultKind::Worker => "worker",
        }
    }
}

impl std::fmt::Display for FaultKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for FaultKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|v| v.name() == s)
            .ok_or_else(|| format!("unknown fault {s:?} (vmm, freeze, nic, worker)"))
    }
}

/// `burstvm bench chaos`.
#[derive(Debug, Clone)]
pub struct BenchChaosConfig {
    /// Bursts to run.
    pub rounds: u32,
    /// Sandboxes started at once per round.
    pub concurrency: usize,
    /// Variant of every sandbox; it must have a VF, and pool memory or a DMA window.
    pub variant: Variant,
    /// Guest memory per sandbox, bytes.
    pub memory: u64,
    /// VMMs SIGKILLed per round.
    pub kills: usize,
    /// Faults beside VMM kills; one per round, in turn.
    pub faults: Vec<FaultKind>,
    /// How long a freeze stops the NIC daemon, ms.
    pub freeze_ms: u64,
    /// Tenants each slot runs back to back (later ones on earlier ones' memory).
    pub tenants: usize,
    /// Seed of the fault schedule (default: from the clock; printed).
    pub seed: Option<u64>,
    /// Seconds each guest may take to become ready.
    pub timeout: u64,
    /// Write the report as JSON here.
    pub report: Option<PathBuf>,
    /// The burstvm binary (default: this one).
    pub burstvm_bin: Option<PathBuf>,
}

/// What the controller did and found in one round.
#[derive(Debug, Default, Serialize)]
pub struct RoundOutcome {
    pub round: u32,
    pub worker_tag: String,
    pub vmms_killed: usize,
    pub nic_frozen_ms: u64,
    pub nic_killed: bool,
    pub worker_killed: bool,
    /// What was done when, from the round's first VMM.
    pub events: Vec<String>,
    /// The worker's own account (absent if it was killed).
    pub worker: Option<RoundReport>,
    /// What the controller found of the round's runtime on the host.
    pub leftovers: Vec<String>,
}

impl RoundOutcome {
    fn clean(&self) -> bool {
        self.leftovers.is_empty()
            && self.worker.as_ref().is_none_or(|w| {
                w.foreign.is_empty() && w.leaks.is_clean() && w.leftover_files.is_empty()
            })
    }
}

#[derive(Debug, Serialize)]
pub struct ChaosReport {
    pub seed: u64,
    pub rounds: Vec<RoundOutcome>,
    pub tenants: usize,
    pub probed: usize,
    pub own_canary_words: usize,
    pub foreign_sightings: usize,
    pub pass: bool,
}

/// A running worker and the lines it prints.
struct Worker {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    tag: String,
}

impl Worker {
    fn spawn(a: &BenchChaosConfig, bin: &Path, memory: u64) -> Result<Worker, Error> {
        let mut child = Command::new(bin)
            .args(["bench", "chaos-worker"])
            .args(["--concurrency", &a.concurrency.to_string()])
            .args(["--variant", a.variant.name()])
            .args(["--memory-bytes", &memory.to_string()])
            .args(["--timeout", &a.timeout.to_string()])
            .args(["--tenants", &a.tenants.to_string()])
            .arg("--burstvm-bin")
            .arg(bin)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|source| Error::Spawn {
                field: "--burstvm-bin",
                path: bin.to_path_buf(),
                source,
            })?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut w = Worker {
            child,
            stdin,
            lines,
            tag: String::new(),
        };
        let hello: Hello = w
            .line(Duration::from_secs(60))
            .and_then(|l| serde_json::from_str(&l).ok())
            .ok_or_else(|| {
                let st = w.child.try_wait().ok().flatten();
                Error::Leaks(format!("chaos worker did not start (status {st:?})"))
            })?;
        w.tag = hello.tag;
        Ok(w)
    }

    fn line(&self, timeout: Duration) -> Option<String> {
        self.lines.recv_timeout(timeout).ok()
    }

    fn prefix(&self) -> String {
        format!("bv{}-", self.tag)
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Ends the worker normally: EOF on stdin, it tears everything down.
    fn finish(self) -> Result<(), WorkerEnd> {
        let Worker {
            mut child, stdin, ..
        } = self;
        drop(stdin);
        match child.wait() {
            Ok(st) if st.success() => Ok(()),
            Ok(st) => Err(WorkerEnd::Exit(st)),
            Err(e) => Err(WorkerEnd::Wait(e)),
        }
    }
}

/// How a worker told to finish did not end cleanly.
#[derive(Debug, thiserror::Error)]
enum WorkerEnd {
    #[error("chaos worker exited with {0}")]
    Exit(std::process::ExitStatus),
    #[error("chaos worker: {0}")]
    Wait(#[source] std::io::Error),
}

/// Host resources of the runtime `tag` (after it ended or was reaped).
fn host_leftovers(tag: &str, layout: &runtime::cgroup::Layout) -> Vec<String> {
    let prefix = runtime::instance::sandbox_prefix_of(tag);
    let mut v = Vec::new();
    for ns in netutil::netns::list(&prefix)
        .into_iter()
        .chain(netutil::netns::list(&runtime::instance::server_netns_of(
            tag,
        )))
    {
        v.push(format!("netns {ns}"));
    }
    for cg in layout.list().into_iter().filter(|c| c.starts_with(&prefix)) {
        v.push(format!("cgroup {cg}"));
    }
    for (pid, sb) in processes("vmm", "--sandbox", &prefix) {
        v.push(format!("VMM {sb} (pid {pid})"));
    }
    if let Some(pid) = nic_pid(tag) {
        v.push(format!("NIC daemon (pid {pid})"));
    }
    let dir = runtime::instance::state_dir_of(tag);
    if dir.exists() {
        v.push(format!("state directory {}", dir.display()));
    }
    v
}

/// Waits until `check` finds nothing (children die asynchronously).
fn settle(limit: Duration, check: impl Fn() -> Vec<String>) -> Vec<String> {
    let end = Instant::now() + limit;
    loop {
        let v = check();
        if v.is_empty() || Instant::now() >= end {
            return v;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn bench_chaos_cli(a: &BenchChaosConfig) -> Result<(), Error> {
    runtime::instance::install_sigint_handler();
    let memory = a.memory;
    let policy = a.variant.policy();
    // Pool memory is where a tenant could see an earlier one's bytes; the
    // window variant's device pages are its fresh DMA window, probed too.
    if policy.net != NetKind::Vf || (policy.memory_policy == "vanilla" && !policy.dma_window) {
        return Err(bad(
            "--variant",
            format!(
                "{}: chaos needs a VF variant with pool memory or a DMA window (fastiov, fastiov-A, pre*, window, ...)",
                a.variant
            ),
        ));
    }
    if a.concurrency == 0 || a.rounds == 0 {
        return Err(bad(
            "--concurrency",
            "rounds and concurrency must be at least 1",
        ));
    }
    if a.tenants == 0 || a.concurrency * a.tenants > nic_api::MAX_VFS {
        return Err(bad(
            "--tenants",
            format!(
                "{} slots × {} tenants: at least one, and at most the {} VFs of a PF",
                a.concurrency,
                a.tenants,
                nic_api::MAX_VFS
            ),
        ));
    }
    let bin = burstvm_bin(&a.burstvm_bin)?;
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    println!(
        "chaos: seed {seed}, {} rounds of {} × {}, {} VMM kills per round, faults {:?}",
        a.rounds, a.concurrency, a.variant, a.kills, a.faults
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let layout = runtime::cgroup::Layout::detect().map_err(runtime::RuntimeError::from)?;
    let mut rounds = Vec::new();
    let mut worker: Option<Worker> = None;
    // Tags of killed workers, checked once the next runtime reaped them.
    let mut dead: Vec<(usize, String)> = Vec::new();
    for r in 0..a.rounds {
        if runtime::instance::sigint_received() {
            break;
        }
        let w = match worker.take() {
            Some(w) => w,
            None => Worker::spawn(a, &bin, memory)?,
        };
        // The new runtime reaped what killed ones left: verify it.
        for (i, tag) in dead.drain(..) {
            check_reaped(&mut rounds[i], &tag, &layout);
        }
        let mut o = RoundOutcome {
            round: r,
            worker_tag: w.tag.clone(),
            ..Default::default()
        };
        let mut w = w;
        let _ = writeln!(w.stdin, "round {r}");
        let p = plan(a, r, &mut rng);
        match inject(a, w, r, p, &mut o, &mut rng) {
            (Some(wk), early) => {
                let limit = Duration::from_secs(3 * a.timeout + 120);
                let line = early.or_else(|| wk.line(limit));
                match line.and_then(|l| serde_json::from_str(&l).ok()) {
                    Some(rep) => {
                        o.worker = Some(rep);
                        worker = Some(wk);
                    }
                    None => {
                        o.leftovers
                            .push("the worker did not report the round in time".into());
                        let tag = wk.tag.clone();
                        wk.kill();
                        dead.push((rounds.len(), tag));
                    }
                }
            }
            (None, _) => {
                // Its VMMs and NIC die with it (PDEATHSIG); its netns,
                // cgroups and state directory wait for the next runtime.
                let tag = o.worker_tag.clone();
                let prefix = format!("bv{tag}-");
                o.leftovers.extend(settle(Duration::from_secs(15), || {
                    let mut v: Vec<String> = processes("vmm", "--sandbox", &prefix)
                        .into_iter()
                        .map(|(pid, sb)| format!("VMM {sb} (pid {pid}) outlived its runtime"))
                        .collect();
                    v.extend(nic_pid(&tag).map(|p| format!("NIC (pid {p}) outlived its runtime")));
                    v
                }));
                dead.push((rounds.len(), tag));
            }
        }
        print_round(&o);
        rounds.push(o);
    }
    if let Some(w) = worker.take() {
        let tag = w.tag.clone();
        let end = w.finish();
        let o = rounds.last_mut().expect("at least one round");
        if let Err(e) = end {
            o.leftovers.push(e.to_string());
        }
        let left = settle(Duration::from_secs(10), || host_leftovers(&tag, &layout));
        if left.is_empty() {
            println!("runtime {tag} ended, nothing left");
        }
        for l in &left {
            println!("runtime {tag} ended; LEFT: {l}");
        }
        o.leftovers.extend(left);
    }
    if !dead.is_empty() {
        // No runtime comes after the last killed one: reap as one would.
        for r in runtime::instance::reap_stale(&layout) {
            println!("  reaped: {r}");
        }
        for (i, tag) in dead.drain(..) {
            check_reaped(&mut rounds[i], &tag, &layout);
        }
    }
    let report = summarize(seed, rounds);
    if let Some(p) = &a.report {
        std::fs::write(p, serde_json::to_vec_pretty(&report).expect("json")).map_err(|source| {
            Error::Output {
                path: p.clone(),
                source,
            }
        })?;
    }
    if runtime::instance::sigint_received() {
        return Err(Error::Interrupted);
    }
    if !report.pass {
        return Err(Error::Leaks(format!(
            "chaos: FAIL (seed {seed}): {} foreign bytes seen, {} round(s) not clean",
            report.foreign_sightings,
            report.rounds.iter().filter(|r| !r.clean()).count()
        )));
    }
    println!(
        "chaos: PASS — {} rounds, {} tenants, {} probed, {} own-canary words seen, 0 foreign bytes, nothing left behind",
        report.rounds.len(),
        report.tenants,
        report.probed,
        report.own_canary_words
    );
    Ok(())
}

/// What a killed runtime left once the next one reaped it: must be nothing.
fn check_reaped(o: &mut RoundOutcome, tag: &str, layout: &runtime::cgroup::Layout) {
    let left = host_leftovers(tag, layout);
    if left.is_empty() {
        println!("round {}: runtime {tag} reaped, nothing left", o.round);
    }
    for l in &left {
        println!("round {}: LEFT by runtime {tag}: {l}", o.round);
    }
    o.leftovers.extend(left);
}

fn summarize(seed: u64, rounds: Vec<RoundOutcome>) -> ChaosReport {
    let ws = || rounds.iter().filter_map(|r| r.worker.as_ref());
    let tenants = ws().map(|w| w.tenants).sum();
    let probed = ws().map(|w| w.probed).sum();
    let own = ws().map(|w| w.own_canary_words).sum();
    let foreign = ws().map(|w| w.foreign.len()).sum();
    // A check that never saw a tenant's own canary could not have seen a
    // foreign one either: then the run proves nothing.
    let blind = probed > 0 && own == 0;
    let pass = rounds.iter().all(RoundOutcome::clean) && !blind;
    if blind {
        println!("chaos: no tenant saw its own canary: the probes do not point at its buffers");
    }
    ChaosReport {
        seed,
        tenants,
        probed,
        own_canary_words: own,
        foreign_sightings: foreign,
        pass,
        rounds,
    }
}

fn print_round(o: &RoundOutcome) {
    let mut faults = vec![format!("{} VMMs killed", o.vmms_killed)];
    if o.nic_frozen_ms > 0 {
        faults.push(format!("NIC frozen {} ms", o.nic_frozen_ms));
    }
    if o.nic_killed {
        faults.push("NIC killed".into());
    }
    if o.worker_killed {
        faults.push("worker runtime killed".into());
    }
    println!(
        "round {} (runtime {}): {}",
        o.round,
        o.worker_tag,
        faults.join(", ")
    );
    for e in &o.events {
        println!("  {e}");
    }
    if let Some(w) = &o.worker {
        println!(
            "  {} tenants, {} ready, {} failed or killed; NIC restarts {}; {} canary frames",
            w.tenants, w.ready, w.failed, w.nic_restarts, w.canary_frames_sent
        );
        println!(
            "  canary: {} probed, {} own words, {} foreign",
            w.probed,
            w.own_canary_words,
            w.foreign.len()
        );
        for s in &w.foreign {
            println!(
                "  FOREIGN: {} read {:#018x} at {:#x} ({})",
                s.tenant,
                s.word,
                s.gpa,
                s.owner
                    .as_deref()
                    .map_or("bytes of no live tenant".to_string(), |o| format!(
                        "canary of {o}"
                    ))
            );
        }
        println!("  {}", w.leaks.describe());
        for f in &w.leftover_files {
            println!("  LEFT: {f}");
        }
    }
    for l in &o.leftovers {
        println!("  LEFT: {l}");
    }
}
