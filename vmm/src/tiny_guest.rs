//! Tiny hand-assembled guests: a minimal ELF64 "kernel" around a few bytes
//! of 64-bit code. The VMM's exit tests use them, and `burstvm bench vmm`
//! boots the same guest on burstvm and on Firecracker.

/// Firecracker's test guest (shared/peers/tiny-guest/g.S): serial `R\n`,
/// then the i8042 reset (both VMMs end with status 0), then `hlt` forever.
pub const SERIAL_THEN_RESET: &[u8] = &[
    0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
    0xb0, b'R', 0xee, // mov al, 'R'; out dx, al
    0xb0, b'\n', 0xee, // mov al, '\n'; out dx, al
    0xb0, 0xfe, 0xe6, 0x64, // mov al, 0xfe; out 0x64, al
    0xf4, 0xeb, 0xfd, // 1: hlt; jmp 1b
];

/// An ELF64 executable with one PT_LOAD of `code` at physical `load`, the
/// entry at its start. No PVH note: VMMs enter it through the 64-bit boot
/// protocol, in long mode.
pub fn elf(load: u64, code: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(0x1000 + code.len());
    f.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    f.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    f.extend_from_slice(&0x3eu16.to_le_bytes()); // x86-64
    f.extend_from_slice(&1u32.to_le_bytes());
    f.extend_from_slice(&load.to_le_bytes()); // e_entry
    f.extend_from_slice(&64u64.to_le_bytes()); // e_phoff
    f.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    f.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    for v in [64u16, 56, 1, 64, 0, 0] {
        f.extend_from_slice(&v.to_le_bytes()); // ehsize, phentsize, phnum, shentsize, shnum, shstrndx
    }
    f.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    f.extend_from_slice(&5u32.to_le_bytes()); // R+X
    let len = code.len() as u64;
    for v in [0x1000u64, load, load, len, len, 0x1000] {
        f.extend_from_slice(&v.to_le_bytes()); // offset, vaddr, paddr, filesz, memsz, align
    }
    f.resize(0x1000, 0);
    f.extend_from_slice(code);
    f
}
