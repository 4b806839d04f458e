//! Soak: many randomized collectives, every result checked against the CPU.
//!
//!     cargo run --release --example soak -- [--iters 10000] [--seed S] [--max-ranks 8]
//!     cargo run --release --example soak -- --back-to-back [--iters 200] [--batch 16] [--max-bytes 12582912]
//!
//! Groups of 2 to `--max-ranks` ranks are laid round-robin over the GPUs
//! (a group may put several ranks on one device: `Group::new` takes any
//! streams, so with 2 GPUs a group of 8 ranks has 4 on each; ranks that
//! share a device run the fused algorithms too, each rank's grid on a share
//! of the device's multiprocessors). Each has one stream per rank,
//! P2P-or-staged links (`PathPolicy::Auto`, verified) or staged links
//! (`StagedOnly`, which stages ranks on one device too), and groups with
//! each algorithm forced (ring, mesh, one-shot over P2P and through host
//! memory), a rank per GPU (two ranks sharing it where there is one). A
//! group that cannot be built fails the run, except a forced mesh or P2P
//! one-shot where the driver claims no P2P between some pair of the
//! devices: that group is left out with a `SKIPPED soak group ...` line,
//! and the summary lists it.
//!
//! Each iteration picks a group, an element type (all twelve), a collective
//! (all-reduce in place and out of place, reduce-scatter, all-gather,
//! broadcast, reduce), a reduction (sum, prod, min, max; avg on floats), an
//! odd element count (log-uniform, 1 to 2^18 + 1) and a root, fills fresh
//! random inputs, poisons the outputs, runs it eagerly, and checks every
//! rank's result bit for bit against the CPU's. One in eight is then
//! captured into a CUDA graph and replayed twice on new inputs in the same
//! buffers, each replay checked (a capture refused, even with a typed
//! `Error::Capture`, is a failure: the warm-up and the eager run before
//! each capture leave nothing to allocate). Results are exact: integers wrap as the
//! GPU's do; floats are small integers, so every partial sum and product
//! is exact in any order (bf16 included; for the fp8 types, sums of -1, 0
//! and 1 and products of powers of two up to 256); avg's inputs are the
//! rank count times small integers, so that each input divided by the count (as the
//! kernels divide before they sum) and every partial sum are exact too.
//!
//! `--per-rank`: the same over per-rank communicators instead of groups
//! (`Comm::from_devices_with`, the ranks as threads: each call is made on
//! every rank's `Comm` from a thread of its own, at once), 2 to
//! `--max-ranks` ranks, P2P-or-staged and staged, and with the two-shot
//! all-reduce forced from 3 ranks; the collectives are joined by a ring
//! shift in a group (`send` to `r + 1`, `recv` from `r - 1`) and an
//! all-to-all, so that the point-to-point exchanges (in one kernel up to
//! their bound, as steps past it) mix with the collectives' barriers. No
//! graphs in this mode (graph replays between eager calls of thread ranks
//! sharing a device are a known stall: docs/gpu-testing.md); the per-rank
//! graph tests are in tests/comm.rs and tests/p2p.rs. Rank r of every
//! communicator is on one stream (`--max-ranks` streams in all), and thread
//! ranks that share a device want `CUDA_DEVICE_MAX_CONNECTIONS=32` (the
//! soak says so when it is lower): two ranks' streams in one hardware work
//! queue can hold each other up until the barrier timeout (measured:
//! docs/gpu-testing.md).
//!
//! `--trace` prints each call before it is made; `--replay FILE` makes the
//! `CALL` lines of such a trace again, in order, after the warm-up;
//! `--only NAME` keeps the groups whose name contains NAME (every group is
//! still built first); `--stop-after K` ends the run after K failures.
//!
//! `--back-to-back`: each iteration takes the next group (all in turn),
//! uploads the inputs of `--batch` random collectives, each on buffers of
//! its own, then enqueues the calls with nothing synchronised between them
//! (no stream, event or group synchronisation, no read-back), then
//! synchronises once and checks them all. Float inputs but fp8 (whose
//! results stay exact, as above)
//! are real values (for sum and avg, per element one random sign and
//! magnitudes in [1, 2); for prod magnitudes in [1.25, 2) of random signs;
//! min, max and the data movements in [-1, 1)), and float reductions are
//! compared element by element with the f64 reduction of that element's
//! inputs, within the bound of the tests (`tests/common/bound.rs`,
//! `float_bound`, included here by path): a rank left out or an
//! average divided by `n - 1` lies outside it. Integers and data movements
//! stay exact, and every rank's all-reduce result must be bitwise the
//! same. Sizes are drawn by bytes per rank, log-uniform up to `--max-bytes`
//! (12 MiB by default) and one in two at a lane's edge (64 KiB and 1 MiB,
//! the one-shot's lanes over P2P; 4 MiB pushed, where `Auto` turns from the
//! one-shot to the mesh; 8 MiB and 16 MiB pushed, the host one-shot's
//! last lane and its end; five rounds of the P2P large lane's slot), a few
//! elements either side, so that two-rank `Auto` groups reach the mesh
//! and the one-shot's large lane; a call's input is at most `--max-bytes`
//! per rank and 2^24 elements over all ranks (the CPU's share), and
//! `--max-count`, if given, caps the count too. No graphs in this mode (the
//! warm-up included); the memory check stays.
//!
//! Memory: after a warm-up (every group and collective once at the largest
//! count, 8-byte elements, a sum and an average, so that group scratch
//! reaches its size), and at
//! the end, each device's default pool is trimmed and its used bytes
//! (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`), `cuMemGetInfo`'s free bytes and the
//! process's resident set (pinned host memory is resident; measured after
//! `malloc_trim`, so that glibc's free heap does not count) are recorded;
//! growth beyond 1 MiB used, 64 MiB device or 64 MiB host fails the run.
//! Back to back with 20 batches or more, the host's growth counts from the
//! tenth batch instead: a batch holds its calls' host buffers at once, more
//! than the warm-up's, and before the trim the allocator kept that peak
//! (on one H200 with per-rank communicators: +273 MB in the first ten
//! batches, then -2 MB from the tenth to the end of forty:
//! bench/results/gpu-tests/h200x1/soak-per-rank/; with the trim, groups
//! back to back: +0.9 MB, then +0.8 MB: soak-b2b-arenas/); a leak per call
//! still grows past it.
//!
//! Prints the groups, a line per 1000 iterations (10 back to back, with the
//! resident set) and a summary; exits 0 only if every check passed, 1
//! otherwise (any wrong element fails the run), 2 (one line) without a GPU.

mod common;

