//! vCPU threads: KVM_RUN and exit handling, and the kick signal that gets
//! a thread out of KVM_RUN when the VMM stops.
//!
//! Stopping needs no polling: the kick handler sets the vCPU's
//! `kvm_run.immediate_exit` (as Firecracker does), so a kick that lands
//! just before the thread enters KVM_RUN still makes KVM_RUN return EINTR
//! at once; one kick per thread is enough. Each thread holds a sender of a
//! channel whose receiver `stop_all` waits on: it disconnects when the last
//! thread ended.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_ioctls::{VcpuExit, VcpuFd};

use crate::bus::Bus;
use crate::coalesced::Ring;
use crate::error::GuestFailure;
use crate::events::{EventSink, VmEvent};

/// Real-time signal used to kick vCPU threads out of KVM_RUN (as Firecracker).
pub fn kick_signal() -> i32 {
    vmm_sys_util::signal::SIGRTMIN()
}

thread_local! {
    /// This thread's `kvm_run` (null on threads that are not vCPUs).
    static KVM_RUN: Cell<*mut kvm_bindings::kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Interrupts KVM_RUN (EINTR), and makes the next KVM_RUN return at once
    // should the signal land before the thread (re-)enters it; the thread
    // then checks its stop flag. A const thread-local Cell of a pointer is a
    // plain TLS load (no lazy init, no destructor): async-signal-safe.
    let run = KVM_RUN.with(|r| r.get());
    if !run.is_null() {
        // SAFETY: set by this thread to its own vCPU's kvm_run mapping, which
        // lives until the thread clears it before dropping the VcpuFd.
        unsafe { std::ptr::addr_of_mut!((*run).immediate_exit).write_volatile(1) };
    }
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
    /// The VM's coalesced-MMIO ring (one for all vCPUs), when KVM has one.
    pub coalesced: Option<Arc<Mutex<Ring>>>,
    pub sink: Arc<EventSink>,
    pub stop: Arc<AtomicBool>,
    /// vCPU 0 stores its first KVM_RUN time here (start of `boot`).
    pub start_ns: Arc<AtomicU64>,
    /// Filled when the thread was stopped from outside (see `stopped_state`).
    pub last_state: Arc<Mutex<Vec<(u8, String)>>>,
    /// Dropped when the thread ends (see `stop_all`).
    pub done: Sender<()>,
}

/// The running vCPU threads and the channel that disconnects when all ended.
pub struct VcpuThreads {
    handles: Vec<JoinHandle<()>>,
    done_tx: Option<Sender<()>>,
    done_rx: Receiver<()>,
}

impl VcpuThreads {
    pub fn new() -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        VcpuThreads {
            handles: Vec::new(),
            done_tx: Some(tx),
            done_rx: rx,
        }
    }

    /// A sender for the next vCPU.
    pub fn done_sender(&self) -> Sender<()> {
        self.done_tx.clone().expect("sender is kept until stop_all")
    }

    pub fn push(&mut self, t: JoinHandle<()>) {
        self.handles.push(t);
    }

    /// The CPU the running vCPU threads have used, in ns (their thread
    /// CPU-time clocks; a thread that ended is not counted).
    pub fn cpu_ns(&self) -> u64 {
        use std::os::unix::thread::JoinHandleExt;
        let mut total = 0;
        for t in self.handles.iter().filter(|t| !t.is_finished()) {
            let mut clock: libc::clockid_t = 0;
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: the handle keeps the thread id valid until joined;
            // both calls write only into the locals passed.
            let ok = unsafe {
                libc::pthread_getcpuclockid(t.as_pthread_t(), &mut clock) == 0
                    && libc::clock_gettime(clock, &mut ts) == 0
            };
            if ok {
                total += ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
            }
        }
        total
    }
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
        let exit = self.fd.run();
        // Writes KVM batched are applied before the exit is served
        // (crate::coalesced): the guest sees them in program order.
        drain(self.coalesced.as_deref(), &self.mmio);
        match exit {
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
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                // Cleared before the loop checks the stop flag: a kick that
                // comes after that check (the flag is set before every kick)
                // sets it again, so no kick is lost.
                self.fd.set_kvm_immediate_exit(0);
                Step::Continue
            }
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
        let run: *mut kvm_bindings::kvm_run = self.fd.get_kvm_run();
        KVM_RUN.with(|r| r.set(run));
        self.run_loop();
        // Before the VcpuFd (and its kvm_run mapping) is dropped.
        KVM_RUN.with(|r| r.set(std::ptr::null_mut()));
        // The vCPU is closed before stop_all learns that this thread ended.
        let Vcpu { fd, done, .. } = self;
        drop(fd);
        drop(done);
    }

    fn run_loop(&mut self) {
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

/// Applies the writes in the coalesced-MMIO ring to the MMIO bus.
fn drain(ring: Option<&Mutex<Ring>>, mmio: &Bus) {
    if let Some(r) = ring {
        r.lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(|addr, data| {
                mmio.write(addr, data);
            });
    }
}

/// Stops vCPU threads: set the flag, kick each thread once (the handler's
/// `immediate_exit` covers a kick that lands outside KVM_RUN), and wait for
/// all to end without polling. Returns how many did not stop within `limit`
/// (those are left running; the process is about to exit).
pub fn stop_all(stop: &AtomicBool, mut threads: VcpuThreads, limit: Duration) -> usize {
    use std::os::unix::thread::JoinHandleExt;
    stop.store(true, Ordering::Release);
    for t in &threads.handles {
        if !t.is_finished() {
            // SAFETY: the handle keeps the thread id valid until joined.
            unsafe { libc::pthread_kill(t.as_pthread_t(), kick_signal()) };
        }
    }
    drop(threads.done_tx.take());
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match threads.done_rx.recv_timeout(left) {
            Ok(()) => continue,
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => {
                return threads.handles.iter().filter(|t| !t.is_finished()).count()
            }
        }
    }
    for t in threads.handles {
        let _ = t.join();
    }
    0
}
