//! Integration tests of the sandbox runtime: `burstvm run` and
//! `burstvm bench startup` against the real VMM, NIC daemon and CNI plugin.
//! They need root, /dev/kvm, iproute2 and host-local (in /opt/cni/bin).

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use serde_json::Value;

mod cli_common;
use cli_common::{burstvm, text, BIN, CNI_BIN};

/// The tests start many VMs on a 2-core machine: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const ALL_VARIANTS: &str =
    "no-net,tap,vanilla,fastiov,fastiov-L,fastiov-S,fastiov-D,fastiov-A,pre10,pre50,pre100";

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("burstvm-rt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// What runtimes create (names starting with `bv`, cgroups also `pool-`):
/// netns, cpu cgroups, and `burstvm vmm --sandbox bv…` processes. Other
/// tests on the host use other names.
fn host_state() -> (HashSet<String>, HashSet<String>, usize) {
    let list = |p: &str| -> HashSet<String> {
        std::fs::read_dir(p)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter_map(|e| e.file_name().into_string().ok())
                    .filter(|n| n.starts_with("bv") || n.starts_with("pool-"))
                    .collect()
            })
            .unwrap_or_default()
    };
    let vmms = runtime::leaks::vmm_processes("bv").len();
    (list("/run/netns"), list("/sys/fs/cgroup/cpu/burstvm"), vmms)
}

fn assert_nothing_new(before: &(HashSet<String>, HashSet<String>, usize)) {
    let after = host_state();
    let new_ns: Vec<_> = after.0.difference(&before.0).collect();
    let new_cg: Vec<_> = after.1.difference(&before.1).collect();
    assert!(new_ns.is_empty(), "netns left: {new_ns:?}");
    assert!(new_cg.is_empty(), "cgroups left: {new_cg:?}");
    assert_eq!(after.2, 0, "burstvm vmm processes left");
}

struct Trace {
    /// sandbox -> stage -> (start, end)
    by_sandbox: BTreeMap<String, BTreeMap<String, (u64, u64)>>,
}

fn read_trace(path: &Path) -> Trace {
    let mut by_sandbox: BTreeMap<String, BTreeMap<String, (u64, u64)>> = BTreeMap::new();
    for line in std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.is_empty())
    {
        let v: Value = serde_json::from_str(line).unwrap();
        let sb = v["sandbox"].as_str().unwrap().to_string();
        let st = v["stage"].as_str().unwrap().to_string();
        let span = (
            v["start_ns"].as_u64().unwrap(),
            v["end_ns"].as_u64().unwrap(),
        );
        assert!(span.0 <= span.1, "{line}");
        assert!(
            by_sandbox.entry(sb).or_default().insert(st, span).is_none(),
            "stage twice: {line}"
        );
    }
    Trace { by_sandbox }
}

/// The stages every sandbox of `variant` must have, in their order.
fn expected(variant: &str) -> Vec<&'static str> {
    let net = variant != "no-net";
    let vf = net && variant != "tap";
    let dma_image = ["vanilla", "fastiov-S", "pre10", "pre50", "pre100"].contains(&variant);
    let mut v = vec!["cgroup", "netns"];
    if net {
        v.push("cni-add");
    }
    v.push("vmm-spawn");
    if vf {
        v.push("dma-ram");
    }
    if dma_image {
        v.push("dma-image");
    }
    if vf {
        v.push("vf-open");
    }
    v.push("boot");
    if net {
        v.push("vf-driver");
    }
    v.push("app-launch");
    // Async VF init: the agent's wait for the link is its own stage.
    if ["fastiov", "fastiov-L", "fastiov-S", "fastiov-D"].contains(&variant) {
        v.push("vf-link");
    }
    v.push("ready");
    v
}

