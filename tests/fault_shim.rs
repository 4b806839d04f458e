//! Fault tests under a lying driver: the libcuda stand-in in
//! `tests/fakecuda/` sits in front of the real driver and
//!
//! - `peer-unavailable`: claims peer access between every pair of devices,
//!   but `cuCtxEnablePeerAccess` fails;
//! - `corrupt-peer-copies`: every device-to-device copy between two devices
//!   lands with its first byte flipped;
//! - `fail-module-load=N`: loading a kernel module fails on device N;
//! - `drop-sm-stores=N`: the fused all-reduce kernels (one-shot, mesh) are
//!   not run on device N though their launch succeeds, so nothing their SM
//!   peer stores would carry arrives (a pair whose copy engines work while
//!   its SM peer stores are lost, as seen from its peers);
//! - `corrupt-fused-results=N`: the fused kernels run and meet their
//!   barriers, then the first byte of their output on device N flips:
//!   wrong data behind a clean barrier, which only the creation check's
//!   comparison of the results with the CPU's can catch;
//! - `fail-call=NAME:N[@AFTER:M|@restart]`: the Nth call of one driver
//!   entry point (after the Mth of another, or after the test arms it)
//!   fails, every asynchronous copy is held back
//!   a little on its stream, and the shim counts frees of memory that a
//!   copy not yet done touches. Under it, an error part way through a link
//!   verification or a ring all-reduce must be typed, name the call, and
//!   leave nothing pending that reads or writes memory freed after the
//!   error is returned.
//!
//! Under each, links, groups (every algorithm, Auto and forced; every
//! path policy) and per-rank communicators (`cuda_peer::Comm`, every path
//! policy) must give either exact results (checked against the CPU),
//! through a verified fallback where the lie is found, or a typed error:
//! never a wrong answer, a panic or a hang (each test runs under a
//! watchdog). Each case is judged on what the library reports, not only
//! on its result: the fault must have fired in that case itself (the
//! shim's count read before and after it), or not at all where it is not
//! on the case's path (StagedOnly under a P2P lie, the ring under a fault
//! of the fused kernels); a claimed fallback must show in the public API
//! (every pull's `LinkStatus` staged, the driver's claim and the
//! verification's result; the group's algorithms, `uses_mesh` and
//! `oneshot_on_host`); refusals must be the error variant the fault calls
//! for, naming the right devices or algorithm. Where the library
//! remembers a fault for the process (a pair's verification verdict is
//! cached), each case runs in a child process of its own. Controls check
//! that, with verification turned off, the corruptions really reach the
//! results, so the passing cases are not vacuous, and a CPU test feeds the
//! judges outcomes that prove nothing, which they must reject.
//!
//! `tests/fakecuda/run.sh` runs this binary once per mode, and requires
//! each mode's own tests to print their last line (`finished`). Groups lay
//! their two ranks round robin over the GPUs (both on device 0 where there
//! is one). The faults of peer access and peer copies, links between two
//! devices, a ring pulling over P2P, and a fault on a device that is not
//! there (`drop-sm-stores=1` on one GPU) need two GPUs and say SKIPPED
//! with one; `drop-sm-stores=0`, `corrupt-fused-results=0` and
//! `fail-module-load=0` run their group cases on one. Without the shim (or
//! without a GPU) the GPU tests skip; with `CUDA_PEER_REQUIRE_GPU=1` and
//! `CUDA_PEER_FAKE_EXPECTED=1` they fail instead. The CPU tests at the
//! end check the judges, and build the shim and run its self-test where gcc
//! is available.

mod common;

use cuda_peer::copy::LinkStatus;
use cuda_peer::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cuda_peer::{Algorithm, Comm, CommOptions, Error, Group, GroupOptions, Link, LinkOptions, Path, PathPolicy, ReduceOp, Selected};
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

/// How long one test may run before the watchdog calls it a hang.
const WATCHDOG: Duration = Duration::from_secs(240);

fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Whether the runner says the shim must be in use (`CUDA_PEER_FAKE_EXPECTED=1`).
fn expected() -> bool {
    std::env::var("CUDA_PEER_FAKE_EXPECTED").map(|v| v == "1").unwrap_or(false)
}

/// The shim's answers, read through the handle the driver was loaded with.
struct Shim {
    mode: String,
    fired: unsafe extern "C" fn() -> std::os::raw::c_long,
    calls: unsafe extern "C" fn(*const std::os::raw::c_char) -> std::os::raw::c_long,
    restart: unsafe extern "C" fn() -> std::os::raw::c_int,
    unsafe_frees: unsafe extern "C" fn() -> std::os::raw::c_long,
    _lib: libloading::os::unix::Library,
}

impl Shim {
    fn fired(&self) -> i64 {
        // SAFETY: `cuda_peer_fake_fired` takes nothing and reads an atomic
        // counter; the library stays loaded (held in `_lib`).
        let n: std::os::raw::c_long = unsafe { (self.fired)() };
        n as i64
    }

    /// How many outermost calls the override `name` has had.
    fn calls(&self, name: &str) -> i64 {
        let name = std::ffi::CString::new(name).expect("a call's name");
        // SAFETY: `cuda_peer_fake_calls` reads a NUL-terminated string (alive
        // for the call) and an atomic counter; the library stays loaded.
        let n: std::os::raw::c_long = unsafe { (self.calls)(name.as_ptr()) };
        n as i64
    }

    /// fail-call: counts toward the fault start again now.
    fn restart(&self) {
        // SAFETY: `cuda_peer_fake_restart` takes nothing and resets two
        // counters under the shim's lock; the library stays loaded.
        let r = unsafe { (self.restart)() };
        assert_eq!(r, 0, "cuda_peer_fake_restart refused: the shim runs {}, not a fail-call mode", self.mode);
    }

    /// fail-call: the frees seen so far of memory that a pending copy touched.
    fn unsafe_frees(&self) -> i64 {
        // SAFETY: as `fired`.
        let n: std::os::raw::c_long = unsafe { (self.unsafe_frees)() };
        n as i64
    }
}

/// The call a `fail-call=NAME:N[@AFTER:M|@restart]` mode fails.
fn fail_call(mode: &str) -> Option<&str> {
    mode.strip_prefix("fail-call=")?.split(':').next()
}

/// The shim in front of the driver this process loaded, if it is one.
fn find_shim() -> Option<Shim> {
    use libloading::os::unix::{Library, RTLD_LAZY};
    /// glibc's `RTLD_NOLOAD` (libloading does not name it).
    const RTLD_NOLOAD: std::os::raw::c_int = 4;
    // SAFETY: RTLD_NOLOAD only returns a library already loaded (the driver,
    // loaded by cuda-peer-sys under this name): no initialiser runs.
    let lib = unsafe { Library::open(Some("libcuda.so.1"), RTLD_LAZY | RTLD_NOLOAD) }.ok()?;
    // SAFETY: the shim exports these with exactly these signatures
    // (tests/fakecuda/fakecuda.c); the real driver exports neither.
    let (mode, fired, calls, restart, unsafe_frees) = unsafe {
        let mode = lib.get::<unsafe extern "C" fn() -> *const std::os::raw::c_char>(b"cuda_peer_fake_mode\0").ok()?;
        let fired = lib.get::<unsafe extern "C" fn() -> std::os::raw::c_long>(b"cuda_peer_fake_fired\0").ok()?;
        let calls = lib.get::<unsafe extern "C" fn(*const std::os::raw::c_char) -> std::os::raw::c_long>(b"cuda_peer_fake_calls\0").ok()?;
        let restart = lib.get::<unsafe extern "C" fn() -> std::os::raw::c_int>(b"cuda_peer_fake_restart\0").ok()?;
        let unsafe_frees = lib.get::<unsafe extern "C" fn() -> std::os::raw::c_long>(b"cuda_peer_fake_unsafe_frees\0").ok()?;
        (std::ffi::CStr::from_ptr(mode()).to_string_lossy().into_owned(), *fired, *calls, *restart, *unsafe_frees)
    };
    Some(Shim { mode, fired, calls, restart, unsafe_frees, _lib: lib })
}

/// The shim and every device's context when the shim runs in a mode that
/// `accept` takes and there is a GPU; `None` after saying why the test is
/// skipped (or a panic where the runner requires the shim). Tests that
/// need two GPUs say so themselves (`common::has_gpus`).
fn under(test: &str, accept: impl Fn(&str) -> bool) -> Option<(Shim, Vec<Arc<CudaContext>>)> {
    let ctxs = common::gpus(test, 1)?;
    let Some(shim) = find_shim() else {
        if expected() {
            panic!("{test}: CUDA_PEER_FAKE_EXPECTED=1 but the libcuda in use is not the fakecuda shim (LD_LIBRARY_PATH?)");
        }
        say(&format!("SKIPPED {test}: the driver in use is not the fakecuda shim (tests/fakecuda/run.sh)"));
        return None;
    };
    if expected() {
        let env = std::env::var("CUDA_PEER_FAKE").unwrap_or_default();
        assert_eq!(shim.mode, if env.is_empty() { "off".to_string() } else { env }, "{test}: the shim's mode is not CUDA_PEER_FAKE");
    }
    same_entry_points(test, &shim);
    if !accept(&shim.mode) {
        say(&format!("SKIPPED {test}: for another mode (the shim runs {})", shim.mode));
        return None;
    }
    say(&format!("{test}: under fakecuda mode {}", shim.mode));
    Some((shim, ctxs))
}

/// [`under`] for a test that needs two GPUs (`what` says for what): it
/// skips, saying so, where fewer are present.
fn under_two_gpus(test: &str, accept: impl Fn(&str) -> bool, what: &str) -> Option<(Shim, Vec<Arc<CudaContext>>)> {
    let (shim, ctxs) = under(test, accept)?;
    common::has_gpus(test, what, ctxs.len(), 2).then_some((shim, ctxs))
}

