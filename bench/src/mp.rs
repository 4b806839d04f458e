//! `mp-allreduce`: the all-reduce between processes, one rank per process
//! on its own GPU, against NCCL in the same layout. Run it under the
//! launcher (`cuda-peer-run -n 2 -- cuda-peer-bench mp-allreduce ...`) or
//! torchrun: every rank reads torchrun's variables.
//!
//! | impl | what runs |
//! |---|---|
//! | `cuda-peer-ipc` | [`cuda_peer::ipc::Comm::all_reduce_in_place`] (one-shot over peer memory imported between processes) |
//! | `cuda-peer-ipc-staged` | the same on the staged path (`CommOptions::path(PathPolicy::StagedOnly)`: pinned host memory shared between the processes) |
//! | `nccl-mp` | NCCL, one rank per process (`ncclCommInitRank`), `NCCL_NVLS_ENABLE=0` unless set, `NCCL_P2P_DISABLE` removed |
//! | `nccl-mp-no-p2p` | the same with `NCCL_P2P_DISABLE=1` |
//! | `cuda-peer-nccl` | [`cuda_peer::ipc::NcclComm`] (cuda-peer's path between hosts) in `nccl-mp`'s setting: its cost over calling NCCL directly |
//!
//! Points, checks and timing are the collective sweep's (all_reduce in
//! place, sum, sizes doubling or quadrupling with `--quick`): each point's
//! inputs come from a seed rank 0 draws and shares, so every rank checks
//! its own output against the CPU reference once, before timing; then
//! warm-up calls and back-to-back timed calls between two CUDA events on
//! the rank's stream (no host synchronisation between the warm-up and the
//! timed calls: the collectives keep the ranks in step). `time_us` is the
//! largest rank's mean per call, `wrong` the sum over ranks. Rank 0 writes
//! `{machine}-multiprocess-allreduce.csv` (the all-reduce CSV's columns)
//! and prints the table and, at the end, the ratios to NCCL.
//!
//! Each rank's bench coordination (seeds, times, ports) runs over its own
//! rendezvous on `MASTER_PORT`; the [`Comm`] gets a second one on a port
//! rank 0 picks. NCCL runs in a child process per rank and implementation
//! (this program again, with a hidden `--child`): NCCL reads
//! `NCCL_P2P_DISABLE` once per process, so the two NCCL impls cannot share
//! one. The children meet over a third rendezvous, share rank 0's
//! `ncclUniqueId` through it, and rank 0's child appends to the CSV.

use crate::cli::{Dt, Op};
use crate::data::{check_windows, par_count, BenchElem, Inputs};
use crate::device::upload;
use crate::nccl::{err as nccl_err, nccl_shim, private_tmp, EXIT_NO_NCCL};
use crate::plan::{geometric, iters_for, warmup_for, Progress, Shape, GIB, KIB, MIB};
use crate::sweep::{print_table_header, Csv, Row, CSV_HEADER};
use crate::{require_gpus, unusable, Res};
use clap::ValueEnum;
use cuda_peer::cudarc::driver::{sys as cu, CudaSlice, CudaStream};
use cuda_peer::ipc::{Bootstrap, Comm, CommOptions, Exchange, NcclComm};
use cuda_peer::{driver, Collectives, PathPolicy, ReduceOp};
use half::bf16;
use rand::Rng;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The options of `mp-allreduce`.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Args {
    /// Implementations, in the order run.
    #[arg(long, value_delimiter = ',', default_value = "cuda-peer-ipc,nccl-mp,cuda-peer-nccl,cuda-peer-ipc-staged,nccl-mp-no-p2p")]
    impls: Vec<MpImpl>,
    /// Element types.
    #[arg(long, value_delimiter = ',', default_value = "f32,bf16")]
    dtypes: Vec<Dt>,
    /// Smallest size in bytes (the buffer on each rank).
    #[arg(long, default_value_t = 4)]
    min_bytes: usize,
    /// Largest size in bytes.
    #[arg(long, default_value_t = GIB)]
    max_bytes: usize,
    /// Timed calls per point (default: 2 GiB / bytes, clamped to 5..=200).
    #[arg(long)]
    iters: Option<usize>,
    /// Warm-up calls per point (fewer for large sizes: at most 1 GiB of warm-up, at least 1 call).
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Sizes quadrupling instead of doubling.
    #[arg(long)]
    quick: bool,
    /// Machine name, used in the CSV file name.
    #[arg(long, default_value = "local")]
    machine: String,
    /// Directory for the CSV (rank 0 writes it).
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
    /// NCCL library to use when `libnccl.so` is not on the loader path (e.g. /usr/lib/x86_64-linux-gnu/libnccl.so.2).
    #[arg(long)]
    nccl_lib: Option<PathBuf>,
    /// Host-cost probe: cuda-peer's communicators without the per-call
    /// check that every rank makes the same call (`CommOptions::check_calls`).
    #[arg(long)]
    no_check_calls: bool,
    /// Host-cost probe: cudarc's event tracking off for the buffers
    /// cuda-peer's communicators reduce (each buffer is used on the
    /// communicator's stream only), so no event waits or records per call.
    #[arg(long)]
    no_event_tracking: bool,
    /// Internal: run as this rank's NCCL child for this impl.
    #[arg(long, hide = true)]
    child: Option<MpImpl>,
    /// Internal: points done before this process (progress lines).
    #[arg(long, hide = true, default_value_t = 0)]
    progress_offset: usize,
    /// Internal: points in the whole run (progress lines).
    #[arg(long, hide = true)]
    progress_total: Option<usize>,
}

