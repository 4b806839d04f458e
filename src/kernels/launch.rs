//! One typed launch per kernel: the argument list, the grid and the
//! contract of each kernel are written here once, for every engine that
//! launches it (the single-process group and the per-rank communicator).

use super::{BLOCK_SIZE, ONESHOT_MAX_BLOCKS};
use crate::dtype::DType;
use crate::error::{cudarc_err, Result};
use crate::kernels::load::PtrArray;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

/// The largest grid of the elementwise kernels on a device with `sms`
/// multiprocessors: four blocks per multiprocessor.
pub(crate) fn max_blocks(sms: u32) -> u32 {
    sms.saturating_mul(4).max(1)
}

/// A grid over `count` elements of `dtype`, 16 bytes per thread, at most
/// `max_blocks` blocks (the kernels stride over what is left).
pub(crate) fn elementwise_grid(count: usize, dtype: DType, max_blocks: u32) -> LaunchConfig {
    let per_block = BLOCK_SIZE as usize * (16 / dtype.size());
    let blocks = count.div_ceil(per_block).clamp(1, max_blocks.max(1) as usize) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK_SIZE, 1, 1), shared_mem_bytes: 0 }
}

/// Launches `dst = a op b` over `count` elements (`cp_reduce2_*`).
///
/// # Safety
///
/// `f` is the reduction kernel of `dtype` (signature `(T*, const T*, const
/// T*, u64)`) loaded in `stream`'s context; `dst`, `a` and `b` each hold
/// `count` elements of `dtype`, on that device or mapped for it (peer
/// memory with access enabled, or mapped host memory), and stay alive and
/// unwritten by anything else until the kernel is done (`dst` may equal
/// `a` or `b`: each element is read before it is written, by one thread).
#[allow(clippy::too_many_arguments)] // the kernel's four arguments, its stream, function, type and grid bound
pub(crate) unsafe fn reduce2(
    stream: &CudaStream,
    f: &CudaFunction,
    dtype: DType,
    dst: u64,
    a: u64,
    b: u64,
    count: usize,
    max_blocks: u32,
) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    let n = count as u64;
    let mut launch = stream.launch_builder(f);
    launch.arg(&dst).arg(&a).arg(&b).arg(&n);
    // SAFETY: the caller's contract.
    unsafe { launch.launch(elementwise_grid(count, dtype, max_blocks)) }.map_err(cudarc_err("cuLaunchKernel (reduce)"))?;
    Ok(())
}

/// Launches `x /= divisor` over `count` elements (`cp_scale_div_*`).
///
/// # Safety
///
/// `f` is the division kernel of `dtype` (signature `(T*, u64, double)`)
/// loaded in `stream`'s context; `x` holds `count` elements of `dtype` on
/// that device, alive until the kernel is done.
pub(crate) unsafe fn scale_div(
    stream: &CudaStream,
    f: &CudaFunction,
    dtype: DType,
    x: u64,
    count: usize,
    divisor: f64,
    max_blocks: u32,
) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    let n = count as u64;
    let mut launch = stream.launch_builder(f);
    launch.arg(&x).arg(&n).arg(&divisor);
    // SAFETY: the caller's contract.
    unsafe { launch.launch(elementwise_grid(count, dtype, max_blocks)) }.map_err(cudarc_err("cuLaunchKernel (scale)"))?;
    Ok(())
}

/// Launches a copy of `bytes` from `src` to `dst` by the SMs (`cp_copy`).
///
/// # Safety
///
/// `f` is `cp_copy` loaded in `stream`'s context; `dst` and `src` hold
/// `bytes` bytes each, reachable from the device (its memory, peer memory
/// with read-write access, or mapped host memory), not overlapping, alive
/// until the kernel is done.
pub(crate) unsafe fn copy(stream: &CudaStream, f: &CudaFunction, dst: u64, src: u64, bytes: usize, max_blocks: u32) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let n = bytes as u64;
    let mut launch = stream.launch_builder(f);
    launch.arg(&dst).arg(&src).arg(&n);
    // SAFETY: the caller's contract.
    unsafe { launch.launch(elementwise_grid(bytes, DType::U8, max_blocks)) }.map_err(cudarc_err("cuLaunchKernel (copy)"))?;
    Ok(())
}

