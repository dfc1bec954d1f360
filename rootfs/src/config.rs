//! An image's run configuration (the image config blob's `config`:
//! Entrypoint, Cmd, Env, WorkingDir, User) and the resolution of its user
//! against the unpacked rootfs's /etc/passwd and /etc/group, done on the
//! host when the image is built (the tree is only there then).
//!
//! The rules are Docker's (runc's `GetExecUser`): `""` is uid 0; a numeric
//! user is a uid even without a passwd entry; a name must be in /etc/passwd;
//! with an explicit group the gid is that group's (numeric: as is; a name:
//! from /etc/group) and there are no additional gids; without one the gid is
//! the passwd entry's and the additional gids are the groups that list the
//! user by name.

use std::collections::VecDeque;
use std::ffi::OsStr;
use std::fs::File;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Docker's highest uid/gid (runc's `maxID`).
const MAX_ID: u32 = i32::MAX as u32;
/// Symlinks followed while resolving one path inside the rootfs.
const MAX_LINKS: usize = 40;
/// /etc/passwd and /etc/group larger than this are refused.
const MAX_DB_BYTES: u64 = 16 << 20;

/// What a container of the image runs, from the image config's `config`.
/// Absent fields default as Docker's do: no entrypoint, no cmd, no env, cwd
/// `/`, user `""` (root).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// `NAME=value` strings.
    pub env: Vec<String>,
    pub working_dir: String,
    /// As written in the image: `""`, `uid`, `uid:gid`, `name`, `name:group`.
    pub user: String,
}

impl Default for ImageConfig {
    fn default() -> Self {
        ImageConfig {
            entrypoint: Vec::new(),
            cmd: Vec::new(),
            env: Vec::new(),
            working_dir: "/".into(),
            user: String::new(),
        }
    }
}

/// Neither the image nor the caller gave a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no command: the image config has neither Entrypoint nor Cmd, and none was given")]
pub struct NoCommand;

impl ImageConfig {
    /// The process's argv by Docker's rule: the entrypoint, then
    /// `override_cmd` if it is not empty, else the image's cmd.
    pub fn args(&self, override_cmd: &[String]) -> Result<Vec<String>, NoCommand> {
        let cmd = if override_cmd.is_empty() {
            &self.cmd
        } else {
            override_cmd
        };
        let args: Vec<String> = self.entrypoint.iter().chain(cmd).cloned().collect();
        if args.is_empty() {
            return Err(NoCommand);
        }
        Ok(args)
    }
}

/// The config blob's fields that matter here (`null` and absent alike).
#[derive(Deserialize)]
struct Blob {
    #[serde(default)]
    config: Option<RawConfig>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RawConfig {
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    cmd: Option<Vec<String>>,
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    user: Option<String>,
}

impl ImageConfig {
    /// Parses an image config blob (OCI `application/vnd.oci.image.config.v1+json`
    /// or Docker's `application/vnd.docker.container.image.v1+json`).
    pub fn from_blob(data: &[u8]) -> Result<ImageConfig, serde_json::Error> {
        let b: Blob = serde_json::from_slice(data)?;
        let Some(c) = b.config else {
            return Ok(ImageConfig::default());
        };
        Ok(ImageConfig {
            entrypoint: c.entrypoint.unwrap_or_default(),
            cmd: c.cmd.unwrap_or_default(),
            env: c.env.unwrap_or_default(),
            working_dir: c
                .working_dir
                .filter(|w| !w.is_empty())
                .unwrap_or_else(|| "/".into()),
            user: c.user.unwrap_or_default(),
        })
    }
}

/// The numeric identity a container of the image runs as.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecUser {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (not including `gid` unless a group lists the user).
    pub additional_gids: Vec<u32>,
    /// The passwd entry's home directory (`/` without one): Docker's `$HOME`
    /// when the env does not set it.
    pub home: String,
}

impl ExecUser {
    /// uid 0, gid 0, no additional groups, home `/`.
    pub fn root() -> ExecUser {
        ExecUser {
            uid: 0,
            gid: 0,
            additional_gids: Vec::new(),
            home: "/".into(),
        }
    }
}