/// An implementation of the multi-process all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub(crate) enum MpImpl {
    /// cuda-peer's communicator of processes (`ipc::Comm`).
    #[value(name = "cuda-peer-ipc")]
    PeerIpc,
    /// cuda-peer between processes on the staged path (no P2P).
    #[value(name = "cuda-peer-ipc-staged")]
    PeerIpcStaged,
    /// NCCL, one rank per process.
    #[value(name = "nccl-mp")]
    NcclMp,
    /// NCCL, one rank per process, `NCCL_P2P_DISABLE=1`.
    #[value(name = "nccl-mp-no-p2p")]
    NcclMpNoP2p,
    /// cuda-peer's NCCL path (`ipc::NcclComm`), one rank per process.
    #[value(name = "cuda-peer-nccl")]
    PeerNccl,
}

impl MpImpl {
    /// The name in the CSV and on the command line.
    pub(crate) fn name(self) -> &'static str {
        match self {
            MpImpl::PeerIpc => "cuda-peer-ipc",
            MpImpl::PeerIpcStaged => "cuda-peer-ipc-staged",
            MpImpl::NcclMp => "nccl-mp",
            MpImpl::NcclMpNoP2p => "nccl-mp-no-p2p",
            MpImpl::PeerNccl => "cuda-peer-nccl",
        }
    }

    /// Runs NCCL, in a child process per rank (NCCL reads its environment once per process).
    fn is_nccl(self) -> bool {
        matches!(self, MpImpl::NcclMp | MpImpl::NcclMpNoP2p | MpImpl::PeerNccl)
    }
}

/// The CSV rank 0 writes.
fn csv_path(args: &Args) -> PathBuf {
    args.out.join(format!("{}-multiprocess-allreduce.csv", args.machine))
}

/// The points of one implementation: (dtype, shape), in order.
fn points(args: &Args, ranks: usize) -> Vec<(Dt, Shape)> {
    let sizes = geometric(args.min_bytes, args.max_bytes, if args.quick { 4 } else { 2 });
    let mut v = Vec::new();
    for &dt in &args.dtypes {
        v.extend(sizes.iter().filter_map(|&b| Shape::new(Op::AllReduce, b, dt.size(), ranks)).map(|s| (dt, s)));
    }
    v
}

