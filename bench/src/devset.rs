//! `bench devset`: N frontends open N VFs of one PF at the same time (real
//! vhost-user sessions with a memory table of `--mem` bytes each) under each
//! lock policy; prints total time, mean and p99 per open and the ratio.
//! `burstvm bench devset` parses its flags (cli/src/cmd/nic.rs) into `BenchDevsetConfig`.

use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use nic::daemon::Nic;
use nic::devset::LockPolicy;
use nic::frontend::{FrontendMemory, SimFrontend};

/// What `bench devset` runs (the `burstvm` CLI parses its flags into this).
#[derive(Debug, Clone)]
pub struct BenchDevsetConfig {
    /// VFs opened concurrently (one frontend thread each).
    pub vfs: usize,
    /// Lock policies to compare.
    pub policy: Vec<LockPolicy>,
    /// Memory table size per VF in bytes: the DMA-mapped RAM.
    pub mem: usize,
    /// Populate the sandboxes' memory before the opens (the NIC then only maps
    /// it); by default the NIC's mapping allocates and zeroes fresh pages.
    pub populated: bool,
    /// Work directory for sockets and state (a fresh temporary one by default).
    pub dir: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("bench devset: {0}")]
    Config(String),
    #[error("bench devset: {}: {source}", .dir.display())]
    Dir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("bench devset: {what}: {source}")]
    Nic {
        what: &'static str,
        #[source]
        source: Box<nic::Error>,
    },
    #[error("bench devset: VF {vf}: {source}")]
    Assign {
        vf: usize,
        #[source]
        source: nic::devset::DevsetError,
    },
    #[error("bench devset: {0}")]
    Frontend(#[from] nic::frontend::FrontendError),
    #[error("bench devset: a frontend thread panicked")]
    FrontendPanicked,
}

#[derive(Debug, Clone)]
pub struct BenchResult {
    pub policy: LockPolicy,
    pub total_ms: f64,
    pub mean_ms: f64,
    pub p99_ms: f64,
}

/// One run: a fresh in-process NIC with `n` VFs, `n` concurrent opens.
pub fn run_once(
    policy: LockPolicy,
    n: usize,
    mem: usize,
    populated: bool,
    dir: &std::path::Path,
) -> Result<BenchResult, BenchError> {
    let nic_err = |what| {
        move |e| BenchError::Nic {
            what,
            source: Box::new(e),
        }
    };
    std::fs::create_dir_all(dir).map_err(|source| BenchError::Dir {
        dir: dir.to_path_buf(),
        source,
    })?;
    let nic = Arc::new(
        Nic::new(
            &[("pf0".into(), n)],
            policy,
            dir,
            dir.join(format!("state-{policy:?}.json")),
            &nic::sg::SgConfig::default(),
        )
        .map_err(nic_err("start the NIC"))?,
    );
    let server = nic::daemon::BackgroundServer::start(nic.clone())
        .map_err(nic_err("start the control server"))?;
    for i in 0..n {
        nic.pfs[0]
            .devset
            .assign(i, &format!("bench-{i}"))
            .map_err(|source| BenchError::Assign { vf: i, source })?;
    }
    let barrier = Arc::new(Barrier::new(n + 1));
    // The sandboxes' memory exists before the opens start.
    let mems = (0..n)
        .map(|_| FrontendMemory::new(mem, populated))
        .collect::<Result<Vec<_>, _>>()?;
    let threads: Vec<_> = mems
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let (b, sock) = (barrier.clone(), nic.pfs[0].ports[i].socket.clone());
            std::thread::spawn(move || {
                b.wait();
                let t = Instant::now();
                let fe = SimFrontend::connect_mem(&sock, m);
                (t, Instant::now(), fe)
            })
        })
        .collect();
    barrier.wait();
    let mut times = Vec::with_capacity(n);
    let mut fes = Vec::with_capacity(n);
    let (mut first, mut last): (Option<Instant>, Option<Instant>) = (None, None);
    for t in threads {
        let (start, end, fe) = t.join().map_err(|_| BenchError::FrontendPanicked)?;
        fes.push(fe?);
        times.push((end - start).as_secs_f64() * 1e3);
        first = Some(first.map_or(start, |f| f.min(start)));
        last = Some(last.map_or(end, |l| l.max(end)));
    }
    // From the first open's start to the last open's end.
    let total_ms = match (first, last) {
        (Some(f), Some(l)) => (l - f).as_secs_f64() * 1e3,
        _ => 0.0,
    };
    drop(fes);
    server.stop();
    times.sort_by(|a, b| a.total_cmp(b));
    let mean_ms = times.iter().sum::<f64>() / n as f64;
    let p99_ms = times[((n as f64 * 0.99).ceil() as usize).clamp(1, n) - 1];
    Ok(BenchResult {
        policy,
        total_ms,
        mean_ms,
        p99_ms,
    })
}

pub fn run_cli(args: &BenchDevsetConfig) -> Result<(), BenchError> {
    let mem = args.mem;
    if args.vfs == 0 || args.vfs > nic::MAX_VFS {
        return Err(BenchError::Config(format!(
            "--vfs {}: must be 1..{}",
            args.vfs,
            nic::MAX_VFS
        )));
    }
    let dir = args.dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("burstvm-bench-devset-{}", std::process::id()))
    });
    let mut results = Vec::new();
    println!("policy        vfs  mem       total_ms   mean_ms   p99_ms");
    for &p in &args.policy {
        let r = run_once(p, args.vfs, mem, args.populated, &dir)?;
        println!(
            "{:<12} {:>4}  {:<8} {:>9.1} {:>9.1} {:>8.1}",
            format!("{p:?}").to_lowercase(),
            args.vfs,
            guestmem::format_size(mem as u64),
            r.total_ms,
            r.mean_ms,
            r.p99_ms
        );
        results.push(r);
    }
    let get = |p| results.iter().find(|r| r.policy == p);
    if let (Some(g), Some(h)) = (get(LockPolicy::Global), get(LockPolicy::Hierarchical)) {
        println!(
            "hierarchical/global: total {:.2}, mean {:.2}, p99 {:.2}",
            h.total_ms / g.total_ms,
            h.mean_ms / g.mean_ms,
            h.p99_ms / g.p99_ms
        );
    }
    if args.dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}
