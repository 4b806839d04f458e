//! One process per rank, on the GPU: each test re-executes this test binary
//! as N children (filtered to itself, with torchrun's variables and
//! `CUDA_PEER_MP_CHILD` set), which create a `Comm` and check their results
//! against a CPU reference; the parent checks that every child ran that
//! test and printed its result line, in time (`common::procs`). With fewer
//! GPUs than ranks the ranks share the GPUs (`CommOptions::share_devices`),
//! so one GPU runs them all; without a GPU a test skips (a `SKIPPED <name>`
//! line; it fails with CUDA_PEER_REQUIRE_GPU=1). Integers and float sums,
//! products, minima and maxima of the small integer inputs are exact; float
//! averages lie within `common::num`'s per-element bound. The tests of the
//! bootstrap alone, of the comparison and of the harness need no GPU.
#![cfg(target_os = "linux")]

mod common;

use common::num::{self, Num};
use common::procs::{self, all_succeeded, child, passes, rank, spawn, End};

use cuda_peer::cudarc::driver::{CudaSlice, CudaStream};
use cuda_peer::ipc::{comm::seeded, AllReduceAlgorithm, Bootstrap, Comm, CommOptions};
use cuda_peer::{Collectives, Error, Path, PathPolicy, ReduceOp};
use half::{bf16, f16};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Set in a child: ranks share the GPUs (more processes than devices).
const SHARE: &str = "CUDA_PEER_MP_SHARE";

/// Set in a child: the staged path (shared host memory), forced.
const STAGED: &str = "CUDA_PEER_MP_STAGED";

/// Set in a child: every all-reduce takes the two-shot
/// (`AllReduceAlgorithm::TwoShot`).
const TWO_SHOT: &str = "CUDA_PEER_MP_TWO_SHOT";

/// Whether the parent asked this child's ranks to share the GPUs.
fn shared() -> bool {
    std::env::var_os(SHARE).is_some()
}

/// The children's options: `share_devices`, the staged path and the
/// two-shot where the parent asked.
fn child_opts() -> CommOptions {
    let path = if std::env::var_os(STAGED).is_some() { PathPolicy::StagedOnly } else { PathPolicy::Auto };
    let algorithm = if std::env::var_os(TWO_SHOT).is_some() { AllReduceAlgorithm::TwoShot } else { AllReduceAlgorithm::Auto };
    CommOptions::default().timeout(Duration::from_secs(30)).share_devices(shared()).path(path).all_reduce(algorithm)
}

/// The communicator of a child, on the path the parent asked for.
fn child_comm(opts: &CommOptions) -> Comm {
    let comm = Comm::from_env(opts).unwrap();
    let want = if opts.path == PathPolicy::StagedOnly { Path::Staged } else { Path::P2p };
    assert_eq!(comm.path(), want, "rank {}", comm.rank());
    comm
}

