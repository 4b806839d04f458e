//! Capturing every rank's stream into one CUDA graph, as a framework that
//! replays its step does, on contexts whose event tracking is off.

use super::gpus;
use cuda_peer::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cuda_peer::cudarc::driver::{CudaContext, CudaGraph, CudaStream};
use std::sync::Arc;

/// Captures `call` (which enqueues on every stream) into one graph: the
/// other streams join `streams[0]`'s capture through an event, and it joins
/// theirs at the end. Panics on any failure.
pub fn capture(streams: &[Arc<CudaStream>], call: impl FnOnce() -> cuda_peer::Result<()>) -> CudaGraph {
    try_capture(streams, || call().map_err(|e| format!("collective under capture: {e}"))).unwrap_or_else(|e| panic!("{e}"))
}

/// [`capture`], returning what failed instead of panicking (for a rank's
/// thread that must still meet its peers).
pub fn try_capture(streams: &[Arc<CudaStream>], call: impl FnOnce() -> Result<(), String>) -> Result<CudaGraph, String> {
    let s0 = &streams[0];
    s0.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(|e| format!("begin capture: {e:?}"))?;
    let mut res: Result<(), String> = s0
        .record_event(None)
        .map_err(|e| format!("fork event: {e:?}"))
        .and_then(|fork| streams[1..].iter().try_for_each(|s| s.wait(&fork).map_err(|e| format!("joining the capture: {e:?}"))));
    res = res.and_then(|()| call());
    for s in &streams[1..] {
        res = res.and_then(|()| s0.join(s).map_err(|e| format!("joining back: {e:?}")));
    }
    // Ended whatever happened, so that a failure reports its first cause.
    let graph = s0.end_capture(CUgraphInstantiate_flags(0));
    res?;
    graph.map_err(|e| format!("end capture / instantiate: {e:?}"))?.ok_or_else(|| "an empty graph".to_string())
}

/// Contexts with event tracking off, for the first `min` devices or more
/// (a captured stream may not wait for events recorded outside the
/// capture; the caller orders its work itself).
pub fn untracked(test: &str, min: usize) -> Option<Vec<Arc<CudaContext>>> {
    let ctxs = gpus(test, min)?;
    for c in &ctxs {
        // SAFETY: these contexts are this test binary's own handles; every
        // buffer is created after this, and the tests order all work
        // themselves (joins and synchronisations).
        unsafe { c.disable_event_tracking() };
    }
    Some(ctxs)
}