/// One rank's launch of the one-shot all-reduce (`cp_oneshot_*`): its lane
/// (grid, slots, flags, counters), its buffers, and the group's control
/// block.
pub(crate) struct OneShot<'a> {
    /// The lane's grid (at most [`ONESHOT_MAX_BLOCKS`]).
    pub(crate) blocks: u32,
    /// The regions this rank stores into, at the lane's offset.
    pub(crate) push: &'a PtrArray,
    /// How many of `push` are used.
    pub(crate) npush: i32,
    /// The region this rank reads from, at the lane's offset.
    pub(crate) pull: u64,
    pub(crate) input: u64,
    pub(crate) output: u64,
    /// This rank's block counters of the lane.
    pub(crate) counters: u64,
    pub(crate) nranks: i32,
    pub(crate) rank: i32,
    /// Elements.
    pub(crate) count: u64,
    /// Bytes of one rank's slot in a round.
    pub(crate) cap: u64,
    /// The lane's pipeline (`OneShotPipeline::arg`).
    pub(crate) ahead: i32,
    /// This rank's control block (`failure::ctl_bytes(nranks)`, mapped for the device).
    pub(crate) ctl: u64,
    pub(crate) timeout_ns: u64,
    /// The call's number, for the failure record.
    pub(crate) call: u32,
}

/// Launches one rank's one-shot kernel.
///
/// # Safety
///
/// `f` is the one-shot kernel of the element type of `input`/`output`
/// (signature `(PtrArray, i32, const void*, const T*, T*, u32*, i32, i32,
/// u64, u64, i32, u32*, u64, u32)`) loaded in `stream`'s context. `input` and
/// `output` hold `count` elements on that device (the same, or disjoint).
/// The `npush` regions of `push` and the `pull` region hold
/// `ONESHOT_FLAG_BYTES + ONESHOT_SETS * nranks * cap` bytes each, reachable
/// from the device (peer memory with read-write access, or mapped host
/// memory) and alive until the kernel is done; `counters` holds
/// [`ONESHOT_MAX_BLOCKS`] words of this rank's; `ctl` is this rank's
/// mapped control block. Every rank of the group launches the lane's same
/// grid and `ahead` for every call of the lane, in the same order (the
/// kernel's slot-reuse rule), and all ranks' grids can be resident at once
/// (one device each, or grids divided among the ranks sharing one, or
/// contexts the driver time-slices).
pub(crate) unsafe fn oneshot(stream: &CudaStream, f: &CudaFunction, a: &OneShot<'_>) -> Result<()> {
    let cfg = LaunchConfig { grid_dim: (a.blocks.clamp(1, ONESHOT_MAX_BLOCKS as u32), 1, 1), block_dim: (BLOCK_SIZE, 1, 1), shared_mem_bytes: 0 };
    let mut launch = stream.launch_builder(f);
    launch
        .arg(a.push)
        .arg(&a.npush)
        .arg(&a.pull)
        .arg(&a.input)
        .arg(&a.output)
        .arg(&a.counters)
        .arg(&a.nranks)
        .arg(&a.rank)
        .arg(&a.count)
        .arg(&a.cap)
        .arg(&a.ahead)
        .arg(&a.ctl)
        .arg(&a.timeout_ns)
        .arg(&a.call);
    // SAFETY: the caller's contract.
    unsafe { launch.launch(cfg) }.map_err(cudarc_err("cuLaunchKernel (one-shot all-reduce)"))?;
    Ok(())
}

