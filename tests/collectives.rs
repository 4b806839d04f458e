//! GPU tests of the collectives against a CPU reference. Ranks are laid
//! round-robin over the visible GPUs, so groups of 3-8 ranks run on one or
//! two devices. Inputs are drawn afresh for every case, outputs poisoned
//! before every run; integers must match exactly, floats within the bound
//! in `tolerance`. Skips without GPUs; fails with CUDA_PEER_REQUIRE_GPU=1.

mod common;

use common::gpus;
use cuda_peer::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cuda_peer::{DType, Element, Group, GroupOptions, PathPolicy, ReduceOp};
use half::{bf16, f16};
use rand::Rng;
use std::sync::Arc;

/// Element types under test: conversions, random draws and exact integer ops.
trait TestElem: Element + PartialEq + std::fmt::Debug {
    fn to_f64(self) -> f64;
    fn random(rng: &mut impl Rng, op: ReduceOp) -> Self;
    /// Exact combination for integer types (wrapping); None for floats.
    fn exact(op: ReduceOp, a: Self, b: Self) -> Option<Self>;
    /// Bits, for bitwise comparison across ranks.
    fn bits(self) -> u64;
    /// Unit roundoff.
    const EPS: f64;
    fn poison() -> Self;
}

macro_rules! float_elem {
    ($t:ty, $eps:expr, $from:expr, $to:expr, $bits:expr, $poison:expr) => {
        impl TestElem for $t {
            fn to_f64(self) -> f64 {
                ($to)(self)
            }
            fn random(rng: &mut impl Rng, op: ReduceOp) -> Self {
                let v: f64 = match op {
                    ReduceOp::Prod => rng.random_range(0.5..1.5),
                    _ => rng.random_range(-1.0..1.0),
                };
                ($from)(v)
            }
            fn exact(_: ReduceOp, _: Self, _: Self) -> Option<Self> {
                None
            }
            fn bits(self) -> u64 {
                ($bits)(self)
            }
            const EPS: f64 = $eps;
            fn poison() -> Self {
                $poison
            }
        }
    };
}
float_elem!(f32, f32::EPSILON as f64, |v: f64| v as f32, |x: f32| x as f64, |x: f32| x.to_bits() as u64, f32::NAN);
float_elem!(f64, f64::EPSILON, |v: f64| v, |x: f64| x, |x: f64| x.to_bits(), f64::NAN);
float_elem!(f16, 0.000977, f16::from_f64, |x: f16| x.to_f64(), |x: f16| x.to_bits() as u64, f16::NAN);
float_elem!(bf16, 0.0078125, bf16::from_f64, |x: bf16| x.to_f64(), |x: bf16| x.to_bits() as u64, bf16::NAN);

macro_rules! int_elem {
    ($t:ty) => {
        impl TestElem for $t {
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn random(rng: &mut impl Rng, _: ReduceOp) -> Self {
                rng.random()
            }
            fn exact(op: ReduceOp, a: Self, b: Self) -> Option<Self> {
                Some(match op {
                    ReduceOp::Sum => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Avg => unreachable!("avg is refused on integers"),
                })
            }
            fn bits(self) -> u64 {
                self as u64
            }
            const EPS: f64 = 0.0;
            fn poison() -> Self {
                <$t>::MAX / 3 + 7
            }
        }
    };
}
int_elem!(i32);
int_elem!(i64);
int_elem!(u32);
int_elem!(u64);
int_elem!(i8);
int_elem!(u8);

/// The expected reduction of `inputs[..][i]` and the allowed error.
/// Floats: the f64 reduction, with |err| <= 2 * eps * N * sum|x| for sum and
/// avg (scaled by 1/N), a relative 2 * eps * (N + 1) for prod, exact for min/max.
fn reference<T: TestElem>(op: ReduceOp, inputs: &[Vec<T>], i: usize) -> (f64, f64, Option<T>) {
    let n = inputs.len();
    if T::DTYPE.is_float() {
        let xs: Vec<f64> = inputs.iter().map(|v| v[i].to_f64()).collect();
        let abs: f64 = xs.iter().map(|x| x.abs()).sum();
        let (v, tol) = match op {
            ReduceOp::Sum => (xs.iter().sum::<f64>(), 2.0 * T::EPS * n as f64 * abs),
            ReduceOp::Avg => (xs.iter().sum::<f64>() / n as f64, 2.0 * T::EPS * (n as f64 + 1.0) * abs / n as f64),
            ReduceOp::Prod => {
                let p: f64 = xs.iter().product();
                (p, 2.0 * T::EPS * (n as f64 + 1.0) * p.abs())
            }
            ReduceOp::Min => (xs.iter().cloned().fold(f64::INFINITY, f64::min), 0.0),
            ReduceOp::Max => (xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max), 0.0),
        };
        (v, tol, None)
    } else {
        let mut acc = inputs[0][i];
        for v in &inputs[1..] {
            acc = T::exact(op, acc, v[i]).unwrap();
        }
        (0.0, 0.0, Some(acc))
    }
}

