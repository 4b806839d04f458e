//! Ranks on several hosts, simulated on one machine: each child process
//! gets its own host identity (`CUDA_PEER_HOST_ID`) and NCCL is forced onto
//! its socket transport (`NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`), as
//! between two hosts. Every collective of [`NcclComm`] is checked against a
//! CPU reference on fresh random data; a peer that dies mid-job fails the
//! survivor in bounded time with its context still usable. Integers, and
//! float results whose partial results are all exact, match exactly; float
//! averages lie within `common::num`'s per-element bound. The parent checks
//! that every child ran its test and printed its result line
//! (`common::procs`). Skipped (a `SKIPPED <name>` line) with fewer than
//! two GPUs (NCCL takes one device per rank), but for NCCL's refusal of two
//! ranks on one GPU, which needs one; a missing GPU or NCCL library
//! fails the test only under `CUDA_PEER_REQUIRE_GPU=1`.
#![cfg(target_os = "linux")]

mod common;

use common::num::{self, Num};
use common::procs::{all_succeeded, child, passes, rank, spawn, End};
use cuda_peer::comm::Engine;
use cuda_peer::cudarc::driver::CudaStream;
use cuda_peer::ipc::{comm::seeded, nccl::nccl_version, spans_hosts, Bootstrap, CommOptions, NcclComm};
use cuda_peer::{Collectives, Comm, Error, ReduceOp};
use half::{bf16, f16};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SEED: &str = "CUDA_PEER_TEST_SEED";

/// The environment of rank r on simulated hosts of `per_host` ranks each:
/// its host's identity and its place there, NCCL on sockets.
fn hosts_env(r: usize, per_host: usize, seed: u64) -> Vec<(&'static str, String)> {
    vec![
        ("CUDA_PEER_HOST_ID", format!("simulated-host-{}", r / per_host)),
        ("LOCAL_RANK", (r % per_host).to_string()),
        ("LOCAL_WORLD_SIZE", per_host.to_string()),
        ("NCCL_P2P_DISABLE", "1".into()),
        ("NCCL_SHM_DISABLE", "1".into()),
        ("NCCL_NVLS_ENABLE", "0".into()),
        ("NCCL_SOCKET_IFNAME", "lo".into()),
        (SEED, seed.to_string()),
    ]
}

/// One simulated host per rank.
fn host_env(r: usize, seed: u64) -> Vec<(&'static str, String)> {
    hosts_env(r, 1, seed)
}

/// `gpus` GPUs and an NCCL library, or `false` after saying why the test
/// skips.
fn ready(test: &str, gpus: usize) -> bool {
    if common::gpu_count(test, gpus).is_none() {
        return false;
    }
    match nccl_version() {
        Ok(v) => {
            eprintln!("{test}: NCCL {v}");
            true
        }
        Err(e) if common::required() => panic!("{test}: CUDA_PEER_REQUIRE_GPU=1 but NCCL cannot be loaded: {e}"),
        Err(e) => {
            common::skipped(test, format!("NCCL cannot be loaded: {e}"));
            false
        }
    }
}

fn seed() -> u64 {
    std::env::var(SEED).ok().and_then(|s| s.parse().ok()).unwrap_or(1)
}

/// A child's communicator: one simulated host per rank, one GPU each.
fn open() -> NcclComm {
    let rv = Bootstrap::from_env().unwrap().with_timeout(Duration::from_secs(60)).connect().unwrap();
    assert!(spans_hosts(&rv).unwrap(), "rank {}: the simulated hosts were not told apart", rank());
    NcclComm::new(&rv, rank(), Duration::from_secs(20)).unwrap()
}

/// A child's `Comm` on simulated hosts of `per_host` ranks: the
/// ranks' devices alternate so that no host, and no NCCL group across
/// hosts, has one GPU twice (device = (local rank + host) mod 2).
fn open_world(per_host: usize) -> Comm {
    let r = rank();
    let device = (r % per_host + r / per_host) % 2;
    let rv = Bootstrap::from_env().unwrap().with_timeout(Duration::from_secs(60)).connect().unwrap();
    let opts = CommOptions::default().timeout(Duration::from_secs(60)).barrier_timeout(Duration::from_secs(20));
    let stream = cuda_peer::driver::context(device).unwrap().new_stream().unwrap();
    Comm::from_exchange(stream, Box::new(rv), &opts).unwrap()
}

