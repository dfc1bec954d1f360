//! Startup-stage tracing shared by every burstvm process.
//!
//! A trace is JSON lines, one per stage per sandbox, with times on
//! CLOCK_MONOTONIC so that traces written by the runtime, the VMM and the NIC
//! merge into one timeline. Writers open the file with O_APPEND and write each
//! line with a single `write(2)`, so several processes can share one file.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// The startup stages, in the order a sandbox goes through them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Stage {
    Cgroup,
    Netns,
    CniAdd,
    /// A ready network attachment taken from the runtime's network pool
    /// (instead of `netns` + `cni-add`): claim, link read, neighbour entry.
    NetClaim,
    VmmSpawn,
    /// A sandbox started from a template: memory mapped, state restored.
    Restore,
    DmaRam,
    Rootfs,
    DmaImage,
    /// `window` variant: the small shared region the device maps instead of
    /// guest RAM (rings and packet buffers) made DMA-ready.
    DmaWindow,
    VfOpen,
    Boot,
    /// Linux guest agent: the container root mounted and switched to.
    RootfsMount,
    /// Linux guest agent: the network configured from the CNI result.
    NetConfig,
    VfDriver,
    AppLaunch,
    /// Async VF init: the wait for the link after the app launched, before
    /// the first packet (FastIOV books it as VF overhead on the critical path).
    VfLink,
    Ready,
    /// Not a startup stage: a VF backend (the NIC) went away and the VMM restored the
    /// vhost-user session on a new one (from the disconnect to the restored rings).
    VfReconnect,
    /// Not a startup stage: a VF backend went away and could not be restored (from the
    /// disconnect to giving up).
    VfLost,
}

impl Stage {
    pub const ALL: [Stage; 18] = [
        Stage::Cgroup,
        Stage::Netns,
        Stage::CniAdd,
        Stage::NetClaim,
        Stage::VmmSpawn,
        Stage::Restore,
        Stage::DmaRam,
        Stage::Rootfs,
        Stage::DmaImage,
        Stage::DmaWindow,
        Stage::VfOpen,
        Stage::Boot,
        Stage::RootfsMount,
        Stage::NetConfig,
        Stage::VfDriver,
        Stage::AppLaunch,
        Stage::VfLink,
        Stage::Ready,
    ];

    /// Events after startup that a trace may also hold (see `VfReconnect`, `VfLost`).
    pub const INCIDENTS: [Stage; 2] = [Stage::VfReconnect, Stage::VfLost];

    /// The stages FastIOV's Table 1 counts as VF-related overhead.
    pub const VF_RELATED: [Stage; 6] = [
        Stage::DmaRam,
        Stage::DmaImage,
        Stage::DmaWindow,
        Stage::VfOpen,
        Stage::VfDriver,
        Stage::VfLink,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Stage::Cgroup => "cgroup",
            Stage::Netns => "netns",
            Stage::CniAdd => "cni-add",
            Stage::NetClaim => "net-claim",
            Stage::VmmSpawn => "vmm-spawn",
            Stage::Restore => "restore",
            Stage::DmaRam => "dma-ram",
            Stage::Rootfs => "rootfs",
            Stage::DmaImage => "dma-image",
            Stage::DmaWindow => "dma-window",
            Stage::VfOpen => "vf-open",
            Stage::Boot => "boot",
            Stage::RootfsMount => "rootfs-mount",
            Stage::NetConfig => "net-config",
            Stage::VfDriver => "vf-driver",
            Stage::AppLaunch => "app-launch",
            Stage::VfLink => "vf-link",
            Stage::Ready => "ready",
            Stage::VfReconnect => "vf-reconnect",
            Stage::VfLost => "vf-lost",
        }
    }

    pub fn is_vf_related(self) -> bool {
        Self::VF_RELATED.contains(&self)
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("unknown stage name {0:?}")]
    UnknownStage(String),
    #[error("trace file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("trace file {path}, line {line}: {source}")]
    Parse {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
}

impl FromStr for Stage {
    type Err = TraceError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Stage::ALL
            .into_iter()
            .chain(Stage::INCIDENTS)
            .find(|st| st.name() == s)
            .ok_or_else(|| TraceError::UnknownStage(s.to_string()))
    }
}

/// One line of a trace file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceEvent {
    pub sandbox: String,
    pub stage: Stage,
    pub start_ns: u64,
    pub end_ns: u64,
}

impl TraceEvent {
    pub fn duration_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }
}

