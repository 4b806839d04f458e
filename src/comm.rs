//! [`Comm`]: one rank's communicator, on the caller's stream, with the
//! names and argument order of `cudarc::nccl::Comm`. The same type whether
//! the ranks are threads of this process ([`Comm::from_devices`]),
//! processes of this host, or processes on several hosts
//! ([`Comm::from_rank`] with an [`Id`], [`Comm::from_env`],
//! [`Comm::from_exchange`]).
//!
//! Underneath, the engine is picked once, when the communicator is made,
//! from where the ranks run:
//! * every rank on this host: cuda-peer's own paths ([`ipc::Comm`]): each
//!   rank's slots and staging buffer in its device memory, mapped by every
//!   peer (threads and processes alike meet on the device, through memory
//!   each rank exports and the others import), or in host memory they
//!   share where there is no P2P;
//! * ranks on several hosts, equal contiguous groups of two or more per
//!   host: two tiers, cuda-peer inside each host and NCCL across;
//! * otherwise NCCL for every rank.
//!
//! Calls may be captured into CUDA graphs. Within a host, a rank's calls
//! and replays run in the order the host issued them, wherever a replay is
//! launched, once the first graph's first launch comes after the calls
//! made before its capture in the stream order; across hosts (NCCL), launch
//! replays in the order of the communicator's stream (docs/algorithms.md,
//! "CUDA graphs").
//!
//! ```no_run
//! use cuda_peer::{Comm, Id, ReduceOp};
//! # fn main() -> Result<(), cuda_peer::Error> {
//! # let (rank, world_size) = (0, 2);
//! # fn send_to_other_ranks(_: &[u8]) {}
//! # fn receive_from_rank0() -> Vec<u8> { vec![] }
//! let stream = cuda_peer::driver::context(rank)?.default_stream();
//! let id = if rank == 0 {
//!     let id = Id::new()?;
//!     send_to_other_ranks(id.as_bytes()); // the application's own channel
//!     id
//! } else {
//!     Id::from_bytes(&receive_from_rank0())?
//! };
//! let comm = Comm::from_rank(stream.clone(), rank, world_size, id)?;
//! let mut x = stream.clone_htod(&[rank as f32; 1024]).unwrap();
//! comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
//! # Ok(()) }
//! ```

use crate::dtype::{Element, Movable, ReduceOp};
use crate::error::{Error, Result};
use crate::ipc::{self, bootstrap::Exchange, nccl::NcclComm, tiered, tiered::Tiered, Bootstrap, CommOptions, Id, ThreadExchange};
use crate::traits::{Blocks, Collectives};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

pub mod group;
mod raw;
mod split;

/// What carries a [`Comm`]'s collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Engine {
    /// cuda-peer between the ranks of one host ([`ipc::Comm`]), on this path.
    Host(crate::copy::Path),
    /// NCCL between hosts ([`NcclComm`]).
    Nccl,
    /// cuda-peer inside each host (on this path), NCCL across hosts.
    Tiered(crate::copy::Path),
}

/// The engine of one [`Comm`].
enum Inner {
    Host(Box<ipc::Comm>),
    /// NCCL, and the exchange the ranks met through (kept for
    /// [`Comm::exchange`]).
    Nccl(Box<NcclComm>, Box<dyn Exchange>),
    Tiered(Box<Tiered>),
}

/// One rank's communicator (see the module docs). `Send + Sync`: it may be
/// called from any thread, one call at a time per rank in the order every
/// rank makes them.
pub struct Comm {
    inner: Inner,
    /// What it was made with (for [`Comm::split`]).
    opts: CommOptions,
    /// The events of the raw-pointer calls ([`Comm::all_reduce_raw`]),
    /// made on first use; held for a whole call.
    raw_events: std::sync::Mutex<Option<crate::raw::RawEvents>>,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm").field("rank", &self.rank()).field("world_size", &self.world_size()).field("engine", &self.engine()).finish()
    }
}

/// Runs `$body` with `$c` bound to the engine's communicator.
macro_rules! either {
    ($self:expr, $c:ident => $body:expr) => {
        match &$self.inner {
            Inner::Host($c) => $body,
            Inner::Nccl($c, _) => $body,
            Inner::Tiered($c) => $body,
        }
    };
}

impl Comm {
    /// Rank `rank` of `world_size`, meeting the others where `id` says
    /// (made by [`Id::new`] on rank 0 and sent by the application to the
    /// other ranks), every collective enqueued on `stream`. Blocks until
    /// every rank has joined (bounded by [`CommOptions::timeout`]).
    pub fn from_rank(stream: Arc<CudaStream>, rank: usize, world_size: usize, id: Id) -> Result<Comm> {
        Comm::from_rank_with(stream, rank, world_size, id, &CommOptions::default())
    }

