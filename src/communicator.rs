//! The communicator under a group: its ranks (context, stream, device,
//! kernels), the routes between them, the launcher threads and the fused
//! kernels' control block, and how one call is entered and launched on
//! every rank. It knows nothing of which algorithm runs.
//!
//! `ranks` are the ranks this process drives (it owns their streams and
//! launches their kernels); `size` is how many ranks the communicator
//! addresses. In a single-process group the two are the same; ranks of
//! other processes would be addressed (through routes) without being
//! driven.

use crate::copy::route::{copy_direct, Direct, RouteTable};
use crate::copy::Path;
use crate::dtype::DType;
use crate::error::{cudarc_err, Error, Result};
use crate::failure::{Ctl, Fault};
use crate::graph::{CallOrder, Captures, KeepAlive};
use crate::kernels::load::{self, load_module, FnTable};
use crate::kernels::{self, Kernel, KernelOp, Module};
use crate::launch::{Job, Launchers};
use crate::peer::PeerAccess;
use crate::reach::ReachCache;
use crate::sync::Orderer;
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream};
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

/// One rank this process drives: its device, stream, kernels and step event.
pub(crate) struct Rank {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    funcs: FnTable,
    /// Recorded on `stream` after each step.
    pub(crate) done: CudaEvent,
    /// Orders callers' buffers with this rank's work (`crate::sync`).
    pub(crate) order: Orderer,
    /// This rank's calls and the replays of its captured calls, in the
    /// order the host issued them; graphs hold it.
    pub(crate) calls: Arc<CallOrder>,
    /// The device's multiprocessors.
    pub(crate) sms: u32,
}

impl Rank {
    /// The largest grid of this rank's elementwise kernels.
    pub(crate) fn max_blocks(&self) -> u32 {
        kernels::launch::max_blocks(self.sms)
    }

    /// A rank on `stream` (of its context), with the reduction module loaded.
    fn new(stream: Arc<CudaStream>) -> Result<Rank> {
        let ctx = stream.context().clone();
        let sms = crate::driver::multiprocessors(&ctx)?;
        Ok(Rank {
            module: load_module(&ctx, Module::Reduce)?,
            done: ctx.new_event(None).map_err(cudarc_err("cuEventCreate"))?,
            funcs: FnTable::default(),
            order: Orderer::default(),
            calls: Arc::new(CallOrder::new(&ctx)?),
            sms,
            ctx,
            stream,
        })
    }
}

/// Ranks, routes and launch machinery of one group.
pub(crate) struct Communicator {
    /// Launcher threads for ranks 1.. (fused all-reduces only).
    launchers: Option<Launchers>,
    /// The ranks this process drives, in rank order.
    pub(crate) ranks: Vec<Rank>,
    /// How many ranks the communicator addresses (here: every rank is driven).
    size: usize,
    /// The routes between ranks, built once.
    pub(crate) routes: Arc<RouteTable>,
    /// Peer access the routes and the fused algorithms rely on.
    pub(crate) access: Arc<Vec<PeerAccess>>,
    /// The fused kernels' control block and the group's failed state
    /// (`crate::failure`), when the group has fused kernels.
    pub(crate) ctl: Option<Arc<Ctl>>,
    /// One lock per stream, shared with every other group on that stream
    /// (`stream_locks`), all held (in a fixed order) for the whole enqueue
    /// of one collective: the per-rank step events and the device-side
    /// barriers and counters assume calls in one order on every rank, so
    /// calls from several threads, and calls of two groups that share
    /// streams, are serialised. (Two groups enqueueing on the same streams
    /// in opposite orders would wait for each other on the device.)
    serial: Vec<Arc<Mutex<()>>>,
    /// Whether the call being enqueued (under `serial`) is captured into a
    /// graph on some rank's stream.
    capturing: AtomicBool,
    /// The number of the call being enqueued (counted from 1 by
    /// [`Self::enter`]; 0 for the creation checks), for failure records.
    call: AtomicU32,
    /// The last captures that hold a reference to the group's resources.
    captures: Captures,
    /// Buffers known to be mapped for the peers' kernels (`crate::reach`).
    pub(crate) reach: ReachCache,
}

