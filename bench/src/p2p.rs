//! `p2p`: cuda-peer's point-to-point calls against NCCL, in the style of
//! nccl-tests' `sendrecv_perf` and `alltoall_perf`, every point checked.
//!
//!     cuda-peer-bench p2p [--ops sendrecv,alltoall] [--dtypes f32,bf16] [--ranks N]
//!         [--min-bytes 4] [--max-bytes 1073741824] [--quick] [--iters N] [--warmup N]
//!         [--machine NAME] [--out DIR] [--nccl-lib PATH]
//!
//! | op | what every rank r of n calls |
//! |---|---|
//! | `sendrecv` | one group: a send of its buffer to rank r+1 and a receive from rank r-1 (mod n) |
//! | `alltoall` | block j (of n equal blocks) of its send buffer to rank j, block j of its receive buffer from rank j |
//! | `allreduce` | the sum of every rank's send buffer into its receive buffer (out of place) |
//!
//! | impl | how |
//! |---|---|
//! | `cuda-peer` | [`cuda_peer::Comm::from_devices`], one thread per rank: `comm.group()` with `send` and `recv`, then `end`; [`cuda_peer::Comm::all_to_all`]; [`cuda_peer::Comm::all_reduce`] (`--all-reduce one-shot` or `two-shot` forces its algorithm, and names the rows `cuda-peer-one-shot`, `cuda-peer-two-shot`) |
//! | `cuda-peer-group` | with `--group`, `allreduce` only: the single-process [`cuda_peer::Group`] over the same ranks (`GroupOptions::with_policy`, `Algorithm::Auto`), one thread enqueueing every rank's call (`Group::all_reduce`) |
//! | `nccl` | cudarc's NCCL, `Comm::from_devices` (`ncclCommInitAll`), one thread driving every rank: per call one `ncclGroupStart/End` with every rank's `ncclSend`/`ncclRecv` (alltoall: n of each per rank; allreduce: its `ncclAllReduce`), in a child process with `NCCL_NVLS_ENABLE=0` (`nccl-no-p2p` with `--path staged`: `NCCL_P2P_DISABLE=1` too) |
//!
//! `--path` sets how cuda-peer's ranks reach each other (`auto`, `p2p`,
//! `staged`: through host memory), for the per-rank communicators and the
//! group alike.
//!
//! Ranks: every GPU (at least 2), or `--ranks N`; rank r runs on GPU
//! r mod (GPU count), each rank on a stream of its own, so more ranks than
//! GPUs share them round-robin (how it runs on one GPU). NCCL needs one GPU
//! per rank: with more ranks than GPUs it is skipped (one line says so);
//! with fewer it runs on the first N GPUs, as cuda-peer does.
//!
//! Conventions are nccl-tests' (`doc/PERFORMANCE.md` there, and the
//! factors of `sendrecv.cu` and `alltoall.cu`): `bytes` is the size of the
//! per-rank buffer, the same for send and receive: for `sendrecv` what one
//! rank sends (and receives), for `alltoall` its whole send buffer of n
//! blocks (the requested size rounded down to n equal blocks of whole
//! elements; sizes that round to an empty block are left out). algbw =
//! bytes / time, in GB/s (1e9 bytes per second); busbw = algbw x factor,
//! the bandwidth each rank's links carry, comparable between rank counts:
//! 1 for `sendrecv` (each rank's bytes cross one link once), (n-1)/n for
//! `alltoall` (the block a rank keeps for itself crosses no link), 2(n-1)/n
//! for `allreduce` (nccl-tests' `all_reduce_perf`). `time_us`
//! is the mean per call of back-to-back calls (so host enqueue cost shows
//! where it is the bottleneck), measured with CUDA events on each rank's
//! stream; the slowest rank's mean is the point's (nccl-tests times the
//! host's wall clock around its iterations until they complete, averaged
//! over its processes by default: a call ends with its slowest rank either
//! way).
//!
//! Each point, for each implementation: fresh random inputs (integers in
//! -127..=127, exact in bf16; for `allreduce`, small enough that every
//! partial sum is exact: `BenchElem::input_range`, each rank's element i a function of a fresh
//! seed, its rank and i), receive buffers poisoned with NaN, one call, every
//! rank's receive buffer compared with the CPU reference (in full up to 64
//! MiB per rank, else in windows: `sampled`); mismatches are `wrong` (over
//! every rank). Then warm-up calls, every rank idle, and `iters` timed
//! calls (the sweep's counts: `--iters`, default enough to move ~2 GiB).
//! `{machine}-p2p.csv` gets a row per point (NCCL's rows from the child);
//! at the end a table gives the ratios to NCCL where both ran (and, with
//! `--group`, the per-rank engine's to the group's). A point with
//! wrong elements, or an implementation that stopped part way, makes the
//! exit status 1 (after every point that could run has run).
//!
//! The harness of the sweep ([`crate::harness::Backend`]) takes the four
//! collectives of `kinds::Op` and rows of their CSV, and its one-thread
//! timing (`device::time_calls`) cannot drive communicators that need a
//! thread per rank: here one timing loop, [`time_per_rank`], serves every
//! implementation (a rank's thread times its own stream; the one thread of
//! NCCL and of the group times every stream), and the sweep's plan
//! helpers, buffers, CSV writer, progress lines and NCCL child machinery
//! are reused.

use crate::cli::{Common, P2pArgs, P2pOp};
use crate::data::{check_windows, par_count, BenchElem, Inputs};
use crate::device::{poisoned, sync_all, upload};
use crate::exit::{require_gpus, unusable, Res};
use crate::kinds::Dt;
use crate::nccl::{child_flags, err as nccl_err, nccl_shim, print_header, private_tmp, require_library, run_child, ChildEnv, EXIT_NO_NCCL};
use crate::output::Csv;
use crate::plan::{geometric, iters_for, warmup_for, Progress};
use crate::sweep::describe_group;
use cuda_peer::copy::PathPolicy;
use cuda_peer::cudarc::driver::DevicePtr;
use cuda_peer::cudarc::driver::{sys as cu, CudaContext, CudaSlice, CudaStream};
use cuda_peer::{driver, Comm, CommOptions, DType, Group, GroupOptions, RawBuffer, RawStream, ReduceOp};
use half::bf16;
use rand::Rng;
use std::ffi::OsString;
use std::path::Path;
use std::sync::{mpsc, Arc};

/// The columns of `{machine}-p2p.csv`.
pub(crate) const CSV_HEADER: &str = "impl,op,dtype,ranks,bytes,time_us,algbw_gbs,busbw_gbs,wrong";

