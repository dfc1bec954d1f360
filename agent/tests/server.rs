//! The agent's server on the host, driven by agent-proto's client: a fake
//! VMM speaks Firecracker's hybrid vsock handshake on a Unix socket and hands
//! each connection to the agent's control or stdio handler, so the client's
//! `connect_uds` path is the one the runtime uses.
//!
//! Every agent in this binary shares the process's reaper: no test here
//! waits for a child of its own.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use agent::{Agent, AgentConfig, PowerOff, PowerOffReason};
use agent_proto::{
    read_frame, write_frame, Client, ClientError, CreateProcess, Endpoint, ErrorCode, Exit,
    HelloReply, Process, ProcessState, Request, Response, StreamKind, User,
};

const T: Duration = Duration::from_secs(10);

/// An error with its sources, as `{:#}` would print it.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s += &format!(": {c}");
        cur = c.source();
    }
    s
}

struct Harness {
    agent: Arc<Agent>,
    vsock: PathBuf,
    dir: PathBuf,
    _tmp: tempfile::TempDir,
}

/// A fresh directory, removed with the returned guard.
fn dir_for(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("agent-test-{name}-"))
        .tempdir()
        .unwrap()
}

fn config() -> AgentConfig {
    AgentConfig {
        ptmx: "/dev/ptmx".into(),
        ..AgentConfig::default()
    }
}

/// Reads the `CONNECT <port>\n` line byte by byte.
fn read_connect(s: &mut UnixStream) -> Option<u32> {
    let mut line = Vec::new();
    let mut b = [0u8];
    while s.read(&mut b).ok()? == 1 && b[0] != b'\n' {
        line.push(b[0]);
    }
    String::from_utf8(line)
        .ok()?
        .strip_prefix("CONNECT ")?
        .parse()
        .ok()
}

fn harness_with(name: &str, cfg: AgentConfig) -> Harness {
    let tmp = dir_for(name);
    let dir = tmp.path().to_path_buf();
    let vsock = dir.join("vsock.sock");
    let agent = Agent::new(cfg);
    let l = UnixListener::bind(&vsock).unwrap();
    let a = Arc::clone(&agent);
    thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let a = Arc::clone(&a);
            thread::spawn(move || match read_connect(&mut s) {
                Some(1024) => {
                    s.write_all(b"OK 1073741824\n").unwrap();
                    a.handle_control(s)
                }
                Some(1025) => {
                    s.write_all(b"OK 1073741825\n").unwrap();
                    a.handle_stdio(s)
                }
                _ => {}
            });
        }
    });
    Harness {
        agent,
        vsock,
        dir,
        _tmp: tmp,
    }
}

fn harness(name: &str) -> Harness {
    harness_with(name, config())
}

impl Harness {
    fn client(&self) -> Client {
        Client::connect_uds(&self.vsock, 1024, T).unwrap()
    }
}

fn sh(script: &str) -> Process {
    let mut p = Process::from_args(["sh", "-c", script]);
    p.env = vec!["PATH=/usr/local/bin:/usr/bin:/bin".into()];
    p
}

fn read_all(mut s: UnixStream) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut v = Vec::new();
        s.read_to_end(&mut v).unwrap();
        v
    })
}

/// Runs `req` with its stdout and stderr attached, `input` (if any) on
/// stdin; returns stdout, stderr and the exit.
fn run(c: &mut Client, req: CreateProcess, input: Option<Vec<u8>>) -> (String, String, Exit) {
    let id = req.id.clone();
    c.create_process(&req).unwrap();
    let writer = input.map(|data| {
        let mut s = c.attach_stream(&id, StreamKind::Stdin).unwrap();
        thread::spawn(move || {
            s.write_all(&data).unwrap();
            s.shutdown(Shutdown::Write).unwrap();
        })
    });
    let out = read_all(c.attach_stream(&id, StreamKind::Stdout).unwrap());
    let err = read_all(c.attach_stream(&id, StreamKind::Stderr).unwrap());
    c.start_process(&id).unwrap();
    let exit = c.wait_process(&id, Some(T)).unwrap();
    if let Some(w) = writer {
        w.join().unwrap();
    }
    let s = |v: Vec<u8>| String::from_utf8(v).unwrap();
    (s(out.join().unwrap()), s(err.join().unwrap()), exit)
}

