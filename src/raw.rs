//! Collectives on raw device pointers, for frameworks whose buffers are not
//! cudarc slices (burn/cubecl, tch, C++ libraries): each rank's buffer is a
//! `CUdeviceptr` ([`RawBuffer`]) and each rank's work is ordered on the
//! caller's own stream ([`RawStream`]).
//!
//! Ordering: for each rank r, the group's stream for rank r waits for the
//! caller's stream r (an event recorded there), the collective is enqueued
//! on the group's streams exactly as [`Group::all_reduce_in_place`] enqueues
//! it (same algorithms, same choice by size), and then the caller's stream r
//! waits for the group's stream (another event). So work enqueued on the
//! caller's stream before the call is done before the collective reads the
//! buffers, and work enqueued on it after the call sees the result. The
//! host never waits. Both waits are graph-capture safe (the usual fork and
//! join of a captured stream), so a framework may capture the call into a
//! CUDA graph from its own stream, under the conditions that the README's
//! graph section lists.
//!
//! Nothing here can track the buffers' lifetimes: that is the contract of
//! the `# Safety` sections.

use crate::driver::{event_record, raw_context, raw_event, raw_stream, raw_stream_of, stream_context, stream_wait_event};
use crate::dtype::{DType, ReduceOp};
use crate::error::{check, cudarc_err, Error, Result};
use crate::group::{Group, RawEvents};
use cuda_peer_sys as sys;
use cudarc::driver::sys as cusys;

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

impl Group {
    /// In-place all-reduce on raw device pointers: every rank's buffer
    /// (`count` elements of `dtype`) becomes the reduction of all ranks'
    /// buffers, ordered on the caller's streams (see the module docs).
    /// The algorithm is the one [`Group::all_reduce_algorithm`] names for
    /// `count * dtype.size()` bytes, as for [`Group::all_reduce_in_place`].
    ///
    /// Checked, with typed errors: one buffer and one stream per rank, no
    /// null pointer, every pointer aligned to the element size, `op`
    /// defined for `dtype` ([`ReduceOp::check`]), every stream of rank r's
    /// context, and every buffer device memory of rank r's device (as the
    /// driver reports it: memory type and device ordinal) holding `count`
    /// elements from the pointer on (where the driver reports the
    /// allocation's range).
    ///
    /// # Safety
    ///
    /// For every rank r, until the point that the call leaves on
    /// `streams[r]` has been passed on the device:
    /// - `bufs[r]` points at `count` elements of `dtype` in device memory of
    ///   rank r's device, usable from rank r's context (the group's context
    ///   for that device: the primary context, as cudarc, candle and cubecl
    ///   use), allocated with `cuMemAlloc`, from the device's default memory
    ///   pool (`cuMemAllocAsync`) or another allocation that the group's
    ///   peers can reach once peer access is enabled (so not a private
    ///   memory pool without access granted to the peers, and not VMM memory
    ///   without a mapping for them);
    /// - the memory stays allocated and nothing else reads or writes it
    ///   (other work may run on `streams[r]` before or after the call,
    ///   since the call is ordered after and before it);
    /// - no two ranks' buffers overlap;
    /// - `streams[r]` is a live stream of rank r's context (or null).
    ///
    /// The checks above catch the cheap cases (and a buffer too short for
    /// `count`, where the driver reports the allocation's range); the rest
    /// is the caller's promise.
    pub unsafe fn all_reduce_raw(&self, bufs: &[RawBuffer], count: usize, dtype: DType, op: ReduceOp, streams: &[RawStream]) -> Result<()> {
        // SAFETY: in place (`send == recv`) is allowed by `all_reduce_raw_out_of_place`'s
        // contract, and the caller's contract above is that contract for identical buffers.
        unsafe { self.all_reduce_raw_out_of_place(bufs, bufs, count, dtype, op, streams) }
    }

