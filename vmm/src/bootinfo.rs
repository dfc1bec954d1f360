//! The boot-info block (VMM → agent) at GPA 0x7000; same layout as
//! guest/src/c/bootinfo.h.

use vm_memory::ByteValued;

use crate::args::{AgentMode, VmConfig};

pub const MAGIC: u64 = 0x4255_5253_544d_5631; // "BURSTVM1"
/// Version 2 appends the rootfs fields, version 3 the SG fields, version 4
/// the SG chain fields, version 5 the DMA window; a reader
/// accepts any version ≥ the one whose fields it needs (docs/design.md).
pub const VERSION: u32 = 5;
pub const BI_ASYNC_VF_INIT: u32 = 1;
pub const BI_PROBE_MODE: u32 = 2;
pub const BI_TOUCH_RX: u32 = 4;
pub const BI_ECHO: u32 = 8;
pub const BI_RESET_ONCE: u32 = 16;
pub const BI_FAULT_ONCE: u32 = 32;
/// Stop at the template checkpoint (agent.c) and report EV_TEMPLATE.
pub const BI_TEMPLATE: u32 = 64;
/// Warp pipes on the SG function (docs/sgiov.md, "The agent's SG mode"); with
/// `BI_ECHO` the agent keeps them moving after READY.
pub const BI_SG: u32 = 128;
/// With `BI_SG`: one end of a chain between two sandboxes (docs/sgiov.md
/// §14.1): the sender CONNECTs to `sg_port` and checks the echo, the
/// receiver LISTENs on it, checks what arrives and echoes it back.
pub const BI_SG_SEND: u32 = 256;
pub const BI_SG_RECV: u32 = 512;
/// The agent does all its work at CPL0 (`--agent-cpl0`); without it, it switches to CPL3
/// after its boot report (docs/guest.md, "The agent at CPL3").
pub const BI_KERNEL_MODE: u32 = 1024;
pub const VIRTIO_ID_NET: u32 = 1;
pub const VIRTIO_ID_BLOCK: u32 = 2;
/// Bytes of `rootfs_file`, NUL included.
pub const ROOTFS_FILE_MAX: usize = 128;
/// UDP source port the agent uses for its request.
pub const CLIENT_PORT: u16 = 40000;

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct BootMem {
    pub base: u64,
    pub size: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct BootDev {
    pub mmio_base: u64,
    pub irq: u32,
    pub virtio_type: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BootInfo {
    pub magic: u64,
    pub version: u32,
    pub flags: u32,
    pub sandbox_id: [u8; 64],
    pub n_mem: u32,
    pub n_dev: u32,
    pub mem: [BootMem; 4],
    pub dev: [BootDev; 4],
    pub app_gpa: u64,
    pub app_len: u64,
    pub mac: [u8; 6],
    pub server_mac: [u8; 6],
    pub ip: u32,
    pub netmask: u32,
    pub gateway: u32,
    pub server_ip: u32,
    pub server_port: u16,
    pub client_port: u16,
    pub n_probe: u32,
    /// Explicit so that every byte of the block is initialized.
    pub pad: u32,
    pub probe_gpa: [u64; 64],
    // Version 2: rootfs.
    /// EROFS image in guest memory (pmem mode); 0 = on the read-only disk.
    pub rootfs_gpa: u64,
    pub rootfs_len: u64,
    /// NUL-terminated path the agent checksums; empty = none.
    pub rootfs_file: [u8; ROOTFS_FILE_MAX],
    // Version 3: SG-IOV.
    /// `BI_SG`: echo sockets to open and bytes to send through each.
    pub sg_pipes: u32,
    pub sg_bytes: u32,
    // Version 4: SG chain.
    /// `BI_SG_SEND`/`BI_SG_RECV`: the port; the sender's transform (0 copy, 1 crypto).
    pub sg_port: u32,
    pub sg_xf: u32,
    // Version 5: the DMA window.
    /// Where the agent must place everything a device reads or writes
    /// (rings, packet buffers); size 0 = anywhere in RAM.
    pub dma_window_gpa: u64,
    pub dma_window_size: u64,
}

/// A device as the boot info lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevEntry {
    pub mmio_base: u64,
    pub gsi: u32,
    pub virtio_type: u32,
}

/// Byte `j` of what the SG agent mode sends through pipe `i` (guest/src/c/agent.c,
/// `sg_byte`), salted with the sandbox's `seed` (`sg_seed`): the VMM computes the
/// checksum the agent must report from it.
pub fn sg_byte(seed: u32, pipe: u32, j: u32) -> u8 {
    // The high half of a word gets 5 x the salt: the checksum's fold (low ^ high) keeps it.
    let salt = ((seed >> (8 * (j & 3))) as u8).wrapping_mul(1 + (j & 4) as u8);
    (pipe.wrapping_mul(31) ^ j ^ (j >> 8).wrapping_mul(7)) as u8 ^ salt
}

/// The salt of a sandbox's SG payload (agent.c `sg_seed_of`: FNV-1a of the sandbox id),
/// so that two sandboxes never send the same bytes: a pipe that handed one sandbox
/// another's data fails the agent's byte-exact check.
pub fn sg_seed(sandbox: &str) -> u32 {
    sandbox
        .bytes()
        .take(64)
        .fold(2166136261u32, |h, b| (h ^ b as u32).wrapping_mul(16777619))
}

/// The checksum the SG agent mode of sandbox `sandbox` reports (docs/sgiov.md): the
/// agent checksum over what came back from pipe 0, 1, ... in turn (`bytes` is a
/// multiple of 8, so the C agent's per-pipe `csum_add` is the same stream).
pub fn sg_checksum(sandbox: &str, pipes: u32, bytes: u32) -> u32 {
    sg_checksum_seeded(sg_seed(sandbox), pipes, bytes)
}

/// The same with the salt given: a chain's two ends (`sg-send`, `sg-recv`) are two
/// sandboxes that must agree on the bytes, so both salt with the chain's port.
pub fn sg_checksum_seeded(seed: u32, pipes: u32, bytes: u32) -> u32 {
    let data: Vec<u8> = (0..pipes)
        .flat_map(|i| (0..bytes).map(move |j| sg_byte(seed, i, j)))
        .collect();
    crate::app::checksum(&data)
}

/// What the agent needs to prove the rootfs (docs/rootfs.md).
#[derive(Debug, Clone, Default)]
pub struct RootfsInfo {
    /// (gpa, len) of the EROFS image in guest memory, pmem mode.
    pub image: Option<(u64, u64)>,
    /// Path in the image the agent checksums.
    pub file: Option<String>,
}

impl BootInfo {
    /// Builds the block for `cfg`, with usable RAM `mem`, devices `devs`.
    pub fn new(
        cfg: &VmConfig,
        mem: &[BootMem],
        devs: &[DevEntry],
        app_gpa: u64,
        rootfs: &RootfsInfo,
    ) -> Self {
        let mut bi = BootInfo {
            magic: MAGIC,
            version: VERSION,
            flags: 0,
            sandbox_id: [0; 64],
            n_mem: mem.len() as u32,
            n_dev: devs.len() as u32,
            mem: [BootMem::default(); 4],
            dev: [BootDev::default(); 4],
            app_gpa,
            app_len: cfg.app_size,
            mac: cfg.boot_mac(),
            server_mac: cfg.netcfg.server_mac.bytes(),
            // Network byte order in memory = the address octets in order.
            ip: u32::from_ne_bytes(cfg.netcfg.ip.octets()),
            netmask: u32::from_ne_bytes(cfg.netcfg.netmask.octets()),
            gateway: u32::from_ne_bytes(cfg.netcfg.gateway.octets()),
            server_ip: cfg
                .netcfg
                .server
                .map_or(0, |s| u32::from_ne_bytes(s.ip().octets())),
            server_port: cfg.netcfg.server.map_or(0, |s| s.port()),
            client_port: CLIENT_PORT,
            n_probe: cfg.probe.len() as u32,
            pad: 0,
            probe_gpa: [0; 64],
            rootfs_gpa: rootfs.image.map_or(0, |i| i.0),
            rootfs_len: rootfs.image.map_or(0, |i| i.1),
            rootfs_file: [0; ROOTFS_FILE_MAX],
            sg_pipes: 0,
            sg_bytes: 0,
            sg_port: 0,
            sg_xf: 0,
            dma_window_gpa: if cfg.dma_window > 0 {
                crate::layout::DMA_WINDOW_ADDR
            } else {
                0
            },
            dma_window_size: cfg.dma_window,
        };
        if let Some(f) = &rootfs.file {
            // Validated to fit (NUL included) by the config.
            let n = f.len().min(ROOTFS_FILE_MAX - 1);
            bi.rootfs_file[..n].copy_from_slice(&f.as_bytes()[..n]);
        }
        if cfg.vf_init == crate::devspec::VfInit::Async {
            bi.flags |= BI_ASYNC_VF_INIT;
        }
        if !cfg.probe.is_empty() {
            bi.flags |= BI_PROBE_MODE;
        }
        if cfg.policy == guestmem::MemoryPolicy::Lazy {
            bi.flags |= BI_TOUCH_RX;
        }
        bi.flags |= match cfg.agent_mode {
            AgentMode::Once => 0,
            AgentMode::Echo => BI_ECHO,
            AgentMode::Reset => BI_RESET_ONCE,
            AgentMode::Fault => BI_FAULT_ONCE,
            AgentMode::Sg => BI_SG,
            AgentMode::SgEcho => BI_SG | BI_ECHO,
            AgentMode::SgSend => BI_SG | BI_SG_SEND,
            AgentMode::SgRecv => BI_SG | BI_SG_RECV,
        };
        if cfg.agent_cpl0 {
            bi.flags |= BI_KERNEL_MODE;
        }
        if cfg.agent_mode.is_sg() {
            bi.sg_pipes = cfg.sg_pipes;
            bi.sg_bytes = cfg.sg_bytes;
            bi.sg_port = cfg.sg_port;
            bi.sg_xf = cfg.sg_xf as u32;
        }
        if matches!(
            cfg.template,
            Some(crate::args::TemplateMode::Save(_) | crate::args::TemplateMode::Probe)
        ) {
            bi.flags |= BI_TEMPLATE;
        }
        bi.sandbox_id[..cfg.sandbox.len()].copy_from_slice(cfg.sandbox.as_bytes());
        for (d, m) in bi.mem.iter_mut().zip(mem) {
            *d = *m;
        }
        for (d, e) in bi.dev.iter_mut().zip(devs) {
            *d = BootDev {
                mmio_base: e.mmio_base,
                irq: e.gsi,
                virtio_type: e.virtio_type,
            };
        }
        for (d, &g) in bi.probe_gpa.iter_mut().zip(&cfg.probe) {
            *d = g;
        }
        bi
    }
}

// SAFETY: BootMem, BootDev and BootInfo are repr(C) structs of integers and
// integer arrays whose fields leave no padding (`_pad` fills the one gap, the
// layout test pins every offset), so every byte is initialized and every bit
// pattern is a valid value.
unsafe impl ByteValued for BootMem {}
// SAFETY: as above.
unsafe impl ByteValued for BootDev {}
// SAFETY: as above.
unsafe impl ByteValued for BootInfo {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn sg_checksum_counts_every_pipe_and_byte() {
        assert_eq!(sg_checksum("a", 0, 1024), 0);
        assert_ne!(sg_checksum("a", 64, 1024), sg_checksum("a", 63, 1024));
        assert_ne!(sg_checksum("a", 64, 1024), sg_checksum("a", 64, 1016));
        // Pipes differ from each other: a pipe echoing another's bytes is caught.
        assert_ne!(sg_byte(0, 0, 0), sg_byte(0, 1, 0));
        // So do sandboxes (the canary of two SG sandboxes).
        let (a, b) = (sg_seed("bvx-sg-a"), sg_seed("bvx-sg-b"));
        assert_ne!(a, b);
        assert_ne!(sg_byte(a, 0, 0), sg_byte(b, 0, 0));
        assert_ne!(sg_checksum("bvx-sg-a", 1, 8), sg_checksum("bvx-sg-b", 1, 8));
        // FNV-1a's published test vector: the C agent computes the same.
        assert_eq!(sg_seed("a"), 0xe40c292c);
    }

    #[test]
    fn layout_matches_bootinfo_h() {
        assert_eq!(offset_of!(BootInfo, sandbox_id), 16);
        assert_eq!(offset_of!(BootInfo, n_mem), 80);
        assert_eq!(offset_of!(BootInfo, mem), 88);
        assert_eq!(offset_of!(BootInfo, dev), 88 + 64);
        assert_eq!(offset_of!(BootInfo, app_gpa), 88 + 64 + 64);
        assert_eq!(offset_of!(BootInfo, mac), 232);
        assert_eq!(offset_of!(BootInfo, ip), 244);
        assert_eq!(offset_of!(BootInfo, server_port), 260);
        assert_eq!(offset_of!(BootInfo, n_probe), 264);
        assert_eq!(offset_of!(BootInfo, probe_gpa), 272);
        assert_eq!(offset_of!(BootInfo, rootfs_gpa), 784);
        assert_eq!(offset_of!(BootInfo, rootfs_file), 800);
        assert_eq!(offset_of!(BootInfo, sg_pipes), 928);
        assert_eq!(offset_of!(BootInfo, sg_bytes), 932);
        assert_eq!(offset_of!(BootInfo, sg_port), 936);
        assert_eq!(offset_of!(BootInfo, sg_xf), 940);
        assert_eq!(offset_of!(BootInfo, dma_window_gpa), 944);
        assert_eq!(offset_of!(BootInfo, dma_window_size), 952);
        assert_eq!(size_of::<BootInfo>(), 960);
    }
}
