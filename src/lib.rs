//! # cuda-peer
//!
//! CUDA peer memory and collectives for Rust programs that already use
//! [`cudarc`]: which devices can reach each other ([`topology`]), peer
//! access as RAII guards ([`peer`]), verified peer copies with a
//! staged-host fallback ([`copy`]), and collectives over those links: one
//! communicator per rank on the caller's stream (`Comm`, with the names
//! of `cudarc::nccl::Comm`), for ranks that are threads, processes of one
//! host or processes on several hosts, and the single-process [`Group`],
//! where one caller passes every rank's buffers. `Auto` links follow the
//! verdicts `cuda-peer doctor` cached for this machine ([`verdict`]).
//!
//! The driver is loaded at run time ([`driver`]); on a machine with no GPU or
//! no driver every entry point returns an [`Error`] instead of panicking.
//!
//! ```no_run
//! use cuda_peer::{copy::{Link, LinkOptions}, driver};
//! # fn main() -> Result<(), cuda_peer::Error> {
//! let (gpu0, gpu1) = (driver::context(0)?, driver::context(1)?);
//! let (s0, s1) = (gpu0.default_stream(), gpu1.default_stream());
//! let src = s0.clone_htod(&[1.0f32, 2.0, 3.0]).unwrap();
//! let mut dst = s1.alloc_zeros::<f32>(3).unwrap();
//! let mut link = Link::open(&gpu0, &gpu1, &LinkOptions::default())?; // verified P2P, or staged
//! link.copy(&src, &mut dst, &s1)?;
//! assert_eq!(s1.clone_dtoh(&dst).unwrap(), vec![1.0, 2.0, 3.0]);
//! # Ok(()) }
//! ```
//!
//! # Modules
//!
//! Public:
//! - `comm` (Linux): the per-rank communicator `Comm` (`from_rank` with an `Id`, `from_env`, `from_exchange`, `from_devices`), its collectives, point-to-point calls (`send`, `recv`, `group`), all-to-all(-v), the uneven collectives and `split`, and `Engine`, what carries them.
//! - [`traits`]: [`Collectives`], the collectives and point-to-point calls of one rank with cudarc's names, implemented by `Comm` and by every engine under it (the point-to-point calls written once over each engine's transfers), and [`Blocks`].
//! - `compat` (Linux): shapes of other libraries' APIs over cuda-peer's own (`compat::nccl`: `cudarc::nccl`'s paths and signatures over `Comm`).
//! - `ipc` (Linux): the per-rank engines and how ranks meet: bootstrap, `Id`, `ThreadExchange`, shared device and host memory, `ipc::Comm` within a host, NCCL between hosts (`NcclComm`) and the two tiers.
//! - [`group`]: the single-process API, a [`Group`] of ranks with its options and accessors.
//! - [`collectives`]: the collectives of a group on cudarc buffers.
//! - [`raw`]: raw device pointers and streams, which both APIs' all-reduce takes (`Comm::all_reduce_raw`, `Group::all_reduce_raw`).
//! - [`verdict`]: the doctor's cached verdicts per pair, and the speed rule the doctor and `Auto` share.
//! - [`copy`]: the transport, with verified links, the path decision, routes between ranks, staging.
//! - [`peer`]: peer access as RAII guards.
//! - [`topology`]: which devices can reach each other, and how.
//! - [`driver`]: loading the driver, devices, and cudarc contexts made only once it loads.
//! - [`failure`]: what happens when a fused collective cannot complete on every rank.
//! - [`dtype`]: element types and reduction operations.
//! - [`error`]: the crate's one error type.
//!
//! Inside:
//! - `args`: the argument checks of each per-rank collective, once for every engine.
//! - `algorithms`: the group's all-reduce algorithms (ring, mesh, one-shot) behind one interface, and the one place that picks among them; the one-shot's layout, which `ipc` uses too.
//! - `communicator`: the group's ranks (context, stream, device), routes, launchers and kernel tables, and how one call is launched on every rank.
//! - `kernels`: the embedded kernels, their typed names, loading them per context, and one typed launch per kernel for both engines.
//! - `launch`: launcher threads that launch one rank's kernel each (the group's).
//! - `sync`: ordering callers' buffers with the crate's work.
//! - `reach`: whether a buffer is mapped for a peer's kernels.
//! - `graph`: what captured CUDA graphs keep alive.
//!
//! Two engines remain: the per-rank one (`ipc::Comm` within a host: the
//! one-shot, or the two-shot where asked, memory each rank exports to its
//! peers) and the
//! group's (ring, mesh and one-shot on the callers' buffers). The group is
//! not yet rebuilt on the per-rank engine; they share the kernels and their
//! launches, the one-shot's layout, `failure`, `graph`, `sync` and the
//! transport.
//!
//! Dependencies point down: a file imports only files of its own layer or
//! of the layers below (a unit test reads the imports from the sources and
//! refuses cycles and imports that point up):
//!
//! ```text
//! api          comm, compat                      the per-rank API: Comm; other libraries' shapes
//!              traits, args                      Collectives, point-to-point over any engine, checks
//!              ipc::comm, ipc::nccl, ipc::tiered its engines: ipc::Comm, NcclComm, two tiers
//!              group, collectives, group_raw     the single-process API: Group
//! algorithms   ring, mesh, one-shot; the pick    the group's (ipc uses the one-shot's layout)
//! engine       communicator, launch, reach       the group's ranks, routes, launchers
//!              failure, kernels                  giving up; the kernels and their typed launches
//! transport    copy, verdict, peer, topology     paths, verified links, routes, copies
//!              ipc::{bootstrap, id, threads,     how ranks meet (Rendezvous, Id, ThreadExchange)
//!              fdpass, shm, vmm}                 and share memory (descriptors, memfd, VMM)
//! ordering     sync, graph, raw                  buffer order, graph keep-alives, raw pointers
//! base         driver, dtype, error, sys
//! ```
//!
//! (`failure` keeps its control block in `copy`'s pinned host memory.)
//!
//! Where things go: a new per-rank collective is a method of
//! [`Collectives`] implemented by each engine (`ipc::Comm`, `NcclComm`, the
//! two tiers) and forwarded by `Comm`, and the compiler lists every engine
//! that lacks it; one made of point-to-point transfers is written once in
//! `traits` over each engine's transfers; a new engine is a variant of
//! `comm::Engine` implementing [`Collectives`]; a new way for ranks to meet
//! is an `ipc::Exchange`. For the group, until it is rebuilt on the
//! per-rank engine: a new all-reduce algorithm is a module in `algorithms`
//! implementing `AllReduce`, opened in `Algorithms::open` and picked in
//! `algorithms::choose`; a new collective is a schedule in
//! `algorithms::schedule` and a method in [`collectives`]; a new kind of
//! route is a `Route` variant in `copy::route`, matched by the ring's pull
//! and built with the route table.
#![deny(missing_docs)]

