//! containerd's runtime v2 shim for burstvm (`--runtime io.containerd.burstvm.v2`).

fn main() {
    shim::run();
}
