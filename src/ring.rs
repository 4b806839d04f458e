//! The ring engine: how each rank pulls from its ring predecessor over the
//! link chosen for that pair, and the lockstep runner of ring schedules
//! (`steps[k][r]`, built by [`crate::schedule`]).
//!
//! Where P2P is verified (or both ranks share a device) a pull is a peer
//! load (a fused reduce kernel reading the predecessor's memory) or a peer
//! copy; elsewhere it goes through the link's staging buffers
//! ([`crate::copy::staged`]), chunk by chunk.

use crate::copy::staged::{Staging, Start};
use crate::copy::{decide, LinkOptions, LinkStatus, Path};
use crate::driver::{api, bind};
use crate::dtype::DType;
use crate::error::{check, cudarc_err, Error, Result};
use crate::group::Group;
use crate::peer::{raw_ctx, PeerAccess};
use crate::sync::is_capturing;
use cuda_peer_sys as sys;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use std::sync::Arc;

/// How a rank pulls from its ring predecessor.
pub(crate) struct Pull {
    pub(crate) status: LinkStatus,
    staging: Option<Staging>,
    /// Device scratch of one staging chunk on the receiving rank (staged reductions).
    scratch: Option<CudaSlice<u8>>,
}

impl Pull {
    /// Opens the link `src -> dst` for a rank whose stream is `stream`
    /// (deciding its path under `link`), with staging buffers and a device
    /// scratch chunk where it is staged; peer-access guards go to `access`.
    pub(crate) fn open(
        src: &Arc<CudaContext>,
        dst: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        link: &LinkOptions,
        access: &mut Vec<PeerAccess>,
    ) -> Result<Pull> {
        let (guards, status) = decide(src, dst, link)?;
        access.extend(guards);
        let (staging, scratch) = if status.path == Path::Staged {
            let st = Staging::new(src, dst, link.staging_chunk_bytes, link.staging_buffers)?;
            // SAFETY (of reading it later): scratch is always written by a
            // host-to-device copy before a kernel reads it.
            let scratch = unsafe { stream.alloc::<u8>(st.chunk_bytes) }.map_err(cudarc_err("cuMemAlloc"))?;
            (Some(st), Some(scratch))
        } else {
            (None, None)
        };
        Ok(Pull { status, staging, scratch })
    }
}

/// One rank's work in one step, on raw device addresses.
#[derive(Debug, Clone, Copy)]
pub(crate) enum PullOp {
    /// `dst[i] = pred[i] op own[i]` for `count` elements of `dtype`.
    Reduce { dst: u64, pred: u64, own: u64, count: usize },
    /// `dst[..bytes] = pred[..bytes]`.
    Copy { dst: u64, pred: u64, bytes: usize },
}

