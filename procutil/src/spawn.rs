//! Spawning a child as posix_spawn does: `clone(CLONE_VM | CLONE_VFORK)`, so the child runs on
//! the parent's memory until it execs and nothing is copied. std's `Command` falls back to
//! `fork()` as soon as a `pre_exec` step is set, and a fork of a large, many-threaded process
//! (the runtime in a burst of sandbox starts) copies its page tables, write-protects its memory
//! (a TLB shootdown on every CPU running one of its threads) and makes every thread that writes
//! memory before the child execs copy that page: milliseconds of CPU per child. The pre-exec
//! steps the runtime needs (a network namespace, a process group, PR_SET_PDEATHSIG, cgroup
//! membership) and the guest agent's (a session, a root, ids, rlimits) have no posix_spawn
//! attribute, so the clone is done here, with glibc's rules: every signal blocked around it,
//! the child's signals reset to their defaults before anything else, and the child's error
//! handed back through the memory it shares with its parent. The program starts as std's
//! `Command` starts one: no signal blocked, none ignored (std resets SIGPIPE, which Rust
//! programs ignore; here every signal goes back to its default).
//!
//! The pre-exec step runs in a child that shares the parent's memory and whose parent thread
//! is suspended: it may only make system calls (async-signal-safe, no allocation, no lock),
//! as for std's `pre_exec`, and must not write memory other than its own stack.

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicI32, Ordering};

pub use crate::child::{Child, Process};

/// Where a child's standard stream goes.
#[derive(Debug)]
pub enum Stdio {
    /// The parent's.
    Inherit,
    /// /dev/null.
    Null,
    /// A pipe; the parent's end is in [`Child`] (`stdin`, `stdout`, `stderr`).
    Piped,
    /// This descriptor.
    Fd(OwnedFd),
}

impl From<File> for Stdio {
    fn from(f: File) -> Stdio {
        Stdio::Fd(f.into())
    }
}

impl From<OwnedFd> for Stdio {
    fn from(f: OwnedFd) -> Stdio {
        Stdio::Fd(f)
    }
}

type PreExec = Box<dyn FnMut() -> io::Result<()> + Send>;

/// A program to spawn: the subset of std's `Command` the runtime uses.
pub struct Command {
    program: OsString,
    /// argv[0] when it is not the program's path.
    arg0: Option<OsString>,
    args: Vec<OsString>,
    /// Changes to the environment (`None`: removed): the inherited one, or none
    /// (`env_clear`).
    env: BTreeMap<OsString, Option<OsString>>,
    clear_env: bool,
    stdio: [Stdio; 3],
    pre_exec: Option<PreExec>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Command")
            .field("program", &self.program)
            .field("args", &self.args)
            .finish_non_exhaustive()
    }
}

impl Command {
    /// `program` is run as given: a path (no PATH search).
    pub fn new(program: impl AsRef<OsStr>) -> Command {
        Command {
            program: program.as_ref().to_os_string(),
            arg0: None,
            args: Vec::new(),
            env: BTreeMap::new(),
            clear_env: false,
            stdio: [Stdio::Inherit, Stdio::Inherit, Stdio::Inherit],
            pre_exec: None,
        }
    }

    pub fn get_program(&self) -> &OsStr {
        &self.program
    }

    /// argv[0] other than the program's path (std's `CommandExt::arg0`).
    pub fn arg0(&mut self, a: impl AsRef<OsStr>) -> &mut Command {
        self.arg0 = Some(a.as_ref().to_os_string());
        self
    }

    /// Starts from an empty environment instead of the parent's.
    pub fn env_clear(&mut self) -> &mut Command {
        self.clear_env = true;
        self.env.clear();
        self
    }

    pub fn arg(&mut self, a: impl AsRef<OsStr>) -> &mut Command {
        self.args.push(a.as_ref().to_os_string());
        self
    }

