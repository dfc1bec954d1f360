use super::*;
use std::ffi::OsStr;
use std::os::unix::process::CommandExt;

/// A request's CNI_* variables.
type Vars<'a> = &'a [(&'a str, &'a str)];

const CONF: &str = r#"{"cniVersion":"0.4.0","name":"n","type":"burstvm-cni","pf":"pf0","nicSocket":"/nonexistent/nic.sock"}"#;

fn request(vars: &[(&str, &str)], config: &[u8]) -> Vec<u8> {
    let vars: Vec<_> = vars.iter().map(|(k, v)| (*k, OsStr::new(v))).collect();
    encode_request(&vars, config).unwrap()
}

/// (lost-server error result, then the outcome), as the forwarder reads them.
fn ask(sock: &Path, req: &[u8]) -> io::Result<(Vec<u8>, plugin::Outcome)> {
    let mut s = UnixStream::connect(sock)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(req)?;
    let lost = client::frame(&mut s, "lost", usize::MAX)?;
    Ok((lost, client::outcome(&mut s)?))
}

fn server() -> (tempfile::TempDir, CniServer) {
    let d = tempfile::tempdir().unwrap();
    let s = CniServer::start(&d.path().join("cni.sock")).unwrap();
    (d, s)
}

/// A served command answers what the exec'd plugin would print, byte for
/// byte, after the error result a lost server leaves (in the config's version).
#[test]
fn a_served_command_is_the_plugins_own_outcome() {
    let (_d, srv) = server();
    let exec = |vars: &[(&str, &str)], conf: &[u8]| {
        let env = Env::from_vars(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        plugin::outcome("burstvm-cni", plugin::run, &env, plugin::read_stdin(conf))
    };
    let cases: [(Vars, &[u8]); 4] = [
        (&[("CNI_COMMAND", "VERSION")], CONF.as_bytes()),
        // ADD without a container id: INVALID_ENV, nothing asked of the NIC.
        (
            &[("CNI_COMMAND", "ADD"), ("CNI_IFNAME", "eth0")],
            CONF.as_bytes(),
        ),
        // DEL with no NIC daemon: TRY_AGAIN_LATER naming its socket.
        (
            &[
                ("CNI_COMMAND", "DEL"),
                ("CNI_CONTAINERID", "c1"),
                ("CNI_IFNAME", "eth0"),
            ],
            CONF.as_bytes(),
        ),
        (&[("CNI_COMMAND", "ADD")], b"{not json"),
    ];
    for (vars, conf) in cases {
        let (lost, served) = ask(srv.path(), &request(vars, conf)).unwrap();
        assert_eq!(served, exec(vars, conf), "{vars:?}");
        let lost: serde_json::Value = serde_json::from_slice(&lost).unwrap();
        assert_eq!(lost["code"], code::TRY_AGAIN_LATER);
        let version = if conf.starts_with(b"{\"") {
            "0.4.0"
        } else {
            "1.1.0"
        };
        assert_eq!(lost["cniVersion"], version, "{lost}");
    }
    let (_, del) = ask(srv.path(), &request(cases[2].0, CONF.as_bytes())).unwrap();
    assert_eq!(del.status, 1);
    assert!(String::from_utf8_lossy(&del.stdout).contains("/nonexistent/nic.sock"));
    assert!(String::from_utf8_lossy(&del.stderr).starts_with("burstvm-cni DEL: "));
}

/// A config above the plugin's bound is its DECODE_FAILURE; a request that
/// is not one (wrong magic, too many variable bytes, cut short) gets no
/// reply at all: nothing was run.
#[test]
fn bounds_and_garbage() {
    let (_d, srv) = server();
    let big = vec![b' '; MAX_STDIN + 1];
    let (_, o) = ask(srv.path(), &request(&[("CNI_COMMAND", "ADD")], &big)).unwrap();
    assert_eq!(o.status, 1);
    let e: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(e["code"], code::DECODE_FAILURE);
    let mut too_long = request(&[("CNI_COMMAND", "VERSION")], b"{}");
    too_long[4..8].copy_from_slice(&(MAX_ENV as u32 + 1).to_le_bytes());
    let mut wrong_magic = request(&[("CNI_COMMAND", "VERSION")], b"{}");
    wrong_magic[0] = b'X';
    let mut short = request(&[("CNI_COMMAND", "VERSION")], b"{}");
    short.truncate(short.len() - 1);
    for req in [too_long, wrong_magic, short] {
        let mut s = UnixStream::connect(srv.path()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s.write_all(&req).unwrap();
        // The cut-short request waits for its last byte until the server's timeout.
        s.shutdown(std::net::Shutdown::Write).unwrap();
        // Closed unread (a reset) or at the end: either way no byte came back.
        let mut got = Vec::new();
        match s.read_to_end(&mut got) {
            Ok(_) => assert!(got.is_empty(), "a reply to a bad request: {got:?}"),
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}"),
        }
    }
    // The server is still serving.
    let (_, o) = ask(srv.path(), &request(&[("CNI_COMMAND", "VERSION")], b"{}")).unwrap();
    assert_eq!(o.status, 0);
}

/// Dropping the server ends its workers (blocked in accept) and removes
/// the socket; the socket is its owner's alone.
#[test]
fn drop_stops_and_removes_the_socket() {
    let (_d, srv) = server();
    let path = srv.path().to_path_buf();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    drop(srv);
    assert!(!path.exists());
    assert!(UnixStream::connect(&path).is_err());
    // A server started on the path over a running one (a restarted daemon)
    // keeps its socket when the first is dropped.
    let first = CniServer::start(&path).unwrap();
    let second = CniServer::start(&path).unwrap();
    drop(first);
    let (_, o) = ask(
        second.path(),
        &request(&[("CNI_COMMAND", "VERSION")], b"{}"),
    )
    .unwrap();
    assert_eq!(o.status, 0);
}

const AS_OTHER_USER: &str = "BURSTVM_CNI_SERVER_TEST_SOCKET";

/// Another user is refused even when the socket's mode would let it in
/// (in a process of its own, this test binary again as uid 65534): no
/// reply, nothing run.
#[test]
fn another_user_is_refused() {
    if let Some(sock) = std::env::var_os(AS_OTHER_USER) {
        let mut s = UnixStream::connect(sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // The server may have closed already (the write then fails: EPIPE).
        let _ = s.write_all(&request(&[("CNI_COMMAND", "VERSION")], b"{}"));
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        assert!(got.is_empty(), "answered another user: {got:?}");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let srv = CniServer::start(&d.path().join("cni.sock")).unwrap();
    std::fs::set_permissions(srv.path(), std::fs::Permissions::from_mode(0o666)).unwrap();
    let st = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "server::tests::another_user_is_refused"])
        .env(AS_OTHER_USER, srv.path())
        .uid(65534)
        .gid(65534)
        .status()
        .unwrap();
    assert!(st.success(), "{st}");
}

const AT_NICE: &str = "BURSTVM_CNI_SERVER_TEST_NICE";

/// A served call runs at its caller's nice value, as an exec'd plugin
/// would (the delegated IPAM plugin, a script, records what it got), and
/// the worker goes back to its own after it.
#[test]
fn a_served_call_runs_at_its_callers_nice() {
    if let Some(args) = std::env::var_os(AT_NICE) {
        let args = args.into_string().unwrap();
        let (sock, path) = args.split_once('|').unwrap();
        let conf = r#"{"cniVersion":"1.1.0","name":"n","type":"burstvm-cni","pf":"pf0","nicSocket":"/nonexistent/nic.sock","ipam":{"type":"nicecheck"}}"#;
        let vars = [
            ("CNI_COMMAND", "DEL"),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", path),
        ];
        ask(Path::new(sock), &request(&vars, conf.as_bytes())).unwrap();
        return;
    }
    let (d, srv) = server();
    let script = d.path().join("nicecheck");
    std::fs::write(&script, "#!/bin/sh\nnice >> \"$(dirname \"$0\")/nice\"\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    for nice in [5, 0, 19] {
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "server::tests::a_served_call_runs_at_its_callers_nice",
        ])
        .env(
            AT_NICE,
            format!("{}|{}", srv.path().display(), d.path().display()),
        );
        // SAFETY: setpriority(2) is async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                libc::setpriority(libc::PRIO_PROCESS, 0, nice);
                Ok(())
            });
        }
        assert!(cmd.status().unwrap().success());
    }
    let got = std::fs::read_to_string(d.path().join("nice")).unwrap();
    assert_eq!(got.split_whitespace().collect::<Vec<_>>(), ["5", "0", "19"]);
}

