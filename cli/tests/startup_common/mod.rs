// Set-up shared by the runtime tests that boot sandboxes through `burstvm run`
// and `bench startup` (runtime_startup.rs, runtime_lifecycle.rs; included with
// `mod`): one VM test at a time, a test's own directory, the host resources a
// runtime creates (to check nothing is left), and reading a stage trace.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde_json::Value;

/// The tests start many VMs on a 2-core machine: one at a time.
pub static SERIAL: Mutex<()> = Mutex::new(());

pub const ALL_VARIANTS: &str =
    "no-net,tap,vanilla,fastiov,fastiov-L,fastiov-S,fastiov-D,fastiov-A,pre10,pre50,pre100,window";

pub fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("burstvm-rt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The `summary.json` a `bench startup --out OUT` wrote.
pub fn read_summary(out: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap()
}

/// What runtimes create (names starting with `bv`, cgroups also `pool-`):
/// netns, cpu cgroups, and `burstvm vmm --sandbox bv…` processes. Other
/// tests on the host use other names.
pub fn host_state() -> (HashSet<String>, HashSet<String>, usize) {
    let list = |p: &str| -> HashSet<String> {
        std::fs::read_dir(p)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter_map(|e| e.file_name().into_string().ok())
                    .filter(|n| n.starts_with("bv") || n.starts_with("pool-"))
                    .collect()
            })
            .unwrap_or_default()
    };
    let vmms = runtime::leaks::vmm_processes("bv").len();
    (list("/run/netns"), list("/sys/fs/cgroup/cpu/burstvm"), vmms)
}

pub fn assert_nothing_new(before: &(HashSet<String>, HashSet<String>, usize)) {
    let after = host_state();
    let new_ns: Vec<_> = after.0.difference(&before.0).collect();
    let new_cg: Vec<_> = after.1.difference(&before.1).collect();
    assert!(new_ns.is_empty(), "netns left: {new_ns:?}");
    assert!(new_cg.is_empty(), "cgroups left: {new_cg:?}");
    assert_eq!(after.2, 0, "burstvm vmm processes left");
}

pub struct Trace {
    /// sandbox -> stage -> (start, end)
    pub by_sandbox: BTreeMap<String, BTreeMap<String, (u64, u64)>>,
}

pub fn read_trace(path: &Path) -> Trace {
    let mut by_sandbox: BTreeMap<String, BTreeMap<String, (u64, u64)>> = BTreeMap::new();
    for line in std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.is_empty())
    {
        let v: Value = serde_json::from_str(line).unwrap();
        let sb = v["sandbox"].as_str().unwrap().to_string();
        let st = v["stage"].as_str().unwrap().to_string();
        let span = (
            v["start_ns"].as_u64().unwrap(),
            v["end_ns"].as_u64().unwrap(),
        );
        assert!(span.0 <= span.1, "{line}");
        assert!(
            by_sandbox.entry(sb).or_default().insert(st, span).is_none(),
            "stage twice: {line}"
        );
    }
    Trace { by_sandbox }
}

/// The stages every sandbox of `variant` must have, in their order.
pub fn expected(variant: &str) -> Vec<&'static str> {
    let net = variant != "no-net";
    let vf = net && variant != "tap";
    let dma_image = ["vanilla", "fastiov-S", "pre10", "pre50", "pre100"].contains(&variant);
    let mut v = vec!["cgroup", "netns"];
    if net {
        v.push("cni-add");
    }
    v.push("vmm-spawn");
    // `window`: the device maps only the DMA window, never guest RAM.
    let window = variant == "window";
    if vf && !window {
        v.push("dma-ram");
    }
    if dma_image {
        v.push("dma-image");
    }
    if window {
        v.push("dma-window");
    }
    if vf {
        v.push("vf-open");
    }
    v.push("boot");
    if net {
        v.push("vf-driver");
    }
    v.push("app-launch");
    // Async VF init: the agent's wait for the link is its own stage.
    if ["fastiov", "fastiov-L", "fastiov-S", "fastiov-D", "window"].contains(&variant) {
        v.push("vf-link");
    }
    v.push("ready");
    v
}

pub fn check_stage_order(variant: &str, sb: &str, st: &BTreeMap<String, (u64, u64)>) {
    let want = expected(variant);
    let got: Vec<&str> = st.keys().map(|s| s.as_str()).collect();
    let mut want_sorted = want.clone();
    want_sorted.sort();
    assert_eq!(got, want_sorted, "{variant} sandbox {sb}: stages present");
    let s = |n: &str| st[n];
    // The runtime's own stages run one after the other, then the VMM's.
    let host: Vec<&str> = want
        .iter()
        .copied()
        .take_while(|n| *n != "vmm-spawn")
        .collect();
    for w in host.windows(2) {
        assert!(
            s(w[0]).1 <= s(w[1]).0,
            "{variant} {sb}: {} before {}",
            w[0],
            w[1]
        );
    }
    assert!(
        s(host[host.len() - 1]).1 <= s("vmm-spawn").0,
        "{variant} {sb}: vmm-spawn after host stages"
    );
    let mut prev = s("vmm-spawn").1;
    for d in ["dma-ram", "dma-image", "dma-window"] {
        if st.contains_key(d) {
            assert!(prev <= s(d).0, "{variant} {sb}: {d} in order");
            prev = s(d).1;
        }
    }
    assert!(
        prev <= s("boot").0,
        "{variant} {sb}: boot after memory setup"
    );
    assert!(
        s("boot").1 <= s("app-launch").0,
        "{variant} {sb}: app-launch after boot"
    );
    if st.contains_key("vf-driver") {
        assert!(
            s("boot").1 <= s("vf-driver").0,
            "{variant} {sb}: vf-driver after boot"
        );
    }
    if st.contains_key("vf-open") {
        let sync = ["vanilla", "fastiov-A", "pre10", "pre50", "pre100"].contains(&variant);
        if sync {
            assert!(
                s("vf-open").1 <= s("boot").0,
                "{variant} {sb}: sync VF open before the vCPU starts"
            );
        }
        // Async: launched before the vCPU, finished in the background; its
        // thread may be scheduled after the vCPU, so no order with boot.
        assert!(
            s("vf-open").1 <= s("ready").1,
            "{variant} {sb}: VF open before the first packet"
        );
    }
    if st.contains_key("vf-link") {
        assert!(
            s("app-launch").1 <= s("vf-link").0 && s("vf-link").1 <= s("ready").0,
            "{variant} {sb}: the link wait between app-launch and ready"
        );
    }
    let last = st.values().map(|v| v.1).max().unwrap();
    assert_eq!(s("ready").1, last, "{variant} {sb}: ready ends last");
}
