//! The executables burstvm runs once per sandbox or attachment are linked
//! static and position-dependent (cli/build.rs): no loader, no relocations
//! at exec. The shim, a long-running daemon per pod, keeps its ASLR.

use std::path::Path;

const ET_EXEC: u16 = 2;
const ET_DYN: u16 = 3;
const PT_INTERP: u32 = 3;

/// (e_type, whether a PT_INTERP header names a dynamic loader).
fn elf_kind(path: &Path) -> (u16, bool) {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&b[..4], b"\x7fELF", "{}", path.display());
    assert_eq!(b[4], 2, "{}: not ELF64", path.display());
    let le = |o: usize, n: usize| (0..n).rev().fold(0u64, |v, i| v << 8 | u64::from(b[o + i]));
    let u16_at = |o: usize| le(o, 2) as u16;
    let u32_at = |o: usize| le(o, 4) as u32;
    let u64_at = |o: usize| le(o, 8);
    let (phoff, phentsize, phnum) = (u64_at(32) as usize, u16_at(54) as usize, u16_at(56));
    let interp = (0..phnum as usize).any(|i| u32_at(phoff + i * phentsize) == PT_INTERP);
    (u16_at(16), interp)
}

#[test]
fn per_start_executables_are_static_and_position_dependent() {
    for exe in [
        env!("CARGO_BIN_EXE_burstvm-vmm"),
        env!("CARGO_BIN_EXE_burstvm-cni"),
        env!("CARGO_BIN_EXE_burstvm-ipam"),
    ] {
        assert_eq!(elf_kind(Path::new(exe)), (ET_EXEC, false), "{exe}");
    }
    let (shim_type, shim_interp) =
        elf_kind(Path::new(env!("CARGO_BIN_EXE_containerd-shim-burstvm-v2")));
    assert_eq!(shim_type, ET_DYN, "the shim stays position-independent");
    assert!(!shim_interp, "the shim is static too (static-pie)");
}