/// [`under`] a mode `PREFIX<ordinal>` (the device it lies about) whose
/// device the test has: the shim, the contexts and the ordinal, which must
/// be below `limit` where the test's groups use only that many devices;
/// `None` after saying why the test skips.
fn under_device(test: &str, prefix: &str, limit: Option<usize>) -> Option<(Shim, Vec<Arc<CudaContext>>, usize)> {
    let (shim, ctxs) = under(test, |m| m.starts_with(prefix))?;
    let device: usize = shim.mode[prefix.len()..].parse().unwrap_or_else(|e| panic!("{}: {prefix}<ordinal> expected: {e}", shim.mode));
    if let Some(limit) = limit {
        assert!(device < limit, "{}: the groups here are on devices 0 and 1", shim.mode);
    }
    if !common::has_gpus(test, &format!("{} (device {device})", shim.mode), ctxs.len(), device + 1) {
        return None;
    }
    Some((shim, ctxs, device))
}

/// Checks that cuda-peer-sys's loader and cudarc's both call the shim's
/// overrides (one library, one handle), not the real driver's entry points.
fn same_entry_points(test: &str, shim: &Shim) {
    let api = cuda_peer::driver::api().expect("the driver loaded");
    // SAFETY: looking up exported symbols by name; nothing is called.
    let shim_fn = unsafe { shim._lib.get::<*const ()>(b"cuCtxEnablePeerAccess\0") }.map(|s| *s as usize).expect("the shim's override");
    assert_eq!(api.cuCtxEnablePeerAccess as usize, shim_fn, "{test}: cuda-peer-sys does not call the shim's cuCtxEnablePeerAccess");
    #[cfg(feature = "dynamic-loading")]
    {
        // SAFETY: cudarc's driver library, loaded on first use (as above);
        // looking up a symbol by name calls nothing.
        let cudarc_fn = unsafe { cuda_peer::cudarc::driver::sys::culib().get::<*const ()>(b"cuMemcpyDtoDAsync_v2\0").map(|s| *s as usize) };
        // SAFETY: as above.
        let shim_copy = unsafe { shim._lib.get::<*const ()>(b"cuMemcpyDtoDAsync_v2\0") }.map(|s| *s as usize).expect("the shim's override");
        assert_eq!(cudarc_fn.ok(), Some(shim_copy), "{test}: cudarc does not call the shim's cuMemcpyDtoDAsync_v2 (another libcuda?)");
    }
}

/// Runs `f` on its own thread and fails the test if it takes longer than
/// [`WATCHDOG`] (a hang) or panics (the panic's message is kept).
fn bounded(test: &str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::Builder::new()
        .name(test.to_string())
        .spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            let _ = tx.send(r);
        })
        .expect("spawn the test thread");
    match rx.recv_timeout(WATCHDOG) {
        Ok(Ok(())) => {
            let _ = handle.join();
        }
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("{test}: still running after {WATCHDOG:?}: a hang"),
    }
}

/// What a correct case went through, as the library's public API reports it.
#[derive(Debug)]
struct How {
    /// A link case: its link's status; a group: each rank's pull (rank r's
    /// from rank r-1, `Group::link_status`).
    links: Vec<LinkStatus>,
    /// A group: the algorithm each count of [`COUNTS`] ran with
    /// (`Group::all_reduce_algorithm`); empty for a link.
    selected: Vec<Selected>,
    /// Whether the group kept the mesh (`Group::uses_mesh`).
    mesh: bool,
    /// Whether it kept the one-shot, and where its slots are
    /// (`Group::oneshot_on_host`: `Some(true)` in host memory).
    oneshot_on_host: Option<bool>,
}

impl How {
    fn describe(&self) -> String {
        let paths: Vec<String> = self.links.iter().map(|s| s.path.to_string()).collect();
        if self.selected.is_empty() {
            return format!("{} link: {}", paths.join(", "), self.links.iter().map(|s| s.reason.as_str()).collect::<Vec<_>>().join("; "));
        }
        format!("pulls {paths:?}, algorithms {:?}, mesh {}, one-shot {:?}", self.selected, self.mesh, self.oneshot_on_host)
    }

    /// Every link on the staged path, with the driver's (false) claim of
    /// P2P in its status and the verification result `verified` (`None`:
    /// none ran, `Some(false)`: it ran and failed).
    fn staged(&self, verified: Option<bool>) -> Result<(), String> {
        match self.links.iter().position(|s| s.path != Path::Staged || !s.driver_claims_p2p || s.verified != verified) {
            Some(r) => Err(format!("link {r} is not staged with the driver claiming P2P and verified {verified:?}: {:?}", self.links[r])),
            None if self.links.is_empty() => Err("no link status".into()),
            None => Ok(()),
        }
    }

    /// A group that kept neither fused algorithm and ran every count on the ring.
    fn ring_only(&self) -> Result<(), String> {
        if self.mesh || self.oneshot_on_host.is_some() || self.selected.len() != COUNTS.len() || self.selected.iter().any(|s| *s != Selected::Ring) {
            return Err(format!("not the ring alone: {}", self.describe()));
        }
        Ok(())
    }

    /// A group whose fused algorithm is the one-shot through host memory
    /// (a staged group's), no mesh; with `forced`, every count ran on it.
    fn host_oneshot(&self, forced: bool) -> Result<(), String> {
        if self.mesh || self.oneshot_on_host != Some(true) || (forced && self.selected.iter().any(|s| *s != Selected::OneShot)) {
            return Err(format!("not on the one-shot through host memory: {}", self.describe()));
        }
        Ok(())
    }
}

/// Where a case's results differed from the CPU's.
#[derive(Debug)]
struct Wrong {
    what: String,
    /// How many elements (or bytes, for a link) were wrong, and the first.
    wrong: usize,
    first: usize,
    /// A group: the rank whose result was wrong, and the algorithm its count ran with.
    group: Option<(usize, Selected)>,
}

/// What one case did.
#[derive(Debug)]
enum Outcome {
    /// Every result exact; how it got there.
    Correct(How),
    /// A typed error.
    Failed(Error),
    /// Results differ from the CPU's.
    Wrong(Wrong),
}

impl Outcome {
    fn short(&self) -> String {
        match self {
            Outcome::Correct(how) => format!("correct ({})", how.describe()),
            Outcome::Failed(e) => format!("error: {e}"),
            Outcome::Wrong(w) => format!("WRONG ANSWER: {}: {} wrong, first at {}", w.what, w.wrong, w.first),
        }
    }
}

fn random_u32(n: usize) -> Vec<u32> {
    common::random_bytes(n * 4).chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Small integers in f32: every sum of a few of them is exact.
fn small_f32(n: usize) -> Vec<f32> {
    common::random_bytes(n).iter().map(|&b| f32::from(b % 64) - 32.0).collect()
}

/// Opens a link 0 -> 1 under `opts` and copies two sizes of random bytes
/// through it (one odd, one over a staging chunk), checking each.
fn link_case(ctxs: &[Arc<CudaContext>], opts: &LinkOptions) -> Outcome {
    let mut link = match Link::open(&ctxs[0], &ctxs[1], opts) {
        Ok(l) => l,
        Err(e) => return Outcome::Failed(e),
    };
    let (s0, s1) = (ctxs[0].new_stream().unwrap(), ctxs[1].new_stream().unwrap());
    for n in [4099usize, (5 << 20) + 3] {
        let data = common::random_bytes(n);
        let src = s0.clone_htod(&data).unwrap();
        let poison: Vec<u8> = data.iter().map(|b| !b).collect();
        let mut dst = s1.clone_htod(&poison).unwrap();
        if let Err(e) = link.copy(&src, &mut dst, &s1) {
            return Outcome::Failed(e);
        }
        let got = s1.clone_dtoh(&dst).unwrap();
        if let Some((first, wrong)) = common::diff(&got, &data) {
            return Outcome::Wrong(Wrong { what: format!("{} link, {n} bytes", link.path()), wrong, first, group: None });
        }
    }
    Outcome::Correct(How { links: vec![link.status().clone()], selected: Vec::new(), mesh: false, oneshot_on_host: None })
}

/// Counts (elements) that take the one-shot, the mesh and the ring's
/// ranges under Auto on two ranks, each with a partial 16-byte unit.
const COUNTS: [usize; 3] = [1023, (1 << 18) + 5, (1 << 21) + 1];

/// Creates a group on `streams` under `opts` and runs, per count, an
/// in-place u32 sum and an out-of-place f32 sum, each checked on every rank.
fn group_case(streams: &[Arc<CudaStream>], opts: &GroupOptions) -> Outcome {
    let group = match Group::new(streams.to_vec(), opts) {
        Ok(g) => g,
        Err(e) => return Outcome::Failed(e),
    };
    let n = streams.len();
    let mut selected = Vec::new();
    for count in COUNTS {
        let algorithm = group.all_reduce_algorithm(count * 4);
        selected.push(algorithm);
        let inputs: Vec<Vec<u32>> = (0..n).map(|_| random_u32(count)).collect();
        let want: Vec<u32> = (0..count).map(|i| inputs.iter().fold(0u32, |a, v| a.wrapping_add(v[i]))).collect();
        let mut bufs: Vec<CudaSlice<u32>> = (0..n).map(|r| streams[r].clone_htod(&inputs[r]).unwrap()).collect();
        if let Err(e) = group.all_reduce_in_place(&mut bufs, ReduceOp::Sum) {
            return Outcome::Failed(e);
        }
        if let Err(e) = group.synchronize() {
            return Outcome::Failed(e);
        }
        for r in 0..n {
            if let Some((first, wrong)) = common::diff(&streams[r].clone_dtoh(&bufs[r]).unwrap(), &want) {
                let what = format!("u32 in place, count {count}, rank {r} ({algorithm:?})");
                return Outcome::Wrong(Wrong { what, wrong, first, group: Some((r, algorithm)) });
            }
        }
        let inputs: Vec<Vec<f32>> = (0..n).map(|_| small_f32(count)).collect();
        let want: Vec<u32> = (0..count).map(|i| inputs.iter().map(|v| v[i]).sum::<f32>().to_bits()).collect();
        let send: Vec<CudaSlice<f32>> = (0..n).map(|r| streams[r].clone_htod(&inputs[r]).unwrap()).collect();
        let mut recv: Vec<CudaSlice<f32>> = (0..n).map(|r| streams[r].clone_htod(&vec![f32::NAN; count]).unwrap()).collect();
        if let Err(e) = group.all_reduce(&send, &mut recv, ReduceOp::Sum) {
            return Outcome::Failed(e);
        }
        if let Err(e) = group.synchronize() {
            return Outcome::Failed(e);
        }
        for r in 0..n {
            let got: Vec<u32> = streams[r].clone_dtoh(&recv[r]).unwrap().iter().map(|x| x.to_bits()).collect();
            if let Some((first, wrong)) = common::diff(&got, &want) {
                let what = format!(
                    "f32 out of place, count {count}, rank {r} ({algorithm:?}): {} instead of {}",
                    f32::from_bits(got[first]),
                    f32::from_bits(want[first])
                );
                return Outcome::Wrong(Wrong { what, wrong, first, group: Some((r, algorithm)) });
            }
        }
    }
    let links = (0..n).filter_map(|r| group.link_status(r).cloned()).collect();
    Outcome::Correct(How { links, selected, mesh: group.uses_mesh(), oneshot_on_host: group.oneshot_on_host() })
}

/// Link options under `policy`, without the doctor's cached verdicts (a
/// cache on the test machine could stage a pair before the lie is met).
fn link_opts(policy: PathPolicy) -> LinkOptions {
    let mut o = LinkOptions::with_policy(policy);
    o.use_doctor_verdicts = false;
    o
}

/// Group options under `policy` and `algorithm`, without the doctor's verdicts.
fn group_opts(policy: PathPolicy, algorithm: Algorithm) -> GroupOptions {
    let mut o = GroupOptions::with_policy(policy);
    o.algorithm = algorithm;
    o.link.use_doctor_verdicts = false;
    o
}

const ALGORITHMS: [Algorithm; 4] = [Algorithm::Auto, Algorithm::Ring, Algorithm::Mesh, Algorithm::OneShot];
const POLICIES: [PathPolicy; 3] = [PathPolicy::Auto, PathPolicy::P2pOnly, PathPolicy::StagedOnly];

/// One case of a mode's sweep: a link 0 -> 1 under a policy, or a group of
/// two ranks on devices 0 and 1 (both on device 0 where there is one GPU)
/// under a policy and an algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    Link(PathPolicy),
    Group(PathPolicy, Algorithm),
}

