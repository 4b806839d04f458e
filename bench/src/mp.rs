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

use crate::cli::{Common, MpArgs, MpImpl};
use crate::data::{BenchElem, Inputs};
use crate::device::{check_output, upload};
use crate::exit::{require_gpus, unusable, Res};
use crate::harness::{sweep, Backend, Measured};
use crate::kinds::{Dt, Op};
use crate::nccl::{child_flags, err as nccl_err, nccl_shim, print_header, private_tmp, require_library, run_child, skip, ChildEnv, EXIT_NO_NCCL};
use crate::output::{Csv, Row, CSV_HEADER};
use crate::plan::{iters_for, warmup_for, Plan, Progress, Shape};
use crate::summary::print_mp_summary;
use cuda_peer::cudarc::driver::{sys as cu, CudaSlice, CudaStream};
use cuda_peer::ipc::{Bootstrap, Comm, CommOptions, Exchange, NcclComm};
use cuda_peer::{driver, Collectives, PathPolicy, ReduceOp};
use rand::Rng;
use std::ffi::OsString;
use std::sync::Arc;

/// The points of one implementation: the sweep's all_reduce points.
fn plan(args: &MpArgs, ranks: usize) -> Plan {
    Plan::new(vec![Op::AllReduce], &args.common(), ranks)
}

/// `mp-allreduce`: checks the setting (one line and exit 2 when it cannot
/// run), then runs as a rank or as a rank's NCCL child.
pub(crate) fn main(args: &MpArgs) -> Res<()> {
    require_gpus(1);
    if std::env::var_os("RANK").is_none() {
        unusable(format_args!(
            "mp-allreduce runs one process per GPU: start it under a launcher, e.g. cuda-peer-run -n 2 -- cuda-peer-bench mp-allreduce"
        ));
    }
    args.common().require_sizes();
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
fn parent(args: &MpArgs, boot: &Bootstrap) -> Res<()> {
    let ex = boot.connect()?;
    let (rank, n) = (ex.rank(), ex.size());
    let common = args.common();
    let plan = plan(args, n);
    let per_impl = plan.points().len();
    let mut progress = Progress { done: 0, total: per_impl * args.impls.len() };
    if rank == 0 {
        std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
        Csv::create(&args.csv(), CSV_HEADER)?;
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
                        sweep(&rank_, &common, &plan, &mut progress, &args.csv())?;
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
                let status = if nccl_missing {
                    None
                } else {
                    // Never NVLink multicast (NVLS) unless the caller said otherwise; P2P off only for nccl-mp-no-p2p.
                    let env = ChildEnv { no_p2p: imp == MpImpl::NcclMpNoP2p, caller_nvls: true, master_port: Some(port) };
                    Some(run_child(&child_args(args, imp, &progress), &env, shim.as_deref())?)
                };
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
        print_mp_summary(args)?;
    }
    Ok(())
}

/// The child's command line: this run's settings, one impl, the progress so far.
fn child_args(args: &MpArgs, imp: MpImpl, progress: &Progress) -> Vec<OsString> {
    let mut v: Vec<OsString> = vec!["mp-allreduce".into(), format!("--child={}", imp.name()).into(), format!("--impls={}", imp.name()).into()];
    v.extend(child_flags(&args.common(), progress));
    v
}

/// A rank's NCCL child: meets the other ranks' children, makes the NCCL
/// communicator from rank 0's unique id, and sweeps.
fn nccl_child(args: &MpArgs, imp: MpImpl, boot: &Bootstrap) -> Res<()> {
    if imp == MpImpl::PeerNccl {
        return peer_nccl_child(args, boot);
    }
    require_library(boot.rank == 0);
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
        print_header(imp.name(), v, &processes(ex.size()));
    }
    child_sweep(args, &MpRank { ex: &ex, stream, imp, engine: Engine::Nccl(&comm) })
}

