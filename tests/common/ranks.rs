//! Ranks of the per-rank `Comm` as threads of the test: their streams,
//! one thread per rank, and the lock that keeps one such test on the
//! device at a time.

use cuda_peer::cudarc::driver::{CudaContext, CudaStream};
use cuda_peer::{Comm, CommOptions};
use std::sync::{Arc, Mutex, MutexGuard};

/// `n` streams over the devices present, round robin.
pub fn streams(ctxs: &[Arc<CudaContext>], n: usize) -> Vec<Arc<CudaStream>> {
    (0..n).map(|r| ctxs[r % ctxs.len()].new_stream().expect("stream")).collect()
}

/// Runs `f(rank, comm)` on one thread per rank, all at once, and returns
/// what each gave (`cuda_peer::Comm`s, or the compat module's).
pub fn each<C: Sync, R: Send>(comms: &[C], f: impl Fn(usize, &C) -> R + Sync) -> Vec<R> {
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

/// Held by every GPU test of a binary for its whole run: the tests run one
/// at a time on the device (a communicator's kernels wait for each other
/// on the GPU; another test's kernels beside them could keep a rank's from
/// being resident until the barrier timeout).
pub fn exclusive() -> MutexGuard<'static, ()> {
    static GPU: Mutex<()> = Mutex::new(());
    GPU.lock().unwrap_or_else(|p| p.into_inner())
}

/// One per-rank `Comm` per stream, each made on a thread of its own through
/// its own `ThreadExchange` with `opts`: each rank's own outcome
/// (`Comm::from_devices_with` returns only the first error).
pub fn made_each(streams: &[Arc<CudaStream>], opts: &CommOptions) -> Vec<cuda_peer::Result<Comm>> {
    let exchanges = cuda_peer::ipc::ThreadExchange::new(streams.len(), opts.timeout).expect("thread exchanges");
    std::thread::scope(|s| {
        let hs: Vec<_> =
            streams.iter().cloned().zip(exchanges).map(|(stream, ex)| s.spawn(move || Comm::from_exchange(stream, Box::new(ex), opts))).collect();
        hs.into_iter().map(|h| h.join().expect("a rank's thread")).collect()
    })
}
