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

pub(crate) mod plan;
pub(crate) mod route;
pub(crate) mod staged;
pub(crate) mod verify;

use crate::driver::api;
use crate::error::{cudarc_err, Error, Result};
use crate::graph::{capture_of, retain, KeepAlive};
use crate::peer::PeerAccess;
use crate::sync::{tracking, with_read, with_write, Orderer, Tracking};
use crate::topology::link_info;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut};
use route::{copy_direct, Direct};
use staged::{Staging, Start};
use std::sync::Arc;
use std::time::Duration;
use verify::Verdict;

/// How a link carries data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// Direct peer copies (NVLink or PCIe P2P).
    P2p,
    /// Through pinned host memory.
    Staged,
    /// Both ends on the same device.
    Local,
}

impl std::fmt::Display for Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Path::P2p => "p2p",
            Path::Staged => "staged",
            Path::Local => "local",
        })
    }
}

/// Which path a link may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PathPolicy {
    /// P2P where the driver supports it and verification passes, else
    /// staged; a pair that `cuda-peer doctor`'s cached verdict for this
    /// machine stages is staged without trying P2P ([`crate::verdict`]).
    #[default]
    Auto,
    /// P2P or an error ([`Error::P2pUnavailable`], [`Error::PeerUnsupported`], ...).
    P2pOnly,
    /// Always staged through host memory, even where P2P works.
    StagedOnly,
}

impl std::str::FromStr for PathPolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(PathPolicy::Auto),
            "p2p" => Ok(PathPolicy::P2pOnly),
            "staged" => Ok(PathPolicy::StagedOnly),
            other => Err(Error::InvalidArgument(format!("path policy {other:?}: expected auto, p2p or staged"))),
        }
    }
}

/// The most pinned staging buffers a link may have
/// ([`LinkOptions::staging_buffers`]).
pub const MAX_STAGING_BUFFERS: usize = 64;

/// The largest staging chunk, in bytes ([`LinkOptions::staging_chunk_bytes`]).
pub const MAX_STAGING_CHUNK_BYTES: usize = 1 << 30;

/// The most pinned host memory, in bytes, one link's staging buffers may
/// hold together ([`LinkOptions::staging_buffers`] times
/// [`LinkOptions::staging_chunk_bytes`]).
pub const MAX_STAGING_BYTES: u64 = 16 << 30;

/// Settings for opening a link: `LinkOptions::default()` or
/// [`LinkOptions::with_policy`], then the builder-style setters (one per
/// field), e.g. `LinkOptions::default().verify(false)`.
///
/// The setters take any value; a link (or a group's routes) opened with
/// staging sizes above their limits fails with [`Error::InvalidArgument`]
/// before anything is enabled or allocated ([`LinkOptions::validate`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LinkOptions {
    /// Path policy.
    pub policy: PathPolicy,
    /// Verify a P2P link with a random pattern before trusting it (default on).
    pub verify: bool,
    /// How long verification may take before the link counts as failed.
    pub verify_timeout: Duration,
    /// Bytes per staging chunk (and per pinned buffer). Default 4 MiB.
    /// Smaller than 4096 counts as 4096; more than
    /// [`MAX_STAGING_CHUNK_BYTES`] is an error when the link opens.
    pub staging_chunk_bytes: usize,
    /// Pinned staging buffers per link. Default 3. Fewer than 2 counts as 2;
    /// more than [`MAX_STAGING_BUFFERS`], or buffers that together would
    /// hold more than [`MAX_STAGING_BYTES`], is an error when the link opens.
    pub staging_buffers: usize,
    /// Under [`PathPolicy::Auto`], follow the verdicts `cuda-peer doctor`
    /// cached for this machine (default on): a pair it found unusable by
    /// P2P, or slower by P2P than staged, is staged without trying P2P.
    /// Off here or with `CUDA_PEER_NO_DOCTOR_CACHE=1`. See [`crate::verdict`].
    pub use_doctor_verdicts: bool,
}

impl Default for LinkOptions {
    fn default() -> Self {
        LinkOptions {
            policy: PathPolicy::Auto,
            verify: true,
            verify_timeout: Duration::from_secs(10),
            staging_chunk_bytes: 4 << 20,
            staging_buffers: 3,
            use_doctor_verdicts: true,
        }
    }
}

impl LinkOptions {
    /// Default options with `policy`.
    pub fn with_policy(policy: PathPolicy) -> Self {
        LinkOptions { policy, ..Default::default() }
    }