impl Case {
    fn name(&self) -> String {
        match self {
            Case::Link(p) => format!("link {p:?}"),
            Case::Group(p, a) => format!("group {p:?} {a:?}"),
        }
    }

    fn policy(&self) -> PathPolicy {
        match *self {
            Case::Link(p) | Case::Group(p, _) => p,
        }
    }
}

/// A link per policy.
fn link_cases() -> Vec<Case> {
    POLICIES.iter().map(|&p| Case::Link(p)).collect()
}

/// Every (policy, algorithm) group.
fn group_cases() -> Vec<Case> {
    POLICIES.iter().flat_map(|&p| ALGORITHMS.iter().map(move |&a| Case::Group(p, a))).collect()
}

/// Runs `case` (groups on `streams`, with a 5 s barrier timeout).
fn run_case(ctxs: &[Arc<CudaContext>], streams: &[Arc<CudaStream>], case: Case) -> Outcome {
    match case {
        Case::Link(policy) => link_case(ctxs, &link_opts(policy)),
        Case::Group(policy, algorithm) => {
            // Field by field (builds if the options become #[non_exhaustive]).
            let mut opts = group_opts(policy, algorithm);
            opts.barrier_timeout = Duration::from_secs(5);
            group_case(streams, &opts)
        }
    }
}

/// Set in a child process that runs one case of its test's sweep (the case's name).
const CASE_ENV: &str = "CUDA_PEER_FAULT_CASE";

/// How long a child running one case may take.
const CASE_DEADLINE: Duration = Duration::from_secs(90);

/// Where a sweep's cases run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isolation {
    /// One after another in this process.
    InProcess,
    /// Each in a child process of its own (this test binary, filtered to
    /// the test, with [`CASE_ENV`] naming the case): for a fault whose
    /// effect the library remembers for the rest of the process (a pair's
    /// verification verdict, cached per pair by `copy::verify`), where in
    /// one process only the first case would meet the fault itself.
    Process,
}

/// Whether a sweep ran every case (`All`), or this process is a child that
/// ran its one case (`One`: the test ends there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ran {
    All,
    One,
}

const NEVER_FIRED: &str = "the shim's fault never fired in this case: its outcome proves nothing about the fault";

/// Requires a case to have met its fault.
fn fired_in_case(fired: i64) -> Result<(), String> {
    if fired < 1 {
        return Err(NEVER_FIRED.into());
    }
    Ok(())
}

/// Requires a case to have met no fault (it is not on its path).
fn quiet_in_case(fired: i64, why: &str) -> Result<(), String> {
    if fired != 0 {
        return Err(format!("the shim's fault fired {fired} times, where {why}"));
    }
    Ok(())
}

/// Runs `cases` and judges each one's outcome and the number of faults the
/// shim fired during it (read before and after the case): `judge` says
/// whether they are what the mode must give (`Err(why)` fails the test
/// after every case ran). A wrong answer always fails.
fn sweep(
    test: &str,
    shim: &Shim,
    ctxs: &[Arc<CudaContext>],
    cases: &[Case],
    isolation: Isolation,
    judge: impl Fn(Case, &Outcome, i64) -> Result<(), String>,
) -> Ran {
    let mode = shim.mode.as_str();
    let streams: Vec<Arc<CudaStream>> = (0..2).map(|r| ctxs[r % ctxs.len()].new_stream().unwrap()).collect();
    let one = |case: Case| -> Result<(), String> {
        let before = shim.fired();
        let outcome = run_case(ctxs, &streams, case);
        let fired = shim.fired() - before;
        say(&format!("  [{mode}] {}: {} (faults fired: {fired})", case.name(), outcome.short()));
        match &outcome {
            Outcome::Wrong(w) => Err(format!("a wrong answer: {}: {} wrong, first at {}", w.what, w.wrong, w.first)),
            o => judge(case, o, fired),
        }
    };
    if let Some(name) = std::env::var(CASE_ENV).ok().filter(|n| !n.is_empty()) {
        let case = cases.iter().copied().find(|c| c.name() == name).unwrap_or_else(|| panic!("{test}: {CASE_ENV}={name:?} is no case of this sweep"));
        if let Err(why) = one(case) {
            panic!("{test}: [{mode}] {name}: {why}");
        }
        say(&format!("{test}: case {name}: right"));
        return Ran::One;
    }
    let mut failures = Vec::new();
    for &case in cases {
        let name = case.name();
        let verdict = match isolation {
            Isolation::InProcess => one(case),
            Isolation::Process => {
                let results = common::procs::spawn(test, 1, CASE_DEADLINE, |_| vec![(CASE_ENV, name.clone())]);
                let (code, out) = &results[0];
                for line in out.lines().filter(|l| l.contains(&format!("  [{mode}] {name}: "))) {
                    say(line);
                }
                let end = common::procs::End::Passes(format!("{test}: case {name}: right"));
                match common::procs::failure(test, *code, out, &end) {
                    Some(why) => Err(format!("its child {why}; the child's output:\n{out}")),
                    None => Ok(()),
                }
            }
        };
        if let Err(why) = verdict {
            failures.push(format!("{name}: {why}"));
        }
    }
    assert!(failures.is_empty(), "[{mode}] cases:\n  {}", failures.join("\n  "));
    Ran::All
}

/// The last line of a mode's test, which `tests/fakecuda/run.sh` requires
/// of each mode's own tests (a test that skipped, or ended early, has none).
fn finished(test: &str, shim: &Shim) {
    say(&format!("{test}: ran to its end under fakecuda mode {}", shim.mode));
}

/// The two lies about P2P.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum P2pLie {
    /// `peer-unavailable`: peer access claimed, and refused when enabled.
    PeerUnavailable,
    /// `corrupt-peer-copies`: peer access works, peer copies land wrong.
    CorruptCopies,
}

/// The typed refusal of P2P under `lie` (the lie found where peer access is
/// enabled, or where the verification copies): `PeerUnsupported` or
/// `P2pUnavailable` between devices 0 and 1 (`pair`: in that direction).
fn p2p_refusal(lie: P2pLie, e: &Error, pair: Option<(usize, usize)>) -> Result<(), String> {
    let ends = match (lie, e) {
        (P2pLie::PeerUnavailable, Error::PeerUnsupported { from, to }) => (*from, *to),
        (P2pLie::CorruptCopies, Error::P2pUnavailable { from, to, .. }) => (*from, *to),
        _ => {
            return Err(format!(
                "expected {} P2P refusal, got {e:?}",
                if lie == P2pLie::PeerUnavailable { "PeerUnsupported" } else { "P2pUnavailable" }
            ))
        }
    };
    let ok = match pair {
        Some(p) => ends == p,
        None => ends == (0, 1) || ends == (1, 0),
    };
    if !ok {
        return Err(format!("the refusal names devices {ends:?}, expected {}", pair.map_or("0 and 1".to_string(), |p| format!("{p:?}"))));
    }
    Ok(())
}

