//! [`Collectives`]: what one rank's communicator does, with the names and
//! argument order of `cudarc::nccl::Comm`. Every per-rank communicator
//! implements it ([`crate::Comm`], and the engines under it), so a new
//! collective is a method here and the compiler lists every engine that
//! must carry it.

use crate::dtype::{Element, ReduceOp};
use crate::error::Result;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

/// The collectives of one rank (see the module docs). Each call enqueues on
/// [`Self::stream`] and returns; buffers written or read on other streams
/// are ordered with it through cudarc's event tracking. Every rank must
/// make the same calls (collective, element type, count, op, root) in the
/// same order.
pub trait Collectives {
    /// This rank.
    fn rank(&self) -> usize;

    /// How many ranks the communicator has.
    fn world_size(&self) -> usize;

    /// The stream every collective is enqueued on.
    fn stream(&self) -> &Arc<CudaStream>;

    /// Waits for this rank's collectives to finish on the device, bounded;
    /// a failure since the last call (a peer that gave up) is its error.
    fn synchronize(&self) -> Result<()>;

    /// A failure already known, without waiting for the device: a peer that
    /// gave up (found in the control block), NCCL's asynchronous error, or
    /// an earlier call's failure that left the communicator unusable.
    /// `Ok` does not mean that enqueued work will succeed.
    fn async_error(&self) -> Result<()>;

    /// `recv` becomes the reduction, in rank order, of every rank's `send`
    /// (of one length).
    fn all_reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()>;

    /// `buf` becomes the reduction, in rank order, of every rank's `buf`.
    fn all_reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp) -> Result<()>;

    /// `recv` (`world_size() * c` elements) becomes every rank's `send` (c
    /// elements) in rank order.
    fn all_gather<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D) -> Result<()>;

    /// `recv` (c elements) becomes block `rank()` of the reduction of every
    /// rank's `send` (`world_size() * c` elements).
    fn reduce_scatter<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()>;

    /// Every rank's `recv` becomes rank `root`'s `send`: only the root's is
    /// read (the others may pass `None`, and what they pass is ignored); a
    /// root without one is an error.
    fn broadcast<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: Option<&S>, recv: &mut D, root: usize) -> Result<()>;

    /// Every rank's `buf` becomes rank `root`'s.
    fn broadcast_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, root: usize) -> Result<()>;

    /// Rank `root`'s `recv` becomes the reduction of every rank's `send`;
    /// the other ranks' `recv` (as long as `send`) is not written.
    fn reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp, root: usize) -> Result<()>;

    /// Rank `root`'s `buf` becomes the reduction of every rank's `buf`; the
    /// others' are not written.
    fn reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp, root: usize) -> Result<()>;
}
