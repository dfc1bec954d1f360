//! `bench sgiov open`: the time to open `--pipes` warp pipes (OPEN and
//! CONNECT messages on one SG function's control pipes, every reply
//! awaited) against `bench devset`'s concurrent open of `--vfs` VFs (one
//! vhost-user session each), in one run.

use std::time::Instant;

use super::{attach, median, open_echo_pipes, settle, BenchSgError, CommonConfig, Daemon};
use nic::devset::LockPolicy;

/// What `bench sgiov open` runs (the `burstvm` CLI parses its flags into this).
#[derive(Debug, Clone)]
pub struct OpenConfig {
    /// Pipes opened on one SG function.
    pub pipes: usize,
    /// VFs opened concurrently by `bench devset` (hierarchical lock).
    pub vfs: usize,
    /// Memory table of each VF in bytes.
    pub vf_mem: usize,
    /// Repetitions (medians).
    pub reps: usize,
    pub common: CommonConfig,
}

impl Default for OpenConfig {
    fn default() -> Self {
        OpenConfig {
            pipes: 4096,
            vfs: 200,
            vf_mem: 4 << 20,
            reps: 3,
            common: CommonConfig::default(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct OpenRow {
    pub what: &'static str,
    pub count: usize,
    pub total_ms: f64,
    pub per_item_us: f64,
    /// Daemon fds with everything open, and idle (pipes only).
    pub daemon_fds: Option<usize>,
    pub idle_fds: Option<usize>,
}

pub fn run(a: &OpenConfig) -> Result<Vec<OpenRow>, BenchSgError> {
    a.common.check()?;
    let vf_mem = a.vf_mem;
    if vf_mem < nic::frontend::MIN_MEM {
        return Err(BenchSgError::Config(format!(
            "--vf-mem {}: at least {}",
            guestmem::format_size(vf_mem as u64),
            guestmem::format_size(nic::frontend::MIN_MEM as u64)
        )));
    }
    if a.pipes == 0 || a.pipes > 8192 || a.vfs == 0 || a.vfs > nic::MAX_VFS || a.reps == 0 {
        return Err(BenchSgError::Config(format!(
            "--pipes 1..8192, --vfs 1..{}, --reps at least 1",
            nic::MAX_VFS
        )));
    }
    let dir = a.common.dir("open");
    let (mut pipe_ms, mut fds) = (Vec::new(), 0);
    let idle_fds;
    {
        let d = Daemon::spawn(&a.common.bin()?, &dir, 1, "rr", a.common.workers)?;
        let mut c = d.client()?;
        idle_fds = d.idle_fds(&mut c)?;
        for rep in 0..a.reps {
            let (_, mut fe) = attach(&mut c, &format!("open-{rep}"), a.pipes, a.common.ring)?;
            let t0 = Instant::now();
            let socks = open_echo_pipes(&mut fe, a.pipes, a.common.ring, 4)?;
            pipe_ms.push(t0.elapsed().as_secs_f64() * 1e3);
            if socks.len() != a.pipes || fe.drv.sockets() != a.pipes {
                return Err(BenchSgError::Check(format!(
                    "{} of {} pipes open",
                    fe.drv.sockets(),
                    a.pipes
                )));
            }
            fds = fds.max(d.fds());
            drop(fe);
            settle(&d, &mut c, idle_fds)?;
        }
    }
    let mut vf_ms = Vec::new();
    for _ in 0..a.reps {
        let r = crate::devset::run_once(
            LockPolicy::Hierarchical,
            a.vfs,
            vf_mem,
            false,
            &dir.join("devset"),
        )?;
        vf_ms.push(r.total_ms);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let (p, v) = (median(&mut pipe_ms), median(&mut vf_ms));
    Ok(vec![
        OpenRow {
            what: "sg pipes",
            count: a.pipes,
            total_ms: p,
            per_item_us: p * 1e3 / a.pipes as f64,
            daemon_fds: Some(fds),
            idle_fds: Some(idle_fds),
        },
        OpenRow {
            what: "VFs (devset)",
            count: a.vfs,
            total_ms: v,
            per_item_us: v * 1e3 / a.vfs as f64,
            daemon_fds: None,
            idle_fds: None,
        },
    ])
}

pub fn run_cli(a: &OpenConfig) -> Result<(), BenchSgError> {
    println!(
        "bench sgiov open: {} pipes (OPEN + CONNECT, replies awaited, {} in flight) on one SG \
         function, against bench devset opening {} VFs concurrently ({} memory tables, \
         hierarchical); {} reps, medians",
        a.pipes,
        super::CTRL_BATCH,
        a.vfs,
        guestmem::format_size(a.vf_mem as u64),
        a.reps
    );
    let rows = run(a)?;
    println!(
        "{:<13} {:>6} {:>10} {:>12} {:>6} {:>6}",
        "what", "count", "total_ms", "per_item_us", "fds", "idle"
    );
    let opt = |v: Option<usize>| v.map_or("-".to_string(), |v| v.to_string());
    for r in &rows {
        println!(
            "{:<13} {:>6} {:>10.1} {:>12.1} {:>6} {:>6}",
            r.what,
            r.count,
            r.total_ms,
            r.per_item_us,
            opt(r.daemon_fds),
            opt(r.idle_fds)
        );
    }
    println!(
        "ratio: total {:.2} (pipes/VFs), per item {:.3}",
        rows[0].total_ms / rows[1].total_ms,
        rows[0].per_item_us / rows[1].per_item_us
    );
    Ok(())
}