/// Why a user spec did not resolve.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error("no user {name:?} in {file}")]
    NoUser { name: String, file: &'static str },
    #[error("no group {name:?} in {file}")]
    NoGroup { name: String, file: &'static str },
    #[error("{what} {id} is out of range (0..={MAX_ID})")]
    Range { what: &'static str, id: String },
    #[error("{file}: {source}")]
    Read {
        file: &'static str,
        #[source]
        source: std::io::Error,
    },
}

const PASSWD: &str = "/etc/passwd";
const GROUP: &str = "/etc/group";

/// One /etc/passwd entry.
struct PasswdEntry {
    name: String,
    uid: u32,
    gid: u32,
    home: String,
}

/// One /etc/group entry.
struct GroupEntry {
    name: String,
    gid: u32,
    members: Vec<String>,
}

/// `name:pw:uid:gid:gecos:home:shell` lines; blank, comment, NIS (`+`/`-`)
/// and malformed lines are skipped, as glibc's files backend does.
fn parse_passwd(text: &str) -> Vec<PasswdEntry> {
    text.lines()
        .filter_map(|l| {
            if l.is_empty() || l.starts_with(['#', '+', '-']) {
                return None;
            }
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 4 || f[0].is_empty() {
                return None;
            }
            Some(PasswdEntry {
                name: f[0].into(),
                uid: f[2].trim().parse().ok()?,
                gid: f[3].trim().parse().ok()?,
                home: f.get(5).copied().unwrap_or("").into(),
            })
        })
        .collect()
}

/// `name:pw:gid:member,member` lines; skipped as in [`parse_passwd`].
fn parse_group(text: &str) -> Vec<GroupEntry> {
    text.lines()
        .filter_map(|l| {
            if l.is_empty() || l.starts_with(['#', '+', '-']) {
                return None;
            }
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 3 || f[0].is_empty() {
                return None;
            }
            Some(GroupEntry {
                name: f[0].into(),
                gid: f[2].trim().parse().ok()?,
                members: f
                    .get(3)
                    .map(|m| {
                        m.split(',')
                            .map(str::trim)
                            .filter(|m| !m.is_empty())
                            .map(String::from)
                            .collect()
                    })
                    .unwrap_or_default(),
            })
        })
        .collect()
}

/// `path` (absolute, inside the image) under `root`, every symlink resolved
/// as if `root` were `/` (`..` stops at it): the image's links never lead
/// to the host's files.
pub(crate) fn resolve_in_root(root: &Path, path: &str) -> std::io::Result<PathBuf> {
    let mut todo: VecDeque<PathBuf> = Path::new(path)
        .components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(PathBuf::from(n)),
            Component::ParentDir => Some(PathBuf::from("..")),
            _ => None,
        })
        .collect();
    let mut done: Vec<PathBuf> = Vec::new();
    let mut links = 0;
    while let Some(c) = todo.pop_front() {
        if c.as_os_str() == OsStr::from_bytes(b"..") {
            done.pop();
            continue;
        }
        let mut p = root.to_path_buf();
        p.extend(&done);
        p.push(&c);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                links += 1;
                if links > MAX_LINKS {
                    return Err(std::io::Error::from_raw_os_error(libc::ELOOP));
                }
                let target = std::fs::read_link(&p)?;
                if target.is_absolute() {
                    done.clear();
                }
                for t in target.components().rev() {
                    match t {
                        Component::Normal(n) => todo.push_front(PathBuf::from(n)),
                        Component::ParentDir => todo.push_front(PathBuf::from("..")),
                        _ => {}
                    }
                }
            }
            _ => done.push(c),
        }
    }
    let mut p = root.to_path_buf();
    p.extend(&done);
    Ok(p)
}

/// The contents of an image file, `None` if it does not exist.
fn read_db(root: &Path, file: &'static str) -> Result<Option<String>, UserError> {
    let read = |file| -> std::io::Result<Option<String>> {
        let p = resolve_in_root(root, file)?;
        let f = match File::open(&p) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        if !f.metadata()?.is_file() {
            return Err(std::io::Error::other("not a regular file"));
        }
        let mut buf = Vec::new();
        f.take(MAX_DB_BYTES + 1).read_to_end(&mut buf)?;
        if buf.len() as u64 > MAX_DB_BYTES {
            return Err(std::io::Error::other("larger than 16 MiB"));
        }
        Ok(Some(String::from_utf8_lossy(&buf).into_owned()))
    };
    read(file).map_err(|source| UserError::Read { file, source })
}

fn numeric(what: &'static str, s: &str) -> Result<Option<u32>, UserError> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Ok(None);
    }
    match s.parse::<u32>() {
        Ok(id) if id <= MAX_ID => Ok(Some(id)),
        _ => Err(UserError::Range { what, id: s.into() }),
    }
}

