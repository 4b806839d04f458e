//! CUDA graph captures: which graph a stream is capturing into, and keeping
//! what a captured call uses (slots, flags, pinned buffers, scratch, peer
//! access) alive for as long as the graph can be launched.
//!
//! The driver's mechanism for this is a *user object* owned by the graph
//! (`cuUserObjectCreate`, `cuGraphRetainUserObject`): executable graphs
//! instantiated from it own it too, and the driver calls its destructor once
//! the last graph is destroyed and its last launch has finished. The
//! destructor may not call CUDA, so it hands the resources to a thread of
//! ours that drops them (their `Drop`s free memory through the driver).

use crate::driver::{api, bind, raw_stream, Busy};
use crate::error::{check, Result};
use cuda_peer_sys as sys;
use cudarc::driver::{CudaContext, CudaStream};
use std::any::Any;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
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
