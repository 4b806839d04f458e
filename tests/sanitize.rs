//! The multi-rank paths at sizes for compute-sanitizer: `tests/sanitizer.sh`
//! runs these tests under memcheck, racecheck and synccheck (they run as
//! ordinary GPU tests too, in seconds). Each reaches what the other test
//! files reach only at sizes too slow under the tools, or not at all:
//!
//! * `ring_of_three_to_eight_ranks`: the ring forced, 3 to 8 ranks laid
//!   round robin over the GPUs, every collective;
//! * `oneshot_every_lane`: the one-shot forced on 2 and 4 ranks, every lane
//!   of its slots in device memory (each lane's top and the next lane's
//!   first bytes, partial 16-byte units, the large lane over one round more
//!   than it has slot sets); with two GPUs also through host memory, every
//!   host lane;
//! * `mesh_above_4_mib`: the mesh of 2 ranks where `Auto` takes it (above
//!   4 MiB pushed), and forced on 3 and 4 ranks, at 4 to 6 MiB per rank;
//! * `staged_ring_rotation` (two GPUs): the staged ring with 64 KiB chunks,
//!   so that every step takes many chunks and the links' pinned buffers
//!   rotate within calls and from call to call;
//! * `two_processes_every_lane` and `two_processes_staged_every_lane_and_chunk`:
//!   two processes (sharing the GPU where there is one) on the P2P and the
//!   staged path: the one-shot on every lane of each, and the other
//!   collectives over several chunks.
//!
//! A group's calls (a process's, for the two-process tests) are enqueued
//! back to back, each on buffers of its own, with nothing synchronised
//! between them (every input is uploaded first); then every result is
//! checked. As docs/testing.md asks: fresh random inputs (the processes
//! agree on a seed the parent draws), outputs poisoned (NaN for floats),
//! integers exact (wrapping), floats within `common::num`'s per-element
//! bound of the f64 reference of that element's inputs (for sum and avg one
//! sign per element and magnitudes in [1, 2), so that a rank left out falls
//! outside it; for prod magnitudes in [1.25, 2)), data movements and
//! all-reduce results across ranks bit for bit, send buffers unchanged.

mod common;

use common::num::{self, Num};
use common::procs::{all_succeeded, child, passes, rank, spawn};
use common::{gpu_count, gpus, skipped};
use cuda_peer::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cuda_peer::ipc::{Comm, CommOptions};
use cuda_peer::{Algorithm, Collectives, Group, GroupOptions, LinkOptions, Path, PathPolicy, ReduceOp};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Duration;

// ---- element types and inputs ----

/// An element type of these tests: its fresh inputs, poison and bits.
trait El: Num {
    /// A fresh input: any value of an integer type; for a float, by `op`
    /// (sum, avg: a magnitude in [1, 2) of the sign given; prod: in
    /// [1.25, 2) of a random sign; else in [-1, 1)).
    fn draw(rng: &mut StdRng, op: ReduceOp, negative: bool) -> Self;
    fn poison() -> Self;
    fn bits(self) -> u64;
}

macro_rules! float_el {
    ($t:ty, $bits:expr) => {
        impl El for $t {
            fn draw(rng: &mut StdRng, op: ReduceOp, negative: bool) -> Self {
                let sign = |negative: bool| if negative { -1.0 } else { 1.0 };
                <$t as Num>::from_f64(match op {
                    ReduceOp::Sum | ReduceOp::Avg => sign(negative) * rng.random_range(1.0..2.0),
                    ReduceOp::Prod => sign(rng.random()) * rng.random_range(1.25..2.0),
                    ReduceOp::Min | ReduceOp::Max => rng.random_range(-1.0..1.0),
                })
            }
            fn poison() -> Self {
                <$t as Num>::from_f64(f64::NAN)
            }
            fn bits(self) -> u64 {
                ($bits)(self)
            }
        }
    };
}
float_el!(f32, |x: f32| x.to_bits() as u64);
float_el!(f64, |x: f64| x.to_bits());
float_el!(f16, |x: f16| x.to_bits() as u64);
float_el!(bf16, |x: bf16| x.to_bits() as u64);