/// `mp-allreduce`: checks the setting (one line and exit 2 when it cannot
/// run), then runs as a rank or as a rank's NCCL child.
pub(crate) fn main(args: &Args) -> Res<()> {
    require_gpus(1);
    if std::env::var_os("RANK").is_none() {
        unusable(format_args!(
            "mp-allreduce runs one process per GPU: start it under a launcher, e.g. cuda-peer-run -n 2 -- cuda-peer-bench mp-allreduce"
        ));
    }
    if args.min_bytes == 0 || args.min_bytes > args.max_bytes {
        unusable(format_args!("need 0 < --min-bytes <= --max-bytes"));
    }
    let boot = Bootstrap::from_env()?;
    match args.child {
        Some(imp) if imp.is_nccl() => nccl_child(args, imp, &boot),
        Some(imp) => Err(format!("--child takes an NCCL impl, not {}", imp.name()).into()),
        None => parent(args, &boot),
    }
}

/// A free TCP port on this host, picked by rank 0 and shared with every
/// rank (for a further rendezvous of the same ranks).
fn shared_port(ex: &dyn Exchange) -> Res<u16> {
    let mine = if ex.rank() == 0 { std::net::TcpListener::bind("0.0.0.0:0")?.local_addr()?.port().to_le_bytes().to_vec() } else { Vec::new() };
    let all = ex.all_gather(&mine)?;
    let b: [u8; 2] = all[0].as_slice().try_into().map_err(|_| "rank 0 sent no port")?;
    Ok(u16::from_le_bytes(b))
}

/// `boot` (its secret included) with another rendezvous port.
fn with_port(boot: &Bootstrap, port: u16) -> Res<Bootstrap> {
    Ok(Bootstrap { master_port: port, ..boot.clone() })
}

/// A rank: each implementation in turn, then (rank 0) the summary.
fn parent(args: &Args, boot: &Bootstrap) -> Res<()> {
    let ex = boot.connect()?;
    let (rank, n) = (ex.rank(), ex.size());
    let per_impl = points(args, n).len();
    let mut progress = Progress { done: 0, total: per_impl * args.impls.len() };
    if rank == 0 {
        std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
        Csv::create(&csv_path(args), CSV_HEADER)?;
        let ctx = driver::context(boot.local_rank)?;
        println!(
            "# mp-allreduce: {} ({n} processes, one GPU each: {}), CUDA driver {}",
            args.machine,
            ctx.name().unwrap_or_default(),
            driver::driver_version().unwrap_or(0)
        );
        println!("# all_reduce in place, sum; time_us: the slowest rank's mean per call; #wrong: summed over ranks");
    }
    // This rank's own (random name, mode 0700), removed when dropped.
    let tmp = private_tmp()?;
    let shim = args.impls.iter().any(|i| i.is_nccl()).then(|| nccl_shim(args.nccl_lib.as_deref(), tmp.path(), rank == 0)).flatten();
    let mut nccl_missing = false;
    for &imp in &args.impls {
        let start = progress.done;
        match imp {
            MpImpl::PeerIpc | MpImpl::PeerIpcStaged => {
                let port = shared_port(&ex)?;
                let (opts, what) = if imp == MpImpl::PeerIpc {
                    (CommOptions::default(), "ipc::Comm, one-shot over imported peer memory")
                } else {
                    (CommOptions::default().path(PathPolicy::StagedOnly), "ipc::Comm on the staged path: shared pinned host memory, no P2P")
                };
                let opts = opts.check_calls(!args.no_check_calls);
                let made = with_port(boot, port).and_then(|b| Ok(Comm::new(Box::new(b.connect()?), boot.local_rank, &opts)?));
                match made {
                    Ok(comm) => {
                        if args.no_event_tracking {
                            // SAFETY: the buffers allocated after this are used
                            // on the communicator's stream only, in stream order.
                            unsafe { comm.context().disable_event_tracking() };
                        }
                        let rank_ = MpRank { ex: &ex, stream: comm.stream().clone(), imp, engine: Engine::Peer(&comm) };
                        if rank == 0 {
                            println!("#");
                            println!("# {}: {n} processes ({what})", imp.name());
                            if args.no_check_calls || args.no_event_tracking {
                                println!(
                                    "# host-cost probe: check_calls {}, cudarc event tracking {}",
                                    !args.no_check_calls, !args.no_event_tracking
                                );
                            }
                        }
                        rank_.sweep(args, &mut progress)?;
                    }
                    Err(e) => {
                        if rank == 0 {
                            println!("# {}: unavailable: {e}", imp.name());
                        }
                    }
                }
            }
            MpImpl::NcclMp | MpImpl::NcclMpNoP2p | MpImpl::PeerNccl => {
                let port = shared_port(&ex)?;
                let status = if nccl_missing { None } else { Some(run_child(args, imp, port, &progress, shim.as_deref())?) };
                // Every rank learns how every rank's child ended.
                let code = status.map(|s| s.code().unwrap_or(-1)).unwrap_or(EXIT_NO_NCCL);
                let codes = ex.all_gather(&code.to_le_bytes())?;
                let codes: Vec<i32> = codes.iter().map(|b| b.as_slice().try_into().map(i32::from_le_bytes).unwrap_or(-1)).collect();
                if codes.contains(&EXIT_NO_NCCL) {
                    nccl_missing = true;
                } else if rank == 0 && codes.iter().any(|&c| c != 0) {
                    println!("# {}: an NCCL child process failed (exit codes by rank: {codes:?}); its remaining points are missing", imp.name());
                }
            }
        }
        progress.done = start + per_impl;
    }
    drop(tmp);
    if rank == 0 {
        print_summary(args)?;
    }
    Ok(())
}

