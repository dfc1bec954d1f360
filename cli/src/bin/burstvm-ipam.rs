//! The IPAM plugin executable (`ipam.type: burstvm-ipam`), installed in
//! /opt/cni/bin for plugins other than burstvm-cni (which runs it in-process).

fn main() {
    std::process::exit(cni::ipam::plugin_main());
}
