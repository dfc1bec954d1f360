//! How a running guest can end the VMM: each way gives a non-zero exit and a
//! message that says which (READY and the i8042 reset end it with status 0). The guests are tiny hand-assembled ELF "kernels"
//! (no PVH note, so they enter through the 64-bit boot protocol in long mode).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod vmm_common;

use vmm_common::*;

fn run_guest(code: &[u8], extra: &[&str]) -> (bool, String, String) {
    assert!(kvm_available(), "/dev/kvm is required");
    let dir = tempdir();
    let k = tiny_elf(dir.path(), "guest.elf", LOW_LOAD, code);
    let out = run(burstvm()
        .args([
            "--sandbox",
            &unique("vmmexit"),
            "--memory",
            "16M",
            "--kernel",
            k.to_str().unwrap(),
        ])
        .args(extra));
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

#[test]
fn triple_fault_is_reported() {
    // ud2 with no IDT: #UD → #DF → triple fault.
    let (ok, _, err) = run_guest(&[0x0f, 0x0b], &[]);
    assert!(!ok);
    assert!(
        err.contains("triple fault") && err.contains("rip=0x100000"),
        "{err}"
    );
}

#[test]
fn agent_error_is_named() {
    let (ok, _, err) = run_guest(&agent_event(0x08, 6), &[]);
    assert!(!ok);
    assert!(
        err.contains("ERROR 6") && err.contains("ERR_LINK_TIMEOUT"),
        "{err}"
    );
}

#[test]
fn guest_exit_before_ready_is_a_failure() {
    let (ok, _, err) = run_guest(&agent_event(0x09, 3), &[]);
    assert!(!ok);
    assert!(err.contains("exited with status 3"), "{err}");
}

#[test]
fn timeout_is_reported() {
    let (ok, _, err) = run_guest(&[0xeb, 0xfe], &["--timeout", "1"]);
    assert!(!ok);
    assert!(err.contains("timeout") && err.contains("1 s"), "{err}");
}

#[test]
fn ready_from_any_guest_ends_with_status_zero() {
    let (ok, out, err) = run_guest(&agent_event(0x06, 0), &[]);
    assert!(ok, "{err}");
    assert!(out.contains("ready"), "{out}");
}

#[test]
fn unknown_ports_and_mmio_are_ignored() {
    // in al, 0x80 (nothing there); mov [0xd0005000], eax (unmapped MMIO); then READY.
    let mut code = vec![0xe4, 0x80, 0xa3];
    code.extend_from_slice(&0xd000_5000u64.to_le_bytes()); // movabs [moffs64], eax
    code.extend_from_slice(&agent_event(0x06, 0));
    let (ok, _, err) = run_guest(&code, &[]);
    assert!(ok, "{err}");
}

#[test]
fn hlt_with_interrupts_off_is_named() {
    // cli; hlt: with the in-kernel irqchip KVM keeps the vCPU halted, so the
    // deadline ends it and the message says where the vCPU was.
    let (ok, _, err) = run_guest(&[0xfa, 0xf4], &["--timeout", "1"]);
    assert!(!ok);
    assert!(
        err.contains("timeout") && err.contains("vCPU 0 executed hlt with interrupts off"),
        "{err}"
    );
}

#[test]
fn executing_from_unbacked_memory_is_an_emulation_failure() {
    // mov rax, 0xd0005000; jmp rax: instruction fetch from a hole KVM cannot emulate.
    let mut code = vec![0x48, 0xb8];
    code.extend_from_slice(&0xd000_5000u64.to_le_bytes());
    code.extend_from_slice(&[0xff, 0xe0]);
    let (ok, _, err) = run_guest(&code, &["--timeout", "10"]);
    assert!(!ok);
    assert!(
        err.contains("instruction emulation failure on vCPU 0"),
        "{err}"
    );
}

#[test]
fn i8042_reset_ends_the_vmm_with_status_zero() {
    // Firecracker's test guest (what `bench vmm` boots on both VMMs): serial
    // output, then the reset, then hlt forever, so only the reset ends it.
    let (ok, out, err) = run_guest(vmm::tiny_guest::SERIAL_THEN_RESET, &["--timeout", "20"]);
    assert!(ok, "{err}");
    assert!(out.contains("R\n") && out.contains("i8042 reset"), "{out}");
}

#[test]
fn every_vcpu_stops_on_one_kick_under_load() {
    // Every vCPU loops on: an I/O exit (mostly outside KVM_RUN, where a kick
    // must still make the next KVM_RUN return) and a short spin inside it
    // (where the kick's signal interrupts it). The deadline stops them: each
    // vCPU must record where it stopped, and none may be left running.
    let code = [
        0xe6, 0x80, // out 0x80, al
        0xb9, 0xe8, 0x03, 0x00, 0x00, // mov ecx, 1000
        0xe2, 0xfe, // loop .
        0xeb, 0xf5, // jmp to the out
    ];
    let (ok, _, err) = run_guest(&code, &["--vcpus", "4", "--timeout", "1"]);
    assert!(!ok);
    for id in 0..4 {
        assert!(err.contains(&format!("vCPU {id} running")), "{err}");
    }
    assert!(!err.contains("did not stop"), "{err}");
}
