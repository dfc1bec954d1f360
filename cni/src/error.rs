//! The CNI error result (spec §5 "Error"): a numeric code, a short message and details.

use std::sync::Arc;

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
    /// burstvm-ipam has no address for the attachment: a range set is full,
    /// a requested address is taken, the gateway or in no range, or the
    /// attachment already holds one (one per range set).
    pub const NO_ADDRESS: u32 = 104;
}

/// The typed cause of a `PluginError` (shared: the error is `Clone`).
pub type Cause = Arc<dyn std::error::Error + Send + Sync + 'static>;

/// A failed plugin operation as the runtime sees it on stdout. `details` is
/// the text of the wire result; `cause`, when the failure came from another
/// error (netns, netlink, NIC client, JSON), is that error itself, so that a
/// caller of `run` can match on it (`Error::source` gives the error itself,
/// not its `Arc`, so that `downcast_ref` works).
#[derive(Debug, Clone)]
pub struct PluginError {
    pub code: u32,
    pub msg: String,
    pub details: String,
    pub cause: Option<Cause>,
}

impl std::fmt::Display for PluginError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} (CNI error code {})",
            self.msg, self.details, self.code
        )
    }
}

impl std::error::Error for PluginError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause
            .as_deref()
            .map(|c| c as &(dyn std::error::Error + 'static))
    }
}

/// Equal when the wire result is equal (the cause is not on the wire).
impl PartialEq for PluginError {
    fn eq(&self, o: &Self) -> bool {
        (self.code, &self.msg, &self.details) == (o.code, &o.msg, &o.details)
    }
}
impl Eq for PluginError {}

impl PluginError {
    pub fn new(code: u32, msg: impl Into<String>, details: impl Into<String>) -> Self {
        PluginError {
            code,
            msg: msg.into(),
            details: details.into(),
            cause: None,
        }
    }

    /// An error caused by `source`; its text is the result's `details`.
    pub fn caused<E>(code: u32, msg: impl Into<String>, source: E) -> Self
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        PluginError {
            code,
            msg: msg.into(),
            details: source.to_string(),
            cause: Some(Arc::new(source)),
        }
    }

    /// The same error with `source` as its cause (the wire text unchanged).
    pub fn with_source<E>(mut self, source: E) -> Self
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        self.cause = Some(Arc::new(source));
        self
    }

    pub fn invalid_env(var: &str, details: impl Into<String>) -> Self {
        Self::new(
            code::INVALID_ENV,
            format!("invalid environment variable {var}"),
            details,
        )
    }

    /// `invalid_env` caused by `source` (e.g. the netns cannot be opened).
    pub fn invalid_env_caused<E>(var: &str, source: E) -> Self
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        Self::caused(
            code::INVALID_ENV,
            format!("invalid environment variable {var}"),
            source,
        )
    }

    pub fn invalid_config(field: &str, details: impl Into<String>) -> Self {
        Self::new(
            code::INVALID_CONFIG,
            format!("invalid network config field {field:?}"),
            details,
        )
    }

    /// `invalid_config` caused by `source` (e.g. the NIC refused the field).
    pub fn invalid_config_caused<E>(field: &str, source: E) -> Self
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        Self::caused(
            code::INVALID_CONFIG,
            format!("invalid network config field {field:?}"),
            source,
        )
    }

    pub fn decode(what: &str, details: impl Into<String>) -> Self {
        Self::new(
            code::DECODE_FAILURE,
            format!("failed to decode {what}"),
            details,
        )
    }

    /// A JSON input that does not parse.
    pub fn decode_json(what: &str, source: serde_json::Error) -> Self {
        Self::caused(
            code::DECODE_FAILURE,
            format!("failed to decode {what}"),
            source,
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
