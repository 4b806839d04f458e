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

/// The pairs of [`pairs`] whose all-reduce of `op`, `got`, is wrong, as
/// text: NaN where either input is NaN; else the step of `op` on the two
/// (min and max in either order: they return one of the inputs, the first
/// on a tie of +0 and -0); avg the sum of the halves (each input divided
/// by the rank count first).
pub fn wrong<T: Num>(op: ReduceOp, ins: &[Vec<T>; 2], got: &[T]) -> Vec<String> {
    let mut wrong = Vec::new();
    for (i, &g) in got.iter().enumerate() {
        let (x, y) = (ins[0][i], ins[1][i]);
        let nan = |v: T| v.to_f64().is_nan();
        let right = if nan(x) || nan(y) {
            nan(g)
        } else {
            match op {
                ReduceOp::Avg => same(g, T::combine(ReduceOp::Sum, T::divide(x, 2), T::divide(y, 2))),
                ReduceOp::Min | ReduceOp::Max => same(g, T::combine(op, x, y)) || same(g, T::combine(op, y, x)),
                _ => same(g, T::combine(op, x, y)),
            }
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
