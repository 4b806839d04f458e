//! The one-shot all-reduce: every rank stores its input into a slot that the
//! others can read, raises a flag, waits for theirs, and reduces every slot
//! in rank order into its output. One barrier per call and only stores on
//! the link, which makes it the lowest-latency algorithm for small messages.
//!
//! Where every pair of ranks has verified P2P, the slots live in each rank's
//! device memory and a rank stores into every peer's region (device medium).
//! Where some link has no P2P, they live in one mapped pinned host buffer
//! that every rank's kernels read and write directly (host medium): the
//! zero-copy staged path, with no copy-engine round trip per step.
//!
//! Messages take one of a few lanes by size: each lane has its own slots,
//! flags and counters and a fixed grid, few blocks for small messages (fewer
//! flags to raise and poll), many for large ones.
//!
//! Memory, for the large-message lane: [`ONESHOT_SCRATCH_BYTES`] per rank
//! of device memory (P2P), or four [`HOST_ROUND_BYTES`] slots per rank in
//! the group's pinned host buffer (no P2P). Plus the other lanes' slots
//! (four sets of one slot per rank: 4352 KiB times the ranks with P2P,
//! 5184 KiB times the ranks without) and a few KiB of flags and counters.
//! Longer messages run in rounds of one slot each; on the large P2P lane a
//! block pushes the next round while it waits for and reduces the current
//! one, so the link keeps carrying data while the SMs reduce, and on the
//! large host lane a block reduces each round in one pass with its push of
//! the round after next.
//!
//! The kernel is in `kernels/reduce.cu` (`cp_oneshot_*`, in the mesh modules).

use super::common::{layout_refusal, prescale, sharing, unavailable, Algorithm, AllReduce};
use crate::communicator::Communicator;
use crate::copy::staged::PinnedBuffer;
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{cudarc_err, Error, Result};
use crate::graph::KeepAlive;
use crate::kernels::launch;
use crate::kernels::load::{FnTable, PtrArray};
use crate::kernels::{self, Kernel, KernelOp, OneShotPipeline};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use std::sync::Mutex;

/// Bytes of slots per rank in device memory (P2P) of the large-message
/// lane: four sets of one slot per rank (4 MiB slots for 2 ranks, faster
/// between processes than 2 MiB or 8 MiB slots; measured, see
/// docs/experiments.md).
pub const ONESHOT_SCRATCH_BYTES: usize = 32 << 20;

/// Slot bytes of the large-message lane through host memory (no P2P): a
/// message runs in rounds of this many bytes, so that while some blocks
/// still write a round into host memory, others already read the one
/// before, and both PCIe directions carry data at once (the size measured
/// best; see docs/experiments.md).
pub const HOST_ROUND_BYTES: usize = 1 << 20;

/// The lanes of a one-shot with slots in device memory (P2P), as (largest
/// message in bytes per rank, blocks, pipeline): each lane has its own
/// slots, flags and counters and one grid, so a small message does not pay
/// for dozens of blocks raising and polling flags, and the large lane has a
/// block on nearly every multiprocessor (128 blocks were faster than 64
/// from 2 MiB up, slower below; measured, see docs/experiments.md). The
/// large lane pushes each round ahead.
const DEVICE_LANES: [(usize, u32, OneShotPipeline); 3] = [
    (64 << 10, 4, OneShotPipeline::Plain),
    (1 << 20, 64, OneShotPipeline::Plain),
    (usize::MAX, kernels::ONESHOT_MAX_BLOCKS as u32, OneShotPipeline::Ahead),
];

