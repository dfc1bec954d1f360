//! KVM's supported CPUID, asked once by a process that starts many VMMs
//! (the runtime) and handed to each of them as a file (`--supported-cpuid`).
//!
//! KVM_GET_SUPPORTED_CPUID runs the host's CPUID instruction for every leaf,
//! and on a host that is itself a VM each one exits to the outer hypervisor:
//! 0.6 ms of a VMM's 3.7 ms start on this machine. The answer is the same for
//! every VMM of one host and KVM module, so one query serves a burst.

use std::io::Write;
use std::path::{Path, PathBuf};

use kvm_bindings::{kvm_cpuid_entry2, CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::Kvm;
use serde::{Deserialize, Serialize};

/// The file's format version; another one is refused, not guessed at.
const VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum SupportedCpuidError {
    #[error("/dev/kvm: {source}")]
    KvmOpen {
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("KVM_GET_SUPPORTED_CPUID: {source}")]
    Kvm {
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("supported CPUID file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("supported CPUID file {path}: not a CPUID file: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("supported CPUID file {path}: {msg}")]
    Invalid { path: PathBuf, msg: String },
}

#[derive(Serialize, Deserialize)]
struct File {
    version: u32,
    entries: Vec<kvm_cpuid_entry2>,
}

/// Asks `kvm` once and writes the answer to `out` (whole or not at all: a
/// VMM never reads half of it).
pub fn write(kvm: &Kvm, out: &Path) -> Result<(), SupportedCpuidError> {
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|source| SupportedCpuidError::Kvm { source })?;
    let json = serde_json::to_vec(&File {
        version: VERSION,
        entries: cpuid.as_slice().to_vec(),
    })
    .map_err(|source| SupportedCpuidError::Json {
        path: out.to_path_buf(),
        source,
    })?;
    let io = |source| SupportedCpuidError::Io {
        path: out.to_path_buf(),
        source,
    };
    let mut name = out.as_os_str().to_owned();
    name.push(format!(".tmp.{}", std::process::id()));
    let tmp = PathBuf::from(name);
    let r = std::fs::File::create(&tmp)
        .and_then(|mut f| f.write_all(&json))
        .and_then(|()| std::fs::rename(&tmp, out));
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r.map_err(io)
}

/// [`write`] with /dev/kvm (what a runtime's VMMs open).
pub fn write_from_dev_kvm(out: &Path) -> Result<(), SupportedCpuidError> {
    let kvm = Kvm::new().map_err(|source| SupportedCpuidError::KvmOpen { source })?;
    write(&kvm, out)
}

/// The CPUID written by [`write`]: at least one entry, at most KVM's limit.
pub fn read(path: &Path) -> Result<CpuId, SupportedCpuidError> {
    let invalid = |msg: String| SupportedCpuidError::Invalid {
        path: path.to_path_buf(),
        msg,
    };
    let text = std::fs::read(path).map_err(|source| SupportedCpuidError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let f: File = serde_json::from_slice(&text).map_err(|source| SupportedCpuidError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    if f.version != VERSION {
        return Err(invalid(format!(
            "version {} (this VMM reads {VERSION})",
            f.version
        )));
    }
    if f.entries.is_empty() || f.entries.len() > KVM_MAX_CPUID_ENTRIES {
        return Err(invalid(format!(
            "{} entries (1..={KVM_MAX_CPUID_ENTRIES})",
            f.entries.len()
        )));
    }
    CpuId::from_entries(&f.entries).map_err(|e| invalid(format!("{e:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kvm() -> Option<Kvm> {
        Kvm::new().ok()
    }

    #[test]
    fn the_file_holds_what_kvm_answers() {
        let Some(kvm) = kvm() else {
            eprintln!("skipped: no /dev/kvm");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cpuid.json");
        write(&kvm, &p).unwrap();
        let got = read(&p).unwrap();
        let want = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();
        assert_eq!(got.as_slice(), want.as_slice());
        // Only the file is left: the temporary was renamed over it.
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn a_bad_file_is_refused_with_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cpuid.json");
        let cases: [(&str, &str); 4] = [
            ("{\"version\":1,\"entries\":", "not a CPUID file"),
            ("{\"version\":2,\"entries\":[]}", "version 2"),
            ("{\"version\":1,\"entries\":[]}", "0 entries"),
            ("[1,2,3]", "not a CPUID file"),
        ];
        for (text, want) in cases {
            std::fs::write(&p, text).unwrap();
            let e = read(&p).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("cpuid.json"), "{text}: {e}");
        }
        let e = read(&dir.path().join("absent")).unwrap_err().to_string();
        assert!(e.contains("absent"), "{e}");
    }

    #[test]
    fn too_many_entries_are_refused() {
        let e = kvm_cpuid_entry2::default();
        let f = File {
            version: VERSION,
            entries: vec![e; KVM_MAX_CPUID_ENTRIES + 1],
        };
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("big.json");
        std::fs::write(&p, serde_json::to_vec(&f).unwrap()).unwrap();
        let e = read(&p).unwrap_err().to_string();
        assert!(e.contains("257 entries"), "{e}");
    }
}
