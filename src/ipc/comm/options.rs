//! The settings of a per-rank communicator ([`CommOptions`]) and its
//! all-reduce algorithms ([`AllReduceAlgorithm`]).

use crate::copy::PathPolicy;
use crate::error::{Error, Result};
use crate::failure::Fault;
use std::time::Duration;

/// The default of [`CommOptions::buffer_bytes`].
pub const DEFAULT_BUFFER_BYTES: usize = 8 << 20;

/// Settings of a [`Comm`](super::Comm): `CommOptions::default()`, then the
/// builder-style setters (one per field).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CommOptions {
    /// Bound on each creation step that waits for peers or the device (the
    /// descriptor exchange, the verification).
    pub timeout: Duration,
    /// Check every rank's slots with a small all-reduce at creation (and
    /// the staging buffers with an all-gather), against the CPU: on the
    /// P2P path under [`PathPolicy::Auto`], a check that fails (wrong data,
    /// or a barrier that timed out) makes every rank fall back to the
    /// staged path, checked the same way; otherwise it fails creation.
    pub verify: bool,
    /// Before each collective, publish its descriptor (collective, element
    /// type, op, count, root) in host memory the processes share, wait
    /// until every rank has published its own for the same call (at most
    /// [`Self::barrier_timeout`]) and compare: ranks that disagree get
    /// [`Error::Mismatch`], and one that does not make the call in time an
    /// [`Error::Timeout`] (the communicator then fails), before anything is
    /// enqueued. Costs well under a microsecond when the ranks call
    /// together, but a call's enqueue waits for every rank's (the host of
    /// a rank cannot run more than one call ahead of its peers'). Off, a
    /// mismatch is undefined (wrong results, or a barrier timeout).
    pub check_calls: bool,
    /// Bytes of each rank's staging buffer (in its device memory, mapped by
    /// every peer) for the collectives other than all-reduce: they run in
    /// chunks of half of it (rounded down to 256 bytes). At least 1 KiB
    /// and 512 bytes per rank (rounded up to 512 bytes); on the P2P path each rank's region is
    /// rounded up to the device's allocation granularity (2 MiB on current
    /// GPUs) and what that adds goes to the staging buffer too, so chunks
    /// can be larger than asked ([`Comm::chunk_bytes`](super::Comm::chunk_bytes) says how large); a size whose regions overflow or reach
    /// 2^62 bytes is [`Error::InvalidArgument`] from [`Comm::new`](super::Comm::new).
    pub buffer_bytes: usize,
    /// Let ranks share a device (more processes than GPUs, as in testing);
    /// [`Comm::from_env`](super::Comm::from_env) then takes device `LOCAL_RANK` modulo the
    /// number of devices. Without it two ranks on one device are
    /// [`Error::Unsupported`]. The kernels of ranks on one device do not
    /// run at the same time but take turns (the driver's time slices
    /// between processes), so each barrier can take a time slice: slow,
    /// but every barrier is still bounded by [`Self::barrier_timeout`].
    pub share_devices: bool,
    /// Which path the ranks' data takes: [`PathPolicy::Auto`],
    /// [`PathPolicy::P2pOnly`] or [`PathPolicy::StagedOnly`], decided for
    /// each pair of ranks as a single-process link decides it
    /// (`copy::decide`): ranks on one device share its memory; between
    /// devices, `Auto` takes P2P where the driver reports peer access
    /// both ways and the doctor's cached verdict for the pair does not
    /// stage it ([`Self::use_doctor_verdicts`]), and where the creation's
    /// verification ([`Self::verify`]) then fails on the P2P path, every
    /// rank falls back to the staged path together and verifies that in
    /// turn. `P2pOnly` ignores the doctor's verdicts and makes a pair
    /// without peer access, or a failed check, an error
    /// ([`Error::P2pUnavailable`]). Staged, every rank's slots, flags and
    /// staging buffer live in host memory the processes share (a `memfd`,
    /// page-locked and mapped for each device with `cuMemHostRegister`):
    /// the kernels and copies reach it over PCIe, no P2P needed. One pair
    /// that stages makes every rank stage; [`Comm::path_reason`](super::Comm::path_reason) says
    /// which and why.
    pub path: PathPolicy,
    /// Under [`PathPolicy::Auto`], follow the verdicts `cuda-peer doctor`
    /// cached for this machine (default on): a pair of devices it found
    /// unusable by P2P, or slower by P2P than staged, stages the
    /// communicator without trying P2P. Off here or with
    /// `CUDA_PEER_NO_DOCTOR_CACHE=1`. See [`crate::verdict`].
    pub use_doctor_verdicts: bool,
    /// How long this rank's kernel waits for its peers at the barrier
    /// before it gives up (a peer that died or stopped calling): the kernel
    /// ends cleanly, the context stays usable, and the communicator reports
    /// [`Error::PeerTimeout`] from then on. See [`crate::failure`].
    pub barrier_timeout: Duration,
    /// How the all-reduce runs (see [`AllReduceAlgorithm`]). Every rank
    /// must pass the same: with [`Self::check_calls`], ranks whose calls
    /// would take different algorithms get [`Error::Mismatch`].
    pub all_reduce: AllReduceAlgorithm,
    /// For tests of the fallback only: a fault (`(rank, fault)`) that
    /// rank's first one-shot launch of the creation's verification takes
    /// on the first path tried.
    #[doc(hidden)]
    pub verify_fault: Option<(usize, Fault)>,
}

