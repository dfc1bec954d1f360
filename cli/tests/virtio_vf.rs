//! The vhost-user-net frontend end to end: the built-in agent drives a VF of
//! `burstvm nic` (passthrough in software); its request leaves through the
//! PF's uplink tap, where the test answers it. Sync and async VF driver init.

mod virtio_common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use virtio_common::{mac_str, serve_agent, stages, vmm_command, TestTap, Wire, GUEST_MAC};

const BURSTVM: &str = env!("CARGO_BIN_EXE_burstvm");

/// A `burstvm nic` daemon with one PF whose uplink is the test's tap; it is
/// stopped (SIGTERM, then SIGKILL) when dropped.
struct Nic {
    child: Child,
    control: PathBuf,
}

impl Nic {
    fn start(dir: &Path, uplink: &str) -> Nic {
        let control = dir.join("nic.sock");
        let child = Command::new(BURSTVM)
            .args(["nic", "--pf", "pf0", "--vfs", "2"])
            .args(["--uplink", &format!("tap:{uplink}")])
            .arg("--control")
            .arg(&control)
            .arg("--state-dir")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn burstvm nic");
        let mut nic = Nic { child, control };
        let end = Instant::now() + Duration::from_secs(30);
        while UnixStream::connect(&nic.control).is_err() {
            if let Some(st) = nic.child.try_wait().unwrap() {
                panic!("burstvm nic exited at start: {st}");
            }
            assert!(
                Instant::now() < end,
                "burstvm nic control socket never came up"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        nic
    }

    fn request(&self, req: serde_json::Value) -> serde_json::Value {
        let mut s = UnixStream::connect(&self.control).expect("connect to nic control");
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        writeln!(s, "{req}").unwrap();
        let mut line = String::new();
        BufReader::new(s)
            .read_line(&mut line)
            .expect("nic response");
        serde_json::from_str(&line).expect("nic response is JSON")
    }

    /// Allocate a VF for `sandbox` with the guest's MAC; returns (id, socket).
    fn alloc(&self, sandbox: &str) -> (String, String) {
        let r = self.request(serde_json::json!({
            "op": "alloc", "pf": "pf0", "sandbox": sandbox, "mac": mac_str(&GUEST_MAC)
        }));
        assert_eq!(r["ok"], true, "alloc: {r}");
        let vf = &r["vf"];
        (
            vf["id"].as_str().unwrap().into(),
            vf["socket"].as_str().unwrap().into(),
        )
    }

    fn vf_state(&self, id: &str) -> String {
        let r = self.request(serde_json::json!({"op": "get", "vf": id}));
        assert_eq!(r["ok"], true, "get: {r}");
        r["vf"]["state"].as_str().unwrap().into()
    }
}

impl Drop for Nic {
    fn drop(&mut self) {
        // SAFETY: signalling our own child by its pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let end = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn request_reply_over_vf(tag: &str, vf_init: &str, policy: &[&str]) {
    let uplink = TestTap::new(tag);
    let dir = tempfile::tempdir().unwrap();
    let nic = Nic::start(dir.path(), &uplink.0);
    let wire = Wire::open(&uplink.0);
    let sandbox = format!("sbx-{tag}-{}", std::process::id());
    let (vf, socket) = nic.alloc(&sandbox);
    let trace = dir.path().join("trace.jsonl");

    let child = vmm_command(BURSTVM, &sandbox, &format!("vf:{socket}"), vf_init, &trace)
        .args(policy)
        .spawn()
        .expect("spawn burstvm vmm");
    serve_agent(&wire, child, &sandbox, &trace, vf_init);

    let st = stages(&trace);
    let get = |name: &str| {
        st.iter()
            .find(|s| s.0 == name)
            .unwrap_or_else(|| panic!("stage {name} missing in {st:?}"))
            .clone()
    };
    let (open, boot) = (get("vf-open"), get("boot"));
    if vf_init == "sync" {
        assert!(
            open.2 <= boot.1,
            "sync: vf-open before the vCPU starts: {st:?}"
        );
    } else {
        // Async: the VF opens while the guest boots, before its first packet.
        assert!(open.1 <= get("ready").2, "{st:?}");
    }
    // The VMM is gone: its vhost-user session (the VF open) is closed.
    let state = nic.vf_state(&vf);
    assert_ne!(state, "open", "VF {vf} still open after the VMM exited");
}

#[test]
fn vf_request_reply_sync() {
    request_reply_over_vf(
        "vs",
        "sync",
        &[
            "--dma-ram",
            "true",
            "--dma-image",
            "true",
            "--memory-policy",
            "vanilla",
        ],
    );
}

#[test]
fn vf_request_reply_async_lazy() {
    request_reply_over_vf(
        "va",
        "async",
        &[
            "--dma-ram",
            "true",
            "--dma-image",
            "false",
            "--memory-policy",
            "lazy",
        ],
    );
}

#[test]
fn missing_vf_socket_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("no-such-vf.sock");
    let out = Command::new(BURSTVM)
        .args([
            "vmm",
            "--sandbox",
            "sbx-vferr",
            "--dma-ram",
            "true",
            "--timeout",
            "30",
        ])
        .arg("--net")
        .arg(format!("vf:{}", socket.display()))
        .output()
        .expect("run burstvm vmm");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&socket.display().to_string()) && err.contains("connect"),
        "{err}"
    );
}

#[test]
fn async_vf_open_failure_reaches_the_guest() {
    // Async: the VMM starts the vCPU at once; the failed open surfaces as
    // DEVICE_NEEDS_RESET, which the agent reports as ERROR 9.
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("no-such-vf.sock");
    let out = Command::new(BURSTVM)
        .args([
            "vmm",
            "--sandbox",
            "sbx-vfasync",
            "--dma-ram",
            "true",
            "--vf-init",
            "async",
        ])
        .args([
            "--ip",
            "10.77.0.2/24",
            "--server",
            "10.77.0.1:7777",
            "--timeout",
            "60",
        ])
        .arg("--net")
        .arg(format!("vf:{}", socket.display()))
        .output()
        .expect("run burstvm vmm");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ERR_DEVICE_FAILED"), "{err}");
    assert!(err.contains(&socket.display().to_string()), "{err}");
}