/// The verdict shared by the two P2P lies, per case. Policy `Auto` must
/// fall back to the staged path (every pull's status: staged, the driver's
/// claim of P2P, the verification's result) and be exact, with the ring,
/// or with the one-shot through host memory (forced or under `Auto`), and
/// a forced mesh a typed `AlgorithmUnavailable`; `P2pOnly` must be the lie's
/// typed refusal; `StagedOnly` as `Auto`, without meeting the fault at all.
/// Every `Auto` and `P2pOnly` case must meet the fault itself.
fn judge_p2p_lie(lie: P2pLie, case: Case, o: &Outcome, fired: i64) -> Result<(), String> {
    let policy = case.policy();
    if policy == PathPolicy::StagedOnly {
        quiet_in_case(fired, "StagedOnly should try neither peer access nor peer copies")?;
    } else {
        fired_in_case(fired)?;
    }
    // A pair whose peer access failed to enable never reaches its
    // verification; one whose verification copies land wrong fails it.
    let verified = (lie == P2pLie::CorruptCopies && policy == PathPolicy::Auto).then_some(false);
    let p2p_only = policy == PathPolicy::P2pOnly;
    match (case, o) {
        (Case::Link(_), Outcome::Failed(e)) if p2p_only => p2p_refusal(lie, e, Some((0, 1))),
        (Case::Group(..), Outcome::Failed(e)) if p2p_only => p2p_refusal(lie, e, None),
        (Case::Group(_, Algorithm::Mesh), Outcome::Failed(Error::AlgorithmUnavailable { algorithm: "mesh", .. })) if !p2p_only => Ok(()),
        (Case::Link(_), Outcome::Correct(how)) if !p2p_only => how.staged(verified),
        (Case::Group(_, algorithm), Outcome::Correct(how)) if !p2p_only && algorithm != Algorithm::Mesh => {
            how.staged(verified)?;
            match algorithm {
                Algorithm::Ring => how.ring_only(),
                _ => how.host_oneshot(algorithm == Algorithm::OneShot),
            }
        }
        (_, o) => {
            let want = match case {
                _ if p2p_only => "the lie's typed refusal",
                Case::Group(_, Algorithm::Mesh) => "AlgorithmUnavailable for the mesh",
                _ => "exact results over the staged path",
            };
            Err(format!("expected {want}, got {}", o.short()))
        }
    }
}

#[test]
fn peer_unavailable_falls_back_or_errors() {
    const T: &str = "peer_unavailable_falls_back_or_errors";
    let Some((shim, ctxs)) = under_two_gpus(T, |m| m == "peer-unavailable", "peer access between two devices") else { return };
    bounded(T, move || {
        let cases: Vec<Case> = link_cases().into_iter().chain(group_cases()).collect();
        if sweep(T, &shim, &ctxs, &cases, Isolation::InProcess, |c, o, f| judge_p2p_lie(P2pLie::PeerUnavailable, c, o, f)) == Ran::One {
            return;
        }
        say(&format!("  [peer-unavailable] faults injected: {}", shim.fired()));
        finished(T, &shim);
    });
}

/// Each case in a process of its own: the library caches a pair's
/// verification verdict for the process, so in one process only the first
/// case to verify the pair would meet the corruption itself.
#[test]
fn corrupt_peer_copies_are_caught() {
    const T: &str = "corrupt_peer_copies_are_caught";
    let Some((shim, ctxs)) = under_two_gpus(T, |m| m == "corrupt-peer-copies", "peer copies between two devices") else { return };
    bounded(T, move || {
        let cases: Vec<Case> = link_cases().into_iter().chain(group_cases()).collect();
        if sweep(T, &shim, &ctxs, &cases, Isolation::Process, |c, o, f| judge_p2p_lie(P2pLie::CorruptCopies, c, o, f)) == Ran::One {
            return;
        }
        finished(T, &shim);
    });
}

/// Two per-rank ranks' sum all-reduce (in place) and all-gather of fresh
/// random u32, each rank's results against the CPU: `None` where every
/// result is exact, else what was wrong (a call's error, or its first
/// wrong element).
fn per_rank_wrong(comms: &[Comm]) -> Option<String> {
    let n = 40_009;
    let ins: Vec<Vec<u32>> = comms.iter().map(|_| random_u32(n)).collect();
    let sum: Vec<u32> = (0..n).map(|i| ins.iter().fold(0u32, |a, x| a.wrapping_add(x[i]))).collect();
    let gathered: Vec<u32> = ins.concat();
    let wrong: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(&ins)
            .enumerate()
            .map(|(r, (c, x))| {
                let (sum, gathered) = (&sum, &gathered);
                s.spawn(move || -> Option<String> {
                    let st = c.stream();
                    let mut buf = st.clone_htod(x).unwrap();
                    let mut all = st.alloc_zeros::<u32>(gathered.len()).unwrap();
                    let run = c.all_reduce_in_place(&mut buf, ReduceOp::Sum).and_then(|()| c.all_gather(&st.clone_htod(x).unwrap(), &mut all));
                    if let Err(e) = run.and_then(|()| c.synchronize()) {
                        return Some(format!("rank {r}: {e}"));
                    }
                    let (got, got_all) = (st.clone_dtoh(&buf).unwrap(), st.clone_dtoh(&all).unwrap());
                    let first = |a: &[u32], b: &[u32]| (0..a.len()).find(|&i| a[i] != b[i]);
                    match (first(&got, sum), first(&got_all, gathered)) {
                        (None, None) => None,
                        (a, g) => Some(format!("rank {r}: all-reduce first wrong at {a:?}, all-gather at {g:?}")),
                    }
                })
            })
            .collect();
        hs.into_iter().filter_map(|h| h.join().expect("a rank's thread")).collect()
    });
    (!wrong.is_empty()).then(|| wrong.join("; "))
}

/// Per-rank communicators (thread ranks on devices 0 and 1) under peer
/// copies that land wrong: under `Auto` the creation's check (its
/// all-gather copies from the peer's device) fails on P2P, every rank
/// falls back to the staged path, says so, and is exact; `P2pOnly` fails
/// with the check's error; `StagedOnly` never meets the fault and is
/// exact. The control: with the check off, the corruption reaches the
/// per-rank all-gather over P2P.
#[test]
fn per_rank_comms_under_corrupt_peer_copies_fall_back_to_staged() {
    const T: &str = "per_rank_comms_under_corrupt_peer_copies_fall_back_to_staged";
    let Some((shim, ctxs)) = under_two_gpus(T, |m| m == "corrupt-peer-copies", "peer copies between two devices") else { return };
    bounded(T, move || {
        let streams = vec![ctxs[0].new_stream().unwrap(), ctxs[1].new_stream().unwrap()];
        let opts = |policy| CommOptions::default().path(policy).use_doctor_verdicts(false);
        let made = |policy, opts: &CommOptions| {
            let before = shim.fired();
            let made = common::ranks::made_each(&streams, opts);
            let fired = shim.fired() - before;
            let short: Vec<String> =
                made.iter().map(|m| m.as_ref().map_or_else(|e| format!("{e}"), |c| format!("{:?}: {:?}", c.engine(), c.path_reason()))).collect();
            say(&format!("  [corrupt-peer-copies] per-rank {policy:?}: {short:?} (faults fired: {fired})"));
            (made, fired)
        };
        let (auto, fired) = made(PathPolicy::Auto, &opts(PathPolicy::Auto));
        fired_in_case(fired).unwrap_or_else(|e| panic!("{T}: Auto: {e}"));
        let comms: Vec<Comm> = auto.into_iter().map(|m| m.unwrap_or_else(|e| panic!("{T}: Auto: {e}"))).collect();
        for (r, c) in comms.iter().enumerate() {
            let why = c.path_reason().unwrap_or_default();
            assert!(
                c.engine() == cuda_peer::comm::Engine::Host(Path::Staged) && why.starts_with("staged after the P2P path failed the creation's check"),
                "{T}: Auto, rank {r}: {:?}: {why}",
                c.engine()
            );
        }
        if let Some(w) = per_rank_wrong(&comms) {
            panic!("{T}: Auto, after the fallback: {w}");
        }
        drop(comms);

        let (p2p_only, fired) = made(PathPolicy::P2pOnly, &opts(PathPolicy::P2pOnly));
        fired_in_case(fired).unwrap_or_else(|e| panic!("{T}: P2pOnly: {e}"));
        for (r, m) in p2p_only.iter().enumerate() {
            assert!(
                matches!(m, Err(Error::P2pUnavailable { .. } | Error::Bootstrap { op: "communicator: verification", .. })),
                "{T}: P2pOnly, rank {r}: {:?}",
                m.as_ref().map(|c| c.engine())
            );
        }

        let (staged, fired) = made(PathPolicy::StagedOnly, &opts(PathPolicy::StagedOnly));
        quiet_in_case(fired, "StagedOnly copies through host memory").unwrap_or_else(|e| panic!("{T}: StagedOnly: {e}"));
        let comms: Vec<Comm> = staged.into_iter().map(|m| m.unwrap_or_else(|e| panic!("{T}: StagedOnly: {e}"))).collect();
        if let Some(w) = per_rank_wrong(&comms) {
            panic!("{T}: StagedOnly: {w}");
        }
        drop(comms);

        let (unchecked, _) = made(PathPolicy::Auto, &opts(PathPolicy::Auto).verify(false));
        let comms: Vec<Comm> = unchecked.into_iter().map(|m| m.unwrap_or_else(|e| panic!("{T}: unchecked: {e}"))).collect();
        assert!(comms.iter().all(|c| c.engine() == cuda_peer::comm::Engine::Host(Path::P2p)), "{T}: unchecked: not P2P");
        let wrong = per_rank_wrong(&comms);
        say(&format!("  [corrupt-peer-copies] per-rank, check off: {wrong:?}"));
        assert!(wrong.is_some(), "{T}: unchecked, the corrupt peer copies did not reach the per-rank all-gather");
        drop(comms);
        finished(T, &shim);
    });
}

