//! One process per GPU, on the GPU: each test re-executes this test binary
//! as N children (filtered to itself, with torchrun's variables and
//! `CUDA_PEER_MP_CHILD` set), which create a `Comm` and check their results
//! against a CPU reference; the parent checks that every child succeeded in
//! time. Skipped (a `SKIPPED <name>` line) with fewer GPUs than needed.
#![cfg(target_os = "linux")]

mod common;

use common::num::Num;
use common::procs::{all_succeeded, child, rank, spawn};

use cuda_peer::cudarc::driver::CudaStream;
use cuda_peer::ipc::{comm::seeded, Bootstrap, Comm, CommOptions};
use cuda_peer::{Error, Path, PathPolicy, ReduceOp};
use half::{bf16, f16};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Set in a child: ranks share the GPUs (more processes than devices).
const SHARE: &str = "CUDA_PEER_MP_SHARE";

/// Set in a child: the staged path (shared host memory), forced.
const STAGED: &str = "CUDA_PEER_MP_STAGED";

/// The children's options: `share_devices` and the staged path where the
/// parent asked.
fn child_opts() -> CommOptions {
    let path = if std::env::var_os(STAGED).is_some() { PathPolicy::StagedOnly } else { PathPolicy::Auto };
    CommOptions::default().timeout(Duration::from_secs(30)).share_devices(std::env::var_os(SHARE).is_some()).path(path)
}

/// The communicator of a child, on the path the parent asked for.
fn child_comm(opts: &CommOptions) -> Comm {
    let comm = Comm::from_env(opts).unwrap();
    let want = if opts.path == PathPolicy::StagedOnly { Path::Staged } else { Path::P2p };
    assert_eq!(comm.path(), want, "rank {}", comm.rank());
    comm
}

/// Runs test `name` as three processes: on fewer than three GPUs, two of
/// them share a device (`CommOptions::share_devices`).
fn three_processes(name: &str) {
    three_processes_with(name, vec![]);
}

