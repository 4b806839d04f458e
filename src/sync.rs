//! Stream ordering across contexts, and bounded waits.
//!
//! cudarc tracks each `CudaSlice`'s last read and write with events of the
//! slice's own context, and an event can only be recorded on a stream of its
//! context. When a slice is used by work on a stream of another device (a
//! peer copy, a kernel reading peer memory), this module orders that work
//! after everything queued on the slice's own stream, and orders the slice's
//! stream after the work, so the slice's read/write events (and its free,
//! which waits for them) cover the foreign work too ([`with_read`],
//! [`with_write`]).

use crate::error::{cudarc_err, Result};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A reusable pair of events for one ordered crossing between two contexts.
#[derive(Debug)]
pub(crate) struct Crossing {
    /// Event in the slice's (home) context.
    pub(crate) home: CudaEvent,
    /// Event in the working stream's context.
    pub(crate) work: CudaEvent,
}

impl Crossing {
    pub(crate) fn new(home: &Arc<CudaContext>, work: &Arc<CudaContext>) -> Result<Self> {
        Ok(Crossing {
            home: home.new_event(None).map_err(cudarc_err("cuEventCreate"))?,
            work: work.new_event(None).map_err(cudarc_err("cuEventCreate"))?,
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

/// Runs `f` with a pointer to `slice` for reading by work that `f` enqueues
/// on `work`, with the ordering described in the module docs.
pub(crate) fn with_read<T, S: DevicePtr<T>, R>(
    slice: &S,
    work: &CudaStream,
    crossing: &Crossing,
    f: impl FnOnce(u64) -> Result<R>,
) -> Result<R> {
    let home = slice.stream().clone();
    if home.context() == work.context() {
        let (ptr, _record) = slice.device_ptr(work);
        return f(ptr);
    }
    let (ptr, _record) = slice.device_ptr(&home);
    wait_for(work, &home, &crossing.home)?;
    let r = f(ptr)?;
    wait_for(&home, work, &crossing.work)?;
    Ok(r)
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
    if home.context() == work.context() {
        let (ptr, _record) = slice.device_ptr_mut(work);
        return f(ptr);
    }
    let (ptr, _record) = slice.device_ptr_mut(&home);
    wait_for(work, &home, &crossing.home)?;
    let r = f(ptr)?;
    wait_for(&home, work, &crossing.work)?;
    Ok(r)
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