macro_rules! int_el {
    ($($t:ty),*) => {$(
        impl El for $t {
            fn draw(rng: &mut StdRng, _: ReduceOp, _: bool) -> Self {
                rng.random()
            }
            fn poison() -> Self {
                <$t>::MAX / 3 + 7
            }
            fn bits(self) -> u64 {
                self as u64
            }
        }
    )*};
}
int_el!(i8, u8, i32, i64, u64);

/// Fresh inputs of `n` ranks, `len` elements each (element `i` has one
/// sign on every rank).
fn inputs<T: El>(rng: &mut StdRng, n: usize, len: usize, op: ReduceOp) -> Vec<Vec<T>> {
    let negative: Vec<bool> = (0..len).map(|_| rng.random()).collect();
    (0..n).map(|_| negative.iter().map(|&neg| T::draw(rng, op, neg)).collect()).collect()
}

/// Whether `got` is right for element `j` of `op` over `ins[r][j]`:
/// integers exactly (wrapping, any order gives the same), floats within
/// `num::float_bound` of the f64 reference (NaN never).
fn right<T: El>(op: ReduceOp, ins: &[Vec<T>], j: usize, got: T) -> bool {
    if T::BITS.is_none() {
        return got == ins[1..].iter().fold(ins[0][j], |a, v| T::combine(op, a, v[j]));
    }
    let mut xs = [0f64; 8];
    for (x, v) in xs.iter_mut().zip(ins) {
        *x = v[j].to_f64();
    }
    num::accepts(op, &xs[..ins.len()], got)
}

/// Panics unless every `got[i]` is right for element `offset + i` (on every
/// core: outputs reach millions of elements), naming the wrong count and
/// the first.
fn check_reduced<T: El>(what: &str, op: ReduceOp, ins: &[Vec<T>], offset: usize, got: &[T]) {
    assert!(ins.len() <= 8, "{} ranks", ins.len());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(32);
    let per = got.len().div_ceil(threads).max(1 << 15);
    let bad: Vec<(usize, usize)> = std::thread::scope(|s| {
        let hs: Vec<_> = got
            .chunks(per)
            .enumerate()
            .map(|(k, part)| {
                s.spawn(move || {
                    let wrong: Vec<usize> = (0..part.len()).filter(|&i| !right(op, ins, offset + k * per + i, part[i])).collect();
                    wrong.first().map(|&f| (wrong.len(), k * per + f))
                })
            })
            .collect();
        hs.into_iter().filter_map(|h| h.join().expect("a checking thread")).collect()
    });
    if let Some(&(_, i)) = bad.first() {
        let xs: Vec<f64> = ins.iter().map(|v| v[offset + i].to_f64()).collect();
        let bound = T::BITS.map_or(0.0, |b| num::float_bound(op, &xs, b));
        panic!(
            "{what}: {} of {} elements wrong; first at {i}: got {:?}, expected {} (within {bound:e}; f64 reference, integers wrap) from {xs:?}",
            bad.iter().map(|b| b.0).sum::<usize>(),
            got.len(),
            got[i],
            num::reference(op, &xs)
        );
    }
}

/// Panics unless `got` is `want` bit for bit.
fn check_bits<T: El>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a.bits() != b.bits()) {
        let wrong = got.iter().zip(want).filter(|(a, b)| a.bits() != b.bits()).count();
        panic!("{what}: {wrong} of {} elements differ; first at {i}: {:?} instead of {:?}", got.len(), got[i], want[i]);
    }
}

// ---- one call, enqueued back to back ----

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    AllReduceInPlace,
    AllReduce,
    ReduceScatter,
    AllGather,
    BroadcastInPlace,
    Reduce,
}

