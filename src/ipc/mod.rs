//! One process per GPU: the pieces for running cuda-peer's collectives
//! between processes of one host, as tensor-parallel frameworks run them.
//!
//! * [`Bootstrap`]: a rank's place in the job, from torchrun's variables
//!   (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//!   `MASTER_ADDR`, `MASTER_PORT`) or given; [`Bootstrap::connect`] meets
//!   the other ranks through a small TCP rendezvous that rank 0 serves
//!   ([`Rendezvous`], an [`Exchange`]: all-gathers of small blobs), which
//!   only ranks that prove the job's secret ([`secret`]) may join; or from
//!   an [`Id`] that rank 0 makes and the application sends to the others
//!   ([`Bootstrap::from_id`]).
//! * [`fdpass`]: file descriptors between the processes of one host, over
//!   Unix domain sockets (`SCM_RIGHTS`).
//! * [`vmm`]: device memory another process can map ([`DeviceRegion`]).
//! * `shm` (crate-private): host memory shared between the processes (a `memfd`), where a
//!   communicator's ranks compare their calls.
//! * [`Comm`]: a communicator of processes, one rank per process on its
//!   own GPU, with all-reduce (the one-shot over peer memory),
//!   reduce-scatter, all-gather, broadcast and reduce.
//! * [`nccl`]: the collectives between hosts, on NCCL loaded at run time
//!   ([`NcclComm`]); [`spans_hosts`] says whether a job needs it.
//! * [`ThreadExchange`]: the exchange of ranks that are threads of one
//!   process.
//!
//! These are the engines under [`crate::comm::Comm`], the per-rank communicator
//! applications use: [`Comm`] within one host; across hosts, two tiers
//! (cuda-peer inside each host, NCCL across) or [`NcclComm`] alone.
//!
//! The `cuda-peer-run` launcher (the `run/` crate of the workspace) starts
//! a program as N processes with torchrun's variables set.
//!
//! ```no_run
//! use cuda_peer::{Comm, CommOptions, ReduceOp};
//! # fn main() -> Result<(), cuda_peer::Error> {
//! let comm = Comm::from_env(&CommOptions::default())?; // under cuda-peer-run or torchrun
//! let mut x = comm.stream().clone_htod(&[comm.rank() as f32; 1024]).unwrap();
//! comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
//! # Ok(()) }
//! ```

pub mod bootstrap;
pub mod comm;
pub mod fdpass;
mod host;
pub mod id;
pub mod nccl;
pub mod secret;
pub(crate) mod shm;
pub mod threads;
pub(crate) mod tiered;
pub mod vmm;
mod wire;

pub use bootstrap::{Bootstrap, Exchange, Rendezvous};
pub use comm::{AllReduceAlgorithm, Comm, CommOptions};
pub use host::{host_identity, spans_hosts, HOST_ID_ENV};
pub use id::Id;
pub use nccl::NcclComm;
pub use secret::JobSecret;
pub use threads::ThreadExchange;
pub use vmm::DeviceRegion;