mod algorithms;
mod args;
pub mod collectives;
#[cfg(target_os = "linux")]
pub mod comm;
mod communicator;
#[cfg(target_os = "linux")]
pub mod compat;
pub mod copy;
pub mod driver;
pub mod dtype;
pub mod error;
pub mod failure;
mod graph;
pub mod group;
mod group_raw;
#[cfg(target_os = "linux")]
pub mod ipc;
pub(crate) mod kernels;
mod launch;
pub mod peer;
pub mod raw;
mod reach;
mod sync;
pub mod topology;
pub mod traits;
pub mod verdict;

pub use cuda_peer_sys as sys;

/// The README's code, compiled as a doctest so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
#[cfg(target_os = "linux")]
pub use comm::Comm;
pub use copy::{Link, LinkOptions, Path, PathPolicy};
pub use cudarc;
pub use dtype::{DType, Element, Movable, ReduceOp};
pub use error::{Error, Result};
/// The fp8 types the data-moving calls take ([`Movable`]).
pub use float8;
pub use group::{Algorithm, Group, GroupOptions, Selected, DEFAULT_BARRIER_TIMEOUT, DEFAULT_LAUNCH_SPIN};
#[cfg(target_os = "linux")]
pub use ipc::{AllReduceAlgorithm, CommOptions, Id};
pub use raw::{RawBuffer, RawStream};
pub use traits::{Blocks, Collectives};

/// The import graph against the table of layers (see the module).
#[cfg(test)]
mod layering;