/// The implementations' names in the table and the CSV.
const PEER: &str = "cuda-peer";
const GROUP: &str = "cuda-peer-group";
const NCCL: &str = "nccl";

/// NCCL's name for a run on `path`: `staged` runs it without P2P.
fn nccl_name(path: PathPolicy) -> &'static str {
    match path {
        PathPolicy::StagedOnly => "nccl-no-p2p",
        _ => NCCL,
    }
}

/// The suffix of the rows run after a capture (`--after-capture`).
const AFTER_CAPTURE: &str = "-after-capture";

/// `name`'s rows after a capture.
fn after_capture(name: &str) -> &'static str {
    // A handful of names per run.
    Box::leak(format!("{name}{AFTER_CAPTURE}").into_boxed_str())
}

/// The elements of the all-reduce each rank captures (`--after-capture`).
const CAPTURED_COUNT: usize = 1024;

/// Input magnitude of the moving calls: every integer up to 256 is exact in bf16.
const RANGE: i64 = 127;

/// cuda-peer's name in the table and the CSV for its all-reduce algorithm
/// (the forced ones named).
fn peer_name(a: cuda_peer::AllReduceAlgorithm) -> &'static str {
    match a.name() {
        "one-shot" => "cuda-peer-one-shot",
        "two-shot" => "cuda-peer-two-shot",
        _ => PEER,
    }
}

/// The input magnitude of `op` on `T` over `n` ranks.
fn range<T: BenchElem>(op: P2pOp, n: usize) -> i64 {
    match op {
        P2pOp::AllReduce => T::input_range(n),
        P2pOp::SendRecv | P2pOp::AllToAll => RANGE,
    }
}

/// busbw / algbw, as nccl-tests defines it for `n` ranks.
pub(crate) fn bus_factor(op: P2pOp, n: usize) -> f64 {
    match op {
        P2pOp::SendRecv => 1.0,
        P2pOp::AllToAll => (n as f64 - 1.0) / n as f64,
        P2pOp::AllReduce => 2.0 * (n as f64 - 1.0) / n as f64,
    }
}

/// One rank's buffers of a point (send and receive alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shape {
    /// Elements of each buffer.
    elems: usize,
    /// Elements of the block for one peer: all of them for sendrecv, 1/n for alltoall.
    block: usize,
    /// The size column: the buffer in bytes.
    bytes: usize,
}

impl Shape {
    /// The shape for a requested size, or `None` when it rounds to nothing.
    fn new(op: P2pOp, bytes: usize, esz: usize, n: usize) -> Option<Shape> {
        let elems = bytes / esz;
        let block = match op {
            P2pOp::SendRecv | P2pOp::AllReduce => elems,
            P2pOp::AllToAll => elems / n,
        };
        let elems = match op {
            P2pOp::SendRecv | P2pOp::AllReduce => elems,
            P2pOp::AllToAll => block * n,
        };
        (block > 0).then_some(Shape { elems, block, bytes: elems * esz })
    }
}

/// One point of the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Point {
    op: P2pOp,
    dt: Dt,
    shape: Shape,
}

/// The points over `n` ranks, in order: ops, then element types, then
/// sizes doubling (quadrupling with `--quick`) from `--min-bytes` to
/// `--max-bytes`.
fn points(args: &P2pArgs, n: usize) -> Vec<Point> {
    let sizes = geometric(args.min_bytes, args.max_bytes, if args.quick { 4 } else { 2 });
    let mut v = Vec::new();
    for &op in &args.ops {
        for &dt in &args.dtypes {
            v.extend(sizes.iter().filter_map(|&b| Shape::new(op, b, dt.size(), n)).map(|shape| Point { op, dt, shape }));
        }
    }
    v
}

/// The correct element `i` of rank `rank`'s receive buffer (`block`: the
/// shape's block).
fn expected(inputs: &Inputs, op: P2pOp, n: usize, block: usize, rank: usize, i: usize) -> i64 {
    match op {
        P2pOp::SendRecv => inputs.value((rank + n - 1) % n, i),
        P2pOp::AllToAll => inputs.value(i / block, rank * block + i % block),
        P2pOp::AllReduce => (0..n).map(|k| inputs.value(k, i)).sum(),
    }
}

/// One measured point: a row of the table and of the CSV.
#[derive(Debug, Clone, PartialEq)]
struct Row {
    imp: &'static str,
    point: Point,
    ranks: usize,
    time_us: f64,
    wrong: u64,
    sampled: bool,
}

impl Row {
    fn algbw(&self) -> f64 {
        self.point.shape.bytes as f64 / self.time_us / 1e3
    }

    fn busbw(&self) -> f64 {
        self.algbw() * bus_factor(self.point.op, self.ranks)
    }

    fn csv(&self) -> String {
        let p = &self.point;
        format!(
            "{},{},{},{},{},{:.3},{:.6},{:.6},{}",
            self.imp,
            p.op.name(),
            p.dt.name(),
            self.ranks,
            p.shape.bytes,
            self.time_us,
            self.algbw(),
            self.busbw(),
            self.wrong
        )
    }

    fn print(&self) {
        let p = &self.point;
        println!(
            "{:>10} {:>9} {:>5} {:>5} {:>12} {:>11} {:>10.2} {:>8.2} {:>8.2} {:>7} {:>7}",
            self.imp,
            p.op.name(),
            p.dt.name(),
            self.ranks,
            p.shape.bytes,
            p.shape.elems,
            self.time_us,
            self.algbw(),
            self.busbw(),
            self.wrong,
            if self.sampled { "sampled" } else { "all" }
        );
    }
}

fn print_table_header() {
    println!(
        "#{:>9} {:>9} {:>5} {:>5} {:>12} {:>11} {:>10} {:>8} {:>8} {:>7} {:>7}",
        "impl", "op", "dtype", "ranks", "bytes", "count", "time_us", "algbw", "busbw", "#wrong", "checked"
    );
}

/// A row read back from the CSV (NCCL's rows come from the child).
#[derive(Debug, Clone, PartialEq)]
struct CsvRow {
    imp: String,
    op: String,
    dtype: String,
    ranks: usize,
    bytes: usize,
    time_us: f64,
    busbw: f64,
    wrong: u64,
}

/// Every row of a CSV of [`CSV_HEADER`]'s columns.
fn read_rows(path: &Path) -> Res<Vec<CsvRow>> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut rows = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        let bad = || format!("{}: a malformed row: {line}", path.display());
        if f.len() != 9 {
            return Err(bad().into());
        }
        rows.push(CsvRow {
            imp: f[0].to_string(),
            op: f[1].to_string(),
            dtype: f[2].to_string(),
            ranks: f[3].parse().map_err(|_| bad())?,
            bytes: f[4].parse().map_err(|_| bad())?,
            time_us: f[5].parse().map_err(|_| bad())?,
            busbw: f[7].parse().map_err(|_| bad())?,
            wrong: f[8].parse().map_err(|_| bad())?,
        });
    }
    Ok(rows)
}