use clap::Parser;
use cuda_peer::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cuda_peer::cudarc::driver::{CudaContext, CudaGraph, CudaSlice, CudaStream};
use cuda_peer::float8::{F8E4M3, F8E5M2};
use cuda_peer::ipc::{AllReduceAlgorithm, CommOptions};
use cuda_peer::{driver, Algorithm, Comm, Element, Error, Group, GroupOptions, PathPolicy, ReduceOp, Selected};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Randomized collectives, every result checked against the CPU")]
struct Args {
    /// Iterations (collectives) after the warm-up.
    #[arg(long, default_value_t = 10_000)]
    iters: u64,
    /// Random seed (default: from the clock; printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Largest group (ranks laid round-robin over the GPUs), 2 to 8.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(2..=8))]
    max_ranks: u64,
    /// Largest element count per rank (rounded up to odd; 2^18 + 1 unless
    /// given). With `--back-to-back`, counts follow `--max-bytes`, and this
    /// caps them only where given.
    #[arg(long)]
    max_count: Option<usize>,
    /// Enqueue `--batch` collectives per iteration back to back, with no
    /// synchronisation between them, on real float values checked within
    /// the per-element bound, at sizes up to `--max-bytes` (see above).
    #[arg(long)]
    back_to_back: bool,
    /// Collectives per back-to-back iteration.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1024))]
    batch: u64,
    /// Largest message per rank in bytes, back to back.
    #[arg(long, default_value_t = 12 << 20)]
    max_bytes: usize,
    /// One in this many iterations is also captured and replayed from a
    /// graph (the warm-up captures every collective); 0: no graphs at all.
    #[arg(long, default_value_t = 8)]
    graph_every: u32,
    /// Per-rank communicators (`cuda_peer::Comm`, a thread per rank)
    /// instead of groups, with send/recv and all-to-all (see above); no
    /// graphs.
    #[arg(long)]
    per_rank: bool,
    /// Print each collective (its iteration, group, kind, reduction, type,
    /// count and root) before it is made, to find the sequence before a
    /// failure.
    #[arg(long)]
    trace: bool,
    /// End the run after this many failures (0: never), to keep a failing
    /// run short.
    #[arg(long, default_value_t = 0)]
    stop_after: usize,
    /// Instead of random calls, make the calls of a `--trace` output's
    /// `CALL` lines in their order (after the warm-up, whose own lines are
    /// left out), to reproduce a failure.
    #[arg(long, conflicts_with = "back_to_back")]
    replay: Option<std::path::PathBuf>,
    /// Keep only the groups whose name contains this: every group is
    /// built (so streams and memory are made in the same order as in a
    /// full run), then the others are dropped before the warm-up; with
    /// `--replay`, only the kept groups' calls are made.
    #[arg(long)]
    only: Option<String>,
}

/// An element type with an exact CPU reference (and, for floats, the f64
/// one with its bound).
trait Val: Element + Copy + std::fmt::Debug {
    /// Significand bits of a float type, its implicit bit included; `None`
    /// for the types compared exactly in both modes (integers, fp8).
    const BITS: Option<u32>;
    fn gen(rng: &mut StdRng, op: ReduceOp) -> Self;
    /// An input of the back-to-back mode: integers as [`Val::gen`]; floats
    /// real values (sum and avg: a magnitude in [1, 2) of the sign given;
    /// prod: a magnitude in [1.25, 2) of a random sign; otherwise in
    /// [-1, 1)).
    fn gen_real(rng: &mut StdRng, op: ReduceOp, negative: bool) -> Self;
    /// `a op b` (sum for avg).
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
    /// `x` divided by `n`, in the kernels' arithmetic (floats only).
    fn avg(x: Self, n: usize) -> Self;
    fn same(a: Self, b: Self) -> bool;
    fn poison() -> Self;
    fn to_f64(self) -> f64;
}

macro_rules! int_val {
    ($($t:ty),*) => {$(
        impl Val for $t {
            const BITS: Option<u32> = None;
            fn gen(rng: &mut StdRng, _: ReduceOp) -> Self { rng.random() }
            fn gen_real(rng: &mut StdRng, _: ReduceOp, _: bool) -> Self { rng.random() }
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            fn avg(sum: Self, _: usize) -> Self { sum }
            fn same(a: Self, b: Self) -> bool { a == b }
            fn poison() -> Self { 0x5a as Self }
            fn to_f64(self) -> f64 { self as f64 }
        }
    )*};
}
int_val!(i8, u8, i32, u32, i64, u64);

/// `a op b` in f64 (sum for avg), for the float types' exact reference.
fn combine_f64(op: ReduceOp, a: f64, b: f64) -> f64 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => a + b,
        ReduceOp::Prod => a * b,
        ReduceOp::Min => a.min(b),
        ReduceOp::Max => a.max(b),
    }
}

macro_rules! float_val {
    ($t:ty, $to:expr, $from:expr, $avg:expr, $bits:expr, $sig:expr) => {
        impl Val for $t {
            const BITS: Option<u32> = Some($sig);
            fn gen(rng: &mut StdRng, op: ReduceOp) -> Self {
                let v: f64 = match op {
                    // At most 8 ranks: sums within +-64, products within +-256,
                    // every partial result an integer that bf16 holds exactly.
                    ReduceOp::Sum | ReduceOp::Avg => f64::from(rng.random_range(-8i32..=8)),
                    ReduceOp::Prod => [-2.0, -1.0, 1.0, 2.0][rng.random_range(0..4usize)],
                    ReduceOp::Min | ReduceOp::Max => f64::from(rng.random_range(-100i32..=100)),
                };
                $from(v)
            }
            fn gen_real(rng: &mut StdRng, op: ReduceOp, negative: bool) -> Self {
                let sign = |negative: bool| if negative { -1.0 } else { 1.0 };
                $from(match op {
                    ReduceOp::Sum | ReduceOp::Avg => sign(negative) * rng.random_range(1.0..2.0),
                    ReduceOp::Prod => sign(rng.random()) * rng.random_range(1.25..2.0),
                    ReduceOp::Min | ReduceOp::Max => rng.random_range(-1.0..1.0),
                })
            }
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                $from(combine_f64(op, $to(a), $to(b)))
            }
            fn avg(sum: Self, n: usize) -> Self {
                $avg(sum, n)
            }
            fn same(a: Self, b: Self) -> bool {
                $bits(a) == $bits(b)
            }
            fn poison() -> Self {
                $from(f64::NAN)
            }
            fn to_f64(self) -> f64 {
                $to(self)
            }
        }
    };
}
float_val!(f32, f64::from, |v: f64| v as f32, |s: f32, n: usize| s / n as f32, f32::to_bits, 24);
float_val!(f64, |v: f64| v, |v: f64| v, |s: f64, n: usize| s / n as f64, f64::to_bits, 53);
float_val!(f16, |v: f16| v.to_f64(), f16::from_f64, |s: f16, n: usize| f16::from_f32(s.to_f32() / n as f32), f16::to_bits, 11);
float_val!(bf16, |v: bf16| v.to_f64(), bf16::from_f64, |s: bf16, n: usize| bf16::from_f32(s.to_f32() / n as f32), bf16::to_bits, 8);

// The fp8 types, compared exactly in both modes (`BITS` is `None`): their
// inputs are integers whose every partial sum (at most 8 ranks: within +-8)
// and product (powers of two up to 256) both fp8 types hold, so the
// kernels' f32 -> f16 -> fp8 rounding never rounds.
macro_rules! fp8_val {
    ($($t:ty),*) => {$(
        impl Val for $t {
            const BITS: Option<u32> = None;
            fn gen(rng: &mut StdRng, op: ReduceOp) -> Self {
                <$t>::from_f64(match op {
                    ReduceOp::Sum | ReduceOp::Avg => f64::from(rng.random_range(-1i32..=1)),
                    ReduceOp::Prod => [-2.0, -1.0, 1.0, 2.0][rng.random_range(0..4usize)],
                    ReduceOp::Min | ReduceOp::Max => f64::from(rng.random_range(-100i32..=100)),
                })
            }
            fn gen_real(rng: &mut StdRng, op: ReduceOp, _: bool) -> Self {
                Self::gen(rng, op)
            }
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                <$t>::from_f64(combine_f64(op, <$t>::to_f64(&a), <$t>::to_f64(&b)))
            }
            fn avg(x: Self, n: usize) -> Self {
                <$t>::from_f64(<$t>::to_f64(&x) / n as f64)
            }
            fn same(a: Self, b: Self) -> bool {
                a.to_bits() == b.to_bits()
            }
            fn poison() -> Self {
                <$t>::from_f64(f64::NAN)
            }
            fn to_f64(self) -> f64 {
                <$t>::to_f64(&self)
            }
        }
    )*};
}
fp8_val!(F8E4M3, F8E5M2);