    /// Out-of-place all-reduce on raw device pointers: `recv[r]` becomes
    /// the reduction of every `send` (`count` elements of `dtype` each);
    /// `send` is unchanged. Otherwise as [`Self::all_reduce_raw`], whose
    /// checks are made on both `send` and `recv`.
    ///
    /// # Safety
    ///
    /// The contract of [`Self::all_reduce_raw`] for every `send[r]` and
    /// every `recv[r]`, where `send[r]` is only read (so may be read by
    /// other work meanwhile), and where `send[r]` and `recv[r]` are either
    /// the same pointer (in place) or do not overlap. No buffer of one rank
    /// overlaps a buffer of another.
    pub unsafe fn all_reduce_raw_out_of_place(
        &self,
        send: &[RawBuffer],
        recv: &[RawBuffer],
        count: usize,
        dtype: DType,
        op: ReduceOp,
        streams: &[RawStream],
    ) -> Result<()> {
        const OP: &str = "all_reduce_raw";
        let _serial = self.enter()?;
        op.check(dtype)?;
        let n = self.size();
        for (what, len) in [("send buffers", send.len()), ("recv buffers", recv.len()), ("streams", streams.len())] {
            if len != n {
                return Err(Error::InvalidArgument(format!("{OP}: {len} {what} for a group of {n} ranks")));
            }
        }
        let bytes = count.checked_mul(dtype.size()).ok_or_else(|| Error::InvalidArgument(format!("{OP}: {count} elements of {dtype} overflow")))?;
        for r in 0..n {
            self.check_raw_stream(r, streams[r])?;
            self.check_raw_buffer(r, "send", send[r], bytes, dtype)?;
            if recv[r] != send[r] {
                self.check_raw_buffer(r, "recv", recv[r], bytes, dtype)?;
                let (s, d) = (send[r].0, recv[r].0);
                if s < d.saturating_add(bytes as u64) && d < s.saturating_add(bytes as u64) {
                    return Err(Error::InvalidArgument(format!("{OP}: rank {r}'s send and recv buffers overlap without being identical")));
                }
            }
        }
        if count == 0 {
            return Ok(());
        }
        let events = self.raw_events.get_or_try_init(|| {
            self.comm
                .ranks
                .iter()
                .map(|rank| {
                    let flags = Some(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
                    Ok(RawEvents {
                        caller_done: rank.ctx.new_event(flags).map_err(cudarc_err("cuEventCreate"))?,
                        group_done: rank.ctx.new_event(flags).map_err(cudarc_err("cuEventCreate"))?,
                    })
                })
                .collect::<Result<Vec<_>>>()
        })?;
        // The group's streams wait for the callers'.
        for r in 0..n {
            let own = raw_stream(&self.comm.ranks[r].stream);
            let caller = raw_stream_of(streams[r].0);
            if caller != own {
                crate::driver::bind(&self.comm.ranks[r].ctx)?;
                let ev = raw_event(&events[r].caller_done);
                // SAFETY: `ev` is an event of rank r's context, which is
                // current; `caller` is a live stream of that context
                // (checked above, and the caller's contract), `own` the
                // group's live stream of it.
                unsafe { event_record("cuEventRecord (caller's stream)", ev, caller) }?;
                // SAFETY: as above.
                unsafe { stream_wait_event("cuStreamWaitEvent", own, ev) }?;
            }
        }
        let ins: Vec<u64> = send.iter().map(|b| b.0).collect();
        let outs: Vec<u64> = recv.iter().map(|b| b.0).collect();
        // A capture begun on the callers' streams has reached the group's
        // now: its graph must hold what the call touches, and the call is
        // launched from this thread.
        let work = self.see_captures().and_then(|()| self.pick(bytes).enqueue(&self.comm, op, dtype, &ins, &outs, count));
        // The callers' streams wait for the group's, also after a failure
        // part-way (whatever was enqueued must be done before the buffers
        // are reused).
        let mut joined = Ok(());
        for r in 0..n {
            let own = raw_stream(&self.comm.ranks[r].stream);
            let caller = raw_stream_of(streams[r].0);
            if caller != own {
                let join = crate::driver::bind(&self.comm.ranks[r].ctx).and_then(|()| {
                    let ev = raw_event(&events[r].group_done);
                    // SAFETY: as for the waits above, the other way round.
                    unsafe { event_record("cuEventRecord", ev, own) }?;
                    // SAFETY: as above.
                    unsafe { stream_wait_event("cuStreamWaitEvent (caller's stream)", caller, ev) }
                });
                joined = joined.and(join);
            }
        }
        work.and(joined)
    }

    /// Checks that `stream` belongs to rank r's context.
    fn check_raw_stream(&self, r: usize, stream: RawStream) -> Result<()> {
        let ctx = &self.comm.ranks[r].ctx;
        crate::driver::bind(ctx)?;
        // SAFETY: `stream` is a live stream (the caller's contract) or null
        // (the current context's, bound above).
        let got = unsafe { stream_context("all_reduce_raw: cuStreamGetCtx (caller's stream)", stream.0) }?;
        if got != raw_context(ctx) {
            return Err(Error::InvalidArgument(format!(
                "all_reduce_raw: rank {r}'s stream is not of the group's context on device {}",
                ctx.ordinal()
            )));
        }
        Ok(())
    }

    /// Checks rank r's buffer: not null, aligned, device memory of rank r's
    /// device, and (where the driver reports the allocation's range) `bytes` long.
    fn check_raw_buffer(&self, r: usize, what: &'static str, buf: RawBuffer, bytes: usize, dtype: DType) -> Result<()> {
        const OP: &str = "all_reduce_raw";
        if buf.0 == 0 {
            return Err(Error::InvalidArgument(format!("{OP}: rank {r}'s {what} buffer is a null pointer")));
        }
        if !buf.0.is_multiple_of(dtype.size() as u64) {
            return Err(Error::InvalidArgument(format!(
                "{OP}: rank {r}'s {what} buffer {:#x} is not aligned to its element size ({} bytes)",
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
        check(OP, attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (&mut memory_type as *mut std::os::raw::c_uint).cast()))?;
        if memory_type != 2 {
            return Err(Error::InvalidArgument(format!("{OP}: rank {r}'s {what} buffer {:#x} is not device memory", buf.0)));
        }
        let expected = self.comm.ranks[r].ctx.ordinal();
        let mut ordinal: std::os::raw::c_int = -1;
        check(OP, attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (&mut ordinal as *mut std::os::raw::c_int).cast()))?;
        if ordinal < 0 || ordinal as usize != expected {
            return Err(Error::WrongDevice { op: OP, what, expected, got: ordinal.max(0) as usize });
        }
        let (mut start, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        let range = (
            attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, (&mut start as *mut sys::CUdeviceptr).cast()),
            attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE, (&mut size as *mut usize).cast()),
        );
        if range == (sys::CUresult::CUDA_SUCCESS, sys::CUresult::CUDA_SUCCESS) && size > 0 {
            let room = (start + size as u64).saturating_sub(buf.0);
            if room < bytes as u64 {
                return Err(Error::LengthMismatch { op: OP, expected: bytes / dtype.size(), got: (room / dtype.size() as u64) as usize });
            }
        }
        Ok(())
    }
}