/// The ratios of every other cuda-peer implementation that `which` takes
/// to `base` (NCCL's rows, the group's, or cuda-peer's before a capture)
/// at every point where both ran.
fn print_ratios(rows: &[CsvRow], base: &str, which: impl Fn(&str) -> bool) {
    let key = |r: &CsvRow| (r.op.clone(), r.dtype.clone(), r.ranks, r.bytes);
    let based: std::collections::HashMap<_, &CsvRow> = rows.iter().filter(|r| r.imp == base).map(|r| (key(r), r)).collect();
    let both: Vec<(&CsvRow, &CsvRow)> = rows
        .iter()
        .filter(|r| r.imp.starts_with(PEER) && r.imp != base && which(&r.imp))
        .filter_map(|r| based.get(&key(r)).map(|n| (r, *n)))
        .collect();
    println!("#");
    if both.is_empty() {
        println!("# ratios to {base}: none (no point ran on both)");
        return;
    }
    println!("# cuda-peer (its rows' name) vs {base}: t_ratio = cuda-peer time / {base} time (< 1: cuda-peer faster); bw_ratio = busbw ratio (> 1: cuda-peer faster)");
    println!(
        "#{:>17} {:>9} {:>5} {:>5} {:>12} {:>10} {:>10} {:>7} {:>8} {:>8} {:>8}",
        "impl", "op", "dtype", "ranks", "bytes", "peer_us", "base_us", "t_ratio", "peer_bw", "base_bw", "bw_ratio"
    );
    for (p, n) in both {
        println!(
            "{:>18} {:>9} {:>5} {:>5} {:>12} {:>10.2} {:>10.2} {:>7.2} {:>8.2} {:>8.2} {:>8.2}",
            p.imp,
            p.op,
            p.dtype,
            p.ranks,
            p.bytes,
            p.time_us,
            n.time_us,
            p.time_us / n.time_us,
            p.busbw,
            n.busbw,
            p.busbw / n.busbw
        );
    }
}

/// Mean microseconds per call on each of `streams`: `warmup` calls, every
/// stream idle, `ready()` (the other ranks' threads idle too), then `iters`
/// back-to-back calls between two CUDA events on each stream.
fn time_per_rank(
    streams: &[Arc<CudaStream>],
    warmup: usize,
    iters: usize,
    mut ready: impl FnMut() -> Res<()>,
    mut call: impl FnMut() -> Res<()>,
) -> Res<Vec<f64>> {
    for _ in 0..warmup {
        call()?;
    }
    sync_all(streams)?;
    ready()?;
    let mut events = Vec::with_capacity(streams.len());
    for s in streams {
        let ctx = s.context();
        let start = ctx.new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = ctx.new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))?;
        start.record(s)?;
        events.push((start, end));
    }
    for _ in 0..iters {
        call()?;
    }
    for (s, (_, end)) in streams.iter().zip(&events) {
        end.record(s)?;
    }
    let mut us = Vec::with_capacity(streams.len());
    for (start, end) in &events {
        us.push(start.elapsed_ms(end)? as f64 * 1e3 / iters as f64);
    }
    sync_all(streams)?;
    Ok(us)
}

/// Compares rank `rank`'s receive buffer with the reference: the wrong
/// elements, and whether only windows were checked.
fn check_recv<T: BenchElem>(
    stream: &Arc<CudaStream>,
    recv: &CudaSlice<T>,
    inputs: &Inputs,
    op: P2pOp,
    n: usize,
    block: usize,
    rank: usize,
) -> Res<(u64, bool)> {
    let windows = check_windows(recv.len(), std::mem::size_of::<T>());
    let sampled = windows.len() > 1;
    let mut wrong = 0;
    for w in windows {
        let got = stream.clone_dtoh(&recv.slice(w.clone()))?;
        wrong += par_count(got.len(), |k| got[k].to_f64() != expected(inputs, op, n, block, rank, w.start + k) as f64);
    }
    Ok((wrong, sampled))
}

/// `p2p`: one line and exit 2 where it cannot run; else the parent, or
/// (hidden `--nccl-child`) the NCCL child.
pub(crate) fn main(args: &P2pArgs) -> Res<()> {
    let gpus = require_gpus(1);
    args.common().require_sizes();
    let n = args.ranks.unwrap_or(gpus.max(2));
    if n < 2 {
        unusable(format_args!("p2p needs at least 2 ranks (--ranks)"));
    }
    if args.nccl_child {
        nccl_child(args, n)
    } else {
        parent(args, gpus, n)
    }
}

