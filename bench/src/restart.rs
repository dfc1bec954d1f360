//! `burstvm bench nic-restart`: what a crash of the NIC daemon costs running sandboxes.
//!
//! Guests of a VF variant run the agent in echo mode (a request to the runtime's echo server
//! as soon as the previous reply arrived). Each round SIGKILLs the NIC daemon and starts it
//! again on its state directory at once; the VMMs reconnect and restore their sessions. A
//! guest's traffic has resumed when the echo server saw two more of its requests than when
//! the new daemon answered: the second proves a reply got back to the guest. Reported per
//! guest: kill → resumed and restart → resumed, and the host CPU of the recovery: the new
//! daemon's until it answers, and the VMMs' VF monitor threads' (reconnect and restore).

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::stats::median;
use crate::{bad, Error};
use runtime::variant::NetKind;
use runtime::{burstvm_bin, cgroup, leaks, SandboxConfig, Variant};
use runtime::{Runtime, RuntimeConfig, Sandbox, SandboxSpec};

/// `burstvm bench nic-restart`.
#[derive(Debug, Clone)]
pub struct BenchNicRestartConfig {
    /// Sandboxes running (and exchanging requests) while the NIC daemon is killed.
    pub guests: usize,
    /// Kills and restarts of the NIC daemon.
    pub rounds: usize,
    /// A variant with a VF (vanilla, fastiov, ...).
    pub variant: Variant,
    pub sandbox: SandboxConfig,
    /// Seconds each guest may take to become ready, and traffic to resume.
    pub timeout: u64,
    /// The burstvm binary (default: this one).
    pub burstvm_bin: Option<PathBuf>,
}

/// CPU time of all threads of a process.
fn cpu_time(pid: u32) -> Option<Duration> {
    procutil::schedstat::live_threads_ns(pid)
        .ok()
        .map(Duration::from_nanos)
}

/// CPU time of the threads of `pid` named `comm` (a VMM's VF monitor threads).
fn threads_cpu(pid: u32, comm: &str) -> Duration {
    procutil::schedstat::named_threads_ns(pid, |c| c == comm)
        .map_or(Duration::ZERO, Duration::from_nanos)
}

/// The VMM thread that reconnects and restores a VF (vmm/src/virtio/vhost_user.rs).
const MONITOR_THREAD: &str = "vhost-user-vf";

