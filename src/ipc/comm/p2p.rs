//! Point-to-point transfers between two ranks of a [`Comm`]: send, receive,
//! their groups, and the all-to-all-v built on them.
//!
//! Each rank's region holds a pair area: flag words per peer (set by that
//! peer) and a view slot per peer (what that peer says it sends and
//! receives). An exchange between ranks `a` and `b` moves what each sends
//! the other through its own staging buffer, in chunks of one slot (the
//! slot of the receiver in the sender's staging half, as the reduce-scatter
//! lays them out), alternating halves. For each chunk each side fills its
//! slot, the two meet (`cp_pair_sync`: flags at system scope, bounded by
//! the barrier timeout, counters in device memory so that graph replays
//! stay in step), and each copies the other's slot out; a last meeting ends
//! the exchange, so that neither refills a slot the other still reads. An
//! exchange of one chunk and at most one message each way, up to
//! [`Comm::fused_bound`], runs these steps in one kernel (`cp_pair_xchg`),
//! split into parts of up to [`FUSED_PART_BYTES`], a block each: each
//! block copies its part and meets the peer's block of the same part
//! through a flag and a counter of that part (part 0's are the steps'), and
//! where every exchange of a call fits, one launch runs them all, so that a
//! send, receive or group within the bound costs one launch instead of four
//! per peer. The
//! first meeting carries each side's view of the exchange (a digest of the
//! lengths of the messages it sends, in order, and of those it receives):
//! views that do not mirror (a send whose receive has another length, a
//! message the other side does not expect) fail both ranks' communicators
//! with a typed error instead of moving a wrong amount. An exchange is
//! matched as a whole: a rank's messages with one peer in one call or
//! group must be the peer's in one call or group (a group with a send and
//! a receive against two plain calls on the other side disagrees).
//!
//! A group runs one exchange per peer, in ascending peer order on every
//! rank, so that the pairs of any set of groups meet in an order that
//! cannot deadlock (the lowest pair still waiting is always ready on both
//! sides), or all of them at once in one launch, which waits for no pair
//! before another. Transfers to this rank itself are device copies, in
//! order.

use super::{Comm, PAIR_FLAG_BYTES};
use crate::error::{Error, Result};
use crate::kernels;
use crate::kernels::launch::{PairJob, PairMeet};
use crate::kernels::load::function;
use crate::kernels::Kernel;
use crate::traits::{counts_digest, Transfer};

const FLAG_BYTES: usize = PAIR_FLAG_BYTES;

impl Comm {
    /// Enqueues one group of transfers (see the module docs). The peers
    /// are in range and the buffers on this device, ordered on the stream
    /// (the callers check); what cannot be matched on this rank alone (a
    /// transfer to itself of another length) is an error before anything
    /// is enqueued.
    pub(crate) fn transfers(&self, ts: &[Transfer]) -> Result<()> {
        let (me, n) = (self.rank, self.size);
        if let Some(t) = ts.iter().find(|t| t.peer >= n) {
            return Err(Error::InvalidArgument(format!("point-to-point: peer {} of {n} ranks", t.peer)));
        }
        let (to_self, from_self) = split(ts, me);
        // Matched in order, one message with one, as a peer's are.
        let lengths = |p: &Pieces| p.iter().map(|m| m.1).collect::<Vec<_>>();
        if lengths(&to_self) != lengths(&from_self) {
            return Err(Error::InvalidArgument(format!(
                "point-to-point: rank {me} sends itself messages of {:?} bytes and receives messages of {:?}",
                lengths(&to_self),
                lengths(&from_self)
            )));
        }
        let out = total(&to_self);
        let _call = self.enter_unchecked()?;
        let peers: Vec<(usize, Pieces, Pieces)> = (0..n)
            .filter(|&q| q != me)
            .map(|q| (q, split(ts, q)))
            .filter(|(_, (o, i))| !o.is_empty() || !i.is_empty())
            .map(|(q, (o, i))| (q, o, i))
            .collect();
        // Each exchange that fits the one-kernel exchange as its job; where
        // every one fits, all of them run in one launch (none waits for
        // another, so the peers' exchanges meet in any order they run
        // theirs), else each in ascending peer order, in one kernel or as
        // steps.
        let bound = self.fused_bound();
        let jobs: Vec<Option<PairJob>> =
            peers.iter().map(|(q, outs, ins)| fusable(outs, ins, bound).map(|(s, d)| self.job(*q, s, d, (view(outs), view(ins))))).collect();
        self.guarded(|| {
            each_segment(&to_self, &from_self, 0, out, |src, dst, len| self.copy(dst, src, len))?;
            if let Some(all) = jobs.iter().copied().collect::<Option<Vec<PairJob>>>().filter(|all| !all.is_empty()) {
                return self.exchange_fused(&all);
            }
            peers.iter().zip(&jobs).try_for_each(|((q, outs, ins), job)| match job {
                Some(job) => self.exchange_fused(std::slice::from_ref(job)),
                None => self.exchange_steps(*q, outs, ins),
            })
        })
    }