/// Runs this rank's NCCL child for `imp` and waits for it.
fn run_child(args: &Args, imp: MpImpl, port: u16, progress: &Progress, shim: Option<&Path>) -> Res<std::process::ExitStatus> {
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(child_args(args, imp, progress));
    cmd.env("MASTER_PORT", port.to_string());
    // Never NVLink multicast (NVLS) unless the caller said otherwise; P2P off only for nccl-mp-no-p2p.
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        cmd.env("NCCL_NVLS_ENABLE", "0");
    }
    match imp {
        MpImpl::NcclMpNoP2p => cmd.env("NCCL_P2P_DISABLE", "1"),
        _ => cmd.env_remove("NCCL_P2P_DISABLE"),
    };
    if let Some(dir) = shim {
        let old = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        cmd.env("LD_LIBRARY_PATH", if old.is_empty() { dir.display().to_string() } else { format!("{}:{old}", dir.display()) });
    }
    Ok(cmd.status()?)
}

/// The child's command line: this run's settings, one impl, the progress so far.
fn child_args(args: &Args, imp: MpImpl, progress: &Progress) -> Vec<std::ffi::OsString> {
    let dtypes: Vec<&str> = args.dtypes.iter().map(|d| d.name()).collect();
    let mut v: Vec<std::ffi::OsString> = [
        "mp-allreduce".to_string(),
        format!("--child={}", imp.name()),
        format!("--impls={}", imp.name()),
        format!("--dtypes={}", dtypes.join(",")),
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
    v.extend(["--out".into(), args.out.clone().into_os_string()]);
    v.extend(args.iters.map(|i| format!("--iters={i}").into()));
    if args.quick {
        v.push("--quick".into());
    }
    v
}

/// A rank's NCCL child: meets the other ranks' children, makes the NCCL
/// communicator from rank 0's unique id, and sweeps.
fn nccl_child(args: &Args, imp: MpImpl, boot: &Bootstrap) -> Res<()> {
    if imp == MpImpl::PeerNccl {
        return peer_nccl_child(args, boot);
    }
    // SAFETY: only tries to open the library under cudarc's candidate names.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        if boot.rank == 0 {
            println!("# NCCL: library not found (cudarc looks for libnccl.so; pass --nccl-lib /path/to/libnccl.so.2): nccl impls skipped");
        }
        std::process::exit(EXIT_NO_NCCL);
    }
    let ex = boot.connect()?;
    let ctx = driver::context(boot.local_rank)?;
    ctx.bind_to_thread()?;
    let stream = ctx.new_stream()?;
    let mine = if ex.rank() == 0 {
        let id = cudarc::nccl::Id::new().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
        id.internal().iter().map(|&c| c as u8).collect()
    } else {
        Vec::new()
    };
    let all = ex.all_gather(&mine)?;
    let bytes: [u8; 128] = all[0].as_slice().try_into().map_err(|_| "rank 0 sent no NCCL unique id")?;
    let id = cudarc::nccl::Id::uninit(bytes.map(|b| b as std::ffi::c_char));
    ctx.bind_to_thread()?;
    let comm = cudarc::nccl::Comm::from_rank(stream.clone(), ex.rank(), ex.size(), id).map_err(|e| nccl_err("ncclCommInitRank", e))?;
    if ex.rank() == 0 {
        let v = cudarc::nccl::result::get_nccl_version().map_err(|e| nccl_err("ncclGetVersion", e))?;
        print_nccl_header(imp.name(), v, ex.size());
    }
    let mut progress = Progress { done: args.progress_offset, total: args.progress_total.unwrap_or(points(args, ex.size()).len()) };
    let r = MpRank { ex: &ex, stream, imp, engine: Engine::Nccl(&comm) };
    r.sweep(args, &mut progress)
}