/// Runs test `name` as `n` processes with `env` set in every child, on the
/// GPUs there are: with fewer than `n`, ranks share them. Every rank must
/// pass, printing `rank N: <line>`.
fn processes(name: &str, n: usize, deadline: Duration, env: Vec<(&'static str, String)>, line: &str) {
    processes_ending(name, n, deadline, env, passes(line));
}

/// As [`processes`], each rank ending as `end(rank)` says.
fn processes_ending(name: &str, n: usize, deadline: Duration, env: Vec<(&'static str, String)>, end: impl Fn(usize) -> End) {
    let Some(gpus) = common::gpu_count(name, 1) else {
        return;
    };
    let mut env = env;
    if gpus < n {
        env.push((SHARE, "1".into()));
        common::skipped(name, format!("one device per rank (P2P between devices): needs {n} GPUs, {gpus} present; the {n} ranks share them"));
    }
    all_succeeded(name, &spawn(name, n, deadline, |_| env.clone()), end);
}

/// Rank r's inputs for `op`: small integers (`num::small_input`), so that
/// every reduction of up to 8 ranks is exact in every type except the
/// division of avg.
fn inputs(seed: u64, n: usize, count: usize, op: ReduceOp) -> Vec<Vec<f64>> {
    (0..n).map(|r| seeded(seed * 16 + r as u64, count).into_iter().map(|x| num::small_input(op, x as u64)).collect()).collect()
}

/// The reductions the test runs on `T`: every op, avg on floats only (the
/// test's own knowledge of the types, not the library's check).
fn ops<T: Num>() -> Vec<ReduceOp> {
    ReduceOp::ALL.into_iter().filter(|&op| op != ReduceOp::Avg || T::BITS.is_some()).collect()
}

/// Asserts that `r` refuses avg on the integer type `T` (and names both).
fn refuses_avg<T: Num>(what: &str, r: cuda_peer::Result<()>) {
    match r {
        Err(Error::UnsupportedOp { op: "avg", dtype }) if dtype == T::DTYPE.name() => {}
        other => panic!("rank {}: {what} avg on {}: expected UnsupportedOp (avg, {}), got {other:?}", rank(), T::DTYPE.name(), T::DTYPE.name()),
    }
}

/// Asserts that every element of `got` is right for `op` over `ins`,
/// element `offset + i` of every rank's inputs for `got[i]`.
fn assert_reduced<T: Num>(what: &str, op: ReduceOp, ins: &[Vec<f64>], offset: usize, got: &[T]) {
    if let Some(i) = (0..got.len()).find(|&i| !num::accepts_at(op, ins, offset + i, got[i])) {
        let xs: Vec<f64> = ins.iter().map(|x| x[offset + i]).collect();
        let bound = T::BITS.map_or(0.0, |b| num::float_bound(op, &xs, b));
        panic!(
            "rank {}: {} {op:?} {what}: [{i}] = {:?}, expected {} (within {bound:e}) from {xs:?}",
            rank(),
            T::DTYPE.name(),
            got[i],
            num::reference(op, &xs)
        );
    }
}

/// Asserts that `got` is exactly `want(i)` at every element.
fn assert_exact<T: Num>(what: &str, got: &[T], want: impl Fn(usize) -> f64) {
    for (i, g) in got.iter().enumerate() {
        let w = T::from_f64(want(i));
        assert!(*g == w, "rank {}: {} {what}: [{i}] = {g:?}, expected {w:?}", rank(), T::DTYPE.name());
    }
}

/// Every op on `T`, in place and out of place, at sizes on the small, the
/// middle and the large lane, and over several rounds of the large lane;
/// avg on an integer type refused.
fn check_type<T: Num>(comm: &Comm, stream: &Arc<CudaStream>, seed: &mut u64) {
    let n = comm.size();
    // Two rounds and a bit of the large lane's slots (32 MiB: four sets of one slot per rank).
    let big = (32usize << 20) / (4 * n) / T::DTYPE.size() * 2 + 7;
    if T::BITS.is_none() {
        let host = vec![T::from_f64(1.0); 100];
        let send = stream.clone_htod(&host).unwrap();
        let mut recv = stream.clone_htod(&host).unwrap();
        refuses_avg::<T>("all_reduce", comm.all_reduce(&send, &mut recv, ReduceOp::Avg));
        refuses_avg::<T>("all_reduce_in_place", comm.all_reduce_in_place(&mut recv, ReduceOp::Avg));
    }
    for op in ops::<T>() {
        for count in [1usize, 1000, 70_000 / T::DTYPE.size() * 4 + 3, big] {
            *seed += 1;
            let ins = inputs(*seed, n, count, op);
            let host: Vec<T> = ins[comm.rank()].iter().map(|&x| T::from_f64(x)).collect();
            let send = stream.clone_htod(&host).unwrap();
            let mut recv = stream.clone_htod(&vec![T::from_f64(0.0); count]).unwrap();
            comm.all_reduce(&send, &mut recv, op).unwrap();
            let mut inplace = stream.clone_htod(&host).unwrap();
            comm.all_reduce_in_place(&mut inplace, op).unwrap();
            for (what, buf) in [("out of place", &recv), ("in place", &inplace)] {
                let got = stream.clone_dtoh(buf).unwrap();
                assert_reduced(&format!("{what}, {count} elements"), op, &ins, 0, &got);
            }
        }
    }
}

/// A child's body of the all-reduce tests.
fn all_reduce_child() {
    let comm = child_comm(&child_opts());
    let stream = comm.stream().clone();
    let mut seed = 0;
    check_type::<f32>(&comm, &stream, &mut seed);
    check_type::<f64>(&comm, &stream, &mut seed);
    check_type::<f16>(&comm, &stream, &mut seed);
    check_type::<bf16>(&comm, &stream, &mut seed);
    check_type::<i32>(&comm, &stream, &mut seed);
    check_type::<i64>(&comm, &stream, &mut seed);
    check_type::<u32>(&comm, &stream, &mut seed);
    check_type::<u64>(&comm, &stream, &mut seed);
    check_type::<i8>(&comm, &stream, &mut seed);
    check_type::<u8>(&comm, &stream, &mut seed);
    comm.synchronize().unwrap();
    println!("rank {}: every type and op right", comm.rank());
}

const ALL_REDUCE_LINE: &str = "every type and op right";

#[test]
fn two_processes_all_reduce_every_type_and_op() {
    if child() {
        return all_reduce_child();
    }
    processes("two_processes_all_reduce_every_type_and_op", 2, Duration::from_secs(300), vec![], ALL_REDUCE_LINE);
}

#[test]
fn three_processes_all_reduce_every_type_and_op() {
    if child() {
        return all_reduce_child();
    }
    processes("three_processes_all_reduce_every_type_and_op", 3, Duration::from_secs(400), vec![], ALL_REDUCE_LINE);
}

/// Rank `r`'s f16/bf16 inputs near the top of the type's range (`lo..hi`),
/// the same on every rank for the same seed.
fn top_inputs(seed: u64, n: usize, count: usize, lo: f64, hi: f64) -> Vec<Vec<f64>> {
    (0..n).map(|r| seeded(seed * 16 + r as u64, count).into_iter().map(|x| lo + (hi - lo) * (x as f64 / u32::MAX as f64)).collect()).collect()
}

/// The one-shot's average between processes of 16-bit floats whose sums
/// overflow the type but whose means do not: finite, and within the
/// rounding of one division and n - 1 additions of the type.
fn avg_top<T: Num>(comm: &Comm, stream: &Arc<CudaStream>, seed: u64, lo: f64, hi: f64, eps: f64) {
    let n = comm.size();
    for count in [1024, (1 << 20) + 3] {
        let ins = top_inputs(seed, n, count, lo, hi);
        let mine: Vec<T> = ins[comm.rank()].iter().map(|&x| T::from_f64(x)).collect();
        let mut buf = stream.clone_htod(&mine).unwrap();
        comm.all_reduce_in_place(&mut buf, ReduceOp::Avg).unwrap();
        let got = stream.clone_dtoh(&buf).unwrap();
        for (i, g) in got.iter().enumerate() {
            let mean = ins.iter().map(|x| T::from_f64(x[i]).to_f64()).sum::<f64>() / n as f64;
            let g = g.to_f64();
            assert!(
                g.is_finite() && (g - mean).abs() <= (n as f64 + 1.0) * eps * mean.abs(),
                "rank {}: {count} x {}: element {i} is {g}, the mean {mean}",
                comm.rank(),
                T::DTYPE
            );
        }
    }
}

/// f16 and bf16 averages near the top of the range between processes.
#[test]
fn two_processes_avg_near_the_top_of_the_range_does_not_overflow() {
    if child() {
        let comm = child_comm(&child_opts());
        let stream = comm.stream().clone();
        avg_top::<f16>(&comm, &stream, 7, 40_000.0, 65_000.0, f64::powi(2.0, -11));
        avg_top::<bf16>(&comm, &stream, 8, 1.8e38, 3.3e38, f64::powi(2.0, -8));
        comm.synchronize().unwrap();
        return println!("rank {}: averages near the top right", comm.rank());
    }
    processes("two_processes_avg_near_the_top_of_the_range_does_not_overflow", 2, Duration::from_secs(120), vec![], "averages near the top right");
}

const ABORT_LINE: &str = "freed by the shared abort word";

/// A rank whose kernel times out tells the others through the abort word
/// the processes share: rank 1, which starts its call a second after rank
/// 0, gives up when rank 0 does (about a second into its wait), not after
/// its own 2 s barrier timeout; rank 2, which calls after the failure, is
/// refused at once. Every rank reports rank 0's timeout of call 2.
#[test]
fn a_timeout_between_processes_frees_the_peers_early() {
    if child() {
        let comm = child_comm(&child_opts().check_calls(false).barrier_timeout(Duration::from_secs(2)));
        let r = comm.rank();
        let stream = comm.stream().clone();
        let count = 4099;
        let mut buf: CudaSlice<u32> = stream.clone_htod(&seeded(30 + r as u64, count)).unwrap();
        let want: Vec<u32> = (0..count).map(|i| (0..comm.world_size()).fold(0u32, |a, k| a.wrapping_add(seeded(30 + k as u64, count)[i]))).collect();
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
        comm.synchronize().unwrap();
        assert!(stream.clone_dtoh(&buf).unwrap() == want, "rank {r}: call 1 is wrong");
        std::thread::sleep(Duration::from_millis([0, 1000, 5000][r]));
        let start = Instant::now();
        let called = comm.all_reduce_in_place(&mut buf, ReduceOp::Sum);
        let synced = comm.synchronize();
        let took = start.elapsed();
        for got in [&synced, if r == 2 { &called } else { &synced }] {
            match got {
                Err(Error::PeerTimeout { rank: 0, call: 2, after }) => assert_eq!(*after, Duration::from_secs(2), "rank {r}"),
                other => panic!("rank {r}: expected rank 0's timeout of call 2, got {other:?}"),
            }
        }
        match r {
            0 => assert!(took >= Duration::from_millis(1900), "rank 0 gave up after {took:?}, before its 2 s timeout"),
            1 => assert!(
                took >= Duration::from_millis(500) && took < Duration::from_millis(1600),
                "rank 1 returned after {took:?}: expected about 1 s (rank 0's timeout), not its own 2 s"
            ),
            _ => assert!(took < Duration::from_millis(500), "rank 2 took {took:?} to be refused"),
        }
        return println!("rank {r}: {ABORT_LINE} after {took:?}");
    }
    processes("a_timeout_between_processes_frees_the_peers_early", 3, Duration::from_secs(120), vec![], ABORT_LINE);
}

/// Two ranks on one device without `share_devices` are refused on both.
#[test]
fn two_ranks_on_one_device_are_a_typed_error() {
    if child() {
        let rv = Bootstrap::from_env().unwrap().with_timeout(Duration::from_secs(30)).connect().unwrap();
        match Comm::new(Box::new(rv), 0, &CommOptions::default()) {
            Err(Error::Unsupported(m)) if m.contains("same device") => return println!("rank {}: Unsupported (same device): {m}", rank()),
            other => panic!("rank {}: expected Error::Unsupported (same device), got {other:?}", rank()),
        }
    }
    let name = "two_ranks_on_one_device_are_a_typed_error";
    if common::gpu_count(name, 1).is_none() {
        return;
    }
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(120), |_| vec![]), passes("Unsupported (same device)"));
}

