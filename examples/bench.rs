//! Collective and copy benchmark: cuda-peer's rings (P2P and staged) against
//! NCCL (with and without P2P), in the style of nccl-tests, every point
//! checked against a CPU reference. See `bench/README.md`.
//!
//!     cargo build --release --examples --features nccl
//!     target/release/examples/bench [--ops all_reduce,reduce_scatter,all_gather,broadcast]
//!         [--dtypes f32,bf16] [--min-bytes 4] [--max-bytes 1073741824]
//!         [--impls cuda-peer-p2p,cuda-peer-staged,nccl,nccl-no-p2p] [--iters N] [--warmup N]
//!         [--machine NAME] [--out bench/results] [--copy] [--quick] [--nccl-lib PATH]
//!
//! Conventions are nccl-tests': one rank per GPU; `bytes` is the per-rank
//! buffer for all_reduce and broadcast, the send buffer (N blocks) for
//! reduce_scatter and the receive buffer (N blocks) for all_gather; `count`
//! is the element count passed to the call (for reduce_scatter the receive
//! count, for all_gather the send count); algbw = bytes / time and busbw =
//! algbw * 2(N-1)/N (all_reduce), (N-1)/N (reduce_scatter, all_gather), 1
//! (broadcast). all_reduce and broadcast (root 0) run in place, the others
//! out of place, for every implementation.
//!
//! NCCL runs in a child process per implementation (this program, run
//! again with a hidden `--child-report`): NCCL reads `NCCL_P2P_DISABLE` once
//! per process (it caches it in a static at the first communicator), so
//! `nccl` and `nccl-no-p2p` cannot share one. The parent never loads NCCL.

use clap::{Parser, ValueEnum};
use cuda_peer::copy::{Link, LinkOptions, PathPolicy};
use cuda_peer::cudarc::driver::{sys as cu, CudaContext, CudaGraph, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cuda_peer::{driver, Algorithm, Element, Group, GroupOptions, ReduceOp};
use half::bf16;
use rand::Rng;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
/// Bytes moved per timed point, at most (more only where `MIN_ITERS` needs it).
const BYTES_PER_POINT: usize = 2 * GIB;
const MIN_ITERS: usize = 5;
const MAX_ITERS: usize = 200;
/// Outputs up to this size are checked element by element; larger ones by windows.
const FULL_CHECK_BYTES: usize = 64 * MIB;
const WINDOW: usize = 4096;
const WINDOWS: usize = 256;
/// Exit code of a child that could not load NCCL (it has said so already).
const EXIT_NO_NCCL: i32 = 3;

// ---------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------

#[derive(Parser, Debug, Clone)]
#[command(about = "cuda-peer collectives and copies against NCCL, nccl-tests style, checked")]
struct Args {
    /// Collectives to run.
    #[arg(long, value_delimiter = ',', default_value = "all_reduce,reduce_scatter,all_gather,broadcast")]
    ops: Vec<Op>,
    /// Element types.
    #[arg(long, value_delimiter = ',', default_value = "f32,bf16")]
    dtypes: Vec<Dt>,
    /// Smallest size in bytes (see the nccl-tests conventions in the docs).
    #[arg(long, default_value_t = 4)]
    min_bytes: usize,
    /// Largest size in bytes.
    #[arg(long, default_value_t = GIB)]
    max_bytes: usize,
    /// Implementations, in the order run.
    #[arg(long, value_delimiter = ',', default_value = "cuda-peer-p2p,cuda-peer-staged,nccl,nccl-no-p2p")]
    impls: Vec<Impl>,
    /// Timed calls per point (default: 2 GiB / bytes, clamped to 5..=200).
    #[arg(long)]
    iters: Option<usize>,
    /// Warm-up calls per point (fewer for large sizes: at most 1 GiB of warm-up, at least 1 call).
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Machine name, used in the CSV file names.
    #[arg(long, default_value = "local")]
    machine: String,
    /// Directory for the CSVs.
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
    /// Also measure copies between every pair of GPUs (first, before any peer access).
    #[arg(long)]
    copy: bool,
    /// all_reduce only, sizes quadrupling (keeps --dtypes, --min-bytes, --max-bytes).
    #[arg(long)]
    quick: bool,
    /// Time calls replayed from CUDA graphs, as a framework that captures its
    /// step does: per point, one graph of up to GRAPH_CALLS calls (every rank's
    /// stream joined into one capture), launched until --iters calls have run;
    /// #wrong also covers a one-call graph replayed on fresh inputs. Turns off
    /// cudarc's event tracking (a capture may not wait for outside events).
    #[arg(long)]
    graph: bool,
    /// NCCL library to use when `libnccl.so` is not on the loader path (e.g. /usr/lib/x86_64-linux-gnu/libnccl.so.2).
    #[arg(long)]
    nccl_lib: Option<PathBuf>,
    /// Internal: run as the NCCL child and write the enqueue time here.
    #[arg(long, hide = true)]
    child_report: Option<PathBuf>,
    /// Internal: points done before this process (progress lines).
    #[arg(long, hide = true, default_value_t = 0)]
    progress_offset: usize,
    /// Internal: points in the whole run (progress lines).
    #[arg(long, hide = true)]
    progress_total: Option<usize>,
}

/// A collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
enum Op {
    #[value(name = "all_reduce")]
    AllReduce,
    #[value(name = "reduce_scatter")]
    ReduceScatter,
    #[value(name = "all_gather")]
    AllGather,
    #[value(name = "broadcast")]
    Broadcast,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
        }
    }

    /// The reduction, as nccl-tests prints it.
    fn redop(self) -> &'static str {
        match self {
            Op::AllReduce | Op::ReduceScatter => "sum",
            Op::AllGather | Op::Broadcast => "none",
        }
    }

    /// busbw / algbw, as nccl-tests defines it.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::ReduceScatter | Op::AllGather => (n - 1.0) / n,
            Op::Broadcast => 1.0,
        }
    }
}

/// An element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
enum Dt {
    #[value(name = "f32")]
    F32,
    #[value(name = "bf16")]
    Bf16,
}

impl Dt {
    fn name(self) -> &'static str {
        match self {
            Dt::F32 => "f32",
            Dt::Bf16 => "bf16",
        }
    }

    fn size(self) -> usize {
        match self {
            Dt::F32 => 4,
            Dt::Bf16 => 2,
        }
    }
}

/// An implementation under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
enum Impl {
    #[value(name = "cuda-peer-p2p")]
    PeerP2p,
    #[value(name = "cuda-peer-staged")]
    PeerStaged,
    /// cuda-peer over P2P, ring all-reduce forced (for the algorithm crossover).
    #[value(name = "cuda-peer-ring")]
    PeerRing,
    /// cuda-peer over P2P, mesh all-reduce forced (for the algorithm crossover).
    #[value(name = "cuda-peer-mesh")]
    PeerMesh,
    /// cuda-peer over P2P, one-shot all-reduce forced (for the algorithm crossover).
    #[value(name = "cuda-peer-oneshot")]
    PeerOneShot,
    /// cuda-peer without P2P, one-shot through host memory forced.
    #[value(name = "cuda-peer-host-oneshot")]
    PeerHostOneShot,
    /// cuda-peer without P2P, staged ring forced.
    #[value(name = "cuda-peer-staged-ring")]
    PeerStagedRing,
    /// cuda-peer-p2p without launcher threads (every rank launched from the calling thread).
    #[value(name = "cuda-peer-p2p-serial")]
    PeerP2pSerial,
    /// cuda-peer-staged without launcher threads.
    #[value(name = "cuda-peer-staged-serial")]
    PeerStagedSerial,
    #[value(name = "nccl")]
    Nccl,
    #[value(name = "nccl-no-p2p")]
    NcclNoP2p,
}

