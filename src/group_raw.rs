//! [`Group::all_reduce_raw`]: the group's all-reduce on raw device
//! pointers and the callers' streams (see [`crate::raw`] for the types and
//! the ordering).

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::raw::{self, RawBuffer, RawEvents, RawStream};

impl Group {
    /// In-place all-reduce on raw device pointers: every rank's buffer
    /// (`count` elements of `dtype`) becomes the reduction of all ranks'
    /// buffers, ordered on the caller's streams (see [`crate::raw`]).
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
        let bytes = raw::byte_count(OP, count, dtype)?;
        for r in 0..n {
            let (ctx, whose) = (&self.comm.ranks[r].ctx, format!("rank {r}'s"));
            // SAFETY: `streams[r]` is a live stream or null (the caller's contract).
            unsafe { raw::check_stream(OP, ctx, &whose, "the group's", streams[r]) }?;
            raw::check_send_recv(OP, ctx, &whose, send[r], recv[r], bytes, dtype)?;
        }
        if count == 0 {
            return Ok(());
        }
        let events = self.raw_events.get_or_try_init(|| self.comm.ranks.iter().map(|rank| RawEvents::new(&rank.ctx)).collect::<Result<Vec<_>>>())?;
        // The group's streams wait for the callers'.
        let mut forked = 0;
        let mut work = Ok(());
        for (r, rank) in self.comm.ranks.iter().enumerate() {
            // SAFETY: `streams[r]` is a live stream of rank r's context (checked above, and the caller's contract).
            work = unsafe { events[r].fork(&rank.ctx, &rank.stream, streams[r]) };
            if work.is_err() {
                break;
            }
            forked += 1;
        }
        let ins: Vec<u64> = send.iter().map(|b| b.0).collect();
        let outs: Vec<u64> = recv.iter().map(|b| b.0).collect();
        // A capture begun on the callers' streams has reached the group's
        // now: its graph must hold what the call touches, and the call is
        // launched from this thread.
        work = work.and_then(|()| self.see_captures()).and_then(|()| self.pick(bytes).enqueue(&self.comm, op, dtype, &ins, &outs, count));
        // The call's place in the order of calls is recorded on the group's
        // streams before they join back into the callers'.
        self.comm.end_calls();
        // The callers' streams wait for the group's, also after a failure
        // part-way (whatever was enqueued must be done before the buffers
        // are reused, and a capture the forks reached must be joined back).
        let mut joined = Ok(());
        for (r, rank) in self.comm.ranks.iter().enumerate().take(forked) {
            // SAFETY: as for the forks above.
            joined = joined.and(unsafe { events[r].join(&rank.ctx, &rank.stream, streams[r]) });
        }
        work.and(joined)
    }
}
