//! The IPAM plugin executable (`ipam.type: burstvm-ipam`), installed in
//! /opt/cni/bin for plugins other than burstvm-cni (which runs it in-process).
//! Exec'd per attachment: entered without std's runtime start-up
//! (`procutil::entry`).

#![no_main]

#[no_mangle]
extern "C" fn main(_argc: libc::c_int, _argv: *const *const libc::c_char) -> libc::c_int {
    procutil::entry::run(cni::ipam::plugin_main)
}
