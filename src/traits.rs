//! [`Collectives`]: what one rank's communicator does, with the names and
//! argument order of `cudarc::nccl::Comm`. Every per-rank communicator
//! implements it ([`crate::comm::Comm`], and the engines under it), so a new
//! collective is a method here and the compiler lists every engine that
//! must carry it.

use crate::dtype::{Element, Movable, ReduceOp};
use crate::error::{Error, Result};
use crate::sync::Orderer;
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

/// The collectives of one rank (see the module docs). Each call enqueues on
/// [`Self::stream`] and returns; buffers written or read on other streams
/// are ordered with it through cudarc's event tracking. Every rank must
/// make the same calls (collective, element type, count, op, root) in the
/// same order.
pub trait Collectives {
    /// This rank.
    fn rank(&self) -> usize;

    /// How many ranks the communicator has.
    fn world_size(&self) -> usize;

    /// The stream every collective is enqueued on.
    fn stream(&self) -> &Arc<CudaStream>;

    /// Waits for this rank's collectives to finish on the device, bounded;
    /// a failure since the last call (a peer that gave up) is its error.
    fn synchronize(&self) -> Result<()>;

    /// A failure already known, without waiting for the device: a peer that
    /// gave up (found in the control block), NCCL's asynchronous error, or
    /// an earlier call's failure that left the communicator unusable.
    /// `Ok` does not mean that enqueued work will succeed.
    fn async_error(&self) -> Result<()>;

    /// `recv` becomes the reduction, in rank order, of every rank's `send`
    /// (of one length).
    fn all_reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()>;

    /// `buf` becomes the reduction, in rank order, of every rank's `buf`.
    fn all_reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp) -> Result<()>;

    /// `recv` (`world_size() * c` elements) becomes every rank's `send` (c
    /// elements) in rank order.
    fn all_gather<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D) -> Result<()>;

    /// `recv` (c elements) becomes block `rank()` of the reduction of every
    /// rank's `send` (`world_size() * c` elements).
    fn reduce_scatter<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()>;

    /// Every rank's `recv` becomes rank `root`'s `send`: only the root's is
    /// read (the others may pass `None`, and what they pass is ignored); a
    /// root without one is an error.
    fn broadcast<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: Option<&S>, recv: &mut D, root: usize) -> Result<()>;

    /// Every rank's `buf` becomes rank `root`'s.
    fn broadcast_in_place<T: Movable, D: DevicePtrMut<T>>(&self, buf: &mut D, root: usize) -> Result<()>;

    /// Rank `root`'s `recv` becomes the reduction of every rank's `send`;
    /// the other ranks' `recv` (as long as `send`) is not written.
    fn reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp, root: usize) -> Result<()>;

    /// Rank `root`'s `buf` becomes the reduction of every rank's `buf`; the
    /// others' are not written.
    fn reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp, root: usize) -> Result<()>;

    /// Sends `send` to rank `peer` (this rank included): it lands in the
    /// buffer of that rank's matching [`Self::recv`] from this one, matched
    /// in the order each side makes them, of the same length (a receive
    /// that never comes times out). Alone, a send returns once enqueued,
    /// but its data moves only while the peer's receive runs: two ranks
    /// that each send to the other must put the send and the receive in
    /// one [`crate::comm::Comm::group`] on both sides.
    ///
    /// Between the ranks of one host, a call's (or a group's) messages
    /// with one peer are matched with the peer's call or group as a whole:
    /// the lengths, in order, must be the same on both sides, else both
    /// ranks' communicators fail with [`crate::error::Error::GroupFailed`] (two
    /// plain sends that cross fail so, at once). Between hosts (NCCL),
    /// lengths that differ are a timeout. Within a host, a send to this
    /// rank itself needs its receives in the same group, matched one with
    /// one in order (else [`crate::error::Error::InvalidArgument`], before
    /// anything moves).
    fn send<T: Movable, S: DevicePtr<T>>(&self, send: &S, peer: usize) -> Result<()>;

    /// Receives into `recv` what rank `peer` sends this one (see
    /// [`Self::send`]).
    fn recv<T: Movable, D: DevicePtrMut<T>>(&self, recv: &mut D, peer: usize) -> Result<()>;

    /// Block `j` of every rank's `recv` becomes block `rank()` of rank
    /// `j`'s `send`: `send` and `recv` hold `world_size()` blocks of one
    /// length each (`world_size() * c` elements).
    fn all_to_all<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D) -> Result<()>;

    /// The all-to-all with a block of its own length and place for each
    /// peer: `send_blocks.count(j)` elements at `send_blocks.offset(j)` of
    /// `send` go to rank `j`, which receives them at
    /// `recv_blocks.offset(rank())` of its `recv` (and must expect
    /// `recv_blocks.count(rank())` of them: counts that disagree fail both
    /// ranks' communicators with a typed error). The counts may change on
    /// every call (the mixture-of-experts dispatch); blocks of `recv` must
    /// not overlap.
    fn all_to_all_v<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(
        &self,
        send: &S,
        send_blocks: &Blocks<'_>,
        recv: &mut D,
        recv_blocks: &Blocks<'_>,
    ) -> Result<()>;

    /// The all-gather with uneven parts: rank `j` contributes `counts[j]`
    /// elements (its `send`), and every rank's `recv` (`counts.iter().sum()`
    /// elements) becomes the parts in rank order. Every rank passes the
    /// same `counts`.
    fn all_gather_v<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, counts: &[usize]) -> Result<()>;

    /// The reduce-scatter with uneven parts: every rank's `send` holds
    /// `counts.iter().sum()` elements, and rank `j`'s `recv` (`counts[j]`
    /// elements) becomes part `j` of their reduction (parts in rank
    /// order). Every rank passes the same `counts`.
    fn reduce_scatter_v<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, counts: &[usize], op: ReduceOp)
        -> Result<()>;
}