/// The control: with verification turned off (the caller's promise that
/// P2P works), the corruption reaches a P2P link's copies and the ring's
/// results, so the shim's corruption is on the paths the library uses and
/// the passing cases above are not vacuous.
#[test]
fn corrupt_peer_copies_reach_unverified_p2p() {
    const T: &str = "corrupt_peer_copies_reach_unverified_p2p";
    let Some((shim, ctxs)) = under_two_gpus(T, |m| m == "corrupt-peer-copies", "peer copies between two devices") else { return };
    bounded(T, move || {
        let mut link = link_opts(PathPolicy::P2pOnly);
        link.verify = false;
        let before = shim.fired();
        let o = link_case(&ctxs, &link);
        let fired = shim.fired() - before;
        say(&format!("  [corrupt-peer-copies, verify off] link P2pOnly: {} (faults fired: {fired})", o.short()));
        assert!(
            matches!(&o, Outcome::Wrong(w) if w.first == 0),
            "with verification off the shim's corruption should show from byte 0: {}",
            o.short()
        );
        assert!(fired >= 1, "{T}: the link's copies met no fault");
        let streams: Vec<Arc<CudaStream>> = ctxs[..2].iter().map(|c| c.new_stream().unwrap()).collect();
        let mut opts = GroupOptions::with_policy(PathPolicy::P2pOnly);
        opts.algorithm = Algorithm::Ring;
        opts.link = link;
        let before = shim.fired();
        let o = group_case(&streams, &opts);
        let fired = shim.fired() - before;
        say(&format!("  [corrupt-peer-copies, verify off] ring over P2P: {} (faults fired: {fired})", o.short()));
        assert!(
            matches!(&o, Outcome::Wrong(Wrong { group: Some((_, Selected::Ring)), .. })),
            "with verification off the ring's P2P copies should be corrupt: {}",
            o.short()
        );
        assert!(fired >= 1, "{T}: the ring's pulls met no fault");
        finished(T, &shim);
    });
}

/// What a fault on the fused kernels does to them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FusedFault {
    /// `drop-sm-stores`: the kernels on one device never run (a barrier
    /// that times out on its peers, or, where every rank is on that
    /// device, results that are the inputs).
    Dropped,
    /// `corrupt-fused-results`: they run and meet their barriers, and the
    /// first byte of their output on one device then flips: `rank` (the
    /// group's first rank on that device) has one wrong element, at 0.
    Corrupted { rank: usize },
}

/// The fused algorithm's name in [`Error::FusedUnverified`] and
/// [`Error::AlgorithmUnavailable`].
fn fused_name(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::Mesh => "mesh",
        Algorithm::OneShot => "one-shot",
        Algorithm::Auto | Algorithm::Ring => "(not fused)",
    }
}

/// The numbers of the creation check's wrong-data reason
/// (`src/algorithms/check.rs`: `rank R: W of C results wrong, first at I`,
/// then ` (C elements)`): (R, W, C, I, C). `FusedUnverified` carries the
/// reason as text only.
fn wrong_data(reason: &str) -> Option<[usize; 5]> {
    let rest = reason.strip_prefix("rank ")?;
    let (rank, rest) = rest.split_once(": ")?;
    let (wrong, rest) = rest.split_once(" of ")?;
    let (count, rest) = rest.split_once(" results wrong, first at ")?;
    let (first, rest) = rest.split_once(" (")?;
    let elements = rest.strip_suffix(" elements)")?;
    let n = |s: &str| s.parse::<usize>().ok();
    Some([n(rank)?, n(wrong)?, n(count)?, n(first)?, n(elements)?])
}

/// The verdict for a fault on the fused kernels, per group case. The ring runs no fused
/// kernel: exact, and the fault never fires. Under `Auto` the creation
/// check meets the fault and the group keeps only the ring: exact. A
/// forced mesh or one-shot fails its check with `FusedUnverified` naming
/// it (for a corruption: the check's wrong-data reason, exactly one
/// element wrong, at 0, on the faulted rank), except a mesh on staged
/// links (`StagedOnly`, on one device too), refused before any kernel runs.
fn judge_fused_fault(fault: FusedFault, case: Case, o: &Outcome, fired: i64) -> Result<(), String> {
    let Case::Group(policy, algorithm) = case else { return Err(format!("{} is not a group case", case.name())) };
    let no_mesh = policy == PathPolicy::StagedOnly;
    match (algorithm, o) {
        (Algorithm::Ring, Outcome::Correct(how)) => {
            quiet_in_case(fired, "the ring runs no fused kernel")?;
            how.ring_only()
        }
        (Algorithm::Auto, Outcome::Correct(how)) => {
            fired_in_case(fired)?;
            how.ring_only().map_err(|e| format!("Auto kept a fused algorithm whose check met the fault: {e}"))
        }
        (Algorithm::Mesh, Outcome::Failed(Error::AlgorithmUnavailable { algorithm: "mesh", .. })) if no_mesh => {
            quiet_in_case(fired, "a mesh that is refused runs no kernel")
        }
        (Algorithm::Mesh | Algorithm::OneShot, Outcome::Failed(Error::FusedUnverified { algorithm: name, reason }))
            if *name == fused_name(algorithm) && !(no_mesh && algorithm == Algorithm::Mesh) =>
        {
            fired_in_case(fired)?;
            match fault {
                FusedFault::Dropped => Ok(()),
                FusedFault::Corrupted { rank } => match wrong_data(reason) {
                    Some([r, 1, c, 0, e]) if r == rank && c == e => Ok(()),
                    _ => Err(format!("expected the check's wrong data on rank {rank} (1 element wrong, at 0), got: {reason}")),
                },
            }
        }
        (_, o) => {
            let want = match algorithm {
                Algorithm::Auto | Algorithm::Ring => "the ring's exact results".to_string(),
                Algorithm::Mesh if no_mesh => "AlgorithmUnavailable for the mesh".to_string(),
                a => format!("FusedUnverified for the {}", fused_name(a)),
            };
            Err(format!("expected {want}, got {}", o.short()))
        }
    }
}

/// Fused kernels that never deliver (the shim drops every one-shot and
/// mesh launch on one device, as when a pair's SM peer stores are lost
/// while its copy engines work): the check at group creation catches it,
/// Auto groups run the ring (exact), forced fused algorithms are a typed
/// error; never a wrong answer or a hang.
#[test]
fn dropped_sm_stores_leave_the_ring_or_a_typed_error() {
    const T: &str = "dropped_sm_stores_leave_the_ring_or_a_typed_error";
    let Some((shim, ctxs, _)) = under_device(T, "drop-sm-stores=", None) else { return };
    bounded(T, move || {
        if sweep(T, &shim, &ctxs, &group_cases(), Isolation::InProcess, |c, o, f| judge_fused_fault(FusedFault::Dropped, c, o, f)) == Ran::One {
            return;
        }
        say(&format!("  [{}] launches dropped: {}", shim.mode, shim.fired()));
        finished(T, &shim);
    });
}

/// The group's first rank on device `ordinal` (ranks lie round robin over
/// the devices there are: both on device 0 where there is one).
fn first_rank_on(ordinal: usize, devices: usize) -> usize {
    (0..2).find(|r| r % devices == ordinal).unwrap_or_else(|| panic!("no rank of two on device {ordinal} of {devices}"))
}

/// Fused kernels that run, meet their barriers and then leave a wrong
/// byte in their output on one device (`corrupt-fused-results=N`: wrong
/// data behind a clean barrier, as from SM peer stores that land wrong):
/// the creation check's comparison with the CPU catches it
/// (`src/algorithms/check.rs`, its wrong-data branch). A forced mesh or
/// one-shot fails creation with `FusedUnverified` and the check's
/// reason: the faulted rank, one element wrong, at 0. Auto groups keep
/// only the ring and are exact; ring groups never meet the fault.
#[test]
fn corrupt_fused_results_fail_the_creation_check() {
    const T: &str = "corrupt_fused_results_fail_the_creation_check";
    let Some((shim, ctxs, device)) = under_device(T, "corrupt-fused-results=", Some(2)) else { return };
    bounded(T, move || {
        let rank = first_rank_on(device, ctxs.len());
        let fault = FusedFault::Corrupted { rank };
        if sweep(T, &shim, &ctxs, &group_cases(), Isolation::InProcess, |c, o, f| judge_fused_fault(fault, c, o, f)) == Ran::One {
            return;
        }
        finished(T, &shim);
    });
}

/// The control: with the checks off (`link.verify = false` skips the
/// links' verification and the fused-path check), an Auto group keeps its
/// one-shot and the corruption reaches the caller's results, on the
/// faulted rank at element 0: the fault is on the kernels the library
/// runs, and the check above is what stops it.
#[test]
fn corrupt_fused_results_reach_an_unchecked_group() {
    const T: &str = "corrupt_fused_results_reach_an_unchecked_group";
    let Some((shim, ctxs, device)) = under_device(T, "corrupt-fused-results=", Some(2)) else { return };
    bounded(T, move || {
        let rank = first_rank_on(device, ctxs.len());
        let streams: Vec<Arc<CudaStream>> = (0..2).map(|r| ctxs[r % ctxs.len()].new_stream().unwrap()).collect();
        let mut opts = group_opts(PathPolicy::Auto, Algorithm::Auto);
        opts.link.verify = false;
        let before = shim.fired();
        let o = group_case(&streams, &opts);
        let fired = shim.fired() - before;
        say(&format!("  [{}, checks off] group Auto: {} (faults fired: {fired})", shim.mode, o.short()));
        match &o {
            Outcome::Wrong(Wrong { wrong: 1, first: 0, group: Some((r, Selected::OneShot)), .. }) if *r == rank => {}
            other => panic!("{T}: expected rank {rank}'s one-shot result wrong at element 0 alone, got {}", other.short()),
        }
        assert!(fired >= 1, "{T}: the one-shot met no fault");
        finished(T, &shim);
    });
}

