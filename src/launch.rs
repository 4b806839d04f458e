//! Launcher threads: kernel launches on several GPUs at once.
//!
//! A fused all-reduce launches one kernel per rank, and for small messages
//! the host's launches are the whole cost of a call; launches from one
//! thread per GPU overlap (measurements in `bench/NOTES.md`). So a group
//! keeps one launcher thread per rank after the first. Rank 0's kernel is
//! launched by the calling thread; the others by their launchers, at the
//! same time, each launcher also taking its rank's buffer in an in-place
//! one-shot (`OneShot::in_place`).
//!
//! A launcher spins for [`GroupOptions::launch_spin`] after each job, then
//! parks. A call that finds a launcher parked does not wait for it to wake:
//! the calling thread launches that rank itself and wakes the launcher for
//! the calls that follow. So a burst of collectives runs its launches in
//! parallel, an isolated call costs what it did without launchers (plus one
//! wake-up), and an idle group holds no CPU.
//!
//! [`GroupOptions::launch_spin`]: crate::GroupOptions::launch_spin

use crate::error::{Error, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One rank's launch, called with the rank's index.
pub(crate) type Job<'a> = dyn Fn(usize) -> Result<()> + Sync + 'a;

/// The most ranks a group's launchers serve (the fused all-reduces' limit).
pub(crate) const MAX_RANKS: usize = 8;

/// A job's address with its lifetime erased, as the launchers see it.
struct JobPtr(*const Job<'static>);

// SAFETY: the pointee is `Sync`, so calling it from another thread is
// allowed; `Launchers::run` keeps it alive until every launcher that was
// given it has finished with it (see there).
unsafe impl Send for JobPtr {}

/// What the calling thread and one launcher share.
struct Shared {
    /// The job of call `posted` (set before `posted` is raised).
    job: Mutex<Option<JobPtr>>,
    /// Number of the last call handed to this launcher.
    posted: AtomicU64,
    /// Number of the last call this launcher finished.
    done: AtomicU64,
    /// The launcher's outcome of call `done`.
    result: Mutex<Result<()>>,
    /// The launcher is parked, or about to park.
    parked: AtomicBool,
    /// The group is being dropped.
    stop: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Launcher {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// The launcher threads of one group (ranks 1 to n-1).
pub(crate) struct Launchers {
    launchers: Vec<Launcher>,
    /// Number of the last call; held for the whole of a call, so calls
    /// from several threads take turns.
    calls: Mutex<u64>,
    /// The process that started the threads: a forked child has none of
    /// them, so it neither posts to them nor joins them.
    pid: u32,
}

impl std::fmt::Debug for Launchers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launchers").field("threads", &self.launchers.len()).finish()
    }
}

impl Launchers {
    /// Starts a launcher for each of ranks 1 to `n - 1`, each spinning for
    /// `spin` after a job. `None` for more than [`MAX_RANKS`] ranks, or if
    /// a thread cannot be started (the group then launches from the calling
    /// thread; a warning is logged).
    pub(crate) fn start(n: usize, spin: Duration) -> Option<Launchers> {
        if n > MAX_RANKS {
            return None;
        }
        let mut launchers = Vec::with_capacity(n.saturating_sub(1));
        for rank in 1..n {
            let shared = Arc::new(Shared {
                job: Mutex::new(None),
                posted: AtomicU64::new(0),
                done: AtomicU64::new(0),
                result: Mutex::new(Ok(())),
                parked: AtomicBool::new(true), // until the thread runs
                stop: AtomicBool::new(false),
            });
            let s = shared.clone();
            match std::thread::Builder::new().name(format!("cuda-peer-launch-{rank}")).spawn(move || serve(&s, rank, spin)) {
                Ok(t) => launchers.push(Launcher { shared, thread: Some(t) }),
                Err(e) => {
                    log::warn!("cuda-peer: cannot start a launcher thread ({e}); launching from the calling thread");
                    // The ones started stop and are joined.
                    drop(Launchers { launchers, calls: Mutex::new(0), pid: std::process::id() });
                    return None;
                }
            }
        }
        Some(Launchers { launchers, calls: Mutex::new(0), pid: std::process::id() })
    }

    /// Runs `job(r)` for every rank `r` in `0..=launchers`: rank 0 on the
    /// calling thread, the others on their launchers where those are awake,
    /// on the calling thread where not. Returns when every rank's job has
    /// returned, with the first error (a panicking job becomes
    /// [`Error::Internal`]).
    pub(crate) fn run(&self, job: &Job<'_>) -> Result<()> {
        if std::process::id() != self.pid {
            // A forked child: the threads stayed in the parent.
            return (0..=self.launchers.len()).rev().try_for_each(job);
        }
        let mut calls = lock(&self.calls);
        *calls += 1;
        let call = *calls;
        // SAFETY: only the lifetime is erased. The pointer is dereferenced by
        // a launcher between its seeing `posted == call` and its storing
        // `done = call`; this function does not return (nor unwind: jobs run
        // under `catch_unwind`) before it has seen `done == call` from every
        // launcher it posted to, so `job` outlives every use.
        let erased: *const Job<'static> = unsafe { std::mem::transmute::<*const Job<'_>, *const Job<'static>>(job as *const Job<'_>) };
        let mut posted = [false; MAX_RANKS];
        for (i, l) in self.launchers.iter().enumerate() {
            let s = &l.shared;
            if s.parked.load(SeqCst) {
                wake(l);
                continue;
            }
            *lock(&s.job) = Some(JobPtr(erased));
            s.posted.store(call, SeqCst);
            // The launcher may have decided to park just before `posted` was
            // raised: it then sees the new `posted` before parking, or we
            // see `parked` here and wake it (both sides use SeqCst).
            if s.parked.load(SeqCst) {
                wake(l);
            }
            posted[i] = true; // i < MAX_RANKS - 1: `start` refuses more ranks
        }
        let mut first = Ok(());
        for r in (0..=self.launchers.len()).rev() {
            if r == 0 || !posted[r - 1] {
                let out = catch_unwind(AssertUnwindSafe(|| job(r))).unwrap_or_else(|p| Err(panicked(r, &*p)));
                if first.is_ok() {
                    first = out;
                }
            }
        }
        for (i, l) in self.launchers.iter().enumerate() {
            if posted[i] {
                wait_done(&l.shared, call);
                let out = std::mem::replace(&mut *lock(&l.shared.result), Ok(()));
                if first.is_ok() {
                    first = out;
                }
            }
        }
        first
    }
}