/// cuda-peer, then NCCL in a child (where every rank has a GPU of its
/// own), then the ratios; exit status 1 for wrong elements or a run cut short.
fn parent(args: &P2pArgs, gpus: usize, n: usize) -> Res<()> {
    let ctxs = driver::all_contexts()?;
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    Csv::create(&args.csv(), CSV_HEADER)?;
    println!(
        "# p2p: {} ({gpus} GPUs: {}), CUDA driver {}, {n} ranks",
        args.machine,
        ctxs[0].name().unwrap_or_default(),
        driver::driver_version().unwrap_or(0)
    );
    println!("# bytes: the per-rank buffer (alltoall: n blocks); algbw = bytes / time; busbw = algbw (sendrecv), algbw * (n-1)/n (alltoall), algbw * 2(n-1)/n (allreduce)");
    println!("# time_us: the slowest rank's mean per call (CUDA events on each rank's stream); #wrong: over every rank's receive buffer");
    let points = points(args, n);
    let grouped = group_points(args, &points);
    let nccl_runs = n <= gpus;
    let nccl = nccl_name(args.path);
    let again = if args.after_capture { 2 } else { 1 };
    let total = points.len() * (again + usize::from(nccl_runs)) + grouped.len() * again;
    let mut stopped = Vec::new();
    let peer = peer_name(args.all_reduce);
    if let Err(e) = run_peer(args, &ctxs, n, &points, total) {
        println!("# {peer}: stopped: {e}");
        stopped.push(peer);
    }
    let mut progress = Progress { done: points.len() * again, total };
    if args.group {
        if let Err(e) = run_group(args, &ctxs, n, &grouped, &mut progress) {
            println!("# {GROUP}: stopped: {e}");
            stopped.push(GROUP);
        }
    }
    progress.done = (points.len() + grouped.len()) * again;
    if nccl_runs {
        // Removed when dropped, after the child.
        let tmp = private_tmp()?;
        let shim = nccl_shim(args.nccl_lib.as_deref(), tmp.path(), true);
        let env = ChildEnv { no_p2p: args.path == PathPolicy::StagedOnly, caller_nvls: false, master_port: None };
        let status = run_child(&child_args(args, n, &progress), &env, shim.as_deref())?;
        match status.code() {
            Some(0) | Some(EXIT_NO_NCCL) => {}
            _ => {
                println!("# {nccl}: the NCCL child process failed ({status}); its remaining points are missing");
                stopped.push(nccl);
            }
        }
    } else {
        println!("#");
        println!("# {nccl}: skipped: NCCL needs one GPU per rank ({n} ranks, {gpus} GPUs); cuda-peer ran with ranks sharing GPUs");
    }
    let rows = read_rows(&args.csv())?;
    let captured = |imp: &str| imp.ends_with(AFTER_CAPTURE);
    print_ratios(&rows, nccl, |_| true);
    if args.group {
        print_ratios(&rows, GROUP, |imp| !captured(imp));
    }
    if args.after_capture {
        for base in [peer, GROUP] {
            let after = after_capture(base);
            print_ratios(&rows, base, |imp| imp == after);
        }
    }
    let wrong = rows.iter().filter(|r| r.wrong > 0).count();
    if wrong > 0 {
        return Err(format!("{wrong} points with wrong elements (the wrong column of {})", args.csv().display()).into());
    }
    if !stopped.is_empty() {
        return Err(format!("stopped part way: {}", stopped.join(", ")).into());
    }
    Ok(())
}

/// The NCCL child's command line: this run's points and ranks, the progress so far.
fn child_args(args: &P2pArgs, n: usize, progress: &Progress) -> Vec<OsString> {
    let ops: Vec<&str> = args.ops.iter().map(|o| o.name()).collect();
    let mut v: Vec<OsString> = vec!["p2p".into(), "--nccl-child".into(), format!("--ops={}", ops.join(",")).into(), format!("--ranks={n}").into()];
    v.push(format!("--path={}", args.path.name()).into());
    v.extend(child_flags(&args.common(), progress));
    v
}

/// What one rank measured at one point.
#[derive(Debug, Clone, Copy)]
struct RankPoint {
    time_us: f64,
    wrong: u64,
    sampled: bool,
}

/// cuda-peer over `n` ranks (rank r on `ctxs[r % len]`, each on a new
/// stream), one thread per rank: every point, rows printed and appended to
/// the CSV as every rank's result comes in.
fn run_peer(args: &P2pArgs, ctxs: &[Arc<CudaContext>], n: usize, points: &[Point], total: usize) -> Res<()> {
    let (devices, streams) = rank_streams(ctxs, n)?;
    let comms = Comm::from_devices_with(streams, &CommOptions::default().all_reduce(args.all_reduce).path(args.path))?;
    let peer = peer_name(args.all_reduce);
    println!("#");
    println!(
        "# {peer}: {n} ranks on GPUs {devices:?}, a thread each (Comm::from_devices), path policy {}, engine {:?}, all-reduce {:?}",
        args.path.name(),
        comms[0].engine(),
        args.all_reduce
    );
    peer_sweep(args, &comms, peer, points, Progress { done: 0, total })?;
    if args.after_capture {
        capture_each(&comms)?;
        let after = after_capture(peer);
        println!("#");
        println!("# {after}: the same communicators, each rank having captured one all-reduce into a CUDA graph (then dropped)");
        peer_sweep(args, &comms, after, points, Progress { done: points.len(), total })?;
    }
    Ok(())
}

/// Each rank captures one all-reduce (raw pointers: the buffer's cudarc
/// events stay out of the capture) into a CUDA graph on its stream, on its
/// own thread, and drops the graph.
fn capture_each(comms: &[Comm]) -> Res<()> {
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                s.spawn(move || -> Result<(), String> {
                    let stream = comm.stream().clone();
                    let x = stream.alloc_zeros::<f32>(CAPTURED_COUNT).map_err(|e| format!("{e:?}"))?;
                    stream.synchronize().map_err(|e| format!("{e:?}"))?;
                    let ptr = RawBuffer(x.device_ptr(&stream).0);
                    capture_on(std::slice::from_ref(&stream), || {
                        // SAFETY: `x` holds CAPTURED_COUNT f32 on the rank's
                        // device and outlives the capture (the graph is
                        // dropped unlaunched); the stream is the rank's own.
                        unsafe { comm.all_reduce_raw(ptr, ptr, CAPTURED_COUNT, DType::F32, ReduceOp::Sum, RawStream(stream.cu_stream())) }
                    })
                    .map_err(|e| format!("rank {}: {e}", comm.rank()))
                })
            })
            .collect();
        let mut first = Ok(());
        for h in handles {
            let r = h.join().unwrap_or_else(|_| Err("a capturing thread panicked".into()));
            if first.is_ok() {
                first = r;
            }
        }
        first.map_err(Into::into)
    })
}