    /// The exchange with peer `q` as steps, a round per slot (see the
    /// module docs); `outs` or `ins` holds a message.
    fn exchange_steps(&self, q: usize, outs: &[(u64, usize)], ins: &[(u64, usize)]) -> Result<()> {
        let me = self.rank;
        let (out, inn) = (total(outs), total(ins));
        let stride = self.slot_bytes();
        // At least one meeting, which compares the views (messages of no
        // bytes are messages too).
        let rounds = out.max(inn).div_ceil(stride).max(1);
        let views = (view(outs), view(ins));
        let mut pacer = self.pacer()?;
        for i in 0..rounds {
            let h = ((i % 2) * self.half) as u64;
            let o = i * stride;
            let slot = self.data[me] + h + (q * stride) as u64;
            each_piece(outs, o, stride.min(out.saturating_sub(o)), |src, at, len| self.copy(slot + at as u64, src, len))?;
            self.meet(q, (i == 0).then_some(views))?;
            pacer.passed()?;
            let theirs = self.data[q] + h + (me * stride) as u64;
            each_piece(ins, o, stride.min(inn.saturating_sub(o)), |dst, at, len| self.copy(dst, theirs + at as u64, len))?;
        }
        self.meet(q, None)
    }

    /// The words of a meeting with `q` (see [`Comm::meet`]).
    fn meeting(&self, q: usize, views: Option<(u64, u64)>) -> PairMeet {
        let me = self.rank;
        let (out, inn) = views.unwrap_or((0, 0));
        PairMeet {
            theirs: self.pairs[q] + (me * 4) as u64,
            mine: self.pairs[me] + (q * 4) as u64,
            counter: self.pair_counters + (q * 4) as u64,
            their_view: self.pairs[q] + (FLAG_BYTES + me * 16) as u64,
            my_view: self.pairs[me] + (FLAG_BYTES + q * 16) as u64,
            out_view: out,
            in_view: inn,
            peer: q as i32,
            check: i32::from(views.is_some()),
        }
    }

    /// This rank's side of a meeting with `q`; `views`: the exchange's
    /// (messages out, messages in), compared with the peer's mirror of them.
    fn meet(&self, q: usize, views: Option<(u64, u64)>) -> Result<()> {
        let f = self.held.red.get(Kernel::PairSync, || function(&self.ctx, Kernel::PairSync))?;
        self.hold_for_capture()?;
        let (me, m) = (self.rank, self.meeting(q, views));
        // SAFETY: `f` is this context's `cp_pair_sync`. The pair areas are
        // `PAIR_AREA_BYTES` at the same offset of every rank's region (one
        // `layout` on every rank), this rank's own and the peer's as mapped
        // here (imported with read-write access, P2P checked, or a thread
        // rank's on this device through its owner's mapping, held through
        // `owned`; or the shared host buffer, registered for this device), alive in `held` as
        // long as this communicator and every graph its calls went into;
        // `q`, `me` < size <= MAX_RANKS, so each word lies in its area. The
        // counter is word `q` of this rank's `size` counters and the
        // control block holds `ctl_bytes(size)`. Both ranks meet in one
        // order: each runs its exchanges in ascending peer order, with the
        // same number of meetings when their views agree (and when they do
        // not, the first meeting fails both).
        unsafe { kernels::launch::pair_sync(&self.stream, f, &m, self.held.ctl.addrs[0], me as i32, self.current_call(), self.held.ctl.timeout_ns) }
    }

