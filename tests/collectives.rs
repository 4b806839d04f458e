//! GPU tests of the collectives against a CPU reference. Ranks are laid
//! round-robin over the visible GPUs (rank r on device r % count), so
//! groups of 2-8 ranks run on one device (the ring, the mesh and the
//! one-shot, every link local; the fused algorithms divide the device's
//! multiprocessors among its ranks) or on two or more. Inputs are drawn afresh for
//! every case, outputs poisoned before every run; integers must match
//! exactly, floats within the per-element bound of `common::num` (the
//! largest error of any order of the reduction's steps), on inputs chosen
//! so that a dropped rank or an average divided by `n - 1` lies outside it
//! (`docs/testing.md`). CPU self-checks at the end plant those defects and
//! check that the comparison and the back-to-back chains catch them. The
//! GPU tests skip without a GPU (fail with CUDA_PEER_REQUIRE_GPU=1 then),
//! and say which parts need two GPUs (links between devices: P2P, staged,
//! mixed, the host one-shot) where only one is present.

mod common;

use common::num::{self, Num};
use common::{chain, gpus};
use cuda_peer::cudarc::driver::{CudaContext, CudaSlice, CudaStream, CudaView};
use cuda_peer::float8::{F8E4M3, F8E5M2};
use cuda_peer::{Algorithm, Error, Group, GroupOptions, Path, PathPolicy, ReduceOp, Selected};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Duration;

/// Element types under test: bitwise comparison, poison, and uniform draws.
trait TestElem: Num {
    /// Uniform over the type for integers; in [-1, 1) for floats.
    fn random(rng: &mut impl Rng) -> Self;
    /// Bits, for bitwise comparison across ranks.
    fn bits(self) -> u64;
    fn poison() -> Self;
}

macro_rules! float_elem {
    ($t:ty, $bits:expr, $poison:expr) => {
        impl TestElem for $t {
            fn random(rng: &mut impl Rng) -> Self {
                <$t as Num>::from_f64(rng.random_range(-1.0..1.0))
            }
            fn bits(self) -> u64 {
                ($bits)(self)
            }
            fn poison() -> Self {
                $poison
            }
        }
    };
}
float_elem!(f32, |x: f32| x.to_bits() as u64, f32::NAN);
float_elem!(f64, |x: f64| x.to_bits(), f64::NAN);
float_elem!(f16, |x: f16| x.to_bits() as u64, f16::NAN);
float_elem!(bf16, |x: bf16| x.to_bits() as u64, bf16::NAN);
float_elem!(F8E4M3, |x: F8E4M3| x.to_bits() as u64, F8E4M3::NAN);
float_elem!(F8E5M2, |x: F8E5M2| x.to_bits() as u64, F8E5M2::NAN);