fn check_element<T: TestElem>(what: &str, op: ReduceOp, inputs: &[Vec<T>], i: usize, got: T) {
    let (v, tol, exact) = reference(op, inputs, i);
    match exact {
        Some(e) => assert_eq!(got, e, "{what}: element {i}: got {got:?}, want {e:?}"),
        None => {
            let g = got.to_f64();
            assert!((g - v).abs() <= tol, "{what}: element {i}: got {g}, want {v} (tolerance {tol})");
        }
    }
}

struct Setup {
    streams: Vec<Arc<CudaStream>>,
    group: Group,
}

/// `n` ranks round-robin over the GPUs, with a path policy per link.
fn setup(ctx: &[Arc<CudaContext>], n: usize, policies: Vec<PathPolicy>) -> Setup {
    let streams: Vec<_> = (0..n).map(|r| ctx[r % ctx.len()].new_stream().unwrap()).collect();
    let opts = GroupOptions { pull_policies: policies, ..GroupOptions::default() };
    let group = Group::new(streams.clone(), &opts).expect("group");
    Setup { streams, group }
}

fn upload<T: TestElem>(s: &Setup, data: &[Vec<T>]) -> Vec<CudaSlice<T>> {
    data.iter().zip(&s.streams).map(|(d, st)| st.clone_htod(d).unwrap()).collect()
}

fn download<T: TestElem>(s: &Setup, bufs: &[CudaSlice<T>]) -> Vec<Vec<T>> {
    bufs.iter().zip(&s.streams).map(|(b, st)| st.clone_dtoh(b).unwrap()).collect()
}

fn random_inputs<T: TestElem>(n: usize, count: usize, op: ReduceOp) -> Vec<Vec<T>> {
    let mut rng = rand::rng();
    (0..n).map(|_| (0..count).map(|_| T::random(&mut rng, op)).collect()).collect()
}

fn assert_ranks_identical<T: TestElem>(what: &str, outs: &[Vec<T>]) {
    for (r, o) in outs.iter().enumerate().skip(1) {
        if let Some(i) = o.iter().zip(&outs[0]).position(|(a, b)| a.bits() != b.bits()) {
            panic!("{what}: rank {r} differs from rank 0 at element {i}: {:?} vs {:?}", o[i], outs[0][i]);
        }
    }
}

/// Every collective for one type, op, group and count.
fn run_all<T: TestElem>(s: &Setup, op: ReduceOp, count: usize, tag: &str) {
    let n = s.group.size();
    let what = |c: &str| format!("{c} {tag} {} {op} n={n} count={count}", T::DTYPE);
    let poison = |len: usize| -> Vec<Vec<T>> { vec![vec![T::poison(); len]; n] };

    // all-reduce, in place
    let inputs = random_inputs::<T>(n, count, op);
    let mut bufs = upload(s, &inputs);
    s.group.all_reduce_in_place(&mut bufs, op).expect("all_reduce_in_place");
    let outs = download(s, &bufs);
    for o in &outs {
        for i in 0..count {
            check_element(&what("all_reduce_in_place"), op, &inputs, i, o[i]);
        }
    }
    assert_ranks_identical(&what("all_reduce_in_place"), &outs);

    // all-reduce, out of place (send must be unchanged)
    let inputs = random_inputs::<T>(n, count, op);
    let send = upload(s, &inputs);
    let mut recv = upload(s, &poison(count));
    s.group.all_reduce(&send, &mut recv, op).expect("all_reduce");
    let outs = download(s, &recv);
    for o in &outs {
        for i in 0..count {
            check_element(&what("all_reduce"), op, &inputs, i, o[i]);
        }
    }
    assert_ranks_identical(&what("all_reduce"), &outs);
    assert!(download(s, &send) == inputs, "{}: send buffers changed", what("all_reduce"));

    // reduce-scatter: send n*count, recv count
    let inputs = random_inputs::<T>(n, n * count, op);
    let send = upload(s, &inputs);
    let mut recv = upload(s, &poison(count));
    s.group.reduce_scatter(&send, &mut recv, op).expect("reduce_scatter");
    for (r, o) in download(s, &recv).iter().enumerate() {
        for i in 0..count {
            check_element(&what("reduce_scatter"), op, &inputs, r * count + i, o[i]);
        }
    }
    assert!(download(s, &send) == inputs, "{}: send buffers changed", what("reduce_scatter"));

    // reduce to each root in turn (two roots at most, to bound the time)
    for root in [0, n - 1].into_iter().take(if n > 1 { 2 } else { 1 }) {
        let inputs = random_inputs::<T>(n, count, op);
        let send = upload(s, &inputs);
        let mut recv = upload(s, &poison(count));
        s.group.reduce(&send, &mut recv, root, op).expect("reduce");
        let out = s.streams[root].clone_dtoh(&recv[root]).unwrap();
        for i in 0..count {
            check_element(&what(&format!("reduce(root={root})")), op, &inputs, i, out[i]);
        }
    }
}

