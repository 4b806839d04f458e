//! All-reduce with the per-rank API over every visible GPU, checked against a
//! CPU reference, with time, algbw and busbw as nccl-tests report them
//! (busbw = algbw * 2(N-1)/N).
//!
//! `Comm::from_devices` makes one `cuda_peer::Comm` per stream, one stream
//! per GPU (`--ranks N` lays N ranks round-robin over the GPUs; with one
//! GPU, two ranks share it). Each rank's thread then uploads its own input
//! and calls `all_reduce` on its own buffers, as a program with one thread
//! or process per GPU calls `cudarc::nccl::Comm`; each rank checks its own
//! result, and the time printed is the slowest rank's.
//!
//!     cargo run --release --example ring_allreduce -- [--ranks N] [--bytes B]
//!         [--dtype f32|f64|f16|bf16|i32|i64|u32|u64|i8|u8|f8e4m3|f8e5m2] [--op sum|prod|min|max|avg]
//!         [--path auto|p2p|staged] [--iters N] [--api comm|group|both]
//!         [--algorithm auto|ring|mesh|oneshot] [--timings] [--lazy-kernels] [--first-call]
//!
//! `--api group` runs the same all-reduce through the single-process
//! `Group` instead (one caller passes every rank's buffers; its own ring,
//! mesh and one-shot, picked by size), `--api both` runs both on the same
//! inputs and prints a row for each. The rest are options of the `Group`
//! (without `--api`, any of them selects `--api group`; with `--api comm`
//! they are refused): `--algorithm` forces one of its
//! algorithms; `--timings` prints to stderr how long the start took, step
//! by step (contexts, group creation without kernels, kernel loading, first
//! call); `--first-call` times on the host (enqueue and synchronise) the
//! first all-reduce of an element type and reduction not used before,
//! against a repeat of it and an ordinary call; `--lazy-kernels` creates
//! the group with `GroupOptions::lazy_kernels` (modules loaded on first
//! use).
//!
//! Without a usable GPU it prints one line and exits 2.

mod common;

use clap::{Parser, ValueEnum};
use cuda_peer::comm::Engine;
use cuda_peer::cudarc::driver::sys::CUevent_flags;
use cuda_peer::cudarc::driver::{CudaSlice, CudaStream};
use cuda_peer::float8::{F8E4M3, F8E5M2};
use cuda_peer::{driver, Algorithm, Comm, CommOptions, DType, Element, Group, GroupOptions, PathPolicy, ReduceOp, Selected};
use half::{bf16, f16};
use rand::Rng;
use std::sync::{Arc, Barrier};
use std::time::Instant;

/// Which API runs the all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Api {
    /// One `cuda_peer::Comm` per rank, each called from its own thread.
    Comm,
    /// The single-process `Group`: one call with every rank's buffers.
    Group,
    /// Both, one after the other, on the same inputs.
    Both,
}

#[derive(Parser, Debug)]
#[command(about = "All-reduce over the GPUs of this host with one communicator per rank, checked and timed")]
struct Args {
    /// Ranks (default: one per GPU, or two sharing the GPU when there is one). Laid round-robin over the GPUs.
    #[arg(long)]
    ranks: Option<usize>,
    /// Bytes per rank: a multiple of the element type's size.
    #[arg(long, default_value_t = 64 << 20)]
    bytes: usize,
    /// Element type: f32, f64, f16, bf16, i32, i64, u32, u64, i8, u8, f8e4m3 or f8e5m2.
    #[arg(long, default_value = "f32")]
    dtype: DType,
    /// Reduction: sum, prod, min, max or avg (avg: floating-point types only).
    #[arg(long, default_value = "sum")]
    op: ReduceOp,
    /// Path policy: auto (P2P where verified, else staged through host memory), p2p or staged.
    #[arg(long, default_value = "auto")]
    path: PathPolicy,
    /// Timed iterations (after 5 warm-up iterations), at least 1.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
    /// The per-rank `Comm`, the single-process `Group`, or both [default: comm; group when a Group-only option is given].
    #[arg(long, value_enum)]
    api: Option<Api>,
    /// Group only: its all-reduce algorithm, auto (by size: one-shot, mesh or ring, where every rank has its own GPU), ring, mesh or oneshot.
    #[arg(long)]
    algorithm: Option<Algorithm>,
    /// Group only: print the start-up steps' times to stderr (the group is then created with lazy kernels and warmed up explicitly, to time the two apart).
    #[arg(long)]
    timings: bool,
    /// Group only: create the group with `lazy_kernels` (each module loaded on first use, not at creation).
    #[arg(long)]
    lazy_kernels: bool,
    /// Group only: after the run, time the first all-reduce of a new element type and reduction against an ordinary call.
    #[arg(long)]
    first_call: bool,
}

