//! The plan: which points, in which order, and how many calls each.

use crate::cli::Common;
use crate::kinds::{Dt, Op};
use crate::units::GIB;
/// Bytes moved per timed point, at most (more only where `MIN_ITERS` needs it).
const BYTES_PER_POINT: usize = 2 * GIB;
const MIN_ITERS: usize = 5;
const MAX_ITERS: usize = 200;

/// Buffer sizes of one point, after nccl-tests' rounding to whole blocks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    /// Elements per rank in the send buffer (0 for in-place collectives).
    pub(crate) send: usize,
    /// Elements per rank in the receive (or in-place) buffer.
    pub(crate) recv: usize,
    /// The count column: elements passed to the call.
    pub(crate) count: usize,
    /// The size column, in bytes.
    pub(crate) bytes: usize,
}

impl Shape {
    /// The shape for a requested size, or `None` when it rounds to nothing.
    pub(crate) fn new(op: Op, bytes: usize, esz: usize, n: usize) -> Option<Shape> {
        let elems = bytes / esz;
        let shape = match op {
            Op::AllReduce | Op::Broadcast => Shape { send: 0, recv: elems, count: elems, bytes: elems * esz },
            Op::ReduceScatter => {
                let block = elems / n;
                Shape { send: block * n, recv: block, count: block, bytes: block * n * esz }
            }
            Op::AllGather => {
                let block = elems / n;
                Shape { send: block, recv: block * n, count: block, bytes: block * n * esz }
            }
        };
        (shape.count > 0).then_some(shape)
    }
}

/// Everything a sweep runs over.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    /// Collectives, in order.
    pub(crate) ops: Vec<Op>,
    /// Element types, in order.
    pub(crate) dtypes: Vec<Dt>,
    /// Requested sizes in bytes, in order.
    pub(crate) sizes: Vec<usize>,
    /// Ranks (GPUs or processes).
    pub(crate) ranks: usize,
}

impl Plan {
    /// The plan of `ops` over `ranks` from the command line: its element
    /// types, and its sizes doubling (quadrupling with `--quick`).
    pub(crate) fn new(ops: Vec<Op>, common: &Common, ranks: usize) -> Plan {
        let factor = if common.quick { 4 } else { 2 };
        Plan { ops, dtypes: common.dtypes.clone(), sizes: geometric(common.min_bytes, common.max_bytes, factor), ranks }
    }

    /// The points of one implementation, in order.
    pub(crate) fn points(&self) -> Vec<(Op, Dt, Shape)> {
        let mut v = Vec::new();
        for &op in &self.ops {
            for &dt in &self.dtypes {
                v.extend(self.sizes.iter().filter_map(|&b| Shape::new(op, b, dt.size(), self.ranks)).map(|s| (op, dt, s)));
            }
        }
        v
    }
}

/// `min, min*factor, ...` up to `max`.
pub(crate) fn geometric(min: usize, max: usize, factor: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min.max(1);
    while s <= max {
        v.push(s);
        match s.checked_mul(factor) {
            Some(next) => s = next,
            None => break,
        }
    }
    v
}

/// Timed calls for a point of `bytes`: `iters` (`--iters`), or enough to move about 2 GiB.
pub(crate) fn iters_for(iters: Option<usize>, bytes: usize) -> usize {
    iters.unwrap_or_else(|| (BYTES_PER_POINT / bytes.max(1)).clamp(MIN_ITERS, MAX_ITERS)).max(1)
}

/// Warm-up calls: `warmup` (`--warmup`), but at most 1 GiB of them and at least one.
pub(crate) fn warmup_for(warmup: usize, bytes: usize) -> usize {
    warmup.min(GIB / bytes.max(1)).max(1)
}

/// The `[k/total]` lines on stderr.
pub(crate) struct Progress {
    /// Points done so far.
    pub(crate) done: usize,
    /// Points in the whole run.
    pub(crate) total: usize,
}

impl Progress {
    /// A child process's progress: `--progress-offset` points of
    /// `--progress-total` done (by default, of the child's own `points`).
    pub(crate) fn resume(common: &Common, points: usize) -> Progress {
        Progress { done: common.progress_offset, total: common.progress_total.unwrap_or(points) }
    }

    /// Counts one more point and says which.
    pub(crate) fn tick(&mut self, what: std::fmt::Arguments) {
        self.done += 1;
        eprintln!("[{}/{}] {what}", self.done, self.total);
    }
}
