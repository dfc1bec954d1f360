//! Canary with the real guest agent: pool memory full of a previous tenant's bytes is
//! given to `burstvm vmm` under lazy, pre50 and vanilla; the agent (probe mode) reads
//! addresses all over RAM and never sees a canary byte, and the boot info the VMM wrote
//! (instant-zero list) is intact.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::process::Command;
use std::sync::Arc;

use guestmem::pool::{Pool, PoolServer, SizeClass};

const BIN: &str = env!("CARGO_BIN_EXE_burstvm");
const CANARY: u32 = 0xA5A5_A5A5;
const BOOTINFO_MAGIC: u64 = 0x4255_5253_544d_5631;
/// Boot info, then addresses the agent never writes (free RAM above its first MiB).
const PROBES: [u64; 8] = [
    0x7000, 0x20_0000, 0x30_0008, 0x100_0000, 0x200_0ff8, 0x280_0000, 0x3f0_0000, 0x3ff_fff8,
];

fn probe(policy: &str) -> (Vec<u64>, guestmem::pool::PoolStats) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("pool.sock");
    let pool = Arc::new(Pool::new(None));
    pool.fill(
        SizeClass {
            size: 64 << 20,
            hugepages: false,
        },
        1,
        Some(0xA5),
    )
    .unwrap();
    let server = PoolServer::start_with(&sock, pool.clone(), false).unwrap();
    let list: Vec<String> = PROBES.iter().map(|a| format!("{a:#x}")).collect();
    let out = Command::new(BIN)
        .args([
            "vmm",
            "--sandbox",
            &format!("gm-probe-{policy}"),
            "--memory",
            "64M",
        ])
        .args([
            "--memory-policy",
            policy,
            "--dma-ram",
            "true",
            "--pool-socket",
        ])
        .arg(&sock)
        .args(["--probe", &list.join(","), "--timeout", "120"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{policy}: vmm failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let words: Vec<u32> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("value "))
        .map(|l| {
            let hex = l
                .split_whitespace()
                .nth(1)
                .unwrap()
                .trim_start_matches("0x");
            u32::from_str_radix(hex, 16).unwrap()
        })
        .collect();
    assert_eq!(words.len(), 2 * PROBES.len(), "{policy}: {stdout}");
    assert!(
        !words.contains(&CANARY),
        "{policy}: guest read old bytes: {stdout}"
    );
    let values = words
        .chunks(2)
        .map(|w| w[0] as u64 | (w[1] as u64) << 32)
        .collect();
    // The VMM's connection is closed once it exited: its memory is back, marked dirty.
    let t = std::time::Instant::now();
    while server.clients() > 0 {
        assert!(t.elapsed().as_secs() < 10, "vmm connection never closed");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let stats = pool.stats();
    server.shutdown();
    (values, stats)
}

#[test]
fn agent_never_reads_a_previous_tenants_bytes() {
    for policy in ["lazy", "pre50", "vanilla"] {
        let (values, stats) = probe(policy);
        assert_eq!(values[0], BOOTINFO_MAGIC, "{policy}: boot info wiped");
        assert!(values[1..].iter().all(|v| *v == 0), "{policy}: {values:x?}");
        assert_eq!(stats.lent_memfds, 0, "{policy}");
        if policy == "vanilla" {
            assert_eq!(stats.hits, 0, "vanilla memory must be fresh");
        } else {
            assert_eq!(stats.hits, 1, "{policy}: the canary memory was not used");
        }
    }
}
