//! Stream ordering of callers' buffers, and bounded waits.
//!
//! A caller's buffer is a cudarc slice or view of a context *object*
//! (`Arc<CudaContext>`) that need not be ours: several objects may wrap one
//! CUDA context (every `CudaContext::new(0)` makes a new one), and cudarc
//! keeps its ordering state per object. What that object does decides how
//! work on one of our streams must be ordered with the buffer ([`Tracking`]):
//!
//! - [`Tracking::Events`]: cudarc records the buffer's reads and writes as
//!   events. Our work waits for them, and the buffer's event is recorded
//!   after our work, on our stream where cudarc can (same CUDA context, and
//!   our stream's object tracks events too), else on a shadow stream of the
//!   buffer's own object that waits for our work. The buffer's free waits for
//!   that event, so it comes after our work.
//! - [`Tracking::HomeStream`]: the object tracks events but has made no
//!   stream of its own yet, so cudarc orders every use of the buffer through
//!   its home stream alone (often the legacy default stream) and records
//!   nothing. Our work then waits for the whole home stream, and the home
//!   stream waits for our work: whatever the caller enqueues there next
//!   (reads, writes, the free) comes after it.
//! - [`Tracking::Caller`]: the caller turned event tracking off (an `unsafe`
//!   promise to order work themselves, e.g. for graph capture). Nothing is
//!   added, except that work on another device waits for the buffer's whole
//!   home stream.
//!
//! [`Orderer::read`] and [`Orderer::write`] give the pointer and a [`Held`]
//! guard; dropping the guard (after the work is enqueued) or
//! [`Held::finish`] orders the buffer after the work.

use crate::error::{cudarc_err, Result};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How cudarc orders a buffer of a given context object (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tracking {
    /// Reads and writes are recorded as events.
    Events,
    /// Every use goes through the buffer's home stream (single-stream mode).
    HomeStream,
    /// Event tracking is off: the caller orders the work.
    Caller,
}

/// How cudarc orders buffers of `ctx`.
pub(crate) fn tracking(ctx: &CudaContext) -> Tracking {
    if ctx.is_managing_stream_synchronization() {
        Tracking::Events
    } else if ctx.is_event_tracking() {
        Tracking::HomeStream
    } else {
        Tracking::Caller
    }
}

/// The events and shadow streams one user of callers' buffers (a rank, a
/// link) needs to order them: at most one event per CUDA context, and a
/// few shadow streams (one per foreign context object), made on first need.
#[derive(Debug, Default)]
pub(crate) struct Orderer {
    events: Mutex<Vec<(usize, Arc<CudaEvent>)>>,
    shadows: Mutex<Vec<Arc<CudaStream>>>,
}

/// Shadow streams kept per orderer; the oldest is let go beyond this.
const MAX_SHADOWS: usize = 4;

impl Orderer {
    /// An event of `ctx`'s CUDA context, made on first use. Each use
    /// records and then waits at once, so one event serves every crossing.
    fn event(&self, ctx: &Arc<CudaContext>) -> Result<Arc<CudaEvent>> {
        let key = ctx.cu_ctx() as usize;
        let mut events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, e)) = events.iter().find(|(k, _)| *k == key) {
            return Ok(e.clone());
        }
        let e = Arc::new(ctx.new_event(None).map_err(cudarc_err("cuEventCreate"))?);
        events.push((key, e.clone()));
        Ok(e)
    }

    /// A stream of the context object `ctx` itself (so that cudarc records
    /// a buffer's events there), made on first use.
    fn shadow(&self, ctx: &Arc<CudaContext>) -> Result<Arc<CudaStream>> {
        let mut shadows = self.shadows.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = shadows.iter().find(|s| Arc::ptr_eq(s.context(), ctx)) {
            return Ok(s.clone());
        }
        let s = ctx.new_stream().map_err(cudarc_err("cuStreamCreate"))?;
        if shadows.len() >= MAX_SHADOWS {
            shadows.remove(0);
        }
        shadows.push(s.clone());
        Ok(s)
    }

    /// Waits on the host for the last work each of this orderer's events
    /// was recorded after.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        for (_, e) in events.iter() {
            e.synchronize().map_err(cudarc_err("cuEventSynchronize"))?;
        }
        Ok(())
    }

    /// The pointer of `slice` for reading by work that the caller then
    /// enqueues on `work`, after the slice's pending writers; the guard
    /// orders the slice after that work (module docs).
    pub(crate) fn read<'a, T, S: DevicePtr<T>>(&'a self, slice: &'a S, work: &'a CudaStream) -> Result<(u64, Held<'a>)> {
        let mode = tracking(slice.stream().context());
        if cudarc_orders(slice.stream(), work, mode) {
            let (p, guard) = slice.device_ptr(work);
            return Ok((p, Held(Some(After::Cudarc { _guard: guard }))));
        }
        let home = slice.stream().clone();
        self.before(&home, work, mode)?;
        // The waits cudarc makes here (on the slice's write event, across
        // contexts too) are wanted; its guard would record the slice's event
        // on `work`, which `after` does where it can be done.
        let (p, guard) = slice.device_ptr(work);
        std::mem::forget(guard);
        let after = self.after(home, work, mode, Box::new(move |s: &CudaStream| drop(slice.device_ptr(s))))?;
        Ok((p, after))
    }

    /// As [`Self::read`], for writing: the work waits for the slice's
    /// pending readers and writers.
    pub(crate) fn write<'a, T, S: DevicePtrMut<T>>(&'a self, slice: &'a mut S, work: &'a CudaStream) -> Result<(u64, Held<'a>)> {
        let mode = tracking(slice.stream().context());
        if cudarc_orders(slice.stream(), work, mode) {
            let (p, guard) = slice.device_ptr_mut(work);
            return Ok((p, Held(Some(After::Cudarc { _guard: guard }))));
        }
        let home = slice.stream().clone();
        self.before(&home, work, mode)?;
        let (p, guard) = slice.device_ptr_mut(work);
        std::mem::forget(guard);
        let after = self.after(home, work, mode, Box::new(move |s: &CudaStream| drop(slice.device_ptr_mut(s))))?;
        Ok((p, after))
    }

    /// The whole-stream wait of `work` for `home`, where the mode needs one.
    fn before(&self, home: &Arc<CudaStream>, work: &CudaStream, mode: Tracking) -> Result<()> {
        let needed = match mode {
            Tracking::Events => false,
            Tracking::HomeStream => true,
            Tracking::Caller => !same_context(home, work),
        };
        if needed && **home != *work {
            wait_for(work, home, &*self.event(home.context())?)?;
        }
        Ok(())
    }

    /// The guard that orders the slice after the work (module docs).
    fn after<'a>(&self, home: Arc<CudaStream>, work: &'a CudaStream, mode: Tracking, record: Box<dyn FnOnce(&CudaStream) + 'a>) -> Result<Held<'a>> {
        Ok(Held(match mode {
            Tracking::Events => {
                let shadow = self.shadow(home.context())?;
                Some(After::Shadow { work, event: self.event(work.context())?, shadow, record })
            }
            Tracking::HomeStream if *home != *work => Some(After::HomeWaits { work, event: self.event(work.context())?, home }),
            _ => None,
        }))
    }
}

