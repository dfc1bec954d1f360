//! The agent port (docs/design.md, "Agent port"): events the VMM timestamps.
//! `ioperm` opens the two ports to this process; where it fails (not under
//! burstvm, or not x86_64) the events are skipped.

/// Agent-port events this agent sends (codes of guest/src/c/agent.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Event {
    Boot = 0x01,
    /// The main process's exec begins (`app-launch` stage).
    AppLaunchStart = 0x04,
    /// ... and is done (DATA 0: no app payload to checksum).
    AppLaunchEnd = 0x05,
    Ready = 0x06,
    Error = 0x08,
    Exit = 0x09,
    /// The container root is mounted and switched to (`rootfs-mount` stage).
    RootfsMounted = 0x10,
    /// The network is configured (`net-config` stage).
    NetConfigured = 0x11,
}

/// `ERROR` codes of the Linux agent (DATA of [`Event::Error`]), above the
/// built-in agent's range (docs/guest.md, "The guest agent (Linux guests)").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ErrorCode {
    /// The kernel command line's burstvm_* configuration is invalid.
    Config = 0x100,
    /// A mount (early filesystems, image, writable layer, overlay, root switch) failed.
    Mount = 0x101,
    /// The network configuration failed.
    Network = 0x102,
    /// The vsock listeners could not be set up.
    Vsock = 0x103,
}

pub const PORT_EVENT: u16 = 0x0f00;
pub const PORT_DATA: u16 = 0x0f04;

/// The open agent port (or none: events are skipped).
#[derive(Debug, Clone, Copy)]
pub struct AgentPort {
    enabled: bool,
}

impl AgentPort {
    /// Asks for the ports 0xf00..0xf08; a failure means "not under burstvm".
    /// Threads created later inherit the permission; children must drop it
    /// ([`drop_in_child`]).
    pub fn open() -> AgentPort {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: ioperm only changes this thread's I/O permission bitmap.
            let r = unsafe { libc::ioperm(PORT_EVENT.into(), 8, 1) };
            AgentPort { enabled: r == 0 }
        }
        #[cfg(not(target_arch = "x86_64"))]
        AgentPort { enabled: false }
    }

    /// A port that sends nothing.
    pub fn disabled() -> AgentPort {
        AgentPort { enabled: false }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Writes DATA, then EVENT.
    pub fn report(&self, event: Event, data: u32) {
        if !self.enabled {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `enabled` means ioperm granted this process the ports
        // 0xf00..0xf08; the VMM's agent port device handles both writes.
        unsafe {
            std::arch::asm!("out dx, eax", in("dx") PORT_DATA, in("eax") data, options(nomem, nostack, preserves_flags));
            std::arch::asm!("out dx, al", in("dx") PORT_EVENT, in("al") event as u8, options(nomem, nostack, preserves_flags));
        }
    }
}

/// Drops the agent port in a forked child (async-signal-safe), so that no
/// container process can send events.
pub fn drop_in_child() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: ioperm only changes the calling process's I/O bitmap; turning
    // ports off cannot fail in a way that matters here.
    unsafe {
        libc::ioperm(PORT_EVENT.into(), 8, 0);
    }
}
