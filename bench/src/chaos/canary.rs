//! Cross-tenant canaries. Every tenant gets a stream of UDP frames whose
//! payload is its own canary word (from the server netns, as any peer would
//! send it), so its receive buffers — guest memory the NIC writes — hold
//! bytes that name it, and its transmit buffer holds its request (its
//! sandbox id). A later tenant reads, in probe mode, the very buffers an
//! earlier tenant used (the agent's layout is fixed), before it sends
//! anything itself: it may find zeros or its own canary, nothing else. A
//! foreign canary, or any other byte where only a long payload can be, is a
//! byte of another tenant.

use std::collections::HashMap;
use std::net::{Ipv4Addr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// High 16 bits of every canary word.
const MAGIC: u64 = 0xca7a;
/// UDP port the frames go to (discard): the agent ignores them.
pub const CANARY_PORT: u16 = 9;
/// Words per frame: with the 2 pad bytes the payload ends 1080 bytes into
/// a receive buffer (12-byte virtio-net header + 42 bytes of headers).
const WORDS: usize = 128;
/// Interval between two frames to the same tenant.
const PERIOD: Duration = Duration::from_millis(40);

/// The canary word of `sandbox`: MAGIC, then 48 bits of FNV-1a of its id.
pub fn canary(sandbox: &str) -> u64 {
    let h = sandbox.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    MAGIC << 48 | (h & 0xffff_ffff_ffff)
}

fn is_canary(w: u64) -> bool {
    w >> 48 == MAGIC
}

/// The built-in agent's network buffers (guest/src/c/virtio_net.c): its
/// bump allocator for device-visible pages starts at the VMM's
/// RAM_FREE_START (1 MiB), or at the DMA window with one (the `window`
/// variant), with the RX ring page, the TX ring page, VQ_SIZE (8) receive
/// buffers of RX_BUF_SIZE (2048) bytes, then the transmit buffer page.
pub const AGENT_HEAP: u64 = 0x10_0000;
pub const VQ_SIZE: u64 = 8;
pub const RX_BUF_SIZE: u64 = 2048;

/// Where the device-visible pages of a sandbox of `variant` begin.
pub fn buffers_base(variant: runtime::Variant) -> u64 {
    if variant.policy().dma_window {
        vmm::DMA_WINDOW_ADDR
    } else {
        AGENT_HEAP
    }
}

fn rx_bufs(base: u64) -> u64 {
    base + 2 * 4096
}

fn tx_buf(base: u64) -> u64 {
    rx_bufs(base) + VQ_SIZE * RX_BUF_SIZE
}
/// Offsets in a receive buffer that only a long payload reaches (the
/// guest's own short frames — the echo reply, ARP — end before 256): canary
/// words when a canary frame was written there (aligned: 56 + 8k).
const RX_OFFSETS: [u64; 4] = [256, 520, 776, 1032];
/// Words of the transmit buffer: header and request (the tenant's sandbox
/// id) of whoever used it last; zero for a tenant that has not sent yet.
const TX_WORDS: u64 = 16;

/// Where a tenant whose buffers begin at `base` probes: 32 receive-buffer
/// words, 16 transmit-buffer words.
pub fn probe_addresses(base: u64) -> Vec<u64> {
    let mut v = Vec::new();
    for i in 0..VQ_SIZE {
        for o in RX_OFFSETS {
            v.push(rx_bufs(base) + i * RX_BUF_SIZE + o);
        }
    }
    v.extend((0..TX_WORDS).map(|j| tx_buf(base) + 8 * j));
    v
}

fn is_tx(base: u64, addr: u64) -> bool {
    (tx_buf(base)..tx_buf(base) + 4096).contains(&addr)
}

/// A byte of another tenant seen by `tenant`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Sighting {
    pub tenant: String,
    pub gpa: u64,
    pub word: u64,
    /// The tenant whose canary it is, when it is one of ours.
    pub owner: Option<String>,
}

/// What one tenant's probes showed.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Verdict {
    pub zero: usize,
    /// Its own canary: the probes point where frames land (the check works).
    pub own: usize,
    pub foreign: Vec<Sighting>,
}

/// Classifies `tenant`'s probe `values` at `probe_addresses(base)`; `known`
/// maps canary words to the tenants they belong to.
pub fn classify(tenant: &str, base: u64, values: &[u64], known: &HashMap<u64, String>) -> Verdict {
    let own = canary(tenant);
    let mut v = Verdict::default();
    for (&gpa, &w) in probe_addresses(base).iter().zip(values) {
        if w == 0 {
            v.zero += 1;
        } else if w == own && !is_tx(base, gpa) {
            v.own += 1;
        } else {
            v.foreign.push(Sighting {
                tenant: tenant.to_string(),
                gpa,
                word: w,
                owner: is_canary(w).then(|| known.get(&w).cloned()).flatten(),
            });
        }
    }
    v
}

/// The UDP payload of `sandbox`'s frames: 2 pad bytes, then its canary.
fn payload(sandbox: &str) -> Vec<u8> {
    let mut p = vec![0u8; 2];
    for _ in 0..WORDS {
        p.extend_from_slice(&canary(sandbox).to_le_bytes());
    }
    p
}