/// The header of an NCCL impl's table: the library's version and NCCL's settings.
fn print_nccl_header(what: &str, version: i32, ranks: usize) {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| "(unset)".into());
    println!("#");
    println!(
        "# {what}: NCCL {}.{}.{}, {ranks} processes (one rank each), NCCL_P2P_DISABLE={}, NCCL_NVLS_ENABLE={}",
        version / 10000,
        version / 100 % 100,
        version % 100,
        var("NCCL_P2P_DISABLE"),
        var("NCCL_NVLS_ENABLE"),
    );
}

/// A rank's `cuda-peer-nccl` child: cuda-peer's own NCCL communicator
/// (which loads `libnccl.so.2` itself and shares the unique id through the
/// exchange it is given).
fn peer_nccl_child(args: &Args, boot: &Bootstrap) -> Res<()> {
    let v = match cuda_peer::ipc::nccl::nccl_version() {
        Ok(v) => v,
        Err(e) => {
            if boot.rank == 0 {
                println!("# cuda-peer-nccl: NCCL cannot be loaded ({e}): skipped");
            }
            std::process::exit(EXIT_NO_NCCL);
        }
    };
    let ex = boot.connect()?;
    let comm = NcclComm::new(&ex, boot.local_rank, std::time::Duration::from_secs(120))?;
    if ex.rank() == 0 {
        print_nccl_header("cuda-peer-nccl (ipc::NcclComm)", v, ex.size());
    }
    let mut progress = Progress { done: args.progress_offset, total: args.progress_total.unwrap_or(points(args, ex.size()).len()) };
    let r = MpRank { ex: &ex, stream: comm.stream().clone(), imp: MpImpl::PeerNccl, engine: Engine::PeerNccl(&comm) };
    r.sweep(args, &mut progress)
}

