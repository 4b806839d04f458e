//! The mesh all-reduce: one kernel per rank. Rank r reduces segment r of
//! every rank's buffer by peer loads and writes the result into segment r
//! of every rank's buffer by peer stores, between two device-side barriers
//! (flags written with release and read with acquire at system scope). The
//! kernel and its protocol are in `kernels/reduce.cu` (`cp_meshar_*`).

use super::common::{layout_refusal, prescale_all, sharing, unavailable, Algorithm, AllReduce};
use crate::communicator::Communicator;
use crate::dtype::{DType, ReduceOp};
use crate::error::{cudarc_err, Error, Result};
use crate::kernels::load::{FnTable, PtrArray};
use crate::kernels::{self, Kernel, KernelOp};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// The mesh all-reduce's per-rank state: kernels and flag areas.
pub(crate) struct Mesh {
    /// Each rank's kernels, loaded on first use.
    pub(crate) funcs: Vec<FnTable>,
    /// Each rank's flag area (zeroed once), kept alive with the group.
    _flags: Vec<CudaSlice<u32>>,
    flag_ptrs: [u64; kernels::MESH_MAX_RANKS],
    /// The largest grid of a rank's launch: half the fewest elementwise
    /// blocks of the ranks' devices, divided among the ranks that share a
    /// device (so that every rank's blocks can be resident at once).
    max_blocks: u32,
}

impl Mesh {
    /// The mesh's wrapping u32 sum in place on `ptrs`, whatever the size
    /// (for the fused-path check, `super::check`).
    pub(crate) fn check_sum(&self, comm: &Communicator, ptrs: &[u64], count: usize) -> Result<()> {
        self.launch(comm, KernelOp::Sum, DType::U32, ptrs, ptrs, count, ptrs.iter().all(|p| p % 16 == 0))
    }

    /// Launches the mesh all-reduce on every rank: `outs[r] = reduce(ins)`;
    /// `aligned`: every pointer is 16-byte aligned (the vector path).
    #[allow(clippy::too_many_arguments)] // the kernel's own arguments, plus the group's state
    fn launch(&self, comm: &Communicator, op: KernelOp, dtype: DType, ins: &[u64], outs: &[u64], count: usize, aligned: bool) -> Result<()> {
        let mesh = self;
        let n = comm.size();
        let e = 16 / dtype.size();
        let seg = count.div_ceil(n).div_ceil(e) * e;
        let blocks = seg.div_ceil(e * kernels::BLOCK_SIZE as usize).clamp(1, self.max_blocks as usize) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (kernels::BLOCK_SIZE, 1, 1), shared_mem_bytes: 0 };
        let (pin, pout, pflags) = (PtrArray::from_slice(ins), PtrArray::from_slice(outs), PtrArray(mesh.flag_ptrs));
        let (nranks, cnt, seg64, vec) = (n as i32, count as u64, seg as u64, aligned as i32);
        // Every rank's kernel is resolved before any rank launches (a no-op
        // after the group's warm-up): a rank that failed to load its module
        // after others launched would leave them waiting at the barrier.
        let kernel = Kernel::Mesh(op, dtype);
        for r in 0..n {
            mesh.funcs[r].get(kernel, || comm.kernel_function(r, kernel))?;
        }
        comm.launch_each(&|r| {
            let f = mesh.funcs[r].get(kernel, || comm.kernel_function(r, kernel))?;
            let rank = r as i32;
            let fused = comm.ctl_args(r)?;
            if fused.skip {
                return Ok(());
            }
            let mut launch = comm.ranks[r].stream.launch_builder(f);
            launch.arg(&pin).arg(&pout).arg(&pflags).arg(&nranks).arg(&rank).arg(&cnt).arg(&seg64).arg(&vec);
            launch.arg(&fused.ctl).arg(&fused.timeout_ns).arg(&fused.call);
            // SAFETY: the signature is (PtrArray, PtrArray, PtrArray, i32, i32,
            // u64, u64, i32, u32*, u64, u32); `ctl` is the group's mapped control
            // block (`ctl_bytes(ranks)`); every pointer holds `count` elements (flags:
            // MESH_FLAG_WORDS words) on a device that every rank's device has
            // P2P access to (enabled and verified when the mesh was set up),
            // or on its own device; the same grid is launched on every rank,
            // as the kernel's per-block barrier requires, and ranks sharing a
            // device divide its blocks (`sharing`), so all can be resident.
            unsafe { launch.launch(cfg) }.map_err(cudarc_err("cuLaunchKernel (mesh all-reduce)"))?;
            Ok(())
        })
    }
}

impl AllReduce for Mesh {
    /// Sets up the mesh all-reduce on `comm` where `request` asks for it
    /// and the group allows it (a forced mesh that it does not is an error).
    fn open(comm: &Communicator, request: Algorithm) -> Result<Option<Mesh>> {
        let ranks = &comm.ranks;
        let n = ranks.len();
        let refuse = |why: &str| if request == Algorithm::Mesh { Err(unavailable("mesh", why)) } else { Ok(None) };
        if matches!(request, Algorithm::Ring | Algorithm::OneShot) {
            return Ok(None);
        }
        let devices: Vec<usize> = ranks.iter().map(|r| r.ctx.ordinal()).collect();
        if let Some(why) = layout_refusal(&devices) {
            return refuse(&why);
        }
        if !comm.routes.ring_all_p2p() {
            return refuse("needs every ring link on P2P");
        }
        match &comm.routes.all_pairs {
            Some(Ok(())) => {}
            Some(Err(why)) => return refuse(why),
            None => return Err(Error::Internal("mesh: the routes were built without the all-pairs check".into())),
        }
        let mut flags = Vec::with_capacity(n);
        let mut flag_ptrs = [0u64; kernels::MESH_MAX_RANKS];
        for (r, rank) in ranks.iter().enumerate() {
            let f = rank.stream.alloc_zeros::<u32>(kernels::MESH_FLAG_WORDS).map_err(cudarc_err("cuMemAlloc (mesh flags)"))?;
            flag_ptrs[r] = {
                use cudarc::driver::DevicePtr;
                f.device_ptr(&rank.stream).0
            };
            flags.push(f);
        }
        // The zeroed flags must be in place before any peer's first kernel reads them.
        for rank in ranks {
            rank.stream.synchronize().map_err(cudarc_err("cuStreamSynchronize"))?;
        }
        let fewest = ranks.iter().map(|r| r.max_blocks()).min().unwrap_or(1);
        let max_blocks = (fewest / 2 / sharing(&devices)).clamp(1, kernels::MESH_MAX_BLOCKS as u32);
        Ok(Some(Mesh { funcs: (0..n).map(|_| FnTable::default()).collect(), _flags: flags, flag_ptrs, max_blocks }))
    }

    fn enqueue(&self, comm: &Communicator, op: ReduceOp, dtype: DType, ins: &[u64], outs: &[u64], count: usize) -> Result<()> {
        let aligned = ins.iter().chain(outs).all(|p| p % 16 == 0);
        comm.check_reach("all_reduce (mesh)", ins, true)?;
        if ins != outs {
            comm.check_reach("all_reduce (mesh)", outs, true)?;
        }
        let (op, in_place) = prescale_all(comm, op, dtype, ins, outs, count)?;
        self.launch(comm, KernelOp::of(op), dtype, if in_place { outs } else { ins }, outs, count, aligned)
    }
}