impl Impl {
    fn name(self) -> &'static str {
        match self {
            Impl::PeerP2p => "cuda-peer-p2p",
            Impl::PeerStaged => "cuda-peer-staged",
            Impl::PeerRing => "cuda-peer-ring",
            Impl::PeerMesh => "cuda-peer-mesh",
            Impl::PeerOneShot => "cuda-peer-oneshot",
            Impl::PeerHostOneShot => "cuda-peer-host-oneshot",
            Impl::PeerStagedRing => "cuda-peer-staged-ring",
            Impl::PeerP2pSerial => "cuda-peer-p2p-serial",
            Impl::PeerStagedSerial => "cuda-peer-staged-serial",
            Impl::Nccl => "nccl",
            Impl::NcclNoP2p => "nccl-no-p2p",
        }
    }

    fn is_nccl(self) -> bool {
        matches!(self, Impl::Nccl | Impl::NcclNoP2p)
    }
}

// ---------------------------------------------------------------------------
// The plan: which points, in which order
// ---------------------------------------------------------------------------

/// Buffer sizes of one point, after nccl-tests' rounding to whole blocks.
#[derive(Debug, Clone, Copy)]
struct Shape {
    /// Elements per rank in the send buffer (0 for in-place collectives).
    send: usize,
    /// Elements per rank in the receive (or in-place) buffer.
    recv: usize,
    /// The count column: elements passed to the call.
    count: usize,
    /// The size column, in bytes.
    bytes: usize,
}

impl Shape {
    /// The shape for a requested size, or `None` when it rounds to nothing.
    fn new(op: Op, bytes: usize, esz: usize, n: usize) -> Option<Shape> {
        let elems = bytes / esz;
        let shape = match op {
            Op::AllReduce | Op::Broadcast => Shape { send: 0, recv: elems, count: elems, bytes: elems * esz },
            Op::ReduceScatter => {
                let block = elems / n;
                Shape { send: block * n, recv: block, count: block, bytes: block * n * esz }
            }
            Op::AllGather => {
                let block = elems / n;
                Shape { send: block, recv: block * n, count: block, bytes: block * n * esz }
            }
        };
        (shape.count > 0).then_some(shape)
    }
}

/// Everything a sweep runs over.
#[derive(Debug, Clone)]
struct Plan {
    ops: Vec<Op>,
    dtypes: Vec<Dt>,
    sizes: Vec<usize>,
    ranks: usize,
}

impl Plan {
    fn new(args: &Args, ranks: usize) -> Plan {
        let (ops, factor) = if args.quick { (vec![Op::AllReduce], 4) } else { (args.ops.clone(), 2) };
        Plan { ops, dtypes: args.dtypes.clone(), sizes: geometric(args.min_bytes, args.max_bytes, factor), ranks }
    }

    /// The points of one implementation, in order.
    fn points(&self) -> Vec<(Op, Dt, Shape)> {
        let mut v = Vec::new();
        for &op in &self.ops {
            for &dt in &self.dtypes {
                v.extend(self.sizes.iter().filter_map(|&b| Shape::new(op, b, dt.size(), self.ranks)).map(|s| (op, dt, s)));
            }
        }
        v
    }
}

/// `min, min*factor, ...` up to `max`.
fn geometric(min: usize, max: usize, factor: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min.max(1);
    while s <= max {
        v.push(s);
        match s.checked_mul(factor) {
            Some(next) => s = next,
            None => break,
        }
    }
    v
}

/// Timed calls for a point of `bytes`: `--iters`, or enough to move about 2 GiB.
fn iters_for(args: &Args, bytes: usize) -> usize {
    args.iters.unwrap_or_else(|| (BYTES_PER_POINT / bytes.max(1)).clamp(MIN_ITERS, MAX_ITERS)).max(1)
}

/// Warm-up calls: `--warmup`, but at most 1 GiB of them and at least one.
fn warmup_for(args: &Args, bytes: usize) -> usize {
    args.warmup.min(GIB / bytes.max(1)).max(1)
}

/// The `[k/total]` lines on stderr.
struct Progress {
    done: usize,
    total: usize,
}

impl Progress {
    fn tick(&mut self, what: std::fmt::Arguments) {
        self.done += 1;
        eprintln!("[{}/{}] {what}", self.done, self.total);
    }
}

// ---------------------------------------------------------------------------
// Element types and the reference data
// ---------------------------------------------------------------------------

#[cfg(feature = "nccl")]
trait NcclElem: cuda_peer::cudarc::nccl::NcclType {}
#[cfg(feature = "nccl")]
impl<T: cuda_peer::cudarc::nccl::NcclType> NcclElem for T {}
#[cfg(not(feature = "nccl"))]
trait NcclElem {}
#[cfg(not(feature = "nccl"))]
impl<T> NcclElem for T {}

/// An element type of the sweep: small integers are exact in it.
trait BenchElem: Element + NcclElem {
    fn from_int(v: i64) -> Self;
    fn to_f64(self) -> f64;
    /// Largest input magnitude for which every partial sum over `ranks` inputs is exact.
    fn input_range(ranks: usize) -> i64;
}

impl BenchElem for f32 {
    fn from_int(v: i64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn input_range(_ranks: usize) -> i64 {
        8 // |sum| <= 8N, exact far beyond any rank count
    }
}

impl BenchElem for bf16 {
    fn from_int(v: i64) -> Self {
        bf16::from_f32(v as f32)
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn input_range(ranks: usize) -> i64 {
        (128 / ranks as i64).clamp(1, 4) // |sum| <= 128: integers up to 256 are exact in bf16
    }
}

/// splitmix64's finaliser.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The inputs of one point: every rank's element i is a function of a fresh
/// random seed, so the reference is computed on the fly, never stored.
#[derive(Debug, Clone, Copy)]
struct Inputs {
    seed: u64,
    range: i64,
}

impl Inputs {
    fn fresh(range: i64) -> Inputs {
        Inputs { seed: rand::rng().random(), range }
    }

    /// Rank `rank`'s element `i`: an integer in `-range..=range`.
    fn value(&self, rank: usize, i: usize) -> i64 {
        let h = mix(self.seed.wrapping_add(((rank as u64) << 40) | i as u64));
        (h % (2 * self.range as u64 + 1)) as i64 - self.range
    }

