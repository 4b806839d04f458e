//! Collectives between hosts, through NCCL: one rank per process, loaded
//! at run time (`libnccl.so.2`, or `CUDA_PEER_NCCL_LIB`).
//!
//! cuda-peer moves data between the GPUs of one host itself; between hosts
//! it uses an existing distributed engine rather than a network layer of
//! its own. [`NcclComm`] is that engine behind cuda-peer's conventions:
//! its [`Element`] types (and the fp8 types, moved as bytes) and
//! [`ReduceOp`]s, its ordering of the caller's buffers (whatever stream or
//! context object they were written on), typed errors instead of panics,
//! a bounded [`NcclComm::synchronize`], and an NCCL communicator that is
//! aborted, never left hanging, when a peer fails or once it and every
//! CUDA graph its calls were captured into are dropped.
//!
//! Point-to-point calls ([`Collectives::send`], [`Collectives::recv`], the
//! all-to-alls and [`Collectives::all_gather_v`]) are NCCL groups of
//! `ncclSend` and `ncclRecv` of bytes (one group per call; a transfer to
//! this rank itself is a send and a receive inside it), and the uneven
//! reduce-scatter is one group of `ncclReduce`, part j reduced to rank j.
//! A group that fails to enqueue aborts the communicator. Two behaviours
//! are NCCL's own: it may connect two ranks on their first transfer, waiting
//! on the host inside the call for the peer's matching call (not bounded
//! by the communicator's timeout: put sends and receives that pair up in
//! one call or group), and a send and a receive of different lengths are
//! not detected (NCCL leaves it undefined; the transfer does not
//! complete), so that [`NcclComm::synchronize`] times out and aborts the
//! communicator, a typed [`Error::Timeout`] on the ranks that wait for it.
//!
//! A job spans hosts when its ranks' host identities differ
//! ([`super::host_identity`]: host name and boot id, or `CUDA_PEER_HOST_ID`
//! to simulate several hosts on one).
//!
//! ```no_run
//! use cuda_peer::{ipc::nccl::NcclComm, Collectives, ReduceOp};
//! # fn main() -> Result<(), cuda_peer::Error> {
//! let comm = NcclComm::from_env(std::time::Duration::from_secs(60))?; // under torchrun or cuda-peer-run
//! let mut x = comm.stream().clone_htod(&[comm.rank() as f32; 1024]).unwrap();
//! comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
//! comm.synchronize()?;
//! # Ok(()) }
//! ```

use super::bootstrap::{Bootstrap, Exchange};
use crate::args;
use crate::dtype::{movable_dtype, DType, Element, Movable, ReduceOp};
use crate::error::{cudarc_err, Error, Result};
use crate::graph::{Captures, KeepAlive};
use crate::sync::{wait_bounded, Orderer};
use crate::traits::{Collectives, PointToPoint, Transfer};
use cuda_peer_sys::nccl::{self as sys, NcclApi};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// NCCL's data type for `dtype` (every cuda-peer element type has one).
pub(crate) fn nccl_dtype(dtype: DType) -> i32 {
    match dtype {
        DType::F32 => sys::dtype::FLOAT32,
        DType::F64 => sys::dtype::FLOAT64,
        DType::F16 => sys::dtype::FLOAT16,
        DType::BF16 => sys::dtype::BFLOAT16,
        DType::I32 => sys::dtype::INT32,
        DType::I64 => sys::dtype::INT64,
        DType::U32 => sys::dtype::UINT32,
        DType::U64 => sys::dtype::UINT64,
        DType::I8 => sys::dtype::INT8,
        DType::U8 => sys::dtype::UINT8,
        DType::F8E4M3 => sys::dtype::FLOAT8E4M3,
        DType::F8E5M2 => sys::dtype::FLOAT8E5M2,
    }
}

/// NCCL's reduction for `op`.
pub(crate) fn nccl_op(op: ReduceOp) -> i32 {
    match op {
        ReduceOp::Sum => sys::op::SUM,
        ReduceOp::Prod => sys::op::PROD,
        ReduceOp::Min => sys::op::MIN,
        ReduceOp::Max => sys::op::MAX,
        ReduceOp::Avg => sys::op::AVG,
    }
}

/// How NCCL moves `count` elements of `T` (no reduction): as its element
/// type, but the fp8 types as `count` bytes (`ncclUint8`), which NCCL
/// before 2.24 moves too.
pub(crate) fn movable_wire<T: Movable>(count: usize) -> (i32, usize) {
    match movable_dtype::<T>() {
        DType::F8E4M3 | DType::F8E5M2 => (sys::dtype::UINT8, count * std::mem::size_of::<T>()),
        d => (nccl_dtype(d), count),
    }
}

