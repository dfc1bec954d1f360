//! Per-sandbox cgroups: cpu, cpuacct, cpuset, memory and blkio on cgroup v1
//! (`/sys/fs/cgroup/<controller>/burstvm/<id>`), or one cgroup2 directory
//! (`/sys/fs/cgroup/unified/burstvm/<id>`) when the v1 controllers are absent.
//!
//! Optionally a RunD-style pool (rund.txt §4.4): idle groups are created ahead
//! of time as `burstvm/pool-<k>` and a sandbox takes one with `rename(2)`,
//! which needs no global cgroup lock, instead of `mkdir` in every hierarchy.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

pub const V1_CONTROLLERS: [&str; 5] = ["cpu", "cpuacct", "cpuset", "memory", "blkio"];
const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// The v1 cpu cgroup beside `burstvm` that holds host work done for sandboxes
/// only while nothing else wants the CPU (a lazy VMM's background zeroer):
/// `cpu.idle` = 1 makes the group's entity SCHED_IDLE against its siblings.
pub const IDLE_CGROUP: &str = "burstvm-idle";
const CFS_PERIOD_US: u64 = 100_000;
/// Headroom above the guest memory for the VMM process itself (page tables,
/// thread stacks, vhost-user rings, the binary).
pub const VMM_OVERHEAD_BYTES: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cgroup {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("no cgroup hierarchy found: neither v1 controllers under {CGROUP_ROOT}/<controller> nor cgroup2 at {CGROUP_ROOT}/unified")]
    NoHierarchy,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CgroupError + '_ {
    move |source| CgroupError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Which hierarchy layout this host has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// One directory per v1 controller, each `<root>/<controller>`.
    V1(PathBuf),
    /// One cgroup2 mount.
    V2(PathBuf),
}

impl Layout {
    pub fn detect() -> Result<Layout, CgroupError> {
        let root = Path::new(CGROUP_ROOT);
        if V1_CONTROLLERS
            .iter()
            .all(|c| root.join(c).join("cgroup.procs").exists())
        {
            return Ok(Layout::V1(root.to_path_buf()));
        }
        for p in [root.join("unified"), root.to_path_buf()] {
            if p.join("cgroup.controllers").exists() {
                return Ok(Layout::V2(p));
            }
        }
        Err(CgroupError::NoHierarchy)
    }

    /// The `burstvm` parent directories, one per hierarchy.
    fn parents(&self) -> Vec<PathBuf> {
        match self {
            Layout::V1(root) => V1_CONTROLLERS
                .iter()
                .map(|c| root.join(c).join("burstvm"))
                .collect(),
            Layout::V2(root) => vec![root.join("burstvm")],
        }
    }

