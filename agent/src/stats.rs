//! Figures for `Stats`, from /proc.

use std::io;

/// `MemTotal` and `MemAvailable` of /proc/meminfo, in KiB.
pub fn meminfo(text: &str) -> (u64, u64) {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (field("MemTotal"), field("MemAvailable"))
}

pub use procutil::stat_times;

/// Resident pages of a /proc/PID/statm line (its second field).
pub fn statm_resident(text: &str) -> Option<u64> {
    text.split_whitespace().nth(1)?.parse().ok()
}

/// (rss KiB, utime ms, stime ms) of `pid`.
pub fn process(pid: i32) -> io::Result<(u64, u64, u64)> {
    let bad = || {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("/proc/{pid}: unexpected format"),
        )
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm"))?;
    let (ut, st) = stat_times(&stat).ok_or_else(bad)?;
    let pages = statm_resident(&statm).ok_or_else(bad)?;
    let tick = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100)
        .max(1) as u64;
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .unwrap_or(4096) as u64;
    Ok((pages * page / 1024, ut * 1000 / tick, st * 1000 / tick))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_files() {
        let mi = "MemTotal:        2014512 kB\nMemFree:  10 kB\nMemAvailable:    1500000 kB\n";
        assert_eq!(meminfo(mi), (2014512, 1500000));
        assert_eq!(meminfo(""), (0, 0));
        let stat = "42 (a b) c) S 1 42 42 0 -1 4194560 100 0 0 0 7 3 0 0 20 0 1 0 5 1000 50";
        assert_eq!(stat_times(stat), Some((7, 3)));
        assert_eq!(statm_resident("1000 250 100 1 0 50 0"), Some(250));
    }

    #[test]
    fn reads_own_process() {
        let (rss, _, _) = process(std::process::id() as i32).unwrap();
        assert!(rss > 0);
    }
}