/// The `ncclReduce` calls of an uneven reduce-scatter: `(root, offset,
/// count)` for each non-empty part (the parts laid out by `offsets`), the
/// empty ones left out (on every rank alike: every rank passes the same
/// counts).
fn reduce_parts(counts: &[usize], offsets: &[usize]) -> Vec<(usize, usize, usize)> {
    counts.iter().zip(offsets).enumerate().filter(|(_, (&c, _))| c > 0).map(|(j, (&c, &o))| (j, o, c)).collect()
}

/// An NCCL result as cuda-peer's error.
fn nccl_error(api: &NcclApi, op: &'static str, code: i32) -> Error {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for
    // any code (NCCL's own "unknown result" for codes it does not know).
    let text = unsafe { (api.ncclGetErrorString)(code) };
    let message = if text.is_null() {
        "unknown NCCL result".to_string()
    } else {
        // SAFETY: non-null, static, NUL-terminated (above).
        unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy().into_owned()
    };
    Error::Nccl { op, code, message }
}

fn check(api: &NcclApi, op: &'static str, code: i32) -> Result<()> {
    if code == sys::NCCL_SUCCESS {
        Ok(())
    } else {
        Err(nccl_error(api, op, code))
    }
}

/// The version of the NCCL library that would be used (e.g. 22803 for
/// 2.28.3), or why it cannot be loaded.
pub fn nccl_version() -> Result<i32> {
    let api = sys::nccl()?;
    let mut v = 0;
    // SAFETY: writes one int.
    check(api, "ncclGetVersion", unsafe { (api.ncclGetVersion)(&mut v) })?;
    Ok(v)
}

/// The NCCL communicator and whether it was aborted.
struct Handle {
    comm: sys::NcclComm,
    /// Why the communicator was aborted, once it was.
    failed: Option<Error>,
}

/// The NCCL communicator, shared by its [`NcclComm`] and every CUDA graph
/// one of its calls was captured into (`crate::graph`): aborted when the
/// last of them lets go (or at once, when a call fails), so that a graph
/// replayed after the [`NcclComm`] is dropped finds it alive. (NCCL's own
/// abort keeps its memory until every graph holding the communicator is
/// destroyed, and waits for that.)
struct Live {
    api: &'static NcclApi,
    /// Made current to abort the communicator.
    ctx: Arc<CudaContext>,
    handle: Mutex<Handle>,
}

// SAFETY: the raw communicator is only used under the `handle` mutex, and
// NCCL allows a communicator to be used from any thread, one at a time.
unsafe impl Send for Live {}
// SAFETY: as above: every use of the communicator takes the mutex.
unsafe impl Sync for Live {}

impl Drop for Live {
    /// Aborts the communicator unless a failure did: its last holder is
    /// gone (the [`NcclComm`], after its bounded wait for its calls, and
    /// every graph, after its last launch).
    fn drop(&mut self) {
        let h = self.handle.get_mut().unwrap_or_else(|p| p.into_inner());
        let comm = std::mem::replace(&mut h.comm, std::ptr::null_mut());
        if !comm.is_null() {
            abort_nccl(self.api, &self.ctx, comm, false);
        }
    }
}

/// `ncclCommAbort` of `comm`, whose last use this is. NCCL tells the
/// communicator's kernels to quit at once, then waits, before it frees
/// anything, until every CUDA graph holding the communicator is destroyed.
/// Where graphs may still hold it (`graphs`), that wait runs on a thread of
/// its own, so that no caller waits for graphs it holds itself (and the
/// graphs' replays find NCCL's memory until they are gone).
fn abort_nccl(api: &'static NcclApi, ctx: &Arc<CudaContext>, comm: sys::NcclComm, graphs: bool) {
    let abort = move |ctx: &Arc<CudaContext>, comm: usize| {
        if crate::driver::bind(ctx).is_err() {
            log::warn!("cuda-peer: could not bind the context to abort the NCCL communicator");
        }
        // SAFETY: a live communicator (made by ncclCommInitRank, never
        // aborted: its holder took it out of its handle to abort it here,
        // once), and nobody uses it after this.
        let r = unsafe { (api.ncclCommAbort)(comm as sys::NcclComm) };
        if r != sys::NCCL_SUCCESS {
            log::warn!("cuda-peer: ncclCommAbort returned {r}");
        }
    };
    if !graphs {
        return abort(ctx, comm as usize);
    }
    let (ctx, comm, busy) = (ctx.clone(), comm as usize, crate::driver::Busy::start());
    let spawned = std::thread::Builder::new().name("cuda-peer-nccl-abort".into()).spawn(move || {
        abort(&ctx, comm);
        drop(busy);
    });
    if let Err(e) = spawned {
        // Aborting here could wait for ever on graphs this thread holds:
        // the communicator is left as it is (its memory leaks).
        log::warn!("cuda-peer: no thread to abort an NCCL communicator that graphs hold ({e}); it is left unaborted");
    }
}

