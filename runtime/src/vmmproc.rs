//! The VMM process: which executable the runtime spawns for a sandbox and how
//! a VMM process is recognised by its argv (leak checks, tests, benches).
//!
//! `burstvm-vmm` (the VMM alone, cheap to exec) is preferred when it sits next
//! to the `burstvm` binary; otherwise `burstvm vmm` (same arguments).

use std::path::{Path, PathBuf};
use std::sync::Once;

use procutil::spawn::Command;

/// The file name of the VMM-only executable.
pub const EXE: &str = "burstvm-vmm";

/// The program (and its leading argument, if any) that runs a VMM for a
/// runtime whose `burstvm` binary is `bin`.
pub fn program(bin: &Path) -> (PathBuf, Option<&'static str>) {
    let own = bin.with_file_name(EXE);
    let (prog, sub) = if own.is_file() {
        (own, None)
    } else {
        (bin.to_path_buf(), Some("vmm"))
    };
    static LOGGED: Once = Once::new();
    LOGGED.call_once(|| match sub {
        None => tracing::info!(program = %prog.display(), "VMMs run as burstvm-vmm"),
        Some(_) => tracing::info!(
            program = %prog.display(),
            "no {EXE} next to burstvm: VMMs run as `burstvm vmm`"
        ),
    });
    (prog, sub)
}

/// A command that starts a VMM; the caller appends `burstvm vmm`'s arguments.
pub fn command(bin: &Path) -> Command {
    let (prog, sub) = program(bin);
    let mut cmd = Command::new(prog);
    if let Some(sub) = sub {
        cmd.arg(sub);
    }
    cmd
}

/// Whether `argv` (of /proc/<pid>/cmdline) is a VMM's: `burstvm-vmm ...` or
/// `burstvm vmm ...`.
pub fn is_vmm<S: AsRef<[u8]>>(argv: &[S]) -> bool {
    let exe = argv.first().map(|a| a.as_ref()).unwrap_or_default();
    let base = exe.rsplit(|&b| b == b'/').next().unwrap_or_default();
    base == EXE.as_bytes() || argv.get(1).is_some_and(|a| a.as_ref() == b"vmm")
}

/// The `--sandbox` argument of a VMM's argv.
pub fn sandbox_of<S: AsRef<[u8]>>(argv: &[S]) -> Option<&[u8]> {
    if !is_vmm(argv) {
        return None;
    }
    argv.windows(2)
        .find(|w| w[0].as_ref() == b"--sandbox")
        .map(|w| w[1].as_ref())
}

/// Pid and argv of every process (the one /proc walker of the workspace);
/// processes that exit while it reads are skipped.
pub fn all_argv() -> Vec<(u32, Vec<String>)> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .filter_map(|e| {
            let pid = e.file_name().to_str()?.parse::<u32>().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            // cmdline ends with a NUL: no empty last argument.
            let cmd = cmd.strip_suffix(&[0]).unwrap_or(&cmd);
            let args = cmd
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            Some((pid, args))
        })
        .collect()
}

/// Pids of the VMM processes whose sandbox id satisfies `want`.
pub fn processes(want: impl Fn(&[u8]) -> bool) -> Vec<u32> {
    all_argv()
        .into_iter()
        .filter(|(_, args)| sandbox_of(args).is_some_and(&want))
        .map(|(pid, _)| pid)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_forms_are_vmms_and_name_their_sandbox() {
        let own = [
            "/opt/bin/burstvm-vmm",
            "--sandbox",
            "bv1",
            "--memory",
            "64M",
        ];
        let multi = [
            "/opt/bin/burstvm",
            "vmm",
            "--memory",
            "64M",
            "--sandbox",
            "bv2",
        ];
        assert_eq!(sandbox_of(&own), Some(&b"bv1"[..]));
        assert_eq!(sandbox_of(&multi), Some(&b"bv2"[..]));
        // Other burstvm processes that also carry a --sandbox are not VMMs.
        assert_eq!(
            sandbox_of(&["/opt/bin/burstvm", "run", "--sandbox", "x"]),
            None
        );
        assert!(!is_vmm(&["/opt/bin/not-burstvm-vmm", "--sandbox", "x"]));
        assert!(!is_vmm::<&str>(&[]));
    }

    #[test]
    fn burstvm_vmm_is_preferred_when_it_sits_next_to_burstvm() {
        let dir = std::env::temp_dir().join(format!("burstvm-vmmproc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bin = dir.join("burstvm");
        std::fs::write(&bin, b"").unwrap();
        let before = program(&bin);
        std::fs::write(dir.join(EXE), b"").unwrap();
        let after = program(&bin);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(before, (bin.clone(), Some("vmm")));
        assert_eq!(after, (dir.join(EXE), None));
    }
}
