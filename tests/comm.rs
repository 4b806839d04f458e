//! The per-rank communicator, `cuda_peer::Comm`: ranks that are threads of
//! this process (`Comm::from_devices`, `Comm::from_rank` with an `Id`),
//! each on its own stream, with ranks sharing one GPU where only one is
//! present; ranks that are processes meeting through an `Id` in a file;
//! graphs captured on the ranks' streams and replayed after every `Comm`
//! is gone; and the typed errors of bad calls, of a call a peer does not
//! make, and of ranks that make different calls.
//!
//! As docs/testing.md asks: fresh random inputs on every run, outputs
//! poisoned before each call, integers compared exactly with a wrapping
//! reference, floats within `common::num`'s per-element bound of the f64
//! reference (inputs of one sign per element and magnitudes in [1, 2], so
//! that a dropped rank or an average divided by `n - 1` falls outside it:
//! `the_comparison_rejects_a_dropped_rank_and_avg_by_n_minus_1` checks
//! that on this file's inputs), all-reduce results bitwise the same on
//! every rank. Every GPU test takes `exclusive()`, so that the spinning
//! kernels of two tests' communicators never share the device at once.

mod common;

use common::graph::{try_capture, untracked};
use common::num::{self, Num};
use common::procs::{self, all_succeeded, child, passes, spawn};
use common::ranks::{each, exclusive, streams};
use common::{gpu_count, gpus, has_gpus, skipped};
use cuda_peer::comm::Engine;
use cuda_peer::cudarc::driver::{CudaContext, CudaGraph, CudaSlice, CudaStream};
use cuda_peer::failure::Fault;
use cuda_peer::{Collectives, Comm, CommOptions, Error, Id, Path, PathPolicy, ReduceOp};
use half::bf16;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

// ---- element types, inputs and the comparison ----

/// Fresh random words: splitmix64 from a seed drawn from the OS for each
/// set of inputs (cheap enough in a debug build for millions of elements).
struct Fresh(u64);

impl Fresh {
    fn new() -> Fresh {
        Fresh(rand::random())
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A magnitude in [1, 2) of the sign given.
    fn magnitude(&mut self, negative: bool) -> f64 {
        let m = 1.0 + (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        if negative {
            -m
        } else {
            m
        }
    }
}

/// An element type of these tests: how its fresh inputs are drawn, and the
/// value that poisons outputs.
trait Elem: Num {
    /// A fresh random input: any value of an integer type; for a float,
    /// a magnitude in [1, 2] of the sign given (`negative`).
    fn draw(rng: &mut Fresh, negative: bool) -> Self;
    /// What outputs hold before a call: for floats outside every result
    /// of these inputs (|x| <= 8).
    fn poison() -> Self;
}

impl Elem for u32 {
    fn draw(rng: &mut Fresh, _: bool) -> u32 {
        (rng.next() >> 32) as u32
    }
    fn poison() -> u32 {
        0xDEAD_BEEF
    }
}

impl Elem for i32 {
    fn draw(rng: &mut Fresh, _: bool) -> i32 {
        (rng.next() >> 32) as u32 as i32
    }
    fn poison() -> i32 {
        -0x2152_4111
    }
}

impl Elem for f32 {
    fn draw(rng: &mut Fresh, negative: bool) -> f32 {
        rng.magnitude(negative) as f32
    }
    fn poison() -> f32 {
        -777.0
    }
}

impl Elem for bf16 {
    fn draw(rng: &mut Fresh, negative: bool) -> bf16 {
        bf16::from_f64(rng.magnitude(negative))
    }
    fn poison() -> bf16 {
        bf16::from_f64(-777.0)
    }
}

impl Elem for half::f16 {
    fn draw(rng: &mut Fresh, negative: bool) -> half::f16 {
        half::f16::from_f64(rng.magnitude(negative))
    }
    fn poison() -> half::f16 {
        half::f16::from_f64(-777.0)
    }
}

/// Fresh inputs of `n` ranks, `count` elements each; element `i` has one
/// sign on every rank.
fn draw<T: Elem>(n: usize, count: usize) -> Vec<Vec<T>> {
    let mut rng = Fresh::new();
    let signs: Vec<bool> = (0..count).map(|_| rng.next() & 1 == 1).collect();
    (0..n).map(|_| signs.iter().map(|&neg| T::draw(&mut rng, neg)).collect()).collect()
}

/// The most ranks the comparison gathers without allocating.
const MAX_RANKS: usize = 8;

/// Whether `got` is a right result of `op` over one element's inputs `xs`
/// (one per rank): for integers exactly the wrapping reduction (wrapping
/// sums, min and max do not depend on the order), for floats within
/// [`num::float_bound`] of the f64 reference (`num::accepts`).
fn is_right<T: Elem>(op: ReduceOp, xs: &[T], got: T) -> bool {
    match T::BITS {
        None => got == xs[1..].iter().fold(xs[0], |a, &x| T::combine(op, a, x)),
        Some(_) => {
            let mut f = [0f64; MAX_RANKS];
            for (d, x) in f.iter_mut().zip(xs) {
                *d = x.to_f64();
            }
            num::accepts(op, &f[..xs.len()], got)
        }
    }
}

/// [`is_right`] for element `i` of every rank's inputs.
fn right_at<T: Elem>(op: ReduceOp, ins: &[Vec<T>], i: usize, got: T) -> bool {
    assert!(ins.len() <= MAX_RANKS, "{} ranks", ins.len());
    let mut xs = [T::poison(); MAX_RANKS];
    for (d, x) in xs.iter_mut().zip(ins) {
        *d = x[i];
    }
    is_right(op, &xs[..ins.len()], got)
}

/// Asserts that `got[i]` is a right reduction of element `offset + i` of
/// every rank's inputs, for every `i`.
fn assert_reduced<T: Elem>(what: &str, op: ReduceOp, ins: &[Vec<T>], offset: usize, got: &[T]) {
    if T::BITS.is_none() {
        // Integers: the exact reduction, rank after rank (a fast path;
        // the element-wise search below says what is wrong).
        let mut want = ins[0][offset..offset + got.len()].to_vec();
        for x in &ins[1..] {
            for (w, &v) in want.iter_mut().zip(&x[offset..offset + got.len()]) {
                *w = T::combine(op, *w, v);
            }
        }
        if bytemuck::cast_slice::<T, u8>(&want) == bytemuck::cast_slice::<T, u8>(got) {
            return;
        }
    }
    let wrong: Vec<usize> = (0..got.len()).filter(|&i| !right_at(op, ins, offset + i, got[i])).collect();
    if let Some(&i) = wrong.first() {
        let xs: Vec<f64> = ins.iter().map(|x| x[offset + i].to_f64()).collect();
        let want = match T::BITS {
            Some(b) => format!("{} within {:e}", num::reference(op, &xs), num::float_bound(op, &xs, b)),
            None => {
                let col: Vec<T> = ins.iter().map(|x| x[offset + i]).collect();
                format!("{:?} exactly (wrapping)", col[1..].iter().fold(col[0], |a, &x| T::combine(op, a, x)))
            }
        };
        panic!("{what}: {} of {} elements wrong, first [{i}] = {:?} from the inputs {xs:?}, expected {want}", wrong.len(), got.len(), got[i]);
    }
}

/// Asserts that `got` and `want` are the same bits.
fn assert_bits<T: Elem>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if bytemuck::cast_slice::<T, u8>(got) == bytemuck::cast_slice::<T, u8>(want) {
        return;
    }
    let wrong: Vec<usize> = (0..got.len()).filter(|&i| bytemuck::bytes_of(&got[i]) != bytemuck::bytes_of(&want[i])).collect();
    if let Some(&i) = wrong.first() {
        panic!("{what}: {} of {} elements differ, first [{i}] = {:?} instead of {:?}", wrong.len(), got.len(), got[i], want[i]);
    }
}

/// A buffer of `count` poisoned elements on `s`.
fn poisoned<T: Elem>(s: &Arc<CudaStream>, count: usize) -> CudaSlice<T> {
    s.clone_htod(&vec![T::poison(); count]).expect("poisoned buffer")
}

/// Root 0 and the last rank.
fn roots(n: usize) -> Vec<usize> {
    if n > 1 {
        vec![0, n - 1]
    } else {
        vec![0]
    }
}

// ---- the collectives of one type against the CPU ----

/// Every reduction of `op` on `T` at `count` elements: all-reduce (out of
/// place, and in place through the `Collectives` trait), reduce-scatter,
/// reduce to rank 0 and to the last rank (out of place, and in place
/// through the trait: the root's own part must be read before its buffer
/// is overwritten). Results right on every rank that gets one, all-reduces
/// bitwise the same on every rank, the others' outputs not written, send
/// buffers unchanged.
fn reductions<T: Elem>(comms: &[Comm], tag: &str, op: ReduceOp, count: usize) {
    let n = comms.len();
    let what = |call: &str| format!("{tag}: {} {op:?} {call} of {count}", T::DTYPE.name());
    let fail = |call: &str, r: usize, e: Error| -> ! { panic!("{}: rank {r}: {e}", what(call)) };

    let ins = draw::<T>(n, count);
    let got = each(comms, |r, c| {
        let s = c.stream();
        let send = s.clone_htod(&ins[r]).unwrap();
        let mut recv = poisoned::<T>(s, count);
        c.all_reduce(&send, &mut recv, op).unwrap_or_else(|e| fail("all_reduce", r, e));
        (s.clone_dtoh(&recv).unwrap(), s.clone_dtoh(&send).unwrap())
    });
    assert_reduced(&what("all_reduce"), op, &ins, 0, &got[0].0);
    for (r, (out, send)) in got.iter().enumerate() {
        assert_bits(&format!("{}: rank {r} against rank 0", what("all_reduce")), out, &got[0].0);
        assert_bits(&format!("{}: rank {r}'s send buffer", what("all_reduce")), send, &ins[r]);
    }

    let ins = draw::<T>(n, count);
    let got = each(comms, |r, c| {
        let s = c.stream();
        let mut buf = s.clone_htod(&ins[r]).unwrap();
        Collectives::all_reduce_in_place(c, &mut buf, op).unwrap_or_else(|e| fail("all_reduce_in_place", r, e));
        s.clone_dtoh(&buf).unwrap()
    });
    assert_reduced(&what("all_reduce_in_place"), op, &ins, 0, &got[0]);
    for (r, out) in got.iter().enumerate() {
        assert_bits(&format!("{}: rank {r} against rank 0", what("all_reduce_in_place")), out, &got[0]);
    }

    let ins = draw::<T>(n, n * count);
    let got = each(comms, |r, c| {
        let s = c.stream();
        let send = s.clone_htod(&ins[r]).unwrap();
        let mut recv = poisoned::<T>(s, count);
        c.reduce_scatter(&send, &mut recv, op).unwrap_or_else(|e| fail("reduce_scatter", r, e));
        (s.clone_dtoh(&recv).unwrap(), s.clone_dtoh(&send).unwrap())
    });
    for (r, (out, send)) in got.iter().enumerate() {
        assert_reduced(&format!("{}: rank {r}'s block", what("reduce_scatter")), op, &ins, r * count, out);
        assert_bits(&format!("{}: rank {r}'s send buffer", what("reduce_scatter")), send, &ins[r]);
    }

    for root in roots(n) {
        let call = format!("reduce to {root}");
        let ins = draw::<T>(n, count);
        let got = each(comms, |r, c| {
            let s = c.stream();
            let send = s.clone_htod(&ins[r]).unwrap();
            let mut recv = poisoned::<T>(s, count);
            c.reduce(&send, &mut recv, op, root).unwrap_or_else(|e| fail(&call, r, e));
            (s.clone_dtoh(&recv).unwrap(), s.clone_dtoh(&send).unwrap())
        });
        for (r, (out, send)) in got.iter().enumerate() {
            if r == root {
                assert_reduced(&format!("{}: the root", what(&call)), op, &ins, 0, out);
            } else {
                assert_bits(&format!("{}: rank {r}'s recv (not the root's) written", what(&call)), out, &vec![T::poison(); count]);
            }
            assert_bits(&format!("{}: rank {r}'s send buffer", what(&call)), send, &ins[r]);
        }

        let call = format!("reduce_in_place to {root}");
        let ins = draw::<T>(n, count);
        let got = each(comms, |r, c| {
            let s = c.stream();
            let mut buf = s.clone_htod(&ins[r]).unwrap();
            Collectives::reduce_in_place(c, &mut buf, op, root).unwrap_or_else(|e| fail(&call, r, e));
            s.clone_dtoh(&buf).unwrap()
        });
        for (r, out) in got.iter().enumerate() {
            if r == root {
                assert_reduced(&format!("{}: the root", what(&call)), op, &ins, 0, out);
            } else {
                assert_bits(&format!("{}: rank {r}'s buffer (not the root's) changed", what(&call)), out, &ins[r]);
            }
        }
    }
}

/// The collectives that move `T` without reducing, at `count` elements:
/// all-gather; broadcast from rank 0 (the root passes its send buffer, the
/// others `None`) and from the last rank (every rank passes one: only the
/// root's is read); broadcast in place (through the trait) from both.
fn moves<T: Elem>(comms: &[Comm], tag: &str, count: usize) {
    let n = comms.len();
    let what = |call: &str| format!("{tag}: {} {call} of {count}", T::DTYPE.name());
    let fail = |call: &str, r: usize, e: Error| -> ! { panic!("{}: rank {r}: {e}", what(call)) };

    let ins = draw::<T>(n, count);
    let got = each(comms, |r, c| {
        let s = c.stream();
        let send = s.clone_htod(&ins[r]).unwrap();
        let mut recv = poisoned::<T>(s, n * count);
        c.all_gather(&send, &mut recv).unwrap_or_else(|e| fail("all_gather", r, e));
        s.clone_dtoh(&recv).unwrap()
    });
    let want = ins.concat();
    for (r, out) in got.iter().enumerate() {
        assert_bits(&format!("{}: rank {r}", what("all_gather")), out, &want);
    }

    for (root, everyone) in [(0, false), (n - 1, true)] {
        let call = format!("broadcast from {root} ({})", if everyone { "every rank passes a send buffer" } else { "None off the root" });
        let ins = draw::<T>(n, count);
        let got = each(comms, |r, c| {
            let s = c.stream();
            let send = s.clone_htod(&ins[r]).unwrap();
            let mut recv = poisoned::<T>(s, count);
            let mine: Option<&CudaSlice<T>> = if r == root || everyone { Some(&send) } else { None };
            c.broadcast(mine, &mut recv, root).unwrap_or_else(|e| fail(&call, r, e));
            (s.clone_dtoh(&recv).unwrap(), s.clone_dtoh(&send).unwrap())
        });
        for (r, (out, send)) in got.iter().enumerate() {
            assert_bits(&format!("{}: rank {r}", what(&call)), out, &ins[root]);
            assert_bits(&format!("{}: rank {r}'s send buffer", what(&call)), send, &ins[r]);
        }
    }

    for root in roots(n) {
        let call = format!("broadcast_in_place from {root}");
        let ins = draw::<T>(n, count);
        let got = each(comms, |r, c| {
            let s = c.stream();
            let mut buf = s.clone_htod(&ins[r]).unwrap();
            Collectives::broadcast_in_place(c, &mut buf, root).unwrap_or_else(|e| fail(&call, r, e));
            s.clone_dtoh(&buf).unwrap()
        });
        for (r, out) in got.iter().enumerate() {
            assert_bits(&format!("{}: rank {r}", what(&call)), out, &ins[root]);
        }
    }
}

/// Every type and op of the suite, every collective, at `count` elements.
fn every_collective(comms: &[Comm], tag: &str, count: usize) {
    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
        reductions::<u32>(comms, tag, op, count);
        reductions::<i32>(comms, tag, op, count);
    }
    for op in [ReduceOp::Sum, ReduceOp::Avg] {
        reductions::<f32>(comms, tag, op, count);
        reductions::<bf16>(comms, tag, op, count);
    }
    moves::<u32>(comms, tag, count);
    moves::<i32>(comms, tag, count);
    moves::<f32>(comms, tag, count);
    moves::<bf16>(comms, tag, count);
}

