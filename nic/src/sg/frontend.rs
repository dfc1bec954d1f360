//! The host-side SG frontend: a "guest" in a memfd that drives one SG
//! function over a real vhost-user session, with `sgiov::driver::Driver`
//! doing what the guest driver does (docs/sgiov.md §7) and [`VuFrontend`]
//! the transport (§8): the attach command on the setup queue, the doorbell
//! as queue 1's kick eventfd, the interrupt as its call eventfd. Used by
//! `bench sgiov` and the daemon tests; a benchmark shards its sockets over
//! a few of these (one per thread), never one per socket.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sgiov::driver::{Driver, DriverConfig, DriverError};
use sgiov::layout::{SetupCmd, SETUP_DETACH, SETUP_MAGIC};
use sgiov::mem::{Memory, RawMemory};
use vm_memory::ByteValued;

use crate::frontend::{FrontendError, FrontendMemory, VuFrontend, BUFFERS};
use crate::poll::{eventfd_fd, wait_readable};

/// Where the setup command and its status live (after the two vrings).
const SETUP_CMD: u64 = BUFFERS;
const SETUP_STATUS: u64 = BUFFERS + 64;
/// The area (at most 16 MiB), then the ring heap up to the end of memory.
pub const AREA: u64 = 0x10_0000;
pub const HEAP: u64 = 0x110_0000;
const SETUP_Q: usize = sgiov::layout::SETUP_QUEUE as usize;
const SIGNAL_Q: usize = sgiov::layout::SIGNAL_QUEUE as usize;

#[derive(Debug, thiserror::Error)]
pub enum SgFrontendError {
    #[error(transparent)]
    Frontend(#[from] FrontendError),
    #[error("SG frontend on {socket}")]
    Driver {
        socket: String,
        #[source]
        source: DriverError,
    },
    #[error("SG frontend on {socket}: memory of {size} bytes is below the ring heap at {HEAP:#x}")]
    Size { socket: String, size: usize },
    #[error("SG frontend on {socket}: setup command refused with status {status}")]
    Refused { socket: String, status: u32 },
    #[error("SG frontend on {socket}: no answer to the setup command within {timeout:?}")]
    Timeout { socket: String, timeout: Duration },
}

#[derive(Debug)]
pub struct SgFrontend {
    /// Declared before `vu`: dropped first (its memory view points into `vu`'s mapping).
    pub drv: Driver,
    vu: VuFrontend,
    /// Doorbells rung.
    pub doorbells: u64,
    /// Interrupts taken.
    pub interrupts: u64,
}

impl SgFrontend {
    /// Connects to an SGF socket, lays out the area in `mem_size` bytes of
    /// fresh memory and attaches it.
    pub fn connect(
        socket: &Path,
        mem_size: usize,
        cfg: DriverConfig,
    ) -> Result<SgFrontend, SgFrontendError> {
        let name = socket.display().to_string();
        if mem_size <= HEAP as usize {
            return Err(SgFrontendError::Size {
                socket: name,
                size: mem_size,
            });
        }
        // `dedicated` mode: one signal-only vring (kick + call) per channel.
        let vu = VuFrontend::connect_channels(
            socket,
            FrontendMemory::new(mem_size, false)?,
            cfg.channels as usize,
        )?;
        let (base, size) = vu.mem().host();
        // SAFETY: the mapping belongs to `vu`, which the returned value owns
        // and drops after `drv` (field order); the view is used only by `drv`.
        let view: Arc<dyn Memory> =
            Arc::new(unsafe { RawMemory::new(format!("frontend {name}"), base, 0, size, None) });
        let derr = |source| SgFrontendError::Driver {
            socket: name.clone(),
            source,
        };
        let (drv, setup) = Driver::new(view, AREA, HEAP, size as u64 - HEAP, cfg).map_err(derr)?;
        let mut me = SgFrontend {
            drv,
            vu,
            doorbells: 0,
            interrupts: 0,
        };
        me.setup(setup)?;
        Ok(me)
    }

