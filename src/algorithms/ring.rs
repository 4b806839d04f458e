//! The ring engine: how each rank pulls from its ring predecessor over the
//! route opened for that pair, the lockstep runner of ring schedules
//! (`steps[k][r]`, built by [`super::schedule`]), and the ring all-reduce.
//!
//! Where P2P is verified (or both ranks share a device) a pull is a peer
//! load (a fused reduce kernel reading the predecessor's memory) or a peer
//! copy; elsewhere it goes through the route's staging buffers, chunk by
//! chunk.
//!
//! A rank's memory is read by its successor's pulls, on the successor's
//! stream (and, over a staged route, on that route's staging stream). When
//! [`run`] returns, with its result or with an error part way through a
//! schedule, each rank's stream is ordered after every such read already
//! enqueued ([`settle`]), so that what the caller enqueues on a rank's
//! stream next (its buffers' guards, then perhaps their free) comes after
//! them.

use super::common::{prescale_all, Algorithm, AllReduce};
use super::schedule::{self, Action};
use crate::communicator::Communicator;
use crate::copy::route::{copy_direct, Direct, Route};
use crate::copy::staged::Start;
use crate::driver::{api, raw_stream};
use crate::dtype::{DType, ReduceOp};
use crate::error::{check, cudarc_err, Result};
use crate::kernels::KernelOp;
use crate::sync::wait_for;
use cudarc::driver::{CudaSlice, CudaStream};
use std::ops::Range;

/// One rank's work in one step, on raw device addresses.
#[derive(Debug, Clone, Copy)]
pub(crate) enum PullOp {
    /// `dst[i] = pred[i] op own[i]` for `count` elements of `dtype`.
    Reduce { dst: u64, pred: u64, own: u64, count: usize },
    /// `dst[..bytes] = pred[..bytes]`.
    Copy { dst: u64, pred: u64, bytes: usize },
}

/// Runs one rank's pull from its predecessor on its stream, over the route's path.
fn pull(comm: &Communicator, r: usize, op: KernelOp, dtype: DType, what: PullOp) -> Result<()> {
    let entry = &comm.routes.ring[r];
    let rank = &comm.ranks[r];
    let stream = &rank.stream;
    match (&entry.route, what) {
        (Route::Local | Route::P2p, PullOp::Reduce { dst, pred: p, own, count }) => comm.launch_reduce2(r, op, dtype, dst, p, own, count),
        (Route::Local, PullOp::Copy { dst, pred: p, bytes }) => comm.local_copy(r, dst, p, bytes),
        (Route::P2p, PullOp::Copy { dst, pred: p, bytes }) => {
            let pred = &comm.ranks[(r + comm.size() - 1) % comm.size()];
            // SAFETY: `p` holds `bytes` bytes on the predecessor's device,
            // `dst` on ours; peer access between them is enabled and held by
            // the group, as are both contexts.
            unsafe { copy_direct(Direct::Peer, dst, &rank.ctx, p, &pred.ctx, bytes, stream) }
        }
        (Route::Staged(staged), PullOp::Copy { dst, pred: p, bytes }) => staged.staging.copy(dst, p, bytes, stream, Start::Ordered),
        (Route::Staged(staged), PullOp::Reduce { dst, pred: p, own, count }) => {
            let esz = dtype.size() as u64;
            let sp = scratch_ptr(&staged.scratch, stream);
            let h2d = raw_stream(stream);
            staged.staging.transfer(p, count * dtype.size(), stream, Start::Ordered, |host, off, len| {
                // SAFETY: the scratch holds one chunk (>= len bytes)
                // and is consumed by the kernel below, in stream order.
                check("cuMemcpyHtoDAsync", unsafe { api()?.cuMemcpyHtoDAsync_v2(sp, host.cast(), len, h2d) })?;
                let o = off as u64;
                comm.launch_reduce2(r, op, dtype, dst + o, sp, own + o, len / esz as usize)
            })
        }
    }
}

/// Records rank r's step event after the work enqueued on its stream.
fn record(comm: &Communicator, r: usize) -> Result<()> {
    comm.ranks[r].done.record(&comm.ranks[r].stream).map_err(cudarc_err("cuEventRecord"))
}

