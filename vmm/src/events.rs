//! Events from vCPU threads and devices to the VMM's main loop.

use std::collections::VecDeque;
use std::sync::Mutex;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::error::GuestFailure;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmEvent {
    /// The agent reported READY.
    Ready,
    /// The agent reported EXIT with this status.
    GuestExit(u32),
    /// The guest reset the machine (i8042 reset command): the VM ends with
    /// status 0, as on Firecracker (a microVM does not reboot).
    Reset,
    /// The agent reached its template checkpoint (boot info BI_TEMPLATE).
    Checkpoint,
    /// Something ended the guest.
    Failure(GuestFailure),
}

/// A queue plus an eventfd the main loop polls.
pub struct EventSink {
    queue: Mutex<VecDeque<VmEvent>>,
    wake: EventFd,
}

impl EventSink {
    pub fn new() -> std::io::Result<Self> {
        Ok(EventSink {
            queue: Mutex::new(VecDeque::new()),
            wake: EventFd::new(EFD_NONBLOCK)?,
        })
    }

    pub fn post(&self, ev: VmEvent) {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(ev);
        // A full counter still wakes the poller, so an error here loses nothing.
        let _ = self.wake.write(1);
    }

    pub fn drain(&self) -> Vec<VmEvent> {
        let _ = self.wake.read();
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect()
    }

    pub fn wake_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsRawFd;
        // SAFETY: the eventfd lives as long as `self`, which the borrow ties to.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(self.wake.as_raw_fd()) }
    }
}