impl Drop for Launchers {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A forked child: there is no thread to stop or join here.
            for l in &mut self.launchers {
                std::mem::forget(l.thread.take());
            }
            return;
        }
        for l in &self.launchers {
            l.shared.stop.store(true, SeqCst);
            wake(l);
        }
        for l in &mut self.launchers {
            if let Some(t) = l.thread.take() {
                if t.join().is_err() {
                    log::warn!("cuda-peer: a launcher thread panicked");
                }
            }
        }
    }
}

fn wake(l: &Launcher) {
    if let Some(t) = &l.thread {
        t.thread().unpark();
    }
}

/// Spins until the launcher has finished call `call` (yielding the CPU
/// after a while, in case it was descheduled or is waking from a park).
fn wait_done(s: &Shared, call: u64) {
    let mut spins = 0u32;
    while s.done.load(SeqCst) != call {
        spins = spins.saturating_add(1);
        if spins < 1 << 16 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

fn panicked(rank: usize, payload: &(dyn std::any::Any + Send)) -> Error {
    let what = payload.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| payload.downcast_ref::<String>().cloned()).unwrap_or_default();
    Error::Internal(format!("launching rank {rank}'s kernel panicked: {what}"))
}

/// A launcher's loop: wait for a call (spinning up to `spin` after the
/// last one, then parked), run the job for `rank`, report.
fn serve(s: &Shared, rank: usize, spin: Duration) {
    let mut seen = 0u64;
    s.parked.store(false, SeqCst);
    'calls: loop {
        let since = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.stop.load(SeqCst) {
                return;
            }
            if s.posted.load(SeqCst) != seen {
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && since.elapsed() >= spin {
                s.parked.store(true, SeqCst);
                if s.posted.load(SeqCst) == seen && !s.stop.load(SeqCst) {
                    std::thread::park();
                }
                s.parked.store(false, SeqCst);
                continue 'calls;
            }
            std::hint::spin_loop();
        }
        seen = s.posted.load(SeqCst);
        let job = lock(&s.job).as_ref().map(|j| j.0);
        let out = match job {
            // SAFETY: `run` stored this pointer before raising `posted` to
            // `seen`, and keeps the job alive until we store `done = seen`
            // below.
            Some(p) => catch_unwind(AssertUnwindSafe(|| unsafe { (*p)(rank) })).unwrap_or_else(|e| Err(panicked(rank, &*e))),
            None => Err(Error::Internal("a launcher was woken without a job".into())),
        };
        *lock(&s.result) = out;
        s.done.store(seen, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_rank_runs_once_per_call_awake_or_parked() {
        // Spinning launchers (long spin) and parked ones (zero spin): every
        // rank's job runs exactly once per call, whoever runs it.
        for spin in [Duration::from_secs(5), Duration::ZERO] {
            let l = Launchers::start(4, spin).expect("threads");
            for call in 0..200 {
                let hits: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
                l.run(&|r| {
                    hits[r].fetch_add(1, SeqCst);
                    Ok(())
                })
                .unwrap();
                assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "call {call}, spin {spin:?}: {hits:?}");
            }
        }
    }

    #[test]
    fn errors_and_panics_come_back_and_the_launchers_keep_working() {
        let l = Launchers::start(3, Duration::from_secs(5)).expect("threads");
        std::thread::sleep(Duration::from_millis(10)); // let them start spinning
        let e = l.run(&|r| if r == 2 { Err(Error::InvalidArgument("rank 2".into())) } else { Ok(()) }).unwrap_err();
        assert_eq!(e, Error::InvalidArgument("rank 2".into()));
        let e = l.run(&|r| if r == 1 { panic!("boom") } else { Ok(()) }).unwrap_err();
        assert!(matches!(&e, Error::Internal(m) if m.contains("rank 1") && m.contains("boom")), "{e}");
        let e = l.run(&|r| if r == 0 { panic!("main") } else { Ok(()) }).unwrap_err();
        assert!(matches!(&e, Error::Internal(m) if m.contains("rank 0")), "{e}");
        let sum = AtomicUsize::new(0);
        l.run(&|r| {
            sum.fetch_add(r + 1, SeqCst);
            Ok(())
        })
        .unwrap();
        assert_eq!(sum.load(SeqCst), 6);
    }

    #[test]
    fn awake_launchers_run_jobs_on_their_own_threads() {
        let l = Launchers::start(3, Duration::from_secs(5)).expect("threads");
        // Each launcher is parked until its thread runs, then spins for 5 s:
        // wait until both are awake (a loaded machine may take a while).
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while l.launchers.iter().any(|x| x.shared.parked.load(SeqCst)) {
            assert!(std::time::Instant::now() < deadline, "the launcher threads did not start within 30 s");
            std::thread::yield_now();
        }
        let me = std::thread::current().id();
        let names = Mutex::new(vec![None; 3]);
        l.run(&|r| {
            let t = std::thread::current();
            lock(&names)[r] = Some((t.id() == me, t.name().map(str::to_string)));
            Ok(())
        })
        .unwrap();
        let names = lock(&names).clone();
        assert_eq!(names[0], Some((true, std::thread::current().name().map(str::to_string))));
        assert_eq!(names[1], Some((false, Some("cuda-peer-launch-1".into()))));
        assert_eq!(names[2], Some((false, Some("cuda-peer-launch-2".into()))));
    }
}