/// Whether cudarc's own guard orders a buffer of `home` with work on
/// `work`: it tracks events, and records them on `work` (same CUDA
/// context, and `work`'s object tracks events too).
fn cudarc_orders(home: &CudaStream, work: &CudaStream, mode: Tracking) -> bool {
    mode == Tracking::Events && same_context(home, work) && work.context().is_managing_stream_synchronization()
}

/// Whether two streams' context objects wrap the same CUDA context.
fn same_context(a: &CudaStream, b: &CudaStream) -> bool {
    a.context().cu_ctx() == b.context().cu_ctx()
}

/// Orders a caller's buffer after the work enqueued while it was held
/// ([`Orderer::read`], [`Orderer::write`]): on drop, or by [`Held::finish`]
/// with its error.
#[must_use]
pub(crate) struct Held<'a>(Option<After<'a>>);

/// What a [`Held`] does.
enum After<'a> {
    /// cudarc's own guard records the slice's event on the work stream.
    Cudarc { _guard: SyncOnDrop<'a> },
    /// The shadow stream waits for the work, then the slice's event is
    /// recorded on it by `record`.
    Shadow { work: &'a CudaStream, event: Arc<CudaEvent>, shadow: Arc<CudaStream>, record: Box<dyn FnOnce(&CudaStream) + 'a> },
    /// The slice's home stream waits for the work.
    HomeWaits { work: &'a CudaStream, event: Arc<CudaEvent>, home: Arc<CudaStream> },
}

impl Held<'_> {
    /// Orders the slice after the work now, with the driver's error.
    pub(crate) fn finish(mut self) -> Result<()> {
        self.order()
    }

    fn order(&mut self) -> Result<()> {
        match self.0.take() {
            None | Some(After::Cudarc { .. }) => Ok(()),
            Some(After::Shadow { work, event, shadow, record }) => {
                wait_for(&shadow, work, &event)?;
                record(&shadow);
                Ok(())
            }
            Some(After::HomeWaits { work, event, home }) => wait_for(&home, work, &event),
        }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.order() {
            log::warn!("ordering a buffer after cuda-peer's work: {e}");
        }
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
/// on `work`, ordered as the module docs say.
pub(crate) fn with_read<T, S: DevicePtr<T>, R>(slice: &S, work: &CudaStream, order: &Orderer, f: impl FnOnce(u64) -> Result<R>) -> Result<R> {
    let (p, held) = order.read(slice, work)?;
    let r = f(p)?;
    held.finish()?;
    Ok(r)
}

/// Runs `f` with a pointer to `slice` for writing by work that `f` enqueues
/// on `work`, ordered as the module docs say.
pub(crate) fn with_write<T, S: DevicePtrMut<T>, R>(slice: &mut S, work: &CudaStream, order: &Orderer, f: impl FnOnce(u64) -> Result<R>) -> Result<R> {
    let (p, held) = order.write(slice, work)?;
    let r = f(p)?;
    held.finish()?;
    Ok(r)
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
            return Err(crate::error::Error::Timeout { op, after: timeout });
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(5));
    }
}
