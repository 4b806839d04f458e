//! CUDA graph captures: which graph a stream is capturing into, keeping
//! what a captured call uses (slots, flags, pinned buffers, scratch, peer
//! access) alive for as long as the graph can be launched, and putting a
//! rank's calls and the replays of its captured calls in one order
//! ([`CallOrder`]).
//!
//! The driver's mechanism for keeping things alive is a *user object* owned
//! by the graph (`cuUserObjectCreate`, `cuGraphRetainUserObject`):
//! executable graphs instantiated from it own it too, and the driver calls
//! its destructor once the last graph is destroyed and its last launch has
//! finished. The destructor may not call CUDA, so it hands the resources to
//! a thread of ours that drops them (their `Drop`s free memory through the
//! driver).

use crate::driver::{api, bind, raw_event, raw_stream, Busy};
use crate::error::{check, cudarc_err, Result};
use cuda_peer_sys as sys;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use std::any::Any;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Mutex, OnceLock};

/// What a captured call needs to outlive it, and a context to make current
/// while it is dropped (its `Drop`s free memory through the driver, which
/// needs a current context; the release thread has none of its own).
pub(crate) struct KeepAlive {
    /// Made current on the release thread before `payload` is dropped.
    pub(crate) ctx: Arc<CudaContext>,
    /// The resources.
    pub(crate) payload: Arc<dyn Any + Send + Sync>,
}

/// How many keep-alives graphs have taken, and how many the release thread
/// has dropped (for tests: [`crate::group::graph_keep_alives`]).
pub(crate) static RETAINED: AtomicU64 = AtomicU64::new(0);
pub(crate) static RELEASED: AtomicU64 = AtomicU64::new(0);

impl KeepAlive {
    /// Drops the payload with `ctx` current.
    fn release(self) {
        RELEASED.fetch_add(1, Relaxed);
        if let Err(e) = self.ctx.bind_to_thread() {
            log::warn!("cuda-peer: releasing what a graph kept alive: cannot make GPU{}'s context current: {e:?}", self.ctx.ordinal());
        }
        drop(self.payload);
    }
}

/// The capture `stream` is in, if any: its id and graph.
pub(crate) fn capture_of(stream: &CudaStream) -> Result<Option<(u64, sys::CUgraph)>> {
    let api = api()?;
    bind(stream.context())?;
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let (mut id, mut graph) = (0u64, std::ptr::null_mut());
    // SAFETY: the stream is alive (we hold it) and its context is current;
    // the driver writes the status, the id and the graph handle, and is
    // told (null) not to return the dependency list.
    check("cuStreamGetCaptureInfo", unsafe {
        api.cuStreamGetCaptureInfo_v2(raw_stream(stream), &mut status, &mut id, &mut graph, std::ptr::null_mut(), std::ptr::null_mut())
    })?;
    Ok((status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE && !graph.is_null()).then_some((id, graph)))
}

/// The latest captures an owner's calls went into (a communicator's), each
/// of which holds one [`KeepAlive`] of the owner's: a call captured into a
/// graph makes the graph hold what it touches once, however many calls the
/// capture takes.
#[derive(Debug, Default)]
pub(crate) struct Captures(Mutex<Vec<u64>>);

impl Captures {
    /// How many captures are remembered (a capture forgotten and seen again
    /// takes a second keep-alive, which is harmless).
    const REMEMBERED: usize = 16;

    /// Where `stream` is capturing into a graph, makes the graph hold
    /// `keep()` (once per capture); returns whether it is capturing.
    pub(crate) fn hold(&self, stream: &CudaStream, keep: impl FnOnce() -> KeepAlive) -> Result<bool> {
        let Some((id, graph)) = capture_of(stream)? else { return Ok(false) };
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if !seen.contains(&id) {
            retain(graph, keep())?;
            if seen.len() >= Self::REMEMBERED {
                seen.remove(0);
            }
            seen.push(id);
        }
        Ok(true)
    }
}

/// Makes `graph` (being captured) own a reference to `keep`, released when
/// the graph and every executable graph made from it are gone.
pub(crate) fn retain(graph: sys::CUgraph, keep: KeepAlive) -> Result<()> {
    let api = api()?;
    // Started before any destructor can run.
    reaper();
    let payload = Box::into_raw(Box::new(keep)) as *mut c_void;
    let mut object = std::ptr::null_mut();
    // SAFETY: `payload` is a live Box that only `release` takes back, once:
    // the object starts with one reference, which the graph takes over.
    let created = check("cuUserObjectCreate", unsafe {
        api.cuUserObjectCreate(&mut object, payload, Some(release), 1, sys::CUuserObject_flags::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC.0)
    });
    if let Err(e) = created {
        // SAFETY: the driver did not take the payload; it is ours again.
        drop(unsafe { Box::from_raw(payload as *mut KeepAlive) });
        return Err(e);
    }
    // SAFETY: `graph` is the graph of a capture in progress (from
    // `capture_of` in this call), `object` was just created with one
    // reference, which MOVE hands to the graph.
    let retained = check("cuGraphRetainUserObject", unsafe {
        api.cuGraphRetainUserObject(graph, object, 1, sys::CUuserObjectRetain_flags::CU_GRAPH_USER_OBJECT_MOVE.0)
    });
    if retained.is_err() {
        // SAFETY: the reference is still ours; releasing it runs `release`.
        unsafe { api.cuUserObjectRelease(object, 1) };
    } else {
        RETAINED.fetch_add(1, Relaxed);
    }
    retained
}

