//! x86_64 vCPU setup: CPUID, MSRs, LAPIC LINT pins, segments, paging, and
//! the GDT / identity page tables the VMM writes into guest memory.

use kvm_bindings::{kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, CpuId, Msrs};
use kvm_ioctls::VcpuFd;

use crate::layout::{GDT_ADDR, PDPT_ADDR, PD_ADDR, PML4_ADDR};

const CR0_PE: u64 = 1;
const CR0_MP: u64 = 1 << 1;
const CR0_ET: u64 = 1 << 4;
const CR0_NE: u64 = 1 << 5;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const CR4_OSFXSR: u64 = 1 << 9;
const CR4_OSXMMEXCPT: u64 = 1 << 10;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

/// GDT descriptors: (flags, base, limit) packed as in Firecracker's gdt_entry.
const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
        | (((limit as u64 & 0x000f_0000) >> 16) << 48)
        | ((flags as u64 & 0x0000_f0ff) << 40)
}

/// Long mode: null, code64 (0x08), data (0x10).
pub const GDT_64: [u64; 3] = [
    0,
    gdt_entry(0xa09b, 0, 0xfffff),
    gdt_entry(0xc093, 0, 0xfffff),
];
/// PVH's 32-bit protected mode entry: null, code32 (0x08), data (0x10).
pub const GDT_32: [u64; 3] = [
    0,
    gdt_entry(0xc09b, 0, 0xfffff),
    gdt_entry(0xc093, 0, 0xfffff),
];

fn segment_from_gdt(entry: u64, index: u16) -> kvm_segment {
    let base = ((entry >> 16) & 0xff_ffff) | ((entry >> 32) & 0xff00_0000);
    let raw = ((entry & 0xffff) | ((entry >> 32) & 0xf_0000)) as u32;
    // KVM wants the byte-granular limit: scale 4 KiB granularity here.
    let limit = if (entry >> 55) & 1 == 1 {
        (raw << 12) | 0xfff
    } else {
        raw
    };
    kvm_segment {
        base,
        limit,
        selector: index * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: ((entry >> 55) & 1) as u8,
        avl: ((entry >> 52) & 1) as u8,
        unusable: if (entry >> 47) & 1 == 0 { 1 } else { 0 },
        padding: 0,
    }
}

pub fn gdt_bytes(gdt: &[u64]) -> Vec<u8> {
    gdt.iter().flat_map(|e| e.to_le_bytes()).collect()
}

/// Page-table entry bits.
const PTE_PRESENT_RW: u64 = 0x3;
/// User-accessible: the built-in agent runs its work at CPL3 (docs/guest.md, "The agent at
/// CPL3"), where kvm_pvm runs guest code natively instead of emulating it.
const PTE_USER: u64 = 0x4;
const PTE_HUGE: u64 = 0x80;

/// PML4 + PDPT + 4 PDs identity-mapping 0–4 GiB with 2 MiB pages, as one
/// blob starting at PML4_ADDR (the tables are contiguous). `user` makes every
/// page reachable from CPL3 too (the built-in agent; a Linux kernel builds its own).
pub fn page_tables(user: bool) -> Vec<u8> {
    let flags = PTE_PRESENT_RW | if user { PTE_USER } else { 0 };
    let mut t = vec![0u64; 6 * 512];
    t[0] = PDPT_ADDR | flags;
    for i in 0..4u64 {
        t[512 + i as usize] = (PD_ADDR + i * 0x1000) | flags;
        for j in 0..512u64 {
            t[1024 + (i * 512 + j) as usize] = ((i * 512 + j) << 21) | flags | PTE_HUGE;
        }
    }
    debug_assert_eq!(PDPT_ADDR, PML4_ADDR + 0x1000);
    debug_assert_eq!(PD_ADDR, PML4_ADDR + 0x2000);
    t.iter().flat_map(|e| e.to_le_bytes()).collect()
}

/// How the vCPU enters the guest.
#[derive(Debug, Clone, Copy)]
pub enum EntryMode {
    /// 64-bit long mode with the identity page tables; `rdi`/`rsi` = boot block.
    Long64 {
        rip: u64,
        rsp: u64,
        rdi: u64,
        rsi: u64,
    },
    /// PVH: 32-bit protected mode, paging off, `rbx` = hvm_start_info.
    Pvh32 { rip: u64, rbx: u64 },
}