/// Captures `call` (which enqueues on `streams`, forked from the first)
/// into a CUDA graph and drops it.
fn capture_on(streams: &[Arc<CudaStream>], call: impl FnOnce() -> cuda_peer::Result<()>) -> Result<(), String> {
    let s0 = &streams[0];
    s0.begin_capture(cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(|e| format!("begin capture: {e:?}"))?;
    let mut res = s0
        .record_event(None)
        .map_err(|e| format!("{e:?}"))
        .and_then(|fork| streams[1..].iter().try_for_each(|s| s.wait(&fork).map_err(|e| format!("{e:?}"))));
    res = res.and_then(|()| call().map_err(|e| format!("the captured all-reduce: {e}")));
    for s in &streams[1..] {
        res = res.and_then(|()| s0.join(s).map_err(|e| format!("{e:?}")));
    }
    let graph = s0.end_capture(cu::CUgraphInstantiate_flags(0));
    res?;
    drop(graph.map_err(|e| format!("end capture: {e:?}"))?);
    Ok(())
}

/// Every point of `points` on each of `comms`, one thread per rank: rows
/// named `name`, printed and appended to the CSV in point order.
fn peer_sweep(args: &P2pArgs, comms: &[Comm], name: &'static str, points: &[Point], progress: Progress) -> Res<()> {
    let (n, peer) = (comms.len(), name);
    print_table_header();
    let common = args.common();
    let seeds: Vec<u64> = points.iter().map(|_| rand::rng().random()).collect();
    let mut csv = Csv::append(&args.csv())?;
    let (tx, rx) = mpsc::channel::<(usize, usize, Result<RankPoint, String>)>();
    std::thread::scope(|s| {
        for comm in comms {
            let (tx, common, seeds, progress) = (tx.clone(), &common, &seeds, &progress);
            s.spawn(move || {
                let rank = comm.rank();
                let mut progress = Progress { done: progress.done, total: progress.total };
                for (k, p) in points.iter().enumerate() {
                    if rank == 0 {
                        progress.tick(format_args!("{peer} {} {} {}", p.op.name(), p.dt.name(), p.shape.bytes));
                    }
                    let res = match p.dt {
                        Dt::F32 => peer_point::<f32>(comm, common, p, seeds[k]),
                        Dt::Bf16 => peer_point::<bf16>(comm, common, p, seeds[k]),
                    }
                    .map_err(|e| format!("rank {rank}: {e}"));
                    let failed = res.is_err();
                    if tx.send((k, rank, res)).is_err() || failed {
                        break;
                    }
                }
            });
        }
        drop(tx);
        // Rows in point order, once every rank's result is in; the first
        // error stops the run (the other ranks' threads end when their
        // next call times out, bounded by the communicators' timeouts).
        let mut got: Vec<Vec<RankPoint>> = vec![Vec::new(); points.len()];
        let mut next = 0;
        let mut first_err: Option<String> = None;
        for (k, _rank, res) in rx {
            match res {
                Ok(rp) if first_err.is_none() => got[k].push(rp),
                Ok(_) => {}
                Err(e) => {
                    let p = &points[k];
                    first_err.get_or_insert(format!("{} {} {} bytes: {e}", p.op.name(), p.dt.name(), p.shape.bytes));
                }
            }
            while first_err.is_none() && next < points.len() && got[next].len() == n {
                let ranks = &got[next];
                let row = Row {
                    imp: peer,
                    point: points[next],
                    ranks: n,
                    time_us: ranks.iter().map(|r| r.time_us).fold(0.0, f64::max),
                    wrong: ranks.iter().map(|r| r.wrong).sum(),
                    sampled: ranks.iter().any(|r| r.sampled),
                };
                row.print();
                if let Err(e) = csv.line(&row.csv()) {
                    first_err = Some(e.to_string());
                }
                next += 1;
            }
        }
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    })
}

/// One cuda-peer call of `op` on this rank.
fn peer_call<T: BenchElem>(comm: &Comm, op: P2pOp, send: &CudaSlice<T>, recv: &mut CudaSlice<T>) -> Res<()> {
    match op {
        P2pOp::SendRecv => {
            let (rank, n) = (comm.rank(), comm.world_size());
            let mut g = comm.group();
            g.send(send, (rank + 1) % n)?;
            g.recv(recv, (rank + n - 1) % n)?;
            g.end()?;
        }
        P2pOp::AllToAll => comm.all_to_all(send, recv)?,
        P2pOp::AllReduce => comm.all_reduce(send, recv, ReduceOp::Sum)?,
    }
    Ok(())
}

/// One point on this rank (on its own thread; every rank's thread calls it
/// with the same point and seed): check, then time.
fn peer_point<T: BenchElem>(comm: &Comm, common: &Common, p: &Point, seed: u64) -> Res<RankPoint> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let stream = comm.stream().clone();
    let inputs = Inputs { seed, range: range::<T>(p.op, n) };
    let send = upload::<T>(&stream, &inputs, rank, p.shape.elems)?;
    let mut recv = poisoned::<T>(&stream, p.shape.elems)?;
    stream.synchronize()?;
    let ex = comm.exchange();
    ex.barrier()?;
    peer_call(comm, p.op, &send, &mut recv)?;
    comm.synchronize()?;
    let (wrong, sampled) = check_recv(&stream, &recv, &inputs, p.op, n, p.shape.block, rank)?;
    let (warmup, iters) = (warmup_for(common.warmup, p.shape.bytes), iters_for(common.iters, p.shape.bytes));
    let times = time_per_rank(std::slice::from_ref(&stream), warmup, iters, || Ok(ex.barrier()?), || peer_call(comm, p.op, &send, &mut recv))?;
    comm.synchronize()?;
    Ok(RankPoint { time_us: times[0], wrong, sampled })
}

/// The NCCL child: NCCL over the first `n` GPUs, every point.
fn nccl_child(args: &P2pArgs, n: usize) -> Res<()> {
    require_library(true);
    let v = cudarc::nccl::result::get_nccl_version().map_err(|e| nccl_err("ncclGetVersion", e))?;
    let ctxs = driver::all_contexts()?;
    if ctxs.len() < n {
        return Err(format!("NCCL needs one GPU per rank: {n} ranks, {} GPUs", ctxs.len()).into());
    }
    let streams = ctxs[..n].iter().map(|c| c.new_stream()).collect::<Result<Vec<_>, _>>()?;
    let comms = cudarc::nccl::Comm::from_devices(streams.clone()).map_err(|e| nccl_err("ncclCommInitAll", e))?;
    let nccl = nccl_name(args.path);
    print_header(nccl, v, &format!("{n} ranks, one process (ncclCommInitAll), one thread, one group per call"));
    let common = args.common();
    let points = points(args, n);
    let mut progress = Progress::resume(&common, points.len());
    let mut caller = NcclCaller(&comms);
    one_thread(nccl, &streams, &common, &points, &mut progress, &args.csv(), &mut caller)
}

/// An implementation that one thread drives over every rank: its calls,
/// enqueued on every rank's stream.
trait EveryRank {
    /// One call of `p` on every rank (`sends[r]` and `recvs[r]` rank r's).
    fn call<T: BenchElem>(&mut self, p: &Point, sends: &[CudaSlice<T>], recvs: &mut [CudaSlice<T>]) -> Res<()>;
}

/// NCCL's calls, one NCCL group each.
struct NcclCaller<'a>(&'a [cudarc::nccl::Comm]);

impl EveryRank for NcclCaller<'_> {
    fn call<T: BenchElem>(&mut self, p: &Point, sends: &[CudaSlice<T>], recvs: &mut [CudaSlice<T>]) -> Res<()> {
        nccl_call(self.0, p.op, p.shape.block, sends, recvs)
    }
}

/// The group's all-reduce (the only call it runs here).
struct GroupCaller<'a>(&'a Group);

