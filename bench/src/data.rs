//! Element types, the reference data every point is checked against, and
//! the parallel loops that generate and check it.

use crate::kinds::Op;
use crate::units::MIB;
use cuda_peer::Element;
use half::bf16;
use rand::Rng;
use std::mem::MaybeUninit;
use std::ops::Range;

/// Outputs up to this size are checked element by element; larger ones by windows.
pub(crate) const FULL_CHECK_BYTES: usize = 64 * MIB;
/// Elements per checked window.
pub(crate) const WINDOW: usize = 4096;
/// Windows per checked output above [`FULL_CHECK_BYTES`].
pub(crate) const WINDOWS: usize = 256;

/// An element type of the sweep: small integers are exact in it.
pub(crate) trait BenchElem: Element + cudarc::nccl::NcclType {
    fn from_int(v: i64) -> Self;
    fn to_f64(self) -> f64;
    /// Largest input magnitude for which every partial sum over `ranks` inputs is exact.
    fn input_range(ranks: usize) -> i64;
}

impl BenchElem for f32 {
    fn from_int(v: i64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn input_range(_ranks: usize) -> i64 {
        8 // |sum| <= 8N, exact far beyond any rank count
    }
}

impl BenchElem for bf16 {
    fn from_int(v: i64) -> Self {
        bf16::from_f32(v as f32)
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn input_range(ranks: usize) -> i64 {
        (128 / ranks as i64).clamp(1, 4) // |sum| <= 128: integers up to 256 are exact in bf16
    }
}

/// splitmix64's finaliser.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The inputs of one point: every rank's element i is a function of a fresh
/// random seed, so the reference is computed on the fly, never stored.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Inputs {
    pub(crate) seed: u64,
    pub(crate) range: i64,
}

impl Inputs {
    pub(crate) fn fresh(range: i64) -> Inputs {
        Inputs { seed: rand::rng().random(), range }
    }

    /// Rank `rank`'s element `i`: an integer in `-range..=range`.
    pub(crate) fn value(&self, rank: usize, i: usize) -> i64 {
        let h = mix(self.seed.wrapping_add(((rank as u64) << 40) | i as u64));
        (h % (2 * self.range as u64 + 1)) as i64 - self.range
    }

    /// The correct output element `i` of rank `rank` (root 0 for broadcast;
    /// `block` is the per-rank block of reduce_scatter and all_gather).
    pub(crate) fn expected(&self, op: Op, ranks: usize, block: usize, rank: usize, i: usize) -> i64 {
        match op {
            Op::AllReduce => (0..ranks).map(|q| self.value(q, i)).sum(),
            Op::ReduceScatter => (0..ranks).map(|q| self.value(q, rank * block + i)).sum(),
            Op::AllGather => self.value(i / block, i % block),
            Op::Broadcast => self.value(0, i),
        }
    }
}

pub(crate) fn threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(32)
}

/// `(0..len).map(f).collect()`, on every core.
pub(crate) fn par_vec<T: Send>(len: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(len);
    let chunk = len.div_ceil(threads()).max(1 << 16);
    std::thread::scope(|s| {
        for (k, part) in v.spare_capacity_mut()[..len].chunks_mut(chunk).enumerate() {
            let f = &f;
            s.spawn(move || {
                for (j, slot) in part.iter_mut().enumerate() {
                    *slot = MaybeUninit::new(f(k * chunk + j));
                }
            });
        }
    });
    // SAFETY: the threads above wrote every one of the first `len` slots.
    unsafe { v.set_len(len) };
    v
}

/// How many `i` in `0..len` have `bad(i)`, on every core.
pub(crate) fn par_count(len: usize, bad: impl Fn(usize) -> bool + Sync) -> u64 {
    let chunk = len.div_ceil(threads()).max(1 << 16);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..len.div_ceil(chunk))
            .map(|k| {
                let bad = &bad;
                s.spawn(move || (k * chunk..((k + 1) * chunk).min(len)).filter(|&i| bad(i)).count() as u64)
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("checker thread")).sum()
    })
}

/// The element ranges of an output of `len` elements that are checked:
/// all of it up to 64 MiB, else 256 evenly spaced windows of 4096 elements
/// (about 1M elements, the first window at the start and the last at the end).
pub(crate) fn check_windows(len: usize, esz: usize) -> Vec<Range<usize>> {
    if len * esz <= FULL_CHECK_BYTES || len <= WINDOW * WINDOWS {
        return std::iter::once(0..len).collect();
    }
    let last = len - WINDOW;
    (0..WINDOWS).map(|k| k * last / (WINDOWS - 1)).map(|s| s..s + WINDOW).collect()
}
