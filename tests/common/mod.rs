//! Shared helpers for the GPU-gated integration tests.
#![allow(dead_code)]

use cuda_peer::cudarc::driver::CudaContext;
use rand::Rng;
use std::sync::Arc;

/// Whether GPU tests must fail rather than skip (`CUDA_PEER_REQUIRE_GPU=1`).
pub fn required() -> bool {
    std::env::var("CUDA_PEER_REQUIRE_GPU").map(|v| v == "1").unwrap_or(false)
}

/// Contexts for the first `min` devices, or `None` after printing why the
/// test is skipped. With `CUDA_PEER_REQUIRE_GPU=1` a missing device panics.
pub fn gpus(test: &str, min: usize) -> Option<Vec<Arc<CudaContext>>> {
    // libtest names each test's thread after the test (`main` when it runs
    // on the main thread): that name, where there is one, is the one to show.
    let current = std::thread::current();
    let test = current.name().filter(|n| *n != "main").unwrap_or(test);
    let why = match cuda_peer::driver::device_count() {
        Ok(n) if n >= min => return Some((0..n).map(|i| cuda_peer::driver::context(i).expect("context")).collect()),
        Ok(n) => format!("needs {min} CUDA device(s), found {n}"),
        Err(e) => format!("no CUDA driver: {e}"),
    };
    if required() {
        panic!("{test}: CUDA_PEER_REQUIRE_GPU=1 but {why}");
    }
    // Written to the stderr handle directly, so libtest's capture does not hide it.
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
    None
}

/// Fresh random bytes.
pub fn random_bytes(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rand::rng().fill(&mut v[..]);
    v
}

/// Index of the first differing element and the count of differences.
pub fn diff<T: PartialEq>(a: &[T], b: &[T]) -> Option<(usize, usize)> {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let wrong: Vec<usize> = a.iter().zip(b).enumerate().filter(|(_, (x, y))| x != y).map(|(i, _)| i).collect();
    wrong.first().map(|&f| (f, wrong.len()))
}
pub mod num;
pub mod procs;