/// Locks shared by every group that enqueues on a stream, by (CUDA
/// context, stream) handle; entries go when their last group does.
type StreamKey = (usize, usize);
static STREAM_LOCKS: Lazy<Mutex<HashMap<StreamKey, Weak<Mutex<()>>>>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// The shared locks of `ranks`' streams, one per distinct stream, in the
/// order of their keys: every group takes them in that one order.
fn stream_locks(ranks: &[Rank]) -> Vec<Arc<Mutex<()>>> {
    let mut keys: Vec<StreamKey> = ranks.iter().map(|r| (r.ctx.cu_ctx() as usize, r.stream.cu_stream() as usize)).collect();
    keys.sort_unstable();
    keys.dedup();
    let mut map = STREAM_LOCKS.lock().unwrap_or_else(|p| p.into_inner());
    map.retain(|_, w| w.strong_count() > 0);
    keys.into_iter()
        .map(|k| {
            map.get(&k).and_then(Weak::upgrade).unwrap_or_else(|| {
                let lock = Arc::new(Mutex::new(()));
                map.insert(k, Arc::downgrade(&lock));
                lock
            })
        })
        .collect()
}

/// Ranks on `streams` (one each), with the reduction module loaded on each.
pub(crate) fn ranks_on(streams: Vec<Arc<CudaStream>>) -> Result<Vec<Rank>> {
    streams.into_iter().map(Rank::new).collect()
}

/// One collective's enqueue in progress ([`Communicator::enter`]): holds
/// the streams' locks; when dropped, records the call's place in each
/// rank's order of calls and replays, then lets the locks go.
pub(crate) struct Entered<'a> {
    comm: &'a Communicator,
    _serial: Vec<MutexGuard<'a, ()>>,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.comm.end_calls();
    }
}

/// A fused kernel's control-block arguments for one rank's launch.
pub(crate) struct Fused {
    /// The control block's address for the rank's kernels.
    pub(crate) ctl: u64,
    /// The barrier timeout.
    pub(crate) timeout_ns: u64,
    /// The call's number (for the failure record).
    pub(crate) call: u32,
    /// An injected fault: the launch is skipped silently.
    pub(crate) skip: bool,
}

impl Communicator {
    /// A communicator of `ranks` with the routes `routes` (built over
    /// them), holding `access`. No fused kernels yet
    /// ([`Self::attach_fused`]).
    pub(crate) fn new(ranks: Vec<Rank>, routes: RouteTable, access: Vec<PeerAccess>) -> Communicator {
        let serial = stream_locks(&ranks);
        Communicator {
            size: ranks.len(),
            ranks,
            routes: Arc::new(routes),
            access: Arc::new(access),
            launchers: None,
            ctl: None,
            serial,
            capturing: AtomicBool::new(false),
            call: AtomicU32::new(0),
            captures: Captures::default(),
            reach: ReachCache::default(),
        }
    }

    /// Gives the communicator what fused kernels need: a control block
    /// with barrier timeout `timeout`, and launcher threads where `spin`
    /// asks for them.
    pub(crate) fn attach_fused(&mut self, spin: Option<Duration>, timeout: Duration) -> Result<()> {
        self.launchers = spin.and_then(|spin| Launchers::start(self.size, spin));
        let ctxs: Vec<&CudaContext> = self.ranks.iter().map(|r| &*r.ctx).collect();
        self.ctl = Some(Arc::new(Ctl::for_contexts(&ctxs, self.size, timeout)?));
        Ok(())
    }

    /// Drops what [`Self::attach_fused`] gave (the group keeps only the ring).
    pub(crate) fn detach_fused(&mut self) {
        self.ctl = None;
        self.launchers = None;
    }

    /// Number of ranks.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// The distinct contexts of the ranks, in rank order.
    pub(crate) fn distinct_contexts(&self) -> Vec<&Arc<CudaContext>> {
        let mut ctxs: Vec<&Arc<CudaContext>> = Vec::with_capacity(self.size());
        for rank in &self.ranks {
            if !ctxs.iter().any(|c| c.cu_ctx() == rank.ctx.cu_ctx()) {
                ctxs.push(&rank.ctx);
            }
        }
        ctxs
    }