/// Every rank's input for call `call` of `op`: small integers
/// (`num::small_input`), exact in every reduction but avg's division.
fn inputs<T: Num>(call: u64, n: usize, count: usize, op: ReduceOp) -> Vec<Vec<T>> {
    (0..n)
        .map(|r| seeded(seed() * 1000 + call * 16 + r as u64, count).into_iter().map(|x| T::from_f64(num::small_input(op, x as u64))).collect())
        .collect()
}

fn poison<T: Num>(stream: &Arc<CudaStream>, count: usize) -> cuda_peer::cudarc::driver::CudaSlice<T> {
    stream.clone_htod(&vec![T::from_f64(77.0); count]).unwrap()
}

/// Asserts that `got[i]` is right for `op` over element `offset + i` of
/// every rank's inputs: exactly for integers (and exact float results),
/// within `num::float_bound` otherwise.
fn assert_reduced<T: Num>(what: &str, op: ReduceOp, ins: &[Vec<T>], offset: usize, got: &[T]) {
    let ins: Vec<Vec<f64>> = ins.iter().map(|x| x[offset..offset + got.len()].iter().map(|v| v.to_f64()).collect()).collect();
    if let Some(i) = (0..got.len()).find(|&i| !num::accepts_at(op, &ins, i, got[i])) {
        let xs: Vec<f64> = ins.iter().map(|x| x[i]).collect();
        let bound = T::BITS.map_or(0.0, |b| num::float_bound(op, &xs, b));
        panic!("{what} {}: [{i}] = {:?}, expected {} (within {bound:e}) from {xs:?}", T::DTYPE.name(), got[i], num::reference(op, &xs));
    }
}

/// Every collective on `T` with `op`, at an odd count; returns the next call number.
fn check_all<C: Collectives, T: Num>(comm: &C, op: ReduceOp, mut call: u64) -> u64 {
    let (n, r, s) = (comm.world_size(), comm.rank(), comm.stream().clone());
    let count = 4099;
    // all-reduce, out of place and in place
    call += 1;
    let ins = inputs::<T>(call, n, count, op);
    let send = s.clone_htod(&ins[r]).unwrap();
    let mut recv = poison::<T>(&s, count);
    comm.all_reduce(&send, &mut recv, op).unwrap();
    let mut inplace = s.clone_htod(&ins[r]).unwrap();
    comm.all_reduce_in_place(&mut inplace, op).unwrap();
    comm.synchronize().unwrap();
    assert_reduced::<T>(&format!("all_reduce {op:?}"), op, &ins, 0, &s.clone_dtoh(&recv).unwrap());
    assert_reduced::<T>(&format!("all_reduce_in_place {op:?}"), op, &ins, 0, &s.clone_dtoh(&inplace).unwrap());
    assert_eq!(s.clone_dtoh(&send).unwrap(), ins[r], "all_reduce changed its input");

    // reduce-scatter
    call += 1;
    let ins = inputs::<T>(call, n, count * n, op);
    let send = s.clone_htod(&ins[r]).unwrap();
    let mut recv = poison::<T>(&s, count);
    comm.reduce_scatter(&send, &mut recv, op).unwrap();
    comm.synchronize().unwrap();
    assert_reduced::<T>(&format!("reduce_scatter {op:?}"), op, &ins, r * count, &s.clone_dtoh(&recv).unwrap());

    // reduce to the last rank (the root is not rank 0)
    call += 1;
    let root = n - 1;
    let ins = inputs::<T>(call, n, count, op);
    let send = s.clone_htod(&ins[r]).unwrap();
    let mut recv = poison::<T>(&s, count);
    comm.reduce(&send, &mut recv, op, root).unwrap();
    comm.synchronize().unwrap();
    let got = s.clone_dtoh(&recv).unwrap();
    if r == root {
        assert_reduced::<T>(&format!("reduce {op:?}"), op, &ins, 0, &got);
    } else {
        assert!(got.iter().all(|&g| g == T::from_f64(77.0)), "reduce wrote a non-root's recv");
    }
    call
}