/// A communicator of processes, one rank per process, whose collectives
/// run on NCCL (see the module docs).
///
/// Every collective enqueues on [`Self::stream`] and returns; the caller's
/// buffers are ordered with the streams they were written on, as for every
/// cuda-peer collective. Every rank must call the same collectives with the
/// same lengths, types and ops, in the same order.
///
/// A call captured into a CUDA graph (on [`Self::stream`], or on a stream
/// of the caller's that it joined) makes the graph hold the NCCL
/// communicator, which is aborted only once the graph and this
/// communicator are both gone: the graph may be replayed after this is
/// dropped, as long as every rank replays it. A failure (a peer that died,
/// a call that could not be enqueued) aborts the NCCL communicator at once,
/// which tells its kernels to quit; NCCL frees its memory only once the
/// graphs holding it are destroyed, so a replay after a failure faults
/// nothing, but its results are not defined.
pub struct NcclComm {
    api: &'static NcclApi,
    rank: usize,
    size: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    order: Orderer,
    timeout: Duration,
    live: Arc<Live>,
    /// The captures its calls went into, each holding `live`.
    captures: Captures,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm").field("rank", &self.rank).field("size", &self.size).field("device", &self.ctx.ordinal()).finish()
    }
}

impl NcclComm {
    /// Reads torchrun's variables ([`Bootstrap::from_env`]), meets the other
    /// ranks and creates the communicator on device `LOCAL_RANK`, with
    /// `timeout` bounding [`Self::synchronize`] and [`Drop`].
    pub fn from_env(timeout: Duration) -> Result<NcclComm> {
        let boot = Bootstrap::from_env()?;
        let rv = boot.connect()?;
        NcclComm::new(&rv, boot.local_rank, timeout)
    }

    /// Creates the communicator of the ranks of `exchange`, this one on
    /// device `device`: rank 0 makes NCCL's unique id and the exchange
    /// carries it to the others. Every rank must call it at the same time.
    /// A missing NCCL library is [`Error::Load`] on every rank, and a rank
    /// whose NCCL communicator could not be made (or not within `timeout`)
    /// fails every rank.
    pub fn new(exchange: &dyn Exchange, device: usize, timeout: Duration) -> Result<NcclComm> {
        let stream = crate::driver::context(device).and_then(|ctx| ctx.new_stream().map_err(cudarc_err("cuStreamCreate")));
        // Every rank takes part in the exchange, even one without a stream.
        let stream = match stream {
            Ok(s) => Ok(s),
            Err(e) => {
                let _ = super::bootstrap::agree(exchange, "NCCL communicator", Err(e.clone()));
                Err(e)
            }
        }?;
        NcclComm::on_stream(exchange, stream, timeout)
    }

    /// As [`Self::new`], enqueueing every collective on `stream` (the
    /// caller's), on its device.
    pub fn on_stream(exchange: &dyn Exchange, stream: Arc<CudaStream>, timeout: Duration) -> Result<NcclComm> {
        let (rank, size) = (exchange.rank(), exchange.size());
        if size == 0 || rank >= size {
            return Err(Error::InvalidArgument(format!("rank {rank} of {size}")));
        }
        // Rank 0's id, or every rank's reason to stop, in one all-gather.
        let mine: Result<Vec<u8>> =
            if rank == 0 { NcclComm::unique_id().map(|id| id.to_vec()) } else { sys::nccl().map(|_| Vec::new()).map_err(Error::from) };
        let all = super::bootstrap::agree(exchange, "NCCL communicator", mine)?;
        // `agree` returned one value per rank (checked), so rank 0's is there.
        let from0 = all.first().map(Vec::as_slice).unwrap_or_default();
        let id: [u8; 128] = from0
            .try_into()
            .map_err(|_| Error::Bootstrap { op: "NCCL communicator", reason: format!("rank 0 sent a {}-byte id, not 128", from0.len()) })?;
        let made = NcclComm::with_stream(&id, rank, size, stream, timeout);
        // A rank whose ncclCommInitRank failed (or timed out) fails every
        // rank, whose communicators would otherwise wait for it in their
        // first collective.
        super::bootstrap::agree(
            exchange,
            "NCCL communicator: every rank's ncclCommInitRank",
            made.as_ref().map(|_| Vec::new()).map_err(Clone::clone),
        )?;
        made
    }