fn quiet(id: &str, p: Process) -> CreateProcess {
    CreateProcess {
        stdout: false,
        stderr: false,
        ..CreateProcess::new(id, p)
    }
}

#[test]
fn echo_via_stdout_and_stderr() {
    let h = harness("echo");
    let mut c = h.client();
    assert_eq!(c.agent().version, agent_proto::PROTOCOL_VERSION);
    let (out, err, exit) = run(
        &mut c,
        CreateProcess::new("e", sh("echo hello; echo oops >&2")),
        None,
    );
    assert_eq!((out.as_str(), err.as_str()), ("hello\n", "oops\n"));
    assert_eq!(exit, Exit::code(0));
}

#[test]
fn exit_status_3() {
    let h = harness("exit3");
    let mut c = h.client();
    c.create_process(&quiet("x", sh("exit 3"))).unwrap();
    let pid = c.start_process("x").unwrap();
    assert!(pid > 0);
    assert_eq!(c.wait_process("x", Some(T)).unwrap(), Exit::code(3));
    // Waiting again gives the same status.
    assert_eq!(c.wait_process("x", Some(T)).unwrap().status, 3);
    let list = c.list_processes().unwrap();
    assert_eq!(list[0].state, ProcessState::Exited);
    assert_eq!(list[0].exit, Some(Exit::code(3)));
}

#[test]
fn sigkill_is_137() {
    let h = harness("kill");
    let mut c = h.client();
    c.create_process(&quiet("s", Process::from_args(["/bin/sleep", "100"])))
        .unwrap();
    c.start_process("s").unwrap();
    let t0 = Instant::now();
    c.signal_process("s", 9).unwrap();
    let exit = c.wait_process("s", Some(T)).unwrap();
    assert_eq!(exit, Exit::signaled(9));
    assert_eq!(exit.status, 137);
    assert!(t0.elapsed() < Duration::from_secs(5));
    let e = c.signal_process("s", 9).unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::State), "{e}");
    let e = c.signal_process("nope", 9).unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::NotFound), "{e}");
    assert!(chain(&e).contains("SignalProcess"), "{e}");
}

#[test]
fn env_and_cwd_are_honoured() {
    let h = harness("env");
    let mut c = h.client();
    let cwd = h.dir.join("work dir");
    std::fs::create_dir_all(&cwd).unwrap();
    let mut p = Process::from_args(["env"]);
    p.env = vec![
        "FOO=bar baz".into(),
        "PATH=/usr/bin:/bin".into(),
        "EMPTY=".into(),
    ];
    p.cwd = cwd.to_str().unwrap().into();
    let (out, _, exit) = run(&mut c, CreateProcess::new("env", p), None);
    assert_eq!(exit.status, 0);
    let mut lines: Vec<&str> = out.lines().collect();
    lines.sort();
    assert_eq!(lines, ["EMPTY=", "FOO=bar baz", "PATH=/usr/bin:/bin"]);

    let mut p = Process::from_args(["/bin/pwd"]);
    p.cwd = cwd.to_str().unwrap().into();
    let (out, _, _) = run(&mut c, CreateProcess::new("pwd", p), None);
    assert_eq!(out.trim_end(), cwd.to_str().unwrap());

    let mut p = Process::from_args(["/bin/pwd"]);
    p.cwd = "/nonexistent-dir".into();
    c.create_process(&quiet("bad-cwd", p)).unwrap();
    let e = c.start_process("bad-cwd").unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::Spawn), "{e}");
    assert!(chain(&e).contains("nonexistent-dir"), "{e}");
}

#[test]
fn user_switch() {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipped: not root");
        return;
    }
    let h = harness("uid");
    let mut c = h.client();
    let mut p = sh("id -u; id -g; id -G; umask");
    p.user = User {
        uid: 65534,
        gid: 65533,
        additional_gids: vec![100, 200],
        umask: Some(0o027),
    };
    let (out, err, exit) = run(&mut c, CreateProcess::new("u", p), None);
    assert_eq!(exit.status, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "65534");
    assert_eq!(lines[1], "65533");
    let mut groups: Vec<&str> = lines[2].split_whitespace().collect();
    groups.sort();
    assert_eq!(groups, ["100", "200", "65533"]);
    assert_eq!(lines[3], "0027");

    // Root keeps no supplementary group it did not ask for.
    let (out, _, _) = run(&mut c, CreateProcess::new("root", sh("id -G")), None);
    assert_eq!(out.trim(), "0");
}

