//! The CNI commands: ADD, DEL, CHECK, STATUS, VERSION, GC.//!
//! This file: the entry point, VERSION, mapping NIC and link failures to
//! spec error codes, and the helpers every command uses. ADD and DEL are in
//! `attach.rs`; CHECK, STATUS and GC (which verify or collect, never
//! allocate) in `inspect.rs`.

mod attach;
mod inspect;

use attach::{add, del};
use inspect::{check, gc, status};

use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::config::{self, NetConf};
use crate::delegate;
use crate::env::{Command, Env};
use crate::error::{code, PluginError};
use crate::ipam;
use crate::placeholder::{self, PlaceholderError};
use crate::version::{Version, SUPPORTED};
use netutil::cni::{CniResult, Interface};
use netutil::{MacAddr, Netns, NetnsError, RouteSpec};
use nic_api::{Client, ClientError, DevKind, ErrorCode, VfInfo as Vf, VfState};

/// Most bytes of network config read from stdin. Real configs are a few
/// KiB; a caller that sends more (broken or hostile) gets a decode error,
/// with nothing done, and the plugin never holds more than this.
pub const MAX_STDIN: usize = 1 << 20;

/// The network config on `input`, at most `MAX_STDIN` bytes: one byte more
/// is refused unread beyond it (DECODE_FAILURE), before anything is done.
pub fn read_stdin(input: impl Read) -> Result<Vec<u8>, PluginError> {
    let mut buf = Vec::new();
    input
        .take(MAX_STDIN as u64 + 1)
        .read_to_end(&mut buf)
        .map_err(|e| {
            PluginError::caused(
                code::IO_FAILURE,
                "cannot read the network config from stdin",
                e,
            )
        })?;
    if buf.len() > MAX_STDIN {
        return Err(PluginError::decode(
            "the network config on stdin",
            format!("longer than {MAX_STDIN} bytes; refused, nothing was done"),
        ));
    }
    Ok(buf)
}

/// Reads env and stdin, runs the command, prints its result or error
/// result; returns the exit status.
pub fn main() -> i32 {
    serve("burstvm-cni", run)
}

/// A plugin executable's body (burstvm-cni, burstvm-ipam): env and stdin
/// in, `run`'s result or error result out, the exit status returned.
pub(crate) fn serve(name: &str, run: Run) -> i32 {
    let env = Env::from_process();
    let stdin = read_stdin(std::io::stdin().lock());
    let out = outcome(name, run, &env, stdin);
    // One write each: a result cut by a failed write is still a failure to the caller.
    let _ = std::io::stdout().write_all(&out.stdout);
    let _ = std::io::stderr().write_all(&out.stderr);
    out.status
}

/// A plugin command's body: `run` on the environment and the config read
/// from stdin.
pub(crate) type Run = fn(&Env, &[u8]) -> Result<Option<Value>, PluginError>;

/// What one invocation prints and its exit status (spec §2: the result, or
/// the error result, on stdout; a line for people on stderr).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub status: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Runs `run` as the executable `name` would, with `stdin` as `read_stdin`
/// returned it: the one path of the exec'd plugin and the served one
/// (`crate::server`).
pub(crate) fn outcome(
    name: &str,
    run: Run,
    env: &Env,
    stdin: Result<Vec<u8>, PluginError>,
) -> Outcome {
    let (stdin, result) = match stdin {
        Ok(stdin) => {
            let r = run(env, &stdin);
            (stdin, r)
        }
        // An oversized config is not looked into (its version neither).
        Err(e) => (Vec::new(), Err(e)),
    };
    match result {
        Ok(Some(out)) => Outcome {
            status: 0,
            stdout: format!("{out}\n").into_bytes(),
            stderr: Vec::new(),
        },
        Ok(None) => Outcome {
            status: 0,
            stdout: Vec::new(),
            stderr: Vec::new(),
        },
        Err(e) => Outcome {
            status: 1,
            stdout: format!("{}\n", e.to_json(&version_or_default(&stdin))).into_bytes(),
            stderr: format!("{name} {}: {e}\n", env.command.as_deref().unwrap_or("?")).into_bytes(),
        },
    }
}

/// The config's `cniVersion` for an error result, the newest if it has none.
pub(crate) fn version_or_default(stdin: &[u8]) -> String {
    config::peek_version(stdin).unwrap_or_else(|| Version::V1_1_0.as_str().into())
}

