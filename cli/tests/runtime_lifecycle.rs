//! Integration tests of sandboxes that outlive a `burstvm run` call
//! (`--keep-running`): torn down on SIGINT, reaped by the next runtime when
//! killed; the tap baseline through the reference bridge plugin; the network
//! pool claimed, refilled and released, and left clean by a killed runtime.
//! They need root, /dev/kvm, iproute2 and host-local/bridge (in /opt/cni/bin).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

mod cli_common;
mod startup_common;
use cli_common::{burstvm, text, BIN, CNI_BIN};
use startup_common::*;

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
    let summary = read_summary(&out);
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
    // The pool's netns and CNI ADD cost CPU too, reported apart from the
    // pooled starts (the unpooled ones pay theirs in the CNI column).
    let refill = |g: &Value| g["cpu"]["pool_refill_ms"].as_f64().unwrap();
    assert_eq!(refill(&groups[0]), 0.0, "{}", groups[0]);
    assert!(refill(&groups[1]) > 0.0, "{}", groups[1]);
    assert!(all.contains("pool refill"), "{all}");
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