#[test]
fn stdin_one_mib_through_cat_byte_exact() {
    let h = harness("stdin");
    let mut c = h.client();
    let data: Vec<u8> = (0..(1u32 << 20))
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let req = CreateProcess {
        stdin: true,
        ..CreateProcess::new("cat", Process::from_args(["/bin/cat"]))
    };
    let (out, _, exit) = {
        // Bytes, not text: run() would decode.
        let id = "cat";
        c.create_process(&req).unwrap();
        let mut sin = c.attach_stream(id, StreamKind::Stdin).unwrap();
        let out = read_all(c.attach_stream(id, StreamKind::Stdout).unwrap());
        let err = read_all(c.attach_stream(id, StreamKind::Stderr).unwrap());
        c.start_process(id).unwrap();
        let d = data.clone();
        let w = thread::spawn(move || {
            sin.write_all(&d).unwrap();
            sin.shutdown(Shutdown::Write).unwrap();
        });
        let exit = c.wait_process(id, Some(T)).unwrap();
        w.join().unwrap();
        (out.join().unwrap(), err.join().unwrap(), exit)
    };
    assert_eq!(exit.status, 0);
    assert_eq!(out.len(), data.len());
    assert!(out == data, "bytes differ");
}

#[test]
fn undeclared_stdin_is_dev_null() {
    let h = harness("nostdin");
    let mut c = h.client();
    let (out, _, exit) = run(&mut c, CreateProcess::new("c", sh("wc -c")), None);
    assert_eq!((out.trim(), exit.status), ("0", 0));
}

#[test]
fn second_process_while_the_first_sleeps() {
    let h = harness("two");
    let mut c = h.client();
    c.create_process(&CreateProcess {
        main: true,
        ..quiet("main", Process::from_args(["/bin/sleep", "30"]))
    })
    .unwrap();
    c.start_process("main").unwrap();
    // A second main is refused.
    let e = c
        .create_process(&CreateProcess {
            main: true,
            ..quiet("main2", Process::from_args(["true"]))
        })
        .unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::Exists));
    // Exec: another process, another control connection waiting on it.
    let mut c2 = h.client();
    let (out, _, exit) = run(
        &mut c2,
        CreateProcess::new("exec", sh("echo from exec")),
        None,
    );
    assert_eq!((out.as_str(), exit.status), ("from exec\n", 0));
    let list = c.list_processes().unwrap();
    let main = list.iter().find(|p| p.id == "main").unwrap();
    assert_eq!(main.state, ProcessState::Running);
    assert!(main.main);
    // Stats see the sleeper.
    let stats = c.stats().unwrap();
    assert!(stats.mem_total_kib > 0 && stats.mem_available_kib > 0);
    let s = stats.processes.iter().find(|p| p.id == "main").unwrap();
    assert_eq!(Some(s.pid), main.pid);
    assert!(s.rss_kib > 0);
    c.signal_process("main", 15).unwrap();
    assert_eq!(c.wait_process("main", Some(T)).unwrap(), Exit::signaled(15));
}

/// Reads from `s` until `pred` holds for everything read so far.
fn read_until(s: &mut UnixStream, acc: &mut Vec<u8>, pred: impl Fn(&str) -> bool) {
    s.set_read_timeout(Some(T)).unwrap();
    let mut buf = [0u8; 4096];
    while !pred(&String::from_utf8_lossy(acc)) {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "EOF; got {:?}", String::from_utf8_lossy(acc));
        acc.extend_from_slice(&buf[..n]);
    }
}

