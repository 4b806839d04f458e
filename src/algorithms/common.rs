//! What every all-reduce algorithm shares: the names a caller asks for
//! ([`Algorithm`]) and gets ([`Selected`]), the size thresholds, the
//! [`AllReduce`] interface, why a group cannot run a fused algorithm, and
//! the prescale of averages.

use crate::communicator::Communicator;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::kernels;

/// Which algorithm a group's all-reduce is asked to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// By message size, where the group allows it (2 to 8 ranks; ranks may
    /// share a device): with P2P verified between every pair (or the pair
    /// on one device), the one-shot
    /// for small messages, the mesh for medium ones, the ring above;
    /// without, the one-shot through host memory for small messages, the
    /// ring above. Other groups always use the ring.
    #[default]
    Auto,
    /// Always the ring (reduce-scatter then all-gather over ring links).
    Ring,
    /// Always the mesh; creating the group fails where it is not possible.
    Mesh,
    /// Always the one-shot all-reduce: slots in peer device memory where
    /// every pair has P2P, else in mapped host memory. Needs 2 to 8 ranks;
    /// creating the group fails otherwise. Ranks that share a device divide
    /// its multiprocessors among their grids (the mesh's too).
    OneShot,
}

impl std::str::FromStr for Algorithm {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Algorithm::Auto),
            "ring" => Ok(Algorithm::Ring),
            "mesh" => Ok(Algorithm::Mesh),
            "oneshot" | "one-shot" => Ok(Algorithm::OneShot),
            other => Err(Error::InvalidArgument(format!("algorithm {other:?}: expected auto, ring, mesh or oneshot"))),
        }
    }
}

/// The algorithm an all-reduce of a given size runs with (the result of
/// the choice; [`Algorithm`] is the request).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Selected {
    /// The ring (reduce-scatter then all-gather over ring links).
    Ring,
    /// The mesh all-reduce (one kernel per rank, peer loads and stores).
    Mesh,
    /// The one-shot all-reduce (one barrier, slots in peer or host memory).
    OneShot,
}

impl From<Selected> for Algorithm {
    fn from(s: Selected) -> Algorithm {
        match s {
            Selected::Ring => Algorithm::Ring,
            Selected::Mesh => Algorithm::Mesh,
            Selected::OneShot => Algorithm::OneShot,
        }
    }
}

/// A result equals the request that forces it (never [`Algorithm::Auto`]).
impl PartialEq<Algorithm> for Selected {
    fn eq(&self, other: &Algorithm) -> bool {
        Algorithm::from(*self) == *other
    }
}

/// Under [`Algorithm::Auto`], a group whose every pair has P2P uses the
/// one-shot while each rank stores at most this many bytes into its peers
/// (message bytes times ranks - 1), the mesh above: beyond it the one-shot's
/// single barrier no longer pays for its extra stores (measured; see
/// docs/measurements.md).
pub(crate) const ONESHOT_AUTO_MAX_BYTES: usize = 4 << 20;

/// Under [`Algorithm::Auto`], a group of 2 to 8 ranks with a staged link
/// (no P2P, or `StagedOnly`) uses the one-shot through host memory while
/// each rank reads at most this many bytes from it (message bytes times
/// ranks - 1), the staged ring above (measured; see docs/measurements.md).
pub(crate) const HOST_ONESHOT_AUTO_MAX_BYTES: usize = 16 << 20;

/// Under [`Algorithm::Auto`], messages of at least this many bytes per rank
/// use the ring even where the mesh is possible: the ring's copy-engine
/// all-gather overtakes the mesh kernel there (measured; see
/// docs/measurements.md).
pub(crate) const MESH_AUTO_MAX_BYTES: usize = 256 << 20;

/// One all-reduce algorithm, opened on a communicator.
pub(crate) trait AllReduce: Sized {
    /// Opens the algorithm on `comm` (its per-rank state) where `request`
    /// allows it and the group can run it: `None` where it does not apply,
    /// [`Error::AlgorithmUnavailable`] where it is forced and cannot run.
    fn open(comm: &Communicator, request: Algorithm) -> Result<Option<Self>>;

