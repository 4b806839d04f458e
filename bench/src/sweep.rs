//! The sweep's backends, every rank in this one process: a cuda-peer
//! `Group` over every GPU, or NCCL over every GPU (`ncclCommInitAll`) in a
//! child process per NCCL impl. Buffers for every rank, check-then-time per
//! point (eager calls, or calls replayed from CUDA graphs), the host's
//! enqueue cost.

use crate::cli::{Args, Common, Impl};
use crate::data::{BenchElem, Inputs};
use crate::device::{capture, check_output, contexts, poisoned, sync_all, time_calls, upload, GRAPH_CALLS};
use crate::exit::Res;
use crate::harness::{sweep, Backend, Measured};
use crate::kinds::{Dt, Op};
use crate::nccl::{child_flags, err, print_header, require_library, run_child, ChildEnv, EXIT_NO_NCCL};
use crate::output::Row;
use crate::plan::{iters_for, warmup_for, Plan, Progress, Shape};
use crate::units::{human, GIB, KIB, MIB};
use cuda_peer::copy::PathPolicy;
use cuda_peer::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut};
use cuda_peer::{Algorithm, Group, GroupOptions, ReduceOp};
use cudarc::nccl::{group_end, group_start, result, Comm, ReduceOp as NcclOp};
use std::ffi::OsString;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One rank's buffers of a point for every rank: `recv` is the in-place
/// buffer of all_reduce and broadcast (then `send` is empty).
pub(crate) struct Bufs<T> {
    pub(crate) send: Vec<CudaSlice<T>>,
    pub(crate) recv: Vec<CudaSlice<T>>,
}

/// What carries the collectives of every rank.
enum Engine {
    Peer(Box<Group>),
    Nccl(Vec<Comm>),
}

/// An implementation set up over every rank of this process.
pub(crate) struct InProcess {
    imp: Impl,
    streams: Vec<Arc<CudaStream>>,
    engine: Engine,
    /// `--graph`: time calls replayed from CUDA graphs.
    graph: bool,
}

impl InProcess {
    pub(crate) fn ranks(&self) -> usize {
        self.streams.len()
    }

    /// Enqueues one collective on every rank (no host synchronisation).
    pub(crate) fn call<T: BenchElem>(&self, op: Op, bufs: &mut Bufs<T>) -> Res<()> {
        match &self.engine {
            Engine::Peer(g) => match op {
                Op::AllReduce => g.all_reduce_in_place(&mut bufs.recv, ReduceOp::Sum)?,
                Op::ReduceScatter => g.reduce_scatter(&bufs.send, &mut bufs.recv, ReduceOp::Sum)?,
                Op::AllGather => g.all_gather(&bufs.send, &mut bufs.recv)?,
                Op::Broadcast => g.broadcast(&mut bufs.recv, 0)?,
            },
            Engine::Nccl(comms) => nccl_call(comms, op, bufs)?,
        }
        Ok(())
    }
}

impl Backend for InProcess {
    fn name(&self) -> &'static str {
        self.imp.name()
    }

    fn leads(&self) -> bool {
        true
    }

    fn measure<T: BenchElem>(&self, common: &Common, op: Op, dt: Dt, shape: Shape) -> Res<Measured> {
        let n = self.ranks();
        let inputs = Inputs::fresh(T::input_range(n));
        let mut bufs = prepare::<T>(&self.streams, op, &shape, &inputs)?;
        self.call(op, &mut bufs)?;
        sync_all(&self.streams)?;
        let (wrong, sampled) = check(&self.streams, op, &shape, &inputs, &bufs.recv)?;
        let (warmup, iters) = (warmup_for(common.warmup, shape.bytes), iters_for(common.iters, shape.bytes));
        let row = |time_us, wrong| Measured { row: Row { imp: self.imp.name(), op, dt, ranks: n, shape, time_us, wrong, sampled }, host_us: None };
        if !self.graph {
            let time_us = time_calls(&self.streams, warmup, iters, || self.call(op, &mut bufs))?;
            return Ok(row(time_us, wrong));
        }
        // One call from a graph, on fresh buffers, checked like the eager call.
        let mut bufs = prepare::<T>(&self.streams, op, &shape, &inputs)?;
        let once = capture(&self.streams, 1, || self.call(op, &mut bufs))?;
        once.launch()?;
        sync_all(&self.streams)?;
        let (wrong_graph, _) = check(&self.streams, op, &shape, &inputs, &bufs.recv)?;
        // Then a graph of k calls, launched back to back.
        let k = iters.min(GRAPH_CALLS);
        let graph = capture(&self.streams, k, || self.call(op, &mut bufs))?;
        let time_us = time_calls(&self.streams, warmup.div_ceil(k), iters.div_ceil(k), || Ok(graph.launch()?))? / k as f64;
        Ok(row(time_us, wrong + wrong_graph))
    }
}