/// The IPAM leases (host-local's format): address → container id (the file named by the
/// address holds the id on its first line).
fn leases(dir: &Path) -> Vec<(Ipv4Addr, String)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .filter_map(|e| {
            let ip: Ipv4Addr = e.file_name().to_str()?.parse().ok()?;
            let text = std::fs::read_to_string(e.path()).ok()?;
            let id = text.lines().next()?.trim().to_string();
            (!id.is_empty()).then_some((ip, id))
        })
        .collect()
}

/// Sends every leased tenant its canary frames until stopped.
#[derive(Debug)]
pub struct Generator {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl Generator {
    /// Runs in the server netns (where the guests' neighbour entries are);
    /// the tenants are read from the IPAM lease directory each period.
    pub fn start(
        server_netns: &Path,
        lease_dir: PathBuf,
    ) -> Result<Generator, netutil::NetnsError> {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let (s, n) = (stop.clone(), sent.clone());
        let ns = netutil::Netns::open(server_netns)?;
        let thread = ns.spawn("canary", move || {
            let sock = match UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!("canary generator: bind: {e}");
                    return;
                }
            };
            let mut payloads: HashMap<String, Vec<u8>> = HashMap::new();
            while !s.load(Ordering::Relaxed) {
                for (ip, id) in leases(&lease_dir) {
                    let p = payloads.entry(id.clone()).or_insert_with(|| payload(&id));
                    // Errors (no neighbour yet, buffer full) only lose a frame.
                    if sock.send_to(p, (ip, CANARY_PORT)).is_ok() {
                        n.fetch_add(1, Ordering::Relaxed);
                    }
                }
                std::thread::sleep(PERIOD);
            }
        })?;
        Ok(Generator {
            stop,
            sent,
            thread: Some(thread),
        })
    }

    /// Stops it; returns how many frames it sent.
    pub fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.sent.load(Ordering::Relaxed)
    }
}

impl Drop for Generator {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_hit_canary_words_in_every_buffer() {
        let a = probe_addresses(AGENT_HEAP);
        assert_eq!(a.len(), 48);
        assert!(a.len() <= 64, "the agent reports at most 64 probes");
        // A canary frame in receive buffer i puts word k at buffer + 56 + 8k.
        for (n, &gpa) in a.iter().take(32).enumerate() {
            let off = (gpa - rx_bufs(AGENT_HEAP)) % RX_BUF_SIZE;
            assert_eq!((gpa - rx_bufs(AGENT_HEAP)) / RX_BUF_SIZE, n as u64 / 4);
            assert_eq!((off - 56) % 8, 0);
            assert!((off - 56) / 8 < WORDS as u64, "inside the payload");
        }
        assert_eq!(payload("x").len(), 2 + 8 * WORDS);
        // 12 + 14 + 20 + 8 + payload fits a receive buffer.
        assert!(54 + payload("x").len() as u64 <= RX_BUF_SIZE);
    }

    #[test]
    fn layout_matches_the_agent() {
        // The agent's constants, from its source (guest/src/c/virtio.h).
        let h = include_str!("../../../guest/src/c/virtio.h");
        let def = |name: &str| -> u64 {
            h.lines()
                .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} in virtio.h"))
        };
        assert_eq!(def("VQ_SIZE"), VQ_SIZE);
        assert_eq!(def("RX_BUF_SIZE"), RX_BUF_SIZE);
        assert_eq!(def("VNET_HDR_LEN"), 12);
        assert_eq!(AGENT_HEAP, vmm_ram_free_start());
        // The window variant's buffers are in its DMA window, laid out alike.
        assert_eq!(buffers_base(runtime::Variant::Fastiov), AGENT_HEAP);
        let w = buffers_base(runtime::Variant::Window);
        assert_eq!(w, vmm::DMA_WINDOW_ADDR);
        assert!(tx_buf(w) + 4096 - w <= runtime::variant::DMA_WINDOW_BYTES);
        assert_eq!(
            probe_addresses(w)[0] - w,
            probe_addresses(AGENT_HEAP)[0] - AGENT_HEAP
        );
    }

    fn vmm_ram_free_start() -> u64 {
        let l = include_str!("../../../vmm/src/layout.rs");
        let line = l
            .lines()
            .find(|l| l.contains("pub const RAM_FREE_START"))
            .expect("RAM_FREE_START");
        let hex = line.split("0x").nth(1).unwrap().trim_end_matches(';');
        u64::from_str_radix(&hex.replace('_', ""), 16).unwrap()
    }

    #[test]
    fn classification_names_foreign_bytes() {
        let addrs = probe_addresses(AGENT_HEAP);
        let mut known = HashMap::new();
        known.insert(canary("a"), "a".to_string());
        let mut vals = vec![0u64; addrs.len()];
        assert_eq!(classify("b", AGENT_HEAP, &vals, &known).foreign, vec![]);
        vals[0] = canary("b");
        vals[1] = canary("a");
        vals[40] = 0x6462_2d76_6240_0000; // bytes of a request in the TX buffer
        let v = classify("b", AGENT_HEAP, &vals, &known);
        assert_eq!(v.own, 1);
        assert_eq!(v.foreign.len(), 2);
        assert_eq!(v.foreign[0].owner.as_deref(), Some("a"));
        assert_eq!(v.foreign[1].owner, None);
        // Its own canary in the transmit buffer is not its own frame.
        let mut t = vec![0u64; addrs.len()];
        t[33] = canary("b");
        assert_eq!(classify("b", AGENT_HEAP, &t, &known).foreign.len(), 1);
    }
}