    /// Enqueues `outs[r] = reduce(ins)` (`ins == outs`: in place) of
    /// `count > 0` elements of `dtype` on every rank, the division of
    /// [`ReduceOp::Avg`] included. The caller has checked the buffers and
    /// ordered them on the ranks' streams.
    fn enqueue(&self, comm: &Communicator, op: ReduceOp, dtype: DType, ins: &[u64], outs: &[u64], count: usize) -> Result<()>;
}

/// Why ranks on `devices` cannot run a fused all-reduce (mesh or
/// one-shot), if they cannot: both need 2 to 8 ranks (which may share
/// devices: see [`sharing`]).
pub(crate) fn layout_refusal(devices: &[usize]) -> Option<String> {
    let n = devices.len();
    (!(2..=kernels::MESH_MAX_RANKS).contains(&n)).then(|| "needs 2 to 8 ranks".into())
}

/// The most ranks of `devices` on one device: a fused algorithm divides
/// each device's multiprocessors among its ranks' grids, so that the
/// blocks of every rank on a device can be resident at once (its kernels
/// wait for each other's).
pub(crate) fn sharing(devices: &[usize]) -> u32 {
    devices.iter().map(|d| devices.iter().filter(|e| *e == d).count()).max().unwrap_or(1).max(1) as u32
}

/// Whether a group of ranks on `devices` asked for `request` needs to know
/// whether every pair of ranks has P2P (a fused algorithm could use it).
pub(crate) fn wants_all_pairs(request: Algorithm, devices: &[usize]) -> bool {
    request != Algorithm::Ring && layout_refusal(devices).is_none()
}

/// The error for a forced all-reduce algorithm the group cannot run.
pub(crate) fn unavailable(algorithm: &'static str, why: &str) -> Error {
    Error::AlgorithmUnavailable { algorithm, reason: why.to_string() }
}

/// Whether [`ReduceOp::Avg`] of `dtype` over `n` ranks runs as a sum of
/// inputs divided by `n` first (averages are of float types only): dividing
/// after the sum overflows near the top of the range (a 16-bit sum is
/// rounded after every add) although the mean is representable. Every
/// all-reduce algorithm, in one process and between processes, averages
/// this way, and so do reduce-scatter and reduce.
pub(crate) fn prescales(op: ReduceOp, dtype: DType, n: usize) -> bool {
    op == ReduceOp::Avg && dtype.is_float() && n > 1
}

/// Rank `r`'s part of an all-reduce of `op` before its reduction: where
/// [`prescales`], its output becomes its input divided by the rank count (a
/// copy first where out of place), and the rank reduces its output in place
/// with [`ReduceOp::Sum`]. Returns the op and the input to reduce.
pub(crate) fn prescale(comm: &Communicator, op: ReduceOp, dtype: DType, r: usize, input: u64, output: u64, count: usize) -> Result<(ReduceOp, u64)> {
    if !prescales(op, dtype, comm.size()) || count == 0 {
        return Ok((op, input));
    }
    if input != output {
        comm.local_copy(r, output, input, count * dtype.size())?;
    }
    comm.launch_scale_div(r, dtype, output, count, comm.size() as f64)?;
    Ok((ReduceOp::Sum, output))
}

/// [`prescale`] on every rank: the op, and whether the reduction now runs in
/// place on the outputs.
pub(crate) fn prescale_all(comm: &Communicator, op: ReduceOp, dtype: DType, ins: &[u64], outs: &[u64], count: usize) -> Result<(ReduceOp, bool)> {
    let mut reduced = op;
    for r in 0..comm.size() {
        reduced = prescale(comm, op, dtype, r, ins[r], outs[r], count)?.0;
    }
    Ok((reduced, reduced != op))
}
