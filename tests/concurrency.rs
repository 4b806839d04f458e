//! Two groups on the same streams, called from two threads at once (issue
//! 16, item 8). Each all-reduce is one kernel per rank with a device-side
//! barrier; if the two groups' kernels were enqueued in opposite orders on
//! the two streams, each would wait on the device for the other. Groups
//! that share a stream serialise their enqueues, so every call completes
//! and every result is exact. Skips without two GPUs; fails with
//! CUDA_PEER_REQUIRE_GPU=1.

mod common;

use common::gpus;
use cuda_peer::cudarc::driver::CudaSlice;
use cuda_peer::{Group, GroupOptions, ReduceOp};
use std::sync::Arc;
use std::time::Instant;

#[test]
fn two_groups_on_the_same_streams_from_two_threads() {
    let Some(ctxs) = gpus("two_groups_on_the_same_streams_from_two_threads", 2) else {
        return;
    };
    let streams: Vec<_> = ctxs[..2].iter().map(|c| c.new_stream().unwrap()).collect();
    // Rank order reversed in the second group: its rank 0 is on device 1.
    let a = Arc::new(Group::new(streams.clone(), &GroupOptions::default()).unwrap());
    let b = Arc::new(Group::new(vec![streams[1].clone(), streams[0].clone()], &GroupOptions::default()).unwrap());
    const CALLS: u32 = 300;
    let count = 1024;
    let start = Instant::now();
    let run = |group: Arc<Group>, order: [usize; 2]| {
        let s = streams.clone();
        std::thread::spawn(move || {
            // Ranks start from 1 and 2, so after k all-reduces each element
            // is 3 * 2^(k-1): exact in f64, and a lost or repeated call
            // changes it.
            let mut bufs: Vec<CudaSlice<f64>> = (0..2).map(|r| s[order[r]].clone_htod(&vec![(r + 1) as f64; count]).unwrap()).collect();
            for _ in 0..CALLS {
                group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap();
            }
            let want = 3.0 * 2f64.powi(CALLS as i32 - 1);
            for (r, &d) in order.iter().enumerate() {
                let got = s[d].clone_dtoh(&bufs[r]).unwrap();
                assert!(got.iter().all(|&x| x == want), "rank {r}: {:?} instead of {want}", &got[..4]);
            }
        })
    };
    let ta = run(a.clone(), [0, 1]);
    let tb = run(b.clone(), [1, 0]);
    ta.join().expect("group A's thread");
    tb.join().expect("group B's thread");
    eprintln!("  {} all-reduces from two threads in {:?}", 2 * CALLS, start.elapsed());
    a.synchronize().unwrap();
    b.synchronize().unwrap();
}