    /// Posts a setup command and waits for its status (non-zero: refused).
    pub fn setup(&mut self, cmd: SetupCmd) -> Result<(), SgFrontendError> {
        let timeout = Duration::from_secs(10);
        let cmd_bytes = cmd.as_slice();
        let slot = self.vu.next_slot(SETUP_Q) & !1;
        // SAFETY: both buffers are in this frontend's own memory (ptr checks bounds).
        unsafe {
            std::ptr::copy_nonoverlapping(
                cmd_bytes.as_ptr(),
                self.vu.ptr(SETUP_CMD, cmd_bytes.len()),
                cmd_bytes.len(),
            );
            std::ptr::write_volatile(self.vu.ptr(SETUP_STATUS, 4) as *mut u32, u32::MAX);
        }
        self.vu.write_desc(
            SETUP_Q,
            slot,
            SETUP_CMD,
            cmd_bytes.len() as u32,
            1,
            slot + 1,
        );
        self.vu
            .write_desc(SETUP_Q, slot + 1, SETUP_STATUS, 4, 2 /* WRITE */, 0);
        let want = self.vu.used_idx(SETUP_Q).wrapping_add(1);
        self.vu.publish(SETUP_Q, slot);
        let end = Instant::now() + timeout;
        while self.vu.used_idx(SETUP_Q) != want {
            if Instant::now() >= end {
                return Err(SgFrontendError::Timeout {
                    socket: self.vu.socket().into(),
                    timeout,
                });
            }
            wait_readable(
                &[eventfd_fd(self.vu.call_fd(SETUP_Q))],
                Duration::from_millis(10),
            );
            let _ = self.vu.call_fd(SETUP_Q).read();
        }
        // SAFETY: in our own memory.
        let status = u32::from_le(unsafe {
            std::ptr::read_volatile(self.vu.ptr(SETUP_STATUS, 4) as *const u32)
        });
        if status != 0 {
            return Err(SgFrontendError::Refused {
                socket: self.vu.socket().into(),
                status,
            });
        }
        Ok(())
    }

    /// Detaches the area (the device stops touching it).
    pub fn detach(&mut self) -> Result<(), SgFrontendError> {
        self.setup(SetupCmd {
            magic: SETUP_MAGIC,
            op: SETUP_DETACH,
            ..Default::default()
        })
    }

    /// Rings the doorbell if the driver's flush says the device wants one.
    pub fn flush(&mut self) -> Result<bool, SgFrontendError> {
        let ring = self.drv.flush().map_err(|source| SgFrontendError::Driver {
            socket: self.vu.socket().into(),
            source,
        })?;
        if ring {
            let _ = self.vu.kick_fd(SIGNAL_Q).write(1);
            self.doorbells += 1;
        }
        // `dedicated` mode: each channel that wants it gets its own doorbell.
        let chans = self.drv.take_channel_kicks();
        for &k in &chans {
            if let Some((kick, _)) = self.vu.channel_fds(k as usize) {
                let _ = kick.write(1);
                self.doorbells += 1;
            }
        }
        Ok(ring || !chans.is_empty())
    }

    /// Flushes, waits up to `timeout` for the interrupt, and runs the
    /// driver's interrupt handler (also without one: it only drains what is
    /// there). Returns whether an interrupt came.
    pub fn pump(&mut self, timeout: Duration) -> Result<bool, SgFrontendError> {
        self.flush()?;
        // The Cross-FIFO's interrupt and, in `dedicated` mode, every channel's.
        let calls: Vec<&vmm_sys_util::eventfd::EventFd> =
            std::iter::once(self.vu.call_fd(SIGNAL_Q))
                .chain((0..self.vu.channels()).filter_map(|k| self.vu.channel_fds(k).map(|c| &c.1)))
                .collect();
        let ready = wait_readable(
            &calls.iter().map(|c| eventfd_fd(c)).collect::<Vec<_>>(),
            timeout,
        );
        let mut irq = false;
        for (c, r) in calls.iter().zip(ready) {
            if r {
                let _ = c.read();
                self.interrupts += 1;
                irq = true;
            }
        }
        self.drv
            .interrupt()
            .map_err(|source| SgFrontendError::Driver {
                socket: self.vu.socket().into(),
                source,
            })?;
        Ok(irq)
    }

    /// Pumps until the reply to control request `req` arrives; its status.
    pub fn wait_reply(&mut self, req: u32, timeout: Duration) -> Result<u32, SgFrontendError> {
        let end = Instant::now() + timeout;
        loop {
            if let Some(r) = self.drv.reply(req) {
                return Ok(r.status);
            }
            if Instant::now() >= end {
                return Err(SgFrontendError::Timeout {
                    socket: self.vu.socket().into(),
                    timeout,
                });
            }
            self.pump(Duration::from_millis(5))?;
        }
    }

    /// The interrupt eventfd (for a thread that waits on several frontends).
    pub fn interrupt_fd(&self) -> &vmm_sys_util::eventfd::EventFd {
        self.vu.call_fd(SIGNAL_Q)
    }
}
