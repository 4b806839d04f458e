//! Element types as numbers: CPU references, the kernels' arithmetic, and
//! the comparison of a reduction's result with its reference.
//!
//! The rule (docs/testing.md): integers, and float results whose every
//! partial result is exactly representable, must match exactly; other
//! float results must lie within [`float_bound`] of the f64 reference, the
//! largest error any order of binary steps can make, computed per element
//! from that element's inputs.
#![allow(dead_code)]

use cuda_peer::float8::{F8E4M3, F8E5M2};
use cuda_peer::{Element, ReduceOp};
use half::{bf16, f16};

/// An element type that holds small integers exactly (every cuda-peer type
/// does up to 127), converted through `f64` for CPU references.
pub trait Num: Element + Copy + std::fmt::Debug + PartialEq + Send + Sync {
    /// `x` in this type (rounded as `as` or `half` round).
    fn from_f64(x: f64) -> Self;
    /// This value as `f64`.
    fn to_f64(self) -> f64;
    /// Significand bits of a float type, its implicit bit included (24 for
    /// f32, 53 for f64, 11 for f16, 8 for bf16, 4 for E4M3, 3 for E5M2);
    /// `None` for integers.
    const BITS: Option<u32>;
    /// `op`'s binary step as the kernels compute it: integers wrap, f32 and
    /// f64 natively, f16 and bf16 in f32 rounded back to nearest, fp8 in
    /// f32 rounded to f16 and then to fp8 (`kernels/reduce.cu`). `Avg`
    /// sums.
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
    /// `x / n` as the kernels turn a sum into an average: f32, f16 and
    /// bf16 in f32 (rounded back), f64 in f64. Integers truncate (they have
    /// no average; for self-checks only).
    fn divide(x: Self, n: usize) -> Self;
}

macro_rules! int_num {
    ($($t:ty),*) => {$(impl Num for $t {
        fn from_f64(x: f64) -> Self { x as $t }
        fn to_f64(self) -> f64 { self as f64 }
        const BITS: Option<u32> = None;
        fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                ReduceOp::Prod => a.wrapping_mul(b),
                ReduceOp::Min => a.min(b),
                ReduceOp::Max => a.max(b),
            }
        }
        fn divide(x: Self, n: usize) -> Self { x / (n as $t) }
    })*};
}
int_num!(i32, i64, u32, u64, i8, u8);

macro_rules! float_num {
    ($t:ty, $bits:expr, $from:expr, $to:expr, $via:ty, $up:expr, $back:expr, $div:expr) => {
        impl Num for $t {
            fn from_f64(x: f64) -> Self {
                ($from)(x)
            }
            fn to_f64(self) -> f64 {
                ($to)(self)
            }
            const BITS: Option<u32> = Some($bits);
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                let (x, y): ($via, $via) = (($up)(a), ($up)(b));
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => ($back)(x + y),
                    ReduceOp::Prod => ($back)(x * y),
                    // One of the inputs, not rounded (fp8's rounding would
                    // saturate an E5M2 infinity). No NaN among the inputs
                    // here; ties keep the first.
                    ReduceOp::Min => {
                        if y < x {
                            b
                        } else {
                            a
                        }
                    }
                    ReduceOp::Max => {
                        if y > x {
                            b
                        } else {
                            a
                        }
                    }
                }
            }
            fn divide(x: Self, n: usize) -> Self {
                ($div)(x, n)
            }
        }
    };
}
float_num!(f32, 24, |x: f64| x as f32, |x: f32| x as f64, f32, |x: f32| x, |v: f32| v, |x: f32, n: usize| x / n as f32);
float_num!(f64, 53, |x: f64| x, |x: f64| x, f64, |x: f64| x, |v: f64| v, |x: f64, n: usize| x / n as f64);
float_num!(f16, 11, f16::from_f64, f16::to_f64, f32, f32::from, f16::from_f32, |x: f16, n: usize| f16::from_f32(x.to_f32() / n as f32));
float_num!(bf16, 8, bf16::from_f64, bf16::to_f64, f32, f32::from, bf16::from_f32, |x: bf16, n: usize| bf16::from_f32(x.to_f32() / n as f32));
float_num!(F8E4M3, 4, F8E4M3::from_f64, |x: F8E4M3| F8E4M3::to_f64(&x), f32, |x: F8E4M3| x.to_f32(), e4m3_of, |x: F8E4M3, n: usize| e4m3_of(
    x.to_f32() / n as f32
));
float_num!(F8E5M2, 3, F8E5M2::from_f64, |x: F8E5M2| F8E5M2::to_f64(&x), f32, |x: F8E5M2| x.to_f32(), e5m2_of, |x: F8E5M2, n: usize| e5m2_of(
    x.to_f32() / n as f32
));

/// An fp8 step's result as the kernels round it (as NCCL does): the f32
/// value rounded to f16, then to fp8 (nearest even, saturating).
fn e4m3_of(v: f32) -> F8E4M3 {
    F8E4M3::from_f64(f16::from_f32(v).to_f64())
}

/// [`e4m3_of`] for E5M2.
fn e5m2_of(v: f32) -> F8E5M2 {
    F8E5M2::from_f64(f16::from_f32(v).to_f64())
}

pub use super::bound::{float_bound, reference};

/// The largest number of ranks the column helpers gather without allocating.
const MAX_RANKS: usize = 16;