/// The all-reduce algorithms of a [`Comm`](super::Comm) ([`CommOptions::all_reduce`]).
/// Both give the same bits: every element is the reduction of the ranks'
/// inputs in rank order (an average: of each input divided by the rank
/// count first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum AllReduceAlgorithm {
    /// The library's choice: today the one-shot at every size. The
    /// two-shot sends less with many ranks, but it has not yet been
    /// measured where that counts (more than two GPUs were never lent);
    /// with ranks sharing one H200 it was faster at some sizes and slower
    /// at others (docs/multiprocess.md). `Auto` will pick it by size once a
    /// machine with 4 or 8 GPUs has measured both.
    #[default]
    Auto,
    /// Always the one-shot: every rank stores its input into every peer's
    /// slots and reduces all of them (one barrier per round; each rank
    /// sends its whole message to each peer).
    OneShot,
    /// Always the two-shot: a reduce-scatter into this rank's part of the
    /// output, then an all-gather of the parts, both through the ranks'
    /// staging buffers ([`CommOptions::buffer_bytes`]). Each rank sends
    /// about twice its message in all, however many ranks, at the cost of
    /// two barriers per chunk.
    TwoShot,
}

impl AllReduceAlgorithm {
    /// Its name: `auto`, `one-shot` or `two-shot` (what [`str::parse`] takes).
    pub fn name(self) -> &'static str {
        match self {
            AllReduceAlgorithm::Auto => "auto",
            AllReduceAlgorithm::OneShot => "one-shot",
            AllReduceAlgorithm::TwoShot => "two-shot",
        }
    }
}

impl std::str::FromStr for AllReduceAlgorithm {
    type Err = Error;
    /// [`AllReduceAlgorithm::name`] back to the variant; anything else is
    /// [`Error::InvalidArgument`].
    fn from_str(s: &str) -> Result<Self> {
        [AllReduceAlgorithm::Auto, AllReduceAlgorithm::OneShot, AllReduceAlgorithm::TwoShot]
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| Error::InvalidArgument(format!("all-reduce algorithm {s:?}: expected auto, one-shot or two-shot")))
    }
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            timeout: Duration::from_secs(60),
            verify: true,
            check_calls: true,
            buffer_bytes: DEFAULT_BUFFER_BYTES,
            share_devices: false,
            path: PathPolicy::Auto,
            barrier_timeout: crate::failure::DEFAULT_BARRIER_TIMEOUT,
            all_reduce: AllReduceAlgorithm::Auto,
            use_doctor_verdicts: true,
            verify_fault: None,
        }
    }
}

impl CommOptions {
    /// Sets [`Self::timeout`].
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets [`Self::verify`].
    pub fn verify(mut self, verify: bool) -> Self {
        self.verify = verify;
        self
    }

    /// Sets [`Self::check_calls`].
    pub fn check_calls(mut self, check_calls: bool) -> Self {
        self.check_calls = check_calls;
        self
    }

    /// Sets [`Self::barrier_timeout`].
    pub fn barrier_timeout(mut self, barrier_timeout: Duration) -> Self {
        self.barrier_timeout = barrier_timeout;
        self
    }

    /// Sets [`Self::buffer_bytes`] (checked by [`Comm::new`](super::Comm::new)).
    pub fn buffer_bytes(mut self, buffer_bytes: usize) -> Self {
        self.buffer_bytes = buffer_bytes;
        self
    }

    /// Sets [`Self::share_devices`].
    pub fn share_devices(mut self, share_devices: bool) -> Self {
        self.share_devices = share_devices;
        self
    }

    /// Sets [`Self::path`].
    pub fn path(mut self, path: PathPolicy) -> Self {
        self.path = path;
        self
    }

    /// Sets [`Self::all_reduce`].
    pub fn all_reduce(mut self, all_reduce: AllReduceAlgorithm) -> Self {
        self.all_reduce = all_reduce;
        self
    }

    /// Sets [`Self::use_doctor_verdicts`].
    pub fn use_doctor_verdicts(mut self, use_doctor_verdicts: bool) -> Self {
        self.use_doctor_verdicts = use_doctor_verdicts;
        self
    }

    /// Sets `verify_fault` (tests of the fallback only).
    #[doc(hidden)]
    pub fn verify_fault(mut self, verify_fault: Option<(usize, Fault)>) -> Self {
        self.verify_fault = verify_fault;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_reduce_algorithm_names_round_trip() {
        for a in [AllReduceAlgorithm::Auto, AllReduceAlgorithm::OneShot, AllReduceAlgorithm::TwoShot] {
            assert_eq!(a.name().parse::<AllReduceAlgorithm>().unwrap(), a);
        }
        assert!(matches!("ring".parse::<AllReduceAlgorithm>(), Err(Error::InvalidArgument(_))));
    }
}