// ---- paths, devices and chunks ----

/// The staging buffer of the suite: the staged path moves chunks of half of
/// it (at most 4 KiB, whole pages of shared host memory per rank).
const BUFFER_BYTES: usize = 4096;

/// Elements that cross the staged path's chunk many times: more than 4
/// chunks of 2-byte elements, of a reduce-scatter's per-rank stride more.
const CROSS: usize = 9013;

/// The path a communicator of `n` ranks over `gpus` devices (round robin)
/// takes under `policy`: staged where asked, else P2P unless two of its
/// devices lack P2P (then `Auto` stages, which is said).
fn expected_path(test: &str, n: usize, gpus: usize, policy: PathPolicy) -> Path {
    if policy == PathPolicy::StagedOnly {
        return Path::Staged;
    }
    let devices: Vec<usize> = (0..n.min(gpus)).collect();
    for &a in &devices {
        for &b in devices.iter().filter(|&&b| b != a) {
            if !cuda_peer::peer::can_access_peer(a, b).expect("cuDeviceCanAccessPeer") {
                skipped(test, format!("n={n}: the P2P path: no P2P from GPU {a} to GPU {b}, so Auto stages (the staged path ran instead)"));
                return Path::Staged;
            }
        }
    }
    Path::P2p
}

/// u32 elements that cross the P2P path's chunk at least three times: its
/// staging buffer is the region's slack past the one-shot slots once the
/// region is rounded up to the VMM granularity, so each half is below
/// `(BUFFER_BYTES + granularity) / 2` bytes, whatever `buffer_bytes` asks.
fn p2p_crossing(ctxs: &[Arc<CudaContext>]) -> usize {
    let g = ctxs.iter().map(|c| cuda_peer::ipc::vmm::granularity(c).expect("VMM granularity")).max().unwrap_or(2 << 20);
    3 * (BUFFER_BYTES + g) / 2 / 4 + 13
}

/// Asserts what each rank of `comms` says of itself: rank, size, engine,
/// its stream (the caller's) and device.
fn assert_ranks(tag: &str, comms: &[Comm], streams: &[Arc<CudaStream>], gpus: usize, path: Path) {
    let n = comms.len();
    for (r, c) in comms.iter().enumerate() {
        assert_eq!(c.engine(), Engine::Host(path), "{tag}: rank {r}'s engine");
        assert_eq!((c.rank(), Collectives::rank(c)), (r, r), "{tag}: rank {r}'s rank");
        assert_eq!((c.world_size(), Collectives::world_size(c)), (n, n), "{tag}: rank {r}'s world size");
        assert!(Arc::ptr_eq(c.stream(), &streams[r]) && Arc::ptr_eq(Collectives::stream(c), &streams[r]), "{tag}: rank {r}: not the caller's stream");
        assert_eq!((c.ordinal(), c.context().ordinal()), (r % gpus, r % gpus), "{tag}: rank {r}'s device");
    }
}

/// The suite on 2, 3 and 4 ranks (threads, `from_devices_with`) under
/// `policy`, with a small staging buffer: every collective, type and op at
/// 0, 1, 1001 and [`CROSS`] elements; on the P2P path every collective of a
/// u32 sum (and the moves) also past its
/// chunk ([`p2p_crossing`]).
fn suite(test: &str, policy: PathPolicy) {
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let g = ctxs.len();
    for n in [2, 3, 4] {
        has_gpus(test, &format!("n={n} with one device per rank (the ranks share the {g} present)"), g, n);
        let path = expected_path(test, n, g, policy);
        let streams = streams(&ctxs, n);
        let opts = CommOptions::default().buffer_bytes(BUFFER_BYTES).path(policy);
        let comms = Comm::from_devices_with(streams.clone(), &opts).unwrap_or_else(|e| panic!("n={n} {policy:?}: from_devices_with: {e}"));
        let tag = format!("n={n} {path:?}");
        assert_ranks(&tag, &comms, &streams, g, path);
        for count in [0, 1, 1001, CROSS] {
            every_collective(&comms, &tag, count);
        }
        if path == Path::P2p {
            let big = p2p_crossing(&ctxs);
            reductions::<u32>(&comms, &tag, ReduceOp::Sum, big);
            moves::<u32>(&comms, &tag, big);
        }
        for c in &comms {
            c.synchronize().expect("synchronize");
        }
    }
}

/// An all-reduce of fresh random u32 (sum, exact) on 2, 3 and 4 ranks,
/// every rank's result against the CPU reference, into a poisoned output.
#[test]
fn threads_all_reduce_against_the_cpu_reference() {
    let _gpu = exclusive();
    let Some(ctxs) = gpus("threads_all_reduce_against_the_cpu_reference", 1) else { return };
    for n in [2usize, 3, 4] {
        let comms = Comm::from_devices(streams(&ctxs, n)).expect("from_devices");
        for count in [1usize, 1000, 65_537, 1 << 20] {
            let inputs = draw::<u32>(n, count);
            let want: Vec<u32> = (0..count).map(|i| inputs.iter().fold(0u32, |a, x| a.wrapping_add(x[i]))).collect();
            let got = each(&comms, |r, c| {
                let s = c.stream();
                let send = s.clone_htod(&inputs[r]).unwrap();
                let mut recv = s.clone_htod(&vec![0xdead_beefu32; count]).unwrap();
                c.all_reduce(&send, &mut recv, ReduceOp::Sum).expect("all_reduce");
                s.clone_dtoh(&recv).unwrap()
            });
            for (r, g) in got.iter().enumerate() {
                assert!(*g == want, "{n} ranks, {count} elements: rank {r} wrong at {:?}", common::diff(g, &want));
            }
        }
    }
}

/// Every collective (all-reduce and reduce in place and out of place,
/// reduce-scatter, all-gather, broadcast with and without send buffers off
/// the root and in place, reduce to rank 0 and to the last rank) on u32 and
/// i32 (sum, max, min: exact) and f32 and bf16 (sum, avg: within the
/// bound), 0, 1, 1001 and 9013 elements and, for u32 sums, past the P2P chunk,
/// on 2, 3 and 4 threads' ranks on the P2P path (`Auto`).
#[test]
fn threads_every_collective_type_and_op_on_the_p2p_path() {
    suite("threads_every_collective_type_and_op_on_the_p2p_path", PathPolicy::Auto);
}

/// The same on the staged path (`PathPolicy::StagedOnly`: slots and
/// staging buffers in shared host memory), 9013 elements taking many
/// chunks of the 4 KiB staging buffer.
#[test]
fn threads_every_collective_type_and_op_on_the_staged_path() {
    suite("threads_every_collective_type_and_op_on_the_staged_path", PathPolicy::StagedOnly);
}

// ---- the path's fallback after a failed check at creation ----