/// Where each peer's block lies in a buffer of [`Collectives::all_to_all_v`]:
/// `counts[j]` elements at `offsets[j]`, one entry per rank.
#[derive(Debug, Clone, Copy)]
pub struct Blocks<'a> {
    counts: &'a [usize],
    offsets: &'a [usize],
}

impl<'a> Blocks<'a> {
    /// Blocks of `counts[j]` elements at `offsets[j]` (one of each per
    /// rank; checked against the buffer and the communicator in the call).
    pub fn new(counts: &'a [usize], offsets: &'a [usize]) -> Blocks<'a> {
        Blocks { counts, offsets }
    }

    /// The count of peer `j`'s block.
    pub fn count(&self, j: usize) -> usize {
        self.counts.get(j).copied().unwrap_or(0)
    }

    /// The offset of peer `j`'s block.
    pub fn offset(&self, j: usize) -> usize {
        self.offsets.get(j).copied().unwrap_or(0)
    }

    /// Checks the blocks for `ranks` peers in a buffer of `len` elements
    /// (each inside it; with `disjoint`, none overlapping another).
    pub(crate) fn check(&self, op: &'static str, what: &str, ranks: usize, len: usize, disjoint: bool) -> Result<()> {
        if self.counts.len() != ranks || self.offsets.len() != ranks {
            return Err(Error::InvalidArgument(format!(
                "{op}: {what} has {} counts and {} offsets for {ranks} ranks",
                self.counts.len(),
                self.offsets.len()
            )));
        }
        let mut spans = Vec::with_capacity(ranks);
        for j in 0..ranks {
            let (c, o) = (self.counts[j], self.offsets[j]);
            match o.checked_add(c) {
                Some(end) if end <= len => spans.push((o, end)),
                _ => return Err(Error::InvalidArgument(format!("{op}: {what} block {j} ({c} elements at {o}) does not fit a buffer of {len}"))),
            }
        }
        if disjoint {
            spans.retain(|s| s.0 < s.1);
            spans.sort_unstable();
            if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
                return Err(Error::InvalidArgument(format!("{op}: {what} blocks overlap ({}..{} and {}..{})", w[0].0, w[0].1, w[1].0, w[1].1)));
            }
        }
        Ok(())
    }
}

/// One point-to-point transfer of a grouped call, its buffer already
/// ordered on the communicator's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Transfer {
    /// The other rank (this one for a copy to itself).
    pub(crate) peer: usize,
    /// The buffer's device address.
    pub(crate) ptr: u64,
    /// Its bytes.
    pub(crate) bytes: usize,
    /// Whether this rank sends it (else it receives into it).
    pub(crate) send: bool,
}

/// What an engine gives the point-to-point calls, which are written once
/// over it ([`send`], [`recv`], [`all_to_all_v`], [`all_gather_v`] and the
/// grouped calls of [`crate::comm::Comm::group`]).
pub(crate) trait PointToPoint: Collectives {
    /// This rank's device context (every buffer's).
    fn p2p_context(&self) -> &Arc<CudaContext>;

    /// What orders the caller's buffers with [`Collectives::stream`].
    fn orderer(&self) -> &Orderer;