fn check_stage_order(variant: &str, sb: &str, st: &BTreeMap<String, (u64, u64)>) {
    let want = expected(variant);
    let got: Vec<&str> = st.keys().map(|s| s.as_str()).collect();
    let mut want_sorted = want.clone();
    want_sorted.sort();
    assert_eq!(got, want_sorted, "{variant} sandbox {sb}: stages present");
    let s = |n: &str| st[n];
    // The runtime's own stages run one after the other, then the VMM's.
    let host: Vec<&str> = want
        .iter()
        .copied()
        .take_while(|n| *n != "vmm-spawn")
        .collect();
    for w in host.windows(2) {
        assert!(
            s(w[0]).1 <= s(w[1]).0,
            "{variant} {sb}: {} before {}",
            w[0],
            w[1]
        );
    }
    assert!(
        s(host[host.len() - 1]).1 <= s("vmm-spawn").0,
        "{variant} {sb}: vmm-spawn after host stages"
    );
    let mut prev = s("vmm-spawn").1;
    for d in ["dma-ram", "dma-image"] {
        if st.contains_key(d) {
            assert!(prev <= s(d).0, "{variant} {sb}: {d} in order");
            prev = s(d).1;
        }
    }
    assert!(
        prev <= s("boot").0,
        "{variant} {sb}: boot after memory setup"
    );
    assert!(
        s("boot").1 <= s("app-launch").0,
        "{variant} {sb}: app-launch after boot"
    );
    if st.contains_key("vf-driver") {
        assert!(
            s("boot").1 <= s("vf-driver").0,
            "{variant} {sb}: vf-driver after boot"
        );
    }
    if st.contains_key("vf-open") {
        let sync = ["vanilla", "fastiov-A", "pre10", "pre50", "pre100"].contains(&variant);
        if sync {
            assert!(
                s("vf-open").1 <= s("boot").0,
                "{variant} {sb}: sync VF open before the vCPU starts"
            );
        }
        // Async: launched before the vCPU, finished in the background; its
        // thread may be scheduled after the vCPU, so no order with boot.
        assert!(
            s("vf-open").1 <= s("ready").1,
            "{variant} {sb}: VF open before the first packet"
        );
    }
    if st.contains_key("vf-link") {
        assert!(
            s("app-launch").1 <= s("vf-link").0 && s("vf-link").1 <= s("ready").0,
            "{variant} {sb}: the link wait between app-launch and ready"
        );
    }
    let last = st.values().map(|v| v.1).max().unwrap();
    assert_eq!(s("ready").1, last, "{variant} {sb}: ready ends last");
}

