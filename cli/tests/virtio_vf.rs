//! The vhost-user-net frontend end to end: the built-in agent drives a VF of
//! `burstvm nic` (passthrough in software); its request leaves through the
//! PF's uplink tap, where the test answers it. Sync and async VF driver init.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nic_api::Client;
use nic_api::VfState;
use testutil::tap::{
    mac_str, serve_agent, stages, stop_child, vmm_command_mac, TestTap, Wire, GUEST_MAC, LAZY_DMA,
    VANILLA_DMA,
};

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
        while Client::connect(&nic.control).is_err() {
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

    fn client(&self) -> Client {
        Client::connect(&self.control).expect("connect to nic control")
    }

    /// Allocate a VF for `sandbox` with the guest's MAC; returns (id, socket).
    fn alloc(&self, sandbox: &str) -> (String, String) {
        let vf = self
            .client()
            .alloc("pf0", sandbox, Some(&mac_str(&GUEST_MAC)), None)
            .expect("alloc");
        (vf.id, vf.socket.display().to_string())
    }

    fn vf_state(&self, id: &str) -> VfState {
        self.client().get_by_id(id).expect("get").state
    }
}

impl Drop for Nic {
    fn drop(&mut self) {
        stop_child(&mut self.child);
    }
}

fn request_reply_over_vf(tag: &str, vf_init: &str, policy: &[&str]) {
    request_reply_over_vf_mac(tag, vf_init, policy, Some(GUEST_MAC));
}

/// The VF has the guest's MAC (GUEST_MAC); the VMM gets `--mac` only if `mac`.
fn request_reply_over_vf_mac(tag: &str, vf_init: &str, policy: &[&str], mac: Option<[u8; 6]>) {
    let uplink = TestTap::new(tag);
    let dir = tempfile::tempdir().unwrap();
    let nic = Nic::start(dir.path(), &uplink.0);
    let wire = Wire::open(&uplink.0);
    let sandbox = format!("sbx-{tag}-{}", std::process::id());
    let (vf, socket) = nic.alloc(&sandbox);
    let trace = dir.path().join("trace.jsonl");

    let child = vmm_command_mac(
        BURSTVM,
        &sandbox,
        &format!("vf:{socket}"),
        vf_init,
        &trace,
        mac,
    )
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
    assert_ne!(
        state,
        VfState::Open,
        "VF {vf} still open after the VMM exited"
    );
}

#[test]
fn vf_request_reply_sync() {
    request_reply_over_vf("vs", "sync", VANILLA_DMA);
}

#[test]
fn vf_request_reply_async_lazy() {
    request_reply_over_vf("va", "async", LAZY_DMA);
}

/// Without `--mac` the guest uses the VF's own MAC, which the NIC reports
/// (passthrough semantics): its frames pass the NIC's spoof check. The async
/// path, where the agent reads the MAC from the device after link-up.
#[test]
fn vf_without_mac_uses_the_vf_mac() {
    request_reply_over_vf_mac("vm", "async", LAZY_DMA, None);
}

/// `--mac` that is not the VF's: refused before the guest runs, naming both.
#[test]
fn vf_with_a_foreign_mac_is_refused() {
    let uplink = TestTap::new("vx");
    let dir = tempfile::tempdir().unwrap();
    let nic = Nic::start(dir.path(), &uplink.0);
    let sandbox = format!("sbx-vx-{}", std::process::id());
    let (_, socket) = nic.alloc(&sandbox);
    let trace = dir.path().join("trace.jsonl");
    let out = vmm_command_mac(
        BURSTVM,
        &sandbox,
        &format!("vf:{socket}"),
        "sync",
        &trace,
        Some([2, 0, 0, 0, 0, 0x99]),
    )
    .args(VANILLA_DMA)
    .output()
    .expect("run burstvm vmm");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("02:00:00:00:00:99") && err.contains(&mac_str(&GUEST_MAC)),
        "{err}"
    );
}

/// Runs the VMM (with `args`) against a VF socket that does not exist and
/// expects it to fail; returns the socket path and stderr.
fn run_without_vf(args: &[&str]) -> (String, String) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("no-such-vf.sock");
    let out = Command::new(BURSTVM)
        .args(["vmm", "--dma-ram", "true"])
        .args(args)
        .arg("--net")
        .arg(format!("vf:{}", socket.display()))
        .output()
        .expect("run burstvm vmm");
    assert!(!out.status.success());
    (
        socket.display().to_string(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn missing_vf_socket_is_a_clear_error() {
    let (socket, err) = run_without_vf(&["--sandbox", "sbx-vferr", "--timeout", "30"]);
    assert!(err.contains(&socket) && err.contains("connect"), "{err}");
}

#[test]
fn async_vf_open_failure_reaches_the_guest() {
    // Async: the VMM starts the vCPU at once; the failed open surfaces as
    // DEVICE_NEEDS_RESET, which the agent reports as ERROR 9.
    let (socket, err) = run_without_vf(&[
        "--sandbox",
        "sbx-vfasync",
        "--vf-init",
        "async",
        "--ip",
        "10.77.0.2/24",
        "--server",
        "10.77.0.1:7777",
        "--timeout",
        "60",
    ]);
    assert!(err.contains("ERR_DEVICE_FAILED"), "{err}");
    assert!(err.contains(&socket), "{err}");
}