/// What carries the all-reduce.
enum Engine<'a> {
    Peer(&'a Comm),
    Nccl(&'a cudarc::nccl::Comm),
    PeerNccl(&'a NcclComm),
}

/// One rank of one implementation.
struct MpRank<'a> {
    ex: &'a dyn Exchange,
    /// The stream the collectives run on and the buffers belong to.
    stream: Arc<CudaStream>,
    imp: MpImpl,
    engine: Engine<'a>,
}

impl MpRank<'_> {
    /// Enqueues one in-place sum on `buf`.
    fn call<T: BenchElem>(&self, buf: &mut CudaSlice<T>) -> Res<()> {
        match self.engine {
            Engine::Peer(comm) => comm.all_reduce_in_place(buf, ReduceOp::Sum)?,
            Engine::Nccl(comm) => {
                comm.all_reduce_in_place(buf, &cudarc::nccl::ReduceOp::Sum).map_err(|e| nccl_err("ncclAllReduce", e))?;
            }
            Engine::PeerNccl(comm) => comm.all_reduce_in_place(buf, ReduceOp::Sum)?,
        }
        Ok(())
    }

    /// Waits for this rank's work (and, for cuda-peer, its failure checks).
    fn synchronize(&self) -> Res<()> {
        match self.engine {
            Engine::Peer(comm) => comm.synchronize()?,
            Engine::Nccl(_) => self.stream.synchronize()?,
            Engine::PeerNccl(comm) => comm.synchronize()?,
        }
        Ok(())
    }

    /// Every point in turn; rank 0 prints and appends each row.
    fn sweep(&self, args: &Args, progress: &mut Progress) -> Res<()> {
        let (rank, n) = (self.ex.rank(), self.ex.size());
        let mut csv = if rank == 0 { Some(Csv::append(&csv_path(args))?) } else { None };
        if rank == 0 {
            print_table_header();
        }
        for (dt, shape) in points(args, n) {
            if rank == 0 {
                progress.tick(format_args!("{} all_reduce {} {}", self.imp.name(), dt.name(), shape.bytes));
            }
            let row = match dt {
                Dt::F32 => self.measure::<f32>(args, dt, shape),
                Dt::Bf16 => self.measure::<bf16>(args, dt, shape),
            }
            .map_err(|e| format!("rank {rank}: {} all_reduce {} {} bytes: {e}", self.imp.name(), dt.name(), shape.bytes))?;
            if let Some(csv) = &mut csv {
                let (row, host_us) = row;
                row.print();
                // Host time per call, enqueue only (the slowest rank's):
                // above the device time, the calls are host-bound.
                println!("#   host enqueue {host_us:.2} us per call");
                csv.line(&row.csv())?;
            }
        }
        Ok(())
    }

    /// Checks, then times, one point on every rank: the row, and the
    /// slowest rank's host time per call spent enqueueing.
    fn measure<T: BenchElem>(&self, args: &Args, dt: Dt, shape: Shape) -> Res<(Row, f64)> {
        let (rank, n) = (self.ex.rank(), self.ex.size());
        // One seed for every rank: rank 0's.
        let seed = if rank == 0 { rand::rng().random::<u64>().to_le_bytes().to_vec() } else { Vec::new() };
        let seeds = self.ex.all_gather(&seed)?;
        let seed: [u8; 8] = seeds[0].as_slice().try_into().map_err(|_| "rank 0 sent no seed")?;
        let inputs = Inputs { seed: u64::from_le_bytes(seed), range: T::input_range(n) };
        let mut buf = upload::<T>(&self.stream, &inputs, rank, shape.recv)?;
        self.stream.synchronize()?;
        self.ex.barrier()?;
        // Check: one call, this rank's output against the CPU reference.
        self.call(&mut buf)?;
        self.synchronize()?;
        let (mut wrong, mut sampled) = (0u64, false);
        let windows = check_windows(buf.len(), std::mem::size_of::<T>());
        sampled |= windows.len() > 1;
        for w in windows {
            let got = self.stream.clone_dtoh(&buf.slice(w.clone()))?;
            wrong += par_count(got.len(), |k| got[k].to_f64() != inputs.expected(Op::AllReduce, n, shape.count, rank, w.start + k) as f64);
        }
        // Time: every rank idle, then warm-up and timed calls back to back.
        let (warmup, iters) = (warmup_for(args.warmup, shape.bytes), iters_for(args.iters, shape.bytes));
        self.ex.barrier()?;
        let ctx = self.stream.context();
        let start = ctx.new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = ctx.new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))?;
        for _ in 0..warmup {
            self.call(&mut buf)?;
        }
        start.record(&self.stream)?;
        let host = std::time::Instant::now();
        for _ in 0..iters {
            self.call(&mut buf)?;
        }
        let host_us = host.elapsed().as_secs_f64() * 1e6 / iters as f64;
        end.record(&self.stream)?;
        let ms = start.elapsed_ms(&end)?;
        self.synchronize()?;
        let us = ms as f64 * 1e3 / iters as f64;
        // The slowest rank's time, every rank's wrong elements.
        let mine = [us.to_le_bytes(), wrong.to_le_bytes(), host_us.to_le_bytes()].concat();
        let all = self.ex.all_gather(&mine)?;
        let (mut time_us, mut wrong_all, mut host_all) = (0f64, 0u64, 0f64);
        for b in &all {
            let (t, rest) = b.split_at_checked(8).ok_or("a rank sent a short report")?;
            let (w, h) = rest.split_at_checked(8).ok_or("a rank sent a short report")?;
            time_us = time_us.max(f64::from_le_bytes(t.try_into()?));
            wrong_all += u64::from_le_bytes(w.try_into()?);
            host_all = host_all.max(f64::from_le_bytes(h.try_into()?));
        }
        let row = Row { imp: self.imp.name(), op: Op::AllReduce, dt, ranks: n, shape, time_us, wrong: wrong_all, sampled };
        Ok((row, host_all))
    }
}

