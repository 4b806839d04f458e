//! The parts that need the driver: the driver's and NVML's answers, the
//! functional checks and speeds (each run in a child process of the doctor,
//! see [`run_child`]), and `--wake`.

use crate::rules::{DriverPair, Outcome, Speeds};
use crate::sysfs::normalize_bdf;
use cuda_peer::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cuda_peer::sys;
use cuda_peer::topology::{self, DeviceInfo};
use cuda_peer::{driver, Algorithm, Error, Group, GroupOptions, Link, LinkOptions, PathPolicy, ReduceOp};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The GPUs as the driver lists them, or why there are none.
pub fn devices() -> Result<Vec<DeviceInfo>, String> {
    let n = driver::device_count().map_err(|e| e.to_string())?;
    if n == 0 {
        return Err(Error::NoDevice.to_string());
    }
    (0..n).map(|i| topology::device_info(i).map_err(|e| e.to_string())).collect()
}

fn p2p_attr(from: usize, to: usize, attr: sys::CUdevice_P2PAttribute) -> Option<i32> {
    let api = driver::api().ok()?;
    let (mut a, mut b, mut v) = (0, 0, 0);
    // SAFETY: each call writes one value; ordinals come from the device count.
    unsafe {
        if api.cuDeviceGet(&mut a, from as i32) != sys::CUresult::CUDA_SUCCESS
            || api.cuDeviceGet(&mut b, to as i32) != sys::CUresult::CUDA_SUCCESS
            || api.cuDeviceGetP2PAttribute(&mut v, attr, a, b) != sys::CUresult::CUDA_SUCCESS
        {
            return None;
        }
    }
    Some(v)
}

/// NVML, if it loads.
pub struct NvmlHandle(pub Result<nvml_wrapper::Nvml, String>);

impl NvmlHandle {
    /// Loads NVML at run time; its absence is a note, not a failure.
    pub fn init() -> Self {
        NvmlHandle(nvml_wrapper::Nvml::init().map_err(|e| format!("NVML unavailable: {e}")))
    }

    /// NVML's P2P status per capability and the common ancestor of `a` -> `b` (bus ids).
    pub fn pair(&self, a: &str, b: &str) -> (Vec<(String, String)>, Option<String>) {
        use nvml_wrapper::enum_wrappers::device::P2pCapabilitiesIndex as I;
        let Ok(nvml) = &self.0 else {
            return (Vec::new(), None);
        };
        let (Ok(da), Ok(db)) = (nvml.device_by_pci_bus_id(a), nvml.device_by_pci_bus_id(b)) else {
            return (Vec::new(), None);
        };
        let status = [("read", I::Read), ("write", I::Write), ("nvlink", I::NvLink), ("atomics", I::Atomics)]
            .into_iter()
            .map(|(k, i)| (k.to_string(), da.p2p_status(&db, i).map(|s| format!("{s:?}")).unwrap_or_else(|e| format!("error: {e}"))))
            .collect();
        let topo = da.topology_common_ancestor(db).map(|l| format!("{l:?}")).ok();
        (status, topo)
    }

    /// NVML's driver version.
    pub fn driver_version(&self) -> Option<String> {
        self.0.as_ref().ok().and_then(|n| n.sys_driver_version().ok())
    }

    /// GPU and memory utilisation (%) and performance state of the GPU at `bdf`.
    pub fn utilization(&self, bdf: &str) -> Result<(u32, u32, String), String> {
        let nvml = self.0.as_ref().map_err(|e| e.clone())?;
        let d = nvml.device_by_pci_bus_id(bdf).map_err(|e| e.to_string())?;
        let u = d.utilization_rates().map_err(|e| e.to_string())?;
        let p = d.performance_state().map(|p| format!("{p:?}")).unwrap_or_else(|e| e.to_string());
        Ok((u.gpu, u.memory, p))
    }
}

