//! Linux boot: a vmlinux ELF loaded with linux-loader, entered through its
//! PVH note (hvm_start_info, 32-bit protected mode) or else the 64-bit boot
//! protocol (boot_params + e820).
//!
//! `probe` reads the ELF and program headers before any memory exists (bad
//! input fails first); `LoadedKernel::write` then has linux-loader write the
//! segments, command line and boot parameters straight into guest memory
//! through the device view, after the instant-zero list claimed exactly
//! those pages (lazy zeroing never wipes them). Nothing else is touched: an
//! ELF at 16 MiB costs its own pages, not the 16 MiB below it.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::{load_cmdline, Cmdline, KernelLoader};
use vm_memory::{ByteValued, GuestAddress, GuestMemoryMmap};

use crate::error::Error;
use crate::layout::{
    align_up, BOOT_INFO_ADDR, CMDLINE_ADDR, CMDLINE_MAX, EBDA_START, HIMEM_START, MEMMAP_ADDR,
};
use crate::x86::EntryMode;

const E820_RAM: u32 = 1;
const HVM_START_MAGIC: u32 = 0x336e_c578;
const MODLIST_ADDR: u64 = 0x7c00;
/// Linux 64-bit boot protocol: stack below the boot_params page.
const BOOT_STACK: u64 = 0x8ff0;
/// The boot pages below 1 MiB the loader writes: boot info, PVH memmap and
/// module list (0x7000..0x8000) and the command line.
const BOOT_PAGES: [(u64, u64); 2] = [(BOOT_INFO_ADDR, 0x1000), (CMDLINE_ADDR, CMDLINE_MAX as u64)];

/// A probed kernel (and initrd), ready to be written into guest memory.
pub struct LoadedKernel {
    path: PathBuf,
    file: File,
    /// Guest range `[start, end)` of the PT_LOAD segments (bss included).
    span: (u64, u64),
    initrd: Option<(u64, Vec<u8>)>,
    cmdline: Cmdline,
    ram_size: u64,
    /// `(gpa, bytes)` of the DMA window: RAM in the memory map, above `ram_size`.
    dma_window: Option<(u64, u64)>,
}

/// Claims guest range `(gpa, len)` on the instant-zero list (`what` names it in errors).
pub type PrepareFn<'a> = dyn Fn(u64, u64, &'static str) -> Result<(), Error> + 'a;
/// Writes bytes at a gpa on the instant-zero list (`what` names them in errors).
pub type WriteFn<'a> = dyn Fn(u64, &[u8], &'static str) -> Result<(), Error> + 'a;

/// Where the vCPUs enter a written kernel.
pub struct KernelEntry {
    pub entry: EntryMode,
    pub pvh: bool,
}

fn kerr(path: &Path, msg: impl Into<String>) -> Error {
    Error::Kernel {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

/// The failed step `what` of loading `path`, with its typed cause.
fn kstep<'a, E: Into<Box<dyn std::error::Error + Send + Sync>>>(
    path: &'a Path,
    what: &'static str,
) -> impl FnOnce(E) -> Error + 'a {
    move |e| Error::KernelStep {
        path: path.to_path_buf(),
        what,
        source: e.into(),
    }
}

/// The command line when the user gives none.
pub const DEFAULT_CMDLINE: &str =
    "reboot=k panic=1 pci=off nomodules i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd";

/// What a guest kernel needs on a kvm_pvm host (a software hypervisor
/// without VMX): CPUID advertises host features whose instructions kvm_pvm
/// cannot run for a guest kernel, so the kernel must not use them.
/// Measured with guest/linux's kernel, each flag alone (docs/guest.md):
/// `xsave` — `xrstor64` in fpu__init_system_xstate is an emulation failure;
/// `smap` — the `clac` at the interrupt entry is an emulation failure;
/// `popcnt` — `popcnt` patched in by alternatives is an emulation failure.
/// Not added where the flag is already given, nor on a VMX/SVM host.
pub const KVM_PVM_CMDLINE: &str = "clearcpuid=smap,popcnt,xsave";

/// Turns on guest/linux's kvm_pvm patches (0002, 0003): there `syscall`
/// stays at CPL3 and arrives as a user-mode page fault at the entry, which
/// the patched kernel then takes as the system call, and the kernel's one
/// FWAIT is skipped (docs/guest.md). A kernel without the patches ignores
/// the parameter.
pub const KVM_PVM_PARAM: &str = "burstvm_kvm_pvm";