/// `call` answers as the forwarder does: the plugin's outcome; exit status
/// 1 with the result sent ahead when the server goes away mid-call; and
/// `NotServed` (nothing done) when the server never had the call.
#[test]
fn call_answers_as_the_forwarder_does() {
    let (d, srv) = server();
    let vars = [
        ("CNI_COMMAND", OsStr::new("ADD")),
        ("CNI_IFNAME", OsStr::new("eth0")),
    ];
    let env = Env::from_vars(
        [("CNI_COMMAND", "ADD"), ("CNI_IFNAME", "eth0")].map(|(k, v)| (k.into(), v.into())),
    );
    let direct = plugin::outcome(
        "burstvm-cni",
        plugin::run,
        &env,
        plugin::read_stdin(CONF.as_bytes()),
    );
    assert_eq!(call(srv.path(), &vars, CONF.as_bytes()).unwrap(), direct);
    assert_eq!(direct.status, 1, "no container id: INVALID_ENV");

    let e = call(&d.path().join("none.sock"), &vars, b"{}").unwrap_err();
    assert_eq!(e.op, "connect");
    assert!(e.to_string().contains("none.sock"), "{e}");
    let e = call(srv.path(), &[("CNI_ARGS", OsStr::new("a\0b"))], b"{}").unwrap_err();
    assert_eq!(e.op, "encode the request");

    // Stand-ins: one takes the request and goes away after the result it
    // sends ahead, one before sending anything.
    for ahead in [true, false] {
        let sock = d.path().join(format!("stand-in-{ahead}.sock"));
        let l = UnixListener::bind(&sock).unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let (env, conf) = read_request(&mut s).unwrap();
            assert_eq!(env.command.as_deref(), Some("ADD"));
            assert_eq!(conf.unwrap(), CONF.as_bytes());
            if ahead {
                let mut r = Vec::new();
                put_frame(&mut r, b"{\"code\":11}\n");
                s.write_all(&r).unwrap();
            }
        });
        let got = call(&sock, &vars, CONF.as_bytes());
        t.join().unwrap();
        match (ahead, got) {
            (true, Ok(o)) => {
                assert_eq!(o.status, 1);
                assert_eq!(o.stdout, b"{\"code\":11}\n");
            }
            (false, Err(e)) => assert_eq!(e.op, "read the reply", "{e}"),
            (_, got) => panic!("sent ahead: {ahead}: {got:?}"),
        }
    }
}
