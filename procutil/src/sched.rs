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

/// The calling thread's nice value.
pub fn thread_nice() -> io::Result<i32> {
    // SAFETY: gettid has no arguments.
    nice_of(unsafe { libc::gettid() } as libc::id_t)
}

/// The nice value of process (or thread) `pid`.
pub fn nice_of(pid: libc::id_t) -> io::Result<i32> {
    // -1 is a valid nice value: only errno tells a failure.
    // SAFETY: errno is this thread's; getpriority reads the priority of
    // `pid` and takes no memory.
    let n = unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, pid)
    };
    let e = io::Error::last_os_error();
    if n == -1 && e.raw_os_error() != Some(0) {
        return Err(e);
    }
    Ok(n)
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
        let before = thread_nice().unwrap();
        let t = std::thread::spawn(|| {
            set_thread_nice(7).unwrap();
            thread_nice().unwrap()
        });
        assert_eq!(t.join().unwrap(), 7);
        assert_eq!(thread_nice().unwrap(), before);
        // Of another process: its own value; of none, an error.
        assert_eq!(nice_of(std::process::id()).unwrap(), before);
        assert!(nice_of(u32::MAX >> 1).is_err());
    }
}
