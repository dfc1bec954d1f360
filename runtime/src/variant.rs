//! Variants: one name selects every startup policy (docs/design.md, "Variants").
//! The policy table lives here and nowhere else.

use std::fmt;
use std::str::FromStr;

/// How the NIC daemon serialises VF opens inside a devset (`burstvm nic --devset-lock`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevsetLock {
    /// One mutex per devset (the vanilla VFIO driver).
    Global,
    /// Devset rwlock plus one mutex per VF (FastIOV's lock decomposition).
    Hierarchical,
}

impl DevsetLock {
    pub fn as_arg(self) -> &'static str {
        match self {
            Global => "global",
            Hierarchical => "hierarchical",
        }
    }
}

/// The DMA window of the `window` variant: the built-in agent's rings and
/// packet buffers take 7 pages (two 8-entry queues, eight 2 KiB receive
/// buffers, one transmit page), twice that after a device reset; 128 KiB
/// holds both with room. Every page of it is zeroed and mapped for the
/// device at start, so it is no larger than that.
pub const DMA_WINDOW_BYTES: u64 = 128 << 10;

/// The DMA window of a Linux guest: its restricted swiotlb pool, through
/// which virtio-net bounces every frame. Each mapping takes whole 2 KiB
/// slots: 256 posted receive buffers take 512 KiB, the two rings 24 KiB,
/// and transmit bursts the rest.
pub const LINUX_DMA_WINDOW_BYTES: u64 = 2 << 20;

/// The DMA window of a `window` sandbox: `DMA_WINDOW_BYTES` for the
/// built-in agent, `LINUX_DMA_WINDOW_BYTES` for a Linux guest, or one
/// 2 MiB page when its memory is hugetlb-backed (the window's granule then).
pub fn dma_window_bytes(hugepages: bool, linux: bool) -> u64 {
    match (hugepages, linux) {
        (_, true) => LINUX_DMA_WINDOW_BYTES,
        (true, false) => 2 << 20,
        (false, false) => DMA_WINDOW_BYTES,
    }
}

/// The sandbox's network attachment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetKind {
    None,
    /// virtio-net over a tap (software CNI baseline).
    Tap,
    /// A VF of the software SR-IOV NIC via the burstvm-cni plugin.
    Vf,
}

/// Everything a variant decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub devset_lock: Option<DevsetLock>,
    pub dma_ram: bool,
    pub dma_image: bool,
    /// The device maps only a small window (`burstvm vmm --dma-window`)
    /// where the built-in agent keeps its rings and packet buffers; guest
    /// RAM stays private to the VMM (issue 27 §2).
    pub dma_window: bool,
    /// `burstvm vmm --memory-policy` value.
    pub memory_policy: &'static str,
    /// `burstvm vmm --vf-init` value (None: no VF).
    pub vf_init: Option<&'static str>,
    pub net: NetKind,
}

