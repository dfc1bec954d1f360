//! From an OCI `process` to a spawned process: checks made at
//! `CreateProcess`, the program's path, and the steps of the child between
//! its creation and exec.
//!
//! Processes are made with `clone(CLONE_VM | CLONE_VFORK)`, as
//! `posix_spawn` does, not with `fork` (`procutil::spawn`, which the runtime
//! uses for its children too): a fork copies the agent's page tables, which
//! under kvm_pvm (the guest kernel emulated instruction by instruction) took
//! seconds per process; a child that shares the agent's memory until its exec
//! copies nothing. Such a child must not allocate, take a lock or call a libc
//! function that touches process-wide state (glibc's `setuid` signals every
//! thread of the agent): its steps are raw system calls on data prepared
//! before the clone.

use std::ffi::CString;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use agent_proto::{AgentError, ErrorCode, Process};
use nix::sys::resource::Resource;
use nix::sys::stat::Mode;
use nix::unistd::{Gid, Uid};

/// The PATH searched when the process's environment has none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// An OCI rlimit name (`RLIMIT_NOFILE`, ...) as a resource.
pub fn rlimit_resource(name: &str) -> Option<Resource> {
    Some(match name {
        "RLIMIT_AS" => Resource::RLIMIT_AS,
        "RLIMIT_CORE" => Resource::RLIMIT_CORE,
        "RLIMIT_CPU" => Resource::RLIMIT_CPU,
        "RLIMIT_DATA" => Resource::RLIMIT_DATA,
        "RLIMIT_FSIZE" => Resource::RLIMIT_FSIZE,
        "RLIMIT_LOCKS" => Resource::RLIMIT_LOCKS,
        "RLIMIT_MEMLOCK" => Resource::RLIMIT_MEMLOCK,
        "RLIMIT_MSGQUEUE" => Resource::RLIMIT_MSGQUEUE,
        "RLIMIT_NICE" => Resource::RLIMIT_NICE,
        "RLIMIT_NOFILE" => Resource::RLIMIT_NOFILE,
        "RLIMIT_NPROC" => Resource::RLIMIT_NPROC,
        "RLIMIT_RSS" => Resource::RLIMIT_RSS,
        "RLIMIT_RTPRIO" => Resource::RLIMIT_RTPRIO,
        "RLIMIT_RTTIME" => Resource::RLIMIT_RTTIME,
        "RLIMIT_SIGPENDING" => Resource::RLIMIT_SIGPENDING,
        "RLIMIT_STACK" => Resource::RLIMIT_STACK,
        _ => return None,
    })
}

fn invalid(id: &str, what: impl std::fmt::Display) -> AgentError {
    AgentError::new(ErrorCode::Invalid, format!("process {id}: {what}"))
}

/// The checks of `CreateProcess`: what can be wrong with the spec itself.
pub fn validate(id: &str, p: &Process) -> Result<(), AgentError> {
    if id.is_empty() {
        return Err(AgentError::new(ErrorCode::Invalid, "empty process id"));
    }
    if p.args.first().is_none_or(|a| a.is_empty()) {
        return Err(invalid(id, "no args"));
    }
    if !p.cwd.starts_with('/') {
        return Err(invalid(id, format!("cwd {:?} is not absolute", p.cwd)));
    }
    let nul = |s: &str| s.contains('\0');
    if p.args.iter().any(|a| nul(a)) || p.env.iter().any(|e| nul(e)) || nul(&p.cwd) {
        return Err(invalid(id, "a NUL byte in args, env or cwd"));
    }
    if let Some(e) = p
        .env
        .iter()
        .find(|e| e.split_once('=').is_none_or(|(k, _)| k.is_empty()))
    {
        return Err(invalid(id, format!("env entry {e:?} is not KEY=VALUE")));
    }
    for r in &p.rlimits {
        if rlimit_resource(&r.kind).is_none() {
            return Err(invalid(id, format!("unknown rlimit {:?}", r.kind)));
        }
        if r.soft > r.hard {
            return Err(invalid(
                id,
                format!("rlimit {}: soft {} over hard {}", r.kind, r.soft, r.hard),
            ));
        }
    }
    Ok(())
}

/// `path` (absolute, as the process sees it) on the agent's side.
fn under(root: Option<&Path>, path: &Path) -> PathBuf {
    match root {
        Some(r) => r.join(path.strip_prefix("/").unwrap_or(path)),
        None => path.to_owned(),
    }
}

