//! Raw device pointers and streams, for frameworks whose buffers are not
//! cudarc slices (burn/cubecl, tch, C++ libraries): a buffer is a
//! `CUdeviceptr` ([`RawBuffer`]) and work is ordered on the caller's own
//! stream ([`RawStream`]). [`crate::Group::all_reduce_raw`] takes one of
//! each per rank, [`crate::Comm::all_reduce_raw`] this rank's.
//!
//! Ordering: the communicator's stream waits for the caller's stream (an
//! event recorded there), the collective is enqueued on the communicator's
//! stream as its cudarc-slice form enqueues it, and then the caller's
//! stream waits for the communicator's (another event). So work enqueued
//! on the caller's stream before the call is done before the collective
//! reads the buffers, and work enqueued on it after the call sees the
//! result. The host never waits. Both waits are graph-capture safe (the
//! usual fork and join of a captured stream), so a framework may capture
//! the call into a CUDA graph from its own stream: the communicator's
//! stream then joins the capture, and the graph holds what the call
//! touches.
//!
//! Nothing here can track the buffers' lifetimes: that is the contract of
//! the `# Safety` sections.

use crate::driver::{event_record, raw_context, raw_event, raw_stream, raw_stream_of, stream_context, stream_wait_event};
use crate::dtype::DType;
use crate::error::{check, cudarc_err, Error, Result};
use cuda_peer_sys as sys;
use cudarc::driver::sys as cusys;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use std::sync::Arc;

/// One rank's buffer: a raw device pointer (`CUdeviceptr`), e.g. from
/// `cuMemAlloc`, `cuMemAllocAsync`, a framework's allocator, or cudarc's
/// `DevicePtr::device_ptr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawBuffer(pub u64);

/// A caller's stream: a raw `CUstream` (cudarc's `CudaStream::cu_stream()`;
/// from other bindings, cast their `CUstream`). The null stream stands for
/// the legacy default stream of the rank's context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawStream(pub cusys::CUstream);

impl RawStream {
    /// The raw handle of a cudarc stream.
    pub fn of(stream: &cudarc::driver::CudaStream) -> Self {
        RawStream(stream.cu_stream())
    }
}

/// The two events that order one rank's raw-pointer call with its caller's
/// stream: the communicator's stream waits on `caller_done` (recorded on
/// the caller's stream), the caller's stream on `own_done` (recorded on the
/// communicator's). Reused by every call, one call at a time.
pub(crate) struct RawEvents {
    caller_done: CudaEvent,
    own_done: CudaEvent,
}