/// The creation's check failing on the device path, as a broken P2P path
/// fails it: rank 1's first one-shot launch of the check never runs (the
/// hidden `CommOptions::verify_fault`), so its result is wrong and rank
/// 0's kernel gives up at the barrier. Under `Auto` every rank falls back
/// to the staged path together, says so in `path_reason`, and then gives
/// exact results; without the fault the same ranks keep the device path
/// (so the fault is what staged them); under `P2pOnly` every rank fails
/// with the check's error; and a launch that fails is no path's fault, so
/// every rank fails with it under `Auto` too. Two thread ranks, on two
/// devices where there are two, else sharing one.
#[test]
fn a_failed_check_at_creation_falls_back_to_the_staged_path_under_auto_only() {
    const T: &str = "a_failed_check_at_creation_falls_back_to_the_staged_path_under_auto_only";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(T, 1) else { return };
    let streams = streams(&ctxs, 2);
    let opts = |policy: PathPolicy, fault: Option<Fault>| {
        CommOptions::default()
            .path(policy)
            .share_devices(true)
            .buffer_bytes(BUFFER_BYTES)
            .barrier_timeout(if fault.is_some() { Duration::from_secs(2) } else { cuda_peer::DEFAULT_BARRIER_TIMEOUT })
            .verify_fault(fault.map(|f| (1, f)))
    };
    let device_path = expected_path(T, 2, ctxs.len(), PathPolicy::Auto);
    if device_path == Path::Staged {
        return;
    }

    let plain: Vec<Comm> =
        common::ranks::made_each(&streams, &opts(PathPolicy::Auto, None)).into_iter().map(|c| c.expect("no fault: creation")).collect();
    for (r, c) in plain.iter().enumerate() {
        let why = c.path_reason().unwrap_or_default();
        assert_eq!(c.engine(), Engine::Host(Path::P2p), "no fault, rank {r}: {why}");
        assert!(why.starts_with("P2P, verified") || why.starts_with("one device, verified"), "no fault, rank {r}: {why}");
    }
    drop(plain);

    let start = Instant::now();
    let comms: Vec<Comm> = common::ranks::made_each(&streams, &opts(PathPolicy::Auto, Some(Fault::NeverArrives)))
        .into_iter()
        .enumerate()
        .map(|(r, c)| c.unwrap_or_else(|e| panic!("Auto, rank 1 never arrives: rank {r}: {e}")))
        .collect();
    println!("{T}: the fallback took {:?}", start.elapsed());
    for (r, c) in comms.iter().enumerate() {
        let why = c.path_reason().unwrap_or_default();
        assert_eq!(c.engine(), Engine::Host(Path::Staged), "after the fallback, rank {r}: {why}");
        assert!(why.starts_with("staged after the P2P path failed the creation's check"), "rank {r}: {why}");
    }
    println!("{T}: rank 0: {}", comms[0].path_reason().unwrap_or_default());
    reductions::<u32>(&comms, "after the fallback", ReduceOp::Sum, 1001);
    moves::<u32>(&comms, "after the fallback", CROSS);
    for c in &comms {
        c.synchronize().expect("synchronize after the fallback");
    }
    drop(comms);

    for (r, made) in common::ranks::made_each(&streams, &opts(PathPolicy::P2pOnly, Some(Fault::NeverArrives))).into_iter().enumerate() {
        match made {
            Err(Error::P2pUnavailable { .. } | Error::PeerTimeout { .. } | Error::Bootstrap { op: "communicator: verification", .. }) => {}
            other => panic!("P2pOnly, rank 1 never arrives: rank {r}: expected the check's error, got {:?}", other.map(|c| c.engine())),
        }
    }
    // Rank 1 reports its launch's error; rank 0 its own, the barrier its
    // kernel gave up at.
    for (r, made) in common::ranks::made_each(&streams, &opts(PathPolicy::Auto, Some(Fault::LaunchFails))).into_iter().enumerate() {
        match (r, made) {
            (1, Err(Error::Internal(m))) if m.contains("injected launch failure on rank 1") => {}
            (0, Err(Error::PeerTimeout { .. })) => {}
            (r, other) => {
                panic!("Auto, rank 1's launch fails: rank {r}: expected no fallback and a typed error, got {:?}", other.map(|c| c.engine()))
            }
        }
    }
}

// ---- the two-shot all-reduce ----

/// Every rank's all-reduce of `op` over `ins` on `comms`, out of place
/// (into poisoned outputs; the send buffers checked unchanged) or in place.
fn all_reduced<T: Elem>(comms: &[Comm], what: &str, ins: &[Vec<T>], op: ReduceOp, in_place: bool) -> Vec<Vec<T>> {
    each(comms, |r, c| {
        let s = c.stream();
        let mut send = s.clone_htod(&ins[r]).unwrap();
        let out = if in_place {
            c.all_reduce_in_place(&mut send, op).unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
            s.clone_dtoh(&send).unwrap()
        } else {
            let mut recv = poisoned::<T>(s, ins[r].len());
            c.all_reduce(&send, &mut recv, op).unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
            assert_bits(&format!("{what}: rank {r}'s send buffer"), &s.clone_dtoh(&send).unwrap(), &ins[r]);
            s.clone_dtoh(&recv).unwrap()
        };
        out
    })
}

/// The all-reduce of `op` on `T` at `count` elements, in place and out of
/// place, on `two` (communicators that take the two-shot) against the CPU,
/// and bitwise what `one` (the one-shot) gives for the same inputs, on
/// every rank.
fn two_shot_matches<T: Elem>(two: &[Comm], one: &[Comm], tag: &str, op: ReduceOp, count: usize) {
    for in_place in [false, true] {
        let what = format!("{tag}: {} {op:?} all_reduce{} of {count}", T::DTYPE.name(), if in_place { "_in_place" } else { "" });
        let ins = draw::<T>(two.len(), count);
        let got = all_reduced(two, &what, &ins, op, in_place);
        assert_reduced(&what, op, &ins, 0, &got[0]);
        let want = all_reduced(one, &format!("{what} (the one-shot)"), &ins, op, in_place);
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_bits(&format!("{what}: rank {r} against the one-shot"), g, w);
        }
    }
}

/// The two-shot all-reduce (`AllReduceAlgorithm::TwoShot`) on `n` thread
/// ranks, on the P2P and the staged path, with the suite's small staging
/// buffer: u32 and i32 sums, maxima and minima, f32 and bf16 sums and
/// averages, at 0, 1, n - 1 (a rank with an empty part), 1001 and
/// [`CROSS`] elements (many chunks), in place and out of place: against the
/// CPU, and bit for bit the one-shot's result on the same inputs. One test
/// per rank count, so that a sanitizer can take one.
fn two_shot_matches_the_cpu_and_the_one_shot(test: &str, n: usize) {
    use cuda_peer::AllReduceAlgorithm::{OneShot, TwoShot};
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let make = |opts: CommOptions| Comm::from_devices_with(streams(&ctxs, n), &opts).unwrap_or_else(|e| panic!("n={n} {opts:?}: {e}"));
    for policy in [PathPolicy::Auto, PathPolicy::StagedOnly] {
        let opts = CommOptions::default().buffer_bytes(BUFFER_BYTES).path(policy);
        let (two, one) = (make(opts.clone().all_reduce(TwoShot)), make(opts.all_reduce(OneShot)));
        let tag = format!("n={n} {:?} two-shot", two[0].engine());
        for count in [0, 1, n - 1, 1001, CROSS] {
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                two_shot_matches::<u32>(&two, &one, &tag, op, count);
                two_shot_matches::<i32>(&two, &one, &tag, op, count);
            }
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                two_shot_matches::<f32>(&two, &one, &tag, op, count);
                two_shot_matches::<bf16>(&two, &one, &tag, op, count);
            }
        }
    }
}

/// [`two_shot_matches_the_cpu_and_the_one_shot`] on 2 ranks.
#[test]
fn threads_two_shot_all_reduces_match_the_cpu_and_the_one_shot_on_2_ranks() {
    two_shot_matches_the_cpu_and_the_one_shot("threads_two_shot_all_reduces_match_the_cpu_and_the_one_shot_on_2_ranks", 2);
}

/// [`two_shot_matches_the_cpu_and_the_one_shot`] on 3 ranks.
#[test]
fn threads_two_shot_all_reduces_match_the_cpu_and_the_one_shot_on_3_ranks() {
    two_shot_matches_the_cpu_and_the_one_shot("threads_two_shot_all_reduces_match_the_cpu_and_the_one_shot_on_3_ranks", 3);
}

/// The two-shot on 3 thread ranks (`PathPolicy::Auto`) with the default
/// staging buffer, on long messages (600,001 f32 sums, 1,200,001 bf16
/// averages), in place and out of place: against the CPU, and bit for bit
/// the one-shot's result on the same inputs.
#[test]
fn threads_two_shot_long_all_reduces_match_the_cpu_and_the_one_shot() {
    use cuda_peer::AllReduceAlgorithm::{OneShot, TwoShot};
    let test = "threads_two_shot_long_all_reduces_match_the_cpu_and_the_one_shot";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let make = |opts: CommOptions| Comm::from_devices_with(streams(&ctxs, 3), &opts).unwrap_or_else(|e| panic!("{opts:?}: {e}"));
    let path = expected_path(test, 3, ctxs.len(), PathPolicy::Auto);
    let (two, one) = (make(CommOptions::default().all_reduce(TwoShot)), make(CommOptions::default().all_reduce(OneShot)));
    let tag = format!("n=3 {path:?} two-shot, the default staging buffer");
    two_shot_matches::<f32>(&two, &one, &tag, ReduceOp::Sum, 600_001);
    two_shot_matches::<bf16>(&two, &one, &tag, ReduceOp::Avg, 1_200_001);
}

/// [`two_shot_matches_the_cpu_and_the_one_shot`] on 4 ranks.
#[test]
fn threads_two_shot_all_reduces_match_the_cpu_and_the_one_shot_on_4_ranks() {
    two_shot_matches_the_cpu_and_the_one_shot("threads_two_shot_all_reduces_match_the_cpu_and_the_one_shot_on_4_ranks", 4);
}

/// Ranks that would take different all-reduce algorithms (one forced to
/// the two-shot, the others to the one-shot): with the verification at
/// creation (the default), creating them fails on every rank, the error
/// naming the two-shot; without it, the first all-reduce is
/// `Error::Mismatch` on every rank before anything is enqueued, and the
/// communicators work on (a broadcast, which no all-reduce setting
/// changes, is right).
#[test]
fn ranks_that_would_take_different_all_reduce_algorithms_are_a_mismatch() {
    use cuda_peer::AllReduceAlgorithm::{OneShot, TwoShot};
    let test = "ranks_that_would_take_different_all_reduce_algorithms_are_a_mismatch";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let n = 3;
    let opts = |r: usize, verify: bool| CommOptions::default().share_devices(true).verify(verify).all_reduce(if r == 1 { TwoShot } else { OneShot });
    for (r, (c, _)) in from_rank_threads(&ctxs, n, |r| Some(opts(r, true))).into_iter().enumerate() {
        match c {
            Err(e) => assert!(e.to_string().contains("two-shot"), "rank {r}: creation failed, but not naming the two-shot: {e}"),
            Ok(_) => panic!("rank {r}: created, although the ranks' all-reduces differ"),
        }
    }
    let comms: Vec<Comm> = from_rank_threads(&ctxs, n, |r| Some(opts(r, false)))
        .into_iter()
        .enumerate()
        .map(|(r, (c, _))| c.unwrap_or_else(|e| panic!("rank {r}: from_rank_with, verify off: {e}")))
        .collect();
    let ins = draw::<u32>(n, 1001);
    let outs = each(&comms, |r, c| {
        let mut buf = c.stream().clone_htod(&ins[r]).unwrap();
        c.all_reduce_in_place(&mut buf, ReduceOp::Sum)
    });
    for (r, o) in outs.iter().enumerate() {
        match o {
            Err(Error::Mismatch { ours, theirs, .. }) => {
                assert!(ours.contains("two-shot") != theirs.contains("two-shot"), "rank {r}: {ours} / {theirs}")
            }
            other => panic!("rank {r}: {other:?}, not a mismatch"),
        }
    }
    let got = each(&comms, |r, c| {
        let s = c.stream();
        let mut buf = s.clone_htod(&ins[r]).unwrap();
        c.broadcast_in_place(&mut buf, 2).expect("broadcast_in_place after the mismatch");
        s.clone_dtoh(&buf).unwrap()
    });
    for (r, g) in got.iter().enumerate() {
        assert_bits(&format!("rank {r}: the broadcast after the mismatch"), g, &ins[2]);
    }
}