    /// The one-chunk exchange with `q` of `out` bytes from `src` and
    /// `inn` bytes into `dst` as a job of [`Comm::exchange_fused`], in
    /// [`parts`] parts: the steps of [`Comm::exchange_steps`]' one round
    /// and its last meeting, with the same slots (the first half of each
    /// staging buffer), meetings and counter (part 0's), so that either
    /// side may run an exchange of one part as steps or in one kernel.
    fn job(&self, q: usize, (src, out): Piece, (dst, inn): Piece, views: (u64, u64)) -> PairJob {
        let (me, stride) = (self.rank, self.slot_bytes());
        PairJob {
            meet: self.meeting(q, Some(views)),
            my_slot: self.data[me] + (q * stride) as u64,
            src,
            out_bytes: out as u64,
            dst,
            their_slot: self.data[q] + (me * stride) as u64,
            in_bytes: inn as u64,
            parts: parts(out.max(inn), self.pair_parts) as i32,
            _pad: 0,
        }
    }

    /// One-chunk exchanges of one message each way with each peer of
    /// `pairs` (peer, (source, bytes), (destination, bytes); each peer once,
    /// never this rank, each within [`Comm::fused_bound`]) in one launch:
    /// the all-to-all of small blocks.
    pub(super) fn exchange_blocks(&self, pairs: &[(usize, Piece, Piece)]) -> Result<()> {
        let jobs: Vec<PairJob> = pairs.iter().map(|&(q, o, i)| self.job(q, o, i, (view(&[o]), view(&[i])))).collect();
        self.exchange_fused(&jobs)
    }

    /// One-chunk exchanges (`jobs`, from [`Comm::job`], each with another
    /// peer) in one kernel, a block each: one synchronisation point.
    fn exchange_fused(&self, jobs: &[PairJob]) -> Result<()> {
        let f = self.held.red.get(Kernel::PairXchg, || function(&self.ctx, Kernel::PairXchg))?;
        let mut pacer = self.pacer()?;
        self.hold_for_capture()?;
        // SAFETY: `f` is this context's `cp_pair_xchg`; each job's meeting
        // words are as in `meet`, for a peer of its own (one job per peer,
        // at most `size - 1 < PAIR_MAX_JOBS`); part `b`'s flags are words
        // `8 b + rank` of the pair areas' `PAIR_FLAG_BYTES` (`b` <
        // `PAIR_MAX_BLOCKS`, ranks < `MAX_RANKS` = 8) and its counter word
        // `8 b + q` of this rank's `PAIR_COUNTER_WORDS`. Its slots are this rank's
        // slot for the peer and the peer's for this rank in the first half
        // of each staging buffer (`stride` bytes each, the ranks < size, so
        // within the half), mapped and held as the pair areas are; its
        // lengths are at most `stride` (`fusable`). `src` and `dst` are
        // callers' buffers holding those lengths on this device (the
        // callers check), apart from the communicator's region, and no two
        // jobs' receive buffers overlap (each is borrowed mutably for the
        // call or group, or is a block of an all-to-all's receive buffer,
        // disjoint by its layout, or of an all-to-all-v's, checked
        // disjoint), and the parts of a job are disjoint, so no two blocks
        // write one byte. Each peer runs the same exchange (its lengths
        // mirror these, or the first meeting fails both), so with as many
        // parts, in one kernel, or with one part as steps, whose slots,
        // meetings and counter are these.
        unsafe {
            kernels::launch::pair_xchg(&self.stream, f, jobs, self.held.ctl.addrs[0], self.rank as i32, self.current_call(), self.held.ctl.timeout_ns)
        }?;
        pacer.passed()
    }
}

/// Bytes (each way) of each part of an exchange that runs in one kernel
/// ([`Comm::exchange_fused`]): one block copies up to this much, and an
/// exchange takes a block per part, up to [`FUSED_MOST_PARTS`](super::FUSED_MOST_PARTS) (fewer
/// where ranks share a device: `Comm::pair_parts`). Above 64 KiB a
/// block's copies take longer than the steps' launches save (measured with
/// thread ranks sharing one H200: docs/point-to-point.md).
const FUSED_PART_BYTES: usize = 64 << 10;

