//! Coalesced MMIO (KVM_REGISTER_COALESCED_MMIO): guest writes to registers
//! that only store a value are appended by KVM to a ring page shared with the
//! VMM instead of exiting to it; the VMM applies them, in order, at the next
//! exit of any vCPU, before it serves that exit. Every read exits, so the
//! guest never observes a write still in the ring.
//!
//! A virtio-mmio driver's set-up is mostly such writes (feature and queue
//! selectors, the driver's features, queue sizes and ring addresses: 22 of a
//! network device's ~50 register accesses); on a host where an exit to the
//! VMM costs 8.5-30 µs (kvm_pvm, nested) they were a third of what a VF adds
//! to a start. QEMU batches VGA and e1000 writes the same way.
//!
//! kvm-ioctls maps the ring per `VcpuFd` and reads it through `&mut VcpuFd`,
//! which the exit being served still borrows; the ring is one page per VM,
//! so the VMM maps it once here and drains it under one lock for all vCPUs.

use std::ptr::NonNull;
use std::sync::atomic::{fence, Ordering};

use kvm_bindings::{kvm_coalesced_mmio, kvm_coalesced_mmio_ring};
use kvm_ioctls::{Cap, VcpuFd, VmFd};
use vmm_sys_util::errno;

/// The ring page's offset in a vCPU fd, in pages, if KVM coalesces MMIO.
pub fn page_offset(vm: &VmFd) -> Option<u64> {
    match vm.check_extension_int(Cap::CoalescedMmio) {
        n if n > 0 => Some(n as u64),
        _ => None,
    }
}

/// The VM's ring page, mapped from one of its vCPU fds.
#[derive(Debug)]
pub struct Ring {
    page: NonNull<kvm_coalesced_mmio_ring>,
    len: usize,
    /// Entries the page holds (KVM_COALESCED_MMIO_MAX).
    max: u32,
}

// SAFETY: the mapping is owned by this value; all access goes through
// `&mut self` (the VMM keeps it in a Mutex), and the kernel side is the
// ring protocol below.
unsafe impl Send for Ring {}

impl Ring {
    pub fn map(vcpu: &VcpuFd, page_offset: u64) -> Result<Ring, errno::Error> {
        use std::os::fd::AsRawFd;
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        // SAFETY: a fresh shared mapping of the vCPU fd's ring page, checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                vcpu.as_raw_fd(),
                (page_offset as usize * page) as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(errno::Error::last());
        }
        let header = size_of::<kvm_coalesced_mmio_ring>();
        let max = ((page - header) / size_of::<kvm_coalesced_mmio>()) as u32;
        Ok(Ring {
            page: NonNull::new(p.cast()).expect("mmap returned a non-null address"),
            len: page,
            max,
        })
    }

    /// Hands every write in the ring to `apply` (address, bytes), oldest
    /// first, and frees their slots. Bounded: at most one ring's worth.
    pub fn drain(&mut self, mut apply: impl FnMut(u64, &[u8])) {
        let ring = self.page.as_ptr();
        // SAFETY: `ring` points to the mapped page for as long as `self`
        // lives; `first` is ours to write, `last` the kernel's (read once,
        // then an acquire fence orders the entry reads after it).
        unsafe {
            let last = std::ptr::addr_of!((*ring).last).read_volatile();
            fence(Ordering::Acquire);
            let mut first = std::ptr::addr_of!((*ring).first).read_volatile();
            if last >= self.max || first >= self.max {
                // Not a state KVM writes; nothing in it can be trusted.
                return;
            }
            let entries = std::ptr::addr_of!((*ring).coalesced_mmio).cast::<kvm_coalesced_mmio>();
            while first != last {
                let e = entries.add(first as usize).read_volatile();
                let n = (e.len as usize).min(e.data.len());
                apply(e.phys_addr, &e.data[..n]);
                first = (first + 1) % self.max;
            }
            // The entries are read before KVM may reuse their slots.
            fence(Ordering::Release);
            std::ptr::addr_of_mut!((*ring).first).write_volatile(first);
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: unmaps the page mapped in `map`, which nothing else refers to.
        unsafe { libc::munmap(self.page.as_ptr().cast(), self.len) };
    }
}
