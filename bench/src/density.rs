//! `burstvm bench density` (RunD §5.3, Fig. 11-13): N idle sandboxes kept
//! alive after READY; what each costs the host (VMM PSS, page tables, the
//! drop of MemAvailable, threads, fds), booted and from a template, and the
//! time to start 10 more with N running. Stops at the first limit and names it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::{bad, Error};
use runtime::instance::{Runtime, RuntimeConfig};
use runtime::leaks::{self, LeakReport};
use runtime::sandbox::{Sandbox, SandboxSpec};
use runtime::template::TemplateConfig;
use runtime::variant::{NetKind, Variant};
use runtime::{burstvm_bin, cgroup, SandboxConfig};

/// Sandboxes started at once while filling up (the 2-core host boots them
/// one per core; more only queue).
const START_WORKERS: usize = 4;

#[derive(Debug, Clone)]
pub struct BenchDensityConfig {
    /// Idle sandboxes kept alive, one level after another, e.g. 100,300.
    pub sandboxes: Vec<usize>,
    /// Network of every sandbox: no-net or tap (a VF variant cannot use a template).
    pub variant: Variant,
    pub sandbox: SandboxConfig,
    /// With a template: every level runs booted and then from the template.
    pub template: TemplateConfig,
    /// Sandboxes started (at once) with N running, timed (RunD Fig. 13).
    pub more: usize,
    /// Seconds each guest may take to become ready.
    pub timeout: u64,
    /// Write the levels as JSON here.
    pub json: Option<PathBuf>,
    /// The burstvm binary (default: this one).
    pub burstvm_bin: Option<PathBuf>,
}

/// One level, booted or from the template.
#[derive(Debug, Clone, Serialize)]
pub struct Level {
    pub mode: &'static str,
    pub asked: usize,
    /// Sandboxes that reached READY and were measured.
    pub running: usize,
    /// What stopped the level before `asked` (None: all started).
    pub limit: Option<String>,
    /// Per sandbox, bytes (or counts), averaged over `running`.
    pub vmm_pss: u64,
    pub page_tables: u64,
    pub mem_available_drop: u64,
    pub threads: f64,
    pub fds: f64,
    /// Time to start `more` sandboxes at once with `running` alive: each one's
    /// start-to-READY, average and max, ms.
    pub more: usize,
    pub more_avg_ms: f64,
    pub more_max_ms: f64,
    pub teardown_errors: Vec<String>,
    pub leaks: LeakReport,
}

/// Sum over the sandboxes' VMM processes.
#[derive(Debug, Default)]
struct ProcTotals {
    pss: u64,
    threads: u64,
    fds: u64,
}

fn proc_totals(pids: &[u32]) -> ProcTotals {
    let mut t = ProcTotals::default();
    for pid in pids {
        let p = PathBuf::from(format!("/proc/{pid}"));
        t.pss += kb_field(&p.join("smaps_rollup"), "Pss:");
        t.threads += kb_field(&p.join("status"), "Threads:");
        t.fds += std::fs::read_dir(p.join("fd")).map_or(0, |d| d.count() as u64);
    }
    t.pss *= 1024;
    t
}