    /// `<cpu>/burstvm-idle` with `cpu.idle` = 1, made if missing and shared by
    /// every runtime (left in place, as the `burstvm` parents are). A thread
    /// at SCHED_IDLE inside a sandbox's cgroup still makes that cgroup
    /// runnable at its full weight against the runtime, the CNI plugins and
    /// the NIC daemon; in this group it is idle against all of them. None
    /// under cgroup2 (a thread cannot leave its process's cgroup outside a
    /// threaded subtree) or without `cpu.idle` (Linux < 5.15).
    pub fn ensure_idle_cgroup(&self) -> Result<Option<PathBuf>, CgroupError> {
        let Layout::V1(root) = self else {
            return Ok(None);
        };
        let cpu = root.join("cpu");
        if !cpu.join("cpu.idle").exists() {
            return Ok(None);
        }
        let dir = cpu.join(IDLE_CGROUP);
        match fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_err(&dir)(e)),
        }
        let idle = dir.join("cpu.idle");
        fs::write(&idle, "1").map_err(io_err(&idle))?;
        Ok(Some(dir))
    }

    /// `ensure_idle_cgroup`, or None with a warning: without it a zeroer
    /// stays at SCHED_IDLE in its VMM's cgroup, which works, more slowly.
    pub fn idle_cgroup_or_warn(&self) -> Option<PathBuf> {
        self.ensure_idle_cgroup().unwrap_or_else(|e| {
            tracing::warn!("no idle cgroup for background zeroing: {e}");
            None
        })
    }

    /// Creates the `burstvm` parents (and, for cpuset, copies the parent's
    /// cpus and mems, which v1 requires before any task can join).
    pub fn ensure_parents(&self) -> Result<(), CgroupError> {
        for p in self.parents() {
            if !p.exists() {
                match fs::create_dir(&p) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(io_err(&p)(e)),
                }
            }
            if p.parent().is_some_and(|pp| pp.ends_with("cpuset")) {
                inherit_cpuset(&p)?;
            }
        }
        if let Layout::V2(root) = self {
            // Delegate what the root offers so that limits can be set below.
            let avail = fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
            let want: Vec<String> = avail
                .split_whitespace()
                .filter(|c| ["cpu", "cpuset", "memory", "io"].contains(c))
                .map(|c| format!("+{c}"))
                .collect();
            for p in [root.clone(), root.join("burstvm")] {
                for w in &want {
                    // A controller that cannot be enabled (e.g. bound to v1) is skipped.
                    let _ = fs::write(p.join("cgroup.subtree_control"), w);
                }
            }
        }
        Ok(())
    }

    /// Every directory of group `name` (one per hierarchy).
    pub fn dirs(&self, name: &str) -> Vec<PathBuf> {
        self.parents().into_iter().map(|p| p.join(name)).collect()
    }

    /// Names of the groups currently under `burstvm/` (first hierarchy).
    pub fn list(&self) -> Vec<String> {
        let Some(parent) = self.parents().into_iter().next() else {
            return Vec::new();
        };
        let Ok(rd) = fs::read_dir(parent) else {
            return Vec::new();
        };
        rd.filter_map(|e| e.ok())
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().into_string().ok())
            .collect()
    }
}

fn inherit_cpuset(dir: &Path) -> Result<(), CgroupError> {
    let parent = dir.parent().expect("cgroup dir has a parent");
    for f in ["cpuset.cpus", "cpuset.mems"] {
        let cur = fs::read_to_string(dir.join(f)).map_err(io_err(&dir.join(f)))?;
        if cur.trim().is_empty() {
            let v = fs::read_to_string(parent.join(f)).map_err(io_err(&parent.join(f)))?;
            fs::write(dir.join(f), v.trim()).map_err(io_err(&dir.join(f)))?;
        }
    }
    Ok(())
}

/// Resource limits of one sandbox.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    pub memory_bytes: u64,
    pub cpus: f64,
}

impl Limits {
    /// A sandbox's limits: its guest RAM plus its image region (agent, app
    /// payload and a pmem rootfs image — `image_bytes` — with 4 MiB for the
    /// agent, 2 MiB aligned as the VMM lays it out), which is guest memory too.
    pub fn for_guest(ram_bytes: u64, image_bytes: u64, cpus: f64) -> Self {
        Limits {
            memory_bytes: ram_bytes + (image_bytes + (4 << 20)).next_multiple_of(2 << 20),
            cpus,
        }
    }
}

fn write_limits(layout: &Layout, dirs: &[PathBuf], l: Limits) -> Result<(), CgroupError> {
    let quota = ((l.cpus * CFS_PERIOD_US as f64).round() as u64).max(1000);
    let mem = l.memory_bytes + VMM_OVERHEAD_BYTES;
    let set = |p: PathBuf, v: String| fs::write(&p, v).map_err(io_err(&p));
    match layout {
        Layout::V1(_) => {
            for d in dirs {
                let ctl = d
                    .parent()
                    .and_then(|p| p.parent())
                    .and_then(|p| p.file_name())
                    .and_then(|n| n.to_str())
                    .unwrap_or("");
                match ctl {
                    "cpu" => {
                        set(d.join("cpu.cfs_period_us"), CFS_PERIOD_US.to_string())?;
                        set(d.join("cpu.cfs_quota_us"), quota.to_string())?;
                    }
                    "memory" => set(d.join("memory.limit_in_bytes"), mem.to_string())?,
                    "cpuset" => inherit_cpuset(d)?,
                    _ => {}
                }
            }
        }
        Layout::V2(_) => {
            let d = &dirs[0];
            // Files exist only for the controllers delegated to this subtree.
            if d.join("memory.max").exists() {
                set(d.join("memory.max"), mem.to_string())?;
            }
            if d.join("cpu.max").exists() {
                set(d.join("cpu.max"), format!("{quota} {CFS_PERIOD_US}"))?;
            }
        }
    }
    Ok(())
}