/// Every pair of values of `T` (an fp8 type) through a two-rank
/// all-reduce of every op on `comms`, in place ([`common::fp8`]).
fn fp8_pairs<T: Num>(comms: &[Comm], tag: &str, from_bits: fn(u8) -> T) {
    let ins = common::fp8::pairs(from_bits);
    for op in ReduceOp::ALL {
        let outs = each(comms, |r, c| {
            let s = c.stream();
            let mut buf = s.clone_htod(&ins[r]).unwrap();
            c.all_reduce_in_place(&mut buf, op).unwrap_or_else(|e| panic!("{tag} {} {op}: rank {r}: {e}", T::DTYPE));
            s.clone_dtoh(&buf).unwrap()
        });
        common::fp8::assert_right(&format!("{tag} {} {op}", T::DTYPE), op, &ins, &outs[0]);
        let differ = outs[0].iter().zip(&outs[1]).filter(|(a, b)| a.to_f64().to_bits() != b.to_f64().to_bits()).count();
        assert_eq!(differ, 0, "{tag} {} {op}: the ranks' results differ", T::DTYPE);
    }
}

/// fp8 reductions on the per-rank engine (sums and products rounded as
/// NCCL's, min and max an input): every pair of values of both fp8 types,
/// every op, two thread ranks on the P2P path (the one-shot) and on the
/// staged path (the one-shot through host memory).
#[test]
fn threads_fp8_reductions_round_as_nccl_does_on_every_pair() {
    let _gpu = exclusive();
    let Some(ctxs) = gpus("threads_fp8_reductions_round_as_nccl_does_on_every_pair", 1) else { return };
    for policy in [PathPolicy::Auto, PathPolicy::StagedOnly] {
        let comms = Comm::from_devices_with(streams(&ctxs, 2), &CommOptions::default().path(policy)).expect("from_devices_with");
        let tag = format!("{:?}", comms[0].engine());
        fp8_pairs(&comms, &tag, cuda_peer::float8::F8E4M3::from_bits);
        fp8_pairs(&comms, &tag, cuda_peer::float8::F8E5M2::from_bits);
    }
}

// ---- ranks meeting through an Id ----

/// Creates `n` ranks with `Comm::from_rank` (`opts: None`) or
/// `from_rank_with`, each on a thread of its own and a stream of its own
/// (round robin over `ctxs`): rank 0's thread makes the `Id` and sends its
/// bytes to the others through channels. Returns each rank's outcome and
/// its stream.
fn from_rank_threads(
    ctxs: &[Arc<CudaContext>],
    n: usize,
    opts: impl Fn(usize) -> Option<CommOptions> + Sync,
) -> Vec<(cuda_peer::Result<Comm>, Arc<CudaStream>)> {
    let streams = streams(ctxs, n);
    let (txs, rxs): (Vec<_>, Vec<_>) = (1..n).map(|_| std::sync::mpsc::channel::<Vec<u8>>()).unzip();
    let mut rxs: Vec<Option<std::sync::mpsc::Receiver<Vec<u8>>>> = std::iter::once(None).chain(rxs.into_iter().map(Some)).collect();
    let mut txs = Some(txs);
    std::thread::scope(|s| {
        let hs: Vec<_> = streams
            .iter()
            .enumerate()
            .map(|(r, stream)| {
                let (rx, txs) = (rxs[r].take(), if r == 0 { txs.take() } else { None });
                let (stream, opts) = (stream.clone(), &opts);
                s.spawn(move || {
                    let id = match (txs, rx) {
                        (Some(txs), _) => {
                            let id = Id::new().expect("Id::new on rank 0");
                            for tx in txs {
                                tx.send(id.as_bytes().to_vec()).expect("sending the id");
                            }
                            id
                        }
                        (None, Some(rx)) => {
                            let bytes = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|e| panic!("rank {r}: no id from rank 0: {e}"));
                            Id::from_bytes(&bytes).unwrap_or_else(|e| panic!("rank {r}: Id::from_bytes: {e}"))
                        }
                        (None, None) => unreachable!("every rank has a channel"),
                    };
                    match opts(r) {
                        Some(o) => Comm::from_rank_with(stream, r, n, id, &o),
                        None => Comm::from_rank(stream, r, n, id),
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("a rank's thread")).zip(streams.iter().cloned()).collect()
    })
}

/// Ranks made with `Comm::from_rank` on threads of their own, the `Id`
/// made by rank 0's thread and its bytes sent to the others through a
/// channel: on one device per rank with the defaults; with fewer devices
/// than ranks, the defaults are refused on every rank (`Unsupported`: two
/// ranks on one device) and `share_devices` runs them. Then the ranks'
/// exchange, all-reduces (f32 avg, u32 sum), reductions to the last rank,
/// and the moving collectives, against the CPU.
#[test]
fn threads_meet_through_an_id_sent_over_a_channel() {
    let test = "threads_meet_through_an_id_sent_over_a_channel";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let g = ctxs.len();
    for n in [2, 3, 4] {
        let own = has_gpus(test, &format!("n={n}: Comm::from_rank with one device per rank (the defaults; with share_devices instead)"), g, n);
        let made = if own {
            from_rank_threads(&ctxs, n, |_| None)
        } else {
            for (r, (c, _)) in from_rank_threads(&ctxs, n, |_| None).into_iter().enumerate() {
                match c {
                    Err(Error::Unsupported(m)) if m.contains("same device") => {}
                    other => {
                        panic!("n={n}: rank {r}: two ranks on one device without share_devices: expected Unsupported (same device), got {other:?}")
                    }
                }
            }
            from_rank_threads(&ctxs, n, |_| Some(CommOptions::default().share_devices(true)))
        };
        let (comms, streams): (Vec<Comm>, Vec<Arc<CudaStream>>) =
            made.into_iter().enumerate().map(|(r, (c, s))| (c.unwrap_or_else(|e| panic!("n={n}: rank {r}: from_rank: {e}")), s)).unzip();
        let path = expected_path(test, n, g, PathPolicy::Auto);
        let tag = format!("n={n} from_rank {path:?}");
        assert_ranks(&tag, &comms, &streams, g, path);
        let gathered = each(&comms, |r, c| c.exchange().all_gather(&[r as u8, 0x5a]).expect("exchange all_gather"));
        for (r, all) in gathered.iter().enumerate() {
            assert_eq!(*all, (0..n).map(|k| vec![k as u8, 0x5a]).collect::<Vec<_>>(), "{tag}: rank {r}'s exchange");
        }
        reductions::<f32>(&comms, &tag, ReduceOp::Avg, 5003);
        reductions::<u32>(&comms, &tag, ReduceOp::Sum, 1001);
        moves::<bf16>(&comms, &tag, 2001);
        for c in &comms {
            c.synchronize().expect("synchronize");
        }
    }
}

/// Set in a child of the process tests: the file rank 0 writes its `Id`'s
/// bytes to (hex), which the other ranks read.
const ID_FILE: &str = "CUDA_PEER_COMM_TEST_ID_FILE";
/// Set in a child of the process tests: the run's seed (fresh inputs every
/// run, the same on every rank).
const SEED: &str = "CUDA_PEER_COMM_TEST_SEED";
/// What a child of the process tests prints at its end.
const ID_FILE_LINE: &str = "all-reduce and all-gather right";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2) && s.is_ascii(), "not hex: {s:?}");
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap_or_else(|e| panic!("not hex: {s:?}: {e}"))).collect()
}

