//! Ethernet MAC addresses: parsed from and printed as `aa:bb:cc:dd:ee:ff`
//! (the form `ip link`, the CNI result and the NIC control API use).

use std::fmt;
use std::str::FromStr;

/// A 48-bit MAC address.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct MacAddr([u8; 6]);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not a MAC address (aa:bb:cc:dd:ee:ff)")]
pub struct MacParseError {
    pub text: String,
}

impl MacAddr {
    pub const BROADCAST: MacAddr = MacAddr([0xff; 6]);
    pub const ZERO: MacAddr = MacAddr([0; 6]);

    pub const fn new(bytes: [u8; 6]) -> MacAddr {
        MacAddr(bytes)
    }

    /// The six bytes of a slice that holds exactly six.
    pub fn from_slice(b: &[u8]) -> Option<MacAddr> {
        <[u8; 6]>::try_from(b).ok().map(MacAddr)
    }

    pub const fn bytes(self) -> [u8; 6] {
        self.0
    }

    pub fn is_multicast(&self) -> bool {
        self.0[0] & 1 != 0
    }

    pub fn is_unicast(&self) -> bool {
        !self.is_multicast()
    }

    pub fn is_locally_administered(&self) -> bool {
        self.0[0] & 2 != 0
    }

    /// A random locally administered unicast address.
    pub fn local_random() -> MacAddr {
        let mut b: [u8; 6] = rand::random();
        b[0] = (b[0] & !1) | 2;
        MacAddr(b)
    }
}

impl From<[u8; 6]> for MacAddr {
    fn from(b: [u8; 6]) -> Self {
        MacAddr(b)
    }
}

impl From<MacAddr> for [u8; 6] {
    fn from(m: MacAddr) -> Self {
        m.0
    }
}

impl std::ops::Deref for MacAddr {
    type Target = [u8; 6];
    fn deref(&self) -> &[u8; 6] {
        &self.0
    }
}

impl PartialEq<[u8; 6]> for MacAddr {
    fn eq(&self, other: &[u8; 6]) -> bool {
        self.0 == *other
    }
}

impl FromStr for MacAddr {
    type Err = MacParseError;

    /// Exactly six colon-separated groups of two hex digits.
    fn from_str(s: &str) -> Result<Self, MacParseError> {
        let bad = || MacParseError {
            text: s.to_string(),
        };
        let mut mac = [0u8; 6];
        let mut parts = s.split(':');
        for b in mac.iter_mut() {
            let p = parts.next().ok_or_else(bad)?;
            if p.len() != 2 || !p.bytes().all(|c| c.is_ascii_hexdigit()) {
                return Err(bad());
            }
            *b = u8::from_str_radix(p, 16).map_err(|_| bad())?;
        }
        match parts.next() {
            None => Ok(MacAddr(mac)),
            Some(_) => Err(bad()),
        }
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

impl fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MacAddr({self})")
    }
}

crate::serde_as_string!(MacAddr);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_formats_and_rejects() {
        let m: MacAddr = "02:42:BF:01:01:02".parse().unwrap();
        assert_eq!(m.bytes(), [0x02, 0x42, 0xbf, 1, 1, 2]);
        assert_eq!(m.to_string(), "02:42:bf:01:01:02");
        for bad in [
            "02:42:bf:01:01",
            "02:42:bf:01:01:02:03",
            "zz:42:bf:01:01:02",
            "2:42:bf:01:01:02",
            "+2:42:bf:01:01:02",
            "02:42:bf:01:01:",
            "",
        ] {
            let e = bad.parse::<MacAddr>().unwrap_err();
            assert!(e.to_string().contains("not a MAC address"), "{bad}: {e}");
        }
    }

    #[test]
    fn serde_round_trip_and_kinds() {
        let m = MacAddr::new([2, 0, 0, 0, 0, 7]);
        let j = serde_json::to_string(&m).unwrap();
        assert_eq!(j, "\"02:00:00:00:00:07\"");
        assert_eq!(serde_json::from_str::<MacAddr>(&j).unwrap(), m);
        assert!(serde_json::from_str::<MacAddr>("\"nope\"").is_err());
        assert!(m.is_unicast() && m.is_locally_administered());
        assert!(MacAddr::BROADCAST.is_multicast());
        for _ in 0..64 {
            let r = MacAddr::local_random();
            assert!(r.is_unicast() && r.is_locally_administered(), "{r}");
        }
        assert_eq!(
            MacAddr::from_slice(&[1, 2, 3, 4, 5, 6]),
            Some([1, 2, 3, 4, 5, 6].into())
        );
        assert_eq!(MacAddr::from_slice(&[1, 2, 3]), None);
    }
}
