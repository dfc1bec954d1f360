//! MicroVM templates (RunD §4.3; Firecracker's snapshots, Kata's
//! templates): a VM paused at the agent's checkpoint, saved as KVM state
//! (versioned, serde) plus one file per memory region; restored by mapping
//! those files copy-on-write (guestmem::template). See docs/templates.md.
//!
//! `create` saves (and `probe` checks the KVM calls); the restore path is a
//! build step, in builder/restore.rs.

pub mod create;
pub mod state;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::Error;
use state::{VcpuState, VmState};

/// Bumped on any change of the file format or of what the state means.
pub const TEMPLATE_VERSION: u32 = 1;
/// The state file in a template directory (written last: its presence
/// means the template is complete).
pub const STATE_FILE: &str = "template.json";

/// One memory region of the template and its file in the directory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TemplateRegion {
    pub name: String,
    pub gpa: u64,
    pub size: u64,
    pub file: String,
    /// Pages with data (the rest of the file is holes).
    pub data_pages: u64,
}

#[derive(Serialize, Deserialize)]
pub struct Template {
    pub version: u32,
    /// The agent that ran up to the checkpoint (its code is in the memory
    /// files; the boot info it reads after the restore must match it).
    pub agent_checksum: u32,
    pub ram_size: u64,
    /// The app payload size the image region was sized for (the largest a
    /// restored sandbox may use).
    pub app_size: u64,
    pub regions: Vec<TemplateRegion>,
    /// Devices that existed at the checkpoint: none. Every device is per
    /// sandbox and attached after the restore, in its reset state, which
    /// is what the guest expects: it checkpoints before touching any.
    pub devices: Vec<String>,
    pub vm: VmState,
    pub vcpus: Vec<VcpuState>,
}

impl Template {
    pub fn load(dir: &Path) -> Result<Template, Error> {
        let path = dir.join(STATE_FILE);
        let bad = |msg: String| Error::Template {
            path: dir.to_path_buf(),
            msg,
        };
        let text = std::fs::read(&path).map_err(|source| Error::File {
            what: "template state",
            path: path.clone(),
            source,
        })?;
        let t: Template = serde_json::from_slice(&text).map_err(|source| Error::TemplateJson {
            path: dir.to_path_buf(),
            source,
        })?;
        if t.version != TEMPLATE_VERSION {
            return Err(bad(format!(
                "version {}, this burstvm reads version {TEMPLATE_VERSION}",
                t.version
            )));
        }
        let agent = guest::checksum(guest::AGENT_IMAGE);
        if t.agent_checksum != agent {
            return Err(bad(format!(
                "made with another agent build (checksum {:#010x}, this one {agent:#010x}); \
                 create it again",
                t.agent_checksum
            )));
        }
        if t.vcpus.is_empty() {
            return Err(bad("no vCPU state".into()));
        }
        for r in &t.regions {
            if r.file.contains('/') || r.file.starts_with('.') {
                return Err(bad(format!(
                    "region {:?}: bad file name {:?}",
                    r.name, r.file
                )));
            }
        }
        Ok(t)
    }

    /// The regions as guestmem specs with their files.
    pub fn region_files(&self, dir: &Path) -> Vec<(guestmem::RegionSpec, PathBuf)> {
        self.regions
            .iter()
            .map(|r| {
                (
                    guestmem::RegionSpec {
                        name: r.name.clone(),
                        gpa: r.gpa,
                        size: r.size,
                        dma: false,
                    },
                    dir.join(&r.file),
                )
            })
            .collect()
    }
}
