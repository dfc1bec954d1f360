//! The startup stages a sandbox of a variant goes through, in order (the
//! names of /work/shared/ARCHITECTURE.md's stage table): what the trace of a
//! ready sandbox holds, and what a failed sandbox's first missing stage is
//! looked up in.

use trace::Stage;

use crate::variant::{NetKind, Variant};

/// The stages a sandbox of `variant` goes through, in order (`rootfs`:
/// it has a root filesystem).
pub fn expected_stages(variant: Variant, rootfs: bool) -> Vec<Stage> {
    expected_stages_with(variant, rootfs, false)
}

/// `expected_stages` of a sandbox that claimed (`pooled`) its network from
/// the network pool: `net-claim` instead of `netns` and `cni-add`.
pub fn expected_stages_with(variant: Variant, rootfs: bool, pooled: bool) -> Vec<Stage> {
    let p = variant.policy();
    let mut v = vec![Stage::Cgroup];
    if pooled {
        v.push(Stage::NetClaim);
    } else {
        v.push(Stage::Netns);
        if p.net != NetKind::None {
            v.push(Stage::CniAdd);
        }
    }
    if rootfs {
        v.push(Stage::Rootfs);
    }
    v.push(Stage::VmmSpawn);
    if p.dma_ram {
        v.push(Stage::DmaRam);
    }
    if p.dma_image {
        v.push(Stage::DmaImage);
    }
    if p.dma_window {
        v.push(Stage::DmaWindow);
    }
    if p.net == NetKind::Vf {
        v.push(Stage::VfOpen);
    }
    v.push(Stage::Boot);
    if p.net != NetKind::None {
        v.push(Stage::VfDriver);
    }
    v.push(Stage::AppLaunch);
    if p.net != NetKind::None && p.vf_init == Some("async") {
        v.push(Stage::VfLink);
    }
    v.push(Stage::Ready);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_stages_follow_the_policy() {
        let f = expected_stages(Variant::Fastiov, false);
        assert!(!f.contains(&Stage::DmaImage) && f.contains(&Stage::VfOpen));
        assert!(!f.contains(&Stage::Rootfs));
        assert!(expected_stages(Variant::FastiovS, false).contains(&Stage::DmaImage));
        let n = expected_stages(Variant::NoNet, true);
        assert!(!n.contains(&Stage::CniAdd) && !n.contains(&Stage::VfDriver));
        assert_eq!(n[2], Stage::Rootfs);
        let t = expected_stages(Variant::Tap, false);
        assert!(t.contains(&Stage::CniAdd) && !t.contains(&Stage::VfOpen));
        assert_eq!(f.first(), Some(&Stage::Cgroup));
        assert_eq!(f.last(), Some(&Stage::Ready));
        let w = expected_stages(Variant::Window, false);
        assert!(
            w.contains(&Stage::DmaWindow)
                && !w.contains(&Stage::DmaRam)
                && w.contains(&Stage::VfOpen)
        );
    }
}
