//! The CNI_* environment variables of one invocation (spec §2 "Parameters").

use std::path::{Path, PathBuf};

use crate::error::PluginError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Status,
    Version,
    Gc,
}

impl Command {
    pub fn as_str(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Status => "STATUS",
            Command::Version => "VERSION",
            Command::Gc => "GC",
        }
    }
}

/// The raw variables; each command asks for the ones it requires.
#[derive(Debug, Clone, Default)]
pub struct Env {
    pub command: Option<String>,
    pub container_id: Option<String>,
    pub netns: Option<String>,
    pub ifname: Option<String>,
    pub path: Option<String>,
    /// CNI_ARGS: `KEY=VALUE` pairs separated by `;` (IPAM reads `IP=`).
    pub args: Option<String>,
}

impl Env {
    pub fn from_process() -> Env {
        Env::from_vars(
            std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))),
        )
    }

    /// The CNI_* variables among `vars` (others are ignored; an empty value
    /// is unset, and of a name given twice the last counts, as in a process
    /// environment).
    pub fn from_vars(vars: impl IntoIterator<Item = (String, String)>) -> Env {
        let mut env = Env::default();
        for (k, v) in vars {
            let slot = match k.as_str() {
                "CNI_COMMAND" => &mut env.command,
                "CNI_CONTAINERID" => &mut env.container_id,
                "CNI_NETNS" => &mut env.netns,
                "CNI_IFNAME" => &mut env.ifname,
                "CNI_PATH" => &mut env.path,
                "CNI_ARGS" => &mut env.args,
                _ => continue,
            };
            *slot = Some(v).filter(|v| !v.is_empty());
        }
        env
    }

    /// The variables as a plugin's environment carries them: (name, value)
    /// for the set ones, (name, None) for the unset (a delegated plugin
    /// must not inherit them from the calling process).
    pub fn vars(&self) -> [(&'static str, Option<&str>); 6] {
        [
            ("CNI_COMMAND", self.command.as_deref()),
            ("CNI_CONTAINERID", self.container_id.as_deref()),
            ("CNI_NETNS", self.netns.as_deref()),
            ("CNI_IFNAME", self.ifname.as_deref()),
            ("CNI_PATH", self.path.as_deref()),
            ("CNI_ARGS", self.args.as_deref()),
        ]
    }

    pub fn command(&self) -> Result<Command, PluginError> {
        match self.command.as_deref() {
            Some("ADD") => Ok(Command::Add),
            Some("DEL") => Ok(Command::Del),
            Some("CHECK") => Ok(Command::Check),
            Some("STATUS") => Ok(Command::Status),
            Some("VERSION") => Ok(Command::Version),
            Some("GC") => Ok(Command::Gc),
            Some(other) => Err(PluginError::invalid_env(
                "CNI_COMMAND",
                format!(
                    "unknown command {other:?} (expected ADD, DEL, CHECK, STATUS, VERSION or GC)"
                ),
            )),
            None => Err(PluginError::invalid_env("CNI_COMMAND", "not set")),
        }
    }

    /// CNI_CONTAINERID: alphanumeric first, then alphanumerics, `_`, `.` or `-`.
    pub fn container_id(&self) -> Result<&str, PluginError> {
        let id = self
            .container_id
            .as_deref()
            .ok_or_else(|| PluginError::invalid_env("CNI_CONTAINERID", "not set"))?;
        let mut chars = id.chars();
        let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphanumeric());
        if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')) {
            return Err(PluginError::invalid_env(
                "CNI_CONTAINERID",
                format!("{id:?} must start with a letter or digit followed by letters, digits, '_', '.' or '-'"),
            ));
        }
        Ok(id)
    }

    pub fn netns(&self) -> Result<&Path, PluginError> {
        self.netns
            .as_deref()
            .map(Path::new)
            .ok_or_else(|| PluginError::invalid_env("CNI_NETNS", "not set"))
    }

    pub fn netns_opt(&self) -> Option<&Path> {
        self.netns.as_deref().map(Path::new)
    }

    /// CNI_IFNAME: a valid Linux interface name.
    pub fn ifname(&self) -> Result<&str, PluginError> {
        let name = self
            .ifname
            .as_deref()
            .ok_or_else(|| PluginError::invalid_env("CNI_IFNAME", "not set"))?;
        if name.len() > 15
            || name == "."
            || name == ".."
            || name
                .chars()
                .any(|c| c == '/' || c == ':' || c.is_whitespace())
        {
            return Err(PluginError::invalid_env(
                "CNI_IFNAME",
                format!("{name:?} is not a valid interface name (at most 15 bytes, no '/', ':' or spaces)"),
            ));
        }
        Ok(name)
    }

    /// CNI_PATH as a list of directories; required when a plugin is delegated to.
    pub fn path(&self) -> Result<Vec<PathBuf>, PluginError> {
        let p = self.path.as_deref().ok_or_else(|| {
            PluginError::invalid_env("CNI_PATH", "not set (needed to find the IPAM plugin)")
        })?;
        Ok(std::env::split_paths(p)
            .filter(|d| !d.as_os_str().is_empty())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::code;

    fn env(cid: &str, ifname: &str) -> Env {
        Env {
            container_id: Some(cid.into()),
            ifname: Some(ifname.into()),
            ..Env::default()
        }
    }

    #[test]
    fn validates_container_id_and_ifname() {
        assert_eq!(
            env("abc-1_2.3", "eth0").container_id().unwrap(),
            "abc-1_2.3"
        );
        for bad in ["-abc", "a b", "a/b", "ä"] {
            let e = env(bad, "eth0").container_id().unwrap_err();
            assert_eq!(e.code, code::INVALID_ENV);
            assert!(e.msg.contains("CNI_CONTAINERID"));
        }
        assert_eq!(env("c", "net1").ifname().unwrap(), "net1");
        for bad in ["0123456789abcdef", "a/b", "..", "a b", "a:b"] {
            assert_eq!(env("c", bad).ifname().unwrap_err().code, code::INVALID_ENV);
        }
        assert!(Env::default()
            .netns()
            .unwrap_err()
            .msg
            .contains("CNI_NETNS"));
    }

    #[test]
    fn unknown_command_is_invalid_env() {
        let e = Env {
            command: Some("EXPLODE".into()),
            ..Env::default()
        };
        assert_eq!(e.command().unwrap_err().code, code::INVALID_ENV);
        let e = Env {
            command: Some("GC".into()),
            ..Env::default()
        };
        assert_eq!(e.command().unwrap(), Command::Gc);
    }

    #[test]
    fn vars_pick_the_cni_ones_and_empty_is_unset() {
        let e = Env::from_vars(
            [
                ("HOME", "/root"),
                ("CNI_COMMAND", "DEL"),
                ("CNI_IFNAME", "eth0"),
                ("CNI_IFNAME", "net1"),
                ("CNI_ARGS", ""),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string())),
        );
        assert_eq!(e.command().unwrap(), Command::Del);
        assert_eq!(e.ifname().unwrap(), "net1");
        assert_eq!(e.args, None);
        assert_eq!(e.container_id, None);
        let vars = e.vars();
        assert!(vars.contains(&("CNI_IFNAME", Some("net1"))));
        assert!(vars.contains(&("CNI_ARGS", None)));
    }

    #[test]
    fn path_splits_on_colons() {
        let e = Env {
            path: Some("/a::/b".into()),
            ..Env::default()
        };
        assert_eq!(
            e.path().unwrap(),
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
    }
}
