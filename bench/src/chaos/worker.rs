//! The chaos worker: a runtime in its own process (so that the controller
//! can SIGKILL it), running one burst per `round <n>` line on stdin and
//! answering with one JSON line per round on stdout.

use std::collections::HashMap;
use std::io::BufRead;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::canary::{self, Sighting};
use crate::Error;
use runtime::instance::{NicRestarts, Runtime};
use runtime::leaks::{self, LeakReport};
use runtime::sandbox::{Sandbox, SandboxSpec};
use runtime::variant::Variant;
use runtime::{cgroup, RuntimeConfig};

/// What the controller tells a worker to be.
#[derive(Debug, Clone)]
pub struct ChaosWorkerConfig {
    pub concurrency: usize,
    pub variant: Variant,
    pub memory_bytes: u64,
    pub timeout: u64,
    /// Tenants each slot runs back to back.
    pub tenants: usize,
    pub burstvm_bin: std::path::PathBuf,
}

/// The first line a worker prints.
#[derive(Debug, Serialize, Deserialize)]
pub struct Hello {
    pub tag: String,
    pub pid: u32,
}

/// One round, as the worker saw it.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct RoundReport {
    pub round: u32,
    pub tenants: usize,
    pub ready: usize,
    /// Failed to start or died after READY (the killed ones, and what a
    /// killed NIC took with it).
    pub failed: usize,
    /// Ready tenants whose probe values came back (the others were killed).
    pub probed: usize,
    /// Probe words holding the tenant's own canary (the check can see frames).
    pub own_canary_words: usize,
    /// Bytes of other tenants seen by a tenant: must stay empty.
    pub foreign: Vec<Sighting>,
    pub canary_frames_sent: u64,
    pub nic_restarts: usize,
    pub leaks: LeakReport,
    /// Files of this round's sandboxes left in the state directory, IPAM leases.
    pub leftover_files: Vec<String>,
    pub failures: Vec<String>,
}

/// One tenant's outcome.
struct Tenant {
    id: String,
    ready: bool,
    failure: Option<String>,
    probe: Option<Vec<u64>>,
}

pub fn worker_main(a: &ChaosWorkerConfig) -> Result<(), Error> {
    runtime::instance::install_sigint_handler();
    let rt = Runtime::new(RuntimeConfig {
        bin: a.burstvm_bin.clone(),
        trace_path: None,
        // One VF per tenant: a killed tenant's VF is reset at its close, but
        // freed only by its teardown's DEL, which a killed NIC daemon delays.
        vfs: (a.concurrency * a.tenants).clamp(1, nic_api::MAX_VFS),
        network: true,
        cgroup_pool: 0,
        cgroup_limits: cgroup::Limits {
            memory_bytes: a.memory_bytes,
            cpus: 1.0,
        },
        rootfs_layer_bytes: None,
        net_pool: 0,
        sgfs: 0,
        cni_server: true,
    })?;
    rt.prepare_variant(a.variant)?;
    let hello = Hello {
        tag: rt.tag().to_string(),
        pid: std::process::id(),
    };
    println!("{}", serde_json::to_string(&hello).expect("json"));
    // Canary words of every tenant this worker ran: the owners of what a
    // later tenant might see.
    let mut known: HashMap<u64, String> = HashMap::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let Some(n) = line
            .strip_prefix("round ")
            .and_then(|n| n.trim().parse().ok())
        else {
            continue;
        };
        let r = run_round(&rt, a, n, &mut known);
        println!("{}", serde_json::to_string(&r).expect("json"));
        if rt.interrupted() {
            break;
        }
    }
    Ok(())
}

