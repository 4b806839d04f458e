//! [`Collectives`] for the communicator of one host's ranks: the checks of
//! each call, its descriptor, the ordering of the caller's buffers, then
//! the enqueue (`ops` and the one-shot in `super`).

use super::ops::{bytes_of, equal_parts};
use super::{desc, Comm, Kind};
use crate::args;
use crate::dtype::{Element, Movable, ReduceOp};
use crate::error::Result;
use crate::sync::Orderer;
use crate::traits::{self, counts_digest, Collectives, PointToPoint, Transfer};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

impl Comm {
    fn check_buffer<T, B: cudarc::driver::DeviceSlice<T>>(&self, op: &'static str, what: &'static str, b: &B) -> Result<()> {
        crate::copy::check_context(op, what, &self.ctx, b.stream().context())
    }
}

impl Collectives for Comm {
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
        Comm::synchronize(self)
    }

    fn async_error(&self) -> Result<()> {
        self.held.ctl.check()
    }

    /// The one-shot over every rank's slots, or the two-shot (see
    /// [`super::AllReduceAlgorithm`] and the module docs of [`super`]).
    fn all_reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()> {
        let count = args::all_reduce(&self.ctx, send, recv, op)?;
        let call = self.enter(self.all_reduce_desc::<T>(op, count))?;
        if count == 0 {
            return Ok(());
        }
        let (src, read) = self.order.read(send, &self.stream)?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let launched = self.all_reduce_body::<T>(op, src, dst, count);
        launched.and(call.end()).and(read.finish()).and(write.finish())
    }

    fn all_reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp) -> Result<()> {
        let count = args::all_reduce_in_place(&self.ctx, buf, op)?;
        let call = self.enter(self.all_reduce_desc::<T>(op, count))?;
        if count == 0 {
            return Ok(());
        }
        let (ptr, held) = self.order.write(buf, &self.stream)?;
        let launched = self.all_reduce_body::<T>(op, ptr, ptr, count);
        launched.and(call.end()).and(held.finish())
    }

    fn all_gather<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D) -> Result<()> {
        let (n, c) = (self.size, args::all_gather(&self.ctx, self.size, send, recv)?);
        let call = self.enter(desc::<T>(Kind::AllGather, None, c, None))?;
        if c == 0 {
            return Ok(());
        }
        let (src, read) = self.order.read(send, &self.stream)?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let r = self.all_gather_body(src, dst, &bytes_of(&equal_parts(c, n), std::mem::size_of::<T>()));
        r.and(call.end()).and(read.finish()).and(write.finish())
    }

    fn reduce_scatter<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()> {
        let (n, c) = (self.size, args::reduce_scatter(&self.ctx, self.size, send, recv, op)?);
        let call = self.enter(desc::<T>(Kind::ReduceScatter, Some(op), c, None))?;
        if c == 0 {
            return Ok(());
        }
        let (src, read) = self.order.read(send, &self.stream)?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let r = self.reduce_scatter_body::<T>(op, src, dst, &equal_parts(c, n), false);
        r.and(call.end()).and(read.finish()).and(write.finish())
    }

    /// The root's `send` is copied into its `recv`, then broadcast in place;
    /// a root without `send`, or with one of another length, is an error on
    /// the root before anything is enqueued (its peers then wait for its
    /// call: [`crate::error::Error::Timeout`] with `check_calls`).
    fn broadcast<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: Option<&S>, recv: &mut D, root: usize) -> Result<()> {
        let send = args::broadcast(&self.ctx, self.size, self.rank, send, recv, root)?;
        let count = recv.len();
        let call = self.enter(desc::<T>(Kind::Broadcast, None, count, Some(root)))?;
        if count == 0 {
            return Ok(());
        }
        let read = send.map(|s| self.order.read(s, &self.stream)).transpose()?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let r = self.guarded(|| match &read {
            Some((src, _)) => self.copy(dst, *src, count * std::mem::size_of::<T>()),
            None => Ok(()),
        });
        let r = r.and_then(|()| if self.size > 1 { self.broadcast_body(dst, count * std::mem::size_of::<T>(), root) } else { Ok(()) });
        let r = r.and(call.end());
        let r = match read {
            Some((_, guard)) => r.and(guard.finish()),
            None => r,
        };
        r.and(write.finish())
    }

    fn broadcast_in_place<T: Movable, D: DevicePtrMut<T>>(&self, buf: &mut D, root: usize) -> Result<()> {
        let count = args::broadcast_in_place(&self.ctx, self.size, buf, root)?;
        let call = self.enter(desc::<T>(Kind::Broadcast, None, count, Some(root)))?;
        if count == 0 || self.size == 1 {
            return Ok(());
        }
        let (ptr, held) = self.order.write(buf, &self.stream)?;
        let r = self.broadcast_body(ptr, count * std::mem::size_of::<T>(), root);
        r.and(call.end()).and(held.finish())
    }

    fn reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp, root: usize) -> Result<()> {
        let count = args::reduce(&self.ctx, self.size, send, recv, op, root)?;
        let call = self.enter(desc::<T>(Kind::Reduce, Some(op), count, Some(root)))?;
        if count == 0 {
            return Ok(());
        }
        let (src, read) = self.order.read(send, &self.stream)?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let r = self.reduce_body::<T>(op, src, dst, count, root);
        r.and(call.end()).and(read.finish()).and(write.finish())
    }

    fn reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp, root: usize) -> Result<()> {
        let count = args::reduce_in_place(&self.ctx, self.size, buf, op, root)?;
        let call = self.enter(desc::<T>(Kind::Reduce, Some(op), count, Some(root)))?;
        if count == 0 {
            return Ok(());
        }
        let (ptr, held) = self.order.write(buf, &self.stream)?;
        let r = self.reduce_body::<T>(op, ptr, ptr, count, root);
        r.and(call.end()).and(held.finish())
    }

    crate::traits::point_to_point_calls!();

    /// Blocks that fit the one-kernel exchange (at most 256 KiB and a
    /// point-to-point slot) as one launch of the point-to-point exchange
    /// kernel, a job per peer; larger ones through the staging buffers,
    /// as the reduce-scatter's sends and the all-gather's reads (see the
    /// module docs of [`super`]).
    fn all_to_all<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D) -> Result<()> {
        self.check_buffer("all_to_all", "send", send)?;
        self.check_buffer("all_to_all", "recv", recv)?;
        let c = traits::equal_blocks("all_to_all", send.len(), recv.len(), self.size)?;
        let call = self.enter(desc::<T>(Kind::AllToAll, None, c, None))?;
        if c == 0 {
            return Ok(());
        }
        let (src, read) = self.order.read(send, &self.stream)?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let r = self.all_to_all_body(src, dst, c * std::mem::size_of::<T>());
        r.and(call.end()).and(read.finish()).and(write.finish())
    }

    fn all_gather_v<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, counts: &[usize]) -> Result<()> {
        let (offsets, total) = args::all_gather_v(&self.ctx, self.size, self.rank, send, recv, counts)?;
        let mut d = desc::<T>(Kind::AllGatherV, None, total, None);
        d.extra = counts_digest(counts);
        let call = self.enter(d)?;
        if total == 0 {
            return Ok(());
        }
        let parts: Vec<(usize, usize)> = offsets.iter().zip(counts).map(|(&o, &c)| (o, c)).collect();
        let (src, read) = self.order.read(send, &self.stream)?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let r = self.all_gather_body(src, dst, &bytes_of(&parts, std::mem::size_of::<T>()));
        r.and(call.end()).and(read.finish()).and(write.finish())
    }

    fn reduce_scatter_v<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(
        &self,
        send: &S,
        recv: &mut D,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let (offsets, total) = args::reduce_scatter_v(&self.ctx, self.size, self.rank, send, recv, counts, op)?;
        let mut d = desc::<T>(Kind::ReduceScatterV, Some(op), total, None);
        d.extra = counts_digest(counts);
        let call = self.enter(d)?;
        if total == 0 {
            return Ok(());
        }
        let parts: Vec<(usize, usize)> = offsets.iter().zip(counts).map(|(&o, &c)| (o, c)).collect();
        let (src, read) = self.order.read(send, &self.stream)?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let r = self.reduce_scatter_body::<T>(op, src, dst, &parts, false);
        r.and(call.end()).and(read.finish()).and(write.finish())
    }
}

impl PointToPoint for Comm {
    fn p2p_context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn orderer(&self) -> &Orderer {
        &self.order
    }

    fn transfers(&self, ts: &[Transfer]) -> Result<()> {
        Comm::transfers(self, ts)
    }
}