/// A cuda-peer group over every GPU with `policy` on every link; prints
/// which path each rank pulls from its predecessor over.
pub(crate) fn peer_backend(imp: Impl, ctxs: &[Arc<CudaContext>], graph: bool) -> Res<InProcess> {
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
    // Fields set one by one (no struct literal: the options may become #[non_exhaustive]).
    let mut opts = GroupOptions::with_policy(policy);
    opts.algorithm = algorithm;
    if serial {
        opts.launch_spin = None;
    }
    let group = Group::new(streams.clone(), &opts)?;
    println!("#");
    describe_group(imp.name(), &group);
    Ok(InProcess { imp, streams, engine: Engine::Peer(Box::new(group)), graph })
}

/// Prints `group`'s ranks (as `name`), the path each rank pulls from its
/// predecessor over, and the all-reduce algorithm it takes by size.
pub(crate) fn describe_group(name: &str, group: &Group) {
    let n = group.size();
    println!("# {name}: {n} ranks");
    for r in 0..n {
        if let Some(st) = group.link_status(r) {
            println!("#   rank {r} <- rank {}: {} ({})", (r + n - 1) % n, st.path, st.reason);
        }
    }
    let algos: Vec<String> =
        [4 * KIB, 256 * KIB, MIB, 16 * MIB, 256 * MIB, GIB].iter().map(|&b| format!("{}: {:?}", human(b), group.all_reduce_algorithm(b))).collect();
    println!("#   all_reduce algorithm by size: {}", algos.join(", "));
}

/// Sweeps one cuda-peer implementation, then measures its enqueue time.
pub(crate) fn run_peer(args: &Args, imp: Impl, ctxs: &[Arc<CudaContext>], plan: &Plan, progress: &mut Progress) -> Res<f64> {
    let backend = peer_backend(imp, ctxs, args.graph)?;
    sweep(&backend, &args.common(), plan, progress, &args.collectives_csv())?;
    let us = enqueue_us(&backend)?;
    println!(
        "# {}: enqueue {us:.2} us per 4 KiB all_reduce, of which cudarc's event tracking of the buffers alone takes {:.2} us",
        imp.name(),
        tracking_us(&backend)?
    );
    Ok(us)
}

