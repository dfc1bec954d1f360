//! Host CPU per sandbox start, by owner (issue #11): what a variant costs on
//! a 56-core host is decided by CPU, not by wall time on 2 cores.
//!
//! - runtime: the sandbox thread's own CPU (its CPU-time clock) from the
//!   start of `Sandbox::start` to READY, plus the CPU the runtime's page-pool
//!   server ran over the round (lending memory to the VMMs, taking the NIC's
//!   registrations: `guestmem::pool::PoolServer::cpu_ns`), divided by the
//!   sandboxes;
//! - CNI plugins: `wait4` rusage of each plugin process (it includes the
//!   IPAM plugin it ran and waited for), summed per thread;
//! - VMM: the sandbox cgroup's CPU usage at READY (the VMM is its only task);
//!   of it, the vCPU threads' (their CPU clocks, which the VMM reads and
//!   sends in its READY line, `vmm::Ready`): the guest's own code, KVM's
//!   handling of its exits (under kvm_pvm that includes emulating every
//!   instruction the guest runs at CPL0) and the VMM's exit handlers;
//! - NIC daemon: its process CPU-time clock (`process_ns`) from the round's issue
//!   to the instant the last sandbox was ready, divided by the sandboxes; the
//!   part of it its CNI server's threads ran (`cni::server`, serving the
//!   plugin's commands the runtime sends itself or `burstvm-cni-thin`
//!   forwards) is booked to the CNI plugins instead (`nic_cpu`).
//!
//! The averages and their report are `bench::cpu`'s.

use std::cell::Cell;
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::process::ExitStatus;

use procutil::spawn::Child;

/// What one sandbox start cost, measured by the sandbox's own thread.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StartCpu {
    pub runtime_ns: u64,
    pub cni_ns: u64,
    pub vmm_ns: u64,
    /// Of `vmm_ns`, the VMM's vCPU threads' (the VMM's READY line,
    /// `vmm::Ready`): the guest running, KVM serving its exits and the VMM's
    /// exit handlers.
    pub vcpu_ns: u64,
    /// The VMM's CPU after READY until its background zeroer ended (the
    /// zeroing a lazy sandbox defers past its start; `Sandbox::
    /// wait_background_zeroing`), 0 if not measured. Not part of the start.
    pub vmm_after_ready_ns: u64,
}

thread_local! {
    static CHILD_CPU_NS: Cell<u64> = const { Cell::new(0) };
}

/// CPU of the child processes this thread waited for with `wait_output`.
pub fn thread_children_ns() -> u64 {
    CHILD_CPU_NS.with(|c| c.get())
}

fn tv_ns(tv: libc::timeval) -> u64 {
    tv.tv_sec as u64 * 1_000_000_000 + tv.tv_usec as u64 * 1_000
}

/// The calling thread's CPU.
pub fn thread_ns() -> u64 {
    procutil::schedstat::this_thread_ns()
}

/// CPU of a whole process (dead threads included), in nanoseconds: its
/// process CPU-time clock (`clock_getcpuclockid`). `/proc/<pid>/stat` counts
/// in clock ticks (10 ms here), which a 50-sandbox round divides into steps
/// of 0.04 ms per start, the size of what a change to the NIC daemon moves.
/// None if it is gone.
pub fn process_ns(pid: u32) -> Option<u64> {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).ok()?);
    let clock = nix::time::clock_getcpuclockid(pid).ok()?;
    let t = nix::time::clock_gettime(clock).ok()?;
    Some(u64::try_from(t.tv_sec()).ok()? * 1_000_000_000 + u64::try_from(t.tv_nsec()).ok()?)
}

/// The NIC daemon's CPU at one instant: all of it, and its CNI server's part.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NicCpu {
    pub total_ns: u64,
    /// The threads of its CNI server (`cni::server::THREAD_PREFIX`).
    pub cni_server_ns: u64,
}

impl NicCpu {
    /// What was spent from `earlier` to this sample.
    pub fn since(self, earlier: NicCpu) -> NicCpu {
        NicCpu {
            total_ns: self.total_ns.saturating_sub(earlier.total_ns),
            cni_server_ns: self.cni_server_ns.saturating_sub(earlier.cni_server_ns),
        }
    }
}

/// The NIC daemon `pid`'s CPU (None if it is gone). Its CNI server's
/// threads live as long as the daemon, so their sum only grows.
pub fn nic_cpu(pid: u32) -> Option<NicCpu> {
    let total_ns = process_ns(pid)?;
    let cni_server_ns = cni_server_ns(pid)?;
    Some(NicCpu {
        total_ns,
        cni_server_ns,
    })
}

/// The CPU of NIC daemon `pid`'s CNI server threads. Their tids are found by
/// name once per daemon and kept: the network pool samples this at every
/// refill, and reading the name of each of a busy daemon's hundreds of
/// session threads every time cost more than the refill's own CNI ADD (and
/// left dentries for every one of those threads' exits to purge).
fn cni_server_ns(pid: u32) -> Option<u64> {
    static TIDS: std::sync::Mutex<Option<(u32, Vec<u32>)>> = std::sync::Mutex::new(None);
    let mut cached = TIDS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((p, tids)) = cached.as_ref() {
        if *p == pid {
            if let Ok(ns) = procutil::schedstat::threads_ns(pid, tids) {
                return Some(ns);
            }
        }
    }
    // Another daemon, or one of its server threads is gone: look again.
    let tids =
        procutil::schedstat::named_threads(pid, |n| n.starts_with(cni::server::THREAD_PREFIX))
            .ok()?;
    let ns = procutil::schedstat::threads_ns(pid, &tids).ok()?;
    // Kept only once all of them are up (a daemon may still be starting them).
    *cached = (tids.len() == cni::server::WORKERS).then_some((pid, tids));
    Some(ns)
}

