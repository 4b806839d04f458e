//! GPU tests of the fused kernels' edge cases (mesh and one-shot, in one
//! process): a mesh rank that arrives after its peer gave up touches none
//! of the peer's buffers (nor faults when they were freed); a graph
//! replayed after a failure writes nothing; the failure names the call;
//! groups that share a device run from several threads at once; a graph
//! launched right after eager calls, ordered as `Group::wait_for_ranks`
//! says, is right every time. Ranks are laid round robin over the GPUs
//! (both on device 0 where there is one: the fused kernels then divide its
//! multiprocessors). Contexts have event tracking off (the graph tests
//! need it; every test orders its work itself). Skips without a GPU;
//! fails then with CUDA_PEER_REQUIRE_GPU=1.

mod common;

use common::graph::{capture, untracked};
use cuda_peer::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cuda_peer::failure::Fault;
use cuda_peer::{Algorithm, Error, Group, GroupOptions, PathPolicy, ReduceOp};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn random_u32(n: usize) -> Vec<u32> {
    common::random_bytes(n * 4).chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Wrapping u32 sums: exact whatever the order.
fn reference(inputs: &[Vec<u32>]) -> Vec<u32> {
    (0..inputs[0].len()).map(|i| inputs.iter().fold(0u32, |a, v| a.wrapping_add(v[i]))).collect()
}

fn streams(ctxs: &[Arc<CudaContext>], n: usize) -> Vec<Arc<CudaStream>> {
    (0..n).map(|r| ctxs[r % ctxs.len()].new_stream().unwrap()).collect()
}

fn sync(streams: &[Arc<CudaStream>]) {
    for s in streams {
        s.synchronize().unwrap();
    }
}

/// The fused algorithms forced, each with a count it runs at.
fn fused() -> [(&'static str, Algorithm, usize); 2] {
    [("mesh", Algorithm::Mesh, (1 << 20) + 3), ("one-shot", Algorithm::OneShot, 4099)]
}

fn options(algorithm: Algorithm, timeout: Duration) -> GroupOptions {
    GroupOptions::with_policy(PathPolicy::P2pOnly).algorithm(algorithm).barrier_timeout(timeout)
}

unsafe extern "C" fn sleep_ms(arg: *mut c_void) {
    std::thread::sleep(Duration::from_millis(arg as usize as u64));
}

/// Holds `stream` for `ms` milliseconds: a host function that sleeps.
fn hold(stream: &CudaStream, ms: u64) {
    // SAFETY: `sleep_ms` takes its argument as a number, never as a
    // pointer; the stream is live.
    unsafe { cuda_peer::cudarc::driver::result::stream::launch_host_function(stream.cu_stream(), sleep_ms, ms as usize as *mut c_void) }
        .expect("cuLaunchHostFunc");
}

/// One all-reduce per rank of fresh random data, checked exactly on every
/// rank.
fn exact_all_reduce(group: &Group, streams: &[Arc<CudaStream>], count: usize, what: &str) {
    let inputs: Vec<Vec<u32>> = (0..streams.len()).map(|_| random_u32(count)).collect();
    let mut bufs: Vec<CudaSlice<u32>> = streams.iter().zip(&inputs).map(|(s, x)| s.clone_htod(x).unwrap()).collect();
    group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap_or_else(|e| panic!("{what}: {e}"));
    sync(streams);
    let want = reference(&inputs);
    for (r, (s, b)) in streams.iter().zip(&bufs).enumerate() {
        if let Some((first, wrong)) = common::diff(&s.clone_dtoh(b).unwrap(), &want) {
            panic!("{what}: rank {r}: {wrong} of {count} wrong, first at {first}");
        }
    }
}

/// Rank 1's stream is held for a second; rank 0's mesh kernel gives up
/// after its 100 ms barrier timeout and its call is over. Then rank 0's
/// buffer is the caller's: overwritten with a pattern (which must survive
/// rank 1's late kernel), or freed (rank 1's context must survive).
#[test]
fn a_late_mesh_rank_leaves_a_peer_that_gave_up_alone() {
    let test = "a_late_mesh_rank_leaves_a_peer_that_gave_up_alone";
    let Some(ctxs) = untracked(test, 1) else { return };
    let count = (1 << 20) + 3;
    for freed in [false, true] {
        let what = if freed { "rank 0's buffer freed" } else { "rank 0's buffer overwritten" };
        let streams = streams(&ctxs, 2);
        let group = Group::new(streams.clone(), &options(Algorithm::Mesh, Duration::from_millis(100))).unwrap();
        // Call 1: a good one.
        exact_all_reduce(&group, &streams, count, what);
        let mut bufs: Vec<CudaSlice<u32>> = streams.iter().map(|s| s.clone_htod(&random_u32(count)).unwrap()).collect();
        sync(&streams);
        // Call 2: rank 1 late by a second.
        hold(&streams[1], 1000);
        group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).expect("the call is enqueued");
        streams[0].synchronize().unwrap();
        let pattern = random_u32(count);
        if freed {
            drop(bufs.remove(0));
        } else {
            streams[0].memcpy_htod(&pattern, &mut bufs[0]).unwrap();
        }
        streams[0].synchronize().unwrap();
        let start = Instant::now();
        streams[1].synchronize().unwrap_or_else(|e| panic!("{what}: rank 1's late kernel: {e}"));
        assert!(start.elapsed() >= Duration::from_millis(500), "{what}: rank 1 was not held ({:?})", start.elapsed());
        if !freed {
            let got = streams[0].clone_dtoh(&bufs[0]).unwrap();
            if let Some((first, wrong)) = common::diff(&got, &pattern) {
                panic!(
                    "{what}: rank 1's late kernel wrote {wrong} of {count} elements of rank 0's buffer after its call had failed (first at {first})"
                );
            }
        }
        match group.synchronize() {
            Err(Error::PeerTimeout { rank: 0, call: 2, after }) => assert_eq!(after, Duration::from_millis(100), "{what}"),
            other => panic!("{what}: expected rank 0's timeout of call 2, got {other:?}"),
        }
        drop(group);
        // Both contexts still work.
        let group = Group::new(streams.clone(), &options(Algorithm::Mesh, Duration::from_secs(10))).unwrap();
        exact_all_reduce(&group, &streams, count, &format!("{what}: a new group"));
    }
}

/// A graph captured on a group, replayed after the group failed (a rank
/// that never arrives), writes nothing: poisoned buffers stay poisoned and
/// the failure is what `synchronize` reports, on every replay.
#[test]
fn a_graph_replayed_after_a_failure_writes_nothing() {
    let test = "a_graph_replayed_after_a_failure_writes_nothing";
    let Some(ctxs) = untracked(test, 1) else { return };
    for (what, algorithm, count) in fused() {
        let streams = streams(&ctxs, 2);
        let group = Group::new(streams.clone(), &options(algorithm, Duration::from_millis(200))).unwrap();
        let inputs: Vec<Vec<u32>> = (0..2).map(|_| random_u32(count)).collect();
        let mut bufs: Vec<CudaSlice<u32>> = streams.iter().zip(&inputs).map(|(s, x)| s.clone_htod(x).unwrap()).collect();
        // Call 1, eager (loads the kernels); call 2 captured, replayed once.
        group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap();
        sync(&streams);
        let graph = capture(&streams, || group.all_reduce_in_place(&mut bufs, ReduceOp::Sum));
        for (s, (b, x)) in streams.iter().zip(bufs.iter_mut().zip(&inputs)) {
            s.memcpy_htod(x, b).unwrap();
            s.synchronize().unwrap();
        }
        group.wait_for_ranks(&streams[0]).unwrap();
        graph.launch().unwrap();
        sync(&streams);
        let want = reference(&inputs);
        for (r, (s, b)) in streams.iter().zip(&bufs).enumerate() {
            assert!(s.clone_dtoh(b).unwrap() == want, "{what}: rank {r}: the first replay is wrong");
        }
        // Call 3: rank 1 never arrives; rank 0 times out.
        group.inject_fault(1, Fault::NeverArrives);
        group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).expect("the call is enqueued");
        let failed = group.synchronize();
        assert!(matches!(failed, Err(Error::PeerTimeout { rank: 0, call: 3, .. })), "{what}: {failed:?}");
        for replay in 0..3 {
            let poison: Vec<Vec<u32>> = (0..2).map(|_| random_u32(count)).collect();
            for (s, (b, p)) in streams.iter().zip(bufs.iter_mut().zip(&poison)) {
                s.memcpy_htod(p, b).unwrap();
                s.synchronize().unwrap();
            }
            let start = Instant::now();
            graph.launch().unwrap();
            sync(&streams);
            assert!(start.elapsed() < Duration::from_millis(150), "{what}: replay {replay} waited {:?} (it should do nothing)", start.elapsed());
            for (r, (s, b)) in streams.iter().zip(&bufs).enumerate() {
                let got = s.clone_dtoh(b).unwrap();
                if let Some((first, wrong)) = common::diff(&got, &poison[r]) {
                    panic!("{what}: replay {replay} after the failure wrote {wrong} of {count} elements of rank {r}'s buffer (first at {first})");
                }
            }
            assert_eq!(group.synchronize().err(), failed.clone().err(), "{what}: replay {replay}");
        }
    }
}

