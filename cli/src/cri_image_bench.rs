//! `burstvm bench startup --via cri --image IMAGE --kernel K`: what containerd
//! and the shim add to starting a container in a Linux guest. Per variant
//! and concurrency N, in one run:
//!
//! - **direct**: N sandboxes of the image through the runtime library (as
//!   `burstvm run --kernel K IMAGE -- CMD`), each running `CMD` as its main
//!   process; time from the start to the process's first output line.
//! - **cri**: N Linux-guest pods through a private containerd's CRI plugin
//!   and the burstvm shim, each RunPodSandbox + CreateContainer +
//!   StartContainer of the image with the same `CMD`; time from
//!   RunPodSandbox to the first line in the container's CRI log, with each
//!   call's share.
//!
//! Host CPU (all processes, /proc/stat) per container covers start through
//! teardown. On a kvm_pvm host the kernel runs emulated (a boot is tens of
//! seconds): the shape, what the CRI path adds, is what this measures.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_proto::{Client, CreateProcess, StreamKind, CONTROL_PORT};
use anyhow::{anyhow, bail, Context, Result};
use bench::startup::BenchStartupConfig;
use runtime::{Attach, Runtime, Sandbox, SandboxSpec, Variant};
use serde::Serialize;

use crate::cri::container::{ContainerOpts, CreateArgs};
use crate::cri::{CriClient, PodArgs};
use crate::cri_bench::{avg, cri_leftovers, host_cpu_ms, p99, setup};

/// What each container prints first (then it exits).
const FIRST: &str = "burstvm-first-line";
/// Pods of the benchmark live in this Kubernetes namespace.
const NAMESPACE: &str = "bench-image";

#[derive(Debug, Serialize)]
pub struct ImageCompare {
    pub variant: String,
    pub concurrency: usize,
    /// Start → the first output line, direct path.
    pub direct_first_avg_ms: f64,
    pub direct_first_p99_ms: f64,
    /// RunPodSandbox's, CreateContainer's and StartContainer's own time.
    pub cri_runp_avg_ms: f64,
    pub cri_create_avg_ms: f64,
    pub cri_start_avg_ms: f64,
    /// RunPodSandbox issued → the first line in the container's log.
    pub cri_first_avg_ms: f64,
    pub cri_first_p99_ms: f64,
    /// cri_first − direct_first (averages).
    pub extra_avg_ms: f64,
    /// Host CPU per container, start through teardown.
    pub cpu_ms_direct: f64,
    pub cpu_ms_cri: f64,
    pub failed_direct: usize,
    pub failed_cri: usize,
}

/// The image name an OCI archive carries (`io.containerd.image.name` of its
/// index), the reference containerd imports it as.
fn image_ref(tar: &Path) -> Result<String> {
    let out = std::process::Command::new("tar")
        .arg("-xOf")
        .arg(tar)
        .arg("./index.json")
        .output()
        .with_context(|| format!("tar -xOf {} ./index.json", tar.display()))?;
    if !out.status.success() {
        bail!(
            "{}: no index.json (an OCI archive of scripts/build-images.sh?)",
            tar.display()
        );
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("{}: index.json", tar.display()))?;
    v["manifests"][0]["annotations"]["io.containerd.image.name"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| anyhow!("{}: index.json names no image", tar.display()))
}

/// Reads `r` until the first line and returns when that came (monotonic
/// ns); drains the rest.
fn first_line(r: impl Read) -> Result<u64> {
    let mut r = BufReader::new(r);
    let mut line = String::new();
    r.read_line(&mut line).context("the process's stdout")?;
    let at = trace::monotonic_ns();
    if line.trim_end() != FIRST {
        bail!("first line {line:?}, not {FIRST:?}");
    }
    std::io::copy(&mut r, &mut std::io::sink()).context("the process's stdout")?;
    Ok(at)
}

/// What the direct path needs for each sandbox.
struct Direct {
    rootfs: runtime::sandbox::rootfs::RootfsSpec,
    kernel: PathBuf,
    initrd: PathBuf,
    process: agent_proto::Process,
    memory: u64,
    cpus: f64,
    timeout: u64,
}