/// KVM_GET_SUPPORTED_CPUID, normalized for vCPU `id` of `count`.
pub fn filter_cpuid(cpuid: &mut CpuId, id: u8, count: u8) {
    for e in cpuid.as_mut_slice().iter_mut() {
        match e.function {
            1 => {
                // No CMPXCHG16B: this host's nested KVM mishandles it (common.md).
                e.ecx &= !(1 << 13);
                // Running under a hypervisor.
                e.ecx |= 1 << 31;
                // Initial APIC id and logical processor count.
                e.ebx = (e.ebx & 0x0000_ffff) | ((id as u32) << 24) | ((count as u32) << 16);
                if count > 1 {
                    e.edx |= 1 << 28; // HTT: the count above is valid
                }
            }
            // Deterministic cache parameters: cores per package = vCPU count.
            4 => e.eax = (e.eax & 0x03ff_ffff) | ((count as u32 - 1) << 26),
            // No architectural PMU for the guest (as Firecracker).
            0xa => {
                e.eax = 0;
                e.ebx = 0;
                e.ecx = 0;
                e.edx = 0;
            }
            0xb | 0x1f => e.edx = id as u32, // x2APIC id
            _ => {}
        }
    }
}

fn boot_msrs() -> Vec<kvm_msr_entry> {
    let msr = |index: u32, data: u64| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    };
    vec![
        msr(0x174, 0),             // IA32_SYSENTER_CS
        msr(0x175, 0),             // IA32_SYSENTER_ESP
        msr(0x176, 0),             // IA32_SYSENTER_EIP
        msr(0xc000_0081, 0),       // STAR
        msr(0xc000_0083, 0),       // CSTAR
        msr(0xc000_0102, 0),       // KERNEL_GS_BASE
        msr(0xc000_0084, 0),       // SYSCALL_MASK
        msr(0xc000_0082, 0),       // LSTAR
        msr(0x10, 0),              // TSC
        msr(0x1a0, 1),             // IA32_MISC_ENABLE: fast strings
        msr(0x2ff, (1 << 11) | 6), // MTRRdefType: MTRRs on, default write-back
    ]
}

fn lapic_reg(regs: &[std::os::raw::c_char; 1024], off: usize) -> u32 {
    u32::from_le_bytes(std::array::from_fn(|i| regs[off + i] as u8))
}

fn set_lapic_reg(regs: &mut [std::os::raw::c_char; 1024], off: usize, v: u32) {
    for (i, b) in v.to_le_bytes().iter().enumerate() {
        regs[off + i] = *b as std::os::raw::c_char;
    }
}