/// The order-free collectives on `T`.
fn check_moves<C: Collectives, T: Num>(comm: &C, mut call: u64) -> u64 {
    let (n, r, s) = (comm.world_size(), comm.rank(), comm.stream().clone());
    let count = 3001;
    call += 1;
    let ins = inputs::<T>(call, n, count, ReduceOp::Sum);
    let send = s.clone_htod(&ins[r]).unwrap();
    let mut recv = poison::<T>(&s, count * n);
    comm.all_gather(&send, &mut recv).unwrap();
    comm.synchronize().unwrap();
    assert_eq!(s.clone_dtoh(&recv).unwrap(), ins.concat(), "all_gather {}", T::DTYPE.name());

    call += 1;
    let root = 1 % n;
    let ins = inputs::<T>(call, n, count, ReduceOp::Sum);
    let mut buf = s.clone_htod(&ins[r]).unwrap();
    comm.broadcast_in_place(&mut buf, root).unwrap();
    comm.synchronize().unwrap();
    assert_eq!(s.clone_dtoh(&buf).unwrap(), ins[root], "broadcast {}", T::DTYPE.name());
    call
}

fn every_collective<C: Collectives>(comm: &C) {
    let mut call = 0;
    call = check_all::<C, f32>(comm, ReduceOp::Sum, call);
    call = check_all::<C, f32>(comm, ReduceOp::Avg, call);
    call = check_all::<C, bf16>(comm, ReduceOp::Max, call);
    call = check_all::<C, f16>(comm, ReduceOp::Sum, call);
    call = check_all::<C, f64>(comm, ReduceOp::Prod, call);
    call = check_all::<C, i32>(comm, ReduceOp::Min, call);
    call = check_all::<C, u8>(comm, ReduceOp::Sum, call);
    call = check_all::<C, i64>(comm, ReduceOp::Prod, call);
    call = check_all::<C, u64>(comm, ReduceOp::Max, call);
    call = check_all::<C, i8>(comm, ReduceOp::Sum, call);
    call = check_all::<C, u32>(comm, ReduceOp::Min, call);
    call = check_moves::<C, u8>(comm, call);
    call = check_moves::<C, f64>(comm, call);
    let _ = check_moves::<C, bf16>(comm, call);
    // Bad input is a typed error, not a panic or a call NCCL would hang on.
    let s = comm.stream().clone();
    let (a, mut b) = (s.alloc_zeros::<f32>(8).unwrap(), s.alloc_zeros::<f32>(9).unwrap());
    assert!(matches!(comm.all_reduce(&a, &mut b, ReduceOp::Sum), Err(Error::LengthMismatch { .. })));
    assert!(matches!(comm.broadcast_in_place(&mut b, 5), Err(Error::RootOutOfRange { .. })));
    let mut i = s.alloc_zeros::<i32>(4).unwrap();
    assert!(matches!(comm.all_reduce_in_place(&mut i, ReduceOp::Avg), Err(Error::UnsupportedOp { op: "avg", dtype: "i32" })));
    comm.synchronize().unwrap();
}

fn every_collective_child() {
    let comm = open();
    every_collective(&comm);
    println!("rank {}: every collective right between simulated hosts", comm.rank());
}

#[test]
fn two_simulated_hosts_run_every_collective_on_nccl() {
    if child() {
        return every_collective_child();
    }
    let name = "two_simulated_hosts_run_every_collective_on_nccl";
    if !ready(name, 2) {
        return;
    }
    let seed: u64 = rand::random::<u32>() as u64;
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(240), |r| host_env(r, seed)), passes("every collective right between simulated hosts"));
}

