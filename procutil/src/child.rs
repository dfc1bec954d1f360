//! The handle of a child spawned by [`crate::spawn::Command`] (std's `Child` for it), and
//! [`Process`]: what stopping a child needs, for std's `Child` and this one alike.

use std::fs::File;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

/// A spawned child. Dropping it neither kills nor reaps it.
#[derive(Debug)]
pub struct Child {
    pid: libc::pid_t,
    pub stdin: Option<File>,
    pub stdout: Option<File>,
    pub stderr: Option<File>,
    status: Option<ExitStatus>,
}

impl Child {
    pub(crate) fn new(
        pid: libc::pid_t,
        stdin: Option<File>,
        stdout: Option<File>,
        stderr: Option<File>,
    ) -> Child {
        Child {
            pid,
            stdin,
            stdout,
            stderr,
            status: None,
        }
    }

    pub fn id(&self) -> u32 {
        self.pid as u32
    }

    /// Reaps the child if it has exited.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.wait_flags(libc::WNOHANG)
    }

    /// Waits for the child to exit (closing its stdin first, as std does).
    pub fn wait(&mut self) -> io::Result<ExitStatus> {
        drop(self.stdin.take());
        loop {
            if let Some(s) = self.wait_flags(0)? {
                return Ok(s);
            }
        }
    }

    /// The child's exit status and CPU use (`wait4`), waiting for it.
    pub fn wait_rusage(&mut self) -> io::Result<(ExitStatus, libc::rusage)> {
        drop(self.stdin.take());
        if self.status.is_some() {
            return Err(io::Error::other(format!(
                "child {}: already reaped, its rusage is gone",
                self.pid
            )));
        }
        let mut st = 0;
        // SAFETY: rusage is written by wait4.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        loop {
            // SAFETY: waits for our own, not yet reaped child.
            let r = unsafe { libc::wait4(self.pid, &mut st, 0, &mut ru) };
            if r == self.pid {
                let s = ExitStatus::from_raw(st);
                self.status = Some(s);
                return Ok((s, ru));
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// SIGKILL, unless it has been reaped already.
    pub fn kill(&mut self) -> io::Result<()> {
        if self.status.is_some() {
            return Ok(());
        }
        // SAFETY: kill(2) on our own child, not yet reaped (so its pid is not reused).
        if unsafe { libc::kill(self.pid, libc::SIGKILL) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn wait_flags(&mut self, flags: libc::c_int) -> io::Result<Option<ExitStatus>> {
        if let Some(s) = self.status {
            return Ok(Some(s));
        }
        let mut st = 0;
        loop {
            // SAFETY: waits for our own child.
            let r = unsafe { libc::waitpid(self.pid, &mut st, flags) };
            if r == self.pid {
                let s = ExitStatus::from_raw(st);
                self.status = Some(s);
                return Ok(Some(s));
            }
            if r == 0 {
                return Ok(None);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// What stopping a child needs, for std's `Child` and this one alike.
pub trait Process {
    fn pid(&self) -> u32;
    fn try_wait(&mut self) -> io::Result<Option<ExitStatus>>;
    fn kill(&mut self) -> io::Result<()>;
    fn wait(&mut self) -> io::Result<ExitStatus>;
}

impl Process for Child {
    fn pid(&self) -> u32 {
        self.id()
    }
    fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        Child::try_wait(self)
    }
    fn kill(&mut self) -> io::Result<()> {
        Child::kill(self)
    }
    fn wait(&mut self) -> io::Result<ExitStatus> {
        Child::wait(self)
    }
}

impl Process for std::process::Child {
    fn pid(&self) -> u32 {
        self.id()
    }
    fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        std::process::Child::try_wait(self)
    }
    fn kill(&mut self) -> io::Result<()> {
        std::process::Child::kill(self)
    }
    fn wait(&mut self) -> io::Result<ExitStatus> {
        std::process::Child::wait(self)
    }
}
