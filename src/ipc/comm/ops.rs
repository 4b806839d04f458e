//! The collectives of a [`Comm`] other than all-reduce: reduce-scatter,
//! all-gather (both also with uneven parts), all-to-all, broadcast and
//! reduce, through the ranks' staging buffers (see the module docs of
//! [`super`]).

use super::{desc, AllReduceAlgorithm, Comm, Kind};
use crate::algorithms::prescales;
use crate::driver::{api, bind};
use crate::dtype::{DType, Element, Movable, ReduceOp};
use crate::error::{check, Error, Result};
use crate::ipc::shm::CallDesc;
use crate::kernels;
use crate::kernels::load::function;
use crate::kernels::{Kernel, KernelOp};

/// Whether an all-reduce on `n` ranks runs as the two-shot under
/// `algorithm` (see [`AllReduceAlgorithm::Auto`]: not yet by size).
fn two_shot(algorithm: AllReduceAlgorithm, n: usize) -> bool {
    match algorithm {
        AllReduceAlgorithm::OneShot | AllReduceAlgorithm::Auto => false,
        AllReduceAlgorithm::TwoShot => n > 1,
    }
}

/// `c` elements in `ranks` parts as even as can be, the first `c % ranks`
/// one longer, in rank order: (offset, count).
fn split(c: usize, ranks: usize) -> Vec<(usize, usize)> {
    let (each, more) = (c / ranks, c % ranks);
    (0..ranks).map(|j| (j * each + j.min(more), each + usize::from(j < more))).collect()
}

impl Comm {
    /// Whether this communicator's all-reduces run as the two-shot.
    fn takes_two_shot(&self) -> bool {
        two_shot(self.all_reduce, self.size)
    }

    /// An all-reduce's descriptor, the two-shot marked in `extra`, so that
    /// ranks whose calls would take different algorithms are a mismatch.
    pub(super) fn all_reduce_desc<T: Element>(&self, op: ReduceOp, count: usize) -> CallDesc {
        CallDesc { extra: u64::from(self.takes_two_shot()), ..desc::<T>(Kind::AllReduce, Some(op), count, None) }
    }

    /// The all-reduce's enqueue (`src` and `dst` ordered on this
    /// communicator's stream, `count` elements, the same or disjoint): the
    /// one-shot, or the two-shot: a reduce-scatter into this rank's part of
    /// `dst`, then an all-gather of every rank's part.
    pub(super) fn all_reduce_body<T: Element>(&self, op: ReduceOp, src: u64, dst: u64, count: usize) -> Result<()> {
        if !self.takes_two_shot() {
            return self.launch::<T>(op, src, dst, count);
        }
        let esz = T::DTYPE.size();
        let parts = split(count, self.size);
        let mine = dst + (parts[self.rank].0 * esz) as u64;
        // In place, the reduce-scatter reads this rank's own share from its
        // staging slot: its part of `dst` is its input until overwritten.
        self.reduce_scatter_body::<T>(op, src, mine, &parts, src == dst)?;
        self.all_gather_body(mine, dst, &bytes_of(&parts, esz))
    }

    /// The reduce-scatter on pointers already ordered on this
    /// communicator's stream (`src`: `size() * c` elements, `dst`: c), for
    /// the collectives built on this one ([`super::super::tiered`]).
    pub(crate) fn reduce_scatter_ptrs<T: Element>(&self, op: ReduceOp, src: u64, dst: u64, c: usize) -> Result<()> {
        let _call = self.enter(desc::<T>(Kind::ReduceScatter, Some(op), c, None))?;
        if c == 0 {
            return Ok(());
        }
        self.reduce_scatter_body::<T>(op, src, dst, &equal_parts(c, self.size), false)
    }

