//! Pseudo-terminals for `terminal` processes: the master from the devpts
//! instance's `ptmx`, the slave by `TIOCGPTPEER` (no path lookup, so it works
//! whatever root the process ends up in).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

nix::ioctl_write_ptr_bad!(tiocsptlck, libc::TIOCSPTLCK, libc::c_int);
nix::ioctl_write_int_bad!(tiocgptpeer, libc::TIOCGPTPEER);
nix::ioctl_write_ptr_bad!(tiocswinsz, libc::TIOCSWINSZ, libc::winsize);
nix::ioctl_write_int_bad!(tiocsctty, libc::TIOCSCTTY);

/// A terminal's master side.
#[derive(Debug)]
pub struct Pty {
    master: File,
}

impl Pty {
    /// Opens a new terminal on `ptmx` (`/dev/pts/ptmx` in the guest),
    /// unlocked, with `size` (rows, cols) if given.
    pub fn open(ptmx: &Path, size: Option<(u16, u16)>) -> io::Result<Pty> {
        let master = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOCTTY | libc::O_CLOEXEC)
            .open(ptmx)?;
        let unlock: libc::c_int = 0;
        // SAFETY: TIOCSPTLCK reads one c_int through the pointer, which
        // points at a live local; the fd is the master we just opened.
        unsafe { tiocsptlck(master.as_raw_fd(), &unlock) }?;
        let pty = Pty { master };
        if let Some((rows, cols)) = size {
            pty.resize(rows, cols)?;
        }
        Ok(pty)
    }

    /// A new descriptor of the slave side (close-on-exec, not made the
    /// controlling terminal).
    pub fn slave(&self) -> io::Result<OwnedFd> {
        let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC;
        // SAFETY: TIOCGPTPEER takes its flags by value and returns a new fd
        // (or -1, which nix turns into an error).
        let fd = unsafe { tiocgptpeer(self.master.as_raw_fd(), flags) }?;
        // SAFETY: the ioctl returned a fresh descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    pub fn resize(&self, rows: u16, cols: u16) -> io::Result<()> {
        let ws = libc::winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads one winsize through the pointer, which
        // points at a live local.
        unsafe { tiocswinsz(self.master.as_raw_fd(), &ws) }?;
        Ok(())
    }

    pub fn master(&self) -> &File {
        &self.master
    }
}

/// Makes the terminal on fd 0 the calling process's controlling terminal
/// (after `setsid`). Async-signal-safe: for a child between fork and exec.
pub fn make_controlling_terminal() -> nix::Result<()> {
    // SAFETY: TIOCSCTTY takes an int by value (0: do not steal a terminal
    // that is another session's); fd 0 is the child's terminal.
    unsafe { tiocsctty(0, 0) }.map(drop)
}
