//! Link verification: before `Auto` trusts a P2P link, a random pattern is
//! copied across it both ways and read back. Drivers have been seen to
//! answer "P2P supported" while peer writes were dropped (IOMMU, ACS) or
//! landed in the wrong place, so the driver's answer is only a hint.
//!
//! A verification frees its buffers only once its copies are confirmed
//! complete, on an error part way as on success; where they cannot be (a
//! copy that does not finish in time, a wait that fails) the buffers are
//! leaked rather than freed under a copy that may still run.

use super::staged::PinnedBuffer;
use crate::driver::{api, bind, raw_context, raw_stream};
use crate::error::{check, cudarc_err, Result};
use crate::sync::{wait_bounded, wait_for};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Bytes copied each way: a little over 1 MiB, odd, so that both the copy
/// engines' bulk path and an unaligned tail are exercised.
pub const VERIFY_BYTES: usize = (1 << 20) + 4099;

/// What verifying one direction found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every byte arrived.
    Ok,
    /// Some bytes differ: how many, and the first offset.
    Corrupt {
        /// Bytes that differ.
        wrong: usize,
        /// The first byte that differs.
        first: usize,
    },
}

/// Verdicts by unordered pair of device ordinals.
type VerdictCache = Lazy<Mutex<HashMap<(usize, usize), Result<Verdict>>>>;

static CACHE: VerdictCache = Lazy::new(|| Mutex::new(HashMap::new()));

/// A fresh pseudo-random byte pattern (splitmix64), different on every call.
pub(crate) fn random_bytes(n: usize) -> Vec<u8> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let mut state = nanos ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(n);
    out
}

/// Compares two byte slices: `Verdict::Ok` or how many differ.
pub(crate) fn compare(expected: &[u8], got: &[u8]) -> Verdict {
    let mut wrong = expected.len().abs_diff(got.len());
    let mut first = None;
    for (i, (a, b)) in expected.iter().zip(got).enumerate() {
        if a != b {
            wrong += 1;
            first.get_or_insert(i);
        }
    }
    match (wrong, first) {
        (0, _) => Verdict::Ok,
        (w, f) => Verdict::Corrupt { wrong: w, first: f.unwrap_or(expected.len().min(got.len())) },
    }
}

/// The memory a verification's copies touch, from the moment the peer
/// copy may be enqueued: the two device buffers, the pinned readback buffer
/// and the streams (dropping a stream may wait for its work). The readback
/// and `s_to` are also used; the rest is only held.
struct InFlight {
    _src: CudaSlice<u8>,
    _dst: CudaSlice<u8>,
    readback: PinnedBuffer,
    _s_from: Arc<CudaStream>,
    s_to: Arc<CudaStream>,
}

/// What becomes of a verification's memory, from how enqueueing its copies
/// went and how waiting for them (at most the timeout) went.
#[derive(Debug, PartialEq)]
enum Settled {
    /// The copies are complete: the memory may be freed; the outcome of
    /// the enqueueing is the result.
    Complete(Result<()>),
    /// The copies may still run: the memory is never freed, and this is
    /// the error (the enqueueing's if it failed, else the wait's).
    Leak(crate::error::Error),
}

/// Wait or leak, as a pure decision: memory is freed only where the wait
/// confirmed every enqueued copy complete.
fn settle(enqueued: Result<()>, waited: Result<()>) -> Settled {
    match waited {
        Ok(()) => Settled::Complete(enqueued),
        Err(wait) => Settled::Leak(enqueued.err().unwrap_or(wait)),
    }
}

impl InFlight {
    /// The one exit of a verification once its copies may be enqueued:
    /// waits at most `timeout` until everything enqueued on `s_to` (the
    /// peer copy, the readback, and through `ready` the source's upload)
    /// is complete, through `done` (recorded after it) or, where recording
    /// `done` failed, an event recorded now. Complete: gives the memory
    /// back (with the enqueueing's first error, `done`'s record included).
    /// Otherwise (a timeout, a failed wait, no event to wait on) the copies
    /// may still touch the memory: it is leaked, never freed.
    fn wait_or_leak(self, enqueued: Result<()>, done: Result<CudaEvent>, timeout: Duration) -> Result<InFlight> {
        let (enqueued, event) = match done {
            Ok(event) => (enqueued, Ok(event)),
            Err(e) => (enqueued.and(Err(e)), self.s_to.record_event(None).map_err(cudarc_err("cuEventRecord"))),
        };
        let waited = event.as_ref().map_err(Clone::clone).and_then(|e| wait_bounded(e, "link verification", timeout));
        match settle(enqueued, waited) {
            Settled::Complete(Ok(())) => Ok(self),
            Settled::Complete(Err(e)) => Err(e),
            Settled::Leak(e) => {
                log::warn!("link verification: its copies could not be confirmed complete ({e}); leaking their {} bytes", 3 * VERIFY_BYTES);
                std::mem::forget((self, event));
                Err(e)
            }
        }
    }
}

