//! Tap devices through /dev/net/tun (TUNSETIFF with a libc `ifreq`).
//!
//! Frames on the fd are plain Ethernet unless `vnet_hdr` is asked for; the
//! fd is non-blocking unless `blocking` is asked for. A tap opened here that
//! is not persistent disappears when the last fd closes.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use vmm_sys_util::ioctl::{ioctl_with_mut_ref, ioctl_with_ref, ioctl_with_val};

use crate::ifreq::{ifreq, name_of};
use crate::NameError;

#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error(transparent)]
    Name(#[from] NameError),
    #[error("tap {name}: no such interface")]
    NoSuchInterface { name: String },
    #[error("tap {name}: interface is not a tun/tap device")]
    NotTap { name: String },
    #[error("tap {name}: busy: already attached to another process")]
    Busy { name: String },
    #[error("tap {name}: exists but is not a tap (or has other flags)")]
    WrongKind { name: String },
    #[error("tap {name}: permission denied (owned by another user?)")]
    Permission { name: String },
    #[error("tap {name}: {op}: {source}")]
    Io {
        name: String,
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

impl TapError {
    /// The raw OS error behind this error, if there is one.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            TapError::Io { source, .. } => source.raw_os_error(),
            TapError::Busy { .. } => Some(libc::EBUSY),
            TapError::WrongKind { .. } => Some(libc::EINVAL),
            TapError::Permission { .. } => Some(libc::EPERM),
            _ => None,
        }
    }
}

/// How to open a tap.
#[derive(Debug, Clone, Copy, Default)]
pub struct TapOptions {
    /// Frames carry a `virtio_net_hdr` (IFF_VNET_HDR).
    pub vnet_hdr: bool,
    /// Fail with EBUSY if a link of that name exists (IFF_TUN_EXCL).
    pub exclusive: bool,
    /// Leave the fd blocking (default: O_NONBLOCK).
    pub blocking: bool,
}

/// An open tap queue.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
}

impl Tap {
    /// Attaches to an existing tap (never creates one: a tap made here would
    /// vanish with the process and hide a configuration error). Looks the
    /// link up first (rtnetlink, in the calling thread's netns) so that the
    /// error says what is wrong.
    pub fn open_existing(name: &str) -> Result<Tap, TapError> {
        crate::ifreq::check_name(name)?;
        let io = |op| {
            let name = name.to_string();
            move |source| TapError::Io { name, op, source }
        };
        let link = crate::Rtnl::open()
            .map_err(io("open rtnetlink"))?
            .link_by_name(name)
            .map_err(io("look up link"))?;
        match link {
            None => return Err(TapError::NoSuchInterface { name: name.into() }),
            Some(l) if !l.is_tun() => return Err(TapError::NotTap { name: name.into() }),
            Some(_) => {}
        }
        Tap::open(name, TapOptions::default())
    }

    /// Opens (creating it if needed and allowed) the tap `name`; a name
    /// with `%d` lets the kernel pick the number.
    pub fn open(name: &str, opts: TapOptions) -> Result<Tap, TapError> {
        let mut req = ifreq(name)?;
        let io = |op| {
            let name = name.to_string();
            move |source| TapError::Io { name, op, source }
        };
        let mut custom = libc::O_CLOEXEC;
        if !opts.blocking {
            custom |= libc::O_NONBLOCK;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(custom)
            .open("/dev/net/tun")
            .map_err(io("open /dev/net/tun"))?;
        let mut flags = libc::IFF_TAP | libc::IFF_NO_PI;
        if opts.vnet_hdr {
            flags |= libc::IFF_VNET_HDR;
        }
        if opts.exclusive {
            flags |= libc::IFF_TUN_EXCL;
        }
        req.ifr_ifru.ifru_flags = flags as libc::c_short;
        // SAFETY: TUNSETIFF reads the name and flags of `req` and writes the
        // final name back into it; `req` is a complete ifreq we own, `file`
        // is an open /dev/net/tun fd.
        let r = unsafe { ioctl_with_mut_ref(&file, libc::TUNSETIFF as _, &mut req) };
        if r < 0 {
            let e = io::Error::last_os_error();
            let name = name.to_string();
            return Err(match e.raw_os_error() {
                Some(libc::EBUSY) => TapError::Busy { name },
                Some(libc::EINVAL) => TapError::WrongKind { name },
                Some(libc::EPERM) => TapError::Permission { name },
                _ => TapError::Io {
                    name,
                    op: "TUNSETIFF",
                    source: e,
                },
            });
        }
        Ok(Tap {
            file,
            name: name_of(&req),
        })
    }

    /// Creates the tap `name` and keeps it after this process exits
    /// (`ip tuntap add`); `Busy` if a link of that name exists.
    ///
    /// Creating attaches a queue for a few ioctls. That is done on a short
    /// thread (in the caller's netns: a new thread inherits it) with a
    /// private fd table, so that no fork of another thread of this process
    /// (a VMM or CNI plugin being spawned) inherits the queue: the child
    /// would keep it attached until it execs, and the tap's real user (the
    /// VMM) would get EBUSY meanwhile (issue 11: 1 of 50 `tap` starts).
    pub fn create_persistent(name: &str) -> Result<(), TapError> {
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_FILES).map_err(|e| {
                    TapError::Io {
                        name: name.to_string(),
                        op: "unshare(CLONE_FILES)",
                        source: e.into(),
                    }
                })?;
                Self::create_persistent_here(name)
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }

    /// `create_persistent` on the calling thread: a process forked by
    /// another thread meanwhile keeps the queue attached until it execs.
    /// For a tap nothing attaches to (a CNI plugin's placeholder), or a
    /// single-threaded process.
    pub fn create_persistent_here(name: &str) -> Result<(), TapError> {
        let tap = Tap::open(
            name,
            TapOptions {
                exclusive: true,
                ..TapOptions::default()
            },
        )?;
        // Dropping `tap` on failure destroys the not yet persistent device.
        tap.set_persistent(true)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// TUNSETPERSIST: whether the device outlives its last fd.
    pub fn set_persistent(&self, on: bool) -> Result<(), TapError> {
        // SAFETY: TUNSETPERSIST takes an int by value; no memory is shared.
        let r = unsafe { ioctl_with_val(&self.file, libc::TUNSETPERSIST as _, on as _) };
        self.check(r, "TUNSETPERSIST")
    }

    /// TUNSETOWNER: the uid that may attach without CAP_NET_ADMIN.
    pub fn set_owner(&self, uid: u32) -> Result<(), TapError> {
        // SAFETY: TUNSETOWNER takes the uid by value; no memory is shared.
        let r = unsafe { ioctl_with_val(&self.file, libc::TUNSETOWNER as _, uid as _) };
        self.check(r, "TUNSETOWNER")
    }

    /// TUNSETVNETHDRSZ: header length with IFF_VNET_HDR (10 or 12).
    pub fn set_vnet_hdr_size(&self, size: i32) -> Result<(), TapError> {
        // SAFETY: TUNSETVNETHDRSZ reads one int through the reference, which
        // lives for the call.
        let r = unsafe { ioctl_with_ref(&self.file, libc::TUNSETVNETHDRSZ as _, &size) };
        self.check(r, "TUNSETVNETHDRSZ")
    }

    /// Switches O_NONBLOCK on or off.
    pub fn set_nonblocking(&self, on: bool) -> Result<(), TapError> {
        use nix::fcntl::{fcntl, FcntlArg, OFlag};
        let io = |e: nix::Error| TapError::Io {
            name: self.name.clone(),
            op: "fcntl",
            source: e.into(),
        };
        let flags =
            OFlag::from_bits_truncate(fcntl(self.file.as_raw_fd(), FcntlArg::F_GETFL).map_err(io)?);
        let flags = if on {
            flags | OFlag::O_NONBLOCK
        } else {
            flags - OFlag::O_NONBLOCK
        };
        fcntl(self.file.as_raw_fd(), FcntlArg::F_SETFL(flags)).map_err(io)?;
        Ok(())
    }

    fn check(&self, r: i32, op: &'static str) -> Result<(), TapError> {
        if r < 0 {
            return Err(TapError::Io {
                name: self.name.clone(),
                op,
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// One frame, or `WouldBlock` when none is queued (non-blocking fd).
    pub fn read_frame(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&self.file).read(buf)
    }

    pub fn write_frame(&self, frame: &[u8]) -> io::Result<usize> {
        (&self.file).write(frame)
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

impl AsFd for Tap {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}