    /// The correct output element `i` of rank `rank` (root 0 for broadcast;
    /// `block` is the per-rank block of reduce_scatter and all_gather).
    fn expected(&self, op: Op, ranks: usize, block: usize, rank: usize, i: usize) -> i64 {
        match op {
            Op::AllReduce => (0..ranks).map(|q| self.value(q, i)).sum(),
            Op::ReduceScatter => (0..ranks).map(|q| self.value(q, rank * block + i)).sum(),
            Op::AllGather => self.value(i / block, i % block),
            Op::Broadcast => self.value(0, i),
        }
    }
}

fn threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(32)
}

/// `(0..len).map(f).collect()`, on every core.
fn par_vec<T: Send>(len: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(len);
    let chunk = len.div_ceil(threads()).max(1 << 16);
    std::thread::scope(|s| {
        for (k, part) in v.spare_capacity_mut()[..len].chunks_mut(chunk).enumerate() {
            let f = &f;
            s.spawn(move || {
                for (j, slot) in part.iter_mut().enumerate() {
                    *slot = MaybeUninit::new(f(k * chunk + j));
                }
            });
        }
    });
    // SAFETY: the threads above wrote every one of the first `len` slots.
    unsafe { v.set_len(len) };
    v
}

/// How many `i` in `0..len` have `bad(i)`, on every core.
fn par_count(len: usize, bad: impl Fn(usize) -> bool + Sync) -> u64 {
    let chunk = len.div_ceil(threads()).max(1 << 16);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..len.div_ceil(chunk))
            .map(|k| {
                let bad = &bad;
                s.spawn(move || (k * chunk..((k + 1) * chunk).min(len)).filter(|&i| bad(i)).count() as u64)
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("checker thread")).sum()
    })
}

/// The element ranges of an output of `len` elements that are checked:
/// all of it up to 64 MiB, else 256 evenly spaced windows of 4096 elements
/// (about 1M elements, the first window at the start and the last at the end).
fn check_windows(len: usize, esz: usize) -> Vec<Range<usize>> {
    if len * esz <= FULL_CHECK_BYTES || len <= WINDOW * WINDOWS {
        return std::iter::once(0..len).collect();
    }
    let last = len - WINDOW;
    (0..WINDOWS).map(|k| k * last / (WINDOWS - 1)).map(|s| s..s + WINDOW).collect()
}

// ---------------------------------------------------------------------------
// Device helpers
// ---------------------------------------------------------------------------

/// Waits until every stream is idle.
fn sync_all(streams: &[Arc<CudaStream>]) -> Res<()> {
    for s in streams {
        s.synchronize()?;
    }
    Ok(())
}

/// A buffer of `len` elements filled with NaN (0x7FC0 in every 16-bit half
/// is a NaN both as f32 and as bf16).
fn poisoned<T: BenchElem>(stream: &Arc<CudaStream>, len: usize) -> Res<CudaSlice<T>> {
    // SAFETY: every byte is written by the memset below before anything reads it.
    let mut buf = unsafe { stream.alloc::<T>(len) }?;
    stream.context().bind_to_thread()?;
    let bytes = buf.num_bytes();
    {
        let (ptr, _record) = buf.device_ptr_mut(stream);
        // SAFETY: `ptr` holds `bytes` bytes (an even number) on this stream's device.
        unsafe { cu::cuMemsetD16Async(ptr, 0x7FC0, bytes / 2, stream.cu_stream()) }.result()?;
    }
    Ok(buf)
}

/// Rank `rank`'s inputs, `len` elements, on its device.
fn upload<T: BenchElem>(stream: &Arc<CudaStream>, inputs: &Inputs, rank: usize, len: usize) -> Res<CudaSlice<T>> {
    let host = par_vec(len, |i| T::from_int(inputs.value(rank, i)));
    Ok(stream.clone_htod(&host)?)
}

/// Mean microseconds per call of `iters` back-to-back `call()`s after
/// `warmup` ones: an event on `streams[0]` that the other streams wait for
/// before the calls, and one after `streams[0]` has joined them.
fn time_calls(streams: &[Arc<CudaStream>], warmup: usize, iters: usize, mut call: impl FnMut() -> Res<()>) -> Res<f64> {
    for _ in 0..warmup {
        call()?;
    }
    sync_all(streams)?;
    let ctx0 = streams[0].context();
    let start = ctx0.new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))?;
    let end = ctx0.new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))?;
    start.record(&streams[0])?;
    for s in &streams[1..] {
        s.wait(&start)?;
    }
    for _ in 0..iters {
        call()?;
    }
    for s in &streams[1..] {
        streams[0].join(s)?;
    }
    end.record(&streams[0])?;
    let ms = start.elapsed_ms(&end)?;
    sync_all(streams)?;
    Ok(ms as f64 * 1e3 / iters as f64)
}

// ---------------------------------------------------------------------------
// Implementations
// ---------------------------------------------------------------------------

/// One rank's buffers of a point for every rank: `recv` is the in-place
/// buffer of all_reduce and broadcast (then `send` is empty).
struct Bufs<T> {
    send: Vec<CudaSlice<T>>,
    recv: Vec<CudaSlice<T>>,
}

enum Engine {
    Peer(Box<Group>),
    #[cfg(feature = "nccl")]
    Nccl(Vec<cuda_peer::cudarc::nccl::Comm>),
}

/// An implementation set up over every rank.
struct Backend {
    imp: Impl,
    streams: Vec<Arc<CudaStream>>,
    engine: Engine,
}

impl Backend {
    fn ranks(&self) -> usize {
        self.streams.len()
    }

    /// Enqueues one collective on every rank (no host synchronisation).
    fn call<T: BenchElem>(&self, op: Op, bufs: &mut Bufs<T>) -> Res<()> {
        match &self.engine {
            Engine::Peer(g) => match op {
                Op::AllReduce => g.all_reduce_in_place(&mut bufs.recv, ReduceOp::Sum)?,
                Op::ReduceScatter => g.reduce_scatter(&bufs.send, &mut bufs.recv, ReduceOp::Sum)?,
                Op::AllGather => g.all_gather(&bufs.send, &mut bufs.recv)?,
                Op::Broadcast => g.broadcast(&mut bufs.recv, 0)?,
            },
            #[cfg(feature = "nccl")]
            Engine::Nccl(comms) => nccl::call(comms, op, bufs)?,
        }
        Ok(())
    }
}

/// A cuda-peer group over every GPU with `policy` on every link; prints
/// which path each rank pulls from its predecessor over.
fn peer_backend(imp: Impl, ctxs: &[Arc<CudaContext>]) -> Res<Backend> {
    let staged = matches!(imp, Impl::PeerStaged | Impl::PeerHostOneShot | Impl::PeerStagedRing | Impl::PeerStagedSerial);
    let serial = matches!(imp, Impl::PeerP2pSerial | Impl::PeerStagedSerial);
    let policy = if staged { PathPolicy::StagedOnly } else { PathPolicy::P2pOnly };
    let algorithm = match imp {
        Impl::PeerRing | Impl::PeerStagedRing => Algorithm::Ring,
        Impl::PeerMesh => Algorithm::Mesh,
        Impl::PeerOneShot | Impl::PeerHostOneShot => Algorithm::OneShot,
        _ => Algorithm::Auto,
    };
    let streams = ctxs.iter().map(|c| c.new_stream()).collect::<Result<Vec<_>, _>>()?;
    let mut opts = GroupOptions::with_policy(policy).algorithm(algorithm);
    if serial {
        opts.launch_spin = None;
    }
    let group = Group::new(streams.clone(), &opts)?;
    let n = group.size();
    println!("#");
    println!("# {}: {n} ranks", imp.name());
    for r in 0..n {
        if let Some(st) = group.link_status(r) {
            println!("#   rank {r} <- rank {}: {} ({})", (r + n - 1) % n, st.path, st.reason);
        }
    }
    let algos: Vec<String> =
        [4 * KIB, 256 * KIB, MIB, 16 * MIB, 256 * MIB, GIB].iter().map(|&b| format!("{}: {:?}", human(b), group.all_reduce_algorithm(b))).collect();
    println!("#   all_reduce algorithm by size: {}", algos.join(", "));
    Ok(Backend { imp, streams, engine: Engine::Peer(Box::new(group)) })
}

