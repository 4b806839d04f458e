//! Device helpers: buffers, checking an output, timing with CUDA events,
//! graph capture.

use crate::data::{check_windows, par_count, par_vec, BenchElem, Inputs};
use crate::exit::Res;
use crate::kinds::Op;
use cuda_peer::cudarc::driver::{sys as cu, CudaContext, CudaGraph, CudaSlice, CudaStream, DevicePtrMut};
use cuda_peer::driver;
use std::sync::Arc;

/// Waits until every stream is idle.
pub(crate) fn sync_all(streams: &[Arc<CudaStream>]) -> Res<()> {
    for s in streams {
        s.synchronize()?;
    }
    Ok(())
}

/// A buffer of `len` elements filled with NaN (0x7FC0 in every 16-bit half
/// is a NaN both as f32 and as bf16).
pub(crate) fn poisoned<T: BenchElem>(stream: &Arc<CudaStream>, len: usize) -> Res<CudaSlice<T>> {
    // SAFETY: every byte is written by the memset below before anything reads it.
    let mut buf = unsafe { stream.alloc::<T>(len) }?;
    stream.context().bind_to_thread()?;
    let bytes = buf.num_bytes();
    {
        let (ptr, _record) = buf.device_ptr_mut(stream);
        // SAFETY: `ptr` holds `bytes` bytes (an even number) on this stream's device.
        unsafe { cu::cuMemsetD16Async(ptr, 0x7FC0, bytes / 2, stream.cu_stream()) }.result()?;
    }
    Ok(buf)
}

/// Rank `rank`'s inputs, `len` elements, on its device.
pub(crate) fn upload<T: BenchElem>(stream: &Arc<CudaStream>, inputs: &Inputs, rank: usize, len: usize) -> Res<CudaSlice<T>> {
    let host = par_vec(len, |i| T::from_int(inputs.value(rank, i)));
    Ok(stream.clone_htod(&host)?)
}

/// Compares rank `rank`'s output `out` (on its `stream`) of `op` over
/// `ranks` ranks with the reference (`block`: the per-rank block of
/// reduce_scatter and all_gather). Returns the number of wrong elements and
/// whether only windows were checked.
pub(crate) fn check_output<T: BenchElem>(
    stream: &Arc<CudaStream>,
    out: &CudaSlice<T>,
    inputs: &Inputs,
    op: Op,
    ranks: usize,
    block: usize,
    rank: usize,
) -> Res<(u64, bool)> {
    let windows = check_windows(out.len(), std::mem::size_of::<T>());
    let sampled = windows.len() > 1;
    let mut wrong = 0;
    for w in windows {
        let got = stream.clone_dtoh(&out.slice(w.clone()))?;
        wrong += par_count(got.len(), |k| got[k].to_f64() != inputs.expected(op, ranks, block, rank, w.start + k) as f64);
    }
    Ok((wrong, sampled))
}

/// Mean microseconds per call of `iters` back-to-back `call()`s after
/// `warmup` ones: an event on `streams[0]` that the other streams wait for
/// before the calls, and one after `streams[0]` has joined them.
pub(crate) fn time_calls(streams: &[Arc<CudaStream>], warmup: usize, iters: usize, mut call: impl FnMut() -> Res<()>) -> Res<f64> {
    for _ in 0..warmup {
        call()?;
    }
    sync_all(streams)?;
    let ctx0 = streams[0].context();
    let start = ctx0.new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))?;
    let end = ctx0.new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))?;
    start.record(&streams[0])?;
    for s in &streams[1..] {
        s.wait(&start)?;
    }
    for _ in 0..iters {
        call()?;
    }
    for s in &streams[1..] {
        streams[0].join(s)?;
    }
    end.record(&streams[0])?;
    let ms = start.elapsed_ms(&end)?;
    sync_all(streams)?;
    Ok(ms as f64 * 1e3 / iters as f64)
}

/// Calls per graph in `--graph` mode (fewer where a point times fewer calls).
pub(crate) const GRAPH_CALLS: usize = 20;

/// `calls` calls of `call` captured into one graph launched on `streams[0]`:
/// the other streams join the capture through an event recorded there, and
/// it joins them back at the end.
pub(crate) fn capture(streams: &[Arc<CudaStream>], calls: usize, mut call: impl FnMut() -> Res<()>) -> Res<CudaGraph> {
    let s0 = &streams[0];
    s0.begin_capture(cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let mut res: Res<()> = s0.record_event(None).map_err(Into::into).and_then(|fork| {
        for s in &streams[1..] {
            s.wait(&fork)?;
        }
        Ok(())
    });
    for _ in 0..calls {
        res = res.and_then(|()| call());
    }
    for s in &streams[1..] {
        res = res.and_then(|()| Ok(s0.join(s)?));
    }
    // The capture is ended whatever happened, so the stream is usable again.
    let graph = s0.end_capture(cu::CUgraphInstantiate_flags(0));
    res.map_err(|e| format!("under graph capture: {e}"))?;
    Ok(graph?.ok_or("the capture recorded nothing")?)
}

/// Every device's context; in `--graph` mode (`graph`) with cudarc's event
/// tracking turned off before any buffer exists.
pub(crate) fn contexts(graph: bool) -> Res<Vec<Arc<CudaContext>>> {
    let ctxs = driver::all_contexts()?;
    if graph {
        for c in &ctxs {
            // SAFETY: no buffer of these contexts exists yet; the benchmark
            // orders its own work (joins and synchronisations around every
            // timed run and every check).
            unsafe { c.disable_event_tracking() };
        }
    }
    Ok(ctxs)
}