/// A rank's `cuda-peer-nccl` child: cuda-peer's own NCCL communicator
/// (which loads `libnccl.so.2` itself and shares the unique id through the
/// exchange it is given).
fn peer_nccl_child(args: &MpArgs, boot: &Bootstrap) -> Res<()> {
    let v = match cuda_peer::ipc::nccl::nccl_version() {
        Ok(v) => v,
        Err(e) => skip(boot.rank == 0, format_args!("# cuda-peer-nccl: NCCL cannot be loaded ({e}): skipped")),
    };
    let ex = boot.connect()?;
    let comm = NcclComm::new(&ex, boot.local_rank, std::time::Duration::from_secs(120))?;
    if ex.rank() == 0 {
        print_header("cuda-peer-nccl (ipc::NcclComm)", v, &processes(ex.size()));
    }
    child_sweep(args, &MpRank { ex: &ex, stream: comm.stream().clone(), imp: MpImpl::PeerNccl, engine: Engine::PeerNccl(&comm) })
}

/// The NCCL header's layout of `ranks` processes.
fn processes(ranks: usize) -> String {
    format!("{ranks} processes (one rank each)")
}

/// A child's sweep over its impl's points, its progress resumed from the parent's.
fn child_sweep(args: &MpArgs, rank: &MpRank) -> Res<()> {
    let (common, plan) = (args.common(), plan(args, rank.ex.size()));
    let mut progress = Progress::resume(&common, plan.points().len());
    sweep(rank, &common, &plan, &mut progress, &args.csv())
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
}

impl Backend for MpRank<'_> {
    fn name(&self) -> &'static str {
        self.imp.name()
    }

    fn leads(&self) -> bool {
        self.ex.rank() == 0
    }

    fn whose(&self) -> String {
        format!("rank {}: ", self.ex.rank())
    }

    /// Checks, then times, one point on every rank: the row, and the
    /// slowest rank's host time per call spent enqueueing.
    fn measure<T: BenchElem>(&self, common: &Common, op: Op, dt: Dt, shape: Shape) -> Res<Measured> {
        if op != Op::AllReduce {
            return Err(format!("mp-allreduce runs all_reduce, not {}", op.name()).into());
        }
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
        let (wrong, sampled) = check_output(&self.stream, &buf, &inputs, op, n, shape.count, rank)?;
        // Time: every rank idle, then warm-up and timed calls back to back.
        let (warmup, iters) = (warmup_for(common.warmup, shape.bytes), iters_for(common.iters, shape.bytes));
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
        let row = Row { imp: self.imp.name(), op, dt, ranks: n, shape, time_us, wrong: wrong_all, sampled };
        Ok(Measured { row, host_us: Some(host_all) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;
    use std::path::PathBuf;

    fn parse(argv: &[&str]) -> MpArgs {
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
        let mut argv: Vec<OsString> = vec!["cuda-peer-bench".into()];
        argv.extend(child_args(&args, MpImpl::NcclMpNoP2p, &progress));
        let child = match Cli::try_parse_from(argv).expect("the child's arguments parse").command {
            Some(Command::MpAllreduce(a)) => a,
            other => panic!("not mp-allreduce: {other:?}"),
        };
        assert_eq!(child.child, Some(MpImpl::NcclMpNoP2p));
        assert_eq!(child.impls, vec![MpImpl::NcclMpNoP2p]);
        assert_eq!((child.progress_offset, child.progress_total), (3, Some(9)));
        assert_eq!(plan(&child, 2).points().len(), plan(&args, 2).points().len());
        assert_eq!((child.iters, child.quick, child.machine.as_str(), child.out.clone()), (Some(7), true, "m", args.out.clone()));
        assert_eq!((child.dtypes.clone(), child.min_bytes, child.max_bytes, child.warmup), (vec![Dt::Bf16], 4, 65536, 5));
    }

    #[test]
    fn points_are_the_sweeps_all_reduce_sizes() {
        let args = parse(&["cuda-peer-bench", "mp-allreduce", "--min-bytes", "4", "--max-bytes", "64"]);
        let p = plan(&args, 2).points();
        // f32: 4..64 (5 sizes); bf16: the same.
        assert_eq!(p.len(), 10);
        assert!(p.iter().all(|&(op, _, _)| op == Op::AllReduce));
        assert_eq!((p[0].2.bytes, p[0].2.count, p[4].2.bytes), (4, 1, 64));
        assert_eq!(args.csv(), PathBuf::from("bench/results/local-multiprocess-allreduce.csv"));
    }
}