    /// A new NCCL unique id (the bytes every rank of a communicator passes
    /// to [`Self::with_stream`]; one rank makes it, the others receive it).
    pub(crate) fn unique_id() -> Result<[u8; 128]> {
        let api = sys::nccl()?;
        let mut id = sys::NcclUniqueId { internal: [0; 128] };
        // SAFETY: writes the 128-byte id.
        check(api, "ncclGetUniqueId", unsafe { (api.ncclGetUniqueId)(&mut id) })?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// Joins the communicator of `size` ranks named by `id` as `rank`,
    /// enqueueing on `stream` (which may be another communicator's: the
    /// tiered collectives run both on one stream). Blocks until every rank
    /// has joined.
    pub(crate) fn with_stream(id: &[u8; 128], rank: usize, size: usize, stream: Arc<CudaStream>, timeout: Duration) -> Result<NcclComm> {
        let api = sys::nccl()?;
        let nid = sys::NcclUniqueId { internal: id.map(|b| b as std::os::raw::c_char) };
        let ctx = stream.context().clone();
        crate::driver::bind(&ctx)?;
        let comm = init_bounded(api, &ctx, nid, rank, size, timeout)?;
        crate::driver::wait_after_the_runtime();
        let live = Arc::new(Live { api, ctx: ctx.clone(), handle: Mutex::new(Handle { comm, failed: None }) });
        Ok(NcclComm { api, rank, size, ctx, stream, order: Orderer::default(), timeout, live, captures: Captures::default() })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks the communicator has.
    pub fn size(&self) -> usize {
        self.size
    }

    /// This rank's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every collective is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits, for at most the communicator's timeout, for every collective
    /// enqueued so far. A peer that died or stopped calling (NCCL reports
    /// an asynchronous error, or the work does not finish in time) aborts
    /// the communicator: this and every later call return an error, the
    /// kernels are ended, and the context stays usable.
    pub fn synchronize(&self) -> Result<()> {
        let event = self.stream.record_event(None).map_err(cudarc_err("cuEventRecord"))?;
        let start = Instant::now();
        loop {
            self.check_async()?;
            match wait_bounded(&event, "NCCL collectives", Duration::from_millis(50)) {
                Ok(()) => break,
                Err(Error::Timeout { .. }) if start.elapsed() < self.timeout => continue,
                Err(Error::Timeout { .. }) => {
                    let e = Error::Timeout { op: "NCCL collectives (a peer died or stopped calling?)", after: self.timeout };
                    return Err(self.abort(e));
                }
                Err(e) => return Err(e),
            }
        }
        self.order.synchronize()
    }

    /// NCCL's asynchronous error, if any (which aborts the communicator).
    fn check_async(&self) -> Result<()> {
        let h = self.live.handle.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = &h.failed {
            return Err(e.clone());
        }
        let mut state = sys::NCCL_SUCCESS;
        // SAFETY: the communicator is live (not aborted: checked above).
        let r = unsafe { (self.api.ncclCommGetAsyncError)(h.comm, &mut state) };
        drop(h);
        check(self.api, "ncclCommGetAsyncError", r)?;
        if state != sys::NCCL_SUCCESS && state != sys::NCCL_IN_PROGRESS {
            return Err(self.abort(nccl_error(self.api, "NCCL collective (asynchronous error)", state)));
        }
        Ok(())
    }

    /// Aborts the communicator (once), remembering `why`; returns the error
    /// later calls will see.
    fn abort(&self, why: Error) -> Error {
        let mut h = self.live.handle.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = &h.failed {
            return e.clone();
        }
        // No other call uses the communicator (the mutex is held), and none
        // will: `failed` is set below. Graphs holding it besides this
        // communicator (`live`'s other holders, which can only come and go
        // under this mutex or when a graph is destroyed) make NCCL's abort
        // wait for them.
        let graphs = Arc::strong_count(&self.live) > 1;
        abort_nccl(self.api, &self.ctx, std::mem::replace(&mut h.comm, std::ptr::null_mut()), graphs);
        let failed = Error::GroupFailed { reason: format!("NCCL communicator aborted: {why}") };
        h.failed = Some(failed.clone());
        failed
    }

    /// Runs `call` with the live communicator and this rank's context
    /// current; every collective goes through here. A failure aborts the
    /// communicator (its error is the abort's): the peers have enqueued
    /// their side, which would otherwise pair with this rank's next call.
    fn enqueue(&self, op: &'static str, call: impl FnOnce(&NcclApi, sys::NcclComm, *mut std::ffi::c_void) -> i32) -> Result<()> {
        self.enqueue_calls(|api, comm, s| (op, call(api, comm, s))).map_err(|e| self.abort(e))
    }

    /// [`Self::enqueue`] of several NCCL calls, which return the name and
    /// result of the one that failed (or of the last).
    fn enqueue_calls(&self, calls: impl FnOnce(&NcclApi, sys::NcclComm, *mut std::ffi::c_void) -> (&'static str, i32)) -> Result<()> {
        let h = self.live.handle.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = &h.failed {
            return Err(e.clone());
        }
        crate::driver::bind(&self.ctx)?;
        self.captures.hold(&self.stream, || KeepAlive { ctx: self.ctx.clone(), payload: self.live.clone() })?;
        let (op, code) = calls(self.api, h.comm, self.stream.cu_stream() as *mut std::ffi::c_void);
        drop(h);
        check(self.api, op, code)
    }

    /// [`Self::enqueue_calls`] inside one NCCL group: `ncclGroupStart`, the
    /// calls (which stop at their first failure), and `ncclGroupEnd` on
    /// every path once the group is open. A failure aborts the
    /// communicator (its error is the abort's): the peers' side of the
    /// group is enqueued and would otherwise match this rank's later calls.
    fn enqueue_group(&self, calls: impl FnOnce(&NcclApi, sys::NcclComm, *mut std::ffi::c_void) -> (&'static str, i32)) -> Result<()> {
        self.enqueue_calls(|api, comm, s| {
            // SAFETY: opens a group on this thread, closed below on every
            // path (the handle's mutex is held throughout).
            let start = unsafe { (api.ncclGroupStart)() };
            if start != sys::NCCL_SUCCESS {
                return ("ncclGroupStart", start);
            }
            let (op, code) = calls(api, comm, s);
            // SAFETY: closes the group opened above, on the same thread.
            let end = unsafe { (api.ncclGroupEnd)() };
            if code != sys::NCCL_SUCCESS {
                (op, code)
            } else {
                ("ncclGroupEnd", end)
            }
        })
        .map_err(|e| self.abort(e))
    }
}

/// NCCL's collectives on this rank (see [`Collectives`] for each one's
/// contract).
impl Collectives for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn synchronize(&self) -> Result<()> {
        NcclComm::synchronize(self)
    }

    fn async_error(&self) -> Result<()> {
        self.check_async()
    }

    fn all_reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp) -> Result<()> {
        let count = args::all_reduce_in_place(&self.ctx, buf, op)?;
        let (ptr, held) = self.order.write(buf, &self.stream)?;
        let (dt, nop) = (nccl_dtype(T::DTYPE), nccl_op(op));
        // SAFETY: `ptr` is valid for `count` elements of T on this rank's
        // device and ordered for this stream (the guard); the same buffer
        // as input and output is NCCL's in-place form.
        let r = self.enqueue("ncclAllReduce", |api, comm, s| unsafe { (api.ncclAllReduce)(ptr as *const _, ptr as *mut _, count, dt, nop, comm, s) });
        r.and(held.finish())
    }

    fn all_reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()> {
        let count = args::all_reduce(&self.ctx, send, recv, op)?;
        let (src, read) = self.order.read(send, &self.stream)?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let (dt, nop) = (nccl_dtype(T::DTYPE), nccl_op(op));
        // SAFETY: both pointers are valid for `count` elements of T on this
        // rank's device, distinct buffers (a & and a &mut), ordered (guards).
        let r = self.enqueue("ncclAllReduce", |api, comm, s| unsafe { (api.ncclAllReduce)(src as *const _, dst as *mut _, count, dt, nop, comm, s) });
        r.and(read.finish()).and(write.finish())
    }

    fn reduce_scatter<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()> {
        let n = args::reduce_scatter(&self.ctx, self.size, send, recv, op)?;
        let (src, read) = self.order.read(send, &self.stream)?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let (dt, nop) = (nccl_dtype(T::DTYPE), nccl_op(op));
        // SAFETY: `send` holds n*size and `recv` n elements of T on this
        // rank's device (checked), distinct, ordered (guards).
        let r =
            self.enqueue("ncclReduceScatter", |api, comm, s| unsafe { (api.ncclReduceScatter)(src as *const _, dst as *mut _, n, dt, nop, comm, s) });
        r.and(read.finish()).and(write.finish())
    }

    fn all_gather<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D) -> Result<()> {
        args::all_gather(&self.ctx, self.size, send, recv)?;
        let (src, read) = self.order.read(send, &self.stream)?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let (dt, n) = movable_wire::<T>(send.len());
        // SAFETY: `send` holds n and `recv` n*size NCCL elements of `dt`
        // (the same bytes as T's) on this rank's device (checked),
        // distinct, ordered (guards).
        let r = self.enqueue("ncclAllGather", |api, comm, s| unsafe { (api.ncclAllGather)(src as *const _, dst as *mut _, n, dt, comm, s) });
        r.and(read.finish()).and(write.finish())
    }

    fn broadcast<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: Option<&S>, recv: &mut D, root: usize) -> Result<()> {
        let send = args::broadcast(&self.ctx, self.size, self.rank, send, recv, root)?;
        let count = recv.len();
        let read = send.map(|s| self.order.read(s, &self.stream)).transpose()?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let src = read.as_ref().map_or(dst, |r| r.0);
        let (dt, count) = movable_wire::<T>(count);
        // SAFETY: `dst` (and on the root `src`, distinct: a & and a &mut)
        // hold `count` NCCL elements of `dt` (T's bytes) on this device,
        // ordered (guards); NCCL reads `src` only on the root.
        let r = self
            .enqueue("ncclBroadcast", |api, comm, s| unsafe { (api.ncclBroadcast)(src as *const _, dst as *mut _, count, dt, root as i32, comm, s) });
        let r = match read {
            Some((_, guard)) => r.and(guard.finish()),
            None => r,
        };
        r.and(write.finish())
    }

