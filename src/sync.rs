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

/// Shared shape of [`with_read`] and [`with_write`]. `ptr_on(stream, keep)`
/// returns the pointer after making `stream` wait for the slice's pending
/// accesses; when `keep` is false the slice's event is not recorded (it
/// would be recorded on a stream of a foreign context, which CUDA refuses).
fn with_access<R>(
    home: &Arc<CudaStream>,
    tracking: bool,
    work: &CudaStream,
    crossing: &Crossing,
    mut ptr_on: impl FnMut(&CudaStream, bool) -> u64,
    f: impl FnOnce(u64) -> Result<R>,
) -> Result<R> {
    if home.context() == work.context() {
        return f(ptr_on(work, true));
    }
    // `work` waits for the slice's tracked accesses (a wait on another
    // context's event is allowed), or for its whole home stream without tracking.
    let ptr = ptr_on(work, false);
    if !tracking {
        wait_for(work, home, &crossing.home)?;
    }
    let r = f(ptr)?;
    // The shadow stream (home context) waits for the work, then the slice's
    // event is recorded there: the slice's free, which waits for that event,
    // now comes after the foreign work.
    wait_for(&crossing.shadow, work, &crossing.work)?;
    ptr_on(&crossing.shadow, true);
    Ok(r)
}

/// Runs `f` with a pointer to `slice` for reading by work that `f` enqueues
/// on `work`, with the ordering described in the module docs.
pub(crate) fn with_read<T, S: DevicePtr<T>, R>(
    slice: &S,
    work: &CudaStream,
    crossing: &Crossing,
    f: impl FnOnce(u64) -> Result<R>,
) -> Result<R> {
    let home = slice.stream().clone();
    let tracking = home.context().is_event_tracking();
    let ptr_on = |s: &CudaStream, keep: bool| {
        let (p, record) = slice.device_ptr(s);
        if !keep {
            std::mem::forget(record);
        }
        p
    };
    with_access(&home, tracking, work, crossing, ptr_on, f)
}

/// Runs `f` with a pointer to `slice` for writing by work that `f` enqueues
/// on `work`, with the ordering described in the module docs.
pub(crate) fn with_write<T, S: DevicePtrMut<T>, R>(
    slice: &mut S,
    work: &CudaStream,
    crossing: &Crossing,
    f: impl FnOnce(u64) -> Result<R>,
) -> Result<R> {
    let home = slice.stream().clone();
    let tracking = home.context().is_event_tracking();
    let ptr_on = |s: &CudaStream, keep: bool| {
        let (p, record) = slice.device_ptr_mut(s);
        if !keep {
            std::mem::forget(record);
        }
        p
    };
    with_access(&home, tracking, work, crossing, ptr_on, f)
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
