//! GPU tests of the collectives against a CPU reference. Ranks are laid
//! round-robin over the visible GPUs, so groups of 3-8 ranks run on one or
//! two devices. Inputs are drawn afresh for every case, outputs poisoned
//! before every run; integers must match exactly, floats within the bound
//! in `tolerance`. Skips without GPUs; fails with CUDA_PEER_REQUIRE_GPU=1.

mod common;

use common::gpus;
use cuda_peer::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cuda_peer::{Algorithm, DType, Element, Group, GroupOptions, PathPolicy, ReduceOp, Selected};
use half::{bf16, f16};
use rand::Rng;
use std::sync::Arc;
use std::time::Duration;

/// Element types under test: conversions, random draws and exact integer ops.
trait TestElem: Element + PartialEq + std::fmt::Debug + Sync {
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

/// Checks `got[i]` against the reduction of `inputs[r][offset + i]` over r.
/// Integers must match exactly (wrapping arithmetic). Floats are compared
/// with the f64 reduction: |err| <= 2 * eps * N * sum|x| for sum (scaled by
/// 1/N for avg), relative 2 * eps * (N + 1) for prod, exact for min/max.
fn check_all<T: TestElem>(what: &str, op: ReduceOp, inputs: &[Vec<T>], offset: usize, got: &[T]) {
    // Large outputs are checked on every core of the machine.
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(32);
    let per = got.len().div_ceil(threads).max(1 << 14);
    let bad: Vec<(usize, usize)> = std::thread::scope(|scope| {
        let handles: Vec<_> = got
            .chunks(per)
            .enumerate()
            .map(|(k, part)| scope.spawn(move || check_range(op, inputs, offset + k * per, part).map(|(w, f)| (w, k * per + f))))
            .collect();
        handles.into_iter().filter_map(|h| h.join().unwrap()).collect()
    });
    if let Some(&(_, i)) = bad.first() {
        let wrong: usize = bad.iter().map(|b| b.0).sum();
        panic!("{what}: {wrong} of {} elements wrong; first at {i}: got {:?}", got.len(), got[i]);
    }
}

/// (wrong count, first wrong index in `got`) or None when all are right.
fn check_range<T: TestElem>(op: ReduceOp, inputs: &[Vec<T>], offset: usize, got: &[T]) -> Option<(usize, usize)> {
    let n = inputs.len() as f64;
    let mut wrong = 0usize;
    let mut first = None;
    for (i, &g) in got.iter().enumerate() {
        let j = offset + i;
        let ok = if T::DTYPE.is_float() {
            let (mut sum, mut abs, mut prod, mut lo, mut hi) = (0.0f64, 0.0f64, 1.0f64, f64::INFINITY, f64::NEG_INFINITY);
            for v in inputs {
                let x = v[j].to_f64();
                sum += x;
                abs += x.abs();
                prod *= x;
                lo = lo.min(x);
                hi = hi.max(x);
            }
            let (want, tol) = match op {
                ReduceOp::Sum => (sum, 2.0 * T::EPS * n * abs),
                ReduceOp::Avg => (sum / n, 2.0 * T::EPS * (n + 1.0) * abs / n),
                ReduceOp::Prod => (prod, 2.0 * T::EPS * (n + 1.0) * prod.abs()),
                ReduceOp::Min => (lo, 0.0),
                ReduceOp::Max => (hi, 0.0),
            };
            (g.to_f64() - want).abs() <= tol
        } else {
            let mut acc = inputs[0][j];
            for v in &inputs[1..] {
                acc = T::exact(op, acc, v[j]).unwrap();
            }
            g == acc
        };
        if !ok {
            wrong += 1;
            first.get_or_insert(i);
        }
    }
    first.map(|f| (wrong, f))
}

struct Setup {
    streams: Vec<Arc<CudaStream>>,
    group: Group,
}

/// `n` ranks round-robin over the GPUs, with a path policy per link.
fn setup(ctx: &[Arc<CudaContext>], n: usize, set: PathSet) -> Setup {
    setup_with(ctx, n, set, GroupOptions::default().launch_spin)
}

/// [`setup`] with the given launcher-thread spin (`None`: no launchers).
fn setup_with(ctx: &[Arc<CudaContext>], n: usize, (tag, policies, algorithm): PathSet, launch_spin: Option<Duration>) -> Setup {
    use std::io::Write;
    let streams: Vec<_> = (0..n).map(|r| ctx[r % ctx.len()].new_stream().unwrap()).collect();
    let opts = GroupOptions::default().pull_policies(policies.clone()).algorithm(algorithm).launch_spin(launch_spin);
    let group = Group::new(streams.clone(), &opts).expect("group");
    let paths: Vec<String> = (0..n).map(|r| group.link_status(r).unwrap().path.to_string()).collect();
    let _ =
        writeln!(std::io::stderr(), "  group n={n} {tag}: mesh={} oneshot_on_host={:?} pulls={paths:?}", group.uses_mesh(), group.oneshot_on_host());
    match algorithm {
        Algorithm::Mesh => assert!(group.uses_mesh() && group.all_reduce_algorithm(4096) == Algorithm::Mesh),
        Algorithm::OneShot => {
            let on_host = policies.contains(&PathPolicy::StagedOnly);
            assert_eq!(group.oneshot_on_host(), Some(on_host), "{tag}");
            assert_eq!(group.all_reduce_algorithm(1 << 30), Algorithm::OneShot);
        }
        Algorithm::Ring => assert_eq!(group.all_reduce_algorithm(4096), Algorithm::Ring),
        Algorithm::Auto => {}
    }
    Setup { streams, group }
}

/// A label, per-link path policies, and the all-reduce algorithm.
type PathSet = (&'static str, Vec<PathPolicy>, Algorithm);

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
        check_all(&what("all_reduce_in_place"), op, &inputs, 0, o);
    }
    assert_ranks_identical(&what("all_reduce_in_place"), &outs);