/// The parts (kernel blocks) of a one-kernel exchange whose larger
/// direction moves `bytes`, of at most `most`: the same on both sides of
/// an exchange.
fn parts(bytes: usize, most: usize) -> usize {
    bytes.div_ceil(FUSED_PART_BYTES).clamp(1, most.max(1))
}

impl Comm {
    /// The largest exchange (in bytes, each way) that runs in one kernel
    /// ([`fused_bound`] of this communicator's slots and parts).
    pub(super) fn fused_bound(&self) -> usize {
        fused_bound(self.slot_bytes(), self.pair_parts)
    }
}

/// The largest exchange (in bytes, each way) that runs in one kernel with
/// slots of `slot` bytes and at most `parts` parts: each part within
/// [`FUSED_PART_BYTES`], the whole within one slot (the kernel's copies
/// stay inside the slots: `Comm::exchange_fused`).
fn fused_bound(slot: usize, parts: usize) -> usize {
    slot.min(FUSED_PART_BYTES * parts.max(1))
}

/// Where an exchange of one chunk each way of at most `bound` bytes (see
/// [`Comm::fused_bound`]), at most one message each way, can run in one
/// kernel: its (source, bytes) and (destination, bytes), an absent message
/// as no bytes.
fn fusable(outs: &[Piece], ins: &[Piece], bound: usize) -> Option<(Piece, Piece)> {
    if outs.len() > 1 || ins.len() > 1 {
        return None;
    }
    let (o, i) = (outs.first().copied().unwrap_or((0, 0)), ins.first().copied().unwrap_or((0, 0)));
    (o.1.max(i.1) <= bound).then_some((o, i))
}

/// A buffer as (device address, bytes).
pub(super) type Piece = (u64, usize);

/// Buffers as (device address, bytes), in order.
type Pieces = Vec<Piece>;

/// The pieces of the transfers to and from peer `q`, in order.
fn split(ts: &[Transfer], q: usize) -> (Pieces, Pieces) {
    let pick = |send: bool| ts.iter().filter(|t| t.peer == q && t.send == send).map(|t| (t.ptr, t.bytes)).collect();
    (pick(true), pick(false))
}

fn total(pieces: &[(u64, usize)]) -> usize {
    pieces.iter().map(|p| p.1).sum()
}

/// What one side says of the messages of one direction of an exchange:
/// a digest of their lengths, in order (the other side's must be equal).
fn view(pieces: &[(u64, usize)]) -> u64 {
    counts_digest(&pieces.iter().map(|p| p.1).collect::<Vec<_>>())
}

/// Calls `f(pointer, at, len)` for each part of bytes `o..o + len` of the
/// concatenation of `pieces`: the part's address in its piece, its offset
/// from `o`, its length.
fn each_piece(pieces: &[(u64, usize)], o: usize, len: usize, mut f: impl FnMut(u64, usize, usize) -> Result<()>) -> Result<()> {
    let (end, mut start) = (o + len, 0usize);
    for &(ptr, bytes) in pieces {
        let (lo, hi) = (start.max(o), (start + bytes).min(end));
        if lo < hi {
            f(ptr + (lo - start) as u64, lo - o, hi - lo)?;
        }
        start += bytes;
        if start >= end {
            break;
        }
    }
    Ok(())
}

