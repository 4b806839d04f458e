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
//! Memory: [`ONESHOT_SCRATCH_BYTES`] per rank of device memory (P2P) or per
//! group of pinned host memory (host), plus a few KiB of flags and counters.
//! Longer messages run in rounds of one slot each.
//!
//! The kernel is in `kernels/reduce.cu` (`cp_oneshot_*`, in the mesh modules).

use crate::copy::staged::PinnedBuffer;
use crate::dtype::DType;
use crate::error::{cudarc_err, Result};
use crate::group::{FnTable, Group, PtrArray, Rank};
use crate::kernels;
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

/// Bytes of slots per rank (P2P: device memory on every rank) or per group
/// (host: one pinned buffer): two parities of one slot per rank.
pub const ONESHOT_SCRATCH_BYTES: usize = 16 << 20;

/// Where the slots live.
pub(crate) enum Medium {
    /// One region per rank in its device memory (kept alive here).
    Device(#[allow(dead_code)] Vec<CudaSlice<u8>>),
    /// One mapped pinned host region for the group.
    Host(#[allow(dead_code)] PinnedBuffer),
}

/// A group's one-shot state: slots, flags, counters and kernels.
pub(crate) struct OneShot {
    pub(crate) medium: Medium,
    /// Each rank's block counters (device memory, zeroed once).
    _counters: Vec<CudaSlice<u32>>,
    counter_ptrs: Vec<u64>,
    /// Per rank: the regions it stores into, and how many.
    push: Vec<PtrArray>,
    npush: i32,
    /// Per rank: the region it reads from.
    pull: Vec<u64>,
    /// Slot bytes (a multiple of 16).
    cap: usize,
    /// The grid, the same on every launch (the kernel's reuse rule).
    blocks: u32,
    funcs: Vec<FnTable>,
}

impl OneShot {
    /// Sets up the slots on `ranks` (2 to 8, one per device): in device
    /// memory when `p2p` (every pair verified), else in mapped host memory.
    pub(crate) fn new(ranks: &[Rank], p2p: bool) -> Result<OneShot> {
        let n = ranks.len();
        let cap = (ONESHOT_SCRATCH_BYTES / (2 * n)) & !255;
        let bytes = kernels::ONESHOT_FLAG_BYTES + 2 * n * cap;
        let mut counters = Vec::with_capacity(n);
        let mut counter_ptrs = Vec::with_capacity(n);
        for rank in ranks {
            let c = rank.stream.alloc_zeros::<u32>(kernels::ONESHOT_MAX_BLOCKS).map_err(cudarc_err("cuMemAlloc (one-shot counters)"))?;
            counter_ptrs.push(c.device_ptr(&rank.stream).0);
            counters.push(c);
        }
        let (medium, push, npush, pull, blocks) = if p2p {
            let mut regions = Vec::with_capacity(n);
            let mut addrs = Vec::with_capacity(n);
            for rank in ranks {
                // Zeroed: the flags must start at 0.
                let r = rank.stream.alloc_zeros::<u8>(bytes).map_err(cudarc_err("cuMemAlloc (one-shot slots)"))?;
                addrs.push(r.device_ptr(&rank.stream).0);
                regions.push(r);
            }
            let push = (0..n).map(|r| PtrArray::from_slice(&(0..n).filter(|&k| k != r).map(|k| addrs[k]).collect::<Vec<_>>())).collect();
            (Medium::Device(regions), push, n as i32 - 1, addrs, kernels::ONESHOT_DEVICE_BLOCKS)
        } else {
            let host = PinnedBuffer::new_mapped(&ranks[0].ctx, bytes)?;
            let addrs = ranks.iter().map(|r| host.device_addr(&r.ctx)).collect::<Result<Vec<_>>>()?;
            let push = addrs.iter().map(|&a| PtrArray::from_slice(&[a])).collect();
            (Medium::Host(host), push, 1, addrs, kernels::ONESHOT_HOST_BLOCKS)
        };
        // The zeroed flags and counters must be in place before any peer's first kernel.
        for rank in ranks {
            rank.stream.synchronize().map_err(cudarc_err("cuStreamSynchronize"))?;
        }
        Ok(OneShot {
            medium,
            _counters: counters,
            counter_ptrs,
            push,
            npush,
            pull,
            cap,
            blocks,
            funcs: (0..n).map(|_| FnTable::default()).collect(),
        })
    }

    /// Whether the slots are in host memory (the group has no P2P mesh).
    pub(crate) fn on_host(&self) -> bool {
        matches!(self.medium, Medium::Host(_))
    }
}

impl Group {
    /// Launches the one-shot all-reduce on every rank: `outs[r] =
    /// reduce(ins)`. Every pointer must be 16-byte aligned (the caller checks).
    pub(crate) fn launch_oneshot(&self, os: &OneShot, op: &'static str, dtype: DType, ins: &[u64], outs: &[u64], count: usize) -> Result<()> {
        let n = self.size();
        let cfg = LaunchConfig { grid_dim: (os.blocks, 1, 1), block_dim: (kernels::BLOCK_SIZE, 1, 1), shared_mem_bytes: 0 };
        let (nranks, cnt, cap) = (n as i32, count as u64, os.cap as u64);
        // Last rank first: the callers' buffer guards then record their events
        // from rank 0 on without switching contexts back and forth.
        for r in (0..n).rev() {
            let f = os.funcs[r].get(op, dtype, || self.mesh_function(r, "cp_oneshot", op, dtype))?;
            let rank = r as i32;
            let mut launch = self.ranks[r].stream.launch_builder(f);
            launch
                .arg(&os.push[r])
                .arg(&os.npush)
                .arg(&os.pull[r])
                .arg(&ins[r])
                .arg(&outs[r])
                .arg(&os.counter_ptrs[r])
                .arg(&nranks)
                .arg(&rank)
                .arg(&cnt)
                .arg(&cap);
            // SAFETY: the signature is (PtrArray, i32, const void*, const T*, T*,
            // u32*, i32, i32, u64, u64). `ins[r]`/`outs[r]` hold `count`
            // elements on rank r's device, 16-byte aligned; the push regions and
            // the pull region hold ONESHOT_FLAG_BYTES + 2 * n * cap bytes and are
            // reachable from rank r's device (peer access enabled and verified
            // for every pair, or mapped portable host memory); the counters hold
            // ONESHOT_MAX_BLOCKS words of rank r. Every rank runs the same grid
            // on every call, as the kernel's slot-reuse rule requires, and each
            // rank is on its own device, so all ranks' blocks can be resident.
            unsafe { launch.launch(cfg) }.map_err(cudarc_err("cuLaunchKernel (one-shot all-reduce)"))?;
        }
        Ok(())
    }
}