impl EveryRank for GroupCaller<'_> {
    fn call<T: BenchElem>(&mut self, p: &Point, sends: &[CudaSlice<T>], recvs: &mut [CudaSlice<T>]) -> Res<()> {
        match p.op {
            P2pOp::AllReduce => Ok(self.0.all_reduce(sends, recvs, ReduceOp::Sum)?),
            other => Err(format!("the group runs allreduce only, not {}", other.name()).into()),
        }
    }
}

/// Every point of `points` on `imp` (named `name`), driven from this one
/// thread over `streams`: rows printed and appended to `csv`.
fn one_thread<I: EveryRank>(
    name: &'static str,
    streams: &[Arc<CudaStream>],
    common: &Common,
    points: &[Point],
    progress: &mut Progress,
    csv: &Path,
    imp: &mut I,
) -> Res<()> {
    print_table_header();
    let mut csv = Csv::append(csv)?;
    for p in points {
        progress.tick(format_args!("{name} {} {} {}", p.op.name(), p.dt.name(), p.shape.bytes));
        let row = match p.dt {
            Dt::F32 => one_thread_point::<f32, I>(name, imp, streams, common, p),
            Dt::Bf16 => one_thread_point::<bf16, I>(name, imp, streams, common, p),
        }
        .map_err(|e| format!("{name} {} {} {} bytes: {e}", p.op.name(), p.dt.name(), p.shape.bytes))?;
        row.print();
        csv.line(&row.csv())?;
    }
    Ok(())
}

/// The points the group runs (`--group`): the all-reduces.
fn group_points(args: &P2pArgs, points: &[Point]) -> Vec<Point> {
    if !args.group {
        return Vec::new();
    }
    points.iter().copied().filter(|p| p.op == P2pOp::AllReduce).collect()
}

/// The group over `n` ranks (rank r on `ctxs[r % len]`, each on a new
/// stream) with `--path`, every one of `points`.
fn run_group(args: &P2pArgs, ctxs: &[Arc<CudaContext>], n: usize, points: &[Point], progress: &mut Progress) -> Res<()> {
    println!("#");
    if points.is_empty() {
        println!("# {GROUP}: no allreduce in --ops: nothing to run");
        return Ok(());
    }
    let (devices, streams) = rank_streams(ctxs, n)?;
    let group = Group::new(streams.clone(), &GroupOptions::with_policy(args.path))?;
    println!("# {GROUP}: on GPUs {devices:?}, one thread (Group::new), path policy {}", args.path.name());
    describe_group(GROUP, &group);
    one_thread(GROUP, &streams, &args.common(), points, progress, &args.csv(), &mut GroupCaller(&group))?;
    if !args.after_capture {
        return Ok(());
    }
    let xs = streams.iter().map(|s| s.alloc_zeros::<f32>(CAPTURED_COUNT)).collect::<Result<Vec<_>, _>>()?;
    sync_all(&streams)?;
    let ptrs: Vec<RawBuffer> = xs.iter().zip(&streams).map(|(x, s)| RawBuffer(x.device_ptr(s).0)).collect();
    let raw: Vec<RawStream> = streams.iter().map(|s| RawStream(s.cu_stream())).collect();
    // SAFETY: each `xs[r]` holds CAPTURED_COUNT f32 on rank r's device and
    // outlives the capture (the graph is dropped unlaunched); the streams
    // are the group's own.
    capture_on(&streams, || unsafe { group.all_reduce_raw(&ptrs, CAPTURED_COUNT, DType::F32, ReduceOp::Sum, &raw) })?;
    let after = after_capture(GROUP);
    println!("#");
    println!("# {after}: the same group, having captured one all-reduce into a CUDA graph (then dropped)");
    one_thread(after, &streams, &args.common(), points, progress, &args.csv(), &mut GroupCaller(&group))
}

/// Where `n` ranks run, rank r on `ctxs[r % len]`, and a new stream for
/// each there.
fn rank_streams(ctxs: &[Arc<CudaContext>], n: usize) -> Res<(Vec<usize>, Vec<Arc<CudaStream>>)> {
    let devices: Vec<usize> = (0..n).map(|r| r % ctxs.len()).collect();
    let streams = devices.iter().map(|&d| ctxs[d].new_stream()).collect::<Result<Vec<_>, _>>()?;
    Ok((devices, streams))
}

/// One call of `op` on every rank, as one NCCL group.
fn nccl_call<T: BenchElem>(comms: &[cudarc::nccl::Comm], op: P2pOp, block: usize, sends: &[CudaSlice<T>], recvs: &mut [CudaSlice<T>]) -> Res<()> {
    cudarc::nccl::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
    let res = nccl_enqueue(comms, op, block, sends, recvs);
    let end = cudarc::nccl::group_end();
    res?;
    end.map_err(|e| nccl_err("ncclGroupEnd", e))?;
    Ok(())
}

/// Every rank's sends and receives of one call (inside the group).
fn nccl_enqueue<T: BenchElem>(comms: &[cudarc::nccl::Comm], op: P2pOp, block: usize, sends: &[CudaSlice<T>], recvs: &mut [CudaSlice<T>]) -> Res<()> {
    let n = comms.len();
    for (r, ((comm, send), recv)) in comms.iter().zip(sends).zip(recvs.iter_mut()).enumerate() {
        match op {
            P2pOp::SendRecv => {
                comm.send(send, ((r + 1) % n) as i32).map_err(|e| nccl_err("ncclSend", e))?;
                comm.recv(recv, ((r + n - 1) % n) as i32).map_err(|e| nccl_err("ncclRecv", e))?;
            }
            P2pOp::AllReduce => comm.all_reduce(send, recv, &cudarc::nccl::ReduceOp::Sum).map(drop).map_err(|e| nccl_err("ncclAllReduce", e))?,
            P2pOp::AllToAll => {
                for j in 0..n {
                    let blk = j * block..(j + 1) * block;
                    comm.send(&send.slice(blk.clone()), j as i32).map_err(|e| nccl_err("ncclSend", e))?;
                    comm.recv(&mut recv.slice_mut(blk), j as i32).map_err(|e| nccl_err("ncclRecv", e))?;
                }
            }
        }
    }
    Ok(())
}

