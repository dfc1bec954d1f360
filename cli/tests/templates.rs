//! MicroVM templates end to end (docs/templates.md): the KVM state probe,
//! `burstvm template create`, sandboxes restored from it that skip the boot
//! and reach READY with their own app checksum, the isolation canary (what
//! one restored sandbox writes is never seen by another, nor written to the
//! template), a SIGKILLed restored VMM, `burstvm run --template`, and
//! `burstvm bench density` with and without a template.
//! Needs root and /dev/kvm.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

mod cli_common;
use cli_common::{burstvm, text, BIN};

/// VMs on a 2-core machine: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tmp(name: &str) -> Dir {
    let d = std::env::temp_dir().join(format!("bv-tmpl-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Dir(d)
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

fn vmm(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("vmm")
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

fn values(o: &Output) -> Vec<u32> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("value "))
        .filter_map(|l| l.split_whitespace().nth(1))
        .map(|h| u32::from_str_radix(h.trim_start_matches("0x"), 16).unwrap())
        .collect()
}

fn stages(trace: &Path, sandbox: &str) -> Vec<String> {
    let t = std::fs::read_to_string(trace).unwrap_or_default();
    t.lines()
        .filter(|l| l.contains(&format!("\"sandbox\":\"{sandbox}\"")))
        .filter_map(|l| l.split("\"stage\":\"").nth(1))
        .map(|s| s.split('"').next().unwrap().to_string())
        .collect()
}

#[test]
fn probe_saves_and_restores_every_kvm_state_and_the_guest_runs_on() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let o = burstvm(&["template", "probe"]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    for what in [
        "irqchip PIC master",
        "irqchip PIC slave",
        "irqchip IOAPIC",
        "pit2",
        "clock",
        "cpuid2",
        "mp_state",
        "regs",
        "sregs",
        "fpu",
        "xsave",
        "xcrs",
        "debugregs",
        "lapic",
        "msrs",
        "vcpu_events",
    ] {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("probe {what} ")))
            .unwrap_or_else(|| panic!("no probe line for {what}\n{}", text(&o)));
        assert!(
            line.contains("get ok") && line.ends_with("set ok"),
            "{line}"
        );
    }
    assert!(
        out.contains("probe resume: READY after every set"),
        "{}",
        text(&o)
    );
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn restored_sandboxes_skip_boot_and_never_see_each_other() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = tmp("iso");
    let o = burstvm(&[
        "template",
        "create",
        "t1",
        "--dir",
        d.0.to_str().unwrap(),
        "--app-size",
        "64K",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let tdir = d.0.join("t1");
    let before = files(&tdir);
    assert_eq!(
        before.iter().map(|f| f.0.as_str()).collect::<Vec<_>>(),
        ["image.mem", "ram.mem", "template.json"]
    );
    let t = tdir.to_str().unwrap();
    let trace = d.0.join("trace.jsonl");
    let tr = trace.to_str().unwrap();
    let canary_file = d.0.join("canary");
    std::fs::write(&canary_file, b"CANARY-A".repeat(8192)).unwrap();
    // The app payload starts right after the agent (< 64 KiB) at 0xc0000000:
    // these addresses lie inside a 64 KiB payload.
    let probe = "0xc0010000,0xc0014000";
    let pid = std::process::id();
    let (a, b, c) = (
        format!("tmplA-{pid}"),
        format!("tmplB-{pid}"),
        format!("tmplC-{pid}"),
    );

    // A: restored, writes its canary payload, stays up.
    let mut sa = Command::new(BIN)
        .args(["vmm", "--sandbox", &a, "--template", t, "--trace", tr])
        .args([
            "--app-file",
            canary_file.to_str().unwrap(),
            "--keep-running",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !stages(&trace, &a).iter().any(|s| s == "ready") {
        assert!(Instant::now() < deadline, "A never got ready");
        assert!(sa.try_wait().unwrap().is_none(), "A exited");
        std::thread::sleep(Duration::from_millis(20));
    }
    // B, from the same template while A runs: no payload of its own; it
    // reads where A's canary lies in A's memory and sees the template's zeros.
    let ob = vmm(&[
        "--sandbox",
        &b,
        "--template",
        t,
        "--trace",
        tr,
        "--probe",
        probe,
    ]);
    assert!(ob.status.success(), "{}", text(&ob));
    assert_eq!(values(&ob), [0, 0, 0, 0], "{}", text(&ob));
    // The same probe in a sandbox that wrote the canary itself sees it.
    let oc = Command::new(BIN)
        .args(["vmm", "--sandbox", &c, "--template", t, "--probe", probe])
        .args(["--app-file", canary_file.to_str().unwrap()])
        .output()
        .unwrap();
    let canary = u32::from_le_bytes(*b"CANA");
    assert_eq!(values(&oc)[0], canary, "{}", text(&oc));

    // A SIGKILLed restored VMM leaves nothing behind: no file appears, and
    // the template is byte for byte what it was.
    // SAFETY: a child we spawned and have not reaped.
    unsafe { libc::kill(sa.id() as i32, libc::SIGKILL) };
    let _ = sa.wait();
    assert!(files(&tdir) == before, "the template changed");

    // Restored sandboxes skip the boot: a restore stage, no boot stage.
    for s in [&a, &b] {
        let st = stages(&trace, s);
        assert!(st.contains(&"restore".to_string()), "{s}: {st:?}");
        assert!(st.contains(&"ready".to_string()), "{s}: {st:?}");
        assert!(!st.contains(&"boot".to_string()), "{s}: {st:?}");
    }
    // A payload larger than the template was sized for is refused by name.
    let o = vmm(&["--sandbox", &b, "--template", t, "--app-size", "4M"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--app-size"), "{}", text(&o));
}

#[test]
fn run_starts_from_a_named_template_and_leaves_nothing() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = tmp("run");
    let dir = d.0.to_str().unwrap();
    let o = burstvm(&["template", "create", "t2", "--dir", dir]);
    assert!(o.status.success(), "{}", text(&o));
    let trace = d.0.join("run.jsonl");
    // `window`: a VF whose only shared memory is a fresh DMA window beside
    // the template's private copy-on-write memory.
    for variant in ["no-net", "tap", "window"] {
        let o = burstvm(&[
            "run",
            "--variant",
            variant,
            "--template",
            "t2",
            "--template-dir",
            dir,
            "--trace",
            trace.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{variant}: {}", text(&o));
        assert!(text(&o).contains("clean"), "{variant}: {}", text(&o));
    }
    let t = std::fs::read_to_string(&trace).unwrap();
    assert!(t.contains("\"stage\":\"restore\""), "{t}");
    assert!(t.contains("\"stage\":\"dma-window\""), "{t}");
    assert!(!t.contains("\"stage\":\"boot\""), "{t}");
    // A VF cannot map a template's private memory: refused by name.
    let o = burstvm(&[
        "run",
        "--variant",
        "fastiov",
        "--template",
        "t2",
        "--template-dir",
        dir,
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("copy-on-write"), "{}", text(&o));
    let o = burstvm(&["template", "create", "t2", "--dir", dir]);
    assert!(
        !o.status.success() && text(&o).contains("--force"),
        "{}",
        text(&o)
    );
}

#[test]
fn density_measures_each_idle_sandbox_booted_and_from_a_template() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = tmp("density");
    let dir = d.0.to_str().unwrap();
    let o = burstvm(&["template", "create", "t3", "--dir", dir]);
    assert!(o.status.success(), "{}", text(&o));
    let json = d.0.join("density.json");
    let o = burstvm(&[
        "bench",
        "density",
        "--sandboxes",
        "3",
        "--more",
        "2",
        "--template",
        "t3",
        "--template-dir",
        dir,
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let levels: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let levels = levels.as_array().unwrap();
    let modes: Vec<_> = levels.iter().map(|l| l["mode"].as_str().unwrap()).collect();
    assert_eq!(modes, ["boot", "template"], "{}", text(&o));
    for l in levels {
        assert_eq!(l["running"], 3, "{l}");
        assert!(l["limit"].is_null(), "{l}");
        assert!(l["vmm_pss"].as_u64().unwrap() > 0, "{l}");
        assert!(l["threads"].as_f64().unwrap() >= 1.0, "{l}");
        assert!(l["fds"].as_f64().unwrap() >= 3.0, "{l}");
        assert_eq!(l["more"], 2, "{l}");
        assert!(l["more_avg_ms"].as_f64().unwrap() > 0.0, "{l}");
        assert_eq!(l["teardown_errors"], serde_json::json!([]), "{l}");
        let leaks = &l["leaks"];
        for k in [
            "netns",
            "links",
            "cgroups",
            "vmm_pids",
            "rootfs_layers",
            "errors",
        ] {
            assert_eq!(leaks[k], serde_json::json!([]), "{k}: {l}");
        }
        assert_eq!(leaks["pool_lent_memfds"], 0, "{l}");
    }
    assert!(text(&o).contains("leaks: none"), "{}", text(&o));
}
