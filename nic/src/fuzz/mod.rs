//! Fuzz bodies of the NIC: what guests (descriptor chains, frames), VMMs
//! (vhost-user messages) and local clients (control requests) can send it.
//! Each `fuzz_*` takes arbitrary bytes and must neither panic nor hang; it
//! is called by the cargo-fuzz targets in `fuzz/` and, on stable, by tests
//! that replay the corpus in `fuzz/corpus/<target>/` (docs/fuzzing.md).
//! The entry points stay small (bytes in, nothing out) so that the
//! dataplane behind them can be rewritten without touching the targets.

mod control;
mod dataplane;
mod vhost_user;

pub use control::{control_seeds, fuzz_control_request};
pub use dataplane::{
    dataplane_seeds, fuzz_dataplane, DpInput, DP_HDR, DP_MEM, UPLINK_FRAMES, VF0_MAC,
};
pub use vhost_user::{fuzz_vhost_user, vhost_user_seeds};

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

pub(super) fn memfd(name: &str, size: u64) -> File {
    let fd = nix::sys::memfd::memfd_create(
        &std::ffi::CString::new(name).expect("no NUL"),
        nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
    )
    .expect("memfd_create");
    let f = File::from(fd);
    f.set_len(size).expect("memfd size");
    f
}

/// A directory on tmpfs if there is one (every request rewrites the state file).
pub(super) fn scratch_dir(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let base = if std::path::Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    base.join(format!(
        "burstvm-fuzz-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

#[cfg(test)]
mod tests {
    use super::dataplane::dp_memory;
    use super::*;
    use crate::port::{RXQ, TXQ};
    use vm_memory::{Bytes, GuestAddress};

    fn used_idx(q: usize, seed: &[u8]) -> u16 {
        let d = DpInput::decode(seed);
        let g = dp_memory().lock().unwrap();
        let mem = g.as_ref().unwrap();
        mem.gm
            .read_obj::<u16>(GuestAddress(d.rings[q][2] as u64 + 2))
            .unwrap()
    }

    /// The harness is not vacuous: the hand-made chains really move frames.
    #[test]
    fn dataplane_seeds_move_frames_and_faults_stop_them() {
        let seeds = dataplane_seeds();
        let _serial = dp_memory(); // one memory for all: run these in order
        fuzz_dataplane(&seeds[0]);
        assert_eq!(used_idx(TXQ, &seeds[0]), 1, "one frame sent");
        fuzz_dataplane(&seeds[1]);
        assert_eq!(
            used_idx(TXQ, &seeds[1]),
            1,
            "one three-descriptor frame sent"
        );
        fuzz_dataplane(&seeds[3]);
        assert_eq!(used_idx(TXQ, &seeds[3]), 2, "batch of 2 of 5 chains");
        // Indirect: refused without the feature (no used entry), used with it.
        let indirect = seeds.len() - 11;
        fuzz_dataplane(&seeds[indirect]);
        assert_eq!(used_idx(TXQ, &seeds[indirect]), 0);
        fuzz_dataplane(&seeds[indirect + 1]);
        assert_eq!(used_idx(TXQ, &seeds[indirect + 1]), 1);
        // Receive: three uplink frames, two posted buffers.
        let rx = indirect + 3;
        fuzz_dataplane(&seeds[rx]);
        assert_eq!(used_idx(RXQ, &seeds[rx]), 2);
        let g = dp_memory().lock().unwrap();
        let mut mac = [0u8; 6];
        g.as_ref()
            .unwrap()
            .gm
            .read_slice(&mut mac, GuestAddress(0x9000 + 12))
            .unwrap();
        assert_eq!(mac, VF0_MAC, "frame written after the header");
    }
}
