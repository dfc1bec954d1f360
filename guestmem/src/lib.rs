//! Guest memory for burstvm sandboxes: memfd-backed regions with a device view and a guest
//! view, DMA-map policies (vanilla, pre-zeroing, lazy zeroing) and a host-wide page pool
//! (the memory benchmark is `bench::memory`). See docs/guestmem.md.

mod device;
mod lazy;
mod memory;
pub mod pool;
mod region;
mod sys;
mod table;
pub mod template;

use std::fmt;
use std::str::FromStr;

pub use device::DeviceMemory;
pub use lazy::{LazyError, LazyErrorCallback, LazyStats, ZeroerHook, ZEROER_THREAD};
pub use memory::{GuestMemory, MemorySource};
pub use region::Region;
pub use sys::{page_size_for, HUGE_PAGE_SIZE};
pub use table::{table_size, PageStats};

/// Page states of the shared page-state table (one byte per page).
pub mod page_state {
    pub use crate::table::{DIRTY, MAPPED, ZERO, ZEROING};
}

/// How a region is made DMA-ready (FastIOV §3.2.3, §4.3, §6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryPolicy {
    /// Fresh memory, populated and locked at map time: the kernel zeroes every page then.
    Vanilla,
    /// Pool pages, that percentage (10, 50 or 100) zeroed ahead of time, the rest at map time.
    Pre(u8),
    /// Pool pages still dirty; zeroed on first touch (userfaultfd MINOR) or in the background.
    Lazy,
}

impl FromStr for MemoryPolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim() {
            "vanilla" => Ok(MemoryPolicy::Vanilla),
            "lazy" => Ok(MemoryPolicy::Lazy),
            other => {
                if let Some(p) = other.strip_prefix("pre") {
                    if let Ok(p) = p.parse::<u8>() {
                        if (1..=100).contains(&p) {
                            return Ok(MemoryPolicy::Pre(p));
                        }
                    }
                }
                Err(Error::BadPolicy(s.to_string()))
            }
        }
    }
}

impl fmt::Display for MemoryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryPolicy::Vanilla => write!(f, "vanilla"),
            MemoryPolicy::Pre(p) => write!(f, "pre{p}"),
            MemoryPolicy::Lazy => write!(f, "lazy"),
        }
    }
}

/// One region of guest physical memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSpec {
    pub name: String,
    pub gpa: u64,
    pub size: u64,
    /// Whether a device may DMA into it (then it is made resident and locked by `dma_map`).
    pub dma: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("unknown memory policy {0:?} (expected vanilla, pre10, pre50, pre100 or lazy)")]
    BadPolicy(String),
    #[error("bad size {0:?} (expected bytes or a number with K, M, G or T)")]
    BadSize(String),
    #[error("region {region:?}: {reason}")]
    InvalidSpec { region: String, reason: String },
    #[error("regions {a:?} and {b:?} overlap")]
    Overlap { a: String, b: String },
    #[error("no region named {0:?}")]
    UnknownRegion(String),
    #[error("guest range {gpa:#x}+{len:#x} is not inside one region")]
    OutOfRange { gpa: u64, len: u64 },
    #[error("region {0:?} has dma = false and is never DMA-mapped")]
    NotDma(String),
    #[error("vm-memory mapping of the regions: {source}")]
    Mapping {
        #[source]
        source: vm_memory::mmap::FromRangesError,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{needed} free 2 MiB huge pages needed but only {free} are reserved and free; reserve \
         them with `echo N > /proc/sys/vm/nr_hugepages` (N >= {needed} plus what is in use)"
    )]
    HugepagesNotReserved { needed: u64, free: u64 },
    #[error(
        "cannot lock {needed} bytes of guest memory: RLIMIT_MEMLOCK of this process is {limit} \
         bytes (raise it with `ulimit -l` or run with CAP_IPC_LOCK)"
    )]
    MemlockLimit { needed: u64, limit: u64 },
    #[error(
        "cannot lock {needed} bytes of guest memory: /proc/meminfo MemAvailable is only {available} bytes"
    )]
    NotEnoughMemory { needed: u64, available: u64 },
    #[error("page-state table: page {page} has invalid state {state}")]
    CorruptTable { page: u64, state: u8 },
    #[error(
        "pool lease {lease} of this memory has ended (now {now}): its sandbox is gone and the \
         memory went back to the pool; the device must not touch it"
    )]
    StaleLease { lease: u64, now: u64 },
    #[error("memfd {what}: {reason}")]
    BadMemfd { what: String, reason: String },
    #[error("userfaultfd for region {region:?}: {op}: {source} ({source:?})")]
    Userfaultfd {
        region: String,
        op: &'static str,
        #[source]
        source: userfaultfd::Error,
    },
    #[error(
        "region {0:?} is a private copy-on-write mapping of a template: no other process \
         (vhost-user backend) can share its pages"
    )]
    PrivateRegion(String),
    #[error("mapping guest pages {gpa:#x}+{len:#x} ahead of the guest: {source}")]
    MapAhead {
        gpa: u64,
        len: u64,
        #[source]
        source: Box<LazyError>,
    },
    #[error("lazy-zeroing handler stopped: {0}")]
    LazyHandler(#[source] std::sync::Arc<LazyError>),
    #[error(transparent)]
    Pool(#[from] pool::Error),
}

impl Error {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io {
            what: what.into(),
            source,
        }
    }
}

/// Parses "512M", "2G", "64K", "1T", "4096" (binary units) into bytes; 0 is allowed.
/// The one size parser of the workspace: callers wrap `None` in their own error naming the field.
pub fn parse_bytes(s: &str) -> Option<u64> {
    let t = s.trim();
    let (num, mul) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let mul = match c.to_ascii_uppercase() {
                'K' => 1u64 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => return None,
            };
            (&t[..i], mul)
        }
        _ => (t, 1),
    };
    num.parse::<u64>().ok()?.checked_mul(mul)
}

/// `n` bytes the way [`parse_bytes`] reads them, in the largest unit that
/// divides it (512M, 1G, 4096).
pub fn format_size(n: u64) -> String {
    for (unit, shift) in [("T", 40), ("G", 30), ("M", 20), ("K", 10)] {
        if n >= 1 << shift && n.is_multiple_of(1 << shift) {
            return format!("{}{unit}", n >> shift);
        }
    }
    n.to_string()
}

/// Like [`parse_bytes`], for sizes that must be greater than 0.
pub fn parse_size(s: &str) -> Result<u64, Error> {
    parse_bytes(s)
        .filter(|n| *n > 0)
        .ok_or_else(|| Error::BadSize(s.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_parses_and_prints() {
        for s in ["vanilla", "pre10", "pre50", "pre100", "lazy"] {
            assert_eq!(s.parse::<MemoryPolicy>().unwrap().to_string(), s);
        }
        assert!("pre0".parse::<MemoryPolicy>().is_err());
        assert!("pre101".parse::<MemoryPolicy>().is_err());
        assert!("fast".parse::<MemoryPolicy>().is_err());
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("2g").unwrap(), 2 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("12X").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn sizes_print_as_they_parse() {
        for s in ["512M", "2G", "4097", "1T", "3K", "1025K"] {
            assert_eq!(format_size(parse_size(s).unwrap()), s);
        }
        assert_eq!(format_size(1 << 30), "1G");
        assert_eq!(format_size(4096), "4K");
    }
}