/// Waits until the NIC daemon answers again (it may be restarting).
fn wait_nic(rt: &Runtime, limit: Duration) {
    let end = Instant::now() + limit;
    while Instant::now() < end && nic_api::Client::connect(&rt.nic_socket()).is_err() {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// How long a tenant lives after READY (a function invocation's work),
/// spread per tenant so that faults find tenants in every phase.
fn hold(id: &str) -> Duration {
    Duration::from_millis(50 + canary::canary(id) % 250)
}

fn run_round(
    rt: &Runtime,
    a: &ChaosWorkerConfig,
    round: u32,
    known: &mut HashMap<u64, String>,
) -> RoundReport {
    let n = a.concurrency;
    let generator = canary::Generator::start(&rt.server().netns_path(), rt.ipam_lease_dir());
    let spec = |id: String| SandboxSpec {
        keep_running: true,
        probe: canary::probe_addresses(canary::buffers_base(a.variant)),
        ..SandboxSpec::new(id, a.variant, a.memory_bytes, a.timeout)
    };
    let start = Barrier::new(n);
    let mut nic = NicRestarts::default();
    let mut failures = Vec::new();
    let tenants: Vec<Tenant> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|k| {
                let (start, spec) = (&start, &spec);
                std::thread::Builder::new()
                    .name(format!("chaos-{k}"))
                    .stack_size(256 << 10)
                    .spawn_scoped(s, move || {
                        // The burst: every slot's first tenant at once; then
                        // each slot's later tenants back to back, on the
                        // memory the earlier ones gave back to the pool.
                        start.wait();
                        let mut out = Vec::new();
                        for t in 0..a.tenants {
                            if rt.interrupted() {
                                break;
                            }
                            let id = format!("{}c{round}-{k}-{t}", rt.sandbox_prefix());
                            if t > 0 {
                                wait_nic(rt, Duration::from_secs(10));
                            }
                            out.push(match Sandbox::start(rt, spec(id.clone())) {
                                Ok(mut sb) => {
                                    std::thread::sleep(hold(&id));
                                    let alive = sb.check_alive();
                                    let td = sb.teardown().err().map(|e| e.to_string());
                                    Tenant {
                                        id,
                                        ready: true,
                                        failure: alive.err().map(|e| e.to_string()).or(td),
                                        probe: sb.probe_values().map(<[u64]>::to_vec),
                                    }
                                }
                                Err(f) => Tenant {
                                    id,
                                    ready: false,
                                    failure: Some(f.to_string()),
                                    probe: None,
                                },
                            });
                        }
                        out
                    })
                    .expect("spawn chaos slot")
            })
            .collect();
        // The NIC daemon is restarted when killed (a fault of the round).
        rt.keep_nic_up_while(&mut nic, || handles.iter().any(|h| !h.is_finished()));
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let sent = match generator {
        Ok(g) => g.stop(),
        Err(e) => {
            failures.push(format!("canary generator: {e}"));
            0
        }
    };
    // Restarts between the last slot and the check count too.
    rt.keep_nic_up_while(&mut nic, || false);
    failures.extend(nic.errors.iter().map(|e| format!("NIC restart: {e}")));
    for t in &tenants {
        known.insert(canary::canary(&t.id), t.id.clone());
    }
    let mut r = RoundReport {
        round,
        tenants: tenants.len(),
        ready: tenants.iter().filter(|t| t.ready).count(),
        failed: tenants.iter().filter(|t| t.failure.is_some()).count(),
        canary_frames_sent: sent,
        nic_restarts: nic.restarts,
        ..Default::default()
    };
    for t in &tenants {
        if let Some(f) = &t.failure {
            r.failures.push(format!("{}: {f}", t.id));
        }
        if let Some(values) = &t.probe {
            r.probed += 1;
            let v = canary::classify(&t.id, canary::buffers_base(a.variant), values, known);
            r.own_canary_words += v.own;
            r.foreign.extend(v.foreign);
        }
    }
    r.failures.extend(failures);
    r.leaks = leaks::check(rt, Duration::from_secs(10));
    r.leftover_files = leftover_files(rt);
    r
}

/// Per-sandbox files of this runtime still in its state directory, and
/// IPAM leases still held.
fn leftover_files(rt: &Runtime) -> Vec<String> {
    let mut v = Vec::new();
    let prefix = rt.sandbox_prefix();
    if let Ok(rd) = std::fs::read_dir(rt.state_dir()) {
        v.extend(
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&prefix)),
        );
    }
    if let Ok(rd) = std::fs::read_dir(rt.ipam_lease_dir()) {
        v.extend(
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.parse::<std::net::Ipv4Addr>().is_ok())
                .map(|n| format!("IPAM lease {n}")),
        );
    }
    v
}