/// Data-movement collectives (no reduction) for one type, group and count.
fn run_moves<T: TestElem>(s: &Setup, count: usize, tag: &str) {
    let n = s.group.size();
    let what = |c: &str| format!("{c} {tag} {} n={n} count={count}", T::DTYPE);
    let inputs = random_inputs::<T>(n, count, ReduceOp::Sum);
    let send = upload(s, &inputs);
    let mut recv = upload(s, &vec![vec![T::poison(); n * count]; n]);
    s.group.all_gather(&send, &mut recv).expect("all_gather");
    let want: Vec<T> = inputs.concat();
    for (r, o) in download(s, &recv).iter().enumerate() {
        assert!(o.iter().zip(&want).all(|(a, b)| a.bits() == b.bits()), "{}: rank {r} wrong", what("all_gather"));
    }
    for root in [0, n / 2] {
        let inputs = random_inputs::<T>(n, count, ReduceOp::Sum);
        let mut bufs = upload(s, &inputs);
        s.group.broadcast(&mut bufs, root).expect("broadcast");
        for (r, o) in download(s, &bufs).iter().enumerate() {
            assert!(o.iter().zip(&inputs[root]).all(|(a, b)| a.bits() == b.bits()), "{}: rank {r} wrong (root {root})", what("broadcast"));
        }
    }
}

fn counts(n: usize) -> Vec<usize> {
    let mut c = vec![0, 1, n.saturating_sub(1), n + 1, 1_000_003];
    c.dedup();
    c
}

fn path_sets(n: usize) -> Vec<(&'static str, Vec<PathPolicy>)> {
    let mixed: Vec<PathPolicy> = (0..n).map(|r| if r % 2 == 0 { PathPolicy::P2pOnly } else { PathPolicy::StagedOnly }).collect();
    vec![("p2p", Vec::new()), ("staged", vec![PathPolicy::StagedOnly; n]), ("mixed", mixed)]
}

macro_rules! for_types {
    ($f:ident, $($args:expr),*) => {{
        $f::<f32>($($args),*);
        $f::<f64>($($args),*);
        $f::<f16>($($args),*);
        $f::<bf16>($($args),*);
        $f::<i32>($($args),*);
        $f::<i64>($($args),*);
        $f::<u32>($($args),*);
        $f::<u64>($($args),*);
        $f::<i8>($($args),*);
        $f::<u8>($($args),*);
    }};
}

fn ops_for<T: TestElem>(s: &Setup, count: usize, tag: &str) {
    for op in ReduceOp::ALL {
        if op == ReduceOp::Avg && !T::DTYPE.is_float() {
            continue;
        }
        run_all::<T>(s, op, count, tag);
    }
}

/// Every op and type, all collectives, for N = 2 and 3 over every path set.
#[test]
fn every_op_and_type_on_two_and_three_ranks() {
    let Some(ctx) = gpus("every_op_and_type", 2) else { return };
    for n in [2, 3] {
        for (tag, policies) in path_sets(n) {
            let s = setup(&ctx, n, policies);
            for count in counts(n) {
                for_types!(ops_for, &s, count, tag);
                for_types!(run_moves, &s, count, tag);
            }
        }
    }
}

/// Sum (and avg where defined) for every type, all collectives, N = 4, 5, 8.
#[test]
fn larger_rings_every_type() {
    let Some(ctx) = gpus("larger_rings", 2) else { return };
    for n in [4, 5, 8] {
        for (tag, policies) in path_sets(n) {
            let s = setup(&ctx, n, policies);
            for count in counts(n) {
                for_types!(sum_only, &s, count, tag);
                for_types!(run_moves, &s, count, tag);
            }
            run_all::<f32>(&s, ReduceOp::Max, n + 1, tag);
            run_all::<bf16>(&s, ReduceOp::Avg, 1_000_003, tag);
        }
    }
}