/// FNV-1a of `bytes`: the digest the ranks compare through the exchange.
fn digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// A child of the process tests: rank 0 makes the `Id` and writes it to
/// the file (through a rename, so that no reader sees half of it), the
/// others wait for the file (bounded); every rank then joins with
/// `Comm::from_rank_with` (`share_devices`: ranks may share a GPU) on a
/// stream of its own and checks an all-reduce of u32 (sum, exact), one of
/// f32 (avg, within the bound, bitwise the same on every rank: digests
/// compared through the exchange) and an all-gather (exact), into
/// poisoned outputs.
fn id_file_child() {
    let rank = procs::rank();
    let n: usize = std::env::var("WORLD_SIZE").expect("WORLD_SIZE").parse().expect("WORLD_SIZE");
    let file = std::path::PathBuf::from(std::env::var(ID_FILE).expect("the id file"));
    let seed: u64 = std::env::var(SEED).expect("the seed").parse().expect("the seed");
    let id = if rank == 0 {
        let id = Id::new().expect("Id::new");
        let part = file.with_extension("part");
        std::fs::write(&part, hex(id.as_bytes())).expect("writing the id");
        std::fs::rename(&part, &file).expect("publishing the id");
        id
    } else {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match std::fs::read_to_string(&file) {
                Ok(text) => break Id::from_bytes(&unhex(text.trim())).unwrap_or_else(|e| panic!("rank {rank}: Id::from_bytes: {e}")),
                Err(e) if Instant::now() >= deadline => panic!("rank {rank}: no id in {} after 60 s: {e}", file.display()),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    };
    let devices = cuda_peer::driver::device_count().expect("device count");
    let stream = cuda_peer::driver::context(rank % devices).expect("context").new_stream().expect("stream");
    let opts = CommOptions::default().share_devices(true).timeout(Duration::from_secs(60));
    let comm = Comm::from_rank_with(stream.clone(), rank, n, id, &opts).unwrap_or_else(|e| panic!("rank {rank}: from_rank_with: {e}"));
    assert_eq!((comm.rank(), comm.world_size()), (rank, n));
    assert!(matches!(comm.engine(), Engine::Host(_)), "rank {rank}: engine {:?}", comm.engine());
    assert!(Arc::ptr_eq(comm.stream(), &stream), "rank {rank}: not the caller's stream");
    let s = &stream;

    let count = 100_003;
    let words = |k: u64, r: usize| cuda_peer::ipc::comm::seeded(seed.wrapping_mul(64).wrapping_add(k * 16 + r as u64), count);
    let ins: Vec<Vec<u32>> = (0..n).map(|r| words(0, r)).collect();
    let send = s.clone_htod(&ins[rank]).unwrap();
    let mut recv = poisoned::<u32>(s, count);
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap_or_else(|e| panic!("rank {rank}: all_reduce: {e}"));
    let sum = s.clone_dtoh(&recv).unwrap();
    assert_reduced(&format!("rank {rank}: u32 Sum all_reduce of {count}"), ReduceOp::Sum, &ins, 0, &sum);

    // f32 inputs of one sign per element, magnitudes in [1, 2).
    let signs = words(1, 15);
    let ins: Vec<Vec<f32>> = (0..n).map(|r| words(2, r).iter().zip(&signs).map(|(&w, &sg)| magnitude_of(w, sg & 1 == 1) as f32).collect()).collect();
    let mut buf = s.clone_htod(&ins[rank]).unwrap();
    comm.all_reduce_in_place(&mut buf, ReduceOp::Avg).unwrap_or_else(|e| panic!("rank {rank}: all_reduce_in_place: {e}"));
    let avg = s.clone_dtoh(&buf).unwrap();
    assert_reduced(&format!("rank {rank}: f32 Avg all_reduce_in_place of {count}"), ReduceOp::Avg, &ins, 0, &avg);
    let digests = comm.exchange().all_gather(&digest(bytemuck::cast_slice(&avg)).to_le_bytes()).expect("exchange all_gather");
    assert!(digests.iter().all(|d| *d == digests[0]), "rank {rank}: the f32 averages differ between ranks (digests {digests:?})");

    let c = 4099;
    let ins: Vec<Vec<u32>> = (0..n).map(|r| words(3, r)[..c].to_vec()).collect();
    let send = s.clone_htod(&ins[rank]).unwrap();
    let mut recv = poisoned::<u32>(s, n * c);
    comm.all_gather(&send, &mut recv).unwrap_or_else(|e| panic!("rank {rank}: all_gather: {e}"));
    assert_bits(&format!("rank {rank}: all_gather of {c}"), &s.clone_dtoh(&recv).unwrap(), &ins.concat());
    comm.synchronize().expect("synchronize");
    println!("rank {rank}: {ID_FILE_LINE}");
}

/// A magnitude in [1, 2) from a random word, of the sign given.
fn magnitude_of(w: u32, negative: bool) -> f64 {
    let m = 1.0 + w as f64 / 4_294_967_296.0;
    if negative {
        -m
    } else {
        m
    }
}

/// The parent of the process tests: `n` children of this test binary
/// ([`id_file_child`]), a new directory for the id file, a new seed.
fn processes_through_an_id_file(name: &str, n: usize) {
    let _gpu = exclusive();
    let Some(g) = gpu_count(name, 1) else { return };
    has_gpus(name, &format!("{n} processes with one device each (they share the {g} present)"), g, n);
    let dir = tempfile::tempdir().expect("a directory for the id");
    let file = dir.path().join("id");
    let seed: u64 = rand::random();
    let env = vec![(ID_FILE, file.display().to_string()), (SEED, seed.to_string())];
    let results = spawn(name, n, Duration::from_secs(180), |_| env.clone());
    all_succeeded(name, &results, passes(ID_FILE_LINE));
}

/// Two processes, rank 0 making the `Id` and passing it through a file;
/// `Comm::from_rank_with` in each; all-reduces and an all-gather against
/// the CPU.
#[test]
fn two_processes_meet_through_an_id_in_a_file() {
    if child() {
        return id_file_child();
    }
    processes_through_an_id_file("two_processes_meet_through_an_id_in_a_file", 2);
}

/// The same with three processes.
#[test]
fn three_processes_meet_through_an_id_in_a_file() {
    if child() {
        return id_file_child();
    }
    processes_through_an_id_file("three_processes_meet_through_an_id_in_a_file", 3);
}

// ---- graphs that outlive their communicators ----

/// One rank's inputs of a graph round.
struct GraphIn {
    /// The all-reduce's and all-gather's send, and the broadcast root's.
    a: Vec<u32>,
    /// The reduce-scatter's send (`n` blocks).
    big: Vec<u32>,
    /// The in-place reduce's buffer.
    ri: Vec<u32>,
}

/// One rank's outputs of a graph round.
#[derive(Debug, Clone)]
struct GraphOut {
    b: Vec<u32>,
    g: Vec<u32>,
    rs: Vec<u32>,
    bc: Vec<u32>,
    ri: Vec<u32>,
}

/// One rank's buffers of a graph round (the graph captures their addresses).
struct GraphBufs {
    a: CudaSlice<u32>,
    b: CudaSlice<u32>,
    g: CudaSlice<u32>,
    big: CudaSlice<u32>,
    rs: CudaSlice<u32>,
    bc: CudaSlice<u32>,
    ri: CudaSlice<u32>,
}

fn driver_err<E: std::fmt::Debug>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{what}: {e:?}")
}

impl GraphBufs {
    fn new(s: &Arc<CudaStream>, n: usize, count: usize) -> Result<GraphBufs, String> {
        let z = |len: usize| s.alloc_zeros::<u32>(len).map_err(driver_err("cuMemAlloc"));
        Ok(GraphBufs { a: z(count)?, b: z(count)?, g: z(n * count)?, big: z(n * count)?, rs: z(count)?, bc: z(count)?, ri: z(count)? })
    }

    /// The inputs copied into the buffers and every output poisoned, in
    /// the stream's order.
    fn fill(&mut self, s: &Arc<CudaStream>, ins: &GraphIn) -> Result<(), String> {
        let up = driver_err("cuMemcpyHtoD");
        s.memcpy_htod(&ins.a, &mut self.a).map_err(&up)?;
        s.memcpy_htod(&ins.big, &mut self.big).map_err(&up)?;
        s.memcpy_htod(&ins.ri, &mut self.ri).map_err(&up)?;
        for out in [&mut self.b, &mut self.g, &mut self.rs, &mut self.bc] {
            let poison = vec![u32::poison(); out.len()];
            s.memcpy_htod(&poison, out).map_err(&up)?;
        }
        Ok(())
    }

    fn read(&self, s: &Arc<CudaStream>) -> Result<GraphOut, String> {
        let down = |b: &CudaSlice<u32>| s.clone_dtoh(b).map_err(driver_err("cuMemcpyDtoH"));
        Ok(GraphOut { b: down(&self.b)?, g: down(&self.g)?, rs: down(&self.rs)?, bc: down(&self.bc)?, ri: down(&self.ri)? })
    }
}

/// The calls of a graph round: all-reduce (sum), all-gather,
/// reduce-scatter (max), broadcast from `root` and reduce in place (min)
/// to `root`.
fn graph_calls(c: &Comm, b: &mut GraphBufs, root: usize) -> cuda_peer::Result<()> {
    c.all_reduce(&b.a, &mut b.b, ReduceOp::Sum)?;
    c.all_gather(&b.a, &mut b.g)?;
    c.reduce_scatter(&b.big, &mut b.rs, ReduceOp::Max)?;
    let send = if c.rank() == root { Some(&b.a) } else { None };
    c.broadcast(send, &mut b.bc, root)?;
    c.reduce_in_place(&mut b.ri, ReduceOp::Min, root)
}

/// The streams of a rank's capture for [`try_capture`], the first the one
/// its graph is captured on and launched from: the communicator's own `s`,
/// or (`fork`) a new stream of the caller's, then `s`, which joins the
/// capture through an event recorded on it, so that the communicator meets
/// the capture only where it enqueues.
fn capture_streams(s: &Arc<CudaStream>, fork: bool) -> Result<Vec<Arc<CudaStream>>, String> {
    if fork {
        Ok(vec![s.context().new_stream().map_err(driver_err("cuStreamCreate"))?, s.clone()])
    } else {
        Ok(vec![s.clone()])
    }
}

/// Whether `n` thread ranks on `g` devices capture their graphs forked from
/// a stream of their own: only where each rank has a device (launched on a
/// stream of their own and ordered through events, graphs of thread ranks
/// sharing one device sometimes stalled: docs/multiprocess.md). Where not,
/// says so, and what the test does `instead`.
fn forks(test: &str, g: usize, n: usize, instead: &str) -> bool {
    if n > g {
        skipped(test, format_args!("n={n} forked ({instead}: thread ranks sharing a device) needs {n} GPUs, {g} present"));
    }
    n <= g
}

/// Launches `graph` (captured on `cap`) in the order of the communicator's
/// stream `s`: after its work so far, and before its work from now on (on
/// `s` itself where it was captured there).
fn launch_in_order(graph: &CudaGraph, cap: &Arc<CudaStream>, s: &Arc<CudaStream>) -> Result<(), String> {
    if Arc::ptr_eq(cap, s) {
        return graph.launch().map_err(driver_err("cuGraphLaunch"));
    }
    cap.join(s).map_err(driver_err("cuStreamWaitEvent (before the launch)"))?;
    graph.launch().map_err(driver_err("cuGraphLaunch"))?;
    s.join(cap).map_err(driver_err("cuStreamWaitEvent (after the launch)"))
}

/// One rank of a graph round, on its own thread: round 0 eagerly; then,
/// once every rank is there, the same calls captured into a graph on its
/// stream or, with `fork`, on a stream of its own that the communicator's
/// joins (every rank at once); every rank drops its `Comm`; then each
/// later round replays the graph on fresh inputs copied into the captured
/// buffers, outputs poisoned. Every rank reaches both barriers whatever
/// fails (no rank left waiting).
fn graph_rank(comm: Comm, rounds: &[Vec<GraphIn>], barrier: &Barrier, root: usize, count: usize, fork: bool) -> Result<Vec<GraphOut>, String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let s = comm.stream().clone();
    let mut outs = Vec::new();
    let bufs = GraphBufs::new(&s, n, count);
    let eager = bufs.and_then(|mut b| {
        b.fill(&s, &rounds[0][r])?;
        graph_calls(&comm, &mut b, root).map_err(|e| format!("rank {r}: the eager calls: {e}"))?;
        comm.synchronize().map_err(|e| format!("rank {r}: synchronize: {e}"))?;
        outs.push(b.read(&s)?);
        Ok(b)
    });
    barrier.wait();
    let captured = eager.and_then(|mut b| {
        let streams = capture_streams(&s, fork)?;
        let graph = try_capture(&streams, || graph_calls(&comm, &mut b, root).map_err(|e| format!("rank {r}: the calls under capture: {e}")))?;
        Ok((b, graph, streams[0].clone()))
    });
    barrier.wait();
    drop(comm);
    barrier.wait();
    let (mut b, graph, cap) = captured?;
    for (k, ins) in rounds.iter().enumerate().skip(1) {
        b.fill(&s, &ins[r])?;
        launch_in_order(&graph, &cap, &s)?;
        s.synchronize().map_err(|e| format!("rank {r}: replay {k}: synchronize: {e:?}"))?;
        outs.push(b.read(&s)?);
    }
    drop(graph);
    Ok(outs)
}

/// Checks every rank's outputs of every round against the CPU.
fn check_graph_rounds(tag: &str, rounds: &[Vec<GraphIn>], outs: &[Vec<GraphOut>], root: usize, count: usize) {
    let n = outs.len();
    for (k, ins) in rounds.iter().enumerate() {
        let round = if k == 0 { "the eager round".to_string() } else { format!("replay {k}, every Comm dropped") };
        let a: Vec<Vec<u32>> = ins.iter().map(|i| i.a.clone()).collect();
        let big: Vec<Vec<u32>> = ins.iter().map(|i| i.big.clone()).collect();
        let ri: Vec<Vec<u32>> = ins.iter().map(|i| i.ri.clone()).collect();
        for (r, per_round) in outs.iter().enumerate() {
            let o = &per_round[k];
            let what = |call: &str| format!("{tag}: {round}: rank {r}: {call}");
            assert_reduced(&what("all_reduce (sum)"), ReduceOp::Sum, &a, 0, &o.b);
            assert_bits(&what("all_gather"), &o.g, &a.concat());
            assert_reduced(&what("reduce_scatter (max)"), ReduceOp::Max, &big, r * count, &o.rs);
            assert_bits(&what(&format!("broadcast from {root}")), &o.bc, &a[root]);
            if r == root {
                assert_reduced(&what("reduce_in_place (min), the root"), ReduceOp::Min, &ri, 0, &o.ri);
            } else {
                assert_bits(&what("reduce_in_place (min), not the root: changed"), &o.ri, &ri[r]);
            }
        }
    }
    assert!(outs.iter().all(|o| o.len() == rounds.len()), "{tag}: {n} ranks, rounds missing");
}