// The float comparison of the back-to-back mode: the tests' own bound
// (docs/testing.md), one file for both.
#[path = "../tests/common/bound.rs"]
mod bound;
use bound::{float_bound, reference};
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    AllReduceInPlace,
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Reduce,
    /// Per-rank only: a grouped send to `r + 1` and receive from `r - 1`.
    RingShift,
    /// Per-rank only: block `j` of rank `r`'s input to block `r` of rank
    /// `j`'s output.
    AllToAll,
}
impl Kind {
    /// Whether it reduces (takes an op).
    fn reduces(self) -> bool {
        !matches!(self, Kind::AllGather | Kind::Broadcast | Kind::RingShift | Kind::AllToAll)
    }
}

/// The collectives of a group.
const KINDS: [Kind; 6] = [Kind::AllReduceInPlace, Kind::AllReduce, Kind::ReduceScatter, Kind::AllGather, Kind::Broadcast, Kind::Reduce];
/// The calls of per-rank communicators.
const RANK_KINDS: [Kind; 8] =
    [Kind::AllReduceInPlace, Kind::AllReduce, Kind::ReduceScatter, Kind::AllGather, Kind::Broadcast, Kind::Reduce, Kind::RingShift, Kind::AllToAll];
const OPS: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];
const DTYPES: [&str; 12] = ["f32", "f64", "f16", "bf16", "i32", "i64", "u32", "u64", "i8", "u8", "f8e4m3", "f8e5m2"];

struct Soak {
    ranks: Ranks,
    streams: Vec<Arc<CudaStream>>,
    name: String,
}

/// What makes the calls: one group, or a communicator per rank.
enum Ranks {
    Group(Box<Group>),
    Comms(Vec<Comm>),
}

impl Soak {
    /// The calls this soak makes.
    fn kinds(&self) -> &'static [Kind] {
        match self.ranks {
            Ranks::Group(_) => &KINDS,
            Ranks::Comms(_) => &RANK_KINDS,
        }
    }
}

/// One collective's buffers.
struct Case<T> {
    kind: Kind,
    op: ReduceOp,
    root: usize,
    count: usize,
    /// Real float inputs, compared within the bound (back to back).
    real: bool,
    /// Inputs (`send`, or the in-place buffers) per rank.
    send: Vec<CudaSlice<T>>,
    recv: Vec<CudaSlice<T>>,
}

/// What a rank's output must hold.
enum Want<T> {
    /// Exactly these values (bit for bit).
    Exact(Vec<T>),
    /// Element `i` within the bound of the f64 reduction of every rank's
    /// input `offset + i` (real floats).
    Near(usize),
    /// Nothing (a rank other than the root of a reduce).
    Unspecified,
}

/// A case's inputs and what each rank's output must hold.
struct Expect<T> {
    inputs: Vec<Vec<T>>,
    ranks: Vec<Want<T>>,
}

impl<T: Val> Case<T> {
    fn in_place(&self) -> bool {
        matches!(self.kind, Kind::AllReduceInPlace | Kind::Broadcast)
    }
    fn in_len(&self, n: usize) -> usize {
        if matches!(self.kind, Kind::ReduceScatter | Kind::AllToAll) {
            n * self.count
        } else {
            self.count
        }
    }
    fn out_len(&self, n: usize) -> usize {
        if matches!(self.kind, Kind::AllGather | Kind::AllToAll) {
            n * self.count
        } else {
            self.count
        }
    }

    /// Fresh inputs and poisoned outputs, on every rank's stream (stream
    /// ordered: nothing is synchronised); returns what every rank's output
    /// must hold.
    fn fill(&mut self, s: &Soak, rng: &mut StdRng) -> Result<Expect<T>, String> {
        let n = s.streams.len();
        let len = self.in_len(n);
        // Real values where the type is compared within the bound.
        let near = self.real && T::BITS.is_some();
        let inputs: Vec<Vec<T>> = if near {
            let negative: Vec<bool> = (0..len).map(|_| rng.random()).collect();
            (0..n).map(|_| negative.iter().map(|&neg| T::gen_real(rng, self.op, neg)).collect()).collect()
        } else if self.op == ReduceOp::Avg {
            // n times a small integer: each input divided by n (as the
            // kernels divide before they sum) is that integer, exactly.
            let times_n = |v: T| (1..n).fold(v, |a, _| T::combine(ReduceOp::Sum, a, v));
            (0..n).map(|_| (0..len).map(|_| times_n(T::gen(rng, self.op))).collect()).collect()
        } else {
            (0..n).map(|_| (0..len).map(|_| T::gen(rng, self.op)).collect()).collect()
        };
        let reduce = |len: usize| -> Vec<T> {
            (0..len)
                .map(|i| {
                    if self.op == ReduceOp::Avg {
                        inputs[1..].iter().fold(T::avg(inputs[0][i], n), |a, x| T::combine(ReduceOp::Sum, a, T::avg(x[i], n)))
                    } else {
                        inputs[1..].iter().fold(inputs[0][i], |a, x| T::combine(self.op, a, x[i]))
                    }
                })
                .collect()
        };
        let all = if near { Vec::new() } else { reduce(len) };
        let reduced = |offset: usize, len: usize| if near { Want::Near(offset) } else { Want::Exact(all[offset..offset + len].to_vec()) };
        let ranks: Vec<Want<T>> = match self.kind {
            Kind::AllReduceInPlace | Kind::AllReduce => (0..n).map(|_| reduced(0, self.count)).collect(),
            Kind::ReduceScatter => (0..n).map(|r| reduced(r * self.count, self.count)).collect(),
            Kind::AllGather => (0..n).map(|_| Want::Exact(inputs.concat())).collect(),
            Kind::Broadcast => (0..n).map(|_| Want::Exact(inputs[self.root].clone())).collect(),
            Kind::Reduce => (0..n).map(|r| if r == self.root { reduced(0, self.count) } else { Want::Unspecified }).collect(),
            Kind::RingShift => (0..n).map(|r| Want::Exact(inputs[(r + n - 1) % n].clone())).collect(),
            Kind::AllToAll => {
                let c = self.count;
                (0..n).map(|r| Want::Exact(inputs.iter().flat_map(|x| x[r * c..(r + 1) * c].iter().copied()).collect())).collect()
            }
        };
        let poison = vec![T::poison(); self.out_len(n)];
        for (r, (st, input)) in s.streams.iter().zip(&inputs).enumerate() {
            if self.in_place() {
                st.memcpy_htod(input, &mut self.recv[r]).map_err(|e| format!("fill: {e:?}"))?;
            } else {
                st.memcpy_htod(input, &mut self.send[r]).map_err(|e| format!("fill: {e:?}"))?;
                st.memcpy_htod(&poison, &mut self.recv[r]).map_err(|e| format!("poison: {e:?}"))?;
            }
        }
        Ok(Expect { inputs, ranks })
    }