    /// The reduce-scatter's enqueue: `dst` becomes part `rank()` of the
    /// reduction of every rank's `src`, whose part `j` is `parts[j]`
    /// (offset, count) in elements. With `own_staged`, this rank's own part
    /// is read from its staging slot, copied there first (`dst` may then be
    /// that part of `src`); else `dst` and `src` are disjoint.
    pub(super) fn reduce_scatter_body<T: Element>(&self, op: ReduceOp, src: u64, dst: u64, parts: &[(usize, usize)], own_staged: bool) -> Result<()> {
        let (n, esz) = (self.size, T::DTYPE.size());
        let me = self.rank;
        let (mine, c) = parts[me];
        let most = parts.iter().map(|p| p.1).max().unwrap_or(0);
        // An average sums shares divided first (as the all-reduce does), so
        // that it cannot overflow where the mean is representable: each
        // share is divided in the staging slot it is sent from, this rank's
        // own in its own slot.
        let pre = prescales(op, T::DTYPE, n);
        let own = pre || own_staged;
        self.guarded(|| {
            if n == 1 {
                return self.copy(dst, src + (mine * esz) as u64, c * esz);
            }
            // Each chunk: this rank's share of part q at q * stride of its
            // staging half, for rank q to read.
            let stride = self.slot_bytes();
            self.staged(
                most,
                stride / esz,
                |o, len, h| {
                    for q in (0..n).filter(|&q| q != me || own) {
                        let (at, cq) = parts[q];
                        let len = len.min(cq.saturating_sub(o));
                        let slot = self.data[me] + h + (q * stride) as u64;
                        self.copy(slot, src + ((at + o) * esz) as u64, len * esz)?;
                        if pre {
                            self.divide::<T>(slot, len)?;
                        }
                    }
                    Ok(())
                },
                |o, len, h| {
                    let len = len.min(c.saturating_sub(o));
                    if len == 0 {
                        return Ok(());
                    }
                    let part = |k: usize| if k == me && !own { src + ((mine + o) * esz) as u64 } else { self.data[k] + h + (me * stride) as u64 };
                    self.fold::<T>(op, dst + (o * esz) as u64, part, len)
                },
            )?;
            if pre {
                Ok(())
            } else {
                self.average::<T>(op, dst, c)
            }
        })
    }

    /// The all-gather on pointers already ordered on this
    /// communicator's stream (`src`: c elements, `dst`: `size() * c`).
    pub(crate) fn all_gather_ptrs<T: Element>(&self, src: u64, dst: u64, c: usize) -> Result<()> {
        let _call = self.enter(desc::<T>(Kind::AllGather, None, c, None))?;
        if c == 0 {
            return Ok(());
        }
        let esz = T::DTYPE.size();
        self.all_gather_body(src, dst, &bytes_of(&equal_parts(c, self.size), esz))
    }