/// Error of one vCPU setup step (the step's name and KVM's error).
pub type SetupError = (&'static str, kvm_ioctls::Error);

/// Configures CPUID, MSRs, FPU, LINT pins, registers and segments.
pub fn setup_vcpu(vcpu: &VcpuFd, cpuid: &CpuId, entry: EntryMode) -> Result<(), SetupError> {
    vcpu.set_cpuid2(cpuid).map_err(|e| ("KVM_SET_CPUID2", e))?;

    let entries = boot_msrs();
    let msrs = Msrs::from_entries(&entries)
        .map_err(|_| ("KVM_SET_MSRS", kvm_ioctls::Error::new(libc::E2BIG)))?;
    let n = vcpu.set_msrs(&msrs).map_err(|e| ("KVM_SET_MSRS", e))?;
    if n != entries.len() {
        return Err((
            "KVM_SET_MSRS (not every MSR accepted)",
            kvm_ioctls::Error::new(libc::EINVAL),
        ));
    }

    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(|e| ("KVM_SET_FPU", e))?;

    // LINT0 = ExtINT, LINT1 = NMI, as Firecracker's set_lint (the PIC and NMI routing Linux expects).
    let mut lapic = vcpu.get_lapic().map_err(|e| ("KVM_GET_LAPIC", e))?;
    const APIC_LVT0: usize = 0x350;
    const APIC_LVT1: usize = 0x360;
    let mode = |reg: u32, m: u32| (reg & !0x700) | (m << 8);
    let l0 = lapic_reg(&lapic.regs, APIC_LVT0);
    set_lapic_reg(&mut lapic.regs, APIC_LVT0, mode(l0, 0x7));
    let l1 = lapic_reg(&lapic.regs, APIC_LVT1);
    set_lapic_reg(&mut lapic.regs, APIC_LVT1, mode(l1, 0x4));
    vcpu.set_lapic(&lapic).map_err(|e| ("KVM_SET_LAPIC", e))?;

    let mut sregs: kvm_sregs = vcpu.get_sregs().map_err(|e| ("KVM_GET_SREGS", e))?;
    let mut regs = kvm_regs {
        rflags: 0x2,
        ..Default::default()
    };
    let gdt = match entry {
        EntryMode::Long64 { .. } => &GDT_64,
        EntryMode::Pvh32 { .. } => &GDT_32,
    };
    let code = segment_from_gdt(gdt[1], 1);
    let data = segment_from_gdt(gdt[2], 2);
    sregs.gdt.base = GDT_ADDR;
    sregs.gdt.limit = (gdt.len() * 8 - 1) as u16;
    sregs.idt.base = 0;
    sregs.idt.limit = 0;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    match entry {
        EntryMode::Long64 { rip, rsp, rdi, rsi } => {
            sregs.cr3 = PML4_ADDR;
            sregs.cr4 = CR4_PAE | CR4_OSFXSR | CR4_OSXMMEXCPT;
            sregs.cr0 = CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_PG;
            sregs.efer = EFER_LME | EFER_LMA;
            regs.rip = rip;
            regs.rsp = rsp;
            regs.rbp = rsp;
            regs.rdi = rdi;
            regs.rsi = rsi;
        }
        EntryMode::Pvh32 { rip, rbx } => {
            sregs.cr0 = CR0_PE | CR0_ET;
            sregs.cr4 = 0;
            sregs.efer = 0;
            regs.rip = rip;
            regs.rbx = rbx;
        }
    }
    vcpu.set_sregs(&sregs).map_err(|e| ("KVM_SET_SREGS", e))?;
    vcpu.set_regs(&regs).map_err(|e| ("KVM_SET_REGS", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_segments_decode() {
        let cs = segment_from_gdt(GDT_64[1], 1);
        assert_eq!(
            (cs.selector, cs.l, cs.db, cs.type_, cs.present),
            (8, 1, 0, 0xb, 1)
        );
        let ds = segment_from_gdt(GDT_64[2], 2);
        assert_eq!(
            (ds.selector, ds.l, ds.db, ds.type_, ds.limit),
            (0x10, 0, 1, 3, 0xffff_ffff)
        );
        let cs32 = segment_from_gdt(GDT_32[1], 1);
        assert_eq!((cs32.l, cs32.db, cs32.g), (0, 1, 1));
        assert_eq!(GDT_64[1], 0x00af_9b00_0000_ffff);
    }

    #[test]
    fn page_tables_identity_map_4g() {
        let t = page_tables(false);
        let q = |i: usize| u64::from_le_bytes(t[i * 8..i * 8 + 8].try_into().unwrap());
        assert_eq!(q(0), PDPT_ADDR | 3);
        assert_eq!(q(512 + 3), (PD_ADDR + 0x3000) | 3);
        // The PD entry for 0xC000_0000 maps it to itself.
        let idx = (0xC000_0000u64 >> 21) as usize;
        assert_eq!(q(1024 + idx), 0xC000_0000 | 0x83);
        assert_eq!(t.len(), 6 * 4096);
    }

    #[test]
    fn user_page_tables_reach_every_level_from_cpl3() {
        let t = page_tables(true);
        let q = |i: usize| u64::from_le_bytes(t[i * 8..i * 8 + 8].try_into().unwrap());
        assert_eq!(q(0), PDPT_ADDR | 7);
        assert_eq!(q(512), PD_ADDR | 7);
        // The LAPIC's page too: the agent programs it from CPL3.
        let lapic = (0xfee0_0000u64 >> 21) as usize;
        assert_eq!(q(1024 + lapic), 0xfee0_0000 | 0x87);
    }
}