/// The driver's answers for `from` -> `to`, with NVML's.
pub fn driver_pair(from: usize, to: usize, infos: &[DeviceInfo], nvml: &NvmlHandle) -> Result<DriverPair, String> {
    let ab = topology::link_info(from, to).map_err(|e| e.to_string())?;
    let ba = topology::link_info(to, from).map_err(|e| e.to_string())?;
    let bdf = |i: usize| infos.get(i).map(|d| normalize_bdf(&d.pci_bus_id)).unwrap_or_default();
    let (nvml_p2p, nvml_topology) = nvml.pair(&bdf(from), &bdf(to));
    Ok(DriverPair {
        can_access_peer: ab.can_access_peer,
        can_access_peer_back: ba.can_access_peer,
        access_supported: p2p_attr(from, to, sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED).map(|v| v != 0),
        performance_rank: Some(ab.performance_rank),
        native_atomics: Some(ab.native_atomics),
        cuda_array_access: Some(ab.cuda_array_access),
        nvml_p2p,
        nvml_topology,
    })
}

/// One line a child writes: the result of one check or measurement.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ChildLine {
    /// The copy-engine P2P check.
    CopyEngine(Outcome),
    /// The staged-path check.
    Staged(Outcome),
    /// The mesh check.
    Mesh(Outcome),
    /// The one-shot check.
    OneShot(Outcome),
    /// Speeds measured so far.
    Speeds(Speeds),
}

/// Which child to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildKind {
    /// Copy checks and speeds.
    Copy,
    /// Forced mesh all-reduce.
    Mesh,
    /// Forced one-shot all-reduce.
    OneShot,
    /// Both, mesh first, in one process (fewer process starts; the doctor
    /// reruns the one-shot alone when the mesh did not pass, so that a
    /// fault left by the mesh cannot be blamed on it).
    Sm,
}

impl ChildKind {
    /// The name on the hidden command line.
    pub fn name(self) -> &'static str {
        match self {
            ChildKind::Copy => "copy",
            ChildKind::Mesh => "mesh",
            ChildKind::OneShot => "oneshot",
            ChildKind::Sm => "sm",
        }
    }

    /// Parses the name.
    pub fn parse(s: &str) -> Option<Self> {
        [ChildKind::Copy, ChildKind::Mesh, ChildKind::OneShot, ChildKind::Sm].into_iter().find(|k| k.name() == s)
    }
}

/// What came back from a child: its lines, and how it ended if not well.
#[derive(Debug, Clone)]
pub struct ChildResult {
    /// Lines parsed from its stdout.
    pub lines: Vec<ChildLine>,
    /// `None`: exited 0. Else: the timeout, or the exit status and stderr's tail.
    pub failure: Option<Outcome>,
    /// How long it ran.
    pub elapsed: Duration,
}

/// Runs `cuda-peer __check KIND FROM TO --bytes N` as a child of this
/// process (the same binary) and kills it after `timeout`.
pub fn spawn_child(kind: ChildKind, from: usize, to: usize, bytes: usize, timeout: Duration) -> ChildResult {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            return ChildResult {
                lines: Vec::new(),
                failure: Some(Outcome::Error(format!("cannot find own executable: {e}"))),
                elapsed: Duration::ZERO,
            }
        }
    };
    let mut cmd = Command::new(exe);
    cmd.args(["__check", kind.name(), &from.to_string(), &to.to_string(), "--bytes", &bytes.to_string()]);
    // A check never follows an earlier run's verdicts (it forces its paths anyway).
    cmd.env(cuda_peer::verdict::NO_CACHE_ENV, "1");
    run_with_timeout(cmd, timeout)
}