    fn broadcast_in_place<T: Movable, D: DevicePtrMut<T>>(&self, buf: &mut D, root: usize) -> Result<()> {
        let (dt, count) = movable_wire::<T>(args::broadcast_in_place(&self.ctx, self.size, buf, root)?);
        let (ptr, held) = self.order.write(buf, &self.stream)?;
        // SAFETY: `ptr` is valid for `count` NCCL elements of `dt` (T's
        // bytes) on this device, ordered (guard); in place is NCCL's
        // same-pointer form.
        let r = self
            .enqueue("ncclBroadcast", |api, comm, s| unsafe { (api.ncclBroadcast)(ptr as *const _, ptr as *mut _, count, dt, root as i32, comm, s) });
        r.and(held.finish())
    }

    fn reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp, root: usize) -> Result<()> {
        let count = args::reduce(&self.ctx, self.size, send, recv, op, root)?;
        let (src, read) = self.order.read(send, &self.stream)?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let (dt, nop) = (nccl_dtype(T::DTYPE), nccl_op(op));
        // SAFETY: both valid for `count` elements of T on this device,
        // distinct, ordered (guards).
        let r = self
            .enqueue("ncclReduce", |api, comm, s| unsafe { (api.ncclReduce)(src as *const _, dst as *mut _, count, dt, nop, root as i32, comm, s) });
        r.and(read.finish()).and(write.finish())
    }

    fn reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp, root: usize) -> Result<()> {
        let count = args::reduce_in_place(&self.ctx, self.size, buf, op, root)?;
        let (ptr, held) = self.order.write(buf, &self.stream)?;
        let (dt, nop) = (nccl_dtype(T::DTYPE), nccl_op(op));
        // SAFETY: `ptr` holds `count` elements of T on this device, ordered
        // (the guard); the same pointer twice is NCCL's in-place form.
        let r = self
            .enqueue("ncclReduce", |api, comm, s| unsafe { (api.ncclReduce)(ptr as *const _, ptr as *mut _, count, dt, nop, root as i32, comm, s) });
        r.and(held.finish())
    }

    crate::traits::point_to_point_calls!(all);

    /// One NCCL group of `ncclReduce` calls, part j reduced to rank j
    /// (`Avg` is NCCL's, as in [`Collectives::reduce`]).
    fn reduce_scatter_v<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(
        &self,
        send: &S,
        recv: &mut D,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let (offsets, _) = args::reduce_scatter_v(&self.ctx, self.size, self.rank, send, recv, counts, op)?;
        let (src, read) = self.order.read(send, &self.stream)?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let r = self.reduce_scatter_v_ptrs(T::DTYPE, op, src, dst, counts, &offsets);
        r.and(read.finish()).and(write.finish())
    }
}

