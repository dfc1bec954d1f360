//! `burstvm vmm` boots the built-in agent to READY: exit status, summary,
//! trace stages and their order, --ready-fd, policies, SIGTERM.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod vmm_common;

use std::io::Read;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use vmm_common::*;

fn names(st: &[(String, String, u64, u64)]) -> Vec<&str> {
    st.iter().map(|s| s.1.as_str()).collect()
}

#[test]
fn agent_boots_to_ready_with_ordered_stages() {
    assert!(kvm_available(), "/dev/kvm is required");
    let dir = tempdir();
    let trace = dir.path().join("trace.jsonl");
    let sb = unique("vmmboot");
    let (mut rd, wr) = ready_pipe();
    let out = run(burstvm()
        .args(["--sandbox", &sb, "--memory", "64M", "--app-size", "256K"])
        .args(["--trace", trace.to_str().unwrap()])
        .args(["--ready-fd", &wr.as_raw_fd().to_string()]));
    drop(wr);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "stdout: {stdout}\nstderr: {}",
        text(&out.stderr)
    );
    // The summary names every stage, one line each.
    for s in ["vmm-spawn", "boot", "app-launch", "ready"] {
        assert!(
            stdout.lines().any(|l| l.contains(&sb) && l.contains(s)),
            "{s} missing in {stdout}"
        );
    }
    let mut msg = Vec::new();
    rd.read_to_end(&mut msg).unwrap();
    let ready = vmm::Ready::parse(&msg)
        .expect("a whole READY line")
        .unwrap();
    // No lazy zeroing (fresh memory): nothing is deferred past READY.
    assert_eq!(
        msg,
        format!("{}{}", ready.line(), vmm::ZEROED_LINE).as_bytes(),
        "READY, then at once the end of the deferred zeroing, nothing else"
    );
    assert!(ready.vcpu_ns > 0, "the guest ran on its vCPU: {ready:?}");

    let st = stages(&trace);
    assert!(st.iter().all(|s| s.0 == sb && s.2 <= s.3), "{st:?}");
    assert_eq!(names(&st), ["vmm-spawn", "boot", "app-launch", "ready"]);
    // Stages follow each other in time; ready starts where app-launch ended.
    for w in st.windows(2) {
        assert!(
            w[0].3 <= w[1].2,
            "{} ends after {} starts: {st:?}",
            w[0].1,
            w[1].1
        );
    }
    assert_eq!(st[3].2, st[2].3);
}

#[test]
fn dma_stages_follow_the_dma_flags() {
    assert!(kvm_available(), "/dev/kvm is required");
    let dir = tempdir();
    for (dma_image, policy) in [("false", "lazy"), ("true", "vanilla")] {
        let trace = dir.path().join(format!("trace-{dma_image}.jsonl"));
        let sb = unique(&format!("vmmdma{dma_image}"));
        let out = run(burstvm()
            .args([
                "--sandbox",
                &sb,
                "--memory",
                "32M",
                "--memory-policy",
                policy,
            ])
            .args(["--dma-ram", "true", "--dma-image", dma_image])
            .args(["--trace", trace.to_str().unwrap()]));
        assert!(out.status.success(), "{}", text(&out.stderr));
        let st = stages(&trace);
        let n = names(&st);
        let want: Vec<&str> = if dma_image == "true" {
            vec![
                "vmm-spawn",
                "dma-ram",
                "dma-image",
                "boot",
                "app-launch",
                "ready",
            ]
        } else {
            vec!["vmm-spawn", "dma-ram", "boot", "app-launch", "ready"]
        };
        assert_eq!(n, want);
    }
}