// ---------------------------------------------------------------------------
// The collective sweep
// ---------------------------------------------------------------------------

/// One measured point.
#[derive(Debug, Clone)]
struct Row {
    imp: &'static str,
    op: Op,
    dt: Dt,
    ranks: usize,
    shape: Shape,
    time_us: f64,
    wrong: u64,
    sampled: bool,
}

impl Row {
    fn algbw(&self) -> f64 {
        self.shape.bytes as f64 / self.time_us / 1e3
    }

    fn busbw(&self) -> f64 {
        self.algbw() * self.op.bus_factor(self.ranks)
    }

    fn csv(&self) -> String {
        format!(
            "{},{},{},{},{},{},{:.3},{:.6},{:.6},{}",
            self.imp,
            self.op.name(),
            self.dt.name(),
            self.op.redop(),
            self.ranks,
            self.shape.bytes,
            self.time_us,
            self.algbw(),
            self.busbw(),
            self.wrong
        )
    }

    fn print(&self) {
        println!(
            "{:>16} {:>14} {:>5} {:>5} {:>12} {:>11} {:>10.2} {:>8.2} {:>8.2} {:>7} {:>7}",
            self.imp,
            self.op.name(),
            self.dt.name(),
            self.op.redop(),
            self.shape.bytes,
            self.shape.count,
            self.time_us,
            self.algbw(),
            self.busbw(),
            self.wrong,
            if self.sampled { "sampled" } else { "all" }
        );
    }
}

const CSV_HEADER: &str = "impl,collective,dtype,op,ranks,bytes,time_us,algbw_gbs,busbw_gbs,wrong";
const COPY_CSV_HEADER: &str = "path,src,dst,direction,bytes,time_us,gbs";

fn print_table_header() {
    println!(
        "#{:>15} {:>14} {:>5} {:>5} {:>12} {:>11} {:>10} {:>8} {:>8} {:>7} {:>7}",
        "impl", "collective", "dtype", "redop", "bytes", "count", "time_us", "algbw", "busbw", "#wrong", "checked"
    );
}

/// Appends lines to a CSV file, one write per line, so that a run cut short keeps what it measured.
struct Csv(std::fs::File);

impl Csv {
    fn create(path: &Path, header: &str) -> Res<Csv> {
        let mut f = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
        writeln!(f, "{header}")?;
        Ok(Csv(f))
    }

    fn append(path: &Path) -> Res<Csv> {
        Ok(Csv(std::fs::OpenOptions::new().append(true).open(path).map_err(|e| format!("{}: {e}", path.display()))?))
    }

    fn line(&mut self, line: &str) -> Res<()> {
        self.0.write_all(format!("{line}\n").as_bytes())?;
        Ok(())
    }
}

fn collectives_csv(args: &Args) -> PathBuf {
    args.out.join(format!("{}-allreduce.csv", args.machine))
}

fn copy_csv(args: &Args) -> PathBuf {
    args.out.join(format!("{}-copy.csv", args.machine))
}

/// Fresh inputs and poisoned outputs for one point on every rank.
fn prepare<T: BenchElem>(streams: &[Arc<CudaStream>], op: Op, shape: &Shape, inputs: &Inputs) -> Res<Bufs<T>> {
    let mut bufs = Bufs { send: Vec::new(), recv: Vec::new() };
    for (r, s) in streams.iter().enumerate() {
        match op {
            Op::AllReduce => bufs.recv.push(upload(s, inputs, r, shape.recv)?),
            Op::Broadcast if r == 0 => bufs.recv.push(upload(s, inputs, r, shape.recv)?),
            Op::Broadcast => bufs.recv.push(poisoned(s, shape.recv)?),
            Op::ReduceScatter | Op::AllGather => {
                bufs.send.push(upload(s, inputs, r, shape.send)?);
                bufs.recv.push(poisoned(s, shape.recv)?);
            }
        }
    }
    Ok(bufs)
}

/// Compares every rank's output with the reference. Returns the number of
/// wrong elements and whether only windows were checked.
fn check<T: BenchElem>(streams: &[Arc<CudaStream>], op: Op, shape: &Shape, inputs: &Inputs, outs: &[CudaSlice<T>]) -> Res<(u64, bool)> {
    let n = streams.len();
    let block = shape.count;
    let (mut wrong, mut sampled) = (0, false);
    for (r, buf) in outs.iter().enumerate() {
        let windows = check_windows(buf.len(), std::mem::size_of::<T>());
        sampled |= windows.len() > 1;
        for w in windows {
            let got = streams[r].clone_dtoh(&buf.slice(w.clone()))?;
            wrong += par_count(got.len(), |k| got[k].to_f64() != inputs.expected(op, n, block, r, w.start + k) as f64);
        }
    }
    Ok((wrong, sampled))
}

/// Checks, then times, one point.
fn measure<T: BenchElem>(backend: &Backend, args: &Args, op: Op, dt: Dt, shape: Shape) -> Res<Row> {
    let n = backend.ranks();
    let inputs = Inputs::fresh(T::input_range(n));
    let mut bufs = prepare::<T>(&backend.streams, op, &shape, &inputs)?;
    backend.call(op, &mut bufs)?;
    sync_all(&backend.streams)?;
    let (wrong, sampled) = check(&backend.streams, op, &shape, &inputs, &bufs.recv)?;
    let (warmup, iters) = (warmup_for(args, shape.bytes), iters_for(args, shape.bytes));
    if !args.graph {
        let time_us = time_calls(&backend.streams, warmup, iters, || backend.call(op, &mut bufs))?;
        return Ok(Row { imp: backend.imp.name(), op, dt, ranks: n, shape, time_us, wrong, sampled });
    }
    // One call from a graph, on fresh buffers, checked like the eager call.
    let mut bufs = prepare::<T>(&backend.streams, op, &shape, &inputs)?;
    let once = capture(&backend.streams, 1, || backend.call(op, &mut bufs))?;
    once.launch()?;
    sync_all(&backend.streams)?;
    let (wrong_graph, _) = check(&backend.streams, op, &shape, &inputs, &bufs.recv)?;
    // Then a graph of k calls, launched back to back.
    let k = iters.min(GRAPH_CALLS);
    let graph = capture(&backend.streams, k, || backend.call(op, &mut bufs))?;
    let time_us = time_calls(&backend.streams, warmup.div_ceil(k), iters.div_ceil(k), || Ok(graph.launch()?))? / k as f64;
    Ok(Row { imp: backend.imp.name(), op, dt, ranks: n, shape, time_us, wrong: wrong + wrong_graph, sampled })
}

/// Calls per graph in `--graph` mode (fewer where a point times fewer calls).
const GRAPH_CALLS: usize = 20;