/// Runs `cmd`, collects the [`ChildLine`]s it writes on stdout, and kills
/// it after `timeout`. A child that exits non-zero, is killed by a signal
/// or times out is reported in [`ChildResult::failure`], with the lines it
/// wrote before.
pub fn run_with_timeout(mut cmd: Command, timeout: Duration) -> ChildResult {
    let t = Instant::now();
    let fail = |o: Outcome| ChildResult { lines: Vec::new(), failure: Some(o), elapsed: t.elapsed() };
    let mut child = match cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn() {
        Ok(c) => c,
        Err(e) => return fail(Outcome::Error(format!("cannot start the check process: {e}"))),
    };
    // Drain both pipes on threads so a chatty child cannot block on a full pipe.
    let mut out = child.stdout.take();
    let mut err = child.stderr.take();
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(o) = out.as_mut() {
            let _ = o.read_to_string(&mut s);
        }
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(e) = err.as_mut() {
            let _ = e.read_to_string(&mut s);
        }
        s
    });
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if t.elapsed() >= timeout => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let stdout = out_t.join().unwrap_or_default();
    let stderr = err_t.join().unwrap_or_default();
    let lines = stdout.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let failure = match status {
        None => Some(Outcome::Timeout),
        Some(s) if s.success() => None,
        Some(s) => {
            let tail: String = stderr.lines().rev().take(3).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join(" | ");
            Some(Outcome::Error(format!("check process ended with {s}{}", if tail.is_empty() { String::new() } else { format!(": {tail}") })))
        }
    };
    ChildResult { lines, failure, elapsed: t.elapsed() }
}

fn emit(line: &ChildLine) {
    if let Ok(s) = serde_json::to_string(line) {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{s}");
        let _ = out.flush();
    }
}

/// A small, fast, seeded generator (splitmix64): random patterns without a dependency.
pub struct Rng(u64);

impl Rng {
    /// Seeded from the clock and `salt`.
    pub fn new(salt: u64) -> Self {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        Rng(t ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        v.truncate(n);
        v
    }
}

/// Compares two buffers; `Some("k of n bytes wrong, first at i")` when they differ.
pub fn compare<T: PartialEq>(got: &[T], want: &[T], unit: &str) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} {unit}s back, expected {}", got.len(), want.len()));
    }
    let mut wrong = 0usize;
    let mut first = None;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g != w {
            wrong += 1;
            first.get_or_insert(i);
        }
    }
    first.map(|f| format!("{wrong} of {} {unit}s wrong, first at {f}", want.len()))
}

type R<T> = Result<T, String>;

fn de(op: &'static str) -> impl Fn(cuda_peer::cudarc::driver::DriverError) -> String {
    move |e| Error::driver(op, e.0 as u32).to_string()
}

/// How a copy is made in a speed measurement.
enum Via<'a> {
    Link(&'a mut Link),
    Driver,
}

fn copy_once(via: &mut Via<'_>, src: &CudaSlice<u8>, dst: &mut CudaSlice<u8>, stream: &Arc<CudaStream>) -> R<()> {
    match via {
        Via::Link(l) => l.copy(src, dst, stream).map_err(|e| e.to_string()),
        Via::Driver => stream.memcpy_dtod(src, dst).map_err(de("cuMemcpyDtoDAsync")),
    }
}

/// Copies a random pattern `bytes` long across, compares every byte, then
/// measures bandwidth (GB/s at `bytes`) and the latency of 4-byte copies (us).
fn measure(via: &mut Via<'_>, a: &Arc<CudaContext>, b: &Arc<CudaContext>, bytes: usize, rng: &mut Rng) -> R<(Outcome, Option<(f64, f64)>)> {
    let (sa, sb) = (a.new_stream().map_err(de("cuStreamCreate"))?, b.new_stream().map_err(de("cuStreamCreate"))?);
    let pattern = rng.bytes(bytes);
    let src = sa.clone_htod(&pattern).map_err(de("cuMemcpyHtoD"))?;
    let mut dst = sb.alloc_zeros::<u8>(bytes).map_err(de("cuMemAlloc"))?;
    sa.synchronize().map_err(de("cuStreamSynchronize"))?;
    copy_once(via, &src, &mut dst, &sb)?;
    sb.synchronize().map_err(de("cuStreamSynchronize"))?;
    let got = sb.clone_dtoh(&dst).map_err(de("cuMemcpyDtoH"))?;
    if let Some(w) = compare(&got, &pattern, "byte") {
        return Ok((Outcome::WrongData(w), None));
    }
    let iters = 16;
    let t = Instant::now();
    for _ in 0..iters {
        copy_once(via, &src, &mut dst, &sb)?;
    }
    sb.synchronize().map_err(de("cuStreamSynchronize"))?;
    let gbs = (bytes * iters) as f64 / t.elapsed().as_secs_f64() / 1e9;
    let small = sa.clone_htod(&[1u8, 2, 3, 4]).map_err(de("cuMemcpyHtoD"))?;
    let mut small_dst = sb.alloc_zeros::<u8>(4).map_err(de("cuMemAlloc"))?;
    sa.synchronize().map_err(de("cuStreamSynchronize"))?;
    copy_once(via, &small, &mut small_dst, &sb)?;
    sb.synchronize().map_err(de("cuStreamSynchronize"))?;
    let lat_iters = 200;
    let t = Instant::now();
    for _ in 0..lat_iters {
        copy_once(via, &small, &mut small_dst, &sb)?;
    }
    sb.synchronize().map_err(de("cuStreamSynchronize"))?;
    let lat = t.elapsed().as_secs_f64() * 1e6 / lat_iters as f64;
    Ok((Outcome::Pass, Some((gbs, lat))))
}

