//! Scheduling class and nice value of the calling thread: the one home of
//! sched_setscheduler/setpriority for the crates' helper threads (nix has
//! neither).
//!
//! - [`Policy::Idle`]: work that may wait for an idle CPU (background
//!   zeroers).
//! - [`Policy::Batch`]: control-plane threads that exchange many small
//!   messages (the vhost-user sessions on both ends). A SCHED_BATCH thread
//!   woken by a message never preempts the thread that sent it, so a
//!   sender's run of messages is read in one go instead of one context
//!   switch per message; it still gets its fair share of the CPU.
//! - [`Policy::Other`]: the default.

use std::io;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Other,
    Batch,
    Idle,
}

impl Policy {
    fn raw(self) -> libc::c_int {
        match self {
            Policy::Other => libc::SCHED_OTHER,
            Policy::Batch => libc::SCHED_BATCH,
            Policy::Idle => libc::SCHED_IDLE,
        }
    }
}

/// Sets the calling thread's scheduling policy.
pub fn set_thread_policy(policy: Policy) -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; `param` is valid for the call.
    if unsafe { libc::sched_setscheduler(0, policy.raw(), &param) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets the calling thread's nice value (a fallback where a policy change is
/// refused).
pub fn set_thread_nice(nice: i32) -> io::Result<()> {
    // SAFETY: gettid has no arguments; setpriority with PRIO_PROCESS and a
    // tid acts on that thread alone (Linux).
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, nice) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's scheduling policy.
    fn thread_policy() -> io::Result<Policy> {
        // SAFETY: pid 0 is the calling thread.
        match unsafe { libc::sched_getscheduler(0) } {
            libc::SCHED_OTHER => Ok(Policy::Other),
            libc::SCHED_BATCH => Ok(Policy::Batch),
            libc::SCHED_IDLE => Ok(Policy::Idle),
            r if r < 0 => Err(io::Error::last_os_error()),
            r => Err(io::Error::other(format!("scheduling policy {r}"))),
        }
    }

    #[test]
    fn a_thread_changes_its_own_policy_only() {
        let before = thread_policy().unwrap();
        let t = std::thread::spawn(|| {
            set_thread_policy(Policy::Batch).unwrap();
            let batch = thread_policy().unwrap();
            set_thread_policy(Policy::Other).unwrap();
            (batch, thread_policy().unwrap())
        });
        assert_eq!(t.join().unwrap(), (Policy::Batch, Policy::Other));
        assert_eq!(thread_policy().unwrap(), before);
    }

    #[test]
    fn nice_applies_to_the_calling_thread() {
        let t = std::thread::spawn(|| {
            set_thread_nice(7).unwrap();
            // SAFETY: getpriority of this thread's tid.
            unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
        });
        assert_eq!(t.join().unwrap(), 7);
    }
}
