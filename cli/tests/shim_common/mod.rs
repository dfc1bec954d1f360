//! A private containerd with the burstvm shim and the host services it
//! attaches to, for the shim tests (root, KVM). Unique paths per test.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use shim::containerd::{Containerd, ContainerdConfig};

pub const BURSTVM: &str = env!("CARGO_BIN_EXE_burstvm");
pub const THIN: &str = env!("CARGO_BIN_EXE_burstvm-cni-thin");
pub const SHIM: &str = env!("CARGO_BIN_EXE_containerd-shim-burstvm-v2");
pub const APP_IMAGE: &str = "burstvm.local/app:1";
pub const PAUSE_IMAGE: &str = "burstvm.local/pause:1";

pub struct Fixture {
    pub dir: PathBuf,
    pub ns: String,
    pub services_dir: PathBuf,
    pub shim_config: PathBuf,
    pub trace: PathBuf,
    pub containerd: Containerd,
    services: Option<Child>,
}

fn link(from: &str, to: &Path) {
    let _ = std::fs::remove_file(to);
    std::os::unix::fs::symlink(from, to).unwrap();
}

impl Fixture {
    pub fn new(name: &str, vfs: usize) -> Fixture {
        let dir = PathBuf::from(format!("/tmp/bvshim-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for d in ["bin", "cni-bin", "cni-conf", "images"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        link(SHIM, &dir.join("bin/containerd-shim-burstvm-v2"));
        // Only the forwarder, no burstvm-cni to fall back to: containerd's ADD
        // and DEL work only if the NIC daemon's CNI server serves them.
        link(THIN, &dir.join("cni-bin/burstvm-cni-thin"));
        for p in ["host-local", "loopback"] {
            link(&format!("/opt/cni/bin/{p}"), &dir.join("cni-bin").join(p));
        }
        let services_dir = dir.join("services");
        let mut cmd = Command::new(BURSTVM);
        cmd.arg("services")
            .arg("--dir")
            .arg(&services_dir)
            .arg("--cni-conf")
            .arg(dir.join("cni-conf/10-burstvm.conf"))
            .arg("--cni-bin")
            .arg(dir.join("cni-bin"))
            .args(["--vfs", &vfs.to_string()])
            .env(
                "PATH",
                format!("/opt/cni/bin:{}", std::env::var("PATH").unwrap_or_default()),
            )
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("services.log")).unwrap());
        // The services die with the test.
        procutil::die_with_parent(&mut cmd);
        let services = cmd.spawn().unwrap();
        let info = services_dir.join("services.json");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !info.exists() {
            assert!(
                Instant::now() < deadline,
                "services did not start: {}",
                std::fs::read_to_string(dir.join("services.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let shim_config = dir.join("shim.json");
        let trace = dir.join("trace.jsonl");
        shim::containerd::write_shim_config(&shim_config, &info, "fastiov", 64 << 20, Some(&trace))
            .unwrap();
        let st = Command::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../scripts/build-images.sh"
        ))
        .arg(dir.join("images"))
        .stdout(Stdio::null())
        .status()
        .unwrap();
        assert!(st.success(), "build-images.sh");
        let containerd = Containerd::start(ContainerdConfig {
            dir: dir.join("containerd"),
            shim_dir: dir.join("bin"),
            shim_config: shim_config.clone(),
            cni_bin_dir: dir.join("cni-bin"),
            cni_conf_dir: dir.join("cni-conf"),
            sandbox_image: PAUSE_IMAGE.into(),
        })
        .unwrap();
        let ns = format!("bvt{}", std::process::id());
        containerd.import(&ns, &dir.join("images/app.tar")).unwrap();
        Fixture {
            dir,
            ns,
            services_dir,
            shim_config,
            trace,
            containerd,
            services: Some(services),
        }
    }

    pub fn ctr(&self, args: &[&str]) -> Command {
        self.containerd.ctr(&self.ns, args)
    }

    /// Imports another image `scripts/build-images.sh` made (`busybox.tar`).
    pub fn import(&self, tarball: &str) {
        self.containerd
            .import(&self.ns, &self.dir.join("images").join(tarball))
            .unwrap();
    }

    /// A shim config for the Linux guest (docs/shim.md): `kernel`, `agent`,
    /// the fixture's own image cache, `variant`, `memory` of guest RAM.
    pub fn write_linux_config(
        &self,
        kernel: &str,
        agent: &str,
        variant: &str,
        memory: &str,
    ) -> PathBuf {
        let path = self.dir.join("shim-linux.json");
        let v = serde_json::json!({
            "services": self.services_dir.join("services.json"),
            "variant": variant,
            "memory": memory,
            "timeout_secs": 300,
            "trace_copy": self.trace,
            "kernel": kernel,
            "agent": agent,
            "image_cache": self.image_cache(),
        });
        std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
        path
    }

    /// The image cache of the Linux-guest config.
    pub fn image_cache(&self) -> PathBuf {
        self.dir.join("image-cache")
    }

    /// `ctr run` of `image` with the burstvm runtime and shim config `config`.
    pub fn ctr_run_with(
        &self,
        config: &Path,
        image: &str,
        id: &str,
        extra: &[&str],
        cmd: &[&str],
    ) -> Command {
        let cfg = config.display().to_string();
        let mut args = vec![
            "run",
            "--runtime",
            "io.containerd.burstvm.v2",
            "--runtime-config-path",
            &cfg,
        ];
        args.extend_from_slice(extra);
        args.push(image);
        args.push(id);
        args.extend_from_slice(cmd);
        self.containerd.ctr(&self.ns, &args)
    }

    /// `ctr run` of the app image with the burstvm runtime.
    pub fn ctr_run(&self, id: &str, extra: &[&str], entry: Option<&str>) -> Command {
        let cfg = self.shim_config.display().to_string();
        let mut args = vec![
            "run",
            "--runtime",
            "io.containerd.burstvm.v2",
            "--runtime-config-path",
            &cfg,
        ];
        args.extend_from_slice(extra);
        args.push(APP_IMAGE);
        args.push(id);
        if let Some(e) = entry {
            args.push(e);
        }
        self.containerd.ctr(&self.ns, &args)
    }

    pub fn sandbox_id(&self, id: &str) -> String {
        shim::sandbox_id(&self.ns, id)
    }

    /// What is left of sandboxes `ids`: shims, VMMs, netns, cgroups, assigned VFs, mounts.
    pub fn leftovers(&self, sandboxes: &[String]) -> Vec<String> {
        let mut left = Vec::new();
        for pid in self.containerd.shim_pids() {
            left.push(format!("shim {pid}"));
        }
        for sb in sandboxes {
            let vmm = runtime::vmmproc::processes(|s| s == sb.as_bytes());
            left.extend(vmm.iter().map(|p| format!("VMM {p} of {sb}")));
            if Path::new("/run/netns").join(sb).exists() {
                left.push(format!("netns {sb}"));
            }
            for p in runtime::cgroup::Layout::detect().unwrap().dirs(sb) {
                if p.exists() {
                    left.push(format!("cgroup {}", p.display()));
                }
            }
        }
        let info = runtime::ServicesInfo::load(&self.services_dir.join("services.json")).unwrap();
        let mut c = nic_api::Client::connect(&info.nic_socket).unwrap();
        for v in c.list().unwrap() {
            if let Some(s) = v.sandbox {
                left.push(format!("VF {} assigned to {s}", v.id));
            }
        }
        // The guests' permanent neighbour entries in the services' server netns.
        let ns = info
            .server_netns
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let out = Command::new("ip")
            .args(["-n", &ns, "neigh", "show", "nud", "permanent"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "ip -n {ns} neigh: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        for l in String::from_utf8_lossy(&out.stdout).lines() {
            left.push(format!("neighbour entry {l}"));
        }
        for m in shim::containerd::mounts_under(&self.containerd.bundle(&self.ns, "")) {
            left.push(format!("mount {}", m.display()));
        }
        // CRI's stdio FIFOs (containerd's io directories) and images held open.
        left.extend(
            fifos_under(self.containerd.dir())
                .into_iter()
                .map(|p| format!("FIFO {}", p.display())),
        );
        left.extend(open_under(&self.image_cache()));
        // A loop device on a file of the fixture (an image or layer mounted by the shim).
        let dir = self.dir.to_string_lossy().into_owned();
        if let Ok(rd) = std::fs::read_dir("/sys/block") {
            for e in rd.flatten() {
                let b =
                    std::fs::read_to_string(e.path().join("loop/backing_file")).unwrap_or_default();
                if b.starts_with(&dir) {
                    left.push(format!(
                        "loop device {:?} on {}",
                        e.file_name(),
                        b.trim_end()
                    ));
                }
            }
        }
        // A Linux guest's state directory (its files, the writable layers' mount).
        for sb in sandboxes {
            let d = Path::new(shim::service::STATE_ROOT).join(format!("shim-{sb}"));
            for m in shim::containerd::mounts_under(&d) {
                left.push(format!("mount {}", m.display()));
            }
            if d.exists() {
                left.push(format!("state directory {}", d.display()));
            }
        }
        left
    }

    /// Polls `leftovers` until nothing is left or `limit` passes.
    pub fn wait_clean(&self, sandboxes: &[String], limit: Duration) -> Vec<String> {
        let deadline = Instant::now() + limit;
        loop {
            let l = self.leftovers(sandboxes);
            if l.is_empty() || Instant::now() > deadline {
                return l;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn trace_stages(&self, sandbox: &str) -> Vec<String> {
        trace::read_trace(&self.trace)
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.sandbox == sandbox)
            .map(|e| e.stage.name().to_string())
            .collect()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let left = self.containerd.stop();
        if !left.is_empty() {
            eprintln!(
                "fixture {}: removed leftovers: {left:?}",
                self.dir.display()
            );
        }
        if let Some(s) = self.services.take() {
            // SIGTERM lets it tear down (NIC daemon, server netns, pool).
            runtime::sandbox::stop_child(s, Duration::from_secs(15));
        }
        if std::env::var_os("BURSTVM_KEEP_LOGS").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// FIFOs under `dir` (recursively; symbolic links not followed).
fn fifos_under(dir: &Path) -> Vec<PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    let mut found = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => todo.push(e.path()),
                Ok(t) if t.is_fifo() => found.push(e.path()),
                _ => {}
            }
        }
    }
    found
}

/// Processes other than this one holding a file under `dir` open.
fn open_under(dir: &Path) -> Vec<String> {
    let me = std::process::id().to_string();
    let mut left = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return left;
    };
    for p in procs.flatten() {
        let pid = p.file_name().to_string_lossy().into_owned();
        if pid == me || !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path()) {
                if target.starts_with(dir) {
                    left.push(format!("pid {pid} holds {} open", target.display()));
                }
            }
        }
    }
    left
}

