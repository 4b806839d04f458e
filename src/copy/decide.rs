//! A pair's path: the types that name it ([`Path`], [`PathPolicy`], the
//! options and status of a link) and the one decision every pair of ranks
//! and every [`super::Link`] goes through ([`decide`]): policy and the
//! driver's claim first, then peer access, then verification.

use super::staged;
use super::verify::{self, Verdict};
use crate::error::{Error, Result};
use crate::peer::PeerAccess;
use crate::topology::link_info;
use cudarc::driver::CudaContext;
use std::sync::Arc;
use std::time::Duration;

pub use super::staged::{MAX_STAGING_BUFFERS, MAX_STAGING_BYTES, MAX_STAGING_CHUNK_BYTES};

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
    /// Always staged through host memory, even where P2P works and
    /// between ranks on one device (so that a machine with one GPU runs
    /// the staged paths too).
    StagedOnly,
}

impl PathPolicy {
    /// Its name: `auto`, `p2p` or `staged` (what [`str::parse`] takes).
    pub fn name(self) -> &'static str {
        match self {
            PathPolicy::Auto => "auto",
            PathPolicy::P2pOnly => "p2p",
            PathPolicy::StagedOnly => "staged",
        }
    }
}

impl std::str::FromStr for PathPolicy {
    type Err = Error;
    /// [`PathPolicy::name`] back to the variant; anything else is
    /// [`Error::InvalidArgument`].
    fn from_str(s: &str) -> Result<Self> {
        [PathPolicy::Auto, PathPolicy::P2pOnly, PathPolicy::StagedOnly]
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| Error::InvalidArgument(format!("path policy {s:?}: expected auto, p2p or staged")))
    }
}

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

/// The first step of deciding a pair's path, from what is known before
/// any peer access is enabled: the policy, whether both ends are one
/// device, and whether the driver claims P2P both ways. Both engines
/// decide their pairs through it (this module's links and groups, and
/// `ipc::Comm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FirstStep {
    /// One device: a local route.
    Local,
    /// Staged, for this reason.
    Staged(&'static str),
    /// P2P demanded where the driver claims none: an error.
    Unsupported,
    /// Enable peer access (and verify it, where asked).
    TryP2p,
}

/// The pure first step of the path decision (see [`FirstStep`]).
pub(crate) fn first_step(policy: PathPolicy, same_device: bool, claims: bool) -> FirstStep {
    match policy {
        PathPolicy::StagedOnly => FirstStep::Staged("staged by policy"),
        _ if same_device => FirstStep::Local,
        PathPolicy::P2pOnly if !claims => FirstStep::Unsupported,
        PathPolicy::Auto if !claims => FirstStep::Staged("driver reports no peer access"),
        PathPolicy::Auto | PathPolicy::P2pOnly => FirstStep::TryP2p,
    }
}

/// Whether a pair whose peer access could not be enabled or verified falls
/// back to the staged path (`Auto`) instead of failing (`P2pOnly`).
pub(crate) fn falls_back(policy: PathPolicy) -> bool {
    policy == PathPolicy::Auto
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
    match first_step(opts.policy, same_device, claims) {
        FirstStep::Local => {
            let status = LinkStatus { path: Path::Local, driver_claims_p2p: true, verified: None, reason: "same device".into() };
            return Ok((Vec::new(), status));
        }
        FirstStep::Staged(reason) => return staged(reason.into(), None),
        FirstStep::Unsupported => return Err(Error::PeerUnsupported { from, to }),
        FirstStep::TryP2p => {}
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
        Err(e) if falls_back(opts.policy) => {
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
    if !falls_back(opts.policy) {
        return fail(why);
    }
    log::warn!("link {from} <-> {to}: the driver reports P2P but {why}; using the staged path");
    staged(note(&why), Some(false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_step_follows_the_policy_and_the_driver() {
        use FirstStep::*;
        use PathPolicy::*;
        for policy in [Auto, P2pOnly] {
            assert_eq!(first_step(policy, true, false), Local, "{policy:?}");
        }
        assert_eq!(first_step(StagedOnly, true, true), Staged("staged by policy"));
        assert_eq!(first_step(StagedOnly, false, true), Staged("staged by policy"));
        assert_eq!(first_step(Auto, false, false), Staged("driver reports no peer access"));
        assert_eq!(first_step(P2pOnly, false, false), Unsupported);
        assert_eq!(first_step(Auto, false, true), TryP2p);
        assert_eq!(first_step(P2pOnly, false, true), TryP2p);
        assert!(falls_back(Auto) && !falls_back(P2pOnly));
    }
}
