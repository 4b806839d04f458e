//! When a fused all-reduce (mesh, one-shot) cannot complete on every rank.
//!
//! Their kernels wait for each other at device-side barriers. If one rank's
//! kernel is never launched (its launch failed) or never arrives, the others
//! would spin; a kernel that traps instead takes its whole context down. So
//! each group with fused kernels has a control block (`Ctl`) in mapped
//! pinned host memory that every rank's kernels and the host share (the
//! layout is in `kernels/reduce.cu`):
//!
//! - the host sets its abort word when a call could not be launched on every
//!   rank: the kernels already running give up at their next barrier;
//! - a kernel that waits longer than the group's barrier timeout gives up,
//!   records which rank and which call, and sets the abort word so that its
//!   peers give up too.
//!
//! Either way the kernels end cleanly and the contexts stay usable, but the
//! ranks' device-side counters are out of step: the group is marked failed,
//! and every later call on it returns the error (make a new group). The
//! host learns of a timeout at the next call or [`crate::Group::synchronize`],
//! which read the control block (host memory: no driver call).

use crate::copy::staged::PinnedBuffer;
use crate::error::{Error, Result};
use cudarc::driver::CudaContext;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

/// How long a kernel waits at a device-side barrier for its peers, unless
/// told otherwise ([`crate::GroupOptions::barrier_timeout`],
/// [`crate::CommOptions::barrier_timeout`]).
pub const DEFAULT_BARRIER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Word indices in the control block (as in `kernels/reduce.cu`).
const CTL_ABORT: usize = 0;
fn ctl_code(r: usize) -> usize {
    1 + 2 * r
}
fn ctl_epoch(r: usize) -> usize {
    2 + 2 * r
}
const CTL_TIMEOUT: u32 = 1;
const CTL_ABORTED: u32 = 2;
/// A point-to-point meeting whose two sides disagree on what moves (the
/// epoch word holds the peer).
const CTL_MISMATCH: u32 = 3;

/// What a test asks the next fused launch on a rank to do instead
/// (see [`crate::Group::inject_fault`]).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The launch fails with an error, as a failed `cuLaunchKernel` would.
    LaunchFails,
    /// The kernel is never launched and no error is reported: a rank that
    /// never arrives, so its peers time out.
    NeverArrives,
}

/// A group's control block and failed state.
pub(crate) struct Ctl {
    host: PinnedBuffer,
    /// The block's address for each rank's kernels.
    pub(crate) addrs: Vec<u64>,
    /// How long a kernel waits at a barrier before it gives up.
    pub(crate) timeout_ns: u64,
    timeout: Duration,
    failed: Mutex<Option<Error>>,
    /// Per rank: 0, or 1 + the `Fault` the next launch takes.
    faults: Vec<AtomicU8>,
}

