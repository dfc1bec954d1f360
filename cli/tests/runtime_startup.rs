//! Integration tests of the sandbox runtime: `burstvm run` and
//! `burstvm bench startup` against the real VMM, NIC daemon and CNI plugin:
//! every variant's stages, a concurrent burst, a VMM killed mid-boot, bad
//! arguments. Kept sandboxes, teardown by signal or by the next runtime, the
//! tap bridge and the network pool are in runtime_lifecycle.rs.
//! They need root, /dev/kvm, iproute2 and host-local (in /opt/cni/bin).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod cli_common;
mod startup_common;
use cli_common::{burstvm, text, BIN};
use startup_common::*;

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
    let summary = read_summary(&out);
    let groups = summary["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 12);
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
        let (vmm, vcpu) = (
            g["cpu"]["vmm_ms"].as_f64().unwrap(),
            g["cpu"]["vcpu_ms"].as_f64().unwrap(),
        );
        assert!(vmm > 0.0, "{v}: {g}");
        // The guest ran, and its vCPU thread is a part of the VMM's CPU.
        assert!(
            vcpu > 0.0 && vcpu <= vmm,
            "{v}: vCPU {vcpu} of VMM {vmm}: {g}"
        );
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
    assert_eq!(trace.by_sandbox.len(), 12);
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
    let summary = read_summary(&out);
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

/// `--repeat 2`: each variant's measured round runs twice, interleaved; its
/// group pools both rounds' sandboxes (their trace too) and keeps each
/// round's CPU per start, and the CPU table gains the per-repetition ratios
/// to no-net with their median. One warm-up per variant. Nothing leaks.
#[test]
fn repeated_rounds_pool_their_sandboxes_and_give_per_repetition_ratios() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let before = host_state();
    let out = tempdir("repeat");
    let o = burstvm(&[
        "bench",
        "startup",
        "--concurrency",
        "2",
        "--variants",
        "no-net,fastiov",
        "--memory",
        "32M",
        "--repeat",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    let all = text(&o);
    assert!(o.status.success(), "{all}");
    let summary = read_summary(&out);
    for g in summary["groups"].as_array().unwrap() {
        assert_eq!(
            (g["rounds"].as_u64(), g["ready"].as_u64()),
            (Some(2), Some(4)),
            "{g}"
        );
        assert_eq!(
            g["cpu_total_per_round"].as_array().map(|v| v.len()),
            Some(2),
            "{g}"
        );
    }
    assert_eq!(summary["groups"][1]["answered"], 4);
    // Interleaved: no-net's second round after fastiov's first.
    let order: Vec<&str> = all
        .lines()
        .filter(|l| l.contains("measured round"))
        .map(|l| l.split(' ').next().unwrap())
        .collect();
    assert_eq!(order, ["no-net", "fastiov", "no-net", "fastiov"], "{all}");
    assert_eq!(all.matches("warm-up round").count(), 2, "{all}");
    let table = all
        .split("each of the 2 repetitions")
        .nth(1)
        .unwrap_or_else(|| panic!("no repetition table: {all}"));
    let row = table
        .lines()
        .find(|l| l.starts_with("fastiov"))
        .expect("fastiov row");
    assert_eq!(row.split_whitespace().count(), 5, "{row}"); // variant, n, rep1, rep2, median
    assert_eq!(read_trace(&out.join("trace.jsonl")).by_sandbox.len(), 8);
    for lc in summary["leak_checks"].as_array().unwrap() {
        assert_eq!(lc["clean"], true, "{lc}");
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
    for args in [
        &["--repeat", "0"][..],
        &["--repeat", "2", "--via", "cri"][..],
    ] {
        let o = burstvm(&[&["bench", "startup"][..], args].concat());
        assert!(!o.status.success());
        assert!(text(&o).contains("--repeat"), "{}", text(&o));
    }
    let o = burstvm(&["run", "--memory", "12Q"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--memory"), "{}", text(&o));
}

/// `--hugepages` (FastIOV's setting): fastiov and window sandboxes on 2 MiB
/// hugetlb pages reach READY and are answered over their VFs; the pages the
/// bench reserved are given back; a memory size that is not whole hugepages
/// is refused with the flag named.
#[test]
fn hugepage_backed_vf_sandboxes_reach_ready_and_the_pages_go_back() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const NR: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages";
    let nr = || std::fs::read_to_string(NR).unwrap().trim().to_string();
    let (before, pages) = (host_state(), nr());
    let out = tempdir("huge");
    let o = burstvm(&[
        "bench",
        "startup",
        "--concurrency",
        "4",
        "--variants",
        "no-net,fastiov,window",
        "--memory",
        "32M",
        "--hugepages",
        "--no-warmup",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let summary = read_summary(&out);
    assert_eq!(summary["hugepages"], true, "{summary}");
    for g in summary["groups"].as_array().unwrap() {
        assert_eq!(
            (g["ready"].as_u64(), g["failed"].as_u64()),
            (Some(4), Some(0)),
            "{g}"
        );
        if g["variant"] != "no-net" {
            assert_eq!(g["answered"], 4, "{g}");
        }
    }
    assert_eq!(nr(), pages, "the reserved hugepages are given back");
    assert_nothing_new(&before);
    std::fs::remove_dir_all(&out).unwrap();

    let o = burstvm(&["bench", "startup", "--memory", "33M", "--hugepages"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--memory"), "{}", text(&o));
}
