//! `burstvm pool`: a standalone page-pool server (or, with `--stats` / `--shrink-*`, a client
//! of a running one) for VMMs started by hand. The pool itself is `guestmem::pool`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use guestmem::pool::{Pool, PoolClient, PoolServer, SizeClass};

/// `burstvm pool --socket PATH [--max SIZE] [--prezero P] [--fill SIZE:COUNT]...` runs a
/// server; with `--stats` / `--shrink-*` it queries a running one instead.
#[derive(Debug, Clone, clap::Args)]
pub struct PoolArgs {
    /// Unix socket to serve on (VMMs use it as --pool-socket).
    #[arg(long)]
    pub socket: PathBuf,
    /// Shrink automatically when more than this many bytes are cached (e.g. 8G).
    #[arg(long)]
    pub max: Option<String>,
    /// Keep this share (0-100) of every cached memfd zeroed ahead of time, at idle priority.
    #[arg(long, default_value_t = 0)]
    pub prezero: u8,
    /// Pre-fill the pool with COUNT resident memfds of SIZE guest bytes (e.g. 64M:10).
    #[arg(long, value_name = "SIZE:COUNT")]
    pub fill: Vec<String>,
    /// Write this byte into every --fill memfd and mark it dirty, as if a previous tenant
    /// had used it (e.g. 0xA5; for canary tests). Default: kernel-zeroed, marked zero.
    #[arg(long, value_name = "BYTE", value_parser = parse_byte)]
    pub fill_pattern: Option<u8>,
    /// Use 2 MiB hugetlb pages for --fill.
    #[arg(long)]
    pub hugepages: bool,
    /// Client mode: print the running server's stats (JSON) and exit.
    #[arg(long)]
    pub stats: bool,
    /// Client mode: release N cached memfds of the running server.
    #[arg(long, value_name = "N")]
    pub shrink_count: Option<u64>,
    /// Client mode: release that percentage of the cached memfds.
    #[arg(long, value_name = "P")]
    pub shrink_percent: Option<u8>,
    /// Client mode: release cached memfds until at most SIZE bytes are cached.
    #[arg(long, value_name = "SIZE")]
    pub shrink_to: Option<String>,
}

/// `burstvm pool --stats/--shrink-*`: talks to a running server.
fn run_client(a: &PoolArgs) -> anyhow::Result<()> {
    let c = PoolClient::connect(&a.socket)?;
    let released = match (a.shrink_count, a.shrink_percent, &a.shrink_to) {
        (Some(n), None, None) => Some(c.shrink_count(n)?),
        (None, Some(p), None) => Some(c.shrink_percent(p)?),
        (None, None, Some(s)) => {
            Some(c.shrink_to(guestmem::parse_size(s).context("--shrink-to")?)?)
        }
        (None, None, None) => None,
        _ => bail!("--shrink-*: give only one of --shrink-count, --shrink-percent, --shrink-to"),
    };
    if let Some(n) = released {
        println!("released {n} memfds");
    }
    if a.stats {
        println!("{}", serde_json::to_string_pretty(&c.stats()?)?);
    }
    Ok(())
}

fn parse_byte(s: &str) -> Result<u8, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u8::from_str_radix(h, 16),
        None => s.parse::<u8>(),
    };
    r.map_err(|_| format!("{s:?} is not a byte (0-255 or 0x00-0xff)"))
}

pub fn run(a: &PoolArgs) -> anyhow::Result<()> {
    use nix::sys::signal::{SigSet, Signal};
    if a.stats || a.shrink_count.is_some() || a.shrink_percent.is_some() || a.shrink_to.is_some() {
        return run_client(a);
    }
    let max = a
        .max
        .as_deref()
        .map(guestmem::parse_size)
        .transpose()
        .context("--max")?;
    if a.prezero > 100 {
        bail!("--prezero {} > 100", a.prezero);
    }
    let mut fills = Vec::new();
    for f in &a.fill {
        let (s, c) = f
            .split_once(':')
            .with_context(|| format!("--fill {f}: expected SIZE:COUNT"))?;
        let size = guestmem::parse_size(s).with_context(|| format!("--fill {f}"))?;
        let count: u64 = c
            .parse()
            .with_context(|| format!("--fill {f}: COUNT is not a number"))?;
        fills.push((size, count));
    }
    // Block the stop signals before any thread exists so only sigwait below sees them.
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.thread_block().context("block SIGINT/SIGTERM")?;
    let pool = Arc::new(Pool::new(max));
    pool.set_prezero_percent(a.prezero);
    for (size, count) in fills {
        let class = SizeClass {
            size,
            hugepages: a.hugepages,
        };
        pool.fill(class, count, a.fill_pattern)?;
    }
    let server = PoolServer::start(&a.socket, pool)?;
    eprintln!("burstvm pool: serving on {}", a.socket.display());
    let sig = set.wait().context("sigwait")?;
    let stats = server.pool().stats();
    server.shutdown();
    eprintln!(
        "burstvm pool: {sig:?}, stopped ({} memfds, {} bytes cached)",
        stats.cached_memfds, stats.cached_bytes
    );
    Ok(())
}
