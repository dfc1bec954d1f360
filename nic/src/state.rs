//! The state file: which VF belongs to which sandbox, so that a restarted
//! daemon keeps the assignments. Written whole to a temporary file and renamed
//! over the old one, so a crash of the daemon leaves either the old or the new
//! state. Not fsynced: the assignments are of sandboxes of this boot, which a
//! power loss ends too, and an fsync on every alloc and release cost the
//! control thread, which serves every request in turn, ~0.2 ms of wall time
//! and 63 µs of CPU each where the state directory is on a disk (docs/nic.md).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use nic_api::DevKind;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    #[serde(default, skip_serializing_if = "DevKind::is_vf_kind")]
    pub kind: DevKind,
    pub pf: String,
    pub index: usize,
    pub sandbox: String,
    pub mac: String,
    pub vlan: Option<u16>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateFile {
    pub version: u32,
    pub assignments: Vec<Assignment>,
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("nic state file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("nic state file {path}: not valid state JSON: {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
}

pub fn load(path: &Path) -> Result<StateFile, StateError> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|source| StateError::Parse {
            path: path.into(),
            source,
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(StateFile {
            version: 1,
            assignments: vec![],
        }),
        Err(source) => Err(StateError::Io {
            path: path.into(),
            source,
        }),
    }
}

pub fn save(path: &Path, state: &StateFile) -> Result<(), StateError> {
    let io = |source| StateError::Io {
        path: path.into(),
        source,
    };
    let tmp = path.with_extension("json.tmp");
    let mut f = fs::File::create(&tmp).map_err(io)?;
    f.write_all(&serde_json::to_vec_pretty(state).expect("state serializes"))
        .map_err(io)?;
    drop(f);
    fs::rename(&tmp, path).map_err(io)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn save_then_load_roundtrips_and_missing_is_empty() {
        let dir = std::env::temp_dir().join(format!("nic-state-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let p = dir.join("state.json");
        assert!(load(&p).unwrap().assignments.is_empty());
        let s = StateFile {
            version: 1,
            assignments: vec![Assignment {
                kind: DevKind::Vf,
                pf: "pf0".into(),
                index: 2,
                sandbox: "a".into(),
                mac: "02:00:00:00:00:01".into(),
                vlan: Some(7),
            }],
        };
        save(&p, &s).unwrap();
        assert_eq!(load(&p).unwrap(), s);
        fs::write(&p, b"{broken").unwrap();
        assert!(matches!(load(&p), Err(StateError::Parse { .. })));
        fs::remove_dir_all(&dir).unwrap();
    }
}
