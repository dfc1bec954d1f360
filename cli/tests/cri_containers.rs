//! `burstvm cri` container commands (create, start, logs, exec (ExecSync and
//! the streaming Exec), ps,
//! inspect, stop, rm, run) through a private containerd's CRI plugin, as
//! kubelet would drive them (root; docs/shim.md). The flow takes the
//! runtime handler as a parameter: it runs with containerd's runc here, and
//! can run with `burstvm` once the shim runs containers in a pod.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod guest_common;
mod shim_common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use shim::containerd::{Containerd, ContainerdConfig};
use shim_common::{derive_image, run_ok, Fixture, BURSTVM};

const BUSYBOX: &str = "burstvm.local/busybox:1";
/// build-images.sh's pause image is a payload for burstvm's built-in agent;
/// runc needs a process that stays: busybox's sleep (derived below).
const RUNC_PAUSE: &str = "burstvm.local/runc-pause:1";

struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// `burstvm cri` against one containerd, for one runtime handler.
struct Cri<'a> {
    containerd: &'a Containerd,
    runtime: String,
    /// Pods' log directories go under here.
    log_root: PathBuf,
    /// runp's and run's pod flags besides name, runtime, network and log
    /// directory (e.g. burstvm's variant annotation).
    pod_flags: Vec<String>,
}

