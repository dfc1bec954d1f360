//! The CNI error result (spec §5 "Error"): a numeric code, a short message and details.

/// Error codes of the CNI spec (0-99 are reserved by the spec, 100+ are ours).
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const INVALID_ENV: u32 = 4;
    pub const IO_FAILURE: u32 = 5;
    pub const DECODE_FAILURE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    pub const TRY_AGAIN_LATER: u32 = 11;
    pub const NOT_AVAILABLE: u32 = 50;
    /// The NIC already gave this container a VF (one VF per container).
    pub const VF_CONFLICT: u32 = 100;
    /// Creating, configuring or reading the placeholder link failed.
    pub const LINK_FAILURE: u32 = 101;
    /// CHECK found the attachment differs from the ADD result or from the NIC.
    pub const CHECK_FAILED: u32 = 102;
    /// A delegated (IPAM) plugin failed without a CNI error result.
    pub const DELEGATE_FAILURE: u32 = 103;
}

/// A failed plugin operation as the runtime sees it on stdout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg}: {details} (CNI error code {code})")]
pub struct PluginError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

impl PluginError {
    pub fn new(code: u32, msg: impl Into<String>, details: impl Into<String>) -> Self {
        PluginError {
            code,
            msg: msg.into(),
            details: details.into(),
        }
    }

    pub fn invalid_env(var: &str, details: impl Into<String>) -> Self {
        Self::new(
            code::INVALID_ENV,
            format!("invalid environment variable {var}"),
            details,
        )
    }

    pub fn invalid_config(field: &str, details: impl Into<String>) -> Self {
        Self::new(
            code::INVALID_CONFIG,
            format!("invalid network config field {field:?}"),
            details,
        )
    }

    pub fn decode(what: &str, details: impl Into<String>) -> Self {
        Self::new(
            code::DECODE_FAILURE,
            format!("failed to decode {what}"),
            details,
        )
    }

    /// The error result JSON, in the protocol version in use.
    pub fn to_json(&self, cni_version: &str) -> serde_json::Value {
        serde_json::json!({
            "cniVersion": cni_version,
            "code": self.code,
            "msg": self.msg,
            "details": self.details,
        })
    }
}