impl Args {
    /// The Group-only options given.
    fn group_only(&self) -> Vec<&'static str> {
        let flags = [
            (self.algorithm.is_some(), "--algorithm"),
            (self.timings, "--timings"),
            (self.lazy_kernels, "--lazy-kernels"),
            (self.first_call, "--first-call"),
        ];
        flags.iter().filter(|(set, _)| *set).map(|(_, f)| *f).collect()
    }

    /// `--api`, or its default: the `Group` when a Group-only option is
    /// given, else the per-rank `Comm`.
    fn api(&self) -> Api {
        self.api.unwrap_or(if self.group_only().is_empty() { Api::Comm } else { Api::Group })
    }
}

trait Num: Element {
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
}
macro_rules! num {
    ($($t:ty: $from:expr, $to:expr;)*) => {$(impl Num for $t {
        fn from_f64(v: f64) -> Self { ($from)(v) }
        fn to_f64(self) -> f64 { ($to)(self) }
    })*};
}
num! {
    f32: |v| v as f32, |x| x as f64;
    f64: |v| v, |x| x;
    f16: f16::from_f64, |x: f16| x.to_f64();
    bf16: bf16::from_f64, |x: bf16| x.to_f64();
    i32: |v| v as i32, |x| x as f64;
    i64: |v| v as i64, |x| x as f64;
    u32: |v| v as u32, |x| x as f64;
    u64: |v| v as u64, |x| x as f64;
    i8: |v| v as i8, |x| x as f64;
    u8: |v| v as u8, |x| x as f64;
    F8E4M3: F8E4M3::from_f64, |x: F8E4M3| F8E4M3::to_f64(&x);
    F8E5M2: F8E5M2::from_f64, |x: F8E5M2| F8E5M2::to_f64(&x);
}

/// `$body` with `$t` the element type of `$dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::F16 => {
                type $t = f16;
                $body
            }
            DType::BF16 => {
                type $t = bf16;
                $body
            }
            DType::I32 => {
                type $t = i32;
                $body
            }
            DType::I64 => {
                type $t = i64;
                $body
            }
            DType::U32 => {
                type $t = u32;
                $body
            }
            DType::U64 => {
                type $t = u64;
                $body
            }
            DType::I8 => {
                type $t = i8;
                $body
            }
            DType::U8 => {
                type $t = u8;
                $body
            }
            DType::F8E4M3 => {
                type $t = F8E4M3;
                $body
            }
            DType::F8E5M2 => {
                type $t = F8E5M2;
                $body
            }
        }
    };
}

fn err<E: std::fmt::Debug>(what: &'static str) -> impl Fn(E) -> cuda_peer::Error {
    move |e| cuda_peer::Error::InvalidArgument(format!("{what}: {e:?}"))
}

/// With `--timings`: the library's log lines (kernel loading) on stderr.
struct StderrLog;

impl log::Log for StderrLog {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::Level::Debug && m.target().starts_with("cuda_peer")
    }
    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            eprintln!("[{}] {}", r.level(), r.args());
        }
    }
    fn flush(&self) {}
}