/// Whether `e` is how NCCL reports a dead peer: the collective's own
/// error (`Error::Nccl`, naming the call and a failing NCCL result), or the
/// communicator aborted (`Error::GroupFailed`) for NCCL's asynchronous
/// error or for work that did not finish within the communicator's
/// timeout.
fn is_dead_peer_error(e: &Error) -> bool {
    match e {
        Error::Nccl { op, code, message } => op.starts_with("nccl") && *code != 0 && !message.is_empty(),
        Error::GroupFailed { reason } => {
            reason.starts_with("NCCL communicator aborted: ")
                && (reason.contains("failed: NCCL result ") || reason.contains("(a peer died or stopped calling?) did not complete within"))
        }
        _ => false,
    }
}

/// Rank 0's side once its peer is dead: its next all-reduce (and the
/// wait for it) fails with a dead peer's error within a bound, and later
/// calls fail at once (an aborted communicator: with the same error).
/// Returns the error and how long it took.
fn survivor_fails_in_bounded_time(comm: &NcclComm, x: &mut cuda_peer::cudarc::driver::CudaSlice<f32>) -> (Error, Duration) {
    std::thread::sleep(Duration::from_millis(500));
    let start = Instant::now();
    let r = comm.all_reduce_in_place(x, ReduceOp::Sum).and_then(|()| comm.synchronize());
    let took = start.elapsed();
    let first = match r {
        Err(e) if is_dead_peer_error(&e) => e,
        other => panic!("rank 0: an all-reduce with a dead peer: expected Error::Nccl or Error::GroupFailed (NCCL aborted), got {other:?}"),
    };
    assert!(took < Duration::from_secs(60), "rank 0: the error took {took:?}");
    let again = comm.all_reduce_in_place(x, ReduceOp::Sum);
    match (&first, &again) {
        (Error::GroupFailed { .. }, Err(e)) => assert_eq!(e, &first, "rank 0: a call on the aborted communicator"),
        (_, Err(e)) => assert!(is_dead_peer_error(e), "rank 0: a call after the failure: {e:?}"),
        (_, Ok(())) => panic!("rank 0: a failed communicator ran another call"),
    }
    (first, took)
}

fn dead_peer_child() {
    let comm = open();
    let s = comm.stream().clone();
    let mut x = s.clone_htod(&vec![1.0f32; 1 << 16]).unwrap();
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
    comm.synchronize().unwrap();
    assert_eq!(s.clone_dtoh(&x).unwrap(), vec![2.0f32; 1 << 16], "rank {}: the first all-reduce", comm.rank());
    if comm.rank() == 1 {
        // Dies with its communicator open, between two collectives.
        println!("rank 1: leaving with the communicator open");
        std::process::exit(0);
    }
    let (first, took) = survivor_fails_in_bounded_time(&comm, &mut x);
    let y = s.clone_htod(&[5u32, 6, 7]).unwrap();
    assert_eq!(s.clone_dtoh(&y).unwrap(), vec![5, 6, 7], "rank 0's context is not usable after the abort");
    println!("rank 0: {first:?} after {took:?}; context usable");
}

#[test]
fn a_dead_host_fails_the_survivor_in_bounded_time() {
    if child() {
        return dead_peer_child();
    }
    let name = "a_dead_host_fails_the_survivor_in_bounded_time";
    if !ready(name, 2) {
        return;
    }
    let end = |r: usize| if r == 1 { End::Exits("rank 1: leaving with the communicator open".into()) } else { End::Passes("rank 0: ".into()) };
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(180), |r| host_env(r, 1)), end);
}

/// A child of [`nccl_refuses_two_ranks_on_one_gpu_with_its_typed_error`]:
/// both ranks open an NCCL communicator on the one device visible.
fn one_gpu_child() {
    let rv = Bootstrap::from_env().unwrap().with_timeout(Duration::from_secs(60)).connect().unwrap();
    match NcclComm::new(&rv, 0, Duration::from_secs(30)) {
        Err(Error::Nccl { op, code, message }) => {
            assert_eq!(op, "ncclCommInitRank", "rank {}: the failing call", rank());
            assert_eq!(code, 5, "rank {}: ncclInvalidUsage expected ({message})", rank());
            assert!(!message.is_empty(), "rank {}: NCCL's description is empty", rank());
            println!("rank {}: NCCL refused the duplicate GPU: {op}: {code} ({message})", rank());
        }
        Err(e) => panic!("rank {}: two ranks on one GPU: expected Error::Nccl from ncclCommInitRank, got {e:?}", rank()),
        Ok(_) => panic!("rank {}: NCCL accepted two ranks on one GPU", rank()),
    }
}