/// As [`three_processes`], with `env` set in every child.
fn three_processes_with(name: &str, env: Vec<(&'static str, String)>) {
    let Some(gpus) = gpu_count(name, 2) else {
        return;
    };
    let mut share = env;
    if gpus < 3 {
        share.push((SHARE, "1".into()));
    }
    if gpus < 3 {
        eprintln!("{name}: {gpus} GPUs: ranks 0 and 2 share device 0");
    }
    all_succeeded(name, &spawn(name, 3, Duration::from_secs(400), |_| share.clone()));
}

fn gpu_count(test: &str, min: usize) -> Option<usize> {
    common::gpus(test, min).map(|g| g.len())
}

/// Rank r's input: small non-negative integers (1..=5), so that every
/// reduction of up to 8 ranks is exact in every type except Avg's division.
fn inputs(seed: u64, n: usize, count: usize) -> Vec<Vec<f64>> {
    (0..n).map(|r| seeded(seed * 16 + r as u64, count).into_iter().map(|x| (x % 5 + 1) as f64).collect()).collect()
}

fn reference(op: ReduceOp, ins: &[Vec<f64>], i: usize) -> f64 {
    let xs = ins.iter().map(|x| x[i]);
    match op {
        ReduceOp::Sum => xs.sum(),
        ReduceOp::Prod => xs.product(),
        ReduceOp::Min => xs.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => xs.fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Avg => xs.sum::<f64>() / ins.len() as f64,
    }
}

/// Every op on `T`, in place and out of place, at sizes on the small, the
/// middle and the large lane, and over several rounds of the large lane.
fn check_type<T: Num>(comm: &Comm, stream: &Arc<CudaStream>, seed: &mut u64) {
    let n = comm.size();
    // Two rounds and a bit of the large lane's slots (32 MiB: four sets of one slot per rank).
    let big = (32usize << 20) / (4 * n) / T::DTYPE.size() * 2 + 7;
    for op in ReduceOp::ALL {
        if op.check(T::DTYPE).is_err() {
            continue;
        }
        for count in [1usize, 1000, 70_000 / T::DTYPE.size() * 4 + 3, big] {
            *seed += 1;
            let ins = inputs(*seed, n, count);
            let host: Vec<T> = ins[comm.rank()].iter().map(|&x| T::from_f64(x)).collect();
            let send = stream.clone_htod(&host).unwrap();
            let mut recv = stream.clone_htod(&vec![T::from_f64(0.0); count]).unwrap();
            comm.all_reduce(&send, &mut recv, op).unwrap();
            let mut inplace = stream.clone_htod(&host).unwrap();
            comm.all_reduce_in_place(&mut inplace, op).unwrap();
            for (what, buf) in [("out of place", &recv), ("in place", &inplace)] {
                let got = stream.clone_dtoh(buf).unwrap();
                for (i, g) in got.iter().enumerate() {
                    let want = T::from_f64(reference(op, &ins, i)).to_f64();
                    let tol = if op == ReduceOp::Avg { 1e-2 * want.abs().max(1.0) } else { 0.0 };
                    assert!((g.to_f64() - want).abs() <= tol, "{} {op:?} {what}, {count} elements: [{i}] = {g:?}, expected {want}", T::DTYPE.name());
                }
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

#[test]
fn two_processes_all_reduce_every_type_and_op() {
    if child() {
        return all_reduce_child();
    }
    let name = "two_processes_all_reduce_every_type_and_op";
    if gpu_count(name, 2).is_none() {
        return;
    }
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(300), |_| vec![]));
}

#[test]
fn three_processes_all_reduce_every_type_and_op() {
    if child() {
        return all_reduce_child();
    }
    let name = "three_processes_all_reduce_every_type_and_op";
    three_processes(name);
}

#[test]
fn two_ranks_on_one_device_are_a_typed_error() {
    if child() {
        let rv = Bootstrap::from_env().unwrap().with_timeout(Duration::from_secs(30)).connect().unwrap();
        match Comm::new(Box::new(rv), 0, &CommOptions::default()) {
            Err(Error::Unsupported(m)) if m.contains("same device") => return,
            other => panic!("rank {}: expected Error::Unsupported (same device), got {other:?}", rank()),
        }
    }
    let name = "two_ranks_on_one_device_are_a_typed_error";
    if gpu_count(name, 2).is_none() {
        return;
    }
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(120), |_| vec![]));
}

#[test]
fn a_peer_that_exits_at_creation_fails_the_survivor_in_time() {
    if child() {
        if rank() == 1 {
            // Meets rank 0, then dies before creating the communicator.
            let rv = Bootstrap::from_env().unwrap().connect().unwrap();
            drop(rv);
            std::process::exit(0);
        }
        let start = Instant::now();
        let r = Comm::from_env(&CommOptions::default().timeout(Duration::from_secs(10)));
        assert!(r.is_err(), "rank 0 created a communicator without its peer");
        assert!(start.elapsed() < Duration::from_secs(30), "took {:?}", start.elapsed());
        println!("rank 0: {:?} after {:?}", r.err(), start.elapsed());
        return;
    }
    let name = "a_peer_that_exits_at_creation_fails_the_survivor_in_time";
    if gpu_count(name, 2).is_none() {
        return;
    }
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(120), |_| vec![]));
}

#[test]
fn a_peer_that_never_starts_is_a_timeout() {
    if child() {
        let start = Instant::now();
        let r = Bootstrap::from_env().unwrap().with_timeout(Duration::from_secs(3)).connect();
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        assert!(start.elapsed() < Duration::from_secs(20));
        return;
    }
    let name = "a_peer_that_never_starts_is_a_timeout";
    if gpu_count(name, 2).is_none() {
        return;
    }
    // One child of a world of two.
    let results = spawn(name, 1, Duration::from_secs(60), |_| vec![("WORLD_SIZE", "2".into()), ("LOCAL_WORLD_SIZE", "2".into())]);
    all_succeeded(name, &results);
}

#[test]
fn a_peer_that_exits_after_creation_fails_the_next_checked_call() {
    if child() {
        let opts = CommOptions::default().timeout(Duration::from_secs(30)).barrier_timeout(Duration::from_secs(2));
        let comm = Comm::from_env(&opts).unwrap();
        let mut x = comm.stream().clone_htod(&[1.0f32; 1000]).unwrap();
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
        comm.synchronize().unwrap();
        if comm.rank() == 1 {
            std::process::exit(0);
        }
        std::thread::sleep(Duration::from_millis(500));
        let start = Instant::now();
        // The peer never publishes its call: a timeout before anything is enqueued.
        let r = comm.all_reduce_in_place(&mut x, ReduceOp::Sum);
        println!("rank 0: {r:?} after {:?}", start.elapsed());
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
        // The communicator failed: later calls are refused at once.
        let mut y = comm.stream().clone_htod(&[1u8; 10]).unwrap();
        let again = comm.broadcast(&mut y, 0);
        assert!(matches!(again, Err(Error::Timeout { .. })), "{again:?}");
        std::process::exit(0); // the peer is gone: no collective drop
    }
    let name = "a_peer_that_exits_after_creation_fails_the_next_checked_call";
    if gpu_count(name, 2).is_none() {
        return;
    }
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(120), |_| vec![]));
}