/// Milliseconds since `t`.
fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Inputs small enough that integer sums and products stay exact in every
/// type and float results are well conditioned.
fn draw(rng: &mut impl Rng, dtype: DType, op: ReduceOp, ranks: usize) -> f64 {
    match (op, dtype.is_float()) {
        (ReduceOp::Prod, true) => rng.random_range(0.9..1.1),
        (ReduceOp::Prod, false) => rng.random_range(1..=2) as f64,
        (_, true) => rng.random_range(-1.0..1.0),
        (_, false) => {
            let cap = if dtype.size() == 1 { 100 / ranks.max(1) } else { 1000 };
            rng.random_range(0..=cap.max(1)) as f64
        }
    }
}

/// How many elements of `got` (one rank's result) differ from the CPU's
/// reduction of `inputs` by more than the type's rounding allows.
fn count_wrong<T: Num>(op: ReduceOp, inputs: &[Vec<T>], got: &[T]) -> usize {
    let n = inputs.len();
    // Each step's relative rounding, and for fp8 the absolute one below
    // its smallest normal (half its smallest subnormal).
    let (eps, tiny) = match T::DTYPE {
        DType::F16 => (1e-3, 0.0),
        DType::BF16 => (8e-3, 0.0),
        DType::F32 => (1.2e-7, 0.0),
        DType::F8E4M3 => (0.0635, 2f64.powi(-10)),
        DType::F8E5M2 => (0.126, 2f64.powi(-17)),
        _ => (2.3e-16, 0.0),
    };
    let mut wrong = 0;
    for (i, g) in got.iter().enumerate() {
        let xs = inputs.iter().map(|v| v[i].to_f64());
        let (want, scale) = match op {
            ReduceOp::Sum => (xs.clone().sum::<f64>(), xs.map(f64::abs).sum::<f64>()),
            ReduceOp::Avg => (xs.clone().sum::<f64>() / n as f64, xs.map(f64::abs).sum::<f64>() / n as f64),
            ReduceOp::Prod => {
                let p = xs.product::<f64>();
                (p, p.abs())
            }
            ReduceOp::Min => (xs.fold(f64::INFINITY, f64::min), 0.0),
            ReduceOp::Max => (xs.fold(f64::NEG_INFINITY, f64::max), 0.0),
        };
        let tol = if T::DTYPE.is_float() { 2.0 * (n as f64 + 1.0) * (eps * scale + tiny) } else { 0.0 };
        if (g.to_f64() - want).abs() > tol {
            wrong += 1;
        }
    }
    wrong
}

/// One API's result: the mean time per call (us) and the wrong elements of
/// the checked call, over every rank.
struct Row {
    api: &'static str,
    us: f64,
    wrong: usize,
}

/// One rank of the per-rank run, on its own thread: the checked
/// out-of-place all-reduce of its input, then the timed in-place ones.
/// Returns its wrong elements and its mean time per call (us).
fn comm_rank<T: Num>(args: &Args, comm: &Comm, inputs: &[Vec<T>], barrier: &Barrier) -> cuda_peer::Result<(usize, f64)> {
    let s = comm.stream();
    let checked = (|| {
        let send = s.clone_htod(&inputs[comm.rank()]).map_err(err("upload"))?;
        let mut recv = s.clone_htod(&vec![T::from_f64(0.0); send.len()]).map_err(err("upload"))?;
        comm.all_reduce(&send, &mut recv, args.op)?;
        let got = s.clone_dtoh(&recv).map_err(err("download"))?;
        Ok::<_, cuda_peer::Error>((count_wrong(args.op, inputs, &got), recv))
    })();
    // Every rank passes the barrier, so one that failed above leaves no
    // peer waiting here (a peer's collectives then time out, bounded).
    barrier.wait();
    let (wrong, mut buf) = checked?;
    let (start, end) = (
        s.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(err("event"))?,
        s.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(err("event"))?,
    );
    // Max keeps the values bounded however many iterations run.
    for _ in 0..5 {
        comm.all_reduce_in_place(&mut buf, ReduceOp::Max)?;
    }
    comm.synchronize()?;
    barrier.wait();
    start.record(s).map_err(err("record"))?;
    for _ in 0..args.iters {
        comm.all_reduce_in_place(&mut buf, ReduceOp::Max)?;
    }
    end.record(s).map_err(err("record"))?;
    comm.synchronize()?;
    let us = start.elapsed_ms(&end).map_err(err("elapsed"))? as f64 * 1e3 / args.iters as f64;
    Ok((wrong, us))
}

