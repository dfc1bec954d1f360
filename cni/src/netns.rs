//! Running code inside another network namespace: on a scoped thread that
//! enters it, so the calling thread (and the runtime) stays where it is.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use nix::sched::{setns, CloneFlags};

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("network namespace {path}: does not exist")]
    Gone { path: PathBuf },
    #[error("network namespace {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

pub struct Netns {
    path: PathBuf,
    file: File,
}

impl Netns {
    pub fn open(path: &Path) -> Result<Netns, NetnsError> {
        match File::open(path) {
            Ok(file) => Ok(Netns {
                path: path.to_path_buf(),
                file,
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err(NetnsError::Gone {
                path: path.to_path_buf(),
            }),
            Err(source) => Err(NetnsError::Io {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether this is the netns the calling thread is in.
    pub fn is_current(&self) -> Result<bool, NetnsError> {
        use std::os::unix::fs::MetadataExt;
        let io = |source| NetnsError::Io {
            path: self.path.clone(),
            source,
        };
        let ours = std::fs::metadata("/proc/thread-self/ns/net").map_err(io)?;
        let this = self.file.metadata().map_err(io)?;
        Ok((ours.dev(), ours.ino()) == (this.dev(), this.ino()))
    }

    /// Runs `f` on a thread inside this netns and returns its result.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T, NetnsError> {
        std::thread::scope(|s| {
            s.spawn(|| {
                setns(&self.file, CloneFlags::CLONE_NEWNET).map_err(|e| NetnsError::Io {
                    path: self.path.clone(),
                    source: io::Error::from(e),
                })?;
                Ok(f())
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }
}
