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
//! - `fail-call=NAME:N[@AFTER:M|@restart]`: the Nth call of one driver
//!   entry point (after the Mth of another, or after the test arms it)
//!   fails, every asynchronous copy is held back
//!   a little on its stream, and the shim counts frees of memory that a
//!   copy not yet done touches. Under it, an error part way through a link
//!   verification or a ring all-reduce must be typed, name the call, and
//!   leave nothing pending that reads or writes memory freed after the
//!   error is returned.
//!
//! Under each, links and groups (every algorithm, Auto and forced; every
//! path policy) must give either exact results (checked against the CPU),
//! through a verified fallback where the lie is found, or a typed error:
//! never a wrong answer, a panic or a hang (each test runs under a
//! watchdog). Controls check that each fault really fires (the shim counts
//! them) and that, with verification turned off, the corruption really
//! reaches the results, so the passing cases are not vacuous.
//!
//! `tests/fakecuda/run.sh` runs this binary once per mode. Groups lay their
//! two ranks round robin over the GPUs (both on device 0 where there is
//! one). The faults of peer access and peer copies, links between two
//! devices, a ring pulling over P2P, and a fault on a device that is not
//! there (`drop-sm-stores=1` on one GPU) need two GPUs and say SKIPPED
//! with one; `drop-sm-stores=0` and `fail-module-load=0` run their group
//! cases on one. Without the shim (or without a GPU) the GPU tests skip;
//! with `CUDA_PEER_REQUIRE_GPU=1` and `CUDA_PEER_FAKE_EXPECTED=1` they fail
//! instead. The CPU test at the
//! end builds the shim and runs its self-test where gcc is available.

mod common;

use cuda_peer::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cuda_peer::{Algorithm, Error, Group, GroupOptions, Link, LinkOptions, Path, PathPolicy, ReduceOp};
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

/// What one case did.
#[derive(Debug)]
enum Outcome {
    /// Every result exact; how it got there.
    Correct(String),
    /// A typed error.
    Failed(Error),
    /// Results differ from the CPU's.
    Wrong(String),
}

impl Outcome {
    fn short(&self) -> String {
        match self {
            Outcome::Correct(how) => format!("correct ({how})"),
            Outcome::Failed(e) => format!("error: {e}"),
            Outcome::Wrong(what) => format!("WRONG ANSWER: {what}"),
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
            return Outcome::Wrong(format!("{:?} link, {n} bytes: {wrong} wrong, first at {first}", link.path()));
        }
    }
    let st = link.status();
    Outcome::Correct(format!("{} link: {}", link.path(), st.reason))
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
    let mut used = Vec::new();
    for count in COUNTS {
        used.push(format!("{:?}", group.all_reduce_algorithm(count * 4)));
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
                return Outcome::Wrong(format!("u32 in place, count {count}, rank {r}: {wrong} wrong, first at {first}"));
            }
        }
        let inputs: Vec<Vec<f32>> = (0..n).map(|_| small_f32(count)).collect();
        let want: Vec<f32> = (0..count).map(|i| inputs.iter().map(|v| v[i]).sum()).collect();
        let send: Vec<CudaSlice<f32>> = (0..n).map(|r| streams[r].clone_htod(&inputs[r]).unwrap()).collect();
        let mut recv: Vec<CudaSlice<f32>> = (0..n).map(|r| streams[r].clone_htod(&vec![f32::NAN; count]).unwrap()).collect();
        if let Err(e) = group.all_reduce(&send, &mut recv, ReduceOp::Sum) {
            return Outcome::Failed(e);
        }
        if let Err(e) = group.synchronize() {
            return Outcome::Failed(e);
        }
        for r in 0..n {
            let got = streams[r].clone_dtoh(&recv[r]).unwrap();
            if let Some(i) = got.iter().zip(&want).position(|(a, b)| a.to_bits() != b.to_bits()) {
                return Outcome::Wrong(format!("f32 out of place, count {count}, rank {r}: first wrong at {i}: {} instead of {}", got[i], want[i]));
            }
        }
    }
    let paths: Vec<String> = (0..n).filter_map(|r| group.link_status(r).map(|s| s.path.to_string())).collect();
    Outcome::Correct(format!("pulls {paths:?}, algorithms {used:?}"))
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