/// The targets for cuda-peer-ipc against nccl-mp by size: `(what,
/// met)` from the time and busbw ratios.
fn target(bytes: usize, t_ratio: f64, bw_ratio: f64) -> Option<(&'static str, bool)> {
    match bytes {
        b if (4 * KIB..=256 * KIB).contains(&b) => Some(("t<=0.5", t_ratio <= 0.5)),
        b if (MIB..=16 * MIB).contains(&b) => Some(("bw>=1.3", bw_ratio >= 1.3)),
        b if (64 * MIB..=GIB).contains(&b) => Some(("bw>=1.1", bw_ratio >= 1.1)),
        _ => None,
    }
}

/// Ratios to NCCL from the CSV (the children's rows included): cuda-peer-ipc
/// against nccl-mp with the targets, and cuda-peer-ipc-staged
/// against nccl-mp-no-p2p (target: busbw >= 1.2x) where it has rows.
fn print_summary(args: &Args) -> Res<()> {
    let text = std::fs::read_to_string(csv_path(args))?;
    // (impl, dtype, bytes) -> (time_us, busbw)
    let mut by: HashMap<(String, String, usize), (f64, f64)> = HashMap::new();
    let mut sizes = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        if f.len() == 10 {
            if let (Ok(bytes), Ok(t), Ok(bw)) = (f[5].parse::<usize>(), f[6].parse(), f[8].parse()) {
                by.insert((f[0].to_string(), f[2].to_string(), bytes), (t, bw));
                if !sizes.contains(&bytes) {
                    sizes.push(bytes);
                }
            }
        }
    }
    sizes.sort_unstable();
    println!("#");
    println!(
        "# summary: t_ratio = cuda-peer time / NCCL time (< 1: cuda-peer faster); bw_ratio = cuda-peer busbw / NCCL busbw (> 1: cuda-peer faster)"
    );
    println!("# targets (issue 17): 4 KiB-256 KiB t_ratio <= 0.5; 1-16 MiB bw_ratio >= 1.3; 64 MiB-1 GiB bw_ratio >= 1.1; staged vs nccl-mp-no-p2p bw_ratio >= 1.2");
    println!(
        "#{:>5} {:>10} | {:>9} {:>9} {:>7} {:>8} {:>8} {:>8} {:>8} {:>4} | {:>9} {:>9} {:>8}",
        "dtype", "bytes", "ipc_us", "nccl_us", "t_ratio", "ipc_bw", "nccl_bw", "bw_ratio", "target", "met", "stg_bw", "nop2p_bw", "bw_ratio"
    );
    let get = |imp: MpImpl, dt: &str, b: usize| by.get(&(imp.name().to_string(), dt.to_string(), b)).copied();
    let (mut met, mut missed) = (0, 0);
    for dt in &args.dtypes {
        for &b in &sizes {
            let mut line = format!("{:>6} {b:>10} |", dt.name());
            match (get(MpImpl::PeerIpc, dt.name(), b), get(MpImpl::NcclMp, dt.name(), b)) {
                (Some((t0, b0)), Some((t1, b1))) => {
                    let (tr, br) = (t0 / t1, b0 / b1);
                    let (what, ok) = target(b, tr, br).map(|(w, ok)| (w, if ok { "yes" } else { "NO" })).unwrap_or(("-", "-"));
                    match ok {
                        "yes" => met += 1,
                        "NO" => missed += 1,
                        _ => {}
                    }
                    line.push_str(&format!(" {t0:>9.2} {t1:>9.2} {tr:>7.2} {b0:>8.2} {b1:>8.2} {br:>8.2} {what:>8} {ok:>4} |"));
                }
                _ => line.push_str(&format!(" {:>9} {:>9} {:>7} {:>8} {:>8} {:>8} {:>8} {:>4} |", "-", "-", "-", "-", "-", "-", "-", "-")),
            }
            match (get(MpImpl::PeerIpcStaged, dt.name(), b), get(MpImpl::NcclMpNoP2p, dt.name(), b)) {
                (Some((_, b0)), Some((_, b1))) => line.push_str(&format!(" {b0:>9.2} {b1:>9.2} {:>8.2}", b0 / b1)),
                (None, Some((_, b1))) => line.push_str(&format!(" {:>9} {b1:>9.2} {:>8}", "-", "-")),
                _ => line.push_str(&format!(" {:>9} {:>9} {:>8}", "-", "-", "-")),
            }
            println!("{line}");
        }
    }
    println!("# cuda-peer-ipc against nccl-mp: {met} points meet their target, {missed} miss it");
    // cuda-peer's NCCL path against NCCL itself (target: within 3%).
    let (mut within, mut worse, mut worst) = (0, 0, 0f64);
    for dt in &args.dtypes {
        for &b in &sizes {
            if let (Some((t0, _)), Some((t1, _))) = (get(MpImpl::PeerNccl, dt.name(), b), get(MpImpl::NcclMp, dt.name(), b)) {
                let r = t0 / t1;
                worst = worst.max(r);
                if r <= 1.03 {
                    within += 1;
                } else {
                    worse += 1;
                }
            }
        }
    }
    if within + worse > 0 {
        println!("# cuda-peer-nccl against nccl-mp (time): {within} points within 3%, {worse} beyond; largest ratio {worst:.3}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    fn parse(argv: &[&str]) -> Args {
        match Cli::try_parse_from(argv).expect("parses").command {
            Some(Command::MpAllreduce(a)) => a,
            other => panic!("not mp-allreduce: {other:?}"),
        }
    }

    #[test]
    fn the_childs_command_line_parses_back_to_the_same_settings() {
        let args =
            parse(&["cuda-peer-bench", "mp-allreduce", "--dtypes", "bf16", "--max-bytes", "65536", "--iters", "7", "--quick", "--machine", "m"]);
        let progress = Progress { done: 3, total: 9 };
        let mut argv: Vec<std::ffi::OsString> = vec!["cuda-peer-bench".into()];
        argv.extend(child_args(&args, MpImpl::NcclMpNoP2p, &progress));
        let child = match Cli::try_parse_from(argv).expect("the child's arguments parse").command {
            Some(Command::MpAllreduce(a)) => a,
            other => panic!("not mp-allreduce: {other:?}"),
        };
        assert_eq!(child.child, Some(MpImpl::NcclMpNoP2p));
        assert_eq!(child.impls, vec![MpImpl::NcclMpNoP2p]);
        assert_eq!((child.progress_offset, child.progress_total), (3, Some(9)));
        assert_eq!(points(&child, 2).len(), points(&args, 2).len());
        assert_eq!((child.iters, child.quick, child.machine.as_str(), child.out.clone()), (Some(7), true, "m", args.out.clone()));
    }

    #[test]
    fn points_are_the_sweeps_all_reduce_sizes() {
        let args = parse(&["cuda-peer-bench", "mp-allreduce", "--min-bytes", "4", "--max-bytes", "64"]);
        let p = points(&args, 2);
        // f32: 4..64 (5 sizes); bf16: the same.
        assert_eq!(p.len(), 10);
        assert_eq!((p[0].1.bytes, p[0].1.count, p[4].1.bytes), (4, 1, 64));
        assert_eq!(csv_path(&args), PathBuf::from("bench/results/local-multiprocess-allreduce.csv"));
    }

    #[test]
    fn targets_by_size() {
        assert_eq!(target(4 * KIB, 0.5, 0.0), Some(("t<=0.5", true)));
        assert_eq!(target(256 * KIB, 0.51, 9.0), Some(("t<=0.5", false)));
        assert_eq!(target(512 * KIB, 0.1, 9.0), None);
        assert_eq!(target(MIB, 1.0, 1.3), Some(("bw>=1.3", true)));
        assert_eq!(target(16 * MIB, 1.0, 1.29), Some(("bw>=1.3", false)));
        assert_eq!(target(32 * MIB, 1.0, 9.0), None);
        assert_eq!(target(64 * MIB, 1.0, 1.1), Some(("bw>=1.1", true)));
        assert_eq!(target(GIB, 1.0, 1.0), Some(("bw>=1.1", false)));
    }
}