/// INCOMPATIBLE_VERSION unless version `v` has `cmd`: CHECK exists since
/// 0.4.0, STATUS and GC since 1.1.0, the other commands in every version.
pub(crate) fn require(cmd: Command, v: Version) -> Result<(), PluginError> {
    let (ok, since) = match cmd {
        Command::Check => (v.has_check(), "0.4.0"),
        Command::Status | Command::Gc => (v.has_status_and_gc(), "1.1.0"),
        Command::Add | Command::Del | Command::Version => return Ok(()),
    };
    if ok {
        return Ok(());
    }
    let cmd = cmd.as_str();
    Err(PluginError::new(
        code::INCOMPATIBLE_VERSION,
        format!("{cmd} is not part of this CNI version"),
        format!(
            "cniVersion {} has no {cmd} ({since} and later have it)",
            v.as_str()
        ),
    ))
}

/// One invocation; `Ok(None)` means success without output (DEL, STATUS, GC).
pub fn run(env: &Env, stdin: &[u8]) -> Result<Option<Value>, PluginError> {
    let cmd = env.command()?;
    if cmd == Command::Version {
        return version(stdin).map(Some);
    }
    let conf = config::parse(stdin)?;
    require(cmd, conf.version)?;
    match cmd {
        Command::Add => add(env, &conf).map(Some),
        Command::Del => del(env, &conf).map(|()| None),
        Command::Check => check(env, &conf).map(|()| None),
        Command::Status => status(env, &conf).map(|()| None),
        Command::Gc => gc(env, &conf).map(|()| None),
        Command::Version => unreachable!("handled above"),
    }
}

pub(crate) fn version(stdin: &[u8]) -> Result<Value, PluginError> {
    let asked = if stdin.iter().all(u8::is_ascii_whitespace) {
        Version::V1_1_0.as_str().to_string()
    } else {
        let v: Value = serde_json::from_slice(stdin)
            .map_err(|e| PluginError::decode_json("VERSION input", e))?;
        v.get("cniVersion")
            .and_then(Value::as_str)
            .unwrap_or(Version::V1_1_0.as_str())
            .to_string()
    };
    Ok(json!({"cniVersion": asked, "supportedVersions": SUPPORTED}))
}

fn nic_error(e: ClientError) -> PluginError {
    if e.is_lost() {
        // Killed mid-call; the runtime restarts it on its state file. DEL must
        // say "try again" so that the runtime repeats it against the new
        // daemon: a 5 would end the retries with the VF still assigned.
        return PluginError::caused(
            code::TRY_AGAIN_LATER,
            "NIC daemon went away mid-call, try again later",
            e,
        );
    }
    if e.is_transient() {
        // Not running, overloaded or not answering within the timeout.
        return PluginError::caused(
            code::TRY_AGAIN_LATER,
            "NIC daemon unavailable, try again later",
            e,
        );
    }
    let refused = match &e {
        ClientError::Refused { code, .. } => Some(*code),
        _ => None,
    };
    match refused {
        None => PluginError::caused(code::IO_FAILURE, "NIC daemon I/O failure", e),
        Some(Some(ErrorCode::NoFreeVf)) => {
            PluginError::caused(code::TRY_AGAIN_LATER, "no free VF", e)
        }
        Some(Some(ErrorCode::UnknownPf)) => PluginError::invalid_config_caused("pf", e),
        Some(Some(ErrorCode::BadRequest)) => PluginError::invalid_config_caused("mac/vlan", e),
        Some(Some(ErrorCode::AlreadyAssigned)) => {
            PluginError::caused(code::VF_CONFLICT, "the container already has a VF", e)
        }
        _ => PluginError::caused(code::IO_FAILURE, "NIC daemon refused", e),
    }
}

/// The VF assigned to `cid`, None if it has none.
fn assigned_vf(nic: &mut Client, cid: &str) -> Result<Option<Vf>, ClientError> {
    match nic.get_by_sandbox(cid) {
        Err(ClientError::Refused {
            code: Some(ErrorCode::NotFound),
            ..
        }) => Ok(None),
        r => r.map(Some),
    }
}

fn link_error(e: PlaceholderError) -> PluginError {
    match e {
        PlaceholderError::Netns(NetnsError::Gone { .. } | NetnsError::NotNetns { .. }) => {
            PluginError::invalid_env_caused("CNI_NETNS", e)
        }
        PlaceholderError::Exists { .. } => {
            PluginError::caused(code::LINK_FAILURE, "interface already exists", e)
        }
        _ => PluginError::caused(code::LINK_FAILURE, "placeholder link", e),
    }
}

const CHECK_FAILED_MSG: &str = "attachment differs from the ADD result";

fn check_failed(details: impl Into<String>) -> PluginError {
    PluginError::new(code::CHECK_FAILED, CHECK_FAILED_MSG, details)
}