/// Every (policy, algorithm) group of two ranks on devices 0 and 1 (both
/// on device 0 where there is one GPU); `judge` says whether each outcome
/// is acceptable (`Err(why)` fails the test after all cases ran). A wrong
/// answer always fails.
fn every_group(mode: &str, ctxs: &[Arc<CudaContext>], judge: impl Fn(PathPolicy, Algorithm, &Outcome) -> Result<(), String>) {
    let streams: Vec<Arc<CudaStream>> = (0..2).map(|r| ctxs[r % ctxs.len()].new_stream().unwrap()).collect();
    let mut failures = Vec::new();
    for policy in POLICIES {
        for algorithm in ALGORITHMS {
            // Field by field (builds if the options become #[non_exhaustive]).
            let mut opts = group_opts(policy, algorithm);
            opts.barrier_timeout = Duration::from_secs(5);
            let outcome = group_case(&streams, &opts);
            say(&format!("  [{mode}] group policy {policy:?}, algorithm {algorithm:?}: {}", outcome.short()));
            let verdict = match &outcome {
                Outcome::Wrong(w) => Err(format!("a wrong answer: {w}")),
                o => judge(policy, algorithm, o),
            };
            if let Err(why) = verdict {
                failures.push(format!("policy {policy:?}, algorithm {algorithm:?}: {why}"));
            }
        }
    }
    assert!(failures.is_empty(), "[{mode}] groups:\n  {}", failures.join("\n  "));
}

/// An error that says, by its type, that peer access or P2P is not to be
/// had, or that the requested algorithm is impossible without it.
fn is_no_p2p(e: &Error) -> bool {
    matches!(e, Error::PeerUnsupported { .. } | Error::P2pUnavailable { .. } | Error::FusedUnverified { .. } | Error::AlgorithmUnavailable { .. })
}

/// The verdict shared by the two P2P lies: Auto policy must fall back and
/// be exact (with every algorithm but a forced mesh, which needs P2P);
/// P2pOnly must be a typed error; StagedOnly must be exact except a forced
/// mesh (a typed error).
fn judge_p2p_lie(policy: PathPolicy, algorithm: Algorithm, o: &Outcome) -> Result<(), String> {
    let needs_p2p = policy == PathPolicy::P2pOnly || algorithm == Algorithm::Mesh;
    match o {
        Outcome::Correct(_) if !needs_p2p => Ok(()),
        Outcome::Failed(e) if needs_p2p && is_no_p2p(e) => Ok(()),
        Outcome::Correct(how) => Err(format!("succeeded ({how}) where P2P is not to be had")),
        Outcome::Failed(e) if needs_p2p => Err(format!("not a typed no-P2P error: {e:?}")),
        Outcome::Failed(e) => Err(format!("expected a verified fallback with exact results, got: {e}")),
        Outcome::Wrong(w) => Err(w.clone()),
    }
}

/// Link cases shared by the two P2P lies.
fn links_under_p2p_lie(mode: &str, ctxs: &[Arc<CudaContext>], want_unverified: bool) {
    let auto = link_case(ctxs, &link_opts(PathPolicy::Auto));
    say(&format!("  [{mode}] link policy Auto: {}", auto.short()));
    assert!(matches!(&auto, Outcome::Correct(how) if how.starts_with("staged")), "[{mode}] link Auto: {}", auto.short());
    let only = link_case(ctxs, &link_opts(PathPolicy::P2pOnly));
    say(&format!("  [{mode}] link policy P2pOnly: {}", only.short()));
    assert!(matches!(&only, Outcome::Failed(e) if is_no_p2p(e)), "[{mode}] link P2pOnly: {}", only.short());
    let staged = link_case(ctxs, &link_opts(PathPolicy::StagedOnly));
    say(&format!("  [{mode}] link policy StagedOnly: {}", staged.short()));
    assert!(matches!(&staged, Outcome::Correct(_)), "[{mode}] link StagedOnly: {}", staged.short());
    // The status tells the lie apart from a driver that says no.
    let link = Link::open(&ctxs[0], &ctxs[1], &link_opts(PathPolicy::Auto)).expect("an Auto link");
    let st = link.status();
    assert_eq!(st.path, Path::Staged, "[{mode}]");
    assert!(st.driver_claims_p2p, "[{mode}] the shim claims P2P, the status should say so: {st:?}");
    if want_unverified {
        assert_eq!(st.verified, Some(false), "[{mode}] the verification should have failed: {st:?}");
    }
}

