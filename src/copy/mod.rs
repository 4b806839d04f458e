//! Copies between devices: verified P2P links, the staged-host fallback,
//! and the per-link path policy.
//!
//! A [`Link`] is one directed pair of contexts (source -> destination) with
//! the path chosen for it when it was opened:
//! - [`Path::P2p`]: `cuMemcpyPeerAsync` with peer access enabled both ways
//!   (held by RAII guards) and verified with a random pattern;
//! - [`Path::Staged`]: device -> pinned host -> device in chunks through at
//!   least two pinned buffers and two streams, so the device-to-host copy of
//!   chunk k+1 overlaps the host-to-device copy of chunk k. The buffers are
//!   allocated when the link opens, reused, and freed when it drops;
//! - [`Path::Local`]: both ends on one device (a device-to-device copy).
//!
//! Copies are asynchronous and ordered on the caller's stream (a stream of
//! the destination device). The buffers' cudarc read/write events are
//! recorded after the copy, so a buffer dropped while the copy is in flight
//! is freed only after it (the ordering lives in the private `sync` module).

pub(crate) mod decide;
pub(crate) mod plan;
pub(crate) mod route;
pub(crate) mod staged;
pub(crate) mod verify;

use crate::driver::api;
use crate::error::{cudarc_err, Error, Result};
use crate::graph::{capture_of, retain, KeepAlive};
use crate::peer::PeerAccess;
use crate::sync::{tracking, with_read, with_write, Orderer, Tracking};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut};
use route::{copy_direct, Direct};
use staged::{Staging, Start};
use std::sync::Arc;

pub(crate) use decide::decide;
pub use decide::{LinkOptions, LinkStatus, Path, PathPolicy, MAX_STAGING_BUFFERS, MAX_STAGING_BYTES, MAX_STAGING_CHUNK_BYTES};

/// A directed link from one context to another, with its path decided.
pub struct Link {
    src: Arc<CudaContext>,
    dst: Arc<CudaContext>,
    status: LinkStatus,
    _access: Vec<PeerAccess>,
    /// Shared with the CUDA graphs that captured staged copies.
    staging: Option<Arc<Staging>>,
    /// Orders callers' buffers with the link's work (`crate::sync`).
    order: Orderer,
    /// Recorded on the copy's stream after each P2P copy, so that the
    /// peer-access guards outlive it (see `Drop`).
    done: CudaEvent,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Link({} -> {}, {})", self.src.ordinal(), self.dst.ordinal(), self.status.path)
    }
}

/// Checks that `got` (a buffer's or stream's context) is `expected`'s CUDA
/// context: the same device, and the same context on it (a buffer of a
/// non-primary context is not mapped in the primary one).
pub(crate) fn check_context(op: &'static str, what: &'static str, expected: &CudaContext, got: &CudaContext) -> Result<()> {
    if expected.ordinal() != got.ordinal() {
        return Err(Error::WrongDevice { op, what, expected: expected.ordinal(), got: got.ordinal() });
    }
    if expected.cu_ctx() != got.cu_ctx() {
        return Err(Error::WrongContext { op, what, device: expected.ordinal() });
    }
    Ok(())
}

impl Link {
    /// Opens the link `src -> dst` under `opts`: decides the path (enabling
    /// and verifying P2P, or allocating staging buffers) once, here.
    pub fn open(src: &Arc<CudaContext>, dst: &Arc<CudaContext>, opts: &LinkOptions) -> Result<Link> {
        let (access, status) = decide(src, dst, opts)?;
        let staging = match status.path {
            Path::Staged => Some(Arc::new(Staging::new(src, dst, opts.staging_chunk_bytes, opts.staging_buffers)?)),
            _ => None,
        };
        let done = dst.new_event(None).map_err(cudarc_err("cuEventCreate"))?;
        Ok(Link { src: src.clone(), dst: dst.clone(), status, _access: access, staging, order: Orderer::default(), done })
    }

    /// The path in use.
    pub fn path(&self) -> Path {
        self.status.path
    }

    /// Why the link took its path.
    pub fn status(&self) -> &LinkStatus {
        &self.status
    }

    /// Source context.
    pub fn src(&self) -> &Arc<CudaContext> {
        &self.src
    }

    /// Destination context.
    pub fn dst(&self) -> &Arc<CudaContext> {
        &self.dst
    }