/// `Error::Nccl` as NCCL reports it: two ranks on one GPU (the device each
/// child sees, `CUDA_VISIBLE_DEVICES=0`), which NCCL refuses at
/// `ncclCommInitRank` with `ncclInvalidUsage` (5) on both, within the
/// bounded initialisation. Needs one GPU and NCCL.
#[test]
fn nccl_refuses_two_ranks_on_one_gpu_with_its_typed_error() {
    if child() {
        return one_gpu_child();
    }
    let name = "nccl_refuses_two_ranks_on_one_gpu_with_its_typed_error";
    if !ready(name, 1) {
        return;
    }
    let env = |r: usize| {
        let mut env = host_env(r, 1);
        env.push(("CUDA_VISIBLE_DEVICES", "0".into()));
        env
    };
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(120), env), passes("NCCL refused the duplicate GPU"));
}

/// A `Comm` child: checks the engine it picked, then an all-reduce and
/// an all-gather of fresh data against the CPU reference.
fn world_child(want_nccl: bool) {
    let rv = Bootstrap::from_env().unwrap().with_timeout(Duration::from_secs(60)).connect().unwrap();
    let stream = cuda_peer::driver::context(rank()).unwrap().new_stream().unwrap();
    let comm = Comm::from_exchange(stream, Box::new(rv), &CommOptions::default().timeout(Duration::from_secs(60))).unwrap();
    let engine = comm.engine();
    assert_eq!(engine == Engine::Nccl, want_nccl, "rank {}: engine {engine:?}", comm.rank());
    let (n, r, s) = (comm.world_size(), comm.rank(), comm.stream().clone());
    let count = 5003;
    let ins = inputs::<u32>(900, n, count, ReduceOp::Sum);
    let mut buf = s.clone_htod(&ins[r]).unwrap();
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
    let send = s.clone_htod(&ins[r]).unwrap();
    let mut all = poison::<u32>(&s, count * n);
    comm.all_gather(&send, &mut all).unwrap();
    comm.synchronize().unwrap();
    let want: Vec<u32> = (0..count).map(|i| ins.iter().map(|x| x[i]).sum()).collect();
    assert_eq!(s.clone_dtoh(&buf).unwrap(), want, "rank {r}: all_reduce on {engine:?}");
    assert_eq!(s.clone_dtoh(&all).unwrap(), ins.concat(), "rank {r}: all_gather on {engine:?}");
    println!("rank {r}: Comm on {engine:?} right");
}

#[test]
fn world_comm_picks_nccl_across_hosts_and_cuda_peer_within_one() {
    if child() {
        return world_child(std::env::var_os("CUDA_PEER_HOST_ID").is_some());
    }
    let name = "world_comm_picks_nccl_across_hosts_and_cuda_peer_within_one";
    if !ready(name, 2) {
        return;
    }
    let seed: u64 = rand::random::<u32>() as u64;
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(180), |r| host_env(r, seed)), passes("Comm on Nccl right"));
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(180), |_| vec![(SEED, seed.to_string())]), passes("Comm on Host("));
}

/// Two simulated hosts of two ranks each (4 processes on the 2 GPUs):
/// `Comm` takes two tiers (cuda-peer inside each host, NCCL across),
/// and every collective is exact against the CPU, at counts that leave a
/// remainder after the split between a host's ranks.
#[test]
fn two_simulated_hosts_of_two_ranks_run_every_collective_in_two_tiers() {
    if child() {
        let comm = open_world(2);
        assert!(matches!(comm.engine(), Engine::Tiered(_)), "rank {}: engine {:?}", rank(), comm.engine());
        every_collective(&comm);
        println!("rank {}: every collective right in two tiers ({:?})", comm.rank(), comm.engine());
        return;
    }
    let name = "two_simulated_hosts_of_two_ranks_run_every_collective_in_two_tiers";
    if !ready(name, 2) {
        return;
    }
    let seed: u64 = rand::random::<u32>() as u64;
    all_succeeded(name, &spawn(name, 4, Duration::from_secs(300), |r| hosts_env(r, 2, seed)), passes("every collective right in two tiers"));
}