    // all-reduce, out of place (send must be unchanged)
    let inputs = random_inputs::<T>(n, count, op);
    let send = upload(s, &inputs);
    let mut recv = upload(s, &poison(count));
    s.group.all_reduce(&send, &mut recv, op).expect("all_reduce");
    let outs = download(s, &recv);
    for o in &outs {
        check_all(&what("all_reduce"), op, &inputs, 0, o);
    }
    assert_ranks_identical(&what("all_reduce"), &outs);
    assert!(download(s, &send) == inputs, "{}: send buffers changed", what("all_reduce"));

    // reduce-scatter: `count` elements in all (rounded up to n blocks of c)
    let c = count.div_ceil(n);
    let inputs = random_inputs::<T>(n, n * c, op);
    let send = upload(s, &inputs);
    let mut recv = upload(s, &poison(c));
    s.group.reduce_scatter(&send, &mut recv, op).expect("reduce_scatter");
    for (r, o) in download(s, &recv).iter().enumerate() {
        check_all(&what("reduce_scatter"), op, &inputs, r * c, o);
    }
    assert!(download(s, &send) == inputs, "{}: send buffers changed", what("reduce_scatter"));

    // reduce to each root in turn (two roots at most, to bound the time)
    for root in [n - 1, 0].into_iter().take(if n > 1 && count < 100_000 { 2 } else { 1 }) {
        let inputs = random_inputs::<T>(n, count, op);
        let send = upload(s, &inputs);
        let mut recv = upload(s, &poison(count));
        s.group.reduce(&send, &mut recv, root, op).expect("reduce");
        let out = s.streams[root].clone_dtoh(&recv[root]).unwrap();
        check_all(&what(&format!("reduce(root={root})")), op, &inputs, 0, &out);
    }
}

