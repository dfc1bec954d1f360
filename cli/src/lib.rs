//! What the burstvm executables share (`burstvm` and the VMM-only
//! `burstvm-vmm`); everything else of `burstvm` is in its binary.

pub mod args;

/// Logs to stderr, filtered by `BURSTVM_LOG` (tracing's EnvFilter syntax),
/// warnings and errors by default: a VMM's stderr is its failure report.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BURSTVM_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
}
