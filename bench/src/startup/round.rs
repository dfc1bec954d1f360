//! One round of `bench startup`: N sandbox creations released at the same
//! instant by a barrier, their failures and CPU, and what must hold before
//! a round (enough host memory, the pre-zeroing pool idle).

use super::*;
use runtime::cpuacct::NicCpu;
use std::sync::Mutex;

/// How long a round waits after its last READY for the VMMs' background
/// zeroing (64 MiB each at idle priority) before it tears them down.
const ZEROING_PATIENCE: Duration = Duration::from_secs(60);
/// Host memory kept free on top of what a round needs.
pub const MEMORY_MARGIN: u64 = 1 << 30;

/// One round's outcome.
#[derive(Debug)]
pub struct Round {
    pub variant: Variant,
    pub concurrency: usize,
    pub issue_ns: u64,
    pub ids: Vec<String>,
    pub failures: Vec<SandboxFailure>,
    pub teardown_errors: Vec<String>,
    /// Ready sandboxes whose request the echo server answered (None: no network).
    pub answered: Option<usize>,
    /// How the writable layers were made, and what each cost.
    pub rootfs: Option<LayerMode>,
    pub rootfs_costs: Vec<RootfsCost>,
    /// Host CPU per sandbox start, by owner (sandboxes that reached READY).
    pub cpu: Option<crate::cpu::CpuPerSandbox>,
    /// `pre*` variants: what the idle zeroer did before the round.
    pub prezero: Option<PrezeroWait>,
    /// The NIC daemon found dead and restarted during the round (as `bench
    /// chaos` does): its sandboxes' VMMs reconnect instead of all failing.
    pub nic: NicRestarts,
}

/// Parameters shared by every sandbox of a round.
#[derive(Debug, Clone, Serialize)]
pub struct RoundSpec {
    pub memory_bytes: u64,
    pub cpus: f64,
    pub app_size: u64,
    // A limit of the run, not a property of the sandboxes: summary.json omits it.
    #[serde(skip_serializing)]
    pub timeout_secs: u64,
    /// The rootfs of every sandbox (its layer mode is set per round).
    #[serde(skip_serializing)]
    pub rootfs: Option<RootfsSpec>,
    /// Start from this template (set per round).
    #[serde(skip_serializing)]
    pub template: Option<PathBuf>,
    /// VF sandboxes claim their network from the runtime's pool (set per round).
    #[serde(skip_serializing)]
    pub net_pool: bool,
    /// Guest memory in 2 MiB hugetlb pages (`--hugepages`).
    pub hugepages: bool,
    /// The built-in agent stays at CPL0 (`--agent-cpl0`).
    pub agent_cpl0: bool,
}