/// On 2, 3 and 4 ranks (threads), P2P and staged: an eager round of
/// all-reduce, all-gather, reduce-scatter, broadcast and in-place reduce to
/// the last rank; then every rank captures the same calls into a CUDA graph
/// on its stream, all at once; every `Comm` is dropped; then each graph is
/// replayed three times on fresh inputs copied into the captured buffers,
/// outputs poisoned, every result exact. Each capture takes a keep-alive of
/// its communicator, released once the graphs are gone. Each with the
/// all-reduce by size and forced to the two-shot.
#[test]
fn graphs_captured_on_every_rank_replay_after_every_comm_is_dropped() {
    let algorithms = [cuda_peer::AllReduceAlgorithm::Auto, cuda_peer::AllReduceAlgorithm::TwoShot];
    graphs_replay_after_every_comm_is_dropped("graphs_captured_on_every_rank_replay_after_every_comm_is_dropped", &algorithms, false);
}

/// The same with each rank's capture started on a stream of the caller's,
/// not the communicator's: the communicator's stream joins the capture
/// through an event recorded there, so the communicator sees the capture
/// only when it enqueues, and must take its keep-alive then (the all-reduce
/// by size). Only where each rank has a device of its own: with thread
/// ranks sharing one H200, replays sometimes timed out (outputs untouched,
/// 3 of 7 runs; docs/multiprocess.md).
#[test]
fn graphs_forked_from_a_callers_stream_replay_after_every_comm_is_dropped() {
    let test = "graphs_forked_from_a_callers_stream_replay_after_every_comm_is_dropped";
    graphs_replay_after_every_comm_is_dropped(test, &[cuda_peer::AllReduceAlgorithm::Auto], true);
}

