// burstvm-vmm is exec'd once per sandbox, burstvm-cni and burstvm-ipam once
// per attachment. Linked as position-dependent executables, their relative
// relocations (~15k in the VMM, ~4.5k in the CNI plugin) are resolved by the
// linker instead of at every start, and the pages they sit in are not
// copied on write in every process (docs/vmm.md, "The burstvm-vmm
// executable"). With glibc linked statically (.cargo/config.toml) rustc asks
// for a static-pie; the later `-static` makes it a plain static executable.
const PER_START: [&str; 3] = ["burstvm-vmm", "burstvm-cni", "burstvm-ipam"];

/// The CNI forwarder: a freestanding C program (no libc, so none of glibc's
/// start-up per exec: `cli/cni-thin/thin.c`), linked as the whole of the
/// `burstvm-cni-thin` executable.
const THIN: &str = "burstvm-cni-thin";
const THIN_SRC: &str = "cni-thin/thin.c";

fn thin(out: &std::path::Path) {
    println!("cargo:rerun-if-changed={THIN_SRC}");
    println!("cargo:rerun-if-env-changed=CC");
    let obj = out.join("thin.o");
    let status = std::process::Command::new(std::env::var("CC").unwrap_or_else(|_| "gcc".into()))
        .args([
            "-c",
            "-O2",
            "-ffreestanding",
            "-fno-pie",
            "-fno-stack-protector",
            "-fno-asynchronous-unwind-tables",
            "-fno-tree-loop-distribute-patterns",
            "-std=gnu11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-o",
        ])
        .arg(&obj)
        .arg(THIN_SRC)
        .status()
        .unwrap_or_else(|e| panic!("{THIN_SRC}: cannot run the C compiler: {e}"));
    assert!(
        status.success(),
        "{THIN_SRC}: the C compiler failed: {status}"
    );
    // It may call nothing it does not define: the libc linked beside it for
    // std's sake never had its start-up run (and memcpy & co. are glibc's IFUNCs).
    let nm = std::process::Command::new("nm")
        .arg("--undefined-only")
        .arg(&obj)
        .output()
        .unwrap_or_else(|e| panic!("{THIN_SRC}: cannot run nm: {e}"));
    assert!(nm.status.success(), "nm {}: {}", obj.display(), nm.status);
    let undefined = String::from_utf8_lossy(&nm.stdout);
    assert!(
        undefined.trim().is_empty(),
        "{THIN_SRC} calls functions it does not define: {undefined}"
    );
    for arg in ["-nostartfiles", "-nostdlib", "-no-pie", "-static"] {
        println!("cargo:rustc-link-arg-bin={THIN}={arg}");
    }
    println!("cargo:rustc-link-arg-bin={THIN}={}", obj.display());
}

fn main() {
    thin(std::path::Path::new(
        &std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"),
    ));
    println!("cargo:rerun-if-env-changed=CARGO_CFG_TARGET_FEATURE");
    let features = std::env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    let crt_static = features.split(',').any(|f| f == "crt-static");
    for bin in PER_START {
        println!("cargo:rustc-link-arg-bin={bin}=-no-pie");
        if crt_static {
            println!("cargo:rustc-link-arg-bin={bin}=-static");
        }
    }
}