    /// The all-gather's enqueue: part `j` of `dst` (`parts[j]`: offset and
    /// length, in bytes) becomes rank `j`'s `src` (this rank's `src` may be
    /// its own part of `dst`; else they are disjoint).
    pub(super) fn all_gather_body(&self, src: u64, dst: u64, parts: &[(usize, usize)]) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let most = parts.iter().map(|p| p.1).max().unwrap_or(0);
        self.guarded(|| {
            let own = dst + parts[me].0 as u64;
            if own != src {
                self.copy(own, src, parts[me].1)?;
            }
            if n == 1 {
                return Ok(());
            }
            self.staged(
                most,
                self.half,
                |o, len, h| self.copy(self.data[me] + h, src + o as u64, len.min(parts[me].1.saturating_sub(o))),
                |o, len, h| {
                    for k in (0..n).filter(|&k| k != me) {
                        let (at, ck) = parts[k];
                        self.copy(dst + (at + o) as u64, self.data[k] + h, len.min(ck.saturating_sub(o)))?;
                    }
                    Ok(())
                },
            )
        })
    }

    /// The all-to-all's enqueue: block `j` of `dst` becomes block `rank()`
    /// of rank `j`'s `src` (blocks of `block` bytes).
    pub(super) fn all_to_all_body(&self, src: u64, dst: u64, block: usize) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        self.guarded(|| {
            self.copy(dst + (me * block) as u64, src + (me * block) as u64, block)?;
            if n == 1 {
                return Ok(());
            }
            // Blocks that fit the one-kernel exchange: every peer's
            // exchange in one launch (the point-to-point path's).
            if block <= self.fused_bound() {
                let pairs: Vec<_> =
                    (0..n).filter(|&q| q != me).map(|q| (q, (src + (q * block) as u64, block), (dst + (q * block) as u64, block))).collect();
                return self.exchange_blocks(&pairs);
            }
            let stride = self.slot_bytes();
            // Each chunk: this rank's block for q at q * stride of its
            // staging half, for rank q to read.
            self.staged(
                block,
                stride,
                |o, len, h| {
                    for q in (0..n).filter(|&q| q != me) {
                        self.copy(self.data[me] + h + (q * stride) as u64, src + (q * block + o) as u64, len)?;
                    }
                    Ok(())
                },
                |o, len, h| {
                    for k in (0..n).filter(|&k| k != me) {
                        self.copy(dst + (k * block + o) as u64, self.data[k] + h + (me * stride) as u64, len)?;
                    }
                    Ok(())
                },
            )
        })
    }

    /// The broadcast in place on a pointer already ordered on this
    /// communicator's stream (`root` < `size()`, checked by the caller).
    pub(crate) fn broadcast_ptrs<T: Movable>(&self, ptr: u64, count: usize, root: usize) -> Result<()> {
        let _call = self.enter(desc::<T>(Kind::Broadcast, None, count, Some(root)))?;
        if count == 0 || self.size == 1 {
            return Ok(());
        }
        self.broadcast_body(ptr, count * std::mem::size_of::<T>(), root)
    }

    /// The broadcast's enqueue: `bytes` at `ptr` of the root's, into every
    /// other rank's `ptr`.
    pub(super) fn broadcast_body(&self, ptr: u64, bytes: usize, root: usize) -> Result<()> {
        let me = self.rank;
        self.guarded(|| {
            self.staged(
                bytes,
                self.half,
                |o, len, h| if me == root { self.copy(self.data[me] + h, ptr + o as u64, len) } else { Ok(()) },
                |o, len, h| if me == root { Ok(()) } else { self.copy(ptr + o as u64, self.data[root] + h, len) },
            )
        })
    }

    /// The reduce's enqueue: rank `root`'s `dst` becomes the reduction of
    /// every rank's `src` (`count` elements; `src` may be `dst`: the root
    /// then stages its own part too, so that it is read before it is
    /// overwritten).
    pub(super) fn reduce_body<T: Element>(&self, op: ReduceOp, src: u64, dst: u64, count: usize, root: usize) -> Result<()> {
        let (n, me, esz) = (self.size, self.rank, T::DTYPE.size());
        // An average sums parts divided first (see `reduce_scatter_body`):
        // every rank divides its part in its staging buffer.
        let pre = prescales(op, T::DTYPE, n);
        let staged_here = me != root || src == dst || pre;
        self.guarded(|| {
            if n == 1 {
                return self.copy(dst, src, count * esz);
            }
            self.staged(
                count,
                self.half / esz,
                |o, len, h| {
                    if !staged_here {
                        return Ok(());
                    }
                    self.copy(self.data[me] + h, src + (o * esz) as u64, len * esz)?;
                    if pre {
                        self.divide::<T>(self.data[me] + h, len)?;
                    }
                    Ok(())
                },
                |o, len, h| {
                    if me != root {
                        return Ok(());
                    }
                    let part = |k: usize| if k == me && !staged_here { src + (o * esz) as u64 } else { self.data[k] + h };
                    self.fold::<T>(op, dst + (o * esz) as u64, part, len)
                },
            )?;
            if me == root && !pre {
                self.average::<T>(op, dst, count)?;
            }
            Ok(())
        })
    }

    /// The bytes of one rank's slot in a staging half: the half divided
    /// among the ranks, 256-byte aligned (slot `q` of a rank's half is for
    /// rank `q` to read: the reduce-scatter's and all-to-all's shares, the
    /// point-to-point chunks).
    pub(super) fn slot_bytes(&self) -> usize {
        (self.half / self.size) & !255
    }

    /// Runs `f`, the enqueue of a collective; if it fails part way, the
    /// ranks are out of step: this rank's kernels still waiting are told
    /// to give up, the peers' time out at their next barrier, and the
    /// communicator fails.
    pub(super) fn guarded(&self, f: impl FnOnce() -> Result<()>) -> Result<()> {
        let r = f();
        if let Err(e) = &r {
            self.held.ctl.abort();
            self.held.ctl.fail(Error::GroupFailed { reason: format!("rank {}: a collective failed part way: {e}", self.rank) });
        }
        r
    }

    /// Moves `count` elements in chunks of at most `per`: for each chunk,
    /// `write(offset, len, half)` fills this rank's staging half (`half`:
    /// its byte offset in every rank's buffer), the ranks meet, and
    /// `read(offset, len, half)` reads the peers' halves. Chunks alternate
    /// halves, so a rank fills one half while a slower peer may still read
    /// the other (filling chunk i + 2 waits for the barrier of chunk i + 1,
    /// which every peer reaches only after reading chunk i); a last barrier
    /// ends the call, so the next call may fill either half.
    fn staged(
        &self,
        count: usize,
        per: usize,
        mut write: impl FnMut(usize, usize, u64) -> Result<()>,
        mut read: impl FnMut(usize, usize, u64) -> Result<()>,
    ) -> Result<()> {
        let per = per.max(1);
        let (mut o, mut i) = (0, 0usize);
        let mut pacer = self.pacer()?;
        while o < count {
            let len = per.min(count - o);
            let h = ((i % 2) * self.half) as u64;
            write(o, len, h)?;
            self.barrier()?;
            pacer.passed()?;
            read(o, len, h)?;
            o += len;
            i += 1;
        }
        self.barrier()
    }

    /// A device-side barrier of every rank: a one-element one-shot
    /// all-reduce, which returns (on the device) only once every rank's
    /// stream has reached it, so each rank's work enqueued before it is
    /// complete and visible. Bounded by the barrier timeout.
    fn barrier(&self) -> Result<()> {
        self.launch::<u32>(ReduceOp::Sum, self.bar_ptr, self.bar_ptr, 1)
    }

    /// `dst = part(0) op part(1) op ... op part(n - 1)`, `len` elements,
    /// left to right (the same order on every rank).
    fn fold<T: Element>(&self, op: ReduceOp, dst: u64, part: impl Fn(usize) -> u64, len: usize) -> Result<()> {
        self.reduce2(op, T::DTYPE, dst, part(0), part(1), len)?;
        for k in 2..self.size {
            self.reduce2(op, T::DTYPE, dst, dst, part(k), len)?;
        }
        Ok(())
    }

    /// `dst = a op b` over `count` elements on this rank's stream.
    fn reduce2(&self, op: ReduceOp, dtype: DType, dst: u64, a: u64, b: u64, count: usize) -> Result<()> {
        let kernel = Kernel::Reduce2(KernelOp::of(op), dtype);
        let f = self.held.red.get(kernel, || function(&self.ctx, kernel))?;
        self.hold_for_capture()?;
        // SAFETY: `f` is this context's reduction kernel of `dtype`; `dst`
        // holds `count` elements of `dtype` on this device (a caller's
        // buffer) and `a`, `b` hold `count` elements each, on this device or
        // in a peer's staging buffer mapped here with read-write access
        // (P2P checked at creation), alive as long as the communicator.
        unsafe { kernels::launch::reduce2(&self.stream, f, dtype, dst, a, b, count, self.max_blocks) }
    }

    /// [`ReduceOp::Avg`]'s division of `count` elements at `x` by the
    /// number of ranks.
    pub(super) fn average<T: Element>(&self, op: ReduceOp, x: u64, count: usize) -> Result<()> {
        if op != ReduceOp::Avg || self.size == 1 {
            return Ok(());
        }
        self.divide::<T>(x, count)
    }

    /// `count` elements at `x` (this rank's memory, or its staging buffer)
    /// divided by the number of ranks.
    fn divide<T: Element>(&self, x: u64, count: usize) -> Result<()> {
        let dtype = T::DTYPE;
        let f = self.held.div.get(Kernel::ScaleDiv(dtype), || function(&self.ctx, Kernel::ScaleDiv(dtype)))?;
        self.hold_for_capture()?;
        // SAFETY: `f` is this context's division kernel of `dtype`; `x` holds
        // `count` elements on this device (a caller's buffer, or this rank's
        // staging buffer: its device memory, or the shared host buffer
        // registered for it).
        unsafe { kernels::launch::scale_div(&self.stream, f, dtype, x, count, self.size as f64, self.max_blocks) }
    }

    /// Copies `bytes` from `src` to `dst` on this rank's stream (either may
    /// be a peer's staging buffer, mapped here: a copy over P2P). Where
    /// another rank is a thread of this process on this device, by the
    /// SMs: the ranks' streams share the context's hardware queues, and a
    /// copy engine's queue serves its copies in order, so a rank's copy
    /// waiting (in its stream) for its barrier could hold up, in a shared
    /// queue, the copy of the peer that barrier waits for, until the
    /// barrier timeout.
    pub(super) fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // A range onto itself (an in-place call on one rank) is already there.
        if bytes == 0 || dst == src {
            return Ok(());
        }
        self.hold_for_capture()?;
        if self.shares_context {
            let f = self.held.red.get(Kernel::Copy, || function(&self.ctx, Kernel::Copy))?;
            // SAFETY: `f` is this context's `cp_copy`; both ranges hold
            // `bytes` bytes as for the copy below, and do not overlap (a
            // caller's buffer and a staging slot, or two callers' buffers
            // that a collective's checks keep apart).
            return unsafe { kernels::launch::copy(&self.stream, f, dst, src, bytes, self.max_blocks) };
        }
        bind(&self.ctx)?;
        // SAFETY: both ranges hold `bytes` bytes, on this device or in a
        // peer's staging buffer mapped here with read-write access, alive
        // as long as the communicator (the callers' buffers are held by
        // their order guards until the copy is ordered).
        check("cuMemcpyDtoDAsync", unsafe { api()?.cuMemcpyDtoDAsync_v2(dst, src, bytes, crate::driver::raw_stream(&self.stream)) })
    }
}

