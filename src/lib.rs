//! # cuda-peer
//!
//! CUDA peer memory for Rust programs that already use [`cudarc`]: which
//! devices can reach each other ([`topology`]), peer access as RAII guards
//! ([`peer`]), verified peer copies with a staged-host fallback ([`copy`]),
//! and ring collectives over those links ([`group`]). `Auto` links follow
//! the verdicts `cuda-peer doctor` cached for this machine ([`verdict`]).
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
#![deny(missing_docs)]

pub mod collectives;
pub mod copy;
pub mod driver;
pub mod dtype;
pub mod error;
pub mod failure;
mod fused_check;
mod graph;
pub mod group;
#[cfg(target_os = "linux")]
pub mod ipc;
pub(crate) mod kernels;
mod launch;
mod mesh;
pub mod oneshot;
pub mod peer;
pub mod raw;
mod reach;
mod ring;
pub mod schedule;
mod sync;
pub mod topology;
pub mod verdict;

pub use cuda_peer_sys as sys;

/// The README's code, compiled as a doctest so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
pub use copy::{Link, LinkOptions, Path, PathPolicy};
pub use cudarc;
pub use dtype::{DType, Element, ReduceOp};
pub use error::{Error, Result};
pub use group::{
    Algorithm, Group, GroupOptions, DEFAULT_BARRIER_TIMEOUT, DEFAULT_LAUNCH_SPIN, HOST_ONESHOT_AUTO_MAX_BYTES, MESH_AUTO_MAX_BYTES,
    ONESHOT_AUTO_MAX_BYTES,
};
pub use raw::{RawBuffer, RawStream};