/// One call: every rank's inputs, and this process's ranks' buffers
/// (every rank's for a group, one for a process's `Comm`).
struct Case<T> {
    what: String,
    kind: Kind,
    op: ReduceOp,
    root: usize,
    /// Elements per rank (per block for reduce-scatter and all-gather).
    count: usize,
    ins: Vec<Vec<T>>,
    /// The ranks whose buffers these are, and their streams.
    ranks: Vec<usize>,
    streams: Vec<Arc<CudaStream>>,
    send: Vec<CudaSlice<T>>,
    recv: Vec<CudaSlice<T>>,
}

/// What a test does with a case, whatever its type: enqueue it on a group
/// or a process's `Comm`, then (after the batch is synchronised) check it.
trait Call {
    fn on_group(&mut self, g: &Group);
    fn on_comm(&mut self, c: &Comm);
    fn check(&self);
}

impl<T: El> Case<T> {
    /// Draws every rank's inputs from `rng` and uploads those of `ranks`
    /// (on `streams`), with poisoned outputs.
    #[allow(clippy::too_many_arguments)]
    fn new(
        tag: &str,
        n: usize,
        ranks: &[usize],
        streams: &[Arc<CudaStream>],
        rng: &mut StdRng,
        kind: Kind,
        op: ReduceOp,
        count: usize,
        root: usize,
    ) -> Self {
        let in_len = if kind == Kind::ReduceScatter { n * count } else { count };
        let out_len = if kind == Kind::AllGather { n * count } else { count };
        let what = format!("{tag} {kind:?} {} {op:?} n={n} count={count} ({} bytes) root={root}", T::DTYPE, in_len * T::DTYPE.size());
        let ins = inputs::<T>(rng, n, in_len, op);
        let in_place = matches!(kind, Kind::AllReduceInPlace | Kind::BroadcastInPlace);
        let (mut send, mut recv) = (Vec::new(), Vec::new());
        for (&r, s) in ranks.iter().zip(streams) {
            let up = |v: &[T]| s.clone_htod(v).unwrap_or_else(|e| panic!("{what}: upload: {e:?}"));
            if in_place {
                recv.push(up(&ins[r]));
            } else {
                send.push(up(&ins[r]));
                recv.push(up(&vec![T::poison(); out_len]));
            }
        }
        Case { what, kind, op, root, count, ins, ranks: ranks.to_vec(), streams: streams.to_vec(), send, recv }
    }
}

impl<T: El> Call for Case<T> {
    fn on_group(&mut self, g: &Group) {
        let r = match self.kind {
            Kind::AllReduceInPlace => g.all_reduce_in_place(&mut self.recv, self.op),
            Kind::AllReduce => g.all_reduce(&self.send, &mut self.recv, self.op),
            Kind::ReduceScatter => g.reduce_scatter(&self.send, &mut self.recv, self.op),
            Kind::AllGather => g.all_gather(&self.send, &mut self.recv),
            Kind::BroadcastInPlace => g.broadcast(&mut self.recv, self.root),
            Kind::Reduce => g.reduce(&self.send, &mut self.recv, self.root, self.op),
        };
        r.unwrap_or_else(|e| panic!("{}: {e}", self.what));
    }

    fn on_comm(&mut self, c: &Comm) {
        let recv = &mut self.recv[0];
        let r = match self.kind {
            Kind::AllReduceInPlace => c.all_reduce_in_place(recv, self.op),
            Kind::AllReduce => c.all_reduce(&self.send[0], recv, self.op),
            Kind::ReduceScatter => c.reduce_scatter(&self.send[0], recv, self.op),
            Kind::AllGather => c.all_gather(&self.send[0], recv),
            Kind::BroadcastInPlace => c.broadcast_in_place(recv, self.root),
            Kind::Reduce => c.reduce(&self.send[0], recv, self.op, self.root),
        };
        r.unwrap_or_else(|e| panic!("rank {}: {}: {e}", rank(), self.what));
    }