/// Nanoseconds on CLOCK_MONOTONIC, comparable across processes on one host.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we pass and nothing else.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Appends trace events of one sandbox to a file (or keeps them in memory
/// only, when no file was asked for). Cheap to share between threads.
#[derive(Debug)]
pub struct TraceWriter {
    sandbox: String,
    file: Option<(PathBuf, Mutex<File>)>,
    events: Mutex<Vec<TraceEvent>>,
}

impl TraceWriter {
    pub fn new(sandbox: impl Into<String>, path: Option<&Path>) -> Result<Self, TraceError> {
        let file = match path {
            Some(p) => {
                let f = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .mode(0o644)
                    .open(p)
                    .map_err(|source| TraceError::Io {
                        path: p.to_path_buf(),
                        source,
                    })?;
                Some((p.to_path_buf(), Mutex::new(f)))
            }
            None => None,
        };
        Ok(TraceWriter {
            sandbox: sandbox.into(),
            file,
            events: Mutex::new(Vec::new()),
        })
    }

    pub fn sandbox(&self) -> &str {
        &self.sandbox
    }

    /// Records a stage that ran from `start_ns` to `end_ns`.
    pub fn record(&self, stage: Stage, start_ns: u64, end_ns: u64) -> Result<(), TraceError> {
        let ev = TraceEvent {
            sandbox: self.sandbox.clone(),
            stage,
            start_ns,
            end_ns,
        };
        if let Some((path, f)) = &self.file {
            let mut line = serde_json::to_vec(&ev).expect("TraceEvent serializes");
            line.push(b'\n');
            // One write per line: O_APPEND keeps lines of concurrent writers whole.
            f.lock()
                .unwrap_or_else(|e| e.into_inner())
                .write_all(&line)
                .map_err(|source| TraceError::Io {
                    path: path.clone(),
                    source,
                })?;
        }
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(ev);
        Ok(())
    }

    /// Runs `f` and records it as `stage`.
    pub fn span<T>(&self, stage: Stage, f: impl FnOnce() -> T) -> Result<T, TraceError> {
        let start = monotonic_ns();
        let out = f();
        self.record(stage, start, monotonic_ns())?;
        Ok(out)
    }

    /// Every event this writer recorded, in recording order.
    pub fn events(&self) -> Vec<TraceEvent> {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// One line per stage: name, duration in ms, offset from the first start.
    pub fn summary(&self) -> String {
        summarize(&self.events())
    }
}

/// Formats events as a one-line-per-stage table.
pub fn summarize(events: &[TraceEvent]) -> String {
    let origin = events.iter().map(|e| e.start_ns).min().unwrap_or(0);
    let mut out = String::new();
    for e in events {
        out.push_str(&format!(
            "{:<12} {:<10} {:>10.3} ms  (+{:.3} ms)\n",
            e.sandbox,
            e.stage.name(),
            e.duration_ns() as f64 / 1e6,
            (e.start_ns - origin) as f64 / 1e6
        ));
    }
    out
}

/// Reads a whole trace file.
pub fn read_trace(path: &Path) -> Result<Vec<TraceEvent>, TraceError> {
    let f = File::open(path).map_err(|source| TraceError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, line) in BufReader::new(f).lines().enumerate() {
        let line = line.map_err(|source| TraceError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(
            serde_json::from_str(&line).map_err(|source| TraceError::Parse {
                path: path.to_path_buf(),
                line: i + 1,
                source,
            })?,
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_names_round_trip() {
        for s in Stage::ALL.into_iter().chain(Stage::INCIDENTS) {
            assert_eq!(s.name().parse::<Stage>().unwrap(), s);
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(json, format!("\"{}\"", s.name()));
        }
        assert!("bogus".parse::<Stage>().is_err());
    }

    #[test]
    fn writer_appends_lines_that_read_back() {
        let dir = std::env::temp_dir().join(format!("trace-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl");
        let _ = std::fs::remove_file(&path);
        let a = TraceWriter::new("sb-a", Some(&path)).unwrap();
        let b = TraceWriter::new("sb-b", Some(&path)).unwrap();
        a.record(Stage::Boot, 10, 20).unwrap();
        b.record(Stage::Ready, 30, 45).unwrap();
        let evs = read_trace(&path).unwrap();
        assert_eq!(evs.len(), 2);
        assert_eq!(evs[0].sandbox, "sb-a");
        assert_eq!(evs[1].stage, Stage::Ready);
        assert_eq!(evs[1].duration_ns(), 15);
        assert!(a.summary().contains("boot"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn monotonic_clock_advances() {
        let a = monotonic_ns();
        let b = monotonic_ns();
        assert!(b >= a && a > 0);
    }
}
