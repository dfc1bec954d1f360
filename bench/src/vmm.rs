//! `burstvm bench vmm`: N VMM processes released at one instant, start to
//! exit, side by side with Firecracker on the same tiny guest (issue 11 §3;
//! the method of shared/peers/tiny-guest/harness.c). Per variant and
//! concurrency: wall time (release to the last exit), per-VM latency
//! p50/p99, host CPU ms per VM (user + sys from wait4's rusage, every thread
//! of the VMM) and peak RSS; variants interleaved in every repetition,
//! medians over repetitions, ratios against Firecracker.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::stats::percentile;

/// Where the guest loads: 16 MiB, as vmlinux and Firecracker's test guests.
const GUEST_LOAD: u64 = 16 << 20;
/// A VM that has not exited by then is killed (and the run fails).
const VM_LIMIT: Duration = Duration::from_secs(120);

/// What `burstvm bench vmm` runs (the `burstvm` CLI parses its flags into this).
#[derive(Debug, Clone)]
pub struct BenchVmmConfig {
    /// Numbers of VMMs released at one instant.
    pub concurrency: Vec<usize>,
    /// A Firecracker binary to run interleaved (`--no-api --config-file`).
    pub firecracker: Option<PathBuf>,
    /// Repetitions (every variant at every concurrency in each; medians).
    pub reps: usize,
    /// Guest memory of every VM, MiB.
    pub memory_mib: u64,
    /// The burstvm binary whose `vmm` runs (default: this executable).
    pub burstvm_bin: Option<PathBuf>,
}

/// Why `bench vmm` failed; each names its step, the cause is its `source()`.
#[derive(Debug, thiserror::Error)]
pub enum BenchVmmError {
    #[error("--concurrency needs numbers >= 1 and --reps >= 1")]
    Args,
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("argument with a NUL byte")]
    Nul(#[source] std::ffi::NulError),
    #[error("no {0}")]
    Missing(&'static str),
    /// A round of one variant at one concurrency.
    #[error("{what}")]
    Round {
        what: String,
        #[source]
        source: Box<BenchVmmError>,
    },
    #[error("{0} VM(s) did not exit with status 0")]
    Failed(usize),
}

type Result<T, E = BenchVmmError> = std::result::Result<T, E>;

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BenchVmmError {
    let what = what.into();
    move |source| BenchVmmError::Io { what, source }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Variant {
    Firecracker,
    /// burstvm with its built-in agent (boots to READY).
    Agent,
    /// burstvm with `--kernel` on the same ELF as Firecracker.
    Kernel,
    /// `Agent` through the VMM-only executable `burstvm-vmm`.
    VmmAgent,
    /// `Kernel` through `burstvm-vmm`.
    VmmKernel,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Firecracker => "firecracker",
            Variant::Agent => "burstvm-agent",
            Variant::Kernel => "burstvm-kernel",
            Variant::VmmAgent => "vmm-agent",
            Variant::VmmKernel => "vmm-kernel",
        }
    }

    fn kernel(self) -> bool {
        matches!(self, Variant::Kernel | Variant::VmmKernel)
    }
}

/// One round: N VMs of one variant.
#[derive(Clone, Copy, Default)]
struct Round {
    wall_us: u64,
    p50_us: u64,
    p99_us: u64,
    cpu_us_per_vm: u64,
    rss_kib_p50: u64,
    minflt_per_vm: u64,
    fails: usize,
}

fn cstr(s: impl AsRef<std::ffi::OsStr>) -> Result<CString> {
    CString::new(s.as_ref().as_bytes()).map_err(BenchVmmError::Nul)
}