/// `calls` calls of `call` captured into one graph launched on `streams[0]`:
/// the other streams join the capture through an event recorded there, and
/// it joins them back at the end.
fn capture(streams: &[Arc<CudaStream>], calls: usize, mut call: impl FnMut() -> Res<()>) -> Res<CudaGraph> {
    let s0 = &streams[0];
    s0.begin_capture(cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let mut res: Res<()> = s0.record_event(None).map_err(Into::into).and_then(|fork| {
        for s in &streams[1..] {
            s.wait(&fork)?;
        }
        Ok(())
    });
    for _ in 0..calls {
        res = res.and_then(|()| call());
    }
    for s in &streams[1..] {
        res = res.and_then(|()| Ok(s0.join(s)?));
    }
    // The capture is ended whatever happened, so the stream is usable again.
    let graph = s0.end_capture(cu::CUgraphInstantiate_flags(0));
    res.map_err(|e| format!("under graph capture: {e}"))?;
    Ok(graph?.ok_or("the capture recorded nothing")?)
}

/// Every device's context; in `--graph` mode with cudarc's event tracking
/// turned off before any buffer exists.
fn contexts(args: &Args) -> Res<Vec<Arc<CudaContext>>> {
    let ctxs = driver::all_contexts()?;
    if args.graph {
        for c in &ctxs {
            // SAFETY: no buffer of these contexts exists yet; the benchmark
            // orders its own work (joins and synchronisations around every
            // timed run and every check).
            unsafe { c.disable_event_tracking() };
        }
    }
    Ok(ctxs)
}

/// Runs every point of the plan on `backend`, printing and appending each row.
fn sweep(backend: &Backend, args: &Args, plan: &Plan, progress: &mut Progress, csv: &mut Csv) -> Res<()> {
    print_table_header();
    for (op, dt, shape) in plan.points() {
        progress.tick(format_args!("{} {} {} {}", backend.imp.name(), op.name(), dt.name(), shape.bytes));
        let row = match dt {
            Dt::F32 => measure::<f32>(backend, args, op, dt, shape),
            Dt::Bf16 => measure::<bf16>(backend, args, op, dt, shape),
        }
        .map_err(|e| format!("{} {} {} {} bytes: {e}", backend.imp.name(), op.name(), dt.name(), shape.bytes))?;
        row.print();
        csv.line(&row.csv())?;
    }
    Ok(())
}

/// `bytes` for people: 4 KiB, 16 MiB, 1 GiB.
fn human(bytes: usize) -> String {
    match bytes {
        b if b >= GIB && b % GIB == 0 => format!("{} GiB", b / GIB),
        b if b >= MIB && b % MIB == 0 => format!("{} MiB", b / MIB),
        b if b >= KIB && b % KIB == 0 => format!("{} KiB", b / KIB),
        b => format!("{b} B"),
    }
}

/// Host microseconds per call of what every call pays to cudarc's event
/// tracking alone: each rank's in-place buffer taken for writing on its
/// stream (two event waits) and its guard dropped (one event record),
/// with no collective. The floor under [`enqueue_us`] for cuda-peer.
fn tracking_us(backend: &Backend) -> Res<f64> {
    let n = backend.ranks();
    let shape = Shape::new(Op::AllReduce, 4 * KIB, 4, n).expect("4 KiB is not empty");
    let inputs = Inputs::fresh(f32::input_range(n));
    let mut bufs = prepare::<f32>(&backend.streams, Op::AllReduce, &shape, &inputs)?;
    sync_all(&backend.streams)?;
    let t = Instant::now();
    for _ in 0..1000 {
        let guards: Vec<_> = bufs.recv.iter_mut().zip(&backend.streams).map(|(b, s)| b.device_ptr_mut(s)).collect();
        drop(guards);
    }
    let us = t.elapsed().as_secs_f64() * 1e6 / 1000.0;
    sync_all(&backend.streams)?;
    Ok(us)
}

/// Host microseconds to enqueue one 4 KiB f32 all_reduce on every rank:
/// 1000 calls in batches of 50 (the GPU drains between batches, outside the
/// timed part, so that a full launch queue never blocks the host).
fn enqueue_us(backend: &Backend) -> Res<f64> {
    let n = backend.ranks();
    let shape = Shape::new(Op::AllReduce, 4 * KIB, 4, n).expect("4 KiB is not empty");
    let inputs = Inputs::fresh(f32::input_range(n));
    let mut bufs = prepare::<f32>(&backend.streams, Op::AllReduce, &shape, &inputs)?;
    backend.call(Op::AllReduce, &mut bufs)?;
    sync_all(&backend.streams)?;
    let mut total = Duration::ZERO;
    for _ in 0..20 {
        let t = Instant::now();
        for _ in 0..50 {
            backend.call(Op::AllReduce, &mut bufs)?;
        }
        total += t.elapsed();
        sync_all(&backend.streams)?;
    }
    Ok(total.as_secs_f64() * 1e6 / 1000.0)
}

// ---------------------------------------------------------------------------
// NCCL (child process)
// ---------------------------------------------------------------------------

#[cfg(feature = "nccl")]
mod nccl {
    use super::*;
    use cuda_peer::cudarc::nccl::{group_end, group_start, result, Comm, ReduceOp as NcclOp};

    fn err(what: &str, e: result::NcclError) -> Box<dyn std::error::Error> {
        format!("{what}: {:?}", e.0).into()
    }

    /// One collective on every rank, as one NCCL group (required when one
    /// thread drives several ranks).
    pub(super) fn call<T: BenchElem>(comms: &[Comm], op: Op, bufs: &mut Bufs<T>) -> Res<()> {
        group_start().map_err(|e| err("ncclGroupStart", e))?;
        let mut first_err = Ok(());
        for (r, comm) in comms.iter().enumerate() {
            let res = match op {
                Op::AllReduce => comm.all_reduce_in_place(&mut bufs.recv[r], &NcclOp::Sum),
                Op::ReduceScatter => comm.reduce_scatter(&bufs.send[r], &mut bufs.recv[r], &NcclOp::Sum),
                Op::AllGather => comm.all_gather(&bufs.send[r], &mut bufs.recv[r]),
                Op::Broadcast => comm.broadcast_in_place(&mut bufs.recv[r], 0),
            };
            if let Err(e) = res {
                first_err = Err(err(op.name(), e));
                break;
            }
        }
        let end = group_end();
        first_err?;
        end.map_err(|e| err("ncclGroupEnd", e))?;
        Ok(())
    }

    /// The child's whole job: load NCCL, sweep, report the enqueue time.
    pub(super) fn child(args: &Args, imp: Impl, report: &Path) -> Res<()> {
        // SAFETY: only tries to open the library under cudarc's candidate names.
        if !unsafe { cuda_peer::cudarc::nccl::sys::is_culib_present() } {
            println!("# NCCL: library not found (cudarc looks for libnccl.so; pass --nccl-lib /path/to/libnccl.so.2): nccl impls skipped");
            std::process::exit(EXIT_NO_NCCL);
        }
        let v = result::get_nccl_version().map_err(|e| err("ncclGetVersion", e))?;
        let ctxs = contexts(args)?;
        let streams = ctxs.iter().map(|c| c.new_stream()).collect::<Result<Vec<_>, _>>()?;
        let comms = Comm::from_devices(streams.clone()).map_err(|e| err("ncclCommInitAll", e))?;
        println!("#");
        println!(
            "# {}: NCCL {}.{}.{}, {} ranks, NCCL_P2P_DISABLE={}, NCCL_NVLS_ENABLE={}",
            imp.name(),
            v / 10000,
            v / 100 % 100,
            v % 100,
            comms.len(),
            std::env::var("NCCL_P2P_DISABLE").unwrap_or_else(|_| "(unset)".into()),
            std::env::var("NCCL_NVLS_ENABLE").unwrap_or_else(|_| "(unset)".into()),
        );
        let backend = Backend { imp, streams, engine: Engine::Nccl(comms) };
        let plan = Plan::new(args, backend.ranks());
        let total = args.progress_total.unwrap_or(plan.points().len());
        let mut progress = Progress { done: args.progress_offset, total };
        let mut csv = Csv::append(&collectives_csv(args))?;
        sweep(&backend, args, &plan, &mut progress, &mut csv)?;
        let us = enqueue_us(&backend)?;
        std::fs::write(report, format!("enqueue_us={us}\n"))?;
        Ok(())
    }
}

/// Where `libnccl.so` must come from for the children, when cudarc would not
/// find it by itself: cudarc opens `libnccl.so` (and a few other names) but
/// not `libnccl.so.2`, the only name a runtime-only NCCL install provides.
/// Returns a directory holding a `libnccl.so` link to the real library, to
/// put first on the children's `LD_LIBRARY_PATH`, or `None` when not needed
/// (or nothing was found: the child then says NCCL is missing).
fn nccl_shim(args: &Args, tmp: &Path) -> Option<PathBuf> {
    let target = match &args.nccl_lib {
        Some(p) => p.clone(),
        None => find_nccl()?,
    };
    let dir = tmp.join("nccl-lib");
    std::fs::create_dir_all(&dir).ok()?;
    #[cfg(unix)]
    std::os::unix::fs::symlink(&target, dir.join("libnccl.so")).ok()?;
    println!("# NCCL: using {} (as libnccl.so)", target.display());
    Some(dir)
}

/// `libnccl.so.2` on the loader path, unless `libnccl.so` is there too (then cudarc finds it).
fn find_nccl() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> =
        std::env::var("LD_LIBRARY_PATH").unwrap_or_default().split(':').filter(|d| !d.is_empty()).map(PathBuf::from).collect();
    for ldconfig in ["ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"] {
        if let Ok(out) = std::process::Command::new(ldconfig).arg("-p").output() {
            for line in String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.contains("libnccl.so")) {
                if let Some(path) = line.split("=>").nth(1) {
                    dirs.extend(Path::new(path.trim()).parent().map(Path::to_path_buf));
                }
            }
            break;
        }
    }
    dirs.extend(
        ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/local/cuda/lib64", "/usr/local/lib"].map(PathBuf::from),
    );
    if dirs.iter().any(|d| d.join("libnccl.so").exists()) {
        return None;
    }
    dirs.into_iter().map(|d| d.join("libnccl.so.2")).find(|p| p.exists())
}

