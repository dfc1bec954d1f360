//! Guest physical layout (docs/design.md, "Guest physical memory layout").

pub const GDT_ADDR: u64 = 0x500;
pub const BOOT_INFO_ADDR: u64 = 0x7000;
pub const PML4_ADDR: u64 = 0x9000;
pub const PDPT_ADDR: u64 = 0xA000;
pub const PD_ADDR: u64 = 0xB000; // 4 page directories, 0xB000..0xF000
/// Linux: where the cmdline goes (below the EBDA, above the page tables).
pub const CMDLINE_ADDR: u64 = 0x2_0000;
pub const CMDLINE_MAX: usize = 0x1_0000;
/// Linux: PVH memmap table (after hvm_start_info at BOOT_INFO_ADDR).
pub const MEMMAP_ADDR: u64 = 0x7800;
/// Start of the usable RAM the agent allocates from.
pub const RAM_FREE_START: u64 = 0x10_0000;
/// End of conventional memory for the e820 map of a Linux guest.
pub const EBDA_START: u64 = 0x9_fc00;
pub const HIMEM_START: u64 = 0x10_0000;

pub const IMAGE_ADDR: u64 = 0xC000_0000;
pub const MAX_RAM: u64 = IMAGE_ADDR; // 3 GiB
pub const MIN_RAM: u64 = 2 << 20;
pub const MMIO_BASE: u64 = 0xD000_0000;
pub const MMIO_SIZE: u64 = 0x1000;
pub const FIRST_VIRTIO_GSI: u32 = 5;
/// Largest `--dma-window`.
pub const MAX_DMA_WINDOW: u64 = 16 << 20;
/// The DMA window (`--dma-window`) starts here: above the image region,
/// below the virtio-mmio window, inside the agent's identity map.
pub const DMA_WINDOW_ADDR: u64 = MMIO_BASE - MAX_DMA_WINDOW;
/// A Linux guest's window is its restricted swiotlb pool, made of whole
/// segments (IO_TLB_SEGSIZE 128 slots of 2 KiB).
pub const LINUX_DMA_WINDOW_GRANULE: u64 = 256 << 10;
/// The image region must end below the DMA window.
pub const MAX_IMAGE: u64 = DMA_WINDOW_ADDR - IMAGE_ADDR;
pub const MAX_APP_SIZE: u64 = MAX_IMAGE - (16 << 20);
/// virtio-mmio devices of a Linux guest: GSIs 5..=20 (Firecracker's mptable
/// routes 5..=23 the same way).
pub const MAX_DEVICES: usize = 16;
/// The built-in agent's boot info lists at most this many.
pub const MAX_AGENT_DEVICES: usize = 4;
pub const MAX_PROBES: usize = 64;

/// KVM's TSS and identity-map pages, just below the IOAPIC, out of RAM's way.
pub const KVM_TSS_ADDR: u64 = 0xfffb_d000;
pub const KVM_IDENTITY_MAP_ADDR: u64 = 0xfffb_c000;

pub const SERIAL_PORT: u64 = 0x3f8;
pub const SERIAL_IRQ: u32 = 4;
pub const AGENT_PORT: u64 = 0x0f00;
pub const AGENT_PORT_LEN: u64 = 8;

pub const ALIGN_2M: u64 = 2 << 20;

pub fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

pub fn virtio_mmio_base(i: usize) -> u64 {
    MMIO_BASE + i as u64 * MMIO_SIZE
}

pub fn virtio_gsi(i: usize) -> u32 {
    FIRST_VIRTIO_GSI + i as u32
}
