//! Waiting until fds are readable (nix::poll): the daemon's accept loops,
//! the dataplane's idle sleep and the test frontend share this.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use vmm_sys_util::eventfd::EventFd;

/// The fd of a vmm-sys-util `EventFd` (which has no `AsFd`).
pub fn eventfd_fd(e: &EventFd) -> BorrowedFd<'_> {
    // SAFETY: the eventfd stays open for as long as `e` is borrowed, which
    // the returned lifetime is tied to.
    unsafe { BorrowedFd::borrow_raw(e.as_raw_fd()) }
}

/// Waits up to `timeout` until one of `fds` is readable (or hung up);
/// returns which are. An interrupted or failed wait reports none.
pub fn wait_readable(fds: &[BorrowedFd<'_>], timeout: Duration) -> Vec<bool> {
    let mut p: Vec<PollFd<'_>> = fds
        .iter()
        .map(|fd| PollFd::new(*fd, PollFlags::POLLIN))
        .collect();
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    let timeout = PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX);
    match poll(&mut p, timeout) {
        Ok(n) if n > 0 => p
            .iter()
            .map(|x| x.revents().is_some_and(|r| !r.is_empty()))
            .collect(),
        _ => vec![false; fds.len()],
    }
}