fn parse_mac(s: &str) -> Option<MacAddr> {
    s.parse().ok()
}

/// Where a network's addresses come from: `burstvm-ipam` in this process,
/// or an IPAM plugin executed from CNI_PATH (spec §4: same stdin and env).
enum Ipam {
    Builtin(Box<ipam::IpamConf>),
    Exec(PathBuf),
}

/// The network's IPAM, if its config has one (an executed plugin needs CNI_PATH).
fn ipam_of(env: &Env, conf: &NetConf) -> Result<Option<Ipam>, PluginError> {
    Ok(match conf.ipam.as_deref() {
        None => None,
        Some(ipam::TYPE) => Some(Ipam::Builtin(Box::new(ipam::parse(
            &conf.raw,
            env.args.as_deref(),
        )?))),
        Some(t) => Some(Ipam::Exec(delegate::find(t, &env.path()?)?)),
    })
}

impl Ipam {
    fn add(&self, env: &Env, conf: &NetConf) -> Result<CniResult, PluginError> {
        let p = match self {
            Ipam::Builtin(c) => return ipam::add(c, ipam::owner(env)?),
            Ipam::Exec(p) => p,
        };
        let what = || format!("result of IPAM plugin {}", p.display());
        let out = delegate::exec(p, env, Command::Add, &conf.raw)?
            .ok_or_else(|| PluginError::decode(&what(), "empty output"))?;
        CniResult::from_json(&out).map_err(|e| PluginError::decode_json(&what(), e))
    }

    /// DEL, CHECK, STATUS or GC: commands whose IPAM result is only success.
    fn call(&self, env: &Env, conf: &NetConf, cmd: Command) -> Result<(), PluginError> {
        let c = match self {
            Ipam::Exec(p) => return delegate::exec(p, env, cmd, &conf.raw).map(|_| ()),
            Ipam::Builtin(c) => c,
        };
        match cmd {
            Command::Del => ipam::del(c, ipam::owner(env)?),
            Command::Check => ipam::check(c, ipam::owner(env)?),
            Command::Status => ipam::status(c),
            Command::Gc => ipam::gc(c).map(|_| ()),
            Command::Add | Command::Version => unreachable!("Ipam::call({cmd:?})"),
        }
    }
}