fn sum_only<T: TestElem>(s: &Setup, count: usize, tag: &str) {
    run_all::<T>(s, ReduceOp::Sum, count, tag);
}

/// 16M elements, f32 and bf16 sum, every N and path set.
#[test]
fn sixteen_million_elements() {
    let Some(ctx) = gpus("sixteen_million", 2) else { return };
    for n in [2, 3, 4, 5, 8] {
        for (tag, policies) in path_sets(n) {
            let s = setup(&ctx, n, policies);
            run_all::<f32>(&s, ReduceOp::Sum, 16 << 20, tag);
            run_all::<bf16>(&s, ReduceOp::Sum, 16 << 20, tag);
        }
    }
}

/// 100 all-reduces back to back with no host synchronisation: wrapping u32
/// sums make any race or missed step visible exactly.
#[test]
fn hundred_back_to_back_all_reduces() {
    let Some(ctx) = gpus("hundred_back_to_back", 2) else { return };
    for n in [2, 3, 8] {
        for (tag, policies) in path_sets(n) {
            let s = setup(&ctx, n, policies);
            let count = 1_000_003;
            let inputs = random_inputs::<u32>(n, count, ReduceOp::Sum);
            let mut want: Vec<u32> = (0..count).map(|i| inputs.iter().fold(0u32, |a, v| a.wrapping_add(v[i]))).collect();
            for _ in 1..100 {
                for w in want.iter_mut() {
                    *w = w.wrapping_mul(n as u32);
                }
            }
            let mut bufs = upload(&s, &inputs);
            for _ in 0..100 {
                s.group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap();
            }
            for (r, o) in download(&s, &bufs).iter().enumerate() {
                let bad = o.iter().zip(&want).filter(|(a, b)| a != b).count();
                assert_eq!(bad, 0, "{tag} n={n}: rank {r} has {bad} wrong elements after 100 all-reduces");
            }
        }
    }
}

/// Bad input is a typed error, never a panic.
#[test]
fn bad_input_is_refused() {
    use cuda_peer::Error;
    let Some(ctx) = gpus("collectives_bad_input", 2) else { return };
    assert!(matches!(Group::new(Vec::new(), &GroupOptions::default()), Err(Error::EmptyGroup)));
    let s = setup(&ctx, 2, Vec::new());
    let mut a = vec![s.streams[0].alloc_zeros::<f32>(10).unwrap(), s.streams[1].alloc_zeros::<f32>(11).unwrap()];
    assert!(matches!(s.group.all_reduce_in_place(&mut a, ReduceOp::Sum), Err(Error::LengthMismatch { .. })));
    let mut swapped = vec![s.streams[1].alloc_zeros::<f32>(10).unwrap(), s.streams[0].alloc_zeros::<f32>(10).unwrap()];
    assert!(matches!(s.group.all_reduce_in_place(&mut swapped, ReduceOp::Sum), Err(Error::WrongDevice { .. })));
    let mut ints = vec![s.streams[0].alloc_zeros::<i32>(10).unwrap(), s.streams[1].alloc_zeros::<i32>(10).unwrap()];
    assert!(matches!(s.group.all_reduce_in_place(&mut ints, ReduceOp::Avg), Err(Error::UnsupportedOp { .. })));
    assert!(matches!(s.group.broadcast(&mut ints, 2), Err(Error::RootOutOfRange { root: 2, size: 2 })));
    let mut one = vec![s.streams[0].alloc_zeros::<i32>(10).unwrap()];
    assert!(matches!(s.group.all_reduce_in_place(&mut one, ReduceOp::Sum), Err(Error::InvalidArgument(_))));
    let send = vec![s.streams[0].alloc_zeros::<i32>(20).unwrap(), s.streams[1].alloc_zeros::<i32>(20).unwrap()];
    let mut recv = vec![s.streams[0].alloc_zeros::<i32>(11).unwrap(), s.streams[1].alloc_zeros::<i32>(11).unwrap()];
    assert!(matches!(s.group.reduce_scatter(&send, &mut recv, ReduceOp::Sum), Err(Error::LengthMismatch { .. })));
    let _ = DType::F32;
}

/// A group of one rank is the identity (avg too).
#[test]
fn single_rank_group_is_identity() {
    let Some(ctx) = gpus("single_rank", 1) else { return };
    let s = setup(&ctx[..1], 1, Vec::new());
    for count in [0, 1, 1000] {
        run_all::<f32>(&s, ReduceOp::Avg, count, "single");
        run_all::<i64>(&s, ReduceOp::Prod, count, "single");
        run_moves::<u8>(&s, count, "single");
    }
}