/// The child's command line: this run's sweep settings, one NCCL impl, and
/// where to report.
fn child_args(args: &Args, imp: Impl, progress: &Progress, report: &Path) -> Vec<std::ffi::OsString> {
    let list = |v: Vec<&str>| v.join(",");
    let mut v: Vec<std::ffi::OsString> = [
        "--impls".to_string(),
        imp.name().to_string(),
        "--ops".to_string(),
        list(args.ops.iter().map(|o| o.name()).collect()),
        "--dtypes".to_string(),
        list(args.dtypes.iter().map(|d| d.name()).collect()),
        format!("--min-bytes={}", args.min_bytes),
        format!("--max-bytes={}", args.max_bytes),
        format!("--warmup={}", args.warmup),
        format!("--machine={}", args.machine),
        format!("--progress-offset={}", progress.done),
        format!("--progress-total={}", progress.total),
    ]
    .into_iter()
    .map(Into::into)
    .collect();
    v.extend(["--out".into(), args.out.clone().into_os_string(), "--child-report".into(), report.as_os_str().to_owned()]);
    v.extend(args.iters.map(|i| format!("--iters={i}").into()));
    if args.quick {
        v.push("--quick".into());
    }
    if args.graph {
        v.push("--graph".into());
    }
    v
}

/// How an NCCL child ended.
enum ChildEnd {
    /// Swept everything; its enqueue time in microseconds.
    Finished(f64),
    /// Failed part way (said so); its remaining points are missing.
    Failed,
    /// Could not load NCCL (said so in one line).
    NoNccl,
}

/// Runs one NCCL implementation in a child process: fresh NCCL state and
/// its own environment.
fn run_nccl_child(args: &Args, imp: Impl, progress: &Progress, shim: Option<&Path>, tmp: &Path) -> Res<ChildEnd> {
    let report = tmp.join(format!("{}.report", imp.name()));
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(child_args(args, imp, progress, &report));
    // Never NVLink multicast (NVLS); P2P off only for nccl-no-p2p.
    cmd.env("NCCL_NVLS_ENABLE", "0");
    match imp {
        Impl::NcclNoP2p => cmd.env("NCCL_P2P_DISABLE", "1"),
        _ => cmd.env_remove("NCCL_P2P_DISABLE"),
    };
    if let Some(dir) = shim {
        let old = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        cmd.env("LD_LIBRARY_PATH", if old.is_empty() { dir.display().to_string() } else { format!("{}:{old}", dir.display()) });
    }
    let status = cmd.status()?;
    let report = std::fs::read_to_string(&report).unwrap_or_default();
    let enqueue_us = report.trim().strip_prefix("enqueue_us=").and_then(|v| v.parse().ok());
    Ok(match (status.code(), enqueue_us) {
        (Some(0), Some(us)) => ChildEnd::Finished(us),
        (Some(EXIT_NO_NCCL), _) => ChildEnd::NoNccl,
        _ => {
            println!("# {}: the NCCL child process failed ({status}); its remaining points are missing", imp.name());
            ChildEnd::Failed
        }
    })
}

// ---------------------------------------------------------------------------
// Copies between pairs of GPUs
// ---------------------------------------------------------------------------

/// How a copy is carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CopyPath {
    /// `cuMemcpyPeerAsync` with peer access never enabled in this process.
    DriverNoPeer,
    /// cuda-peer's staged link (through pinned host memory).
    Staged,
    /// cuda-peer's verified P2P link.
    P2p,
}

impl CopyPath {
    fn name(self) -> &'static str {
        match self {
            CopyPath::DriverNoPeer => "driver-no-peer",
            CopyPath::Staged => "staged",
            CopyPath::P2p => "p2p",
        }
    }
}

/// The byte at `i` of side `side`'s source buffer (never 0, the poison).
fn pattern(side: usize, i: usize) -> u8 {
    (mix(((side as u64 + 1) << 44) | i as u64) as u8) | 1
}

/// Two GPUs, each with a source buffer (its side's pattern) and a destination
/// buffer; "into side k" copies side 1-k's source into side k's destination
/// on side k's stream.
struct Pair {
    devices: [usize; 2],
    streams: [Arc<CudaStream>; 2],
    src: [CudaSlice<u8>; 2],
    dst: [CudaSlice<u8>; 2],
    /// Raw addresses of `src` and `dst`, for the driver's own copies.
    src_ptr: [u64; 2],
    dst_ptr: [u64; 2],
    /// `links[k]`: the link into side k (cuda-peer paths only).
    links: Option<[Link; 2]>,
}