/// What a guest kernel's boot costs on a kvm_pvm host, which emulates the
/// kernel instruction by instruction: `mark_rodata_ro()` and the freeing of
/// the kernel image's gaps change page attributes one 4 KiB page at a time
/// (direct-map alias included), 4.2 s of a 19 s boot to init measured
/// ("Write protecting the kernel read-only data" to the last "Freeing
/// unused kernel image" line). Without it the guest kernel's text and
/// read-only data stay writable to the guest kernel itself (never to its
/// user space: those pages are supervisor-only either way), and the 3.6 MiB
/// of gaps stay reserved. The guest is the sandbox's own: the VM, not the
/// guest kernel's W^X, is the boundary (docs/guest.md, "Boot cost under
/// kvm_pvm"). Not added where the user's line says `rodata=`, nor on a
/// VMX/SVM host, where the same work takes milliseconds.
pub const KVM_PVM_RODATA: &str = "rodata=off";

/// Whether this host's KVM is kvm_pvm.
pub fn host_is_kvm_pvm() -> bool {
    Path::new("/sys/module/kvm_pvm").exists()
}

/// The kernel parameter (guest/linux/patches/0004) that makes the DMA
/// window `(gpa, bytes)` the restricted swiotlb pool of every virtio-mmio
/// device that negotiates VIRTIO_F_ACCESS_PLATFORM: the device tree's
/// restricted-dma-pool, which x86 has no device tree to give.
pub fn dma_window_param((gpa, size): (u64, u64)) -> String {
    format!("virtio_mmio.dma_window={}K@{gpa:#x}", size >> 10)
}

/// The command line: the user's (or a default), plus console, devices, the
/// DMA window and what a kvm_pvm host needs. Words after ` -- ` in the
/// user's line are init's arguments (the command burstvm's init runs): the
/// kernel parameters added here go before them.
pub fn build_cmdline(
    user: Option<&str>,
    devices: &[(u64, u32)],
    dma_window: Option<(u64, u64)>,
) -> Result<Cmdline, linux_loader::cmdline::Error> {
    cmdline_for_host(user, devices, dma_window, host_is_kvm_pvm())
}

/// `build_cmdline` for a host that is (or is not) kvm_pvm.
fn cmdline_for_host(
    user: Option<&str>,
    devices: &[(u64, u32)],
    dma_window: Option<(u64, u64)>,
    kvm_pvm: bool,
) -> Result<Cmdline, linux_loader::cmdline::Error> {
    let mut c = Cmdline::try_from(user.unwrap_or(DEFAULT_CMDLINE), CMDLINE_MAX)?;
    let rendered = c.as_cstring()?.into_string().unwrap_or_default();
    let boot = rendered.split(" -- ").next().unwrap_or("").to_string();
    let has = |pred: &dyn Fn(&str) -> bool| boot.split_whitespace().any(pred);
    if !has(&|w| w.starts_with("console=")) {
        c.insert_str("console=ttyS0")?;
    }
    if !has(&|w| w.starts_with("earlycon")) {
        // Prints from the first printk on, which a slow nested guest needs.
        c.insert_str("earlycon=uart8250,io,0x3f8")?;
    }
    for (base, gsi) in devices {
        c.insert_str(format!("virtio_mmio.device=4K@{base:#x}:{gsi}"))?;
    }
    if let Some(w) = dma_window {
        c.insert_str(dma_window_param(w))?;
    }
    if kvm_pvm {
        if !has(&|w| w.starts_with("clearcpuid=")) {
            c.insert_str(KVM_PVM_CMDLINE)?;
        }
        if !has(&|w| w.starts_with("rodata=")) {
            c.insert_str(KVM_PVM_RODATA)?;
        }
        if !has(&|w| w == KVM_PVM_PARAM) {
            c.insert_str(KVM_PVM_PARAM)?;
        }
    }
    Ok(c)
}

/// The RAM ranges of the memory map: conventional memory, RAM above 1 MiB,
/// and the DMA window (RAM the kernel maps, which the parameter of
/// `dma_window_param` reserves for the swiotlb pool).
fn e820(ram_size: u64, dma_window: Option<(u64, u64)>) -> Vec<(u64, u64)> {
    let mut m = vec![(0, EBDA_START), (HIMEM_START, ram_size - HIMEM_START)];
    m.extend(dma_window);
    m
}