    /// Enqueues one group of transfers (peers in range, buffers on this
    /// rank's device and ordered on the stream: the callers check).
    fn transfers(&self, ts: &[Transfer]) -> Result<()>;
}

/// The methods of [`Collectives`] that an engine implementing
/// [`PointToPoint`] takes as they are from this module's functions
/// (`send`, `recv`, `all_to_all_v`; with `all`, also `all_to_all` and
/// `all_gather_v`), written once for every engine.
macro_rules! point_to_point_calls {
    () => {
        fn send<T: $crate::dtype::Movable, S: cudarc::driver::DevicePtr<T>>(&self, send: &S, peer: usize) -> $crate::error::Result<()> {
            $crate::traits::send(self, send, peer)
        }

        fn recv<T: $crate::dtype::Movable, D: cudarc::driver::DevicePtrMut<T>>(&self, recv: &mut D, peer: usize) -> $crate::error::Result<()> {
            $crate::traits::recv(self, recv, peer)
        }

        fn all_to_all_v<T: $crate::dtype::Movable, S: cudarc::driver::DevicePtr<T>, D: cudarc::driver::DevicePtrMut<T>>(
            &self,
            send: &S,
            send_blocks: &$crate::traits::Blocks<'_>,
            recv: &mut D,
            recv_blocks: &$crate::traits::Blocks<'_>,
        ) -> $crate::error::Result<()> {
            $crate::traits::all_to_all_v(self, send, send_blocks, recv, recv_blocks)
        }
    };
    (all) => {
        $crate::traits::point_to_point_calls!();

        fn all_to_all<T: $crate::dtype::Movable, S: cudarc::driver::DevicePtr<T>, D: cudarc::driver::DevicePtrMut<T>>(
            &self,
            send: &S,
            recv: &mut D,
        ) -> $crate::error::Result<()> {
            $crate::traits::all_to_all(self, send, recv)
        }

        fn all_gather_v<T: $crate::dtype::Movable, S: cudarc::driver::DevicePtr<T>, D: cudarc::driver::DevicePtrMut<T>>(
            &self,
            send: &S,
            recv: &mut D,
            counts: &[usize],
        ) -> $crate::error::Result<()> {
            $crate::traits::all_gather_v(self, send, recv, counts)
        }
    };
}
pub(crate) use point_to_point_calls;

/// `peer` names a rank of `ranks`.
pub(crate) fn check_peer(op: &'static str, peer: usize, ranks: usize) -> Result<()> {
    if peer >= ranks {
        return Err(Error::InvalidArgument(format!("{op}: peer {peer} of {ranks} ranks")));
    }
    Ok(())
}

/// [`Collectives::send`] over an engine.
pub(crate) fn send<E: PointToPoint, T: Movable, S: DevicePtr<T>>(e: &E, buf: &S, peer: usize) -> Result<()> {
    check_peer("send", peer, e.world_size())?;
    crate::copy::check_context("send", "send", e.p2p_context(), buf.stream().context())?;
    let bytes = buf.len() * std::mem::size_of::<T>();
    let (ptr, held) = e.orderer().read(buf, e.stream())?;
    e.transfers(&[Transfer { peer, ptr, bytes, send: true }]).and(held.finish())
}

/// [`Collectives::recv`] over an engine.
pub(crate) fn recv<E: PointToPoint, T: Movable, D: DevicePtrMut<T>>(e: &E, buf: &mut D, peer: usize) -> Result<()> {
    check_peer("recv", peer, e.world_size())?;
    crate::copy::check_context("recv", "recv", e.p2p_context(), buf.stream().context())?;
    let bytes = buf.len() * std::mem::size_of::<T>();
    let (ptr, held) = e.orderer().write(buf, e.stream())?;
    e.transfers(&[Transfer { peer, ptr, bytes, send: false }]).and(held.finish())
}

/// [`Collectives::all_to_all_v`] over an engine: a send and a receive per
/// rank, in one group.
pub(crate) fn all_to_all_v<E: PointToPoint, T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(
    e: &E,
    send: &S,
    send_blocks: &Blocks<'_>,
    recv: &mut D,
    recv_blocks: &Blocks<'_>,
) -> Result<()> {
    const OP: &str = "all_to_all_v";
    let n = e.world_size();
    crate::copy::check_context(OP, "send", e.p2p_context(), send.stream().context())?;
    crate::copy::check_context(OP, "recv", e.p2p_context(), recv.stream().context())?;
    send_blocks.check(OP, "send", n, send.len(), false)?;
    recv_blocks.check(OP, "recv", n, recv.len(), true)?;
    let esz = std::mem::size_of::<T>();
    let (src, read) = e.orderer().read(send, e.stream())?;
    let (dst, write) = e.orderer().write(recv, e.stream())?;
    let mut ts = Vec::with_capacity(2 * n);
    for j in 0..n {
        ts.push(Transfer { peer: j, ptr: src + (send_blocks.offset(j) * esz) as u64, bytes: send_blocks.count(j) * esz, send: true });
        ts.push(Transfer { peer: j, ptr: dst + (recv_blocks.offset(j) * esz) as u64, bytes: recv_blocks.count(j) * esz, send: false });
    }
    e.transfers(&ts).and(read.finish()).and(write.finish())
}