    /// As [`Self::from_rank`], with `opts`.
    pub fn from_rank_with(stream: Arc<CudaStream>, rank: usize, world_size: usize, id: Id, opts: &CommOptions) -> Result<Comm> {
        let rv = Bootstrap::from_id(rank, world_size, &id)?.with_timeout(opts.timeout).connect()?;
        Comm::from_exchange(stream, Box::new(rv), opts)
    }

    /// From torchrun's variables ([`Bootstrap::from_env`], as `cuda-peer-run`
    /// sets them): meets the other ranks and makes the communicator on a
    /// new stream of device `LOCAL_RANK` (modulo the device count with
    /// [`CommOptions::share_devices`]). Use [`Self::from_exchange`] with
    /// `Bootstrap::from_env()?.connect()?` for a stream of your own.
    pub fn from_env(opts: &CommOptions) -> Result<Comm> {
        let boot = Bootstrap::from_env()?;
        let rv = boot.clone().with_timeout(opts.timeout).connect()?;
        let stream = crate::driver::device_count().and_then(|devices| {
            let device = if opts.share_devices { boot.local_rank % devices.max(1) } else { boot.local_rank };
            crate::driver::context(device)?.new_stream().map_err(crate::error::cudarc_err("cuStreamCreate"))
        });
        Comm::create(stream, Box::new(rv), opts)
    }

    /// The ranks of `exchange` (the application's own store, or a
    /// [`crate::ipc::Rendezvous`]), this one enqueueing on `stream`. Every
    /// rank must call it at the same time.
    pub fn from_exchange(stream: Arc<CudaStream>, exchange: Box<dyn Exchange>, opts: &CommOptions) -> Result<Comm> {
        Comm::create(Ok(stream), exchange, opts)
    }

    /// Picks the engine from every rank's host (a rank without a stream
    /// fails every rank here, instead of leaving them waiting).
    fn create(stream: Result<Arc<CudaStream>>, exchange: Box<dyn Exchange>, opts: &CommOptions) -> Result<Comm> {
        let mine = stream.as_ref().map(|_| ipc::host_identity().into_bytes()).map_err(Clone::clone);
        let hosts = ipc::bootstrap::agree(&*exchange, "communicator: the ranks' hosts", mine)?;
        let stream = stream?;
        let inner = if hosts.iter().all(|h| *h == hosts[0]) {
            Inner::Host(Box::new(ipc::Comm::with_stream(exchange, stream, opts)?))
        } else if let Some(layout) = tiered::layout(&hosts) {
            Inner::Tiered(Box::new(Tiered::new(exchange, layout, stream, opts)?))
        } else {
            let comm = NcclComm::on_stream(&*exchange, stream, opts.barrier_timeout)?;
            Inner::Nccl(Box::new(comm), exchange)
        };
        Ok(Comm { inner, opts: opts.clone(), raw_events: Default::default() })
    }

    /// One communicator per stream, rank r on `streams[r]`, for one process
    /// that drives each rank from a thread of its own (as
    /// `ncclCommInitAll`): each `Comm` must be called from its own thread,
    /// concurrently with the others (a call waits for every rank's). The
    /// ranks meet on the device as processes do. Streams may share a device
    /// (ranks then take turns on it); each rank needs its own stream. Where
    /// they share one, launch graphs of the ranks' calls on each
    /// communicator's stream: launched on other streams and ordered with it
    /// through events, they sometimes stalled until the barrier timeout
    /// (docs/multiprocess.md, "Ranks sharing a device").
    pub fn from_devices(streams: Vec<Arc<CudaStream>>) -> Result<Vec<Comm>> {
        Comm::from_devices_with(streams, &CommOptions::default())
    }