impl Cri<'_> {
    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BURSTVM);
        c.arg("cri")
            .arg("--endpoint")
            .arg(self.containerd.socket())
            // A Linux pod's RunPodSandbox boots a kernel (emulated here).
            .args(["--timeout", "300"])
            .args(args)
            .stdin(Stdio::null());
        c
    }

    fn run(&self, args: &[&str]) -> Out {
        let o = self.command(args).output().unwrap();
        Out {
            code: o.status.code(),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }

    /// Runs `args`, asserts success, returns stdout trimmed.
    fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert_eq!(
            o.code,
            Some(0),
            "burstvm cri {args:?}: {}\ncontainerd: {}",
            o.stderr,
            self.containerd.log_tail()
        );
        o.stdout.trim().to_string()
    }

    fn runp(&self, name: &str) -> String {
        let dir = self.log_root.join(name);
        let dir = dir.to_str().unwrap();
        let mut args = vec![
            "runp",
            "--name",
            name,
            "--runtime",
            &self.runtime,
            "--host-network",
            "--log-dir",
            dir,
        ];
        args.extend(self.pod_flags.iter().map(String::as_str));
        let id = self.ok(&args);
        assert_eq!(id.len(), 64, "pod id {id:?}");
        id
    }

    fn inspect(&self, id: &str) -> serde_json::Value {
        serde_json::from_str(&self.ok(&["inspect", id])).unwrap()
    }

    /// `ps --json` with `extra` flags: (id, state, name) per container.
    fn ps(&self, extra: &[&str]) -> Vec<(String, i64, String)> {
        let mut args = vec!["ps", "--json"];
        args.extend_from_slice(extra);
        self.ok(&args)
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (
                    v["id"].as_str().unwrap().to_string(),
                    v["state"].as_i64().unwrap(),
                    v["metadata"]["name"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }

    /// Polls `logs ID` until its stdout has `want` (or 60 s pass).
    fn wait_log(&self, id: &str, want: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let o = self.run(&["logs", id]);
            if o.stdout.contains(want) || Instant::now() > deadline {
                return o.stdout;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Polls `inspect ID` until the container has exited (or 60 s pass).
    fn wait_exited(&self, id: &str) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let v = self.inspect(id);
            if v["state"] == EXITED || Instant::now() > deadline {
                return v;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

const CREATED: i64 = 0;
const RUNNING: i64 = 1;
const EXITED: i64 = 2;

/// Runs `cmd` with `input` on its stdin to its end, or kills it after `limit`.
fn bounded(mut cmd: Command, input: &[u8], limit: Duration) -> Out {
    let o = testutil::run_bounded(&mut cmd, input, limit);
    Out {
        code: o.status.code(),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

/// The Kubernetes-shaped flow: a pod, two containers in it (one long-running,
/// one exiting 3), logs, exec, ps, inspect, stop, rm; `run`; then nothing left.
fn container_flow(cri: &Cri, with_run: bool) {
    let images = cri.ok(&["images"]);
    assert!(
        images
            .lines()
            .any(|l| l.starts_with("burstvm.local/busybox ")),
        "{images}"
    );
    let pod = cri.runp("p1");

    // create: the container exists, not running.
    let c1 = cri.ok(&[
        "create",
        &pod,
        BUSYBOX,
        "--name",
        "c1",
        "--",
        "sh",
        "-c",
        "echo hello-from-c1; echo line-2; sleep 1000",
    ]);
    assert_eq!(c1.len(), 64, "container id {c1:?}");
    assert_eq!(cri.ps(&["-a"]), [(c1.clone(), CREATED, "c1".to_string())]);
    assert!(
        cri.ps(&[]).is_empty(),
        "ps without -a lists running ones only"
    );

    cri.ok(&["start", &c1]);
    let log = cri.wait_log(&c1, "line-2");
    assert_eq!(log, "hello-from-c1\nline-2\n");
    assert_eq!(cri.ok(&["logs", "--tail", "1", &c1]), "line-2");
    // The log is where the pod's --log-dir and the default log path say.
    let status = cri.inspect(&c1);
    assert_eq!(status["state"], RUNNING, "{status}");
    let log_path = cri.log_root.join("p1/c1_0.log");
    assert_eq!(status["log_path"], log_path.to_str().unwrap(), "{status}");
    assert!(log_path.exists());
    assert_eq!(status["image"]["image"], BUSYBOX, "{status}");

    // exec: output and exit status are the command's.
    let o = cri.run(&["exec", &c1, "--", "echo", "hi"]);
    assert_eq!(
        (o.code, o.stdout.as_str()),
        (Some(0), "hi\n"),
        "{}",
        o.stderr
    );
    let o = cri.run(&["exec", &c1, "--", "sh", "-c", "echo oops >&2; exit 7"]);
    assert_eq!((o.code, o.stderr.trim()), (Some(7), "oops"), "{}", o.stdout);
    // The image's environment.
    let o = cri.run(&["exec", &c1, "--", "sh", "-c", "echo $BURSTVM_IMAGE"]);
    assert_eq!(o.stdout.trim(), "busybox");

    let listed = cri.ok(&["ps"]);
    assert!(
        listed.contains(&c1[..13]) && listed.contains("Running") && listed.contains("c1"),
        "{listed}"
    );
    assert!(listed.contains(&pod[..13]), "POD ID column: {listed}");

    // A second container in the same pod, with an environment variable,
    // that exits 3: `logs -f` ends when it does.
    let c2 = cri.ok(&[
        "create",
        &pod,
        BUSYBOX,
        "--name",
        "c2",
        "--env",
        "GREETING=hi-from-c2",
        "--workdir",
        "/tmp",
        "--",
        "sh",
        "-c",
        "echo $GREETING in $(pwd); echo c2-err >&2; exit 3",
    ]);
    cri.ok(&["start", &c2]);
    let o = bounded(
        cri.command(&["logs", "-f", &c2]),
        b"",
        Duration::from_secs(30),
    );
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    assert_eq!(o.stdout, "hi-from-c2 in /tmp\n");
    // stderr entries go to stderr.
    let o = cri.run(&["logs", &c2]);
    assert_eq!(
        (o.stdout.as_str(), o.stderr.as_str()),
        ("hi-from-c2 in /tmp\n", "c2-err\n")
    );
    let s2 = cri.wait_exited(&c2);
    assert_eq!(
        (s2["state"].clone(), s2["exit_code"].clone()),
        (EXITED.into(), 3.into()),
        "{s2}"
    );
    assert_eq!(cri.ps(&[]), [(c1.clone(), RUNNING, "c1".to_string())]);
    let mut all = cri.ps(&["-a", "--pod", &pod[..12]]);
    all.sort_by(|a, b| a.2.cmp(&b.2));
    assert_eq!(
        all,
        [
            (c1.clone(), RUNNING, "c1".to_string()),
            (c2.clone(), EXITED, "c2".to_string())
        ]
    );
    // exec needs a running container.
    let o = cri.run(&["exec", &c2, "--", "true"]);
    assert_ne!(o.code, Some(0));
    assert!(
        o.stderr.contains("ExecSync") && o.stderr.contains(&c2),
        "{}",
        o.stderr
    );

    cri.ok(&["stop", &c1]);
    let s1 = cri.inspect(&c1);
    assert_eq!(s1["state"], EXITED, "{s1}");
    assert!(cri.ps(&[]).is_empty());
    assert_eq!(cri.ps(&["-a"]).len(), 2);
    // Removing a running container is refused without -f (as crictl does).
    let c3 = cri.ok(&[
        "create", &pod, BUSYBOX, "--name", "c3", "--", "sleep", "1000",
    ]);
    cri.ok(&["start", &c3]);
    let o = cri.run(&["rm", &c3]);
    assert_ne!(o.code, Some(0), "rm of a running container");
    assert!(
        o.stderr.contains("is running") && o.stderr.contains(&c3),
        "{}",
        o.stderr
    );
    cri.ok(&["rm", "-f", &c3]);
    cri.ok(&["rm", &c1, &c2]);
    assert!(cri.ps(&["-a"]).is_empty());

    // Errors name the call and the container.
    let o = cri.run(&["start", "no-such-container"]);
    assert_ne!(o.code, Some(0));
    assert!(
        o.stderr.contains("StartContainer no-such-container"),
        "{}",
        o.stderr
    );

    cri.ok(&["stopp", &pod]);
    cri.ok(&["rmp", &pod]);
    if with_run {
        run_flow(cri);
    }
    assert!(cri.ps(&["-a"]).is_empty(), "no containers left");
    assert_eq!(cri.ok(&["pods", "--json"]), "", "no pods left");
}

/// `run`: pod and container in one; both listed, then removed with the pod.
fn run_flow(cri: &Cri) {
    let dir = cri.log_root.join("p2");
    let mut args = vec![
        "run",
        "--name",
        "p2",
        "--runtime",
        &cri.runtime,
        "--host-network",
        "--log-dir",
        dir.to_str().unwrap(),
    ];
    args.extend(cri.pod_flags.iter().map(String::as_str));
    args.extend([BUSYBOX, "--", "sh", "-c", "echo ran; sleep 1000"]);
    let out = cri.ok(&args);
    let ids: Vec<&str> = out.lines().collect();
    assert_eq!(ids.len(), 2, "run prints pod and container ids: {out}");
    let (pod2, c4) = (ids[0], ids[1]);
    assert_eq!(cri.ps(&[]), [(c4.to_string(), RUNNING, "p2".to_string())]);
    assert!(cri.wait_log(c4, "ran").contains("ran"));
    cri.ok(&["stopp", pod2]);
    cri.ok(&["rmp", pod2]);
}

/// A private containerd for runc pods: busybox and a runc-able pause image
/// imported, no CNI (the pods take the host's network), no burstvm services.
struct RuncFixture {
    dir: PathBuf,
    containerd: Containerd,
}

impl RuncFixture {
    fn new(name: &str) -> RuncFixture {
        let dir = PathBuf::from(format!("/tmp/bvcri-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for d in ["bin", "cni-conf", "images", "logs"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        let images = dir.join("images");
        run_ok(
            Command::new(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../scripts/build-images.sh"
            ))
            .arg(&images)
            .stdout(Stdio::null()),
        );
        derive_image(
            &images.join("busybox.tar"),
            &images.join("runc-pause.tar"),
            RUNC_PAUSE,
            &["/bin/sleep", "2147483647"],
        );
        let containerd = Containerd::start(ContainerdConfig {
            dir: dir.join("containerd"),
            shim_dir: dir.join("bin"),
            // Only a burstvm pod would read it.
            shim_config: dir.join("shim.json"),
            cni_bin_dir: PathBuf::from("/opt/cni/bin"),
            cni_conf_dir: dir.join("cni-conf"),
            sandbox_image: RUNC_PAUSE.into(),
        })
        .unwrap();
        for t in ["busybox.tar", "runc-pause.tar"] {
            containerd.import("k8s.io", &images.join(t)).unwrap();
        }
        RuncFixture { dir, containerd }
    }

    fn cri(&self, runtime: &str) -> Cri<'_> {
        Cri {
            containerd: &self.containerd,
            runtime: runtime.into(),
            log_root: self.dir.join("logs"),
            pod_flags: Vec::new(),
        }
    }
}

impl Drop for RuncFixture {
    fn drop(&mut self) {
        // A failed test's pods: stopped and removed through the CRI, so no
        // runc shim or container process outlives the test.
        let cri = self.cri("runc");
        for l in cri.run(&["pods", "--json"]).stdout.lines() {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(l) {
                let id = v["id"].as_str().unwrap_or_default();
                cri.run(&["stopp", id]);
                cri.run(&["rmp", id]);
            }
        }
        let socket = self.containerd.socket().to_string_lossy().into_owned();
        for pid in shim::containerd::processes(|a| {
            a.first()
                .is_some_and(|x| x.ends_with("containerd-shim-runc-v2"))
                && a.windows(2).any(|w| w[0] == "-address" && w[1] == socket)
        }) {
            // SAFETY: kill(2) on a shim our containerd started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        self.containerd.stop();
        if std::env::var_os("BURSTVM_KEEP_LOGS").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

#[test]
fn runc_pod_containers_create_start_log_exec_stop_rm() {
    let f = RuncFixture::new("runc");
    container_flow(&f.cri("runc"), true);
}

/// `exec -i`/`-t` through the Exec call and containerd's streaming server.
fn exec_stream_flow(cri: &Cri) {
    let pod = cri.runp("p");
    let c = cri.ok(&["create", &pod, BUSYBOX, "--", "sleep", "1000"]);
    cri.ok(&["start", &c]);
    let limit = Duration::from_secs(30);

    // -i: stdin reaches the command; stdout and stderr stay apart; the
    // status is the command's.
    let o = bounded(
        cri.command(&[
            "exec",
            "-i",
            &c,
            "--",
            "sh",
            "-c",
            "read x; echo got-$x; echo err-$x >&2; exit 5",
        ]),
        b"hello\n",
        limit,
    );
    assert_eq!(
        (o.code, o.stdout.as_str(), o.stderr.as_str()),
        (Some(5), "got-hello\n", "err-hello\n")
    );
    // -t: a terminal, stderr on it too (the terminal's CRLF).
    let o = bounded(
        cri.command(&[
            "exec",
            "-t",
            &c,
            "--",
            "sh",
            "-c",
            "tty; echo on-tty >&2; exit 4",
        ]),
        b"",
        limit,
    );
    assert_eq!(o.code, Some(4), "{}", o.stderr);
    assert!(
        o.stdout.starts_with("/dev/pts/") && o.stdout.ends_with("on-tty\r\n"),
        "{:?}",
        o.stdout
    );
    // -i -t, the keys as typed: a line, then `exit` ends the shell. (A ^D
    // typed ahead was lost once under load, arriving while the shell
    // switched its terminal's modes between two lines.)
    let o = bounded(
        cri.command(&["exec", "-i", "-t", &c, "--", "sh"]),
        b"echo $((6*7))\nexit\n",
        limit,
    );
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    assert!(o.stdout.contains("42\r\n"), "{:?}", o.stdout);
    // A command that cannot start: the runtime's reason, no status.
    let o = bounded(
        cri.command(&["exec", "-t", &c, "--", "/no/such"]),
        b"",
        limit,
    );
    assert_ne!(o.code, Some(0));
    assert!(o.stderr.contains("/no/such"), "{}", o.stderr);

    cri.ok(&["rm", "-f", &c]);
    cri.ok(&["stopp", &pod]);
    cri.ok(&["rmp", &pod]);
}

#[test]
fn runc_exec_streams_stdin_and_a_terminal() {
    let f = RuncFixture::new("exec-stream");
    exec_stream_flow(&f.cri("runc"));
}

/// The same flow on burstvm pods (`burstvm services`, KVM, the Linux guest:
/// each pod boots the condensed kernel, ~30-40 s here): every container is
/// a root of its own in its pod's VM (docs/shim.md, "What a pod is here").
#[test]
fn burstvm_pod_containers_create_start_log_exec_stop_rm() {
    let f = Fixture::new("cri-ctr", 4);
    // The CRI runtime's ConfigPath is the fixture's shim.json: the Linux guest's.
    let linux = f.write_linux_config(
        &guest_common::kernel(),
        &guest_common::agent(),
        "no-net",
        "128M",
    );
    std::fs::copy(&linux, &f.shim_config).unwrap();
    for t in ["pause.tar", "busybox.tar"] {
        f.containerd
            .import("k8s.io", &f.dir.join("images").join(t))
            .unwrap();
    }
    let cri = Cri {
        containerd: &f.containerd,
        runtime: "burstvm".into(),
        log_root: f.dir.join("logs"),
        // A host-network pod is the no-net variant.
        pod_flags: vec!["--annotation".into(), "io.burstvm.variant=no-net".into()],
    };
    // `run` is RunPodSandbox + CreateContainer + StartContainer again
    // (the runc flow covers it): a second Linux boot (~40 s here) spared.
    container_flow(&cri, false);
}