fn as_outcome(r: R<(Outcome, Option<(f64, f64)>)>) -> (Outcome, Option<(f64, f64)>) {
    r.unwrap_or_else(|e| (Outcome::Error(e), None))
}

/// The copy child: the driver's own copy without peer access (measured
/// first, before anything enables peer access), the staged path, then the
/// copy-engine P2P path, each checked byte for byte and timed.
fn child_copy(from: usize, to: usize, bytes: usize) -> R<()> {
    let a = driver::context(from).map_err(|e| e.to_string())?;
    let b = driver::context(to).map_err(|e| e.to_string())?;
    let mut rng = Rng::new((from * 31 + to) as u64);
    let mut speeds = Speeds { bytes, ..Default::default() };
    if let (_, Some((g, l))) = as_outcome(measure(&mut Via::Driver, &a, &b, bytes, &mut rng)) {
        speeds.driver_gbs = Some(g);
        speeds.driver_lat_us = Some(l);
    }
    emit(&ChildLine::Speeds(speeds.clone()));
    let staged = match Link::open(&a, &b, &LinkOptions::with_policy(PathPolicy::StagedOnly)) {
        Ok(mut link) => as_outcome(measure(&mut Via::Link(&mut link), &a, &b, bytes, &mut rng)),
        Err(e) => (Outcome::Error(e.to_string()), None),
    };
    if let Some((g, l)) = staged.1 {
        speeds.staged_gbs = Some(g);
        speeds.staged_lat_us = Some(l);
    }
    emit(&ChildLine::Staged(staged.0));
    emit(&ChildLine::Speeds(speeds.clone()));
    let p2p = match Link::open(&a, &b, &LinkOptions::with_policy(PathPolicy::P2pOnly)) {
        Ok(mut link) => as_outcome(measure(&mut Via::Link(&mut link), &a, &b, bytes, &mut rng)),
        Err(e @ Error::PeerUnsupported { .. }) => (Outcome::Skipped(format!("peer access could not be enabled: {e}")), None),
        Err(Error::P2pUnavailable { reason, .. }) if reason.contains("wrong") => (Outcome::WrongData(reason), None),
        Err(e) => (Outcome::Error(e.to_string()), None),
    };
    if let Some((g, l)) = p2p.1 {
        speeds.p2p_gbs = Some(g);
        speeds.p2p_lat_us = Some(l);
    }
    emit(&ChildLine::CopyEngine(p2p.0));
    emit(&ChildLine::Speeds(speeds));
    Ok(())
}