/// The user object's destructor: hands the payload to the reaper thread
/// (no CUDA call is allowed here). Without a reaper the payload leaks,
/// which is safe.
unsafe extern "C" fn release(payload: *mut c_void) {
    // SAFETY: `payload` is the Box made in `retain`, and the driver calls
    // this once per object.
    let keep = unsafe { Box::from_raw(payload as *mut KeepAlive) };
    match REAPER.get().and_then(Option::as_ref) {
        Some(tx) => {
            // The process's exit waits for the drop (`Busy`).
            if let Err(mpsc::SendError((keep, _busy))) = tx.send((keep, Busy::start())) {
                std::mem::forget(keep);
            }
        }
        None => std::mem::forget(keep),
    }
}

/// A payload handed to the reaper thread, and the exit's wait for its drop.
type Release = (Box<KeepAlive>, Busy);

static REAPER: OnceLock<Option<mpsc::Sender<Release>>> = OnceLock::new();

/// The thread that drops what released graphs kept alive, started on first
/// use (before any destructor can run).
fn reaper() -> Option<&'static mpsc::Sender<Release>> {
    REAPER
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Release>();
            let spawned = std::thread::Builder::new().name("cuda-peer-graph-release".into()).spawn(move || {
                for (keep, _busy) in rx {
                    keep.release();
                }
            });
            match spawned {
                Ok(_) => Some(tx),
                Err(e) => {
                    log::warn!("cuda-peer: cannot start the graph release thread ({e}); what graphs keep alive will leak");
                    None
                }
            }
        })
        .as_ref()
}

/// One rank's calls and the replays of its captured calls, run one after
/// another in the order the host issued them, wherever each replay is
/// launched.
///
/// A rank's kernels use its slots, counters, flags and staging buffers, as
/// every call's do, so two of its calls must not run at once on the device.
/// Eager calls are ordered by the rank's stream; a graph replay runs
/// wherever the caller launches it. So every call also takes its place in
/// one order through an event: before its first enqueue on the rank's
/// stream it waits there for the event's last record ([`Self::begin`]),
/// and after its last it records the event ([`Self::end`]). A captured call
/// does both as the graph's external event nodes: a graph's wait node waits
/// for the event's last record before the graph's launch, and a stream that
/// waits for the event after the launch waits for the replay's record node
/// (`bench/experiments/graph_event_order/`). Eager calls do this only once a
/// call has been captured: before that no replay exists, and a record on
/// every call costs the calls of applications that never capture (about
/// 1-2 us per small call on one H200). So the first launch of a rank's
/// first graph must come after the calls made before its capture in the
/// caller's stream order (launched on the rank's stream, or on one that
/// waits for it), as NCCL asks of every launch; from then on the order is
/// kept here.
///
/// Graphs wait for and record the event, so what they keep alive must hold
/// the `CallOrder`. One call at a time uses it (the owner's call lock).
#[derive(Debug)]
pub(crate) struct CallOrder {
    /// Waited for before each call and recorded after it.
    event: CudaEvent,
    /// Whether a call has been captured into a graph.
    captured: AtomicBool,
    /// How the call being enqueued took its place in the order: `NOT_YET`,
    /// `EAGER` (on the stream) or `CAPTURED` (as a graph node).
    state: AtomicU8,
}

const NOT_YET: u8 = 0;
const EAGER: u8 = 1;
const CAPTURED: u8 = 2;

impl CallOrder {
    /// The order of a rank's calls on streams of `ctx`.
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<CallOrder> {
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let event = ctx.new_event(Some(flags)).map_err(cudarc_err("cuEventCreate"))?;
        Ok(CallOrder { event, captured: AtomicBool::new(false), state: AtomicU8::new(NOT_YET) })
    }

    /// Before a call's enqueue on `stream` (of the event's context), where
    /// `capturing` says whether `stream` is being captured into a graph:
    /// the stream waits for the order's last record, as an external node of
    /// the graph when capturing (eagerly only once a call has been
    /// captured, see above). A call may call this before each of its enqueues: it
    /// takes its place once, and once more if its stream has joined a
    /// capture since (a fork from a caller's capturing stream, or a
    /// buffer's event recorded under one).
    pub(crate) fn begin(&self, stream: &CudaStream, capturing: bool) -> Result<()> {
        let state = self.state.load(SeqCst);
        if capturing {
            if state == CAPTURED {
                return Ok(());
            }
            self.captured.store(true, SeqCst);
        } else if state != NOT_YET || !self.captured.load(SeqCst) {
            return Ok(());
        }
        bind(stream.context())?;
        let flags = if capturing { sys::CUevent_wait_flags::CU_EVENT_WAIT_EXTERNAL.0 } else { 0 };
        // SAFETY: the event is alive (self) and of the stream's context
        // (the caller's contract, `new`), which is current; the stream is
        // alive (borrowed).
        check("cuStreamWaitEvent (the order of calls)", unsafe { api()?.cuStreamWaitEvent(raw_stream(stream), raw_event(&self.event), flags) })?;
        self.state.store(if capturing { CAPTURED } else { EAGER }, SeqCst);
        Ok(())
    }

    /// After a call's last enqueue on `stream`: records the order's event
    /// where the call took its place in it (nothing if it did not). Before
    /// a captured call's stream joins back into the caller's.
    pub(crate) fn end(&self, stream: &CudaStream) -> Result<()> {
        let flags = match self.state.swap(NOT_YET, SeqCst) {
            NOT_YET => return Ok(()),
            CAPTURED => sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL.0,
            _ => 0,
        };
        bind(stream.context())?;
        // SAFETY: as in `begin`.
        check("cuEventRecordWithFlags (the order of calls)", unsafe {
            api()?.cuEventRecordWithFlags(raw_event(&self.event), raw_stream(stream), flags)
        })
    }
}
