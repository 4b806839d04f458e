//! GPU tests of fused all-reduces (one-shot, mesh) that cannot complete on
//! every rank: a launch that fails on one rank, and a rank whose kernel
//! never arrives. The kernels already running must end
//! cleanly (no trap: a trap would kill the contexts), the call or the next
//! synchronisation must report a typed error, the failed group must refuse
//! further calls, and a new group on the same contexts must give exact
//! results. Faults are injected with the hidden `Group::inject_fault`.
//! The two ranks are laid round robin over the GPUs: on one GPU they share
//! it (the fused kernels divide its multiprocessors; `StagedOnly` stages
//! them too, so the one-shot through host memory runs there as well).
//! Skips without a GPU; fails then with CUDA_PEER_REQUIRE_GPU=1.

mod common;

use common::gpus;
use cuda_peer::cudarc::driver::{CudaSlice, CudaStream};
use cuda_peer::failure::Fault;
use cuda_peer::{Algorithm, Error, Group, GroupOptions, PathPolicy, ReduceOp};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn random_u32(n: usize) -> Vec<u32> {
    common::random_bytes(n * 4).chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The fused configurations, with a message size that takes them: the
/// one-shot over P2P (local on one device), the mesh, and the one-shot
/// through host memory (staged links, on one device too).
fn configs() -> Vec<(&'static str, GroupOptions, usize)> {
    let with = |policy: PathPolicy, algorithm: Algorithm| GroupOptions::with_policy(policy).algorithm(algorithm);
    let mut configs = vec![
        ("one-shot over P2P", with(PathPolicy::P2pOnly, Algorithm::Auto), 1024),
        ("mesh", with(PathPolicy::P2pOnly, Algorithm::Mesh), (1 << 20) + 3),
    ];
    configs.push(("one-shot through host memory", with(PathPolicy::StagedOnly, Algorithm::OneShot), 4099));
    configs
}

/// One exact all-reduce (wrapping u32 sums) on a fresh group: the contexts
/// still work.
fn exact_all_reduce(streams: &[Arc<CudaStream>], opts: &GroupOptions, count: usize, what: &str) {
    let group = Group::new(streams.to_vec(), opts).unwrap_or_else(|e| panic!("{what}: a new group after the failure: {e}"));
    let inputs: Vec<Vec<u32>> = (0..2).map(|_| random_u32(count)).collect();
    let expected: Vec<u32> = (0..count).map(|i| inputs[0][i].wrapping_add(inputs[1][i])).collect();
    let mut bufs: Vec<CudaSlice<u32>> = (0..2).map(|r| streams[r].clone_htod(&inputs[r]).unwrap()).collect();
    group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap_or_else(|e| panic!("{what}: all-reduce on a new group: {e}"));
    for r in 0..2 {
        let out = streams[r].clone_dtoh(&bufs[r]).unwrap();
        if let Some((first, wrong)) = common::diff(&out, &expected) {
            panic!("{what}: new group, rank {r}: {wrong} of {count} wrong, first at {first}");
        }
    }
}

/// One new stream per rank, rank r on device r % count (both on device 0
/// where there is one GPU).
fn setup(test: &str) -> Option<Vec<Arc<CudaStream>>> {
    let ctxs = gpus(test, 1)?;
    Some((0..2).map(|r| ctxs[r % ctxs.len()].new_stream().unwrap()).collect())
}

#[test]
fn a_launch_that_fails_on_one_rank_frees_the_others() {
    let test = "a_launch_that_fails_on_one_rank_frees_the_others";
    let Some(streams) = setup(test) else { return };
    for (what, mut opts, count) in configs() {
        // Long enough that only the abort word can free rank 0 in time.
        opts.barrier_timeout = Duration::from_secs(60);
        let group = Group::new(streams.clone(), &opts).unwrap();
        let mut bufs: Vec<CudaSlice<u32>> = (0..2).map(|r| streams[r].clone_htod(&random_u32(count)).unwrap()).collect();
        // Rank 1's launch fails; rank 0's kernel (launched first or at the same
        // time) is left waiting at its barrier until the host aborts it.
        group.inject_fault(1, Fault::LaunchFails);
        let err = group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap_err();
        assert!(err.to_string().contains("injected launch failure"), "{what}: {err}");
        let start = Instant::now();
        let synced = group.synchronize();
        assert!(start.elapsed() < Duration::from_secs(30), "{what}: rank 0 was not freed by the abort ({:?})", start.elapsed());
        assert!(matches!(synced, Err(Error::GroupFailed { .. })), "{what}: synchronize after the failure: {synced:?}");
        let again = group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap_err();
        assert!(matches!(again, Error::GroupFailed { .. }), "{what}: a call on the failed group: {again}");
        drop(group);
        exact_all_reduce(&streams, &opts, count, what);
    }
}

#[test]
fn a_rank_that_never_arrives_times_out() {
    let test = "a_rank_that_never_arrives_times_out";
    let Some(streams) = setup(test) else { return };
    for (what, mut opts, count) in configs() {
        opts.barrier_timeout = Duration::from_millis(200);
        let group = Group::new(streams.clone(), &opts).unwrap();
        let mut bufs: Vec<CudaSlice<u32>> = (0..2).map(|r| streams[r].clone_htod(&random_u32(count)).unwrap()).collect();
        // A good call first: the timeout does not fire on calls that complete.
        group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap();
        group.synchronize().unwrap();
        group.inject_fault(1, Fault::NeverArrives);
        let start = Instant::now();
        group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).expect("the call itself is enqueued");
        let synced = group.synchronize();
        let took = start.elapsed();
        match synced {
            Err(Error::PeerTimeout { rank: 0, call, after }) => {
                assert_eq!(after, Duration::from_millis(200), "{what}: the group's barrier timeout");
                assert_eq!(call, 2, "{what}: the second call is the one that timed out");
            }
            other => panic!("{what}: expected rank 0 to time out, got {other:?}"),
        }
        // Rank 0's kernel waited its barrier timeout before it gave up (the
        // device's timer may tick in steps of a millisecond or so), and not
        // much longer.
        assert!(took >= Duration::from_millis(180), "{what}: rank 0 gave up after {took:?}, before its 200 ms barrier timeout");
        assert!(took < Duration::from_secs(10), "{what}: rank 0 gave up only after {took:?} (barrier timeout 200 ms)");
        let again = group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap_err();
        assert!(matches!(again, Error::PeerTimeout { .. }), "{what}: a call on the failed group: {again}");
        drop(group);
        exact_all_reduce(&streams, &opts, count, what);
    }
}