/// The words of one rank's side of a point-to-point meeting
/// (`cp_pair_sync`'s and each `cp_pair_xchg` job's `PairMeet`, field for
/// field): the words of the exchange's part 0; part `b`'s flags and counter
/// lie [`PAIR_BLOCK_WORDS`] `* b` words further on.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PairMeet {
    /// The peer's flag word for this rank, in the peer's pair area.
    pub(crate) theirs: u64,
    /// This rank's flag word for the peer, in its own pair area.
    pub(crate) mine: u64,
    /// This rank's meeting counter for the peer (device memory).
    pub(crate) counter: u64,
    /// The peer's view slot for this rank (two words).
    pub(crate) their_view: u64,
    /// This rank's view slot for the peer (two words).
    pub(crate) my_view: u64,
    /// This rank's view of what it sends the peer in the exchange.
    pub(crate) out_view: u64,
    /// Its view of what it receives from the peer.
    pub(crate) in_view: u64,
    pub(crate) peer: i32,
    /// Whether the views are exchanged and compared (1: the exchange's
    /// first meeting) or not (0).
    pub(crate) check: i32,
}

// SAFETY: plain integers, laid out like the C struct the kernel takes by
// value (seven eight-byte words and two ints, 64 bytes).
unsafe impl cudarc::driver::DeviceRepr for PairMeet {}
const _: () = assert!(std::mem::size_of::<PairMeet>() == 64);

/// Words between the flags (and the counters) of one part of an exchange
/// and the next part's (`PAIR_BLOCK_WORDS` in the kernel).
pub(crate) const PAIR_BLOCK_WORDS: usize = 8;

/// Parts (kernel blocks) one exchange of [`pair_xchg`] is split into at
/// most (`PAIR_MAX_BLOCKS` in the kernel).
pub(crate) const PAIR_MAX_BLOCKS: usize = 8;

/// Launches one rank's side of a meeting of part 0 (one thread), with this
/// rank's control block, its rank, the call's number (for the failure
/// record) and the timeout.
///
/// # Safety
///
/// `f` is `cp_pair_sync` loaded in `stream`'s context; `theirs`,
/// `their_view` (16 bytes) lie in the peer's pair area and `mine`,
/// `my_view` in this rank's, reachable from the device (peer memory with
/// read-write access, or mapped host memory) and alive until the kernel is
/// done; `counter` is one word of this rank's device memory; `ctl` is this
/// rank's mapped control block (`failure::ctl_bytes` of more than `rank`
/// ranks). Both ranks of the pair launch their meetings in the same order.
pub(crate) unsafe fn pair_sync(stream: &CudaStream, f: &CudaFunction, m: &PairMeet, ctl: u64, rank: i32, call: u32, timeout_ns: u64) -> Result<()> {
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
    let mut launch = stream.launch_builder(f);
    launch.arg(m).arg(&ctl).arg(&rank).arg(&call).arg(&timeout_ns);
    // SAFETY: the caller's contract.
    unsafe { launch.launch(cfg) }.map_err(cudarc_err("cuLaunchKernel (point-to-point meeting)"))?;
    Ok(())
}

/// Threads of each block of a pair exchange ([`pair_xchg`]).
pub(crate) const PAIR_XCHG_THREADS: u32 = 512;

/// Exchanges one launch of [`pair_xchg`] takes at most (`PAIR_MAX_JOBS`
/// in the kernel): one per peer.
pub(crate) const PAIR_MAX_JOBS: usize = super::MESH_MAX_RANKS;

/// One rank's side of a whole one-chunk exchange with a peer
/// (`cp_pair_xchg`'s `PairJob`, field for field), in `parts` parts of a
/// kernel block each: what it sends copied into its slot, the first
/// meeting, what it receives copied out of the peer's slot, the last
/// meeting.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PairJob {
    /// The meetings' words.
    pub(crate) meet: PairMeet,
    /// This rank's slot for the peer, in its own staging buffer.
    pub(crate) my_slot: u64,
    /// What this rank sends: `out_bytes` bytes.
    pub(crate) src: u64,
    pub(crate) out_bytes: u64,
    /// Where what it receives goes: `in_bytes` bytes.
    pub(crate) dst: u64,
    /// The peer's slot for this rank, in the peer's staging buffer.
    pub(crate) their_slot: u64,
    pub(crate) in_bytes: u64,
    /// Parts, 1 to [`PAIR_MAX_BLOCKS`]; the peer's side of the exchange has
    /// as many.
    pub(crate) parts: i32,
    pub(crate) _pad: i32,
}