#[test]
fn peer_unavailable_falls_back_or_errors() {
    const T: &str = "peer_unavailable_falls_back_or_errors";
    let Some((shim, ctxs)) = under(T, |m| m == "peer-unavailable") else { return };
    if !common::has_gpus(T, "peer access between two devices", ctxs.len(), 2) {
        return;
    }
    bounded(T, move || {
        links_under_p2p_lie("peer-unavailable", &ctxs, false);
        every_group("peer-unavailable", &ctxs, judge_p2p_lie);
        assert!(shim.fired() > 0, "the shim never refused peer access: the test proved nothing");
        say(&format!("  [peer-unavailable] faults injected: {}", shim.fired()));
    });
}

#[test]
fn corrupt_peer_copies_are_caught() {
    const T: &str = "corrupt_peer_copies_are_caught";
    let Some((shim, ctxs)) = under(T, |m| m == "corrupt-peer-copies") else { return };
    if !common::has_gpus(T, "peer copies between two devices", ctxs.len(), 2) {
        return;
    }
    bounded(T, move || {
        links_under_p2p_lie("corrupt-peer-copies", &ctxs, true);
        every_group("corrupt-peer-copies", &ctxs, judge_p2p_lie);
        assert!(shim.fired() > 0, "the shim never corrupted a copy: the test proved nothing");
        say(&format!("  [corrupt-peer-copies] faults injected: {}", shim.fired()));
    });
}

/// The control: with verification turned off (the caller's promise that
/// P2P works), the corruption reaches a P2P link's copies and the ring's
/// results, so the shim's corruption is on the paths the library uses and
/// the passing cases above are not vacuous.
#[test]
fn corrupt_peer_copies_reach_unverified_p2p() {
    const T: &str = "corrupt_peer_copies_reach_unverified_p2p";
    let Some((shim, ctxs)) = under(T, |m| m == "corrupt-peer-copies") else { return };
    if !common::has_gpus(T, "peer copies between two devices", ctxs.len(), 2) {
        return;
    }
    bounded(T, move || {
        let mut link = link_opts(PathPolicy::P2pOnly);
        link.verify = false;
        let o = link_case(&ctxs, &link);
        say(&format!("  [corrupt-peer-copies, verify off] link P2pOnly: {}", o.short()));
        assert!(matches!(o, Outcome::Wrong(_)), "with verification off the shim's corruption should show: {}", o.short());
        let streams: Vec<Arc<CudaStream>> = ctxs[..2].iter().map(|c| c.new_stream().unwrap()).collect();
        let mut opts = GroupOptions::with_policy(PathPolicy::P2pOnly);
        opts.algorithm = Algorithm::Ring;
        opts.link = link;
        let o = group_case(&streams, &opts);
        say(&format!("  [corrupt-peer-copies, verify off] ring over P2P: {}", o.short()));
        assert!(matches!(o, Outcome::Wrong(_)), "with verification off the ring's P2P copies should be corrupt: {}", o.short());
        assert!(shim.fired() > 0);
    });
}

