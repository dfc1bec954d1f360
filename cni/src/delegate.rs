//! Running a delegated plugin (IPAM) exactly as spec §4 says: found in
//! CNI_PATH, same environment and stdin, its stderr passed through.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command as Process, Stdio};

use serde_json::Value;

use crate::env::{Command, Env};
use crate::error::{code, PluginError};

/// The first executable named `plugin` in the CNI_PATH directories.
pub fn find(plugin: &str, dirs: &[PathBuf]) -> Result<PathBuf, PluginError> {
    dirs.iter()
        .map(|d| d.join(plugin))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| {
            PluginError::invalid_config(
                "ipam.type",
                format!(
                    "plugin {plugin:?} not found in CNI_PATH {}",
                    std::env::join_paths(dirs)
                        .map(|p| p.to_string_lossy().into_owned())
                        .unwrap_or_default()
                ),
            )
        })
}

/// Runs `plugin` with the invocation's CNI_* variables `env` (CNI_COMMAND
/// set to `command`), the rest of our environment and `stdin`; returns its
/// stdout as JSON (`None` if it printed nothing), or its error result. The
/// variables come from `env`, not from our environment: a served plugin
/// (`crate::server`) has none of its caller's.
pub fn exec(
    plugin: &Path,
    env: &Env,
    command: Command,
    stdin: &[u8],
) -> Result<Option<Value>, PluginError> {
    let name = plugin.display();
    let io = |what: &str, e: std::io::Error| {
        PluginError::caused(
            code::IO_FAILURE,
            format!("delegated plugin {name}: {what}"),
            e,
        )
    };
    let mut process = Process::new(plugin);
    for (k, v) in env.vars() {
        match v {
            Some(v) => process.env(k, v),
            None => process.env_remove(k),
        };
    }
    let mut child = process
        .env("CNI_COMMAND", command.as_str())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| io("cannot start", e))?;
    let write = child.stdin.take().expect("stdin is piped").write_all(stdin);
    let out = child
        .wait_with_output()
        .map_err(|e| io("cannot wait for it", e))?;
    // A plugin may exit without reading its stdin (EPIPE here, or a write
    // cut short): its exit status and output tell then.
    if out.status.success() {
        match write {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
            w => w.map_err(|e| io("cannot write its stdin", e))?,
        }
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let json: Option<Value> = if text.trim().is_empty() {
        None
    } else {
        serde_json::from_str(&text).ok()
    };
    if !out.status.success() {
        let field = |k: &str| json.as_ref().and_then(|j| j.get(k));
        return Err(match field("code").and_then(Value::as_u64) {
            Some(c) => PluginError::new(
                c as u32,
                format!(
                    "delegated plugin {name} {}: {}",
                    command.as_str(),
                    field("msg").and_then(Value::as_str).unwrap_or("")
                ),
                field("details")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
            ),
            None => PluginError::new(
                code::DELEGATE_FAILURE,
                format!(
                    "delegated plugin {name} {} failed ({})",
                    command.as_str(),
                    out.status
                ),
                text.trim().to_string(),
            ),
        });
    }
    match (json, text.trim().is_empty()) {
        (Some(j), _) => Ok(Some(j)),
        (None, true) => Ok(None),
        (None, false) => Err(PluginError::decode(
            &format!("result of delegated plugin {name}"),
            text.trim().to_string(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
        let p = dir.join(name);
        testutil::write_executable(&p, &format!("#!/bin/sh\n{body}\n"));
        p
    }

    #[test]
    fn finds_only_executables_in_order() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let dirs = [a.path().to_path_buf(), b.path().to_path_buf()];
        fs::write(a.path().join("ipam"), "not executable").unwrap();
        let want = script(b.path(), "ipam", "exit 0");
        assert_eq!(find("ipam", &dirs).unwrap(), want);
        assert_eq!(find("other", &dirs).unwrap_err().code, code::INVALID_CONFIG);
    }

    #[test]
    fn passes_stdin_and_command_and_returns_results_or_errors() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let echo = script(
            d,
            "echo",
            r#"read -r line; printf '{"cmd":"%s","id":"%s","args":"%s","in":%s}' "$CNI_COMMAND" "$CNI_CONTAINERID" "${CNI_ARGS-unset}" "$line""#,
        );
        // The variables are the invocation's, not this process's: an unset
        // one is not inherited.
        let env = Env {
            container_id: Some("c7".into()),
            ..Env::default()
        };
        std::env::set_var("CNI_ARGS", "IP=10.0.0.9");
        let out = exec(&echo, &env, Command::Del, b"{\"a\":1}\n");
        std::env::remove_var("CNI_ARGS");
        let out = out.unwrap().unwrap();
        assert_eq!(out["cmd"], "DEL");
        assert_eq!(out["id"], "c7");
        assert_eq!(out["args"], "unset");
        assert_eq!(out["in"]["a"], 1);
        let env = &Env::default();
        let fail = script(
            d,
            "fail",
            r#"echo '{"cniVersion":"1.0.0","code":11,"msg":"no addresses","details":"range full"}'; exit 1"#,
        );
        let e = exec(&fail, env, Command::Add, b"{}").unwrap_err();
        assert_eq!(e.code, 11);
        assert!(
            e.msg.contains("no addresses") && e.details == "range full",
            "{e}"
        );
        let crash = script(d, "crash", "echo boom; exit 3");
        assert_eq!(
            exec(&crash, env, Command::Add, b"{}").unwrap_err().code,
            code::DELEGATE_FAILURE
        );
        let garbage = script(d, "garbage", "echo '{nope'");
        assert_eq!(
            exec(&garbage, env, Command::Add, b"{}").unwrap_err().code,
            code::DECODE_FAILURE
        );
        let quiet = script(d, "quiet", "cat >/dev/null");
        assert_eq!(exec(&quiet, env, Command::Del, b"{}").unwrap(), None);
    }
}
