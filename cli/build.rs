// burstvm-vmm is exec'd once per sandbox. Linked as a position-dependent
// executable, its ~15k relative relocations are resolved by the linker instead
// of at every start (docs/vmm.md, "The burstvm-vmm executable"). With glibc
// linked statically (.cargo/config.toml) rustc asks for a static-pie; the
// later `-static` makes it a plain static executable.
fn main() {
    println!("cargo:rerun-if-env-changed=CARGO_CFG_TARGET_FEATURE");
    println!("cargo:rustc-link-arg-bin=burstvm-vmm=-no-pie");
    let features = std::env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    if features.split(',').any(|f| f == "crt-static") {
        println!("cargo:rustc-link-arg-bin=burstvm-vmm=-static");
    }
}
