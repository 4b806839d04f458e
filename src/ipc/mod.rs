//! One process per GPU: the pieces for running cuda-peer's collectives
//! between processes of one host, as tensor-parallel frameworks run them.
//!
//! * [`Bootstrap`]: a rank's place in the job, from torchrun's variables
//!   (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//!   `MASTER_ADDR`, `MASTER_PORT`) or given; [`Bootstrap::connect`] meets
//!   the other ranks through a small TCP rendezvous that rank 0 serves
//!   ([`Rendezvous`], an [`Exchange`]: all-gathers of small blobs).
//! * [`fdpass`]: file descriptors between the processes of one host, over
//!   Unix domain sockets (`SCM_RIGHTS`).
//! * [`vmm`]: device memory another process can map ([`DeviceRegion`]).
//! * [`shm`]: host memory shared between the processes (a `memfd`), where a
//!   communicator's ranks compare their calls.
//! * [`Comm`]: a communicator of processes, one rank per process on its
//!   own GPU, with all-reduce (the one-shot over peer memory),
//!   reduce-scatter, all-gather, broadcast and reduce.
//!
//! The `cuda-peer-run` launcher (the `run/` crate of the workspace) starts
//! a program as N processes with torchrun's variables set.
//!
//! ```no_run
//! use cuda_peer::{ipc::{Comm, CommOptions}, ReduceOp};
//! # fn main() -> Result<(), cuda_peer::Error> {
//! let comm = Comm::from_env(&CommOptions::default())?; // under cuda-peer-run or torchrun
//! let mut x = comm.stream().clone_htod(&[comm.rank() as f32; 1024]).unwrap();
//! comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
//! # Ok(()) }
//! ```

pub mod bootstrap;
pub mod comm;
pub mod fdpass;
pub mod shm;
pub mod vmm;

pub use bootstrap::{Bootstrap, Exchange, Rendezvous};
pub use comm::{Comm, CommOptions};
pub use vmm::DeviceRegion;