    /// As [`Self::from_devices`], with `opts` ([`CommOptions::share_devices`]
    /// is taken as set).
    pub fn from_devices_with(streams: Vec<Arc<CudaStream>>, opts: &CommOptions) -> Result<Vec<Comm>> {
        if streams.is_empty() {
            return Err(Error::InvalidArgument("Comm::from_devices: no streams".into()));
        }
        let exchanges = ThreadExchange::new(streams.len(), opts.timeout)?;
        let opts = opts.clone().share_devices(true);
        let made: Vec<Result<Comm>> = std::thread::scope(|s| {
            let handles: Vec<_> = streams
                .into_iter()
                .zip(exchanges)
                .map(|(stream, ex)| {
                    let opts = &opts;
                    s.spawn(move || Comm::from_exchange(stream, Box::new(ex), opts))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::Internal("a rank's thread panicked".into())))).collect()
        });
        made.into_iter().collect()
    }

    /// What carries the collectives.
    pub fn engine(&self) -> Engine {
        match &self.inner {
            Inner::Host(c) => Engine::Host(c.path()),
            Inner::Nccl(..) => Engine::Nccl,
            Inner::Tiered(t) => Engine::Tiered(t.local_path()),
        }
    }

    /// Why the ranks of this host exchange data the way [`Self::engine`]
    /// says (`P2P, verified`, or which rank staged and why: the policy, the
    /// driver, the doctor's verdict, or a failed check at creation that
    /// made every rank fall back; see [`CommOptions::path`]); `None` where
    /// NCCL carries every collective.
    pub fn path_reason(&self) -> Option<&str> {
        match &self.inner {
            Inner::Host(c) => Some(c.path_reason()),
            Inner::Nccl(..) => None,
            Inner::Tiered(t) => Some(t.local_path_reason()),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        either!(self, c => c.rank())
    }

    /// How many ranks the communicator has.
    pub fn world_size(&self) -> usize {
        either!(self, c => c.size())
    }

    /// The stream every collective is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        either!(self, c => c.stream())
    }

    /// This rank's device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        either!(self, c => c.context())
    }

    /// This rank's device ordinal.
    pub fn ordinal(&self) -> usize {
        self.context().ordinal()
    }

    /// The exchange the ranks met through: small all-gathers and barriers
    /// on the host (every rank must make the same calls).
    pub fn exchange(&self) -> &dyn Exchange {
        match &self.inner {
            Inner::Host(c) => c.exchange(),
            Inner::Nccl(_, ex) => &**ex,
            Inner::Tiered(t) => t.exchange(),
        }
    }

    /// Waits, bounded, for this rank's collectives to finish on the device;
    /// a failure since the last call (a peer that gave up) is its error.
    pub fn synchronize(&self) -> Result<()> {
        either!(self, c => c.synchronize())
    }

    /// A failure already known, without waiting for the device
    /// ([`Collectives::async_error`]).
    pub fn async_error(&self) -> Result<()> {
        either!(self, c => Collectives::async_error(&**c))
    }

    /// `recv` becomes the reduction, in rank order, of every rank's `send`
    /// ([`Collectives::all_reduce`]).
    pub fn all_reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()> {
        either!(self, c => Collectives::all_reduce(&**c, send, recv, op))
    }

    /// `buf` becomes the reduction of every rank's `buf`
    /// ([`Collectives::all_reduce_in_place`]).
    pub fn all_reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp) -> Result<()> {
        either!(self, c => Collectives::all_reduce_in_place(&**c, buf, op))
    }

    /// `recv` becomes every rank's `send` in rank order
    /// ([`Collectives::all_gather`]).
    pub fn all_gather<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D) -> Result<()> {
        either!(self, c => Collectives::all_gather(&**c, send, recv))
    }

    /// `recv` becomes this rank's block of the reduction
    /// ([`Collectives::reduce_scatter`]).
    pub fn reduce_scatter<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()> {
        either!(self, c => Collectives::reduce_scatter(&**c, send, recv, op))
    }

    /// Every rank's `recv` becomes the root's `send`
    /// ([`Collectives::broadcast`]).
    pub fn broadcast<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: Option<&S>, recv: &mut D, root: usize) -> Result<()> {
        either!(self, c => Collectives::broadcast(&**c, send, recv, root))
    }

    /// Every rank's `buf` becomes the root's ([`Collectives::broadcast_in_place`]).
    pub fn broadcast_in_place<T: Movable, D: DevicePtrMut<T>>(&self, buf: &mut D, root: usize) -> Result<()> {
        either!(self, c => Collectives::broadcast_in_place(&**c, buf, root))
    }

    /// The root's `recv` becomes the reduction of every rank's `send`
    /// ([`Collectives::reduce`]).
    pub fn reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp, root: usize) -> Result<()> {
        either!(self, c => Collectives::reduce(&**c, send, recv, op, root))
    }

    /// The root's `buf` becomes the reduction of every rank's `buf`
    /// ([`Collectives::reduce_in_place`]).
    pub fn reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp, root: usize) -> Result<()> {
        either!(self, c => Collectives::reduce_in_place(&**c, buf, op, root))
    }

    /// Sends `send` to rank `peer` ([`Collectives::send`]).
    pub fn send<T: Movable, S: DevicePtr<T>>(&self, send: &S, peer: usize) -> Result<()> {
        either!(self, c => Collectives::send(&**c, send, peer))
    }

    /// Receives from rank `peer` into `recv` ([`Collectives::recv`]).
    pub fn recv<T: Movable, D: DevicePtrMut<T>>(&self, recv: &mut D, peer: usize) -> Result<()> {
        either!(self, c => Collectives::recv(&**c, recv, peer))
    }

    /// Block `j` of `recv` becomes block `rank()` of rank `j`'s `send`
    /// ([`Collectives::all_to_all`]).
    pub fn all_to_all<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D) -> Result<()> {
        either!(self, c => Collectives::all_to_all(&**c, send, recv))
    }

    /// The all-to-all with per-peer counts and offsets
    /// ([`Collectives::all_to_all_v`]).
    pub fn all_to_all_v<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(
        &self,
        send: &S,
        send_blocks: &Blocks<'_>,
        recv: &mut D,
        recv_blocks: &Blocks<'_>,
    ) -> Result<()> {
        either!(self, c => Collectives::all_to_all_v(&**c, send, send_blocks, recv, recv_blocks))
    }

    /// The all-gather with uneven parts ([`Collectives::all_gather_v`]).
    pub fn all_gather_v<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, counts: &[usize]) -> Result<()> {
        either!(self, c => Collectives::all_gather_v(&**c, send, recv, counts))
    }

    /// The reduce-scatter with uneven parts
    /// ([`Collectives::reduce_scatter_v`]).
    pub fn reduce_scatter_v<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(
        &self,
        send: &S,
        recv: &mut D,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        either!(self, c => Collectives::reduce_scatter_v(&**c, send, recv, counts, op))
    }
}