#[test]
fn terminal_process_sees_a_tty_and_resizes() {
    let h = harness("tty");
    let mut c = h.client();
    let mut p = sh("tty; test -t 0 && echo istty; stty size; read x; stty size; exit 4");
    p.terminal = true;
    p.console_size = Some(agent_proto::ConsoleSize {
        height: 24,
        width: 80,
    });
    let req = CreateProcess {
        stdin: true,
        ..CreateProcess::new("t", p)
    };
    c.create_process(&req).unwrap();
    // Streams other than pty are not declared by a terminal process.
    let e = c.attach_stream("t", StreamKind::Stdout).unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::State), "{e}");
    let mut pty = c.attach_stream("t", StreamKind::Pty).unwrap();
    c.start_process("t").unwrap();
    let mut acc = Vec::new();
    read_until(&mut pty, &mut acc, |s| s.contains("24 80"));
    let text = String::from_utf8_lossy(&acc).to_string();
    assert!(text.contains("/dev/pts/"), "{text}");
    assert!(text.contains("istty"), "{text}");
    c.resize_pty("t", 50, 132).unwrap();
    pty.write_all(b"go\n").unwrap();
    read_until(&mut pty, &mut acc, |s| s.contains("50 132"));
    // EOF once the process (the slave's last holder) is gone.
    let mut rest = Vec::new();
    pty.read_to_end(&mut rest).unwrap();
    assert_eq!(c.wait_process("t", Some(T)).unwrap().status, 4);
    let e = c.resize_pty("nope", 1, 1).unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::NotFound));
}

#[test]
fn resize_of_a_non_terminal_is_refused() {
    let h = harness("noresize");
    let mut c = h.client();
    c.create_process(&quiet("q", Process::from_args(["true"])))
        .unwrap();
    let e = c.resize_pty("q", 10, 10).unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::State));
}

#[test]
fn a_flood_of_stdout_does_not_stall_another_connection() {
    let h = harness("flood");
    let mut c = h.client();
    let req = CreateProcess::new("yes", Process::from_args(["/usr/bin/yes", "flood"]));
    c.create_process(&req).unwrap();
    // Attached and never read.
    let _out = c.attach_stream("yes", StreamKind::Stdout).unwrap();
    let _err = c.attach_stream("yes", StreamKind::Stderr).unwrap();
    c.start_process("yes").unwrap();
    thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    let mut c2 = Client::connect_uds(&h.vsock, 1024, Duration::from_secs(2)).unwrap();
    c2.hello().unwrap();
    let (out, _, exit) = run(&mut c2, CreateProcess::new("echo", sh("echo ok")), None);
    assert_eq!((out.as_str(), exit.status), ("ok\n", 0));
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    // And the first connection still answers.
    c.list_processes().unwrap();
    c.signal_process("yes", 9).unwrap();
    assert_eq!(c.wait_process("yes", Some(T)).unwrap().status, 137);
}

fn raw(h: &Harness) -> UnixStream {
    Endpoint::Hybrid {
        path: h.vsock.clone(),
        port: 1024,
    }
    .connect(T)
    .unwrap()
}

fn send_raw(s: &mut UnixStream, body: &[u8]) {
    let mut buf = (body.len() as u32).to_be_bytes().to_vec();
    buf.extend_from_slice(body);
    s.write_all(&buf).unwrap();
}

fn error_code(s: &mut UnixStream) -> ErrorCode {
    match read_frame::<Response<serde_json::Value>>(s).unwrap() {
        Response::Error(e) => e.code,
        Response::Ok(v) => panic!("ok: {v}"),
    }
}