/// Calls `f(src, dst, len)` for each run of bytes `o..o + len` that lies
/// in one piece of `from` and one of `to` (both concatenated).
fn each_segment(from: &[(u64, usize)], to: &[(u64, usize)], o: usize, len: usize, mut f: impl FnMut(u64, u64, usize) -> Result<()>) -> Result<()> {
    each_piece(from, o, len, |src, at, run| each_piece(to, o + at, run, |dst, at2, run2| f(src + at2 as u64, dst, run2)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces_of(p: &[(u64, usize)], o: usize, len: usize) -> Vec<(u64, usize, usize)> {
        let mut v = Vec::new();
        each_piece(p, o, len, |a, at, l| {
            v.push((a, at, l));
            Ok(())
        })
        .unwrap();
        v
    }

    #[test]
    fn ranges_of_concatenated_pieces() {
        let p = [(1000, 10), (2000, 0), (3000, 5)];
        assert_eq!(pieces_of(&p, 0, 15), vec![(1000, 0, 10), (3000, 10, 5)]);
        assert_eq!(pieces_of(&p, 8, 4), vec![(1008, 0, 2), (3000, 2, 2)]);
        assert_eq!(pieces_of(&p, 12, 3), vec![(3002, 0, 3)]);
        assert_eq!(pieces_of(&p, 15, 0), vec![]);
    }

    #[test]
    fn segments_follow_both_sides_pieces() {
        let from = [(100, 3), (200, 5)];
        let to = [(1000, 6), (2000, 2)];
        let mut v = Vec::new();
        each_segment(&from, &to, 0, 8, |s, d, l| {
            v.push((s, d, l));
            Ok(())
        })
        .unwrap();
        assert_eq!(v, vec![(100, 1000, 3), (200, 1003, 3), (203, 2000, 2)]);
    }

    #[test]
    fn only_one_message_each_way_within_the_bound_is_fused() {
        let bound = 512 << 10;
        assert_eq!(fusable(&[(10, 4)], &[(20, 8)], bound), Some(((10, 4), (20, 8))));
        assert_eq!(fusable(&[], &[(20, 8)], bound), Some(((0, 0), (20, 8))));
        assert_eq!(fusable(&[(10, 0)], &[], bound), Some(((10, 0), (0, 0))));
        assert_eq!(fusable(&[(10, bound)], &[(20, bound)], bound), Some(((10, bound), (20, bound))));
        assert_eq!(fusable(&[(10, bound + 1)], &[], bound), None);
        assert_eq!(fusable(&[], &[(20, bound + 1)], bound), None);
        assert_eq!(fusable(&[(10, 4), (30, 4)], &[], bound), None);
        assert_eq!(fusable(&[], &[(10, 4), (30, 4)], bound), None);
    }

    #[test]
    fn the_one_kernel_bound_stays_within_a_slot_and_its_parts() {
        assert_eq!(fused_bound(1 << 20, 4), 4 * FUSED_PART_BYTES);
        assert_eq!(fused_bound(1 << 20, 1), FUSED_PART_BYTES);
        assert_eq!(fused_bound(1 << 20, 0), FUSED_PART_BYTES);
        // A slot smaller than the parts: a message of more than one slot takes rounds.
        assert_eq!(fused_bound(1024, 4), 1024);
        assert_eq!(fusable(&[(10, 4096)], &[], fused_bound(1024, 4)), None);
        assert_eq!(fusable(&[(10, 1024)], &[], fused_bound(1024, 4)), Some(((10, 1024), (0, 0))));
        for slot in [0, 256, 3 << 10, 100 << 10, 4 << 20] {
            for parts in 0..=8 {
                let b = fused_bound(slot, parts);
                assert!(b <= slot && b <= FUSED_PART_BYTES * parts.max(1), "slot {slot}, parts {parts}: {b}");
            }
        }
    }

    #[test]
    fn exchanges_split_into_parts_of_at_most_the_part_bound() {
        let most = super::super::FUSED_MOST_PARTS;
        assert_eq!(parts(0, most), 1);
        assert_eq!(parts(1, most), 1);
        assert_eq!(parts(FUSED_PART_BYTES, most), 1);
        assert_eq!(parts(FUSED_PART_BYTES + 1, most), 2);
        assert_eq!(parts(FUSED_PART_BYTES * most, most), most);
        assert_eq!(parts(usize::MAX, most), most);
        assert_eq!(parts(FUSED_PART_BYTES * 5, 2), 2);
        assert_eq!(parts(FUSED_PART_BYTES * 5, 0), 1);
        for b in [1, 4093, FUSED_PART_BYTES * 3 - 5, FUSED_PART_BYTES * most] {
            assert!(b.div_ceil(parts(b, most)) <= FUSED_PART_BYTES);
        }
    }

    #[test]
    fn transfers_split_by_peer_and_direction_in_order() {
        let t = |peer, ptr, send| Transfer { peer, ptr, bytes: 4, send };
        let ts = [t(1, 10, true), t(0, 20, false), t(1, 30, true), t(1, 40, false)];
        assert_eq!(split(&ts, 1), (vec![(10, 4), (30, 4)], vec![(40, 4)]));
        assert_eq!(split(&ts, 0), (vec![], vec![(20, 4)]));
    }
}
