//! Step 4 of the build: the guest's boot state, all written on guestmem's
//! instant-zero list (lazy zeroing never wipes it). The built-in agent gets
//! GDT, page tables, boot info, its image, the app payload and (pmem mode)
//! the EROFS image; a Linux kernel gets what linux-loader writes (segments,
//! initrd, command line, boot parameters) plus GDT, page tables and the MP
//! table, and nothing else.

use vm_memory::{ByteValued, GuestMemoryMmap};

use trace::{monotonic_ns, Stage, TraceWriter};

use super::memory::ImageLayout;
use crate::args::VmConfig;
use crate::bootinfo::{BootInfo, BootMem, DevEntry, RootfsInfo};
use crate::error::Error;
use crate::layout::*;
use crate::linux::LoadedKernel;
use crate::x86::{self, EntryMode};

/// Where the vCPUs start, and the checksum the agent must report.
pub(super) struct LoadedGuest {
    pub entry: EntryMode,
    pub app_checksum: u32,
}

pub(super) fn load_guest(
    cfg: &VmConfig,
    mem: &guestmem::GuestMemory,
    linux: Option<LoadedKernel>,
    view: &GuestMemoryMmap,
    devs: &[DevEntry],
    image: &ImageLayout,
) -> Result<LoadedGuest, Error> {
    let sb = cfg.sandbox.as_str();
    let write = writer(sb, mem);
    // Linux guests carry no app payload: their APP_LAUNCH_END (init's, or
    // the guest agent's exec of the container's main process) reports 0.
    let mut app_checksum = 0;
    let entry = match linux {
        None => {
            write(GDT_ADDR, &x86::gdt_bytes(&x86::GDT_64), "GDT")?;
            write(PML4_ADDR, &x86::page_tables(true), "page tables")?;
            write(guest::LOAD_ADDR, guest::AGENT_IMAGE, "agent image")?;
            app_checksum = write_sandbox_info(cfg, mem, devs, image)?;
            // The agent's allocator starts at mem[0]'s base: its rings and first buffers
            // are the only pages it touches that we did not write. Under lazy zeroing
            // that fault-around block is mapped ahead too, so the agent's boot takes no
            // userfault at all (each costs its vCPU a sleep and the handler a wake-up).
            mem.map_ahead(RAM_FREE_START, 1).map_err(guest_write_err(
                sb,
                RAM_FREE_START,
                "agent heap",
            ))?;
            EntryMode::Long64 {
                rip: guest::ENTRY_ADDR,
                rsp: 0x8ff0,
                rdi: BOOT_INFO_ADDR,
                rsi: 0,
            }
        }
        Some(k) => {
            let prepare = |gpa: u64, len: u64, what: &'static str| {
                mem.prepare_for_device_write(gpa, len)
                    .map_err(guest_write_err(sb, gpa, what))
            };
            let k = k.write(view, &prepare, &write)?;
            let gdt: &[u64] = if k.pvh { &x86::GDT_32 } else { &x86::GDT_64 };
            write(GDT_ADDR, &x86::gdt_bytes(gdt), "GDT")?;
            write(PML4_ADDR, &x86::page_tables(false), "page tables")?;
            // CPU count and IOAPIC routing for the kernel.
            write(
                crate::mptable::MPTABLE_ADDR,
                &crate::mptable::build(cfg.vcpus),
                "MP table",
            )?;
            k.entry
        }
    };
    Ok(LoadedGuest {
        entry,
        app_checksum,
    })
}

fn payload(cfg: &VmConfig) -> Vec<u8> {
    match &cfg.app_bytes {
        Some(b) => b.clone(),
        None => crate::app::payload(&cfg.sandbox, cfg.app_size as usize),
    }
}

/// The built-in agent's per-sandbox input: boot info and app payload (also
/// what a template restore writes over the template's). Returns the app
/// checksum the agent must report.
pub(super) fn write_sandbox_info(
    cfg: &VmConfig,
    mem: &guestmem::GuestMemory,
    devs: &[DevEntry],
    image: &ImageLayout,
) -> Result<u32, Error> {
    let sb = cfg.sandbox.as_str();
    let write = writer(sb, mem);
    let payload = payload(cfg);
    let usable = [BootMem {
        base: RAM_FREE_START,
        size: cfg.ram_size - RAM_FREE_START,
    }];
    let rootfs = RootfsInfo {
        image: image.rootfs,
        file: cfg.rootfs_check.as_ref().map(|(f, _)| f.clone()),
    };
    let info = BootInfo::new(cfg, &usable, devs, image.app_gpa, &rootfs);
    write(BOOT_INFO_ADDR, info.as_slice(), "boot info")?;
    if !payload.is_empty() {
        write(image.app_gpa, &payload, "app payload")?;
    }
    Ok(crate::app::checksum(&payload))
}

/// Writes on guestmem's instant-zero list, errors naming the sandbox.
fn writer<'a>(
    sb: &'a str,
    mem: &'a guestmem::GuestMemory,
) -> impl Fn(u64, &[u8], &'static str) -> Result<(), Error> + 'a {
    move |gpa, data, what| {
        mem.write_instant(gpa, data)
            .map_err(guest_write_err(sb, gpa, what))
    }
}

/// A guest memory write at `gpa` (`what`) of sandbox `sb` failed.
fn guest_write_err<'a>(
    sb: &'a str,
    gpa: u64,
    what: &'static str,
) -> impl FnOnce(guestmem::Error) -> Error + 'a {
    move |source| Error::GuestWrite {
        sandbox: sb.to_string(),
        gpa,
        what,
        source,
    }
}

/// pmem mode: copies the EROFS image (`len` bytes of `f`) to `gpa` in the
/// image region, 1 MiB at a time, timed as the VMM's part of the `rootfs`
/// stage.
pub(super) fn load_pmem_image(
    cfg: &VmConfig,
    mem: &guestmem::GuestMemory,
    f: &std::fs::File,
    len: u64,
    gpa: u64,
    trace: &TraceWriter,
) -> Result<(), Error> {
    use std::os::unix::fs::FileExt;
    let t0 = monotonic_ns();
    let write = writer(&cfg.sandbox, mem);
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        f.read_exact_at(&mut buf[..n], off)
            .map_err(|source| Error::File {
                what: "--rootfs-pmem image",
                path: cfg.rootfs_pmem.clone().unwrap_or_default(),
                source,
            })?;
        write(gpa + off, &buf[..n], "rootfs image")?;
        off += n as u64;
    }
    trace.record(Stage::Rootfs, t0, monotonic_ns())?;
    Ok(())
}