/// Without the per-call check, the survivor's kernel waits for the dead
/// peer's flags until its barrier timeout, then gives up cleanly: the next
/// synchronization reports `PeerTimeout`, later calls are refused, and the
/// context still works.
#[test]
fn a_peer_that_exits_after_creation_times_out_an_unchecked_call() {
    if child() {
        let opts = CommOptions::default().timeout(Duration::from_secs(30)).barrier_timeout(Duration::from_millis(500)).check_calls(false);
        let comm = Comm::from_env(&opts).unwrap();
        comm.exchange().barrier().unwrap();
        if comm.rank() == 1 {
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
        std::process::exit(0); // the peer is gone: no collective drop
    }
    let name = "a_peer_that_exits_after_creation_times_out_an_unchecked_call";
    if gpu_count(name, 2).is_none() {
        return;
    }
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(120), |_| vec![]));
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
    let r = if me == 0 { comm.broadcast(&mut b, 0) } else { comm.all_reduce_in_place(&mut b, ReduceOp::Max) };
    expect_mismatch("collectives", r);
    // Different roots.
    expect_mismatch("roots", comm.broadcast(&mut b, me));
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

#[test]
fn mismatched_calls_are_an_error_on_every_rank_then_the_comm_works() {
    if child() {
        return mismatch_child();
    }
    let name = "mismatched_calls_are_an_error_on_every_rank_then_the_comm_works";
    if gpu_count(name, 2).is_none() {
        return;
    }
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(120), |_| vec![]));
}

#[test]
fn three_processes_mismatched_calls_are_an_error_on_every_rank() {
    if child() {
        return mismatch_child();
    }
    three_processes("three_processes_mismatched_calls_are_an_error_on_every_rank");
}

/// The value that poisons outputs (the inputs are 1..=5).
const POISON: f64 = 99.0;

fn upload<T: Num>(s: &Arc<CudaStream>, xs: &[f64]) -> cuda_peer::cudarc::driver::CudaSlice<T> {
    s.clone_htod(&xs.iter().map(|&x| T::from_f64(x)).collect::<Vec<_>>()).unwrap()
}

fn assert_close<T: Num>(what: &str, got: &[T], want: impl Fn(usize) -> f64, tol: f64) {
    for (i, g) in got.iter().enumerate() {
        let w = T::from_f64(want(i)).to_f64();
        assert!((g.to_f64() - w).abs() <= tol * w.abs().max(1.0), "rank {}: {} {what}: [{i}] = {g:?}, expected {w}", rank(), T::DTYPE.name());
    }
}

/// Reduce-scatter, all-gather, broadcast and reduce of `T`, every op and
/// root, at one element, an odd size, and sizes of several chunks, against
/// a CPU reference; outputs poisoned first.
fn check_collectives<T: Num>(comm: &Comm, seed: &mut u64) {
    let (me, n, s) = (comm.rank(), comm.size(), comm.stream());
    let chunk = comm.chunk_bytes() / T::DTYPE.size();
    for count in [1usize, 1001, 2 * chunk + 13] {
        // All-gather: c = count.
        *seed += 1;
        let ins = inputs(*seed, n, count);
        let mut recv = upload::<T>(s, &vec![POISON; n * count]);
        comm.all_gather(&upload::<T>(s, &ins[me]), &mut recv).unwrap();
        assert_close(&format!("all_gather of {count}"), &s.clone_dtoh(&recv).unwrap(), |i| ins[i / count][i % count], 0.0);
        // Broadcast from every root.
        for root in 0..n {
            *seed += 1;
            let ins = inputs(*seed, n, count);
            let mut buf = upload::<T>(s, &ins[me]);
            comm.broadcast(&mut buf, root).unwrap();
            assert_close(&format!("broadcast of {count} from {root}"), &s.clone_dtoh(&buf).unwrap(), |i| ins[root][i], 0.0);
        }
        for op in ReduceOp::ALL {
            if op.check(T::DTYPE).is_err() {
                continue;
            }
            let tol = if op == ReduceOp::Avg { 1e-2 } else { 0.0 };
            // Reduce-scatter: c = count, send n * count.
            *seed += 1;
            let ins = inputs(*seed, n, n * count);
            let mut recv = upload::<T>(s, &vec![POISON; count]);
            comm.reduce_scatter(&upload::<T>(s, &ins[me]), &mut recv, op).unwrap();
            let what = format!("reduce_scatter {op:?} of {count}");
            assert_close(&what, &s.clone_dtoh(&recv).unwrap(), |i| reference(op, &ins, me * count + i), tol);
            // Reduce to each root; the others' recv untouched.
            for root in 0..n {
                *seed += 1;
                let ins = inputs(*seed, n, count);
                let mut recv = upload::<T>(s, &vec![POISON; count]);
                comm.reduce(&upload::<T>(s, &ins[me]), &mut recv, root, op).unwrap();
                let got = s.clone_dtoh(&recv).unwrap();
                let what = format!("reduce {op:?} of {count} to {root}");
                if me == root {
                    assert_close(&what, &got, |i| reference(op, &ins, i), tol);
                } else {
                    assert_close(&what, &got, |_| POISON, 0.0);
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

#[test]
fn two_processes_every_collective_type_and_op() {
    if child() {
        return collectives_child();
    }
    let name = "two_processes_every_collective_type_and_op";
    if gpu_count(name, 2).is_none() {
        return;
    }
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(300), |_| vec![]));
}

#[test]
fn three_processes_every_collective_type_and_op() {
    if child() {
        return collectives_child();
    }
    let name = "three_processes_every_collective_type_and_op";
    three_processes(name);
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
    let name = "two_processes_staged_every_collective_type_and_op";
    if gpu_count(name, 2).is_none() {
        return;
    }
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(300), |_| staged()));
}

#[test]
fn two_processes_staged_all_reduce_every_type_and_op() {
    if child() {
        return all_reduce_child();
    }
    let name = "two_processes_staged_all_reduce_every_type_and_op";
    if gpu_count(name, 2).is_none() {
        return;
    }
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(300), |_| staged()));
}