    fn call(&mut self, ranks: &Ranks) -> cuda_peer::Result<()> {
        let g = match ranks {
            Ranks::Group(g) => g,
            Ranks::Comms(comms) => return self.call_ranks(comms),
        };
        match self.kind {
            Kind::AllReduceInPlace => g.all_reduce_in_place(&mut self.recv, self.op),
            Kind::AllReduce => g.all_reduce(&self.send, &mut self.recv, self.op),
            Kind::ReduceScatter => g.reduce_scatter(&self.send, &mut self.recv, self.op),
            Kind::AllGather => g.all_gather(&self.send, &mut self.recv),
            Kind::Broadcast => g.broadcast(&mut self.recv, self.root),
            Kind::Reduce => g.reduce(&self.send, &mut self.recv, self.root, self.op),
            Kind::RingShift | Kind::AllToAll => Err(Error::InvalidArgument(format!("{:?} is not a call of a group", self.kind))),
        }
    }

    /// Every rank's call on its communicator, each from a thread of its
    /// own, at once; the first error (by rank).
    fn call_ranks(&mut self, comms: &[Comm]) -> cuda_peer::Result<()> {
        let (kind, op, root) = (self.kind, self.op, self.root);
        let sends: Vec<Option<&CudaSlice<T>>> = if self.in_place() { vec![None; comms.len()] } else { self.send.iter().map(Some).collect() };
        std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .iter()
                .zip(sends)
                .zip(self.recv.iter_mut())
                .map(|((c, send), recv)| scope.spawn(move || call_rank(c, kind, op, root, send, recv)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::Internal("a rank's thread panicked".into())))).collect::<Vec<_>>()
        })
        .into_iter()
        .collect()
    }

    /// Reads every rank's output back and compares it with `want`: bit for
    /// bit, or within the bound of each element's f64 reduction; every
    /// rank's all-reduce result must be bitwise the same too.
    fn check(&self, s: &Soak, want: &Expect<T>) -> Result<(), String> {
        let mut first: Option<Vec<T>> = None;
        for (r, w) in want.ranks.iter().enumerate() {
            if matches!(w, Want::Unspecified) {
                continue;
            }
            let got = s.streams[r].clone_dtoh(&self.recv[r]).map_err(|e| format!("read back: {e:?}"))?;
            match w {
                Want::Unspecified => {}
                Want::Exact(w) => {
                    if let Some(i) = got.iter().zip(w).position(|(a, b)| !T::same(*a, *b)) {
                        let wrong = got.iter().zip(w).filter(|(a, b)| !T::same(**a, **b)).count();
                        return Err(format!("rank {r}: {wrong} of {} wrong, first at {i}: {:?} instead of {:?}", w.len(), got[i], w[i]));
                    }
                }
                &Want::Near(offset) => {
                    let bits = T::BITS.ok_or("a bound on an integer type")?;
                    let mut xs = vec![0f64; want.inputs.len()];
                    let (mut wrong, mut first_wrong) = (0usize, None);
                    for (i, g) in got.iter().enumerate() {
                        for (x, input) in xs.iter_mut().zip(&want.inputs) {
                            *x = input[offset + i].to_f64();
                        }
                        let (reference, bound) = (reference(self.op, &xs), float_bound(self.op, &xs, bits));
                        // NaN (the poison) is never within it.
                        let error = (g.to_f64() - reference).abs();
                        if error.is_nan() || error > bound {
                            wrong += 1;
                            first_wrong.get_or_insert((i, *g, reference, bound, xs.clone()));
                        }
                    }
                    if let Some((i, g, reference, bound, xs)) = first_wrong {
                        return Err(format!(
                            "rank {r}: {wrong} of {} outside the bound, first at {i}: {g:?}, expected {reference} within {bound:e} (f64 reference) from {xs:?}",
                            got.len()
                        ));
                    }
                }
            }
            if matches!(self.kind, Kind::AllReduceInPlace | Kind::AllReduce) {
                match &first {
                    None => first = Some(got),
                    Some(f) => {
                        if let Some(i) = got.iter().zip(f).position(|(a, b)| !T::same(*a, *b)) {
                            return Err(format!(
                                "rank {r} differs from rank 0 at {i}: {:?} vs {:?} (all-reduce results must be bitwise the same)",
                                got[i], f[i]
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// One rank's call of `kind` on `c` (`send` absent in place).
fn call_rank<T: Val>(c: &Comm, kind: Kind, op: ReduceOp, root: usize, send: Option<&CudaSlice<T>>, recv: &mut CudaSlice<T>) -> cuda_peer::Result<()> {
    let input = || send.ok_or_else(|| Error::InvalidArgument(format!("{kind:?} without an input")));
    let (r, n) = (c.rank(), c.world_size());
    match kind {
        Kind::AllReduceInPlace => c.all_reduce_in_place(recv, op),
        Kind::AllReduce => c.all_reduce(input()?, recv, op),
        Kind::ReduceScatter => c.reduce_scatter(input()?, recv, op),
        Kind::AllGather => c.all_gather(input()?, recv),
        Kind::Broadcast => c.broadcast_in_place(recv, root),
        Kind::Reduce => c.reduce(input()?, recv, op, root),
        Kind::RingShift => {
            let mut g = c.group();
            g.send(input()?, (r + 1) % n)?;
            g.recv(recv, (r + n - 1) % n)?;
            g.end()
        }
        Kind::AllToAll => c.all_to_all(input()?, recv),
    }
}

fn sync(s: &Soak) -> Result<(), String> {
    for st in &s.streams {
        st.synchronize().map_err(|e| format!("synchronize: {e:?}"))?;
    }
    match &s.ranks {
        Ranks::Group(g) => g.synchronize().map_err(|e| format!("group: {e}")),
        Ranks::Comms(comms) => comms.iter().try_for_each(|c| c.synchronize().map_err(|e| format!("rank {}: {e}", c.rank()))),
    }
}

/// Captures `call` on every rank's stream into one graph (the other
/// streams join stream 0's capture and are joined back).
fn capture(streams: &[Arc<CudaStream>], call: impl FnOnce() -> cuda_peer::Result<()>) -> Result<CudaGraph, Result<Error, String>> {
    let s0 = &streams[0];
    s0.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(|e| Err(format!("begin capture: {e:?}")))?;
    let mut res: Result<(), Result<Error, String>> = s0
        .record_event(None)
        .map_err(|e| Err(format!("fork event: {e:?}")))
        .and_then(|fork| streams[1..].iter().try_for_each(|s| s.wait(&fork).map_err(|e| Err(format!("join capture: {e:?}")))));
    res = res.and_then(|()| call().map_err(Ok));
    for s in &streams[1..] {
        res = res.and_then(|()| s0.join(s).map_err(|e| Err(format!("join back: {e:?}"))));
    }
    let graph = s0.end_capture(CUgraphInstantiate_flags(0));
    res?;
    match graph {
        Ok(Some(g)) => Ok(g),
        Ok(None) => Err(Err("an empty graph".into())),
        Err(e) => Err(Err(format!("end capture: {e:?}"))),
    }
}

#[derive(Default)]
struct Tally {
    eager: u64,
    replays: u64,
    failures: Vec<String>,
    by: BTreeMap<String, u64>,
    /// `--trace`: print each collective before it is made.
    trace: bool,
}

impl Tally {
    /// Whether the run ends here: `--stop-after` (`most`, 0: never) failures
    /// reached (said once).
    fn stops(&self, most: usize) -> bool {
        let stop = most > 0 && self.failures.len() >= most;
        if stop {
            println!("soak: stopped after {} failures (--stop-after)", self.failures.len());
        }
        stop
    }

    fn fail(&mut self, what: String) {
        if self.failures.len() < 20 {
            eprintln!("FAIL {what}");
        }
        self.failures.push(what);
    }
}

/// A case's buffers on every rank's stream, poisoned (the send buffers
/// too, until `fill`).
fn alloc_case<T: Val>(s: &Soak, kind: Kind, op: ReduceOp, count: usize, root: usize, real: bool) -> Result<Case<T>, String> {
    let n = s.streams.len();
    let mut case = Case::<T> { kind, op, root, count, real, send: Vec::new(), recv: Vec::new() };
    let (in_len, out_len) = (case.in_len(n), case.out_len(n));
    for st in &s.streams {
        let alloc = |len: usize| st.clone_htod(&vec![T::poison(); len]);
        let (snd, rcv) = (if case.in_place() { Ok(None) } else { alloc(in_len).map(Some) })
            .and_then(|snd| alloc(out_len).map(|rcv| (snd, rcv)))
            .map_err(|e| format!("allocating: {e:?}"))?;
        case.send.extend(snd);
        case.recv.push(rcv);
    }
    Ok(case)
}

/// A collective of a back-to-back batch: its inputs uploaded first (for
/// every call of the batch), then the call enqueued, then (once the batch
/// is synchronised) its results checked.
trait Pending {
    fn what(&self) -> &str;
    fn call(&mut self, s: &Soak) -> Result<(), String>;
    fn check(&self, s: &Soak) -> Result<(), String>;
}

struct Enqueued<T> {
    what: String,
    case: Case<T>,
    want: Expect<T>,
}

impl<T: Val> Pending for Enqueued<T> {
    fn what(&self) -> &str {
        &self.what
    }
    fn call(&mut self, s: &Soak) -> Result<(), String> {
        self.case.call(&s.ranks).map_err(|e| format!("{}: call: {e}", self.what))
    }
    fn check(&self, s: &Soak) -> Result<(), String> {
        self.case.check(s, &self.want).map_err(|e| format!("{} (back to back): {e}", self.what))
    }
}

/// Allocates and fills (real floats) one collective's buffers, stream
/// ordered: nothing is synchronised.
fn prepare_case<T: Val>(
    s: &Soak,
    kind: Kind,
    op: ReduceOp,
    count: usize,
    root: usize,
    rng: &mut StdRng,
    tag: &str,
) -> Result<Box<dyn Pending>, String> {
    let what = format!("{tag} {} {kind:?} {op:?} {} count {count} ({} bytes) root {root}", s.name, T::DTYPE.name(), count * T::DTYPE.size());
    let r = alloc_case::<T>(s, kind, op, count, root, true).and_then(|mut case| case.fill(s, rng).map(|want| (case, want)));
    match r {
        Ok((case, want)) => Ok(Box::new(Enqueued { what, case, want })),
        Err(e) => Err(format!("{what}: {e}")),
    }
}

/// The element count per rank of a back-to-back call of `kind` on `n`
/// ranks with `elem`-byte elements: at most `max_bytes` of input per rank
/// and 2^24 input elements over all ranks (the CPU draws and checks them),
/// and at most `max_count`, where given.
fn b2b_cap(n: usize, elem: usize, kind: Kind, max_bytes: usize, max_count: Option<usize>) -> usize {
    let per = if matches!(kind, Kind::ReduceScatter | Kind::AllToAll) { n } else { 1 };
    let cap = (max_bytes / elem / per).min((1 << 24) / (n * per)).max(1);
    max_count.map_or(cap, |m| cap.min(m.max(1)))
}

/// A back-to-back call's count: bytes per rank log-uniform up to
/// `max_bytes`, or (one in two) a lane's edge a few elements either side;
/// odd where possible; within [`b2b_cap`].
fn b2b_count(rng: &mut StdRng, n: usize, elem: usize, kind: Kind, max_bytes: usize, max_count: Option<usize>) -> usize {
    let pushing = n.saturating_sub(1).max(1);
    // The one-shot's lanes over P2P (64 KiB, 1 MiB), the bytes pushed where
    // `Auto` leaves the one-shot for the mesh (4 MiB) and the host one-shot
    // changes lanes (8 MiB) and ends (16 MiB), and five rounds of the P2P
    // large lane's slot (one more than it has slot sets).
    let slot = ((32usize << 20) / (4 * n)) & !255;
    let edges = [64 << 10, 1 << 20, (4 << 20) / pushing, (8 << 20) / pushing, (16 << 20) / pushing, 5 * slot];
    let bytes = if rng.random_ratio(1, 2) {
        let edge = edges[rng.random_range(0..edges.len())] as i64;
        (edge + elem as i64 * rng.random_range(-3i64..=3)).max(1) as usize
    } else {
        2f64.powf(rng.random_range(0.0..=(max_bytes.max(2) as f64).log2())) as usize
    };
    let count = (bytes / elem).clamp(1, b2b_cap(n, elem, kind, max_bytes, max_count));
    if count > 1 && count.is_multiple_of(2) {
        count - 1
    } else {
        count
    }
}

/// One collective: eager, then (if `graph`) captured and replayed twice.
#[allow(clippy::too_many_arguments)]
fn run_case<T: Val>(s: &Soak, kind: Kind, op: ReduceOp, count: usize, root: usize, graph: bool, rng: &mut StdRng, tally: &mut Tally, tag: &str) {
    let what = format!("{tag} {} {kind:?} {op:?} {} count {count} root {root}", s.name, T::DTYPE.name());
    if tally.trace {
        println!("CALL {what}");
    }
    let mut case = match alloc_case::<T>(s, kind, op, count, root, false) {
        Ok(c) => c,
        Err(e) => return tally.fail(format!("{what}: {e}")),
    };
    let eager = case.fill(s, rng).and_then(|want| {
        sync(s)?;
        case.call(&s.ranks).map_err(|e| format!("eager call: {e}"))?;
        sync(s)?;
        case.check(s, &want).map_err(|e| format!("eager: {e}"))
    });
    if let Err(e) = eager {
        return tally.fail(format!("{what}: {e}"));
    }
    tally.eager += 1;
    if !graph {
        return;
    }
    let g = match capture(&s.streams, || case.call(&s.ranks)) {
        Ok(g) => g,
        // The eager call of this size just ran: nothing is left to allocate.
        Err(Ok(e @ Error::Capture { .. })) => return tally.fail(format!("{what}: capture refused after an eager call of the same size: {e}")),
        Err(Ok(e)) => return tally.fail(format!("{what}: under capture: {e}")),
        Err(Err(e)) => return tally.fail(format!("{what}: capture: {e}")),
    };
    for replay in 0..2 {
        let r = case.fill(s, rng).and_then(|want| {
            for st in &s.streams[1..] {
                s.streams[0].join(st).map_err(|e| format!("join: {e:?}"))?;
            }
            g.launch().map_err(|e| format!("graph launch: {e:?}"))?;
            sync(s)?;
            case.check(s, &want).map_err(|e| format!("replay {replay}: {e}"))
        });
        if let Err(e) = r {
            return tally.fail(format!("{what} (graph): {e}"));
        }
        tally.replays += 1;
    }
}

/// `$body` with `$T` the element type named `$dtype` (one of [`DTYPES`]).
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        with_dtype!(@arms $dtype, $T, $body, "f32" f32, "f64" f64, "f16" f16, "bf16" bf16, "i32" i32, "i64" i64, "u32" u32, "u64" u64, "i8" i8, "f8e4m3" F8E4M3, "f8e5m2" F8E5M2)
    };
    (@arms $dtype:expr, $T:ident, $body:expr, $($name:literal $ty:ty),*) => {
        match $dtype {
            $($name => {
                type $T = $ty;
                $body
            })*
            _ => {
                type $T = u8;
                $body
            }
        }
    };
}

#[allow(clippy::too_many_arguments)]
fn dispatch_prepare(
    s: &Soak,
    dtype: &str,
    kind: Kind,
    op: ReduceOp,
    count: usize,
    root: usize,
    rng: &mut StdRng,
    tag: &str,
) -> Result<Box<dyn Pending>, String> {
    with_dtype!(dtype, T => prepare_case::<T>(s, kind, op, count, root, rng, tag))
}

/// The byte size of an element of `dtype` (one of [`DTYPES`]).
fn dtype_size(dtype: &str) -> usize {
    with_dtype!(dtype, T => std::mem::size_of::<T>())
}

#[allow(clippy::too_many_arguments)]
fn dispatch(s: &Soak, dtype: &str, kind: Kind, op: ReduceOp, count: usize, root: usize, graph: bool, rng: &mut StdRng, tally: &mut Tally, tag: &str) {
    with_dtype!(dtype, T => run_case::<T>(s, kind, op, count, root, graph, rng, tally, tag))
}

/// Per device: (pool bytes in use, cuMemGetInfo free bytes), after
/// synchronising and trimming the default pool; and the resident set.
fn memory(ctxs: &[Arc<CudaContext>]) -> Result<(Vec<(u64, usize)>, u64), String> {
    use cuda_peer::cudarc::driver::sys;
    let mut per = Vec::new();
    for ctx in ctxs {
        ctx.synchronize().map_err(|e| format!("{e:?}"))?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: writes one pool handle of an existing device.
        let r = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuDeviceGetDefaultMemPool: {r:?}"));
        }
        // SAFETY: a valid pool; trimming releases only unused reserved memory.
        let r = unsafe { sys::cuMemPoolTrimTo(pool, 0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemPoolTrimTo: {r:?}"));
        }
        let mut used = 0u64;
        // SAFETY: USED_MEM_CURRENT writes one u64.
        let r =
            unsafe { sys::cuMemPoolGetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT, (&mut used as *mut u64).cast()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemPoolGetAttribute: {r:?}"));
        }
        let (free, _total) = ctx.mem_get_info().map_err(|e| format!("cuMemGetInfo: {e:?}"))?;
        per.push((used, free));
    }
    Ok((per, resident()))
}

/// This process's resident set in bytes (0 where /proc says nothing),
/// after glibc has handed its free heap back to the system: what is left is
/// memory in use (pinned host memory included), not the peaks that the
/// allocator's per-thread arenas keep (the soak runs a launcher thread per
/// rank of each group).
fn resident() -> u64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only returns free memory of glibc's heap to the
    // system; it may be called at any time, from any thread.
    unsafe {
        libc::malloc_trim(0);
    }
    let kib = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()))
        .unwrap_or(0);
    kib * 1024
}

/// Whether the driver claims P2P between every pair of devices `0..n`.
fn all_pairs_claim_p2p(n: usize) -> bool {
    (0..n).all(|a| (0..n).all(|b| a == b || cuda_peer::topology::link_info(a, b).is_ok_and(|l| l.can_access_peer)))
}

/// One `CALL` line of a `--trace` output: (group name, kind, reduction,
/// element type, count, root); `None` for the warm-up's and other lines.
fn traced_call(line: &str) -> Option<(String, Kind, ReduceOp, &'static str, usize, usize)> {
    let words: Vec<&str> = line.strip_prefix("CALL ")?.split(' ').collect();
    if words.len() < 9 || words[0] == "warm-up" {
        return None;
    }
    let at = words.len() - 7;
    let kind = RANK_KINDS.into_iter().find(|k| format!("{k:?}") == words[at])?;
    let op = OPS.into_iter().find(|o| format!("{o:?}") == words[at + 1])?;
    let dtype = DTYPES.into_iter().find(|d| *d == words[at + 2])?;
    let (count, root) = (words[at + 4].parse().ok()?, words[at + 6].parse().ok()?);
    Some((words[1..at].join(" "), kind, op, dtype, count, root))
}

/// Every rank's stream of a soak of `n` ranks laid round-robin over
/// `ctxs` (or the run ends, saying why).
fn rank_streams(ctxs: &[Arc<CudaContext>], n: usize, name: &str) -> Vec<Arc<CudaStream>> {
    let streams: Result<Vec<_>, _> = (0..n).map(|r| ctxs[r % ctxs.len()].new_stream()).collect();
    streams.unwrap_or_else(|e| {
        println!("{name}: no streams ({e:?})");
        std::process::exit(1);
    })
}

/// The per-rank soaks: 2 to `max_ranks` thread ranks, P2P-or-staged and
/// staged, and the two-shot all-reduce from 3 ranks. Rank r of every
/// communicator is on the same stream, the r-th of `max_ranks` made first,
/// as an application with one stream per device and several communicators
/// (a tensor- and a data-parallel one) has them: so the ranks' streams stay
/// few enough for a hardware work queue each (see the module docs).
fn rank_soaks(ctxs: &[Arc<CudaContext>], max_ranks: usize) -> Vec<Soak> {
    let mut out = Vec::new();
    let shared = rank_streams(ctxs, max_ranks, "per-rank soak");
    for n in 2..=max_ranks {
        let mut specs = vec![(PathPolicy::Auto, AllReduceAlgorithm::Auto), (PathPolicy::StagedOnly, AllReduceAlgorithm::Auto)];
        if n >= 3 {
            specs.push((PathPolicy::Auto, AllReduceAlgorithm::TwoShot));
        }
        for (policy, all_reduce) in specs {
            let name = format!("comm n={n}/{policy:?}/{}", all_reduce.name());
            let streams = shared[..n].to_vec();
            let opts = CommOptions::default().path(policy).all_reduce(all_reduce);
            match Comm::from_devices_with(streams.clone(), &opts) {
                Ok(comms) => {
                    println!("{name}: engine {:?}", comms[0].engine());
                    out.push(Soak { ranks: Ranks::Comms(comms), streams, name });
                }
                Err(e) => {
                    println!("{name}: creating it failed: {e}");
                    std::process::exit(1);
                }
            }
        }
    }
    out
}

/// The soak's groups, and the names of those left out (with why).
fn groups(ctxs: &[Arc<CudaContext>], max_ranks: usize) -> (Vec<Soak>, Vec<String>) {
    let gpus = ctxs.len();
    let mut specs: Vec<(usize, PathPolicy, Algorithm)> = Vec::new();
    let mut left_out = Vec::new();
    for n in 2..=max_ranks {
        specs.push((n, PathPolicy::Auto, Algorithm::Auto));
        specs.push((n, PathPolicy::StagedOnly, Algorithm::Auto));
    }
    let n = gpus.min(max_ranks).max(2);
    for (p, a) in [
        (PathPolicy::Auto, Algorithm::Ring),
        (PathPolicy::Auto, Algorithm::Mesh),
        (PathPolicy::Auto, Algorithm::OneShot),
        (PathPolicy::StagedOnly, Algorithm::OneShot),
        (PathPolicy::StagedOnly, Algorithm::Ring),
    ] {
        specs.push((n, p, a));
    }
    let mut out = Vec::new();
    for (n, policy, algorithm) in specs {
        let name = format!("n={n}/{policy:?}/{algorithm:?}");
        let streams = rank_streams(ctxs, n, &format!("group {name}"));
        let mut opts = GroupOptions::with_policy(policy);
        opts.algorithm = algorithm;
        match Group::new(streams.clone(), &opts) {
            Ok(group) => {
                let paths: Vec<String> = (0..n).filter_map(|r| group.link_status(r).map(|s| s.path.to_string())).collect();
                println!(
                    "group {name}: links {}, all-reduce of 4 KiB / 8 MiB by {:?} / {:?}",
                    paths.join(","),
                    group.all_reduce_algorithm(4096),
                    group.all_reduce_algorithm(8 << 20)
                );
                out.push(Soak { ranks: Ranks::Group(Box::new(group)), streams, name });
            }
            // A forced algorithm that needs P2P between devices the driver
            // says have none: not this machine's to run.
            Err(e) if policy == PathPolicy::Auto && matches!(algorithm, Algorithm::Mesh | Algorithm::OneShot) && !all_pairs_claim_p2p(n) => {
                println!("SKIPPED soak group {name}: not possible here ({e}): the driver claims no P2P between some pair of devices 0..{n}");
                left_out.push(name);
            }
            Err(e) => {
                println!("group {name}: creating it failed: {e}");
                std::process::exit(1);
            }
        }
    }
    (out, left_out)
}

/// A random element type, call of `kinds` and reduction (avg on floats
/// only).
fn pick(rng: &mut StdRng, kinds: &[Kind]) -> (&'static str, Kind, ReduceOp) {
    let dtype = DTYPES[rng.random_range(0..DTYPES.len())];
    let kind = kinds[rng.random_range(0..kinds.len())];
    let float = matches!(dtype, "f32" | "f64" | "f16" | "bf16" | "f8e4m3" | "f8e5m2");
    let op = loop {
        let op = OPS[rng.random_range(0..OPS.len())];
        if op != ReduceOp::Avg || float {
            break op;
        }
    };
    (dtype, kind, op)
}

/// The algorithm and lane an all-reduce of `bytes` per rank takes on `s`
/// (the one-shot's lanes as `oneshot::DEVICE_LANES` and `HOST_LANES` cut
/// them), for the summary.
fn lane(s: &Soak, bytes: usize) -> String {
    let group = match &s.ranks {
        Ranks::Group(g) => g,
        Ranks::Comms(_) => return "per-rank".into(),
    };
    let algorithm = group.all_reduce_algorithm(bytes);
    if algorithm != Selected::OneShot {
        return format!("{algorithm:?}");
    }
    let host = group.oneshot_on_host() == Some(true);
    let edges: &[(usize, &str)] = if host {
        &[(16 << 10, "<=16KiB"), (256 << 10, "<=256KiB"), (8 << 20, "<=8MiB"), (usize::MAX, ">8MiB")]
    } else {
        &[(64 << 10, "<=64KiB"), (1 << 20, "<=1MiB"), (usize::MAX, ">1MiB")]
    };
    let name = edges.iter().find(|(max, _)| bytes <= *max).map_or("?", |e| e.1);
    format!("OneShot {} lane {name}", if host { "host" } else { "device" })
}

/// One back-to-back iteration on `s`: `--batch` random collectives, each
/// on buffers of its own, every input uploaded first, then every call
/// enqueued with nothing synchronised between them; then one
/// synchronisation of every stream and the group, and every result checked.
fn back_to_back(s: &Soak, args: &Args, rng: &mut StdRng, tally: &mut Tally, i: u64) {
    let n = s.streams.len();
    let mut pending: Vec<Box<dyn Pending>> = Vec::new();
    for b in 0..args.batch {
        let (dtype, kind, op) = pick(rng, s.kinds());
        let count = b2b_count(rng, n, dtype_size(dtype), kind, args.max_bytes, args.max_count);
        let root = rng.random_range(0..n);
        *tally.by.entry(format!("dtype {dtype}")).or_default() += 1;
        *tally.by.entry(format!("kind {kind:?}")).or_default() += 1;
        *tally.by.entry(format!("op {op:?}")).or_default() += 1;
        *tally.by.entry(format!("group {}", s.name)).or_default() += 1;
        if matches!(kind, Kind::AllReduceInPlace | Kind::AllReduce) {
            *tally.by.entry(format!("all-reduce n={n} {}", lane(s, count * dtype_size(dtype)))).or_default() += 1;
        }
        match dispatch_prepare(s, dtype, kind, op, count, root, rng, &format!("#{i}.{b}")) {
            Ok(p) => pending.push(p),
            Err(e) => tally.fail(e),
        }
    }
    let mut called = Vec::with_capacity(pending.len());
    for mut p in pending {
        match p.call(s) {
            Ok(()) => called.push(p),
            Err(e) => tally.fail(e),
        }
    }
    if let Err(e) = sync(s) {
        for p in &called {
            tally.fail(format!("{} (back to back): {e}", p.what()));
        }
        return;
    }
    for p in &called {
        match p.check(s) {
            Ok(()) => tally.eager += 1,
            Err(e) => tally.fail(e),
        }
    }
}

fn main() {
    let args = Args::parse();
    let gpus = common::gpus_or_exit("soak");
    let ctxs: Vec<Arc<CudaContext>> = match (0..gpus).map(driver::context).collect() {
        Ok(c) => c,
        Err(e) => common::no_device("soak", &e),
    };
    for c in &ctxs {
        // SAFETY: the soak's own contexts: every buffer is made after this,
        // on a group's stream, and the soak orders all work itself, as graph
        // capture needs: it synchronises every stream around each
        // collective, or (back to back) keeps all of a case's work (its
        // allocation, uploads, call and read-back) on its ranks' streams,
        // reads back only after synchronising them all, and frees the
        // buffers after that.
        unsafe { c.disable_event_tracking() };
    }
    let seed = args.seed.unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64));
    let max_count = args.max_count.unwrap_or((1 << 18) + 1) | 1;
    let graph_every = if args.per_rank { 0 } else { args.graph_every };
    let what = if args.per_rank { "per-rank communicators (threads), with ring shifts and all-to-alls" } else { "groups" };
    if args.back_to_back {
        println!(
            "soak: {gpus} GPU(s), {what}, ranks 2..={}, {} iterations of {} back-to-back collectives, seed {seed}, up to {} bytes per rank{}, real floats within the bound, no graphs",
            args.max_ranks,
            args.iters,
            args.batch,
            args.max_bytes,
            args.max_count.map_or(String::new(), |m| format!(" and {m} elements"))
        );
    } else {
        println!(
            "soak: {gpus} GPU(s), {what}, ranks 2..={}, {} iterations, seed {seed}, counts 1..={max_count} (odd), {}",
            args.max_ranks,
            args.iters,
            if graph_every > 0 { format!("graph 1 in {graph_every}") } else { "no graphs".into() }
        );
    }
    let start = Instant::now();
    let queues = std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok().and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(8);
    if args.per_rank && args.max_ranks > gpus as u64 && queues < 32 {
        println!("soak: thread ranks share the {gpus} GPU(s) with {queues} hardware work queues: set CUDA_DEVICE_MAX_CONNECTIONS=32 (their streams may hold each other up until the barrier timeout)");
    }
    let (mut soaks, left_out) =
        if args.per_rank { (rank_soaks(&ctxs, args.max_ranks as usize), Vec::new()) } else { groups(&ctxs, args.max_ranks as usize) };
    if let Some(only) = &args.only {
        soaks.retain(|s| s.name.contains(only.as_str()));
    }
    println!("soak: {} groups in {:.1} s", soaks.len(), start.elapsed().as_secs_f64());
    let mut rng = StdRng::seed_from_u64(seed);
    let mut tally = Tally { trace: args.trace, ..Tally::default() };

    // Warm-up: every group and collective at the largest count with 8-byte
    // elements (scratch reaches its size), eager and from a graph, as a sum
    // and as an average (whose reduce-scatter and reduce divide into a
    // scratch of their own). Back to back: the largest count of 8-byte
    // elements any call takes, eager only.
    for s in &soaks {
        let n = s.streams.len();
        for &kind in s.kinds() {
            let (count, graph) =
                if args.back_to_back { (b2b_cap(n, 8, kind, args.max_bytes, args.max_count), false) } else { (max_count, graph_every > 0) };
            dispatch(s, "u64", kind, ReduceOp::Sum, count, n - 1, graph, &mut rng, &mut tally, "warm-up");
            if kind.reduces() {
                dispatch(s, "f64", kind, ReduceOp::Avg, count, n - 1, graph, &mut rng, &mut tally, "warm-up");
            }
        }
    }
    let warm_failures = tally.failures.len();
    let before = match memory(&ctxs) {
        Ok(m) => m,
        Err(e) => {
            println!("soak: memory after warm-up: {e}");
            std::process::exit(1);
        }
    };
    println!("soak: warm-up done ({warm_failures} failures) at {:.1} s", start.elapsed().as_secs_f64());

    let t0 = Instant::now();
    // Back to back with 20 batches or more, the host's growth counts from
    // the tenth batch (see the module docs).
    let mut tenth: Option<u64> = None;
    if args.back_to_back {
        for i in 1..=args.iters {
            // Every group in turn, so that each gets its share of batches.
            back_to_back(&soaks[(i as usize - 1) % soaks.len()], &args, &mut rng, &mut tally, i);
            if i == 10 && args.iters >= 20 {
                tenth = Some(resident());
            }
            if i % 10 == 0 || i == args.iters {
                println!(
                    "soak: {i}/{} batches done, {} collectives checked, {} failures, {:.1} s, resident set {} bytes",
                    args.iters,
                    tally.eager,
                    tally.failures.len(),
                    t0.elapsed().as_secs_f64(),
                    resident()
                );
            }
        }
    }
    if let Some(path) = &args.replay {
        let trace = std::fs::read_to_string(path).unwrap_or_else(|e| {
            println!("soak: reading {}: {e}", path.display());
            std::process::exit(1);
        });
        let mut made = 0;
        for (name, kind, op, dtype, count, root) in trace.lines().filter_map(traced_call) {
            let Some(s) = soaks.iter().find(|s| s.name == name) else { continue };
            made += 1;
            dispatch(s, dtype, kind, op, count, root, false, &mut rng, &mut tally, &format!("r{made}"));
            if tally.stops(args.stop_after) {
                break;
            }
        }
        println!("soak: replayed {made} calls of {}, {} failures", path.display(), tally.failures.len());
    }
    for i in (1..=args.iters).filter(|_| !args.back_to_back && args.replay.is_none()) {
        let s = &soaks[rng.random_range(0..soaks.len())];
        let n = s.streams.len();
        let (dtype, kind, op) = pick(&mut rng, s.kinds());
        // Log-uniform odd counts.
        let bits = rng.random_range(0.0..=(max_count as f64).log2());
        let count = ((2f64.powf(bits) as usize) | 1).min(max_count);
        let root = rng.random_range(0..n);
        let graph = graph_every > 0 && rng.random_ratio(1, graph_every);
        *tally.by.entry(format!("dtype {dtype}")).or_default() += 1;
        *tally.by.entry(format!("kind {kind:?}")).or_default() += 1;
        *tally.by.entry(format!("op {op:?}")).or_default() += 1;
        *tally.by.entry(format!("group {}", s.name)).or_default() += 1;
        dispatch(s, dtype, kind, op, count, root, graph, &mut rng, &mut tally, &format!("#{i}"));
        if tally.stops(args.stop_after) {
            break;
        }
        if i % 1000 == 0 || i == args.iters {
            println!(
                "soak: {i}/{} done, {} eager + {} graph replays checked, {} failures, {:.1} s",
                args.iters,
                tally.eager,
                tally.replays,
                tally.failures.len(),
                t0.elapsed().as_secs_f64()
            );
        }
    }
    // Measured with the same groups alive as after the warm-up.
    let after = match memory(&ctxs) {
        Ok(m) => m,
        Err(e) => {
            println!("soak: memory at the end: {e}");
            std::process::exit(1);
        }
    };
    drop(soaks);
    println!("soak: by type, collective, reduction and group:");
    for (k, v) in &tally.by {
        println!("  {k}: {v}");
    }
    for name in &left_out {
        println!("  left out (SKIPPED above): {name}");
    }
    let mut ok = tally.failures.is_empty();
    for (d, ((u0, f0), (u1, f1))) in before.0.iter().zip(&after.0).enumerate() {
        let used = *u1 as i64 - *u0 as i64;
        let free = *f1 as i64 - *f0 as i64;
        println!("soak: GPU{d}: pool in use {u0} -> {u1} bytes ({used:+}), cuMemGetInfo free {f0} -> {f1} bytes ({free:+})");
        if used > 1 << 20 || free < -(64 << 20) {
            println!("soak: GPU{d}: device memory grew after the warm-up");
            ok = false;
        }
    }
    let rss = after.1 as i64 - before.1 as i64;
    println!("soak: resident set (pinned host memory included) {} -> {} bytes ({rss:+})", before.1, after.1);
    let (since, base) = tenth.map_or(("the warm-up", before.1), |b| ("the tenth batch", b));
    let grown = after.1 as i64 - base as i64;
    if tenth.is_some() {
        println!("soak: resident set after {since} {base} -> {} bytes ({grown:+})", after.1);
    }
    if grown > 64 << 20 {
        println!("soak: host memory grew after {since}");
        ok = false;
    }
    println!(
        "soak: {} + warm-up: {} eager collectives and {} graph replays checked, {} failures, seed {seed}, {:.1} s: {}",
        if args.replay.is_some() { "the replayed calls".to_string() } else { format!("{} iterations", args.iters) },
        tally.eager,
        tally.replays,
        tally.failures.len(),
        start.elapsed().as_secs_f64(),
        if ok { "PASS" } else { "FAIL" }
    );
    std::process::exit(if ok { 0 } else { 1 });
}
