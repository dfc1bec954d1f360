//! The CNI plugin executable (`type: burstvm-cni`), installed in /opt/cni/bin.
//! Exec'd per attachment: entered without std's runtime start-up
//! (`procutil::entry`).

#![no_main]

#[no_mangle]
extern "C" fn main(_argc: libc::c_int, _argv: *const *const libc::c_char) -> libc::c_int {
    procutil::entry::run(cni::plugin_main)
}
