//! [`Collectives`] for the communicator of one host's ranks: the checks of
//! each call, its descriptor, the ordering of the caller's buffers, then
//! the enqueue (`ops` and the one-shot in `super`).

use super::{desc, Comm, Kind};
use crate::dtype::{Element, ReduceOp};
use crate::error::{Error, Result};
use crate::traits::Collectives;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
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

    /// The one-shot over every rank's slots (see the module docs of
    /// [`super`]).
    fn all_reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()> {
        op.check(T::DTYPE)?;
        self.check_buffer("all_reduce", "send", send)?;
        self.check_buffer("all_reduce", "recv", recv)?;
        let count = send.len();
        if recv.len() != count {
            return Err(Error::LengthMismatch { op: "all_reduce", expected: count, got: recv.len() });
        }
        let _call = self.enter(desc(Kind::AllReduce, T::DTYPE, Some(op), count, None))?;
        if count == 0 {
            return Ok(());
        }
        let (src, read) = self.order.read(send, &self.stream)?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let launched = self.launch::<T>(op, src, dst, count);
        launched.and(read.finish()).and(write.finish())
    }

    fn all_reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp) -> Result<()> {
        op.check(T::DTYPE)?;
        self.check_buffer("all_reduce", "buffer", buf)?;
        let count = buf.len();
        let _call = self.enter(desc(Kind::AllReduce, T::DTYPE, Some(op), count, None))?;
        if count == 0 {
            return Ok(());
        }
        let (ptr, held) = self.order.write(buf, &self.stream)?;
        let launched = self.launch::<T>(op, ptr, ptr, count);
        launched.and(held.finish())
    }

    fn all_gather<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D) -> Result<()> {
        self.check_buffer("all_gather", "send", send)?;
        self.check_buffer("all_gather", "recv", recv)?;
        let (n, c) = (self.size, send.len());
        let total = c.checked_mul(n).ok_or_else(|| Error::InvalidArgument("all_gather: count overflows".into()))?;
        if recv.len() != total {
            return Err(Error::LengthMismatch { op: "all_gather", expected: total, got: recv.len() });
        }
        let _call = self.enter(desc(Kind::AllGather, T::DTYPE, None, c, None))?;
        if c == 0 {
            return Ok(());
        }
        let (src, read) = self.order.read(send, &self.stream)?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let r = self.all_gather_body::<T>(src, dst, c);
        r.and(read.finish()).and(write.finish())
    }

    fn reduce_scatter<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()> {
        op.check(T::DTYPE)?;
        self.check_buffer("reduce_scatter", "send", send)?;
        self.check_buffer("reduce_scatter", "recv", recv)?;
        let (n, c) = (self.size, recv.len());
        let total = c.checked_mul(n).ok_or_else(|| Error::InvalidArgument("reduce_scatter: count overflows".into()))?;
        if send.len() != total {
            return Err(Error::LengthMismatch { op: "reduce_scatter", expected: total, got: send.len() });
        }
        let _call = self.enter(desc(Kind::ReduceScatter, T::DTYPE, Some(op), c, None))?;
        if c == 0 {
            return Ok(());
        }
        let (src, read) = self.order.read(send, &self.stream)?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let r = self.reduce_scatter_body::<T>(op, src, dst, c);
        r.and(read.finish()).and(write.finish())
    }

    /// The root's `send` is copied into its `recv`, then broadcast in place;
    /// a root without `send`, or with one of another length, is an error on
    /// the root before anything is enqueued (its peers then wait for its
    /// call: [`Error::Timeout`] with `check_calls`).
    fn broadcast<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: Option<&S>, recv: &mut D, root: usize) -> Result<()> {
        crate::error::check_root(root, self.size)?;
        self.check_buffer("broadcast", "recv", recv)?;
        let count = recv.len();
        let send = if self.rank == root {
            let send = send.ok_or_else(|| Error::InvalidArgument("broadcast: the root passes no send buffer".into()))?;
            self.check_buffer("broadcast", "send", send)?;
            if send.len() != count {
                return Err(Error::LengthMismatch { op: "broadcast", expected: count, got: send.len() });
            }
            Some(send)
        } else {
            None
        };
        let _call = self.enter(desc(Kind::Broadcast, T::DTYPE, None, count, Some(root)))?;
        if count == 0 {
            return Ok(());
        }
        let read = send.map(|s| self.order.read(s, &self.stream)).transpose()?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let r = self.guarded(|| match &read {
            Some((src, _)) => self.copy(dst, *src, count * T::DTYPE.size()),
            None => Ok(()),
        });
        let r = r.and_then(|()| if self.size > 1 { self.broadcast_body::<T>(dst, count, root) } else { Ok(()) });
        let r = match read {
            Some((_, guard)) => r.and(guard.finish()),
            None => r,
        };
        r.and(write.finish())
    }

    fn broadcast_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, root: usize) -> Result<()> {
        crate::error::check_root(root, self.size)?;
        self.check_buffer("broadcast", "buffer", buf)?;
        let count = buf.len();
        let _call = self.enter(desc(Kind::Broadcast, T::DTYPE, None, count, Some(root)))?;
        if count == 0 || self.size == 1 {
            return Ok(());
        }
        let (ptr, held) = self.order.write(buf, &self.stream)?;
        let r = self.broadcast_body::<T>(ptr, count, root);
        r.and(held.finish())
    }

    fn reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp, root: usize) -> Result<()> {
        op.check(T::DTYPE)?;
        crate::error::check_root(root, self.size)?;
        self.check_buffer("reduce", "send", send)?;
        self.check_buffer("reduce", "recv", recv)?;
        let count = send.len();
        if recv.len() != count {
            return Err(Error::LengthMismatch { op: "reduce", expected: count, got: recv.len() });
        }
        let _call = self.enter(desc(Kind::Reduce, T::DTYPE, Some(op), count, Some(root)))?;
        if count == 0 {
            return Ok(());
        }
        let (src, read) = self.order.read(send, &self.stream)?;
        let (dst, write) = self.order.write(recv, &self.stream)?;
        let r = self.reduce_body::<T>(op, src, dst, count, root);
        r.and(read.finish()).and(write.finish())
    }

    fn reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp, root: usize) -> Result<()> {
        op.check(T::DTYPE)?;
        crate::error::check_root(root, self.size)?;
        self.check_buffer("reduce", "buffer", buf)?;
        let count = buf.len();
        let _call = self.enter(desc(Kind::Reduce, T::DTYPE, Some(op), count, Some(root)))?;
        if count == 0 {
            return Ok(());
        }
        let (ptr, held) = self.order.write(buf, &self.stream)?;
        let r = self.reduce_body::<T>(op, ptr, ptr, count, root);
        r.and(held.finish())
    }
}