impl Group {
    /// Runs one rank's pull from its predecessor on its stream, over the link's path.
    fn pull(&self, r: usize, op: &str, dtype: DType, what: PullOp) -> Result<()> {
        let pull = &self.pulls[r];
        let stream = &self.ranks[r].stream;
        match (pull.status.path, what) {
            (Path::Local | Path::P2p, PullOp::Reduce { dst, pred: p, own, count }) => self.launch_reduce2(r, op, dtype, dst, p, own, count),
            (Path::Local, PullOp::Copy { dst, pred: p, bytes }) => self.local_copy(r, dst, p, bytes),
            (Path::P2p, PullOp::Copy { dst, pred: p, bytes }) => {
                if bytes == 0 {
                    return Ok(());
                }
                bind(&self.ranks[r].ctx)?;
                let raw = stream.cu_stream() as sys::CUstream;
                // cuMemcpyPeerAsync cannot be captured into a CUDA graph
                // (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED); the unified-
                // addressing copy can, but ran 2% slower on 2x H200 at
                // 256 MiB-1 GiB (ring all-reduce, A/B twice in one run).
                if is_capturing(stream)? {
                    // SAFETY: `p` holds `bytes` bytes on the predecessor's
                    // device, `dst` on ours; peer access between them is
                    // enabled and held by the group, as are both contexts.
                    return check("cuMemcpyAsync", unsafe { api()?.cuMemcpyAsync(dst, p, bytes, raw) });
                }
                let pred = (r + self.size() - 1) % self.size();
                let (dctx, sctx) = (raw_ctx(&self.ranks[r].ctx), raw_ctx(&self.ranks[pred].ctx));
                // SAFETY: as above.
                check("cuMemcpyPeerAsync", unsafe { api()?.cuMemcpyPeerAsync(dst, dctx, p, sctx, bytes, raw) })
            }
            (Path::Staged, what) => {
                let (Some(staging), Some(scratch)) = (&pull.staging, &pull.scratch) else {
                    return Err(Error::InvalidArgument("staged pull without staging buffers".into()));
                };
                match what {
                    PullOp::Copy { dst, pred: p, bytes } => staging.copy(dst, p, bytes, stream, Start::Ordered),
                    PullOp::Reduce { dst, pred: p, own, count } => {
                        let esz = dtype.size() as u64;
                        let sp = scratch_ptr(scratch, stream);
                        let h2d = stream.cu_stream() as sys::CUstream;
                        staging.transfer(p, count * dtype.size(), stream, Start::Ordered, |host, off, len| {
                            // SAFETY: the scratch holds one chunk (>= len bytes)
                            // and is consumed by the kernel below, in stream order.
                            check("cuMemcpyHtoDAsync", unsafe { api()?.cuMemcpyHtoDAsync_v2(sp, host.cast(), len, h2d) })?;
                            let o = off as u64;
                            self.launch_reduce2(r, op, dtype, dst + o, sp, own + o, len / esz as usize)
                        })
                    }
                }
            }
        }
    }

    /// Runs a schedule: `steps[k][r]` is rank r's work at step k. Ranks
    /// advance in lockstep with their two ring neighbours (events only; no
    /// host synchronisation). Before the first step, each rank's stream has
    /// already been ordered after its buffers' writers by the caller; after
    /// the last, each rank waits for its successor, which may still read
    /// from it.
    #[allow(clippy::needless_range_loop)] // r indexes ranks, pulls and the step alike
    pub(crate) fn run(&self, op: &str, dtype: DType, steps: &[Vec<Option<PullOp>>]) -> Result<()> {
        let n = self.size();
        let rec = |r: usize| self.ranks[r].done.record(&self.ranks[r].stream).map_err(cudarc_err("cuEventRecord"));
        let wait = |r: usize, on: usize| {
            if r == on {
                return Ok(());
            }
            self.ranks[r].stream.wait(&self.ranks[on].done).map_err(cudarc_err("cuStreamWaitEvent"))
        };
        for r in 0..n {
            rec(r)?;
        }
        for step in steps {
            for r in 0..n {
                let (pred, succ) = ((r + n - 1) % n, (r + 1) % n);
                wait(r, pred)?;
                if succ != pred {
                    wait(r, succ)?;
                }
                // A staged pull's device-to-host side runs on the predecessor's
                // device and needs only the predecessor's previous step.
                if let (Some(_), Some(staging)) = (step[r], &self.pulls[r].staging) {
                    staging.d2h.wait(&self.ranks[pred].done).map_err(cudarc_err("cuStreamWaitEvent"))?;
                }
            }
            for r in 0..n {
                if let Some(what) = step[r] {
                    self.pull(r, op, dtype, what)?;
                }
                rec(r)?;
            }
        }
        if !steps.is_empty() {
            for r in 0..n {
                wait(r, (r + 1) % n)?;
            }
        }
        Ok(())
    }
}

fn scratch_ptr(scratch: &CudaSlice<u8>, stream: &CudaStream) -> u64 {
    use cudarc::driver::DevicePtr;
    let (p, _record) = scratch.device_ptr(stream);
    p
}