/// One sandbox of the direct path: start → its first output line, ns.
fn direct_one(rt: &Runtime, d: &Direct, v: Variant, id: String) -> Result<u64> {
    let t0 = trace::monotonic_ns();
    let spec = SandboxSpec {
        cpus: d.cpus,
        rootfs: Some(d.rootfs.clone()),
        kernel: Some(d.kernel.clone()),
        agent_initrd: Some(d.initrd.clone()),
        ..SandboxSpec::new(id.clone(), v, d.memory, d.timeout)
    };
    let attach = Attach {
        until_exit: true,
        ..Attach::default()
    };
    let mut sb =
        Sandbox::start_attached(rt, spec, attach).map_err(|e| anyhow!("{}", shim::describe(&e)))?;
    let r = (|| -> Result<u64> {
        let vsock = sb
            .vsock_path()
            .ok_or_else(|| anyhow!("sandbox {id}: no vsock"))?
            .to_path_buf();
        let mut c = Client::connect_uds(&vsock, CONTROL_PORT, runtime::container::AGENT_TIMEOUT)?;
        let create = CreateProcess {
            main: true,
            stderr: false,
            ..CreateProcess::new("main", d.process.clone())
        };
        c.create_process(&create)?;
        let out = c.attach_stream("main", StreamKind::Stdout)?;
        c.start_process("main")?;
        let at = first_line(out)?;
        c.wait_process("main", None)?;
        Ok(at - t0)
    })();
    sb.wait_status();
    sb.teardown()?;
    r.with_context(|| format!("sandbox {id}"))
}