/// Forks `argvs.len()` children that wait on a pipe, releases them at once
/// (closing the pipe), and reaps them with wait4.
fn run_round(argvs: &[Vec<CString>]) -> Result<Round> {
    let devnull = cstr("/dev/null")?;
    let mut fds = [0; 2];
    // SAFETY: fds has room for two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io("pipe")(std::io::Error::last_os_error()));
    }
    let (rd, wr) = (fds[0], fds[1]);
    let ptrs: Vec<Vec<*const libc::c_char>> = argvs
        .iter()
        .map(|a| {
            let mut p: Vec<_> = a.iter().map(|s| s.as_ptr()).collect();
            p.push(std::ptr::null());
            p
        })
        .collect();
    let pids = Arc::new(Mutex::new(Vec::with_capacity(argvs.len())));
    for argv in &ptrs {
        // SAFETY: the child only calls async-signal-safe functions (open,
        // dup2, read, close, execv, _exit) on data prepared before the fork.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            let e = std::io::Error::last_os_error();
            kill_all(&pids);
            // SAFETY: closing our own pipe ends.
            unsafe { (libc::close(rd), libc::close(wr)) };
            return Err(io("fork")(e));
        }
        if pid == 0 {
            // SAFETY: see above; the pointers stay valid in the child's copy.
            unsafe {
                let null = libc::open(devnull.as_ptr(), libc::O_RDWR);
                for fd in 0..3 {
                    libc::dup2(null, fd);
                }
                libc::close(wr);
                let mut c = 0u8;
                while libc::read(rd, (&mut c as *mut u8).cast(), 1) > 0 {}
                libc::execv(argv[0], argv.as_ptr());
                libc::_exit(127);
            }
        }
        pids.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(pid);
    }
    // SAFETY: the parent's copy of the read end.
    unsafe { libc::close(rd) };
    // The children are blocked in read (or about to be) when released:
    // fork returned in each, and the read blocks until the close below.
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    let watchdog = {
        let pids = pids.clone();
        std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = stop_rx.recv_timeout(VM_LIMIT) {
                kill_all(&pids);
            }
        })
    };
    let t0 = Instant::now();
    // SAFETY: closing the write end releases every child at once.
    unsafe { libc::close(wr) };
    let n = argvs.len();
    let (mut lat, mut cpu, mut rss) = (Vec::new(), Vec::new(), Vec::new());
    let (mut minflt, mut fails, mut last) = (0u64, 0, Duration::ZERO);
    while lat.len() < n {
        let mut status = 0;
        // SAFETY: an all-zero rusage is valid; wait4 fills it.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: plain wait4 for any child of ours.
        let pid = unsafe { libc::wait4(-1, &mut status, 0, &mut ru) };
        if pid < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(io("wait4")(e));
        }
        let at = t0.elapsed();
        {
            let mut p = pids.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(i) = p.iter().position(|&x| x == pid) else {
                continue; // not one of this round's (cannot happen: none other)
            };
            p.swap_remove(i);
        }
        let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
        lat.push(at.as_micros() as u64);
        cpu.push(tv(ru.ru_utime) + tv(ru.ru_stime));
        rss.push(ru.ru_maxrss as u64);
        minflt += ru.ru_minflt as u64;
        if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
            fails += 1;
        }
        last = at;
    }
    drop(stop_tx);
    let _ = watchdog.join();
    Ok(Round {
        wall_us: last.as_micros() as u64,
        p50_us: percentile(&lat, 0.5),
        p99_us: percentile(&lat, 0.99),
        cpu_us_per_vm: cpu.iter().sum::<u64>() / n as u64,
        rss_kib_p50: percentile(&rss, 0.5),
        minflt_per_vm: minflt / n as u64,
        fails,
    })
}

fn kill_all(pids: &Mutex<Vec<libc::pid_t>>) {
    for &p in pids.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        // SAFETY: an unreaped child of ours (removed from the list when reaped).
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
}

/// The argv of VM `i` of a variant.
fn argv(v: Variant, i: usize, a: &BenchVmmConfig, files: &Files) -> Result<Vec<CString>> {
    let tag = format!("bv{}-{i}", std::process::id());
    let args: Vec<std::ffi::OsString> = match v {
        Variant::Firecracker => {
            let fc = a
                .firecracker
                .as_ref()
                .ok_or(BenchVmmError::Missing("--firecracker"))?;
            let config = files.fc_config.as_os_str();
            vec![fc.into(), "--no-api".into(), "--id".into(), tag.into()]
                .into_iter()
                .chain(["--config-file".into(), config.into()])
                .collect()
        }
        Variant::Agent | Variant::Kernel | Variant::VmmAgent | Variant::VmmKernel => {
            let mem = format!("{}M", a.memory_mib);
            let mut b: Vec<std::ffi::OsString> = match v {
                Variant::VmmAgent | Variant::VmmKernel => {
                    vec![files
                        .vmm
                        .clone()
                        .ok_or(BenchVmmError::Missing("burstvm-vmm"))?
                        .into()]
                }
                _ => vec![files.burstvm.clone().into(), "vmm".into()],
            };
            for s in ["--sandbox", &tag, "--memory", &mem, "--timeout", "60"] {
                b.push(s.into());
            }
            if v.kernel() {
                b.extend(["--kernel".into(), files.guest.clone().into()]);
            }
            b
        }
    };
    args.iter().map(cstr).collect()
}

struct Files {
    burstvm: PathBuf,
    /// `burstvm-vmm` next to `burstvm`, when it was built.
    vmm: Option<PathBuf>,
    guest: PathBuf,
    fc_config: PathBuf,
}

fn write_files(dir: &Path, a: &BenchVmmConfig) -> Result<Files> {
    let guest = dir.join("guest.elf");
    std::fs::write(
        &guest,
        vmm::tiny_guest::elf(GUEST_LOAD, vmm::tiny_guest::SERIAL_THEN_RESET),
    )
    .map_err(io(format!("writing {}", guest.display())))?;
    let fc_config = dir.join("vm.json");
    let cfg = serde_json::json!({
        "boot-source": {"kernel_image_path": guest, "boot_args": "console=ttyS0"},
        "drives": [],
        "machine-config": {"vcpu_count": 1, "mem_size_mib": a.memory_mib},
    });
    std::fs::write(&fc_config, cfg.to_string())
        .map_err(io(format!("writing {}", fc_config.display())))?;
    let burstvm = match &a.burstvm_bin {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(io("the burstvm executable"))?,
    };
    let vmm = match runtime::vmmproc::program(&burstvm) {
        (p, None) => Some(p),
        (_, Some(_)) => None,
    };
    Ok(Files {
        burstvm,
        vmm,
        guest,
        fc_config,
    })
}