    fn check(&self) {
        let down = |s: &Arc<CudaStream>, b: &CudaSlice<T>| s.clone_dtoh(b).unwrap_or_else(|e| panic!("{}: read back: {e:?}", self.what));
        let mut first: Option<Vec<T>> = None;
        for (k, &r) in self.ranks.iter().enumerate() {
            let what = format!("{}, rank {r}", self.what);
            let got = down(&self.streams[k], &self.recv[k]);
            match self.kind {
                Kind::AllReduceInPlace | Kind::AllReduce => {
                    check_reduced(&what, self.op, &self.ins, 0, &got);
                    // Every rank's result bitwise the same.
                    match &first {
                        None => first = Some(got),
                        Some(f) => check_bits(&format!("{what} against rank {}", self.ranks[0]), &got, f),
                    }
                }
                Kind::ReduceScatter => check_reduced(&what, self.op, &self.ins, r * self.count, &got),
                Kind::AllGather => check_bits(&what, &got, &self.ins.concat()),
                Kind::BroadcastInPlace => check_bits(&what, &got, &self.ins[self.root]),
                Kind::Reduce if r == self.root => check_reduced(&what, self.op, &self.ins, 0, &got),
                // A process's `Comm` leaves the others' outputs untouched
                // (a group's are unspecified).
                Kind::Reduce if self.ranks.len() == 1 => check_bits(&format!("{what} (not the root)"), &got, &vec![T::poison(); self.count]),
                Kind::Reduce => {}
            }
            if let Some(s) = self.send.get(k) {
                check_bits(&format!("{what}: the send buffer"), &down(&self.streams[k], s), &self.ins[r]);
            }
        }
    }
}