/// The point-to-point calls of [`crate::traits`] on NCCL: each call's
/// transfers are one NCCL group.
impl PointToPoint for NcclComm {
    fn p2p_context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn orderer(&self) -> &Orderer {
        &self.order
    }

    fn transfers(&self, ts: &[Transfer]) -> Result<()> {
        self.transfers_ptrs(ts)
    }
}

impl NcclComm {
    /// One NCCL group of an `ncclSend` or `ncclRecv` of bytes per transfer,
    /// in their order (a send to this rank and a receive from it pair up
    /// inside the group); transfers of no bytes are left out (on both
    /// sides alike, when the ranks agree on the lengths). The buffers are
    /// on this device and ordered on this stream (the caller's contract).
    pub(crate) fn transfers_ptrs(&self, ts: &[Transfer]) -> Result<()> {
        for t in ts {
            crate::traits::check_peer(if t.send { "send" } else { "recv" }, t.peer, self.size)?;
        }
        if ts.iter().all(|t| t.bytes == 0) {
            return Ok(());
        }
        self.enqueue_group(|api, comm, s| {
            for t in ts.iter().filter(|t| t.bytes > 0) {
                // `peer` < size (checked above), which fits an int (checked
                // when the communicator was made).
                let peer = t.peer as i32;
                let (op, code) = if t.send {
                    // SAFETY: `ptr` holds `bytes` bytes on this device,
                    // ordered on `s` (the caller's contract), inside the
                    // group this thread opened.
                    ("ncclSend", unsafe { (api.ncclSend)(t.ptr as *const _, t.bytes, sys::dtype::UINT8, peer, comm, s) })
                } else {
                    // SAFETY: as above, for the buffer received into.
                    ("ncclRecv", unsafe { (api.ncclRecv)(t.ptr as *mut _, t.bytes, sys::dtype::UINT8, peer, comm, s) })
                };
                if code != sys::NCCL_SUCCESS {
                    return (op, code);
                }
            }
            ("ncclGroupEnd", sys::NCCL_SUCCESS)
        })
    }