/// The body of the two tests above: `algorithms` for the all-reduce, the
/// capture forked from a caller's stream or not.
fn graphs_replay_after_every_comm_is_dropped(test: &str, algorithms: &[cuda_peer::AllReduceAlgorithm], fork: bool) {
    let _gpu = exclusive();
    // Each rank orders its own work: its buffers on its communicator's
    // stream, a forked capture joined back, each replay ordered around.
    let Some(ctxs) = untracked(test, 1) else { return };
    let g = ctxs.len();
    let count = 3001; // several chunks of the 4 KiB staging buffer
    let ranks: Vec<usize> = [2, 3, 4].into_iter().filter(|&n| !fork || forks(test, g, n, "left out")).collect();
    for (policy, algorithm) in [PathPolicy::Auto, PathPolicy::StagedOnly].into_iter().flat_map(|p| algorithms.iter().map(move |&a| (p, a))) {
        for &n in &ranks {
            let path = expected_path(test, n, g, policy);
            let tag = format!("n={n} {path:?} {algorithm:?}{}", if fork { ", forked" } else { "" });
            let root = n - 1;
            let streams = streams(&ctxs, n);
            let opts = CommOptions::default().buffer_bytes(BUFFER_BYTES).path(policy).all_reduce(algorithm);
            let comms = Comm::from_devices_with(streams.clone(), &opts).unwrap_or_else(|e| panic!("{tag}: from_devices_with: {e}"));
            assert_ranks(&tag, &comms, &streams, g, path);
            let rounds: Vec<Vec<GraphIn>> = (0..4)
                .map(|_| {
                    let (a, big, ri) = (draw::<u32>(n, count), draw::<u32>(n, n * count), draw::<u32>(n, count));
                    a.into_iter().zip(big).zip(ri).map(|((a, big), ri)| GraphIn { a, big, ri }).collect()
                })
                .collect();
            let (retained, released, _) = cuda_peer::group::graph_keep_alives();
            let barrier = Barrier::new(n);
            let outs: Vec<Result<Vec<GraphOut>, String>> = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .into_iter()
                    .map(|comm| {
                        let (rounds, barrier) = (&rounds, &barrier);
                        s.spawn(move || graph_rank(comm, rounds, barrier, root, count, fork))
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().expect("a rank's thread")).collect()
            });
            let outs: Vec<Vec<GraphOut>> = outs.into_iter().map(|o| o.unwrap_or_else(|e| panic!("{tag}: {e}"))).collect();
            check_graph_rounds(&tag, &rounds, &outs, root, count);
            let (now_retained, _, _) = cuda_peer::group::graph_keep_alives();
            assert!(now_retained >= retained + n as u64, "{tag}: {} keep-alives taken by {n} captures", now_retained - retained);
            // The graphs are gone (dropped on their threads): what they kept
            // alive is released, by a thread of the library's, soon after.
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let (_, now_released, _) = cuda_peer::group::graph_keep_alives();
                if now_released >= released + n as u64 {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "{tag}: {} of {n} keep-alives released 10 s after the graphs were dropped",
                    now_released - released
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// How many times each rank launches its graph between eager calls in
/// [`graph_replays_between_eager_calls_are_right_every_time`].
const INTERLEAVED: usize = 100;

/// One rank's histories of the interleaving test, launch after launch.
struct Histories {
    /// The graph's all-reduce (sum).
    graph_sum: Vec<u32>,
    /// The graph's all-gather.
    graph_gather: Vec<u32>,
    /// The eager all-reduce (max).
    eager_max: Vec<u32>,
}

/// One rank of the interleaving test, on its own thread: a graph of an
/// all-reduce (sum) and an all-gather of `gin`, captured on the
/// communicator's stream or, with `fork`, forked from a stream of its own
/// (see [`capture_streams`]); then, `INTERLEAVED` times
/// with no host synchronisation, an eager all-reduce (max) of `ein` on the
/// communicator's stream and a launch of the graph in that stream's order
/// ([`launch_in_order`]), every output copied into a history on the
/// device; the histories are read at the end.
fn interleaving_rank(comm: &Comm, gin: &[u32], ein: &[u32], fork: bool) -> Result<Histories, String> {
    let (r, n, count) = (comm.rank(), comm.world_size(), gin.len());
    let s = comm.stream().clone();
    let up = |h: &[u32]| s.clone_htod(h).map_err(driver_err("cuMemcpyHtoD"));
    let (gin, ein) = (up(gin)?, up(ein)?);
    let (mut gout, mut gg, mut eout) = (poisoned::<u32>(&s, count), poisoned::<u32>(&s, n * count), poisoned::<u32>(&s, count));
    let (mut hist_g, mut hist_gg, mut hist_e) =
        (poisoned::<u32>(&s, INTERLEAVED * count), poisoned::<u32>(&s, INTERLEAVED * n * count), poisoned::<u32>(&s, INTERLEAVED * count));
    s.synchronize().map_err(driver_err("cuStreamSynchronize"))?;
    let streams = capture_streams(&s, fork)?;
    let cap = streams[0].clone();
    let graph = try_capture(&streams, || {
        comm.all_reduce(&gin, &mut gout, ReduceOp::Sum).map_err(|e| format!("rank {r}: the captured all_reduce: {e}"))?;
        comm.all_gather(&gin, &mut gg).map_err(|e| format!("rank {r}: the captured all_gather: {e}"))
    })?;
    let copy = driver_err("cuMemcpyDtoD");
    for k in 0..INTERLEAVED {
        comm.all_reduce(&ein, &mut eout, ReduceOp::Max).map_err(|e| format!("rank {r}: eager call {k}: {e}"))?;
        s.memcpy_dtod(&eout, &mut hist_e.slice_mut(k * count..(k + 1) * count)).map_err(&copy)?;
        launch_in_order(&graph, &cap, &s)?;
        s.memcpy_dtod(&gout, &mut hist_g.slice_mut(k * count..(k + 1) * count)).map_err(&copy)?;
        s.memcpy_dtod(&gg, &mut hist_gg.slice_mut(k * n * count..(k + 1) * n * count)).map_err(&copy)?;
    }
    comm.synchronize().map_err(|e| format!("rank {r}: synchronize: {e}"))?;
    let down = |b: &CudaSlice<u32>| s.clone_dtoh(b).map_err(driver_err("cuMemcpyDtoH"));
    Ok(Histories { graph_sum: down(&hist_g)?, graph_gather: down(&hist_gg)?, eager_max: down(&hist_e)? })
}

/// A graph's calls and the communicator's eager calls share its slots,
/// counters and staging buffer, so they must not overlap: a graph runs in
/// order with the communicator's calls where it is launched in its
/// stream's order (captured forked from a stream of the caller's: the
/// launch stream waits for the communicator's stream, which waits for the
/// launch). On 2, 3 and 4 thread ranks, P2P and staged: 100 launches of a
/// graph (all-reduce sum and all-gather of one input) each right after an
/// eager all-reduce (max) of another input, nothing synchronised between
/// them; every one of the 300 results on every rank exact. Forked where
/// each rank has a device; where ranks share one, captured on the
/// communicator's stream (forked, launches there sometimes timed out at a
/// barrier, 2 ranks too: see docs/multiprocess.md).
#[test]
fn graph_replays_between_eager_calls_are_right_every_time() {
    let test = "graph_replays_between_eager_calls_are_right_every_time";
    let _gpu = exclusive();
    // Each rank orders its own work: its buffers are used on the
    // communicator's stream only, and the graph's launch stream is joined
    // with it around each launch.
    let Some(ctxs) = untracked(test, 1) else { return };
    let count = 1501; // chunks of the 4 KiB staging buffer
    let g = ctxs.len();
    let ranks: Vec<(usize, bool)> = [2, 3, 4].into_iter().map(|n| (n, forks(test, g, n, "captured on the communicator's stream instead"))).collect();
    for policy in [PathPolicy::Auto, PathPolicy::StagedOnly] {
        for &(n, fork) in &ranks {
            let path = expected_path(test, n, g, policy);
            let tag = format!("n={n} {path:?}{}", if fork { ", forked" } else { "" });
            let opts = CommOptions::default().buffer_bytes(BUFFER_BYTES).path(policy);
            let comms = Comm::from_devices_with(streams(&ctxs, n), &opts).unwrap_or_else(|e| panic!("{tag}: from_devices_with: {e}"));
            let (gin, ein) = (draw::<u32>(n, count), draw::<u32>(n, count));
            let outs = each(&comms, |r, c| interleaving_rank(c, &gin[r], &ein[r], fork));
            for (r, out) in outs.into_iter().enumerate() {
                let h = out.unwrap_or_else(|e| panic!("{tag}: {e}"));
                for k in 0..INTERLEAVED {
                    let what = |call: &str| format!("{tag}: rank {r}: launch {k}: {call}");
                    let one = k * count..(k + 1) * count;
                    assert_reduced(&what("the eager all_reduce (max)"), ReduceOp::Max, &ein, 0, &h.eager_max[one.clone()]);
                    assert_reduced(&what("the graph's all_reduce (sum)"), ReduceOp::Sum, &gin, 0, &h.graph_sum[one]);
                    assert_bits(&what("the graph's all_gather"), &h.graph_gather[k * n * count..(k + 1) * n * count], &gin.concat());
                }
            }
        }
    }
}

/// Calls each rank enqueues with no host synchronisation between them.
const UNSYNCED: usize = 4000;

/// Frameworks enqueue thousands of calls between host synchronisations.
/// Thread ranks on one device share its context's command queues, each
/// rank's calls wait for its peers' on the device, and each call reuses
/// the slots and flags of the calls before it, still running. On 2, 3 and
/// 4 ranks on one device, P2P and staged: [`UNSYNCED`] all-reduces (sum)
/// of fresh inputs, each into its own part of a poisoned output, nothing
/// synchronised until the end; every result exact on every rank, and no
/// call timed out.
#[test]
fn thread_ranks_on_one_device_make_thousands_of_calls_with_no_host_synchronisation() {
    let test = "thread_ranks_on_one_device_make_thousands_of_calls_with_no_host_synchronisation";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let one = &ctxs[..1];
    let count = 67;
    for policy in [PathPolicy::Auto, PathPolicy::StagedOnly] {
        for n in [2, 3, 4] {
            let tag = format!("n={n} {policy:?}");
            let opts = CommOptions::default().buffer_bytes(BUFFER_BYTES).path(policy);
            let comms = Comm::from_devices_with(streams(one, n), &opts).unwrap_or_else(|e| panic!("{tag}: from_devices_with: {e}"));
            let ins = draw::<u32>(n, UNSYNCED * count);
            let outs = each(&comms, |r, c| -> Result<Vec<u32>, String> {
                let s = c.stream();
                let input = s.clone_htod(&ins[r]).map_err(driver_err("cuMemcpyHtoD"))?;
                let mut out = poisoned::<u32>(s, UNSYNCED * count);
                s.synchronize().map_err(driver_err("cuStreamSynchronize"))?;
                for k in 0..UNSYNCED {
                    let part = k * count..(k + 1) * count;
                    c.all_reduce(&input.slice(part.clone()), &mut out.slice_mut(part), ReduceOp::Sum)
                        .map_err(|e| format!("rank {r}: call {k}: {e}"))?;
                }
                c.synchronize().map_err(|e| format!("rank {r}: synchronize: {e}"))?;
                s.clone_dtoh(&out).map_err(driver_err("cuMemcpyDtoH"))
            });
            for (r, out) in outs.into_iter().enumerate() {
                let got = out.unwrap_or_else(|e| panic!("{tag}: {e}"));
                assert_reduced(&format!("{tag}: rank {r}: {UNSYNCED} all-reduces"), ReduceOp::Sum, &ins, 0, &got);
            }
        }
    }
}

// ---- typed errors ----

/// One stream for two ranks is refused on every rank (their kernels would
/// wait for each other on it): 2 ranks on one stream, and 3 ranks where
/// rank 2 reuses rank 0's.
#[test]
fn one_stream_for_two_ranks_is_an_invalid_argument() {
    let test = "one_stream_for_two_ranks_is_an_invalid_argument";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let s = streams(&ctxs, 2);
    for (what, given) in
        [("2 ranks on one stream", vec![s[0].clone(), s[0].clone()]), ("rank 2 on rank 0's stream", vec![s[0].clone(), s[1].clone(), s[0].clone()])]
    {
        match Comm::from_devices(given) {
            Err(Error::InvalidArgument(m)) if m.contains("stream") => {}
            other => panic!("{what}: expected InvalidArgument (one stream), got {:?}", other.map(|c| c.len())),
        }
    }
}

fn expect_root(what: &str, r: cuda_peer::Result<()>, root: usize, size: usize) {
    match r {
        Err(Error::RootOutOfRange { root: g, size: s }) if (g, s) == (root, size) => {}
        other => panic!("{what}: expected RootOutOfRange {{ root: {root}, size: {size} }}, got {other:?}"),
    }
}

fn expect_length(what: &str, r: cuda_peer::Result<()>, op: &str, expected: usize, got: usize) {
    match r {
        Err(Error::LengthMismatch { op: o, expected: e, got: g }) if (o, e, g) == (op, expected, got) => {}
        other => panic!("{what}: expected LengthMismatch {{ op: {op}, expected: {expected}, got: {got} }}, got {other:?}"),
    }
}

/// Calls every rank makes with a root out of range, buffers of lengths that
/// do not fit, or avg on an integer type: the typed error on every rank,
/// before anything is enqueued or any call is counted (the outputs still
/// hold their poison), and the communicator then right on the next calls.
#[test]
fn bad_calls_are_typed_errors_and_the_comm_still_works() {
    let test = "bad_calls_are_typed_errors_and_the_comm_still_works";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let n = 3;
    let comms = Comm::from_devices(streams(&ctxs, n)).expect("from_devices");
    let c = 100;
    let ins = draw::<u32>(n, c);
    let after = draw::<u32>(n, c);
    let got = each(&comms, |r, comm| {
        let s = comm.stream();
        let w = |what: &str| format!("rank {r}: {what}");
        let x = s.clone_htod(&ins[r]).unwrap();
        let mut one_more = poisoned::<u32>(s, c + 1);
        let mut out = poisoned::<u32>(s, c);
        let mut third = poisoned::<u32>(s, c / 3);
        let mut gather_short = poisoned::<u32>(s, n * c - 1);
        for root in [n, n + 5, usize::MAX] {
            expect_root(&w("broadcast_in_place"), comm.broadcast_in_place(&mut out, root), root, n);
            expect_root(&w("broadcast"), comm.broadcast(Some(&x), &mut out, root), root, n);
            expect_root(&w("reduce"), comm.reduce(&x, &mut out, ReduceOp::Sum, root), root, n);
            expect_root(&w("reduce_in_place"), Collectives::reduce_in_place(comm, &mut out, ReduceOp::Max, root), root, n);
        }
        expect_length(&w("all_reduce"), comm.all_reduce(&x, &mut one_more, ReduceOp::Sum), "all_reduce", c, c + 1);
        expect_length(&w("all_gather"), comm.all_gather(&x, &mut gather_short), "all_gather", n * c, n * c - 1);
        expect_length(&w("reduce_scatter"), comm.reduce_scatter(&x, &mut third, ReduceOp::Sum), "reduce_scatter", n * (c / 3), c);
        expect_length(&w("reduce"), comm.reduce(&x, &mut one_more, ReduceOp::Min, 0), "reduce", c, c + 1);
        for (call, res) in [
            ("all_reduce_in_place avg", comm.all_reduce_in_place(&mut out, ReduceOp::Avg)),
            ("reduce_scatter avg", comm.reduce_scatter(&x, &mut third, ReduceOp::Avg)),
            ("reduce avg", comm.reduce(&x, &mut out, ReduceOp::Avg, 0)),
        ] {
            match res {
                Err(Error::UnsupportedOp { op: "avg", dtype: "u32" }) => {}
                other => panic!("{}: expected UnsupportedOp (avg, u32), got {other:?}", w(call)),
            }
        }
        let untouched: Vec<Vec<u32>> = [&out, &one_more, &third, &gather_short].iter().map(|b| s.clone_dtoh(*b).unwrap()).collect();
        // The next calls, matched, are right.
        let mut buf = s.clone_htod(&after[r]).unwrap();
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap_or_else(|e| panic!("{}: {e}", w("all_reduce_in_place after the errors")));
        let mut root_buf = s.clone_htod(&ins[r]).unwrap();
        comm.reduce_in_place(&mut root_buf, ReduceOp::Max, n - 1).unwrap_or_else(|e| panic!("{}: {e}", w("reduce_in_place after the errors")));
        (untouched, s.clone_dtoh(&buf).unwrap(), s.clone_dtoh(&root_buf).unwrap())
    });
    for (r, (untouched, sum, max)) in got.iter().enumerate() {
        for b in untouched {
            assert_bits(&format!("rank {r}: an output of a refused call"), b, &vec![u32::poison(); b.len()]);
        }
        assert_reduced(&format!("rank {r}: all_reduce_in_place sum after the refused calls"), ReduceOp::Sum, &after, 0, sum);
        if r == n - 1 {
            assert_reduced(&format!("rank {r}: reduce_in_place max after the refused calls, the root"), ReduceOp::Max, &ins, 0, max);
        } else {
            assert_bits(&format!("rank {r}: reduce_in_place max after the refused calls, not the root"), max, &ins[r]);
        }
    }
}

/// With a barrier timeout of 500 ms: ranks 0 and 2 of 3 make a call that
/// rank 1 never makes: `Error::Timeout` on both, after the barrier timeout
/// and well within a few seconds of it, nothing enqueued (their buffers
/// unchanged), and their communicators then refuse the next call at once.
/// And on 2 ranks, a broadcast whose root passes a send buffer of another
/// length, or none: the root's typed errors at once (it never makes the
/// call), and its peer, which makes the call, times out.
#[test]
fn a_call_a_peer_does_not_make_times_out_after_the_barrier_timeout() {
    let test = "a_call_a_peer_does_not_make_times_out_after_the_barrier_timeout";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let bt = Duration::from_millis(500);
    let opts = CommOptions::default().barrier_timeout(bt);
    let timed_out = |what: &str, r: &cuda_peer::Result<()>, took: Duration| {
        assert!(matches!(r, Err(Error::Timeout { after, .. }) if *after == bt), "{what}: expected Timeout after {bt:?}, got {r:?}");
        assert!(took >= bt && took < bt + Duration::from_secs(5), "{what}: the timeout came after {took:?} (barrier timeout {bt:?})");
    };

    let comms = Comm::from_devices_with(streams(&ctxs, 3), &opts).expect("from_devices_with");
    let ins = draw::<u32>(3, 1000);
    each(&comms, |r, c| {
        if r == 1 {
            return; // never makes the call
        }
        let s = c.stream();
        let mut x = s.clone_htod(&ins[r]).unwrap();
        let t = Instant::now();
        let res = c.all_reduce_in_place(&mut x, ReduceOp::Sum);
        timed_out(&format!("rank {r}: all_reduce_in_place without rank 1"), &res, t.elapsed());
        assert_bits(&format!("rank {r}: the buffer of the call that timed out"), &s.clone_dtoh(&x).unwrap(), &ins[r]);
        let t = Instant::now();
        let again = c.all_gather(&x, &mut poisoned::<u32>(s, 3000));
        assert!(
            matches!(again, Err(Error::Timeout { .. })),
            "rank {r}: the call after the timeout: expected the failed communicator's Timeout, got {again:?}"
        );
        assert!(t.elapsed() < bt, "rank {r}: the failed communicator took {:?} to refuse a call", t.elapsed());
    });
    drop(comms);

    let comms = Comm::from_devices_with(streams(&ctxs, 2), &opts).expect("from_devices_with");
    let ins = draw::<u32>(2, 100);
    each(&comms, |r, c| {
        let s = c.stream();
        let mut recv = poisoned::<u32>(s, 100);
        if r == 0 {
            let short = s.clone_htod(&ins[0][..99]).unwrap();
            let t = Instant::now();
            expect_length("the root's broadcast with a short send buffer", c.broadcast(Some(&short), &mut recv, 0), "broadcast", 100, 99);
            match c.broadcast(None::<&CudaSlice<u32>>, &mut recv, 0) {
                Err(Error::InvalidArgument(_)) => {}
                other => panic!("the root's broadcast without a send buffer: expected InvalidArgument, got {other:?}"),
            }
            assert!(t.elapsed() < bt, "the root's refusals took {:?}: they must not wait for the peer", t.elapsed());
        } else {
            let t = Instant::now();
            let res = c.broadcast(None::<&CudaSlice<u32>>, &mut recv, 0);
            timed_out("rank 1: a broadcast the root refused", &res, t.elapsed());
        }
        assert_bits(&format!("rank {r}: the broadcast's recv"), &s.clone_dtoh(&recv).unwrap(), &vec![u32::poison(); 100]);
    });
}

fn expect_mismatch(what: &str, me: usize, r: cuda_peer::Result<()>) {
    match r {
        Err(Error::Mismatch { rank, ours, theirs }) if rank != me && ours != theirs => {}
        other => panic!("{what}: rank {me}: expected Mismatch naming another rank, got {other:?}"),
    }
}

/// On 2 and 3 ranks, calls that differ between the ranks in collective,
/// count, op, root or element type: `Error::Mismatch` on every rank,
/// nothing moved; then matched calls right on the same communicator.
#[test]
fn mismatched_calls_are_a_mismatch_on_every_rank_then_the_comm_works() {
    let test = "mismatched_calls_are_a_mismatch_on_every_rank_then_the_comm_works";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    for n in [2, 3] {
        let comms = Comm::from_devices(streams(&ctxs, n)).expect("from_devices");
        let ins = draw::<u32>(n, 5003);
        let gathered = draw::<i32>(n, 777);
        let got = each(&comms, |r, c| {
            let s = c.stream();
            let w = |what: &str| format!("n={n}: {what}");
            let bytes = vec![7u8; 64];
            let mut b = s.clone_htod(&bytes).unwrap();
            let res = if r == 0 { c.broadcast_in_place(&mut b, 0) } else { c.all_reduce_in_place(&mut b, ReduceOp::Max) };
            expect_mismatch(&w("broadcast against all-reduce"), r, res);
            let counts = vec![1.5f32; 1000 + r];
            let mut x = s.clone_htod(&counts).unwrap();
            expect_mismatch(&w("counts"), r, c.all_reduce_in_place(&mut x, ReduceOp::Sum));
            let same = vec![2.5f32; 500];
            let mut y = s.clone_htod(&same).unwrap();
            expect_mismatch(&w("ops"), r, c.all_reduce_in_place(&mut y, if r == 0 { ReduceOp::Sum } else { ReduceOp::Max }));
            expect_mismatch(&w("roots"), r, c.reduce_in_place(&mut y, ReduceOp::Sum, r));
            let res = if r == 0 {
                c.all_reduce_in_place(&mut s.clone_htod(&[1.0f32; 64]).unwrap(), ReduceOp::Sum)
            } else {
                c.all_reduce_in_place(&mut s.clone_htod(&[1i32; 64]).unwrap(), ReduceOp::Sum)
            };
            expect_mismatch(&w("element types"), r, res);
            assert_eq!(s.clone_dtoh(&b).unwrap(), bytes, "n={n}: rank {r}: a refused call moved data");
            assert_eq!(s.clone_dtoh(&x).unwrap(), counts, "n={n}: rank {r}: a refused call moved data");
            assert_eq!(s.clone_dtoh(&y).unwrap(), same, "n={n}: rank {r}: a refused call moved data");
            // Matched calls, right.
            let send = s.clone_htod(&ins[r]).unwrap();
            let mut recv = poisoned::<u32>(s, ins[r].len());
            c.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap_or_else(|e| panic!("n={n}: rank {r}: all_reduce after the mismatches: {e}"));
            let send = s.clone_htod(&gathered[r]).unwrap();
            let mut all = poisoned::<i32>(s, n * gathered[r].len());
            c.all_gather(&send, &mut all).unwrap_or_else(|e| panic!("n={n}: rank {r}: all_gather after the mismatches: {e}"));
            (s.clone_dtoh(&recv).unwrap(), s.clone_dtoh(&all).unwrap())
        });
        for (r, (sum, all)) in got.iter().enumerate() {
            assert_reduced(&format!("n={n}: rank {r}: all_reduce after the mismatches"), ReduceOp::Sum, &ins, 0, sum);
            assert_bits(&format!("n={n}: rank {r}: all_gather after the mismatches"), all, &gathered.concat());
        }
    }
}

/// Three ranks, the last of which starts late (300 ms): five calls whose
/// counts differ between the ranks, then a matched all-reduce. A mismatch
/// refuses the call on every rank and leaves the communicator usable, so
/// the late rank must get each of the five mismatches too, and the
/// all-reduce must then be right on every rank, whatever the ranks' pace
/// (ranks that return their mismatch as soon as one peer differs run ahead
/// of a rank that has not published its call yet).
#[test]
fn a_late_rank_gets_every_mismatch_and_then_the_ranks_agree() {
    let test = "a_late_rank_gets_every_mismatch_and_then_the_ranks_agree";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let n = 3;
    let opts = CommOptions::default().barrier_timeout(Duration::from_secs(2));
    let comms = Comm::from_devices_with(streams(&ctxs, n), &opts).expect("from_devices_with");
    let ins = draw::<u32>(n, 4099);
    let got = each(&comms, |r, c| {
        let s = c.stream();
        if r == n - 1 {
            std::thread::sleep(Duration::from_millis(300));
        }
        for k in 0..5 {
            let mut x = s.clone_htod(&vec![1u32; 100 + r]).unwrap();
            expect_mismatch(&format!("mismatched call {k} (counts {} to {})", 100, 100 + n - 1), r, c.all_reduce_in_place(&mut x, ReduceOp::Sum));
        }
        let mut buf = s.clone_htod(&ins[r]).unwrap();
        c.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap_or_else(|e| panic!("rank {r}: the matched all_reduce after the mismatches: {e}"));
        s.clone_dtoh(&buf).unwrap()
    });
    for (r, out) in got.iter().enumerate() {
        assert_reduced(&format!("rank {r}: the matched all_reduce after the mismatches"), ReduceOp::Sum, &ins, 0, out);
    }
}

// ---- CPU self-check of the comparison ----

/// The comparison of this file (`is_right`, on `draw`'s inputs) takes
/// every right result the kernels' orders may give (rank order, reverse,
/// cyclic, largest first, a tree, a pre-divided average) and rejects, on
/// every element, a rank dropped and an average divided by `n - 1`, for
/// f32 and bf16 on 2 to 8 ranks; for u32 and i32 sums, it takes the
/// wrapping sum and rejects the sum without a rank (where that rank's
/// input is not 0). No GPU needed.
#[test]
fn the_comparison_rejects_a_dropped_rank_and_avg_by_n_minus_1() {
    fn floats<T: Elem>() {
        let count = 2000;
        for n in 2..=MAX_RANKS {
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let ins = draw::<T>(n, count);
                for i in 0..count {
                    let xs: Vec<T> = ins.iter().map(|x| x[i]).collect();
                    for (name, got) in num::right_results(op, &xs, i % n) {
                        assert!(right_at(op, &ins, i, got), "{} {op:?} n={n}: {name} [{i}] = {got:?} rejected", T::DTYPE.name());
                    }
                    // The all-reduce's average: every input divided by n first, then summed.
                    let pre: Vec<T> = xs.iter().map(|&x| T::divide(x, n)).collect();
                    let summed = pre[1..].iter().fold(pre[0], |a, &x| T::combine(ReduceOp::Sum, a, x));
                    if op == ReduceOp::Avg {
                        assert!(right_at(op, &ins, i, summed), "{} Avg n={n}: pre-divided sum [{i}] = {summed:?} rejected", T::DTYPE.name());
                    }
                    let defects = num::planted_defects(op, &xs, i % n);
                    assert!(!defects.is_empty());
                    for (name, got) in defects {
                        assert!(!right_at(op, &ins, i, got), "{} {op:?} n={n}: {name} [{i}] = {got:?} accepted", T::DTYPE.name());
                    }
                }
            }
        }
    }
    fn integers<T: Elem>() {
        let count = 2000;
        for n in 2..=MAX_RANKS {
            let ins = draw::<T>(n, count);
            let mut rejected = 0;
            for i in 0..count {
                let xs: Vec<T> = ins.iter().map(|x| x[i]).collect();
                let sum = xs[1..].iter().fold(xs[0], |a, &x| T::combine(ReduceOp::Sum, a, x));
                assert!(right_at(ReduceOp::Sum, &ins, i, sum), "{} n={n}: the sum [{i}] rejected", T::DTYPE.name());
                let dropped = i % n;
                if xs[dropped] == T::from_f64(0.0) {
                    continue;
                }
                let without = (0..n).filter(|&k| k != dropped).map(|k| xs[k]).reduce(|a, x| T::combine(ReduceOp::Sum, a, x)).unwrap();
                assert!(!right_at(ReduceOp::Sum, &ins, i, without), "{} n={n}: a sum without rank {dropped} [{i}] accepted", T::DTYPE.name());
                rejected += 1;
            }
            assert!(rejected >= count - 2, "{} n={n}: only {rejected} of {count} elements had a nonzero input to drop", T::DTYPE.name());
        }
    }
    floats::<f32>();
    floats::<bf16>();
    integers::<u32>();
    integers::<i32>();
}

/// Averages of f16 and bf16 near the top of their range, whose sums
/// overflow the type while their means do not, through every collective
/// that averages (all-reduce, reduce-scatter, reduce to a root past 0), on
/// 2 and 3 ranks: every result finite and within a few units in the last
/// place of the f64 mean (fresh inputs in [0.55, 0.95] of the largest
/// finite value, one sign per element). Fails where a collective sums
/// first and divides after: the sum is infinite.
#[test]
fn averages_near_the_top_of_the_range_do_not_overflow_in_any_collective() {
    fn run<T: Elem>(comms: &[Comm], max: f64, eps: f64) {
        let n = comms.len();
        let count = 3001;
        let seed = common::random_bytes(8);
        let mut x = u64::from_le_bytes(seed.try_into().unwrap()) | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64
        };
        let signs: Vec<f64> = (0..count).map(|_| if next() < 0.5 { -1.0 } else { 1.0 }).collect();
        let ins: Vec<Vec<T>> = (0..n).map(|_| (0..count).map(|i| T::from_f64(signs[i] * max * (0.55 + 0.4 * next()))).collect()).collect();
        let mean = |i: usize| ins.iter().map(|v| v[i].to_f64()).sum::<f64>() / n as f64;
        let check = |what: &str, got: &[T], offset: usize| {
            for (j, g) in got.iter().enumerate() {
                let (g, m) = (g.to_f64(), mean(offset + j));
                assert!(g.is_finite(), "{} {what} on {n} ranks: [{}] = {g}, the mean is {m}", T::DTYPE.name(), offset + j);
                assert!(
                    (g - m).abs() <= (n as f64 + 2.0) * eps * m.abs(),
                    "{} {what} on {n} ranks: [{}] = {g}, the mean is {m}",
                    T::DTYPE.name(),
                    offset + j
                );
            }
        };
        let root = n - 1;
        let part = count / n;
        let got = each(comms, |r, c| {
            let s = c.stream();
            let send = s.clone_htod(&ins[r]).unwrap();
            let mut all = poisoned::<T>(s, count);
            c.all_reduce(&send, &mut all, ReduceOp::Avg).expect("all_reduce");
            let scatter_send = s.clone_htod(&ins[r][..part * n]).unwrap();
            let mut mine = poisoned::<T>(s, part);
            c.reduce_scatter(&scatter_send, &mut mine, ReduceOp::Avg).expect("reduce_scatter");
            let mut reduced = poisoned::<T>(s, count);
            c.reduce(&send, &mut reduced, ReduceOp::Avg, root).expect("reduce");
            (s.clone_dtoh(&all).unwrap(), s.clone_dtoh(&mine).unwrap(), s.clone_dtoh(&reduced).unwrap())
        });
        for (r, (all, mine, reduced)) in got.iter().enumerate() {
            check("all_reduce", all, 0);
            check("reduce_scatter", mine, r * part);
            if r == root {
                check("reduce", reduced, 0);
            }
        }
    }
    let test = "averages_near_the_top_of_the_range_do_not_overflow_in_any_collective";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    for n in [2usize, 3] {
        for policy in [PathPolicy::Auto, PathPolicy::StagedOnly] {
            let comms = Comm::from_devices_with(streams(&ctxs, n), &CommOptions::default().path(policy)).expect("from_devices");
            run::<half::f16>(&comms, 65504.0, 1.0 / 1024.0);
            run::<bf16>(&comms, 3.38e38, 1.0 / 128.0);
        }
    }
}
