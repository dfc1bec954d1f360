//! 2 MiB hugepages reserved for a run (DPDK's testpmd, hugepage-backed
//! sandboxes in `bench startup`) and given back after it.

/// Where the kernel keeps the 2 MiB hugepage pool size.
const NR_HUGEPAGES: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages";

#[derive(Debug, thiserror::Error)]
pub enum HugepagesError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{NR_HUGEPAGES}: asked for {want} 2 MiB hugepages, the kernel gave {got}")]
    Short { want: u64, got: u64 },
}

/// 2 MiB hugepages added to the kernel's pool; the pool is set back to its
/// size before on drop, so nothing is left reserved on any exit path short
/// of SIGKILL.
#[derive(Debug)]
pub struct Hugepages {
    before: u64,
}

fn read_nr() -> Result<u64, HugepagesError> {
    let io = |source| HugepagesError::Io {
        what: NR_HUGEPAGES.into(),
        source,
    };
    let s = std::fs::read_to_string(NR_HUGEPAGES).map_err(io)?;
    s.trim().parse().map_err(|_| {
        io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not a number: {s:?}"),
        ))
    })
}

fn write_nr(n: u64) -> Result<(), HugepagesError> {
    std::fs::write(NR_HUGEPAGES, n.to_string()).map_err(|source| HugepagesError::Io {
        what: format!("{NR_HUGEPAGES} := {n}"),
        source,
    })
}

impl Hugepages {
    /// Adds `pages` to the pool (needs root); fails, leaving the pool as it
    /// was, if the kernel cannot find that much contiguous memory.
    /// A host that has run for a while has its free memory in pieces: on a
    /// shortfall the kernel compacts memory, then also drops clean page
    /// cache, and the reservation is tried again after each.
    pub fn reserve(pages: u64) -> Result<Hugepages, HugepagesError> {
        let before = read_nr()?;
        let want = before + pages;
        write_nr(want)?;
        let mut got = read_nr()?;
        for knobs in [&["compact_memory"][..], &["drop_caches", "compact_memory"]] {
            if got >= want {
                break;
            }
            for knob in knobs {
                let file = format!("/proc/sys/vm/{knob}");
                if let Err(e) = std::fs::write(&file, "1") {
                    tracing::warn!("{file} := 1: {e}");
                }
            }
            write_nr(want)?;
            got = read_nr()?;
        }
        if got < want {
            let _ = write_nr(before);
            return Err(HugepagesError::Short { want, got });
        }
        Ok(Hugepages { before })
    }
}

impl Drop for Hugepages {
    fn drop(&mut self) {
        if let Err(e) = write_nr(self.before) {
            tracing::warn!("hugepages not given back: {e}");
        }
    }
}