impl RawEvents {
    /// The events of a rank of `ctx`.
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<RawEvents> {
        let flags = Some(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        Ok(RawEvents {
            caller_done: ctx.new_event(flags).map_err(cudarc_err("cuEventCreate"))?,
            own_done: ctx.new_event(flags).map_err(cudarc_err("cuEventCreate"))?,
        })
    }

    /// `own` (the communicator's stream, of `ctx`) waits for what the
    /// caller enqueued on `caller` so far (nothing where they are one).
    ///
    /// # Safety
    ///
    /// `caller` is a live stream of `ctx` (or null, `ctx`'s legacy stream).
    pub(crate) unsafe fn fork(&self, ctx: &CudaContext, own: &CudaStream, caller: RawStream) -> Result<()> {
        let (own, caller) = (raw_stream(own), raw_stream_of(caller.0));
        // SAFETY: both are live streams of `ctx` (the caller's contract, and
        // the communicator's own stream).
        unsafe { wait_for(ctx, own, caller, &self.caller_done, ("cuEventRecord (caller's stream)", "cuStreamWaitEvent")) }
    }

    /// `caller` waits for what was enqueued on `own` so far: [`Self::fork`]
    /// the other way round.
    ///
    /// # Safety
    ///
    /// As for [`Self::fork`].
    pub(crate) unsafe fn join(&self, ctx: &CudaContext, own: &CudaStream, caller: RawStream) -> Result<()> {
        let (own, caller) = (raw_stream(own), raw_stream_of(caller.0));
        // SAFETY: as in `fork`.
        unsafe { wait_for(ctx, caller, own, &self.own_done, ("cuEventRecord", "cuStreamWaitEvent (caller's stream)")) }
    }
}

/// `waiter` waits for what was enqueued on `done` so far, through `event`
/// (nothing where they are one stream); `ops` name the record and the wait
/// in errors.
///
/// # Safety
///
/// `waiter` and `done` are live streams of `ctx` (or null, its legacy
/// stream), and `event` is an event of `ctx`.
unsafe fn wait_for(
    ctx: &CudaContext,
    waiter: sys::CUstream,
    done: sys::CUstream,
    event: &CudaEvent,
    ops: (&'static str, &'static str),
) -> Result<()> {
    if waiter == done {
        return Ok(());
    }
    crate::driver::bind(ctx)?;
    let ev = raw_event(event);
    // SAFETY: `ev` is an event of `ctx`, which is current; both streams are
    // live streams of it (this function's contract).
    unsafe { event_record(ops.0, ev, done) }?;
    // SAFETY: as above.
    unsafe { stream_wait_event(ops.1, waiter, ev) }
}

/// The checks of a raw all-reduce's arguments that need no communicator:
/// the byte count (`count` elements of `dtype`, overflow refused).
pub(crate) fn byte_count(op: &'static str, count: usize, dtype: DType) -> Result<usize> {
    count.checked_mul(dtype.size()).ok_or_else(|| Error::InvalidArgument(format!("{op}: {count} elements of {dtype} overflow")))
}

/// Checks that `stream` belongs to `ctx` (`whose`: "rank 1's", say; `owner`:
/// "the group's", say).
///
/// # Safety
///
/// `stream` is a live stream (of any context) or null.
pub(crate) unsafe fn check_stream(op: &'static str, ctx: &CudaContext, whose: &str, owner: &str, stream: RawStream) -> Result<()> {
    crate::driver::bind(ctx)?;
    // SAFETY: `stream` is a live stream or null (the current context's,
    // bound above): the caller's contract.
    let got = unsafe { stream_context("all_reduce_raw: cuStreamGetCtx (caller's stream)", stream.0) }?;
    if got != raw_context(ctx) {
        return Err(Error::InvalidArgument(format!("{op}: {whose} stream is not of {owner} context on device {}", ctx.ordinal())));
    }
    Ok(())
}

/// Checks a buffer of `ctx`'s device (`whose`/`what`: "rank 1's"/"send",
/// say): not null, aligned, device memory of that device (as the driver
/// reports it: memory type and device ordinal), and, where the driver
/// reports the allocation's range, `bytes` long from the pointer on.
pub(crate) fn check_buffer(
    op: &'static str,
    ctx: &CudaContext,
    whose: &str,
    what: &'static str,
    buf: RawBuffer,
    bytes: usize,
    dtype: DType,
) -> Result<()> {
    if buf.0 == 0 {
        return Err(Error::InvalidArgument(format!("{op}: {whose} {what} buffer is a null pointer")));
    }
    if !buf.0.is_multiple_of(dtype.size() as u64) {
        return Err(Error::InvalidArgument(format!(
            "{op}: {whose} {what} buffer {:#x} is not aligned to its element size ({} bytes)",
            buf.0,
            dtype.size()
        )));
    }
    let api = crate::driver::api()?;
    let attribute = |which: sys::CUpointer_attribute, out: *mut std::ffi::c_void| {
        // SAFETY: `out` points at a value of the type the attribute writes
        // (an unsigned int, an int, a CUdeviceptr or a size_t, below); any
        // pointer value may be asked about.
        unsafe { api.cuPointerGetAttribute(out, which, buf.0) }
    };
    // CU_MEMORYTYPE_DEVICE (2 in cuda.h's CUmemorytype): cuMemAlloc, pools and
    // managed memory. Host memory, even where the device can reach it, is refused.
    let mut memory_type: std::os::raw::c_uint = 0;
    check(op, attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (&mut memory_type as *mut std::os::raw::c_uint).cast()))?;
    if memory_type != 2 {
        return Err(Error::InvalidArgument(format!("{op}: {whose} {what} buffer {:#x} is not device memory", buf.0)));
    }
    let expected = ctx.ordinal();
    let mut ordinal: std::os::raw::c_int = -1;
    check(op, attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (&mut ordinal as *mut std::os::raw::c_int).cast()))?;
    if ordinal < 0 || ordinal as usize != expected {
        return Err(Error::WrongDevice { op, what, expected, got: ordinal.max(0) as usize });
    }
    let (mut start, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    let range = (
        attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, (&mut start as *mut sys::CUdeviceptr).cast()),
        attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE, (&mut size as *mut usize).cast()),
    );
    if range == (sys::CUresult::CUDA_SUCCESS, sys::CUresult::CUDA_SUCCESS) && size > 0 {
        let room = (start + size as u64).saturating_sub(buf.0);
        if room < bytes as u64 {
            return Err(Error::LengthMismatch { op, expected: bytes / dtype.size(), got: (room / dtype.size() as u64) as usize });
        }
    }
    Ok(())
}

/// Checks one rank's `send` and `recv` (see [`check_buffer`]), which are
/// the same (in place) or do not overlap.
pub(crate) fn check_send_recv(
    op: &'static str,
    ctx: &CudaContext,
    whose: &str,
    send: RawBuffer,
    recv: RawBuffer,
    bytes: usize,
    dtype: DType,
) -> Result<()> {
    check_buffer(op, ctx, whose, "send", send, bytes, dtype)?;
    if recv != send {
        check_buffer(op, ctx, whose, "recv", recv, bytes, dtype)?;
        let (s, d) = (send.0, recv.0);
        if s < d.saturating_add(bytes as u64) && d < s.saturating_add(bytes as u64) {
            return Err(Error::InvalidArgument(format!("{op}: {whose} send and recv buffers overlap without being identical")));
        }
    }
    Ok(())
}
