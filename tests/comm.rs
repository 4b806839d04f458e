//! The per-rank communicator, `cuda_peer::Comm`: ranks that are threads of
//! this process (`Comm::from_devices`, `Comm::from_rank` with an `Id`),
//! each on its own stream, with ranks sharing one GPU where only one is
//! present.

mod common;

use common::gpus;
use cuda_peer::cudarc::driver::CudaStream;
use cuda_peer::{Comm, ReduceOp};
use rand::Rng;
use std::sync::Arc;

/// `n` streams over the devices present, round robin.
fn streams(ctxs: &[Arc<cuda_peer::cudarc::driver::CudaContext>], n: usize) -> Vec<Arc<CudaStream>> {
    (0..n).map(|r| ctxs[r % ctxs.len()].new_stream().expect("stream")).collect()
}

/// Runs `f(rank, comm)` on one thread per rank and returns what each gave.
fn each<R: Send>(comms: &[Comm], f: impl Fn(usize, &Comm) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                let f = &f;
                s.spawn(move || f(r, c))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("a rank's thread")).collect()
    })
}

/// An all-reduce of fresh random u32 (sum, exact) on 2, 3 and 4 ranks,
/// every rank's result against the CPU reference, into a poisoned output.
#[test]
fn threads_all_reduce_against_the_cpu_reference() {
    let Some(ctxs) = gpus("threads_all_reduce_against_the_cpu_reference", 1) else { return };
    for n in [2usize, 3, 4] {
        let comms = Comm::from_devices(streams(&ctxs, n)).expect("from_devices");
        for count in [1usize, 1000, 65_537, 1 << 20] {
            let inputs: Vec<Vec<u32>> = (0..n).map(|_| (0..count).map(|_| rand::rng().random()).collect()).collect();
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
