//! Containers in a Linux guest (issue 25, docs/runtime.md "Containers"):
//! `burstvm run --kernel K IMAGE -- CMD` boots the condensed kernel with the
//! guest agent, runs the image's process with the image config's env, cwd
//! and user, relays its stdio over vsock and exits with its status. Needs
//! the condensed kernel (scripts/build-guest-kernel.sh) and the static agent
//! (scripts/build-agent.sh), both made by scripts/setup.sh / test.sh. Each
//! test boots one VM: under kvm_pvm the kernel runs emulated (~20-40 s).
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

mod guest_common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use guest_common::{agent, kernel, script};

/// busybox.tar of scripts/build-images.sh in a directory of its own.
fn busybox(dir: &Path) -> PathBuf {
    let out = dir.join("images");
    script("build-images.sh", &[out.to_str().unwrap()]);
    out.join("busybox.tar")
}

struct Env {
    dir: tempfile::TempDir,
    image: PathBuf,
    kernel: String,
    agent: String,
}

fn setup() -> Env {
    assert!(Path::new("/dev/kvm").exists(), "/dev/kvm is required");
    let dir = tempfile::tempdir().unwrap();
    let image = busybox(dir.path());
    Env {
        image,
        kernel: kernel(),
        agent: agent(),
        dir,
    }
}

/// `burstvm run --variant no-net --kernel K --agent A IMAGE [flags] -- cmd`,
/// `stdin` fed to it.
fn run(env: &Env, flags: &[&str], cmd: &[&str], stdin: &[u8]) -> Output {
    run_variant(env, "no-net", flags, cmd, stdin)
}

/// As `run`, with another variant.
fn run_variant(env: &Env, variant: &str, flags: &[&str], cmd: &[&str], stdin: &[u8]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_burstvm"));
    c.args([
        "run",
        "--variant",
        variant,
        "--timeout",
        "300",
        "--memory",
        "128M",
    ])
    .args(["--kernel", &env.kernel, "--agent", &env.agent])
    .arg("--image-cache")
    .arg(env.dir.path().join("cache"))
    .arg("--rootfs")
    .arg(&env.image)
    .args(flags)
    .arg("--")
    .args(cmd)
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut input = child.stdin.take().unwrap();
    let data = stdin.to_vec();
    let feeder = std::thread::spawn(move || {
        let _ = input.write_all(&data);
    });
    let o = child.wait_with_output().unwrap();
    feeder.join().unwrap();
    o
}

fn describe(o: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The image's process runs with its config (env, cwd, root), its stdout
/// arrives, its exit status is ours, and writes land in the writable layer,
/// never in the shared EROFS image.
#[test]
fn a_container_prints_honours_its_image_config_and_exits_with_its_status() {
    let env = setup();
    let trace = env.dir.path().join("trace.jsonl");
    let o = run(
        &env,
        &["--trace", trace.to_str().unwrap()],
        &[
            "sh",
            "-c",
            "echo hello; echo image=$BURSTVM_IMAGE; pwd; id -u; \
             echo written > /etc/newfile && cat /etc/newfile; \
             echo rng=$(cat /sys/class/misc/hw_random/rng_current) \
             entropy=$(cat /proc/sys/kernel/random/entropy_avail); exit 3",
        ],
        b"",
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(3), "{}", describe(&o));
    assert!(
        out.contains("hello\nimage=busybox\n/\n0\nwritten\n"),
        "{}",
        describe(&o)
    );
    // The entropy device seeded the guest: its CRNG is ready (a full pool)
    // before the container's process runs (docs/vmm.md, "The entropy device").
    assert!(
        out.contains("rng=virtio_rng.0 entropy=256\n"),
        "{}",
        describe(&o)
    );
    // The Linux path's stages, from the agent's events (docs/design.md).
    let stages: Vec<String> = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["stage"].to_string())
        .collect();
    for want in ["boot", "rootfs-mount", "net-config", "ready", "app-launch"] {
        assert!(
            stages.iter().any(|s| s.trim_matches('"') == want),
            "no {want} in {stages:?}"
        );
    }
    // The image the sandbox ran is unchanged: no /etc/newfile in it.
    let images: Vec<_> = std::fs::read_dir(env.dir.path().join("cache"))
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    assert_eq!(images.len(), 1, "{images:?}");
    let meta = std::fs::read_to_string(&images[0]).unwrap();
    assert!(!meta.contains("/etc/newfile"), "{meta}");
    // dump.erofs exits 0 either way: its "File :" line says a path exists.
    let lists = |path: &str| {
        let d = Command::new("dump.erofs")
            .args(["--path", path])
            .arg(images[0].with_extension("erofs"))
            .output()
            .expect("dump.erofs (erofs-utils)");
        String::from_utf8_lossy(&d.stdout).contains(&format!("File : {path}"))
    };
    assert!(
        lists("/etc/passwd"),
        "dump.erofs does not list files as expected"
    );
    assert!(
        !lists("/etc/newfile"),
        "the EROFS image holds the container's write"
    );
}