/// The per-rank API: `Comm::from_devices` on `streams`, then one thread per
/// rank.
fn run_comm<T: Num>(args: &Args, streams: &[Arc<CudaStream>], inputs: &[Vec<T>]) -> cuda_peer::Result<Row> {
    let t = Instant::now();
    let comms = Comm::from_devices_with(streams.to_vec(), &CommOptions::default().path(args.path))?;
    let engine = match comms[0].engine() {
        Engine::Host(path) => format!("cuda-peer within this host, {path}"),
        other => format!("{other:?}"),
    };
    let ordinals: Vec<String> = comms.iter().map(|c| format!("rank {} on GPU{}", c.rank(), c.ordinal())).collect();
    println!("# comm: Comm::from_devices, one thread per rank ({}): {engine}; made in {:.0} ms", ordinals.join(", "), ms(t));
    let barrier = Barrier::new(comms.len());
    let per_rank: Vec<cuda_peer::Result<(usize, f64)>> = std::thread::scope(|s| {
        let barrier = &barrier;
        let handles: Vec<_> = comms.iter().map(|comm| s.spawn(move || comm_rank(args, comm, inputs, barrier))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(cuda_peer::Error::Internal("a rank's thread panicked".into())))).collect()
    });
    let (mut wrong, mut us) = (0, 0f64);
    for r in per_rank {
        let (w, t) = r?;
        wrong += w;
        us = us.max(t);
    }
    Ok(Row { api: "comm", us, wrong })
}

/// The single-process `Group` on `streams`: one call with every rank's
/// buffers.
fn run_group<T: Num>(args: &Args, group: &Group, streams: &[Arc<CudaStream>], inputs: &[Vec<T>]) -> cuda_peer::Result<Row> {
    let mut bufs: Vec<CudaSlice<T>> = inputs.iter().zip(streams).map(|(d, s)| s.clone_htod(d)).collect::<Result<_, _>>().map_err(err("upload"))?;
    group.all_reduce_in_place(&mut bufs, args.op)?;
    let mut wrong_elems = 0;
    for (r, b) in bufs.iter().enumerate() {
        wrong_elems += count_wrong(args.op, inputs, &streams[r].clone_dtoh(b).map_err(err("download"))?);
    }

    // Time back-to-back iterations with events on rank 0's stream.
    let ctx0 = streams[0].context();
    let (start, end) = (
        ctx0.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(err("event"))?,
        ctx0.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(err("event"))?,
    );
    for _ in 0..5 {
        group.all_reduce_in_place(&mut bufs, ReduceOp::Max)?;
    }
    group.synchronize()?;
    start.record(&streams[0]).map_err(err("record"))?;
    for s in &streams[1..] {
        s.wait(&start).map_err(err("wait"))?;
    }
    for _ in 0..args.iters {
        group.all_reduce_in_place(&mut bufs, ReduceOp::Max)?;
    }
    for s in &streams[1..] {
        streams[0].join(s).map_err(err("join"))?;
    }
    end.record(&streams[0]).map_err(err("record"))?;
    end.synchronize().map_err(err("sync"))?;
    let us = start.elapsed_ms(&end).map_err(err("elapsed"))? as f64 * 1e3 / args.iters as f64;
    Ok(Row { api: "group", us, wrong: wrong_elems })
}