    pub fn args<I, S>(&mut self, args: I) -> &mut Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        for a in args {
            self.arg(a);
        }
        self
    }

    pub fn env(&mut self, key: impl AsRef<OsStr>, val: impl AsRef<OsStr>) -> &mut Command {
        self.env.insert(
            key.as_ref().to_os_string(),
            Some(val.as_ref().to_os_string()),
        );
        self
    }

    pub fn env_remove(&mut self, key: impl AsRef<OsStr>) -> &mut Command {
        self.env.insert(key.as_ref().to_os_string(), None);
        self
    }

    pub fn stdin(&mut self, s: impl Into<Stdio>) -> &mut Command {
        self.stdio[0] = s.into();
        self
    }

    pub fn stdout(&mut self, s: impl Into<Stdio>) -> &mut Command {
        self.stdio[1] = s.into();
        self
    }

    pub fn stderr(&mut self, s: impl Into<Stdio>) -> &mut Command {
        self.stdio[2] = s.into();
        self
    }

    /// A step between clone and exec, in the child.
    ///
    /// # Safety
    /// As std's `CommandExt::pre_exec`, and more: the child shares the parent's memory, so
    /// the step must only make system calls (no allocation, no lock, no panic) and write no
    /// memory but its own stack. Descriptors it uses must stay open until `spawn` returns.
    pub unsafe fn pre_exec(
        &mut self,
        f: impl FnMut() -> io::Result<()> + Send + 'static,
    ) -> &mut Command {
        self.pre_exec = Some(Box::new(f));
        self
    }

    /// Starts the program. Returns once it has exec'd (or failed to: then its error).
    pub fn spawn(&mut self) -> io::Result<Child> {
        let cstr = |s: &OsStr| {
            CString::new(s.as_bytes()).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("spawn {:?}: a NUL byte in {s:?}", self.program),
                )
            })
        };
        if !self.program.as_bytes().contains(&b'/') {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("spawn {:?}: not a path", self.program),
            ));
        }
        let path = cstr(&self.program)?;
        let mut argv = vec![match &self.arg0 {
            Some(a) => cstr(a)?,
            None => path.clone(),
        }];
        for a in &self.args {
            argv.push(cstr(a)?);
        }
        let mut env: BTreeMap<OsString, OsString> = if self.clear_env {
            BTreeMap::new()
        } else {
            std::env::vars_os().collect()
        };
        for (k, v) in &self.env {
            match v {
                Some(v) => env.insert(k.clone(), v.clone()),
                None => env.remove(k),
            };
        }
        let mut envp = Vec::with_capacity(env.len());
        for (k, v) in &env {
            let mut kv = k.clone();
            kv.push("=");
            kv.push(v);
            envp.push(cstr(&kv)?);
        }
        let ptrs = |v: &[CString]| -> Vec<*const libc::c_char> {
            v.iter()
                .map(|c| c.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect()
        };
        let (argv_p, envp_p) = (ptrs(&argv), ptrs(&envp));

        // The child's end of each stream (dup2'd onto 0, 1, 2) and the parent's end of a pipe.
        let mut child_ends: [Option<OwnedFd>; 3] = [None, None, None];
        let mut parent_ends: [Option<OwnedFd>; 3] = [None, None, None];
        for (i, s) in self.stdio.iter_mut().enumerate() {
            match std::mem::replace(s, Stdio::Inherit) {
                Stdio::Inherit => {}
                Stdio::Null => child_ends[i] = Some(File::open("/dev/null")?.into()),
                Stdio::Fd(fd) => child_ends[i] = Some(fd),
                Stdio::Piped => {
                    let (r, w) = pipe()?;
                    let (c, p) = if i == 0 { (r, w) } else { (w, r) };
                    child_ends[i] = Some(c);
                    parent_ends[i] = Some(p);
                }
            }
        }
        // A child end numbered 0..=2 could be overwritten by an earlier dup2: move it up.
        for end in child_ends.iter_mut().flatten() {
            if end.as_raw_fd() <= 2 {
                *end = dup_above_stdio(end)?;
            }
        }
        let mut ctx = ChildCtx {
            path: path.as_ptr(),
            argv: argv_p.as_ptr(),
            envp: envp_p.as_ptr(),
            stdio: std::array::from_fn(|i| child_ends[i].as_ref().map_or(-1, |f| f.as_raw_fd())),
            pre_exec: self.pre_exec.as_mut(),
            err: AtomicI32::new(0),
        };
        let stack = ChildStack::new()?;
        // Every signal of this thread blocked (glibc's internal ones too, as its posix_spawn
        // does): no handler of ours runs in the child before it reset them.
        let old = set_mask(&full_set());
        // SAFETY: CLONE_VFORK suspends this thread until the child execs or exits, so ctx,
        // the argv/envp arrays and the stack outlive every use the child makes of them;
        // child_main only makes system calls.
        let pid = unsafe {
            libc::clone(
                child_main,
                stack.top(),
                libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                (&mut ctx as *mut ChildCtx<'_>).cast(),
            )
        };
        let clone_err = io::Error::last_os_error();
        set_mask(&old);
        if pid < 0 {
            return Err(clone_err);
        }
        drop(stack);
        let err = ctx.err.load(Ordering::Acquire);
        if err != 0 {
            let mut st = 0;
            // SAFETY: reaps our own child, which exited before exec.
            unsafe { libc::waitpid(pid, &mut st, 0) };
            return Err(io::Error::from_raw_os_error(err));
        }
        let [stdin, stdout, stderr] = parent_ends;
        Ok(Child::new(
            pid,
            stdin.map(File::from),
            stdout.map(File::from),
            stderr.map(File::from),
        ))
    }
}

