//! The implementations under test and the collective sweep: check, then
//! time, every point; the CSV and the stdout table.

use crate::cli::{Args, Dt, Impl, Op};
use crate::data::{check_windows, par_count, BenchElem, Inputs};
use crate::device::{capture, poisoned, sync_all, time_calls, upload, GRAPH_CALLS};
use crate::plan::{iters_for, warmup_for, Plan, Progress, Shape, GIB, KIB, MIB};
use crate::Res;
use cuda_peer::copy::PathPolicy;
use cuda_peer::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut};
use cuda_peer::{Algorithm, Group, GroupOptions, ReduceOp};
use half::bf16;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One rank's buffers of a point for every rank: `recv` is the in-place
/// buffer of all_reduce and broadcast (then `send` is empty).
pub(crate) struct Bufs<T> {
    pub(crate) send: Vec<CudaSlice<T>>,
    pub(crate) recv: Vec<CudaSlice<T>>,
}

pub(crate) enum Engine {
    Peer(Box<Group>),
    Nccl(Vec<cudarc::nccl::Comm>),
}

/// An implementation set up over every rank.
pub(crate) struct Backend {
    pub(crate) imp: Impl,
    pub(crate) streams: Vec<Arc<CudaStream>>,
    pub(crate) engine: Engine,
}

impl Backend {
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
            Engine::Nccl(comms) => crate::nccl::call(comms, op, bufs)?,
        }
        Ok(())
    }
}

/// A cuda-peer group over every GPU with `policy` on every link; prints
/// which path each rank pulls from its predecessor over.
pub(crate) fn peer_backend(imp: Impl, ctxs: &[Arc<CudaContext>]) -> Res<Backend> {
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
pub(crate) struct Row {
    pub(crate) imp: &'static str,
    pub(crate) op: Op,
    pub(crate) dt: Dt,
    pub(crate) ranks: usize,
    pub(crate) shape: Shape,
    pub(crate) time_us: f64,
    pub(crate) wrong: u64,
    pub(crate) sampled: bool,
}

impl Row {
    pub(crate) fn algbw(&self) -> f64 {
        self.shape.bytes as f64 / self.time_us / 1e3
    }

    pub(crate) fn busbw(&self) -> f64 {
        self.algbw() * self.op.bus_factor(self.ranks)
    }

    pub(crate) fn csv(&self) -> String {
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

    pub(crate) fn print(&self) {
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

pub(crate) const CSV_HEADER: &str = "impl,collective,dtype,op,ranks,bytes,time_us,algbw_gbs,busbw_gbs,wrong";
pub(crate) const COPY_CSV_HEADER: &str = "path,src,dst,direction,bytes,time_us,gbs";

pub(crate) fn print_table_header() {
    println!(
        "#{:>15} {:>14} {:>5} {:>5} {:>12} {:>11} {:>10} {:>8} {:>8} {:>7} {:>7}",
        "impl", "collective", "dtype", "redop", "bytes", "count", "time_us", "algbw", "busbw", "#wrong", "checked"
    );
}

/// Appends lines to a CSV file, one write per line, so that a run cut short keeps what it measured.
pub(crate) struct Csv(std::fs::File);

impl Csv {
    pub(crate) fn create(path: &Path, header: &str) -> Res<Csv> {
        let mut f = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
        writeln!(f, "{header}")?;
        Ok(Csv(f))
    }

    pub(crate) fn append(path: &Path) -> Res<Csv> {
        Ok(Csv(std::fs::OpenOptions::new().append(true).open(path).map_err(|e| format!("{}: {e}", path.display()))?))
    }

    pub(crate) fn line(&mut self, line: &str) -> Res<()> {
        self.0.write_all(format!("{line}\n").as_bytes())?;
        Ok(())
    }
}

pub(crate) fn collectives_csv(args: &Args) -> PathBuf {
    args.out.join(format!("{}-allreduce.csv", args.machine))
}

pub(crate) fn copy_csv(args: &Args) -> PathBuf {
    args.out.join(format!("{}-copy.csv", args.machine))
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
pub(crate) fn measure<T: BenchElem>(backend: &Backend, args: &Args, op: Op, dt: Dt, shape: Shape) -> Res<Row> {
    let n = backend.ranks();
    let inputs = Inputs::fresh(T::input_range(n));
    let mut bufs = prepare::<T>(&backend.streams, op, &shape, &inputs)?;
    backend.call(op, &mut bufs)?;
    sync_all(&backend.streams)?;
    let (wrong, sampled) = check(&backend.streams, op, &shape, &inputs, &bufs.recv)?;
    let (warmup, iters) = (warmup_for(args.warmup, shape.bytes), iters_for(args.iters, shape.bytes));
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

/// Runs every point of the plan on `backend`, printing and appending each row.
pub(crate) fn sweep(backend: &Backend, args: &Args, plan: &Plan, progress: &mut Progress, csv: &mut Csv) -> Res<()> {
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
pub(crate) fn human(bytes: usize) -> String {
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
pub(crate) fn tracking_us(backend: &Backend) -> Res<f64> {
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
pub(crate) fn enqueue_us(backend: &Backend) -> Res<f64> {
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