/// One sandbox of every variant reaches `ready`, gets its reply, has exactly
/// its variant's stages in order; nothing is left behind.
#[test]
fn every_variant_reaches_ready_with_its_stages() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let before = host_state();
    let out = tempdir("variants");
    let o = burstvm(&[
        "bench",
        "startup",
        "--concurrency",
        "1",
        "--no-warmup",
        "--variants",
        ALL_VARIANTS,
        "--memory",
        "32M",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("leak check: clean after every round"),
        "{}",
        text(&o)
    );
    let summary: Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let groups = summary["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 11);
    for g in groups {
        let v = g["variant"].as_str().unwrap();
        assert_eq!(g["ready"], 1, "{v}: {g}");
        assert_eq!(g["failed"], 0, "{v}: {g}");
        // The stage shares of the critical path (and its uncovered wait) sum to 100%.
        let sum = |k: &str, w: &str| {
            g["stages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|st| st[k].as_f64().unwrap())
                .sum::<f64>()
                + g[w].as_f64().unwrap()
        };
        for (k, w) in [
            ("avg_share", "wait_avg_share"),
            ("p99_share", "wait_p99_share"),
        ] {
            let s = sum(k, w);
            assert!((s - 1.0).abs() < 1e-6, "{v}: {k} sum to {s}: {g}");
        }
        assert!(
            g["net_overhead"]["ratio_avg"].as_f64().unwrap() > 0.0,
            "{v}: {g}"
        );
        assert!(g["cpu"]["vmm_ms"].as_f64().unwrap() > 0.0, "{v}: {g}");
        assert!(g["cpu"]["runtime_ms"].as_f64().unwrap() > 0.0, "{v}: {g}");
        if v == "no-net" {
            assert!(g["answered"].is_null(), "{v}");
        } else {
            assert_eq!(
                g["answered"], 1,
                "{v}: the echo server answered the guest's request"
            );
        }
    }
    let trace = read_trace(&out.join("trace.jsonl"));
    assert_eq!(trace.by_sandbox.len(), 11);
    for (sb, st) in &trace.by_sandbox {
        let v = ALL_VARIANTS
            .split(',')
            .filter(|v| sb.ends_with(&format!("-{}-0", v.to_lowercase())))
            .max_by_key(|v| v.len())
            .unwrap_or_else(|| panic!("variant of {sb}"));
        check_stage_order(v, sb, st);
    }
    for png in [
        "breakdown.png",
        "cdf.png",
        "timeline-fastiov.png",
        "timeline-vanilla.png",
    ] {
        let b = std::fs::read(out.join(png)).unwrap();
        assert!(b.starts_with(b"\x89PNG"), "{png}");
    }
    assert_nothing_new(&before);
    std::fs::remove_dir_all(&out).unwrap();
}

/// 20 fastiov sandboxes issued at once all become ready; no leak.
#[test]
fn twenty_concurrent_fastiov_sandboxes_leave_nothing() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let before = host_state();
    let out = tempdir("c20");
    let o = burstvm(&[
        "bench",
        "startup",
        "--concurrency",
        "20",
        "--variants",
        "fastiov",
        "--memory",
        "32M",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let summary: Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let g = &summary["groups"][0];
    assert_eq!(g["ready"], 20, "{g}");
    assert_eq!(g["failed"], 0, "{g}");
    assert_eq!(g["answered"], 20, "{g}");
    for lc in summary["leak_checks"].as_array().unwrap() {
        assert_eq!(lc["clean"], true, "{lc}");
    }
    let trace = read_trace(&out.join("trace.jsonl"));
    assert_eq!(trace.by_sandbox.len(), 20);
    for (sb, st) in &trace.by_sandbox {
        check_stage_order("fastiov", sb, st);
    }
    assert_nothing_new(&before);
    std::fs::remove_dir_all(&out).unwrap();
}

/// A VMM killed during boot: the sandbox is reported with its stage and torn
/// down (VF released, CNI DEL, netns and cgroup removed).
#[test]
fn vmm_killed_mid_boot_is_torn_down() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let before = host_state();
    let dir = tempdir("kill");
    // A stand-in for `burstvm` that runs the real VMM and SIGKILLs it as soon
    // as it has recorded vmm-spawn (guest memory set up, before dma-ram ends).
    let wrapper = dir.join("burstvm");
    testutil::write_executable(
        &wrapper,
        &format!(
            r#"#!/bin/bash
REAL={BIN}
[ "$1" = vmm ] || exec "$REAL" "$@"
args=("$@"); trace=""; sb=""
for ((i=0; i<${{#args[@]}}; i++)); do
  case "${{args[$i]}}" in --trace) trace="${{args[$((i+1))]}}";; --sandbox) sb="${{args[$((i+1))]}}";; esac
done
"$REAL" "$@" &
pid=$!
for i in $(seq 1 2000); do
  grep -q "\"sandbox\":\"$sb\",\"stage\":\"vmm-spawn\"" "$trace" 2>/dev/null && break
  sleep 0.005
done
kill -9 $pid
wait $pid
echo "test: killed the VMM of $sb" >&2
exit 137
"#
        ),
    );
    let o = burstvm(&[
        "run",
        "--variant",
        "vanilla",
        "--memory",
        "256M",
        "--burstvm-bin",
        wrapper.to_str().unwrap(),
    ]);
    let all = text(&o);
    assert!(!o.status.success(), "{all}");
    assert!(
        all.contains("without READY") && all.contains("killed the VMM"),
        "{all}"
    );
    // The stage named is one the VMM had not finished.
    assert!(
        [
            "stage dma-ram",
            "stage dma-image",
            "stage vf-open",
            "stage boot"
        ]
        .iter()
        .any(|s| all.contains(s)),
        "{all}"
    );
    assert!(all.contains("leak check: clean"), "{all}");
    assert_nothing_new(&before);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Bad input is refused with the flag named, before anything is created.
#[test]
fn bad_arguments_name_the_flag() {
    let o = burstvm(&["bench", "startup", "--variants", "fastiov,bogus"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("bogus"), "{}", text(&o));
    let o = burstvm(&[
        "bench",
        "startup",
        "--concurrency",
        "100000",
        "--memory",
        "64M",
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--concurrency"), "{}", text(&o));
    let o = burstvm(&["run", "--memory", "12Q"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--memory"), "{}", text(&o));
}

/// Starts `burstvm run --keep-running` and waits until its sandbox is ready.
/// The caller keeps reading stdout (the runtime prints its leak check there).
fn start_kept_sandbox(
    variant: &str,
) -> (
    std::process::Child,
    std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
    String,
) {
    start_kept_sandbox_with(variant, &[])
}

/// `start_kept_sandbox` with more `run` arguments.
fn start_kept_sandbox_with(
    variant: &str,
    args: &[&str],
) -> (
    std::process::Child,
    std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
    String,
) {
    use std::io::BufRead;
    let cni_dir = Path::new(CNI_BIN).parent().unwrap();
    let mut child = Command::new(BIN)
        .args(["run", "--variant", variant, "--keep-running"])
        .args(args)
        .env("CNI_PATH", format!("{}:/opt/cni/bin", cni_dir.display()))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if line.starts_with("running;") {
            return (child, lines, seen);
        }
    }
    let status = child.wait();
    panic!("burstvm run ended ({status:?}) before the sandbox was ready:\n{seen}");
}

/// Ctrl-C on a running sandbox tears everything down.
#[test]
fn sigint_tears_a_running_sandbox_down() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let before = host_state();
    let (mut child, lines, _) = start_kept_sandbox("fastiov");
    assert_eq!(host_state().2, 1, "the sandbox's VMM runs");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}: {rest:?}");
    assert!(
        rest.iter().any(|l| l.starts_with("leak check: clean")),
        "{rest:?}"
    );
    assert_nothing_new(&before);
}

/// A runtime killed with SIGKILL cannot clean up; its VMM and NIC daemon die
/// with it, and the next runtime removes its netns, cgroups and state.
#[test]
fn the_next_runtime_reaps_a_killed_one() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let before = host_state();
    let (mut child, _lines, _) = start_kept_sandbox("vanilla");
    child.kill().unwrap();
    child.wait().unwrap();
    let o = burstvm(&["run", "--variant", "no-net"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("removed what a dead runtime left"),
        "{}",
        text(&o)
    );
    assert_nothing_new(&before);
    let left: Vec<_> = std::fs::read_dir("/run/burstvm")
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("rt-"))
        .collect();
    assert!(left.is_empty(), "state directories left: {left:?}");
}

/// The `tap` variant runs through the reference `bridge` CNI plugin: its veth
/// in the sandbox netns is joined to the VMM's tap by tc both ways (Kata's
/// tcfilter), the guest is answered, host-local holds the lease until the
/// sandbox goes, and nothing is left.
#[test]
fn tap_runs_through_the_reference_bridge_plugin() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let before = host_state();
    let (mut child, lines, seen) = start_kept_sandbox("tap");
    assert!(seen.contains("1 request(s) answered"), "{seen}");
    // The VMM's sandbox id starts with `bv<runtime tag>-`.
    let vmm = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok())
        .find_map(|e| {
            let c = std::fs::read(e.path().join("cmdline")).ok()?;
            let args: Vec<String> = c
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let i = args.iter().position(|a| a == "--sandbox")?;
            let sb = args.get(i + 1)?;
            (runtime::vmmproc::is_vmm(&args) && sb.ends_with("-run-tap"))
                .then(|| (e.path(), sb.clone()))
        })
        .expect("the tap sandbox's VMM runs");
    let ns = netutil::Netns::open(&vmm.0.join("ns/net")).unwrap();
    let (eth, tap, redirects) = ns
        .run(|| {
            let mut nl = netutil::Rtnl::open().unwrap();
            let eth = nl.link_by_name("eth0").unwrap().expect("the plugin's veth");
            let tap = nl.link_by_name("tap0").unwrap().expect("the VMM's tap");
            let r = (
                nl.ingress_redirects(eth.index).unwrap(),
                nl.ingress_redirects(tap.index).unwrap(),
            );
            (eth, tap, r)
        })
        .unwrap();
    assert!(tap.is_tun() && tap.up, "{tap:?}");
    assert_eq!(redirects, (vec![tap.index], vec![eth.index]));
    let tag = vmm.1.strip_prefix("bv").unwrap().split('-').next().unwrap();
    let ipam = Path::new("/run/burstvm")
        .join(format!("rt-{tag}"))
        .join("ipam")
        .join(format!("burstvm-tap-{tag}"));
    let leases: Vec<String> = std::fs::read_dir(&ipam)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("10.77."))
        .collect();
    assert_eq!(leases.len(), 1, "{ipam:?}: {leases:?}");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    assert!(child.wait().unwrap().success(), "{rest:?}");
    assert!(
        rest.iter().any(|l| l.starts_with("leak check: clean")),
        "{rest:?}"
    );
    assert_nothing_new(&before);
}

/// `--net-pool`: pooled rounds claim ready attachments (`net-claim`, no
/// `netns`/`cni-add`), the guests are answered through them, the pool
/// refills after the warm-up, and every pooled attachment is DELed at the end.
#[test]
fn pooled_network_is_claimed_used_refilled_and_released() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let before = host_state();
    let out = tempdir("netpool");
    let o = burstvm(&[
        "bench",
        "startup",
        "--concurrency",
        "2",
        "--variants",
        "fastiov",
        "--net-pool",
        "2",
        "--net-pool-compare",
        "--memory",
        "32M",
        "--out",
        out.to_str().unwrap(),
    ]);
    let all = text(&o);
    assert!(o.status.success(), "{all}");
    assert!(all.contains("leak check: clean after every round"), "{all}");
    // Full before the unpooled measured round and the pooled warm-up, and
    // refilled (the warm-up claimed both) before the pooled measured round.
    assert_eq!(
        all.matches("net pool: 2 of 2 attachments ready").count(),
        3,
        "{all}"
    );
    let summary: Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let groups = summary["groups"].as_array().unwrap();
    let names: Vec<&str> = groups
        .iter()
        .map(|g| g["variant"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["fastiov", "fastiov+pool"]);
    for g in groups {
        assert_eq!(g["ready"], 2, "{g}");
        assert_eq!(g["answered"], 2, "the echo server answered: {g}");
    }
    let trace = read_trace(&out.join("trace.jsonl"));
    assert_eq!(trace.by_sandbox.len(), 4);
    let mut pooled = 0;
    for (sb, st) in &trace.by_sandbox {
        if sb.contains("-m2p-") {
            pooled += 1;
            assert!(
                !st.contains_key("netns") && !st.contains_key("cni-add"),
                "{sb}: {st:?}"
            );
            let claim = st["net-claim"];
            assert!(claim.1 <= st["vmm-spawn"].0, "{sb}: {st:?}");
            assert!(st["cgroup"].1 <= claim.0, "{sb}: {st:?}");
        } else {
            assert!(!st.contains_key("net-claim"), "{sb}: {st:?}");
            check_stage_order("fastiov", sb, st);
        }
    }
    assert_eq!(pooled, 2);
    assert_nothing_new(&before);
    std::fs::remove_dir_all(&out).unwrap();
}

/// A runtime SIGKILLed with a full network pool: its pooled netns, leases
/// and VF state stay until the next runtime starts, which removes them all;
/// its NIC daemon (holding the VFs) died with it.
#[test]
fn a_killed_runtime_with_a_full_net_pool_leaves_nothing() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let before = host_state();
    let (mut child, _lines, seen) = start_kept_sandbox_with("vanilla", &["--net-pool", "3"]);
    assert!(
        seen.contains("net pool: 3 of 3 attachments ready"),
        "{seen}"
    );
    assert!(seen.contains("net-claim"), "the sandbox claimed: {seen}");
    let tag = seen
        .lines()
        .find_map(|l| l.strip_prefix("sandbox bv")?.split('-').next())
        .unwrap_or_else(|| panic!("no sandbox line: {seen}"))
        .to_string();
    let prefix = format!("bv{tag}-pool");
    let state = PathBuf::from(format!("/run/burstvm/rt-{tag}"));
    let leases = state.join("ipam").join(format!("burstvm-{tag}"));
    let count_leases = || {
        std::fs::read_dir(&leases)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter(|e| {
                        e.file_name()
                            .to_string_lossy()
                            .parse::<std::net::Ipv4Addr>()
                            .is_ok()
                    })
                    .count()
            })
            .unwrap_or(0)
    };
    // The claimed one (now the sandbox's) and three refilled.
    let end = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while netutil::netns::list(&prefix).len() < 4 || count_leases() < 4 {
        assert!(
            std::time::Instant::now() < end,
            "pool not refilled: {:?}, {} leases",
            netutil::netns::list(&prefix),
            count_leases()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let ours = |pat: &str| -> Vec<u32> {
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|p| {
                std::fs::read(format!("/proc/{p}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(pat))
            })
            .collect()
    };
    let nic = ours(&format!("rt-{tag}/nic.sock"));
    assert_eq!(nic.len(), 1, "the NIC daemon runs");
    child.kill().unwrap();
    child.wait().unwrap();
    // Nothing cleaned up by the dead runtime itself.
    assert_eq!(netutil::netns::list(&prefix).len(), 4);
    assert!(state.exists());
    let o = burstvm(&["run", "--variant", "no-net"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains(&format!("netns bv{tag}-pool")),
        "the pooled netns were reaped: {}",
        text(&o)
    );
    assert!(netutil::netns::list(&format!("bv{tag}-")).is_empty());
    assert!(!state.exists(), "leases and NIC state are gone");
    let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !ours(&format!("rt-{tag}")).is_empty() {
        assert!(
            std::time::Instant::now() < end,
            "a process of the dead runtime lives"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_nothing_new(&before);
}