fn is_executable(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The program to exec: `args[0]` if it holds a `/` (relative to cwd), else
/// the first executable `args[0]` in the PATH of the process's environment
/// (or [`DEFAULT_PATH`]). Looked up as the process will see its root
/// (absolute symbolic links inside a chroot `root` resolve on the agent's
/// side: the guest's processes have no chroot, the agent switched root).
pub fn resolve_program(id: &str, p: &Process, root: Option<&Path>) -> Result<PathBuf, AgentError> {
    let arg0 = &p.args[0];
    let spawn = |what: String| AgentError::new(ErrorCode::Spawn, format!("process {id}: {what}"));
    if arg0.contains('/') {
        let path = Path::new(&p.cwd).join(arg0);
        if !is_executable(&under(root, &path)) {
            return Err(spawn(format!(
                "{} is not an executable file",
                path.display()
            )));
        }
        return Ok(path);
    }
    let path_var = p
        .env
        .iter()
        .find_map(|e| e.strip_prefix("PATH="))
        .unwrap_or(DEFAULT_PATH);
    for dir in path_var.split(':').filter(|d| !d.is_empty()) {
        let cand = Path::new(&p.cwd).join(dir).join(arg0);
        if is_executable(&under(root, &cand)) {
            return Ok(cand);
        }
    }
    Err(spawn(format!(
        "executable {arg0:?} not found in PATH {path_var}"
    )))
}

/// The three standard streams of a child (a stream the process does not
/// have is /dev/null, opened by the caller).
#[derive(Debug)]
pub struct Stdio3 {
    pub stdin: OwnedFd,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

/// What the child does between its creation and exec, all prepared
/// beforehand: raw system calls only (see the module's header).
#[derive(Debug, Clone)]
struct ChildSteps {
    root: Option<CString>,
    cwd: CString,
    rlimits: Vec<(Resource, libc::rlimit)>,
    groups: Vec<libc::gid_t>,
    uid: libc::uid_t,
    gid: libc::gid_t,
    umask: Option<libc::mode_t>,
    terminal: bool,
    no_new_privs: bool,
    drop_ioperm: bool,
    /// Set groups, gid and uid (off when the agent is not root and the
    /// process keeps the agent's ids: tests as a user).
    switch_user: bool,
}

/// `Err(errno)` of a raw system call's return value.
fn check(r: libc::c_long) -> Result<(), i32> {
    if r < 0 {
        Err(io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL))
    } else {
        Ok(())
    }
}

impl ChildSteps {
    /// Runs in the child: raw system calls only. Err: the errno.
    fn run(&self) -> Result<(), i32> {
        if self.drop_ioperm {
            crate::port::drop_in_child();
        }
        // SAFETY: plain system calls on values and NUL-terminated strings
        // prepared before the clone.
        unsafe {
            // Every process leads its own session; a terminal process's
            // terminal (its fd 0) becomes the session's controlling terminal.
            check(libc::syscall(libc::SYS_setsid))?;
            if self.terminal {
                check(libc::syscall(libc::SYS_ioctl, 0, libc::TIOCSCTTY, 0))?;
            }
            for (r, lim) in &self.rlimits {
                let res = *r as libc::c_int;
                check(libc::syscall(
                    libc::SYS_setrlimit,
                    res,
                    lim as *const libc::rlimit,
                ))?;
            }
            if let Some(root) = &self.root {
                check(libc::syscall(libc::SYS_chroot, root.as_ptr()))?;
            }
            check(libc::syscall(libc::SYS_chdir, self.cwd.as_ptr()))?;
            if let Some(m) = self.umask {
                libc::syscall(libc::SYS_umask, m);
            }
            if self.switch_user {
                check(libc::syscall(
                    libc::SYS_setgroups,
                    self.groups.len(),
                    self.groups.as_ptr(),
                ))?;
                check(libc::syscall(libc::SYS_setgid, self.gid))?;
                check(libc::syscall(libc::SYS_setuid, self.uid))?;
            }
            if self.no_new_privs {
                check(libc::syscall(
                    libc::SYS_prctl,
                    libc::PR_SET_NO_NEW_PRIVS,
                    1,
                    0,
                    0,
                    0,
                ))?;
            }
        }
        Ok(())
    }
}

/// A process ready to be spawned: program, argv, environment, stdio and
/// [`ChildSteps`] (session, terminal, rlimits, root, cwd, umask, groups,
/// gid, uid, no_new_privs, in that order), every byte prepared.
#[derive(Debug)]
pub struct Spawn {
    program: PathBuf,
    /// argv[0] as given, then the rest.
    argv: Vec<String>,
    /// KEY=VALUE entries: exactly the process's environment.
    env: Vec<(String, String)>,
    stdio: Stdio3,
    steps: ChildSteps,
}

impl Spawn {
    /// Creates the process (`procutil::spawn`: a clone sharing the agent's memory until
    /// its exec); returns its pid once it has exec'd. A failure before the exec (a step or
    /// the exec itself) is the child's errno; the failed child is reaped there.
    pub fn spawn(&self) -> io::Result<i32> {
        let mut c = procutil::spawn::Command::new(&self.program);
        if let Some((arg0, rest)) = self.argv.split_first() {
            c.arg0(arg0).args(rest);
        }
        c.env_clear();
        for (k, v) in &self.env {
            c.env(k, v);
        }
        c.stdin(self.stdio.stdin.try_clone()?)
            .stdout(self.stdio.stdout.try_clone()?)
            .stderr(self.stdio.stderr.try_clone()?);
        let steps = self.steps.clone();
        // SAFETY: ChildSteps::run makes raw system calls on data prepared before the spawn.
        unsafe {
            c.pre_exec(move || steps.run().map_err(io::Error::from_raw_os_error));
        }
        Ok(c.spawn()?.id() as i32)
    }
}

/// What the agent adds to every process it spawns.
#[derive(Debug, Clone, Copy, Default)]
pub struct Extras {
    /// Drop the agent port's I/O permission.
    pub drop_ioperm: bool,
    /// Keep glibc off AVX (`with_no_avx`).
    pub no_avx: bool,
}

/// glibc's tunable that keeps its string and memory functions (and its other ifuncs) off
/// AVX, AVX2 and AVX-512. Under kvm_pvm user code runs natively with the host's XCR0, so
/// CPUID and XGETBV say AVX-512 is usable, while the guest kernel can save only the
/// x87/SSE state between tasks (it cannot use XSAVE there): two processes using AVX
/// corrupt each other's upper vector and mask registers. glibc in every process does
/// (`cat f | cat` crashed in glibc's startup 3 to 6 times in 10; docs/guest.md).
pub const NO_AVX_TUNABLES: &str = "glibc.cpu.hwcaps=-AVX,-AVX2,-AVX512F,-AVX512DQ,-AVX512BW,\
-AVX512CD,-AVX512VL,-AVX512_IFMA,-AVX512_VBMI,-AVX512_VBMI2,-AVX512_VNNI,-AVX512_BITALG,\
-AVX512_VPOPCNTDQ,-AVX512_BF16,-AVX_VNNI,-FMA,-F16C,-XSAVE,-XSAVEC";

/// `env` with [`NO_AVX_TUNABLES`]: added as GLIBC_TUNABLES when there is none, appended
/// to one that sets no `glibc.cpu.hwcaps`, and a process's own hwcaps left as they are.
pub fn with_no_avx(env: &[String]) -> Vec<String> {
    const KEY: &str = "GLIBC_TUNABLES=";
    let mut out = env.to_vec();
    match out.iter_mut().find(|e| e.starts_with(KEY)) {
        None => out.push(format!("{KEY}{NO_AVX_TUNABLES}")),
        Some(e)
            if !e[KEY.len()..]
                .split(':')
                .any(|t| t.starts_with("glibc.cpu.hwcaps=")) =>
        {
            if e.len() > KEY.len() {
                e.push(':');
            }
            e.push_str(NO_AVX_TUNABLES);
        }
        Some(_) => {}
    }
    out
}

/// The spawn of a validated `p`: its program, argv (argv[0] as given),
/// its environment (with `extras`), its stdio, and [`ChildSteps`].
pub fn command(
    id: &str,
    p: &Process,
    root: Option<&Path>,
    stdio: Stdio3,
    extras: Extras,
) -> Result<Spawn, AgentError> {
    let drop_ioperm = extras.drop_ioperm;
    let program = resolve_program(id, p, root)?;
    let cwd_outside = under(root, Path::new(&p.cwd));
    if !cwd_outside.is_dir() {
        return Err(AgentError::new(
            ErrorCode::Spawn,
            format!("process {id}: cwd {} is not a directory", p.cwd),
        ));
    }
    let cstr = |b: &[u8]| CString::new(b).map_err(|_| invalid(id, "a NUL byte in a path"));
    let steps = ChildSteps {
        root: root.map(|r| cstr(r.as_os_str().as_bytes())).transpose()?,
        cwd: cstr(p.cwd.as_bytes())?,
        rlimits: p
            .rlimits
            .iter()
            .filter_map(|r| {
                let lim = libc::rlimit {
                    rlim_cur: r.soft,
                    rlim_max: r.hard,
                };
                Some((rlimit_resource(&r.kind)?, lim))
            })
            .collect(),
        groups: p.user.additional_gids.clone(),
        uid: p.user.uid,
        gid: p.user.gid,
        umask: p
            .user
            .umask
            .map(|m| Mode::from_bits_truncate(m as libc::mode_t).bits()),
        terminal: p.terminal,
        no_new_privs: p.no_new_privileges,
        drop_ioperm,
        switch_user: Uid::effective().is_root()
            || p.user.uid != Uid::effective().as_raw()
            || p.user.gid != Gid::effective().as_raw(),
    };
    if let Some(a) = p.args.iter().find(|a| a.contains('\0')) {
        return Err(invalid(id, format!("a NUL byte in argument {a:?}")));
    }
    // The process's environment, KEY=VALUE entries only.
    let env = if extras.no_avx {
        with_no_avx(&p.env)
    } else {
        p.env.clone()
    };
    let env = env
        .iter()
        .filter_map(|e| e.split_once('='))
        .map(|(k, v)| {
            if k.contains('\0') || v.contains('\0') {
                Err(invalid(id, "a NUL byte in the environment"))
            } else {
                Ok((k.to_string(), v.to_string()))
            }
        })
        .collect::<Result<_, _>>()?;
    Ok(Spawn {
        program,
        argv: p.args.clone(),
        env,
        stdio,
        steps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_avx_tunables_are_added_appended_or_left_to_the_process() {
        let env = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let ours = format!("GLIBC_TUNABLES={NO_AVX_TUNABLES}");
        assert_eq!(with_no_avx(&env(&["A=1"])), env(&["A=1", &ours]));
        assert_eq!(
            with_no_avx(&env(&["GLIBC_TUNABLES=glibc.malloc.arena_max=2"])),
            env(&[&format!(
                "GLIBC_TUNABLES=glibc.malloc.arena_max=2:{NO_AVX_TUNABLES}"
            )])
        );
        assert_eq!(with_no_avx(&env(&["GLIBC_TUNABLES="])), env(&[&ours]));
        let own = env(&["GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX2"]);
        assert_eq!(with_no_avx(&own), own, "a process's own hwcaps stay");
        assert!(NO_AVX_TUNABLES.starts_with("glibc.cpu.hwcaps=-AVX,-AVX2,-AVX512F,"));
        assert!(!NO_AVX_TUNABLES.contains(' ') && !NO_AVX_TUNABLES.contains('\n'));
    }
    use agent_proto::Rlimit;

    #[test]
    fn validation() {
        let ok = Process::from_args(["true"]);
        validate("a", &ok).unwrap();
        let mut p = ok.clone();
        p.args.clear();
        assert_eq!(validate("a", &p).unwrap_err().code, ErrorCode::Invalid);
        let mut p = ok.clone();
        p.env = vec!["NOEQUALS".into()];
        assert!(validate("a", &p).unwrap_err().message.contains("NOEQUALS"));
        let mut p = ok.clone();
        p.cwd = "rel".into();
        assert!(validate("a", &p).is_err());
        let mut p = ok.clone();
        p.rlimits = vec![Rlimit {
            kind: "RLIMIT_BOGUS".into(),
            hard: 1,
            soft: 1,
        }];
        assert!(validate("a", &p)
            .unwrap_err()
            .message
            .contains("RLIMIT_BOGUS"));
        assert!(validate("", &ok).is_err());
    }

    #[test]
    fn program_lookup() {
        let mut p = Process::from_args(["sh"]);
        assert!(resolve_program("a", &p, None).unwrap().ends_with("sh"));
        p.env = vec!["PATH=/nonexistent".into()];
        let e = resolve_program("a", &p, None).unwrap_err();
        assert_eq!(e.code, ErrorCode::Spawn);
        assert!(e.message.contains("/nonexistent"), "{e}");
        let p = Process::from_args(["/bin/sh"]);
        assert_eq!(
            resolve_program("a", &p, None).unwrap(),
            Path::new("/bin/sh")
        );
        let p = Process::from_args(["/etc/passwd"]);
        assert!(resolve_program("a", &p, None).is_err());
    }
}