#[test]
fn spawn_time_from_the_environment_starts_vmm_spawn() {
    assert!(kvm_available(), "/dev/kvm is required");
    let dir = tempdir();
    let trace = dir.path().join("t.jsonl");
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime fills the timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let t0 = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
    let out = run(burstvm().env("BURSTVM_SPAWN_NS", t0.to_string()).args([
        "--sandbox",
        &unique("vmmenv"),
        "--trace",
        trace.to_str().unwrap(),
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let st = stages(&trace);
    assert_eq!(st[0].1, "vmm-spawn");
    assert_eq!(st[0].2, t0);
}

#[test]
fn two_vcpus_boot() {
    assert!(kvm_available(), "/dev/kvm is required");
    let out = run(burstvm().args(["--sandbox", &unique("vmmsmp"), "--vcpus", "2"]));
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn sigterm_ends_a_kept_running_vm_promptly() {
    assert!(kvm_available(), "/dev/kvm is required");
    let (mut rd, wr) = ready_pipe();
    let mut child = burstvm()
        .args(["--sandbox", &unique("vmmterm"), "--keep-running"])
        .args(["--ready-fd", &wr.as_raw_fd().to_string()])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    drop(wr);
    let ready = read_ready(&mut rd);
    assert!(ready.vcpu_ns > 0, "the guest ran on its vCPU: {ready:?}");
    // Still running after READY.
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        child.try_wait().unwrap().is_none(),
        "--keep-running VMM exited after READY"
    );
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let t = Instant::now();
    // Bounded wait so a hang fails the test instead of blocking the suite.
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("VMM did not exit on SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // After READY a SIGTERM is the normal way to stop it: status 0.
    assert!(status.success(), "{status:?}");
}

#[test]
fn probe_mode_reports_guest_memory_as_values() {
    assert!(kvm_available(), "/dev/kvm is required");
    // 0x7000 holds the boot-info magic "BURSTVM1"; 0x500 the GDT's null entry.
    let out = run(burstvm().args(["--sandbox", &unique("vmmprobe"), "--probe", "0x7000,0x500"]));
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let values: Vec<&str> = stdout.lines().filter(|l| l.starts_with("value ")).collect();
    assert_eq!(
        values,
        [
            "value 0 0x544d5631",
            "value 1 0x42555253",
            "value 2 0x00000000",
            "value 3 0x00000000"
        ]
    );
}

/// The agent does its work at CPL3 (docs/guest.md, "The agent at CPL3") and names the ring of
/// a fault: a probe beyond its 4 GiB identity map is a page fault in user mode (CS 0x23), or
/// in kernel mode (CS 0x08) with `--agent-cpl0`. Both modes checksum the app payload alike.
#[test]
fn the_agent_works_in_user_mode_and_reports_a_faults_ring() {
    assert!(kvm_available(), "/dev/kvm is required");
    for (extra, cs) in [
        (&[][..], "0x00000023"),
        (&["--agent-cpl0"][..], "0x00000008"),
    ] {
        let out = run(burstvm()
            .args(["--sandbox", &unique("vmmring"), "--probe", "0x100000000"])
            .args(extra));
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(!out.status.success(), "{extra:?}: {stdout}");
        assert!(stderr.contains("ERR_EXCEPTION"), "{extra:?}: {stderr}");
        let values: Vec<String> = stdout
            .lines()
            .filter(|l| l.starts_with("value "))
            .map(str::to_string)
            .collect();
        assert_eq!(values.len(), 5, "{extra:?}: {stdout}");
        assert_eq!(values[0], "value 0 0x0000000e", "{extra:?}: #PF expected");
        assert_eq!(
            values[2..],
            [
                "value 2 0x00000000".to_string(),
                "value 3 0x00000001".to_string(),
                format!("value 4 {cs}")
            ],
            "{extra:?}: CR2 = 4 GiB and the ring"
        );
        let out = run(burstvm()
            .args(["--sandbox", &unique("vmmring"), "--app-size", "64K"])
            .args(extra));
        assert!(out.status.success(), "{extra:?}: {}", text(&out.stderr));
    }
}

#[test]
fn a_supported_cpuid_file_replaces_the_kvm_query() {
    assert!(kvm_available(), "/dev/kvm is required");
    let dir = tempdir();
    let file = dir.path().join("supported-cpuid.json");
    vmm::supported_cpuid::write_from_dev_kvm(&file).unwrap();
    let boot = |f: &std::path::Path| {
        run(burstvm()
            .args(["--sandbox", &unique("vmmcpuid"), "--vcpus", "2"])
            .arg("--supported-cpuid")
            .arg(f))
    };
    let out = boot(&file);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // The VMM takes the file's leaves, not KVM's: KVM_SET_CPUID2 refuses 40
    // virtual-address bits in leaf 0x80000008 (only 48 and 57 exist).
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    // kvm-bindings serializes an entry as its 40 bytes: function at 0..4, eax at 12..16.
    let mut found = false;
    for e in json["entries"].as_array_mut().unwrap() {
        let b: Vec<u64> = e
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        if b[..4] == [8, 0, 0, 0x80] {
            e[13] = 40.into(); // eax[15:8], the linear-address width
            found = true;
        }
    }
    assert!(found, "no leaf 0x80000008 in {json}");
    let bad = dir.path().join("bad-cpuid.json");
    std::fs::write(&bad, serde_json::to_vec(&json).unwrap()).unwrap();
    let out = boot(&bad);
    let err = text(&out.stderr);
    assert!(
        !out.status.success() && err.contains("KVM_SET_CPUID2"),
        "booted with 40-bit virtual addresses: {err}"
    );
    // A file that is not one is named.
    std::fs::write(&bad, b"{").unwrap();
    let out = boot(&bad);
    let err = text(&out.stderr);
    assert!(
        !out.status.success() && err.contains("bad-cpuid.json"),
        "{err}"
    );
}