fn elf_err(kernel: &Path, e: linux_loader::loader::elf::Error) -> Error {
    let hint = match e {
        linux_loader::loader::elf::Error::InvalidElfMagicNumber => {
            " (not an ELF file; a bzImage/vmlinuz must be extracted to its vmlinux first)"
        }
        _ => "",
    };
    Error::KernelElf {
        path: kernel.to_path_buf(),
        hint,
        source: e,
    }
}

/// The guest range of the PT_LOAD segments, from the headers only (the
/// checks linux-loader makes, so that it cannot fail later on the same file).
fn segment_span(kernel: &Path, f: &mut File) -> Result<(u64, u64), Error> {
    use linux_loader::elf::{self, Elf64_Ehdr as Ehdr, Elf64_Phdr as Phdr};
    use linux_loader::loader::elf::Error as E;
    use std::io::{Seek, SeekFrom};
    let mut ehdr = Ehdr::default();
    f.read_exact(ehdr.as_mut_slice())
        .map_err(|_| elf_err(kernel, E::ReadElfHeader))?;
    if ehdr.e_ident[..4] != *b"\x7fELF" {
        return Err(elf_err(kernel, E::InvalidElfMagicNumber));
    }
    if ehdr.e_ident[elf::EI_DATA] != elf::ELFDATA2LSB {
        return Err(elf_err(kernel, E::BigEndianElfOnLittle));
    }
    if ehdr.e_phentsize as usize != size_of::<Phdr>() {
        return Err(elf_err(kernel, E::InvalidProgramHeaderSize));
    }
    if (ehdr.e_phoff as usize) < size_of::<Ehdr>() {
        return Err(elf_err(kernel, E::InvalidProgramHeaderOffset));
    }
    if ehdr.e_entry < HIMEM_START {
        return Err(elf_err(kernel, E::InvalidEntryAddress));
    }
    f.seek(SeekFrom::Start(ehdr.e_phoff))
        .map_err(|_| elf_err(kernel, E::SeekProgramHeader))?;
    let (mut start, mut end) = (u64::MAX, 0u64);
    for _ in 0..ehdr.e_phnum {
        let mut ph = Phdr::default();
        f.read_exact(ph.as_mut_slice())
            .map_err(|_| elf_err(kernel, E::ReadProgramHeader))?;
        if ph.p_type != elf::PT_LOAD || ph.p_filesz == 0 {
            continue;
        }
        let seg_end = ph
            .p_paddr
            .checked_add(ph.p_memsz.max(ph.p_filesz))
            .ok_or_else(|| elf_err(kernel, E::InvalidProgramHeaderAddress))?;
        start = start.min(ph.p_paddr);
        end = end.max(seg_end);
    }
    if end == 0 {
        return Err(kerr(
            kernel,
            "not a bootable vmlinux ELF: no loadable segment",
        ));
    }
    Ok((start, end))
}

/// Reads the kernel's headers and the initrd and checks they fit in
/// `ram_size`: everything that can be wrong with the files, before any
/// guest memory exists.
pub fn probe(
    kernel: &Path,
    initrd: Option<&Path>,
    cmdline: &Cmdline,
    ram_size: u64,
    dma_window: Option<(u64, u64)>,
) -> Result<LoadedKernel, Error> {
    let mut file = File::open(kernel).map_err(kstep(kernel, "cannot open"))?;
    let (start, end) = segment_span(kernel, &mut file)?;
    if start < HIMEM_START || end > ram_size {
        return Err(kerr(
            kernel,
            format!(
                "segments {start:#x}..{end:#x} are not inside guest RAM \
                 {HIMEM_START:#x}..{ram_size:#x}"
            ),
        ));
    }
    let initrd = match initrd {
        None => None,
        Some(p) => {
            let data = std::fs::read(p).map_err(|source| Error::InitrdRead {
                path: p.to_path_buf(),
                source,
            })?;
            let len = data.len() as u64;
            let addr = ram_size
                .checked_sub(align_up(len, 4096))
                .filter(|a| *a >= align_up(end, 4096));
            let addr = addr.ok_or_else(|| Error::Initrd {
                path: p.to_path_buf(),
                msg: format!("{len} bytes do not fit in guest RAM above the kernel (end {end:#x})"),
            })?;
            Some((addr, data))
        }
    };
    Ok(LoadedKernel {
        path: kernel.to_path_buf(),
        file,
        span: (start, end),
        initrd,
        cmdline: cmdline.clone(),
        ram_size,
        dma_window,
    })
}