/// `ranks` parts of `c` elements, in rank order: (offset, count).
pub(super) fn equal_parts(c: usize, ranks: usize) -> Vec<(usize, usize)> {
    (0..ranks).map(|j| (j * c, c)).collect()
}

/// `parts` in bytes of elements of `esz` bytes.
pub(super) fn bytes_of(parts: &[(usize, usize)], esz: usize) -> Vec<(usize, usize)> {
    parts.iter().map(|&(o, c)| (o * esz, c * esz)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_keeps_the_one_shot_and_only_a_rank_count_above_one_splits() {
        use AllReduceAlgorithm::*;
        for n in 1..=8 {
            assert!(!two_shot(Auto, n) && !two_shot(OneShot, n));
            assert_eq!(two_shot(TwoShot, n), n > 1);
        }
    }

    #[test]
    fn split_parts_are_contiguous_and_as_even_as_can_be() {
        for ranks in 1..=8 {
            for c in [0, 1, 2, 7, 8, 9, 1000, 1_048_579] {
                let parts = split(c, ranks);
                assert_eq!(parts.len(), ranks);
                let mut at = 0;
                for &(o, n) in &parts {
                    assert_eq!(o, at, "c={c} ranks={ranks}: {parts:?}");
                    assert!(n == c / ranks || n == c / ranks + 1, "c={c} ranks={ranks}: {parts:?}");
                    at += n;
                }
                assert_eq!(at, c);
            }
        }
    }
}
