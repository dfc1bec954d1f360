//! `burstvm nic` as a process: control API errors, restart with persisted
//! assignments, SIGTERM cleanup, forwarding between VFs, a frontend process
//! killed with SIGKILL, and one daemon per directory. Frontends are nic's
//! test frontend (vhost crate Frontend, memfd memory, hand-written split
//! rings).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

// The nic crate's test helpers (frames, VF polling, a frontend in a child process).
use testutil::nic as nic_common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nic::frontend::{SimFrontend, MIN_MEM};
use nic_api::{Client, ErrorCode, Response, VfInfo, VfState};
use nic_common::{frame, hold_frontend_if_child, spawn_frontend_child};

const T: Duration = Duration::from_secs(10);

struct Daemon {
    child: Option<Child>,
    dir: PathBuf,
    control: PathBuf,
    args: Vec<String>,
}

impl Daemon {
    fn start(name: &str, extra: &[&str]) -> Daemon {
        let dir = testutil::fresh_dir("nic-d", name);
        let control = dir.join("ctl.sock");
        let mut args: Vec<String> = vec![
            "nic".into(),
            "--control".into(),
            control.display().to_string(),
            "--state-dir".into(),
            dir.display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut d = Daemon {
            child: None,
            dir,
            control,
            args,
        };
        d.spawn();
        d
    }

    fn spawn(&mut self) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_burstvm"))
            .args(&self.args)
            .spawn()
            .unwrap();
        nic_common::wait_control(&mut child, &self.control, T);
        self.child = Some(child);
    }

    fn client(&self) -> Client {
        Client::connect(&self.control).unwrap()
    }

    fn wait_vf(&self, sandbox: &str, what: &str, f: impl Fn(&VfInfo) -> bool) -> VfInfo {
        nic_common::wait_vf(&self.control, sandbox, what, f)
    }

    /// SIGTERM: exits 0 and leaves no socket behind.
    fn terminate(&mut self) {
        let mut child = self.child.take().unwrap();
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let st = child.wait().unwrap();
        assert!(st.success(), "burstvm nic exit status {st}");
        let socks: Vec<_> = std::fs::read_dir(&self.dir)
            .unwrap()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "sock"))
            .map(|e| e.path())
            .collect();
        assert!(socks.is_empty(), "sockets left behind: {socks:?}");
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn raw(c: &mut Client, line: &str) -> Response {
    serde_json::from_str(&c.call_raw(line).unwrap()).unwrap()
}