fn connect(conf: &NetConf) -> Result<Client, PluginError> {
    Client::connect_with_timeout(&conf.nic_socket, conf.nic_timeout).map_err(nic_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(cmd: &str) -> Env {
        Env {
            command: Some(cmd.into()),
            container_id: Some("c1".into()),
            netns: Some("/run/netns/does-not-exist-here".into()),
            ifname: Some("eth0".into()),
            path: None,
            args: None,
        }
    }

    const CONF: &str = r#"{"cniVersion":"1.1.0","name":"n","type":"burstvm-cni","pf":"pf0","nicSocket":"/nonexistent/nic.sock"}"#;

    /// Up to `MAX_STDIN` bytes are read; one more is refused, and no more
    /// than that is ever read from the caller.
    #[test]
    fn stdin_is_bounded() {
        let exact = vec![b' '; MAX_STDIN];
        assert_eq!(read_stdin(&exact[..]).unwrap().len(), MAX_STDIN);
        let mut endless = std::io::repeat(b' ');
        let e = read_stdin(&mut endless).unwrap_err();
        assert_eq!(e.code, code::DECODE_FAILURE, "{e}");
        assert!(e.details.contains(&MAX_STDIN.to_string()), "{e}");
    }

    #[test]
    fn version_answers_with_the_asked_version() {
        let v = run(&env("VERSION"), br#"{"cniVersion":"0.4.0"}"#)
            .unwrap()
            .unwrap();
        assert_eq!(v["cniVersion"], "0.4.0");
        assert_eq!(
            v["supportedVersions"].as_array().unwrap().len(),
            SUPPORTED.len()
        );
        assert_eq!(
            run(&env("VERSION"), b"{nope").unwrap_err().code,
            code::DECODE_FAILURE
        );
    }

    #[test]
    fn add_checks_env_before_touching_anything() {
        let mut e = env("ADD");
        e.container_id = None;
        assert_eq!(
            run(&e, CONF.as_bytes()).unwrap_err().code,
            code::INVALID_ENV
        );
        // A netns that does not exist: invalid CNI_NETNS, the NIC is never asked.
        let err = run(&env("ADD"), CONF.as_bytes()).unwrap_err();
        assert_eq!(err.code, code::INVALID_ENV);
        assert!(err.msg.contains("CNI_NETNS"), "{err}");
        // IPAM configured but no CNI_PATH.
        let with_ipam = CONF.replace(
            r#""pf":"pf0""#,
            r#""pf":"pf0","ipam":{"type":"host-local"}"#,
        );
        let err = run(&env("ADD"), with_ipam.as_bytes()).unwrap_err();
        assert!(
            err.code == code::INVALID_ENV && err.msg.contains("CNI_PATH"),
            "{err}"
        );
    }

    #[test]
    fn version_gated_commands() {
        let old = CONF.replace("1.1.0", "0.3.1");
        assert_eq!(
            run(&env("CHECK"), old.as_bytes()).unwrap_err().code,
            code::INCOMPATIBLE_VERSION
        );
        let v10 = CONF.replace("1.1.0", "1.0.0");
        assert_eq!(
            run(&env("STATUS"), v10.as_bytes()).unwrap_err().code,
            code::INCOMPATIBLE_VERSION
        );
        assert_eq!(
            run(&env("GC"), v10.as_bytes()).unwrap_err().code,
            code::INCOMPATIBLE_VERSION
        );
    }

    #[test]
    fn unreachable_nic_maps_to_try_again_and_status_50() {
        // DEL with a gone netns and no NIC: the NIC failure is reported (the runtime retries).
        let e = run(&env("DEL"), CONF.as_bytes()).unwrap_err();
        assert_eq!(e.code, code::TRY_AGAIN_LATER);
        assert!(e.details.contains("/nonexistent/nic.sock"), "{e}");
        assert_eq!(
            run(&env("STATUS"), CONF.as_bytes()).unwrap_err().code,
            code::NOT_AVAILABLE
        );
        assert_eq!(
            run(&env("GC"), CONF.as_bytes()).unwrap_err().code,
            code::TRY_AGAIN_LATER
        );
    }

    #[test]
    fn failures_keep_their_typed_cause() {
        // The NIC client's error is the source, not only the details text.
        let e = run(&env("STATUS"), CONF.as_bytes()).unwrap_err();
        let cause = std::error::Error::source(&e).expect("a cause");
        assert!(cause.downcast_ref::<ClientError>().is_some(), "{cause:?}");
        assert_eq!(e.details, cause.to_string());
        // A JSON input that does not parse keeps serde's error.
        let e = run(&env("ADD"), b"{").unwrap_err();
        assert_eq!(e.code, code::DECODE_FAILURE);
        let cause = std::error::Error::source(&e).expect("a cause");
        assert!(cause.downcast_ref::<serde_json::Error>().is_some());
    }

    #[test]
    fn nic_refusals_map_to_spec_codes() {
        let refused = |c| ClientError::Refused {
            path: "/s".into(),
            code: Some(c),
            error: "x".into(),
        };
        assert_eq!(
            nic_error(refused(ErrorCode::NoFreeVf)).code,
            code::TRY_AGAIN_LATER
        );
        assert_eq!(
            nic_error(refused(ErrorCode::UnknownPf)).code,
            code::INVALID_CONFIG
        );
        assert_eq!(
            nic_error(refused(ErrorCode::AlreadyAssigned)).code,
            code::VF_CONFLICT
        );
        assert_eq!(
            nic_error(refused(ErrorCode::Busy)).code,
            code::TRY_AGAIN_LATER
        );
        let io = ClientError::Io {
            path: "/s".into(),
            source: std::io::ErrorKind::PermissionDenied.into(),
        };
        assert_eq!(nic_error(io).code, code::IO_FAILURE);
        // The daemon died mid-call: retry (DEL must reach the restarted daemon).
        let lost = ClientError::Lost {
            path: "/run/x/nic.sock".into(),
            source: std::io::ErrorKind::ConnectionReset.into(),
        };
        let e = nic_error(lost);
        assert_eq!(e.code, code::TRY_AGAIN_LATER);
        assert!(e.details.contains("/run/x/nic.sock"), "{e}");
        assert_eq!(
            nic_error(ClientError::Closed { path: "/s".into() }).code,
            code::TRY_AGAIN_LATER
        );
        let timeout = ClientError::Timeout {
            path: "/run/x/nic.sock".into(),
            what: "response",
            after: std::time::Duration::from_secs(1),
        };
        let e = nic_error(timeout);
        assert_eq!(e.code, code::TRY_AGAIN_LATER);
        assert!(e.details.contains("/run/x/nic.sock"), "{e}");
        let unavailable = ClientError::Unavailable {
            path: "/s".into(),
            source: std::io::ErrorKind::ConnectionRefused.into(),
        };
        assert_eq!(nic_error(unavailable).code, code::TRY_AGAIN_LATER);
    }
}