/// Makes rank r's stream wait for rank `on`'s step event.
fn wait(comm: &Communicator, r: usize, on: usize) -> Result<()> {
    if r == on {
        return Ok(());
    }
    comm.ranks[r].stream.wait(&comm.ranks[on].done).map_err(cudarc_err("cuStreamWaitEvent"))
}

/// Keeps the first error.
fn keep_first(first: &mut Result<()>, r: Result<()>) {
    if first.is_ok() {
        *first = r;
    }
}

/// Runs a schedule: `steps[k][r]` is rank r's work at step k. Ranks
/// advance in lockstep with their two ring neighbours (events only; no
/// host synchronisation). Before the first step, each rank's stream has
/// already been ordered after its buffers' writers by the caller. When it
/// returns, each rank's stream is ordered after every pull enqueued that
/// reads from it ([`settle`]): after the last step as after an error part
/// way through, whose first error is returned.
pub(crate) fn run(comm: &Communicator, op: KernelOp, dtype: DType, steps: &[Vec<Option<PullOp>>]) -> Result<()> {
    let enqueued = run_steps(comm, op, dtype, steps);
    let settled = match (&enqueued, steps.is_empty()) {
        (Ok(()), true) => Ok(()),
        (Ok(()), false) => settle(comm, false),
        (Err(_), _) => settle(comm, true),
    };
    enqueued.and(settled)
}

/// The lockstep of [`run`], up to its first error.
#[allow(clippy::needless_range_loop)] // r indexes ranks, routes and the step alike
fn run_steps(comm: &Communicator, op: KernelOp, dtype: DType, steps: &[Vec<Option<PullOp>>]) -> Result<()> {
    let n = comm.size();
    for r in 0..n {
        record(comm, r)?;
    }
    for step in steps {
        for r in 0..n {
            let (pred, succ) = ((r + n - 1) % n, (r + 1) % n);
            wait(comm, r, pred)?;
            if succ != pred {
                wait(comm, r, succ)?;
            }
            // A staged pull's device-to-host side runs on the predecessor's
            // device and needs only the predecessor's previous step.
            if let (Some(_), Some(staged)) = (step[r], comm.routes.ring[r].staged()) {
                staged.staging.d2h.wait(&comm.ranks[pred].done).map_err(cudarc_err("cuStreamWaitEvent"))?;
            }
        }
        for r in 0..n {
            if let Some(what) = step[r] {
                pull(comm, r, op, dtype, what)?;
            }
            record(comm, r)?;
        }
    }
    Ok(())
}

/// The waits that end a schedule, `(r, succ)`: each rank's stream waits for
/// its successor's, which may still read from it (none for a rank that is
/// its own successor).
fn successor_waits(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n).map(move |r| (r, (r + 1) % n)).filter(|&(r, succ)| r != succ)
}

/// Orders each rank's stream after every pull enqueued so far that reads
/// the rank's memory: its successor's stream (through the successor's step
/// event) and, `after_error`, the staging stream of a staged route from it
/// (a transfer that failed part way may have left device-to-host copies
/// that the successor's stream never waited for). After a complete
/// schedule the step events recorded after the last step say it all; after
/// an error, each stream's latest work is recorded first, since the
/// lockstep stopped part way. Where recording or waiting fails, the host
/// waits for that stream instead (`cuStreamSynchronize`), so that either
/// way no read of a rank's memory is left unordered before the rank's
/// stream; should that wait fail too, the driver can neither order nor
/// wait, and its error is all that is left to return. Returns the first
/// error.
#[allow(clippy::needless_range_loop)] // r indexes ranks, routes and `recorded` alike
fn settle(comm: &Communicator, after_error: bool) -> Result<()> {
    let n = comm.size();
    let mut first = Ok(());
    let mut recorded = vec![true; n];
    if after_error {
        for r in 0..n {
            let rank = &comm.ranks[r];
            let succ = (r + 1) % n;
            if let (true, Some(staged)) = (succ != r, comm.routes.ring[succ].staged()) {
                // The route from r stages through r's device: its staging
                // stream and r's step event share r's context.
                let d2h = &staged.staging.d2h;
                if let Err(e) = wait_for(&rank.stream, d2h, &rank.done) {
                    keep_first(&mut first, Err(e));
                    keep_first(&mut first, d2h.synchronize().map_err(cudarc_err("cuStreamSynchronize")));
                }
            }
            if let Err(e) = record(comm, r) {
                recorded[r] = false;
                keep_first(&mut first, Err(e));
            }
        }
    }
    for (r, succ) in successor_waits(n) {
        let ordered = recorded[succ]
            && match wait(comm, r, succ) {
                Ok(()) => true,
                Err(e) => {
                    keep_first(&mut first, Err(e));
                    false
                }
            };
        if !ordered {
            keep_first(&mut first, comm.ranks[succ].stream.synchronize().map_err(cudarc_err("cuStreamSynchronize")));
        }
    }
    first
}