/// Host time (enqueue and synchronise, in us) of two all-reduces of `op`
/// on fresh buffers of `count` elements of `T`: the first and a repeat.
fn two_calls<T: Num>(group: &Group, streams: &[Arc<CudaStream>], op: ReduceOp, count: usize) -> cuda_peer::Result<(f64, f64)> {
    let host = vec![T::from_f64(1.0); count];
    let mut bufs: Vec<CudaSlice<T>> = streams.iter().map(|s| s.clone_htod(&host)).collect::<Result<_, _>>().map_err(err("upload"))?;
    group.synchronize()?;
    let mut times = [0.0; 2];
    for t in &mut times {
        let start = Instant::now();
        group.all_reduce_in_place(&mut bufs, op)?;
        group.synchronize()?;
        *t = start.elapsed().as_secs_f64() * 1e6;
    }
    Ok((times[0], times[1]))
}

/// The `Group` part: creation (timed with `--timings`), the run, and
/// `--first-call`.
fn group_part<T: Num>(args: &Args, streams: &[Arc<CudaStream>], inputs: &[Vec<T>], gpus: usize, t0: Instant, t_ctx: f64) -> cuda_peer::Result<Row> {
    let ranks = streams.len();
    let opts =
        GroupOptions::with_policy(args.path).algorithm(args.algorithm.unwrap_or(Algorithm::Auto)).lazy_kernels(args.lazy_kernels || args.timings);
    let t = Instant::now();
    let group = Group::new(streams.to_vec(), &opts)?;
    let t_group = ms(t);
    let t = Instant::now();
    if args.timings && !args.lazy_kernels {
        group.warm_up()?;
    }
    let t_warm = ms(t);
    let algo = match group.all_reduce_algorithm(args.bytes) {
        Selected::OneShot if group.oneshot_on_host() == Some(true) => "one-shot through host memory",
        Selected::OneShot => "one-shot",
        Selected::Mesh => "mesh",
        Selected::Ring => "ring",
    };
    println!("# group: Group::new, one caller for every rank: algorithm {algo}");
    for r in 0..ranks {
        let st = group.link_status(r).expect("rank exists");
        println!("#   rank {} (GPU{}) <- rank {}: {} ({})", r, r % gpus, (r + ranks - 1) % ranks, st.path, st.reason);
    }
    let t = Instant::now();
    let row = run_group(args, &group, streams, inputs)?;
    let t_run = ms(t);
    if args.timings {
        let image =
            if std::env::var_os(cuda_peer::group::FORCE_PTX_ENV).is_some_and(|v| !v.is_empty() && v != "0") { "ptx-forced" } else { "default" };
        eprintln!(
            "timings_ms dtype={} kernels={image} lazy={} contexts={t_ctx:.1} group_new={t_group:.1} warm_up={t_warm:.1} run={t_run:.1} main_total={:.1}",
            args.dtype.name(),
            args.lazy_kernels,
            ms(t0)
        );
    }
    if args.first_call {
        // A (type, reduction) pair this run has not used: with kernels
        // loaded at creation its first call costs what a repeat does.
        let new_dtype = if args.dtype == DType::BF16 { DType::F16 } else { DType::BF16 };
        let new_op = if args.op == ReduceOp::Min { ReduceOp::Max } else { ReduceOp::Min };
        let calls = |dtype: DType, op: ReduceOp| by_dtype!(dtype, U => two_calls::<U>(&group, streams, op, (args.bytes / dtype.size()).max(1)));
        let (first, repeat) = calls(new_dtype, new_op)?;
        let (_, ordinary) = calls(args.dtype, args.op)?;
        println!(
            "# first call of ({}, {}): {first:.1} us; its repeat: {repeat:.1} us; an ordinary ({}, {}) call: {ordinary:.1} us (host: enqueue and synchronise; lazy kernels: {})",
            new_dtype.name(),
            new_op.name(),
            args.dtype.name(),
            args.op.name(),
            args.lazy_kernels
        );
    }
    Ok(row)
}

