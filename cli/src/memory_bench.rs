//! `burstvm bench memory`'s arguments; the benchmark is `bench::memory`.

use bench::memory::{MemoryBenchConfig, PoolPinning};
use guestmem::MemoryPolicy;

#[derive(Debug, Clone, clap::Args)]
pub struct MemoryBenchArgs {
    /// Guest memory per sandbox (one `ram` region, dma = true).
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    pub size: u64,
    /// Comma-separated policies to measure.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "vanilla,pre10,pre50,pre100,lazy",
        value_parser = parse_policy
    )]
    pub policy: Vec<MemoryPolicy>,
    /// Use 2 MiB hugetlb pages (must be reserved in /proc/sys/vm/nr_hugepages).
    #[arg(long)]
    pub hugepages: bool,
    /// Sandboxes mapping their memory at the same time.
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Repetitions per policy (the median over all sandboxes and runs is reported).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Pool policies with the pool keeping its memory pinned (`on`), each DMA mapping
    /// pinning its own pages (`off`), or both side by side (`compare`: rows `<policy>
    /// unpinned`).
    #[arg(long, default_value = "compare")]
    pub pool_pinning: PoolPinning,
}

fn parse_size(s: &str) -> Result<u64, guestmem::Error> {
    guestmem::parse_size(s)
}

fn parse_policy(s: &str) -> Result<MemoryPolicy, guestmem::Error> {
    s.parse()
}

impl MemoryBenchArgs {
    pub fn config(&self) -> MemoryBenchConfig {
        MemoryBenchConfig {
            size: self.size,
            policies: self.policy.clone(),
            hugepages: self.hugepages,
            concurrency: self.concurrency,
            runs: self.runs,
            pool_pinning: self.pool_pinning,
        }
    }
}