impl Ctl {
    /// A zeroed control block for `nranks` ranks whose kernels run on
    /// `ctxs` (`addrs[i]` is its address in `ctxs[i]`), with barrier
    /// timeout `timeout`. A process of a multi-process communicator has one
    /// context and the whole communicator's rank count.
    pub(crate) fn for_contexts(ctxs: &[&CudaContext], nranks: usize, timeout: Duration) -> Result<Ctl> {
        let first = ctxs.first().ok_or_else(|| Error::Internal("a control block for no context".into()))?;
        let words = 1 + 2 * nranks;
        let host = PinnedBuffer::new_mapped(first, words * 4)?;
        let addrs = ctxs.iter().map(|c| host.device_addr(c)).collect::<Result<Vec<_>>>()?;
        let timeout_ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX).clamp(1, i64::MAX as u64);
        Ok(Ctl { host, addrs, timeout_ns, timeout, failed: Mutex::new(None), faults: (0..nranks).map(|_| AtomicU8::new(0)).collect() })
    }

    fn word(&self, i: usize) -> *mut u32 {
        debug_assert!((i + 1) * 4 <= self.host.len());
        // The block is 4-byte aligned (page-locked allocations are page
        // aligned) and `i` is in range (callers index within 1 + 2 * ranks).
        self.host.addr().cast::<u32>().wrapping_add(i)
    }

    fn read(&self, i: usize) -> u32 {
        // SAFETY: an aligned word of the live, mapped block; the kernels
        // write it concurrently, so it is read with a volatile load (no
        // Rust reference into the memory is made).
        unsafe { std::ptr::read_volatile(self.word(i)) }
    }

    /// Asks every kernel of the group still waiting at a barrier to give up.
    pub(crate) fn abort(&self) {
        // SAFETY: as in `read`; a volatile store the kernels poll for.
        unsafe { std::ptr::write_volatile(self.word(CTL_ABORT), 1) };
    }

    /// Marks the group failed with `e` (the first failure stays).
    pub(crate) fn fail(&self, e: Error) {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        failed.get_or_insert(e);
    }

    /// The group's failure, if it has failed: earlier, or by a kernel that
    /// gave up since (found in the control block).
    pub(crate) fn check(&self) -> Result<()> {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = failed.as_ref() {
            return Err(e.clone());
        }
        if self.read(CTL_ABORT) == 0 {
            return Ok(());
        }
        let ranks = self.faults.len();
        let codes: Vec<(usize, u32, u32)> = (0..ranks).map(|r| (r, self.read(ctl_code(r)), self.read(ctl_epoch(r)))).collect();
        let e = match (codes.iter().find(|c| c.1 == CTL_MISMATCH), codes.iter().find(|c| c.1 == CTL_TIMEOUT)) {
            (Some(&(rank, _, peer)), _) => Error::GroupFailed {
                reason: format!(
                    "rank {rank} and rank {peer} disagree on a point-to-point exchange (a send and its receive must match in order and length)"
                ),
            },
            (None, Some(&(rank, _, epoch))) => Error::PeerTimeout { rank, call: epoch, after: self.timeout },
            (None, None) => Error::GroupFailed {
                reason: format!("aborted; ranks that gave up: {:?}", codes.iter().filter(|c| c.1 == CTL_ABORTED).map(|c| c.0).collect::<Vec<_>>()),
            },
        };
        *failed = Some(e.clone());
        Err(e)
    }

    /// Arms `fault` for the next fused launch on `rank`.
    pub(crate) fn inject(&self, rank: usize, fault: Fault) {
        if let Some(f) = self.faults.get(rank) {
            f.store(1 + fault as u8, Relaxed);
        }
    }

    /// The fault armed for this launch on `rank`, if any (disarmed).
    pub(crate) fn take_fault(&self, rank: usize) -> Option<Fault> {
        match self.faults.get(rank)?.swap(0, Relaxed) {
            1 => Some(Fault::LaunchFails),
            2 => Some(Fault::NeverArrives),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_kernels() {
        // kernels/reduce.cu: CTL_ABORT 0, CTL_CODE(r) 1 + 2r, CTL_EPOCH(r) 2 + 2r.
        assert_eq!(CTL_ABORT, 0);
        assert_eq!((ctl_code(0), ctl_epoch(0), ctl_code(7), ctl_epoch(7)), (1, 2, 15, 16));
        let src = include_str!("../kernels/reduce.cu");
        for needle in [
            "#define CTL_ABORT 0",
            "#define CTL_CODE(r) (1 + 2 * (r))",
            "#define CTL_EPOCH(r) (2 + 2 * (r))",
            "#define CTL_TIMEOUT 1u",
            "#define CTL_ABORTED 2u",
            "#define CTL_MISMATCH 3u",
        ] {
            assert!(src.contains(needle), "{needle}");
        }
        assert_eq!((CTL_TIMEOUT, CTL_ABORTED, CTL_MISMATCH), (1, 2, 3));
    }
}