/// Copies a random pattern from `from` to `to` with `cuMemcpyPeerAsync` and
/// reads it back, waiting at most `timeout`. Once the peer copy may be
/// enqueued, every return goes through [`InFlight::wait_or_leak`]: an
/// error part way still waits for what was enqueued before the memory is
/// freed, and memory whose copies cannot be confirmed complete is leaked.
pub fn verify_direction(from: &Arc<CudaContext>, to: &Arc<CudaContext>, timeout: Duration) -> Result<Verdict> {
    let n = VERIFY_BYTES;
    let pattern = random_bytes(n);
    let poison: Vec<u8> = pattern.iter().map(|b| !b).collect();
    let s_from = from.new_stream().map_err(cudarc_err("cuStreamCreate"))?;
    let s_to = to.new_stream().map_err(cudarc_err("cuStreamCreate"))?;
    // Until the peer copy each buffer is used on its own stream only, where
    // cudarc orders its free: an early return frees nothing in use.
    let src = s_from.clone_htod(&pattern).map_err(cudarc_err("cuMemcpyHtoD"))?;
    let dst = s_to.clone_htod(&poison).map_err(cudarc_err("cuMemcpyHtoD"))?;
    let ready = from.new_event(None).map_err(cudarc_err("cuEventCreate"))?;
    wait_for(&s_to, &s_from, &ready)?;
    let readback = PinnedBuffer::new(to, n)?;
    let api = api()?;
    let enqueued = {
        let (sp, _r1) = src.device_ptr(&s_from);
        let (dp, _r2) = dst.device_ptr(&s_to);
        let raw = raw_stream(&s_to);
        bind(to).and_then(|()| {
            // SAFETY: both allocations hold `n` bytes and the pinned buffer
            // `n`; all three are freed only once these copies are confirmed
            // complete, or never (`InFlight::wait_or_leak`).
            unsafe {
                check("cuMemcpyPeerAsync", api.cuMemcpyPeerAsync(dp, raw_context(to), sp, raw_context(from), n, raw))?;
                check("cuMemcpyDtoHAsync", api.cuMemcpyDtoHAsync_v2(readback.addr().cast(), dp, n, raw))
            }
        })
    };
    let done = s_to.record_event(None).map_err(cudarc_err("cuEventRecord"));
    let flight = InFlight { _src: src, _dst: dst, readback, _s_from: s_from, s_to }.wait_or_leak(enqueued, done, timeout)?;
    // SAFETY: the copy into the pinned buffer completed (`wait_or_leak`
    // returned the memory); it holds `n` initialised bytes and nothing else
    // writes it now.
    let got = unsafe { std::slice::from_raw_parts(flight.readback.addr(), n) };
    Ok(compare(&pattern, got))
}

/// Verifies both directions between `a` and `b` (peer access must already
/// be enabled both ways for the copies to take the P2P path). A verdict for
/// a pair (and a copy that never completed) is cached for the life of the
/// process; any other error (out of memory, a failed driver call) is
/// transient and the next link verifies again.
pub fn verify_pair(a: &Arc<CudaContext>, b: &Arc<CudaContext>, timeout: Duration) -> Result<Verdict> {
    let key = (a.ordinal().min(b.ordinal()), a.ordinal().max(b.ordinal()));
    if let Some(v) = CACHE.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return v.clone();
    }
    let v = verify_direction(a, b, timeout).and_then(|v| match v {
        Verdict::Ok => verify_direction(b, a, timeout),
        bad => Ok(bad),
    });
    if cacheable(&v) {
        CACHE.lock().unwrap_or_else(|p| p.into_inner()).insert(key, v.clone());
    }
    v
}

/// Whether a verification's outcome says something lasting about the pair:
/// a verdict, or a copy that did not complete in time; not an error that
/// another attempt may not meet (memory, a driver call failing).
fn cacheable(v: &Result<Verdict>) -> bool {
    matches!(v, Ok(_) | Err(crate::error::Error::Timeout { .. }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_patterns_differ_and_are_not_zero() {
        let a = random_bytes(4099);
        let b = random_bytes(4099);
        assert_eq!(a.len(), 4099);
        assert_ne!(a, b);
        assert!(a.iter().filter(|&&x| x == 0).count() < 100);
    }

    #[test]
    fn only_verdicts_and_hung_copies_are_cached() {
        assert!(cacheable(&Ok(Verdict::Ok)));
        assert!(cacheable(&Ok(Verdict::Corrupt { wrong: 1, first: 0 })));
        assert!(cacheable(&Err(crate::error::Error::Timeout { op: "link verification", after: Duration::from_secs(1) })));
        let oom = crate::error::Error::driver("cuMemAlloc", 2); // CUDA_ERROR_OUT_OF_MEMORY
        assert!(!cacheable(&Err(oom)), "an out-of-memory error downgraded the pair for good");
    }

    #[test]
    fn memory_is_freed_only_once_the_copies_are_confirmed_complete() {
        let failed = || crate::error::Error::driver("cuMemcpyDtoHAsync", 999);
        let timeout = || crate::error::Error::Timeout { op: "link verification", after: Duration::from_secs(1) };
        assert_eq!(settle(Ok(()), Ok(())), Settled::Complete(Ok(())));
        // A failed enqueue whose earlier copies completed: freed, the enqueue's error.
        assert_eq!(settle(Err(failed()), Ok(())), Settled::Complete(Err(failed())));
        // Not confirmed complete: leaked, with the first error.
        assert_eq!(settle(Ok(()), Err(timeout())), Settled::Leak(timeout()));
        assert_eq!(settle(Err(failed()), Err(timeout())), Settled::Leak(failed()));
        let query = crate::error::Error::driver("link verification", 700); // CUDA_ERROR_ILLEGAL_ADDRESS
        assert_eq!(settle(Ok(()), Err(query.clone())), Settled::Leak(query));
    }

    #[test]
    fn compare_counts_wrong_bytes() {
        let a = random_bytes(1000);
        assert_eq!(compare(&a, &a), Verdict::Ok);
        let mut b = a.clone();
        b[10] ^= 1;
        b[999] ^= 0x80;
        assert_eq!(compare(&a, &b), Verdict::Corrupt { wrong: 2, first: 10 });
        assert_eq!(compare(&a, &a[..990]), Verdict::Corrupt { wrong: 10, first: 990 });
    }
}
