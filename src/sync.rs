//! Stream ordering across contexts, and bounded waits.
//!
//! cudarc tracks each `CudaSlice`'s last read and write with events of the
//! slice's own context, and an event can only be recorded on a stream of its
//! context. When a slice is used by work on a stream of another device (a
//! peer copy, a kernel reading peer memory), this module orders that work
//! after the slice's tracked writes (and reads, for a write), and records the
//! slice's event on a shadow stream of its own context that waits for the
//! work, so the slice's free, which waits for that event, comes after the
//! foreign work too ([`with_read`], [`with_write`]).

use crate::error::{cudarc_err, Result};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Reusable events and a shadow stream for crossings from one context (the
/// slices' home) to another (the working stream's).
#[derive(Debug)]
pub(crate) struct Crossing {
    /// Event in the home context.
    pub(crate) home: CudaEvent,
    /// Event in the working context.
    pub(crate) work: CudaEvent,
    /// A stream of the home context that waits for the foreign work and
    /// carries the slices' read/write events, so that unrelated work queued
    /// on the slices' own streams is never serialised behind it.
    shadow: Arc<CudaStream>,
}

impl Crossing {
    pub(crate) fn new(home: &Arc<CudaContext>, work: &Arc<CudaContext>) -> Result<Self> {
        Ok(Crossing {
            home: home.new_event(None).map_err(cudarc_err("cuEventCreate"))?,
            work: work.new_event(None).map_err(cudarc_err("cuEventCreate"))?,
            shadow: home.new_stream().map_err(cudarc_err("cuStreamCreate"))?,
        })
    }
}

/// Makes `waiter` wait for all work queued so far on `on`, through `event`
/// (which must belong to `on`'s context).
pub(crate) fn wait_for(waiter: &CudaStream, on: &CudaStream, event: &CudaEvent) -> Result<()> {
    if waiter == on {
        return Ok(());
    }
    event.record(on).map_err(cudarc_err("cuEventRecord"))?;
    waiter.wait(event).map_err(cudarc_err("cuStreamWaitEvent"))
}

/// The shared body of [`with_read`] and [`with_write`]; `$ptr` is
/// `device_ptr` or `device_ptr_mut`. The slice's guard lives until the work
/// is enqueued, so the event it records covers the work.
macro_rules! with_access {
    ($slice:ident, $ptr:ident, $work:ident, $crossing:ident, $f:ident) => {{
        let home = $slice.stream().clone();
        if home.context() == $work.context() {
            let (p, _record) = $slice.$ptr($work);
            return $f(p);
        }
        let tracking = home.context().is_event_tracking();
        // `work` waits for the slice's tracked accesses (waiting on another
        // context's event is allowed; recording on it is not, so that guard
        // is forgotten), or for its whole home stream without tracking.
        let (p, record) = $slice.$ptr($work);
        std::mem::forget(record);
        if !tracking {
            wait_for($work, &home, &$crossing.home)?;
        }
        let r = $f(p)?;
        // The shadow stream (home context) waits for the work, then the
        // slice's event is recorded there: the slice's free, which waits for
        // that event, now comes after the foreign work.
        wait_for(&$crossing.shadow, $work, &$crossing.work)?;
        let (_, _record) = $slice.$ptr(&$crossing.shadow);
        Ok(r)
    }};
}

/// Runs `f` with a pointer to `slice` for reading by work that `f` enqueues
/// on `work`, with the ordering described in the module docs.
pub(crate) fn with_read<T, S: DevicePtr<T>, R>(
    slice: &S,
    work: &CudaStream,
    crossing: &Crossing,
    f: impl FnOnce(u64) -> Result<R>,
) -> Result<R> {
    with_access!(slice, device_ptr, work, crossing, f)
}

/// Runs `f` with a pointer to `slice` for writing by work that `f` enqueues
/// on `work`, with the ordering described in the module docs.
pub(crate) fn with_write<T, S: DevicePtrMut<T>, R>(
    slice: &mut S,
    work: &CudaStream,
    crossing: &Crossing,
    f: impl FnOnce(u64) -> Result<R>,
) -> Result<R> {
    with_access!(slice, device_ptr_mut, work, crossing, f)
}

/// Whether work enqueued on `stream` now is being captured into a CUDA
/// graph (`cuStreamIsCapturing`).
pub(crate) fn is_capturing(stream: &CudaStream) -> Result<bool> {
    let status = stream.capture_status().map_err(cudarc_err("cuStreamIsCapturing"))?;
    Ok(status != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Waits until `event` completes, polling, for at most `timeout`.
pub(crate) fn wait_bounded(event: &CudaEvent, op: &'static str, timeout: Duration) -> Result<()> {
    let start = Instant::now();
    let mut nap = Duration::from_micros(20);
    loop {
        if event.try_is_complete().map_err(cudarc_err(op))? {
            return Ok(());
        }
        if start.elapsed() > timeout {
            return Err(crate::Error::Timeout { op, after: timeout });
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(5));
    }
}