/// stdin is piped through byte-exact (1 MiB through `cat`).
#[test]
fn stdin_is_piped_through_byte_exact() {
    let env = setup();
    let data: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let o = run(&env, &["-i"], &["cat"], &data);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    assert_eq!(o.stdout.len(), data.len(), "{}", describe(&o));
    assert!(o.stdout == data, "the bytes differ");
}

/// A process killed by SIGKILL is reported as 128+9.
#[test]
fn a_sigkilled_container_exits_with_137() {
    let env = setup();
    let o = run(
        &env,
        &[],
        &["sh", "-c", "echo before; kill -9 $$; echo after"],
        b"",
    );
    assert_eq!(o.status.code(), Some(137), "{}", describe(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("before") && !out.contains("after"),
        "{}",
        describe(&o)
    );
}

/// `burstvm exec` runs a second process, with its own stdio and status, in
/// the sandbox of a `run --keep-running` whose main process sleeps; Ctrl-C
/// of the run ends the main process (SIGTERM: 143) and leaves nothing.
#[test]
fn exec_runs_a_second_process_beside_the_sleeping_main_one() {
    let env = setup();
    let mut run = Command::new(env!("CARGO_BIN_EXE_burstvm"));
    run.args([
        "run",
        "--variant",
        "no-net",
        "--timeout",
        "300",
        "--memory",
        "128M",
    ])
    .args([
        "--kernel",
        &env.kernel,
        "--agent",
        &env.agent,
        "--keep-running",
    ])
    .arg("--image-cache")
    .arg(env.dir.path().join("cache"))
    .arg("--rootfs")
    .arg(&env.image)
    .args(["--", "sh", "-c", "echo main started; exec sleep 1000"])
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = run.spawn().unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    // "sandbox ID: agent at PATH (burstvm exec ID -- CMD)"
    let mut sandbox = None;
    let mut seen = String::new();
    for _ in 0..10_000 {
        let mut line = String::new();
        if stderr.read_line(&mut line).unwrap() == 0 {
            break;
        }
        seen.push_str(&line);
        if let Some(rest) = line.strip_prefix("sandbox ") {
            if line.contains(": agent at ") {
                sandbox = rest.split(':').next().map(str::to_string);
                break;
            }
        }
    }
    let Some(sandbox) = sandbox else {
        let _ = child.kill();
        panic!("no agent line from burstvm run: {seen}");
    };
    let exec = Command::new(env!("CARGO_BIN_EXE_burstvm"))
        .args(["exec", &sandbox, "-e", "WHO=exec", "-w", "/tmp", "--"])
        .args([
            "sh",
            "-c",
            "echo from $WHO in $(pwd); ps -o comm | grep -c sleep; exit 4",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    // Pipelines of two glibc programs (busybox), each process context-switched against the
    // other: under kvm_pvm the guest kernel saves no AVX state, so they run off AVX
    // (GLIBC_TUNABLES from the agent); with it they crashed in glibc's startup.
    let pipes = Command::new(env!("CARGO_BIN_EXE_burstvm"))
        .args(["exec", &sandbox, "--", "sh", "-c"])
        .arg(
            "n=0; for i in 1 2 3 4 5 6; do \
             cat /etc/passwd | cat > /dev/null && ps -o comm | grep -q sleep && n=$((n+1)); \
             done; echo $n; echo \"$GLIBC_TUNABLES\"",
        )
        .stdin(Stdio::null())
        .output()
        .unwrap();
    // A terminal (-t) from a terminal of ours: script(1) gives one.
    let exec_t = format!(
        "{} exec -t {sandbox} -- sh -c 'tty; echo tty-done'",
        env!("CARGO_BIN_EXE_burstvm")
    );
    let tty = Command::new("script")
        .args(["-qec", &exec_t, "/dev/null"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let rest = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    let o = child.wait_with_output().unwrap();
    let rest = rest.join().unwrap();
    assert_eq!(exec.status.code(), Some(4), "exec: {}", describe(&exec));
    assert_eq!(
        String::from_utf8_lossy(&exec.stdout),
        "from exec in /tmp\n1\n",
        "exec: {}",
        describe(&exec)
    );
    let pipes_out = String::from_utf8_lossy(&pipes.stdout);
    let mut lines = pipes_out.lines();
    assert_eq!(lines.next(), Some("6"), "pipelines: {}", describe(&pipes));
    assert!(
        !String::from_utf8_lossy(&pipes.stderr).contains("Segmentation"),
        "pipelines: {}",
        describe(&pipes)
    );
    let tunables = lines.next().unwrap_or_default();
    assert_eq!(
        vmm::host_is_kvm_pvm(),
        tunables.starts_with("glibc.cpu.hwcaps=-AVX,"),
        "GLIBC_TUNABLES {tunables:?}"
    );
    let tty_out = String::from_utf8_lossy(&tty.stdout);
    assert!(
        tty_out.contains("/dev/pts/") && tty_out.contains("tty-done"),
        "exec -t: {}",
        describe(&tty)
    );
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("main started"),
        "{}",
        describe(&o)
    );
    assert_eq!(o.status.code(), Some(143), "{seen}{rest}");
    assert!(rest.contains("leak check: clean"), "{seen}{rest}");
}

/// The container reaches the runtime's server over its sandbox's VF
/// (`fastiov`: burstvm-cni, the NIC daemon, vhost-user): 1 MB fetched with
/// busybox wget from the server's file server arrives intact.
#[test]
fn a_container_fetches_a_file_over_its_vf() {
    fetch_over_vf("fastiov");
}

/// The same under `window`: the NIC maps only the sandbox's 2 MiB DMA
/// window, so every ring and frame of the Linux guest's virtio-net must be
/// there (its restricted swiotlb pool, guest/linux/patches/0004); a single
/// descriptor elsewhere would put the VF in error and the fetch would fail.
#[test]
fn a_container_fetches_a_file_over_its_windowed_vf() {
    fetch_over_vf("window");
}

fn fetch_over_vf(variant: &str) {
    let env = setup();
    const N: u64 = 1_000_000;
    let file = env.dir.path().join("expected");
    std::fs::write(&file, runtime::fileserver::pattern_bytes(N)).unwrap();
    let sum = Command::new("sha256sum").arg(&file).output().unwrap();
    let want = String::from_utf8_lossy(&sum.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    let fetch = format!(
        "gw=$(ip route | awk '/^default/ {{print $3}}'); \
         wget -q -O - http://$gw:{}/bytes/{N} | sha256sum",
        runtime::fileserver::FILE_PORT
    );
    let o = run_variant(&env, variant, &[], &["sh", "-c", &fetch], b"");
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    let got = String::from_utf8_lossy(&o.stdout);
    assert!(got.contains(&want), "want {want}; {}", describe(&o));
}
