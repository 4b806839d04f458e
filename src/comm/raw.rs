//! [`Comm::all_reduce_raw`]: this rank's all-reduce on raw device pointers
//! and the caller's stream (see [`crate::raw`] for the types and the
//! ordering).

use super::{Comm, Inner};
use crate::dtype::{with_element, DType, ReduceOp};
use crate::error::Result;
use crate::raw::{self, RawBuffer, RawEvents, RawStream};

impl Comm {
    /// Out-of-place all-reduce on raw device pointers: `recv` becomes the
    /// reduction, in rank order, of every rank's `send` (`count` elements of
    /// `dtype` each; the same pointer for in place), ordered on the
    /// caller's `stream` (see [`crate::raw`]): the communicator's stream
    /// waits for `stream`, the collective is enqueued as
    /// [`Comm::all_reduce`] enqueues it (every rank's call checked against
    /// the others', the same engine), and `stream` waits for it. A capture
    /// begun on `stream` is joined by the communicator's stream and holds
    /// what the call touches, as for the other calls. Every rank calls it
    /// with the same `count`, `dtype` and `op` (in its order of calls, as
    /// for any collective; a rank may mix it with the other calls).
    ///
    /// Checked, with typed errors, before anything is enqueued: `op`
    /// defined for `dtype` ([`ReduceOp::check`]); `stream` of this rank's
    /// context; neither pointer null; both aligned to the element size;
    /// both device memory of this rank's device (as the driver reports it:
    /// memory type and device ordinal), holding `count` elements from the
    /// pointer on where the driver reports the allocation's range; `send`
    /// and `recv` the same or not overlapping. Unlike
    /// [`crate::Group::all_reduce_raw`], no peer ever reads these buffers
    /// (the peers read this rank's own working memory), so any device
    /// memory of this device will do, a private pool's or VMM memory
    /// mapped here included.
    ///
    /// # Safety
    ///
    /// Until the point that the call leaves on `stream` has been passed on
    /// the device:
    /// - `send` and `recv` point at `count` elements of `dtype` in device
    ///   memory of this rank's device, usable from this rank's context
    ///   ([`Comm::context`]);
    /// - that memory stays allocated; nothing else writes `send` or reads
    ///   or writes `recv` (other work may run on `stream` before or after
    ///   the call, which is ordered after and before it);
    /// - `stream` is a live stream of this rank's context (or null, its
    ///   legacy stream).
    ///
    /// The checks above catch the cheap cases; the rest is the caller's
    /// promise.
    pub unsafe fn all_reduce_raw(&self, send: RawBuffer, recv: RawBuffer, count: usize, dtype: DType, op: ReduceOp, stream: RawStream) -> Result<()> {
        const OP: &str = "all_reduce_raw";
        op.check(dtype)?;
        let bytes = raw::byte_count(OP, count, dtype)?;
        let ctx = self.context();
        // SAFETY: `stream` is a live stream or null (the caller's contract).
        unsafe { raw::check_stream(OP, ctx, "this rank's", "the communicator's", stream) }?;
        raw::check_send_recv(OP, ctx, "this rank's", send, recv, bytes, dtype)?;
        let mut events = self.raw_events.lock().unwrap_or_else(|p| p.into_inner());
        let events = match &mut *events {
            Some(e) => e,
            empty => empty.insert(RawEvents::new(ctx)?),
        };
        let own = self.stream();
        // SAFETY: `stream` is a live stream of this rank's context (checked
        // above, and the caller's contract).
        unsafe { events.fork(ctx, own, stream) }?;
        let (src, dst) = (send.0, recv.0);
        // The buffers are ordered on the communicator's stream now (the
        // caller's contract keeps them alive and untouched until `stream`
        // passes the join below).
        let work = match &self.inner {
            Inner::Host(c) => with_element!(dtype, T => c.all_reduce_ptrs::<T>(op, src, dst, count)),
            Inner::Nccl(c, _) => c.all_reduce_ptrs(dtype, op, src, dst, count),
            Inner::Tiered(t) => with_element!(dtype, T => t.all_reduce_ordered::<T>(op, src, dst, count)),
        };
        // The caller's stream waits for whatever was enqueued, after a
        // failure part-way too.
        // SAFETY: as for the fork above.
        work.and(unsafe { events.join(ctx, own, stream) })
    }
}