/// A sandbox's cgroup (one directory per hierarchy). Removed (or returned to
/// its pool) by `delete` or on drop.
#[derive(Debug)]
pub struct Cgroup {
    name: String,
    dirs: Vec<PathBuf>,
    pool: Option<(std::sync::Arc<CgroupPool>, String)>,
    deleted: bool,
}

impl Cgroup {
    /// Creates `burstvm/<name>` in every hierarchy with the given limits.
    pub fn create(layout: &Layout, name: &str, limits: Limits) -> Result<Cgroup, CgroupError> {
        let dirs = layout.dirs(name);
        let mut cg = Cgroup {
            name: name.to_string(),
            dirs: Vec::new(),
            pool: None,
            deleted: false,
        };
        for d in &dirs {
            fs::create_dir(d).map_err(io_err(d))?;
            cg.dirs.push(d.clone());
        }
        write_limits(layout, &cg.dirs, limits)?;
        Ok(cg)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Opens every `cgroup.procs` for writing, so that a child can join all
    /// hierarchies between fork and exec (see `join_self`).
    pub fn open_procs(&self) -> Result<ProcsFiles, CgroupError> {
        let mut files = Vec::new();
        for d in &self.dirs {
            let p = d.join("cgroup.procs");
            files.push(
                OpenOptions::new()
                    .write(true)
                    .open(&p)
                    .map_err(io_err(&p))?,
            );
        }
        Ok(ProcsFiles(files))
    }

    /// CPU time its tasks used so far (v1 `cpuacct.usage`, v2 `cpu.stat`
    /// usage_usec); None when neither is readable.
    pub fn cpu_usage_ns(&self) -> Option<u64> {
        self.dirs.iter().find_map(|d| {
            if let Ok(s) = fs::read_to_string(d.join("cpuacct.usage")) {
                return s.trim().parse().ok();
            }
            let s = fs::read_to_string(d.join("cpu.stat")).ok()?;
            s.lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(|us| us * 1000)
        })
    }

    /// Moves a process into every hierarchy of this group.
    pub fn add_pid(&self, pid: u32) -> Result<(), CgroupError> {
        for d in &self.dirs {
            let p = d.join("cgroup.procs");
            fs::write(&p, pid.to_string()).map_err(io_err(&p))?;
        }
        Ok(())
    }

    /// Removes the group (its tasks must have exited), or renames it back
    /// into the pool it came from.
    pub fn delete(&mut self) -> Result<(), CgroupError> {
        if self.deleted {
            return Ok(());
        }
        self.deleted = true;
        if let Some((pool, slot)) = self.pool.take() {
            return pool.give_back(&self.dirs, slot);
        }
        let mut first_err = None;
        for d in self.dirs.iter().rev() {
            if let Err(e) = rmdir_retry(d) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        if let Err(e) = self.delete() {
            tracing::warn!("cgroup {}: {e}", self.name);
        }
    }
}

/// `cgroup.procs` files opened ahead of a fork.
#[derive(Debug)]
pub struct ProcsFiles(Vec<File>);

impl ProcsFiles {
    pub fn raw_fds(&self) -> Vec<RawFd> {
        self.0.iter().map(|f| f.as_raw_fd()).collect()
    }
}

/// Writes "0" (the calling process) to each fd. Async-signal-safe: only
/// `write(2)`, so it may run between fork and exec.
pub fn join_self(fds: &[RawFd]) -> io::Result<()> {
    for &fd in fds {
        // SAFETY: writes two bytes from a static buffer to an fd we own.
        let r = unsafe { libc::write(fd, b"0\n".as_ptr().cast(), 2) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Whether joining a cgroup skips waiting for an RCU grace period: a
/// cgroup2 mount with `favordynmods` (Linux >= 6.0) switches the kernel's
/// cgroup migration lock to a mode where writers need none, at a small cost
/// to fork and exit. One such mount is enough (the lock is global); without
/// it every write to `cgroup.procs` ([`join_self`]) waits ~8 ms on this
/// host. Some(false): there is a cgroup2 mount and none has it; None: no
/// cgroup2 mount (nothing to remount) or /proc/self/mounts unreadable.
pub fn favordynmods() -> Option<bool> {
    favordynmods_in(&fs::read_to_string("/proc/self/mounts").ok()?)
}

fn favordynmods_in(mounts: &str) -> Option<bool> {
    let cgroup2: Vec<&str> = mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(2) == Some(&"cgroup2")).then(|| f.get(3).copied().unwrap_or(""))
        })
        .collect();
    (!cgroup2.is_empty()).then(|| {
        cgroup2
            .iter()
            .any(|opts| opts.split(',').any(|o| o == "favordynmods"))
    })
}

/// One line for a log or a benchmark's header on what [`favordynmods`]
/// found, and how to get there if it is not set.
pub fn favordynmods_note(state: Option<bool>) -> String {
    match state {
        Some(true) => {
            "cgroup moves: a cgroup2 mount has favordynmods (no RCU grace period per move)".into()
        }
        Some(false) => "cgroup moves: no cgroup2 mount has favordynmods, so each VMM waits for an \
             RCU grace period per cgroup it joins (~8 ms here); scripts/setup.sh remounts \
             one with it (docs/runtime.md \"Joining the cgroups\")"
            .into(),
        None => "cgroup moves: no cgroup2 mount to set favordynmods on".into(),
    }
}

/// What `reap` did: the processes it killed, the directories it removed.
#[derive(Debug, Default)]
pub(crate) struct Reaped {
    pub killed: Vec<i32>,
    pub removed: Vec<PathBuf>,
}

/// Removes the group `name` of an owner that died without removing it (a
/// SIGKILLed runtime or shim): SIGKILLs the processes still in it (in every
/// hierarchy), then removes its directories, leaf hierarchy last. Parts
/// already gone are skipped; a directory that cannot be removed is logged.
pub(crate) fn reap(layout: &Layout, name: &str) -> Reaped {
    let mut r = Reaped::default();
    let dirs: Vec<PathBuf> = layout
        .dirs(name)
        .into_iter()
        .filter(|d| d.is_dir())
        .collect();
    for d in &dirs {
        if let Ok(procs) = fs::read_to_string(d.join("cgroup.procs")) {
            for p in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                // SAFETY: kill(2) on a process in the dead owner's own cgroup.
                unsafe { libc::kill(p, libc::SIGKILL) };
                r.killed.push(p);
            }
        }
    }
    for d in dirs.iter().rev() {
        match rmdir_retry(d) {
            Ok(()) => r.removed.push(d.clone()),
            Err(e) => tracing::warn!("{e}"),
        }
    }
    r
}

/// A removed cgroup's tasks may take a moment to leave it after being reaped.
pub(crate) fn rmdir_retry(d: &Path) -> Result<(), CgroupError> {
    for i in 0.. {
        match fs::remove_dir(d) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && i < 100 => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            Err(e) => return Err(io_err(d)(e)),
        }
    }
    unreachable!()
}

