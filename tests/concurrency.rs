//! Two groups on the same streams, called from two threads at once. Each
//! all-reduce is one kernel per rank with a device-side barrier; if the
//! two groups' kernels were enqueued in opposite orders on the two
//! streams, each would wait on the device for the other. Groups that share
//! a stream serialise their enqueues, so every call completes and every
//! result is exact (each element its own value, so that one moved is
//! caught too). The two streams are laid round robin over the GPUs: on one
//! GPU both are streams of it (the two ranks share the device, and their
//! fused kernels wait for each other on it just as across two). Skips
//! without a GPU (fails with CUDA_PEER_REQUIRE_GPU=1 then).

mod common;

use common::gpus;
use cuda_peer::cudarc::driver::CudaSlice;
use cuda_peer::{Group, GroupOptions, ReduceOp};
use std::sync::Arc;
use std::time::Instant;

/// Rank r's starting buffer: element i is `2i + r + 1`, distinct per
/// element and rank, so that after k sums element i is `(4i + 3) 2^(k-1)`:
/// exact in f64, and a lost or repeated call, or an element moved, changes
/// it.
fn initial(r: usize, count: usize) -> Vec<f64> {
    (0..count).map(|i| (2 * i + r + 1) as f64).collect()
}

/// Rank r's buffer after `calls` all-reduces of [`initial`]'s buffers.
fn check_rank(what: &str, r: usize, got: &[f64], calls: u32) {
    let scale = 2f64.powi(calls as i32 - 1);
    let want: Vec<f64> = (0..got.len()).map(|i| (4 * i + 3) as f64 * scale).collect();
    if let Some((first, wrong)) = common::diff(got, &want) {
        panic!("{what} rank {r}: {wrong} of {} elements wrong, first at {first}: {} instead of {}", got.len(), got[first], want[first]);
    }
}

/// Two groups on the same two streams (stream r on device r % count; the
/// second group with its ranks in the reverse order), `CALLS` in-place
/// all-reduces each, from two threads at once (`threads`) or alternating
/// on one thread; launcher threads on or off (`spin`).
fn two_groups(test: &str, threads: bool, spin: Option<std::time::Duration>) {
    let Some(ctxs) = gpus(test, 1) else {
        return;
    };
    let streams: Vec<_> = (0..2).map(|r| ctxs[r % ctxs.len()].new_stream().unwrap()).collect();
    let opts = GroupOptions::default().launch_spin(spin);
    // Rank order reversed in the second group: its rank 0 is on stream 1
    // (device 1 where there are two).
    let a = Arc::new(Group::new(streams.clone(), &opts).unwrap());
    let b = Arc::new(Group::new(vec![streams[1].clone(), streams[0].clone()], &opts).unwrap());
    const CALLS: u32 = 300;
    let count = 1024;
    let start = Instant::now();
    let bufs = |order: [usize; 2]| -> Vec<CudaSlice<f64>> { (0..2).map(|r| streams[order[r]].clone_htod(&initial(r, count)).unwrap()).collect() };
    let check = |what: &str, order: [usize; 2], bufs: &[CudaSlice<f64>]| {
        for (r, &d) in order.iter().enumerate() {
            check_rank(&format!("{test}: {what}"), r, &streams[d].clone_dtoh(&bufs[r]).unwrap(), CALLS);
        }
    };
    let (mut ba, mut bb) = (bufs([0, 1]), bufs([1, 0]));
    if threads {
        std::thread::scope(|s| {
            let ta =
                s.spawn(|| (0..CALLS).try_for_each(|k| a.all_reduce_in_place(&mut ba, ReduceOp::Sum).map_err(|e| format!("group A, call {k}: {e}"))));
            let tb =
                s.spawn(|| (0..CALLS).try_for_each(|k| b.all_reduce_in_place(&mut bb, ReduceOp::Sum).map_err(|e| format!("group B, call {k}: {e}"))));
            let (ra, rb) = (ta.join().expect("group A's thread"), tb.join().expect("group B's thread"));
            ra.and(rb).unwrap_or_else(|e| panic!("{test}: {e}"));
        });
    } else {
        for k in 0..CALLS {
            a.all_reduce_in_place(&mut ba, ReduceOp::Sum).unwrap_or_else(|e| panic!("{test}: group A, call {k}: {e}"));
            b.all_reduce_in_place(&mut bb, ReduceOp::Sum).unwrap_or_else(|e| panic!("{test}: group B, call {k}: {e}"));
        }
    }
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    check("group A", [0, 1], &ba);
    check("group B", [1, 0], &bb);
    eprintln!("  {test}: {} all-reduces in {:?}", 2 * CALLS, start.elapsed());
}

#[test]
fn two_groups_on_the_same_streams_from_two_threads() {
    two_groups("two_groups_on_the_same_streams_from_two_threads", true, Some(cuda_peer::DEFAULT_LAUNCH_SPIN));
}

#[test]
fn two_groups_on_the_same_streams_from_two_threads_without_launchers() {
    two_groups("two_groups_on_the_same_streams_from_two_threads_without_launchers", true, None);
}

#[test]
fn two_groups_on_the_same_streams_alternating_on_one_thread() {
    two_groups("two_groups_on_the_same_streams_alternating_on_one_thread", false, Some(cuda_peer::DEFAULT_LAUNCH_SPIN));
}

/// As `two_groups_on_the_same_streams_from_two_threads`, with each thread
/// making its own buffers (allocations and copies on the shared streams
/// while the other thread's collectives are being enqueued).
#[test]
fn two_groups_on_the_same_streams_buffers_made_on_the_threads() {
    let test = "two_groups_on_the_same_streams_buffers_made_on_the_threads";
    let Some(ctxs) = gpus(test, 1) else {
        return;
    };
    let streams: Vec<_> = (0..2).map(|r| ctxs[r % ctxs.len()].new_stream().unwrap()).collect();
    let a = Group::new(streams.clone(), &GroupOptions::default()).unwrap();
    let b = Group::new(vec![streams[1].clone(), streams[0].clone()], &GroupOptions::default()).unwrap();
    const CALLS: u32 = 300;
    let run = |group: &Group, order: [usize; 2], name: &str| {
        let mut bufs: Vec<CudaSlice<f64>> = (0..2).map(|r| streams[order[r]].clone_htod(&initial(r, 1024)).unwrap()).collect();
        for k in 0..CALLS {
            group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap_or_else(|e| panic!("{test}: group {name}, call {k}: {e}"));
        }
        for (r, &d) in order.iter().enumerate() {
            check_rank(&format!("{test}: group {name}"), r, &streams[d].clone_dtoh(&bufs[r]).unwrap(), CALLS);
        }
    };
    std::thread::scope(|s| {
        let ta = s.spawn(|| run(&a, [0, 1], "A"));
        let tb = s.spawn(|| run(&b, [1, 0], "B"));
        ta.join().expect("group A's thread");
        tb.join().expect("group B's thread");
    });
}
