//! How a running guest can end the VMM: each way gives a non-zero exit and a
//! message that says which. The guests are tiny hand-assembled ELF "kernels"
//! (no PVH note, so they enter through the 64-bit boot protocol in long mode).

mod vmm_common;

use std::path::{Path, PathBuf};

use vmm_common::*;

const LOAD: u64 = 0x10_0000;

/// An ELF64 executable with one PT_LOAD of `code` at physical LOAD.
fn tiny_elf(dir: &Path, name: &str, code: &[u8]) -> PathBuf {
    let mut f = Vec::new();
    f.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    f.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    f.extend_from_slice(&0x3eu16.to_le_bytes()); // x86-64
    f.extend_from_slice(&1u32.to_le_bytes());
    f.extend_from_slice(&LOAD.to_le_bytes()); // e_entry
    f.extend_from_slice(&64u64.to_le_bytes()); // e_phoff
    f.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    f.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    for v in [64u16, 56, 1, 64, 0, 0] {
        f.extend_from_slice(&v.to_le_bytes()); // ehsize, phentsize, phnum, shentsize, shnum, shstrndx
    }
    f.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    f.extend_from_slice(&5u32.to_le_bytes()); // R+X
    for v in [
        0x1000u64,
        LOAD,
        LOAD,
        code.len() as u64,
        code.len() as u64,
        0x1000,
    ] {
        f.extend_from_slice(&v.to_le_bytes()); // offset, vaddr, paddr, filesz, memsz, align
    }
    f.resize(0x1000, 0);
    f.extend_from_slice(code);
    let p = dir.join(name);
    std::fs::write(&p, f).unwrap();
    p
}

/// `outl DATA=data; outb EVENT=event; jmp .`
fn agent_event(event: u8, data: u32) -> Vec<u8> {
    let mut c = vec![0x66, 0xba, 0x04, 0x0f, 0xb8]; // mov dx, 0x0f04; mov eax, imm32
    c.extend_from_slice(&data.to_le_bytes());
    c.extend_from_slice(&[0xef, 0x66, 0xba, 0x00, 0x0f, 0xb0, event, 0xee]); // out; mov dx, 0x0f00; mov al, ev; out
    c.extend_from_slice(&[0xeb, 0xfe]);
    c
}

fn run_guest(code: &[u8], extra: &[&str]) -> (bool, String, String) {
    assert!(kvm_available(), "/dev/kvm is required");
    let dir = tempdir();
    let k = tiny_elf(dir.path(), "guest.elf", code);
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
