//! Replays every committed input of every fuzz target (`fuzz/corpus/<target>/`:
//! hand-made seeds and the minimized crashes the fuzzers found) through the
//! same library functions the cargo-fuzz targets call, on stable Rust. A
//! crash found once stays fixed. docs/fuzzing.md says how to fuzz further.
//!
//! The seeds are also made by code (`*_seeds()` in each crate's `fuzz`
//! module); this test checks that each of them is in the corpus, and
//! `BURSTVM_WRITE_SEEDS=1` writes them there after a seed changed.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::path::{Path, PathBuf};

type Body = fn(&[u8]);

fn targets() -> Vec<(&'static str, Body, Vec<Vec<u8>>)> {
    vec![
        (
            "dataplane",
            nic::fuzz::fuzz_dataplane,
            nic::fuzz::dataplane_seeds(),
        ),
        ("mmio", vmm::fuzz::fuzz_mmio, vmm::fuzz::mmio_seeds()),
        ("vsock", vmm::fuzz::fuzz_vsock, vmm::fuzz::vsock_seeds()),
        (
            "vhost_user",
            nic::fuzz::fuzz_vhost_user,
            nic::fuzz::vhost_user_seeds(),
        ),
        (
            "control_request",
            nic::fuzz::fuzz_control_request,
            nic::fuzz::control_seeds(),
        ),
        (
            "cni_config",
            cni::fuzz::fuzz_config,
            cni::fuzz::config_seeds(),
        ),
        (
            "cni_server",
            cni::fuzz::fuzz_server_request,
            cni::fuzz::server_seeds(),
        ),
    ]
}

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target)
}

fn corpus(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|e| e.expect("corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let data = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, data)
        })
        .collect()
}

fn replay(target: &str) {
    let (_, body, seeds) = targets()
        .into_iter()
        .find(|t| t.0 == target)
        .expect("known target");
    let dir = corpus_dir(target);
    if std::env::var_os("BURSTVM_WRITE_SEEDS").is_some() {
        std::fs::create_dir_all(&dir).unwrap();
        for (k, s) in seeds.iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{k:03}")), s).unwrap();
        }
    }
    let files = corpus(&dir);
    for (k, s) in seeds.iter().enumerate() {
        assert!(
            files.iter().any(|(_, d)| d == s),
            "{target}: seed {k} is not in {} (BURSTVM_WRITE_SEEDS=1 writes it)",
            dir.display()
        );
    }
    for (path, data) in &files {
        // A panic names the input that caused it.
        let r = std::panic::catch_unwind(|| body(data));
        assert!(r.is_ok(), "{target}: {} crashes", path.display());
    }
    assert!(files.len() >= seeds.len());
}

#[test]
fn fuzz_corpus_dataplane() {
    replay("dataplane");
}

#[test]
fn fuzz_corpus_mmio() {
    replay("mmio");
}

#[test]
fn fuzz_corpus_vsock() {
    replay("vsock");
}

#[test]
fn fuzz_corpus_vhost_user() {
    replay("vhost_user");
}

#[test]
fn fuzz_corpus_control_request() {
    replay("control_request");
}

#[test]
fn fuzz_corpus_cni_config() {
    replay("cni_config");
}

#[test]
fn fuzz_corpus_cni_server() {
    replay("cni_server");
}