struct Outage {
    nic_restart: Duration,
    /// CPU of the new daemon from its start until it answered.
    nic_cpu: Duration,
    /// Per guest: kill → resumed, restart → resumed.
    guests: Vec<(Duration, Duration)>,
    /// CPU of the VMMs' VF monitor threads during the round (reconnect, restore).
    vmm_cpu: Duration,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One kill and restart while `sandboxes` exchange requests.
fn round(rt: &Runtime, sandboxes: &mut [Sandbox<'_>], timeout: Duration) -> Result<Outage, Error> {
    let ips: Vec<Ipv4Addr> = sandboxes.iter().filter_map(|s| s.guest_ip).collect();
    let count = |ip: &Ipv4Addr| rt.server().replies().get(ip).copied().unwrap_or(0);
    let wait = |what: &str, base: &[u64], sbs: &mut [Sandbox<'_>]| -> Result<Vec<Instant>, Error> {
        let end = Instant::now() + timeout;
        let mut done: Vec<Option<Instant>> = vec![None; ips.len()];
        while done.iter().any(Option::is_none) {
            for (i, ip) in ips.iter().enumerate() {
                if done[i].is_none() && count(ip) >= base[i] + 2 {
                    done[i] = Some(Instant::now());
                }
            }
            if Instant::now() > end || rt.interrupted() {
                for sb in sbs.iter_mut() {
                    sb.check_alive()?;
                }
                return Err(bad(
                    "--timeout",
                    format!("guests' traffic not {what} within {} s", timeout.as_secs()),
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(done.into_iter().flatten().collect())
    };
    // Steady traffic first.
    let base: Vec<u64> = ips.iter().map(count).collect();
    wait("flowing", &base, sandboxes)?;
    let monitors = |sbs: &[Sandbox<'_>]| -> Duration {
        sbs.iter()
            .filter_map(|s| s.vmm_pid())
            .map(|p| threads_cpu(p, MONITOR_THREAD))
            .sum()
    };
    let vmm_cpu0 = monitors(sandboxes);
    let (killed, up, nic_pid) = rt.crash_and_restart_nic()?;
    let nic_cpu = cpu_time(nic_pid).unwrap_or_default();
    let at_up: Vec<u64> = ips.iter().map(count).collect();
    let resumed = wait("resumed", &at_up, sandboxes)?;
    for sb in sandboxes.iter_mut() {
        sb.check_alive()?;
    }
    let vmm_cpu = monitors(sandboxes);
    Ok(Outage {
        nic_restart: up - killed,
        nic_cpu,
        guests: resumed
            .iter()
            .map(|t| (*t - killed, t.saturating_duration_since(up)))
            .collect(),
        vmm_cpu: vmm_cpu.saturating_sub(vmm_cpu0),
    })
}

pub fn run_cli(a: &BenchNicRestartConfig) -> Result<(), Error> {
    runtime::instance::install_sigint_handler();
    if a.variant.policy().net != NetKind::Vf {
        return Err(bad("--variant", format!("{} has no VF", a.variant)));
    }
    if !(1..=64).contains(&a.guests) || a.rounds == 0 {
        return Err(bad("--guests/--rounds", "1..64 guests, at least one round"));
    }
    let (memory, app_size) = a.sandbox.bytes()?;
    let rt = Runtime::new(RuntimeConfig::networked(
        burstvm_bin(&a.burstvm_bin)?,
        a.guests,
        cgroup::Limits::for_guest(memory, app_size, a.sandbox.cpus),
    ))?;
    rt.prepare_variant(a.variant)?;
    let result = (|| -> Result<Vec<Outage>, Error> {
        let mut sandboxes = Vec::new();
        for i in 0..a.guests {
            let id = format!("{}restart-{i}", rt.sandbox_prefix());
            let spec = SandboxSpec {
                cpus: a.sandbox.cpus,
                app_size,
                keep_running: true,
                echo: true,
                ..SandboxSpec::new(id, a.variant, memory, a.timeout)
            };
            sandboxes.push(Sandbox::start(&rt, spec)?);
        }
        let mut outages = Vec::new();
        for r in 1..=a.rounds {
            let o = round(&rt, &mut sandboxes, Duration::from_secs(a.timeout))?;
            eprintln!(
                "round {r}: NIC restarted in {:.1} ms; guests resumed {} ms after the kill",
                ms(o.nic_restart),
                o.guests
                    .iter()
                    .map(|g| format!("{:.0}", ms(g.0)))
                    .collect::<Vec<_>>()
                    .join("/")
            );
            outages.push(o);
        }
        for sb in &sandboxes {
            for l in sb
                .vf_incidents()
                .iter()
                .filter(|l| l.contains("reconnected"))
            {
                tracing::info!("{l}");
            }
        }
        for mut sb in sandboxes {
            sb.teardown()?;
        }
        Ok(outages)
    })();
    let lc = leaks::check(&rt, Duration::from_secs(5));
    let outages = result?;
    println!(
        "nic-restart bench: {} guests ({}), {} rounds: NIC daemon SIGKILLed and restarted at once",
        a.guests, a.variant, a.rounds
    );
    println!(
        "{:>5} {:>14} {:>12} {:>6} {:>17} {:>20} {:>16}",
        "round",
        "nic-restart ms",
        "nic cpu ms",
        "guest",
        "kill->resumed ms",
        "restart->resumed ms",
        "reconnect cpu ms"
    );
    for (r, o) in outages.iter().enumerate() {
        for (g, (k, u)) in o.guests.iter().enumerate() {
            println!(
                "{:>5} {:>14.1} {:>12.1} {:>6} {:>17.1} {:>20.1} {:>16.2}",
                r + 1,
                ms(o.nic_restart),
                ms(o.nic_cpu),
                g,
                ms(*k),
                ms(*u),
                ms(o.vmm_cpu)
            );
        }
    }
    let all = |f: &dyn Fn(&(Duration, Duration)) -> Duration| {
        median(
            &mut outages
                .iter()
                .flat_map(|o| o.guests.iter().map(|g| ms(f(g))))
                .collect::<Vec<_>>(),
        )
    };
    println!(
        "median: nic-restart {:.1} ms, kill->resumed {:.1} ms, restart->resumed {:.1} ms",
        median(
            &mut outages
                .iter()
                .map(|o| ms(o.nic_restart))
                .collect::<Vec<_>>()
        ),
        all(&|g| g.0),
        all(&|g| g.1)
    );
    println!("{}", lc.describe());
    if !lc.is_clean() {
        return Err(Error::Leaks(lc.describe()));
    }
    Ok(())
}