/// The context of `device` with event tracking off (a captured stream may
/// not wait for events recorded outside the capture), for a child that
/// captures: call it before any buffer is made.
fn untracked_context(device: usize) -> Arc<cuda_peer::cudarc::driver::CudaContext> {
    let ctx = cuda_peer::driver::context(device).unwrap();
    // SAFETY: this child process's own context handle, before any buffer
    // is made; the child orders its work itself (one stream, synchronized).
    unsafe { ctx.disable_event_tracking() };
    ctx
}

/// An all-reduce captured into a graph on `comm`'s stream (its context's
/// event tracking off), `comm` dropped, then the graph replayed on fresh
/// inputs: each replay is checked against the CPU reference, and the graph
/// holds what the call uses until it is destroyed (the keep-alive counts).
fn replays_after_drop<C: Collectives>(comm: C) {
    let (n, r, s) = (comm.world_size(), comm.rank(), comm.stream().clone());
    let count = 4099;
    let op = ReduceOp::Sum;
    // Eagerly first: the two tiers' scratch is sized outside the capture.
    let ins = inputs::<f32>(1, n, count, op);
    let mut send = s.clone_htod(&ins[r]).unwrap();
    let mut recv = poison::<f32>(&s, count);
    comm.all_reduce(&send, &mut recv, op).unwrap();
    comm.synchronize().unwrap();
    assert_reduced::<f32>("eager all_reduce", op, &ins, 0, &s.clone_dtoh(&recv).unwrap());
    let (retained, released, _) = cuda_peer::group::graph_keep_alives();
    let graph = common::graph::capture(std::slice::from_ref(&s), || comm.all_reduce(&send, &mut recv, op));
    let (now_retained, _, _) = cuda_peer::group::graph_keep_alives();
    assert!(now_retained > retained, "rank {r}: the graph took no keep-alive ({retained} before the capture, {now_retained} after)");
    drop(comm);
    for call in 2..5 {
        let ins = inputs::<f32>(call, n, count, op);
        s.memcpy_htod(&ins[r], &mut send).unwrap();
        s.memcpy_htod(&vec![77.0f32; count], &mut recv).unwrap();
        graph.launch().unwrap();
        s.synchronize().unwrap();
        assert_reduced::<f32>(&format!("rank {r}: replay {} after the drop", call - 1), op, &ins, 0, &s.clone_dtoh(&recv).unwrap());
    }
    let (_, now_released, _) = cuda_peer::group::graph_keep_alives();
    assert_eq!(now_released, released, "rank {r}: what the graph holds was released while the graph lives");
    drop(graph);
    let start = Instant::now();
    while cuda_peer::group::graph_keep_alives().1 == released {
        assert!(start.elapsed() < Duration::from_secs(30), "rank {r}: the destroyed graph's keep-alive was never released");
        std::thread::sleep(Duration::from_millis(10));
    }
    println!("rank {r}: the graph replayed after the communicator was dropped, and released it");
}

fn nccl_graph_child() {
    let stream = untracked_context(rank()).new_stream().unwrap();
    let rv = Bootstrap::from_env().unwrap().with_timeout(Duration::from_secs(60)).connect().unwrap();
    // Generous: under the sharded suite, NCCL's initialisation on the one
    // H200 once took more than 20 s.
    replays_after_drop(NcclComm::on_stream(&rv, stream, Duration::from_secs(120)).unwrap());
}

/// A graph of an NCCL call holds the NCCL communicator: replayed after the
/// `NcclComm` is dropped, it runs on a live communicator (not on one
/// aborted and freed), which is aborted once the graph is destroyed. One
/// rank on one GPU (NCCL takes one GPU per rank).
#[test]
fn a_graph_of_an_nccl_call_replays_after_the_communicator_is_dropped() {
    if child() {
        return nccl_graph_child();
    }
    let name = "a_graph_of_an_nccl_call_replays_after_the_communicator_is_dropped";
    if !ready(name, 1) {
        return;
    }
    let seed: u64 = rand::random::<u32>() as u64;
    all_succeeded(
        name,
        &spawn(name, 1, Duration::from_secs(120), |r| host_env(r, seed)),
        passes("the graph replayed after the communicator was dropped"),
    );
}

