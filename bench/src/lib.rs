//! burstvm's benchmarks: every `burstvm bench ...` command, their statistics,
//! tables and plots, and the chaos and NIC-restart harnesses. The crates they
//! measure (runtime, nic, sgiov, guestmem, vmm) keep only what a running
//! system needs (counters, traces, CPU accounting); the `burstvm` binary
//! parses the flags into each module's config and calls its `run_cli`.
//!
//! - `startup` (`bench startup`), with `stats`, `critpath`, `overhead`,
//!   `cpu` and `plot` for its tables and figures; `density`, `chaos`,
//!   `restart` (`bench nic-restart`): sandboxes through the runtime;
//! - `memory`: guest memory policies (guestmem);
//! - `vmm`: VMM start to exit, beside Firecracker;
//! - `devset`, `dataplane` (with DPDK's testpmd as a peer): the NIC;
//! - `sgiov` (in-process SG-IOV core) and `sg` (warp pipes through a NIC daemon).

pub mod chaos;
pub mod cpu;
pub mod critpath;
pub mod dataplane;
pub mod density;
pub mod devset;
pub mod echo;
pub mod hugepages;
pub mod memory;
pub mod overhead;
pub mod plot;
pub mod restart;
pub mod sg;
pub mod sgiov;
pub mod startup;
pub mod stats;
pub mod vmm;

use std::path::PathBuf;

/// Why a sandbox benchmark (`startup`, `density`, `chaos`, `restart`) failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{field}: {reason}")]
    BadArg { field: &'static str, reason: String },
    #[error(transparent)]
    Runtime(#[from] runtime::Error),
    #[error(transparent)]
    Plot(#[from] plot::PlotError),
    /// A program a flag names could not be started.
    #[error("{field}: spawn {}: {source}", .path.display())]
    Spawn {
        field: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("output {}: {source}", .path.display())]
    Output {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Leaks(String),
    #[error("interrupted (SIGINT); everything was torn down")]
    Interrupted,
}

pub(crate) fn bad(field: &'static str, reason: impl Into<String>) -> Error {
    Error::BadArg {
        field,
        reason: reason.into(),
    }
}

/// The runtime's errors a benchmark passes on keep their message (they are
/// transparent in `runtime::Error` too).
macro_rules! from_runtime {
    ($($t:ty),*) => {$(
        impl From<$t> for Error {
            fn from(e: $t) -> Self {
                Error::Runtime(e.into())
            }
        }
    )*};
}
from_runtime!(
    runtime::RuntimeError,
    runtime::SandboxFailure,
    runtime::sandbox::TeardownError,
    trace::TraceError
);