fn scratch_ptr(scratch: &CudaSlice<u8>, stream: &CudaStream) -> u64 {
    use cudarc::driver::DevicePtr;
    let (p, _record) = scratch.device_ptr(stream);
    p
}

/// `count` elements of `dtype` in `parts` segments, each aligned to 16 bytes.
pub(crate) fn segments(dtype: DType, count: usize, parts: usize) -> Vec<Range<usize>> {
    schedule::partition(count, parts, 16 / dtype.size())
}

/// The ring all-reduce: reduce-scatter then all-gather over the ring
/// routes, where over P2P each step is one fused kernel reading the
/// predecessor's memory.
pub(crate) struct Ring;

impl AllReduce for Ring {
    /// The ring applies to every group and needs nothing opened.
    fn open(_comm: &Communicator, _request: Algorithm) -> Result<Option<Ring>> {
        Ok(Some(Ring))
    }

    fn enqueue(&self, comm: &Communicator, op: ReduceOp, dtype: DType, src: &[u64], dst: &[u64], count: usize) -> Result<()> {
        // Checked before anything is written, so that a refusal leaves
        // every output as it was.
        comm.check_reach("all_reduce (ring)", dst, false)?;
        for r in 0..comm.size() {
            if src[r] != dst[r] {
                comm.local_copy(r, dst[r], src[r], count * dtype.size())?;
            }
        }
        all_reduce_in_place(comm, op, dtype, dst, count)
    }
}

/// The ring all-reduce of `ptrs` in place.
fn all_reduce_in_place(comm: &Communicator, op: ReduceOp, dtype: DType, ptrs: &[u64], count: usize) -> Result<()> {
    let n = comm.size();
    let (op, _) = prescale_all(comm, op, dtype, ptrs, ptrs, count)?;
    let esz = dtype.size() as u64;
    let segs = segments(dtype, count, n);
    let steps: Vec<Vec<Option<PullOp>>> = schedule::all_reduce(n)
        .into_iter()
        .map(|step| {
            (0..n)
                .map(|r| {
                    let pred = (r + n - 1) % n;
                    let seg = &segs[step[r].part()];
                    let off = seg.start as u64 * esz;
                    (!seg.is_empty()).then(|| match step[r] {
                        Action::Reduce(_) => PullOp::Reduce { dst: ptrs[r] + off, pred: ptrs[pred] + off, own: ptrs[r] + off, count: seg.len() },
                        Action::Copy(_) => PullOp::Copy { dst: ptrs[r] + off, pred: ptrs[pred] + off, bytes: seg.len() * esz as usize },
                    })
                })
                .collect()
        })
        .collect();
    run(comm, KernelOp::of(op), dtype, &steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_waits_for_its_successor_but_not_for_itself() {
        assert_eq!(successor_waits(1).count(), 0);
        assert_eq!(successor_waits(2).collect::<Vec<_>>(), vec![(0, 1), (1, 0)]);
        assert_eq!(successor_waits(4).collect::<Vec<_>>(), vec![(0, 1), (1, 2), (2, 3), (3, 0)]);
    }

    #[test]
    fn the_first_error_is_kept() {
        let mut first = Ok(());
        keep_first(&mut first, Ok(()));
        assert_eq!(first, Ok(()));
        keep_first(&mut first, Err(crate::error::Error::driver("cuMemcpyPeerAsync", 999)));
        keep_first(&mut first, Err(crate::error::Error::driver("cuStreamSynchronize", 999)));
        keep_first(&mut first, Ok(()));
        assert!(matches!(first, Err(crate::error::Error::Driver { op: "cuMemcpyPeerAsync", .. })), "{first:?}");
    }
}
