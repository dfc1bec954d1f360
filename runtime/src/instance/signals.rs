//! SIGINT/SIGTERM of a runtime process: the handler only sets a flag that
//! every wait loop checks, so that teardown then runs in order on the
//! threads that own the resources (children are in their own process
//! groups, so a terminal's Ctrl-C reaches only the runtime).

use std::sync::atomic::{AtomicBool, Ordering};

static SIGINT: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    SIGINT.store(true, Ordering::SeqCst);
}

/// Ctrl-C sets a flag that every wait loop checks; teardown then runs normally.
pub fn install_sigint_handler() {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_sigint as *const () as libc::sighandler_t);
    }
}

pub fn sigint_received() -> bool {
    SIGINT.load(Ordering::SeqCst)
}
