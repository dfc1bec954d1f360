//! `burstvm bench vmm`'s arguments; the benchmark is `bench::vmm`.

use std::path::PathBuf;

use bench::vmm::BenchVmmConfig;

#[derive(Debug, Clone, clap::Args)]
pub struct BenchVmmArgs {
    /// Comma-separated numbers of VMMs released at one instant.
    #[arg(long, value_delimiter = ',', default_value = "1,50,200")]
    pub concurrency: Vec<usize>,
    /// A Firecracker binary to run interleaved (`--no-api --config-file`).
    #[arg(long)]
    pub firecracker: Option<PathBuf>,
    /// Repetitions (every variant at every concurrency in each; medians).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Guest memory of every VM, MiB.
    #[arg(long, default_value_t = 64)]
    pub memory_mib: u64,
}

impl BenchVmmArgs {
    pub fn into_config(self) -> BenchVmmConfig {
        BenchVmmConfig {
            concurrency: self.concurrency,
            firecracker: self.firecracker,
            reps: self.reps,
            memory_mib: self.memory_mib,
            burstvm_bin: None,
        }
    }
}
