//! A real KVM guest reads pool memory full of a previous tenant's canary under each policy:
//! KVM's own accesses (kernel-mode faults) must go through the lazy-zeroing path too.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod common;

use common::*;
use guestmem::MemoryPolicy;
use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::{Kvm, VcpuExit};

/// 16-bit real-mode guest at 0x1000: counts canary bytes in ES:[0x2000, 0xF000) (ES at
/// 0x10000: the 64 KiB block after the one the instant writes map ahead, so KVM's reads
/// there fault) and sends the count to port 0x10, then the bytes at 0x5000 (VMM instant
/// write) and 0x9001 (device write) to port 0x11, then `hlt`.
const GUEST: [u8; 33] = [
    0xbe, 0x00, 0x20, // mov $0x2000, %si
    0x31, 0xc9, // xor %cx, %cx
    0x26, 0xac, // l: lodsb %es:(%si)
    0x3c, 0xa5, // cmp $0xA5, %al
    0x75, 0x01, // jne skip
    0x41, // inc %cx
    0x81, 0xfe, 0x00, 0xf0, // skip: cmp $0xF000, %si
    0x72, 0xf3, // jb l
    0x89, 0xc8, // mov %cx, %ax
    0xe7, 0x10, // out %ax, $0x10
    0xa0, 0x00, 0x50, // mov (0x5000), %al
    0xe6, 0x11, // out %al, $0x11
    0xa0, 0x01, 0x90, // mov (0x9001), %al
    0xe6, 0x11, // out %al, $0x11
    0xf4, // hlt
];

fn run_guest(policy: MemoryPolicy) -> (u16, Vec<u8>) {
    const SIZE: u64 = 1 << 20;
    let server = canary_pool(&format!("kvm-{policy}"), SIZE, 1);
    let mut gm = pool_ram(&server, SIZE, policy);
    gm.write_instant(0x1000, &GUEST).unwrap();
    gm.write_instant(0x5000, &[0x42]).unwrap();
    gm.dma_map("ram").unwrap();
    gm.prepare_for_device_write(0x9000, 16).unwrap();
    let r = &gm.regions()[0];
    // SAFETY: the 16 bytes lie inside the mapped device view of `gm`.
    unsafe { std::ptr::write_bytes(r.device_view_ptr().add(0x9000), 0x3C, 16) };

    let kvm = Kvm::new().unwrap();
    let vm = kvm.create_vm().unwrap();
    // SAFETY: the guest view stays mapped until after the VM is dropped.
    unsafe {
        vm.set_user_memory_region(kvm_userspace_memory_region {
            slot: 0,
            flags: 0,
            guest_phys_addr: 0,
            memory_size: SIZE,
            userspace_addr: r.guest_view_ptr() as u64,
        })
        .unwrap();
    }
    let mut vcpu = vm.create_vcpu(0).unwrap();
    let mut sregs = vcpu.get_sregs().unwrap();
    for seg in [&mut sregs.cs, &mut sregs.ds, &mut sregs.ss] {
        seg.base = 0;
        seg.selector = 0;
    }
    sregs.es.base = 0x10000;
    sregs.es.selector = 0x1000;
    vcpu.set_sregs(&sregs).unwrap();
    let mut regs = vcpu.get_regs().unwrap();
    regs.rip = 0x1000;
    regs.rflags = 2;
    vcpu.set_regs(&regs).unwrap();

    let (mut count, mut bytes) = (None, Vec::new());
    for _ in 0..16 {
        match vcpu.run().unwrap() {
            VcpuExit::IoOut(0x10, d) => count = Some(u16::from_le_bytes([d[0], d[1]])),
            VcpuExit::IoOut(0x11, d) => bytes.push(d[0]),
            VcpuExit::Hlt => break,
            other => panic!("{policy}: unexpected exit {other:?}"),
        }
    }
    assert!(gm.lazy_error().is_none());
    if policy == MemoryPolicy::Lazy {
        // KVM's accesses were served by the userfaultfd handler.
        assert!(gm.lazy_stats().faults > 0, "{:?}", gm.lazy_stats());
    }
    (count.expect("guest reported no count"), bytes)
}

#[test]
fn kvm_guest_never_reads_old_bytes() {
    for policy in [
        MemoryPolicy::Lazy,
        MemoryPolicy::Pre(50),
        MemoryPolicy::Vanilla,
    ] {
        let (count, bytes) = run_guest(policy);
        assert_eq!(count, 0, "{policy}: guest read {count} canary bytes");
        assert_eq!(bytes, vec![0x42, 0x3C], "{policy}: VMM/device data lost");
    }
}
