//! CNI spec versions this plugin speaks, and what each one changes.

use crate::error::{code, PluginError};

/// Supported spec versions, oldest first (reported by VERSION).
pub const SUPPORTED: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Version {
    V0_3_0,
    V0_3_1,
    V0_4_0,
    V1_0_0,
    V1_1_0,
}

impl Version {
    pub fn parse(s: &str) -> Result<Version, PluginError> {
        Ok(match s {
            "0.3.0" => Version::V0_3_0,
            "0.3.1" => Version::V0_3_1,
            "0.4.0" => Version::V0_4_0,
            "1.0.0" => Version::V1_0_0,
            "1.1.0" => Version::V1_1_0,
            _ => {
                return Err(PluginError::new(
                    code::INCOMPATIBLE_VERSION,
                    format!("incompatible CNI version {s:?}"),
                    format!("burstvm-cni supports cniVersion {}", SUPPORTED.join(", ")),
                ))
            }
        })
    }

    pub fn as_str(self) -> &'static str {
        SUPPORTED[self as usize]
    }

    /// CHECK exists since 0.4.0.
    pub fn has_check(self) -> bool {
        self >= Version::V0_4_0
    }

    /// STATUS and GC exist since 1.1.0.
    pub fn has_status_and_gc(self) -> bool {
        self >= Version::V1_1_0
    }

    /// Before 1.0.0 every `ips` entry carries `"version": "4"|"6"`.
    pub fn ips_have_version(self) -> bool {
        self < Version::V1_0_0
    }

    /// Interface `mtu`, `socketPath` and `pciID` and route `mtu`/`advmss`/... are 1.1.0 fields.
    pub fn has_1_1_fields(self) -> bool {
        self >= Version::V1_1_0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_supported_version_and_nothing_else() {
        for s in SUPPORTED {
            assert_eq!(Version::parse(s).unwrap().as_str(), s);
        }
        for bad in ["0.1.0", "0.2.0", "1.2.0", "", "1.0"] {
            assert_eq!(
                Version::parse(bad).unwrap_err().code,
                code::INCOMPATIBLE_VERSION
            );
        }
        assert!(!Version::V0_3_1.has_check());
        assert!(Version::V0_4_0.has_check());
        assert!(!Version::V1_0_0.has_status_and_gc());
        assert!(Version::V0_4_0.ips_have_version());
        assert!(!Version::V1_0_0.ips_have_version());
    }
}