/// As above, on two simulated hosts (NCCL between two GPUs), and on two
/// simulated hosts of two ranks each (`Comm` in two tiers: the graph holds
/// the tiers' scratch and both NCCL communicators as well as the host
/// communicator's memory).
#[test]
fn graphs_across_simulated_hosts_replay_after_the_communicators_are_dropped() {
    if child() {
        if std::env::var("LOCAL_WORLD_SIZE").as_deref() == Ok("2") {
            let device = (rank() % 2 + rank() / 2) % 2;
            let stream = untracked_context(device).new_stream().unwrap();
            let rv = Bootstrap::from_env().unwrap().with_timeout(Duration::from_secs(60)).connect().unwrap();
            let opts = CommOptions::default().timeout(Duration::from_secs(60)).barrier_timeout(Duration::from_secs(20));
            let comm = Comm::from_exchange(stream, Box::new(rv), &opts).unwrap();
            assert!(matches!(comm.engine(), Engine::Tiered(_)), "rank {}: engine {:?}", rank(), comm.engine());
            return replays_after_drop(comm);
        }
        return nccl_graph_child();
    }
    let name = "graphs_across_simulated_hosts_replay_after_the_communicators_are_dropped";
    if !ready(name, 2) {
        return;
    }
    let seed: u64 = rand::random::<u32>() as u64;
    let replayed = passes("the graph replayed after the communicator was dropped");
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(180), |r| host_env(r, seed)), &replayed);
    all_succeeded(name, &spawn(name, 4, Duration::from_secs(300), |r| hosts_env(r, 2, seed)), &replayed);
}

/// A child of the test below: both ranks capture a graph of an all-reduce
/// and keep it; rank 1 then dies, and rank 0's next call must fail in
/// bounded time although the graph still holds the NCCL communicator
/// (NCCL's abort waits for every graph holding it to be destroyed).
fn dead_peer_graph_child() {
    let stream = untracked_context(rank()).new_stream().unwrap();
    let rv = Bootstrap::from_env().unwrap().with_timeout(Duration::from_secs(60)).connect().unwrap();
    let comm = NcclComm::on_stream(&rv, stream.clone(), Duration::from_secs(20)).unwrap();
    let mut x = stream.clone_htod(&vec![1.0f32; 1 << 16]).unwrap();
    let graph = common::graph::capture(std::slice::from_ref(&stream), || comm.all_reduce_in_place(&mut x, ReduceOp::Sum));
    graph.launch().unwrap();
    comm.synchronize().unwrap();
    assert_eq!(stream.clone_dtoh(&x).unwrap(), vec![2.0f32; 1 << 16], "rank {}: the replayed all-reduce", rank());
    if rank() == 1 {
        println!("rank 1: leaving with the communicator and its graph open");
        std::process::exit(0);
    }
    let (_, took) = survivor_fails_in_bounded_time(&comm, &mut x);
    drop(comm);
    drop(graph);
    let y = stream.clone_htod(&[5u32, 6, 7]).unwrap();
    assert_eq!(stream.clone_dtoh(&y).unwrap(), vec![5, 6, 7], "rank 0's context is not usable after the abort");
    println!("rank 0: failed in {took:?} with the graph alive; context usable");
}

#[test]
fn a_dead_host_fails_the_survivor_in_bounded_time_while_a_graph_holds_the_communicator() {
    if child() {
        return dead_peer_graph_child();
    }
    let name = "a_dead_host_fails_the_survivor_in_bounded_time_while_a_graph_holds_the_communicator";
    if !ready(name, 2) {
        return;
    }
    let end = |r: usize| {
        if r == 1 {
            End::Exits("rank 1: leaving with the communicator and its graph open".into())
        } else {
            End::Passes("rank 0: failed in".into())
        }
    };
    all_succeeded(name, &spawn(name, 2, Duration::from_secs(180), |r| host_env(r, 1)), end);
}
