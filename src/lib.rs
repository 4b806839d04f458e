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
//!
//! # Modules
//!
//! Public:
//! - [`group`]: the communicator API, a [`Group`] of ranks with its options and accessors.
//! - [`collectives`]: the collectives of a group on cudarc buffers.
//! - [`raw`]: the all-reduce of a group on raw device pointers and streams.
//! - `ipc` (Linux): one process per GPU, with bootstrap, shared device memory and `Comm`, and NCCL between hosts (`NcclComm`, `WorldComm`).
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
//! - `algorithms`: the all-reduce algorithms (ring, mesh, one-shot) behind one interface, and the one place that picks among them.
//! - `communicator`: ranks (context, stream, device), routes, launchers and kernel tables, and how one call is launched on every rank.
//! - `kernels`: the embedded kernels, their typed names, and loading them per context.
//! - `launch`: launcher threads that launch one rank's kernel each.
//! - `sync`: ordering callers' buffers with the crate's work.
//! - `reach`: whether a buffer is mapped for a peer's kernels.
//! - `graph`: what captured CUDA graphs keep alive.
//!
//! Dependencies point one way (a unit test reads them from the sources
//! and refuses cycles):
//!
//! ```text
//! group, collectives, raw, ipc          the public API
//!   -> algorithms                       ring, mesh, one-shot; the pick
//!     -> communicator                   ranks, routes, launchers
//!       -> failure, launch, reach, kernels
//!       -> copy (route, staged, verify) transport: path decision, routes, copies
//!         -> verdict, peer, topology, sync, graph
//!           -> driver, dtype, error, sys
//! ```
//!
//! (`failure` keeps its control block in `copy`'s pinned host memory.)
//!
//! Where things go: a new all-reduce algorithm is a module in
//! `algorithms` implementing `AllReduce`, opened in `Algorithms::open` and
//! picked in `algorithms::choose`; a new collective (all-to-all, say) is a
//! schedule in `algorithms::schedule` and a method in [`collectives`]; a
//! new kind of route (another process's rank, `Ipc`) is a `Route` variant
//! in `copy::route`, matched by the ring's pull and built with the route
//! table.
#![deny(missing_docs)]

mod algorithms;
pub mod collectives;
#[cfg(target_os = "linux")]
pub mod comm;
#[cfg(target_os = "linux")]
pub mod compat;
mod communicator;
pub mod copy;
pub mod driver;
pub mod dtype;
pub mod error;
pub mod failure;
mod graph;
pub mod group;
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
pub use dtype::{DType, Element, ReduceOp};
pub use error::{Error, Result};
pub use group::{Algorithm, Group, GroupOptions, Selected, DEFAULT_BARRIER_TIMEOUT, DEFAULT_LAUNCH_SPIN};
#[cfg(target_os = "linux")]
pub use ipc::{CommOptions, Id};
pub use raw::{RawBuffer, RawStream};
pub use traits::Collectives;

/// The module dependency graph, read from the sources: no cycles, and the
/// layers point one way (see the crate docs).
#[cfg(test)]
mod layering {
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::Path;

    /// Every `.rs` file under `dir`, recursively.
    fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("src is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    /// `module -> modules it names as crate::name` (code lines only, not
    /// comments), by top-level module of the crate.
    fn edges() -> BTreeMap<String, BTreeSet<String>> {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut paths = Vec::new();
        files(&src, &mut paths);
        let module_of = |p: &Path| {
            let rel = p.strip_prefix(&src).expect("under src");
            let first = rel.components().next().expect("a component").as_os_str().to_string_lossy().to_string();
            first.trim_end_matches(".rs").to_string()
        };
        let modules: BTreeSet<String> = paths.iter().map(|p| module_of(p)).filter(|m| m != "lib").collect();
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for p in &paths {
            let from = module_of(p);
            let text = std::fs::read_to_string(p).expect("a readable source file");
            for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
                for (i, _) in line.match_indices("crate::") {
                    let rest = &line[i + "crate::".len()..];
                    let name: String = rest.chars().take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_').collect();
                    if name != from && modules.contains(&name) {
                        graph.entry(from.clone()).or_default().insert(name);
                    }
                }
            }
        }
        graph
    }

    /// A cycle in `graph`, if there is one.
    fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
        fn visit(n: &str, graph: &BTreeMap<String, BTreeSet<String>>, done: &mut BTreeSet<String>, stack: &mut Vec<String>) -> Option<Vec<String>> {
            if let Some(at) = stack.iter().position(|s| s == n) {
                let mut c = stack[at..].to_vec();
                c.push(n.to_string());
                return Some(c);
            }
            if done.contains(n) {
                return None;
            }
            stack.push(n.to_string());
            for m in graph.get(n).into_iter().flatten() {
                if let Some(c) = visit(m, graph, done, stack) {
                    return Some(c);
                }
            }
            stack.pop();
            done.insert(n.to_string());
            None
        }
        let mut done = BTreeSet::new();
        graph.keys().find_map(|n| visit(n, graph, &mut done, &mut Vec::new()))
    }

    #[test]
    fn modules_import_each_other_without_cycles() {
        let graph = edges();
        assert_eq!(cycle(&graph), None, "import cycle among modules; graph: {graph:#?}");
    }

    #[test]
    fn the_layers_point_one_way() {
        let graph = edges();
        let uses = |a: &str, b: &str| graph.get(a).is_some_and(|s| s.contains(b));
        assert!(uses("group", "algorithms") && uses("algorithms", "communicator") && uses("communicator", "copy"), "{graph:#?}");
        for (lower, upper) in [("algorithms", "group"), ("communicator", "algorithms"), ("communicator", "group"), ("copy", "communicator")] {
            assert!(!uses(lower, upper), "{lower} must not depend on {upper}");
        }
    }

    #[test]
    fn a_cycle_is_found() {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        g.entry("a".into()).or_default().insert("b".into());
        g.entry("b".into()).or_default().insert("a".into());
        assert_eq!(cycle(&g), Some(vec!["a".to_string(), "b".into(), "a".into()]));
    }
}
