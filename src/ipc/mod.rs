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
//! * (to come: shareable device memory and a communicator of processes.)

pub mod bootstrap;
pub mod fdpass;

pub use bootstrap::{Bootstrap, Exchange, Rendezvous};