#[test]
fn nic_control_api_errors_and_restart_keeps_assignments() {
    let mut d = Daemon::start(
        "ctl",
        &[
            "--pf",
            "pf0",
            "--pf",
            "pf1",
            "--vfs",
            "2",
            "--vfs",
            "1",
            "--devset-lock",
            "global",
        ],
    );
    let mut c = d.client();
    let all = c.list().unwrap();
    assert_eq!(all.len(), 3);
    assert_eq!(all[2].id, "0000:b2:00.0");
    assert!(all
        .iter()
        .all(|v| v.state == VfState::Free && v.socket.exists()));

    let a = c
        .alloc("pf0", "sb-a", Some("02:11:22:33:44:55"), Some(12))
        .unwrap();
    assert_eq!(
        (a.id.as_str(), a.mac, a.vlan),
        (
            "0000:b1:00.0",
            Some("02:11:22:33:44:55".parse().unwrap()),
            Some(12)
        )
    );
    let r = raw(&mut c, r#"{"op":"alloc","pf":"pf0","sandbox":"sb-a"}"#);
    assert_eq!((r.ok, r.code), (false, Some(ErrorCode::AlreadyAssigned)));
    let r = raw(&mut c, r#"{"op":"alloc","pf":"pf9","sandbox":"sb-x"}"#);
    assert_eq!(r.code, Some(ErrorCode::UnknownPf));
    let r = raw(
        &mut c,
        r#"{"op":"alloc","pf":"pf0","sandbox":"sb-x","mac":"01:00:00:00:00:01"}"#,
    );
    assert_eq!(r.code, Some(ErrorCode::BadRequest), "multicast MAC refused");
    let r = raw(
        &mut c,
        r#"{"op":"alloc","pf":"pf0","sandbox":"sb-x","vlan":4095}"#,
    );
    assert_eq!(r.code, Some(ErrorCode::BadRequest));
    let r = raw(&mut c, "{this is not json");
    assert_eq!((r.ok, r.code), (false, Some(ErrorCode::BadRequest)));
    let r = raw(&mut c, r#"{"op":"frobnicate"}"#);
    assert_eq!(r.code, Some(ErrorCode::BadRequest));
    let r = raw(&mut c, r#"{"op":"get","sandbox":"nobody"}"#);
    assert_eq!(r.code, Some(ErrorCode::NotFound));
    // Release of an unknown sandbox is fine (idempotent).
    assert!(raw(&mut c, r#"{"op":"release","sandbox":"nobody"}"#).ok);
    c.alloc("pf0", "sb-b", None, None).unwrap();
    let r = raw(&mut c, r#"{"op":"alloc","pf":"pf0","sandbox":"sb-c"}"#);
    assert_eq!(r.code, Some(ErrorCode::NoFreeVf));
    let p1 = c.alloc("pf1", "sb-c", None, None).unwrap();
    assert_eq!(p1.mac, Some("02:42:bf:01:00:00".parse().unwrap()));
    // The connection survived every error.
    assert_eq!(c.list().unwrap().len(), 3);

    // Restart: assignments come back from the state file.
    drop(c);
    d.terminate();
    d.spawn();
    let mut c = d.client();
    let a2 = c.get_by_sandbox("sb-a").unwrap();
    assert_eq!(
        (a2.id, a2.mac, a2.vlan, a2.state),
        (a.id.clone(), a.mac, Some(12), VfState::Assigned)
    );
    assert_eq!(c.get_by_sandbox("sb-c").unwrap().id, "0000:b2:00.0");
    c.release("sb-a").unwrap();
    let freed = c.get_by_id(&a.id).unwrap();
    assert_eq!(
        (freed.state, freed.sandbox, freed.mac),
        (
            VfState::Free,
            None,
            Some("02:42:bf:00:00:00".parse().unwrap())
        )
    );
    drop(c);
    d.terminate();
}

#[test]
fn nic_bad_arguments_are_refused() {
    let dir = format!("/tmp/nic-d{}-args", std::process::id());
    for args in [
        vec!["--pf", "pf0", "--vfs", "0"],
        vec!["--pf", "pf0", "--vfs", "300"],
        vec!["--pf", "pf0", "--pf", "pf0"],
        vec!["--pf", "pf0", "--uplink", "eth0"],
        vec![
            "--pf", "pf0", "--pf", "pf1", "--vfs", "1", "--vfs", "2", "--vfs", "3",
        ],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_burstvm"))
            .args([
                "nic",
                "--control",
                &format!("{dir}/ctl.sock"),
                "--state-dir",
                &dir,
            ])
            .args(&args)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(!String::from_utf8_lossy(&out.stderr).trim().is_empty());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn nic_forwards_between_vfs_and_survives_bad_descriptors() {
    let mut d = Daemon::start(
        "fwd",
        &["--pf", "pf0", "--vfs", "3", "--devset-lock", "hierarchical"],
    );
    let mut c = d.client();
    let (a, b, x) = (
        c.alloc("pf0", "sb-a", None, None).unwrap(),
        c.alloc("pf0", "sb-b", None, None).unwrap(),
        c.alloc("pf0", "sb-x", None, None).unwrap(),
    );
    let mut fa = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
    let mut fb = SimFrontend::connect(&b.socket, MIN_MEM).unwrap();
    let mut fx = SimFrontend::connect(&x.socket, MIN_MEM).unwrap();
    let f = frame(&b.mac, &a.mac, b"one");
    fa.send(&f);
    assert_eq!(fb.recv(T).as_deref(), Some(&f[..]));
    // A bad VF goes to error; the others keep forwarding; the daemon lives.
    fx.send_out_of_bounds();
    d.wait_vf("sb-x", "in error", |v| {
        v.state == VfState::Error && v.counters.bad_descriptors == 1
    });
    let g = frame(&a.mac, &b.mac, b"two");
    fb.send(&g);
    assert_eq!(fa.recv(T).as_deref(), Some(&g[..]));
    let va = d.wait_vf("sb-a", "counted", |v| v.counters.rx_packets == 1);
    assert_eq!(
        (
            va.counters.tx_packets,
            va.counters.tx_bytes,
            va.counters.rx_bytes
        ),
        (1, f.len() as u64, g.len() as u64)
    );
    // SIGTERM with sessions open: clean exit, sockets removed.
    drop(c);
    d.terminate();
    drop((fa, fb, fx));
}

/// A frame sent the moment a frontend's set-up returns reaches that VF, for
/// every VF that comes up: set-up messages are acked once the session did
/// them, and the dataplane looks at the VFs again before it routes a burst.
/// (CI once lost the first frame of `nic_forwards_between_vfs_...`: the
/// test's frontend did not wait for acks and raced the session thread.)
#[test]
fn a_frame_sent_right_after_a_vf_comes_up_is_delivered() {
    const SESSIONS: u8 = 20;
    let vfs = (SESSIONS + 1).to_string();
    let d = Daemon::start("up", &["--pf", "pf0", "--vfs", &vfs]);
    let mut c = d.client();
    let a = c.alloc("pf0", "sb-a", None, None).unwrap();
    let mut fa = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
    // Sandboxes keep coming up on the other VFs; each is sent to at once.
    for k in 0..SESSIONS {
        let sb = format!("sb-b{k}");
        let b = c.alloc("pf0", &sb, None, None).unwrap();
        let mut fb = SimFrontend::connect(&b.socket, MIN_MEM).unwrap();
        let f = frame(&b.mac, &a.mac, &[k; 16]);
        fa.send(&f);
        assert_eq!(fb.recv(T).as_deref(), Some(&f[..]), "session {k}");
        let vb = d.wait_vf(&sb, "counted", |v| v.counters.rx_packets == 1);
        assert_eq!(vb.counters.rx_drops, 0, "session {k}");
    }
    let va = d.wait_vf("sb-a", "counted", |v| {
        v.counters.tx_packets == u64::from(SESSIONS)
    });
    assert_eq!(va.counters.tx_drops, 0);
}

#[test]
fn nic_frontend_killed_with_sigkill_frees_its_vf() {
    const NAME: &str = "nic_frontend_killed_with_sigkill_frees_its_vf";
    hold_frontend_if_child();
    let mut d = Daemon::start(
        "kill",
        &["--pf", "pf0", "--vfs", "2", "--devset-lock", "global"],
    );
    let a = d.client().alloc("pf0", "sb-a", None, None).unwrap();
    let mut child = spawn_frontend_child(NAME, &a.socket);
    d.wait_vf("sb-a", "open", |v| v.state == VfState::Open);
    // SAFETY: killing our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().unwrap();
    d.wait_vf("sb-a", "closed and reset", |v| v.state == VfState::Reset);
    let mut c = d.client();
    c.release("sb-a").unwrap();
    let again = c.alloc("pf0", "sb-new", None, None).unwrap();
    assert_eq!(again.id, a.id);
    let fe = SimFrontend::connect(&again.socket, MIN_MEM).unwrap();
    d.wait_vf("sb-new", "open", |v| v.state == VfState::Open);
    drop(fe);
    drop(c);
    d.terminate();
}

/// One daemon per directory: a second one on the first's state directory, or
/// with its VF sockets there, exits non-zero naming the first's pid and
/// touches nothing of it (sockets, state file, sessions); once the first is
/// SIGKILLed, its successor starts at once on the same directory.
#[test]
fn a_second_daemon_on_the_same_directory_is_refused_until_the_first_dies() {
    let mut d = Daemon::start("owner", &["--pf", "pf0", "--vfs", "2"]);
    let first = d.child.as_ref().unwrap().id();
    let mut c = d.client();
    let a = c.alloc("pf0", "sb-a", None, None).unwrap();
    let state = std::fs::read(d.dir.join("nic-state.json")).unwrap();
    let other = testutil::fresh_dir("nic-d", "owner-other");
    let second = |state_dir: &PathBuf, socket_dir: Option<&PathBuf>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_burstvm"));
        cmd.args(["nic", "--pf", "pf0", "--vfs", "2", "--control"])
            .arg(other.join("b.sock"))
            .arg("--state-dir")
            .arg(state_dir);
        if let Some(s) = socket_dir {
            cmd.arg("--socket-dir").arg(s);
        }
        let err = testutil::assert_refused_owner(&mut cmd, first, T);
        assert!(err.contains(&d.dir.display().to_string()), "{err}");
    };
    second(&d.dir, None);
    second(&other, Some(&d.dir));
    assert!(!other.join("b.sock").exists(), "the second daemon served");

    // The first serves on: its sockets, state file and connection are intact.
    assert_eq!(std::fs::read(d.dir.join("nic-state.json")).unwrap(), state);
    assert_eq!(c.get_by_sandbox("sb-a").unwrap().state, VfState::Assigned);
    let fe = SimFrontend::connect(&a.socket, MIN_MEM).unwrap();
    d.wait_vf("sb-a", "open", |v| v.state == VfState::Open);
    drop((fe, c));

    // SIGKILL: the lock dies with the process; the successor takes the
    // directory at once and has the assignment back.
    let mut child = d.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    d.spawn();
    let back = d.client().get_by_sandbox("sb-a").unwrap();
    assert_eq!((back.id, back.state), (a.id, VfState::Assigned));
    d.terminate();
    let _ = std::fs::remove_dir_all(&other);
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// Thousands of idle connections, an over-long line and malformed requests:
/// the daemon stays within its connection cap, answers `bad-request`, closes
/// idle clients, and `list` still answers.
#[test]
fn nic_control_server_survives_flood_long_lines_and_malformed_requests() {
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::UnixStream;
    const CAP: usize = 64;
    let mut d = Daemon::start(
        "flood",
        &[
            "--pf",
            "pf0",
            "--vfs",
            "2",
            "--control-max-connections",
            &CAP.to_string(),
            "--control-idle-timeout",
            "2",
        ],
    );
    let pid = d.child.as_ref().unwrap().id();
    let base = fd_count(pid);

    // The flood: far more idle connections than the cap, all kept open here.
    let mut flood = Vec::new();
    for _ in 0..3000 {
        match nic_api::connect_timeout(&d.control, Duration::from_secs(2)) {
            Ok(s) => flood.push(s),
            Err(e) => panic!("connect #{} failed: {e}", flood.len()),
        }
    }
    let mut c = d.client();
    assert_eq!(c.list().unwrap().len(), 2, "list answers after the flood");
    let during = fd_count(pid);
    assert!(
        during <= base + CAP + 2,
        "daemon holds {during} fds (before the flood: {base}, cap {CAP})"
    );
    // An evicted connection was told why.
    flood[0]
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut line = String::new();
    BufReader::new(&flood[0]).read_line(&mut line).unwrap();
    assert!(line.contains("\"busy\""), "{line:?}");
    drop(flood);

    // Malformed requests: bad-request, and the connection stays usable.
    let bad_requests: Vec<Vec<u8>> = vec![
        b"{\"op\":\"get\",\"sandbox\":\"\xff\xfe\"}".to_vec(),
        br#"{"op":"list","verbose":true}"#.to_vec(),
        br#"{"op":"alloc","pf":"pf0","sandbox":"s","colour":"red"}"#.to_vec(),
        br#"{"op":"alloc","pf":"pf0","sandbox":"a\u0000b"}"#.to_vec(),
        br#"{"op":"alloc","pf":"pf0","sandbox":"../../etc/passwd"}"#.to_vec(),
        br#"{"op":"alloc","pf":"pf0","sandbox":"a\nb"}"#.to_vec(),
        br#"{"op":"alloc","pf":"pf0","sandbox":"\u001b[2J"}"#.to_vec(),
        format!(
            r#"{{"op":"alloc","pf":"pf0","sandbox":"{}"}}"#,
            "x".repeat(300)
        )
        .into_bytes(),
        br#"{"op":"release","sandbox":"a/b"}"#.to_vec(),
        br#"{"op":"get","sandbox":"a\tb"}"#.to_vec(),
    ];
    let mut s = UnixStream::connect(&d.control).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    for req in &bad_requests {
        s.write_all(req).unwrap();
        s.write_all(b"\n").unwrap();
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        let resp: Response = serde_json::from_str(&line).unwrap();
        assert_eq!(
            resp.code,
            Some(ErrorCode::BadRequest),
            "{}: {line}",
            String::from_utf8_lossy(req)
        );
    }
    assert!(c.list().unwrap().iter().all(|v| v.sandbox.is_none()));

    // One line far over the limit: bad-request after at most the limit has
    // been read, then the daemon closes; its memory does not grow with it.
    let rss = |pid: u32| -> u64 {
        let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        st.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
            .unwrap()
    };
    let rss0 = rss(pid);
    s.set_write_timeout(Some(T)).unwrap();
    let junk = vec![b'x'; 1 << 20];
    let mut sent = 0usize;
    while sent < 100 << 20 {
        match s.write(&junk) {
            Ok(n) => sent += n,
            Err(_) => break,
        }
    }
    assert!(sent < 100 << 20, "the daemon read a 100 MiB line");
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(
        line.contains("bad-request") && line.contains("longer than"),
        "{line:?}"
    );
    assert!(
        rss(pid) < rss0 + 16 * 1024,
        "RSS {} kB -> {} kB",
        rss0,
        rss(pid)
    );

    // An idle connection is closed after --control-idle-timeout.
    let idle = UnixStream::connect(&d.control).unwrap();
    idle.set_read_timeout(Some(T)).unwrap();
    let t0 = Instant::now();
    let mut line = String::new();
    assert_eq!(
        BufReader::new(&idle).read_line(&mut line).unwrap(),
        0,
        "{line:?}"
    );
    assert!(
        t0.elapsed() >= Duration::from_secs(1),
        "closed before it was idle"
    );

    // Still serving, and back to the fds it had before the flood.
    let mut c = d.client();
    assert_eq!(c.list().unwrap().len(), 2);
    drop(c);
    let t0 = Instant::now();
    while fd_count(pid) > base + 1 {
        assert!(t0.elapsed() < T, "fds: {} (base {base})", fd_count(pid));
        std::thread::sleep(Duration::from_millis(50));
    }
    d.terminate();
}