/// Starts `n` sandboxes at once (a barrier), waits until every one is ready
/// (or failed), then tears them all down; the NIC daemon is restarted if it
/// dies meanwhile (or died since the last round).
pub fn run_round(rt: &Runtime, variant: Variant, n: usize, label: &str, spec: &RoundSpec) -> Round {
    let mut nic = NicRestarts::default();
    nic.add(rt.restart_nic_if_gone());
    let ids: Vec<String> = (0..n)
        .map(|i| {
            format!(
                "{}{}-{}-{}",
                rt.sandbox_prefix(),
                label,
                variant.name().to_lowercase(),
                i
            )
        })
        .collect();
    let barrier = Barrier::new(n + 1);
    let issue = AtomicU64::new(u64::MAX);
    let done = Barrier::new(n);
    // The NIC daemon's and the page-pool server's CPU from the issue to the last READY.
    let nic_pid = rt.nic_pid();
    let sample = || SharedCpu {
        nic: nic_pid.and_then(runtime::cpuacct::nic_cpu),
        pool_server_ns: rt.pool_server_cpu_ns(),
    };
    let cpu0 = sample();
    let cpu1 = Mutex::new(None);
    let sample_end = || *cpu1.lock().unwrap_or_else(|p| p.into_inner()) = Some(sample());
    type Outcome = Result<
        (
            Option<String>,
            Option<bool>,
            Option<RootfsCost>,
            Option<runtime::cpuacct::StartCpu>,
        ),
        SandboxFailure,
    >;
    let results: Vec<Outcome> = std::thread::scope(|s| {
        let handles: Vec<_> = ids
            .iter()
            .map(|id| {
                let (barrier, issue, done, sample_end) = (&barrier, &issue, &done, &sample_end);
                let sspec = SandboxSpec {
                    cpus: spec.cpus,
                    app_size: spec.app_size,
                    keep_running: true,
                    rootfs: spec.rootfs.clone(),
                    template: spec.template.clone(),
                    net_pool: spec.net_pool,
                    hugepages: spec.hugepages,
                    agent_cpl0: spec.agent_cpl0,
                    watch_zeroing: true,
                    ..SandboxSpec::new(id.clone(), variant, spec.memory_bytes, spec.timeout_secs)
                };
                std::thread::Builder::new()
                    .name(format!("sb-{id}"))
                    .stack_size(256 << 10)
                    .spawn_scoped(s, move || {
                        // The last to arrive releases everyone: its clock is the issue instant.
                        if barrier.wait().is_leader() {
                            issue.fetch_min(trace::monotonic_ns(), Ordering::Relaxed);
                        }
                        // Every thread passes `done` (also on error or panic)
                        // before any sandbox is torn down: teardown (VM
                        // destruction) must not compete with startups.
                        let done_guard = ArriveOnDrop(done, sample_end);
                        let mut sb = match Sandbox::start(rt, sspec) {
                            Ok(sb) => sb,
                            Err(f) => {
                                drop(done_guard);
                                return Err(f);
                            }
                        };
                        // READY already means the agent got its reply; the
                        // echo server's count is the server-side proof.
                        let answered = sb
                            .guest_ip
                            .map(|ip| rt.server().replies().get(&ip).copied().unwrap_or(0) > 0);
                        drop(done_guard);
                        let r = sb.check_alive();
                        // Every sandbox is READY: the zeroing a lazy VMM
                        // deferred past its start runs now, counted apart.
                        if r.is_ok() {
                            sb.wait_background_zeroing(ZEROING_PATIENCE);
                        }
                        let td = sb.teardown().err().map(|e| e.to_string());
                        r.map(|_| (td, answered, sb.rootfs_cost, sb.start_cpu))
                    })
                    .expect("spawn sandbox thread")
            })
            .collect();
        if barrier.wait().is_leader() {
            issue.fetch_min(trace::monotonic_ns(), Ordering::Relaxed);
        }
        rt.keep_nic_up_while(&mut nic, || handles.iter().any(|h| !h.is_finished()));
        handles
            .into_iter()
            .zip(&ids)
            .map(|(h, id)| {
                h.join().unwrap_or_else(|_| {
                    Err(SandboxFailure {
                        sandbox: id.clone(),
                        stage: "?".into(),
                        error: "sandbox thread panicked".into(),
                        cause: None,
                    })
                })
            })
            .collect()
    });
    let mut failures = Vec::new();
    let mut teardown_errors = Vec::new();
    let mut answered = None;
    let mut rootfs_costs = Vec::new();
    let mut starts = Vec::new();
    for r in results {
        match r {
            Ok((td, ans, cost, cpu)) => {
                teardown_errors.extend(td);
                starts.extend(cpu);
                rootfs_costs.extend(cost);
                if let Some(a) = ans {
                    *answered.get_or_insert(0) += a as usize;
                }
            }
            Err(f) => failures.push(f),
        }
    }
    Round {
        variant,
        concurrency: n,
        issue_ns: issue.into_inner(),
        ids,
        failures,
        teardown_errors,
        answered,
        rootfs: spec.rootfs.as_ref().map(|r| r.layer_mode),
        rootfs_costs,
        cpu: crate::cpu::per_sandbox(
            &starts,
            cpu1.into_inner().ok().flatten().map(|end| end.since(&cpu0)),
        ),
        prezero: None,
        nic,
    }
}

/// How long the bench lets the pool's idle zeroer work before a `pre*` round.
pub const PREZERO_BOUND: Duration = Duration::from_secs(60);

/// The pool's idle (SCHED_IDLE) zeroer working ahead of a `pre*` round:
/// how far it got and how long it took, within `PREZERO_BOUND`.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct PrezeroWait {
    pub percent: u8,
    pub target_mib: f64,
    pub reached_mib: f64,
    pub wait_ms: f64,
    pub bound_s: u64,
}