/// The number after `key` in a /proc key-value file (0 when absent).
fn kb_field(path: &std::path::Path, key: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn meminfo(key: &str) -> u64 {
    kb_field(std::path::Path::new("/proc/meminfo"), key) * 1024
}

/// What the starter threads of a level share.
struct Shared {
    pids: Mutex<Vec<u32>>,
    /// Start-to-READY of each sandbox started in the timed `more` phase.
    more_times: Mutex<Vec<Duration>>,
    limit: Mutex<Option<String>>,
    teardown_errors: Mutex<Vec<String>>,
}

/// Starts sandboxes `range` on `workers` threads, stopping at the first
/// failure or when MemAvailable falls under the margin (the limit). Each
/// thread keeps what it started until `release` can be read, then tears it
/// down. Every thread sends on `started` when it is done starting.
#[allow(clippy::too_many_arguments)]
fn spawn_starters<'s, 'e: 's>(
    s: &'s std::thread::Scope<'s, 'e>,
    rt: &'e Runtime,
    spec: &'e (dyn Fn(usize) -> SandboxSpec + Sync),
    range: std::ops::Range<usize>,
    workers: usize,
    timed: bool,
    sh: &'e Shared,
    release: &'e RwLock<()>,
    started: std::sync::mpsc::Sender<()>,
) {
    let next = Arc::new(AtomicUsize::new(range.start));
    for _ in 0..workers.min(range.len()) {
        let (next, started, end) = (next.clone(), started.clone(), range.end);
        s.spawn(move || {
            let mut mine = Vec::new();
            loop {
                if sh
                    .limit
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .is_some()
                    || rt.interrupted()
                {
                    break;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= end {
                    break;
                }
                let avail = crate::startup::mem_available();
                if avail < crate::startup::MEMORY_MARGIN {
                    sh.limit
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .get_or_insert(format!(
                            "memory: MemAvailable {} MiB is under the {} MiB margin",
                            avail >> 20,
                            crate::startup::MEMORY_MARGIN >> 20
                        ));
                    break;
                }
                let t0 = Instant::now();
                match Sandbox::start(rt, spec(i)) {
                    Ok(sb) => {
                        if timed {
                            sh.more_times
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .push(t0.elapsed());
                        }
                        sh.pids
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .extend(sb.vmm_pid());
                        mine.push(sb);
                    }
                    Err(f) => {
                        sh.limit
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .get_or_insert(format!(
                                "sandbox {} failed at {}: {}",
                                f.sandbox, f.stage, f.error
                            ));
                        break;
                    }
                }
            }
            // Dropping the sender too: a panicked sibling then ends the wait.
            let _ = started.send(());
            drop(started);
            drop(release.read());
            let mut errs = Vec::new();
            for mut sb in mine {
                if let Err(e) = sb.check_alive() {
                    errs.push(format!("{}: died while idle: {}", e.sandbox, e.error));
                }
                errs.extend(sb.teardown().err().map(|e| e.to_string()));
            }
            sh.teardown_errors
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(errs);
        });
    }
}

fn run_level(
    rt: &Runtime,
    a: &BenchDensityConfig,
    n: usize,
    template: Option<PathBuf>,
    memory: u64,
    app_size: u64,
) -> Level {
    let mode = if template.is_some() {
        "template"
    } else {
        "boot"
    };
    let prefix = format!("{}d{n}{}-", rt.sandbox_prefix(), &mode[..1]);
    let spec = |i: usize| SandboxSpec {
        cpus: a.sandbox.cpus,
        app_size,
        keep_running: true,
        template: template.clone(),
        ..SandboxSpec::new(format!("{prefix}{i}"), a.variant, memory, a.timeout)
    };
    let sh = Shared {
        pids: Mutex::default(),
        more_times: Mutex::default(),
        limit: Mutex::default(),
        teardown_errors: Mutex::default(),
    };
    let release = RwLock::new(());
    let avail0 = crate::startup::mem_available();
    let pt0 = meminfo("PageTables:");
    let mut m = Measured::default();
    let mut more_limit = None;
    std::thread::scope(|s| {
        let hold = release.write().unwrap_or_else(PoisonError::into_inner);
        let (tx, rx) = std::sync::mpsc::channel();
        let w = START_WORKERS.min(n);
        spawn_starters(s, rt, &spec, 0..n, w, false, &sh, &release, tx);
        rx.iter().take(w).for_each(drop);
        // Idle after READY: let the agents settle before reading.
        std::thread::sleep(Duration::from_millis(500));
        let pids = sh
            .pids
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        m.running = pids.len();
        m.totals = proc_totals(&pids);
        m.drop = avail0.saturating_sub(crate::startup::mem_available());
        m.pt = meminfo("PageTables:").saturating_sub(pt0);
        if sh
            .limit
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
            && a.more > 0
        {
            let (tx, rx) = std::sync::mpsc::channel();
            spawn_starters(s, rt, &spec, n..n + a.more, a.more, true, &sh, &release, tx);
            rx.iter().take(a.more).for_each(drop);
            more_limit = sh
                .limit
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
        }
        drop(hold);
    });
    let running = m.running;
    let per = |v: u64| v / running.max(1) as u64;
    let ms: Vec<f64> = sh
        .more_times
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .map(|d| d.as_secs_f64() * 1e3)
        .collect();
    let limit = sh
        .limit
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner);
    let limit = match more_limit {
        Some(l) => Some(format!("while starting {} more: {l}", a.more)),
        None => limit.or(rt.interrupted().then(|| "interrupted (Ctrl-C)".to_string())),
    };
    Level {
        mode,
        asked: n,
        running,
        limit,
        vmm_pss: per(m.totals.pss),
        page_tables: per(m.pt),
        mem_available_drop: per(m.drop),
        threads: m.totals.threads as f64 / running.max(1) as f64,
        fds: m.totals.fds as f64 / running.max(1) as f64,
        more: ms.len(),
        more_avg_ms: ms.iter().sum::<f64>() / ms.len().max(1) as f64,
        more_max_ms: ms.iter().cloned().fold(0.0, f64::max),
        teardown_errors: sh
            .teardown_errors
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner),
        leaks: leaks::check(rt, Duration::from_secs(10)),
    }
}