/// One point of `imp` (named `name`) over every rank, from this thread:
/// check, then time.
fn one_thread_point<T: BenchElem, I: EveryRank>(
    name: &'static str,
    imp: &mut I,
    streams: &[Arc<CudaStream>],
    common: &Common,
    p: &Point,
) -> Res<Row> {
    let n = streams.len();
    let inputs = Inputs::fresh(range::<T>(p.op, n));
    let sends = streams.iter().enumerate().map(|(r, s)| upload::<T>(s, &inputs, r, p.shape.elems)).collect::<Res<Vec<_>>>()?;
    let mut recvs = streams.iter().map(|s| poisoned::<T>(s, p.shape.elems)).collect::<Res<Vec<_>>>()?;
    sync_all(streams)?;
    imp.call(p, &sends, &mut recvs)?;
    sync_all(streams)?;
    let (mut wrong, mut sampled) = (0, false);
    for (r, recv) in recvs.iter().enumerate() {
        let (w, s) = check_recv(&streams[r], recv, &inputs, p.op, n, p.shape.block, r)?;
        wrong += w;
        sampled |= s;
    }
    let (warmup, iters) = (warmup_for(common.warmup, p.shape.bytes), iters_for(common.iters, p.shape.bytes));
    let times = time_per_rank(streams, warmup, iters, || Ok(()), || imp.call(p, &sends, &mut recvs))?;
    Ok(Row { imp: name, point: *p, ranks: n, time_us: times.iter().copied().fold(0.0, f64::max), wrong, sampled })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use crate::units::{GIB, KIB};
    use clap::Parser;
    use std::path::PathBuf;

    fn parse(argv: &[&str]) -> P2pArgs {
        match Cli::try_parse_from(argv).expect("parses").command {
            Some(Command::P2p(a)) => a,
            other => panic!("not p2p: {other:?}"),
        }
    }

    #[test]
    fn the_defaults_are_both_ops_both_types_4_bytes_to_1_gib() {
        let a = parse(&["cuda-peer-bench", "p2p"]);
        assert_eq!(a.ops, vec![P2pOp::SendRecv, P2pOp::AllToAll]);
        assert_eq!(a.dtypes, vec![Dt::F32, Dt::Bf16]);
        assert_eq!((a.ranks, a.min_bytes, a.max_bytes, a.iters, a.warmup, a.quick, a.nccl_child), (None, 4, GIB, None, 5, false, false));
        assert_eq!(a.csv(), PathBuf::from("bench/results/local-p2p.csv"));
    }

    #[test]
    fn every_option_parses() {
        let a = parse(&[
            "cuda-peer-bench",
            "p2p",
            "--ops",
            "alltoall",
            "--dtypes",
            "bf16",
            "--ranks",
            "4",
            "--quick",
            "--max-bytes",
            "65536",
            "--out",
            "/tmp/x",
            "--machine",
            "h200",
        ]);
        assert_eq!((a.ops.clone(), a.dtypes.clone(), a.ranks, a.quick, a.max_bytes), (vec![P2pOp::AllToAll], vec![Dt::Bf16], Some(4), true, 65536));
        assert_eq!(a.csv(), PathBuf::from("/tmp/x/h200-p2p.csv"));
        assert!(Cli::try_parse_from(["cuda-peer-bench", "p2p", "--ops", "allgather"]).is_err());
        assert!(Cli::try_parse_from(["cuda-peer-bench", "p2p", "--all-reduce", "ring"]).is_err());
        let a = parse(&["cuda-peer-bench", "p2p", "--ops", "allreduce", "--all-reduce", "two-shot"]);
        assert_eq!((a.ops.clone(), peer_name(a.all_reduce)), (vec![P2pOp::AllReduce], "cuda-peer-two-shot"));
        assert_eq!(a.all_reduce, cuda_peer::AllReduceAlgorithm::TwoShot);
        assert_eq!(peer_name(parse(&["cuda-peer-bench", "p2p"]).all_reduce), PEER);
        assert!(Cli::try_parse_from(["cuda-peer-bench", "p2p", "--ranks", "two"]).is_err());
        let a = parse(&["cuda-peer-bench", "p2p", "--ops", "sendrecv,allreduce", "--path", "staged", "--group"]);
        assert_eq!((a.path, a.group, nccl_name(a.path)), (PathPolicy::StagedOnly, true, "nccl-no-p2p"));
        let d = parse(&["cuda-peer-bench", "p2p"]);
        assert_eq!((d.path, d.group, d.after_capture, nccl_name(d.path)), (PathPolicy::Auto, false, false, NCCL));
        assert!(parse(&["cuda-peer-bench", "p2p", "--after-capture"]).after_capture);
        assert_eq!(after_capture(GROUP), "cuda-peer-group-after-capture");
        assert!(Cli::try_parse_from(["cuda-peer-bench", "p2p", "--path", "nvlink"]).is_err());
        // The group runs the all-reduces only, and only when asked.
        let ops = |a: &P2pArgs| group_points(a, &points(a, 2)).iter().map(|p| p.op).collect::<Vec<_>>();
        assert!(!ops(&a).is_empty() && ops(&a).iter().all(|&o| o == P2pOp::AllReduce));
        assert_eq!(ops(&a).len(), points(&a, 2).iter().filter(|p| p.op == P2pOp::AllReduce).count());
        assert!(ops(&parse(&["cuda-peer-bench", "p2p", "--ops", "allreduce"])).is_empty());
    }

    #[test]
    fn the_childs_command_line_parses_back_to_the_same_settings() {
        let a = parse(&[
            "cuda-peer-bench",
            "p2p",
            "--ops",
            "sendrecv",
            "--dtypes",
            "f32",
            "--max-bytes",
            "4096",
            "--iters",
            "7",
            "--quick",
            "--machine",
            "m",
            "--path",
            "p2p",
        ]);
        let mut argv: Vec<OsString> = vec!["cuda-peer-bench".into()];
        argv.extend(child_args(&a, 3, &Progress { done: 6, total: 12 }));
        let c = match Cli::try_parse_from(argv).expect("the child's arguments parse").command {
            Some(Command::P2p(c)) => c,
            other => panic!("not p2p: {other:?}"),
        };
        assert!(c.nccl_child);
        assert_eq!(c.path, PathPolicy::P2pOnly);
        assert_eq!((c.ranks, c.progress_offset, c.progress_total), (Some(3), 6, Some(12)));
        assert_eq!((c.ops.clone(), c.dtypes.clone(), c.min_bytes, c.max_bytes), (a.ops.clone(), a.dtypes.clone(), 4, 4096));
        assert_eq!((c.iters, c.warmup, c.quick, c.machine.as_str(), c.out.clone()), (Some(7), 5, true, "m", a.out.clone()));
        assert_eq!(points(&c, 3), points(&a, 3));
    }

    #[test]
    fn sizes_double_from_4_bytes_to_1_gib_quadruple_with_quick_and_stop_at_max_bytes() {
        let bytes = |argv: &[&str], n| points(&parse(argv), n).iter().map(|p| p.shape.bytes).collect::<Vec<_>>();
        let all = bytes(&["b", "p2p", "--ops", "sendrecv", "--dtypes", "f32"], 2);
        assert_eq!(all.len(), 29);
        assert_eq!((all[0], all[1], all[28]), (4, 8, GIB));
        let quick = bytes(&["b", "p2p", "--ops", "sendrecv", "--dtypes", "f32", "--quick"], 2);
        assert_eq!(quick, (0..15).map(|k| 4usize << (2 * k)).collect::<Vec<_>>());
        let capped = bytes(&["b", "p2p", "--ops", "sendrecv", "--dtypes", "f32", "--max-bytes", "100"], 2);
        assert_eq!(capped, vec![4, 8, 16, 32, 64]);
        // Ops, then types, then sizes.
        let p = points(&parse(&["b", "p2p", "--max-bytes", "16"]), 2);
        let order: Vec<_> = p.iter().map(|p| (p.op, p.dt, p.shape.bytes)).collect();
        assert_eq!(order[0], (P2pOp::SendRecv, Dt::F32, 4));
        assert_eq!(order.last(), Some(&(P2pOp::AllToAll, Dt::Bf16, 16)));
    }

    #[test]
    fn alltoall_sizes_round_to_equal_blocks_of_whole_elements() {
        // 3 ranks of f32: 4 and 8 bytes are no whole block; 16 bytes -> 3 blocks of one element.
        assert_eq!(Shape::new(P2pOp::AllToAll, 4, 4, 3), None);
        assert_eq!(Shape::new(P2pOp::AllToAll, 8, 4, 3), None);
        assert_eq!(Shape::new(P2pOp::AllToAll, 16, 4, 3), Some(Shape { elems: 3, block: 1, bytes: 12 }));
        assert_eq!(Shape::new(P2pOp::AllToAll, 4 * KIB, 2, 2), Some(Shape { elems: 2048, block: 1024, bytes: 4 * KIB }));
        assert_eq!(Shape::new(P2pOp::SendRecv, 4, 4, 3), Some(Shape { elems: 1, block: 1, bytes: 4 }));
        assert_eq!(Shape::new(P2pOp::SendRecv, 6, 4, 3), Some(Shape { elems: 1, block: 1, bytes: 4 }));
        assert_eq!(Shape::new(P2pOp::SendRecv, 2, 4, 3), None);
        let p = points(&parse(&["b", "p2p", "--ops", "alltoall", "--dtypes", "f32", "--max-bytes", "64", "--ranks", "8"]), 8);
        assert_eq!(p.iter().map(|p| p.shape.bytes).collect::<Vec<_>>(), vec![32, 64]);
    }

    #[test]
    fn busbw_is_algbw_for_sendrecv_and_n_minus_1_over_n_of_it_for_alltoall() {
        assert_eq!(bus_factor(P2pOp::SendRecv, 2), 1.0);
        assert_eq!(bus_factor(P2pOp::SendRecv, 8), 1.0);
        assert_eq!(bus_factor(P2pOp::AllToAll, 2), 0.5);
        assert_eq!(bus_factor(P2pOp::AllToAll, 4), 0.75);
        assert_eq!(bus_factor(P2pOp::AllToAll, 8), 0.875);
        assert_eq!(bus_factor(P2pOp::AllReduce, 2), 1.0);
        assert_eq!(bus_factor(P2pOp::AllReduce, 4), 1.5);
        // 1 GB in 1000 us: 1000 GB/s.
        let shape = Shape { elems: 250_000_000, block: 62_500_000, bytes: 1_000_000_000 };
        let row = |op| Row { imp: PEER, point: Point { op, dt: Dt::F32, shape }, ranks: 4, time_us: 1000.0, wrong: 0, sampled: true };
        assert_eq!((row(P2pOp::SendRecv).algbw(), row(P2pOp::SendRecv).busbw()), (1000.0, 1000.0));
        assert_eq!((row(P2pOp::AllToAll).algbw(), row(P2pOp::AllToAll).busbw()), (1000.0, 750.0));
        assert_eq!(row(P2pOp::AllToAll).csv(), "cuda-peer,alltoall,f32,4,1000000000,1000.000,1000.000000,750.000000,0");
    }

    #[test]
    fn the_reference_is_each_calls_definition() {
        // Simulate both calls on the CPU from every rank's inputs and
        // compare with `expected`, for a few rank counts and blocks.
        let inputs = Inputs { seed: 42, range: RANGE };
        for n in 2..=5 {
            for block in [1, 3] {
                let elems = n * block;
                let send = |r: usize, i: usize| inputs.value(r, i);
                for rank in 0..n {
                    for i in 0..elems {
                        assert_eq!(expected(&inputs, P2pOp::SendRecv, n, elems, rank, i), send((rank + n - 1) % n, i));
                        // Block j of rank's receive buffer is block `rank` of rank j's send buffer.
                        let (j, k) = (i / block, i % block);
                        assert_eq!(expected(&inputs, P2pOp::AllToAll, n, block, rank, i), send(j, rank * block + k));
                        assert_eq!(expected(&inputs, P2pOp::AllReduce, n, elems, rank, i), (0..n).map(|q| send(q, i)).sum::<i64>());
                    }
                }
            }
        }
        // Exact in bf16 and f32.
        for i in 0..1000 {
            let v = inputs.value(1, i);
            assert!(v.abs() <= RANGE);
            assert_eq!(<bf16 as BenchElem>::from_int(v).to_f64(), v as f64);
        }
    }

    #[test]
    fn rows_read_back_from_the_csv_and_ratios_pair_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m-p2p.csv");
        let mut csv = Csv::create(&path, CSV_HEADER).unwrap();
        let shape = Shape::new(P2pOp::SendRecv, 4096, 4, 2).unwrap();
        let point = Point { op: P2pOp::SendRecv, dt: Dt::F32, shape };
        for (imp, t, wrong) in [(PEER, 2.0, 0), (NCCL, 4.0, 3)] {
            csv.line(&Row { imp, point, ranks: 2, time_us: t, wrong, sampled: false }.csv()).unwrap();
        }
        drop(csv);
        let rows = read_rows(&path).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(
            (rows[0].imp.as_str(), rows[0].op.as_str(), rows[0].dtype.as_str(), rows[0].ranks, rows[0].bytes),
            (PEER, "sendrecv", "f32", 2, 4096)
        );
        assert_eq!((rows[0].time_us, rows[0].busbw, rows[1].wrong), (2.0, 2.048, 3));
        print_ratios(&rows, NCCL, |_| true);
        std::fs::write(&path, format!("{CSV_HEADER}\nnccl,sendrecv,f32\n")).unwrap();
        assert!(read_rows(&path).is_err());
    }
}
