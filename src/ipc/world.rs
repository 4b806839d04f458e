//! One API for a job of processes, wherever its ranks run: [`WorldComm`]
//! runs cuda-peer's own paths ([`Comm`]) when every rank is on one host;
//! when the ranks span hosts, two tiers ([`Tiered`]: cuda-peer inside each
//! host, NCCL across) where the hosts run equal, contiguous groups of at
//! least two ranks, else NCCL for every rank ([`NcclComm`]). Decided at
//! bootstrap from the ranks' host identities ([`super::host_identity`]).

use super::bootstrap::{Bootstrap, Exchange};
use super::comm::{Comm, CommOptions};
use super::nccl::NcclComm;
use super::tiered::{self, Tiered};
use crate::dtype::{Element, ReduceOp};
use crate::error::Result;
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

/// What carries a [`WorldComm`]'s collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Engine {
    /// cuda-peer between the processes of one host ([`Comm`]), on this path.
    Host(crate::copy::Path),
    /// NCCL between hosts ([`NcclComm`]).
    Nccl,
    /// cuda-peer inside each host (on this path), NCCL across hosts ([`Tiered`]).
    Tiered(crate::copy::Path),
}

/// The communicator of a job of processes, one rank per process: the
/// collectives of [`Comm`] with the same signatures, on cuda-peer's paths
/// within one host and on NCCL across hosts (see the module docs).
#[non_exhaustive]
pub enum WorldComm {
    /// Every rank on this host.
    Host(Box<Comm>),
    /// Ranks on several hosts, and the exchange they met through (kept for
    /// [`WorldComm::exchange`]).
    Hosts(Box<NcclComm>, Box<dyn Exchange>),
    /// Ranks on several hosts, in two tiers.
    Tiered(Box<Tiered>),
}

impl std::fmt::Debug for WorldComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorldComm::Host(c) => f.debug_tuple("Host").field(c).finish(),
            WorldComm::Hosts(c, _) => f.debug_tuple("Hosts").field(c).finish(),
            WorldComm::Tiered(c) => f.debug_tuple("Tiered").field(c).finish(),
        }
    }
}

/// Runs `$body` with `$c` bound to the engine's communicator.
macro_rules! either {
    ($self:expr, $c:ident => $body:expr) => {
        match $self {
            WorldComm::Host($c) => $body,
            WorldComm::Hosts($c, _) => $body,
            WorldComm::Tiered($c) => $body,
        }
    };
}

impl WorldComm {
    /// Reads torchrun's variables ([`Bootstrap::from_env`]), meets the other
    /// ranks, and creates the communicator on device `LOCAL_RANK` (modulo
    /// the device count with [`CommOptions::share_devices`], within a host).
    pub fn from_env(opts: &CommOptions) -> Result<WorldComm> {
        let boot = Bootstrap::from_env()?;
        let rv = boot.connect()?;
        let device = if opts.share_devices { boot.local_rank % crate::driver::device_count()?.max(1) } else { boot.local_rank };
        WorldComm::new(Box::new(rv), device, opts)
    }

    /// Creates the communicator of the ranks of `exchange`, this one on
    /// `device`: [`Comm::new`] when they share a host; across hosts,
    /// [`Tiered`] where the hosts run equal, contiguous groups of two or
    /// more ranks, else [`NcclComm::new`] (its waits bounded by
    /// [`CommOptions::barrier_timeout`]). Every rank must call it at the
    /// same time.
    pub fn new(exchange: Box<dyn Exchange>, device: usize, opts: &CommOptions) -> Result<WorldComm> {
        let hosts = super::bootstrap::gather(&*exchange, super::host_identity().as_bytes())?;
        if hosts.iter().all(|h| *h == hosts[0]) {
            return Ok(WorldComm::Host(Box::new(Comm::new(exchange, device, opts)?)));
        }
        if let Some(layout) = tiered::layout(&hosts) {
            return Ok(WorldComm::Tiered(Box::new(Tiered::new(exchange, layout, device, opts)?)));
        }
        let comm = NcclComm::new(&*exchange, device, opts.barrier_timeout)?;
        Ok(WorldComm::Hosts(Box::new(comm), exchange))
    }

    /// What carries the collectives.
    pub fn engine(&self) -> Engine {
        match self {
            WorldComm::Host(c) => Engine::Host(c.path()),
            WorldComm::Hosts(..) => Engine::Nccl,
            WorldComm::Tiered(t) => Engine::Tiered(t.local_path()),
        }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        either!(self, c => c.rank())
    }

    /// How many ranks the job has.
    pub fn size(&self) -> usize {
        either!(self, c => c.size())
    }

    /// The exchange the ranks met through: small all-gathers and barriers
    /// between the processes, on the host (the bootstrap's TCP rendezvous).
    pub fn exchange(&self) -> &dyn Exchange {
        match self {
            WorldComm::Host(c) => c.exchange(),
            WorldComm::Hosts(_, ex) => &**ex,
            WorldComm::Tiered(t) => t.exchange(),
        }
    }

    /// This rank's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        either!(self, c => c.context())
    }

    /// The stream the collectives are enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        either!(self, c => c.stream())
    }

    /// Waits for the collectives enqueued so far, bounded ([`Comm::synchronize`],
    /// [`NcclComm::synchronize`]).
    pub fn synchronize(&self) -> Result<()> {
        either!(self, c => c.synchronize())
    }

    /// [`Comm::all_reduce_in_place`].
    pub fn all_reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp) -> Result<()> {
        either!(self, c => c.all_reduce_in_place(buf, op))
    }

    /// [`Comm::all_reduce`].
    pub fn all_reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()> {
        either!(self, c => c.all_reduce(send, recv, op))
    }

    /// [`Comm::reduce_scatter`].
    pub fn reduce_scatter<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()> {
        either!(self, c => c.reduce_scatter(send, recv, op))
    }

    /// [`Comm::all_gather`].
    pub fn all_gather<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D) -> Result<()> {
        either!(self, c => c.all_gather(send, recv))
    }

    /// [`Comm::broadcast`] (in place).
    pub fn broadcast<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, root: usize) -> Result<()> {
        either!(self, c => c.broadcast(buf, root))
    }

    /// [`Comm::reduce`].
    pub fn reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, root: usize, op: ReduceOp) -> Result<()> {
        either!(self, c => c.reduce(send, recv, root, op))
    }
}
