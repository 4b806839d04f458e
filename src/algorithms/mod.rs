//! The all-reduce algorithms over a [`Communicator`] (the ring, the mesh
//! and the one-shot), and the one place that picks among them.
//!
//! Each algorithm opens on a communicator (where it applies to the group;
//! a forced one that cannot is
//! [`crate::error::Error::AlgorithmUnavailable`]) and
//! enqueues `outs[r] = reduce(ins)` on every rank ([`AllReduce`]). Which
//! one a call takes is [`Algorithms::pick`]: first availability (what the
//! group opened), then the size thresholds, then the pick; a call
//! evaluates it once. The request ([`Algorithm`], `Auto` or forced) and
//! the result ([`Selected`]) are separate types.

pub(crate) mod check;
pub(crate) mod common;
pub(crate) mod mesh;
pub(crate) mod oneshot;
pub(crate) mod ring;
pub(crate) mod schedule;

use crate::communicator::Communicator;
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
pub(crate) use common::{prescale, prescales, wants_all_pairs, AllReduce, HOST_ONESHOT_AUTO_MAX_BYTES, MESH_AUTO_MAX_BYTES, ONESHOT_AUTO_MAX_BYTES};
pub use common::{Algorithm, Selected};
use mesh::Mesh;
use oneshot::OneShot;
use std::sync::Arc;

/// The algorithm a call takes, with its state.
pub(crate) enum Pick<'a> {
    /// The ring.
    Ring,
    /// The mesh.
    Mesh(&'a Mesh),
    /// The one-shot.
    OneShot(&'a OneShot),
}

impl Pick<'_> {
    /// Which algorithm it is.
    pub(crate) fn selected(&self) -> Selected {
        match self {
            Pick::Ring => Selected::Ring,
            Pick::Mesh(_) => Selected::Mesh,
            Pick::OneShot(_) => Selected::OneShot,
        }
    }

    /// Enqueues the all-reduce of pointers with the picked algorithm
    /// (nothing for `count == 0`).
    pub(crate) fn enqueue(&self, comm: &Communicator, op: ReduceOp, dtype: DType, ins: &[u64], outs: &[u64], count: usize) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        match self {
            Pick::Ring => ring::Ring.enqueue(comm, op, dtype, ins, outs, count),
            Pick::Mesh(mesh) => mesh.enqueue(comm, op, dtype, ins, outs, count),
            Pick::OneShot(os) => os.enqueue(comm, op, dtype, ins, outs, count),
        }
    }
}

/// The algorithms a group opened (the ring needs nothing opened).
pub(crate) struct Algorithms {
    /// What the group was asked for.
    pub(crate) request: Algorithm,
    /// The mesh all-reduce, when the group has it.
    pub(crate) mesh: Option<Arc<Mesh>>,
    /// The one-shot all-reduce, when the group has it.
    pub(crate) oneshot: Option<Arc<OneShot>>,
}

impl Algorithms {
    /// Opens, on `comm`, the fused algorithms that `request` allows and the
    /// group can run; a forced one that it cannot is an error.
    pub(crate) fn open(comm: &Communicator, request: Algorithm) -> Result<Algorithms> {
        let mesh = <Mesh as AllReduce>::open(comm, request)?.map(Arc::new);
        let oneshot = <OneShot as AllReduce>::open(comm, request)?.map(Arc::new);
        Ok(Algorithms { request, mesh, oneshot })
    }

    /// Whether the group has a fused algorithm (mesh or one-shot).
    pub(crate) fn any_fused(&self) -> bool {
        self.mesh.is_some() || self.oneshot.is_some()
    }

    /// The algorithm for an all-reduce of `bytes` bytes per rank on `n`
    /// ranks: what the group has, then the thresholds (under `Auto`), then
    /// the pick.
    pub(crate) fn pick(&self, n: usize, bytes: usize) -> Pick<'_> {
        let oneshot = self.oneshot.as_deref().map(|os| (os, os.on_host()));
        match choose(self.request, n, oneshot.map(|(_, h)| h), self.mesh.is_some(), bytes) {
            Selected::OneShot => oneshot.map_or(Pick::Ring, |(os, _)| Pick::OneShot(os)),
            Selected::Mesh => self.mesh.as_deref().map_or(Pick::Ring, Pick::Mesh),
            Selected::Ring => Pick::Ring,
        }
    }
}