/// What a level read with its N sandboxes idle.
#[derive(Default)]
struct Measured {
    running: usize,
    totals: ProcTotals,
    drop: u64,
    pt: u64,
}

fn table(levels: &[Level]) -> String {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let mut s = format!(
        "{:<9} {:>6} {:>7} {:>9} {:>9} {:>9} {:>7} {:>5} {:>14}  limit / leaks\n",
        "mode",
        "asked",
        "running",
        "PSS MiB",
        "PT KiB",
        "avail MiB",
        "threads",
        "fds",
        "+more avg/max"
    );
    for l in levels {
        s += &format!(
            "{:<9} {:>6} {:>7} {:>9.2} {:>9.1} {:>9.2} {:>7.1} {:>5.1} {:>6.0}/{:<4.0}ms  {}; {}\n",
            l.mode,
            l.asked,
            l.running,
            mib(l.vmm_pss),
            l.page_tables as f64 / 1024.0,
            mib(l.mem_available_drop),
            l.threads,
            l.fds,
            l.more_avg_ms,
            l.more_max_ms,
            l.limit.as_deref().unwrap_or("none"),
            if l.leaks.is_clean() && l.teardown_errors.is_empty() {
                "leaks: none".to_string()
            } else {
                format!("{}; {:?}", l.leaks.describe(), l.teardown_errors)
            }
        );
    }
    s
}

pub fn bench_density_cli(a: &BenchDensityConfig) -> Result<(), Error> {
    runtime::instance::install_sigint_handler();
    let (memory, app_size) = a.sandbox.bytes()?;
    if a.sandboxes.is_empty() || a.sandboxes.contains(&0) {
        return Err(bad("--sandboxes", "levels of at least 1"));
    }
    if !matches!(a.variant.policy().net, NetKind::None | NetKind::Tap) {
        return Err(bad(
            "--variant",
            "no-net or tap (a VF variant's memory cannot be a template's copy-on-write pages)",
        ));
    }
    let template = a.template.resolve()?;
    let max_n = a.sandboxes.iter().max().copied().unwrap_or(0) + a.more;
    let rt = Runtime::new(RuntimeConfig {
        bin: burstvm_bin(&a.burstvm_bin)?,
        trace_path: None,
        vfs: 0,
        network: a.variant.policy().net != NetKind::None,
        cgroup_pool: 0,
        cgroup_limits: cgroup::Limits::for_guest(memory, app_size, a.sandbox.cpus),
        rootfs_layer_bytes: None,
        net_pool: 0,
        sgfs: 0,
        cni_server: true,
    })?;
    rt.prepare_variant(a.variant)?;
    eprintln!(
        "bench density: {} ({} MiB guest memory), levels {:?} (+{} more), up to {max_n} at once",
        a.variant,
        memory >> 20,
        a.sandboxes,
        a.more
    );
    let mut levels = Vec::new();
    let modes: Vec<Option<PathBuf>> = match &template {
        Some(t) => vec![None, Some(t.clone())],
        None => vec![None],
    };
    'outer: for &n in &a.sandboxes {
        for t in &modes {
            let l = run_level(&rt, a, n, t.clone(), memory, app_size);
            eprint!("{}", table(std::slice::from_ref(&l)));
            let stop = l.limit.is_some() || rt.interrupted();
            levels.push(l);
            if stop {
                break 'outer;
            }
        }
    }
    print!("{}", table(&levels));
    if let Some(p) = &a.json {
        let s = serde_json::to_string_pretty(&levels).expect("levels serialize");
        std::fs::write(p, s).map_err(|source| Error::Output {
            path: p.clone(),
            source,
        })?;
    }
    let unclean: Vec<_> = levels
        .iter()
        .filter(|l| !l.leaks.is_clean() || !l.teardown_errors.is_empty())
        .collect();
    drop(rt);
    if !unclean.is_empty() {
        return Err(Error::Leaks(format!(
            "{} level(s) left something behind (see the table)",
            unclean.len()
        )));
    }
    Ok(())
}