fn run<T: Num>(args: &Args, gpus: usize, t0: Instant) -> cuda_peer::Result<()> {
    let ranks = args.ranks.unwrap_or(if gpus >= 2 { gpus } else { 2 });
    let t = Instant::now();
    let ctx = driver::all_contexts()?;
    let new_streams = || (0..ranks).map(|r| ctx[r % gpus].new_stream()).collect::<Result<Vec<_>, _>>().map_err(err("stream"));
    let streams = new_streams()?;
    let t_ctx = ms(t);
    println!("# ring_allreduce: {ranks} rank(s) on {gpus} GPU(s): {}", ctx[0].name().unwrap_or_default());

    let count = (args.bytes / std::mem::size_of::<T>()).max(1);
    let bytes = count * std::mem::size_of::<T>();
    let mut rng = rand::rng();
    let inputs: Vec<Vec<T>> = (0..ranks).map(|_| (0..count).map(|_| T::from_f64(draw(&mut rng, T::DTYPE, args.op, ranks))).collect()).collect();
    let mut rows = Vec::new();
    let api = args.api();
    if api != Api::Group {
        rows.push(run_comm(args, &streams, &inputs)?);
    }
    if api != Api::Comm {
        // Streams of its own: the communicators above are gone, and the two
        // APIs share nothing.
        let streams = if api == Api::Both { new_streams()? } else { streams };
        rows.push(group_part(args, &streams, &inputs, gpus, t0, t_ctx)?);
    }

    println!(
        "{:>6} {:>12} {:>10} {:>6} {:>6} {:>10} {:>9} {:>9} {:>7}",
        "api", "bytes", "count", "type", "redop", "time(us)", "algbw", "busbw", "#wrong"
    );
    for row in &rows {
        let algbw = bytes as f64 / row.us / 1e3;
        let busbw = algbw * 2.0 * (ranks as f64 - 1.0) / ranks as f64;
        println!(
            "{:>6} {:>12} {:>10} {:>6} {:>6} {:>10.1} {:>9.2} {:>9.2} {:>7}",
            row.api,
            bytes,
            count,
            T::DTYPE.name(),
            args.op.name(),
            row.us,
            algbw,
            busbw,
            row.wrong
        );
    }
    println!(
        "(GB/s; time is the mean of {} back-to-back all-reduces (comm: the slowest rank's), #wrong from the checked run over every rank)",
        args.iters
    );
    let wrong: usize = rows.iter().map(|r| r.wrong).sum();
    if wrong > 0 {
        return Err(cuda_peer::Error::InvalidArgument(format!("{wrong} wrong elements")));
    }
    Ok(())
}

/// A bad argument: one line on stderr, exit 64.
fn usage(msg: String) -> ! {
    eprintln!("ring_allreduce: {msg}");
    std::process::exit(64)
}

fn main() {
    let t0 = Instant::now();
    let args = Args::parse();
    // Checked before any GPU is opened: clear errors for bad arguments.
    if args.bytes % args.dtype.size() != 0 {
        usage(format!("--bytes {} is not a multiple of {}'s size ({} bytes)", args.bytes, args.dtype, args.dtype.size()));
    }
    if let Err(e) = args.op.check(args.dtype) {
        usage(e.to_string());
    }
    if args.ranks == Some(0) {
        usage("--ranks must be at least 1".into());
    }
    if let (Some(Api::Comm), Some(flag)) = (args.api, args.group_only().first()) {
        usage(format!("{flag} is an option of the single-process Group: --api group or --api both"));
    }
    if args.timings && log::set_logger(&StderrLog).is_ok() {
        log::set_max_level(log::LevelFilter::Debug);
    }
    let gpus = common::gpus_or_exit("ring_allreduce");
    if let Err(e) = by_dtype!(args.dtype, T => run::<T>(&args, gpus, t0)) {
        eprintln!("ring_allreduce: {e}");
        std::process::exit(1);
    }
}