macro_rules! int_elem {
    ($t:ty) => {
        impl TestElem for $t {
            fn random(rng: &mut impl Rng) -> Self {
                rng.random()
            }
            fn bits(self) -> u64 {
                self as u64
            }
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

/// Most ranks a test group has (the column buffers below).
const MAX_RANKS: usize = 8;

/// Whether `got` is right for element `j` of the reduction of
/// `inputs[r][j]` over the ranks r: integers exactly (wrapping, in rank
/// order: every order gives the same), floats within `num::float_bound`.
fn element_ok<T: TestElem>(op: ReduceOp, inputs: &[Vec<T>], j: usize, got: T) -> bool {
    if T::BITS.is_none() {
        let acc = inputs[1..].iter().fold(inputs[0][j], |a, v| T::combine(op, a, v[j]));
        return got == acc;
    }
    let mut xs = [0f64; MAX_RANKS];
    for (x, v) in xs.iter_mut().zip(inputs) {
        *x = v[j].to_f64();
    }
    num::accepts(op, &xs[..inputs.len()], got)
}

/// Checks `got[i]` against the reduction of `inputs[r][offset + i]` over r
/// (see [`element_ok`]); panics naming the wrong count and the first.
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
        let xs: Vec<f64> = inputs.iter().map(|v| v[offset + i].to_f64()).collect();
        let (want, bound) = (num::reference(op, &xs), T::BITS.map_or(0.0, |b| num::float_bound(op, &xs, b)));
        panic!(
            "{what}: {wrong} of {} elements wrong; first at {i}: got {:?}, expected {want} (within {bound:e}; f64 reference, integers wrap) from {xs:?}",
            got.len(),
            got[i]
        );
    }
}

/// (wrong count, first wrong index in `got`) or None when all are right.
fn check_range<T: TestElem>(op: ReduceOp, inputs: &[Vec<T>], offset: usize, got: &[T]) -> Option<(usize, usize)> {
    assert!(inputs.len() <= MAX_RANKS, "{} ranks", inputs.len());
    let mut wrong = 0usize;
    let mut first = None;
    for (i, &g) in got.iter().enumerate() {
        if !element_ok(op, inputs, offset + i, g) {
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
    random_inputs_from(&mut rand::rng(), n, count, op)
}

/// Every rank's inputs for `op`, rank by rank. Integers are uniform over
/// the type. Float sums and averages: each element's inputs share a random
/// sign and have magnitudes in [1, 2], so that leaving out any rank moves a
/// sum by at least 1, and dividing the average by `n - 1` moves it by at
/// least `1 / (n - 1)`, both beyond the bound for every type up to 8 ranks
/// (bf16's included: the CPU self-check below confirms it), but fp8, whose
/// bound with 3 or 2 mantissa bits is wider than a dropped rank: fp8 steps
/// are checked exactly, every pair of values, in
/// `fp8_reductions_round_as_nccl_does_on_every_pair`. Float
/// products: magnitudes in [1.25, 2] with random signs (a dropped factor
/// moves the product by 20% at least). Min, max and the data movements:
/// uniform in [-1, 1).
fn random_inputs_from<T: TestElem>(rng: &mut impl Rng, n: usize, count: usize, op: ReduceOp) -> Vec<Vec<T>> {
    if T::BITS.is_none() {
        return (0..n).map(|_| (0..count).map(|_| T::random(rng)).collect()).collect();
    }
    fn sign(rng: &mut impl Rng) -> f64 {
        if rng.random::<bool>() {
            1.0
        } else {
            -1.0
        }
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            let signs: Vec<f64> = (0..count).map(|_| sign(rng)).collect();
            (0..n).map(|_| signs.iter().map(|s| T::from_f64(s * rng.random_range(1.0..2.0))).collect()).collect()
        }
        ReduceOp::Prod => (0..n).map(|_| (0..count).map(|_| T::from_f64(sign(rng) * rng.random_range(1.25..2.0))).collect()).collect(),
        ReduceOp::Min | ReduceOp::Max => (0..n).map(|_| (0..count).map(|_| T::random(rng)).collect()).collect(),
    }
}

fn assert_ranks_identical<T: TestElem>(what: &str, outs: &[Vec<T>]) {
    for (r, o) in outs.iter().enumerate().skip(1) {
        if let Some(i) = o.iter().zip(&outs[0]).position(|(a, b)| a.bits() != b.bits()) {
            panic!("{what}: rank {r} differs from rank 0 at element {i}: {:?} vs {:?}", o[i], outs[0][i]);
        }
    }
}

/// Checks every rank's all-reduce output: rank 0's against the reference,
/// the others bit for bit against rank 0's (and, where one differs,
/// against the reference too, for the count of wrong elements).
fn check_all_ranks<T: TestElem>(what: &str, op: ReduceOp, inputs: &[Vec<T>], outs: &[Vec<T>]) {
    check_all(what, op, inputs, 0, &outs[0]);
    for (r, o) in outs.iter().enumerate().skip(1) {
        if o.iter().zip(&outs[0]).any(|(a, b)| a.bits() != b.bits()) {
            check_all(&format!("{what}, rank {r}"), op, inputs, 0, o);
        }
    }
    assert_ranks_identical(what, outs);
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
    check_all_ranks(&what("all_reduce_in_place"), op, &inputs, &download(s, &bufs));

    // all-reduce, out of place (send must be unchanged)
    let inputs = random_inputs::<T>(n, count, op);
    let send = upload(s, &inputs);
    let mut recv = upload(s, &poison(count));
    s.group.all_reduce(&send, &mut recv, op).expect("all_reduce");
    check_all_ranks(&what("all_reduce"), op, &inputs, &download(s, &recv));
    assert!(download(s, &send) == inputs, "{}: send buffers changed", what("all_reduce"));

    // reduce-scatter: `count` elements in all (rounded up to n blocks of c)
    let c = count.div_ceil(n);
    let inputs = random_inputs::<T>(n, n * c, op);
    let send = upload(s, &inputs);
    let mut recv = upload(s, &poison(c));
    s.group.reduce_scatter(&send, &mut recv, op).expect("reduce_scatter");
    for (r, o) in download(s, &recv).iter().enumerate() {
        check_all(&what(&format!("reduce_scatter, rank {r}")), op, &inputs, r * c, o);
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

/// The ring, the mesh and the one-shot over direct routes (P2P between
/// devices, local within one), and with two GPUs or more also the links
/// between devices: staged (Auto), a ring mixing P2P and staged (Auto),
/// the one-shot through host memory and the staged ring forced (Auto picks
/// the host one-shot there). Ranks share devices where there are more than
/// GPUs. On one GPU the first three only: every `Auto` link there is
/// local; the staged links on one device (`StagedOnly` stages them too)
/// run in `staged_links_within_one_device`, at fewer types and sizes.
fn path_sets(n: usize, gpus: usize) -> Vec<PathSet> {
    if gpus == 1 {
        return vec![
            ("one-device-ring", Vec::new(), Algorithm::Ring),
            ("one-device-mesh", Vec::new(), Algorithm::Mesh),
            ("one-device-oneshot", Vec::new(), Algorithm::OneShot),
        ];
    }
    let mixed: Vec<PathPolicy> = (0..n).map(|r| if r % 2 == 0 { PathPolicy::P2pOnly } else { PathPolicy::StagedOnly }).collect();
    vec![
        ("p2p-ring", Vec::new(), Algorithm::Ring),
        ("staged", vec![PathPolicy::StagedOnly; n], Algorithm::Auto),
        ("mixed", mixed, Algorithm::Auto),
        ("p2p-mesh", Vec::new(), Algorithm::Mesh),
        ("p2p-oneshot", Vec::new(), Algorithm::OneShot),
        ("host-oneshot", vec![PathPolicy::StagedOnly; n], Algorithm::OneShot),
        ("staged-ring", vec![PathPolicy::StagedOnly; n], Algorithm::Ring),
    ]
}

/// Says (in a `SKIPPED` line) which path sets `n` ranks on `gpus` GPUs do
/// not cover: on one GPU, the links between devices.
fn say_uncovered(test: &str, n: usize, gpus: usize) {
    common::has_gpus(
        test,
        &format!(
            "n={n}: the P2P, staged and mixed links between devices and the host one-shot (the ring, mesh and one-shot ran on one; \
             staged_links_within_one_device runs the staged sets there)"
        ),
        gpus,
        2,
    );
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
        $f::<F8E4M3>($($args),*);
        $f::<F8E5M2>($($args),*);
    }};
}

/// Every op on `T` (avg on floats; on integers, the refusal of avg).
fn ops_for<T: TestElem>(s: &Setup, count: usize, tag: &str) {
    for op in ReduceOp::ALL {
        if op == ReduceOp::Avg && T::BITS.is_none() {
            avg_is_refused::<T>(s, tag);
            continue;
        }
        run_all::<T>(s, op, count, tag);
    }
}

/// Avg on an integer type is `Error::UnsupportedOp` naming both, from
/// every collective that reduces.
fn avg_is_refused<T: TestElem>(s: &Setup, tag: &str) {
    let n = s.group.size();
    let bufs = |len: usize| -> Vec<CudaSlice<T>> { s.streams.iter().map(|st| st.clone_htod(&vec![T::poison(); len]).unwrap()).collect() };
    let (send, mut recv, mut one) = (bufs(n), bufs(n), bufs(1));
    let results = [
        ("all_reduce_in_place", s.group.all_reduce_in_place(&mut recv, ReduceOp::Avg)),
        ("all_reduce", s.group.all_reduce(&send, &mut recv, ReduceOp::Avg)),
        ("reduce_scatter", s.group.reduce_scatter(&send, &mut one, ReduceOp::Avg)),
        ("reduce", s.group.reduce(&send, &mut recv, 0, ReduceOp::Avg)),
    ];
    for (what, r) in results {
        match r {
            Err(Error::UnsupportedOp { op: "avg", dtype }) if dtype == T::DTYPE.name() => {}
            other => panic!("{what} {tag} avg on {}: expected UnsupportedOp (avg, {}), got {other:?}", T::DTYPE, T::DTYPE.name()),
        }
    }
}

/// Runs `body` on a group of each of `ns` ranks over every path set the
/// GPUs allow, saying (SKIPPED) which sets they do not.
fn each_group(test: &str, ctx: &[Arc<CudaContext>], ns: &[usize], mut body: impl FnMut(&Setup, usize, &str)) {
    for &n in ns {
        say_uncovered(test, n, ctx.len());
        for set in path_sets(n, ctx.len()) {
            let tag = set.0;
            let s = setup(ctx, n, set);
            body(&s, n, tag);
        }
    }
}

/// Every op and type, all collectives, for N = 2 and 3 over every path set.
#[test]
fn every_op_and_type_on_two_and_three_ranks() {
    let test = "every_op_and_type_on_two_and_three_ranks";
    let Some(ctx) = gpus(test, 1) else { return };
    each_group(test, &ctx, &[2, 3], |s, n, tag| {
        for count in counts(n) {
            for_types!(ops_for, s, count, tag);
            for_types!(run_moves, s, count, tag);
        }
    });
}

/// The staged path sets on one device (`StagedOnly` stages ranks that
/// share one, through pinned host memory as between two devices): staged
/// Auto, a ring mixing local and staged links, the one-shot through host
/// memory and the staged ring, on 2 and 3 ranks, every collective at a
/// few types and ops and at sizes that cross the host one-shot's lanes
/// and the staging chunks. Where there are two GPUs or more,
/// `every_op_and_type_on_two_and_three_ranks` runs these sets between
/// devices at every type, so this runs on one only.
#[test]
fn staged_links_within_one_device() {
    let test = "staged_links_within_one_device";
    let Some(ctx) = gpus(test, 1) else { return };
    if ctx.len() > 1 {
        return;
    }
    for n in [2, 3] {
        let mixed: Vec<PathPolicy> = (0..n).map(|r| if r % 2 == 0 { PathPolicy::P2pOnly } else { PathPolicy::StagedOnly }).collect();
        let sets: [PathSet; 4] = [
            ("one-device-staged", vec![PathPolicy::StagedOnly; n], Algorithm::Auto),
            ("one-device-mixed", mixed, Algorithm::Auto),
            ("one-device-host-oneshot", vec![PathPolicy::StagedOnly; n], Algorithm::OneShot),
            ("one-device-staged-ring", vec![PathPolicy::StagedOnly; n], Algorithm::Ring),
        ];
        for set in sets {
            let tag = set.0;
            let s = setup(&ctx, n, set);
            let staged = (0..n).filter(|&r| s.group.link_status(r).is_some_and(|st| st.path == Path::Staged)).count();
            assert!(staged >= 1, "{tag} n={n}: no staged link");
            for count in [1, n + 1, 300_007, (5 << 20) + 3] {
                run_all::<u32>(&s, ReduceOp::Sum, count, tag);
                run_all::<f32>(&s, ReduceOp::Avg, count, tag);
                run_all::<bf16>(&s, ReduceOp::Max, count, tag);
                run_moves::<u32>(&s, count, tag);
            }
        }
    }
}

/// Every pair of fp8 values as the inputs of a two-rank all-reduce of
/// `T`, for every op ([`common::fp8`]), both ranks' results bit for bit
/// the same.
fn fp8_pairs<T: TestElem>(s: &Setup, tag: &str, from_bits: fn(u8) -> T) {
    let ins = common::fp8::pairs(from_bits);
    for op in ReduceOp::ALL {
        let mut bufs = upload(s, &ins);
        s.group.all_reduce_in_place(&mut bufs, op).unwrap_or_else(|e| panic!("{tag} {} {op}: {e}", T::DTYPE));
        let outs = download(s, &bufs);
        assert_ranks_identical(&format!("{tag} {} {op} pairs", T::DTYPE), &outs);
        common::fp8::assert_right(&format!("{tag} {} {op}", T::DTYPE), op, &ins, &outs[0]);
    }
}

/// fp8 sums and products round as NCCL's, min and max return an input:
/// every pair of values of both fp8 types
/// through a two-rank all-reduce of every op, on every path set and
/// algorithm the GPUs allow ([`fp8_pairs`]).
#[test]
fn fp8_reductions_round_as_nccl_does_on_every_pair() {
    let test = "fp8_reductions_round_as_nccl_does_on_every_pair";
    let Some(ctx) = gpus(test, 1) else { return };
    each_group(test, &ctx, &[2], |s, _, tag| {
        fp8_pairs::<F8E4M3>(s, tag, F8E4M3::from_bits);
        fp8_pairs::<F8E5M2>(s, tag, F8E5M2::from_bits);
    });
}

/// The pair check of [`fp8_pairs`] can fail: for both fp8 types and every
/// op it takes the model's own results (NaN where an input is NaN), and
/// rejects a rank dropped (rank 0's inputs returned), another op's results,
/// and exactly the elements changed to a neighbouring code. No GPU needed.
#[test]
fn the_fp8_pair_check_rejects_a_dropped_rank_another_op_and_a_changed_code() {
    fn model<T: Num>(op: ReduceOp, ins: &[Vec<T>; 2], nan: T) -> Vec<T> {
        ins[0].iter().zip(&ins[1]).map(|(&x, &y)| common::fp8::step(op, x, y).unwrap_or(nan)).collect()
    }
    fn run<T: Num>(from_bits: fn(u8) -> T, to_bits: fn(&T) -> u8) {
        let ins = common::fp8::pairs(from_bits);
        let nan = from_bits(0x7f);
        let mut rng = StdRng::seed_from_u64(0xf8);
        for op in ReduceOp::ALL {
            let what = |d: &str| format!("{} {op}: {d}", T::DTYPE);
            let right = model(op, &ins, nan);
            assert_eq!(common::fp8::wrong(op, &ins, &right), Vec::<String>::new(), "{}", what("the model's results"));
            let dropped = common::fp8::wrong(op, &ins, &ins[0]).len();
            assert!(dropped > 1000, "{}", what(&format!("a dropped rank: only {dropped} pairs rejected")));
            let other = if op == ReduceOp::Max { ReduceOp::Min } else { ReduceOp::Max };
            let swapped = common::fp8::wrong(op, &ins, &model(other, &ins, nan)).len();
            assert!(swapped > 1000, "{}", what(&format!("{other}'s results: only {swapped} pairs rejected")));
            let mut changed = right.clone();
            let mut n = 0;
            for _ in 0..200 {
                let i = rng.random_range(0..changed.len());
                let near = from_bits(to_bits(&right[i]) ^ 1);
                if right[i].to_f64().is_nan() || near.to_f64().is_nan() || to_bits(&changed[i]) != to_bits(&right[i]) {
                    continue;
                }
                changed[i] = near;
                n += 1;
            }
            assert!(n > 100, "{}", what("too few codes changed"));
            assert_eq!(common::fp8::wrong(op, &ins, &changed).len(), n, "{}", what("codes changed by one bit"));
        }
    }
    run::<F8E4M3>(F8E4M3::from_bits, F8E4M3::to_bits);
    run::<F8E5M2>(F8E5M2::from_bits, F8E5M2::to_bits);
}

/// The all-reduce average of one 16-bit float type near the top of its
/// range, in place and out of place: every rank's inputs in `lo..hi`, so
/// that the sum of any two overflows the type while the mean does not.
fn avg_near_the_top<T: TestElem>(s: &Setup, lo: f64, hi: f64, tag: &str) {
    let n = s.group.size();
    let mut rng = rand::rng();
    for count in [1024, (1 << 20) + 3] {
        let what = |c: &str| format!("{c} {tag} {} avg near the top n={n} count={count}", T::DTYPE);
        let inputs: Vec<Vec<T>> = (0..n).map(|_| (0..count).map(|_| T::from_f64(rng.random_range(lo..hi))).collect()).collect();
        assert!(inputs.iter().flatten().all(|x| x.to_f64().is_finite()), "{}: inputs out of range", what("setup"));
        let mut bufs = upload(s, &inputs);
        s.group.all_reduce_in_place(&mut bufs, ReduceOp::Avg).expect("all_reduce_in_place");
        let outs = download(s, &bufs);
        assert!(outs.iter().flatten().all(|x| x.to_f64().is_finite()), "{}: an average overflowed", what("all_reduce_in_place"));
        check_all_ranks(&what("all_reduce_in_place"), ReduceOp::Avg, &inputs, &outs);
        let send = upload(s, &inputs);
        let mut recv = upload(s, &vec![vec![T::poison(); count]; n]);
        s.group.all_reduce(&send, &mut recv, ReduceOp::Avg).expect("all_reduce");
        let outs = download(s, &recv);
        assert!(outs.iter().flatten().all(|x| x.to_f64().is_finite()), "{}: an average overflowed", what("all_reduce"));
        check_all_ranks(&what("all_reduce"), ReduceOp::Avg, &inputs, &outs);
        assert!(download(s, &send) == inputs, "{}: send buffers changed", what("all_reduce"));
        // Reduce-scatter: block r of every rank's `inputs` (count rounded down
        // to n blocks).
        let c = count / n;
        let blocks: Vec<Vec<T>> = inputs.iter().map(|x| x[..n * c].to_vec()).collect();
        let send = upload(s, &blocks);
        let mut recv = upload(s, &vec![vec![T::poison(); c]; n]);
        s.group.reduce_scatter(&send, &mut recv, ReduceOp::Avg).expect("reduce_scatter");
        for (r, o) in download(s, &recv).iter().enumerate() {
            assert!(o.iter().all(|x| x.to_f64().is_finite()), "{}: an average overflowed", what(&format!("reduce_scatter, rank {r}")));
            check_all(&what(&format!("reduce_scatter, rank {r}")), ReduceOp::Avg, &blocks, r * c, o);
        }
        assert!(download(s, &send) == blocks, "{}: send buffers changed", what("reduce_scatter"));
        // Reduce to the last rank.
        let root = n - 1;
        let send = upload(s, &inputs);
        let mut recv = upload(s, &vec![vec![T::poison(); count]; n]);
        s.group.reduce(&send, &mut recv, root, ReduceOp::Avg).expect("reduce");
        let out = s.streams[root].clone_dtoh(&recv[root]).unwrap();
        assert!(out.iter().all(|x| x.to_f64().is_finite()), "{}: an average overflowed", what("reduce"));
        check_all(&what("reduce"), ReduceOp::Avg, &inputs, 0, &out);
        assert!(download(s, &send) == inputs, "{}: send buffers changed", what("reduce"));
    }
}

/// f16 and bf16 averages whose sums overflow the type but whose means do
/// not (two ranks of 40,000 in f16, say) are finite and right, on every
/// algorithm the GPUs allow, and in the group's reduce-scatter and reduce.
#[test]
fn avg_near_the_top_of_the_range_does_not_overflow() {
    let test = "avg_near_the_top_of_the_range_does_not_overflow";
    let Some(ctx) = gpus(test, 1) else { return };
    each_group(test, &ctx, &[2, 3], |s, _, tag| {
        avg_near_the_top::<f16>(s, 40_000.0, 65_000.0, tag);
        avg_near_the_top::<bf16>(s, 1.8e38, 3.3e38, tag);
    });
}

/// Sum for every type and avg for every float type, all collectives,
/// N = 4, 5, 8.
#[test]
fn larger_rings_every_type() {
    let test = "larger_rings_every_type";
    let Some(ctx) = gpus(test, 1) else { return };
    each_group(test, &ctx, &[4, 5, 8], |s, n, tag| {
        for count in counts(n) {
            for_types!(sum_only, s, count, tag);
            for_types!(run_moves, s, count, tag);
        }
        run_all::<f32>(s, ReduceOp::Max, n + 1, tag);
        for count in [n + 1, 1_000_003] {
            run_all::<f32>(s, ReduceOp::Avg, count, tag);
            run_all::<f64>(s, ReduceOp::Avg, count, tag);
            run_all::<f16>(s, ReduceOp::Avg, count, tag);
            run_all::<bf16>(s, ReduceOp::Avg, count, tag);
        }
        avg_is_refused::<i32>(s, tag);
    });
}

fn sum_only<T: TestElem>(s: &Setup, count: usize, tag: &str) {
    run_all::<T>(s, ReduceOp::Sum, count, tag);
}

/// 16M elements, f32 and bf16 sum, every N and path set (on one GPU the
/// mesh and the one-shot: the ring on one device at these sizes is what
/// `larger_rings_every_type` runs at 1M).
#[test]
fn sixteen_million_elements() {
    let test = "sixteen_million_elements";
    let Some(ctx) = gpus(test, 1) else { return };
    for n in [2, 3, 4, 5, 8] {
        say_uncovered(test, n, ctx.len());
        for set in path_sets(n, ctx.len()).into_iter().filter(|set| ctx.len() > 1 || set.2 != Algorithm::Ring) {
            let tag = set.0;
            let s = setup(&ctx, n, set);
            // Not a whole number of one-shot rounds or 16-byte units.
            run_all::<f32>(&s, ReduceOp::Sum, (16 << 20) + 5, tag);
            run_all::<bf16>(&s, ReduceOp::Sum, 16 << 20, tag);
        }
    }
}

/// Runs `calls` (a chain: `common::chain`) of in-place sums on `bufs`,
/// refilling the rank each call names from `refill` first, on its stream.
fn run_chain(s: &Setup, bufs: &mut [CudaSlice<u32>], refill: &[CudaSlice<u32>], calls: &[chain::Call], what: &str) {
    for (k, (range, refilled)) in calls.iter().enumerate() {
        assert_eq!(range.start, 0, "whole buffers only");
        if let Some(p) = *refilled {
            s.streams[p].memcpy_dtod(&refill[p], &mut bufs[p]).unwrap();
        }
        s.group.all_reduce_in_place(bufs, ReduceOp::Sum).unwrap_or_else(|e| panic!("{what}: call {k}: {e}"));
    }
}

/// Every rank's buffer against the chain's expected one.
fn check_chain(s: &Setup, bufs: &[CudaSlice<u32>], want: &[Vec<u32>], what: &str) {
    for (r, o) in download(s, bufs).iter().enumerate() {
        if let Some((first, bad)) = common::diff(o, &want[r]) {
            panic!("{what}: rank {r} has {bad} of {} wrong elements, first at {first}: {} instead of {}", o.len(), o[first], want[r][first]);
        }
    }
}

/// 100 all-reduces back to back with no host synchronisation: a chain of
/// wrapping u32 sums (`common::chain`), so that any race or missed step,
/// in any call, is visible exactly at the end for every rank count.
#[test]
fn hundred_back_to_back_all_reduces() {
    let Some(ctx) = gpus("hundred_back_to_back_all_reduces", 1) else { return };
    let count = 1_000_003;
    for n in [2, 3, 8] {
        let start = random_inputs::<u32>(n, count, ReduceOp::Sum);
        let refill = random_inputs::<u32>(n, count, ReduceOp::Sum);
        let calls = chain::calls(n, 0..count, 100);
        let want = chain::simulate(&start, &refill, &calls);
        chain::assert_informative(&format!("n={n}"), &want[0]);
        for set in path_sets(n, ctx.len()) {
            let tag = set.0;
            let s = setup(&ctx, n, set);
            let mut bufs = upload(&s, &start);
            let refills = upload(&s, &refill);
            let what = format!("{tag} n={n}, 100 all-reduces");
            run_chain(&s, &mut bufs, &refills, &calls, &what);
            check_chain(&s, &bufs, &want, &what);
        }
    }
}

/// Calls of different sizes interleaved with no host synchronisation, so
/// that consecutive calls take different one-shot lanes (and algorithms
/// under Auto), with out-of-place calls between them: chains of wrapping
/// u32 sums (`common::chain`) make any race between them exact. Each set
/// runs with launcher threads spinning, without them, and with them parked
/// at every call. On one GPU both ranks share it (the one-shot and Auto
/// over local routes, and over staged ones: `StagedOnly` stages them).
#[test]
fn interleaved_sizes_back_to_back() {
    let test = "interleaved_sizes_back_to_back";
    let Some(ctx) = gpus(test, 1) else { return };
    let n = 2;
    // 4 KB, 40 KB, 240 KB, 4 MB and 40 MB per rank.
    let sizes = [1_000, 10_000, 60_000, 1_000_003, 10_000_000];
    let mut sets = vec![("p2p-oneshot", Vec::new(), Algorithm::OneShot), ("p2p-auto", Vec::new(), Algorithm::Auto)];
    sets.push(("host-oneshot", vec![PathPolicy::StagedOnly; n], Algorithm::OneShot));
    sets.push(("staged-auto", vec![PathPolicy::StagedOnly; n], Algorithm::Auto));
    // Launcher threads as by default, none, and parked before every call
    // (spin 0: the calling thread launches every rank and wakes them).
    let spins = [GroupOptions::default().launch_spin, None, Some(Duration::ZERO)];
    for (set, spin) in sets.into_iter().flat_map(|set| spins.map(|spin| (set.clone(), spin))) {
        let tag = format!("{} launch_spin {spin:?}", set.0);
        let s = setup_with(&ctx, n, set, spin);
        let inputs: Vec<Vec<Vec<u32>>> = sizes.iter().map(|&c| random_inputs::<u32>(n, c, ReduceOp::Sum)).collect();
        let refill: Vec<Vec<Vec<u32>>> = sizes.iter().map(|&c| random_inputs::<u32>(n, c, ReduceOp::Sum)).collect();
        let mut bufs: Vec<Vec<CudaSlice<u32>>> = inputs.iter().map(|i| upload(&s, i)).collect();
        let refills: Vec<Vec<CudaSlice<u32>>> = refill.iter().map(|i| upload(&s, i)).collect();
        let mut calls: Vec<Vec<chain::Call>> = vec![Vec::new(); sizes.len()];
        // Out of place too: a pair of 40 KB buffers, each call reducing one
        // into the other (ping-pong), between the in-place calls; a chain
        // whose refilled rank sends its refill buffer instead.
        let pp_count = 10_000;
        let pp_inputs = random_inputs::<u32>(n, pp_count, ReduceOp::Sum);
        let pp_refill = random_inputs::<u32>(n, pp_count, ReduceOp::Sum);
        let pp_refills = upload(&s, &pp_refill);
        let mut pp = [upload(&s, &pp_inputs), upload(&s, &vec![vec![u32::MAX; pp_count]; n])];
        let mut pp_calls: Vec<chain::Call> = Vec::new();
        // 40 calls, 8 of each size, each size followed by every other one.
        for k in 0..40 {
            let which = (k * 7 + k / 5) % sizes.len();
            let refilled = chain::refilled(n, calls[which].len());
            if let Some(p) = refilled {
                s.streams[p].memcpy_dtod(&refills[which][p], &mut bufs[which][p]).unwrap();
            }
            s.group.all_reduce_in_place(&mut bufs[which], ReduceOp::Sum).unwrap();
            calls[which].push((0..sizes[which], refilled));
            if k % 3 == 0 {
                let j = pp_calls.len();
                let refilled = chain::refilled(n, j);
                let [a, b] = &mut pp;
                let (from, to) = if j.is_multiple_of(2) { (&*a, b) } else { (&*b, a) };
                let send: Vec<CudaView<u32>> =
                    (0..n).map(|r| if Some(r) == refilled { pp_refills[r].slice(..) } else { from[r].slice(..) }).collect();
                s.group.all_reduce(&send, to, ReduceOp::Sum).unwrap();
                pp_calls.push((0..pp_count, refilled));
            }
        }
        // The last call wrote pp[m % 2]; the one before, the other buffer.
        let m = pp_calls.len();
        let want = chain::simulate(&pp_inputs, &pp_refill, &pp_calls);
        chain::assert_informative(&format!("{tag}: ping-pong"), &want[0]);
        check_chain(&s, &pp[m % 2], &want, &format!("{tag}: out-of-place ping-pong after {m} calls"));
        let before = chain::simulate(&pp_inputs, &pp_refill, &pp_calls[..m - 1]);
        check_chain(&s, &pp[(m + 1) % 2], &before, &format!("{tag}: out-of-place ping-pong after {} calls", m - 1));
        for (w, &c) in sizes.iter().enumerate() {
            let want = chain::simulate(&inputs[w], &refill[w], &calls[w]);
            chain::assert_informative(&format!("{tag}: size {c}"), &want[0]);
            check_chain(&s, &bufs[w], &want, &format!("{tag}: size {c} after {} calls", calls[w].len()));
        }
    }
}

/// Bad input is a typed error, never a panic. Ranks round robin over the
/// GPUs; the buffers swapped between devices need two.
#[test]
fn bad_input_is_refused() {
    let test = "bad_input_is_refused";
    let Some(ctx) = gpus(test, 1) else { return };
    let s = setup(&ctx, 2, ("p2p", Vec::new(), Algorithm::Auto));
    // The fused algorithms take 2 to 8 ranks (sharing devices or not): one
    // rank or nine are refused when forced.
    // Two ranks on one stream (the same stream twice, or one context's
    // legacy default stream twice): their fused kernels would wait for each
    // other at a barrier.
    let one = ctx[0].new_stream().unwrap();
    for (streams, what) in
        [(vec![one.clone(), one], "one stream twice"), (vec![ctx[0].default_stream(), ctx[0].default_stream()], "the default stream twice")]
    {
        match Group::new(streams, &GroupOptions::default()) {
            Err(Error::InvalidArgument(why)) => assert!(why.contains("one stream"), "{what}: {why}"),
            other => panic!("{what}: expected InvalidArgument, got {:?}", other.map(|_| "a group")),
        }
    }
    for (ranks, what) in [(1, "one rank"), (MAX_RANKS + 1, "nine ranks")] {
        let streams: Vec<_> = (0..ranks).map(|r| ctx[r % ctx.len()].new_stream().unwrap()).collect();
        for (algorithm, name) in [(Algorithm::Mesh, "mesh"), (Algorithm::OneShot, "one-shot")] {
            match Group::new(streams.clone(), &GroupOptions::default().algorithm(algorithm)) {
                Err(Error::AlgorithmUnavailable { algorithm, .. }) => assert_eq!(algorithm, name, "{name} on {what}"),
                other => panic!("{name} on {what}: expected AlgorithmUnavailable, got {:?}", other.map(|_| "a group")),
            }
        }
    }
    let mut a = vec![s.streams[0].alloc_zeros::<f32>(10).unwrap(), s.streams[1].alloc_zeros::<f32>(11).unwrap()];
    assert!(matches!(s.group.all_reduce_in_place(&mut a, ReduceOp::Sum), Err(Error::LengthMismatch { .. })));
    if common::has_gpus(test, "buffers swapped between the ranks' devices (WrongDevice)", ctx.len(), 2) {
        let mut swapped = vec![s.streams[1].alloc_zeros::<f32>(10).unwrap(), s.streams[0].alloc_zeros::<f32>(10).unwrap()];
        assert!(matches!(s.group.all_reduce_in_place(&mut swapped, ReduceOp::Sum), Err(Error::WrongDevice { .. })));
    }
    let mut ints = vec![s.streams[0].alloc_zeros::<i32>(10).unwrap(), s.streams[1].alloc_zeros::<i32>(10).unwrap()];
    assert!(matches!(s.group.all_reduce_in_place(&mut ints, ReduceOp::Avg), Err(Error::UnsupportedOp { .. })));
    assert!(matches!(s.group.broadcast(&mut ints, 2), Err(Error::RootOutOfRange { root: 2, size: 2 })));
    let mut one = vec![s.streams[0].alloc_zeros::<i32>(10).unwrap()];
    assert!(matches!(s.group.all_reduce_in_place(&mut one, ReduceOp::Sum), Err(Error::InvalidArgument(_))));
    let send = vec![s.streams[0].alloc_zeros::<i32>(20).unwrap(), s.streams[1].alloc_zeros::<i32>(20).unwrap()];
    let mut recv = vec![s.streams[0].alloc_zeros::<i32>(11).unwrap(), s.streams[1].alloc_zeros::<i32>(11).unwrap()];
    assert!(matches!(s.group.reduce_scatter(&send, &mut recv, ReduceOp::Sum), Err(Error::LengthMismatch { .. })));
}

/// A group of no rank is refused before any driver call (no GPU needed).
#[test]
fn an_empty_group_is_refused() {
    assert!(matches!(Group::new(Vec::new(), &GroupOptions::default()), Err(Error::EmptyGroup)));
}

/// A group of one rank is the identity (avg too).
#[test]
fn single_rank_group_is_identity() {
    let Some(ctx) = gpus("single_rank_group_is_identity", 1) else { return };
    let s = setup(&ctx[..1], 1, ("single", Vec::new(), Algorithm::Auto));
    for count in [0, 1, 1000] {
        run_all::<f32>(&s, ReduceOp::Avg, count, "single");
        run_all::<i64>(&s, ReduceOp::Prod, count, "single");
        run_moves::<u8>(&s, count, "single");
    }
}

/// All-reduces of several sizes (one-shot, mesh and ring under Auto) and
/// unaligned views, interleaved back to back with no host synchronisation:
/// chains of wrapping u32 sums (`common::chain`, over the whole buffer or
/// the view's elements) show any slot reused too early or any race between
/// algorithms exactly. On one GPU both ranks share it (Auto over local
/// routes, and staged Auto over staged ones).
#[test]
fn interleaved_sizes_and_algorithms() {
    let test = "interleaved_sizes_and_algorithms";
    let Some(ctx) = gpus(test, 1) else { return };
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
        let refill: Vec<Vec<Vec<u32>>> = counts.iter().map(|&c| random_inputs::<u32>(n, c, ReduceOp::Sum)).collect();
        let mut bufs: Vec<Vec<CudaSlice<u32>>> = inputs.iter().map(|i| upload(&s, i)).collect();
        let refills: Vec<Vec<CudaSlice<u32>>> = refill.iter().map(|i| upload(&s, i)).collect();
        let mut calls: Vec<Vec<chain::Call>> = vec![Vec::new(); counts.len()];
        let mut rounds = [0u32; 5];
        for step in 0..50 {
            let k = (step * 7 + step / 3) % 5;
            // Unaligned views (4 bytes in) of the largest buffer (mesh
            // or ring) and of the smallest (the one-shot's element path).
            let (b, from) = match k {
                3 => (2, 1),
                4 => (0, 1),
                _ => (k, 0),
            };
            let refilled = chain::refilled(n, calls[b].len());
            if let Some(p) = refilled {
                s.streams[p].memcpy_dtod(&refills[b][p].slice(from..), &mut bufs[b][p].slice_mut(from..)).unwrap();
            }
            if from == 0 {
                s.group.all_reduce_in_place(&mut bufs[b], ReduceOp::Sum).unwrap();
            } else {
                let mut views: Vec<_> = bufs[b].iter_mut().map(|b| b.slice_mut(from..)).collect();
                s.group.all_reduce_in_place(&mut views, ReduceOp::Sum).unwrap();
            }
            calls[b].push((from..counts[b], refilled));
            rounds[k] += 1;
        }
        for (k, &c) in counts.iter().enumerate() {
            let want = chain::simulate(&inputs[k], &refill[k], &calls[k]);
            chain::assert_informative(&format!("{tag}: buffer of {c} elements"), &want[0]);
            let views = match k {
                2 => rounds[3],
                0 => rounds[4],
                _ => 0,
            };
            check_chain(&s, &bufs[k], &want, &format!("{tag}: buffer of {c} elements after {} whole + {views} view all-reduces", rounds[k]));
        }
    }
}

// ---- CPU self-checks (no GPU): the planted defects must be caught ----

/// The float comparison (`check_range`, as every GPU test above uses it)
/// accepts a right reduction in every order the kernels may take, and
/// rejects, on every element, a rank dropped and an average divided by
/// `n - 1`, for every float type and 2 to 8 ranks, on the inputs
/// `random_inputs` draws; for fp8 (whose bound is wider than a dropped
/// rank: its steps are checked exactly by
/// `fp8_reductions_round_as_nccl_does_on_every_pair`) only the first.
#[test]
fn the_float_comparison_rejects_a_dropped_rank_and_avg_by_n_minus_1() {
    fn for_type<T: TestElem>(rng: &mut StdRng, defects_rejected: bool) {
        let count = 1000;
        for n in 2..=MAX_RANKS {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod] {
                let inputs = random_inputs_from::<T>(rng, n, count, op);
                let column = |i: usize| -> Vec<T> { inputs.iter().map(|v| v[i]).collect() };
                let what = |case: &str| format!("{} {op} n={n}: {case}", T::DTYPE);
                let cases = num::right_results(op, &column(0), 0).len();
                for c in 0..cases {
                    let got: Vec<T> = (0..count).map(|i| num::right_results(op, &column(i), i % n)[c].1).collect();
                    let name = num::right_results(op, &column(0), 0)[c].0;
                    if let Some((wrong, first)) = check_range(op, &inputs, 0, &got) {
                        panic!("{}: {wrong} of {count} rejected, first at {first}: {:?} from {:?}", what(name), got[first], column(first));
                    }
                }
                if !defects_rejected {
                    continue;
                }
                let defects = num::planted_defects(op, &column(0), 0).len();
                assert!(defects >= 1);
                for d in 0..defects {
                    let got: Vec<T> = (0..count).map(|i| num::planted_defects(op, &column(i), i % n)[d].1).collect();
                    let name = num::planted_defects(op, &column(0), 0)[d].0;
                    match check_range(op, &inputs, 0, &got) {
                        Some((wrong, _)) if wrong == count => {}
                        other => panic!("{}: not rejected on every element ({other:?}: (wrong, first wrong))", what(name)),
                    }
                }
            }
        }
    }
    let mut rng = StdRng::seed_from_u64(0x5eed_0f10);
    for_type::<f32>(&mut rng, true);
    for_type::<f64>(&mut rng, true);
    for_type::<f16>(&mut rng, true);
    for_type::<bf16>(&mut rng, true);
    for_type::<F8E4M3>(&mut rng, false);
    for_type::<F8E5M2>(&mut rng, false);
}