#[test]
fn bad_frames_get_errors_and_the_server_keeps_serving() {
    let h = harness("garbage");
    let mut s = raw(&h);
    // Before Hello.
    write_frame(&mut s, &Request::ListProcesses).unwrap();
    assert_eq!(error_code(&mut s), ErrorCode::HelloRequired);
    // Wrong version.
    write_frame(&mut s, &Request::Hello { version: 99 }).unwrap();
    assert_eq!(error_code(&mut s), ErrorCode::VersionMismatch);
    write_frame(&mut s, &Request::Hello { version: 1 }).unwrap();
    let r: Response<HelloReply> = read_frame(&mut s).unwrap();
    assert!(matches!(r, Response::Ok(HelloReply { version: 1, .. })));
    // Garbage and unknown requests: errors, the connection goes on.
    send_raw(&mut s, b"{not json");
    assert_eq!(error_code(&mut s), ErrorCode::BadRequest);
    send_raw(&mut s, br#"{"op":"Reboot"}"#);
    assert_eq!(error_code(&mut s), ErrorCode::BadRequest);
    send_raw(&mut s, br#"{"op":"StartProcess"}"#);
    assert_eq!(error_code(&mut s), ErrorCode::BadRequest);
    write_frame(&mut s, &Request::ListProcesses).unwrap();
    let r: Response<serde_json::Value> = read_frame(&mut s).unwrap();
    assert!(matches!(r, Response::Ok(_)));
    // Over the limit: an error, then the agent closes this connection.
    s.write_all(&(2u32 << 20).to_be_bytes()).unwrap();
    s.write_all(b"{\"op\":").unwrap();
    assert_eq!(error_code(&mut s), ErrorCode::FrameTooLarge);
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
    // Others are served.
    let mut c = h.client();
    c.list_processes().unwrap();

    // The stdio port too.
    let mut st = Endpoint::Hybrid {
        path: h.vsock.clone(),
        port: 1025,
    }
    .connect(T)
    .unwrap();
    send_raw(&mut st, b"[]");
    assert_eq!(error_code(&mut st), ErrorCode::BadRequest);
}

#[test]
fn start_waits_for_declared_streams() {
    let h = harness_with(
        "streams",
        AgentConfig {
            stream_wait: Duration::from_millis(300),
            ..config()
        },
    );
    let mut c = h.client();
    let req = CreateProcess {
        stdin: true,
        ..CreateProcess::new("p", Process::from_args(["/bin/cat"]))
    };
    c.create_process(&req).unwrap();
    let e = c.create_process(&req).unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::Exists));
    let out = c.attach_stream("p", StreamKind::Stdout).unwrap();
    let e = c.attach_stream("p", StreamKind::Stdout).unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::Exists), "{e}");
    let e = c.attach_stream("p", StreamKind::Pty).unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::State), "{e}");
    let e = c.attach_stream("zzz", StreamKind::Stdout).unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::NotFound), "{e}");
    // stdin and stderr missing: refused after the wait.
    let e = c.start_process("p").unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::StreamsMissing), "{e}");
    assert!(chain(&e).contains("stdin, stderr"), "{e}");
    // Attached while StartProcess waits: it starts.
    let vsock = h.vsock.clone();
    let late = thread::spawn(move || {
        thread::sleep(Duration::from_millis(100));
        let c = Client::connect_uds(&vsock, 1024, T).unwrap();
        let mut sin = c.attach_stream("p", StreamKind::Stdin).unwrap();
        let err = c.attach_stream("p", StreamKind::Stderr).unwrap();
        sin.write_all(b"late\n").unwrap();
        sin.shutdown(Shutdown::Write).unwrap();
        err
    });
    let out = read_all(out);
    c.start_process("p").unwrap();
    let _err = late.join().unwrap();
    assert_eq!(c.wait_process("p", Some(T)).unwrap().status, 0);
    assert_eq!(out.join().unwrap(), b"late\n");
    // Started: no more attaching, no second start.
    let e = c.attach_stream("p", StreamKind::Stdin).unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::State), "{e}");
    let e = c.start_process("p").unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::State), "{e}");
}

#[test]
fn exec_failures() {
    let h = harness("execfail");
    let mut c = h.client();
    c.create_process(&quiet("nf", Process::from_args(["no-such-program-xyz"])))
        .unwrap();
    let e = c.start_process("nf").unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::Spawn), "{e}");
    assert!(chain(&e).contains("no-such-program-xyz"), "{e}");
    // It never ran: waiters see 127.
    assert_eq!(c.wait_process("nf", Some(T)).unwrap().status, 127);
    let e = c
        .create_process(&quiet("inv", Process::from_args(Vec::<String>::new())))
        .unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::Invalid), "{e}");
    // Over the wire error type: typed source.
    let ClientError::Agent { source, .. } = e else {
        panic!()
    };
    assert!(source.message.contains("no args"));
}

#[test]
fn rlimits_and_no_new_privileges() {
    let h = harness("rlimits");
    let mut c = h.client();
    let mut p = sh("ulimit -n; grep NoNewPrivs /proc/self/status");
    p.rlimits = vec![agent_proto::Rlimit {
        kind: "RLIMIT_NOFILE".into(),
        hard: 200,
        soft: 100,
    }];
    p.no_new_privileges = true;
    let (out, err, exit) = run(&mut c, CreateProcess::new("r", p), None);
    assert_eq!(exit.status, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "100");
    assert!(lines[1].ends_with("\t1"), "{out}");
}