/// `Child::wait_with_output`, but reaps with `wait4` and books the child's
/// CPU (with that of the children it waited for) to this thread.
pub fn wait_output(mut child: Child) -> io::Result<(ExitStatus, Vec<u8>, Vec<u8>)> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let (mut out, mut err) = (Vec::new(), Vec::new());
    {
        let mut so = child.stdout.take();
        let mut se = child.stderr.take();
        let mut buf = [0u8; 8192];
        while so.is_some() || se.is_some() {
            // Both pipes at once: a plugin filling one cannot block on the other.
            let mut fds = Vec::new();
            for p in [
                so.as_ref().map(|p| p.as_fd()),
                se.as_ref().map(|p| p.as_fd()),
            ]
            .into_iter()
            .flatten()
            {
                fds.push(PollFd::new(p, PollFlags::POLLIN));
            }
            match poll(&mut fds, PollTimeout::NONE) {
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
                Ok(_) => {}
            }
            let ready: Vec<bool> = fds.iter().map(|f| f.any().unwrap_or(true)).collect();
            drop(fds);
            let mut ready = ready.into_iter();
            if so.is_some() && ready.next() == Some(true) && drain(&mut so, &mut buf, &mut out)? {
                so = None;
            }
            if se.is_some() && ready.next() == Some(true) && drain(&mut se, &mut buf, &mut err)? {
                se = None;
            }
        }
    }
    let (status, ru) = child.wait_rusage()?;
    let ns = tv_ns(ru.ru_utime) + tv_ns(ru.ru_stime);
    CHILD_CPU_NS.with(|c| c.set(c.get() + ns));
    Ok((status, out, err))
}

/// Reads what a ready pipe holds; true at end of file.
fn drain<R: Read>(pipe: &mut Option<R>, buf: &mut [u8], dst: &mut Vec<u8>) -> io::Result<bool> {
    let Some(r) = pipe.as_mut() else {
        return Ok(true);
    };
    match r.read(buf) {
        Ok(0) => Ok(true),
        Ok(n) => {
            dst.extend_from_slice(&buf[..n]);
            Ok(false)
        }
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use procutil::spawn::{Command, Stdio};

    #[test]
    fn child_cpu_is_booked_to_the_waiting_thread() {
        let before = thread_children_ns();
        // A child that burns some CPU and writes to both pipes.
        let child = Command::new("/bin/sh")
            .args([
                "-c",
                "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; echo out; echo err >&2; exit 3",
            ])
            .stdout(Stdio::Piped)
            .stderr(Stdio::Piped)
            .spawn()
            .unwrap();
        let (st, out, err) = wait_output(child).unwrap();
        assert_eq!(st.code(), Some(3));
        assert_eq!(out, b"out\n");
        assert_eq!(err, b"err\n");
        assert!(thread_children_ns() > before, "the loop cost CPU");
        assert!(process_ns(std::process::id()).is_some());
        assert!(thread_ns() > 0);
    }

    /// A process's CPU is read to the nanosecond: a millisecond of this
    /// thread's CPU shows in the process's count (a clock-tick count would
    /// mostly not move).
    #[test]
    fn a_process_cpu_counts_less_than_a_tick() {
        let me = std::process::id();
        let (p0, t0) = (process_ns(me).unwrap(), thread_ns());
        let mut x = 0u64;
        while thread_ns() - t0 < 1_000_000 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let (p1, t1) = (process_ns(me).unwrap(), thread_ns());
        assert!(
            p1 - p0 >= t1 - t0 - 100_000,
            "process CPU moved {} ns while this thread spent {} ns",
            p1 - p0,
            t1 - t0
        );
        assert!(process_ns(u32::MAX).is_none(), "no such process");
    }

    /// The CNI server's threads are counted by name, kept by tid while they
    /// all live, and looked up again when one of them ends.
    #[test]
    fn the_cni_servers_threads_are_sampled_until_one_ends() {
        let me = std::process::id();
        let burn = |ms: u64| {
            let t0 = thread_ns();
            let mut x = 0u64;
            while thread_ns() - t0 < ms * 1_000_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
        };
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let mut stops = Vec::new();
        let mut threads = Vec::new();
        for i in 0..cni::server::WORKERS {
            let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
            let ready = ready_tx.clone();
            stops.push(stop_tx);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("{}-{i}", cni::server::THREAD_PREFIX))
                    .spawn(move || {
                        burn(5);
                        ready.send(()).unwrap();
                        let _ = stop_rx.recv();
                    })
                    .unwrap(),
            );
        }
        for _ in 0..cni::server::WORKERS {
            ready_rx.recv().unwrap();
        }
        let all = cni_server_ns(me).unwrap();
        assert!(all >= 4 * 5_000_000, "{all} ns for 4 × 5 ms");
        assert!(cni_server_ns(me).unwrap() >= all, "sampled again");
        // One ends: the others are found again, and counted without it.
        drop(stops.remove(0));
        threads.remove(0).join().unwrap();
        let rest = cni_server_ns(me).unwrap();
        assert!(rest >= 3 * 5_000_000 && rest < all, "{rest} of {all} ns");
        drop(stops);
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(cni_server_ns(me), Some(0));
    }
}
