//! Shared helpers for the GPU-gated integration tests (docs/testing.md).
//!
//! Every skip, of a whole test or of part of it, goes through [`skipped`]:
//! a `SKIPPED <test>: <why>` line that libtest does not capture. The gate
//! is [`gpus`] (or [`gpu_count`], which opens no context): without any
//! usable GPU a test skips, or fails under `CUDA_PEER_REQUIRE_GPU=1`; with
//! fewer GPUs than it needs it skips, saying `needs N GPUs, M present`,
//! under `CUDA_PEER_REQUIRE_GPU=1` too (a one-GPU machine runs what it
//! can, and says what it cannot).
#![allow(dead_code)]

use cuda_peer::cudarc::driver::CudaContext;
use rand::Rng;
use std::sync::Arc;

pub mod bound;
pub mod fp8;
pub mod graph;
pub mod num;
pub mod procs;
pub mod ranks;
mod skip;

pub use skip::{skipped, test_name};

/// Whether a missing GPU fails the tests rather than skipping them
/// (`CUDA_PEER_REQUIRE_GPU=1`).
pub fn required() -> bool {
    std::env::var("CUDA_PEER_REQUIRE_GPU").map(|v| v == "1").unwrap_or(false)
}

/// The number of CUDA devices if there are at least `min`, else `None`
/// after saying why the test skips. No GPU at all (no driver, or no
/// device) panics under `CUDA_PEER_REQUIRE_GPU=1`; fewer than `min` (but
/// some) skips even then. Opens no context (for the parents of
/// multi-process tests).
pub fn gpu_count(test: &str, min: usize) -> Option<usize> {
    let why = match cuda_peer::driver::device_count() {
        Ok(n) if n >= min.max(1) => return Some(n),
        Ok(n) if n > 0 => {
            skipped(test, format!("needs {min} GPUs, {n} present"));
            return None;
        }
        Ok(_) => "no CUDA device".to_string(),
        Err(e) => format!("no CUDA driver: {e}"),
    };
    if required() {
        panic!("{}: CUDA_PEER_REQUIRE_GPU=1 but {why}", test_name(test));
    }
    skipped(test, why);
    None
}

/// Contexts for every device when there are at least `min` (see
/// [`gpu_count`] for what happens otherwise).
pub fn gpus(test: &str, min: usize) -> Option<Vec<Arc<CudaContext>>> {
    let n = gpu_count(test, min)?;
    Some((0..n).map(|i| cuda_peer::driver::context(i).expect("context")).collect())
}

/// Whether `present` GPUs are enough for the part `what` of a test that
/// needs `min`; if not, says so in a `SKIPPED` line naming the part.
pub fn has_gpus(test: &str, what: &str, present: usize, min: usize) -> bool {
    if present >= min {
        return true;
    }
    skipped(test, format!("{what} needs {min} GPUs, {present} present"));
    false
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

/// Chains of in-place sum all-reduces (wrapping u32) run back to back, that
/// stay exact and informative for any number of ranks.
///
/// After a sum every rank holds the same value `v`, and a plain next sum
/// gives `n * v`: with an even `n` each call multiplies the earlier calls'
/// errors by an even number, and after a few dozen calls they are gone
/// (`2^32` divides them) and the expected result is zero. So, before each
/// call but the first, on an even number of ranks, one rank's buffer (rank
/// `call % n`, so that it rotates) is refilled on the device, in stream
/// order, from a buffer of its own random values: the call then gives
/// `(n - 1) * v + refill`, an odd multiple plus a known term. On an odd
/// number of ranks nothing is refilled (`n * v`, `n` odd). Either way each
/// call is a bijection of the element values, so an error in any call
/// reaches the end unchanged in its effect (a missed call, a rank dropped,
/// a stale read, a call that wrote zeros), whatever the rank count. The one
/// output a chain does not carry is the refilled rank's previous one (its
/// buffer is overwritten): each rank's output is carried in all but one in
/// `n` calls, and every rank's last output is compared.
pub mod chain {
    use std::ops::Range;

    /// The rank whose buffer is refilled before call `call` (0-based) of a
    /// chain on `n` ranks, if any.
    pub fn refilled(n: usize, call: usize) -> Option<usize> {
        (call > 0 && n.is_multiple_of(2)).then_some(call % n)
    }

    /// One call of a chain: the elements it reduces, and the rank refilled
    /// first (from `refill[rank]`, the same elements).
    pub type Call = (Range<usize>, Option<usize>);

    /// The calls of a chain of `calls` calls over elements `range` on `n` ranks.
    pub fn calls(n: usize, range: Range<usize>, calls: usize) -> Vec<Call> {
        (0..calls).map(|k| (range.clone(), refilled(n, k))).collect()
    }

    /// Every rank's buffer after `calls`, from `start` (rank by rank),
    /// computed on the CPU. `defect(call, inputs, outputs)` may change a
    /// call's outputs (the CPU self-checks plant defects with it).
    pub fn simulate_with<F>(start: &[Vec<u32>], refill: &[Vec<u32>], calls: &[Call], defect: F) -> Vec<Vec<u32>>
    where
        F: Fn(usize, &[u32], &mut [u32]) + Sync,
    {
        let n = start.len();
        let count = start[0].len();
        let threads = std::thread::available_parallelism().map(|t| t.get()).unwrap_or(1).min(32);
        let per = count.div_ceil(threads).max(1 << 14);
        let parts: Vec<Vec<Vec<u32>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..count.div_ceil(per))
                .map(|part| {
                    let defect = &defect;
                    scope.spawn(move || {
                        let (lo, hi) = (part * per, ((part + 1) * per).min(count));
                        let mut out = vec![Vec::with_capacity(hi - lo); n];
                        let (mut v, mut next) = (vec![0u32; n], vec![0u32; n]);
                        for i in lo..hi {
                            for r in 0..n {
                                v[r] = start[r][i];
                            }
                            for (k, (range, refilled)) in calls.iter().enumerate() {
                                if !range.contains(&i) {
                                    continue;
                                }
                                if let Some(p) = *refilled {
                                    v[p] = refill[p][i];
                                }
                                let s = v.iter().fold(0u32, |a, &x| a.wrapping_add(x));
                                next.fill(s);
                                defect(k, &v, &mut next);
                                v.copy_from_slice(&next);
                            }
                            for r in 0..n {
                                out[r].push(v[r]);
                            }
                        }
                        out
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("chain simulation")).collect()
        });
        let mut all = vec![Vec::with_capacity(count); n];
        for part in parts {
            for (r, p) in part.into_iter().enumerate() {
                all[r].extend(p);
            }
        }
        all
    }

    /// [`simulate_with`] without defects.
    pub fn simulate(start: &[Vec<u32>], refill: &[Vec<u32>], calls: &[Call]) -> Vec<Vec<u32>> {
        simulate_with(start, refill, calls, |_, _, _| {})
    }

    /// Fails unless `want` is informative: not all zeros and not one value
    /// repeated (random inputs make at most a few elements collide).
    pub fn assert_informative(what: &str, want: &[u32]) {
        if want.len() < 2 {
            return;
        }
        let zeros = want.iter().filter(|&&x| x == 0).count();
        let same = want.iter().filter(|&&x| x == want[0]).count();
        assert!(zeros <= want.len() / 1000, "{what}: {zeros} of {} expected elements are zero: the chain lost its information", want.len());
        assert!(same <= want.len() / 1000 + 1, "{what}: {same} of {} expected elements equal the first: the chain lost its information", want.len());
    }
}
