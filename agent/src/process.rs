//! From an OCI `process` to a `Command`: checks made at `CreateProcess`,
//! the program's path, and the steps of the child between fork and exec.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use agent_proto::{AgentError, ErrorCode, Process};
use nix::sys::resource::{setrlimit, Resource};
use nix::sys::stat::{umask, Mode};
use nix::unistd::{chdir, chroot, setgid, setgroups, setsid, setuid, Gid, Uid};

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

/// The three standard streams of a child.
pub struct Stdio3 {
    pub stdin: Stdio,
    pub stdout: Stdio,
    pub stderr: Stdio,
}

/// What the child does between fork and exec, all prepared beforehand (no
/// allocation in the child).
struct ChildSteps {
    root: Option<CString>,
    cwd: CString,
    rlimits: Vec<(Resource, u64, u64)>,
    groups: Vec<Gid>,
    uid: Uid,
    gid: Gid,
    umask: Option<Mode>,
    terminal: bool,
    no_new_privs: bool,
    drop_ioperm: bool,
    /// Set groups, gid and uid (off when the agent is not root and the
    /// process keeps the agent's ids: tests as a user).
    switch_user: bool,
}

impl ChildSteps {
    /// Runs in the forked child: only async-signal-safe calls.
    fn run(&self) -> std::io::Result<()> {
        if self.drop_ioperm {
            crate::port::drop_in_child();
        }
        // Every process leads its own session; a terminal process's
        // terminal (its fd 0) becomes the session's controlling terminal.
        setsid()?;
        if self.terminal {
            crate::pty::make_controlling_terminal()?;
        }
        for &(r, soft, hard) in &self.rlimits {
            setrlimit(r, soft, hard)?;
        }
        if let Some(root) = &self.root {
            chroot(root.as_c_str())?;
        }
        chdir(self.cwd.as_c_str())?;
        if let Some(m) = self.umask {
            umask(m);
        }
        if self.switch_user {
            setgroups(&self.groups)?;
            setgid(self.gid)?;
            setuid(self.uid)?;
        }
        if self.no_new_privs {
            nix::sys::prctl::set_no_new_privs()?;
        }
        Ok(())
    }
}

/// The command for a validated `p`: its program, argv (argv[0] as given),
/// exactly its environment, its stdio, and [`ChildSteps`] (session, terminal,
/// rlimits, root, cwd, umask, groups, gid, uid, no_new_privs, in that order).
pub fn command(
    id: &str,
    p: &Process,
    root: Option<&Path>,
    stdio: Stdio3,
    drop_ioperm: bool,
) -> Result<Command, AgentError> {
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
            .filter_map(|r| Some((rlimit_resource(&r.kind)?, r.soft, r.hard)))
            .collect(),
        groups: p
            .user
            .additional_gids
            .iter()
            .map(|&g| Gid::from_raw(g))
            .collect(),
        uid: Uid::from_raw(p.user.uid),
        gid: Gid::from_raw(p.user.gid),
        umask: p
            .user
            .umask
            .map(|m| Mode::from_bits_truncate(m as libc::mode_t)),
        terminal: p.terminal,
        no_new_privs: p.no_new_privileges,
        drop_ioperm,
        switch_user: Uid::effective().is_root()
            || p.user.uid != Uid::effective().as_raw()
            || p.user.gid != Gid::effective().as_raw(),
    };
    let mut cmd = Command::new(&program);
    cmd.arg0(&p.args[0]).args(&p.args[1..]).env_clear();
    for e in &p.env {
        if let Some((k, v)) = e.split_once('=') {
            cmd.env(k, v);
        }
    }
    cmd.stdin(stdio.stdin)
        .stdout(stdio.stdout)
        .stderr(stdio.stderr);
    // SAFETY: the closure only makes async-signal-safe system calls on data
    // prepared before the fork (ChildSteps::run), as pre_exec requires.
    unsafe {
        cmd.pre_exec(move || steps.run());
    }
    Ok(cmd)
}

#[cfg(test)]
mod tests {
    use super::*;
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