/// The verdict on per-rank communicators made under `policy` while the
/// fused kernels of one device lie (dropped, or a wrong byte behind a
/// clean barrier): the creation's check runs the one-shot on every path,
/// so it must fail every rank with the check's typed error (wrong data,
/// a barrier that timed out, or a peer's failure naming the check), the
/// fault must have fired, and under `Auto` the error must show that the
/// ranks fell back to the staged path and checked it too (the reason of a
/// rank's wrong data says so).
fn judge_per_rank(policy: PathPolicy, made: &[Result<(), Error>], fired: i64) -> Result<(), String> {
    fired_in_case(fired)?;
    let mut fell_back = false;
    for (r, m) in made.iter().enumerate() {
        match m {
            Err(Error::P2pUnavailable { reason, .. }) => fell_back |= reason.contains("on the staged path, after the P2P path failed the check too"),
            Err(Error::PeerTimeout { .. } | Error::Bootstrap { op: "communicator: verification", .. }) => {}
            Err(e) => return Err(format!("rank {r}: expected the check's error, got {e:?}")),
            Ok(()) => return Err(format!("rank {r}: made a communicator whose one-shot lies")),
        }
    }
    if policy == PathPolicy::Auto && !fell_back {
        return Err("under Auto no rank's error shows the fallback to the staged path".into());
    }
    Ok(())
}

/// Per-rank communicators (`cuda_peer::Comm`, thread ranks) under a lie of
/// the fused kernels on one device (`drop-sm-stores=N`,
/// `corrupt-fused-results=N`): every path policy's creation fails with the
/// check's typed error (Auto after falling back to the staged path, whose
/// one-shot meets the lie too), never a communicator that gives wrong
/// answers, a panic or a hang. The control: with the check off, the lie
/// reaches an all-reduce's results on the faulted device.
#[test]
fn per_rank_comms_under_lying_fused_kernels_fail_their_check() {
    const T: &str = "per_rank_comms_under_lying_fused_kernels_fail_their_check";
    let Some((shim, ctxs)) = under(T, |m| m.starts_with("drop-sm-stores=") || m.starts_with("corrupt-fused-results=")) else { return };
    let device: usize =
        shim.mode.rsplit('=').next().and_then(|d| d.parse().ok()).unwrap_or_else(|| panic!("{}: <mode>=<ordinal> expected", shim.mode));
    if !common::has_gpus(T, &format!("{} (device {device})", shim.mode), ctxs.len(), device + 1) {
        return;
    }
    let corrupt = shim.mode.starts_with("corrupt-fused-results=");
    bounded(T, move || {
        let streams: Vec<Arc<CudaStream>> = (0..2).map(|r| ctxs[r % ctxs.len()].new_stream().unwrap()).collect();
        let opts = |policy| CommOptions::default().path(policy).share_devices(true).barrier_timeout(Duration::from_millis(500));
        let mut failures = Vec::new();
        for policy in POLICIES {
            let before = shim.fired();
            let made: Vec<Result<(), Error>> = common::ranks::made_each(&streams, &opts(policy)).into_iter().map(|m| m.map(drop)).collect();
            let fired = shim.fired() - before;
            say(&format!("  [{}] per-rank {policy:?}: {made:?} (faults fired: {fired})", shim.mode));
            if let Err(why) = judge_per_rank(policy, &made, fired) {
                failures.push(format!("{policy:?}: {why}"));
            }
        }
        assert!(failures.is_empty(), "[{}] per-rank cases:\n  {}", shim.mode, failures.join("\n  "));

        // The control: unchecked, the faulted device's ranks get wrong results.
        let comms: Vec<Comm> = common::ranks::made_each(&streams, &opts(PathPolicy::Auto).verify(false))
            .into_iter()
            .map(|m| m.expect("an unchecked communicator"))
            .collect();
        let n = 1000;
        let ins: Vec<Vec<u32>> = (0..2).map(|_| random_u32(n)).collect();
        let want: Vec<u32> = (0..n).map(|i| ins[0][i].wrapping_add(ins[1][i])).collect();
        let got: Vec<Option<Vec<u32>>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .zip(&ins)
                .map(|(c, x)| {
                    s.spawn(move || {
                        let mut buf = c.stream().clone_htod(x).unwrap();
                        c.all_reduce_in_place(&mut buf, ReduceOp::Sum).ok()?;
                        c.synchronize().ok()?;
                        Some(c.stream().clone_dtoh(&buf).unwrap())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("a rank's thread")).collect()
        });
        let on_device: Vec<usize> = (0..2).filter(|r| r % ctxs.len() == device).collect();
        let wrong: Vec<(usize, usize, Option<usize>)> = on_device
            .iter()
            .filter_map(|&r| got[r].as_ref().map(|g| (r, (0..n).filter(|&i| g[i] != want[i]).count(), (0..n).find(|&i| g[i] != want[i]))))
            .collect();
        say(&format!("  [{}] per-rank, check off: (rank, wrong, first) {wrong:?}", shim.mode));
        let reached = if corrupt { wrong.iter().any(|w| w.1 == 1 && w.2 == Some(0)) } else { wrong.iter().any(|w| w.1 > 0) };
        assert!(reached, "{T}: [{}] unchecked, no rank on device {device} got the lie's wrong result: {wrong:?}", shim.mode);
        drop(comms);
        finished(T, &shim);
    });
}

#[test]
fn failed_module_load_is_an_error_and_leaves_the_rest_working() {
    const T: &str = "failed_module_load_is_an_error_and_leaves_the_rest_working";
    let Some((shim, ctxs, bad)) = under_device(T, "fail-module-load=", Some(2)) else { return };
    // Where there is one GPU, every group's ranks are on the bad device,
    // and there is no good device.
    let good =
        common::has_gpus(T, "a group on the good device and a link between two devices", ctxs.len(), 2).then_some(if bad == 0 { 1 } else { 0 });
    bounded(T, move || {
        let mode = shim.mode.clone();
        // Every group with a rank on the bad device fails to be created,
        // with the driver's error by name, each having met the fault itself
        // (nothing caches a failed load).
        let judge = |_: Case, o: &Outcome, fired: i64| {
            fired_in_case(fired)?;
            match o {
                Outcome::Failed(Error::Driver { op, name, .. }) if op.contains("cuModuleLoadData") && name == "CUDA_ERROR_OUT_OF_MEMORY" => Ok(()),
                other => Err(format!("expected the module load's error, got {}", other.short())),
            }
        };
        if sweep(T, &shim, &ctxs, &group_cases(), Isolation::InProcess, judge) == Ran::One {
            return;
        }
        // Two ranks on the good device alone: exact, and the fault stays on its device.
        if let Some(good) = good {
            let streams: Vec<Arc<CudaStream>> = (0..2).map(|_| ctxs[good].new_stream().unwrap()).collect();
            for algorithm in [Algorithm::Auto, Algorithm::Ring] {
                let before = shim.fired();
                let o = group_case(&streams, &group_opts(PathPolicy::Auto, algorithm));
                let fired = shim.fired() - before;
                say(&format!("  [{mode}] two ranks on device {good}, {algorithm:?}: {} (faults fired: {fired})", o.short()));
                assert!(matches!(o, Outcome::Correct(_)), "a group on device {good} alone: {}", o.short());
                assert_eq!(fired, 0, "{T}: a group on device {good} alone met the fault of device {bad}");
            }
        }
        // Plain cudarc work on the bad device's context still works.
        let s = ctxs[bad].new_stream().unwrap();
        let data = common::random_bytes(1 << 20);
        let buf = s.clone_htod(&data).unwrap();
        let copy = s.clone_dtod(&buf).unwrap();
        assert!(s.clone_dtoh(&copy).unwrap() == data, "a device-to-device copy on device {bad}");
        // And links (no kernels) between the two devices work.
        if good.is_some() {
            let before = shim.fired();
            let o = link_case(&ctxs, &link_opts(PathPolicy::Auto));
            let fired = shim.fired() - before;
            say(&format!("  [{mode}] link 0 -> 1: {} (faults fired: {fired})", o.short()));
            assert!(matches!(o, Outcome::Correct(_)), "a link after the failed loads: {}", o.short());
            assert_eq!(fired, 0, "{T}: a link, which loads no kernel, met the fault");
        }
        say(&format!("  [{mode}] faults injected: {}", shim.fired()));
        finished(T, &shim);
    });
}

/// A link verification whose second direction fails after its peer copy
/// is enqueued, under `fail-call=cuMemcpyDtoHAsync_v2:2@restart` (its
/// readback copy fails) or `fail-call=cuEventRecord:3@cuMemcpyDtoHAsync_v2:2`
/// (the event recorded after the readback fails; the two records before it
/// are cudarc's read guards of the two device buffers, dropped first), each
/// counted from the test's restart of the shim's counts. The link
/// is refused with a typed error that names the call, and nothing the
/// pending copies touch is freed before they are done: the shim holds each
/// copy back on its stream and counts the frees, at the call for the
/// pinned readback buffer (cuMemFreeHost), where they run for the device
/// buffers (cuMemFreeAsync), of memory that a copy not yet done touches.
/// The error is transient: the next link verifies and copies exactly.
#[test]
fn failed_verification_frees_nothing_its_copies_touch() {
    const T: &str = "failed_verification_frees_nothing_its_copies_touch";
    let Some((shim, ctxs)) =
        under_two_gpus(T, |m| matches!(fail_call(m), Some("cuMemcpyDtoHAsync_v2" | "cuEventRecord")), "a link verified between two devices")
    else {
        return;
    };
    bounded(T, move || {
        let call = fail_call(&shim.mode).unwrap_or_default().to_string();
        // cuda-peer names the readback "cuMemcpyDtoHAsync".
        let op = call.trim_end_matches("_v2").to_string();
        shim.restart();
        let (frees, fired, readbacks) = (shim.unsafe_frees(), shim.fired(), shim.calls("cuMemcpyDtoHAsync_v2"));
        let opened = Link::open(&ctxs[0], &ctxs[1], &link_opts(PathPolicy::P2pOnly));
        match &opened {
            Err(Error::P2pUnavailable { reason, .. }) if reason.contains(&format!("{op} failed: CUDA_ERROR_UNKNOWN")) => {
                say(&format!("  [{}] link P2pOnly: {reason}", shim.mode));
            }
            Err(e) => panic!("{T}: expected P2pUnavailable naming {op}'s CUDA_ERROR_UNKNOWN, got {e:?}"),
            Ok(l) => panic!("{T}: the link opened ({:?}) though {call} was to fail (faults fired: {})", l.status(), shim.fired() - fired),
        }
        assert_eq!(shim.fired() - fired, 1, "{T}: one fault");
        assert_eq!(shim.calls("cuMemcpyDtoHAsync_v2") - readbacks, 2, "{T}: one readback per direction");
        // The device buffers' frees run in their streams' order: done once both devices are idle.
        for c in &ctxs[..2] {
            c.synchronize().expect("the devices are idle");
        }
        let unsafe_frees = shim.unsafe_frees() - frees;
        assert_eq!(unsafe_frees, 0, "{T}: {unsafe_frees} buffers freed while a verification copy touching them was pending");
        let again = link_case(&ctxs, &link_opts(PathPolicy::P2pOnly));
        say(&format!("  [{}] link P2pOnly after the fault: {}", shim.mode, again.short()));
        assert!(matches!(&again, Outcome::Correct(_)), "{T}: a transient error left the pair unusable: {}", again.short());
        finished(T, &shim);
    });
}

/// A ring all-reduce on two ranks over P2P whose second all-gather pull
/// fails, under `fail-call=cuMemcpyPeerAsync:2@restart` (armed once the
/// group is created and verified): rank 0's pull (a peer copy
/// reading rank 1's buffer, held back by the shim) is enqueued, rank 1's
/// fails. The call returns that typed error, and by then every rank's
/// stream is ordered after the pulls enqueued that read its buffer: the
/// caller frees both buffers at once (cudarc's stream-ordered cuMemFreeAsync
/// on each buffer's stream), and no free may run while a copy touching the
/// buffer is pending (the shim checks each where it runs). The group still
/// works after the error.
#[test]
fn failed_ring_pull_leaves_no_read_of_a_returned_buffer() {
    const T: &str = "failed_ring_pull_leaves_no_read_of_a_returned_buffer";
    let Some((shim, ctxs)) = under_two_gpus(T, |m| fail_call(m) == Some("cuMemcpyPeerAsync"), "a ring pulling over P2P between two devices") else {
        return;
    };
    bounded(T, move || {
        let streams: Vec<Arc<CudaStream>> = ctxs[..2].iter().map(|c| c.new_stream().unwrap()).collect();
        let group = Group::new(streams.clone(), &group_opts(PathPolicy::P2pOnly, Algorithm::Ring)).expect("a ring group over P2P");
        for r in 0..2 {
            assert_eq!(group.link_status(r).map(|s| s.path), Some(Path::P2p), "{T}: rank {r}'s pull is not P2P");
        }
        let count = (1 << 20) + 5;
        let inputs: Vec<Vec<u32>> = (0..2).map(|_| random_u32(count)).collect();
        let want: Vec<u32> = (0..count).map(|i| inputs[0][i].wrapping_add(inputs[1][i])).collect();
        let mut bufs: Vec<CudaSlice<u32>> = (0..2).map(|r| streams[r].clone_htod(&inputs[r]).unwrap()).collect();
        for s in &streams {
            s.synchronize().unwrap();
        }
        shim.restart();
        let (frees, fired, copies) = (shim.unsafe_frees(), shim.fired(), shim.calls("cuMemcpyPeerAsync"));
        let result = group.all_reduce_in_place(&mut bufs, ReduceOp::Sum);
        // What a caller may do with its buffers once the call has returned.
        drop(bufs);
        match &result {
            Err(Error::Driver { op: "cuMemcpyPeerAsync", name, .. }) if name == "CUDA_ERROR_UNKNOWN" => {}
            other => panic!("{T}: expected cuMemcpyPeerAsync's CUDA_ERROR_UNKNOWN, got {other:?}"),
        }
        assert_eq!(shim.fired() - fired, 1, "{T}: one fault");
        assert_eq!(shim.calls("cuMemcpyPeerAsync") - copies, 2, "{T}: rank 0's all-gather pull, then rank 1's (failed)");
        for s in &streams {
            s.synchronize().expect("the ranks' streams are idle");
        }
        let unsafe_frees = shim.unsafe_frees() - frees;
        assert_eq!(unsafe_frees, 0, "{T}: {unsafe_frees} buffers freed while a ring pull reading them was pending");
        // The next call runs in step again.
        let mut bufs: Vec<CudaSlice<u32>> = (0..2).map(|r| streams[r].clone_htod(&inputs[r]).unwrap()).collect();
        group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).expect("an all-reduce after the failed one");
        group.synchronize().expect("synchronize");
        for r in 0..2 {
            let got = streams[r].clone_dtoh(&bufs[r]).unwrap();
            assert!(common::diff(&got, &want).is_none(), "{T}: rank {r}'s result after the failed call is wrong");
        }
        say(&format!("  [{}] the failed pull's error, no free under a pending pull, then exact results", shim.mode));
        finished(T, &shim);
    });
}