impl PrezeroWait {
    pub fn describe(&self) -> String {
        format!(
            "pre-zero: the pool's idle zeroer had {:.0} of {:.0} MiB ({}% of each cached memfd) zeroed after {:.0} ms of idle time (bound {} s); the round then runs with what it did",
            self.reached_mib, self.target_mib, self.percent, self.wait_ms, self.bound_s
        )
    }
}

/// Sets the idle zeroer's share for `v` (0 for non-`pre*` variants) and,
/// for `pre*`, waits (bounded) until the background thread reaches it.
pub fn idle_prezero(rt: &Runtime, v: Variant) -> Option<PrezeroWait> {
    let mp = v.policy().memory_policy;
    let Some(p) = mp.strip_prefix("pre").and_then(|p| p.parse::<u8>().ok()) else {
        rt.pool().set_prezero_percent(0);
        return None;
    };
    let pool = rt.pool();
    let n0 = pool.stats().cached_memfds;
    let start = std::time::Instant::now();
    pool.set_prezero_percent(p);
    let progress = || {
        let st = pool.stats();
        let (mut target, mut reached) = (0u64, 0u64);
        for c in &st.classes {
            let ps: u64 = if c.hugepages { 2 << 20 } else { 4096 };
            target += c.cached * ((c.size / ps) * p as u64 / 100) * ps;
            reached += c.zeroed_ahead_bytes;
        }
        // An entry the zeroer holds is out of the cache: not done yet.
        (target, reached, st.cached_memfds >= n0)
    };
    loop {
        let (target, reached, all_in) = progress();
        let waited = start.elapsed();
        if (all_in && reached >= target) || waited >= PREZERO_BOUND {
            return Some(PrezeroWait {
                percent: p,
                target_mib: target as f64 / (1 << 20) as f64,
                reached_mib: reached as f64 / (1 << 20) as f64,
                wait_ms: waited.as_secs_f64() * 1e3,
                bound_s: PREZERO_BOUND.as_secs(),
            });
        }
        // Polls a background thread's progress; the work is the zeroer's.
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits on the barrier when dropped, so a thread arrives even if it panics.
/// The last to arrive samples the CPU of the processes and threads the
/// starts share (the closure).
struct ArriveOnDrop<'a>(&'a Barrier, &'a (dyn Fn() + Sync));

impl Drop for ArriveOnDrop<'_> {
    fn drop(&mut self) {
        if self.0.wait().is_leader() {
            (self.1)();
        }
    }
}

/// The CPU the starts of a round share, at one instant.
#[derive(Debug, Clone, Copy)]
struct SharedCpu {
    nic: Option<NicCpu>,
    pool_server_ns: u64,
}

impl SharedCpu {
    fn since(&self, start: &SharedCpu) -> crate::cpu::Shared {
        crate::cpu::Shared {
            nicd: self.nic.zip(start.nic).map(|(e, s)| e.since(s)),
            pool_server_ns: self.pool_server_ns.saturating_sub(start.pool_server_ns),
        }
    }
}

/// MemAvailable of /proc/meminfo, bytes.
pub fn mem_available() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
}

/// Guest bytes one sandbox backs: RAM plus the image region (agent + app
/// + a pmem rootfs image, 2 MiB aligned).
pub fn sandbox_bytes(spec: &RoundSpec) -> u64 {
    let pmem = spec.rootfs.as_ref().map_or(0, |r| r.guest_bytes());
    spec.memory_bytes + (spec.app_size + pmem + (2 << 20)).next_multiple_of(2 << 20)
}

/// Before a round of fresh-memory sandboxes: shrink the pool so that its
/// cached memory plus the round's fresh memory fits the host. Returns the
/// memfds released.
pub fn fit_pool_for_fresh_round(rt: &Runtime, n: usize, spec: &RoundSpec) -> u64 {
    let need =
        n as u64 * (sandbox_bytes(spec) + runtime::cgroup::VMM_OVERHEAD_BYTES / 4) + MEMORY_MARGIN;
    let cached = rt.pool().stats().cached_bytes;
    let avail_if_empty = mem_available() + cached;
    rt.pool().shrink_to(avail_if_empty.saturating_sub(need))
}
