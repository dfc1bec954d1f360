//! The one ethtool setting burstvm needs: transmit checksum offload off.
//!
//! A frame the local stack sends through a veth or bridge may leave with
//! its TCP/UDP checksum unfinished (CHECKSUM_PARTIAL: the "hardware" is to
//! fill it in). The runtime's server netns stands for the wire behind the
//! NIC's uplink, and the NIC reads the uplink with AF_PACKET, which hands
//! such frames over as they are: a guest then drops every TCP segment the
//! server sends (ICMP, checksummed in software, still passes). A wire never
//! carries unfinished checksums, so the server side computes them itself.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::ifreq::ifreq;

/// `struct ethtool_value` of <linux/ethtool.h>.
#[repr(C)]
struct EthtoolValue {
    cmd: u32,
    data: u32,
}

const ETHTOOL_STXCSUM: u32 = 0x0000_0017;

/// Turns transmit checksum offload of interface `name` (in the calling
/// thread's netns) on or off, as `ethtool -K NAME tx on|off` does.
pub fn set_tx_checksum(name: &str, on: bool) -> std::io::Result<()> {
    let mut req = ifreq(name).map_err(std::io::Error::other)?;
    let mut val = EthtoolValue {
        cmd: ETHTOOL_STXCSUM,
        data: on as u32,
    };
    req.ifr_ifru.ifru_data = (&mut val as *mut EthtoolValue).cast();
    // SAFETY: a plain datagram socket for the ioctl, owned at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh socket nobody else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: SIOCETHTOOL reads the ifreq and the ethtool_value it points
    // to; both live until the call returns.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCETHTOOL, &mut req) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_interfaces_and_bad_names_are_errors() {
        assert!(set_tx_checksum("bvnosuchif0", false).is_err());
        assert!(set_tx_checksum("a/b", false).is_err());
    }
}