/// One case of a batch: type, collective, reduction, elements per rank
/// (per block for reduce-scatter and all-gather), root.
#[derive(Clone, Copy)]
struct Spec(&'static str, Kind, ReduceOp, usize, usize);

/// Elements of `size` bytes in `bytes` (at least one).
fn elems(bytes: usize, size: usize) -> usize {
    (bytes / size).max(1)
}

fn byte_size(t: &str) -> usize {
    match t {
        "f64" | "i64" | "u64" => 8,
        "f32" | "i32" => 4,
        "f16" | "bf16" => 2,
        _ => 1,
    }
}

/// The case of `spec`, its inputs drawn from `rng`, its buffers those of
/// `ranks` on `streams`.
fn make(tag: &str, n: usize, ranks: &[usize], streams: &[Arc<CudaStream>], rng: &mut StdRng, spec: Spec) -> Box<dyn Call> {
    let Spec(t, kind, op, count, root) = spec;
    macro_rules! case {
        ($t:ty) => {
            Box::new(Case::<$t>::new(tag, n, ranks, streams, rng, kind, op, count, root)) as Box<dyn Call>
        };
    }
    match t {
        "f32" => case!(f32),
        "f64" => case!(f64),
        "f16" => case!(f16),
        "bf16" => case!(bf16),
        "i8" => case!(i8),
        "u8" => case!(u8),
        "i32" => case!(i32),
        "i64" => case!(i64),
        "u64" => case!(u64),
        other => panic!("no type {other}"),
    }
}

// ---- groups ----

struct G {
    tag: String,
    streams: Vec<Arc<CudaStream>>,
    group: Group,
}

/// `n` ranks round robin over the GPUs, with `opts`.
fn group(ctx: &[Arc<CudaContext>], n: usize, opts: &GroupOptions, tag: &str) -> G {
    let streams: Vec<_> = (0..n).map(|r| ctx[r % ctx.len()].new_stream().expect("stream")).collect();
    let group = Group::new(streams.clone(), opts).unwrap_or_else(|e| panic!("{tag}: creating the group of {n} ranks: {e}"));
    let paths: Vec<String> = (0..n).map(|r| group.link_status(r).map_or("-".into(), |s| s.path.to_string())).collect();
    eprintln!(
        "  group {tag} n={n}: pulls {paths:?}, mesh {}, one-shot on host {:?}, all-reduce of 64 KiB / 8 MiB: {:?} / {:?}",
        group.uses_mesh(),
        group.oneshot_on_host(),
        group.all_reduce_algorithm(64 << 10),
        group.all_reduce_algorithm(8 << 20)
    );
    G { tag: format!("{tag} n={n}"), streams, group }
}

/// Uploads every case's inputs, enqueues every call back to back, then
/// synchronises the group and checks every result.
fn batch(g: &G, specs: &[Spec]) {
    let n = g.streams.len();
    let ranks: Vec<usize> = (0..n).collect();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let mut calls: Vec<Box<dyn Call>> = specs.iter().map(|&s| make(&g.tag, n, &ranks, &g.streams, &mut rng, s)).collect();
    for c in &mut calls {
        c.on_group(&g.group);
    }
    g.group.synchronize().unwrap_or_else(|e| panic!("{}: synchronising after {} calls back to back: {e}", g.tag, calls.len()));
    for c in &calls {
        c.check();
    }
    eprintln!("  {}: {} calls back to back, every result right", g.tag, calls.len());
}

use Kind::*;
use ReduceOp::{Avg, Max, Min, Prod, Sum};

/// The ring forced, 3 to 8 ranks over the GPUs present (several on each
/// device where there are fewer): every collective, tiny counts (fewer
/// elements than ranks' segments hold) and ~400 KB, and an all-reduce of
/// 4 MiB.
#[test]
fn ring_of_three_to_eight_ranks() {
    let test = "ring_of_three_to_eight_ranks";
    let Some(ctx) = gpus(test, 1) else { return };
    for n in 3..=8 {
        let g = group(&ctx, n, &GroupOptions::default().algorithm(Algorithm::Ring), "ring");
        assert!(g.group.all_reduce_algorithm(1 << 20) == Algorithm::Ring, "{}: not the ring", g.tag);
        let (tiny, mid) = (n + 1, 100_003);
        batch(
            &g,
            &[
                Spec("f32", AllReduceInPlace, Sum, mid, 0),
                Spec("f32", AllReduceInPlace, Sum, (1 << 20) + 3, 0),
                Spec("bf16", AllReduce, Avg, mid, 0),
                Spec("i8", AllReduce, Sum, tiny, 0),
                Spec("f64", AllReduceInPlace, Prod, tiny, 0),
                Spec("u64", AllReduce, Max, mid, 0),
                Spec("f16", AllReduceInPlace, Avg, tiny, 0),
                Spec("f32", ReduceScatter, Sum, mid.div_ceil(n), 0),
                Spec("f16", ReduceScatter, Avg, 1, 0),
                Spec("i32", ReduceScatter, Min, tiny, 0),
                Spec("u8", AllGather, Sum, mid.div_ceil(n), 0),
                Spec("f32", AllGather, Sum, 1, 0),
                Spec("i64", BroadcastInPlace, Sum, mid, n - 1),
                Spec("bf16", BroadcastInPlace, Sum, tiny, 0),
                Spec("f32", Reduce, Avg, mid, n / 2),
                Spec("u8", Reduce, Sum, tiny, 0),
            ],
        );
    }
}

/// The bytes per rank at every lane's edge of a one-shot whose lanes end
/// at `tops` (the last: any size), the large lane's slot `slot` (rounds of
/// it): each lane's top less 12 bytes (a partial 16-byte unit), its first
/// 4 bytes past the lane below, and the last lane over one round more than
/// the four slot sets.
fn lane_bytes(tops: &[usize], slot: usize) -> Vec<usize> {
    let mut b = vec![4];
    for &t in tops {
        b.push(t - 12);
        b.push(t + 4);
    }
    b.push(5 * slot - 12);
    b
}

/// Every lane of the one-shot with `tops` and `slot`: f32 sums at each
/// edge (alternately in place), and other types and ops on the large lane.
fn lane_specs(tops: &[usize], slot: usize) -> Vec<Spec> {
    let mut specs: Vec<Spec> = lane_bytes(tops, slot)
        .into_iter()
        .enumerate()
        .map(|(i, b)| Spec("f32", if i % 2 == 0 { AllReduceInPlace } else { AllReduce }, Sum, elems(b, 4), 0))
        .collect();
    let large = 5 * slot;
    specs.extend([
        Spec("bf16", AllReduceInPlace, Avg, elems(large - 6, 2), 0),
        Spec("f16", AllReduce, Sum, elems(large / 2 + 2, 2), 0),
        Spec("u8", AllReduce, Max, elems(large - 3, 1), 0),
        Spec("i64", AllReduceInPlace, Sum, elems(large / 3, 8), 0),
        Spec("f64", AllReduce, Prod, elems(tops[0] - 24, 8), 0),
        Spec("i32", AllReduceInPlace, Min, 1, 0),
    ]);
    specs
}

/// The one-shot forced on 2 and 4 ranks, its slots in device memory: every
/// lane (`src/algorithms/oneshot.rs`: to 64 KiB, to 1 MiB, then the large
/// lane in rounds of `32 MiB / (4 n)`). With two GPUs, also through host
/// memory (staged links): lanes to 16 KiB, 256 KiB, 8 MiB, then rounds of
/// 1 MiB.
#[test]
fn oneshot_every_lane() {
    let test = "oneshot_every_lane";
    let Some(ctx) = gpus(test, 1) else { return };
    for n in [2, 4] {
        let g = group(&ctx, n, &GroupOptions::default().algorithm(Algorithm::OneShot), "device-oneshot");
        assert_eq!(g.group.oneshot_on_host(), Some(false), "{}: slots in device memory", g.tag);
        batch(&g, &lane_specs(&[64 << 10, 1 << 20], ((32 << 20) / (4 * n)) & !255));
    }
    let opts = GroupOptions::default().pull_policies(vec![PathPolicy::StagedOnly; 2]).algorithm(Algorithm::OneShot);
    let g = group(&ctx, 2, &opts, "host-oneshot");
    assert_eq!(g.group.oneshot_on_host(), Some(true), "{}: slots in host memory", g.tag);
    batch(&g, &lane_specs(&[16 << 10, 256 << 10, 8 << 20], 1 << 20));
}

/// Cases above 4 MiB per rank, where `Auto` leaves the one-shot of two
/// ranks for the mesh.
fn mesh_specs() -> Vec<Spec> {
    let mib = 1usize << 20;
    vec![
        Spec("f32", AllReduceInPlace, Sum, elems(4 * mib + 4, 4), 0),
        Spec("bf16", AllReduce, Avg, elems(5 * mib - 6, 2), 0),
        Spec("u8", AllReduceInPlace, Max, elems(6 * mib + 1, 1), 0),
        Spec("f64", AllReduce, Sum, elems(4 * mib + mib / 2, 8), 0),
        Spec("f16", AllReduceInPlace, Prod, elems(4 * mib + 2, 2), 0),
        Spec("i64", AllReduce, Min, elems(4 * mib + 8, 8), 0),
    ]
}

/// The mesh above 4 MiB: two ranks under `Auto` (which takes the one-shot
/// to 4 MiB pushed and the mesh above), and the mesh forced on 3 and 4.
#[test]
fn mesh_above_4_mib() {
    let test = "mesh_above_4_mib";
    let Some(ctx) = gpus(test, 1) else { return };
    let g = group(&ctx, 2, &GroupOptions::default(), "auto");
    if g.group.uses_mesh() {
        assert!(g.group.all_reduce_algorithm(4 << 20) == Algorithm::OneShot, "{}: the one-shot to 4 MiB", g.tag);
        assert!(g.group.all_reduce_algorithm((4 << 20) + 4) == Algorithm::Mesh, "{}: the mesh above 4 MiB", g.tag);
        batch(&g, &mesh_specs());
    } else {
        skipped(test, "n=2 Auto: the group has no mesh (no P2P between its devices); the forced meshes below need it too");
        return;
    }
    for n in [3, 4] {
        let g = group(&ctx, n, &GroupOptions::default().algorithm(Algorithm::Mesh), "mesh");
        assert!(g.group.uses_mesh() && g.group.all_reduce_algorithm(5 << 20) == Algorithm::Mesh, "{}: not the mesh", g.tag);
        batch(&g, &mesh_specs());
    }
}

/// The staged ring (`StagedOnly`: on one device too) with 64 KiB staging
/// chunks: every step of these sizes takes many chunks through the links'
/// three pinned buffers, which rotate within a call and across the calls
/// enqueued back to back.
#[test]
fn staged_ring_rotation() {
    let test = "staged_ring_rotation";
    let Some(ctx) = gpus(test, 1) else { return };
    for n in [2, 3] {
        let link = LinkOptions::with_policy(PathPolicy::StagedOnly).staging_chunk_bytes(64 << 10);
        let opts = GroupOptions::default().link(link).pull_policies(vec![PathPolicy::StagedOnly; n]).algorithm(Algorithm::Ring);
        let g = group(&ctx, n, &opts, "staged-ring");
        let staged = (0..n).filter(|&r| g.group.link_status(r).is_some_and(|s| s.path == Path::Staged)).count();
        assert!(staged >= 2, "{}: {staged} staged links", g.tag);
        batch(
            &g,
            &[
                Spec("f32", AllReduceInPlace, Sum, (1 << 20) + 3, 0),
                Spec("bf16", AllReduce, Avg, 300_001, 0),
                Spec("f32", ReduceScatter, Sum, 262_147, 0),
                Spec("u8", AllGather, Sum, (1 << 20) + 1, 0),
                Spec("f64", BroadcastInPlace, Sum, 200_003, 1),
                Spec("i32", Reduce, Sum, 500_001, 0),
                Spec("f16", AllReduce, Sum, 65_537, 0),
            ],
        );
    }
}

// ---- two processes ----

/// Set in a child: the seed of every rank's inputs (the parent's draw).
const SEED: &str = "CUDA_PEER_SANITIZE_SEED";
/// Set in a child: the staged path, forced.
const STAGED: &str = "CUDA_PEER_SANITIZE_STAGED";
/// Set in a child: the ranks share the GPUs.
const SHARE: &str = "CUDA_PEER_SANITIZE_SHARE";

/// Runs `name` as two processes, on the staged path or not.
fn two_processes(name: &str, staged: bool) {
    let Some(gpus) = gpu_count(name, 1) else { return };
    let mut env = vec![(SEED, rand::random::<u64>().to_string())];
    if staged {
        env.push((STAGED, "1".into()));
    }
    if gpus < 2 {
        env.push((SHARE, "1".into()));
        skipped(name, format!("one device per rank (P2P between devices): needs 2 GPUs, {gpus} present; the 2 ranks share it"));
    }
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(300), |_| env.clone()), passes("every case right"));
}