fn median_round(rs: &[Round]) -> Round {
    let m = |f: fn(&Round) -> u64| percentile(&rs.iter().map(f).collect::<Vec<_>>(), 0.5);
    Round {
        wall_us: m(|r| r.wall_us),
        p50_us: m(|r| r.p50_us),
        p99_us: m(|r| r.p99_us),
        cpu_us_per_vm: m(|r| r.cpu_us_per_vm),
        rss_kib_p50: m(|r| r.rss_kib_p50),
        minflt_per_vm: m(|r| r.minflt_per_vm),
        fails: rs.iter().map(|r| r.fails).sum(),
    }
}

pub fn run(a: &BenchVmmConfig) -> Result<()> {
    if a.concurrency.is_empty() || a.concurrency.contains(&0) || a.reps == 0 {
        return Err(BenchVmmError::Args);
    }
    let dir = PathBuf::from(format!("/tmp/burstvm-bench-vmm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
    let result = write_files(&dir, a).and_then(|files| run_all(a, &files));
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run_all(a: &BenchVmmConfig, files: &Files) -> Result<()> {
    let mut variants = vec![Variant::Agent, Variant::Kernel];
    match files.vmm {
        Some(_) => variants.extend([Variant::VmmAgent, Variant::VmmKernel]),
        None => eprintln!(
            "no {} next to burstvm: its variants skipped",
            runtime::vmmproc::EXE
        ),
    }
    if a.firecracker.is_some() {
        variants.insert(0, Variant::Firecracker);
    }
    let mut rounds: Vec<(Variant, usize, Vec<Round>)> = Vec::new();
    for rep in 0..a.reps {
        for &n in &a.concurrency {
            for &v in &variants {
                let argvs = (0..n)
                    .map(|i| argv(v, i, a, files))
                    .collect::<Result<Vec<_>>>()?;
                let r = run_round(&argvs).map_err(|e| BenchVmmError::Round {
                    what: format!("{} x{n}", v.name()),
                    source: Box::new(e),
                })?;
                eprintln!(
                    "rep {rep} {:<15} n={n:<4} wall {:>9.2} ms  cpu/VM {:>6.2} ms  fails {}",
                    v.name(),
                    r.wall_us as f64 / 1e3,
                    r.cpu_us_per_vm as f64 / 1e3,
                    r.fails
                );
                match rounds.iter_mut().find(|(rv, rn, _)| *rv == v && *rn == n) {
                    Some((_, _, rs)) => rs.push(r),
                    None => rounds.push((v, n, vec![r])),
                }
            }
        }
    }
    println!(
        "bench vmm: {} MiB, 1 vCPU, {} reps (medians), guest = serial + i8042 reset at {:#x}",
        a.memory_mib, a.reps, GUEST_LOAD
    );
    println!(
        "{:<15} {:>5} {:>10} {:>9} {:>9} {:>9} {:>8} {:>7} {:>5}  {:>6} {:>6}",
        "variant",
        "N",
        "wall ms",
        "p50 ms",
        "p99 ms",
        "cpu ms/VM",
        "RSS MiB",
        "minflt",
        "fails",
        "wall×",
        "cpu×"
    );
    let mut failed = 0;
    for &n in &a.concurrency {
        let fc = rounds
            .iter()
            .find(|(v, rn, _)| *v == Variant::Firecracker && *rn == n)
            .map(|(_, _, rs)| median_round(rs));
        for (v, rn, rs) in rounds.iter().filter(|(_, rn, _)| *rn == n) {
            let m = median_round(rs);
            failed += m.fails;
            let ratio = |x: u64, y: u64| match fc {
                Some(_) if y > 0 => format!("{:.2}", x as f64 / y as f64),
                _ => "-".into(),
            };
            let f = fc.unwrap_or_default();
            println!(
                "{:<15} {:>5} {:>10.2} {:>9.2} {:>9.2} {:>9.2} {:>8.1} {:>7} {:>5}  {:>6} {:>6}",
                v.name(),
                rn,
                m.wall_us as f64 / 1e3,
                m.p50_us as f64 / 1e3,
                m.p99_us as f64 / 1e3,
                m.cpu_us_per_vm as f64 / 1e3,
                m.rss_kib_p50 as f64 / 1024.0,
                m.minflt_per_vm,
                m.fails,
                ratio(m.wall_us, f.wall_us),
                ratio(m.cpu_us_per_vm, f.cpu_us_per_vm),
            );
        }
    }
    if failed > 0 {
        return Err(BenchVmmError::Failed(failed));
    }
    Ok(())
}
