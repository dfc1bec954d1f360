//! The critical path of one sandbox's startup, derived from its trace events
//! (FastIOV §6.3 counts stage shares of the path, not of summed stage time).
//!
//! Walking back from the end of the last stage, the path at each instant is
//! the stage that ends latest among those that started before it; the part
//! of a stage hidden under a later-ending one (e.g. the VMM's `vf-open`
//! running while the guest boots) is off the path: it *overlaps*. Time that
//! no stage covers (queueing before the first stage, gaps between stages) is
//! booked as `wait`. The on-path times plus the wait sum exactly to the
//! end-to-end time.

use std::collections::BTreeMap;

use trace::{Stage, TraceEvent};

/// One sandbox's end-to-end time split along its critical path.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CriticalPath {
    /// On-path nanoseconds per stage.
    pub on_path: BTreeMap<Stage, u64>,
    /// Nanoseconds no stage covers, from `origin` to the last end.
    pub wait_ns: u64,
}

impl CriticalPath {
    pub fn total_ns(&self) -> u64 {
        self.on_path.values().sum::<u64>() + self.wait_ns
    }
}

/// The critical path of one sandbox's `events`, from `origin_ns` (the issue
/// instant; clamped to the first start) to the last end.
pub fn critical_path(events: &[&TraceEvent], origin_ns: u64) -> CriticalPath {
    let mut cp = CriticalPath::default();
    let Some(end) = events.iter().map(|e| e.end_ns).max() else {
        return cp;
    };
    let first = events.iter().map(|e| e.start_ns).min().unwrap_or(end);
    let origin = origin_ns.min(first);
    let mut used = vec![false; events.len()];
    let mut cur = end;
    while cur > first {
        // The latest-ending unused stage that started before `cur`; on a tie,
        // the one that started first (it covers more of the path).
        let pick = events
            .iter()
            .enumerate()
            .filter(|(i, e)| !used[*i] && e.start_ns < cur)
            .max_by_key(|(_, e)| (e.end_ns.min(cur), std::cmp::Reverse(e.start_ns)));
        let Some((i, e)) = pick else { break };
        used[i] = true;
        let top = e.end_ns.min(cur);
        cp.wait_ns += cur - top;
        *cp.on_path.entry(e.stage).or_insert(0) += top - e.start_ns;
        cur = e.start_ns;
    }
    cp.wait_ns += cur - origin;
    cp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(stage: Stage, s: u64, e: u64) -> TraceEvent {
        TraceEvent {
            sandbox: "a".into(),
            stage,
            start_ns: s,
            end_ns: e,
        }
    }

    fn path(evs: &[TraceEvent], origin: u64) -> CriticalPath {
        let refs: Vec<&TraceEvent> = evs.iter().collect();
        critical_path(&refs, origin)
    }

    #[test]
    fn sequential_stages_are_all_on_the_path() {
        let evs = [
            ev(Stage::Cgroup, 10, 12),
            ev(Stage::Netns, 12, 15),
            ev(Stage::Boot, 17, 30),
        ];
        let cp = path(&evs, 5);
        assert_eq!(cp.on_path[&Stage::Cgroup], 2);
        assert_eq!(cp.on_path[&Stage::Netns], 3);
        assert_eq!(cp.on_path[&Stage::Boot], 13);
        // 5 before the first stage, 2 between netns and boot.
        assert_eq!(cp.wait_ns, 7);
        assert_eq!(cp.total_ns(), 25);
    }

    #[test]
    fn overlapped_stages_are_clipped_or_off_the_path() {
        // vf-open runs inside boot; app-launch and an async vf-driver overlap,
        // the driver ending later; then the link wait and ready.
        let evs = [
            ev(Stage::VmmSpawn, 0, 10),
            ev(Stage::Boot, 10, 40),
            ev(Stage::VfOpen, 12, 30),
            ev(Stage::AppLaunch, 40, 50),
            ev(Stage::VfDriver, 45, 55),
            ev(Stage::VfLink, 55, 70),
            ev(Stage::Ready, 70, 71),
        ];
        let cp = path(&evs, 0);
        assert!(!cp.on_path.contains_key(&Stage::VfOpen));
        assert_eq!(cp.on_path[&Stage::VfDriver], 10);
        assert_eq!(
            cp.on_path[&Stage::AppLaunch],
            5,
            "clipped at the driver start"
        );
        assert_eq!(cp.on_path[&Stage::VfLink], 15);
        assert_eq!(cp.wait_ns, 0);
        assert_eq!(cp.total_ns(), 71);
    }

    #[test]
    fn empty_and_origin_after_first_start() {
        assert_eq!(path(&[], 0).total_ns(), 0);
        let cp = path(&[ev(Stage::Boot, 10, 20)], 15);
        assert_eq!(cp.total_ns(), 10);
        assert_eq!(cp.wait_ns, 0);
    }
}
