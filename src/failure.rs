//! When a fused all-reduce (mesh, one-shot) or a point-to-point meeting
//! cannot complete on every rank.
//!
//! Their kernels wait for each other at device-side barriers. If one rank's
//! kernel is never launched (its launch failed) or never arrives, the others
//! would spin; a kernel that traps instead takes its whole context down. So
//! each communicator with such kernels has a control block (`Ctl`) in
//! pinned host memory mapped for every rank's device (between processes,
//! memory the processes share), which the kernels and the host read (the
//! layout is in `kernels/reduce.cu`):
//!
//! - the host sets its abort word when a call could not be launched on every
//!   rank: the kernels already running give up at their next barrier;
//! - a kernel that waits longer than the barrier timeout gives up, records
//!   which rank and which call, and sets the abort word, so that its peers
//!   (in this process or another) give up at their next check, within a
//!   few microseconds of spinning, instead of waiting out their own timeout;
//! - a kernel that starts with the abort word set (a CUDA graph replayed
//!   after a failure) writes nothing into the callers' buffers;
//! - a mesh rank never touches the buffers of a rank that gave up: the
//!   ranks agree to go on before any rank reads or writes a peer's buffer
//!   (`mesh_start` in the kernels).
//!
//! Either way the kernels end cleanly and the contexts stay usable, but the
//! ranks' device-side counters are out of step: the communicator is marked
//! failed, and every later call on it returns the error (make a new one).
//! The host learns of a failure at the next call or synchronisation
//! ([`crate::Group::synchronize`], [`crate::comm::Comm::synchronize`]), which read
//! the control block (host memory: no driver call). A replayed graph's
//! launch reports success whatever its kernels found: the failure shows at
//! that synchronisation, or at the next eager call.

use crate::copy::staged::PinnedBuffer;
use crate::error::{Error, Result};
use cudarc::driver::CudaContext;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a kernel waits at a device-side barrier for its peers, unless
/// told otherwise ([`crate::GroupOptions::barrier_timeout`],
/// [`crate::CommOptions::barrier_timeout`]).
pub const DEFAULT_BARRIER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Word indices in the control block (as in `kernels/reduce.cu`): the abort
/// word, then from word 2 one 8-byte record per rank (its first failure's
/// code in the low half, the call in the high half, written in one store
/// before the abort word).
const CTL_ABORT: usize = 0;
fn ctl_record(r: usize) -> usize {
    2 + 2 * r
}
/// The control block's bytes for `nranks` ranks.
pub(crate) fn ctl_bytes(nranks: usize) -> usize {
    4 * ctl_record(nranks)
}
const CTL_TIMEOUT: u32 = 1;
const CTL_ABORTED: u32 = 2;
/// A point-to-point meeting whose two sides disagree on what moves (the
/// record's high half holds the peer).
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

/// Where a control block lives.
enum Block {
    /// This process's own pinned memory, mapped for every rank's context.
    Own(PinnedBuffer),
    /// Memory the processes share (`crate::ipc`'s call board), mapped for
    /// this process's context; `_keep` holds the mapping alive.
    Shared { host: *mut u32, _keep: Arc<dyn Send + Sync> },
}

/// A communicator's control block and failed state.
pub(crate) struct Ctl {
    block: Block,
    /// The block's words.
    words: usize,
    /// The block's address for each rank's kernels.
    pub(crate) addrs: Vec<u64>,
    /// How long a kernel waits at a barrier before it gives up.
    pub(crate) timeout_ns: u64,
    timeout: Duration,
    failed: Mutex<Option<Error>>,
    /// Per rank: 0, or 1 + the `Fault` the next launch takes.
    faults: Vec<AtomicU8>,
}

// SAFETY: the shared block's pointer is only read and written with volatile
// accesses of whole words (the kernels of every rank write it too), and
// `_keep` keeps its mapping alive as long as the `Ctl`.
unsafe impl Send for Ctl {}
// SAFETY: as for `Send`: no `&` access reaches the block's memory.
unsafe impl Sync for Ctl {}

fn timeout_ns(timeout: Duration) -> u64 {
    u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX).clamp(1, i64::MAX as u64)
}

impl Ctl {
    /// A zeroed control block for `nranks` ranks whose kernels run on
    /// `ctxs` (`addrs[i]` is its address in `ctxs[i]`), with barrier
    /// timeout `timeout`.
    pub(crate) fn for_contexts(ctxs: &[&CudaContext], nranks: usize, timeout: Duration) -> Result<Ctl> {
        let first = ctxs.first().ok_or_else(|| Error::Internal("a control block for no context".into()))?;
        let host = PinnedBuffer::new_mapped(first, ctl_bytes(nranks))?;
        let addrs = ctxs.iter().map(|c| host.device_addr(c)).collect::<Result<Vec<_>>>()?;
        Ok(Ctl::with(Block::Own(host), nranks, addrs, timeout))
    }