/// Runs `wait_power_off` on a thread; the receiver gets its answer.
fn power_off_waiter(agent: &Arc<Agent>) -> mpsc::Receiver<PowerOff> {
    let (tx, rx) = mpsc::channel();
    let a = Arc::clone(agent);
    thread::spawn(move || {
        let _ = tx.send(a.wait_power_off());
    });
    rx
}

#[test]
fn power_off_after_main_exit_and_last_connection() {
    let h = harness("poweroff");
    let rx = power_off_waiter(&h.agent);
    let mut c = h.client();
    c.create_process(&CreateProcess {
        main: true,
        ..quiet("m", sh("exit 7"))
    })
    .unwrap();
    c.start_process("m").unwrap();
    assert_eq!(c.wait_process("m", Some(T)).unwrap().status, 7);
    // A connection is still open: no power-off yet.
    assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
    drop(c);
    let off = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(
        off,
        PowerOff {
            reason: PowerOffReason::MainExited,
            status: 7
        }
    );
}

#[test]
fn power_off_on_shutdown_and_after_the_grace_period() {
    let h = harness_with(
        "shutdown",
        AgentConfig {
            exit_grace: Duration::from_millis(500),
            ..config()
        },
    );
    let rx = power_off_waiter(&h.agent);
    let mut c = h.client();
    c.create_process(&CreateProcess {
        main: true,
        ..quiet("m", Process::from_args(["/bin/sleep", "30"]))
    })
    .unwrap();
    c.start_process("m").unwrap();
    c.shutdown().unwrap();
    let off = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    // The main still ran: the power-off kills it.
    assert_eq!(
        off,
        PowerOff {
            reason: PowerOffReason::Shutdown,
            status: 137
        }
    );
    c.signal_process("m", 9).unwrap();
    c.wait_process("m", Some(T)).unwrap();

    // Main exited, the host keeps its connection open: the grace period ends it.
    let h = harness_with(
        "grace",
        AgentConfig {
            exit_grace: Duration::from_millis(500),
            ..config()
        },
    );
    let rx = power_off_waiter(&h.agent);
    let mut c = h.client();
    c.create_process(&CreateProcess {
        main: true,
        ..quiet("m", sh("exit 2"))
    })
    .unwrap();
    c.start_process("m").unwrap();
    let off = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(
        off,
        PowerOff {
            reason: PowerOffReason::Grace,
            status: 2
        }
    );
    drop(c);
}

#[test]
fn pod_mode_stays_up_until_shutdown() {
    let h = harness_with(
        "pod",
        AgentConfig {
            pod: true,
            exit_grace: Duration::from_millis(100),
            ..config()
        },
    );
    let rx = power_off_waiter(&h.agent);
    let mut c = h.client();
    c.create_process(&CreateProcess {
        main: true,
        ..quiet("m", sh("exit 0"))
    })
    .unwrap();
    c.start_process("m").unwrap();
    c.wait_process("m", Some(T)).unwrap();
    drop(c);
    assert!(rx.recv_timeout(Duration::from_millis(500)).is_err());
    h.client().shutdown().unwrap();
    let off = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(off.reason, PowerOffReason::Shutdown);
    assert_eq!(off.status, 0);
}