impl Policy {
    /// Whether the VMM takes its memory from the runtime's page pool.
    /// Fresh-memory policies (`vanilla`) do not; every other policy does.
    pub fn uses_pool(&self) -> bool {
        self.memory_policy != "vanilla"
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Variant {
    NoNet,
    Tap,
    Vanilla,
    Fastiov,
    FastiovL,
    FastiovS,
    FastiovD,
    FastiovA,
    Pre10,
    Pre50,
    Pre100,
    Window,
}

use DevsetLock::{Global, Hierarchical};

/// (variant, name, policy): the table of docs/design.md as data.
const TABLE: [(Variant, &str, Policy); 12] = [
    (
        Variant::NoNet,
        "no-net",
        p(None, false, false, "vanilla", None, NetKind::None),
    ),
    (
        Variant::Tap,
        "tap",
        p(None, false, false, "vanilla", None, NetKind::Tap),
    ),
    (
        Variant::Vanilla,
        "vanilla",
        p(
            Some(Global),
            true,
            true,
            "vanilla",
            Some("sync"),
            NetKind::Vf,
        ),
    ),
    (
        Variant::Fastiov,
        "fastiov",
        p(
            Some(Hierarchical),
            true,
            false,
            "lazy",
            Some("async"),
            NetKind::Vf,
        ),
    ),
    (
        Variant::FastiovL,
        "fastiov-L",
        p(
            Some(Global),
            true,
            false,
            "lazy",
            Some("async"),
            NetKind::Vf,
        ),
    ),
    (
        Variant::FastiovS,
        "fastiov-S",
        p(
            Some(Hierarchical),
            true,
            true,
            "lazy",
            Some("async"),
            NetKind::Vf,
        ),
    ),
    (
        Variant::FastiovD,
        "fastiov-D",
        p(
            Some(Hierarchical),
            true,
            false,
            "vanilla",
            Some("async"),
            NetKind::Vf,
        ),
    ),
    (
        Variant::FastiovA,
        "fastiov-A",
        p(
            Some(Hierarchical),
            true,
            false,
            "lazy",
            Some("sync"),
            NetKind::Vf,
        ),
    ),
    (
        Variant::Pre10,
        "pre10",
        p(Some(Global), true, true, "pre10", Some("sync"), NetKind::Vf),
    ),
    (
        Variant::Pre50,
        "pre50",
        p(Some(Global), true, true, "pre50", Some("sync"), NetKind::Vf),
    ),
    (
        Variant::Pre100,
        "pre100",
        p(
            Some(Global),
            true,
            true,
            "pre100",
            Some("sync"),
            NetKind::Vf,
        ),
    ),
    (
        Variant::Window,
        "window",
        // Guest RAM fresh and never device-mapped (as no-net's); the window
        // is fresh too, so nothing is zeroed ahead or recycled for it.
        Policy {
            dma_window: true,
            ..p(
                Some(Hierarchical),
                false,
                false,
                "vanilla",
                Some("async"),
                NetKind::Vf,
            )
        },
    ),
];

const fn p(
    devset_lock: Option<DevsetLock>,
    dma_ram: bool,
    dma_image: bool,
    memory_policy: &'static str,
    vf_init: Option<&'static str>,
    net: NetKind,
) -> Policy {
    Policy {
        devset_lock,
        dma_ram,
        dma_image,
        dma_window: false,
        memory_policy,
        vf_init,
        net,
    }
}

impl Variant {
    pub const ALL: [Variant; 12] = [
        Variant::NoNet,
        Variant::Tap,
        Variant::Vanilla,
        Variant::Fastiov,
        Variant::FastiovL,
        Variant::FastiovS,
        Variant::FastiovD,
        Variant::FastiovA,
        Variant::Pre10,
        Variant::Pre50,
        Variant::Pre100,
        Variant::Window,
    ];

    fn row(self) -> &'static (Variant, &'static str, Policy) {
        TABLE
            .iter()
            .find(|r| r.0 == self)
            .expect("every variant has a row in TABLE")
    }

    pub fn name(self) -> &'static str {
        self.row().1
    }

    pub fn policy(self) -> Policy {
        self.row().2
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown variant {0:?} (expected one of: no-net, tap, vanilla, fastiov, fastiov-L, fastiov-S, fastiov-D, fastiov-A, pre10, pre50, pre100, window)")]
pub struct UnknownVariant(pub String);

impl FromStr for Variant {
    type Err = UnknownVariant;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TABLE
            .iter()
            .find(|r| r.1.eq_ignore_ascii_case(s))
            .map(|r| r.0)
            .ok_or_else(|| UnknownVariant(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_table_is_complete() {
        for v in Variant::ALL {
            assert_eq!(v.name().parse::<Variant>().unwrap(), v);
        }
        assert_eq!("FASTIOV-s".parse::<Variant>().unwrap(), Variant::FastiovS);
        assert!("fastiov-X".parse::<Variant>().is_err());
        assert_eq!(TABLE.len(), Variant::ALL.len());
    }

    #[test]
    fn ablations_differ_from_fastiov_in_exactly_one_policy() {
        let f = Variant::Fastiov.policy();
        let diff = |o: Policy| {
            [
                o.devset_lock != f.devset_lock,
                o.dma_image != f.dma_image,
                o.memory_policy != f.memory_policy,
                o.vf_init != f.vf_init,
            ]
        };
        assert_eq!(
            diff(Variant::FastiovL.policy()),
            [true, false, false, false]
        );
        assert_eq!(
            diff(Variant::FastiovS.policy()),
            [false, true, false, false]
        );
        assert_eq!(
            diff(Variant::FastiovD.policy()),
            [false, false, true, false]
        );
        assert_eq!(
            diff(Variant::FastiovA.policy()),
            [false, false, false, true]
        );
    }

    #[test]
    fn pool_use_follows_memory_policy() {
        assert!(!Variant::Vanilla.policy().uses_pool());
        assert!(Variant::Fastiov.policy().uses_pool());
        assert!(Variant::Pre50.policy().uses_pool());
        assert!(!Variant::NoNet.policy().uses_pool());
    }
}