/// One collective on every rank, as one NCCL group (required when one
/// thread drives several ranks).
fn nccl_call<T: BenchElem>(comms: &[Comm], op: Op, bufs: &mut Bufs<T>) -> Res<()> {
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

/// The NCCL child's whole job: load NCCL, sweep, report the enqueue time.
pub(crate) fn nccl_child(args: &Args, imp: Impl, report: &Path) -> Res<()> {
    require_library(true);
    let v = result::get_nccl_version().map_err(|e| err("ncclGetVersion", e))?;
    let ctxs = contexts(args.graph)?;
    let streams = ctxs.iter().map(|c| c.new_stream()).collect::<Result<Vec<_>, _>>()?;
    let comms = Comm::from_devices(streams.clone()).map_err(|e| err("ncclCommInitAll", e))?;
    print_header(imp.name(), v, &format!("{} ranks", comms.len()));
    let backend = InProcess { imp, streams, engine: Engine::Nccl(comms), graph: args.graph };
    let common = args.common();
    let plan = Plan::new(args.swept_ops(), &common, backend.ranks());
    let mut progress = Progress::resume(&common, plan.points().len());
    sweep(&backend, &common, &plan, &mut progress, &args.collectives_csv())?;
    let us = enqueue_us(&backend)?;
    std::fs::write(report, format!("enqueue_us={us}\n"))?;
    Ok(())
}

/// The NCCL child's command line: this run's sweep settings, one NCCL impl,
/// and where to report.
fn child_args(args: &Args, imp: Impl, progress: &Progress, report: &Path) -> Vec<OsString> {
    let ops: Vec<&str> = args.ops.iter().map(|o| o.name()).collect();
    let mut v: Vec<OsString> = vec!["--impls".into(), imp.name().into(), "--ops".into(), ops.join(",").into()];
    v.extend(child_flags(&args.common(), progress));
    v.extend(["--child-report".into(), report.as_os_str().to_owned()]);
    if args.graph {
        v.push("--graph".into());
    }
    v
}

/// How an NCCL child ended.
pub(crate) enum ChildEnd {
    /// Swept everything; its enqueue time in microseconds.
    Finished(f64),
    /// Failed part way (said so); its remaining points are missing.
    Failed,
    /// Could not load NCCL (said so in one line).
    NoNccl,
}

/// Runs one NCCL implementation in a child process: fresh NCCL state and
/// its own environment (never NVLink multicast; P2P off only for
/// nccl-no-p2p).
pub(crate) fn run_nccl_child(args: &Args, imp: Impl, progress: &Progress, shim: Option<&Path>, tmp: &Path) -> Res<ChildEnd> {
    let report = tmp.join(format!("{}.report", imp.name()));
    let env = ChildEnv { no_p2p: imp == Impl::NcclNoP2p, caller_nvls: false, master_port: None };
    let status = run_child(&child_args(args, imp, progress, &report), &env, shim)?;
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

/// Fresh inputs and poisoned outputs for one point on every rank.
pub(crate) fn prepare<T: BenchElem>(streams: &[Arc<CudaStream>], op: Op, shape: &Shape, inputs: &Inputs) -> Res<Bufs<T>> {
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
pub(crate) fn check<T: BenchElem>(streams: &[Arc<CudaStream>], op: Op, shape: &Shape, inputs: &Inputs, outs: &[CudaSlice<T>]) -> Res<(u64, bool)> {
    let (mut wrong, mut sampled) = (0, false);
    for (r, buf) in outs.iter().enumerate() {
        let (w, s) = check_output(&streams[r], buf, inputs, op, streams.len(), shape.count, r)?;
        wrong += w;
        sampled |= s;
    }
    Ok((wrong, sampled))
}

/// The buffers of a 4 KiB f32 all_reduce on every rank, what the enqueue
/// probes below call.
fn small_all_reduce(backend: &InProcess) -> Res<Bufs<f32>> {
    let n = backend.ranks();
    let shape = Shape::new(Op::AllReduce, 4 * KIB, 4, n).expect("4 KiB is not empty");
    let inputs = Inputs::fresh(f32::input_range(n));
    prepare::<f32>(&backend.streams, Op::AllReduce, &shape, &inputs)
}

/// Host microseconds per call of what every call pays to cudarc's event
/// tracking alone: each rank's in-place buffer taken for writing on its
/// stream (two event waits) and its guard dropped (one event record),
/// with no collective. The floor under [`enqueue_us`] for cuda-peer.
pub(crate) fn tracking_us(backend: &InProcess) -> Res<f64> {
    let mut bufs = small_all_reduce(backend)?;
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
pub(crate) fn enqueue_us(backend: &InProcess) -> Res<f64> {
    let mut bufs = small_all_reduce(backend)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Cli;
    use clap::Parser;
    use std::path::PathBuf;

    #[test]
    fn the_childs_command_line_parses_back_to_the_same_settings() {
        let cli = Cli::try_parse_from(["cuda-peer-bench", "--quick", "--dtypes", "f32", "--machine", "m", "--graph"]).expect("parses");
        let args = cli.sweep;
        let progress = Progress { done: 5, total: 20 };
        let mut argv: Vec<OsString> = vec!["cuda-peer-bench".into()];
        argv.extend(child_args(&args, Impl::NcclNoP2p, &progress, Path::new("/tmp/r")));
        let child = Cli::try_parse_from(argv).expect("the child's arguments parse");
        assert!(child.command.is_none());
        let c = child.sweep;
        assert_eq!(c.impls, vec![Impl::NcclNoP2p]);
        assert_eq!(c.child_report, Some(PathBuf::from("/tmp/r")));
        assert_eq!((c.progress_offset, c.progress_total), (5, Some(20)));
        assert_eq!((c.quick, c.graph, c.machine.as_str(), c.dtypes.clone()), (true, true, "m", args.dtypes.clone()));
        assert_eq!(
            (c.ops.clone(), c.min_bytes, c.max_bytes, c.iters, c.warmup, c.out.clone()),
            (args.ops.clone(), 4, GIB, None, 5, args.out.clone())
        );
    }
}