/// A peer that meets rank 0 and exits before creating its communicator:
/// rank 0's creation fails at its first exchange, naming the peer, in time.
#[test]
fn a_peer_that_exits_at_creation_fails_the_survivor_in_time() {
    if child() {
        if rank() == 1 {
            // Meets rank 0, then dies before creating the communicator.
            let rv = Bootstrap::from_env().unwrap().connect().unwrap();
            drop(rv);
            println!("rank 1: leaving after the rendezvous");
            std::process::exit(0);
        }
        let start = Instant::now();
        let r = Comm::from_env(&CommOptions::default().timeout(Duration::from_secs(10)));
        let took = start.elapsed();
        match &r {
            Err(Error::Bootstrap { op: "all-gather", reason }) if reason.starts_with("rank 1: ") => {}
            other => panic!("rank 0: expected Error::Bootstrap (all-gather, naming rank 1), got {:?}", other.as_ref().map(|_| "a communicator")),
        }
        assert!(took < Duration::from_secs(30), "took {took:?}");
        println!("rank 0: {:?} after {took:?}", r.err());
        return;
    }
    let name = "a_peer_that_exits_at_creation_fails_the_survivor_in_time";
    // Rank 0 alone opens a device.
    if common::gpu_count(name, 1).is_none() {
        return;
    }
    let end =
        |r: usize| if r == 1 { End::Exits("rank 1: leaving after the rendezvous".into()) } else { End::Passes("rank 0: Some(Bootstrap".into()) };
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(120), |_| vec![]), end);
}

/// The rendezvous alone (TCP, no GPU): a rank whose peer never starts
/// times out in bounded time.
#[test]
fn a_peer_that_never_starts_is_a_timeout() {
    if child() {
        let start = Instant::now();
        let r = Bootstrap::from_env().unwrap().with_timeout(Duration::from_secs(3)).connect();
        assert!(
            matches!(r, Err(Error::Timeout { op: "rendezvous (waiting for every rank to connect)", after }) if after == Duration::from_secs(3)),
            "{r:?}"
        );
        assert!(start.elapsed() < Duration::from_secs(20));
        println!("rank 0: {:?} after {:?}", r.err(), start.elapsed());
        return;
    }
    let name = "a_peer_that_never_starts_is_a_timeout";
    // One child of a world of two.
    let results = spawn(name, 1, Duration::from_secs(60), |_| vec![("WORLD_SIZE", "2".into()), ("LOCAL_WORLD_SIZE", "2".into())]);
    all_succeeded(name, &results, passes("Some(Timeout"));
}

