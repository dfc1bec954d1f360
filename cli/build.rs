// burstvm-vmm is exec'd once per sandbox, burstvm-cni and burstvm-ipam once
// per attachment. Linked as position-dependent executables, their relative
// relocations (~15k in the VMM, ~4.5k in the CNI plugin) are resolved by the
// linker instead of at every start, and the pages they sit in are not
// copied on write in every process (docs/vmm.md, "The burstvm-vmm
// executable"). With glibc linked statically (.cargo/config.toml) rustc asks
// for a static-pie; the later `-static` makes it a plain static executable.
const PER_START: [&str; 3] = ["burstvm-vmm", "burstvm-cni", "burstvm-ipam"];

fn main() {
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