    /// The uneven reduce-scatter on pointers already ordered on this
    /// stream: `src` holds the parts of `counts` elements of `dtype` at
    /// `offsets`, `dst` this rank's part (`counts[rank()]` elements); one
    /// group of `ncclReduce`, part j to rank j, empty parts left out.
    pub(crate) fn reduce_scatter_v_ptrs(&self, dtype: DType, op: ReduceOp, src: u64, dst: u64, counts: &[usize], offsets: &[usize]) -> Result<()> {
        let plan = reduce_parts(counts, offsets);
        if plan.is_empty() {
            return Ok(());
        }
        let (dt, nop, esz) = (nccl_dtype(dtype), nccl_op(op), dtype.size());
        self.enqueue_group(|api, comm, s| {
            for &(root, offset, count) in &plan {
                let part = src + (offset * esz) as u64;
                // SAFETY: `part` holds `count` elements of `dtype` inside
                // `src`, and on rank `root` (this one, when it is) `dst`
                // holds `count` (the caller's contract); NCCL writes `dst`
                // only on the root. `root` < size, which fits an int.
                let code = unsafe { (api.ncclReduce)(part as *const _, dst as *mut _, count, dt, nop, root as i32, comm, s) };
                if code != sys::NCCL_SUCCESS {
                    return ("ncclReduce", code);
                }
            }
            ("ncclGroupEnd", sys::NCCL_SUCCESS)
        })
    }

    /// The all-reduce on pointers already ordered on this communicator's
    /// stream (`count` elements of `dtype` each; the same or disjoint).
    pub(crate) fn all_reduce_ptrs(&self, dtype: DType, op: ReduceOp, src: u64, dst: u64, count: usize) -> Result<()> {
        let (dt, nop) = (nccl_dtype(dtype), nccl_op(op));
        // SAFETY: the caller's contract: both pointers hold `count` elements
        // of `dtype` on this device and are ordered on this stream.
        self.enqueue("ncclAllReduce", |api, comm, s| unsafe { (api.ncclAllReduce)(src as *const _, dst as *mut _, count, dt, nop, comm, s) })
    }

    /// The all-gather on pointers already ordered on this communicator's
    /// stream (`src`: c elements, `dst`: `size() * c`; `src` may be
    /// `dst`'s block `rank()`, NCCL's in-place form).
    pub(crate) fn all_gather_ptrs(&self, dtype: DType, src: u64, dst: u64, c: usize) -> Result<()> {
        let dt = nccl_dtype(dtype);
        // SAFETY: the caller's contract (sizes, device, order).
        self.enqueue("ncclAllGather", |api, comm, s| unsafe { (api.ncclAllGather)(src as *const _, dst as *mut _, c, dt, comm, s) })
    }

    /// The broadcast in place on a pointer already ordered on this
    /// communicator's stream (`root` < `size()`).
    pub(crate) fn broadcast_ptrs(&self, dtype: DType, ptr: u64, count: usize, root: usize) -> Result<()> {
        let dt = nccl_dtype(dtype);
        // SAFETY: the caller's contract (size, device, order); in place.
        self.enqueue("ncclBroadcast", |api, comm, s| unsafe { (api.ncclBroadcast)(ptr as *const _, ptr as *mut _, count, dt, root as i32, comm, s) })
    }
}

/// Where [`init_bounded`]'s thread and its caller meet.
enum Init {
    Waiting,
    /// The caller stopped waiting: a communicator made later is aborted.
    GaveUp,
    /// The communicator (as an address: raw pointers are not `Send`), or
    /// why there is none.
    Done(Result<usize>),
}

