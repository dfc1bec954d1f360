//! An IP address with a prefix length (`10.1.0.5/16`, host bits kept), as
//! CNI results and rtnetlink addresses and routes carry it.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpNet {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl IpNet {
    /// None when `prefix` is longer than the address.
    pub fn new(addr: IpAddr, prefix: u8) -> Option<IpNet> {
        let max = if addr.is_ipv4() { 32 } else { 128 };
        (prefix <= max).then_some(IpNet { addr, prefix })
    }
}

/// Why a string is not an `address/prefix`; each names the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IpNetError {
    #[error("{0:?} is not in CIDR notation (address/prefix)")]
    NotCidr(String),
    #[error("{input:?}: {addr:?} is not an IP address")]
    Addr {
        input: String,
        addr: String,
        #[source]
        source: std::net::AddrParseError,
    },
    #[error("{input:?}: {prefix:?} is not a prefix length")]
    Prefix {
        input: String,
        prefix: String,
        #[source]
        source: std::num::ParseIntError,
    },
    #[error("{input:?}: prefix length {prefix} too long")]
    TooLong { input: String, prefix: u8 },
}

impl FromStr for IpNet {
    type Err = IpNetError;
    fn from_str(s: &str) -> Result<Self, IpNetError> {
        let (a, p) = s
            .split_once('/')
            .ok_or_else(|| IpNetError::NotCidr(s.into()))?;
        let addr: IpAddr = a.parse().map_err(|source| IpNetError::Addr {
            input: s.into(),
            addr: a.into(),
            source,
        })?;
        let prefix: u8 = p.parse().map_err(|source| IpNetError::Prefix {
            input: s.into(),
            prefix: p.into(),
            source,
        })?;
        IpNet::new(addr, prefix).ok_or_else(|| IpNetError::TooLong {
            input: s.into(),
            prefix,
        })
    }
}

impl fmt::Display for IpNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

crate::serde_as_string!(IpNet);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipnet_parses_and_rejects() {
        let n: IpNet = "10.1.0.5/16".parse().unwrap();
        assert_eq!(n.to_string(), "10.1.0.5/16");
        assert_eq!("fd00::5/64".parse::<IpNet>().unwrap().prefix, 64);
        for bad in ["10.1.0.5", "10.1.0.5/33", "x/8", "10.0.0.1/x", "::1/129"] {
            assert!(bad.parse::<IpNet>().is_err(), "{bad}");
        }
    }
}