/// Whether `got` is a right result of `op` over one element's inputs `xs`
/// (one per rank): exactly the reference for integers (no wrapping: small
/// inputs), within [`float_bound`] of it for floats. NaN is never right.
pub fn accepts<T: Num>(op: ReduceOp, xs: &[f64], got: T) -> bool {
    let want = reference(op, xs);
    let g = got.to_f64();
    match T::BITS {
        None => g == want,
        Some(bits) => (g - want).abs() <= float_bound(op, xs, bits),
    }
}

/// [`accepts`] for element `i` of every rank's inputs `ins[rank]`.
pub fn accepts_at<T: Num>(op: ReduceOp, ins: &[Vec<f64>], i: usize, got: T) -> bool {
    let mut buf = [0f64; MAX_RANKS];
    let n = ins.len();
    assert!(n <= MAX_RANKS, "{n} ranks");
    for (d, x) in buf.iter_mut().zip(ins) {
        *d = x[i];
    }
    accepts(op, &buf[..n], got)
}

/// `op` over `xs` as the kernels compute it, combining in `order` (rank
/// indices; every rank once), `Avg` divided once at the end.
pub fn kernel_reduce<T: Num>(op: ReduceOp, xs: &[T], order: &[usize]) -> T {
    let v = order[1..].iter().fold(xs[order[0]], |acc, &r| T::combine(op, acc, xs[r]));
    if op == ReduceOp::Avg {
        T::divide(v, xs.len())
    } else {
        v
    }
}

/// `op` over `xs` combined as a balanced tree (pairs of neighbours, then
/// pairs of pairs), `Avg` divided once at the end.
pub fn kernel_tree<T: Num>(op: ReduceOp, xs: &[T]) -> T {
    let mut level: Vec<T> = xs.to_vec();
    while level.len() > 1 {
        level = level.chunks(2).map(|p| if p.len() == 2 { T::combine(op, p[0], p[1]) } else { p[0] }).collect();
    }
    if op == ReduceOp::Avg {
        T::divide(level[0], xs.len())
    } else {
        level[0]
    }
}

/// An average as NCCL computes it for floats: every input multiplied by
/// `1/n` (in the type) first, then summed in rank order.
pub fn premultiplied_avg<T: Num>(xs: &[T]) -> T {
    let scale = T::from_f64(1.0 / xs.len() as f64);
    let scaled: Vec<T> = xs.iter().map(|&x| T::combine(ReduceOp::Prod, x, scale)).collect();
    scaled[1..].iter().fold(scaled[0], |a, &x| T::combine(ReduceOp::Sum, a, x))
}

/// Right results of `op` over `xs` that kernels may give: the reduction in
/// rank order, in reverse, in a cyclic order from `start`, largest
/// magnitude first, as a tree, and (avg) NCCL's pre-multiplied form.
pub fn right_results<T: Num>(op: ReduceOp, xs: &[T], start: usize) -> Vec<(&'static str, T)> {
    let n = xs.len();
    let forward: Vec<usize> = (0..n).collect();
    let backward: Vec<usize> = (0..n).rev().collect();
    let cyclic: Vec<usize> = (0..n).map(|k| (start + k) % n).collect();
    let mut largest_first = forward.clone();
    largest_first.sort_by(|&a, &b| xs[b].to_f64().abs().total_cmp(&xs[a].to_f64().abs()));
    let mut out = vec![
        ("rank order", kernel_reduce(op, xs, &forward)),
        ("reverse order", kernel_reduce(op, xs, &backward)),
        ("cyclic order", kernel_reduce(op, xs, &cyclic)),
        ("largest first", kernel_reduce(op, xs, &largest_first)),
        ("tree", kernel_tree(op, xs)),
    ];
    if op == ReduceOp::Avg {
        out.push(("pre-multiplied (NCCL)", premultiplied_avg(xs)));
    }
    out
}

/// Planted defects: results of a wrong reduction of `op` over `xs` that a
/// comparison must reject: rank `dropped` left out (of the sum, and of the
/// average's sum, still divided by `n`), and the average divided by
/// `n - 1`.
pub fn planted_defects<T: Num>(op: ReduceOp, xs: &[T], dropped: usize) -> Vec<(&'static str, T)> {
    let n = xs.len();
    let others: Vec<usize> = (0..n).filter(|&r| r != dropped).collect();
    let mut out = Vec::new();
    if n > 1 {
        let v = others[1..].iter().fold(xs[others[0]], |acc, &r| T::combine(op, acc, xs[r]));
        out.push(("one rank dropped", if op == ReduceOp::Avg { T::divide(v, n) } else { v }));
    }
    if op == ReduceOp::Avg && n > 1 {
        let all: Vec<usize> = (0..n).collect();
        let sum = kernel_reduce(ReduceOp::Sum, xs, &all);
        out.push(("avg divided by n - 1", T::divide(sum, n - 1)));
    }
    out
}

/// Inputs of the multi-process tests for `op`: small integers from the
/// seeded stream `x`, so that every sum, product, min and max of up to 8
/// ranks is exact in every type; for sum and avg in 4..=8, bounded away
/// from zero, so that a rank dropped, or an average divided by `n - 1`,
/// is further from the right result than [`float_bound`]; else 1..=5.
pub fn small_input(op: ReduceOp, x: u64) -> f64 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => (4 + x % 5) as f64,
        _ => (1 + x % 5) as f64,
    }
}