/// Fused kernels that never deliver (the shim drops every one-shot and
/// mesh launch on one device, as when a pair's SM peer stores are lost
/// while its copy engines work): the check at group creation catches it,
/// Auto groups run the ring (exact), forced fused algorithms are a typed
/// error; never a wrong answer or a hang.
#[test]
fn dropped_sm_stores_leave_the_ring_or_a_typed_error() {
    const T: &str = "dropped_sm_stores_leave_the_ring_or_a_typed_error";
    let Some((shim, ctxs)) = under(T, |m| m.starts_with("drop-sm-stores=")) else { return };
    let dropped: usize = shim.mode["drop-sm-stores=".len()..].parse().expect("drop-sm-stores=<ordinal>");
    if !common::has_gpus(T, &format!("{} (device {dropped})", shim.mode), ctxs.len(), dropped + 1) {
        return;
    }
    bounded(T, move || {
        let mode = shim.mode.clone();
        every_group(&mode, &ctxs, |_, algorithm, o| match (algorithm, o) {
            (Algorithm::Mesh | Algorithm::OneShot, Outcome::Failed(e)) if is_no_p2p(e) => Ok(()),
            (Algorithm::Auto, Outcome::Correct(how)) if how.contains("OneShot") || how.contains("Mesh") => {
                Err(format!("Auto kept a fused algorithm whose kernels never ran: {how}"))
            }
            (Algorithm::Auto | Algorithm::Ring, Outcome::Correct(_)) => Ok(()),
            (_, other) => Err(format!("expected the ring's exact result or a typed refusal, got {}", other.short())),
        });
        assert!(shim.fired() > 0, "the shim never dropped a launch: the test proved nothing");
        say(&format!("  [{mode}] launches dropped: {}", shim.fired()));
    });
}

#[test]
fn failed_module_load_is_an_error_and_leaves_the_rest_working() {
    const T: &str = "failed_module_load_is_an_error_and_leaves_the_rest_working";
    let Some((shim, ctxs)) = under(T, |m| m.starts_with("fail-module-load=")) else { return };
    let bad: usize = shim.mode["fail-module-load=".len()..].parse().expect("fail-module-load=<ordinal>");
    assert!(bad < 2, "fail-module-load={bad}: the groups here are on devices 0 and 1");
    if !common::has_gpus(T, &format!("{} (device {bad})", shim.mode), ctxs.len(), bad + 1) {
        return;
    }
    // Where there is one GPU, every group's ranks are on the bad device,
    // and there is no good device.
    let good =
        common::has_gpus(T, "a group on the good device and a link between two devices", ctxs.len(), 2).then_some(if bad == 0 { 1 } else { 0 });
    bounded(T, move || {
        let mode = shim.mode.clone();
        // Every group with a rank on the bad device fails to be created,
        // with the driver's error by name.
        every_group(&mode, &ctxs, |_, _, o| match o {
            Outcome::Failed(Error::Driver { op, name, .. }) if op.contains("cuModuleLoadData") && name == "CUDA_ERROR_OUT_OF_MEMORY" => Ok(()),
            other => Err(format!("expected the module load's error, got {}", other.short())),
        });
        assert!(shim.fired() > 0, "the shim never failed a module load: the test proved nothing");
        // Two ranks on the good device alone: exact.
        if let Some(good) = good {
            let streams: Vec<Arc<CudaStream>> = (0..2).map(|_| ctxs[good].new_stream().unwrap()).collect();
            for algorithm in [Algorithm::Auto, Algorithm::Ring] {
                let o = group_case(&streams, &group_opts(PathPolicy::Auto, algorithm));
                say(&format!("  [{mode}] two ranks on device {good}, {algorithm:?}: {}", o.short()));
                assert!(matches!(o, Outcome::Correct(_)), "a group on device {good} alone: {}", o.short());
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
            let o = link_case(&ctxs, &link_opts(PathPolicy::Auto));
            say(&format!("  [{mode}] link 0 -> 1: {}", o.short()));
            assert!(matches!(o, Outcome::Correct(_)), "a link after the failed loads: {}", o.short());
        }
        say(&format!("  [{mode}] faults injected: {}", shim.fired()));
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
    let Some((shim, ctxs)) = under(T, |m| matches!(fail_call(m), Some("cuMemcpyDtoHAsync_v2" | "cuEventRecord"))) else { return };
    if !common::has_gpus(T, "a link verified between two devices", ctxs.len(), 2) {
        return;
    }
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
    let Some((shim, ctxs)) = under(T, |m| fail_call(m) == Some("cuMemcpyPeerAsync")) else { return };
    if !common::has_gpus(T, "a ring pulling over P2P between two devices", ctxs.len(), 2) {
        return;
    }
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
    });
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
    say("layering probe: ok");
}