/// The judges themselves (CPU only), fed outcomes that prove nothing or
/// are wrong, which they must reject, beside the right ones, which they
/// must accept: a case that never met its fault, a fault met where it is
/// not on the case's path, a fallback claimed on a P2P pull, a fused
/// algorithm kept by Auto, a refusal of the wrong type or naming the wrong
/// algorithm, and a creation check that failed for another reason than
/// the corrupted element (or on another rank).
#[test]
fn the_fault_judges_reject_cases_that_prove_nothing() {
    let status = |path: Path, verified: Option<bool>| LinkStatus { path, driver_claims_p2p: true, verified, reason: String::new() };
    let group = |links: Vec<LinkStatus>, selected: Selected, mesh: bool, oneshot_on_host: Option<bool>| {
        Outcome::Correct(How { links, selected: vec![selected; COUNTS.len()], mesh, oneshot_on_host })
    };
    let staged = |verified| vec![status(Path::Staged, verified); 2];
    use Algorithm::{Auto, Mesh, OneShot, Ring};
    use PathPolicy::{P2pOnly, StagedOnly};
    let (unavailable, corrupt) = (P2pLie::PeerUnavailable, P2pLie::CorruptCopies);
    // The P2P lies: right outcomes.
    let host = group(staged(None), Selected::OneShot, false, Some(true));
    assert_eq!(judge_p2p_lie(unavailable, Case::Group(PathPolicy::Auto, Auto), &host, 1), Ok(()));
    assert_eq!(judge_p2p_lie(unavailable, Case::Group(StagedOnly, OneShot), &host, 0), Ok(()));
    let ring = group(staged(Some(false)), Selected::Ring, false, None);
    assert_eq!(judge_p2p_lie(corrupt, Case::Group(PathPolicy::Auto, Ring), &ring, 3), Ok(()));
    let refused = Outcome::Failed(Error::PeerUnsupported { from: 1, to: 0 });
    assert_eq!(judge_p2p_lie(unavailable, Case::Group(P2pOnly, Mesh), &refused, 1), Ok(()));
    let no_mesh = Outcome::Failed(Error::AlgorithmUnavailable { algorithm: "mesh", reason: "needs every ring link on P2P".into() });
    assert_eq!(judge_p2p_lie(unavailable, Case::Group(StagedOnly, Mesh), &no_mesh, 0), Ok(()));
    let link = Outcome::Correct(How { links: vec![status(Path::Staged, Some(false))], selected: Vec::new(), mesh: false, oneshot_on_host: None });
    assert_eq!(judge_p2p_lie(corrupt, Case::Link(PathPolicy::Auto), &link, 1), Ok(()));
    // ... and what they must reject.
    let rejects = [
        (unavailable, Case::Group(PathPolicy::Auto, Auto), &host, 0, "a fallback that never met the fault"),
        (unavailable, Case::Group(StagedOnly, OneShot), &host, 1, "StagedOnly meeting the fault"),
        (corrupt, Case::Group(PathPolicy::Auto, Ring), &ring, 0, "a cached verdict reused instead of the case's own"),
        (
            corrupt,
            Case::Group(PathPolicy::Auto, Auto),
            &group(vec![status(Path::P2p, Some(true)); 2], Selected::OneShot, true, Some(false)),
            1,
            "P2P pulls where the fallback is claimed",
        ),
        (
            unavailable,
            Case::Group(PathPolicy::Auto, Auto),
            &group(staged(None), Selected::OneShot, false, Some(false)),
            1,
            "a one-shot in device memory over staged links",
        ),
        (
            corrupt,
            Case::Group(PathPolicy::Auto, Ring),
            &group(staged(None), Selected::Ring, false, None),
            1,
            "a staged pull whose verification did not fail",
        ),
        (corrupt, Case::Group(P2pOnly, Ring), &refused, 1, "the other lie's refusal"),
        (unavailable, Case::Link(P2pOnly), &refused, 1, "a link's refusal naming the reverse direction"),
        (unavailable, Case::Group(P2pOnly, Ring), &ring, 1, "P2pOnly succeeding"),
        (unavailable, Case::Group(StagedOnly, OneShot), &no_mesh, 0, "a refusal of what the group can run"),
    ];
    for (lie, case, o, fired, what) in rejects {
        assert!(judge_p2p_lie(lie, case, o, fired).is_err(), "judge_p2p_lie accepted {what}: {lie:?} {} {} (fired {fired})", case.name(), o.short());
    }
    // The fused faults, on two devices, rank 1 faulted.
    let local = vec![status(Path::P2p, Some(true)); 2];
    let ring = group(local.clone(), Selected::Ring, false, None);
    let unverified = |algorithm: &'static str, reason: &str| Outcome::Failed(Error::FusedUnverified { algorithm, reason: reason.into() });
    let wrong_one = unverified("one-shot", "rank 1: 1 of 16381 results wrong, first at 0 (16381 elements)");
    let timeout =
        unverified("mesh", "rank 0 waited 5s for its peers at call 1 and gave up; the group is out of step (make a new one) (16387 elements)");
    let c = FusedFault::Corrupted { rank: 1 };
    let d = FusedFault::Dropped;
    for fault in [c, d] {
        assert_eq!(judge_fused_fault(fault, Case::Group(PathPolicy::Auto, Auto), &ring, 2), Ok(()));
        assert_eq!(judge_fused_fault(fault, Case::Group(StagedOnly, Ring), &ring, 0), Ok(()));
        assert_eq!(judge_fused_fault(fault, Case::Group(StagedOnly, Mesh), &no_mesh, 0), Ok(()));
        assert_eq!(judge_fused_fault(fault, Case::Group(P2pOnly, OneShot), &wrong_one, 1), Ok(()));
    }
    assert_eq!(judge_fused_fault(d, Case::Group(P2pOnly, Mesh), &timeout, 2), Ok(()));
    let rejects = [
        (c, Case::Group(PathPolicy::Auto, Auto), &ring, 0, "Auto on the ring without having met the fault"),
        (c, Case::Group(PathPolicy::Auto, Ring), &ring, 1, "the ring meeting a fault of fused kernels"),
        (d, Case::Group(PathPolicy::Auto, Auto), &group(local.clone(), Selected::OneShot, true, Some(false)), 2, "Auto keeping its fused algorithms"),
        (d, Case::Group(PathPolicy::Auto, Auto), &group(local.clone(), Selected::Ring, true, None), 2, "Auto keeping the mesh unused"),
        (c, Case::Group(P2pOnly, Mesh), &timeout, 2, "a check failed by its barrier, not its data"),
        (FusedFault::Corrupted { rank: 0 }, Case::Group(P2pOnly, OneShot), &wrong_one, 1, "the wrong-data branch on the other rank"),
        (
            c,
            Case::Group(P2pOnly, OneShot),
            &unverified("one-shot", "rank 1: 2 of 16381 results wrong, first at 0 (16381 elements)"),
            1,
            "two elements wrong",
        ),
        (
            c,
            Case::Group(P2pOnly, OneShot),
            &unverified("one-shot", "rank 1: 1 of 16381 results wrong, first at 4 (16381 elements)"),
            1,
            "another element wrong",
        ),
        (d, Case::Group(P2pOnly, Mesh), &wrong_one, 1, "the check of another algorithm"),
        (d, Case::Group(P2pOnly, OneShot), &wrong_one, 0, "a check failed without the fault"),
        (d, Case::Group(P2pOnly, Mesh), &no_mesh, 0, "a mesh refused where the group has P2P"),
        (d, Case::Group(P2pOnly, OneShot), &refused, 1, "a refusal of P2P"),
    ];
    for (fault, case, o, fired, what) in rejects {
        assert!(
            judge_fused_fault(fault, case, o, fired).is_err(),
            "judge_fused_fault accepted {what}: {fault:?} {} {} (fired {fired})",
            case.name(),
            o.short()
        );
    }
    // A StagedOnly group (on one device too) refuses a forced mesh: a check of it proves nothing.
    assert!(judge_fused_fault(d, Case::Group(StagedOnly, Mesh), &timeout, 2).is_err());
    // The check's reason, as src/algorithms/check.rs writes it.
    assert_eq!(wrong_data("rank 1: 1 of 16387 results wrong, first at 0 (16387 elements)"), Some([1, 1, 16387, 0, 16387]));
    assert_eq!(wrong_data("launching the check failed: x (16387 elements)"), None);
    assert_eq!(first_rank_on(1, 2), 1);
    assert_eq!(first_rank_on(0, 1), 0);
}

