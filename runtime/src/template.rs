//! `burstvm template create|probe` and the `--template NAME` option of
//! `run` and `bench startup` (RunD §4.3, docs/templates.md). The VMM does
//! the work (`burstvm vmm --template-save / --template-probe / --template`);
//! this module names templates and spawns it.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{bad, burstvm_bin, Error, SandboxConfig};

/// Where templates live by default, one directory per name.
pub const DEFAULT_DIR: &str = "/var/lib/burstvm/templates";

/// A template named on the command line of `run` and `bench startup`.
#[derive(Debug, Clone)]
pub struct TemplateConfig {
    /// Start sandboxes from this template (a name under --template-dir, or
    /// a path) instead of booting them; per-sandbox devices are attached
    /// after the restore.
    pub template: Option<String>,
    /// Directory of named templates.
    pub template_dir: PathBuf,
}

impl TemplateConfig {
    /// The template's directory, checked to hold a complete template.
    pub fn resolve(&self) -> Result<Option<PathBuf>, Error> {
        let Some(name) = &self.template else {
            return Ok(None);
        };
        let dir = path_of(name, &self.template_dir);
        if !dir.join("template.json").is_file() {
            return Err(bad(
                "--template",
                format!(
                    "{}: no template there (make it with `burstvm template create {name}`)",
                    dir.display()
                ),
            ));
        }
        Ok(Some(dir))
    }
}

fn path_of(name: &str, dir: &Path) -> PathBuf {
    if name.contains('/') {
        PathBuf::from(name)
    } else {
        dir.join(name)
    }
}

/// `burstvm template create NAME` / `burstvm template probe`.
#[derive(Debug, Clone)]
pub struct TemplateCreateConfig {
    /// Name of the template (a directory under --dir).
    pub name: String,
    /// Directory of named templates.
    pub dir: PathBuf,
    /// Guest memory and the largest app payload of the sandboxes that
    /// will start from it (the template fixes both).
    pub sandbox: SandboxConfig,
    /// Replace an existing template of that name.
    pub force: bool,
    /// The burstvm binary to run the VMM from (default: this one).
    pub burstvm_bin: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub struct TemplateProbeConfig {
    /// The burstvm binary to run the VMM from (default: this one).
    pub burstvm_bin: Option<PathBuf>,
}

fn run_vmm(bin: &Path, args: &[String], what: &str) -> Result<(), Error> {
    let status = Command::new(bin)
        .arg("vmm")
        .args(args)
        .status()
        .map_err(|source| Error::ArgIo {
            field: "--burstvm-bin",
            path: bin.to_path_buf(),
            source,
        })?;
    if !status.success() {
        return Err(bad(
            "template",
            format!("{what}: burstvm vmm failed ({status})"),
        ));
    }
    Ok(())
}

pub fn create_cli(a: &TemplateCreateConfig) -> Result<(), Error> {
    if a.name.is_empty() || a.name.contains('/') || a.name.starts_with('.') {
        return Err(bad(
            "NAME",
            format!("{:?}: a plain name (no '/', not starting with '.')", a.name),
        ));
    }
    let (memory, app_size) = a.sandbox.bytes()?;
    let dir = a.dir.join(&a.name);
    std::fs::create_dir_all(&a.dir).map_err(|source| Error::ArgIo {
        field: "--dir",
        path: a.dir.clone(),
        source,
    })?;
    if dir.exists() {
        if !a.force {
            return Err(bad(
                "NAME",
                format!("{} exists (use --force to replace it)", dir.display()),
            ));
        }
        std::fs::remove_dir_all(&dir).map_err(|source| Error::ArgIo {
            field: "--force",
            path: dir.clone(),
            source,
        })?;
    }
    let args = vec![
        "--sandbox".to_string(),
        format!("tmpl-{}", a.name.chars().take(50).collect::<String>()),
        "--memory".into(),
        format!("{}K", memory >> 10),
        "--app-size".into(),
        app_size.to_string(),
        "--template-save".into(),
        dir.display().to_string(),
    ];
    run_vmm(
        &burstvm_bin(&a.burstvm_bin)?,
        &args,
        &format!("creating {}", dir.display()),
    )
}

pub fn probe_cli(a: &TemplateProbeConfig) -> Result<(), Error> {
    let args = vec![
        "--sandbox".to_string(),
        format!("tmpl-probe-{}", std::process::id()),
        "--template-probe".into(),
    ];
    run_vmm(&burstvm_bin(&a.burstvm_bin)?, &args, "the KVM state probe")
}
