//! The float comparison's bound: the exact f64 reference of a reduction
//! and the largest error the kernels' arithmetic can make against it
//! (docs/testing.md). Shared by the tests (`num` re-exports it) and by
//! `examples/soak.rs` (which includes this file by path: an example cannot
//! use the tests' modules). Depends on nothing but cuda-peer's `ReduceOp`.

use cuda_peer::ReduceOp;

/// The exact result of `op` over one element's inputs `xs` (one per rank),
/// in f64.
pub fn reference(op: ReduceOp, xs: &[f64]) -> f64 {
    match op {
        ReduceOp::Sum => xs.iter().sum(),
        ReduceOp::Prod => xs.iter().product(),
        ReduceOp::Min => xs.iter().copied().fold(f64::INFINITY, f64::min),
        ReduceOp::Max => xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Avg => xs.iter().sum::<f64>() / xs.len() as f64,
    }
}

/// The relative error of one binary step of the kernels in a float type
/// of `bits` significand bits: its unit roundoff `2^-bits` (round to
/// nearest), plus f32's where a 16-bit or 8-bit type is computed in f32
/// first, plus f16's where an fp8 type is rounded through f16.
pub fn step_roundoff(bits: u32) -> f64 {
    let mut u = 2f64.powi(-(bits as i32));
    if bits < 24 {
        u += 2f64.powi(-24);
    }
    if bits < 11 {
        u += 2f64.powi(-11);
    }
    u
}

/// The sum, over the `n - 1` partial results of a sum of `xs` taken in the
/// worst order, of their magnitudes: `sum_{k=2..n}` (the sum of the `k`
/// largest `|x|`). Every order of binary additions (a chain in any rank
/// order, as the ring; rank order, as the one-shot and the mesh; a tree)
/// has partial results whose magnitudes sum to at most this.
pub fn worst_partials(xs: &[f64]) -> f64 {
    let mut buf = [0f64; 16];
    let mut heap;
    let a: &mut [f64] = if xs.len() <= buf.len() {
        &mut buf[..xs.len()]
    } else {
        heap = vec![0f64; xs.len()];
        &mut heap[..]
    };
    for (d, x) in a.iter_mut().zip(xs) {
        *d = x.abs();
    }
    a.sort_unstable_by(|x, y| y.total_cmp(x));
    let (mut top, mut partials) = (0.0, 0.0);
    for (k, v) in a.iter().enumerate() {
        top += v;
        if k >= 1 {
            partials += top;
        }
    }
    partials
}

/// Whether every partial result of `op` over `xs` in any order is exactly
/// representable in a float type of `bits` significand bits (integer
/// inputs whose magnitudes sum, or multiply, to at most `2^bits`).
fn exact_in(op: ReduceOp, xs: &[f64], bits: u32) -> bool {
    let limit = 2f64.powi(bits as i32);
    let integers = xs.iter().all(|x| x.fract() == 0.0);
    match op {
        ReduceOp::Sum => integers && xs.iter().map(|x| x.abs()).sum::<f64>() <= limit,
        ReduceOp::Prod => integers && xs.iter().map(|x| x.abs()).product::<f64>() <= limit,
        ReduceOp::Min | ReduceOp::Max => true,
        ReduceOp::Avg => false,
    }
}

/// The largest error of `op` over one element's inputs `xs` (one per rank)
/// computed by the kernels in a float type of `bits` significand bits,
/// against [`reference`]:
///
/// * min, max, and sums and products whose partial results are all exact:
///   0;
/// * sum: `u * worst_partials(xs)`, where `u` is one step's roundoff
///   ([`step_roundoff`]) plus f64's (the reference is rounded too);
/// * avg: the sum's bound plus the division's rounding (or NCCL's
///   pre-multiplication of every input by `1/n`: `2u` per input), over `n`;
/// * prod: `(n - 1) u` relative;
///
/// each widened by `1 + 2(n + 1)u` for the second-order terms. One rank is
/// the identity: 0.
pub fn float_bound(op: ReduceOp, xs: &[f64], bits: u32) -> f64 {
    let n = xs.len();
    if n <= 1 && op != ReduceOp::Avg {
        return 0.0;
    }
    if exact_in(op, xs, bits) {
        return 0.0;
    }
    let u = step_roundoff(bits) + 2f64.powi(-53);
    let widen = 1.0 + 2.0 * (n as f64 + 1.0) * u;
    let abs: f64 = xs.iter().map(|x| x.abs()).sum();
    match op {
        ReduceOp::Sum => u * worst_partials(xs) * widen,
        ReduceOp::Avg if n == 1 => 0.0,
        ReduceOp::Avg => (u * worst_partials(xs) + (2.0 * u + 2f64.powi(-22)) * abs) * widen / n as f64,
        ReduceOp::Prod => (n as f64 - 1.0) * u * reference(ReduceOp::Prod, xs).abs() * widen,
        ReduceOp::Min | ReduceOp::Max => 0.0,
    }
}