impl Pair {
    fn new(ctxs: [&Arc<CudaContext>; 2], bytes: usize, path: CopyPath) -> Res<Pair> {
        let links = match path {
            CopyPath::DriverNoPeer => None,
            CopyPath::Staged | CopyPath::P2p => {
                let policy = if path == CopyPath::P2p { PathPolicy::P2pOnly } else { PathPolicy::StagedOnly };
                let opts = LinkOptions::with_policy(policy);
                Some([Link::open(ctxs[1], ctxs[0], &opts)?, Link::open(ctxs[0], ctxs[1], &opts)?])
            }
        };
        let streams = [ctxs[0].new_stream()?, ctxs[1].new_stream()?];
        let mut src = Vec::new();
        let mut dst = Vec::new();
        for (k, s) in streams.iter().enumerate() {
            src.push(s.clone_htod(&par_vec(bytes, |i| pattern(k, i)))?);
            dst.push(s.alloc_zeros::<u8>(bytes)?);
        }
        let ptr = |b: &CudaSlice<u8>, s: &Arc<CudaStream>| b.device_ptr(s).0;
        let src_ptr = [ptr(&src[0], &streams[0]), ptr(&src[1], &streams[1])];
        let dst_ptr = [ptr(&dst[0], &streams[0]), ptr(&dst[1], &streams[1])];
        sync_all(&streams)?;
        let devices = [ctxs[0].ordinal(), ctxs[1].ordinal()];
        let (src, dst) = (to_pair(src), to_pair(dst));
        Ok(Pair { devices, streams, src, dst, src_ptr, dst_ptr, links })
    }

    /// Enqueues one copy of `len` bytes into side `into`.
    fn enqueue(&mut self, path: CopyPath, into: usize, len: usize) -> Res<()> {
        let from = 1 - into;
        let stream = &self.streams[into];
        match (&mut self.links, path) {
            (Some(links), CopyPath::Staged | CopyPath::P2p) => {
                links[into].copy(&self.src[from].slice(..len), &mut self.dst[into].slice_mut(..len), stream)?;
            }
            _ => {
                let (dctx, sctx) = (stream.context(), self.streams[from].context());
                dctx.bind_to_thread()?;
                // SAFETY: both addresses hold at least `len` bytes on their
                // devices and outlive the copy (the pair is synchronised
                // before its buffers are read back or dropped).
                unsafe {
                    cuda_peer::cudarc::driver::result::memcpy_peer_async(
                        dctx.cu_ctx(),
                        self.dst_ptr[into],
                        sctx.cu_ctx(),
                        self.src_ptr[from],
                        len,
                        stream.cu_stream(),
                    )
                }?;
            }
        }
        Ok(())
    }

    /// Zeroes the first `len` bytes of the destinations of `sides`.
    fn poison(&mut self, sides: &[usize], len: usize) -> Res<()> {
        for &k in sides {
            self.streams[k].memset_zeros(&mut self.dst[k].slice_mut(..len))?;
        }
        sync_all(&self.streams)
    }

    /// Wrong bytes in the first `len` bytes of side `into`'s destination.
    fn wrong(&self, into: usize, len: usize) -> Res<u64> {
        let mut wrong = 0;
        for w in check_windows(len, 1) {
            let got = self.streams[into].clone_dtoh(&self.dst[into].slice(w.clone()))?;
            wrong += par_count(got.len(), |k| got[k] != pattern(1 - into, w.start + k));
        }
        Ok(wrong)
    }
}

fn to_pair<T>(v: Vec<T>) -> [T; 2] {
    let mut it = v.into_iter();
    [it.next().expect("two"), it.next().expect("two")]
}

/// Times copies into `sides` (one side: one way; both: both ways at once).
/// Returns (microseconds per round, wrong bytes).
fn time_copy(pair: &mut Pair, args: &Args, path: CopyPath, sides: &[usize], len: usize) -> Res<(f64, u64)> {
    pair.poison(sides, len)?;
    let streams: Vec<_> = sides.iter().map(|&k| pair.streams[k].clone()).collect();
    let (warmup, iters) = (warmup_for(args, len), iters_for(args, len));
    let us = time_calls(&streams, warmup, iters, || sides.iter().try_for_each(|&k| pair.enqueue(path, k, len)))?;
    let mut wrong = 0;
    for &k in sides {
        wrong += pair.wrong(k, len)?;
    }
    Ok((us, wrong))
}

