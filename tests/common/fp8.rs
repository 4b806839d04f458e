//! The exhaustive check of fp8 reductions: every pair of values of an fp8
//! type as the inputs of a two-rank all-reduce, each result against the
//! kernels' step (`Num::combine`: sums and products in f32, then f16, then
//! fp8, saturating to the largest finite value, as NCCL rounds them; min
//! and max one of the inputs).
#![allow(dead_code)]

use super::num::Num;
use cuda_peer::ReduceOp;

/// The two ranks' inputs: element `i` is the pair `(i >> 8, i & 255)` of
/// codes, so that the 65,536 elements hold every pair once (NaNs too).
pub fn pairs<T: Copy>(from_bits: fn(u8) -> T) -> [Vec<T>; 2] {
    let n = 1usize << 16;
    [(0..n).map(|i| from_bits((i >> 8) as u8)).collect(), (0..n).map(|i| from_bits(i as u8)).collect()]
}

/// Whether `got` is the same fp8 value as `want`, the sign of zero
/// included (fp8 values convert to distinct f64s but for ±0); any NaN is
/// the same as any other (a step of two non-NaN inputs can give NaN in
/// E5M2: an infinity minus itself, or times zero).
fn same<T: Num>(got: T, want: T) -> bool {
    let (g, w) = (got.to_f64(), want.to_f64());
    (g.is_nan() && w.is_nan()) || (g == w && g.is_sign_negative() == w.is_sign_negative())
}

/// The model's all-reduce of `op` over the pair `(x, y)`: `None` where
/// either is NaN (the result must then be NaN); else the step of `op` (avg:
/// the sum of the halves, each input divided by the rank count first).
pub fn step<T: Num>(op: ReduceOp, x: T, y: T) -> Option<T> {
    let nan = |v: T| v.to_f64().is_nan();
    if nan(x) || nan(y) {
        return None;
    }
    Some(match op {
        ReduceOp::Avg => T::combine(ReduceOp::Sum, T::divide(x, 2), T::divide(y, 2)),
        _ => T::combine(op, x, y),
    })
}

/// The pairs of [`pairs`] whose all-reduce of `op`, `got`, is wrong, as
/// text: not [`step`] (min and max in either order: they return one of
/// the inputs, the first on a tie of +0 and -0), or not NaN where an input
/// is NaN.
pub fn wrong<T: Num>(op: ReduceOp, ins: &[Vec<T>; 2], got: &[T]) -> Vec<String> {
    let mut wrong = Vec::new();
    for (i, &g) in got.iter().enumerate() {
        let (x, y) = (ins[0][i], ins[1][i]);
        let right = match step(op, x, y) {
            None => g.to_f64().is_nan(),
            Some(w) => same(g, w) || (matches!(op, ReduceOp::Min | ReduceOp::Max) && step(op, y, x).is_some_and(|w| same(g, w))),
        };
        if !right {
            wrong.push(format!("{x:?} {op} {y:?} = {g:?}"));
        }
    }
    wrong
}

/// Fails `what` (its name for the call: engine, type and op) where
/// [`wrong`] finds any pair wrong, naming a few.
pub fn assert_right<T: Num>(what: &str, op: ReduceOp, ins: &[Vec<T>; 2], got: &[T]) {
    let wrong = wrong(op, ins, got);
    assert!(wrong.is_empty(), "{what}: {} of 65536 pairs wrong, e.g. {:?}", wrong.len(), &wrong[..wrong.len().min(8)]);
}