/// The all-reduce child: a 2-rank group (`from`, `to`) with `algorithm`
/// forced and P2P only; random u32 data, checked exactly against a CPU
/// wrapping sum on both ranks.
fn child_allreduce(from: usize, to: usize, algorithm: Algorithm) -> Outcome {
    let opts = GroupOptions::with_policy(PathPolicy::P2pOnly).algorithm(algorithm);
    let group = match Group::from_devices(&[from, to], &opts) {
        Ok(g) => g,
        Err(e @ Error::PeerUnsupported { .. }) => return Outcome::Skipped(format!("peer access could not be enabled: {e}")),
        Err(e) => return Outcome::Error(e.to_string()),
    };
    let run = || -> R<Outcome> {
        let mut rng = Rng::new((from * 131 + to) as u64);
        // 4 MiB and an odd tail, so vector and scalar paths both run.
        let n = (1 << 20) + 37;
        let chosen = group.all_reduce_algorithm(n * 4);
        if chosen != algorithm {
            return Ok(Outcome::Error(format!("the group runs {chosen:?} instead of the forced {algorithm:?}")));
        }
        let inputs: Vec<Vec<u32>> = (0..2).map(|_| (0..n).map(|_| rng.next_u64() as u32).collect()).collect();
        let want: Vec<u32> = (0..n).map(|i| inputs[0][i].wrapping_add(inputs[1][i])).collect();
        let mut bufs = Vec::new();
        for (r, input) in inputs.iter().enumerate() {
            let s = group.stream(r).ok_or("no stream")?;
            bufs.push(s.clone_htod(input).map_err(de("cuMemcpyHtoD"))?);
        }
        for r in 0..2 {
            group.stream(r).ok_or("no stream")?.synchronize().map_err(de("cuStreamSynchronize"))?;
        }
        group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).map_err(|e| e.to_string())?;
        group.synchronize().map_err(|e| e.to_string())?;
        let mut wrong = Vec::new();
        for (r, buf) in bufs.iter().enumerate() {
            let got = group.stream(r).ok_or("no stream")?.clone_dtoh(buf).map_err(de("cuMemcpyDtoH"))?;
            if let Some(w) = compare(&got, &want, "element") {
                wrong.push(format!("rank {r} (GPU {}): {w}", [from, to][r]));
            }
        }
        Ok(if wrong.is_empty() { Outcome::Pass } else { Outcome::WrongData(wrong.join("; ")) })
    };
    run().unwrap_or_else(Outcome::Error)
}

/// The hidden `__check` subcommand: runs one child's checks and writes one
/// JSON line per result on stdout. Returns the exit status.
pub fn run_child(kind: ChildKind, from: usize, to: usize, bytes: usize) -> i32 {
    match kind {
        ChildKind::Copy => match child_copy(from, to, bytes) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("{e}");
                3
            }
        },
        ChildKind::Mesh => {
            emit(&ChildLine::Mesh(child_allreduce(from, to, Algorithm::Mesh)));
            0
        }
        ChildKind::OneShot => {
            emit(&ChildLine::OneShot(child_allreduce(from, to, Algorithm::OneShot)));
            0
        }
        ChildKind::Sm => {
            emit(&ChildLine::Mesh(child_allreduce(from, to, Algorithm::Mesh)));
            emit(&ChildLine::OneShot(child_allreduce(from, to, Algorithm::OneShot)));
            0
        }
    }
}

/// One GPU's `--wake` report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Wake {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// Bus id.
    pub bdf: String,
    /// GPU %, memory %, performance state before.
    pub before: Result<(u32, u32, String), String>,
    /// Creating, using and destroying a context.
    pub context: Result<f64, String>,
    /// GPU %, memory %, performance state after.
    pub after: Result<(u32, u32, String), String>,
}

/// Creates a context on each GPU, touches its memory, destroys it, and
/// reports NVML's utilisation before and after.
pub fn wake(infos: &[DeviceInfo], nvml: &NvmlHandle) -> Vec<Wake> {
    infos
        .iter()
        .map(|d| {
            let bdf = normalize_bdf(&d.pci_bus_id);
            let before = nvml.utilization(&bdf);
            let t = Instant::now();
            let context = (|| -> R<f64> {
                let ctx = driver::context(d.ordinal).map_err(|e| e.to_string())?;
                let s = ctx.default_stream();
                let buf = s.alloc_zeros::<u8>(1 << 20).map_err(de("cuMemAlloc"))?;
                s.synchronize().map_err(de("cuStreamSynchronize"))?;
                drop(buf);
                drop(ctx);
                Ok(t.elapsed().as_secs_f64() * 1e3)
            })();
            std::thread::sleep(Duration::from_millis(100));
            let after = nvml.utilization(&bdf);
            Wake { ordinal: d.ordinal, bdf, before, context, after }
        })
        .collect()
}