/// `ncclCommInitRank`, which waits for every rank without a bound of its
/// own, on a thread of its own, waited for at most `timeout`: a rank that
/// never arrives is an [`Error::Timeout`] here, and a communicator that
/// the thread makes after that is aborted there.
fn init_bounded(
    api: &'static NcclApi,
    ctx: &Arc<CudaContext>,
    id: sys::NcclUniqueId,
    rank: usize,
    size: usize,
    timeout: Duration,
) -> Result<sys::NcclComm> {
    let (rank_c, size_c) = (
        i32::try_from(rank).map_err(|_| Error::InvalidArgument(format!("rank {rank}")))?,
        i32::try_from(size).map_err(|_| Error::InvalidArgument(format!("{size} ranks")))?,
    );
    let state = Arc::new((Mutex::new(Init::Waiting), std::sync::Condvar::new()));
    let (theirs, ctx, busy) = (state.clone(), ctx.clone(), crate::driver::Busy::start());
    std::thread::Builder::new()
        .name("cuda-peer-nccl-init".into())
        .spawn(move || {
            // Held until this thread is done with NCCL (the exit waits for it).
            let _busy = busy;
            let made = crate::driver::bind(&ctx).and_then(|()| {
                let mut comm: sys::NcclComm = std::ptr::null_mut();
                // SAFETY: every rank passes the same id and size and its own
                // rank; the context is current on this thread (bound above).
                check(api, "ncclCommInitRank", unsafe { (api.ncclCommInitRank)(&mut comm, size_c, id, rank_c) }).map(|()| comm as usize)
            });
            let (lock, cv) = &*theirs;
            let mut st = lock.lock().unwrap_or_else(|p| p.into_inner());
            match (&*st, made) {
                (Init::GaveUp, Ok(comm)) => {
                    // SAFETY: a communicator this thread made and nobody else
                    // holds (the caller gave up on it); aborted once.
                    let r = unsafe { (api.ncclCommAbort)(comm as sys::NcclComm) };
                    if r != sys::NCCL_SUCCESS {
                        log::warn!("cuda-peer: ncclCommAbort of a late communicator returned {r}");
                    }
                }
                (Init::GaveUp, Err(_)) => {}
                (_, made) => *st = Init::Done(made),
            }
            cv.notify_all();
        })
        .map_err(|e| Error::Internal(format!("a thread for ncclCommInitRank: {e}")))?;
    let (lock, cv) = &*state;
    let start = Instant::now();
    let mut st = lock.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        if let Init::Done(_) = &*st {
            if let Init::Done(made) = std::mem::replace(&mut *st, Init::GaveUp) {
                return made.map(|c| c as sys::NcclComm);
            }
        }
        let left = timeout.saturating_sub(start.elapsed());
        if left.is_zero() {
            *st = Init::GaveUp;
            return Err(Error::Timeout { op: "ncclCommInitRank (waiting for every rank)", after: timeout });
        }
        st = cv.wait_timeout(st, left.min(Duration::from_secs(1))).unwrap_or_else(|p| p.into_inner()).0;
    }
}

impl Drop for NcclComm {
    /// Waits (bounded) for the enqueued collectives; the NCCL communicator
    /// is aborted then, or once the last graph holding it is gone:
    /// never a panic, never an unbounded wait on a dead peer.
    fn drop(&mut self) {
        if let Err(e) = self.synchronize() {
            log::warn!("cuda-peer: NCCL communicator dropped after an error: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_element_type_and_op_has_its_nccl_value() {
        let dts: Vec<i32> = DType::ALL.iter().map(|&d| nccl_dtype(d)).collect();
        let mut uniq = dts.clone();
        uniq.sort();
        uniq.dedup();
        assert_eq!(uniq.len(), DType::ALL.len(), "two types map to one NCCL type: {dts:?}");
        assert_eq!(nccl_dtype(DType::BF16), 9);
        assert_eq!(nccl_dtype(DType::F16), 6);
        assert_eq!((nccl_dtype(DType::F8E4M3), nccl_dtype(DType::F8E5M2)), (10, 11));
        let ops: Vec<i32> = ReduceOp::ALL.iter().map(|&o| nccl_op(o)).collect();
        assert_eq!(ops, vec![0, 1, 3, 2, 4]);
    }

    #[test]
    fn movable_types_move_as_their_type_or_as_bytes() {
        assert_eq!(movable_wire::<f32>(10), (sys::dtype::FLOAT32, 10));
        assert_eq!(movable_wire::<half::bf16>(3), (sys::dtype::BFLOAT16, 3));
        assert_eq!(movable_wire::<u8>(7), (sys::dtype::UINT8, 7));
        assert_eq!(movable_wire::<float8::F8E4M3>(5), (sys::dtype::UINT8, 5));
        assert_eq!(movable_wire::<float8::F8E5M2>(0), (sys::dtype::UINT8, 0));
        assert_eq!(movable_dtype::<i64>(), DType::I64);
        assert_eq!(movable_dtype::<float8::F8E4M3>(), DType::F8E4M3);
    }

    #[test]
    fn the_uneven_reduce_scatter_reduces_each_nonempty_part_to_its_rank() {
        let counts = [3, 0, 2, 4];
        let (offsets, total) = crate::args::parts("rsv", &counts, 4).unwrap();
        assert_eq!(total, 9);
        assert_eq!(reduce_parts(&counts, &offsets), vec![(0, 0, 3), (2, 3, 2), (3, 5, 4)]);
        assert!(reduce_parts(&[0, 0], &[0, 0]).is_empty());
    }
}
