//! An existing tap interface, opened without IFF_VNET_HDR: frames on the fd
//! are plain Ethernet and the device adds/strips the virtio-net header (we
//! offer no offloads, so the header carries nothing the tap would need).

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::VirtioError;

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

pub struct Tap {
    file: File,
    name: String,
}

impl Tap {
    /// Attach to the tap `name`, which must exist (we never create one: a
    /// tap made here would vanish with us and hide a configuration error).
    pub fn open(name: &str) -> Result<Tap, VirtioError> {
        let err = |reason: String| VirtioError::Tap {
            name: name.to_string(),
            reason,
        };
        if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('/') {
            return Err(err("not a valid interface name".into()));
        }
        let sys = Path::new("/sys/class/net").join(name);
        if !sys.exists() {
            return Err(err("no such interface".into()));
        }
        if !sys.join("tun_flags").exists() {
            return Err(err("interface is not a tun/tap device".into()));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(|e| err(format!("open /dev/net/tun: {e}")))?;
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is laid out as.
        let r = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            let reason = match e.raw_os_error() {
                Some(libc::EBUSY) => "busy: already attached to another process".to_string(),
                Some(libc::EINVAL) => "exists but is not a tap (or has other flags)".to_string(),
                Some(libc::EPERM) => "permission denied (owned by another user?)".to_string(),
                _ => format!("TUNSETIFF: {e}"),
            };
            return Err(err(reason));
        }
        Ok(Tap {
            file,
            name: name.to_string(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// One frame, or `WouldBlock` when none is queued.
    pub fn read_frame(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        (&self.file).read(buf)
    }

    pub fn write_frame(&self, frame: &[u8]) -> std::io::Result<usize> {
        (&self.file).write(frame)
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}
