//! Routes between ranks: how data gets from one rank's device to another's
//! once the path is decided ([`super::decide`]), and the one dispatcher of
//! direct (same-device or P2P) copies that [`super::Link`] and the ring
//! both use.

use super::decide::{decide, LinkOptions, LinkStatus, Path};
use super::staged::Staging;
use crate::driver::{api, bind, raw_context, raw_stream};
use crate::error::{check, cudarc_err, Result};
use crate::peer::PeerAccess;
use crate::sync::is_capturing;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use std::sync::Arc;

/// How data moves from a source rank to a destination rank. An enum, so
/// that a staged route always has its staging buffers.
pub(crate) enum Route {
    /// Both ranks on one device: device-to-device copies, plain loads.
    Local,
    /// Verified (or policy-trusted) peer access between the two devices.
    P2p,
    /// Through pinned host memory, chunk by chunk.
    Staged(Box<StagedRoute>),
    // Room for `Ipc` (another process's rank, memory shared by handle).
}

/// A staged route's resources.
pub(crate) struct StagedRoute {
    /// Pinned buffers, the source-side stream and their events.
    pub(crate) staging: Staging,
    /// Device scratch of one staging chunk on the receiving rank (staged reductions).
    pub(crate) scratch: CudaSlice<u8>,
}

/// One opened route and why it took its path.
pub(crate) struct RouteEntry {
    /// The path and the reason for it.
    pub(crate) status: LinkStatus,
    /// The resources of the path.
    pub(crate) route: Route,
}

impl RouteEntry {
    /// Opens the route `src -> dst` for a rank whose stream is `stream`
    /// (deciding its path under `link`), with staging buffers and a device
    /// scratch chunk where it is staged; peer-access guards go to `access`.
    pub(crate) fn open(
        src: &Arc<CudaContext>,
        dst: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        link: &LinkOptions,
        access: &mut Vec<PeerAccess>,
    ) -> Result<RouteEntry> {
        let (guards, status) = decide(src, dst, link)?;
        access.extend(guards);
        let route = match status.path {
            Path::Local => Route::Local,
            Path::P2p => Route::P2p,
            Path::Staged => {
                let staging = Staging::new(src, dst, link.staging_chunk_bytes, link.staging_buffers)?;
                // SAFETY (of reading it later): scratch is always written by a
                // host-to-device copy before a kernel reads it.
                let scratch = unsafe { stream.alloc::<u8>(staging.chunk_bytes) }.map_err(cudarc_err("cuMemAlloc"))?;
                Route::Staged(Box::new(StagedRoute { staging, scratch }))
            }
        };
        Ok(RouteEntry { status, route })
    }

    /// The staging resources, where the route is staged.
    pub(crate) fn staged(&self) -> Option<&StagedRoute> {
        match &self.route {
            Route::Staged(s) => Some(s),
            Route::Local | Route::P2p => None,
        }
    }
}

/// The routes of a group, built once when it is created: `ring[r]` carries
/// rank r-1's data to rank r (the ring's pulls), and `all_pairs` says
/// whether every pair of ranks has verified P2P (asked only where a fused
/// algorithm could use it).
pub(crate) struct RouteTable {
    /// `ring[r]`: rank r pulling from rank r-1.
    pub(crate) ring: Vec<RouteEntry>,
    /// `Some(Ok(()))`: every pair has P2P (enabled and verified);
    /// `Some(Err(why))`: the first pair without; `None`: not asked.
    pub(crate) all_pairs: Option<std::result::Result<(), String>>,
}

impl RouteTable {
    /// Whether every ring route is direct: P2P, or within one device.
    pub(crate) fn ring_all_p2p(&self) -> bool {
        self.ring.iter().all(|e| matches!(e.status.path, Path::P2p | Path::Local))
    }
}

/// Enables and verifies P2P between every pair of `ctxs` under `link`;
/// `Err(why)` for the first pair without it. Guards go to `access`.
pub(crate) fn all_pairs_p2p(ctxs: &[&Arc<CudaContext>], link: &LinkOptions, access: &mut Vec<PeerAccess>) -> std::result::Result<(), String> {
    let n = ctxs.len();
    for i in 0..n {
        for j in i + 1..n {
            match decide(ctxs[i], ctxs[j], link) {
                Ok((guards, st)) if matches!(st.path, Path::P2p | Path::Local) => access.extend(guards),
                Ok((_, st)) => return Err(format!("ranks {i} and {j}: {}", st.reason)),
                Err(e) => return Err(format!("ranks {i} and {j}: {e}")),
            }
        }
    }
    Ok(())
}

/// A direct copy: within one device, or between two with peer access.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direct {
    /// Both ranges on the device of `stream`.
    Local,
    /// `src` on `src_ctx`'s device, `dst` on `dst_ctx`'s, peer access enabled.
    Peer,
}

/// The one dispatcher of direct copies: `bytes` bytes from `src` to `dst`
/// on `stream` (a stream of `dst_ctx`), made current first. A peer copy is
/// `cuMemcpyPeerAsync`, except under graph capture, where that call is
/// refused (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`) and the
/// unified-addressing `cuMemcpyAsync` is used instead (it ran 2% slower
/// eagerly on large messages, so it is not used otherwise).
///
/// # Safety
///
/// `src` holds `bytes` bytes on `src_ctx`'s device and `dst` on
/// `dst_ctx`'s, both alive until the copy is done on the device; for
/// [`Direct::Peer`], peer access between the two is enabled and both
/// contexts stay alive as long.
pub(crate) unsafe fn copy_direct(
    how: Direct,
    dst: u64,
    dst_ctx: &CudaContext,
    src: u64,
    src_ctx: &CudaContext,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let api = api()?;
    bind(dst_ctx)?;
    let raw = raw_stream(stream);
    match how {
        // SAFETY: the caller's contract: both ranges hold `bytes` bytes on this device.
        Direct::Local => check("cuMemcpyDtoDAsync", unsafe { api.cuMemcpyDtoDAsync_v2(dst, src, bytes, raw) }),
        Direct::Peer if is_capturing(stream)? => {
            // SAFETY: the caller's contract; with unified addressing the
            // driver finds each range's device from its address.
            check("cuMemcpyAsync", unsafe { api.cuMemcpyAsync(dst, src, bytes, raw) })
        }
        Direct::Peer => {
            // SAFETY: the caller's contract; both context handles are alive.
            check("cuMemcpyPeerAsync", unsafe { api.cuMemcpyPeerAsync(dst, raw_context(dst_ctx), src, raw_context(src_ctx), bytes, raw) })
        }
    }
}
