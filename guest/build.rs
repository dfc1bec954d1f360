//! Builds the freestanding C agent into a flat binary linked at LOAD_ADDR.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const SOURCES: &[&str] = &[
    "entry.S",
    "agent.c",
    "virtio.c",
    "virtio_net.c",
    "virtio_blk.c",
    "sg.c",
    "net.c",
    "erofs.c",
    "rootfs.c",
];
const HEADERS: &[&str] = &[
    "agent.h",
    "bootinfo.h",
    "virtio.h",
    "net.h",
    "sg.h",
    "csum.h",
    "erofs.h",
    "rootfs.h",
];
const LINKER_SCRIPT: &str = "agent.ld";

const CFLAGS: &[&str] = &[
    "-ffreestanding",
    "-nostdlib",
    "-mno-red-zone",
    "-fno-pic",
    "-fno-pie",
    "-fno-stack-protector",
    "-mgeneral-regs-only",
    "-fno-asynchronous-unwind-tables",
    "-fno-builtin",
    "-fno-tree-loop-distribute-patterns",
    "-O2",
    "-static",
    "-std=gnu11",
    "-Wall",
    "-Wextra",
    "-Werror",
    // The image sits at 3 GiB, outside the small code model's signed 32-bit
    // range, so absolute addresses need 64-bit relocations.
    "-mcmodel=large",
];

fn run(cmd: &mut Command) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("guest build: cannot run {cmd:?}: {e}"));
    assert!(status.success(), "guest build: {cmd:?} failed: {status}");
}

fn main() {
    let src = Path::new("src/c");
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR for build scripts"));
    let cc = env::var("GUEST_CC").unwrap_or_else(|_| "gcc".into());

    for f in SOURCES.iter().chain(HEADERS).chain([&LINKER_SCRIPT]) {
        println!("cargo:rerun-if-changed={}", src.join(f).display());
    }
    println!("cargo:rerun-if-changed=src/c");
    println!("cargo:rerun-if-env-changed=GUEST_CC");

    let mut objs = Vec::new();
    for f in SOURCES {
        let obj = out.join(format!("{f}.o"));
        run(Command::new(&cc)
            .args(CFLAGS)
            .arg("-c")
            .arg(src.join(f))
            .arg("-o")
            .arg(&obj));
        objs.push(obj);
    }

    let elf = out.join("agent.elf");
    run(Command::new(&cc)
        .args(CFLAGS)
        .arg("-Wl,--build-id=none")
        .arg("-Wl,-T")
        .arg(src.join(LINKER_SCRIPT))
        .args(&objs)
        .arg("-o")
        .arg(&elf));

    let bin = out.join("agent.bin");
    run(Command::new("objcopy")
        .args(["-O", "binary"])
        .arg(&elf)
        .arg(&bin));

    let nm = Command::new("nm")
        .arg(&elf)
        .output()
        .expect("guest build: cannot run nm");
    let syms = String::from_utf8_lossy(&nm.stdout);
    let addr_of = |name: &str| -> u64 {
        syms.lines()
            .find_map(|l| {
                let mut it = l.split_whitespace();
                let (a, _t, n) = (it.next()?, it.next()?, it.next()?);
                (n == name).then(|| u64::from_str_radix(a, 16).ok())?
            })
            .unwrap_or_else(|| panic!("guest build: symbol {name} missing in {}", elf.display()))
    };
    let entry = addr_of("_start");
    let image_end = addr_of("__image_end");
    let len = fs::metadata(&bin)
        .expect("guest build: the linked agent image")
        .len();
    assert!(
        0xC000_0000 + len >= image_end,
        "guest build: agent.bin ({len} bytes) does not cover .bss (ends at {image_end:#x})"
    );

    // burstvm init for Linux guests: a static, freestanding user-space ELF.
    let init_src = Path::new("linux/init.c");
    println!("cargo:rerun-if-changed={}", init_src.display());
    run(Command::new(&cc)
        .args([
            "-static",
            "-nostdlib",
            "-ffreestanding",
            "-fno-pie",
            "-no-pie",
            "-fno-stack-protector",
            "-fno-asynchronous-unwind-tables",
            "-fno-tree-loop-distribute-patterns",
            "-O2",
            "-std=gnu11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-Wl,--build-id=none",
            "-s",
        ])
        .arg(init_src)
        .arg("-o")
        .arg(out.join("linux_init")));

    fs::write(
        out.join("agent_consts.rs"),
        format!("pub const ENTRY_ADDR: u64 = {entry:#x};\n"),
    )
    .expect("guest build: write agent_consts.rs");
}