/// [`Collectives::all_to_all`] over an engine, as the all-to-all-v of
/// equal blocks.
pub(crate) fn all_to_all<E: PointToPoint, T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(e: &E, send: &S, recv: &mut D) -> Result<()> {
    let n = e.world_size();
    let c = equal_blocks("all_to_all", send.len(), recv.len(), n)?;
    let counts = vec![c; n];
    let offsets: Vec<usize> = (0..n).map(|j| j * c).collect();
    let blocks = Blocks::new(&counts, &offsets);
    all_to_all_v(e, send, &blocks, recv, &blocks)
}

/// [`Collectives::all_gather_v`] over an engine: this rank's part sent to
/// every rank, every part received, in one group.
pub(crate) fn all_gather_v<E: PointToPoint, T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(
    e: &E,
    send: &S,
    recv: &mut D,
    counts: &[usize],
) -> Result<()> {
    let (n, me) = (e.world_size(), e.rank());
    let (offsets, _) = crate::args::all_gather_v(e.p2p_context(), n, me, send, recv, counts)?;
    let esz = std::mem::size_of::<T>();
    let (src, read) = e.orderer().read(send, e.stream())?;
    let (dst, write) = e.orderer().write(recv, e.stream())?;
    let mut ts = Vec::with_capacity(2 * n);
    for j in 0..n {
        ts.push(Transfer { peer: j, ptr: src, bytes: counts[me] * esz, send: true });
        ts.push(Transfer { peer: j, ptr: dst + (offsets[j] * esz) as u64, bytes: counts[j] * esz, send: false });
    }
    e.transfers(&ts).and(read.finish()).and(write.finish())
}

/// The block length of an all-to-all of `send` and `recv` elements over
/// `ranks` ranks: both the same multiple of `ranks`.
pub(crate) fn equal_blocks(op: &'static str, send: usize, recv: usize, ranks: usize) -> Result<usize> {
    if recv != send {
        return Err(Error::LengthMismatch { op, expected: send, got: recv });
    }
    if ranks == 0 || !send.is_multiple_of(ranks) {
        return Err(Error::InvalidArgument(format!("{op}: {send} elements are not {ranks} equal blocks")));
    }
    Ok(send / ranks)
}

/// A digest of `counts` for the call descriptors the ranks compare (ranks
/// that pass different counts to a collective with uneven parts must not
/// go on: FNV-1a over the counts).
pub(crate) fn counts_digest(counts: &[usize]) -> u64 {
    counts
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &c| (c as u64).to_le_bytes().iter().fold(h, |h, b| (h ^ *b as u64).wrapping_mul(0x0000_0100_0000_01b3)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_checked_against_the_buffer() {
        let ok = Blocks::new(&[2, 0, 3], &[0, 2, 2]);
        assert!(ok.check("a2a", "recv", 3, 5, true).is_ok());
        assert!(matches!(ok.check("a2a", "recv", 2, 5, true), Err(Error::InvalidArgument(m)) if m.contains("3 counts")));
        assert!(matches!(ok.check("a2a", "recv", 3, 4, true), Err(Error::InvalidArgument(m)) if m.contains("block 2")));
        let overlap = Blocks::new(&[2, 2], &[0, 1]);
        assert!(matches!(overlap.check("a2a", "recv", 2, 4, true), Err(Error::InvalidArgument(m)) if m.contains("overlap")));
        assert!(overlap.check("a2a", "send", 2, 4, false).is_ok());
        let huge = Blocks::new(&[usize::MAX, 1], &[2, 0]);
        assert!(huge.check("a2a", "send", 2, 4, false).is_err());
    }

    #[test]
    fn digests_tell_counts_apart() {
        assert_ne!(counts_digest(&[1, 2]), counts_digest(&[2, 1]));
        assert_ne!(counts_digest(&[0]), counts_digest(&[0, 0]));
    }
}