#[test]
fn three_processes_staged_every_collective_type_and_op() {
    if child() {
        return collectives_child();
    }
    three_processes_with("three_processes_staged_every_collective_type_and_op", staged());
}

#[test]
fn two_processes_staged_replay_a_captured_graph() {
    if child() {
        return graph_child();
    }
    let name = "two_processes_staged_replay_a_captured_graph";
    if gpu_count(name, 2).is_none() {
        return;
    }
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(120), |_| staged()));
}

/// A graph captured on each process's communicator stream (an all-reduce,
/// then an all-gather of its result), replayed on fresh inputs.
fn graph_child() {
    use cuda_peer::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
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
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    let captured = comm.all_reduce_in_place(&mut x, ReduceOp::Sum).and_then(|()| comm.all_gather(&x, &mut g));
    let graph = s.end_capture(CUgraphInstantiate_flags(0));
    captured.unwrap();
    let graph = graph.unwrap().expect("a non-empty graph");
    for replay in 0..3u64 {
        let ins: Vec<Vec<u32>> = (0..n).map(|r| seeded(7000 + replay * 16 + r as u64, count)).collect();
        s.memcpy_htod(&ins[me], &mut x).unwrap();
        graph.launch().unwrap();
        comm.synchronize().unwrap();
        let want: Vec<u32> = (0..count).map(|i| ins.iter().fold(0u32, |a, v| a.wrapping_add(v[i]))).collect();
        assert_eq!(s.clone_dtoh(&x).unwrap(), want, "rank {me}: replay {replay}: all-reduce");
        assert_eq!(s.clone_dtoh(&g).unwrap(), want.repeat(n), "rank {me}: replay {replay}: all-gather");
    }
    // Eager calls still agree after the replays.
    comm.all_reduce_in_place(&mut x, ReduceOp::Max).unwrap();
    comm.synchronize().unwrap();
    println!("rank {me}: graph replays right");
}

#[test]
fn two_processes_replay_a_captured_graph() {
    if child() {
        return graph_child();
    }
    let name = "two_processes_replay_a_captured_graph";
    if gpu_count(name, 2).is_none() {
        return;
    }
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(120), |_| vec![]));
}

#[test]
fn three_processes_replay_a_captured_graph() {
    if child() {
        return graph_child();
    }
    three_processes("three_processes_replay_a_captured_graph");
}

/// The exchange is usable by the caller after creation, and ranks agree.
#[test]
fn the_exchange_serves_the_caller() {
    if child() {
        let comm = Comm::from_env(&CommOptions::default()).unwrap();
        let all = comm.exchange().all_gather(&[comm.rank() as u8]).unwrap();
        assert_eq!(all, (0..comm.size()).map(|r| vec![r as u8]).collect::<Vec<_>>());
        return;
    }
    let name = "the_exchange_serves_the_caller";
    if gpu_count(name, 2).is_none() {
        return;
    }
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(120), |_| vec![]));
}