/// Rank 1 leaves after one call: rank 0's next call times out before
/// anything is enqueued, and the communicator refuses the calls after.
#[test]
fn a_peer_that_exits_after_creation_fails_the_next_checked_call() {
    if child() {
        let opts = CommOptions::default().timeout(Duration::from_secs(30)).barrier_timeout(Duration::from_secs(2)).share_devices(shared());
        let comm = Comm::from_env(&opts).unwrap();
        let mut x = comm.stream().clone_htod(&[1.0f32; 1000]).unwrap();
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
        comm.synchronize().unwrap();
        assert_eq!(comm.stream().clone_dtoh(&x).unwrap(), vec![comm.size() as f32; 1000], "rank {}: the first call", comm.rank());
        if comm.rank() == 1 {
            println!("rank 1: leaving after one call");
            std::process::exit(0);
        }
        std::thread::sleep(Duration::from_millis(500));
        let start = Instant::now();
        // The peer never publishes its call: a timeout before anything is enqueued.
        let r = comm.all_reduce_in_place(&mut x, ReduceOp::Sum);
        println!("rank 0: {r:?} after {:?}", start.elapsed());
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
        // Nothing was enqueued: the buffer still holds the first call's result.
        assert_eq!(comm.stream().clone_dtoh(&x).unwrap(), vec![2.0f32; 1000], "rank 0: the refused call changed its buffer");
        // The communicator failed: later calls are refused at once.
        let mut y = comm.stream().clone_htod(&[1u8; 10]).unwrap();
        let again = comm.broadcast_in_place(&mut y, 0);
        assert!(matches!(again, Err(Error::Timeout { .. })), "{again:?}");
        println!("rank 0: timed out, then refused");
        std::process::exit(0); // the peer is gone: no collective drop
    }
    let end = |r: usize| End::Exits(if r == 1 { "rank 1: leaving after one call".into() } else { "rank 0: timed out, then refused".into() });
    processes_ending("a_peer_that_exits_after_creation_fails_the_next_checked_call", 2, Duration::from_secs(120), vec![], end);
}

/// Without the per-call check, the survivor's kernel waits for the dead
/// peer's flags until its barrier timeout, then gives up cleanly: the next
/// synchronization reports `PeerTimeout`, later calls are refused, and the
/// context still works.
#[test]
fn a_peer_that_exits_after_creation_times_out_an_unchecked_call() {
    if child() {
        let opts = CommOptions::default()
            .timeout(Duration::from_secs(30))
            .barrier_timeout(Duration::from_millis(500))
            .check_calls(false)
            .share_devices(shared());
        let comm = Comm::from_env(&opts).unwrap();
        comm.exchange().barrier().unwrap();
        if comm.rank() == 1 {
            println!("rank 1: leaving after the barrier");
            std::process::exit(0);
        }
        std::thread::sleep(Duration::from_millis(500));
        let start = Instant::now();
        let mut x = comm.stream().clone_htod(&[1.0f32; 1000]).unwrap();
        let r = comm.all_reduce_in_place(&mut x, ReduceOp::Sum).and_then(|()| comm.synchronize());
        println!("rank 0: {r:?} after {:?}", start.elapsed());
        assert!(matches!(r, Err(Error::PeerTimeout { rank: 0, .. })), "expected a timeout of rank 0, got {r:?}");
        let again = comm.all_reduce_in_place(&mut x, ReduceOp::Sum);
        assert!(matches!(again, Err(Error::PeerTimeout { .. })), "{again:?}");
        // The context survived: plain copies still work.
        let back = comm.stream().clone_dtoh(&x).unwrap();
        assert_eq!(back.len(), 1000);
        let y = comm.stream().clone_htod(&[5u32, 6, 7]).unwrap();
        assert_eq!(comm.stream().clone_dtoh(&y).unwrap(), vec![5, 6, 7], "rank 0's context after the timeout");
        println!("rank 0: timed out, context usable");
        std::process::exit(0); // the peer is gone: no collective drop
    }
    let end = |r: usize| End::Exits(if r == 1 { "rank 1: leaving after the barrier".into() } else { "rank 0: timed out, context usable".into() });
    processes_ending("a_peer_that_exits_after_creation_times_out_an_unchecked_call", 2, Duration::from_secs(120), vec![], end);
}

/// Asserts that `r` is a mismatch error.
fn expect_mismatch(what: &str, r: Result<(), Error>) {
    match r {
        Err(Error::Mismatch { ours, theirs, .. }) => println!("rank {}: {what}: mismatch, ours {ours}, theirs {theirs}", rank()),
        other => panic!("rank {}: {what}: expected Error::Mismatch, got {other:?}", rank()),
    }
}

/// Ranks that call with different counts, element types, collectives or
/// roots all get `Error::Mismatch`, nothing moves, and the communicator
/// still works afterwards.
fn mismatch_child() {
    let comm = child_comm(&child_opts());
    let (me, n, s) = (comm.rank(), comm.size(), comm.stream().clone());
    let count = 1000 + me;
    let mut x = s.clone_htod(&vec![1.0f32; count]).unwrap();
    expect_mismatch("counts", comm.all_reduce_in_place(&mut x, ReduceOp::Sum));
    // Different element types (same count).
    let r = if me == 0 {
        let mut a = s.clone_htod(&[1.0f32; 64]).unwrap();
        comm.all_reduce_in_place(&mut a, ReduceOp::Sum)
    } else {
        let mut a = s.clone_htod(&[1i32; 64]).unwrap();
        comm.all_reduce_in_place(&mut a, ReduceOp::Sum)
    };
    expect_mismatch("types", r);
    // Different collectives.
    let mut b = s.clone_htod(&[7u8; 64]).unwrap();
    let r = if me == 0 { comm.broadcast_in_place(&mut b, 0) } else { comm.all_reduce_in_place(&mut b, ReduceOp::Max) };
    expect_mismatch("collectives", r);
    // Different roots.
    expect_mismatch("roots", comm.broadcast_in_place(&mut b, me));
    // Nothing moved, and the next calls are right.
    assert_eq!(s.clone_dtoh(&x).unwrap(), vec![1.0f32; count]);
    assert_eq!(s.clone_dtoh(&b).unwrap(), vec![7u8; 64]);
    let mut y = s.clone_htod(&[(me + 1) as f32; 4096]).unwrap();
    comm.all_reduce_in_place(&mut y, ReduceOp::Sum).unwrap();
    let mut g = s.alloc_zeros::<u32>(8 * n).unwrap();
    comm.all_gather(&s.clone_htod(&[me as u32; 8]).unwrap(), &mut g).unwrap();
    comm.synchronize().unwrap();
    assert_eq!(s.clone_dtoh(&y).unwrap(), vec![(n * (n + 1) / 2) as f32; 4096]);
    assert_eq!(s.clone_dtoh(&g).unwrap(), (0..n).flat_map(|r| [r as u32; 8]).collect::<Vec<_>>());
    println!("rank {me}: every mismatch reported, then right");
}