    /// The control block of a communicator whose ranks are processes: in
    /// memory they all map (zeroed by its creator), at `host` here and
    /// `device` for this process's kernels.
    ///
    /// # Safety
    ///
    /// `host` points to [`ctl_bytes`]`(nranks)` bytes, 8-byte aligned,
    /// mapped as long as `keep` lives, read and written by others only
    /// through whole-word accesses (the kernels, the other processes'
    /// `Ctl`s); `device` is the same memory's address for this process's
    /// kernels.
    pub(crate) unsafe fn shared(host: *mut u8, device: u64, nranks: usize, timeout: Duration, keep: Arc<dyn Send + Sync>) -> Result<Ctl> {
        if host.is_null() || !(host as usize).is_multiple_of(8) || !device.is_multiple_of(8) {
            return Err(Error::Internal("a shared control block that is not 8-byte aligned".into()));
        }
        Ok(Ctl::with(Block::Shared { host: host.cast(), _keep: keep }, nranks, vec![device], timeout))
    }

    fn with(block: Block, nranks: usize, addrs: Vec<u64>, timeout: Duration) -> Ctl {
        Ctl {
            block,
            words: ctl_record(nranks),
            addrs,
            timeout_ns: timeout_ns(timeout),
            timeout,
            failed: Mutex::new(None),
            faults: (0..nranks).map(|_| AtomicU8::new(0)).collect(),
        }
    }

    fn word(&self, i: usize) -> *mut u32 {
        debug_assert!(i < self.words, "control block word {i} of {}", self.words);
        let base = match &self.block {
            Block::Own(host) => host.addr().cast::<u32>(),
            Block::Shared { host, .. } => *host,
        };
        // In range (callers index below 2 + 2 * ranks) of a block of `words` words, 4-byte
        // aligned (page-locked allocations are page aligned; a shared block
        // is checked in `shared`).
        base.wrapping_add(i)
    }

    fn read(&self, i: usize) -> u32 {
        // SAFETY: an aligned word of the live, mapped block; the kernels
        // write it concurrently, so it is read with a volatile load (no
        // Rust reference into the memory is made).
        unsafe { std::ptr::read_volatile(self.word(i)) }
    }

    /// Rank r's failure record: (code, call).
    fn record(&self, r: usize) -> (u32, u32) {
        debug_assert!(ctl_record(r) + 1 < self.words);
        // SAFETY: as in `read`: the record's two words, 8-byte aligned (an
        // even word of an 8-byte-aligned block), written by a kernel in one
        // 8-byte store; read in one volatile 8-byte load, so both halves
        // come from the same store.
        let v = unsafe { std::ptr::read_volatile(self.word(ctl_record(r)).cast::<u64>()) };
        (v as u32, (v >> 32) as u32)
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

    /// The communicator's failure, if it has failed: earlier, or by a
    /// kernel that gave up since (found in the control block).
    pub(crate) fn check(&self) -> Result<()> {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = failed.as_ref() {
            return Err(e.clone());
        }
        if self.read(CTL_ABORT) == 0 {
            return Ok(());
        }
        // The records are read after the abort word: a kernel wrote its
        // record before it set the word (release), so it is seen here.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        let ranks = self.faults.len();
        let records: Vec<(usize, u32, u32)> = (0..ranks).map(|r| (r, self.record(r).0, self.record(r).1)).collect();
        let mismatch = records.iter().find(|c| c.1 == CTL_MISMATCH);
        let timeout = records.iter().find(|c| c.1 == CTL_TIMEOUT);
        let e = match (mismatch, timeout) {
            (Some(&(rank, _, peer)), _) => Error::GroupFailed {
                reason: format!(
                    "rank {rank} and rank {peer} disagree on a point-to-point exchange (a send and its receive must match in order and length)"
                ),
            },
            (None, Some(&(rank, _, call))) => Error::PeerTimeout { rank, call, after: self.timeout },
            (None, None) => Error::GroupFailed {
                reason: format!(
                    "aborted by another rank or process; ranks that gave up: {:?}",
                    records.iter().filter(|c| c.1 == CTL_ABORTED).map(|c| c.0).collect::<Vec<_>>()
                ),
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
        // kernels/reduce.cu: CTL_ABORT 0, CTL_RECORD(r) 2 + 2r (8-byte aligned).
        assert_eq!(CTL_ABORT, 0);
        assert_eq!((ctl_record(0), ctl_record(7), ctl_bytes(8)), (2, 16, 72));
        assert!((0..8).all(|r| ctl_record(r).is_multiple_of(2)));
        let src = include_str!("../kernels/reduce.cu");
        for needle in [
            "#define CTL_ABORT 0",
            "#define CTL_RECORD(r) (2 + 2 * (r))",
            "#define CTL_TIMEOUT 1u",
            "#define CTL_ABORTED 2u",
            "#define CTL_MISMATCH 3u",
        ] {
            assert!(src.contains(needle), "{needle}");
        }
        assert_eq!((CTL_TIMEOUT, CTL_ABORTED, CTL_MISMATCH), (1, 2, 3));
    }
}
