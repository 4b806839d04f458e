//! The ring engine: how each rank pulls from its ring predecessor over the
//! route opened for that pair, the lockstep runner of ring schedules
//! (`steps[k][r]`, built by [`super::schedule`]), and the ring all-reduce.
//!
//! Where P2P is verified (or both ranks share a device) a pull is a peer
//! load (a fused reduce kernel reading the predecessor's memory) or a peer
//! copy; elsewhere it goes through the route's staging buffers, chunk by
//! chunk.

use super::schedule::{self, Action};
use super::{divide, Algorithm, AllReduce};
use crate::communicator::Communicator;
use crate::copy::route::{copy_direct, Direct, Route};
use crate::copy::staged::Start;
use crate::driver::{api, raw_stream};
use crate::dtype::{DType, ReduceOp};
use crate::error::{check, cudarc_err, Result};
use crate::kernels::KernelOp;
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

/// Runs a schedule: `steps[k][r]` is rank r's work at step k. Ranks
/// advance in lockstep with their two ring neighbours (events only; no
/// host synchronisation). Before the first step, each rank's stream has
/// already been ordered after its buffers' writers by the caller; after
/// the last, each rank waits for its successor, which may still read
/// from it.
#[allow(clippy::needless_range_loop)] // r indexes ranks, routes and the step alike
pub(crate) fn run(comm: &Communicator, op: KernelOp, dtype: DType, steps: &[Vec<Option<PullOp>>]) -> Result<()> {
    let n = comm.size();
    let rec = |r: usize| comm.ranks[r].done.record(&comm.ranks[r].stream).map_err(cudarc_err("cuEventRecord"));
    let wait = |r: usize, on: usize| {
        if r == on {
            return Ok(());
        }
        comm.ranks[r].stream.wait(&comm.ranks[on].done).map_err(cudarc_err("cuStreamWaitEvent"))
    };
    for r in 0..n {
        rec(r)?;
    }
    for step in steps {
        for r in 0..n {
            let (pred, succ) = ((r + n - 1) % n, (r + 1) % n);
            wait(r, pred)?;
            if succ != pred {
                wait(r, succ)?;
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
            rec(r)?;
        }
    }
    if !steps.is_empty() {
        for r in 0..n {
            wait(r, (r + 1) % n)?;
        }
    }
    Ok(())
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
        for r in 0..comm.size() {
            if src[r] != dst[r] {
                comm.local_copy(r, dst[r], src[r], count * dtype.size())?;
            }
        }
        comm.check_reach("all_reduce (ring)", dst, false)?;
        all_reduce_in_place(comm, op, dtype, dst, count)
    }
}

/// The ring all-reduce of `ptrs` in place.
fn all_reduce_in_place(comm: &Communicator, op: ReduceOp, dtype: DType, ptrs: &[u64], count: usize) -> Result<()> {
    let n = comm.size();
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
    run(comm, KernelOp::of(op), dtype, &steps)?;
    divide(comm, op, dtype, ptrs, count, 0..n)
}