const MISMATCH_LINE: &str = "every mismatch reported, then right";

#[test]
fn mismatched_calls_are_an_error_on_every_rank_then_the_comm_works() {
    if child() {
        return mismatch_child();
    }
    processes("mismatched_calls_are_an_error_on_every_rank_then_the_comm_works", 2, Duration::from_secs(120), vec![], MISMATCH_LINE);
}

#[test]
fn three_processes_mismatched_calls_are_an_error_on_every_rank() {
    if child() {
        return mismatch_child();
    }
    processes("three_processes_mismatched_calls_are_an_error_on_every_rank", 3, Duration::from_secs(400), vec![], MISMATCH_LINE);
}

/// The value that poisons outputs (the inputs are at most 8).
const POISON: f64 = 99.0;

fn upload<T: Num>(s: &Arc<CudaStream>, xs: &[f64]) -> CudaSlice<T> {
    s.clone_htod(&xs.iter().map(|&x| T::from_f64(x)).collect::<Vec<_>>()).unwrap()
}

/// Reduce-scatter, all-gather, broadcast and reduce of `T`, every op and
/// root, at one element, an odd size, and sizes of several chunks, against
/// a CPU reference; outputs poisoned first; avg on an integer type refused.
fn check_collectives<T: Num>(comm: &Comm, seed: &mut u64) {
    let (me, n, s) = (comm.rank(), comm.size(), comm.stream());
    let chunk = comm.chunk_bytes() / T::DTYPE.size();
    if T::BITS.is_none() {
        let send = upload::<T>(s, &vec![1.0; n * 4]);
        let mut recv = upload::<T>(s, &[POISON; 4]);
        refuses_avg::<T>("reduce_scatter", comm.reduce_scatter(&send, &mut recv, ReduceOp::Avg));
        let send = upload::<T>(s, &[1.0; 4]);
        refuses_avg::<T>("reduce", comm.reduce(&send, &mut recv, ReduceOp::Avg, 0));
        assert_exact("recv after the refused calls", &s.clone_dtoh(&recv).unwrap(), |_| POISON);
    }
    for count in [1usize, 1001, 2 * chunk + 13] {
        // All-gather: c = count.
        *seed += 1;
        let ins = inputs(*seed, n, count, ReduceOp::Sum);
        let mut recv = upload::<T>(s, &vec![POISON; n * count]);
        comm.all_gather(&upload::<T>(s, &ins[me]), &mut recv).unwrap();
        assert_exact(&format!("all_gather of {count}"), &s.clone_dtoh(&recv).unwrap(), |i| ins[i / count][i % count]);
        // Broadcast from every root.
        for root in 0..n {
            *seed += 1;
            let ins = inputs(*seed, n, count, ReduceOp::Sum);
            let mut buf = upload::<T>(s, &ins[me]);
            comm.broadcast_in_place(&mut buf, root).unwrap();
            assert_exact(&format!("broadcast of {count} from {root}"), &s.clone_dtoh(&buf).unwrap(), |i| ins[root][i]);
        }
        for op in ops::<T>() {
            // Reduce-scatter: c = count, send n * count.
            *seed += 1;
            let ins = inputs(*seed, n, n * count, op);
            let mut recv = upload::<T>(s, &vec![POISON; count]);
            comm.reduce_scatter(&upload::<T>(s, &ins[me]), &mut recv, op).unwrap();
            assert_reduced(&format!("reduce_scatter of {count}"), op, &ins, me * count, &s.clone_dtoh(&recv).unwrap());
            // Reduce to each root; the others' recv untouched.
            for root in 0..n {
                *seed += 1;
                let ins = inputs(*seed, n, count, op);
                let mut recv = upload::<T>(s, &vec![POISON; count]);
                comm.reduce(&upload::<T>(s, &ins[me]), &mut recv, op, root).unwrap();
                let got = s.clone_dtoh(&recv).unwrap();
                let what = format!("reduce of {count} to {root}");
                if me == root {
                    assert_reduced(&what, op, &ins, 0, &got);
                } else {
                    assert_exact(&what, &got, |_| POISON);
                }
            }
        }
    }
}

/// A child's body of the collectives tests: a staging buffer of 1 MiB, so
/// that the larger sizes take several chunks.
fn collectives_child() {
    let opts = child_opts().buffer_bytes(1 << 20);
    let comm = child_comm(&opts);
    let mut seed = 1000;
    check_collectives::<f32>(&comm, &mut seed);
    check_collectives::<f64>(&comm, &mut seed);
    check_collectives::<f16>(&comm, &mut seed);
    check_collectives::<bf16>(&comm, &mut seed);
    check_collectives::<i32>(&comm, &mut seed);
    check_collectives::<i64>(&comm, &mut seed);
    check_collectives::<u32>(&comm, &mut seed);
    check_collectives::<u64>(&comm, &mut seed);
    check_collectives::<i8>(&comm, &mut seed);
    check_collectives::<u8>(&comm, &mut seed);
    comm.synchronize().unwrap();
    println!("rank {}: every collective, type and op right (chunks of {} bytes)", comm.rank(), comm.chunk_bytes());
}

const COLLECTIVES_LINE: &str = "every collective, type and op right";

#[test]
fn two_processes_every_collective_type_and_op() {
    if child() {
        return collectives_child();
    }
    processes("two_processes_every_collective_type_and_op", 2, Duration::from_secs(300), vec![], COLLECTIVES_LINE);
}

