//! [`ThreadExchange`]: the [`Exchange`] of ranks that are threads of one
//! process, through memory they share: no socket, nothing another process
//! can reach. [`crate::comm::Comm::from_devices`] meets its ranks through it.

use super::bootstrap::Exchange;
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What the ranks of one [`ThreadExchange`] share.
#[derive(Debug)]
struct Shared {
    size: usize,
    job: String,
    timeout: Duration,
    /// The all-gathers under way, by call number: every rank's blob so far,
    /// and how many ranks have yet to read the result.
    calls: Mutex<BTreeMap<u64, Call>>,
    changed: Condvar,
}

#[derive(Debug)]
struct Call {
    blobs: Vec<Option<Vec<u8>>>,
    unread: usize,
}

/// One rank of a job whose ranks are threads of this process (see the
/// module docs). Each rank's all-gather waits for every other rank's, at
/// most the exchange's timeout ([`Error::Bootstrap`] after it, naming a
/// rank that never called, or was dropped).
#[derive(Debug)]
pub struct ThreadExchange {
    rank: usize,
    shared: Arc<Shared>,
    /// This rank's next call number.
    next: Mutex<u64>,
}

impl ThreadExchange {
    /// The `size` ranks of a new job (rank r at index r), each waiting at
    /// most `timeout` for the others in each all-gather ([`Error::Bootstrap`]
    /// naming the ranks that did not call, after it). `size` 0 is
    /// [`Error::InvalidArgument`].
    pub fn new(size: usize, timeout: Duration) -> Result<Vec<ThreadExchange>> {
        if size == 0 {
            return Err(Error::InvalidArgument("a thread exchange of 0 ranks".into()));
        }
        let job: String = super::secret::random_bytes::<8>()?.iter().map(|b| format!("{b:02x}")).collect();
        let shared = Arc::new(Shared { size, job: format!("threads-{job}"), timeout, calls: Mutex::new(BTreeMap::new()), changed: Condvar::new() });
        Ok((0..size).map(|rank| ThreadExchange { rank, shared: shared.clone(), next: Mutex::new(0) }).collect())
    }
}

impl Exchange for ThreadExchange {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn job_id(&self) -> &str {
        &self.shared.job
    }

    fn all_gather(&self, blob: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
        let (n, me, call) = (self.shared.size, self.rank, *next);
        let deadline = Instant::now() + self.shared.timeout;
        let mut calls = self.shared.calls.lock().unwrap_or_else(|p| p.into_inner());
        let entry = calls.entry(call).or_insert_with(|| Call { blobs: vec![None; n], unread: n });
        entry.blobs[me] = Some(blob.to_vec());
        *next += 1;
        self.shared.changed.notify_all();
        loop {
            let c = calls.get_mut(&call).ok_or_else(|| Error::Internal(format!("thread exchange: call {call} vanished")))?;
            if c.blobs.iter().all(Option::is_some) {
                let all: Vec<Vec<u8>> = c.blobs.iter().map(|b| b.clone().unwrap_or_default()).collect();
                c.unread = c.unread.saturating_sub(1);
                if c.unread == 0 {
                    calls.remove(&call);
                }
                return Ok(all);
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<String> = (0..n).filter(|&k| c.blobs[k].is_none()).map(|k| k.to_string()).collect();
                // This rank's blob stays: a late peer still completes the
                // call, and this rank is out of step from now on. It will
                // not read the call: once every other rank has, it is gone.
                c.unread = c.unread.saturating_sub(1);
                if c.unread == 0 {
                    calls.remove(&call);
                }
                return Err(Error::Bootstrap {
                    op: "thread exchange: all-gather",
                    reason: format!("rank {me} waited {:?} for rank(s) {}", self.shared.timeout, missing.join(", ")),
                });
            }
            calls = self.shared.changed.wait_timeout(calls, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_gather_every_blob_in_rank_order_many_times() {
        let ranks = ThreadExchange::new(4, Duration::from_secs(20)).unwrap();
        let out: Vec<Vec<Vec<Vec<u8>>>> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .iter()
                .map(|ex| s.spawn(move || (0..50u8).map(|i| super::super::bootstrap::gather(ex, &[ex.rank() as u8, i]).unwrap()).collect()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for per_rank in &out {
            for (i, all) in per_rank.iter().enumerate() {
                assert_eq!(*all, (0..4u8).map(|r| vec![r, i as u8]).collect::<Vec<_>>());
            }
        }
        assert!(ranks[0].shared.calls.lock().unwrap().is_empty(), "finished calls are forgotten");
        assert_eq!(ranks[0].job_id(), ranks[3].job_id());
    }

    #[test]
    fn a_rank_that_never_calls_is_a_timeout_naming_it() {
        let ranks = ThreadExchange::new(3, Duration::from_millis(200)).unwrap();
        let t = Instant::now();
        let r = std::thread::scope(|s| {
            let a = s.spawn(|| ranks[0].all_gather(b"a"));
            let b = s.spawn(|| ranks[2].all_gather(b"c"));
            (a.join().unwrap(), b.join().unwrap())
        });
        assert!(t.elapsed() < Duration::from_secs(5));
        for got in [r.0, r.1] {
            match got {
                Err(Error::Bootstrap { reason, .. }) => assert!(reason.ends_with("for rank(s) 1"), "{reason}"),
                other => panic!("{other:?}"),
            }
        }
        // The late rank still completes the call (with both blobs), and the
        // call is then forgotten.
        assert_eq!(ranks[1].all_gather(b"b").unwrap(), vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
        assert!(ranks[0].shared.calls.lock().unwrap().is_empty(), "a timed-out call is forgotten once read");
    }

    #[test]
    fn no_ranks_is_an_invalid_argument() {
        assert!(matches!(ThreadExchange::new(0, Duration::from_secs(1)), Err(Error::InvalidArgument(_))));
    }
}
