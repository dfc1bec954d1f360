//! `burstvm bench sgiov latency|throughput|open` (issue 13): warp pipes
//! through a spawned `burstvm nic` daemon over real vhost-user sessions and
//! memfds. The pipes are sharded over a few threads, each owning one SG
//! function and its [`SgFrontend`] (a guest with one vCPU), never a thread
//! per pipe. Every pipe is an echo (CONNECT to port 0): what a frontend sends
//! comes back through the daemon's copy executor and is checked byte for
//! byte. After each configuration the frontends disconnect and the bench
//! checks through the control API and `/proc` that the daemon holds no pipe,
//! ring, staging byte or fd more than before (a leak fails the run).
//!
//! The library functions return rows (for tests); `run_cli` prints tables.
//!
//! This file: the common configuration, errors and statistics; the spawned
//! daemon and its leak check are in `daemon.rs`, the echo-pipe load the
//! frontends drive in `load.rs`.

mod daemon;
mod load;

pub mod latency;
pub mod open;
pub mod throughput;
pub mod vf;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nic_api::{Client, ClientError, DevKind, VfInfo};
use sgiov::dedicated::MAX_CHANNELS;
use sgiov::driver::{DriverConfig, DriverError};
use sgiov::layout::{PathKind, Transform};
use sgiov::signal::RingId;

use nic::sg::frontend::{SgFrontend, SgFrontendError, HEAP};

use crate::stats::median;

/// Control requests in flight at once (the driver's control ring holds 1024).
const CTRL_BATCH: usize = 256;
/// Bound of every wait on the daemon.
const T: Duration = Duration::from_secs(30);
/// Length of the byte pattern each pipe repeats.
const PAT: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum BenchSgError {
    #[error("bench sgiov: {0}")]
    Config(String),
    #[error("bench sgiov: NIC daemon {bin}: spawn")]
    Spawn {
        bin: PathBuf,
        #[source]
        source: Box<std::io::Error>,
    },
    #[error("bench sgiov: NIC daemon: {what}")]
    Daemon { what: String },
    #[error("bench sgiov: control {what}")]
    Control {
        what: String,
        #[source]
        source: Box<ClientError>,
    },
    #[error("bench sgiov: {what}")]
    Frontend {
        what: String,
        #[source]
        source: Box<SgFrontendError>,
    },
    #[error("bench sgiov: {what}")]
    VfFrontend {
        what: String,
        #[source]
        source: Box<nic::frontend::FrontendError>,
    },
    #[error("bench sgiov: {what}")]
    Driver {
        what: String,
        #[source]
        source: Box<DriverError>,
    },
    #[error("bench sgiov: {0}")]
    Check(String),
    #[error("bench sgiov open")]
    Devset(#[from] crate::devset::BenchError),
    #[error("bench sgiov: {what}")]
    Io {
        what: String,
        #[source]
        source: Box<std::io::Error>,
    },
}

/// What the three subcommands share (their common flags).
#[derive(Debug, Clone)]
pub struct CommonConfig {
    /// Frontend threads carrying the (backlogged) pipes, one SG function each.
    pub threads: usize,
    /// Bytes of each pipe's TX and RX ring (a power of two, >= 4096).
    pub ring: u32,
    /// Executor threads of the daemon's SG engine (--sg-workers).
    pub workers: usize,
    /// The burstvm binary that runs `nic` (default: this one).
    pub nic_bin: Option<PathBuf>,
    /// Work directory for sockets and state (a fresh temporary one by default).
    pub dir: Option<PathBuf>,
}

impl Default for CommonConfig {
    fn default() -> Self {
        CommonConfig {
            threads: 2,
            ring: 4096,
            workers: 1,
            nic_bin: None,
            dir: None,
        }
    }
}

impl CommonConfig {
    pub fn check(&self) -> Result<(), BenchSgError> {
        if self.threads == 0 || self.threads > 64 {
            return Err(BenchSgError::Config(format!(
                "--threads {}: must be 1..64",
                self.threads
            )));
        }
        if !self.ring.is_power_of_two() || self.ring < PAT as u32 || self.ring > 1 << 20 {
            return Err(BenchSgError::Config(format!(
                "--ring {}: a power of two 4096..1M",
                self.ring
            )));
        }
        Ok(())
    }

    /// `--pipes`: a non-empty list of counts 1..8192.
    pub fn check_pipes(pipes: &[usize]) -> Result<(), BenchSgError> {
        if pipes.is_empty() || pipes.iter().any(|&n| n == 0 || n > 8192) {
            return Err(BenchSgError::Config(format!(
                "--pipes {pipes:?}: counts 1..8192"
            )));
        }
        Ok(())
    }

    pub fn bin(&self) -> Result<PathBuf, BenchSgError> {
        match &self.nic_bin {
            Some(b) => Ok(b.clone()),
            None => std::env::current_exe().map_err(|source| BenchSgError::Io {
                what: "the burstvm binary".into(),
                source: Box::new(source),
            }),
        }
    }

    pub fn dir(&self, what: &str) -> PathBuf {
        self.dir.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("burstvm-bench-sgiov-{what}-{}", std::process::id()))
        })
    }
}

pub use daemon::*;
pub use load::*;

/// Jain's fairness index of `x`: 1 when all equal, 1/n when one has all.
pub fn jain(x: &[f64]) -> f64 {
    let (s, s2) = x.iter().fold((0.0, 0.0), |(s, s2), v| (s + v, s2 + v * v));
    if s2 == 0.0 {
        0.0
    } else {
        s * s / (x.len() as f64 * s2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_and_median() {
        assert!((jain(&[1.0, 1.0, 1.0, 1.0]) - 1.0).abs() < 1e-12);
        assert!((jain(&[4.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
        assert_eq!(jain(&[0.0, 0.0]), 0.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn frontend_memory_holds_the_rings() {
        let m = frontend_mem(4096, 4096);
        assert!(m as u64 >= HEAP + 2 * 4096 * 4096);
        assert_eq!(m % (1 << 20), 0);
        assert!(driver_config(4096).table_entries >= 8194);
    }
}
