//! vCPU threads: KVM_RUN and exit handling, and the kick signal that gets
//! a thread out of KVM_RUN when the VMM stops.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_ioctls::{VcpuExit, VcpuFd};

use crate::bus::Bus;
use crate::error::GuestFailure;
use crate::events::{EventSink, VmEvent};

/// Real-time signal used to kick vCPU threads out of KVM_RUN (as Firecracker).
pub fn kick_signal() -> i32 {
    vmm_sys_util::signal::SIGRTMIN()
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Only interrupts KVM_RUN (EINTR); the thread then checks its stop flag.
}

pub fn install_kick_handler() -> std::io::Result<()> {
    vmm_sys_util::signal::register_signal_handler(kick_signal(), on_kick)
        .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
}

pub struct Vcpu {
    pub id: u8,
    pub fd: VcpuFd,
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub sink: Arc<EventSink>,
    pub stop: Arc<AtomicBool>,
    /// vCPU 0 stores its first KVM_RUN time here (start of `boot`).
    pub start_ns: Arc<AtomicU64>,
    /// Filled when the thread was stopped from outside (see `stopped_state`).
    pub last_state: Arc<Mutex<Vec<(u8, String)>>>,
}

/// What one KVM_RUN ended with, after the I/O was served.
enum Step {
    Continue,
    Fail(GuestFailure),
    InternalError,
    TripleFault,
}

impl Vcpu {
    pub fn spawn(self) -> std::io::Result<JoinHandle<()>> {
        std::thread::Builder::new()
            .name(format!("vcpu{}", self.id))
            .spawn(move || self.run())
    }

    fn step(&mut self) -> Step {
        let id = self.id;
        match self.fd.run() {
            Ok(VcpuExit::IoIn(port, data)) => {
                if !self.pio.read(port as u64, data) {
                    data.fill(0xff); // floating bus
                }
                Step::Continue
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                self.pio.write(port as u64, data);
                Step::Continue
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                if !self.mmio.read(addr, data) {
                    tracing::debug!("vcpu{id}: MMIO read of unmapped {addr:#x}");
                    data.fill(0);
                }
                Step::Continue
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                if !self.mmio.write(addr, data) {
                    tracing::debug!("vcpu{id}: MMIO write to unmapped {addr:#x}");
                }
                Step::Continue
            }
            Ok(VcpuExit::Hlt) => Step::Fail(GuestFailure::HltInterruptsOff { vcpu: id }),
            Ok(VcpuExit::Shutdown) => Step::TripleFault,
            Ok(VcpuExit::InternalError) => Step::InternalError,
            Ok(VcpuExit::FailEntry(reason, _)) => {
                Step::Fail(GuestFailure::FailEntry { vcpu: id, reason })
            }
            Ok(VcpuExit::IrqWindowOpen) | Ok(VcpuExit::Intr) => Step::Continue,
            Ok(VcpuExit::SystemEvent(kind, _)) => Step::Fail(GuestFailure::UnexpectedExit {
                vcpu: id,
                what: format!("KVM_EXIT_SYSTEM_EVENT type {kind} (guest reset or power-off)"),
            }),
            Ok(other) => Step::Fail(GuestFailure::UnexpectedExit {
                vcpu: id,
                what: format!("{other:?}"),
            }),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => Step::Continue,
            Err(e) => Step::Fail(GuestFailure::UnexpectedExit {
                vcpu: id,
                what: format!("KVM_RUN failed: {e}"),
            }),
        }
    }

    /// Where the guest was, for failure messages.
    fn cpu_state(&self) -> String {
        match (self.fd.get_regs(), self.fd.get_sregs()) {
            (Ok(r), Ok(s)) => format!(
                "rip={:#x} rsp={:#x} cr0={:#x} cr3={:#x} cr4={:#x} efer={:#x}",
                r.rip, r.rsp, s.cr0, s.cr3, s.cr4, s.efer
            ),
            _ => "unknown state".to_string(),
        }
    }

    /// What the vCPU was doing when it was stopped from outside.
    fn stopped_state(&self) -> String {
        let halted = self
            .fd
            .get_mp_state()
            .map(|m| m.mp_state == kvm_bindings::KVM_MP_STATE_HALTED)
            .unwrap_or(false);
        let interrupts_on = self
            .fd
            .get_regs()
            .map(|r| r.rflags & 0x200 != 0)
            .unwrap_or(true);
        let what = match (halted, interrupts_on) {
            (true, false) => "executed hlt with interrupts off",
            (true, true) => "halted, waiting for an interrupt",
            _ => "running",
        };
        format!("{what} ({})", self.cpu_state())
    }

    fn run(mut self) {
        if self.id == 0 {
            self.start_ns
                .store(trace::monotonic_ns(), Ordering::Release);
        }
        loop {
            if self.stop.load(Ordering::Acquire) {
                let state = self.stopped_state();
                self.last_state
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((self.id, state));
                break;
            }
            match self.step() {
                Step::Continue => {}
                Step::InternalError => {
                    // SAFETY: the exit reason was KVM_EXIT_INTERNAL_ERROR, so
                    // `internal` is the active member of the union.
                    let suberror =
                        unsafe { self.fd.get_kvm_run().__bindgen_anon_1.internal.suberror };
                    let failure = if suberror == kvm_bindings::KVM_INTERNAL_ERROR_EMULATION {
                        GuestFailure::EmulationFailure {
                            vcpu: self.id,
                            state: self.cpu_state(),
                        }
                    } else {
                        GuestFailure::InternalError {
                            vcpu: self.id,
                            suberror,
                        }
                    };
                    self.sink.post(VmEvent::Failure(failure));
                    break;
                }
                Step::TripleFault => {
                    let state = self.cpu_state();
                    self.sink.post(VmEvent::Failure(GuestFailure::TripleFault {
                        vcpu: self.id,
                        state,
                    }));
                    break;
                }
                Step::Fail(f) => {
                    self.sink.post(VmEvent::Failure(f));
                    break;
                }
            }
        }
    }
}

/// Stops vCPU threads: set the flag, then signal each thread until it has
/// left KVM_RUN (a single signal could land just before it re-enters).
/// Returns the threads that did not stop within `limit`.
pub fn stop_all(stop: &AtomicBool, threads: Vec<JoinHandle<()>>, limit: Duration) -> usize {
    use std::os::unix::thread::JoinHandleExt;
    stop.store(true, Ordering::Release);
    let deadline = Instant::now() + limit;
    let mut left = threads;
    while !left.is_empty() && Instant::now() < deadline {
        for t in &left {
            if !t.is_finished() {
                // SAFETY: the handle keeps the thread id valid until joined.
                unsafe { libc::pthread_kill(t.as_pthread_t(), kick_signal()) };
            }
        }
        std::thread::sleep(Duration::from_millis(1));
        let (done, running): (Vec<_>, Vec<_>) = left.into_iter().partition(|t| t.is_finished());
        for t in done {
            let _ = t.join();
        }
        left = running;
    }
    left.len()
}