/// The per-rank judge refuses what proves nothing: a communicator made,
/// a fault that never fired, an untyped error, and under `Auto` errors
/// that show no fallback.
#[test]
fn the_per_rank_judge_rejects_cases_that_prove_nothing() {
    let wrong = |reason: &str| Err(Error::P2pUnavailable { from: 0, to: 0, reason: reason.into() });
    let timeout = Err(Error::PeerTimeout { rank: 1, call: 0, after: Duration::from_millis(500) });
    let fell_back = wrong("verification all-reduce wrong at 0, on the staged path, after the P2P path failed the check too (...)");
    let first_try = wrong("verification all-reduce wrong at 0");
    assert_eq!(judge_per_rank(PathPolicy::Auto, &[fell_back.clone(), timeout.clone()], 2), Ok(()));
    assert_eq!(judge_per_rank(PathPolicy::P2pOnly, &[first_try.clone(), timeout.clone()], 1), Ok(()));
    assert_eq!(judge_per_rank(PathPolicy::StagedOnly, &[first_try.clone(), first_try.clone()], 1), Ok(()));
    assert!(judge_per_rank(PathPolicy::Auto, &[first_try.clone(), timeout.clone()], 2).is_err(), "no fallback shown");
    assert!(judge_per_rank(PathPolicy::Auto, &[fell_back.clone(), timeout.clone()], 0).is_err(), "the fault never fired");
    assert!(judge_per_rank(PathPolicy::P2pOnly, &[Ok(()), Ok(())], 1).is_err(), "made");
    assert!(judge_per_rank(PathPolicy::P2pOnly, &[first_try, Err(Error::Internal("x".into()))], 1).is_err(), "untyped");
}

/// The shim builds (no CUDA needed), exports exactly its overrides, and
/// layers over a pretend driver as it must over the real one (one handle
/// for both names, overrides first, everything else passed through,
/// cuGetProcAddress handing out the overrides): `tests/fakecuda/selftest.sh`.
/// Skips where there is no gcc, unless `CUDA_PEER_FAKE_EXPECTED=1`.
#[test]
fn fakecuda_shim_builds_and_layers() {
    // From the repository root (the GPU runner's working directory), else
    // where the crate was built.
    let here = std::path::Path::new("tests/fakecuda/selftest.sh");
    let script = if here.exists() { here.to_path_buf() } else { std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(here) };
    let have_gcc = std::process::Command::new("gcc").arg("--version").output().is_ok_and(|o| o.status.success());
    if !have_gcc {
        assert!(!expected(), "CUDA_PEER_FAKE_EXPECTED=1 but there is no gcc to build the shim");
        say("SKIPPED fakecuda_shim_builds_and_layers: no gcc");
        return;
    }
    let out = std::env::temp_dir().join(format!("cuda-peer-fakecuda-selftest-{}", std::process::id()));
    let run = std::process::Command::new("bash").arg(&script).arg(&out).output().expect("run selftest.sh");
    let text = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "tests/fakecuda/selftest.sh failed:\n{text}");
    assert!(text.contains("fakecuda: exports and layering ok"), "{text}");
    // The Rust side, in a child process (the driver loads once per
    // process): this binary's `layering_probe` over the pretend driver.
    let exe = std::env::current_exe().expect("this test binary");
    let probe = std::process::Command::new(exe)
        .args(["--ignored", "--exact", "layering_probe", "--nocapture", "--test-threads=1"])
        .env("LD_LIBRARY_PATH", &out)
        .env("CUDA_PEER_FAKE", "off")
        .output()
        .expect("run the probe");
    let _ = std::fs::remove_dir_all(&out);
    let text = format!("{}{}", String::from_utf8_lossy(&probe.stdout), String::from_utf8_lossy(&probe.stderr));
    assert!(probe.status.success() && text.contains("layering probe: ok") && text.contains("1 passed"), "the layering probe failed:\n{text}");
}

/// Run by `fakecuda_shim_builds_and_layers` in a child process whose
/// `LD_LIBRARY_PATH` puts the shim in front of a pretend driver: both
/// cuda-peer-sys's loader and cudarc's open the shim and call its overrides.
#[test]
#[ignore = "run by fakecuda_shim_builds_and_layers in a child process, over a pretend driver"]
fn layering_probe() {
    cuda_peer::driver::api().expect("the pretend driver loads through the shim");
    let shim = find_shim().expect("the library loaded as libcuda.so.1 is the shim");
    assert_eq!(shim.mode, "off");
    same_entry_points("layering_probe", &shim);
    // The pretend driver reports no device: every way to a context is
    // Error::NoDevice (not a driver error, not an ordinal out of range).
    assert_eq!(cuda_peer::driver::device_count(), Ok(0), "the pretend driver's device count");
    assert_eq!(cuda_peer::driver::context(0).err(), Some(cuda_peer::Error::NoDevice), "driver::context(0)");
    assert_eq!(cuda_peer::driver::all_contexts().err(), Some(cuda_peer::Error::NoDevice), "driver::all_contexts()");
    let group = cuda_peer::Group::from_devices(&[0, 1], &cuda_peer::GroupOptions::default());
    assert_eq!(group.err(), Some(cuda_peer::Error::NoDevice), "Group::from_devices");
    say("layering probe: ok");
}
