//! The executables burstvm runs once per sandbox or attachment are linked
//! static and position-dependent (cli/build.rs): no loader, no relocations
//! at exec. The shim, a long-running daemon per pod, keeps its ASLR.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use linux_loader::elf::{self, Elf64_Ehdr as Ehdr, Elf64_Phdr as Phdr};
use vm_memory::ByteValued;

const ET_EXEC: u16 = 2;
const ET_DYN: u16 = 3;

/// (e_type, whether a PT_INTERP header names a dynamic loader).
fn elf_kind(path: &Path) -> (u16, bool) {
    let ctx = |e: std::io::Error| format!("{}: {e}", path.display());
    let mut f = File::open(path).unwrap_or_else(|e| panic!("{}", ctx(e)));
    let mut ehdr = Ehdr::default();
    f.read_exact(ehdr.as_mut_slice())
        .unwrap_or_else(|e| panic!("{}", ctx(e)));
    assert_eq!(&ehdr.e_ident[..4], b"\x7fELF", "{}", path.display());
    assert_eq!(
        ehdr.e_ident[elf::EI_DATA],
        elf::ELFDATA2LSB,
        "{}",
        path.display()
    );
    assert_eq!(
        usize::from(ehdr.e_phentsize),
        size_of::<Phdr>(),
        "{}",
        path.display()
    );
    f.seek(SeekFrom::Start(ehdr.e_phoff))
        .unwrap_or_else(|e| panic!("{}", ctx(e)));
    let interp = (0..ehdr.e_phnum).any(|_| {
        let mut ph = Phdr::default();
        f.read_exact(ph.as_mut_slice())
            .unwrap_or_else(|e| panic!("{}", ctx(e)));
        ph.p_type == elf::PT_INTERP
    });
    (ehdr.e_type, interp)
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
