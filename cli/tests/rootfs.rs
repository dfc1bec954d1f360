//! The RunD rootfs end to end (docs/rootfs.md): `burstvm rootfs build`, the
//! agent reading a file from the EROFS image (virtio-blk and pmem) and
//! marking its writable layer, and the runtime's reflinked layers — private
//! to each sandbox, the template unchanged, nothing left after teardown,
//! also when the VMM or the runtime itself is killed with SIGKILL.
//! Needs root, /dev/kvm, erofs-utils, xfsprogs, e2fsprogs.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::io::{BufRead, BufReader, Lines};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

mod cli_common;
use cli_common::{burstvm, text, BIN};

/// VMs on a 2-core machine: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A small rootfs source tree and an image cache, unique to the test.
fn fixture(name: &str) -> (Dir, PathBuf, PathBuf) {
    let d = std::env::temp_dir().join(format!("bv-rootfs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    let src = d.join("src");
    std::fs::create_dir_all(src.join("etc")).unwrap();
    std::fs::create_dir_all(src.join("app")).unwrap();
    std::fs::write(src.join("etc/os-release"), b"NAME=burstvm-test\n").unwrap();
    let app: Vec<u8> = (0..9000u32).map(|i| (i * 31 + i / 7) as u8).collect();
    std::fs::write(src.join("app/code.bin"), app).unwrap();
    (Dir(d.clone()), src, d.join("cache"))
}

/// (image path, checksum of /app/code.bin) from `burstvm rootfs build`.
fn build(src: &Path, cache: &Path) -> (String, String) {
    let o = burstvm(&[
        "rootfs",
        "build",
        src.to_str().unwrap(),
        "--cache",
        cache.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let image = out
        .lines()
        .find_map(|l| l.strip_prefix("image   "))
        .expect("image line")
        .to_string();
    let data = std::fs::read(src.join("app/code.bin")).unwrap();
    let mut sum = 0u64;
    for c in data.chunks(8) {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        sum = sum.wrapping_add(u64::from_le_bytes(w));
    }
    let folded = sum as u32 ^ (sum >> 32) as u32;
    (image, format!("{folded:08x}"))
}

fn ext4(path: &Path) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(8 << 20).unwrap();
    let st = Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(path)
        .status()
        .unwrap();
    assert!(st.success());
}

fn vmm(args: &[&str]) -> Output {
    let mut a = vec!["vmm", "--timeout", "60"];
    a.extend_from_slice(args);
    burstvm(&a)
}

#[test]
fn guest_reads_the_image_and_marks_only_its_own_layer() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (dir, src, cache) = fixture("vmm");
    let (image, sum) = build(&src, &cache);
    // Built once: the second build is a cache hit with the same image.
    let again = burstvm(&[
        "rootfs",
        "build",
        src.to_str().unwrap(),
        "--cache",
        cache.to_str().unwrap(),
    ]);
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("cached"),
        "{}",
        text(&again)
    );

    let rw = dir.0.join("rw.ext4");
    ext4(&rw);
    let ro_disk = format!("path={image},ro");
    let rw_disk = format!("path={},id=rw", rw.display());
    let check = format!("/app/code.bin={sum}");
    let sb = format!("rootfs-vmm-{}", std::process::id());
    let trace = dir.0.join("trace.jsonl");
    let o = vmm(&[
        "--sandbox",
        &sb,
        "--disk",
        &ro_disk,
        "--disk",
        &rw_disk,
        "--rootfs-check",
        &check,
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    // The marker is in the writable layer's first sector, with the sandbox id.
    let sector = std::fs::read(&rw).unwrap()[..512].to_vec();
    assert!(sector.starts_with(b"BURSTVM-MARKER\0"));
    assert_eq!(&sector[16..16 + sb.len()], sb.as_bytes());
    // A layer that already holds a marker is not fresh: the guest says so.
    let o = vmm(&[
        "--sandbox",
        "rootfs-vmm2",
        "--disk",
        &ro_disk,
        "--disk",
        &rw_disk,
    ]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("writable layer not fresh"),
        "{}",
        text(&o)
    );

    // The host's checksum is what the guest must read.
    let wrong = format!(
        "/app/code.bin={:08x}",
        u32::from_str_radix(&sum, 16).unwrap() ^ 1
    );
    let o = vmm(&[
        "--sandbox",
        "rootfs-vmm3",
        "--disk",
        &ro_disk,
        "--rootfs-check",
        &wrong,
    ]);
    assert!(
        text(&o).contains("rootfs file /app/code.bin"),
        "{}",
        text(&o)
    );
    let o = vmm(&[
        "--sandbox",
        "rootfs-vmm4",
        "--disk",
        &ro_disk,
        "--rootfs-check",
        "/app/none=1",
    ]);
    assert!(text(&o).contains("ERR_EROFS"), "{}", text(&o));

    // pmem: the image in the image region, DMA-mapped with it (vanilla's
    // dma-image), and timed as the VMM's part of the rootfs stage.
    let ptrace = dir.0.join("pmem.jsonl");
    let o = vmm(&[
        "--sandbox",
        "rootfs-pmem",
        "--rootfs-pmem",
        &image,
        "--rootfs-check",
        &check,
        "--dma-image",
        "true",
        "--trace",
        ptrace.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let t = std::fs::read_to_string(&ptrace).unwrap();
    assert!(
        t.contains("\"dma-image\"") && t.contains("\"rootfs\""),
        "{t}"
    );
}

/// (runtime tag, `burstvm run` output) of a run; the tag names its state dir.
fn run_tag(out: &str) -> String {
    let id = out
        .lines()
        .find_map(|l| l.strip_prefix("sandbox "))
        .and_then(|l| l.split_whitespace().next())
        .expect("sandbox line");
    id.trim_start_matches("bv")
        .split('-')
        .next()
        .unwrap()
        .to_string()
}

/// Nothing of runtime `tag`'s writable layers is left: no state, no mount,
/// no loop device on its backing file.
fn assert_layers_gone(tag: &str) {
    let dir = format!("/run/burstvm/rt-{tag}/rootfs");
    assert!(!Path::new(&dir).exists(), "{dir} left");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&dir), "mount of {dir} left");
    let backing = format!("{dir}/rw.xfs");
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let b = std::fs::read_to_string(e.path().join("loop/backing_file")).unwrap_or_default();
        assert!(
            !b.starts_with(&backing),
            "{:?} backs {backing}",
            e.file_name()
        );
    }
}

#[test]
fn runtime_layers_leave_nothing_even_after_sigkill() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (_dir, src, cache) = fixture("run");
    let (image, _) = build(&src, &cache);
    let o = burstvm(&[
        "run",
        "--variant",
        "no-net",
        "--rootfs",
        &image,
        "--rootfs-file",
        "/app/code.bin",
    ]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(
        out.contains("  rootfs ") && out.contains("leak check: clean"),
        "{out}"
    );
    assert_layers_gone(&run_tag(&out));

    // SIGKILL the VMM of a running sandbox: the runtime tears down and
    // leaves nothing (the VMM had unlinked its layer already).
    let (mut child, lines, tag) = keep_running(&image);
    let vmm_pid = vmm_of(&format!("bv{tag}-"));
    // The runtime runs its VMMs as the burstvm-vmm built next to burstvm.
    let exe = std::fs::read_link(format!("/proc/{vmm_pid}/exe")).unwrap();
    let own = Path::new(env!("CARGO_BIN_EXE_burstvm")).with_file_name("burstvm-vmm");
    assert_eq!(exe, own.canonicalize().unwrap());
    // SAFETY: kill(2) of the test's own grandchild.
    unsafe { libc::kill(vmm_pid, libc::SIGKILL) };
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    // The run reports the dead VMM, and still leaves nothing behind.
    assert!(!child.wait().unwrap().success());
    assert!(err.contains("after READY"), "{err}");
    assert!(
        rest.iter().any(|l| l.contains("leak check: clean")),
        "{rest:?}"
    );
    assert_layers_gone(&tag);

    // SIGKILL the runtime itself: its VMM dies with it (PDEATHSIG), its
    // mount stays until the next runtime reaps it.
    let (mut child, _lines, tag) = keep_running(&image);
    child.kill().unwrap();
    child.wait().unwrap();
    let o = burstvm(&["run", "--variant", "no-net", "--rootfs", &image]);
    assert!(o.status.success(), "{}", text(&o));
    assert_layers_gone(&tag);
}

/// `burstvm run --keep-running --rootfs image`, once its sandbox is ready:
/// the child, the rest of its stdout, its runtime's tag.
fn keep_running(image: &str) -> (Child, Lines<BufReader<ChildStdout>>, String) {
    let mut child = Command::new(BIN)
        .args([
            "run",
            "--variant",
            "no-net",
            "--keep-running",
            "--rootfs",
            image,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.ends_with("ready"), "{first}");
    let tag = run_tag(&first);
    (child, lines, tag)
}

/// The pid of the VMM whose sandbox id starts with `prefix`.
fn vmm_of(prefix: &str) -> i32 {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(&pid) = runtime::leaks::vmm_processes(prefix).first() {
            return pid as i32;
        }
        assert!(Instant::now() < end, "no VMM for {prefix}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn concurrent_sandboxes_get_private_layers_reflink_and_copy() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (dir, src, cache) = fixture("bench");
    let (image, _) = build(&src, &cache);
    let out = dir.0.join("out");
    // Every agent checks its layer starts clean (another sandbox's marker
    // would fail it); the leak checks compare the template's digest.
    let o = burstvm(&[
        "bench",
        "startup",
        "--concurrency",
        "3",
        "--variants",
        "no-net",
        "--no-warmup",
        "--rootfs",
        &image,
        "--rootfs-copy",
        "--out",
        out.to_str().unwrap(),
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("== no-net+reflink (concurrency 3, 3 ready, 0 failed)"),
        "{t}"
    );
    assert!(
        t.contains("== no-net+copy (concurrency 3, 3 ready, 0 failed)"),
        "{t}"
    );
    assert!(
        t.contains("rootfs writable layer per sandbox, no-net x3: copy"),
        "{t}"
    );
    assert!(t.contains("leak check: clean after every round"), "{t}");
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let modes: Vec<&str> = summary["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["rootfs"]["mode"].as_str().unwrap())
        .collect();
    assert_eq!(modes, ["reflink", "copy"]);
}

/// A blob of an OCI layout as JSON.
fn blob_json(layout: &Path, digest: &str) -> serde_json::Value {
    let p = layout
        .join("blobs/sha256")
        .join(digest.strip_prefix("sha256:").unwrap());
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

/// Writes `v` as a blob of `layout`; its digest and size.
fn put_blob_json(layout: &Path, v: &serde_json::Value) -> (String, usize) {
    let data = serde_json::to_vec(v).unwrap();
    let digest = rootfs::oci::sha256_of(&data[..], layout).unwrap();
    let p = layout
        .join("blobs/sha256")
        .join(digest.strip_prefix("sha256:").unwrap());
    std::fs::write(p, &data).unwrap();
    (digest, data.len())
}

/// `burstvm rootfs build` of scripts/build-images.sh's busybox.tar keeps the
/// image config in the sidecar, and the image's /etc/passwd and /etc/group
/// resolve its users (root by default, `app` when the config names it).
/// Needs busybox-static (scripts/setup.sh); no VM.
#[test]
fn busybox_image_config_in_the_sidecar() {
    let d = std::env::temp_dir().join(format!("bv-rootfs-busybox-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    let dir = Dir(d.clone());
    let images = dir.0.join("images");
    let cache = dir.0.join("cache");
    let st = Command::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../scripts/build-images.sh"
    ))
    .arg(&images)
    .stdout(Stdio::null())
    .status()
    .unwrap();
    assert!(st.success(), "build-images.sh");
    let tarball = images.join("busybox.tar");
    let built = |src: &Path| {
        let o = burstvm(&[
            "rootfs",
            "build",
            src.to_str().unwrap(),
            "--cache",
            cache.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", text(&o));
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        let image = out
            .lines()
            .find_map(|l| l.strip_prefix("image   "))
            .expect("image line")
            .to_string();
        PathBuf::from(image)
    };
    let erofs = built(&tarball);
    let sidecar: serde_json::Value =
        serde_json::from_slice(&std::fs::read(erofs.with_extension("json")).unwrap()).unwrap();
    let c = &sidecar["config"];
    assert_eq!(c["cmd"], serde_json::json!(["sh"]), "{sidecar}");
    assert_eq!(c["entrypoint"], serde_json::json!([]));
    assert_eq!(
        c["env"],
        serde_json::json!([
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "BURSTVM_IMAGE=busybox"
        ])
    );
    assert_eq!((&c["working_dir"], &c["user"]), (&"/".into(), &"".into()));
    assert_eq!(
        sidecar["exec_user"],
        serde_json::json!({"uid":0,"gid":0,"additional_gids":[],"home":"/root"})
    );
    let img = rootfs::Image::open(&erofs).unwrap();
    assert_eq!(img.args(&[]).unwrap(), ["sh"]);
    assert!(img.file("/bin/busybox").is_some());

    // The same image with `"User": "app"`: the script's passwd and group
    // make it 1000:1000, also in wheel (10).
    let layout = dir.0.join("layout");
    std::fs::create_dir_all(&layout).unwrap();
    let st = Command::new("tar")
        .arg("-xf")
        .arg(&tarball)
        .arg("-C")
        .arg(&layout)
        .status()
        .unwrap();
    assert!(st.success());
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let mdigest = index["manifests"][0]["digest"]
        .as_str()
        .unwrap()
        .to_string();
    let mut manifest = blob_json(&layout, &mdigest);
    let mut config = blob_json(&layout, manifest["config"]["digest"].as_str().unwrap());
    config["config"]["User"] = "app".into();
    let (cd, cs) = put_blob_json(&layout, &config);
    manifest["config"]["digest"] = cd.into();
    manifest["config"]["size"] = cs.into();
    let (md, ms) = put_blob_json(&layout, &manifest);
    index["manifests"][0]["digest"] = md.into();
    index["manifests"][0]["size"] = ms.into();
    std::fs::write(
        layout.join("index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
    let app = rootfs::Image::open(&built(&layout)).unwrap();
    assert_eq!(app.config().user, "app");
    let u = app.exec_user();
    assert_eq!(
        (u.uid, u.gid, u.additional_gids.as_slice(), u.home.as_str()),
        (1000, 1000, &[10][..], "/home/app")
    );
}