/// The lanes of a one-shot with slots in host memory (no P2P), as for
/// [`DEVICE_LANES`]: polling host memory over PCIe costs more per block, so
/// small messages take fewer blocks still. Pushing ahead is slower through
/// host memory, but from 16 MiB up, reducing each round in one pass with
/// the push of the round after next ([`OneShotPipeline::Deep`]) is faster
/// (and slower at 2-4 MiB; measured, see docs/experiments.md).
const HOST_LANES: [(usize, u32, OneShotPipeline); 4] = [
    (16 << 10, 2, OneShotPipeline::Plain),
    (256 << 10, 4, OneShotPipeline::Plain),
    (8 << 20, kernels::ONESHOT_HOST_BLOCKS, OneShotPipeline::Plain),
    (usize::MAX, kernels::ONESHOT_HOST_BLOCKS, OneShotPipeline::Deep),
];

/// One lane's place in a one-shot region (shared by the single-process
/// group and the multi-process [`crate::ipc::Comm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LaneLayout {
    /// Largest message in bytes per rank (any for the last lane).
    pub(crate) max_bytes: usize,
    /// The lane's grid.
    pub(crate) blocks: u32,
    /// Slot bytes (a multiple of 256).
    pub(crate) cap: usize,
    /// How the lane overlaps its rounds (the kernel's `ahead`).
    pub(crate) pipeline: OneShotPipeline,
    /// Byte offset of the lane in a region: its flags, then its slots.
    pub(crate) offset: usize,
}

/// The lanes of a one-shot among `n` ranks, with slots in device memory
/// (`p2p`) or in host memory, and the bytes of one region holding them all.
/// `sms` is the fewest multiprocessors a rank has (its device's, divided
/// among the ranks sharing it). A block of the one-shot fills a
/// multiprocessor (its registers), and no lane's grid takes more than
/// `sms - 1` of them: a block waits only for the blocks of the same index
/// on the other ranks, so a free multiprocessor on every device is enough
/// for some pair of blocks to run, whereas two groups whose kernels each
/// filled a device the other needs would wait for each other until the
/// barrier timeout (`tests/edges.rs` runs several groups on shared devices
/// at once).
pub(crate) fn layout(n: usize, p2p: bool, sms: u32) -> (Vec<LaneLayout>, usize) {
    let spec: &[(usize, u32, OneShotPipeline)] = if p2p { &DEVICE_LANES } else { &HOST_LANES };
    let last_cap = if p2p { (ONESHOT_SCRATCH_BYTES / (kernels::ONESHOT_SETS * n.max(1))) & !255 } else { HOST_ROUND_BYTES };
    let mut lanes = Vec::with_capacity(spec.len());
    let mut bytes = 0;
    for &(max_bytes, blocks, pipeline) in spec {
        let cap = if max_bytes == usize::MAX { last_cap } else { (max_bytes.div_ceil(256) * 256).min(last_cap) };
        lanes.push(LaneLayout { max_bytes, blocks: blocks.min(sms.saturating_sub(1)).max(1), cap, pipeline, offset: bytes });
        bytes += kernels::ONESHOT_FLAG_BYTES + kernels::ONESHOT_SETS * n * cap;
    }
    (lanes, bytes)
}

/// The index of the lane for a message of `bytes` per rank among lanes
/// ordered by size (the last takes any size).
pub(crate) fn lane_index(max_bytes: impl Iterator<Item = usize>, bytes: usize, lanes: usize) -> usize {
    let mut max_bytes = max_bytes;
    max_bytes.position(|m| bytes <= m).unwrap_or(lanes.saturating_sub(1))
}

/// Elements of `elem` bytes for a check of each lane of `lanes` (in the
/// same order): a message that takes that lane, ends in a partial 16-byte
/// unit, and runs in at least as many rounds as the lane allows up to one
/// more than there are slot sets (so that a lane with rounds reuses a set and, where
/// it pushes ahead, overlaps its rounds) — the creation checks of the group
/// and of [`crate::ipc::Comm`] run these counts.
pub(crate) fn check_counts(lanes: &[LaneLayout], elem: usize) -> Vec<usize> {
    let elem = elem.max(1);
    let mut lower = 0usize;
    lanes
        .iter()
        .map(|lane| {
            let upper = lane.max_bytes;
            let cap = lane.cap.max(256);
            let rounds = (upper / cap).clamp(1, kernels::ONESHOT_SETS + 1);
            // Three elements short of whole rounds (or of the lane's top):
            // past the lane below, not a multiple of 16 bytes.
            let bytes = (rounds * cap).min(upper).saturating_sub(3 * elem).max(lower + elem);
            lower = upper;
            bytes / elem
        })
        .collect()
}