    /// Starts one collective's enqueue: serialises it against calls from
    /// other threads (the guard), notes whether it is being captured into a
    /// graph, makes each graph it is captured into keep `keep_alive()`
    /// alive for as long as the graph lives (`crate::graph`): a graph may
    /// be replayed after the group is dropped; and puts the call in each
    /// rank's order of calls and replays ([`CallOrder`]), which the guard
    /// records when dropped.
    pub(crate) fn enter(&self, keep_alive: impl Fn() -> KeepAlive) -> Result<Entered<'_>> {
        let serial: Vec<_> = self.serial.iter().map(|m| m.lock().unwrap_or_else(|p| p.into_inner())).collect();
        if let Some(ctl) = &self.ctl {
            ctl.check()?;
        }
        let entered = Entered { comm: self, _serial: serial };
        self.capturing.store(false, Relaxed);
        self.see_captures(keep_alive)?;
        self.call.fetch_add(1, Relaxed);
        Ok(entered)
    }

    /// [`Self::see_capture`] for every rank (see [`Self::enter`]). A call
    /// whose ranks' streams may join a capture only after `enter` (ordered
    /// after a caller's capturing stream: the raw entry's fork, or a
    /// buffer's event recorded under a capture) looks again once they may
    /// have, before its first kernel or copy.
    pub(crate) fn see_captures(&self, keep_alive: impl Fn() -> KeepAlive) -> Result<()> {
        for r in 0..self.size() {
            self.see_capture(r, &keep_alive)?;
        }
        Ok(())
    }

    /// Whether rank `r`'s stream is being captured into a graph (noted for
    /// [`Self::capturing`]): if so, the graph keeps `keep_alive()` alive
    /// (once per capture); and the call takes its place in the rank's
    /// order of calls and replays ([`CallOrder::begin`]). For a launcher's
    /// own rank too, once it has ordered that rank's buffers.
    pub(crate) fn see_capture(&self, r: usize, keep_alive: &dyn Fn() -> KeepAlive) -> Result<bool> {
        let rank = self.rank(r)?;
        let captured = self.captures.hold(&rank.stream, keep_alive)?;
        rank.calls.begin(&rank.stream, captured)?;
        if captured {
            self.capturing.store(true, Relaxed);
        }
        Ok(captured)
    }

    /// Records the call's place in each rank's order of calls and replays
    /// ([`Self::end_call`] for every rank; a failure is logged and fails
    /// the group); [`Entered`] does it on drop otherwise.
    pub(crate) fn end_calls(&self) {
        for r in 0..self.size() {
            let _ = self.end_call(r);
        }
    }

    /// Records the call's place in rank `r`'s order of calls and replays,
    /// after its last kernel or copy on the rank's stream and before the
    /// stream joins back into streams of the caller's (their waits, or the
    /// events of the callers' buffers, which such a stream may join back
    /// through). A failed record leaves later calls unordered with this
    /// one: the group fails, where it can.
    pub(crate) fn end_call(&self, r: usize) -> Result<()> {
        let rank = self.rank(r)?;
        rank.calls.end(&rank.stream).inspect_err(|e| {
            log::warn!("cuda-peer: group rank {r}: ordering a call: {e}");
            if let Some(ctl) = &self.ctl {
                ctl.fail(Error::GroupFailed { reason: format!("rank {r}: ordering a call: {e}") });
            }
        })
    }

    /// Rank `r`, or an internal error where there is none.
    fn rank(&self, r: usize) -> Result<&Rank> {
        self.ranks.get(r).ok_or_else(|| Error::Internal(format!("no rank {r} in a group of {}", self.size())))
    }

    /// Whether the call being enqueued is captured into a graph (set by
    /// [`Self::enter`]).
    pub(crate) fn capturing(&self) -> bool {
        self.capturing.load(Relaxed)
    }

    /// Runs `launch(r)` for every rank r: at once on the launcher threads
    /// where the group has them and no rank's stream is being captured into
    /// a graph (a replayed graph costs no launches), else one after another
    /// from this thread, last rank first (so this thread ends on rank 0's
    /// context, where the callers' buffer guards record their events).
    ///
    /// If any rank's launch fails, the kernels already launched are told to
    /// give up (the control block's abort word) and the group is marked
    /// failed: its ranks are out of step (`crate::failure`).
    pub(crate) fn launch_each(&self, launch: &Job<'_>) -> Result<()> {
        let launched = match &self.launchers {
            Some(l) if !self.capturing() => l.run(launch),
            _ => (0..self.size()).rev().try_for_each(launch),
        };
        if let (Err(e), Some(ctl)) = (&launched, &self.ctl) {
            ctl.abort();
            ctl.fail(Error::GroupFailed { reason: format!("a collective could not be launched on every rank: {e}") });
        }
        launched
    }

    /// What rank r's fused kernel takes from the control block (see
    /// [`Fused`]).
    pub(crate) fn ctl_args(&self, r: usize) -> Result<Fused> {
        let Some(c) = &self.ctl else {
            return Err(Error::Internal("fused kernel launched on a group without a control block".into()));
        };
        let fused = |skip| Fused { ctl: c.addrs[r], timeout_ns: c.timeout_ns, call: self.call.load(Relaxed), skip };
        match c.take_fault(r) {
            Some(Fault::LaunchFails) => Err(Error::Internal(format!("injected launch failure on rank {r}"))),
            Some(Fault::NeverArrives) => Ok(fused(true)),
            None => Ok(fused(false)),
        }
    }

    /// Checks that the kernels that read or write `bufs[q]` on a peer's
    /// device can: every other rank's for the fused kernels (`all`), else
    /// the ring successor's where it pulls from q by peer loads (P2P).
    pub(crate) fn check_reach(&self, op: &'static str, bufs: &[u64], all: bool) -> Result<()> {
        let n = self.size();
        let ctxs: Vec<&CudaContext> = self.ranks.iter().map(|r| &*r.ctx).collect();
        self.reach.check(op, &ctxs, bufs, |q| {
            if all {
                (0..n).filter(|&p| p != q).collect()
            } else {
                let succ = (q + 1) % n;
                if succ != q && self.routes.ring[succ].status.path == Path::P2p {
                    vec![succ]
                } else {
                    Vec::new()
                }
            }
        })
    }

    /// Synchronises every rank's stream, and the work ordered with callers'
    /// buffers, and returns each failure with its rank.
    pub(crate) fn synchronize_each(&self) -> Vec<(usize, Error)> {
        let mut errors = Vec::new();
        for (i, r) in self.ranks.iter().enumerate() {
            if let Err(e) = r.stream.synchronize().map_err(cudarc_err("cuStreamSynchronize")).and_then(|_| r.order.synchronize()) {
                errors.push((i, e));
            }
        }
        errors
    }

    /// Rank r's kernel `kernel` of the reduction module, from its table.
    pub(crate) fn function(&self, r: usize, kernel: Kernel) -> Result<&CudaFunction> {
        let rank = &self.ranks[r];
        rank.funcs.get(kernel, || rank.module.load_function(&kernel.name()).map_err(cudarc_err("cuModuleGetFunction")))
    }

    /// Loads `kernel` from its module on rank r (the module loaded once per
    /// context); for the algorithms' own function tables.
    pub(crate) fn kernel_function(&self, r: usize, kernel: Kernel) -> Result<CudaFunction> {
        load::function(&self.ranks[r].ctx, kernel)
    }

    /// Launches `dst = a op b` over `count` elements on rank `r`'s stream.
    #[allow(clippy::too_many_arguments)] // the kernel's own arguments, plus rank, op and type
    pub(crate) fn launch_reduce2(&self, r: usize, op: KernelOp, dtype: DType, dst: u64, a: u64, b: u64, count: usize) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let f = self.function(r, Kernel::Reduce2(op, dtype))?;
        let rank = &self.ranks[r];
        // SAFETY: `f` is rank r's reduction kernel of `dtype`; the three
        // addresses hold `count` elements of `dtype` on, or peer-accessible
        // from, rank r's device (the callers' route checks), and stay alive
        // until the step's events complete.
        unsafe { kernels::launch::reduce2(&rank.stream, f, dtype, dst, a, b, count, rank.max_blocks()) }
    }

    /// Resolves the division kernel for `dtype` on every rank.
    pub(crate) fn resolve_scale_div(&self, dtype: DType) -> Result<()> {
        for r in 0..self.size() {
            self.function(r, Kernel::ScaleDiv(dtype))?;
        }
        Ok(())
    }

    /// Launches `x /= divisor` over `count` elements on rank `r`'s stream.
    pub(crate) fn launch_scale_div(&self, r: usize, dtype: DType, x: u64, count: usize, divisor: f64) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let f = self.function(r, Kernel::ScaleDiv(dtype))?;
        let rank = &self.ranks[r];
        // SAFETY: `f` is rank r's division kernel of `dtype`; `x` holds
        // `count` elements on rank r's device (the callers' checks).
        unsafe { kernels::launch::scale_div(&rank.stream, f, dtype, x, count, divisor, rank.max_blocks()) }
    }

    /// A device-to-device copy on rank `r`'s stream (same device).
    pub(crate) fn local_copy(&self, r: usize, dst: u64, src: u64, bytes: usize) -> Result<()> {
        let rank = &self.ranks[r];
        // SAFETY: both ranges hold `bytes` bytes on rank r's device (the callers' checks).
        unsafe { copy_direct(Direct::Local, dst, &rank.ctx, src, &rank.ctx, bytes, &rank.stream) }
    }
}
