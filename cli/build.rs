// burstvm-vmm is exec'd once per sandbox. Linked as a position-dependent
// executable, its ~15k relative relocations are resolved by the linker instead
// of by ld.so at every start (docs/vmm.md, "The burstvm-vmm executable").
fn main() {
    println!("cargo:rustc-link-arg-bin=burstvm-vmm=-no-pie");
}