    /// Sets [`Self::policy`].
    pub fn policy(mut self, policy: PathPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets [`Self::verify`].
    pub fn verify(mut self, verify: bool) -> Self {
        self.verify = verify;
        self
    }

    /// Sets [`Self::verify_timeout`].
    pub fn verify_timeout(mut self, verify_timeout: Duration) -> Self {
        self.verify_timeout = verify_timeout;
        self
    }

    /// Sets [`Self::staging_chunk_bytes`].
    pub fn staging_chunk_bytes(mut self, staging_chunk_bytes: usize) -> Self {
        self.staging_chunk_bytes = staging_chunk_bytes;
        self
    }

    /// Sets [`Self::staging_buffers`].
    pub fn staging_buffers(mut self, staging_buffers: usize) -> Self {
        self.staging_buffers = staging_buffers;
        self
    }

    /// Sets [`Self::use_doctor_verdicts`].
    pub fn use_doctor_verdicts(mut self, use_doctor_verdicts: bool) -> Self {
        self.use_doctor_verdicts = use_doctor_verdicts;
        self
    }

    /// Checks the options as opening a link does, without a GPU:
    /// [`Error::InvalidArgument`], saying which field and its limit, where
    /// [`Self::staging_buffers`] is above [`MAX_STAGING_BUFFERS`],
    /// [`Self::staging_chunk_bytes`] above [`MAX_STAGING_CHUNK_BYTES`], or
    /// the two together above [`MAX_STAGING_BYTES`].
    pub fn validate(&self) -> Result<()> {
        staged::staging_shape(self.staging_chunk_bytes, self.staging_buffers).map(|_| ())
    }
}

/// Why a link took its path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkStatus {
    /// The path in use.
    pub path: Path,
    /// `cuDeviceCanAccessPeer` both ways.
    pub driver_claims_p2p: bool,
    /// The verification result, if one ran.
    pub verified: Option<bool>,
    /// A human-readable reason for the path. Where the doctor's cache
    /// decided it, or confirmed P2P, it says `doctor verdict (cache <path>): ...`
    /// ([`crate::verdict`]).
    pub reason: String,
}

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

/// Enables peer access both ways between `a` and `b`.
pub(crate) fn enable_both(a: &Arc<CudaContext>, b: &Arc<CudaContext>) -> Result<Vec<PeerAccess>> {
    Ok(vec![PeerAccess::enable(a, b)?, PeerAccess::enable(b, a)?])
}

/// Decides whether `a` <-> `b` may use P2P under `opts`, enabling and
/// verifying it. Returns the guards (empty when staged) and the status.
pub(crate) fn decide(a: &Arc<CudaContext>, b: &Arc<CudaContext>, opts: &LinkOptions) -> Result<(Vec<PeerAccess>, LinkStatus)> {
    // Every link and group route opens through here: sizes it could not
    // allocate are refused before peer access is enabled.
    opts.validate()?;
    let (from, to) = (a.ordinal(), b.ordinal());
    let same_device = from == to;
    let claims = same_device || (link_info(from, to)?.can_access_peer && link_info(to, from)?.can_access_peer);
    let staged = |reason: String, verified| Ok((Vec::new(), LinkStatus { path: Path::Staged, driver_claims_p2p: claims, verified, reason }));
    let fail = |reason: String| Err(Error::P2pUnavailable { from, to, reason });
    match route::first_step(opts.policy, same_device, claims) {
        route::FirstStep::Local => {
            let status = LinkStatus { path: Path::Local, driver_claims_p2p: true, verified: None, reason: "same device".into() };
            return Ok((Vec::new(), status));
        }
        route::FirstStep::Staged(reason) => return staged(reason.into(), None),
        route::FirstStep::Unsupported => return Err(Error::PeerUnsupported { from, to }),
        route::FirstStep::TryP2p => {}
    }
    // The doctor's verdicts (crate::verdict): under Auto, the cached verdict
    // for this pair may stage it without trying P2P; a `p2p` verdict only
    // adds its note to the reason below.
    let doctor = if opts.policy == PathPolicy::Auto { crate::verdict::consult(from, to, opts.use_doctor_verdicts) } else { None };
    if let Some(advice) = doctor.as_ref().filter(|a| a.stage) {
        return staged(advice.reason.clone(), None);
    }
    let note = |reason: &str| crate::verdict::annotate(reason, doctor.as_ref());
    // End of the doctor's verdicts.
    let access = match enable_both(a, b) {
        Ok(g) => g,
        Err(e) if route::falls_back(opts.policy) => {
            log::warn!("link {from} <-> {to}: enabling peer access failed ({e}); using the staged path");
            return staged(format!("enabling peer access failed: {e}"), None);
        }
        Err(e) => return Err(e),
    };
    if !opts.verify {
        let status = LinkStatus { path: Path::P2p, driver_claims_p2p: true, verified: None, reason: note("P2P, not verified") };
        return Ok((access, status));
    }
    let why = match verify::verify_pair(a, b, opts.verify_timeout) {
        Ok(Verdict::Ok) => {
            let status = LinkStatus { path: Path::P2p, driver_claims_p2p: true, verified: Some(true), reason: note("P2P, verified") };
            return Ok((access, status));
        }
        Ok(Verdict::Corrupt { wrong, first }) => {
            format!("verification failed: {wrong} of {} bytes wrong, first at {first}", verify::VERIFY_BYTES)
        }
        Err(e) => format!("verification failed: {e}"),
    };
    drop(access);
    if !route::falls_back(opts.policy) {
        return fail(why);
    }
    log::warn!("link {from} <-> {to}: the driver reports P2P but {why}; using the staged path");
    staged(note(&why), Some(false))
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