    /// Enqueues a copy of `src` (on the source device) into `dst` (on the
    /// destination device), ordered on `stream` (a stream of the destination
    /// device): it starts after the buffers' pending writers and the work
    /// already on `stream`, and work enqueued on `stream` afterwards sees the
    /// data. No host synchronisation.
    ///
    /// One exception on a staged link: where `src`'s context tracks events
    /// (cudarc's default), the staged copy reads `src` as soon as its tracked
    /// writers are done, without waiting for the rest of `stream` (only its
    /// writes into `dst` wait for that). So back-to-back staged copies
    /// overlap, the next one leaving the source while the last chunks of the
    /// previous one still arrive. Without event tracking, the whole copy
    /// waits for `stream`, so order `src`'s writers through it.
    ///
    /// A staged copy captured into a CUDA graph uses the link's pinned
    /// buffers, as its other copies do: launch the graph in the order of
    /// the link's copies (on their stream, or on a stream that waits for it
    /// before the launch and that it waits for after). A launch that
    /// overlaps another copy of the link can mix their data.
    pub fn copy<T, S, D>(&mut self, src: &S, dst: &mut D, stream: &Arc<CudaStream>) -> Result<()>
    where
        S: DevicePtr<T>,
        D: DevicePtrMut<T>,
    {
        const OP: &str = "Link::copy";
        if src.len() != dst.len() {
            return Err(Error::LengthMismatch { op: OP, expected: src.len(), got: dst.len() });
        }
        check_context(OP, "source", &self.src, src.stream().context())?;
        check_context(OP, "destination", &self.dst, dst.stream().context())?;
        check_context(OP, "stream", &self.dst, stream.context())?;
        let bytes = src.num_bytes();
        if bytes == 0 {
            return Ok(());
        }
        api()?;
        match self.status.path {
            Path::Local => with_read(src, stream, &self.order, |s| {
                with_write(dst, stream, &self.order, |d| {
                    // SAFETY: both ranges hold `bytes` bytes (lengths checked)
                    // on the destination device and stay alive: their events
                    // are recorded after this.
                    unsafe { copy_direct(Direct::Local, d, &self.dst, s, &self.dst, bytes, stream) }
                })
            }),
            Path::P2p => with_read(src, stream, &self.order, |s| {
                with_write(dst, stream, &self.order, |d| {
                    // SAFETY: as above, `s` on the source device; peer access
                    // is held by the link, and both contexts are alive.
                    unsafe { copy_direct(Direct::Peer, d, &self.dst, s, &self.src, bytes, stream) }?;
                    self.done.record(stream).map_err(cudarc_err("cuEventRecord"))
                })
            }),
            Path::Staged => {
                let Some(staging) = self.staging.as_ref() else {
                    return Err(Error::InvalidArgument("staged link without staging buffers".into()));
                };
                // A graph that captures the copy uses the pinned buffers
                // whenever it is replayed: it keeps them alive.
                if let Some((_, graph)) = capture_of(stream)? {
                    retain(graph, KeepAlive { ctx: self.src.clone(), payload: staging.clone() })?;
                }
                // With event tracking, reading `src` on the staging stream
                // waited for its writers' events; without, the caller orders
                // them through `stream`.
                let start = if tracking(src.stream().context()) == Tracking::Caller { Start::AfterStream } else { Start::Ordered };
                with_read(src, &staging.d2h, &self.order, |s| with_write(dst, stream, &self.order, |d| staging.copy(d, s, bytes, stream, start)))
            }
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // Let the last P2P copy, and the last work ordered with a caller's
        // buffer, finish before the peer-access guards drop.
        if let Err(e) = self.done.synchronize().map_err(cudarc_err("cuEventSynchronize")).and_then(|_| self.order.synchronize()) {
            log::warn!("link drop: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_and_default_to_auto() {
        assert_eq!("auto".parse::<PathPolicy>().unwrap(), PathPolicy::Auto);
        assert_eq!("p2p".parse::<PathPolicy>().unwrap(), PathPolicy::P2pOnly);
        assert_eq!("staged".parse::<PathPolicy>().unwrap(), PathPolicy::StagedOnly);
        assert!(matches!("nvlink".parse::<PathPolicy>(), Err(Error::InvalidArgument(_))));
        for p in [PathPolicy::Auto, PathPolicy::P2pOnly, PathPolicy::StagedOnly] {
            assert_eq!(p.name().parse::<PathPolicy>().unwrap(), p, "{p:?}'s name parses back");
        }
        let o = LinkOptions::default();
        assert_eq!(o.policy, PathPolicy::Auto);
        assert!(o.verify && o.staging_buffers >= 2 && o.staging_chunk_bytes >= 4096);
        assert_eq!(LinkOptions::with_policy(PathPolicy::StagedOnly).policy, PathPolicy::StagedOnly);
        assert_eq!(Path::P2p.to_string(), "p2p");
        assert_eq!(Path::Staged.to_string(), "staged");
    }

    #[test]
    fn huge_staging_sizes_are_typed_errors() {
        assert!(LinkOptions::default().validate().is_ok());
        assert!(LinkOptions::default().staging_buffers(0).staging_chunk_bytes(0).validate().is_ok(), "small values are raised, not refused");
        let huge = [
            LinkOptions::default().staging_buffers(usize::MAX),
            LinkOptions::default().staging_buffers(MAX_STAGING_BUFFERS + 1),
            LinkOptions::default().staging_buffers(usize::MAX / 2),
            LinkOptions::default().staging_chunk_bytes(usize::MAX),
            LinkOptions::default().staging_chunk_bytes(MAX_STAGING_CHUNK_BYTES + 1),
            LinkOptions::default().staging_buffers(usize::MAX).staging_chunk_bytes(usize::MAX),
            LinkOptions::default().staging_buffers(MAX_STAGING_BUFFERS).staging_chunk_bytes(MAX_STAGING_CHUNK_BYTES),
        ];
        for o in huge {
            match o.validate() {
                Err(Error::InvalidArgument(m)) => assert!(m.starts_with("LinkOptions"), "{m}"),
                other => panic!("{} x {}: {other:?}", o.staging_buffers, o.staging_chunk_bytes),
            }
        }
    }
}
