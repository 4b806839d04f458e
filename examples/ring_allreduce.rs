//! All-reduce over every visible GPU (or `--ranks N`, laid round-robin over
//! the GPUs), checked against a CPU reference, with time, algbw and busbw
//! as nccl-tests report them (busbw = algbw * 2(N-1)/N).
//!
//!     cargo run --release --example ring_allreduce -- [--ranks N] [--bytes B]
//!         [--dtype f32|f64|f16|bf16|i32|i64|u32|u64|i8|u8] [--op sum|prod|min|max|avg]
//!         [--path auto|p2p|staged] [--iters N] [--timings] [--lazy-kernels] [--first-call]
//!
//! `--timings` prints to stderr how long the start took, step by step
//! (contexts, group creation without kernels, kernel loading, first call);
//! `--first-call` times on the host (enqueue and synchronise) the first
//! all-reduce of an element type and reduction not used before, against a
//! repeat of it and an ordinary call; `--lazy-kernels` creates the group
//! with `GroupOptions::lazy_kernels` (modules loaded on first use).

mod common;

use clap::Parser;
use cuda_peer::cudarc::driver::{CudaSlice, CudaStream};
use cuda_peer::{driver, Algorithm, DType, Element, Group, GroupOptions, PathPolicy, ReduceOp, Selected};
use half::{bf16, f16};
use rand::Rng;
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Ring all-reduce over the GPUs of this host, checked and timed")]
struct Args {
    /// Ranks in the group (default: one per GPU). Ranks are laid round-robin over the GPUs.
    #[arg(long)]
    ranks: Option<usize>,
    /// Bytes per rank: a multiple of the element type's size.
    #[arg(long, default_value_t = 64 << 20)]
    bytes: usize,
    /// Element type: f32, f64, f16, bf16, i32, i64, u32, u64, i8 or u8.
    #[arg(long, default_value = "f32")]
    dtype: DType,
    /// Reduction: sum, prod, min, max or avg (avg: floating-point types only).
    #[arg(long, default_value = "sum")]
    op: ReduceOp,
    /// Link path policy.
    #[arg(long, default_value = "auto")]
    path: PathPolicy,
    /// All-reduce algorithm: auto (by size: one-shot, mesh or ring, where every rank has its own GPU), ring, mesh or oneshot.
    #[arg(long, default_value = "auto")]
    algorithm: Algorithm,
    /// Timed iterations (after 5 warm-up iterations), at least 1.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
    /// Print the start-up steps' times to stderr (the group is then created with lazy kernels and warmed up explicitly, to time the two apart).
    #[arg(long)]
    timings: bool,
    /// Create the group with `lazy_kernels` (each module loaded on first use, not at creation).
    #[arg(long)]
    lazy_kernels: bool,
    /// After the run, time the first all-reduce of a new element type and reduction against an ordinary call.
    #[arg(long)]
    first_call: bool,
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

/// `two_calls` for the element type `dtype`.
fn two_calls_of(dtype: DType, group: &Group, streams: &[Arc<CudaStream>], op: ReduceOp, bytes: usize) -> cuda_peer::Result<(f64, f64)> {
    let count = (bytes / dtype.size()).max(1);
    match dtype {
        DType::F32 => two_calls::<f32>(group, streams, op, count),
        DType::F64 => two_calls::<f64>(group, streams, op, count),
        DType::F16 => two_calls::<f16>(group, streams, op, count),
        DType::BF16 => two_calls::<bf16>(group, streams, op, count),
        DType::I32 => two_calls::<i32>(group, streams, op, count),
        DType::I64 => two_calls::<i64>(group, streams, op, count),
        DType::U32 => two_calls::<u32>(group, streams, op, count),
        DType::U64 => two_calls::<u64>(group, streams, op, count),
        DType::I8 => two_calls::<i8>(group, streams, op, count),
        DType::U8 => two_calls::<u8>(group, streams, op, count),
    }
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

fn run<T: Num>(args: &Args, group: &Group, streams: &[Arc<CudaStream>]) -> cuda_peer::Result<()> {
    let n = group.size();
    let count = (args.bytes / std::mem::size_of::<T>()).max(1);
    let bytes = count * std::mem::size_of::<T>();
    let mut rng = rand::rng();
    let inputs: Vec<Vec<T>> = (0..n).map(|_| (0..count).map(|_| T::from_f64(draw(&mut rng, T::DTYPE, args.op, n))).collect()).collect();
    let mut bufs: Vec<CudaSlice<T>> = inputs.iter().zip(streams).map(|(d, s)| s.clone_htod(d)).collect::<Result<_, _>>().map_err(err("upload"))?;

    // Check once, against the CPU reference.
    group.all_reduce_in_place(&mut bufs, args.op)?;
    let mut wrong = 0usize;
    let eps = match T::DTYPE {
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
        DType::F32 => 1.2e-7,
        _ => 2.3e-16,
    };
    for (r, b) in bufs.iter().enumerate() {
        let got = streams[r].clone_dtoh(b).map_err(err("download"))?;
        for i in 0..count {
            let xs = inputs.iter().map(|v| v[i].to_f64());
            let (want, scale) = match args.op {
                ReduceOp::Sum => (xs.clone().sum::<f64>(), xs.map(f64::abs).sum::<f64>()),
                ReduceOp::Avg => (xs.clone().sum::<f64>() / n as f64, xs.map(f64::abs).sum::<f64>() / n as f64),
                ReduceOp::Prod => {
                    let p = xs.product::<f64>();
                    (p, p.abs())
                }
                ReduceOp::Min => (xs.fold(f64::INFINITY, f64::min), 0.0),
                ReduceOp::Max => (xs.fold(f64::NEG_INFINITY, f64::max), 0.0),
            };
            let tol = if T::DTYPE.is_float() { 2.0 * eps * (n as f64 + 1.0) * scale } else { 0.0 };
            if (got[i].to_f64() - want).abs() > tol {
                wrong += 1;
            }
        }
    }

    // Time back-to-back iterations with events on rank 0's stream.
    let ctx0 = streams[0].context();
    let (start, end) = (
        ctx0.new_event(Some(cuda_peer::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(err("event"))?,
        ctx0.new_event(Some(cuda_peer::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(err("event"))?,
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
        // Max keeps the values bounded however many iterations run.
        group.all_reduce_in_place(&mut bufs, ReduceOp::Max)?;
    }
    for s in &streams[1..] {
        streams[0].join(s).map_err(err("join"))?;
    }
    end.record(&streams[0]).map_err(err("record"))?;
    end.synchronize().map_err(err("sync"))?;
    let us = start.elapsed_ms(&end).map_err(err("elapsed"))? as f64 * 1e3 / args.iters as f64;
    let algbw = bytes as f64 / us / 1e3;
    let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
    println!("{:>12} {:>10} {:>6} {:>6} {:>10} {:>9} {:>9} {:>7}", "bytes", "count", "type", "redop", "time(us)", "algbw", "busbw", "#wrong");
    println!("{:>12} {:>10} {:>6} {:>6} {:>10.1} {:>9.2} {:>9.2} {:>7}", bytes, count, T::DTYPE.name(), args.op.name(), us, algbw, busbw, wrong);
    println!("(GB/s; time is the mean of {} back-to-back all-reduces, #wrong from the checked run)", args.iters);
    if wrong > 0 {
        return Err(cuda_peer::Error::InvalidArgument(format!("{wrong} wrong elements")));
    }
    Ok(())
}

fn main() {
    let t0 = Instant::now();
    let args = Args::parse();
    // Checked before any GPU is opened: clear errors for bad arguments.
    if args.bytes % args.dtype.size() != 0 {
        eprintln!("ring_allreduce: --bytes {} is not a multiple of {}'s size ({} bytes)", args.bytes, args.dtype, args.dtype.size());
        std::process::exit(64);
    }
    if let Err(e) = args.op.check(args.dtype) {
        eprintln!("ring_allreduce: {e}");
        std::process::exit(64);
    }
    if args.ranks == Some(0) {
        eprintln!("ring_allreduce: --ranks must be at least 1");
        std::process::exit(64);
    }
    if args.timings && log::set_logger(&StderrLog).is_ok() {
        log::set_max_level(log::LevelFilter::Debug);
    }
    let gpus = common::gpus_or_exit("ring_allreduce");
    let result = (|| -> cuda_peer::Result<()> {
        let ranks = args.ranks.unwrap_or(gpus);
        let t = Instant::now();
        let ctx = driver::all_contexts()?;
        let streams: Vec<Arc<CudaStream>> = (0..ranks).map(|r| ctx[r % gpus].new_stream()).collect::<Result<_, _>>().map_err(err("stream"))?;
        let t_ctx = ms(t);
        let opts = GroupOptions::with_policy(args.path).algorithm(args.algorithm).lazy_kernels(args.lazy_kernels || args.timings);
        let t = Instant::now();
        let group = Group::new(streams.clone(), &opts)?;
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
        println!("# ring_allreduce: {ranks} ranks on {gpus} GPU(s): {}; algorithm {algo}", ctx[0].name().unwrap_or_default());
        for r in 0..ranks {
            let st = group.link_status(r).expect("rank exists");
            println!("#   rank {} (GPU{}) <- rank {}: {} ({})", r, r % gpus, (r + ranks - 1) % ranks, st.path, st.reason);
        }
        let t = Instant::now();
        match args.dtype {
            DType::F32 => run::<f32>(&args, &group, &streams),
            DType::F64 => run::<f64>(&args, &group, &streams),
            DType::F16 => run::<f16>(&args, &group, &streams),
            DType::BF16 => run::<bf16>(&args, &group, &streams),
            DType::I32 => run::<i32>(&args, &group, &streams),
            DType::I64 => run::<i64>(&args, &group, &streams),
            DType::U32 => run::<u32>(&args, &group, &streams),
            DType::U64 => run::<u64>(&args, &group, &streams),
            DType::I8 => run::<i8>(&args, &group, &streams),
            DType::U8 => run::<u8>(&args, &group, &streams),
        }?;
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
            let (first, repeat) = two_calls_of(new_dtype, &group, &streams, new_op, args.bytes)?;
            let (_, ordinary) = two_calls_of(args.dtype, &group, &streams, args.op, args.bytes)?;
            println!(
                "# first call of ({}, {}): {first:.1} us; its repeat: {repeat:.1} us; an ordinary ({}, {}) call: {ordinary:.1} us (host: enqueue and synchronise; lazy kernels: {})",
                new_dtype.name(),
                new_op.name(),
                args.dtype.name(),
                args.op.name(),
                args.lazy_kernels
            );
        }
        Ok(())
    })();
    if let Err(e) = result {
        eprintln!("ring_allreduce: {e}");
        std::process::exit(1);
    }
}