/// The all-reduce algorithm for a message of `bytes` per rank in a group
/// of `n` ranks asked for `request`, with a one-shot (`Some(on_host)`) and
/// a mesh or not.
fn choose(request: Algorithm, n: usize, oneshot: Option<bool>, mesh: bool, bytes: usize) -> Selected {
    let pushed = bytes.saturating_mul(n.saturating_sub(1));
    let auto = request == Algorithm::Auto;
    if let Some(on_host) = oneshot {
        let max = if on_host { HOST_ONESHOT_AUTO_MAX_BYTES } else { ONESHOT_AUTO_MAX_BYTES };
        if !auto || pushed <= max {
            return Selected::OneShot;
        }
    }
    if mesh && (!auto || bytes < MESH_AUTO_MAX_BYTES) {
        return Selected::Mesh;
    }
    Selected::Ring
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::common::layout_refusal;
    use crate::error::Error;

    #[test]
    fn algorithm_names_parse() {
        assert_eq!("auto".parse::<Algorithm>().unwrap(), Algorithm::Auto);
        assert_eq!("ring".parse::<Algorithm>().unwrap(), Algorithm::Ring);
        assert_eq!("mesh".parse::<Algorithm>().unwrap(), Algorithm::Mesh);
        assert_eq!("oneshot".parse::<Algorithm>().unwrap(), Algorithm::OneShot);
        assert_eq!("one-shot".parse::<Algorithm>().unwrap(), Algorithm::OneShot);
        assert!(matches!("tree".parse::<Algorithm>(), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn auto_picks_by_size_and_forced_algorithms_stick() {
        use Algorithm::*;
        let (mib, p2p, host) = (1usize << 20, Some(false), Some(true));
        let s = |request, n, oneshot, mesh, bytes| choose(request, n, oneshot, mesh, bytes);
        // P2P, two ranks: one-shot to 4 MiB, mesh below 256 MiB, ring above.
        assert_eq!(s(Auto, 2, p2p, true, 4096), Selected::OneShot);
        assert_eq!(s(Auto, 2, p2p, true, 4 * mib), Selected::OneShot);
        assert_eq!(s(Auto, 2, p2p, true, 4 * mib + 1), Selected::Mesh);
        assert_eq!(s(Auto, 2, p2p, true, 256 * mib - 1), Selected::Mesh);
        assert_eq!(s(Auto, 2, p2p, true, 256 * mib), Selected::Ring);
        // More ranks push more: the one-shot ends sooner.
        assert_eq!(s(Auto, 5, p2p, true, mib), Selected::OneShot);
        assert_eq!(s(Auto, 5, p2p, true, mib + 1), Selected::Mesh);
        // Without P2P: one-shot through host memory to 16 MiB, then the ring.
        assert_eq!(s(Auto, 2, host, false, 16 * mib), Selected::OneShot);
        assert_eq!(s(Auto, 2, host, false, 16 * mib + 1), Selected::Ring);
        // Groups with neither (one rank, more than 8): the ring.
        assert_eq!(s(Auto, 3, None, false, 4096), Selected::Ring);
        // Forced algorithms hold at every size where the group has them.
        assert_eq!(s(OneShot, 2, p2p, false, 1 << 30), Selected::OneShot);
        assert_eq!(s(OneShot, 2, host, false, 1 << 30), Selected::OneShot);
        assert_eq!(s(Mesh, 2, None, true, 1 << 30), Selected::Mesh);
        assert_eq!(s(Ring, 2, None, false, 4096), Selected::Ring);
    }

    #[test]
    fn fused_layouts_need_two_to_eight_ranks_which_may_share_devices() {
        assert!(layout_refusal(&[0]).is_some());
        assert!(layout_refusal(&[0, 1]).is_none());
        assert!(layout_refusal(&[0, 0]).is_none(), "ranks may share a device");
        assert_eq!(crate::algorithms::common::sharing(&[0, 1, 0, 2, 0]), 3);
        assert_eq!(crate::algorithms::common::sharing(&[3]), 1);
        assert!(layout_refusal(&[0, 1, 2, 3, 4, 5, 6, 7, 8]).is_some());
        assert!(!wants_all_pairs(Algorithm::Ring, &[0, 1]));
        assert!(wants_all_pairs(Algorithm::Auto, &[0, 1]));
        assert!(wants_all_pairs(Algorithm::Mesh, &[0, 0]));
        assert!(!wants_all_pairs(Algorithm::Mesh, &[0]));
    }
}