impl Collectives for Comm {
    fn rank(&self) -> usize {
        Comm::rank(self)
    }

    fn world_size(&self) -> usize {
        Comm::world_size(self)
    }

    fn stream(&self) -> &Arc<CudaStream> {
        Comm::stream(self)
    }

    fn synchronize(&self) -> Result<()> {
        Comm::synchronize(self)
    }

    fn async_error(&self) -> Result<()> {
        Comm::async_error(self)
    }

    fn all_reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()> {
        Comm::all_reduce(self, send, recv, op)
    }

    fn all_reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp) -> Result<()> {
        Comm::all_reduce_in_place(self, buf, op)
    }

    fn all_gather<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D) -> Result<()> {
        Comm::all_gather(self, send, recv)
    }

    fn reduce_scatter<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()> {
        Comm::reduce_scatter(self, send, recv, op)
    }

    fn broadcast<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: Option<&S>, recv: &mut D, root: usize) -> Result<()> {
        Comm::broadcast(self, send, recv, root)
    }

    fn broadcast_in_place<T: Movable, D: DevicePtrMut<T>>(&self, buf: &mut D, root: usize) -> Result<()> {
        Comm::broadcast_in_place(self, buf, root)
    }

    fn reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp, root: usize) -> Result<()> {
        Comm::reduce(self, send, recv, op, root)
    }

    fn reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp, root: usize) -> Result<()> {
        Comm::reduce_in_place(self, buf, op, root)
    }

    fn send<T: Movable, S: DevicePtr<T>>(&self, send: &S, peer: usize) -> Result<()> {
        Comm::send(self, send, peer)
    }

    fn recv<T: Movable, D: DevicePtrMut<T>>(&self, recv: &mut D, peer: usize) -> Result<()> {
        Comm::recv(self, recv, peer)
    }

    fn all_to_all<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D) -> Result<()> {
        Comm::all_to_all(self, send, recv)
    }

    fn all_to_all_v<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(
        &self,
        send: &S,
        send_blocks: &Blocks<'_>,
        recv: &mut D,
        recv_blocks: &Blocks<'_>,
    ) -> Result<()> {
        Comm::all_to_all_v(self, send, send_blocks, recv, recv_blocks)
    }

    fn all_gather_v<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, counts: &[usize]) -> Result<()> {
        Comm::all_gather_v(self, send, recv, counts)
    }

    fn reduce_scatter_v<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(
        &self,
        send: &S,
        recv: &mut D,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        Comm::reduce_scatter_v(self, send, recv, counts, op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send_sync<T: Send + Sync>() {}

    #[test]
    fn a_comm_may_be_shared_between_threads() {
        send_sync::<Comm>();
    }

    #[test]
    fn no_streams_is_an_invalid_argument() {
        assert!(matches!(Comm::from_devices(Vec::new()), Err(Error::InvalidArgument(_))));
    }
}