/// The back-to-back chains (`common::chain`, as the GPU tests above run
/// them) carry a defect planted in any call, early or late, to every
/// element of the end result, for 2 to 8 ranks: a rank dropped from a sum,
/// a call that wrote zeros, a call that did not run, one rank's output off
/// by one (on a rank whose output the chain carries). The expected results
/// are informative (no zeros).
#[test]
fn back_to_back_chains_carry_every_calls_error_to_the_end() {
    let mut rng = StdRng::seed_from_u64(0xc4a1_0b2b);
    let (count, calls_n) = (1024, 100);
    for n in 2..=MAX_RANKS {
        let start = random_inputs_from::<u32>(&mut rng, n, count, ReduceOp::Sum);
        let refill = random_inputs_from::<u32>(&mut rng, n, count, ReduceOp::Sum);
        let calls = chain::calls(n, 0..count, calls_n);
        let want = chain::simulate(&start, &refill, &calls);
        chain::assert_informative(&format!("n={n}"), &want[0]);
        assert!(want.iter().all(|w| *w == want[0]), "n={n}: ranks end differently");
        for at in [0, 1, calls_n / 2, calls_n - 2, calls_n - 1] {
            let q = at % n;
            // A rank whose output of call `at` the next call reads.
            let carried = chain::refilled(n, at + 1).map_or(q, |p| (p + 1) % n);
            type Defect = Box<dyn Fn(&[u32], &mut [u32]) + Sync>;
            let defects: Vec<(&str, Defect, bool)> = vec![
                (
                    "a rank dropped",
                    Box::new(move |v: &[u32], out: &mut [u32]| {
                        let s = out[0].wrapping_sub(v[q]);
                        out.fill(s)
                    }),
                    true,
                ),
                ("zeros written", Box::new(|_: &[u32], out: &mut [u32]| out.fill(0)), true),
                ("the call not run", Box::new(|v: &[u32], out: &mut [u32]| out.copy_from_slice(v)), true),
                ("one rank's output off by one", Box::new(move |_: &[u32], out: &mut [u32]| out[carried] = out[carried].wrapping_add(1)), false),
            ];
            for (name, defect, every_rank) in &defects {
                let got = chain::simulate_with(&start, &refill, &calls, |k, v, out| {
                    if k == at {
                        defect(v, out)
                    }
                });
                let lost = (0..count).filter(|&i| (0..n).all(|r| got[r][i] == want[r][i])).count();
                assert_eq!(lost, 0, "n={n}, {name} at call {at}: {lost} of {count} elements end right");
                if *every_rank {
                    for r in 0..n {
                        let lost = (0..count).filter(|&i| got[r][i] == want[r][i]).count();
                        assert_eq!(lost, 0, "n={n}, {name} at call {at}: rank {r} ends right in {lost} of {count} elements");
                    }
                }
            }
        }
    }
}
