//! CNI spec versions this plugin speaks (the model is netutil's), and the
//! error a config with any other `cniVersion` gets.

use crate::error::{code, PluginError};
pub use netutil::cni::{Version, SUPPORTED};

/// `s` as a supported version, or INCOMPATIBLE_VERSION naming what we speak.
pub fn parse(s: &str) -> Result<Version, PluginError> {
    s.parse().map_err(|e: netutil::cni::UnknownVersion| {
        PluginError::new(
            code::INCOMPATIBLE_VERSION,
            e.to_string(),
            format!("burstvm-cni supports cniVersion {}", SUPPORTED.join(", ")),
        )
        .with_source(e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_supported_version_and_nothing_else() {
        for s in SUPPORTED {
            assert_eq!(parse(s).unwrap().as_str(), s);
        }
        for bad in ["0.1.0", "0.2.0", "1.2.0", "", "1.0"] {
            assert_eq!(parse(bad).unwrap_err().code, code::INCOMPATIBLE_VERSION);
        }
    }
}