/// A child: its `Comm`, every case's inputs uploaded, every call enqueued
/// back to back, one synchronisation, every result checked.
fn child_body() {
    let staged = std::env::var_os(STAGED).is_some();
    let seed: u64 = std::env::var(SEED).ok().and_then(|s| s.parse().ok()).expect("the parent's seed");
    let opts = CommOptions::default()
        .timeout(Duration::from_secs(120))
        .barrier_timeout(Duration::from_secs(30))
        .share_devices(std::env::var_os(SHARE).is_some())
        .path(if staged { PathPolicy::StagedOnly } else { PathPolicy::Auto })
        .buffer_bytes(1 << 20);
    let comm = Comm::from_env(&opts).unwrap_or_else(|e| panic!("rank {}: Comm::from_env: {e}", rank()));
    let (me, n) = (comm.rank(), comm.size());
    assert_eq!(comm.path(), if staged { Path::Staged } else { Path::P2p }, "rank {me}: the path");
    // The one-shot's lanes (device: 64 KiB, 1 MiB, then slots of
    // 32 MiB / (4 n); host: 16 KiB, 256 KiB, 8 MiB, then 1 MiB rounds), and
    // counts of several chunks for the other collectives.
    let mut specs =
        if staged { lane_specs(&[16 << 10, 256 << 10, 8 << 20], 1 << 20) } else { lane_specs(&[64 << 10, 1 << 20], ((32 << 20) / (4 * n)) & !255) };
    let chunk = |t: &str| 2 * comm.chunk_bytes() / byte_size(t) + 13;
    specs.extend([
        Spec("f32", ReduceScatter, Sum, chunk("f32"), 0),
        Spec("bf16", ReduceScatter, Avg, chunk("bf16") / n, 0),
        Spec("u8", AllGather, Sum, chunk("u8"), 0),
        Spec("f32", AllGather, Sum, 1001, 0),
        Spec("i32", BroadcastInPlace, Sum, chunk("i32"), 1),
        Spec("f16", BroadcastInPlace, Sum, 1, 0),
        Spec("f32", Reduce, Sum, chunk("f32"), 0),
        Spec("i8", Reduce, Sum, chunk("i8"), 1),
        Spec("f64", Reduce, Avg, 1001, 1),
    ]);
    let tag = format!("{} path", if staged { "staged" } else { "P2P" });
    let stream = comm.stream().clone();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut calls: Vec<Box<dyn Call>> = specs.iter().map(|&s| make(&tag, n, &[me], std::slice::from_ref(&stream), &mut rng, s)).collect();
    for c in &mut calls {
        c.on_comm(&comm);
    }
    comm.synchronize().unwrap_or_else(|e| panic!("rank {me}: synchronising after {} calls back to back: {e}", calls.len()));
    for c in &calls {
        c.check();
    }
    println!("rank {me}: every case right ({} calls back to back on the {tag}, chunks of {} bytes)", calls.len(), comm.chunk_bytes());
}