/// The kernel's array of jobs, by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PairJobs([PairJob; PAIR_MAX_JOBS]);

// SAFETY: plain integers, laid out like the C structs the kernel takes by
// value (`PairJob`: a `PairMeet`, six eight-byte words and two ints, 120
// bytes).
unsafe impl cudarc::driver::DeviceRepr for PairJobs {}
const _: () = assert!(std::mem::size_of::<PairJob>() == 120 && std::mem::size_of::<PairJobs>() == 120 * PAIR_MAX_JOBS);

/// Launches one rank's side of up to [`PAIR_MAX_JOBS`] one-chunk
/// exchanges, a block per part of each, with the arguments of
/// [`pair_sync`] but the meeting.
///
/// # Safety
///
/// `f` is `cp_pair_xchg` loaded in `stream`'s context; `ctl` is as
/// [`pair_sync`] requires. Each job's meeting words are as [`pair_sync`]
/// requires of its peer's, for each of its `parts` parts (the flags in the
/// pair areas, the counters in this rank's device memory), and no two jobs
/// have one peer; `my_slot` holds `out_bytes` bytes and `their_slot`
/// `in_bytes` bytes (the two ranks' slots for each other of one staging
/// half, reachable from the device as the pair areas are, and alive until
/// the kernel is done), `src` holds `out_bytes` readable bytes and `dst`
/// `in_bytes` writable bytes on this device, neither overlapping a slot nor
/// another job's `dst`. Each peer launches its side of the same exchange,
/// in as many parts (in a `cp_pair_xchg` of its own), or, where it has one
/// part, as the same steps enqueued one by one.
pub(crate) unsafe fn pair_xchg(
    stream: &CudaStream,
    f: &CudaFunction,
    jobs: &[PairJob],
    ctl: u64,
    rank: i32,
    call: u32,
    timeout_ns: u64,
) -> Result<()> {
    if jobs.is_empty() {
        return Ok(());
    }
    if jobs.len() > PAIR_MAX_JOBS || jobs.iter().any(|j| !(1..=PAIR_MAX_BLOCKS as i32).contains(&j.parts)) {
        return Err(crate::error::Error::Internal(format!(
            "{} point-to-point exchanges in one launch, or an exchange of no parts or too many",
            jobs.len()
        )));
    }
    let mut all = PairJobs::default();
    all.0[..jobs.len()].copy_from_slice(jobs);
    let n = jobs.len() as i32;
    let parts = jobs.iter().map(|j| j.parts as u32).max().unwrap_or(1);
    let cfg = LaunchConfig { grid_dim: (parts, n as u32, 1), block_dim: (PAIR_XCHG_THREADS, 1, 1), shared_mem_bytes: 0 };
    let mut launch = stream.launch_builder(f);
    launch.arg(&all).arg(&n).arg(&ctl).arg(&rank).arg(&call).arg(&timeout_ns);
    // SAFETY: the caller's contract.
    unsafe { launch.launch(cfg) }.map_err(cudarc_err("cuLaunchKernel (point-to-point exchange)"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elementwise_grids_cover_the_count_within_the_bound() {
        for dtype in DType::ALL {
            let per_block = BLOCK_SIZE as usize * (16 / dtype.size());
            assert_eq!(elementwise_grid(0, dtype, 528).grid_dim.0, 1);
            assert_eq!(elementwise_grid(per_block, dtype, 528).grid_dim.0, 1);
            assert_eq!(elementwise_grid(per_block + 1, dtype, 528).grid_dim.0, 2);
            assert_eq!(elementwise_grid(usize::MAX / 2, dtype, 528).grid_dim.0, 528);
            assert_eq!(elementwise_grid(usize::MAX / 2, dtype, 0).grid_dim.0, 1);
        }
        assert_eq!(max_blocks(132), 528);
        assert_eq!(max_blocks(0), 1);
    }
}