/// Copies between every pair of GPUs over every path, 4 KiB to 1 GiB
/// (quadrupling, capped by --max-bytes); the driver's own copies first, before
/// this process enables peer access anywhere. One way for each ordered pair;
/// both ways once per unordered pair (the same measurement either way round).
fn copy_sweep(args: &Args, ctxs: &[Arc<CudaContext>]) -> Res<()> {
    let sizes = geometric(4 * KIB, args.max_bytes.min(GIB), 4);
    let Some(&max) = sizes.last() else {
        println!("# copy: --max-bytes below 4 KiB, no copies");
        return Ok(());
    };
    let n = ctxs.len();
    let pairs: Vec<(usize, usize)> = (0..n).flat_map(|i| (i + 1..n).map(move |j| (i, j))).collect();
    let paths = [CopyPath::DriverNoPeer, CopyPath::Staged, CopyPath::P2p];
    let mut progress = Progress { done: 0, total: paths.len() * pairs.len() * sizes.len() * 3 };
    let mut csv = Csv::create(&copy_csv(args), COPY_CSV_HEADER)?;
    println!("#");
    println!("# copies: driver-no-peer first (no peer access enabled yet), then staged, then p2p; GB/s counts the bytes of every direction");
    println!("#{:>15} {:>4} {:>4} {:>4} {:>12} {:>10} {:>8} {:>7}", "path", "src", "dst", "dir", "bytes", "time_us", "GB/s", "#wrong");
    for path in paths {
        for &(i, j) in &pairs {
            let mut pair = match Pair::new([&ctxs[i], &ctxs[j]], max, path) {
                Ok(p) => p,
                Err(e) => {
                    println!("# copy {} GPU{i} <-> GPU{j}: unavailable: {e}", path.name());
                    progress.done += sizes.len() * 3;
                    continue;
                }
            };
            for &len in &sizes {
                // (sides, src, dst, direction): into side 1 is i -> j.
                let [a, b] = pair.devices;
                for (sides, src, dst, dir) in [(&[1][..], a, b, "uni"), (&[0][..], b, a, "uni"), (&[1, 0][..], a, b, "bi")] {
                    progress.tick(format_args!("copy {} {src}->{dst} {dir} {len}", path.name()));
                    let (us, wrong) = time_copy(&mut pair, args, path, sides, len)?;
                    let gbs = (len * sides.len()) as f64 / us / 1e3;
                    println!("{:>16} {src:>4} {dst:>4} {dir:>4} {len:>12} {us:>10.2} {gbs:>8.2} {wrong:>7}", path.name());
                    csv.line(&format!("{},{src},{dst},{dir},{len},{us:.3},{gbs:.6}", path.name()))?;
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Summary
// ---------------------------------------------------------------------------

/// Ratios of cuda-peer to NCCL for all_reduce at a few sizes, from the CSV
/// (so NCCL's rows, written by the children, are included).
fn print_summary(args: &Args, enqueue: &[(Impl, f64)]) -> Res<()> {
    let text = std::fs::read_to_string(collectives_csv(args))?;
    // (impl, dtype, bytes) -> (time_us, busbw) for all_reduce.
    let mut ar: HashMap<(String, String, usize), (f64, f64)> = HashMap::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        if f.len() == 10 && f[1] == "all_reduce" {
            if let (Ok(bytes), Ok(t), Ok(bw)) = (f[5].parse(), f[6].parse(), f[8].parse()) {
                ar.insert((f[0].to_string(), f[2].to_string(), bytes), (t, bw));
            }
        }
    }
    let get = |imp: Impl, dt: &str, bytes: usize| ar.get(&(imp.name().to_string(), dt.to_string(), bytes)).copied();
    println!("#");
    println!("# summary, all_reduce: cuda-peer-p2p vs nccl, cuda-peer-staged vs nccl-no-p2p");
    println!("#   t_ratio = cuda-peer time / NCCL time (< 1: cuda-peer faster); bw_ratio = cuda-peer busbw / NCCL busbw (> 1: cuda-peer faster)");
    println!(
        "#{:>5} {:>10} | {:>9} {:>9} {:>7} {:>8} {:>8} {:>8} | {:>9} {:>9} {:>7} {:>8} {:>8} {:>8}",
        "dtype",
        "bytes",
        "p2p_us",
        "nccl_us",
        "t_ratio",
        "p2p_bw",
        "nccl_bw",
        "bw_ratio",
        "stg_us",
        "nop2p_us",
        "t_ratio",
        "stg_bw",
        "nop2p_bw",
        "bw_ratio"
    );
    for dt in ["f32", "bf16"] {
        for bytes in [4 * KIB, 256 * KIB, 16 * MIB, 256 * MIB] {
            let mut line = format!("{dt:>6} {bytes:>10}");
            for (ours, theirs) in [(Impl::PeerP2p, Impl::Nccl), (Impl::PeerStaged, Impl::NcclNoP2p)] {
                line.push_str(" |");
                match (get(ours, dt, bytes), get(theirs, dt, bytes)) {
                    (Some((t0, b0)), Some((t1, b1))) => {
                        write!(line, " {t0:>9.2} {t1:>9.2} {:>7.2} {b0:>8.2} {b1:>8.2} {:>8.2}", t0 / t1, b0 / b1)?;
                    }
                    (a, b) => {
                        let cell = |x: Option<(f64, f64)>, f: fn((f64, f64)) -> f64| x.map(|v| format!("{:.2}", f(v))).unwrap_or("-".into());
                        write!(
                            line,
                            " {:>9} {:>9} {:>7} {:>8} {:>8} {:>8}",
                            cell(a, |v| v.0),
                            cell(b, |v| v.0),
                            "-",
                            cell(a, |v| v.1),
                            cell(b, |v| v.1),
                            "-"
                        )?;
                    }
                }
            }
            println!("{line}");
        }
    }
    if !enqueue.is_empty() {
        let list: Vec<String> = enqueue.iter().map(|(imp, us)| format!("{} {us:.2} us", imp.name())).collect();
        println!("#");
        println!("# host time to enqueue one 4 KiB f32 all_reduce on all ranks (1000 calls in batches of 50, no GPU wait): {}", list.join(", "));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Main
// ---------------------------------------------------------------------------

/// The parent: copies (optional), then every implementation, then the summary.
fn run(args: &Args) -> Res<()> {
    let ctxs = contexts(args)?;
    let n = ctxs.len();
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    println!("# bench: {} ({n} GPUs: {}), CUDA driver {}", args.machine, ctxs[0].name().unwrap_or_default(), driver::driver_version().unwrap_or(0));
    println!(
        "# #wrong: every element of every rank's output checked up to {} MiB per buffer; larger outputs: {WINDOWS} evenly spaced windows of {WINDOW} elements per rank (~1M, first and last included) ('sampled')",
        FULL_CHECK_BYTES / MIB
    );
    if args.graph {
        println!("# --graph: time per call replayed from one CUDA graph of up to {GRAPH_CALLS} calls (all ranks in one capture); cudarc's event tracking off; enqueue times below are still eager calls");
    }
    if args.copy {
        copy_sweep(args, &ctxs)?;
    }
    let plan = Plan::new(args, n);
    let per_impl = plan.points().len();
    let mut progress = Progress { done: 0, total: per_impl * args.impls.len() };
    let csv_path = collectives_csv(args);
    Csv::create(&csv_path, CSV_HEADER)?;
    let tmp = std::env::temp_dir().join(format!("cuda-peer-bench-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let mut shim: Option<Option<PathBuf>> = None;
    let mut nccl_missing = false;
    let mut enqueue = Vec::new();
    for &imp in &args.impls {
        let start = progress.done;
        if imp.is_nccl() {
            if !cfg!(feature = "nccl") {
                println!("# {}: skipped: built without the `nccl` feature (cargo build --release --examples --features nccl)", imp.name());
            } else if !nccl_missing {
                let shim = shim.get_or_insert_with(|| nccl_shim(args, &tmp));
                match run_nccl_child(args, imp, &progress, shim.as_deref(), &tmp) {
                    Ok(ChildEnd::Finished(us)) => enqueue.push((imp, us)),
                    Ok(ChildEnd::Failed) => {}
                    Ok(ChildEnd::NoNccl) => nccl_missing = true,
                    Err(e) => println!("# {}: skipped: could not run the NCCL child: {e}", imp.name()),
                }
            }
        } else {
            match run_peer(args, imp, &ctxs, &plan, &mut progress, &csv_path) {
                Ok(us) => enqueue.push((imp, us)),
                Err(e) => println!("# {}: stopped: {e}", imp.name()),
            }
        }
        progress.done = start + per_impl;
    }
    let _ = std::fs::remove_dir_all(&tmp);
    print_summary(args, &enqueue)
}

/// Sweeps one cuda-peer implementation, then measures its enqueue time.
fn run_peer(args: &Args, imp: Impl, ctxs: &[Arc<CudaContext>], plan: &Plan, progress: &mut Progress, csv: &Path) -> Res<f64> {
    let backend = peer_backend(imp, ctxs)?;
    sweep(&backend, args, plan, progress, &mut Csv::append(csv)?)?;
    let us = enqueue_us(&backend)?;
    println!(
        "# {}: enqueue {us:.2} us per 4 KiB all_reduce, of which cudarc's event tracking of the buffers alone takes {:.2} us",
        imp.name(),
        tracking_us(&backend)?
    );
    Ok(us)
}

fn main() {
    let args = Args::parse();
    let gpus = match driver::device_count() {
        Ok(0) => Err(cuda_peer::Error::NoDevice),
        other => other,
    };
    match gpus {
        Err(e) => {
            eprintln!("bench: no usable CUDA device: {e}");
            std::process::exit(2);
        }
        Ok(1) => {
            eprintln!("bench: needs at least 2 GPUs, found 1");
            std::process::exit(2);
        }
        Ok(_) => {}
    }
    if args.min_bytes == 0 || args.min_bytes > args.max_bytes {
        eprintln!("bench: need 0 < --min-bytes <= --max-bytes");
        std::process::exit(2);
    }
    let result = match &args.child_report {
        #[cfg(feature = "nccl")]
        Some(report) => match args.impls.as_slice() {
            [imp] if imp.is_nccl() => nccl::child(&args, *imp, report),
            _ => Err("--child-report takes exactly one NCCL impl".into()),
        },
        #[cfg(not(feature = "nccl"))]
        Some(_) => Err("--child-report needs the `nccl` feature".into()),
        None => run(&args),
    };
    if let Err(e) = result {
        eprintln!("bench: {e}");
        std::process::exit(1);
    }
}