/// Resolves a user spec (`""`, `uid`, `uid:gid`, `name`, `name:group`, and
/// the mixed forms) against `root`'s /etc/passwd and /etc/group.
pub fn resolve_user(root: &Path, spec: &str) -> Result<ExecUser, UserError> {
    let (user_arg, group_arg) = spec.split_once(':').unwrap_or((spec, ""));
    let uid_arg = numeric("uid", user_arg)?;
    let gid_arg = numeric("gid", group_arg)?;
    let mut user = ExecUser::root();

    // The user: "" is uid 0; a number is a uid; anything else a name.
    let passwd = read_db(root, PASSWD)?
        .map(|t| parse_passwd(&t))
        .unwrap_or_default();
    let found = passwd.iter().find(|u| match (user_arg, uid_arg) {
        ("", _) => u.uid == 0,
        (_, Some(uid)) => u.uid == uid,
        (name, None) => u.name == name,
    });
    let matched_name = match (found, uid_arg) {
        (Some(u), _) => {
            user.uid = u.uid;
            user.gid = u.gid;
            if !u.home.is_empty() {
                user.home = u.home.clone();
            }
            Some(u.name.as_str())
        }
        (None, Some(uid)) => {
            user.uid = uid;
            None
        }
        (None, None) if user_arg.is_empty() => None,
        (None, None) => {
            return Err(UserError::NoUser {
                name: user_arg.into(),
                file: PASSWD,
            })
        }
    };

    // The groups: an explicit one sets the gid; otherwise the groups that
    // list the user by name are its additional gids.
    if group_arg.is_empty() && matched_name.is_none() {
        return Ok(user);
    }
    let groups = read_db(root, GROUP)?
        .map(|t| parse_group(&t))
        .unwrap_or_default();
    if !group_arg.is_empty() {
        let found = groups.iter().find(|g| match gid_arg {
            Some(gid) => g.gid == gid,
            None => g.name == group_arg,
        });
        user.gid = match (found, gid_arg) {
            (Some(g), _) => g.gid,
            (None, Some(gid)) => gid,
            (None, None) => {
                return Err(UserError::NoGroup {
                    name: group_arg.into(),
                    file: GROUP,
                })
            }
        };
    } else if let Some(name) = matched_name {
        for g in groups
            .iter()
            .filter(|g| g.members.iter().any(|m| m == name))
        {
            if !user.additional_gids.contains(&g.gid) {
                user.additional_gids.push(g.gid);
            }
        }
    }
    Ok(user)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn args_follow_dockers_rule() {
        let mut c = ImageConfig::default();
        assert_eq!(c.args(&[]), Err(NoCommand));
        assert_eq!(c.args(&s(&["ls", "-l"])).unwrap(), s(&["ls", "-l"]));
        c.cmd = s(&["sh"]);
        assert_eq!(c.args(&[]).unwrap(), s(&["sh"]));
        assert_eq!(c.args(&s(&["true"])).unwrap(), s(&["true"]));
        c.entrypoint = s(&["/init", "--"]);
        assert_eq!(c.args(&[]).unwrap(), s(&["/init", "--", "sh"]));
        assert_eq!(c.args(&s(&["x"])).unwrap(), s(&["/init", "--", "x"]));
        c.cmd.clear();
        assert_eq!(c.args(&[]).unwrap(), s(&["/init", "--"]));
    }

    #[test]
    fn blob_fields_and_defaults() {
        let c = ImageConfig::from_blob(
            br#"{"architecture":"amd64","config":{"Entrypoint":["/e"],"Cmd":["a","b"],
                "Env":["A=1","PATH=/bin"],"WorkingDir":"/w","User":"app:wheel"}}"#,
        )
        .unwrap();
        assert_eq!(c.entrypoint, s(&["/e"]));
        assert_eq!(c.cmd, s(&["a", "b"]));
        assert_eq!(c.env, s(&["A=1", "PATH=/bin"]));
        assert_eq!(
            (c.working_dir.as_str(), c.user.as_str()),
            ("/w", "app:wheel")
        );
        for empty in [
            &b"{}"[..],
            br#"{"config":null}"#,
            br#"{"config":{"Entrypoint":null,"Cmd":null,"Env":null,"WorkingDir":"","User":""}}"#,
        ] {
            assert_eq!(
                ImageConfig::from_blob(empty).unwrap(),
                ImageConfig::default()
            );
        }
        assert!(ImageConfig::from_blob(br#"{"config":{"Cmd":"sh"}}"#).is_err());
    }

    fn etc(root: &Path, passwd: Option<&str>, group: Option<&str>) {
        std::fs::create_dir_all(root.join("etc")).unwrap();
        if let Some(p) = passwd {
            std::fs::write(root.join("etc/passwd"), p).unwrap();
        }
        if let Some(g) = group {
            std::fs::write(root.join("etc/group"), g).unwrap();
        }
    }

    const PW: &str = "root:x:0:0:root:/root:/bin/sh\n# comment\n\nbad:x:zz:1::/:\n\
                      app:x:1000:1000:App:/home/app:/bin/sh\ndaemon:x:1:1::/usr/sbin:\n";
    const GR: &str = "root:x:0:\nwheel:x:10:root,app\napp:x:1000:\nstaff:x:50: daemon , app\n";

    fn user(uid: u32, gid: u32, gids: &[u32], home: &str) -> ExecUser {
        ExecUser {
            uid,
            gid,
            additional_gids: gids.to_vec(),
            home: home.into(),
        }
    }

    #[test]
    fn users_resolve_by_name_and_number() {
        let t = tempfile::tempdir().unwrap();
        etc(t.path(), Some(PW), Some(GR));
        let r = |spec| resolve_user(t.path(), spec).unwrap();
        assert_eq!(r(""), user(0, 0, &[10], "/root"));
        assert_eq!(r("app"), user(1000, 1000, &[10, 50], "/home/app"));
        assert_eq!(r("1000"), user(1000, 1000, &[10, 50], "/home/app"));
        // An explicit group: its gid, no additional groups.
        assert_eq!(r("app:wheel"), user(1000, 10, &[], "/home/app"));
        assert_eq!(r("1000:50"), user(1000, 50, &[], "/home/app"));
        assert_eq!(r("1000:4242"), user(1000, 4242, &[], "/home/app"));
        // Numeric ids need no entry.
        assert_eq!(r("4242"), user(4242, 0, &[], "/"));
        assert_eq!(r("4242:7"), user(4242, 7, &[], "/"));
        assert_eq!(r("daemon:root"), user(1, 0, &[], "/usr/sbin"));
        let e = resolve_user(t.path(), "nobody").unwrap_err().to_string();
        assert_eq!(e, "no user \"nobody\" in /etc/passwd");
        let e = resolve_user(t.path(), "app:nogroup")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "no group \"nogroup\" in /etc/group");
        let e = resolve_user(t.path(), "4294967295")
            .unwrap_err()
            .to_string();
        assert!(e.contains("out of range"), "{e}");
    }

    #[test]
    fn missing_files_allow_numeric_users_only() {
        let t = tempfile::tempdir().unwrap();
        let r = |spec| resolve_user(t.path(), spec);
        assert_eq!(r("").unwrap(), ExecUser::root());
        assert_eq!(r("1000:1000").unwrap(), user(1000, 1000, &[], "/"));
        assert!(matches!(r("app"), Err(UserError::NoUser { .. })));
        assert!(matches!(r("0:wheel"), Err(UserError::NoGroup { .. })));
        // passwd without group: a name resolves, no additional groups.
        etc(t.path(), Some(PW), None);
        assert_eq!(r("app").unwrap(), user(1000, 1000, &[], "/home/app"));
        // A directory where the file should be is an error, not "missing".
        std::fs::create_dir(t.path().join("etc/group")).unwrap();
        let e = r("app").unwrap_err().to_string();
        assert!(e.starts_with("/etc/group: "), "{e}");
    }

    #[test]
    fn links_stay_inside_the_root() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        etc(&root, None, None);
        std::fs::create_dir_all(root.join("usr/lib")).unwrap();
        std::fs::write(root.join("usr/lib/passwd"), "u:x:7:8::/h:\n").unwrap();
        // An absolute link and a relative one that climbs past the root both
        // land inside it.
        std::os::unix::fs::symlink("/usr/lib/passwd", root.join("etc/passwd")).unwrap();
        std::fs::write(t.path().join("group"), "outside:x:99:u\n").unwrap();
        std::os::unix::fs::symlink("../../../group", root.join("etc/group")).unwrap();
        assert_eq!(
            resolve_in_root(&root, "/etc/group").unwrap(),
            root.join("group")
        );
        assert_eq!(
            resolve_user(&root, "u").unwrap(),
            user(7, 8, &[], "/h"),
            "the host's group file is not read"
        );
        // A loop ends.
        std::fs::remove_file(root.join("etc/passwd")).unwrap();
        std::os::unix::fs::symlink("passwd", root.join("etc/passwd")).unwrap();
        let e = resolve_user(&root, "u").unwrap_err().to_string();
        assert!(e.starts_with("/etc/passwd: "), "{e}");
    }
}
