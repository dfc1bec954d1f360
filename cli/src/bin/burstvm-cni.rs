//! The CNI plugin executable (`type: burstvm-cni`), installed in /opt/cni/bin.

fn main() {
    std::process::exit(cni::plugin_main());
}