/// Two processes on the P2P path: the one-shot on every device lane, the
/// other collectives over several chunks.
#[test]
fn two_processes_every_lane() {
    if child() {
        return child_body();
    }
    two_processes("two_processes_every_lane", false);
}

/// Two processes on the staged path (shared pinned host memory): the
/// one-shot on every host lane, the other collectives over several chunks
/// of the 1 MiB staging buffer.
#[test]
fn two_processes_staged_every_lane_and_chunk() {
    if child() {
        return child_body();
    }
    two_processes("two_processes_staged_every_lane_and_chunk", true);
}

/// CPU self-check of this file's comparison on its own inputs: the right
/// results (rank order, reverse, a tree, ...) pass; a rank left out, an
/// average divided by `n - 1`, and a poisoned element are caught, for every
/// float type and 2 to 8 ranks.
#[test]
fn the_checks_reject_a_dropped_rank_an_avg_by_n_minus_1_and_the_poison() {
    fn for_type<T: El>() {
        let mut rng = StdRng::seed_from_u64(rand::random());
        for n in 2..=8 {
            for op in [Sum, Avg, Prod] {
                let ins = inputs::<T>(&mut rng, n, 64, op);
                let column = |j: usize| -> Vec<T> { ins.iter().map(|v| v[j]).collect() };
                for (name, _) in num::right_results(op, &column(0), 0) {
                    let got: Vec<T> =
                        (0..64).map(|j| num::right_results(op, &column(j), j % n).into_iter().find(|r| r.0 == name).unwrap().1).collect();
                    check_reduced(&format!("{} {op:?} n={n} {name}", T::DTYPE), op, &ins, 0, &got);
                }
                let mut plants: Vec<(String, Vec<T>)> = Vec::new();
                for (k, (name, _)) in num::planted_defects(op, &column(0), 0).into_iter().enumerate() {
                    plants.push((name.into(), (0..64).map(|j| num::planted_defects(op, &column(j), j % n)[k].1).collect()));
                }
                let mut poisoned = num::right_results(op, &column(0), 0)[0..1].iter().map(|r| r.1).collect::<Vec<T>>();
                poisoned.extend((1..64).map(|j| num::kernel_reduce(op, &column(j), &(0..n).collect::<Vec<_>>())));
                poisoned[7] = T::poison();
                plants.push(("the poison left in one element".into(), poisoned));
                for (name, got) in plants {
                    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check_reduced("plant", op, &ins, 0, &got))).is_err();
                    assert!(caught, "{} {op:?} n={n}: {name} was not caught", T::DTYPE);
                }
            }
        }
    }
    for_type::<f32>();
    for_type::<f64>();
    for_type::<f16>();
    for_type::<bf16>();
}