/// Idle pre-created groups (RunD's rename-based cgroup pool).
#[derive(Debug)]
pub struct CgroupPool {
    layout: Layout,
    prefix: String,
    limits: Limits,
    idle: Mutex<Vec<String>>,
    all: Vec<String>,
}

impl CgroupPool {
    /// Pre-creates `count` idle groups `burstvm/<prefix>-<k>` with `limits`.
    pub fn new(
        layout: &Layout,
        prefix: &str,
        count: usize,
        limits: Limits,
    ) -> Result<std::sync::Arc<CgroupPool>, CgroupError> {
        let mut all = Vec::new();
        let pool = |all: Vec<String>| CgroupPool {
            layout: layout.clone(),
            prefix: prefix.to_string(),
            limits,
            idle: Mutex::new(all.clone()),
            all,
        };
        for k in 0..count {
            let slot = format!("{prefix}-{k}");
            match Cgroup::create(layout, &slot, limits) {
                Ok(mut cg) => {
                    cg.deleted = true; // owned by the pool from now on
                    all.push(slot);
                }
                Err(e) => {
                    drop(pool(all)); // removes what was made
                    return Err(e);
                }
            }
        }
        Ok(std::sync::Arc::new(pool(all)))
    }

    /// Takes an idle group and renames it to `name` in every hierarchy.
    /// Falls back to creating a new group when the pool is empty.
    pub fn take(self: &std::sync::Arc<Self>, name: &str) -> Result<Cgroup, CgroupError> {
        let slot = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let Some(slot) = slot else {
            return Cgroup::create(&self.layout, name, self.limits);
        };
        let from = self.layout.dirs(&slot);
        let to = self.layout.dirs(name);
        for (i, (f, t)) in from.iter().zip(&to).enumerate() {
            if let Err(e) = fs::rename(f, t) {
                // Undo the renames done so far and keep the slot.
                for (f2, t2) in from.iter().zip(&to).take(i) {
                    let _ = fs::rename(t2, f2);
                }
                self.idle
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(slot);
                return Err(io_err(f)(e));
            }
        }
        Ok(Cgroup {
            name: name.to_string(),
            dirs: to,
            pool: Some((self.clone(), slot)),
            deleted: false,
        })
    }