/// Data-movement collectives (no reduction) for one type, group and count.
fn run_moves<T: TestElem>(s: &Setup, count: usize, tag: &str) {
    let n = s.group.size();
    let what = |c: &str| format!("{c} {tag} {} n={n} count={count}", T::DTYPE);
    // all-gather: `count` elements in all (n blocks of c)
    let c = count.div_ceil(n);
    let inputs = random_inputs::<T>(n, c, ReduceOp::Sum);
    let send = upload(s, &inputs);
    let mut recv = upload(s, &vec![vec![T::poison(); n * c]; n]);
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

/// P2P ring, staged (Auto), a ring mixing both (Auto), and with one rank per
/// GPU also the mesh, the one-shot over P2P and over host memory, and the
/// staged ring forced (Auto picks the host one-shot there).
fn path_sets(n: usize, gpus: usize) -> Vec<PathSet> {
    let mixed: Vec<PathPolicy> = (0..n).map(|r| if r % 2 == 0 { PathPolicy::P2pOnly } else { PathPolicy::StagedOnly }).collect();
    let mut sets = vec![
        ("p2p-ring", Vec::new(), Algorithm::Ring),
        ("staged", vec![PathPolicy::StagedOnly; n], Algorithm::Auto),
        ("mixed", mixed, Algorithm::Auto),
    ];
    if n <= gpus {
        sets.push(("p2p-mesh", Vec::new(), Algorithm::Mesh));
        sets.push(("p2p-oneshot", Vec::new(), Algorithm::OneShot));
        sets.push(("host-oneshot", vec![PathPolicy::StagedOnly; n], Algorithm::OneShot));
        sets.push(("staged-ring", vec![PathPolicy::StagedOnly; n], Algorithm::Ring));
    }
    sets
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
        for set in path_sets(n, ctx.len()) {
            let tag = set.0;
            let s = setup(&ctx, n, set);
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
        for set in path_sets(n, ctx.len()) {
            let tag = set.0;
            let s = setup(&ctx, n, set);
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
        for set in path_sets(n, ctx.len()) {
            let tag = set.0;
            let s = setup(&ctx, n, set);
            // Not a whole number of one-shot rounds or 16-byte units.
            run_all::<f32>(&s, ReduceOp::Sum, (16 << 20) + 5, tag);
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
        for set in path_sets(n, ctx.len()) {
            let tag = set.0;
            let s = setup(&ctx, n, set);
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

/// Calls of different sizes interleaved with no host synchronisation, so
/// that consecutive calls take different one-shot lanes (and algorithms
/// under Auto), with out-of-place calls between them: wrapping u32 sums make
/// any race between them exact. Each set runs with launcher threads
/// spinning, without them, and with them parked at every call.
#[test]
fn interleaved_sizes_back_to_back() {
    let Some(ctx) = gpus("interleaved_sizes", 2) else { return };
    let n = 2;
    // 4 KB, 40 KB, 240 KB, 4 MB and 40 MB per rank.
    let sizes = [1_000, 10_000, 60_000, 1_000_003, 10_000_000];
    let sets = [
        ("p2p-oneshot", Vec::new(), Algorithm::OneShot),
        ("host-oneshot", vec![PathPolicy::StagedOnly; n], Algorithm::OneShot),
        ("p2p-auto", Vec::new(), Algorithm::Auto),
        ("staged-auto", vec![PathPolicy::StagedOnly; n], Algorithm::Auto),
    ];
    // Launcher threads as by default, none, and parked before every call
    // (spin 0: the calling thread launches every rank and wakes them).
    let spins = [GroupOptions::default().launch_spin, None, Some(Duration::ZERO)];
    for (set, spin) in sets.into_iter().flat_map(|set| spins.map(|spin| (set.clone(), spin))) {
        let tag = format!("{} launch_spin {spin:?}", set.0);
        let s = setup_with(&ctx, n, set, spin);
        let inputs: Vec<Vec<Vec<u32>>> = sizes.iter().map(|&c| random_inputs::<u32>(n, c, ReduceOp::Sum)).collect();
        let mut bufs: Vec<Vec<CudaSlice<u32>>> = inputs.iter().map(|i| upload(&s, i)).collect();
        let mut calls = vec![0u32; sizes.len()];
        // Out of place too: a pair of 40 KB buffers, each call reducing one
        // into the other (ping-pong), between the in-place calls.
        let pp_count = 10_000;
        let pp_inputs = random_inputs::<u32>(n, pp_count, ReduceOp::Sum);
        let mut pp = [upload(&s, &pp_inputs), upload(&s, &vec![vec![u32::MAX; pp_count]; n])];
        let mut pp_calls = 0u32;
        // 40 calls, 8 of each size, each size followed by every other one.
        for k in 0..40 {
            let which = (k * 7 + k / 5) % sizes.len();
            s.group.all_reduce_in_place(&mut bufs[which], ReduceOp::Sum).unwrap();
            calls[which] += 1;
            if k % 3 == 0 {
                let [a, b] = &mut pp;
                let (from, to) = if pp_calls.is_multiple_of(2) { (&*a, b) } else { (&*b, a) };
                s.group.all_reduce(from, to, ReduceOp::Sum).unwrap();
                pp_calls += 1;
            }
        }
        // The last call wrote pp[pp_calls % 2]: the sum times n^(pp_calls - 1).
        let mut want: Vec<u32> = (0..pp_count).map(|i| pp_inputs.iter().fold(0u32, |a, v| a.wrapping_add(v[i]))).collect();
        for x in want.iter_mut() {
            for _ in 1..pp_calls {
                *x = x.wrapping_mul(n as u32);
            }
        }
        for (r, o) in download(&s, &pp[(pp_calls % 2) as usize]).iter().enumerate() {
            let bad = o.iter().zip(&want).filter(|(a, b)| a != b).count();
            assert_eq!(bad, 0, "{tag}: out-of-place ping-pong, rank {r}: {bad} wrong elements after {pp_calls} calls");
        }
        for (w, &c) in sizes.iter().enumerate() {
            // After the first call every rank holds the sum; each later call multiplies it by n.
            let mut want: Vec<u32> = (0..c).map(|i| inputs[w].iter().fold(0u32, |a, v| a.wrapping_add(v[i]))).collect();
            for _ in 1..calls[w] {
                for x in want.iter_mut() {
                    *x = x.wrapping_mul(n as u32);
                }
            }
            for (r, o) in download(&s, &bufs[w]).iter().enumerate() {
                let bad = o.iter().zip(&want).filter(|(a, b)| a != b).count();
                assert_eq!(bad, 0, "{tag}: size {c}, rank {r}: {bad} wrong elements after {} calls", calls[w]);
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
    let s = setup(&ctx, 2, ("p2p", Vec::new(), Algorithm::Auto));
    let shared: Vec<_> = (0..3).map(|r| ctx[r % 2].new_stream().unwrap()).collect();
    let mesh_opts = GroupOptions::default().algorithm(Algorithm::Mesh);
    assert!(
        matches!(Group::new(shared.clone(), &mesh_opts), Err(Error::AlgorithmUnavailable { algorithm: "mesh", .. })),
        "mesh with a shared device"
    );
    let oneshot_opts = GroupOptions::default().algorithm(Algorithm::OneShot);
    assert!(
        matches!(Group::new(shared, &oneshot_opts), Err(Error::AlgorithmUnavailable { algorithm: "one-shot", .. })),
        "one-shot with a shared device"
    );
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
    let s = setup(&ctx[..1], 1, ("single", Vec::new(), Algorithm::Auto));
    for count in [0, 1, 1000] {
        run_all::<f32>(&s, ReduceOp::Avg, count, "single");
        run_all::<i64>(&s, ReduceOp::Prod, count, "single");
        run_moves::<u8>(&s, count, "single");
    }
}

/// All-reduces of several sizes (one-shot, mesh and ring under Auto) and
/// unaligned views, interleaved back to back with no host synchronisation:
/// wrapping u32 sums show any slot reused too early or any race between
/// algorithms exactly.
#[test]
fn interleaved_sizes_and_algorithms() {
    let Some(ctx) = gpus("interleaved_sizes", 2) else { return };
    let n = 2;
    let sets: Vec<PathSet> = vec![("p2p-auto", Vec::new(), Algorithm::Auto), ("staged-auto", vec![PathPolicy::StagedOnly; n], Algorithm::Auto)];
    for set in sets {
        let tag = set.0;
        let s = setup(&ctx, n, set);
        let counts = [1000usize, 300_001, 5_000_003];
        let algos: Vec<Selected> = counts.iter().map(|c| s.group.all_reduce_algorithm(c * 4)).collect();
        eprintln!("  {tag}: algorithms {algos:?}");
        assert_eq!(algos[0], Selected::OneShot, "{tag}: the smallest buffer (and its unaligned view) must take the one-shot");
        let inputs: Vec<Vec<Vec<u32>>> = counts.iter().map(|&c| random_inputs::<u32>(n, c, ReduceOp::Sum)).collect();
        let mut bufs: Vec<Vec<CudaSlice<u32>>> = inputs.iter().map(|i| upload(&s, i)).collect();
        let mut rounds = [0u32; 5];
        for step in 0..50 {
            let k = (step * 7 + step / 3) % 5;
            if k < 3 {
                s.group.all_reduce_in_place(&mut bufs[k], ReduceOp::Sum).unwrap();
            } else {
                // Unaligned views (4 bytes in) of the largest buffer (mesh
                // or ring) and of the smallest (the one-shot's element path).
                let b = if k == 3 { 2 } else { 0 };
                let mut views: Vec<_> = bufs[b].iter_mut().map(|b| b.slice_mut(1..)).collect();
                s.group.all_reduce_in_place(&mut views, ReduceOp::Sum).unwrap();
            }
            rounds[k] += 1;
        }
        for (k, &c) in counts.iter().enumerate() {
            let mut want: Vec<u32> = (0..c).map(|i| inputs[k].iter().fold(0u32, |a, v| a.wrapping_add(v[i]))).collect();
            let mul = |w: &mut [u32], times: u32| {
                for x in w.iter_mut() {
                    for _ in 1..times {
                        *x = x.wrapping_mul(n as u32);
                    }
                }
            };
            mul(&mut want, rounds[k]);
            // The view's elements were reduced rounds[3] or rounds[4] more times.
            let extra = match k {
                2 => rounds[3],
                0 => rounds[4],
                _ => 0,
            };
            for x in want[1..].iter_mut() {
                for _ in 0..extra {
                    *x = x.wrapping_mul(n as u32);
                }
            }
            for (r, o) in download(&s, &bufs[k]).iter().enumerate() {
                let bad = o.iter().zip(&want).filter(|(a, b)| a != b).count();
                assert_eq!(bad, 0, "{tag}: buffer of {c} elements, rank {r}: {bad} wrong after {} + {extra} all-reduces", rounds[k]);
            }
        }
    }
}
