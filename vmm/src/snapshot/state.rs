//! KVM state of a paused VM and its vCPUs: get and set, in Firecracker's
//! order (persist.rs / vstate), versioned with the template file.

use kvm_bindings::kvm_clock_data;
use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_msr_entry,
    kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs,
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};

/// A get or set ioctl that failed, by name.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct StateError {
    pub what: String,
    #[source]
    pub source: kvm_ioctls::Error,
}

fn err(what: impl Into<String>) -> impl FnOnce(kvm_ioctls::Error) -> StateError {
    let what = what.into();
    move |source| StateError { what, source }
}

/// VM-wide state: the in-kernel PICs, IOAPIC, PIT and kvmclock.
#[derive(Serialize, Deserialize)]
pub struct VmState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
}

/// One vCPU's state.
#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub mp_state: kvm_mp_state,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    /// Includes the legacy FPU/SSE area (KVM_GET_FPU is its subset).
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub debugregs: kvm_debugregs,
    pub lapic: kvm_lapic_state,
    pub msrs: Vec<kvm_msr_entry>,
    pub events: kvm_vcpu_events,
}

fn irqchip(id: u32) -> kvm_irqchip {
    kvm_irqchip {
        chip_id: id,
        ..Default::default()
    }
}

pub const IRQCHIPS: [(&str, u32); 3] = [
    ("KVM_GET_IRQCHIP PIC master", KVM_IRQCHIP_PIC_MASTER),
    ("KVM_GET_IRQCHIP PIC slave", KVM_IRQCHIP_PIC_SLAVE),
    ("KVM_GET_IRQCHIP IOAPIC", KVM_IRQCHIP_IOAPIC),
];

pub fn get_irqchip(vm: &VmFd, id: u32) -> Result<kvm_irqchip, kvm_ioctls::Error> {
    let mut c = irqchip(id);
    vm.get_irqchip(&mut c)?;
    Ok(c)
}

pub fn save_vm(vm: &VmFd) -> Result<VmState, StateError> {
    let [m, s, io] = IRQCHIPS.map(|(what, id)| get_irqchip(vm, id).map_err(err(what)));
    Ok(VmState {
        pic_master: m?,
        pic_slave: s?,
        ioapic: io?,
        pit: vm.get_pit2().map_err(err("KVM_GET_PIT2"))?,
        clock: vm.get_clock().map_err(err("KVM_GET_CLOCK"))?,
    })
}

pub fn restore_vm(vm: &VmFd, s: &VmState) -> Result<(), StateError> {
    vm.set_pit2(&s.pit).map_err(err("KVM_SET_PIT2"))?;
    // Only the clock value: the flags of a GET (e.g. KVM_CLOCK_TSC_STABLE)
    // are not valid input to SET.
    let clock = kvm_clock_data {
        clock: s.clock.clock,
        ..Default::default()
    };
    vm.set_clock(&clock).map_err(err("KVM_SET_CLOCK"))?;
    for (chip, name) in [
        (&s.pic_master, "KVM_SET_IRQCHIP PIC master"),
        (&s.pic_slave, "KVM_SET_IRQCHIP PIC slave"),
        (&s.ioapic, "KVM_SET_IRQCHIP IOAPIC"),
    ] {
        vm.set_irqchip(chip).map_err(err(name))?;
    }
    Ok(())
}

/// The MSRs KVM lists, each read alone: an MSR this host's KVM cannot
/// read (the list names some that a vCPU model lacks) is skipped and counted.
pub fn get_msrs(kvm: &Kvm, fd: &VcpuFd) -> Result<(Vec<kvm_msr_entry>, Vec<u32>), StateError> {
    let list = kvm
        .get_msr_index_list()
        .map_err(err("KVM_GET_MSR_INDEX_LIST"))?;
    let mut got = Vec::new();
    let mut skipped = Vec::new();
    for &index in list.as_slice() {
        let mut one = Msrs::from_entries(&[kvm_msr_entry {
            index,
            ..Default::default()
        }])
        .map_err(|_| StateError {
            what: "building an MSR list".into(),
            source: kvm_ioctls::Error::new(libc::EINVAL),
        })?;
        match fd.get_msrs(&mut one) {
            Ok(1) => got.push(one.as_slice()[0]),
            _ => skipped.push(index),
        }
    }
    Ok((got, skipped))
}