fn sha256(path: &Path) -> String {
    let o = Command::new("sha256sum").arg(path).output().unwrap();
    assert!(o.status.success());
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// Runs `cmd`; panics unless it succeeds.
pub fn run_ok(cmd: &mut Command) {
    let st = cmd.status().unwrap();
    assert!(st.success(), "{cmd:?}: {st}");
}

/// The OCI archive `src` (one manifest) again as `dst`, named `name`, its
/// config's Entrypoint `entrypoint` and no Cmd.
pub fn derive_image(src: &Path, dst: &Path, name: &str, entrypoint: &[&str]) {
    let d = dst.with_extension("d");
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    run_ok(Command::new("tar").arg("-xf").arg(src).arg("-C").arg(&d));
    let read = |p: &Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
    };
    let blob = |digest: &serde_json::Value| {
        d.join("blobs/sha256")
            .join(digest.as_str().unwrap().trim_start_matches("sha256:"))
    };
    // Writes a blob; returns its descriptor's digest and size.
    let put = |v: &serde_json::Value| {
        let tmp = d.join("blob.tmp");
        let bytes = serde_json::to_vec(v).unwrap();
        std::fs::write(&tmp, &bytes).unwrap();
        let digest = sha256(&tmp);
        std::fs::rename(&tmp, d.join("blobs/sha256").join(&digest)).unwrap();
        (format!("sha256:{digest}"), bytes.len())
    };
    let mut index = read(&d.join("index.json"));
    let mut manifest = read(&blob(&index["manifests"][0]["digest"]));
    let mut config = read(&blob(&manifest["config"]["digest"]));
    config["config"]["Entrypoint"] = serde_json::json!(entrypoint);
    config["config"].as_object_mut().unwrap().remove("Cmd");
    let (digest, size) = put(&config);
    manifest["config"]["digest"] = digest.into();
    manifest["config"]["size"] = size.into();
    let (digest, size) = put(&manifest);
    let m = &mut index["manifests"][0];
    m["digest"] = digest.into();
    m["size"] = size.into();
    m["annotations"]["io.containerd.image.name"] = name.into();
    m["annotations"]["org.opencontainers.image.ref.name"] = name.rsplit(':').next().unwrap().into();
    std::fs::write(d.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    run_ok(
        Command::new("tar")
            .arg("-cf")
            .arg(dst)
            .arg("-C")
            .arg(&d)
            .arg("."),
    );
    std::fs::remove_dir_all(&d).unwrap();
}