#[test]
fn three_processes_every_collective_type_and_op() {
    if child() {
        return collectives_child();
    }
    processes("three_processes_every_collective_type_and_op", 3, Duration::from_secs(400), vec![], COLLECTIVES_LINE);
}

/// The staged path between processes (shared pinned host memory), forced.
fn staged() -> Vec<(&'static str, String)> {
    vec![(STAGED, "1".into())]
}

#[test]
fn two_processes_staged_every_collective_type_and_op() {
    if child() {
        return collectives_child();
    }
    processes("two_processes_staged_every_collective_type_and_op", 2, Duration::from_secs(300), staged(), COLLECTIVES_LINE);
}

#[test]
fn two_processes_staged_all_reduce_every_type_and_op() {
    if child() {
        return all_reduce_child();
    }
    processes("two_processes_staged_all_reduce_every_type_and_op", 2, Duration::from_secs(300), staged(), ALL_REDUCE_LINE);
}

/// Every type and op through the two-shot between three processes, on
/// the P2P path and the staged one (sizes on every lane of the one-shot
/// and past it: the two-shot's chunks).
#[test]
fn three_processes_two_shot_all_reduce_every_type_and_op() {
    if child() {
        return all_reduce_child();
    }
    let test = "three_processes_two_shot_all_reduce_every_type_and_op";
    processes(test, 3, Duration::from_secs(400), vec![(TWO_SHOT, "1".into())], ALL_REDUCE_LINE);
    processes(test, 3, Duration::from_secs(400), [staged(), vec![(TWO_SHOT, "1".into())]].concat(), ALL_REDUCE_LINE);
}

#[test]
fn three_processes_staged_every_collective_type_and_op() {
    if child() {
        return collectives_child();
    }
    processes("three_processes_staged_every_collective_type_and_op", 3, Duration::from_secs(400), staged(), COLLECTIVES_LINE);
}

const GRAPH_LINE: &str = "graph replays right";

#[test]
fn two_processes_staged_replay_a_captured_graph() {
    if child() {
        return graph_child();
    }
    processes("two_processes_staged_replay_a_captured_graph", 2, Duration::from_secs(120), staged(), GRAPH_LINE);
}

/// A graph captured on each process's communicator stream (an all-reduce,
/// then an all-gather of its result), replayed on fresh inputs; then eager
/// calls, checked, on the same buffers.
fn graph_child() {
    let comm = child_comm(&child_opts());
    // SAFETY: the test orders its own work: everything runs on the
    // communicator's stream, so cudarc's events are not needed (a captured
    // stream may not wait for events recorded outside the capture).
    unsafe { comm.context().disable_event_tracking() };
    let (me, n, s) = (comm.rank(), comm.size(), comm.stream().clone());
    let count = 3000;
    let mut x = s.alloc_zeros::<u32>(count).unwrap();
    let mut g = s.alloc_zeros::<u32>(n * count).unwrap();
    // Eager first (the first use loads the kernels).
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
    comm.all_gather(&x, &mut g).unwrap();
    let graph = common::graph::capture(std::slice::from_ref(&s), || {
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum).and_then(|()| comm.all_gather(&x, &mut g))
    });
    for replay in 0..3u64 {
        let ins: Vec<Vec<u32>> = (0..n).map(|r| seeded(7000 + replay * 16 + r as u64, count)).collect();
        s.memcpy_htod(&ins[me], &mut x).unwrap();
        graph.launch().unwrap();
        comm.synchronize().unwrap();
        let want: Vec<u32> = (0..count).map(|i| ins.iter().fold(0u32, |a, v| a.wrapping_add(v[i]))).collect();
        assert_eq!(s.clone_dtoh(&x).unwrap(), want, "rank {me}: replay {replay}: all-reduce");
        assert_eq!(s.clone_dtoh(&g).unwrap(), want.repeat(n), "rank {me}: replay {replay}: all-gather");
    }
    // Eager calls still agree after the replays: a max of fresh inputs.
    let ins: Vec<Vec<u32>> = (0..n).map(|r| seeded(9000 + r as u64, count)).collect();
    s.memcpy_htod(&ins[me], &mut x).unwrap();
    comm.all_reduce_in_place(&mut x, ReduceOp::Max).unwrap();
    comm.synchronize().unwrap();
    let want: Vec<u32> = (0..count).map(|i| ins.iter().map(|v| v[i]).max().unwrap()).collect();
    assert_eq!(s.clone_dtoh(&x).unwrap(), want, "rank {me}: an eager max after the replays");
    println!("rank {me}: graph replays right");
}

#[test]
fn two_processes_replay_a_captured_graph() {
    if child() {
        return graph_child();
    }
    processes("two_processes_replay_a_captured_graph", 2, Duration::from_secs(120), vec![], GRAPH_LINE);
}

#[test]
fn three_processes_replay_a_captured_graph() {
    if child() {
        return graph_child();
    }
    processes("three_processes_replay_a_captured_graph", 3, Duration::from_secs(400), vec![], GRAPH_LINE);
}

/// A graph captured on the communicator's stream and replayed after every
/// rank has dropped its communicator: the graph keeps what its kernels
/// touch (the slots, flags and counters, the peers' memory as mapped here,
/// the kernels), so every replay is exact and no context dies.
fn graph_after_drop_child() {
    let comm = child_comm(&child_opts());
    // SAFETY: everything runs on the communicator's stream (see graph_child).
    unsafe { comm.context().disable_event_tracking() };
    let (me, n, s) = (comm.rank(), comm.size(), comm.stream().clone());
    let count = 3000;
    let mut x = s.alloc_zeros::<u32>(count).unwrap();
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
    let graph = common::graph::capture(std::slice::from_ref(&s), || comm.all_reduce_in_place(&mut x, ReduceOp::Sum));
    drop(comm);
    for replay in 0..3u64 {
        let ins: Vec<Vec<u32>> = (0..n).map(|r| seeded(7100 + replay * 16 + r as u64, count)).collect();
        s.memcpy_htod(&ins[me], &mut x).unwrap();
        graph.launch().unwrap();
        s.synchronize().unwrap();
        let want: Vec<u32> = (0..count).map(|i| ins.iter().fold(0u32, |a, v| a.wrapping_add(v[i]))).collect();
        assert_eq!(s.clone_dtoh(&x).unwrap(), want, "rank {me}: replay {replay} after the communicator was dropped");
    }
    println!("rank {me}: graph replays after the drop right");
}

