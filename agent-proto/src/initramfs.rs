//! The Linux guest's initramfs: an uncompressed newc cpio whose only file is
//! the agent, as `/init`, plus the mount points it uses and `/dev/console`
//! (so that the kernel can open the console before devtmpfs is mounted).

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use cpio::newc::{trailer, Builder};

/// Directories of the initramfs with their modes: the agent's mount points
/// (docs/guest.md, "The guest agent (Linux guests)").
pub const DIRS: &[(&str, u32)] = &[
    ("dev", 0o755),
    ("proc", 0o555),
    ("sys", 0o555),
    ("run", 0o755),
    ("tmp", 0o1777),
    ("newroot", 0o755),
];

const S_IFDIR: u32 = 0o040000;
const S_IFCHR: u32 = 0o020000;
const S_IFREG: u32 = 0o100000;

#[derive(Debug, thiserror::Error)]
pub enum InitramfsError {
    #[error("reading the agent binary {path}")]
    ReadAgent {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("agent binary {path} is {size} bytes, over the newc format's 4 GiB")]
    TooLarge { path: PathBuf, size: usize },
    #[error("writing the initramfs {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Writes the initramfs to `out`: `/init` (the agent, mode 0755), [`DIRS`],
/// `/dev/console` (char 5,1). All entries are owned by root with mtime 0, so
/// the same binary gives the same bytes.
pub fn write_initramfs(agent_binary: &Path, out: &Path) -> Result<(), InitramfsError> {
    let agent = std::fs::read(agent_binary).map_err(|source| InitramfsError::ReadAgent {
        path: agent_binary.to_owned(),
        source,
    })?;
    let size = u32::try_from(agent.len()).map_err(|_| InitramfsError::TooLarge {
        path: agent_binary.to_owned(),
        size: agent.len(),
    })?;
    let write = |source| InitramfsError::Write {
        path: out.to_owned(),
        source,
    };
    let file = File::create(out).map_err(write)?;
    let mut w = BufWriter::new(file);
    write_archive(&mut w, &agent, size).map_err(write)?;
    w.into_inner()
        .map_err(|e| e.into_error())
        .and_then(|f| f.sync_all())
        .map_err(write)
}

fn write_archive(w: &mut impl Write, agent: &[u8], size: u32) -> io::Result<()> {
    let mut ino = 0;
    let mut next = || {
        ino += 1;
        ino
    };
    for (name, mode) in DIRS {
        Builder::new(name)
            .ino(next())
            .mode(S_IFDIR | mode)
            .nlink(2)
            .write(&mut *w, 0)
            .finish()?;
    }
    Builder::new("dev/console")
        .ino(next())
        .mode(S_IFCHR | 0o600)
        .rdev_major(5)
        .rdev_minor(1)
        .write(&mut *w, 0)
        .finish()?;
    let mut f = Builder::new("init")
        .ino(next())
        .mode(S_IFREG | 0o755)
        .write(&mut *w, size);
    f.write_all(agent)?;
    f.finish()?;
    trailer(&mut *w)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn archive_lists_init_dirs_and_console() {
        let tmp = tempfile::Builder::new()
            .prefix("agent-proto-initramfs-")
            .tempdir()
            .unwrap();
        let dir = tmp.path();
        let agent = dir.join("agent");
        let body: Vec<u8> = (0..10_001u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&agent, &body).unwrap();
        let out = dir.join("initramfs.cpio");
        write_initramfs(&agent, &out).unwrap();

        // Read back with the crate's reader.
        let mut r = File::open(&out).unwrap();
        let mut seen = Vec::new();
        loop {
            let mut e = cpio::NewcReader::new(r).unwrap();
            if e.entry().is_trailer() {
                break;
            }
            let (name, mode) = (e.entry().name().to_string(), e.entry().mode());
            let (maj, min) = (e.entry().rdev_major(), e.entry().rdev_minor());
            let mut data = Vec::new();
            io::Read::read_to_end(&mut e, &mut data).unwrap();
            if name == "init" {
                assert_eq!(mode, 0o100755);
                assert_eq!(data, body);
            }
            if name == "dev/console" {
                assert_eq!((mode & 0o170000, maj, min), (S_IFCHR, 5, 1));
            }
            seen.push(name);
            r = e.finish().unwrap();
        }
        for want in [
            "init",
            "dev",
            "dev/console",
            "proc",
            "sys",
            "run",
            "tmp",
            "newroot",
        ] {
            assert!(seen.iter().any(|n| n == want), "{want} missing: {seen:?}");
        }

        // And with cpio(1), when installed (Debian package `cpio`).
        match Command::new("cpio")
            .args(["-t", "-v", "--quiet", "-F"])
            .arg(&out)
            .output()
        {
            Ok(o) => {
                assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
                let list = String::from_utf8_lossy(&o.stdout);
                let line = |name: &str| {
                    list.lines()
                        .find(|l| l.split_whitespace().last() == Some(name))
                        .unwrap_or_else(|| panic!("{name} not in\n{list}"))
                        .to_string()
                };
                assert!(line("init").starts_with("-rwxr-xr-x"), "{list}");
                assert!(line("dev/console").starts_with("crw-------"), "{list}");
                assert!(line("tmp").starts_with("drwxrwxrwt"), "{list}");
            }
            Err(e) => eprintln!("cpio(1) not run ({e}): apt-get install cpio"),
        }
    }
}