/// Several groups over the same device(s), each driven from its own thread
/// at once, with the fused algorithm forced: every call exact, none times
/// out (the kernels of every group must be able to be resident together).
#[test]
fn groups_sharing_devices_run_from_threads_at_once() {
    let test = "groups_sharing_devices_run_from_threads_at_once";
    let Some(ctxs) = untracked(test, 1) else { return };
    for groups in [2, 3] {
        for (what, algorithm, count) in fused() {
            let made: Vec<(Group, Vec<Arc<CudaStream>>)> = (0..groups)
                .map(|_| {
                    let s = streams(&ctxs, 2);
                    (Group::new(s.clone(), &options(algorithm, Duration::from_secs(5))).unwrap(), s)
                })
                .collect();
            let start = Instant::now();
            std::thread::scope(|scope| {
                for (g, (group, s)) in made.iter().enumerate() {
                    scope.spawn(move || {
                        for call in 0..50 {
                            exact_all_reduce(group, s, count, &format!("{groups} groups, {what}, group {g}, call {call}"));
                        }
                    });
                }
            });
            eprintln!("  {groups} groups of 2 ranks, {what}: 50 calls each in {:?}", start.elapsed());
        }
    }
}

/// A graph captured over both ranks' streams, launched on rank 0's stream
/// right after eager calls (no synchronisation between them), 1,000 times,
/// ordered by `wait_for_ranks` before each launch and `ranks_wait_for`
/// after it: every replay's result and every eager result exact (each
/// copied into a history on the device, checked at the end).
#[test]
fn a_graph_launched_right_after_eager_calls_is_right_every_time() {
    let test = "a_graph_launched_right_after_eager_calls_is_right_every_time";
    let Some(ctxs) = untracked(test, 1) else { return };
    const ROUNDS: usize = 1000;
    for (what, algorithm, count) in [("mesh", Algorithm::Mesh, (1 << 16) + 3), ("one-shot", Algorithm::OneShot, 4099)] {
        let streams = streams(&ctxs, 2);
        let group = Group::new(streams.clone(), &options(algorithm, Duration::from_secs(5))).unwrap();
        let (graph_in, eager_in): (Vec<Vec<u32>>, Vec<Vec<u32>>) =
            ((0..2).map(|_| random_u32(count)).collect(), (0..2).map(|_| random_u32(count)).collect());
        let send: Vec<CudaSlice<u32>> = streams.iter().zip(&graph_in).map(|(s, x)| s.clone_htod(x).unwrap()).collect();
        let mut recv: Vec<CudaSlice<u32>> = streams.iter().map(|s| s.alloc_zeros(count).unwrap()).collect();
        let esend: Vec<CudaSlice<u32>> = streams.iter().zip(&eager_in).map(|(s, x)| s.clone_htod(x).unwrap()).collect();
        let mut erecv: Vec<CudaSlice<u32>> = streams.iter().map(|s| s.alloc_zeros(count).unwrap()).collect();
        let mut history: Vec<CudaSlice<u32>> = streams.iter().map(|s| s.alloc_zeros(count * ROUNDS).unwrap()).collect();
        let mut ehistory: Vec<CudaSlice<u32>> = streams.iter().map(|s| s.alloc_zeros(count * ROUNDS).unwrap()).collect();
        let poison = vec![0xDEAD_BEEFu32; count];
        group.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
        sync(&streams);
        let graph = capture(&streams, || group.all_reduce(&send, &mut recv, ReduceOp::Sum));
        for round in 0..ROUNDS {
            group.all_reduce(&esend, &mut erecv, ReduceOp::Sum).unwrap();
            for (s, b) in streams.iter().zip(recv.iter_mut()) {
                s.memcpy_htod(&poison, b).unwrap();
            }
            group.wait_for_ranks(&streams[0]).unwrap();
            graph.launch().unwrap();
            group.ranks_wait_for(&streams[0]).unwrap();
            for r in 0..2 {
                let at = round * count..(round + 1) * count;
                streams[r].memcpy_dtod(&recv[r], &mut history[r].slice_mut(at.clone())).unwrap();
                streams[r].memcpy_dtod(&erecv[r], &mut ehistory[r].slice_mut(at)).unwrap();
            }
        }
        sync(&streams);
        group.synchronize().unwrap_or_else(|e| panic!("{what}: {e}"));
        for (name, hist, want) in [("graph", &history, reference(&graph_in)), ("eager", &ehistory, reference(&eager_in))] {
            for r in 0..2 {
                let got = streams[r].clone_dtoh(&hist[r]).unwrap();
                for round in 0..ROUNDS {
                    if let Some((first, wrong)) = common::diff(&got[round * count..(round + 1) * count], &want) {
                        panic!("{what}: {name} result of round {round}, rank {r}: {wrong} of {count} wrong, first at {first}");
                    }
                }
            }
        }
    }
}