#[test]
fn two_processes_replay_a_graph_after_the_comm_is_dropped() {
    if child() {
        return graph_after_drop_child();
    }
    processes("two_processes_replay_a_graph_after_the_comm_is_dropped", 2, Duration::from_secs(120), vec![], "graph replays after the drop right");
}

#[test]
fn two_processes_staged_replay_a_graph_after_the_comm_is_dropped() {
    if child() {
        return graph_after_drop_child();
    }
    processes(
        "two_processes_staged_replay_a_graph_after_the_comm_is_dropped",
        2,
        Duration::from_secs(120),
        staged(),
        "graph replays after the drop right",
    );
}

/// The exchange is usable by the caller after creation, and ranks agree.
#[test]
fn the_exchange_serves_the_caller() {
    if child() {
        let comm = Comm::from_env(&CommOptions::default().share_devices(shared())).unwrap();
        let all = comm.exchange().all_gather(&[comm.rank() as u8]).unwrap();
        assert_eq!(all, (0..comm.size()).map(|r| vec![r as u8]).collect::<Vec<_>>());
        return println!("rank {}: the exchange right", comm.rank());
    }
    processes("the_exchange_serves_the_caller", 2, Duration::from_secs(120), vec![], "the exchange right");
}

// ---- CPU self-checks (no GPU) ----

/// The comparison the children use (`num::accepts`, through
/// `assert_reduced`) takes every right result of the kernels' orders and
/// rejects, on every element, a rank dropped and an average divided by
/// `n - 1`, on this file's inputs, for every type and 2 to 8 ranks.
#[test]
fn the_comparison_rejects_a_dropped_rank_and_avg_by_n_minus_1() {
    fn for_type<T: Num>() {
        let count = 500;
        for n in 2..=8 {
            for op in ops::<T>().into_iter().filter(|&op| matches!(op, ReduceOp::Sum | ReduceOp::Avg)) {
                let ins = inputs(n as u64 * 31 + 5, n, count, op);
                let column = |i: usize| -> Vec<T> { ins.iter().map(|x| T::from_f64(x[i])).collect() };
                let what = |case: &str| format!("{} {op:?} n={n}: {case}", T::DTYPE.name());
                for i in 0..count {
                    for (name, got) in num::right_results(op, &column(i), i % n) {
                        assert!(num::accepts_at(op, &ins, i, got), "{}: [{i}] = {got:?} rejected", what(name));
                    }
                    let defects = num::planted_defects(op, &column(i), i % n);
                    assert!(!defects.is_empty());
                    for (name, got) in defects {
                        assert!(!num::accepts_at(op, &ins, i, got), "{}: [{i}] = {got:?} accepted", what(name));
                    }
                }
            }
        }
    }
    for_type::<f32>();
    for_type::<f64>();
    for_type::<f16>();
    for_type::<bf16>();
    for_type::<i32>();
    for_type::<u8>();
}

/// A child of the harness self-check below: prints its line and passes,
/// or (as `CUDA_PEER_MP_PROBE` asks) panics, or ends its process itself.
const PROBE: &str = "CUDA_PEER_MP_PROBE";

/// The harness (`common::procs`) takes a child that ran its test and
/// printed its line, and refuses one that ran no test (a name that matches
/// none: libtest runs nothing and exits 0), printed another line, failed,
/// or ended its process where it should have passed. No GPU needed.
#[test]
fn the_harness_requires_each_child_to_run_its_test_and_print_its_line() {
    let name = "the_harness_requires_each_child_to_run_its_test_and_print_its_line";
    if child() {
        match std::env::var(PROBE).as_deref() {
            Ok("panic") => panic!("rank {}: a planted failure", rank()),
            Ok("exit") => {
                println!("rank {}: probe right", rank());
                std::process::exit(0);
            }
            _ => return println!("rank {}: probe right", rank()),
        }
    }
    let deadline = Duration::from_secs(60);
    let good = spawn(name, 2, deadline, |_| vec![]);
    all_succeeded(name, &good, passes("probe right"));
    let fails = |results: &[(Option<i32>, String)], test: &str, end: End| -> String {
        let (code, out) = &results[0];
        procs::failure(test, *code, out, &end).unwrap_or_else(|| panic!("{test}: the harness took a planted failure ({end:?}); its output:\n{out}"))
    };
    let line = End::Passes("rank 0: probe right".into());
    let why = fails(&good, name, End::Passes("rank 0: another line".into()));
    assert!(why.contains("never printed"), "{why}");
    let none = "no_test_has_this_name";
    let why = fails(&spawn(none, 1, deadline, |_| vec![]), none, line.clone());
    assert!(why.contains("did not run exactly one test"), "{why}");
    let why = fails(&spawn(name, 1, deadline, |_| vec![(PROBE, "panic".into())]), name, line.clone());
    assert!(why.contains("exited with Some(101)"), "{why}");
    let exited = spawn(name, 1, deadline, |_| vec![(PROBE, "exit".into())]);
    let why = fails(&exited, name, line);
    assert!(why.contains("test result: ok. 1 passed"), "{why}");
    all_succeeded(name, &exited, |r| End::Exits(format!("rank {r}: probe right")));
}