/// The CRI path's times of one container, ns: (runp, create, start, first line).
fn cri_one(
    c: &CriClient,
    pod: &PodArgs,
    image: &str,
    limit: Duration,
) -> Result<(u64, u64, u64, u64)> {
    let t0 = trace::monotonic_ns();
    let pod_id = c.runp(pod)?;
    let t1 = trace::monotonic_ns();
    let args = CreateArgs {
        pod: pod_id.clone(),
        image: image.to_string(),
        cmd: vec!["sh".into(), "-c".into(), format!("echo {FIRST}")],
        name: Some("c".into()),
        annotations: Vec::new(),
        labels: Vec::new(),
        opts: ContainerOpts {
            envs: Vec::new(),
            workdir: None,
            tty: false,
            stdin: false,
            log_path: None,
        },
    };
    let cfg = pod.config();
    let cid = c.create(&pod_id, args.config(&cfg), cfg)?;
    let t2 = trace::monotonic_ns();
    c.start(&cid)?;
    let t3 = trace::monotonic_ns();
    let log = pod
        .log_dir
        .as_ref()
        .map(|d| d.join(format!("{}_0.log", args.name())))
        .ok_or_else(|| anyhow!("pod {}: no log directory", pod.name))?;
    let deadline = Instant::now() + limit;
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.lines().any(|l| l.ends_with(FIRST)) {
            let t4 = trace::monotonic_ns();
            return Ok((t1 - t0, t2 - t1, t3 - t2, t4 - t0));
        }
        if Instant::now() > deadline {
            bail!(
                "container {cid}: no {FIRST:?} in {} within {limit:?}",
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub fn run(a: &BenchStartupConfig) -> Result<()> {
    runtime::instance::install_sigint_handler();
    let name = a
        .image
        .as_deref()
        .ok_or_else(|| anyhow!("--image missing"))?;
    let tar = a.images.join(format!("{name}.tar"));
    if !tar.is_file() {
        bail!(
            "--image {name}: {} missing; run scripts/build-images.sh {} first",
            tar.display(),
            a.images.display()
        );
    }
    let image = image_ref(&tar)?;
    // Absolute: the shims read them from their bundles' directories.
    let absolute = |flag: &str, p: &Path| {
        std::fs::canonicalize(p).with_context(|| format!("{flag} {}", p.display()))
    };
    let kernel = a
        .kernel
        .clone()
        .ok_or_else(|| anyhow!("--image needs --kernel"))?;
    let kernel = absolute("--kernel", &kernel)?;
    let agent = a
        .agent
        .clone()
        .or_else(runtime::container::default_agent)
        .ok_or_else(|| anyhow!("--agent: no guest agent found (scripts/build-agent.sh)"))?;
    let agent = absolute("--agent", &agent)?;
    // Every sandbox of the runtime has the image as its rootfs.
    let mut cfg = a.clone();
    cfg.rootfs.rootfs = Some(tar.clone());
    let (rt, plan) = bench::startup::bench_setup(&cfg)?;
    std::fs::create_dir_all(&plan.out).with_context(|| plan.out.display().to_string())?;
    let mut rootfs = plan
        .spec
        .rootfs
        .clone()
        .ok_or_else(|| anyhow!("{}: no rootfs", tar.display()))?;
    // The container's process is the proof, not a checksummed file.
    rootfs.check = None;
    let cache = cfg.rootfs.image_cache_dir();
    let initrd = runtime::container::initramfs(&agent, &cache)?;
    let cmd = vec!["sh".to_string(), "-c".into(), format!("echo {FIRST}")];
    let process = runtime::container::image_process(&rootfs.image, &cmd, false)?;
    let direct = Arc::new(Direct {
        rootfs,
        kernel: kernel.clone(),
        initrd,
        process,
        memory: plan.spec.memory_bytes,
        cpus: plan.spec.cpus,
        timeout: a.timeout,
    });
    let linux = serde_json::json!({
        "kernel": kernel,
        "agent": agent,
        "image_cache": cache,
        "timeout_secs": a.timeout,
    });
    let s = setup(&rt, &cfg, plan.spec.memory_bytes, Some(linux))?;
    s.containerd.import("k8s.io", &tar)?;
    let client = CriClient::connect(s.containerd.socket(), Duration::from_secs(a.timeout + 60))?;
    let limit = Duration::from_secs(a.timeout + 60);
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    let mut leaks = Vec::new();
    'levels: for &n in &plan.levels {
        for &v in &plan.variants {
            if rt.interrupted() {
                break 'levels;
            }
            rt.prepare_variant(v)?;
            eprintln!("{v} x{n}: direct (the runtime library, as burstvm run)");
            let cpu0 = host_cpu_ms();
            let results: Vec<Result<u64>> = std::thread::scope(|sc| {
                let hs: Vec<_> = (0..n)
                    .map(|i| {
                        let (rt, d) = (&rt, &direct);
                        let id = format!(
                            "{}img-{}-{n}-{i}",
                            rt.sandbox_prefix(),
                            v.name().to_lowercase()
                        );
                        sc.spawn(move || direct_one(rt, d, v, id))
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("thread panicked"))))
                    .collect()
            });
            let cpu_direct = host_cpu_ms() - cpu0;
            let mut dtimes = Vec::new();
            for r in results {
                match r {
                    Ok(t) => dtimes.push(t),
                    Err(e) => failures.push(format!("{v} x{n} direct: {e:#}")),
                }
            }
            let lc = runtime::leaks::check(&rt, Duration::from_secs(5));
            if !lc.is_clean() {
                leaks.push(format!("{v} x{n} direct: {}", lc.describe()));
            }

            eprintln!("{v} x{n}: via containerd's CRI plugin");
            let pods: Vec<PodArgs> = (0..n)
                .map(|i| {
                    let name = format!("img-{}-{n}-{i}", v.name().to_lowercase());
                    PodArgs {
                        log_dir: Some(s.dir.join("logs").join(&name)),
                        name,
                        namespace: NAMESPACE.into(),
                        uid: None,
                        runtime: "burstvm".into(),
                        annotations: vec![(
                            shim::config::ANNOTATION_VARIANT.into(),
                            v.name().into(),
                        )],
                        host_network: v.policy().net == runtime::variant::NetKind::None,
                    }
                })
                .collect();
            let cpu0 = host_cpu_ms();
            let results: Vec<Result<(u64, u64, u64, u64)>> = std::thread::scope(|sc| {
                let hs: Vec<_> = pods
                    .iter()
                    .map(|p| {
                        let (c, image) = (&client, image.as_str());
                        sc.spawn(move || cri_one(c, p, image, limit))
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("thread panicked"))))
                    .collect()
            });
            // Every pod of the round, failed ones too.
            let all: Vec<String> = client
                .pods()
                .unwrap_or_default()
                .into_iter()
                .filter(|p| {
                    p.metadata
                        .as_ref()
                        .is_some_and(|m| m.namespace == NAMESPACE)
                })
                .map(|p| p.id)
                .collect();
            let sandboxes: Vec<String> = all
                .iter()
                .map(|id| shim::sandbox_id("k8s.io", id))
                .collect();
            failures.extend(client.stop_remove_concurrent(&all));
            let cpu_cri = host_cpu_ms() - cpu0;
            let left = cri_leftovers(&rt, &s, &sandboxes);
            if !left.is_empty() {
                leaks.push(format!("{v} x{n} cri: {}", left.join(", ")));
            }
            let (mut runp, mut create, mut start, mut first) = (vec![], vec![], vec![], vec![]);
            for r in results {
                match r {
                    Ok((a, b, c, d)) => {
                        runp.push(a);
                        create.push(b);
                        start.push(c);
                        first.push(d);
                    }
                    Err(e) => failures.push(format!("{v} x{n} cri: {e:#}")),
                }
            }
            let per = |cpu: f64, ok: usize| if ok == 0 { 0.0 } else { cpu / ok as f64 };
            let row = ImageCompare {
                variant: v.name().into(),
                concurrency: n,
                direct_first_avg_ms: avg(&dtimes),
                direct_first_p99_ms: p99(&dtimes),
                cri_runp_avg_ms: avg(&runp),
                cri_create_avg_ms: avg(&create),
                cri_start_avg_ms: avg(&start),
                cri_first_avg_ms: avg(&first),
                cri_first_p99_ms: p99(&first),
                // Only when both paths have a start to compare.
                extra_avg_ms: if first.is_empty() || dtimes.is_empty() {
                    0.0
                } else {
                    avg(&first) - avg(&dtimes)
                },
                cpu_ms_direct: per(cpu_direct, dtimes.len()),
                cpu_ms_cri: per(cpu_cri, first.len()),
                failed_direct: n - dtimes.len(),
                failed_cri: n - first.len(),
            };
            eprintln!("{}", format_rows(std::slice::from_ref(&row)));
            rows.push(row);
        }
    }
    println!("{}", format_rows(&rows));
    for f in &failures {
        println!("failure: {f}");
    }
    for l in &leaks {
        println!("leak: {l}");
    }
    if leaks.is_empty() {
        println!("leak check: clean");
    }
    let summary = serde_json::json!({
        "image": image,
        "kernel": kernel,
        "memory_bytes": plan.spec.memory_bytes,
        "rows": rows,
        "failures": failures,
        "leaks": leaks,
    });
    let path = plan.out.join("summary-image.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&summary)?)
        .with_context(|| path.display().to_string())?;
    println!("summary: {}", path.display());
    // The pods' stage trace (the shim's trace_copy) beside the summary.
    if s.trace.exists() {
        let to = plan.out.join("cri-trace.jsonl");
        std::fs::copy(&s.trace, &to).with_context(|| to.display().to_string())?;
        println!("pods' trace: {}", to.display());
    }
    let _ = std::fs::remove_dir_all(&s.dir);
    if !failures.is_empty() || !leaks.is_empty() {
        bail!(
            "{} failure(s), {} leak report(s)",
            failures.len(),
            leaks.len()
        );
    }
    Ok(())
}

/// The table: per variant and concurrency, the direct and CRI paths to the
/// first output line, the CRI calls' shares and CPU per container.
pub fn format_rows(rows: &[ImageCompare]) -> String {
    let mut s = format!(
        "{:<10} {:>3} {:>11} {:>11} {:>9} {:>9} {:>9} {:>11} {:>11} {:>9} {:>10} {:>10}\n",
        "variant",
        "n",
        "direct avg",
        "direct p99",
        "runp",
        "create",
        "start",
        "cri avg",
        "cri p99",
        "extra",
        "cpu direct",
        "cpu cri"
    );
    for r in rows {
        s.push_str(&format!(
            "{:<10} {:>3} {:>9.0}ms {:>9.0}ms {:>7.0}ms {:>7.0}ms {:>7.0}ms {:>9.0}ms {:>9.0}ms {:>7.0}ms {:>8.0}ms {:>8.0}ms{}\n",
            r.variant,
            r.concurrency,
            r.direct_first_avg_ms,
            r.direct_first_p99_ms,
            r.cri_runp_avg_ms,
            r.cri_create_avg_ms,
            r.cri_start_avg_ms,
            r.cri_first_avg_ms,
            r.cri_first_p99_ms,
            r.extra_avg_ms,
            r.cpu_ms_direct,
            r.cpu_ms_cri,
            if r.failed_direct + r.failed_cri > 0 {
                format!("  ({} direct, {} cri failed)", r.failed_direct, r.failed_cri)
            } else {
                String::new()
            }
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_line_must_be_the_marker() {
        assert!(first_line(&b"burstvm-first-line\nmore\n"[..]).is_ok());
        let e = first_line(&b"oops\n"[..]).unwrap_err().to_string();
        assert!(e.contains("oops"), "{e}");
    }

    #[test]
    fn the_table_has_a_row_per_round() {
        let r = ImageCompare {
            variant: "no-net".into(),
            concurrency: 2,
            direct_first_avg_ms: 30_000.0,
            direct_first_p99_ms: 31_000.0,
            cri_runp_avg_ms: 32_000.0,
            cri_create_avg_ms: 50.0,
            cri_start_avg_ms: 400.0,
            cri_first_avg_ms: 33_000.0,
            cri_first_p99_ms: 34_000.0,
            extra_avg_ms: 3_000.0,
            cpu_ms_direct: 25_000.0,
            cpu_ms_cri: 27_000.0,
            failed_direct: 0,
            failed_cri: 1,
        };
        let t = format_rows(&[r]);
        assert_eq!(t.lines().count(), 2);
        assert!(t.contains("no-net") && t.contains("1 cri failed"), "{t}");
    }
}