    fn give_back(&self, dirs: &[PathBuf], slot: String) -> Result<(), CgroupError> {
        let to = self.layout.dirs(&slot);
        for (f, t) in dirs.iter().zip(&to) {
            fs::rename(f, t).map_err(io_err(f))?;
        }
        self.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(slot);
        Ok(())
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }
}

impl Drop for CgroupPool {
    fn drop(&mut self) {
        for slot in &self.all {
            for d in self.layout.dirs(slot).iter().rev() {
                if let Err(e) = rmdir_retry(d) {
                    tracing::warn!("cgroup pool: {e}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn favordynmods_is_read_from_any_cgroup2_mount() {
        let v1 = "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n";
        let off = "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n";
        let on = "cgroup2 /x cgroup2 rw,nosuid,favordynmods,memory_recursiveprot 0 0\n";
        assert_eq!(favordynmods_in(v1), None);
        assert_eq!(favordynmods_in(&format!("{v1}{off}")), Some(false));
        assert_eq!(favordynmods_in(&format!("{v1}{off}{on}")), Some(true));
        // An option that merely contains the word does not count.
        let near = "cgroup2 /y cgroup2 rw,nofavordynmods2 0 0\n";
        assert_eq!(favordynmods_in(near), Some(false));
    }

    #[test]
    fn a_guest_is_charged_its_ram_and_its_2m_aligned_image_region() {
        assert_eq!(Limits::for_guest(64 << 20, 0, 1.0).memory_bytes, 68 << 20);
        assert_eq!(
            Limits::for_guest(64 << 20, (3 << 20) + 1, 0.5),
            Limits {
                memory_bytes: (64 << 20) + (8 << 20),
                cpus: 0.5
            }
        );
    }

    fn layout() -> Option<Layout> {
        // Needs root and a cgroup mount: present on the project's machines.
        let l = Layout::detect().ok()?;
        l.ensure_parents().ok()?;
        Some(l)
    }

    /// The idle group exists with cpu.idle set, a thread of a process can join it
    /// alone (v1) by writing "0", and a second call finds it as it is.
    #[test]
    fn the_idle_cgroup_takes_a_single_thread() {
        let l = layout().expect("cgroup hierarchy (run as root)");
        let Some(dir) = l.ensure_idle_cgroup().unwrap() else {
            assert!(!matches!(&l, Layout::V1(r) if r.join("cpu/cpu.idle").exists()));
            return;
        };
        assert_eq!(
            fs::read_to_string(dir.join("cpu.idle")).unwrap().trim(),
            "1"
        );
        assert_eq!(l.ensure_idle_cgroup().unwrap(), Some(dir.clone()));
        // The calling thread's cpu cgroup, as /proc/thread-self/cgroup names it.
        let cpu_cgroup = || {
            fs::read_to_string("/proc/thread-self/cgroup")
                .unwrap()
                .lines()
                .find(|l| l.split(':').nth(1) == Some("cpu"))
                .map(|l| l.rsplit(':').next().unwrap_or("").to_string())
        };
        let main_before = cpu_cgroup();
        let (inside, home) = std::thread::spawn(move || {
            let before = cpu_cgroup();
            // "0", as the VMM's background zeroer writes it: the writing
            // thread alone, not its process.
            fs::write(dir.join("tasks"), "0").unwrap();
            let inside = cpu_cgroup();
            // Back where it came from, so the test process stays in one cgroup.
            let root = Path::new(CGROUP_ROOT).join("cpu");
            let home = root.join(before.as_deref().unwrap_or("/").trim_start_matches('/'));
            fs::write(home.join("tasks"), "0").unwrap();
            (inside, before)
        })
        .join()
        .unwrap();
        assert_eq!(inside.as_deref(), Some(format!("/{IDLE_CGROUP}").as_str()));
        let main_after = cpu_cgroup();
        assert_eq!(main_after, main_before, "the other threads stayed");
        assert_eq!(home, main_before);
    }

    #[test]
    fn create_limit_join_and_delete() {
        let l = layout().expect("cgroup hierarchy (run as root)");
        let name = format!("test-{}", std::process::id());
        let lim = Limits {
            memory_bytes: 32 << 20,
            cpus: 0.5,
        };
        let mut cg = Cgroup::create(&l, &name, lim).unwrap();
        for d in cg.dirs() {
            assert!(d.is_dir(), "{}", d.display());
        }
        if let Layout::V1(root) = &l {
            let q = fs::read_to_string(
                root.join("cpu/burstvm")
                    .join(&name)
                    .join("cpu.cfs_quota_us"),
            );
            assert_eq!(q.unwrap().trim(), "50000");
            let m = fs::read_to_string(
                root.join("memory/burstvm")
                    .join(&name)
                    .join("memory.limit_in_bytes"),
            );
            assert_eq!(
                m.unwrap().trim(),
                ((32u64 << 20) + VMM_OVERHEAD_BYTES).to_string()
            );
        }
        // A child joins through the pre-opened procs files before exec.
        let procs = cg.open_procs().unwrap();
        let fds = procs.raw_fds();
        let mut cmd = std::process::Command::new("cat");
        cmd.arg("/proc/self/cgroup");
        use std::os::unix::process::CommandExt;
        // SAFETY: join_self only calls write(2).
        unsafe { cmd.pre_exec(move || join_self(&fds)) };
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(&format!("/burstvm/{name}")), "{text}");
        drop(procs);
        cg.delete().unwrap();
        for d in cg.dirs() {
            assert!(!d.exists(), "{}", d.display());
        }
    }

    #[test]
    fn pool_renames_and_returns() {
        let l = layout().expect("cgroup hierarchy (run as root)");
        let prefix = format!("tpool-{}", std::process::id());
        let lim = Limits {
            memory_bytes: 16 << 20,
            cpus: 1.0,
        };
        let pool = CgroupPool::new(&l, &prefix, 2, lim).unwrap();
        let name = format!("tsb-{}", std::process::id());
        let mut cg = pool.take(&name).unwrap();
        assert!(l.dirs(&name).iter().all(|d| d.is_dir()));
        assert_eq!(pool.idle.lock().unwrap().len(), 1);
        cg.delete().unwrap();
        assert!(l.dirs(&name).iter().all(|d| !d.exists()));
        assert_eq!(pool.idle.lock().unwrap().len(), 2);
        let slots = pool.all.clone();
        drop(pool);
        for s in slots {
            assert!(l.dirs(&s).iter().all(|d| !d.exists()));
        }
    }
}