/// Where the slots live.
pub(crate) enum Medium {
    /// One region per rank in its device memory (kept alive here).
    Device(#[allow(dead_code)] Vec<CudaSlice<u8>>),
    /// One mapped pinned host region for the group.
    Host(#[allow(dead_code)] PinnedBuffer),
}

/// One independent one-shot: slots, flags and counters used only by it, and
/// one grid for all its launches. The kernel's slot-reuse rule holds per
/// lane, so consecutive calls may take different lanes.
struct Lane {
    /// Its size range, grid, slot bytes and pipeline.
    layout: LaneLayout,
    /// Per rank: the regions it stores into.
    push: Vec<PtrArray>,
    /// Per rank: the region it reads from.
    pull: Vec<u64>,
    /// Per rank: its block counters (ONESHOT_MAX_BLOCKS words).
    counters: Vec<u64>,
}

/// A group's one-shot state: slots, flags, counters and kernels.
pub(crate) struct OneShot {
    pub(crate) medium: Medium,
    /// Each rank's block counters, every lane's (device memory, zeroed once).
    _counters: Vec<CudaSlice<u32>>,
    /// By message size, smallest first.
    lanes: Vec<Lane>,
    /// How many regions each rank stores into.
    npush: i32,
    pub(crate) funcs: Vec<FnTable>,
}

/// One-shot states dropped so far (for the graph-lifetime test, through
/// `crate::group::graph_keep_alives`).
pub(crate) static DROPPED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl Drop for OneShot {
    fn drop(&mut self) {
        DROPPED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl OneShot {
    /// Sets up the slots on `comm`'s ranks (2 to 8, one per device): in device
    /// memory when `p2p` (every pair verified), else in mapped host memory.
    fn new(comm: &Communicator, p2p: bool) -> Result<OneShot> {
        let ranks = &comm.ranks;
        let n = ranks.len();
        let sms = ranks.iter().map(|r| r.sms).min().unwrap_or(1);
        let devices: Vec<usize> = ranks.iter().map(|r| r.ctx.ordinal()).collect();
        let (layout, bytes) = layout(n, p2p, (sms / sharing(&devices)).max(1));
        let mut counters = Vec::with_capacity(n);
        let mut counter_ptrs = Vec::with_capacity(n);
        for rank in ranks {
            let words = layout.len() * kernels::ONESHOT_MAX_BLOCKS;
            let c = rank.stream.alloc_zeros::<u32>(words).map_err(cudarc_err("cuMemAlloc (one-shot counters)"))?;
            counter_ptrs.push(c.device_ptr(&rank.stream).0);
            counters.push(c);
        }
        // Per rank: the regions it stores into and the one it reads from
        // (each region holds every lane).
        let (medium, push, npush, pull) = if p2p {
            let mut regions = Vec::with_capacity(n);
            let mut addrs = Vec::with_capacity(n);
            for rank in ranks {
                // Zeroed: the flags must start at 0.
                let r = rank.stream.alloc_zeros::<u8>(bytes).map_err(cudarc_err("cuMemAlloc (one-shot slots)"))?;
                addrs.push(r.device_ptr(&rank.stream).0);
                regions.push(r);
            }
            let push: Vec<Vec<u64>> = (0..n).map(|r| (0..n).filter(|&k| k != r).map(|k| addrs[k]).collect()).collect();
            (Medium::Device(regions), push, n as i32 - 1, addrs)
        } else {
            let host = PinnedBuffer::new_mapped(&ranks[0].ctx, bytes)?;
            let addrs = ranks.iter().map(|r| host.device_addr(&r.ctx)).collect::<Result<Vec<_>>>()?;
            let push = addrs.iter().map(|&a| vec![a]).collect();
            (Medium::Host(host), push, 1, addrs)
        };
        let lanes = layout
            .iter()
            .enumerate()
            .map(|(l, &lane)| {
                let off = lane.offset as u64;
                Lane {
                    layout: lane,
                    push: push.iter().map(|p| PtrArray::from_slice(&p.iter().map(|a| a + off).collect::<Vec<_>>())).collect(),
                    pull: pull.iter().map(|a| a + off).collect(),
                    counters: counter_ptrs.iter().map(|c| c + (l * kernels::ONESHOT_MAX_BLOCKS * 4) as u64).collect(),
                }
            })
            .collect();
        // The zeroed flags and counters must be in place before any peer's first kernel.
        for rank in ranks {
            rank.stream.synchronize().map_err(cudarc_err("cuStreamSynchronize"))?;
        }
        Ok(OneShot { medium, _counters: counters, lanes, npush, funcs: (0..n).map(|_| FnTable::default()).collect() })
    }

    /// Whether the slots are in host memory (the group has no P2P mesh).
    pub(crate) fn on_host(&self) -> bool {
        matches!(self.medium, Medium::Host(_))
    }

    /// Elements of `elem` bytes for a check of every lane ([`check_counts`]).
    pub(crate) fn check_counts(&self, elem: usize) -> Vec<usize> {
        check_counts(&self.lanes.iter().map(|l| l.layout).collect::<Vec<_>>(), elem)
    }

    /// The lane for a message of `bytes` per rank.
    fn lane(&self, bytes: usize) -> &Lane {
        &self.lanes[lane_index(self.lanes.iter().map(|l| l.layout.max_bytes), bytes, self.lanes.len())]
    }
}

impl OneShot {
    /// The in-place one-shot all-reduce of `bufs` (then the division of
    /// [`ReduceOp::Avg`]), where each rank's launcher (or the calling
    /// thread, for rank 0) takes its own buffer's pointer, launches, and
    /// records the buffer's event: cudarc's event tracking of the buffers
    /// then runs in parallel too. A rank whose stream joins a capture
    /// through its buffer's ordering is seen before its kernel
    /// ([`Communicator::see_capture`], with `keep_alive`).
    pub(crate) fn in_place<T: Element, D: DevicePtrMut<T> + Send>(
        &self,
        comm: &Communicator,
        op: ReduceOp,
        bufs: &mut [D],
        count: usize,
        keep_alive: &(dyn Fn() -> KeepAlive + Sync),
    ) -> Result<()> {
        self.resolve(comm, op, T::DTYPE)?;
        let cells = cells(bufs);
        comm.launch_each(&|r| {
            let buf = take(&cells, r)?;
            let rank = &comm.ranks[r];
            // The guard orders the buffer after this rank's kernels.
            let (ptr, held) = rank.order.write(buf, &rank.stream)?;
            let launched = comm.see_capture(r, keep_alive).and_then(|_| self.rank(comm, op, T::DTYPE, r, ptr, ptr, count));
            launched.and(comm.end_call(r)).and(held.finish())
        })
    }

    /// The out-of-place one-shot all-reduce, `recv[r] = reduce(send)`, each
    /// rank's buffers taken on its own launcher as in [`Self::in_place`].
    pub(crate) fn out_of_place<T: Element, S: DevicePtr<T> + Sync, D: DevicePtrMut<T> + Send>(
        &self,
        comm: &Communicator,
        op: ReduceOp,
        send: &[S],
        recv: &mut [D],
        count: usize,
        keep_alive: &(dyn Fn() -> KeepAlive + Sync),
    ) -> Result<()> {
        self.resolve(comm, op, T::DTYPE)?;
        let cells = cells(recv);
        comm.launch_each(&|r| {
            let out = take(&cells, r)?;
            let input = send.get(r).ok_or_else(|| Error::Internal(format!("one-shot: no send buffer for rank {r}")))?;
            let rank = &comm.ranks[r];
            let (src, read) = rank.order.read(input, &rank.stream)?;
            let (dst, write) = rank.order.write(out, &rank.stream)?;
            let launched = comm.see_capture(r, keep_alive).and_then(|_| self.rank(comm, op, T::DTYPE, r, src, dst, count));
            launched.and(comm.end_call(r)).and(read.finish()).and(write.finish())
        })
    }

    /// The one-shot all-reduce on raw pointers, `output[r] = reduce(every
    /// input)` (in place where they are equal), each rank launched on its
    /// own launcher: for callers that order the buffers themselves
    /// ([`crate::raw`]).
    pub(crate) fn ptrs(&self, comm: &Communicator, op: ReduceOp, dtype: DType, input: &[u64], output: &[u64], count: usize) -> Result<()> {
        comm.launch_each(&|r| match (input.get(r), output.get(r)) {
            (Some(&i), Some(&o)) => self.rank(comm, op, dtype, r, i, o, count),
            _ => Err(Error::Internal(format!("one-shot: no buffer for rank {r}"))),
        })
    }

    /// Resolves every rank's kernels for `op` on `dtype` before any rank
    /// launches (a no-op after the group's warm-up): a rank that failed to
    /// load its module after others launched would leave them waiting for
    /// its flags.
    fn resolve(&self, comm: &Communicator, op: ReduceOp, dtype: DType) -> Result<()> {
        for r in 0..comm.size() {
            let kernel = Kernel::OneShot(KernelOp::of(op), dtype);
            self.funcs[r].get(kernel, || comm.kernel_function(r, kernel))?;
        }
        if op == ReduceOp::Avg {
            comm.resolve_scale_div(dtype)?;
        }
        Ok(())
    }

    /// Rank r's one-shot kernel, then the division of [`ReduceOp::Avg`].
    #[allow(clippy::too_many_arguments)] // the kernel's own arguments, plus the group's state
    fn rank(&self, comm: &Communicator, op: ReduceOp, dtype: DType, r: usize, input: u64, output: u64, count: usize) -> Result<()> {
        let (op, input) = prescale(comm, op, dtype, r, input, output, count)?;
        self.launch_rank(comm, KernelOp::of(op), dtype, r, input, output, count)
    }

    /// Launches rank r's one-shot kernel: `out = reduce(every rank's in)`.
    #[allow(clippy::too_many_arguments)] // the kernel's own arguments, plus the group's state
    fn launch_rank(&self, comm: &Communicator, op: KernelOp, dtype: DType, r: usize, input: u64, output: u64, count: usize) -> Result<()> {
        let lane = self.lane(count * dtype.size());
        let kernel = Kernel::OneShot(op, dtype);
        let f = self.funcs[r].get(kernel, || comm.kernel_function(r, kernel))?;
        let fused = comm.ctl_args(r)?;
        if fused.skip {
            return Ok(());
        }
        let args = launch::OneShot {
            blocks: lane.layout.blocks,
            push: &lane.push[r],
            npush: self.npush,
            pull: lane.pull[r],
            input,
            output,
            counters: lane.counters[r],
            nranks: comm.size() as i32,
            rank: r as i32,
            count: count as u64,
            cap: lane.layout.cap as u64,
            ahead: lane.layout.pipeline.arg(),
            ctl: fused.ctl,
            timeout_ns: fused.timeout_ns,
            call: fused.call,
        };
        // SAFETY: `f` is rank r's one-shot kernel of `dtype`; `ctl` is the
        // group's mapped control block. `input`/`output` hold `count`
        // elements of `dtype` on rank r's device (the callers' checks); the
        // lane's push regions and pull region were sized by `layout` for
        // `n` ranks and are reachable from rank r's device (peer access
        // enabled and verified for every pair, or mapped portable host
        // memory), alive as long as the group (and its graphs: the keep-
        // alives); the counters are rank r's. Every rank runs the lane's
        // grid on every call of the lane (callers launch every rank), and
        // ranks sharing a device divide its multiprocessors among their
        // grids (`sharing`), so all ranks' blocks can be resident.
        unsafe { launch::oneshot(&comm.ranks[r].stream, f, &args) }
    }
}

impl AllReduce for OneShot {
    /// Sets up the one-shot all-reduce on `comm` where `request` asks for
    /// it and the group allows it (a forced one-shot that it does not is an
    /// error): slots in device memory when every pair has P2P, else in
    /// host memory.
    fn open(comm: &Communicator, request: Algorithm) -> Result<Option<OneShot>> {
        if !matches!(request, Algorithm::Auto | Algorithm::OneShot) {
            return Ok(None);
        }
        let devices: Vec<usize> = comm.ranks.iter().map(|r| r.ctx.ordinal()).collect();
        if let Some(why) = layout_refusal(&devices) {
            return if request == Algorithm::OneShot { Err(unavailable("one-shot", &why)) } else { Ok(None) };
        }
        let p2p = comm.routes.ring_all_p2p() && comm.routes.all_pairs == Some(Ok(()));
        OneShot::new(comm, p2p).map(Some)
    }

    fn enqueue(&self, comm: &Communicator, op: ReduceOp, dtype: DType, ins: &[u64], outs: &[u64], count: usize) -> Result<()> {
        self.ptrs(comm, op, dtype, ins, outs, count)
    }
}

/// One cell per rank's buffer, so that each rank's launcher can take its own.
fn cells<D>(bufs: &mut [D]) -> Vec<Mutex<Option<&mut D>>> {
    bufs.iter_mut().map(|b| Mutex::new(Some(b))).collect()
}

/// Rank r's buffer out of its cell (once per call).
fn take<'a, D>(cells: &[Mutex<Option<&'a mut D>>], r: usize) -> Result<&'a mut D> {
    let taken = cells.get(r).and_then(|c| c.lock().unwrap_or_else(|p| p.into_inner()).take());
    taken.ok_or_else(|| Error::Internal(format!("one-shot: rank {r}'s buffer missing or taken twice")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_grow_by_size_and_end_with_every_size() {
        for spec in [&DEVICE_LANES[..], &HOST_LANES[..]] {
            assert!(spec.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1), "{spec:?}");
            assert_eq!(spec.last().map(|l| l.0), Some(usize::MAX));
            assert!(spec.iter().all(|&(_, b, _)| b >= 1 && b as usize <= kernels::ONESHOT_MAX_BLOCKS));
        }
    }

    #[test]
    fn layout_packs_lanes_back_to_back() {
        for n in 2..=8 {
            for p2p in [true, false] {
                let (lanes, bytes) = layout(n, p2p, 132);
                let mut end = 0;
                for l in &lanes {
                    assert_eq!(l.offset, end);
                    assert_eq!(l.cap % 256, 0);
                    end += kernels::ONESHOT_FLAG_BYTES + kernels::ONESHOT_SETS * n * l.cap;
                }
                assert_eq!(end, bytes);
            }
        }
        let (lanes, _) = layout(2, true, 132);
        assert_eq!(lanes.last().map(|l| l.cap), Some(ONESHOT_SCRATCH_BYTES / (2 * kernels::ONESHOT_SETS)));
        // Between 2 ranks, the largest message Auto gives the one-shot is one
        // round (two rounds of half the size were slower: docs/experiments.md).
        assert!(lanes.last().is_some_and(|l| l.cap >= crate::algorithms::ONESHOT_AUTO_MAX_BYTES));
        let maxes = || lanes.iter().map(|l| l.max_bytes);
        assert_eq!(lane_index(maxes(), 4096, lanes.len()), 0);
        assert_eq!(lane_index(maxes(), 1 << 30, lanes.len()), lanes.len() - 1);
    }

    #[test]
    fn rounds_never_exceed_the_last_lanes_and_grids_fit_the_devices() {
        for n in 2..=8 {
            for p2p in [true, false] {
                let (lanes, _) = layout(n, p2p, 132);
                let last = lanes.last().map(|l| l.cap).unwrap_or(0);
                // A lane below the last runs in rounds no longer than the last's
                // (the host lanes' 1 MiB rounds were measured best).
                assert!(lanes.iter().all(|l| l.cap <= last && l.cap >= 256), "{n} {p2p} {lanes:?}");
                assert!(lanes.iter().all(|l| l.blocks as usize <= kernels::ONESHOT_MAX_BLOCKS));
                // A device with fewer multiprocessors than a lane's grid gets a
                // grid of one block per multiprocessor but one; the slots stay
                // in place.
                let (small, bytes_small) = layout(n, p2p, 58);
                assert_eq!(bytes_small, layout(n, p2p, 132).1);
                for (a, b) in small.iter().zip(&lanes) {
                    assert_eq!(a.blocks, b.blocks.min(57));
                    assert_eq!((a.cap, a.offset, a.max_bytes, a.pipeline), (b.cap, b.offset, b.max_bytes, b.pipeline));
                }
                assert!(layout(n, p2p, 0).0.iter().all(|l| l.blocks == 1));
            }
        }
        let (host, _) = layout(2, false, 132);
        assert!(host.iter().filter(|l| l.max_bytes > 256 << 10).all(|l| l.cap == HOST_ROUND_BYTES));
        let (device, _) = layout(2, true, 132);
        assert_eq!(device.last().map(|l| l.blocks), Some(kernels::ONESHOT_MAX_BLOCKS as u32));
        // A multiprocessor of every device stays free for another group.
        for sms in [2, 66, 108, 128, 129] {
            for p2p in [true, false] {
                assert!(layout(2, p2p, sms).0.iter().all(|l| l.blocks < sms), "{sms} multiprocessors");
            }
        }
        assert_eq!(layout(2, true, 128).0.last().map(|l| l.blocks), Some(127));
    }

    /// Each lane's check count takes that lane, in at least as many rounds as
    /// the lane allows up to one more than the slot sets (several rounds
    /// wherever a lane's range is longer than its slots: the pushed-ahead and
    /// deep lanes included), ends in a partial 16-byte unit, and stays small
    /// enough for a creation check.
    #[test]
    fn check_counts_take_every_lane_in_several_rounds() {
        for n in 2..=8 {
            for p2p in [true, false] {
                for elem in [1, 2, 4, 8] {
                    let (lanes, _) = layout(n, p2p, 132);
                    let counts = check_counts(&lanes, elem);
                    assert_eq!(counts.len(), lanes.len());
                    for (l, (&count, lane)) in counts.iter().zip(&lanes).enumerate() {
                        let bytes = count * elem;
                        assert_eq!(lane_index(lanes.iter().map(|x| x.max_bytes), bytes, lanes.len()), l, "n {n} p2p {p2p} elem {elem}: {count}");
                        assert!(bytes % 16 != 0, "lane {l}: {bytes} bytes");
                        let rounds = bytes.div_ceil(lane.cap);
                        let possible = (lane.max_bytes / lane.cap).clamp(1, kernels::ONESHOT_SETS + 1);
                        assert!(rounds >= possible, "n {n} p2p {p2p} lane {l}: {bytes} bytes in {} B slots", lane.cap);
                        assert!(bytes <= 24 << 20, "lane {l}: {bytes} bytes");
                    }
                    // The lanes that overlap rounds are checked with more rounds than slot sets.
                    for (lane, &count) in lanes.iter().zip(&counts) {
                        if lane.pipeline != OneShotPipeline::Plain {
                            assert!((count * elem).div_ceil(lane.cap) > kernels::ONESHOT_SETS, "{lane:?}");
                        }
                    }
                }
            }
        }
    }
}