pub fn set_msrs(fd: &VcpuFd, msrs: &[kvm_msr_entry]) -> Result<(), StateError> {
    let all = Msrs::from_entries(msrs).map_err(|_| StateError {
        what: format!("building a list of {} MSRs", msrs.len()),
        source: kvm_ioctls::Error::new(libc::EINVAL),
    })?;
    let n = fd.set_msrs(&all).map_err(err("KVM_SET_MSRS"))?;
    if n != msrs.len() {
        return Err(StateError {
            what: format!("KVM_SET_MSRS stopped at MSR {:#x}", msrs[n].index),
            source: kvm_ioctls::Error::new(libc::EINVAL),
        });
    }
    Ok(())
}

pub fn save_vcpu(kvm: &Kvm, fd: &VcpuFd) -> Result<VcpuState, StateError> {
    let cpuid = fd
        .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(err("KVM_GET_CPUID2"))?;
    let mp_state = fd.get_mp_state().map_err(err("KVM_GET_MP_STATE"))?;
    let regs = fd.get_regs().map_err(err("KVM_GET_REGS"))?;
    let sregs = fd.get_sregs().map_err(err("KVM_GET_SREGS"))?;
    let xsave = fd.get_xsave().map_err(err("KVM_GET_XSAVE"))?;
    let xcrs = fd.get_xcrs().map_err(err("KVM_GET_XCRS"))?;
    let debugregs = fd.get_debug_regs().map_err(err("KVM_GET_DEBUGREGS"))?;
    let lapic = fd.get_lapic().map_err(err("KVM_GET_LAPIC"))?;
    let (msrs, _) = get_msrs(kvm, fd)?;
    let events = fd.get_vcpu_events().map_err(err("KVM_GET_VCPU_EVENTS"))?;
    Ok(VcpuState {
        cpuid: cpuid.as_slice().to_vec(),
        mp_state,
        regs,
        sregs,
        xsave,
        xcrs,
        debugregs,
        lapic,
        msrs,
        events,
    })
}

/// Restores a vCPU created with KVM_CREATE_VCPU and nothing else set.
pub fn restore_vcpu(fd: &VcpuFd, s: &VcpuState) -> Result<(), StateError> {
    let cpuid = CpuId::from_entries(&s.cpuid).map_err(|_| StateError {
        what: format!("building a CPUID of {} entries", s.cpuid.len()),
        source: kvm_ioctls::Error::new(libc::EINVAL),
    })?;
    fd.set_cpuid2(&cpuid).map_err(err("KVM_SET_CPUID2"))?;
    fd.set_mp_state(s.mp_state)
        .map_err(err("KVM_SET_MP_STATE"))?;
    fd.set_regs(&s.regs).map_err(err("KVM_SET_REGS"))?;
    fd.set_sregs(&s.sregs).map_err(err("KVM_SET_SREGS"))?;
    // SAFETY: a kvm_xsave of the legacy 4 KiB size, as KVM_GET_XSAVE returned it.
    unsafe { fd.set_xsave(&s.xsave) }.map_err(err("KVM_SET_XSAVE"))?;
    fd.set_xcrs(&s.xcrs).map_err(err("KVM_SET_XCRS"))?;
    fd.set_debug_regs(&s.debugregs)
        .map_err(err("KVM_SET_DEBUGREGS"))?;
    fd.set_lapic(&s.lapic).map_err(err("KVM_SET_LAPIC"))?;
    set_msrs(fd, &s.msrs)?;
    fd.set_vcpu_events(&s.events)
        .map_err(err("KVM_SET_VCPU_EVENTS"))?;
    Ok(())
}