fn full_set() -> libc::sigset_t {
    // SAFETY: sigfillset initializes the set.
    unsafe {
        let mut s: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut s);
        s
    }
}

/// The calling thread's signal mask becomes `set` (the raw system call: glibc's wrapper keeps
/// its own signals unblocked); returns the old one. Async-signal-safe.
fn set_mask(set: &libc::sigset_t) -> libc::sigset_t {
    // SAFETY: both point to sigset_t values; the kernel reads and writes 8 bytes of each.
    unsafe {
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK,
            set as *const libc::sigset_t,
            &mut old as *mut libc::sigset_t,
            8usize,
        );
        old
    }
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two descriptors that we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn dup_above_stdio(fd: &OwnedFd) -> io::Result<OwnedFd> {
    // SAFETY: fcntl on a descriptor we own; the new one is ours.
    let n = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just created.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

/// What the child reads (prepared by the parent) and its one write: `err`.
struct ChildCtx<'a> {
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    /// Descriptors to become 0, 1, 2 (-1: inherit).
    stdio: [RawFd; 3],
    pre_exec: Option<&'a mut PreExec>,
    /// errno of the step that failed (0: the child exec'd).
    err: AtomicI32,
}

const STACK_BYTES: usize = 64 << 10;
const PAGE: usize = 4096;

/// The child's stack, with a guard page below it: an overflow faults instead of writing
/// into the parent's memory.
struct ChildStack(*mut libc::c_void);

impl ChildStack {
    fn new() -> io::Result<ChildStack> {
        // SAFETY: a fresh private mapping; its lowest page is made inaccessible.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                STACK_BYTES + PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            );
            if p == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            if libc::mprotect(p, PAGE, libc::PROT_NONE) < 0 {
                let e = io::Error::last_os_error();
                libc::munmap(p, STACK_BYTES + PAGE);
                return Err(e);
            }
            Ok(ChildStack(p))
        }
    }

    fn top(&self) -> *mut libc::c_void {
        // SAFETY: one past the end of the mapping (the stack grows down), 16-byte aligned.
        unsafe { self.0.cast::<u8>().add(STACK_BYTES + PAGE).cast() }
    }
}

impl Drop for ChildStack {
    fn drop(&mut self) {
        // SAFETY: our own mapping, no longer used (the child exec'd or exited).
        unsafe { libc::munmap(self.0, STACK_BYTES + PAGE) };
    }
}

extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: arg is the parent's ChildCtx, alive while the parent thread is suspended.
    let ctx = unsafe { &mut *arg.cast::<ChildCtx<'_>>() };
    let r = child_setup(ctx);
    let errno = match r {
        Ok(()) => {
            // SAFETY: the arrays are NUL-terminated and outlive the exec.
            unsafe { libc::execve(ctx.path, ctx.argv, ctx.envp) };
            io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EINVAL)
        }
        Err(e) => e.raw_os_error().unwrap_or(libc::EINVAL),
    };
    ctx.err.store(errno.max(1), Ordering::Release);
    // SAFETY: ends the child without running anything of the parent's (no atexit, no flush).
    unsafe { libc::_exit(127) }
}

fn child_setup(ctx: &mut ChildCtx<'_>) -> io::Result<()> {
    // SAFETY: system calls only. A handler of the parent's must never run here, on shared
    // memory, and the program starts with every signal at its default: all go back to
    // SIG_DFL (the sighand table is the child's own copy without CLONE_SIGHAND).
    unsafe {
        // The kernel's struct sigaction (handler, flags, restorer, mask), through the raw
        // system call: glibc's wrapper refuses its own two signals (32, 33).
        let dfl: [u64; 4] = [libc::SIG_DFL as u64, 0, 0, 0];
        for sig in 1..=64 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::syscall(
                    libc::SYS_rt_sigaction,
                    sig,
                    dfl.as_ptr(),
                    std::ptr::null_mut::<u64>(),
                    8usize,
                );
            }
        }
        for (target, &fd) in ctx.stdio.iter().enumerate() {
            if fd >= 0 && libc::dup2(fd, target as RawFd) < 0 {
                return Err(io::Error::last_os_error());
            }
        }
    }
    if let Some(f) = ctx.pre_exec.as_mut() {
        f()?;
    }
    // The program's mask (exec keeps it): nothing blocked.
    // SAFETY: an all-zero sigset_t is the empty set.
    set_mask(&unsafe { std::mem::zeroed() });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::process::ExitStatusExt;
    use std::sync::atomic::AtomicU32;
    use std::sync::Arc;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("/bin/sh");
        c.args(["-c", script]);
        c
    }

    #[test]
    fn output_env_and_exit_status_come_back() {
        let mut c = sh("echo \"$GREETING\"; echo err >&2; exit 3");
        c.env("GREETING", "hello")
            .env_remove("HOME")
            .stdout(Stdio::Piped)
            .stderr(Stdio::Piped);
        let mut ch = c.spawn().unwrap();
        let (mut out, mut err) = (String::new(), String::new());
        ch.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        ch.stderr.take().unwrap().read_to_string(&mut err).unwrap();
        assert_eq!((out.as_str(), err.as_str()), ("hello\n", "err\n"));
        assert_eq!(ch.wait().unwrap().code(), Some(3));
        // Reaped once; asked again, the same status.
        assert_eq!(ch.try_wait().unwrap().and_then(|s| s.code()), Some(3));
    }

    #[test]
    fn stdin_is_a_pipe_and_removed_variables_are_gone() {
        let mut c = sh("test -z \"$HOME\" && cat");
        c.env_remove("HOME")
            .stdin(Stdio::Piped)
            .stdout(Stdio::Piped);
        let mut ch = c.spawn().unwrap();
        ch.stdin
            .take()
            .unwrap()
            .write_all(b"through the pipe")
            .unwrap();
        let mut out = String::new();
        ch.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        assert_eq!(out, "through the pipe");
        assert!(ch.wait().unwrap().success());
    }

    /// The child runs on the parent's memory until it execs (CLONE_VM): not a fork.
    #[test]
    fn the_pre_exec_step_runs_on_the_parents_memory() {
        static SEEN_PID: AtomicU32 = AtomicU32::new(0);
        let mut c = Command::new("/bin/true");
        // SAFETY: getpid and one atomic store to a static, no allocation.
        unsafe {
            c.pre_exec(|| {
                SEEN_PID.store(libc::getpid() as u32, Ordering::Relaxed);
                Ok(())
            });
        }
        let mut ch = c.spawn().unwrap();
        assert_eq!(SEEN_PID.load(Ordering::Relaxed), ch.id());
        assert!(ch.wait().unwrap().success());
    }

    #[test]
    fn a_failing_pre_exec_step_is_the_spawns_error_and_leaves_no_child() {
        let ran = Arc::new(AtomicU32::new(0));
        let r = ran.clone();
        let mut c = Command::new("/bin/true");
        // SAFETY: an atomic add, no allocation; the error is an OS error (no allocation).
        unsafe {
            c.pre_exec(move || {
                r.fetch_add(1, Ordering::Relaxed);
                Err(io::Error::from_raw_os_error(libc::EPERM))
            });
        }
        let e = c.spawn().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        assert_eq!(ran.load(Ordering::Relaxed), 1);
        // Reaped by the spawn: this thread has no child, not even a zombie.
        let children = std::fs::read_to_string("/proc/thread-self/children").unwrap();
        assert_eq!(children.trim(), "", "children left: {children}");
    }

    #[test]
    fn a_missing_program_is_enoent_and_a_bare_name_is_refused() {
        let e = Command::new("/nonexistent/prog").spawn().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "{e}");
        let e = Command::new("true").spawn().unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        assert!(e.to_string().contains("not a path"), "{e}");
    }

    #[test]
    fn descriptors_stay_private_unless_given() {
        let (r, w) = pipe().unwrap();
        // The write end is CLOEXEC: the child does not hold it, so the read end sees EOF
        // once the parent's is closed.
        let mut c = sh("sleep 0.2");
        c.stdout(Stdio::Null);
        let mut ch = c.spawn().unwrap();
        drop(w);
        let mut buf = Vec::new();
        File::from(r).read_to_end(&mut buf).unwrap();
        assert!(buf.is_empty());
        assert!(ch.wait().unwrap().success());
        // Given as stdout (Fd), the same kind of descriptor reaches the program.
        let (r, w) = pipe().unwrap();
        let mut c = sh("echo given");
        c.stdout(Stdio::from(w));
        let mut ch = c.spawn().unwrap();
        let mut out = String::new();
        File::from(r).read_to_string(&mut out).unwrap();
        assert_eq!(out, "given\n");
        assert!(ch.wait().unwrap().success());
    }

    /// As std starts one: nothing blocked, nothing ignored, whatever the parent does (Rust
    /// ignores SIGPIPE; this thread blocks SIGUSR2 for the spawn).
    #[test]
    fn the_program_starts_with_no_signal_blocked_or_ignored() {
        // SAFETY: sigset operations on a local set; the mask is this thread's, restored below.
        let old = unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGUSR2);
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
            old
        };
        let mut c = Command::new("/bin/cat");
        c.arg("/proc/self/status").stdout(Stdio::Piped);
        let mut ch = c.spawn().unwrap();
        // SAFETY: restores this thread's mask.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
        let mut status = String::new();
        ch.stdout
            .take()
            .unwrap()
            .read_to_string(&mut status)
            .unwrap();
        assert!(ch.wait().unwrap().success());
        for field in ["SigBlk:", "SigIgn:"] {
            let line = status.lines().find(|l| l.starts_with(field)).unwrap();
            assert!(
                line.split_whitespace()
                    .nth(1)
                    .unwrap()
                    .chars()
                    .all(|c| c == '0'),
                "{line}"
            );
        }
    }

    #[test]
    fn kill_ends_a_running_child_with_sigkill() {
        let mut ch = sh("sleep 30").spawn().unwrap();
        assert!(ch.try_wait().unwrap().is_none());
        ch.kill().unwrap();
        assert_eq!(ch.wait().unwrap().signal(), Some(libc::SIGKILL));
        // Killing a reaped child is a no-op, not an error about another process.
        ch.kill().unwrap();
    }
}