/// A graph of an all-reduce captured on the communicator's stream, then
/// replayed on another stream of the caller's with nothing ordering the
/// two streams, between eager all-reduces on the communicator's stream, a
/// replay and an eager call each round, no host synchronisation until the
/// end: every result is exact, because each rank's calls and replays run in
/// the order the host issued them (`ipc::comm::calls`). Before, a replay
/// and an eager call ran at once on one rank's slots (the docs asked the
/// caller to order them). Each round's inputs are fresh and the results
/// are copied out on the stream that made them.
fn unordered_replays_child() {
    let comm = child_comm(&child_opts());
    // SAFETY: the test orders its own buffers (each on the stream that
    // writes and reads it, synchronised at the end); a captured stream may
    // not wait for events recorded outside the capture.
    unsafe { comm.context().disable_event_tracking() };
    let (me, n, s) = (comm.rank(), comm.size(), comm.stream().clone());
    let other = comm.context().new_stream().unwrap();
    let (count, rounds) = (3001, 24u64);
    let mut x = s.alloc_zeros::<u32>(count).unwrap();
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
    let graph = common::graph::capture(std::slice::from_ref(&s), || comm.all_reduce_in_place(&mut x, ReduceOp::Sum));
    let ins = |seed: u64| -> Vec<Vec<u32>> { (0..n).map(|r| seeded(seed * 16 + r as u64, count)).collect() };
    let sum = |xs: &[Vec<u32>]| -> Vec<u32> { (0..count).map(|i| xs.iter().fold(0u32, |a, v| a.wrapping_add(v[i]))).collect() };
    // Every round's inputs on the device first (then synchronised).
    let replay_in: Vec<CudaSlice<u32>> = (0..rounds).map(|k| s.clone_htod(&ins(8000 + k)[me]).unwrap()).collect();
    let mut eager: Vec<CudaSlice<u32>> = (0..rounds).map(|k| s.clone_htod(&ins(8500 + k)[me]).unwrap()).collect();
    let mut replay_out: Vec<CudaSlice<u32>> = (0..rounds).map(|_| s.alloc_zeros::<u32>(count).unwrap()).collect();
    s.synchronize().unwrap();
    for k in 0..rounds as usize {
        // The replay's input into the captured buffer, the replay and its
        // result out, all on `other`.
        other.memcpy_dtod(&replay_in[k], &mut x).unwrap();
        // SAFETY: a live executable graph of this context, launched on a
        // live stream of it.
        unsafe { cuda_peer::cudarc::driver::result::graph::launch(graph.cu_graph_exec(), other.cu_stream()) }.unwrap();
        other.memcpy_dtod(&x, &mut replay_out[k]).unwrap();
        comm.all_reduce_in_place(&mut eager[k], ReduceOp::Sum).unwrap();
    }
    other.synchronize().unwrap();
    comm.synchronize().unwrap();
    for k in 0..rounds as usize {
        assert_eq!(s.clone_dtoh(&replay_out[k]).unwrap(), sum(&ins(8000 + k as u64)), "rank {me}: round {k}: the replay on another stream");
        assert_eq!(s.clone_dtoh(&eager[k]).unwrap(), sum(&ins(8500 + k as u64)), "rank {me}: round {k}: the eager call between replays");
    }
    println!("rank {me}: replays on another stream ordered with eager calls");
}

/// One rank of [`two_processes_capture_reaching_the_comm_through_its_buffers`]:
/// with cudarc's event tracking on, a capture begun on a stream of this
/// rank's own reaches the communicator's stream through the buffers (it
/// waits for their writers, recorded under the capture) and joins back
/// through them; the capture ends, and three replays on fresh inputs are
/// exact.
fn capture_through_buffers_child() {
    let comm = child_comm(&child_opts());
    let (me, n) = (comm.rank(), comm.size());
    let c = comm.context().new_stream().unwrap();
    let count = 3001;
    // SAFETY: every replay writes `src` (before its launch) and `send`,
    // `recv` and `out` (in the graph) before reading them; nothing is
    // recorded on them before the capture.
    let alloc = || unsafe { c.alloc::<u32>(count) }.unwrap();
    let (mut src, mut send, mut recv, mut out) = (alloc(), alloc(), alloc(), alloc());
    let graph = common::graph::try_capture(std::slice::from_ref(&c), || {
        c.memcpy_dtod(&src, &mut send).map_err(|e| format!("copy in: {e:?}"))?;
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum).map_err(|e| format!("all_reduce under the capture: {e}"))?;
        c.memcpy_dtod(&recv, &mut out).map_err(|e| format!("copy out: {e:?}"))
    })
    .unwrap_or_else(|e| panic!("rank {me}: {e}"));
    // SAFETY: from here on the test orders its own work: uploads and
    // launches on `c`, a synchronisation before each read.
    unsafe { comm.context().disable_event_tracking() };
    let sum = |xs: &[Vec<u32>]| -> Vec<u32> { (0..count).map(|i| xs.iter().fold(0u32, |a, v| a.wrapping_add(v[i]))).collect() };
    for round in 0..3u64 {
        let ins: Vec<Vec<u32>> = (0..n).map(|r| seeded(9000 + round * 16 + r as u64, count)).collect();
        c.memcpy_htod(&ins[me], &mut src).unwrap();
        c.memcpy_htod(&vec![0xDEAD_BEEFu32; count], &mut out).unwrap();
        graph.launch().unwrap();
        c.synchronize().unwrap();
        assert_eq!(c.clone_dtoh(&out).unwrap(), sum(&ins), "rank {me}: replay {round}");
    }
    println!("rank {me}: a capture reaching the communicator through its buffers");
}

/// A capture that reaches the communicator's stream only through the
/// buffers' events (cudarc's event tracking on), and joins back through
/// them: the call's place in the order of calls is recorded before the
/// buffers' events, so the capture ends (before, its record was left
/// unjoined), and the replays are exact. Two processes (they share the
/// GPU where there is one).
#[test]
fn two_processes_capture_reaching_the_comm_through_its_buffers() {
    if child() {
        return capture_through_buffers_child();
    }
    let name = "two_processes_capture_reaching_the_comm_through_its_buffers";
    processes(name, 2, Duration::from_secs(180), vec![], "a capture reaching the communicator through its buffers");
}

#[test]
fn two_processes_replays_on_another_stream_are_ordered_with_eager_calls() {
    if child() {
        return unordered_replays_child();
    }
    let name = "two_processes_replays_on_another_stream_are_ordered_with_eager_calls";
    processes(name, 2, Duration::from_secs(180), vec![], "replays on another stream ordered with eager calls");
}