/// The fused algorithms run a check on real data when the group is created
/// (`src/algorithms/check.rs`). Where it fails (a rank whose check kernel never
/// arrives, as when SM peer stores or flags are lost, or a failed launch),
/// an Auto group keeps only the ring and gives exact results, and a forced
/// algorithm is a typed error. Without a fault, the checks pass and the
/// group keeps its fused algorithms.
#[test]
fn fused_paths_that_fail_their_check_fall_back_to_the_ring() {
    let Some(streams) = setup("fused_paths_that_fail_their_check_fall_back_to_the_ring") else { return };
    let opts = |algorithm: Algorithm, fault: Option<(usize, Fault)>| {
        GroupOptions::with_policy(PathPolicy::P2pOnly).algorithm(algorithm).barrier_timeout(Duration::from_millis(300)).check_fault(fault)
    };
    let healthy = Group::new(streams.clone(), &opts(Algorithm::Auto, None)).unwrap();
    assert!(healthy.uses_mesh() && healthy.oneshot_on_host() == Some(false), "a healthy pair keeps the mesh and the one-shot");
    drop(healthy);
    for fault in [Fault::NeverArrives, Fault::LaunchFails] {
        let group = Group::new(streams.clone(), &opts(Algorithm::Auto, Some((1, fault)))).unwrap();
        assert!(!group.uses_mesh() && group.oneshot_on_host().is_none(), "{fault:?}: the fused algorithms were kept");
        assert_eq!(group.all_reduce_algorithm(4096), Algorithm::Ring);
        for count in [1024, (1 << 20) + 3] {
            let inputs: Vec<Vec<u32>> = (0..2).map(|_| random_u32(count)).collect();
            let expected: Vec<u32> = (0..count).map(|i| inputs[0][i].wrapping_add(inputs[1][i])).collect();
            let mut bufs: Vec<CudaSlice<u32>> = (0..2).map(|r| streams[r].clone_htod(&inputs[r]).unwrap()).collect();
            group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap();
            for r in 0..2 {
                let out = streams[r].clone_dtoh(&bufs[r]).unwrap();
                if let Some((first, wrong)) = common::diff(&out, &expected) {
                    panic!("{fault:?}, ring fallback, rank {r}: {wrong} of {count} wrong, first at {first}");
                }
            }
        }
        drop(group);
        for (algorithm, name) in [(Algorithm::Mesh, "mesh"), (Algorithm::OneShot, "one-shot")] {
            match Group::new(streams.clone(), &opts(algorithm, Some((1, fault)))) {
                Err(Error::FusedUnverified { algorithm, .. }) => assert_eq!(algorithm, name),
                other => panic!("{fault:?}: forced {name}: expected FusedUnverified, got {:?}", other.map(|_| "a group")),
            }
        }
    }
}