#[test]
fn orphans_are_reaped() {
    // The test process stands in for PID 1: orphans come to it.
    nix::sys::prctl::set_child_subreaper(true).unwrap();
    let h = harness("orphans");
    let mut c = h.client();
    let (out, _, exit) = run(
        &mut c,
        CreateProcess::new("o", sh("sleep 0.2 >/dev/null 2>&1 & echo $!")),
        None,
    );
    assert_eq!(exit.status, 0);
    let pid: i32 = out.trim().parse().unwrap();
    let gone = Instant::now() + T;
    while Path::new(&format!("/proc/{pid}")).exists() {
        assert!(Instant::now() < gone, "orphan {pid} not reaped");
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn plain_unix_listeners() {
    let tmp = dir_for("unix");
    let dir = tmp.path();
    let (control, stdio) = (dir.join("control.sock"), dir.join("stdio.sock"));
    let agent = Agent::new(config());
    agent.serve_control(UnixListener::bind(&control).unwrap());
    agent.serve_stdio(UnixListener::bind(&stdio).unwrap());
    let mut c = Client::connect(
        &Endpoint::Unix(control.clone()),
        Some(Endpoint::Unix(stdio)),
        T,
    )
    .unwrap();
    let (out, _, exit) = run(&mut c, CreateProcess::new("u", sh("echo plain")), None);
    assert_eq!((out.as_str(), exit.status), ("plain\n", 0));
    // connect_stream: any stream, no stdio endpoint unless given.
    let c2 = Client::connect_stream(UnixStream::connect(&control).unwrap(), T).unwrap();
    let e = c2.attach_stream("u", StreamKind::Stdout).unwrap_err();
    assert!(matches!(e, ClientError::NoStdioEndpoint { .. }), "{e}");
}

/// Container roots in a directory: a "mount" copies the static busybox into
/// `<dir>/<id>` with a marker naming the disk; an unmount removes it.
struct DirRoots {
    dir: PathBuf,
    unmounted: std::sync::Mutex<Vec<String>>,
}

impl agent::pod::ContainerRoots for DirRoots {
    fn mount(&self, id: &str, disk: &str) -> Result<PathBuf, agent_proto::AgentError> {
        let root = self.dir.join(id);
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
        std::os::unix::fs::symlink("busybox", root.join("bin/sh")).unwrap();
        for tool in ["sleep", "cat"] {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(tool)).unwrap();
        }
        std::fs::write(root.join("marker"), format!("root of {id} from {disk}")).unwrap();
        Ok(root)
    }

    fn unmount(&self, id: &str, root: &Path) -> Result<(), agent_proto::AgentError> {
        std::fs::remove_dir_all(root).unwrap();
        self.unmounted.lock().unwrap().push(id.to_string());
        Ok(())
    }
}

/// A pod's containers: each process runs chrooted in its container's root
/// (it reads that root's marker, not another's); an unknown container is
/// refused; unmounting kills what still runs there and forgets the root.
#[test]
fn pod_containers_run_in_their_own_roots() {
    let tmp = dir_for("roots");
    let dir = tmp.path();
    let roots = Arc::new(DirRoots {
        dir: dir.join("roots"),
        unmounted: Default::default(),
    });
    let h = harness_with(
        "pod-containers",
        AgentConfig {
            pod: true,
            containers: Some(agent::pod::Roots(roots.clone())),
            ..config()
        },
    );
    let mut c = h.client();
    let e = c
        .create_process(&CreateProcess {
            container: Some("c1".into()),
            ..CreateProcess::new("p0", sh("true"))
        })
        .unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::NotFound), "{e}");
    c.mount_container("c1", "slot0").unwrap();
    c.mount_container("c2", "slot1").unwrap();
    let e = c.mount_container("c1", "slot2").unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::Exists), "{e}");
    let e = c.mount_container("../x", "slot2").unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::Invalid), "{e}");
    for (id, disk) in [("c1", "slot0"), ("c2", "slot1")] {
        let req = CreateProcess {
            container: Some(id.into()),
            ..CreateProcess::new(format!("cat-{id}"), sh("cat /marker"))
        };
        let (out, err, exit) = run(&mut c, req, None);
        assert_eq!(out, format!("root of {id} from {disk}"), "{err}");
        assert_eq!(exit.status, 0);
    }
    let sleeper = CreateProcess {
        container: Some("c1".into()),
        stdout: false,
        stderr: false,
        ..CreateProcess::new("sleeper", sh("exec sleep 1000"))
    };
    c.create_process(&sleeper).unwrap();
    c.start_process("sleeper").unwrap();
    c.unmount_container("c1").unwrap();
    let exit = c.wait_process("sleeper", None).unwrap();
    assert_eq!(exit.signal, Some(libc::SIGKILL));
    assert_eq!(*roots.unmounted.lock().unwrap(), vec!["c1".to_string()]);
    assert!(!dir.join("roots/c1").exists() && dir.join("roots/c2/marker").exists());
    let e = c.unmount_container("c1").unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::NotFound), "{e}");
    drop(h);
}

/// Outside a pod (no container roots) MountContainer is refused.
#[test]
fn containers_need_a_pod() {
    let h = harness("no-pod-containers");
    let e = h.client().mount_container("c1", "slot0").unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::Invalid), "{e}");
}