impl LoadedKernel {
    /// Writes the kernel segments, initrd, command line and boot parameters
    /// into guest memory: `prepare` claims each range on the instant-zero
    /// list first, then linux-loader writes it through `view` (the device
    /// view). Returns where the vCPUs enter.
    pub fn write(
        mut self,
        view: &GuestMemoryMmap,
        prepare: &PrepareFn,
        write: &WriteFn,
    ) -> Result<KernelEntry, Error> {
        let kernel = self.path.as_path();
        let ram_size = self.ram_size;
        let map = e820(ram_size, self.dma_window);
        prepare(self.span.0, self.span.1 - self.span.0, "kernel")?;
        let res = Elf::load(view, None, &mut self.file, Some(GuestAddress(HIMEM_START)))
            .map_err(kstep(kernel, "not a bootable vmlinux ELF"))?;
        for (gpa, len) in BOOT_PAGES {
            prepare(gpa, len, "boot parameters")?;
        }
        let mut initrd_range = None;
        if let Some((addr, data)) = &self.initrd {
            write(*addr, data, "initrd")?;
            initrd_range = Some((*addr, data.len() as u64));
        }
        let cmdline = &self.cmdline;
        load_cmdline(view, GuestAddress(CMDLINE_ADDR), cmdline)
            .map_err(kstep(kernel, "cmdline"))?;
        let cmdline_len = cmdline
            .as_cstring()
            .map(|c| c.as_bytes_with_nul().len())
            .unwrap_or(1);
        let (entry, pvh) = match res.pvh_boot_cap {
            PvhBootCapability::PvhEntryPresent(addr) => {
                let memmap: Vec<hvm_memmap_table_entry> = map
                    .iter()
                    .map(|&(addr, size)| hvm_memmap_table_entry {
                        addr,
                        size,
                        type_: E820_RAM,
                        reserved: 0,
                    })
                    .collect();
                let mut info = hvm_start_info {
                    magic: HVM_START_MAGIC,
                    version: 1,
                    cmdline_paddr: CMDLINE_ADDR,
                    memmap_paddr: MEMMAP_ADDR,
                    memmap_entries: memmap.len() as u32,
                    ..Default::default()
                };
                let mut params = BootParams::new(&info, GuestAddress(BOOT_INFO_ADDR));
                params.set_sections(&memmap, GuestAddress(MEMMAP_ADDR));
                if let Some((paddr, size)) = initrd_range {
                    info.nr_modules = 1;
                    info.modlist_paddr = MODLIST_ADDR;
                    params = BootParams::new(&info, GuestAddress(BOOT_INFO_ADDR));
                    params.set_sections(&memmap, GuestAddress(MEMMAP_ADDR));
                    params.set_modules(
                        &[hvm_modlist_entry {
                            paddr,
                            size,
                            ..Default::default()
                        }],
                        GuestAddress(MODLIST_ADDR),
                    );
                }
                PvhBootConfigurator::write_bootparams::<GuestMemoryMmap>(&params, view)
                    .map_err(kstep(kernel, "PVH start info"))?;
                (
                    EntryMode::Pvh32 {
                        rip: addr.0,
                        rbx: BOOT_INFO_ADDR,
                    },
                    true,
                )
            }
            _ => {
                let mut bp = boot_params::default();
                if let Some(hdr) = res.setup_header {
                    bp.hdr = hdr;
                }
                bp.hdr.type_of_loader = 0xff;
                bp.hdr.boot_flag = 0xaa55;
                bp.hdr.header = 0x5372_6448; // "HdrS"
                bp.hdr.cmd_line_ptr = CMDLINE_ADDR as u32;
                bp.hdr.cmdline_size = cmdline_len as u32;
                bp.hdr.kernel_alignment = 0x0100_0000;
                if let Some((addr, len)) = initrd_range {
                    bp.hdr.ramdisk_image = addr as u32;
                    bp.hdr.ramdisk_size = len as u32;
                }
                for (i, &(addr, size)) in map.iter().enumerate() {
                    bp.e820_table[i] = boot_e820_entry {
                        addr,
                        size,
                        r#type: E820_RAM,
                    };
                }
                bp.e820_entries = map.len() as u8;
                LinuxBootConfigurator::write_bootparams::<GuestMemoryMmap>(
                    &BootParams::new(&bp, GuestAddress(BOOT_INFO_ADDR)),
                    view,
                )
                .map_err(kstep(kernel, "boot_params"))?;
                (
                    EntryMode::Long64 {
                        rip: res.kernel_load.0,
                        rsp: BOOT_STACK,
                        rdi: 0,
                        rsi: BOOT_INFO_ADDR,
                    },
                    false,
                )
            }
        };
        Ok(KernelEntry { entry, pvh })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmdline_gets_console_and_devices() {
        let c = build_cmdline(Some("quiet"), &[(0xd000_0000, 5), (0xd000_1000, 6)], None).unwrap();
        let s = c.as_cstring().unwrap().into_string().unwrap();
        assert!(s.starts_with("quiet console=ttyS0"), "{s}");
        assert!(s.contains("virtio_mmio.device=4K@0xd0000000:5"), "{s}");
        assert!(s.contains("virtio_mmio.device=4K@0xd0001000:6"), "{s}");
        let c = build_cmdline(Some("console=hvc0"), &[], None).unwrap();
        assert!(!c.as_cstring().unwrap().to_str().unwrap().contains("ttyS0"));
    }

    /// A kvm_pvm host gets the CPUID flags, the patches' parameter and no
    /// rodata protection, each unless the user's line says otherwise; other
    /// hosts get none of them.
    #[test]
    fn kvm_pvm_words_only_on_kvm_pvm() {
        let words = |user, pvm| {
            let c = cmdline_for_host(user, &[], None, pvm).unwrap();
            let s = c.as_cstring().unwrap().into_string().unwrap();
            let boot = s.split(" -- ").next().unwrap().to_string();
            boot.split_whitespace()
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        let pvm = words(Some("quiet -- /bin/sh"), true);
        for w in [KVM_PVM_CMDLINE, KVM_PVM_PARAM, KVM_PVM_RODATA] {
            assert!(pvm.iter().any(|x| x == w), "{w} missing: {pvm:?}");
        }
        let own = words(Some("rodata=on clearcpuid=xsave"), true);
        assert!(own.iter().any(|x| x == "rodata=on"), "{own:?}");
        assert!(!own.iter().any(|x| x == KVM_PVM_RODATA), "{own:?}");
        assert!(!own.iter().any(|x| x == KVM_PVM_CMDLINE), "{own:?}");
        let vmx = words(Some("quiet"), false);
        assert!(
            !vmx.iter().any(|x| x.starts_with("rodata=")
                || x.starts_with("clearcpuid=")
                || x == KVM_PVM_PARAM),
            "{vmx:?}"
        );
    }

    #[test]
    fn init_arguments_stay_last() {
        let c = build_cmdline(
            Some("ro -- /bin/sh -c \"echo a -- b; exit 3\""),
            &[(0xd000_0000, 5)],
            None,
        )
        .unwrap();
        let s = c.as_cstring().unwrap().into_string().unwrap();
        let (boot, init) = s.split_once(" -- ").unwrap();
        assert!(boot.starts_with("ro console=ttyS0"), "{s}");
        assert!(boot.contains("virtio_mmio.device=4K@0xd0000000:5"), "{s}");
        assert_eq!(init, "/bin/sh -c \"echo a -- b; exit 3\"", "{s}");
    }

    /// The window is RAM in the memory map and named to the kernel, before
    /// init's arguments.
    #[test]
    fn a_dma_window_is_ram_and_a_kernel_parameter() {
        let w = (0xcf00_0000, 2 << 20);
        let c = build_cmdline(Some("ro -- /bin/sh"), &[(0xd000_0000, 5)], Some(w)).unwrap();
        let s = c.as_cstring().unwrap().into_string().unwrap();
        let (boot, init) = s.split_once(" -- ").unwrap();
        assert!(
            boot.contains("virtio_mmio.dma_window=2048K@0xcf000000"),
            "{s}"
        );
        assert_eq!(init, "/bin/sh");
        assert_eq!(
            e820(64 << 20, Some(w)),
            [
                (0, EBDA_START),
                (HIMEM_START, (64 << 20) - HIMEM_START),
                (0xcf00_0000, 2 << 20)
            ]
        );
        assert_eq!(e820(64 << 20, None).len(), 2);
    }

    #[test]
    fn non_elf_is_rejected_with_its_name() {
        let dir = std::env::temp_dir().join(format!("vmm-linux-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("notakernel");
        std::fs::write(&p, b"MZ this is not an elf file at all, just bytes........").unwrap();
        let c = build_cmdline(None, &[], None).unwrap();
        let e = probe(&p, None, &c, 64 << 20, None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("notakernel") && e.contains("not a bootable"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
